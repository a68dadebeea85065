"""One call around an effect: reserve, run it at most once, commit.

::

    guard = Guard(Client(url, token=token))
    result = guard.run(key, charge, request={"method": "POST", "path": "/charges", "body": args})

- a key already completed returns the stored result; the effect does not run;
- a key another caller holds is waited for (``Prefer: wait``, then retries of
  the same key) within ``wait_budget`` seconds, then :class:`InFlight` is
  raised: the step belongs in the caller's dead-letter queue, never in a
  second execution;
- a key whose outcome is unknown (an earlier holder was cut off under
  ``on_lease_expiry="hold"``) raises :class:`~idemgate_client.OutcomeUnknown`
  at once and the effect does not run: the step belongs in the dead-letter
  queue, never retried and never under a new key, until an operator settles
  the key (completed: the next run returns that result; released: it runs);
- a key reused with another payload raises :class:`~idemgate_client.KeyReused`
  and is never retried;
- a takeover (the earlier holder's lease ran out) hands the effect
  ``holding.attempt > 1`` and the recovery point that holder recorded: the
  effect must reconcile (look for what it did) before acting again;
- the effect's lease is extended while it runs;
- an effect that raises :class:`NotExecuted` (it failed before acting)
  releases the key, so a retry runs it; any other exception leaves the key in
  flight until its lease ends, because the effect may have acted. What
  follows is the guard's ``on_lease_expiry``: ``takeover`` (the server's
  default) hands the key to the next run, with the recovery point to
  reconcile from; ``hold`` makes its outcome unknown, for an effect that
  cannot reconcile, and leaves it to an operator.

Both dead-letter errors, :class:`InFlight` and
:class:`~idemgate_client.OutcomeUnknown`, carry ``dead_letter_reason``
(``idempotency_in_flight``, ``outcome_unknown``)::

    try:
        result = guard.run(key, charge, request=...)
    except (InFlight, OutcomeUnknown) as stuck:
        dead_letter(step, reason=stuck.dead_letter_reason)
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Mapping, TypeVar
from uuid import UUID

from .api import AsyncClient, Client, Completed, LeaseExpiry, RecoveryPoint, Reserved
from .errors import IdemgateError, RequestInFlight

__all__ = ["AsyncGuard", "AsyncHolding", "Guard", "Holding", "InFlight", "NotExecuted"]

T = TypeVar("T")

#: The longest single ``Prefer: wait`` asked for; the server caps it too.
MAX_WAIT_SECONDS = 10


class InFlight(IdemgateError):
    """The key stayed held by another caller for the whole wait budget."""

    #: The reason the step is put in the dead-letter queue with.
    dead_letter_reason = "idempotency_in_flight"

    def __init__(self, key: str, waited: float, lease_expires_at: datetime | None) -> None:
        self.key = key
        self.waited = waited
        self.lease_expires_at = lease_expires_at
        super().__init__(
            f"the key is still in flight after {waited:.1f} s"
            + (f" (its holder's lease ends at {lease_expires_at.isoformat()})" if lease_expires_at else "")
        )


class NotExecuted(Exception):
    """Raised by an effect that failed before it acted: the key is released."""


@dataclass
class Holding:
    """What the effect gets: its reservation, and how to record progress."""

    reservation_id: UUID
    attempt: int
    """1 for a new key; more for a takeover, which must reconcile first."""
    recovery: RecoveryPoint | None
    """What an earlier holder of the key recorded with :meth:`checkpoint`."""
    _client: Client = field(repr=False)

    def checkpoint(self, recovery_point: str, data: Any = None) -> None:
        """Records how far the effect got, for a holder that takes over."""
        self._client.checkpoint(self.reservation_id, recovery_point=recovery_point, data=data)


def _beat_every(reserved: Reserved, lease_seconds: int | None) -> float:
    """A third of the lease (at least 0.2 s): how often the heartbeat extends it."""
    left = (reserved.lease_expires_at - datetime.now(timezone.utc)).total_seconds()
    return max(0.2, min(left, float(lease_seconds or left)) / 3)


class _Heartbeat:
    """Extends the lease every third of it while the effect runs."""

    def __init__(self, client: Client, reserved: Reserved, lease_seconds: int | None) -> None:
        self._every = _beat_every(reserved, lease_seconds)
        self._client = client
        self._id = reserved.reservation_id
        self._lease = lease_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="idemgate-lease", daemon=True)

    def __enter__(self) -> "_Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._client.extend(self._id, lease_seconds=self._lease)
            except IdemgateError:
                # Lost or unreachable: the commit will say so; keep trying
                # while the store is away.
                continue


def _wait_for(budget: float, started: float) -> int | None:
    """The ``Prefer: wait`` seconds for the next reserve (None: ask none)."""
    wait = int(min(MAX_WAIT_SECONDS, max(0.0, budget - (time.monotonic() - started))))
    return wait if wait > 0 else None


def _pause(key: str, busy: RequestInFlight, budget: float, started: float) -> float:
    """How long to sleep before reserving again; raises InFlight past the budget."""
    waited = time.monotonic() - started
    left = budget - waited
    if left <= 0:
        raise InFlight(key, waited, busy.lease_expires_at) from busy
    return min(left, busy.retry_after or 1.0, 1.0)


class Guard:
    """Runs effects under idempotency keys, through one :class:`Client`.

    ``on_lease_expiry`` is what the guard's lease ending without a commit
    means (the process died, or the effect raised after it may have acted):
    unset, the server's default ``takeover``; ``"hold"`` for an effect that
    cannot reconcile, whose key then waits for an operator.
    """

    def __init__(
        self,
        client: Client,
        *,
        wait_budget: float = 30.0,
        lease_seconds: int | None = None,
        on_lease_expiry: LeaseExpiry | None = None,
        encode: Callable[[Any], str] = json.dumps,
        decode: Callable[[str], Any] = json.loads,
    ) -> None:
        self.client = client
        self.wait_budget = wait_budget
        self.lease_seconds = lease_seconds
        self.on_lease_expiry: LeaseExpiry | None = on_lease_expiry
        self.encode = encode
        self.decode = decode

    def run(
        self,
        key: str,
        effect: Callable[[Holding], T],
        *,
        request: Mapping[str, Any] | None = None,
        fingerprint: str | None = None,
    ) -> T:
        """The effect's result for ``key``: run now, or stored by an earlier run.

        Raises :class:`InFlight` (held past the wait budget) or
        :class:`~idemgate_client.OutcomeUnknown` without running the effect:
        both for the dead-letter queue, never for a retry under a new key.
        """
        reserved = self._reserve(key, request, fingerprint)
        if isinstance(reserved, Completed):
            return self.decode(reserved.response.text())  # type: ignore[no-any-return]
        holding = Holding(reserved.reservation_id, reserved.attempt, reserved.recovery, self.client)
        try:
            with _Heartbeat(self.client, reserved, self.lease_seconds):
                result = effect(holding)
        except NotExecuted:
            self.client.release(reserved.reservation_id)
            raise
        self.client.commit(reserved.reservation_id, status=200, body=self.encode(result))
        return result

    def effect(
        self,
        key: Callable[..., str],
        request: Callable[..., Mapping[str, Any]] | None = None,
    ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """The decorator form of :meth:`run`: ``key`` (and ``request``) are
        computed from the call's arguments; the function gets the
        :class:`Holding` first, then those arguments::

            @guard.effect(key=lambda run, step, args: derive_key(tenant="acme", run=run, step=step, tool="charge"),
                          request=lambda run, step, args: {"method": "POST", "path": "/charges", "body": args})
            def charge(holding, run, step, args):
                return payments.charge(**args)

            charge(run_id, 3, {"amount": 500})   # at most once per (run, step)
        """

        def decorate(fn: Callable[..., T]) -> Callable[..., T]:
            @functools.wraps(fn)
            def guarded(*args: Any, **kwargs: Any) -> T:
                return self.run(
                    key(*args, **kwargs),
                    lambda holding: fn(holding, *args, **kwargs),
                    request=request(*args, **kwargs) if request is not None else None,
                )

            return guarded

        return decorate

    def _reserve(
        self, key: str, request: Mapping[str, Any] | None, fingerprint: str | None
    ) -> Reserved | Completed:
        started = time.monotonic()
        while True:
            try:
                return self.client.reserve(
                    key,
                    request=request,
                    fingerprint=fingerprint,
                    lease_seconds=self.lease_seconds,
                    wait=_wait_for(self.wait_budget, started),
                    on_lease_expiry=self.on_lease_expiry,
                )
            except RequestInFlight as busy:
                time.sleep(_pause(key, busy, self.wait_budget, started))


@dataclass
class AsyncHolding:
    """As :class:`Holding`, for :class:`AsyncGuard`."""

    reservation_id: UUID
    attempt: int
    recovery: RecoveryPoint | None
    _client: AsyncClient = field(repr=False)

    async def checkpoint(self, recovery_point: str, data: Any = None) -> None:
        """Records how far the effect got, for a holder that takes over."""
        await self._client.checkpoint(self.reservation_id, recovery_point=recovery_point, data=data)


class AsyncGuard:
    """As :class:`Guard`, over an :class:`AsyncClient`, for async effects."""

    def __init__(
        self,
        client: AsyncClient,
        *,
        wait_budget: float = 30.0,
        lease_seconds: int | None = None,
        on_lease_expiry: LeaseExpiry | None = None,
        encode: Callable[[Any], str] = json.dumps,
        decode: Callable[[str], Any] = json.loads,
    ) -> None:
        self.client = client
        self.wait_budget = wait_budget
        self.lease_seconds = lease_seconds
        self.on_lease_expiry: LeaseExpiry | None = on_lease_expiry
        self.encode = encode
        self.decode = decode

    async def run(
        self,
        key: str,
        effect: Callable[[AsyncHolding], Awaitable[T]],
        *,
        request: Mapping[str, Any] | None = None,
        fingerprint: str | None = None,
    ) -> T:
        """The effect's result for ``key``: run now, or stored by an earlier run."""
        reserved = await self._reserve(key, request, fingerprint)
        if isinstance(reserved, Completed):
            return self.decode(reserved.response.text())  # type: ignore[no-any-return]
        holding = AsyncHolding(reserved.reservation_id, reserved.attempt, reserved.recovery, self.client)
        every = _beat_every(reserved, self.lease_seconds)

        async def beat() -> None:
            while True:
                await asyncio.sleep(every)
                try:
                    await self.client.extend(reserved.reservation_id, lease_seconds=self.lease_seconds)
                except IdemgateError:
                    continue

        heartbeat = asyncio.create_task(beat())
        try:
            result = await effect(holding)
        except NotExecuted:
            await self.client.release(reserved.reservation_id)
            raise
        finally:
            heartbeat.cancel()
        await self.client.commit(reserved.reservation_id, status=200, body=self.encode(result))
        return result

    async def _reserve(
        self, key: str, request: Mapping[str, Any] | None, fingerprint: str | None
    ) -> Reserved | Completed:
        started = time.monotonic()
        while True:
            try:
                return await self.client.reserve(
                    key,
                    request=request,
                    fingerprint=fingerprint,
                    lease_seconds=self.lease_seconds,
                    wait=_wait_for(self.wait_budget, started),
                    on_lease_expiry=self.on_lease_expiry,
                )
            except RequestInFlight as busy:
                await asyncio.sleep(_pause(key, busy, self.wait_budget, started))
