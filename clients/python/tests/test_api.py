"""The typed reservation calls against a real idemgate."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import pytest

from idemgate_client import (
    AsyncClient,
    Client,
    Completed,
    Guard,
    InvalidRequest,
    KeyReused,
    LeaseLost,
    NotFound,
    OutcomeUnknown,
    RequestInFlight,
    Reserved,
    Unauthorized,
    derive_key,
)

from conftest import OTHER_TOKEN, TOKEN

CHARGE = {"method": "POST", "path": "/charges", "body": {"amount": 500, "currency": "EUR"}}


def fresh_key() -> str:
    return derive_key(tenant="acme", run=f"run-{uuid.uuid4()}", step=1, tool="charge")


@pytest.fixture
def idem(server):
    with Client(server.base_url, token=TOKEN) as client:
        yield client


def test_reserve_commit_replay(idem):
    key = fresh_key()
    first = idem.reserve(key, request=CHARGE)
    assert isinstance(first, Reserved)
    assert first.attempt == 1 and first.recovery is None
    with pytest.raises(RequestInFlight) as in_flight:
        idem.reserve(key, request=CHARGE)
    assert in_flight.value.status == 409
    assert in_flight.value.retry_after is not None and in_flight.value.retry_after >= 1
    assert in_flight.value.lease_expires_at is not None
    done = idem.commit(first.reservation_id, status=201, headers=[("content-type", "application/json")],
                       body=json.dumps({"charge": "ch_1"}))
    assert done.response.status == 201 and not done.replayed
    # A reordered body is the same request: the stored response comes back.
    again = idem.reserve(key, request={**CHARGE, "body": {"currency": "EUR", "amount": 500}})
    assert isinstance(again, Completed) and again.replayed
    assert again.response.status == 201
    assert json.loads(again.response.text()) == {"charge": "ch_1"}
    assert ("content-type", "application/json") in again.response.headers


def test_another_payload_is_key_reused_and_says_so(idem):
    key = fresh_key()
    reserved = idem.reserve(key, request=CHARGE)
    idem.commit(reserved.reservation_id, status=201, body="ok")
    with pytest.raises(KeyReused) as reused:
        idem.reserve(key, request={**CHARGE, "body": {"amount": 900, "currency": "EUR"}})
    assert reused.value.status == 422
    assert reused.value.type.endswith("/key-reused")


def test_release_makes_the_key_new_again(idem):
    key = fresh_key()
    first = idem.reserve(key, request=CHARGE)
    idem.release(first.reservation_id)
    second = idem.reserve(key, request=CHARGE)
    assert isinstance(second, Reserved)
    assert second.reservation_id != first.reservation_id


def test_checkpoint_extend_and_get(idem):
    key = fresh_key()
    held = idem.reserve(key, request=CHARGE, lease_seconds=5)
    record = idem.checkpoint(held.reservation_id, recovery_point="charged", data={"charge": "ch_9"})
    assert record.recovery is not None and record.recovery.recovery_point == "charged"
    assert record.recovery.data == {"charge": "ch_9"}
    extended = idem.extend(held.reservation_id, lease_seconds=60)
    assert extended.lease_expires_at > held.lease_expires_at
    seen = idem.get(held.reservation_id)
    assert seen.live and seen.state == "in_flight" and seen.attempt == 1
    assert seen.recovery == record.recovery


def test_bytes_bodies_round_trip(idem):
    key = fresh_key()
    held = idem.reserve(key, request=CHARGE)
    payload = bytes(range(256))
    idem.commit(held.reservation_id, status=200, body=payload)
    replay = idem.reserve(key, request=CHARGE)
    assert isinstance(replay, Completed) and replay.response.body == payload


def test_prefer_wait_gets_the_replay_when_the_first_finishes(idem, server):
    key = fresh_key()
    held = idem.reserve(key, request=CHARGE)

    def finish() -> None:
        time.sleep(0.5)
        with Client(server.base_url, token=TOKEN) as other:
            other.commit(held.reservation_id, status=201, body="done")

    thread = threading.Thread(target=finish)
    thread.start()
    started = time.monotonic()
    answer = idem.reserve(key, request=CHARGE, wait=5)
    thread.join()
    assert isinstance(answer, Completed) and answer.response.text() == "done"
    assert time.monotonic() - started < 5


def test_a_held_key_past_its_lease_is_outcome_unknown(idem):
    key = fresh_key()
    held = idem.reserve(key, request=CHARGE, lease_seconds=1, on_lease_expiry="hold")
    assert isinstance(held, Reserved)
    time.sleep(1.5)  # its holder was cut off: the lease ends without news
    for wait in (None, 5):  # waiting does not help: nothing will settle it by itself
        started = time.monotonic()
        with pytest.raises(OutcomeUnknown) as unknown:
            idem.reserve(key, request=CHARGE, wait=wait)
        assert time.monotonic() - started < 2
        assert unknown.value.status == 409
        assert unknown.value.type.endswith("/outcome-unknown")
        assert unknown.value.retry_after is None
        assert "retry_after_seconds" not in unknown.value.body
        assert unknown.value.dead_letter_reason == "outcome_unknown"
    assert idem.get(held.reservation_id).state == "unknown"
    # The holder's own late commit settles it: every request then replays it.
    idem.commit(held.reservation_id, status=201, body="late")
    replay = idem.reserve(key, request=CHARGE)
    assert isinstance(replay, Completed) and replay.response.text() == "late"


def test_mark_unknown_holds_the_key_for_an_operator_at_once(idem):
    key = fresh_key()
    # Under takeover, the reservation API's default: marked, it is unknown all the same.
    held = idem.reserve(key, request=CHARGE, lease_seconds=60)
    assert isinstance(held, Reserved)
    reason = "the provider timed out after the request was sent"
    record = idem.mark_unknown(held.reservation_id, reason)
    assert record.state == "unknown" and record.reservation_id == held.reservation_id
    assert record.marked_unknown is not None and record.marked_unknown.reason == reason
    for wait in (None, 5):  # at once, 59 s before the lease ends, and waiting does not help
        started = time.monotonic()
        with pytest.raises(OutcomeUnknown) as unknown:
            idem.reserve(key, request=CHARGE, wait=wait)
        assert time.monotonic() - started < 2
        assert unknown.value.status == 409 and unknown.value.type.endswith("/outcome-unknown")
        assert unknown.value.retry_after is None
        assert "retry_after_seconds" not in unknown.value.body
    # Marked again: 200, the first reason stays.
    again = idem.mark_unknown(held.reservation_id, "another reason")
    assert again.marked_unknown is not None and again.marked_unknown.reason == reason
    assert idem.get(held.reservation_id).state == "unknown"
    # The holder's late commit still settles it: every request replays it.
    idem.commit(held.reservation_id, status=201, body="late but real")
    replay = idem.reserve(key, request=CHARGE)
    assert isinstance(replay, Completed) and replay.response.text() == "late but real"


def test_mark_unknown_wants_a_reason_and_a_live_reservation(idem):
    held = idem.reserve(fresh_key(), request=CHARGE)
    assert isinstance(held, Reserved)
    with pytest.raises(InvalidRequest) as empty:
        idem.mark_unknown(held.reservation_id, "")
    assert empty.value.status == 400
    with pytest.raises(InvalidRequest):
        idem.mark_unknown(held.reservation_id, "x" * 1001)
    assert idem.get(held.reservation_id).state == "in_flight"  # a refused mark marks nothing
    with pytest.raises(NotFound) as missing:
        idem.mark_unknown(uuid.uuid4(), "the provider timed out")
    assert missing.value.status == 404
    idem.release(held.reservation_id)
    with pytest.raises(LeaseLost) as dead:  # released: the key is new again, nothing to mark
        idem.mark_unknown(held.reservation_id, "the provider timed out")
    assert dead.value.status == 409


def test_a_key_under_takeover_is_taken_over_not_unknown(idem):
    key = fresh_key()
    idem.reserve(key, request=CHARGE, lease_seconds=1, on_lease_expiry="takeover")
    time.sleep(1.5)
    taken = idem.reserve(key, request=CHARGE)
    assert isinstance(taken, Reserved) and taken.attempt == 2


def test_tenants_do_not_share_keys(server, idem):
    key = fresh_key()
    idem.reserve(key, request=CHARGE)
    with Client(server.base_url, token=OTHER_TOKEN) as globex:
        assert isinstance(globex.reserve(key, request=CHARGE), Reserved)


def test_a_wrong_token_is_unauthorized(server):
    with Client(server.base_url, token="not-a-token") as stranger:
        with pytest.raises(Unauthorized) as refused:
            stranger.reserve(fresh_key(), request=CHARGE)
    assert refused.value.status == 401


def test_the_async_client(server):
    async def flow() -> None:
        async with AsyncClient(server.base_url, token=TOKEN) as idem:
            key = fresh_key()
            held = await idem.reserve(key, request=CHARGE)
            assert isinstance(held, Reserved)
            await idem.commit(held.reservation_id, status=201, body="async")
            replay = await idem.reserve(key, request=CHARGE)
            assert isinstance(replay, Completed) and replay.response.text() == "async"
            with pytest.raises(KeyReused):
                await idem.reserve(key, request={**CHARGE, "body": {"amount": 1}})

            unknown = fresh_key()
            await idem.reserve(unknown, request=CHARGE, lease_seconds=1, on_lease_expiry="hold")
            await asyncio.sleep(1.5)
            with pytest.raises(OutcomeUnknown) as refused:
                await idem.reserve(unknown, request=CHARGE)
            assert refused.value.retry_after is None

            marked = fresh_key()
            held = await idem.reserve(marked, request=CHARGE)
            assert isinstance(held, Reserved)
            record = await idem.mark_unknown(held.reservation_id, "the provider timed out")
            assert record.state == "unknown"
            assert record.marked_unknown is not None and record.marked_unknown.reason == "the provider timed out"
            with pytest.raises(OutcomeUnknown):
                await idem.reserve(marked, request=CHARGE)
            with pytest.raises(InvalidRequest):
                await idem.mark_unknown(held.reservation_id, "")
            with pytest.raises(NotFound):
                await idem.mark_unknown(uuid.uuid4(), "the provider timed out")

    asyncio.run(flow())


def test_a_label_is_kept_beside_the_key_and_never_fingerprinted(server, idem):
    """SPEC §5: the reserve's label is shown to an operator beside the key
    (GET /v1/admin/keys/{tenant}/{key_hash}); another label on the same
    request is the same request (a replay, never key-reused)."""
    from conftest import admin_view

    key = fresh_key()
    first = idem.reserve(key, request=CHARGE, label="orders.charge order-1042")
    assert isinstance(first, Reserved)
    assert admin_view(server.base_url, key).get("label") == "orders.charge order-1042"
    idem.commit(first.reservation_id, status=201, body=json.dumps({"charge": "ch_1"}))
    again = idem.reserve(key, request=CHARGE, label="another label")
    assert isinstance(again, Completed) and again.replayed
    assert admin_view(server.base_url, key).get("label") == "orders.charge order-1042"
    # The guard passes it through; without one, none is sent.
    guarded = fresh_key()
    assert Guard(idem).run(guarded, lambda holding: {"ok": True}, request=CHARGE, label="a job") == {"ok": True}
    assert admin_view(server.base_url, guarded).get("label") == "a job"
    plain = fresh_key()
    Guard(idem).run(plain, lambda holding: 1, request=CHARGE)
    assert admin_view(server.base_url, plain).get("label") is None
