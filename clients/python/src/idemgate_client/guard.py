"""One call around an effect: reserve, run it at most once, commit.

::

    guard = Guard(Client(url, token=token))
    result = guard.run(key, charge, request={"method": "POST", "path": "/charges", "body": args})

- a key already completed returns the stored result; the effect does not run;
- a key another caller holds is waited for (``Prefer: wait``, then retries of
  the same key) within ``wait_budget`` seconds, then :class:`InFlight` is
  raised: the step belongs in the caller's dead-letter queue, never in a
  second execution;
- a key whose outcome is unknown raises
  :class:`~idemgate_client.OutcomeUnknown` at once and the effect does not
  run: the step belongs in the dead-letter queue, never retried and never
  under a new key, until an operator settles the key (completed: the next run
  returns that result; released: it runs);
- a key reused with another payload raises :class:`~idemgate_client.KeyReused`
  and is never retried;
- the effect's lease is extended while it runs;
- an effect that raises is judged by the guard's ``classify_failure``
  (default :func:`classify_failure`): an exception that proves the effect
  never acted (:class:`NotExecuted`, always; a connection refused, a name
  that does not resolve, a connect timeout) releases the key, so a retry
  runs it; any other (a read timeout, a connection reset after the request
  went out, a protocol error, anything unknown) marks the key unknown at
  once (``mark_unknown``, the reason naming the exception's type, never its
  message), so its duplicates get ``OutcomeUnknown`` at once instead of
  waiting out the lease, and an operator settles it. Either way the caller
  gets the effect's own exception. A process that dies leaves the key in
  flight until its lease ends.

A guard with its own classifier (which :class:`NotExecuted` still
bypasses)::

    def classify(error: Exception) -> Failure:
        if isinstance(error, CardDeclined):   # the provider refused: nothing was charged
            return "release"
        return classify_failure(error)

    guard = Guard(client, classify_failure=classify)

What the lease's end means is the guard's ``on_lease_expiry``:

- by default ``"hold"``: a crashed effect is never run again by itself. Its
  key's outcome becomes unknown when the lease ends (at once, for an effect
  that raised something other than a proof that it never acted), the next
  run raises
  :class:`~idemgate_client.OutcomeUnknown` without running the effect, and
  an operator settles the key;
- with a ``reconcile`` function (``run(..., reconcile=...)``), ``"takeover"``:
  the next run after the lease takes the key over (``holding.attempt > 1``,
  with ``holding.recovery``, what the earlier holder recorded with
  :meth:`Holding.checkpoint`) and calls ``reconcile(holding)`` before
  anything else. It looks for what the earlier attempt did and returns
  ``Reconciled(result)`` if the effect happened (that result is committed as
  the key's and returned; the effect does not run) or ``None`` if it did not
  (the effect runs, with ``holding.attempt > 1``). An effect that raised
  is then not marked unknown (unless it proved it never acted: released),
  since the next run's ``reconcile`` finds out what it did::

      def find_charge(holding: Holding) -> Reconciled[Charge] | None:
          charge = payments.find(idempotency_key=key)
          return Reconciled(charge) if charge else None

      guard.run(key, charge, request=..., reconcile=find_charge)

- ``Guard(client, on_lease_expiry="takeover")`` without a ``reconcile``: the
  effect itself is taken over, with ``holding.attempt > 1``. That is the
  caller's promise that the effect reconciles by itself (it is idempotent on
  the key, as a call to an API that dedupes on it is); the guard cannot check.
  Here too an effect that raised is left in flight for that takeover.

A guard that would not take over (``"hold"``, no ``reconcile``) and still
gets a key taken over from an earlier holder that chose ``"takeover"`` does
not run the effect either: it raises
:class:`~idemgate_client.OutcomeUnknown` and leaves the key to end its lease
under ``hold``, unknown, for an operator.

The commit after the effect is retried while idemgate is away (no answer,
or a 503/502/504), with exponential backoff and jitter, for the guard's
``commit_budget`` seconds (default: the lease, ``lease_seconds`` or the
server's default 30 s; a holder's late commit is accepted while its
reservation is current, and committing the same response twice is fine), so
a server back within the budget gets the result and the caller gets it too.
Past the budget the guard raises
:class:`~idemgate_client.ResultNotCommitted` (a ``StoreUnavailable``) with
the effect's ``result``: the effect acted, so it is never run again; the
step is dead-lettered with the result, and the key (in flight, then unknown
under ``hold``) is completed by an operator or a late commit. Every other
call that gets no answer (the reserve, a release, an unknown mark) raises
:class:`~idemgate_client.StoreUnavailable` with httpx's exception as its
``__cause__``, never a raw httpx exception.

The three dead-letter errors, :class:`InFlight`,
:class:`~idemgate_client.OutcomeUnknown` and
:class:`~idemgate_client.ResultNotCommitted`, carry ``dead_letter_reason``
(``idempotency_in_flight``, ``outcome_unknown``, ``result_not_committed``)::

    try:
        result = guard.run(key, charge, request=...)
    except (InFlight, OutcomeUnknown) as stuck:
        dead_letter(step, reason=stuck.dead_letter_reason)
    except ResultNotCommitted as unsaved:
        dead_letter(step, reason=unsaved.dead_letter_reason, result=unsaved.result)
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Generic, Literal, Mapping, TypeVar, overload
from uuid import UUID

import httpx

from .api import AsyncClient, Client, Completed, LeaseExpiry, RecoveryPoint, Reserved
from .errors import IdemgateError, OutcomeUnknown, Problem, RequestInFlight, ResultNotCommitted, StoreUnavailable

__all__ = [
    "AsyncGuard",
    "AsyncHolding",
    "Failure",
    "Guard",
    "Holding",
    "InFlight",
    "NotExecuted",
    "Reconciled",
    "classify_failure",
]

T = TypeVar("T")

#: The longest single ``Prefer: wait`` asked for; the server caps it too.
MAX_WAIT_SECONDS = 10

#: The server's default lease (SPEC §5): a guard's default commit budget
#: when it does not choose ``lease_seconds``.
DEFAULT_LEASE_SECONDS = 30

#: The commit's first and longest pause between tries (before jitter).
_COMMIT_FIRST_PAUSE = 0.2
_COMMIT_LONGEST_PAUSE = 2.0


def _commit_retryable(error: Exception) -> bool:
    """A commit that may succeed later: no answer, or the store (or a proxy
    before it) away."""
    return isinstance(error, StoreUnavailable) or (isinstance(error, Problem) and error.status in (502, 503, 504))


class _CommitTries:
    """The commit's retry schedule: exponential backoff with full jitter
    (half to all of the step), within a budget of its own."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.started = time.monotonic()
        self._step = _COMMIT_FIRST_PAUSE

    def waited(self) -> float:
        return time.monotonic() - self.started

    def pause(self, error: Problem) -> float | None:
        """How long to sleep before the next try; None once the budget is spent."""
        left = self.budget - self.waited()
        if left <= 0:
            return None
        pause = random.uniform(self._step / 2, self._step)
        if error.retry_after:
            pause = max(pause, min(error.retry_after, _COMMIT_LONGEST_PAUSE))
        self._step = min(self._step * 2, _COMMIT_LONGEST_PAUSE)
        return min(pause, left)


def _commit_budget(chosen: float | None, lease_seconds: int | None) -> float:
    return float(chosen) if chosen is not None else float(lease_seconds or DEFAULT_LEASE_SECONDS)


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


#: What an exception raised by a guarded effect says about the effect:
#: ``"release"``, it proves the effect never acted (the key is released, a
#: retry runs it); ``"unknown"``, it does not (the key is marked unknown at
#: once under ``hold``, for an operator).
Failure = Literal["release", "unknown"]

#: Raised before a request was sent: nothing reached the other side.
_NEVER_SENT: tuple[type[BaseException], ...] = (
    httpx.ConnectError,  # refused, the name did not resolve, the TLS handshake failed
    httpx.ConnectTimeout,
    ConnectionRefusedError,
    socket.gaierror,
)


def classify_failure(error: Exception) -> Failure:
    """The guards' default judgement of an exception raised by an effect.

    ``"release"`` only for what proves the effect never acted:
    :class:`NotExecuted` (the effect says so), and a connection that was
    never made — ``httpx.ConnectError`` (refused, the name did not resolve),
    ``httpx.ConnectTimeout``, ``ConnectionRefusedError``, ``socket.gaierror``.
    ``"unknown"`` for everything else: a read or write timeout, a connection
    reset or closed after the request went out, a remote protocol error, any
    exception it does not know.

    It looks at the exception alone: an effect that makes another call after
    the one that acts (a receipt, a webhook) must not let that call's
    connection error escape, or pass a classifier of its own.
    """
    if isinstance(error, NotExecuted):
        return "release"
    if isinstance(error, _NEVER_SENT):
        return "release"
    return "unknown"


def _type_name(error: BaseException) -> str:
    """The exception's type, as a reason may name it: ``httpx.ReadTimeout``,
    ``TimeoutError`` (its public module, never its message)."""
    kind = type(error)
    module = kind.__module__
    if module == "builtins":
        return kind.__qualname__
    public = []
    for part in module.split("."):
        if part.startswith("_"):
            break
        public.append(part)
    return ".".join([*public, kind.__qualname__]) if public else kind.__qualname__


def _unknown_reason(error: BaseException) -> str:
    """The reason a key is marked unknown with: the exception's type only;
    its message or a body could carry a secret, and never leaves."""
    return f"the guarded effect raised {_type_name(error)}: it may have acted"[:1000]


def _verdict(classify: Callable[[Exception], Failure], error: Exception) -> Failure:
    """``classify``'s judgement of ``error``; :class:`NotExecuted` is always a
    release, and a classifier that raises or answers anything but
    ``"release"`` means unknown."""
    if isinstance(error, NotExecuted):
        return "release"
    try:
        return "release" if classify(error) == "release" else "unknown"
    except Exception as failed:
        _note(error, f"idemgate: the guard's classify_failure raised {_type_name(failed)}; taken as unknown")
        return "unknown"


def _note(error: BaseException, text: str) -> None:
    """Adds ``text`` to the traceback of ``error`` (Python 3.11+; dropped before)."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(text)


def _settle_failed(error: Exception, failed: Exception, verdict: Failure) -> None:
    """The release or the unknown mark failed (the store is away, or the lease
    was lost meanwhile). The caller still gets the effect's exception, with a
    note. The key is not released instead: left in flight, its lease ending
    makes it unknown anyway under ``hold`` (a takeover under ``takeover``)."""
    what = "releasing the key" if verdict == "release" else "marking the key unknown"
    _note(error, f"idemgate: {what} failed too ({_type_name(failed)}); the key stays in flight until its lease ends")


@dataclass(frozen=True)
class Reconciled(Generic[T]):
    """What a ``reconcile`` function returns when the earlier attempt's effect
    did happen: its result, committed as the key's and returned in place of
    running the effect again. (``None`` says it did not happen: the effect
    runs.)"""

    result: T


def _lease_expiry(chosen: LeaseExpiry | None, reconciles: bool) -> LeaseExpiry:
    """The ``on_lease_expiry`` a run reserves with: the guard's, when it chose
    one; unset, ``takeover`` with a ``reconcile`` and ``hold`` without."""
    if chosen is not None:
        return chosen
    return "takeover" if reconciles else "hold"


def _unreconciled(attempt: int) -> OutcomeUnknown:
    """A takeover that this run cannot reconcile (no ``reconcile``, and it did
    not choose ``takeover`` itself): whether the earlier attempt acted is
    unknown, so the effect does not run; the key, held under ``hold``, turns
    unknown when this run's lease ends."""
    return OutcomeUnknown(
        409,
        {
            # Raised by the guard itself (the server answered 201): its slug, no base URI.
            "type": "outcome-unknown",
            "title": "Outcome unknown",
            "detail": f"the key was taken over from an earlier attempt (this is attempt {attempt}) "
            "that may have acted, and this guard has no reconcile function: the effect is not run; "
            "the key becomes unknown when this lease ends, for an operator to settle",
            "attempt": attempt,
        },
        None,
    )


def _reconciled(found: object) -> Reconciled[Any] | None:
    if found is None or isinstance(found, Reconciled):
        return found
    raise TypeError(
        f"reconcile must return Reconciled(result) or None, not {type(found).__name__}; "
        "the key is not committed"
    )


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
            except (IdemgateError, httpx.HTTPError):
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

    ``on_lease_expiry`` is what a run's lease ending without a commit means
    (the process died, or the effect raised after it may have acted). Unset:
    ``"hold"`` (the key's outcome becomes unknown and waits for an
    operator; the effect never runs again by itself), or ``"takeover"`` for a
    run given a ``reconcile`` function, which the next run calls first.
    ``"takeover"`` chosen here without a ``reconcile`` hands the key to the
    effect itself: the caller's promise that the effect reconciles by itself.

    ``classify_failure`` judges an exception the effect raises (see
    :func:`classify_failure`, the default): ``"release"`` releases the key;
    ``"unknown"`` marks it unknown at once under ``hold`` (under
    ``takeover`` it is left in flight for the next run to reconcile). The
    effect's exception is raised to the caller either way.

    ``commit_budget`` (seconds) is how long the commit is retried while
    idemgate is away; unset, the lease (``lease_seconds``, or the server's
    default 30 s). Past it, :class:`~idemgate_client.ResultNotCommitted`
    carries the effect's result.
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
        classify_failure: Callable[[Exception], Failure] = classify_failure,
        commit_budget: float | None = None,
    ) -> None:
        self.client = client
        self.commit_budget = commit_budget
        self.wait_budget = wait_budget
        self.lease_seconds = lease_seconds
        self.on_lease_expiry: LeaseExpiry | None = on_lease_expiry
        self.encode = encode
        self.decode = decode
        self.classify_failure = classify_failure

    def run(
        self,
        key: str,
        effect: Callable[[Holding], T],
        *,
        request: Mapping[str, Any] | None = None,
        fingerprint: str | None = None,
        reconcile: Callable[[Holding], Reconciled[T] | None] | None = None,
        label: str | None = None,
    ) -> T:
        """The effect's result for ``key``: run now, or stored by an earlier run.

        With ``reconcile``, the key is reserved under ``takeover``, and a run
        that takes it over (``holding.attempt > 1``) calls
        ``reconcile(holding)`` first: ``Reconciled(result)`` (the earlier
        attempt's effect happened) commits and returns that result without
        running the effect; ``None`` (it did not) runs the effect.

        ``label`` is sent with the reserve (:meth:`Client.reserve`): what a
        person sees beside the key, an order id or a job's name.

        Raises :class:`InFlight` (held past the wait budget) or
        :class:`~idemgate_client.OutcomeUnknown` without running the effect:
        both for the dead-letter queue, never for a retry under a new key.
        """
        expiry = _lease_expiry(self.on_lease_expiry, reconcile is not None)
        reserved = self._reserve(key, request, fingerprint, expiry, label)
        if isinstance(reserved, Completed):
            return self.decode(reserved.response.text())  # type: ignore[no-any-return]
        if reserved.attempt > 1 and reconcile is None and expiry == "hold":
            raise _unreconciled(reserved.attempt)
        holding = Holding(reserved.reservation_id, reserved.attempt, reserved.recovery, self.client)
        try:
            with _Heartbeat(self.client, reserved, self.lease_seconds):
                found = None
                if reconcile is not None and reserved.attempt > 1:
                    found = _reconciled(reconcile(holding))
                result: T = found.result if found is not None else effect(holding)
        except Exception as error:
            # (A BaseException — KeyboardInterrupt, SystemExit — is a crash:
            # the key stays in flight until its lease ends.)
            self._failed(reserved.reservation_id, expiry, error)
            raise
        self._commit(reserved.reservation_id, result)
        return result

    def _commit(self, reservation_id: UUID, result: Any) -> None:
        """Commits ``result``, retried while idemgate is away (see the
        module's doc); past ``commit_budget``, :class:`ResultNotCommitted`."""
        body = self.encode(result)
        tries = _CommitTries(_commit_budget(self.commit_budget, self.lease_seconds))
        while True:
            try:
                self.client.commit(reservation_id, status=200, body=body)
                return
            except Problem as error:
                if not _commit_retryable(error):
                    raise
                pause = tries.pause(error)
                if pause is None:
                    raise ResultNotCommitted.of(reservation_id, result, body, tries.waited(), error) from error
                time.sleep(pause)

    def _failed(self, reservation_id: UUID, expiry: LeaseExpiry, error: Exception) -> None:
        """Releases the key or marks it unknown, as ``classify_failure`` judges
        ``error``; whatever happens here, the caller gets ``error``."""
        verdict = _verdict(self.classify_failure, error)
        try:
            if verdict == "release":
                self.client.release(reservation_id)
            elif expiry == "hold":
                self.client.mark_unknown(reservation_id, _unknown_reason(error))
            # Under takeover the key stays in flight: the next run after the
            # lease takes it over and reconciles.
        except Exception as failed:
            _settle_failed(error, failed, verdict)

    @overload
    def effect(
        self,
        key: Callable[..., str],
        request: Callable[..., Mapping[str, Any]] | None = None,
    ) -> Callable[[Callable[..., T]], Callable[..., T]]: ...

    @overload
    def effect(
        self,
        key: Callable[..., str],
        request: Callable[..., Mapping[str, Any]] | None = None,
        *,
        reconcile: Callable[..., Reconciled[T] | None],
    ) -> Callable[[Callable[..., T]], Callable[..., T]]: ...

    def effect(
        self,
        key: Callable[..., str],
        request: Callable[..., Mapping[str, Any]] | None = None,
        *,
        reconcile: Callable[..., Reconciled[T] | None] | None = None,
    ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """The decorator form of :meth:`run`: ``key`` (and ``request``) are
        computed from the call's arguments; the function (and ``reconcile``,
        if given) gets the :class:`Holding` first, then those arguments::

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
                    reconcile=(lambda holding: reconcile(holding, *args, **kwargs)) if reconcile is not None else None,
                )

            return guarded

        return decorate

    def _reserve(
        self,
        key: str,
        request: Mapping[str, Any] | None,
        fingerprint: str | None,
        expiry: LeaseExpiry,
        label: str | None = None,
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
                    on_lease_expiry=expiry,
                    label=label,
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
    """As :class:`Guard`, over an :class:`AsyncClient`, for async effects
    (and an async ``reconcile``). ``on_lease_expiry`` unset: ``"hold"``, or
    ``"takeover"`` for a run given a ``reconcile``; ``classify_failure`` as
    in :class:`Guard` (a plain function, not awaited); ``commit_budget`` as
    in :class:`Guard`."""

    def __init__(
        self,
        client: AsyncClient,
        *,
        wait_budget: float = 30.0,
        lease_seconds: int | None = None,
        on_lease_expiry: LeaseExpiry | None = None,
        encode: Callable[[Any], str] = json.dumps,
        decode: Callable[[str], Any] = json.loads,
        classify_failure: Callable[[Exception], Failure] = classify_failure,
        commit_budget: float | None = None,
    ) -> None:
        self.client = client
        self.commit_budget = commit_budget
        self.wait_budget = wait_budget
        self.lease_seconds = lease_seconds
        self.on_lease_expiry: LeaseExpiry | None = on_lease_expiry
        self.encode = encode
        self.decode = decode
        self.classify_failure = classify_failure

    async def run(
        self,
        key: str,
        effect: Callable[[AsyncHolding], Awaitable[T]],
        *,
        request: Mapping[str, Any] | None = None,
        fingerprint: str | None = None,
        reconcile: Callable[[AsyncHolding], Awaitable[Reconciled[T] | None]] | None = None,
        label: str | None = None,
    ) -> T:
        """The effect's result for ``key``: run now, or stored by an earlier run.

        ``reconcile`` as in :meth:`Guard.run`, awaited: on a takeover
        (``holding.attempt > 1``) it runs first, and ``Reconciled(result)``
        is committed and returned without running the effect.
        """
        expiry = _lease_expiry(self.on_lease_expiry, reconcile is not None)
        reserved = await self._reserve(key, request, fingerprint, expiry, label)
        if isinstance(reserved, Completed):
            return self.decode(reserved.response.text())  # type: ignore[no-any-return]
        if reserved.attempt > 1 and reconcile is None and expiry == "hold":
            raise _unreconciled(reserved.attempt)
        holding = AsyncHolding(reserved.reservation_id, reserved.attempt, reserved.recovery, self.client)
        every = _beat_every(reserved, self.lease_seconds)

        async def beat() -> None:
            while True:
                await asyncio.sleep(every)
                try:
                    await self.client.extend(reserved.reservation_id, lease_seconds=self.lease_seconds)
                except (IdemgateError, httpx.HTTPError):
                    continue

        heartbeat = asyncio.create_task(beat())
        try:
            found = None
            if reconcile is not None and reserved.attempt > 1:
                found = _reconciled(await reconcile(holding))
            result: T = found.result if found is not None else await effect(holding)
        except Exception as error:
            # (A cancellation or another BaseException is a crash: the key
            # stays in flight until its lease ends.)
            heartbeat.cancel()
            await self._failed(reserved.reservation_id, expiry, error)
            raise
        finally:
            heartbeat.cancel()
        await self._commit(reserved.reservation_id, result)
        return result

    async def _commit(self, reservation_id: UUID, result: Any) -> None:
        """As :meth:`Guard._commit`."""
        body = self.encode(result)
        tries = _CommitTries(_commit_budget(self.commit_budget, self.lease_seconds))
        while True:
            try:
                await self.client.commit(reservation_id, status=200, body=body)
                return
            except Problem as error:
                if not _commit_retryable(error):
                    raise
                pause = tries.pause(error)
                if pause is None:
                    raise ResultNotCommitted.of(reservation_id, result, body, tries.waited(), error) from error
                await asyncio.sleep(pause)

    async def _failed(self, reservation_id: UUID, expiry: LeaseExpiry, error: Exception) -> None:
        """As :meth:`Guard._failed`."""
        verdict = _verdict(self.classify_failure, error)
        try:
            if verdict == "release":
                await self.client.release(reservation_id)
            elif expiry == "hold":
                await self.client.mark_unknown(reservation_id, _unknown_reason(error))
        except Exception as failed:
            _settle_failed(error, failed, verdict)

    async def _reserve(
        self,
        key: str,
        request: Mapping[str, Any] | None,
        fingerprint: str | None,
        expiry: LeaseExpiry,
        label: str | None = None,
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
                    on_lease_expiry=expiry,
                    label=label,
                )
            except RequestInFlight as busy:
                await asyncio.sleep(_pause(key, busy, self.wait_budget, started))
