"""A storm through `idemgate proxy --protocol mcp` on PostgreSQL: twenty
official-client sessions calling the same thirty keys at once, in both answer
forms of the server; then a `kill -9` of the proxy in the middle of slow calls
and the retries on a new proxy. The JSON form is driven by the client's
default (mcp 2.x's `Client`: 2026-07-28), the event-stream form by its legacy
`ClientSession` (2025-11-25): at 2026-07-28 the mcp 2.x server answers JSON
whatever its form, so that pairing storms both of the door's replay forms and
both protocols in the time of two. Every answer must be one the client reads — a
tool result, or a JSON-RPC error with idemgate's problem in it — never the
SDK's stand-in for an HTTP error status (-32603 "Server returned an error
response") nor a result it refuses as invalid, and no key may run twice.

    IDEMGATE_BIN=target/debug/idemgate python -m pytest tests/mcp/test_burst.py
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from door_rig import BIN, Door, Rig, SharedServer
from official import MODES, RpcError, session

ADMIN_URL = os.environ.get("IDEMGATE_MCP_TEST_PG", "postgres://postgres@127.0.0.1:5432/postgres")
# HOST:PORT of a pooler in transaction mode in front of that PostgreSQL
# (.ci/pgbouncer): the proxies then go through it with --pg-pooler
# transaction, their database migrated directly first.
POOLER = os.environ.get("IDEMGATE_MCP_TEST_PG_POOLER", "")
SESSIONS = 20
KEYS = 30
# The answer form of the server, and how the client connects in it.
MODE = {"json": MODES[0], "event-stream": MODES[-1]}


def _psql(sql: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["psql", ADMIN_URL, "-q", "-c", sql], capture_output=True, timeout=30)


@pytest.fixture
def database() -> Iterator[str]:
    """A PostgreSQL database of its own; in CI a missing PostgreSQL fails."""
    name = f"idemgate_mcp_{uuid.uuid4().hex[:12]}"
    if shutil.which("psql") is None or _psql(f'CREATE DATABASE "{name}"').returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"no PostgreSQL to run the storm on ({ADMIN_URL})")
        pytest.skip(f"no PostgreSQL at {ADMIN_URL}")
    try:
        yield ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        _psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class PgRig(Rig):
    """The rig of test_door.py, its proxies on one PostgreSQL database."""

    pg_url: str = ""
    mode: str = ""

    def database_url(self) -> str:
        return self.pg_url

    def start_proxy(self, *flags: str, env: dict[str, str] | None = None, upstream: str | None = None) -> Door:
        return super().start_proxy(
            "--default-lease", "3", "--default-wait", "6", "--prune-interval", "0",
            *(["--pg-pooler", "transaction"] if POOLER else []),
            *flags,
            env=env, upstream=upstream,
        )


@pytest.fixture(params=["event-stream", "json"], ids=lambda form: f"{form}-{MODE[form]}")
def rig(request: pytest.FixtureRequest, tmp_path: Path, database: str,
        servers: dict[str, SharedServer]) -> Iterator[PgRig]:
    shared = servers[request.param]
    rig = PgRig(tmp_path, json_response=request.param == "json", server_port=shared.port,
                shared_log=shared.log, who=f"storm-{uuid.uuid4().hex[:10]}")
    rig.pg_url = database
    if POOLER:
        subprocess.run([BIN, "migrate", "--database-url", database], check=True, capture_output=True, timeout=60)
        rig.pg_url = database.replace(database.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1], POOLER, 1)
    rig.mode = MODE[request.param]
    try:
        rig.start_proxy()
        yield rig
    finally:
        rig.stop()


def problem_of(result: dict[str, Any]) -> str | None:
    if not result.get("isError"):
        return None
    return str(result["_meta"]["dev.idemgate/problem"]["type"]).rsplit("/", 1)[-1]


async def one_session(url: str, mode: str, tool: str, calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Every call of `calls` on one session, all at once: what each got, as
    ("result", the tool result) or ("error", RpcError) or ("cut", exception)."""
    out: list[tuple[str, Any]] = []
    try:
        async with session(url, mode) as s:
            async def one(args: dict[str, Any]) -> tuple[str, Any]:
                try:
                    return ("result", await s.call(tool, args, timeout=30))
                except RpcError as e:
                    return ("error", e)
                except Exception as e:  # noqa: BLE001 - a connection cut by a kill
                    return ("cut", e)

            out = list(await asyncio.gather(*(one(a) for a in calls)))
    except BaseException as e:  # noqa: BLE001 - the session's teardown against a killed proxy
        out = out or [("cut", e) for _ in calls]
    return out


def readable(kind: str, answer: Any) -> None:
    """An answer the client read: a tool result, or a JSON-RPC error that
    carries idemgate's problem or the server's own status — never the SDK's
    stand-in for an HTTP error status, nor a result the client refused."""
    if kind == "error":
        error = answer.error
        assert error.message != "Server returned an error response", error
        assert error.code != -32603, error
    if kind == "cut":
        assert "validation error" not in str(answer).lower(), answer


def plan(keys: list[str], n: int, who: str, **extra: Any) -> list[dict[str, Any]]:
    """Session n's calls: every key, starting at its own place in the list."""
    order = keys[n % len(keys):] + keys[: n % len(keys)]
    return [{"customer": who, "amount": keys.index(k) + 1, **extra, "idempotency_key": k} for k in order]


def test_many_sessions_on_shared_keys_each_run_once(rig: PgRig) -> None:
    keys = [f"burst-{uuid.uuid4()}" for _ in range(KEYS)]

    async def go() -> list[list[tuple[str, Any]]]:
        return list(await asyncio.gather(
            *(one_session(rig.url, rig.mode, "charge", plan(keys, n, str(rig.who))) for n in range(SESSIONS))))

    answers = [a for s in asyncio.run(go()) for a in s]
    assert len(answers) == SESSIONS * KEYS
    charges: dict[int, set[str]] = {}
    for kind, answer in answers:
        readable(kind, answer)
        assert kind == "result", answer
        assert not answer.get("isError"), answer
        content = answer["structuredContent"]
        charges.setdefault(content["amount"], set()).add(content["charge"])
    # Every session got the one charge of each key.
    assert all(len(c) == 1 for c in charges.values()), charges
    ran = Counter(e["amount"] for e in rig.executions("charge"))
    assert ran == Counter({i + 1: 1 for i in range(KEYS)}), ran


def test_a_proxy_killed_in_a_storm_runs_nothing_twice(rig: PgRig) -> None:
    keys = [f"kill-{uuid.uuid4()}" for _ in range(KEYS)]

    def calls(n: int) -> list[dict[str, Any]]:
        return plan(keys, n, str(rig.who), seconds=2.0)

    def kill_once_running() -> None:
        # The kill comes once the server runs calls (it logs their starts),
        # however long the sessions took to connect; from a thread of its
        # own, for the storm's event loop may be too busy to come back soon.
        deadline = time.monotonic() + 60
        while len(rig.executions("slow_charge.started")) < KEYS // 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rig.proxy is not None
        rig.proxy.send_signal(signal.SIGKILL)
        rig.proxy.wait()

    async def storm() -> list[tuple[str, Any]]:
        killer = threading.Thread(target=kill_once_running)
        killer.start()
        got = await asyncio.gather(*(one_session(rig.url, rig.mode, "slow_charge", calls(n)) for n in range(SESSIONS)))
        killer.join()
        return [a for s in got for a in s]

    first = asyncio.run(storm())
    for kind, answer in first:
        readable(kind, answer)
    rig.start_proxy()

    async def retries() -> list[tuple[str, Any]]:
        got = await asyncio.gather(*(one_session(rig.url, rig.mode, "slow_charge", calls(n)) for n in range(SESSIONS)))
        return [a for s in got for a in s]

    again = asyncio.run(retries())
    for kind, answer in again:
        readable(kind, answer)
        assert kind == "result", answer
        # The keys whose calls the kill cut off: held (in flight under the
        # lease, then unknown) — never sent again by themselves.
        assert problem_of(answer) in (None, "request-in-flight", "outcome-unknown"), answer
    held = [a for _, a in again if problem_of(a) is not None]
    assert held, (f"the kill cut no call off: the storm tested nothing (first storm: "
                  f"{Counter(kind for kind, _ in first)}, {len(rig.executions('slow_charge.started'))} calls "
                  f"started, {len(rig.executions('slow_charge'))} ended)")
    ran = Counter(e["amount"] for e in rig.executions("slow_charge"))
    assert all(n == 1 for n in ran.values()), ran
