"""Guard.run against a real idemgate: at most one execution per key."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Awaitable, Callable

import pytest

from idemgate_client import (
    AsyncClient,
    AsyncGuard,
    AsyncHolding,
    Client,
    Guard,
    Holding,
    InFlight,
    KeyReused,
    NotExecuted,
    OutcomeUnknown,
    Reconciled,
    Reserved,
    derive_key,
)

from conftest import TOKEN, settle

CHARGE = {"method": "POST", "path": "/charges", "body": {"amount": 500}}


def fresh_key() -> str:
    return derive_key(tenant="acme", run=f"run-{uuid.uuid4()}", step=1, tool="charge")


class Charges:
    """A side effect that counts its executions."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.runs = 0
        self.attempts: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, holding: Holding) -> dict[str, object]:
        with self.lock:
            self.runs += 1
            n = self.runs
        self.attempts.append(holding.attempt)
        time.sleep(self.seconds)
        return {"charge": f"ch_{n}", "attempt": holding.attempt}


@pytest.fixture
def client(server):
    with Client(server.base_url, token=TOKEN) as c:
        yield c


def test_a_retry_returns_the_stored_result_without_running(client):
    guard, charge, key = Guard(client), Charges(), fresh_key()
    first = guard.run(key, charge, request=CHARGE)
    second = guard.run(key, charge, request=CHARGE)
    assert first == second == {"charge": "ch_1", "attempt": 1}
    assert charge.runs == 1


def test_a_duplicate_while_the_first_runs_waits_for_its_result(client, server):
    charge, key = Charges(seconds=1.0), fresh_key()
    results: list[object] = []

    def call() -> None:
        with Client(server.base_url, token=TOKEN) as own:
            results.append(Guard(own).run(key, charge, request=CHARGE))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert charge.runs == 1
    assert results == [{"charge": "ch_1", "attempt": 1}] * 4


def test_a_key_held_past_the_budget_is_in_flight_not_run(client, server):
    slow, key = Charges(seconds=3.0), fresh_key()
    holder = threading.Thread(target=lambda: Guard(Client(server.base_url, token=TOKEN)).run(key, slow, request=CHARGE))
    holder.start()
    time.sleep(0.3)
    other = Charges()
    started = time.monotonic()
    with pytest.raises(InFlight) as busy:
        Guard(client, wait_budget=1.0).run(key, other, request=CHARGE)
    assert time.monotonic() - started < 2.5
    assert busy.value.key == key and busy.value.lease_expires_at is not None
    assert busy.value.dead_letter_reason == "idempotency_in_flight"
    holder.join()
    assert other.runs == 0 and slow.runs == 1


def test_another_payload_is_key_reused_and_never_run(client):
    guard, charge, key = Guard(client), Charges(), fresh_key()
    guard.run(key, charge, request=CHARGE)
    with pytest.raises(KeyReused):
        guard.run(key, charge, request={**CHARGE, "body": {"amount": 900}})
    assert charge.runs == 1


def test_an_effect_that_did_not_act_releases_the_key(client):
    guard, key = Guard(client), fresh_key()

    def refused(_: Holding) -> object:
        raise NotExecuted("the card was declined before anything was charged")

    with pytest.raises(NotExecuted):
        guard.run(key, refused, request=CHARGE)
    charge = Charges()
    assert guard.run(key, charge, request=CHARGE) == {"charge": "ch_1", "attempt": 1}


def test_an_effect_that_failed_after_it_may_have_acted_keeps_the_key(client):
    guard, key = Guard(client, wait_budget=1.0, lease_seconds=30), fresh_key()

    def broke(_: Holding) -> object:
        raise ConnectionError("the payment API hung up after the request was sent")

    with pytest.raises(ConnectionError):
        guard.run(key, broke, request=CHARGE)
    charge = Charges()
    with pytest.raises(InFlight):
        guard.run(key, charge, request=CHARGE)
    assert charge.runs == 0


def test_an_unknown_outcome_is_not_run_and_goes_to_the_dead_letter_queue(client, server):
    # A guard for an effect that cannot reconcile: its lease ending means unknown.
    guard, key = Guard(client, lease_seconds=1, on_lease_expiry="hold"), fresh_key()

    def broke(_: Holding) -> object:
        raise ConnectionError("the payment API hung up after the request was sent")

    with pytest.raises(ConnectionError):
        guard.run(key, broke, request=CHARGE)
    time.sleep(1.5)  # the lease ends: nobody knows whether the charge went out
    charge = Charges()
    # Whoever retries, whatever it would choose.
    for retry in (guard, Guard(client), Guard(client, on_lease_expiry="takeover")):
        with pytest.raises(OutcomeUnknown) as unknown:
            retry.run(key, charge, request=CHARGE)
        assert unknown.value.dead_letter_reason == "outcome_unknown"
        assert unknown.value.retry_after is None
    assert charge.runs == 0

    # An operator finds that the charge went through and completes the key
    # with it: every run returns that result, and the effect still never runs.
    view = settle(server.base_url, key, {
        "action": "complete",
        "reason": "the payment API shows the charge",
        "response": {"status": 200, "headers": [], "body": json.dumps({"charge": "ch_found", "attempt": 1})},
    })
    assert view["state"] == "completed"
    assert guard.run(key, charge, request=CHARGE) == {"charge": "ch_found", "attempt": 1}
    assert Guard(client).run(key, charge, request=CHARGE) == {"charge": "ch_found", "attempt": 1}
    assert charge.runs == 0


def test_the_lease_is_extended_while_a_long_effect_runs(client, server):
    slow, key = Charges(seconds=3.5), fresh_key()
    holder = threading.Thread(
        target=lambda: Guard(Client(server.base_url, token=TOKEN), lease_seconds=1).run(key, slow, request=CHARGE)
    )
    holder.start()
    time.sleep(2.0)  # two leases of 1 s: without the heartbeat, the lease would have ended
    other = Charges()
    with pytest.raises(InFlight):
        Guard(client, wait_budget=0.5, lease_seconds=1).run(key, other, request=CHARGE)
    holder.join()
    assert other.runs == 0 and slow.runs == 1


def test_a_takeover_hands_the_attempt_and_the_recovery_point(client):
    key = fresh_key()
    # A holder that recorded its progress, then died: its lease ends (under
    # the reservation API's default, takeover).
    dead = client.reserve(key, request=CHARGE, lease_seconds=1)
    assert isinstance(dead, Reserved)
    client.checkpoint(dead.reservation_id, recovery_point="charge-sent", data={"charge": "ch_7"})
    time.sleep(1.3)
    seen: list[Holding] = []

    def reconcile(holding: Holding) -> dict[str, object]:
        seen.append(holding)
        assert holding.recovery is not None
        return {"charge": holding.recovery.data["charge"], "reconciled": True}

    # A guard that takes over without a reconcile function: its effect
    # reconciles by itself (the caller's promise).
    result = Guard(client, on_lease_expiry="takeover").run(key, reconcile, request=CHARGE)
    assert result == {"charge": "ch_7", "reconciled": True}
    assert seen[0].attempt == 2 and seen[0].recovery.recovery_point == "charge-sent"


class Payments:
    """A payments API and an effect that charges through it, counting: the
    effect's runs, the charges it made (per key), and a crash either before
    or after the charge on the effect's first run."""

    def __init__(self, crash: str | None = None) -> None:
        self.crash = crash
        self.runs = 0
        self.charges: dict[str, str] = {}

    def charge(self, key: str, holding: Holding) -> dict[str, object]:
        self.runs += 1
        holding.checkpoint("validated", {"amount": 500})
        if self.crash == "before" and self.runs == 1:
            raise RuntimeError("the worker crashed before the charge went out")
        self.charges[key] = f"ch_{len(self.charges) + 1}"
        holding.checkpoint("charge-sent", {"charge": self.charges[key]})
        if self.crash == "after" and self.runs == 1:
            raise ConnectionError("the payment API hung up after charging")
        return {"charge": self.charges[key], "attempt": holding.attempt}

    def find(self, key: str) -> Reconciled[dict[str, object]] | None:
        """What a reconcile asks the payments API: the key's charge, if any."""
        return Reconciled({"charge": self.charges[key], "found": True}) if key in self.charges else None


def test_by_default_an_effect_that_raised_after_acting_is_never_run_again(client):
    payments, key = Payments(crash="after"), fresh_key()
    guard = Guard(client, lease_seconds=1)
    with pytest.raises(ConnectionError):
        guard.run(key, lambda h: payments.charge(key, h), request=CHARGE)
    time.sleep(1.5)  # the lease ends: under hold, the outcome is unknown
    for _ in range(2):
        with pytest.raises(OutcomeUnknown) as unknown:
            guard.run(key, lambda h: payments.charge(key, h), request=CHARGE)
        assert unknown.value.dead_letter_reason == "outcome_unknown"
    assert payments.runs == 1 and len(payments.charges) == 1


def test_a_default_guard_does_not_run_a_takeover_it_cannot_reconcile(client):
    key = fresh_key()
    # An earlier holder that chose takeover (the reservation API's default) dies.
    dead = client.reserve(key, request=CHARGE, lease_seconds=1)
    assert isinstance(dead, Reserved)
    time.sleep(1.3)
    charge = Charges()
    with pytest.raises(OutcomeUnknown) as refused:
        Guard(client, lease_seconds=1).run(key, charge, request=CHARGE)
    assert refused.value.dead_letter_reason == "outcome_unknown"
    time.sleep(1.3)  # the refusing guard's own lease (under hold) ends: unknown
    with pytest.raises(OutcomeUnknown) as unknown:
        Guard(client).run(key, charge, request=CHARGE, reconcile=lambda h: None)
    assert unknown.value.retry_after is None
    assert charge.runs == 0


def test_a_reconcile_that_finds_the_effect_returns_its_result_without_running(client):
    payments, key = Payments(crash="after"), fresh_key()
    guard = Guard(client, lease_seconds=1)
    seen: list[Holding] = []

    def reconcile(holding: Holding) -> Reconciled[dict[str, object]] | None:
        seen.append(holding)
        return payments.find(key)

    with pytest.raises(ConnectionError):
        guard.run(key, lambda h: payments.charge(key, h), request=CHARGE, reconcile=reconcile)
    time.sleep(1.5)  # the lease ends: under takeover, the next run reconciles
    found = {"charge": "ch_1", "found": True}
    assert guard.run(key, lambda h: payments.charge(key, h), request=CHARGE, reconcile=reconcile) == found
    # The key is completed with the reconciled result: every run replays it.
    assert guard.run(key, lambda h: payments.charge(key, h), request=CHARGE, reconcile=reconcile) == found
    assert Guard(client).run(key, lambda h: payments.charge(key, h), request=CHARGE) == found
    assert payments.runs == 1 and payments.charges == {key: "ch_1"}
    assert len(seen) == 1 and seen[0].attempt == 2
    assert seen[0].recovery is not None and seen[0].recovery.recovery_point == "charge-sent"


def test_a_reconcile_that_finds_nothing_runs_the_effect_on_the_takeover(client):
    payments, key = Payments(crash="before"), fresh_key()
    guard = Guard(client, lease_seconds=1)
    seen: list[Holding] = []

    def reconcile(holding: Holding) -> Reconciled[dict[str, object]] | None:
        seen.append(holding)
        return payments.find(key)

    with pytest.raises(RuntimeError):  # a crash, not NotExecuted: the key stays held
        guard.run(key, lambda h: payments.charge(key, h), request=CHARGE, reconcile=reconcile)
    time.sleep(1.5)
    ran = {"charge": "ch_1", "attempt": 2}
    assert guard.run(key, lambda h: payments.charge(key, h), request=CHARGE, reconcile=reconcile) == ran
    assert guard.run(key, lambda h: payments.charge(key, h), request=CHARGE, reconcile=reconcile) == ran
    # Two runs of the effect, because the first never charged: one charge.
    assert payments.runs == 2 and payments.charges == {key: "ch_1"}
    assert len(seen) == 1 and seen[0].attempt == 2
    assert seen[0].recovery is not None and seen[0].recovery.recovery_point == "validated"
    assert seen[0].recovery.data == {"amount": 500}


def test_the_decorator_form_with_reconcile(client):
    payments, guard, run = Payments(crash="after"), Guard(client, lease_seconds=1), f"run-{uuid.uuid4()}"
    key_of = lambda run, step: derive_key(tenant="acme", run=run, step=step, tool="charge")  # noqa: E731
    attempts: list[int] = []

    def find(holding: Holding, run: str, step: int) -> Reconciled[dict[str, object]] | None:
        attempts.append(holding.attempt)
        return payments.find(key_of(run, step))

    @guard.effect(key=key_of, reconcile=find)
    def charge(holding: Holding, run: str, step: int) -> dict[str, object]:
        return payments.charge(key_of(run, step), holding)

    with pytest.raises(ConnectionError):
        charge(run, 1)
    time.sleep(1.5)
    assert charge(run, 1) == {"charge": "ch_1", "found": True}
    assert charge(run, 1) == {"charge": "ch_1", "found": True}
    assert payments.runs == 1 and attempts == [2]


def test_the_async_guard(server):
    import asyncio

    from idemgate_client import AsyncClient, AsyncGuard, AsyncHolding

    runs = 0

    async def charge(holding: AsyncHolding) -> dict[str, object]:
        nonlocal runs
        runs += 1
        await holding.checkpoint("started")
        await asyncio.sleep(1.5)  # longer than the 1 s lease: the heartbeat keeps it
        return {"charge": "ch_async", "attempt": holding.attempt}

    async def flow() -> None:
        key = fresh_key()
        async with AsyncClient(server.base_url, token=TOKEN) as a, AsyncClient(server.base_url, token=TOKEN) as b:
            results = await asyncio.gather(
                AsyncGuard(a, lease_seconds=1).run(key, charge, request=CHARGE),
                AsyncGuard(b, lease_seconds=1).run(key, charge, request=CHARGE),
            )
            assert results == [{"charge": "ch_async", "attempt": 1}] * 2
            with pytest.raises(KeyReused):
                await AsyncGuard(a).run(key, charge, request={**CHARGE, "body": {"amount": 1}})

            released = fresh_key()

            async def declined(_: AsyncHolding) -> object:
                raise NotExecuted("declined")

            with pytest.raises(NotExecuted):
                await AsyncGuard(a).run(released, declined, request=CHARGE)
            assert isinstance(await a.reserve(released, request=CHARGE), Reserved)

            # A holder cut off under hold: the guard does not run the effect
            # and says so; an operator who finds nothing happened releases the
            # key, and the next run executes it once.
            unknown = fresh_key()
            await a.reserve(unknown, request=CHARGE, lease_seconds=1, on_lease_expiry="hold")
            await asyncio.sleep(1.5)
            with pytest.raises(OutcomeUnknown) as stuck:
                await AsyncGuard(a).run(unknown, charge, request=CHARGE)
            assert stuck.value.dead_letter_reason == "outcome_unknown"
            settle(server.base_url, unknown, {"action": "release", "reason": "the payment API has no such charge"})
            assert await AsyncGuard(a, lease_seconds=1).run(unknown, charge, request=CHARGE) == {
                "charge": "ch_async", "attempt": 1,
            }

    asyncio.run(flow())
    assert runs == 2


class AsyncPayments(Payments):
    """As :class:`Payments`, for the async guard."""

    async def acharge(self, key: str, holding: AsyncHolding) -> dict[str, object]:
        self.runs += 1
        await holding.checkpoint("validated", {"amount": 500})
        if self.crash == "before" and self.runs == 1:
            raise RuntimeError("the worker crashed before the charge went out")
        self.charges[key] = f"ch_{len(self.charges) + 1}"
        await holding.checkpoint("charge-sent", {"charge": self.charges[key]})
        if self.crash == "after" and self.runs == 1:
            raise ConnectionError("the payment API hung up after charging")
        return {"charge": self.charges[key], "attempt": holding.attempt}


def _run_async(server, flow: Callable[[AsyncClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with AsyncClient(server.base_url, token=TOKEN) as a:
            await flow(a)

    asyncio.run(main())


def test_the_async_guard_by_default_never_runs_again_an_effect_that_raised_after_acting(server):
    payments, key = AsyncPayments(crash="after"), fresh_key()

    async def flow(a: AsyncClient) -> None:
        guard = AsyncGuard(a, lease_seconds=1)
        with pytest.raises(ConnectionError):
            await guard.run(key, lambda h: payments.acharge(key, h), request=CHARGE)
        await asyncio.sleep(1.5)
        for _ in range(2):
            with pytest.raises(OutcomeUnknown) as unknown:
                await guard.run(key, lambda h: payments.acharge(key, h), request=CHARGE)
            assert unknown.value.dead_letter_reason == "outcome_unknown"

    _run_async(server, flow)
    assert payments.runs == 1 and len(payments.charges) == 1


def test_the_async_guard_with_a_reconcile_that_finds_the_effect(server):
    payments, key = AsyncPayments(crash="after"), fresh_key()
    seen: list[AsyncHolding] = []

    async def reconcile(holding: AsyncHolding) -> Reconciled[dict[str, object]] | None:
        seen.append(holding)
        return payments.find(key)

    async def flow(a: AsyncClient) -> None:
        guard = AsyncGuard(a, lease_seconds=1)
        with pytest.raises(ConnectionError):
            await guard.run(key, lambda h: payments.acharge(key, h), request=CHARGE, reconcile=reconcile)
        await asyncio.sleep(1.5)
        for _ in range(2):  # the reconciled result, then its replay
            assert await guard.run(
                key, lambda h: payments.acharge(key, h), request=CHARGE, reconcile=reconcile
            ) == {"charge": "ch_1", "found": True}

    _run_async(server, flow)
    assert payments.runs == 1 and payments.charges == {key: "ch_1"}
    assert len(seen) == 1 and seen[0].attempt == 2
    assert seen[0].recovery is not None and seen[0].recovery.recovery_point == "charge-sent"


def test_the_async_guard_with_a_reconcile_that_finds_nothing(server):
    payments, key = AsyncPayments(crash="before"), fresh_key()
    seen: list[AsyncHolding] = []

    async def reconcile(holding: AsyncHolding) -> Reconciled[dict[str, object]] | None:
        seen.append(holding)
        return payments.find(key)

    async def flow(a: AsyncClient) -> None:
        guard = AsyncGuard(a, lease_seconds=1)
        with pytest.raises(RuntimeError):
            await guard.run(key, lambda h: payments.acharge(key, h), request=CHARGE, reconcile=reconcile)
        await asyncio.sleep(1.5)
        for _ in range(2):
            assert await guard.run(
                key, lambda h: payments.acharge(key, h), request=CHARGE, reconcile=reconcile
            ) == {"charge": "ch_1", "attempt": 2}

    _run_async(server, flow)
    assert payments.runs == 2 and payments.charges == {key: "ch_1"}
    assert len(seen) == 1 and seen[0].attempt == 2
    assert seen[0].recovery is not None and seen[0].recovery.recovery_point == "validated"


def test_the_decorator_form(client):
    guard = Guard(client)
    run = f"run-{uuid.uuid4()}"
    made: list[tuple[int, dict[str, int]]] = []

    @guard.effect(
        key=lambda run, step, args: derive_key(tenant="acme", run=run, step=step, tool="charge"),
        request=lambda run, step, args: {"method": "POST", "path": "/charges", "body": args},
    )
    def charge(holding: Holding, run: str, step: int, args: dict[str, int]) -> dict[str, object]:
        made.append((step, args))
        return {"step": step, "amount": args["amount"], "attempt": holding.attempt}

    assert charge(run, 1, {"amount": 500}) == {"step": 1, "amount": 500, "attempt": 1}
    assert charge(run, 1, {"amount": 500}) == {"step": 1, "amount": 500, "attempt": 1}
    assert charge(run, 2, {"amount": 700}) == {"step": 2, "amount": 700, "attempt": 1}
    with pytest.raises(KeyReused):
        charge(run, 2, {"amount": 900})
    assert made == [(1, {"amount": 500}), (2, {"amount": 700})]
    assert charge.__name__ == "charge"
