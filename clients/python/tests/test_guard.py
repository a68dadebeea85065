"""Guard.run against a real idemgate: at most one execution per key."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from typing import Awaitable, Callable, Iterator

import httpx
import pytest

from idemgate_client import (
    AsyncClient,
    AsyncGuard,
    AsyncHolding,
    Client,
    Failure,
    Guard,
    Holding,
    InFlight,
    KeyReused,
    NotExecuted,
    OutcomeUnknown,
    Reconciled,
    RequestInFlight,
    Reserved,
    classify_failure,
    derive_key,
)

from conftest import TOKEN, Origin, admin_view, closed_port, settle, start_server

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


def test_an_effect_that_failed_after_it_may_have_acted_is_unknown_at_once(client):
    guard, key = Guard(client, wait_budget=10.0, lease_seconds=30), fresh_key()

    def broke(_: Holding) -> object:
        raise ConnectionResetError("the payment API hung up after the request was sent")

    with pytest.raises(ConnectionResetError):
        guard.run(key, broke, request=CHARGE)
    charge = Charges()
    started = time.monotonic()
    with pytest.raises(OutcomeUnknown):  # not in flight for 30 s: unknown, for an operator
        guard.run(key, charge, request=CHARGE)
    assert time.monotonic() - started < 2
    assert charge.runs == 0


@pytest.fixture
def origin() -> Iterator[Origin]:
    payments = Origin()
    yield payments
    payments.close()


def pay(url: str, key: str, path: str = "/charges", read_timeout: float = 5.0) -> dict[str, object]:
    """One charge at a payments API, over real HTTP."""
    answer = httpx.post(f"{url}{path}", json={"amount": 500}, headers={"idempotency-key": key},
                        timeout=httpx.Timeout(5.0, read=read_timeout))
    answer.raise_for_status()
    charge: dict[str, object] = answer.json()
    return charge


def test_a_read_timeout_after_the_origin_acted_makes_the_key_unknown_at_once(client, server, origin):
    guard, key = Guard(client, lease_seconds=30, wait_budget=30), fresh_key()
    with pytest.raises(httpx.ReadTimeout) as lost:  # the guard raises the effect's own exception
        # The origin charges at once and answers 3 s later; the effect gives up after 0.5 s.
        guard.run(key, lambda _: pay(origin.url, key, "/stall/3000", read_timeout=0.5), request=CHARGE)
    other = Charges()
    started = time.monotonic()
    with pytest.raises(OutcomeUnknown) as unknown:  # not InFlight after a 30 s wait: unknown now
        guard.run(key, other, request=CHARGE)
    assert time.monotonic() - started < 2
    assert unknown.value.retry_after is None and unknown.value.dead_letter_reason == "outcome_unknown"
    with pytest.raises(OutcomeUnknown) as duplicate:  # any duplicate, through the API too
        client.reserve(key, request=CHARGE, wait=5)
    assert duplicate.value.retry_after is None
    view = admin_view(server.base_url, key)
    assert view["state"] == "unknown"
    marked = view["marked_unknown"]
    assert isinstance(marked, dict)
    # The reason names the exception's type, never its message.
    assert marked["reason"] == "the guarded effect raised httpx.ReadTimeout: it may have acted"
    assert str(lost.value) not in marked["reason"]
    assert origin.charges == {key: 1} and other.runs == 0


def test_a_refused_connection_releases_the_key_and_the_retry_runs(client, origin):
    guard, key = Guard(client), fresh_key()
    nobody = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(httpx.ConnectError):  # nothing listens there: the request never went out
        guard.run(key, lambda _: pay(nobody, key), request=CHARGE)
    assert guard.run(key, lambda _: pay(origin.url, key), request=CHARGE) == {"charge": "ch_1"}
    assert guard.run(key, lambda _: pay(origin.url, key), request=CHARGE) == {"charge": "ch_1"}
    assert origin.charges == {key: 1}


def test_the_default_classifier_releases_only_what_proves_nothing_was_sent():
    request = httpx.Request("POST", "http://127.0.0.1/charges")
    released = [
        NotExecuted("declined"),
        httpx.ConnectError("refused", request=request),
        httpx.ConnectTimeout("connect timed out", request=request),
        ConnectionRefusedError(),
        socket.gaierror(socket.EAI_NONAME, "name or service not known"),
    ]
    unknown = [
        httpx.ReadTimeout("timed out", request=request),
        httpx.WriteTimeout("timed out", request=request),
        httpx.PoolTimeout("timed out", request=request),
        httpx.ReadError("reset", request=request),
        httpx.RemoteProtocolError("server disconnected", request=request),
        ConnectionResetError(),
        TimeoutError(),
        RuntimeError("the answer could not be parsed"),
        NotExecutedLookalike(),
    ]
    assert [classify_failure(e) for e in released] == ["release"] * len(released)
    assert [classify_failure(e) for e in unknown] == ["unknown"] * len(unknown)


class NotExecutedLookalike(Exception):
    """Not a NotExecuted, whatever its name says."""


class CardDeclined(Exception):
    """The provider refused before charging: this application knows nothing happened."""


def test_a_custom_classifier_is_honoured(client, origin):
    def lenient(error: Exception) -> Failure:
        return "release" if isinstance(error, CardDeclined) else classify_failure(error)

    guard, key = Guard(client, classify_failure=lenient), fresh_key()

    def declined(_: Holding) -> object:
        raise CardDeclined("card_declined")

    with pytest.raises(CardDeclined):
        guard.run(key, declined, request=CHARGE)
    assert guard.run(key, lambda _: pay(origin.url, key), request=CHARGE) == {"charge": "ch_1"}

    # Stricter than the default: even a refused connection is unknown
    # (NotExecuted, the effect's own word, still releases).
    strict = Guard(client, classify_failure=lambda error: "unknown")
    refused, nobody = fresh_key(), f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(httpx.ConnectError):
        strict.run(refused, lambda _: pay(nobody, refused), request=CHARGE)
    with pytest.raises(OutcomeUnknown):
        strict.run(refused, lambda _: pay(origin.url, refused), request=CHARGE)
    said, other = fresh_key(), Charges()

    def not_executed(_: Holding) -> object:
        raise NotExecuted("validation failed")

    with pytest.raises(NotExecuted):
        strict.run(said, not_executed, request=CHARGE)
    assert strict.run(said, other, request=CHARGE) == {"charge": "ch_1", "attempt": 1}

    # A classifier that raises is taken as unknown; the caller still gets the effect's exception.
    def broken(error: Exception) -> Failure:
        raise ValueError("a bug in the classifier")

    odd = fresh_key()
    with pytest.raises(CardDeclined):
        Guard(client, classify_failure=broken).run(odd, declined, request=CHARGE)
    with pytest.raises(OutcomeUnknown):
        guard.run(odd, other, request=CHARGE)
    assert origin.charges == {key: 1} and other.runs == 1


def test_when_the_mark_fails_the_caller_gets_the_effects_exception_and_the_key_stays_held(tmp_path):
    database_url = f"sqlite://{tmp_path / 'keys.db'}"
    first = start_server(database_url, tmp_path / "first")
    key, lost = fresh_key(), TimeoutError("the provider did not answer")

    def effect(_: Holding) -> object:
        first.process.terminate()  # the store goes away while the effect runs
        first.process.wait(timeout=20)
        raise lost

    with Client(first.base_url, token=TOKEN, timeout=5) as c:
        with pytest.raises(TimeoutError) as raised:
            Guard(c, lease_seconds=30).run(key, effect, request=CHARGE)
    assert raised.value is lost
    notes = getattr(raised.value, "__notes__", None)
    if notes is not None:  # Python 3.11+
        assert any("marking the key unknown failed too (idemgate_client.errors.StoreUnavailable)" in note for note in notes)
    second = start_server(database_url, tmp_path / "second")
    try:
        with Client(second.base_url, token=TOKEN) as c:
            # Neither released nor marked: in flight until its lease ends (then, under hold, unknown).
            with pytest.raises(RequestInFlight):
                c.reserve(key, request=CHARGE)
    finally:
        second.process.terminate()
        second.process.wait(timeout=20)


def test_the_async_guard_judges_a_failure_as_the_sync_one_does(server, origin):
    async def apay(http: httpx.AsyncClient, url: str, key: str, path: str = "/charges") -> dict[str, object]:
        answer = await http.post(f"{url}{path}", json={"amount": 500}, headers={"idempotency-key": key})
        answer.raise_for_status()
        charge: dict[str, object] = answer.json()
        return charge

    async def flow(a: AsyncClient) -> None:
        guard = AsyncGuard(a, lease_seconds=30)
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.5)) as http:
            timed_out = fresh_key()
            with pytest.raises(httpx.ReadTimeout):
                await guard.run(timed_out, lambda _: apay(http, origin.url, timed_out, "/stall/3000"), request=CHARGE)
            started = time.monotonic()
            with pytest.raises(OutcomeUnknown):
                await guard.run(timed_out, lambda _: apay(http, origin.url, timed_out), request=CHARGE)
            assert time.monotonic() - started < 2
            view = admin_view(server.base_url, timed_out)
            assert view["marked_unknown"] == {
                "reason": "the guarded effect raised httpx.ReadTimeout: it may have acted",
                "at": view["marked_unknown"]["at"],  # type: ignore[index]
            }

            refused, nobody = fresh_key(), f"http://127.0.0.1:{closed_port()}"
            with pytest.raises(httpx.ConnectError):
                await guard.run(refused, lambda _: apay(http, nobody, refused), request=CHARGE)
            assert await guard.run(refused, lambda _: apay(http, origin.url, refused), request=CHARGE) == {
                "charge": "ch_2"
            }

            declined = fresh_key()

            async def refuses(_: AsyncHolding) -> object:
                raise CardDeclined("card_declined")

            lenient = AsyncGuard(a, classify_failure=lambda e: "release" if isinstance(e, CardDeclined) else "unknown")
            with pytest.raises(CardDeclined):
                await lenient.run(declined, refuses, request=CHARGE)
            assert isinstance(await a.reserve(declined, request=CHARGE), Reserved)

    _run_async(server, flow)
    assert origin.charges == {k: 1 for k in origin.charges} and len(origin.charges) == 2


def test_an_unknown_outcome_is_not_run_and_goes_to_the_dead_letter_queue(client, server):
    # A guard for an effect that cannot reconcile: its lease ending means unknown.
    guard, key = Guard(client, lease_seconds=1, on_lease_expiry="hold"), fresh_key()

    def broke(_: Holding) -> object:
        raise ConnectionError("the payment API hung up after the request was sent")

    with pytest.raises(ConnectionError):
        guard.run(key, broke, request=CHARGE)
    # Marked unknown at once (the exception does not prove nothing was
    # charged); past the lease it would be unknown all the same.
    time.sleep(1.5)
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
    guard = Guard(client, lease_seconds=30)
    with pytest.raises(ConnectionError):
        guard.run(key, lambda h: payments.charge(key, h), request=CHARGE)
    # Under hold the key is marked unknown at once: no waiting out the lease.
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
        guard = AsyncGuard(a, lease_seconds=30)
        with pytest.raises(ConnectionError):
            await guard.run(key, lambda h: payments.acharge(key, h), request=CHARGE)
        # Marked unknown at once, as by the sync guard.
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
