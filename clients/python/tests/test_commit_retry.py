"""The guard's commit outlives a server that goes away right after the
effect acted: a real `idemgate serve`, killed (SIGKILL) inside the effect and
started again on the same store and port 3 s later. The guard returns the
effect's result, the key is completed (nothing left in flight or unknown),
and the next run replays without running the effect. A server that never
comes back within the guard's commit budget yields ``ResultNotCommitted``
(a ``StoreUnavailable``) with the result, never a raw httpx exception."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import httpx
import pytest

from idemgate_client import (
    AsyncClient,
    AsyncGuard,
    Client,
    Guard,
    ResultNotCommitted,
    StoreUnavailable,
    derive_key,
)
from conftest import ADMIN_TOKEN, TOKEN, Server, _drop, _postgres_url, admin_view, closed_port, start_server

CHARGE = {"method": "POST", "path": "/charges", "body": {"amount": 500}}
RESULT = {"charge": "ch_1", "amount": 500}


def fresh_key() -> str:
    return derive_key(tenant="acme", run=f"run-{uuid.uuid4()}", step=1, tool="charge")


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store of the test's own, which its servers come and go on."""
    if request.param == "sqlite":
        yield f"sqlite://{tmp_path / 'keys.db'}"
        return
    made = _postgres_url()
    if made is None:
        if os.environ.get("IDEMGATE_CLIENT_TEST_REQUIRE_PG"):
            raise RuntimeError("no PostgreSQL to test on (psql on IDEMGATE_CLIENT_TEST_PG)")
        pytest.skip("no PostgreSQL (psql on IDEMGATE_CLIENT_TEST_PG); CI requires it")
    yield made
    _drop(made)


class Outage:
    """A server of the test's own that the effect kills (SIGKILL) right after
    it acted; ``back_after`` seconds later (None: never) a thread starts
    another on the same store and port."""

    def __init__(self, store: str, work: Path, back_after: float | None) -> None:
        self.store, self.work, self.back_after = store, work, back_after
        self.server: Server = start_server(store, work / "first")
        self.port = int(urlparse(self.server.base_url).port or 0)
        self.back = threading.Event()
        self.killed_at = 0.0
        self.effects = 0
        self._restart: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def kill(self) -> None:
        self.effects += 1
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait()
        self.killed_at = time.monotonic()
        if self.back_after is not None:
            self._restart = threading.Thread(target=self._start_again, daemon=True)
            self._restart.start()

    def _start_again(self) -> None:
        time.sleep(self.back_after or 0)
        self.server = start_server(self.store, self.work / "second", port=self.port)
        self.back.set()

    def start_again_now(self) -> None:
        self.server = start_server(self.store, self.work / "second", port=self.port)

    def stop(self) -> None:
        if self._restart is not None:
            self._restart.join(timeout=60)
        if self.server.process.poll() is None:
            self.server.process.terminate()
            self.server.process.wait(timeout=20)


@pytest.fixture
def outage_factory(store: str, tmp_path: Path) -> Iterator[Any]:
    made: list[Outage] = []

    def make(back_after: float | None) -> Outage:
        outage = Outage(store, tmp_path, back_after)
        made.append(outage)
        return outage

    yield make
    for outage in made:
        outage.stop()


def stuck_keys(base_url: str) -> list[dict[str, Any]]:
    """The keys the operators' list shows in flight or unknown."""
    found: list[dict[str, Any]] = []
    for state in ("in_flight", "unknown"):
        answer = httpx.get(f"{base_url}/v1/admin/keys", params={"state": state},
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
        assert answer.status_code == 200, answer.text
        found.extend(answer.json()["keys"])
    return found


def assert_completed_and_replayed(outage: Outage, key: str) -> None:
    view = admin_view(outage.base_url, key)
    assert view["state"] == "completed", view
    assert stuck_keys(outage.base_url) == []
    before = outage.effects
    with Client(outage.base_url, token=TOKEN) as c:
        assert Guard(c).run(key, lambda _: outage.kill(), request=CHARGE) == RESULT
    assert outage.effects == before  # replayed: the effect did not run


def test_the_commit_waits_for_a_server_killed_right_after_the_effect(outage_factory):
    outage, key = outage_factory(3.0), fresh_key()

    def charge(_: object) -> dict[str, Any]:
        outage.kill()  # the charge went out; the store's server dies before the commit
        return RESULT

    with Client(outage.base_url, token=TOKEN, timeout=5) as c:
        assert Guard(c, lease_seconds=30).run(key, charge, request=CHARGE) == RESULT
    # The commit landed on the server started 3 s after the kill (whose
    # thread may not have returned yet: the server answers before it does).
    assert time.monotonic() - outage.killed_at >= 3 and outage.back.wait(timeout=60)
    assert outage.effects == 1
    assert_completed_and_replayed(outage, key)


def test_the_async_commit_waits_for_a_server_killed_right_after_the_effect(outage_factory):
    outage, key = outage_factory(3.0), fresh_key()

    async def charge(_: object) -> dict[str, Any]:
        outage.kill()
        return RESULT

    async def flow() -> Any:
        async with AsyncClient(outage.base_url, token=TOKEN, timeout=5) as a:
            return await AsyncGuard(a, lease_seconds=30).run(key, charge, request=CHARGE)

    assert asyncio.run(flow()) == RESULT
    # The commit landed on the server started 3 s after the kill (whose
    # thread may not have returned yet: the server answers before it does).
    assert time.monotonic() - outage.killed_at >= 3 and outage.back.wait(timeout=60)
    assert outage.effects == 1
    assert_completed_and_replayed(outage, key)


def _assert_not_committed(error: ResultNotCommitted, budget: float) -> None:
    assert isinstance(error, StoreUnavailable) and not error.answered
    assert error.result == RESULT and error.waited >= budget
    assert error.dead_letter_reason == "result_not_committed"
    # idemgate's error for the last try, and httpx's under it: never raised raw.
    assert isinstance(error.__cause__, StoreUnavailable)
    assert isinstance(error.__cause__.__cause__, httpx.TransportError)


def test_a_server_that_never_comes_back_yields_the_result_in_store_unavailable(outage_factory):
    outage, key = outage_factory(None), fresh_key()

    def charge(_: object) -> dict[str, Any]:
        outage.kill()
        return RESULT

    with Client(outage.base_url, token=TOKEN, timeout=5) as c:
        started = time.monotonic()
        with pytest.raises(ResultNotCommitted) as raised:
            Guard(c, lease_seconds=30, commit_budget=2.0).run(key, charge, request=CHARGE)
        assert 2.0 <= time.monotonic() - started < 10
        _assert_not_committed(raised.value, 2.0)
        # The server back (after the budget, within the lease): the holder's late
        # commit of the result it kept completes the key.
        outage.start_again_now()
        assert stuck_keys(outage.base_url) != []
        c.commit(raised.value.reservation_id, status=200, body=raised.value.encoded_result)
    assert_completed_and_replayed(outage, key)


def test_the_async_guard_too_yields_the_result_when_the_server_stays_away(outage_factory):
    outage, key = outage_factory(None), fresh_key()

    async def charge(_: object) -> dict[str, Any]:
        outage.kill()
        return RESULT

    async def flow() -> ResultNotCommitted:
        async with AsyncClient(outage.base_url, token=TOKEN, timeout=5) as a:
            with pytest.raises(ResultNotCommitted) as raised:
                await AsyncGuard(a, lease_seconds=30, commit_budget=1.5).run(key, charge, request=CHARGE)
            return raised.value

    _assert_not_committed(asyncio.run(flow()), 1.5)


def test_every_call_that_gets_no_answer_raises_store_unavailable():
    nobody = f"http://127.0.0.1:{closed_port()}"
    rid = uuid.uuid4()
    with Client(nobody, token=TOKEN, timeout=2) as c:
        calls = [
            lambda: c.reserve(fresh_key(), request=CHARGE),
            lambda: c.commit(rid, status=200, body="{}"),
            lambda: c.release(rid),
            lambda: c.extend(rid),
            lambda: c.mark_unknown(rid, "timed out"),
            lambda: c.checkpoint(rid, recovery_point="sent"),
            lambda: c.get(rid),
            lambda: Guard(c).run(fresh_key(), lambda _: RESULT, request=CHARGE),
        ]
        for call in calls:
            with pytest.raises(StoreUnavailable) as raised:
                call()
            assert not raised.value.answered
            assert isinstance(raised.value.__cause__, httpx.ConnectError)
            assert "ConnectError" in raised.value.detail

    async def flow() -> None:
        async with AsyncClient(nobody, token=TOKEN, timeout=2) as a:
            for call in (lambda: a.reserve(fresh_key()), lambda: a.commit(rid, status=200), lambda: a.release(rid),
                         lambda: a.extend(rid), lambda: a.mark_unknown(rid, "timed out"), lambda: a.get(rid)):
                with pytest.raises(StoreUnavailable) as raised:
                    await call()
                assert isinstance(raised.value.__cause__, httpx.ConnectError)

    asyncio.run(flow())
