"""A storm through `idemgate proxy --protocol mcp` on PostgreSQL: many
official-client sessions calling the same keys at once, in both answer forms
of the server, then a `kill -9` of the proxy in the middle of slow calls and
the retries on a new proxy. Every answer must be one the client reads — a
tool result, or a JSON-RPC error with idemgate's problem in it — never the
SDK's stand-in for an HTTP error status (-32603 "Server returned an error
response"), and no key may run twice.

    IDEMGATE_BIN=target/debug/idemgate python -m pytest tests/mcp/test_burst.py
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp.shared.exceptions import MCPError

from test_door import BIN, Rig, free_port, session, wait_for

ADMIN_URL = os.environ.get("IDEMGATE_MCP_TEST_PG", "postgres://postgres@127.0.0.1:5432/postgres")
# HOST:PORT of a pooler in transaction mode in front of that PostgreSQL
# (.ci/pgbouncer): the proxy then goes through it with --pg-pooler
# transaction, its database migrated directly first.
POOLER = os.environ.get("IDEMGATE_MCP_TEST_PG_POOLER", "")
SESSIONS = 10
KEYS = 6


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
    """The rig of test_door.py, its proxy on PostgreSQL and restartable."""

    database_url: str = ""

    def start_proxy(self, *flags: str) -> None:
        port, admin = free_port(), free_port()
        assert BIN
        self.proxy = subprocess.Popen(
            [
                BIN, "proxy", "--protocol", "mcp",
                "--upstream", f"http://127.0.0.1:{self.server_port}",
                "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
                "--database-url", self.database_url,
                "--default-lease", "3", "--default-wait", "6", "--prune-interval", "0",
                *(["--pg-pooler", "transaction"] if POOLER else []),
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / "proxy.log", "ab"),
        )
        wait_for(f"http://127.0.0.1:{admin}/healthz", "idemgate proxy")
        self.url = f"http://127.0.0.1:{port}/mcp"
        self.admin = f"http://127.0.0.1:{admin}"


@pytest.fixture(params=["event-stream", "json"])
def rig(request: pytest.FixtureRequest, tmp_path: Path, database: str) -> Iterator[PgRig]:
    rig = PgRig(tmp_path, json_response=request.param == "json")
    rig.database_url = database
    if POOLER:
        assert BIN
        subprocess.run([BIN, "migrate", "--database-url", database], check=True, capture_output=True, timeout=60)
        rig.database_url = database.replace(database.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1], POOLER, 1)
    rig.start_server()
    rig.start_proxy()
    try:
        yield rig
    finally:
        rig.stop()


def problem_of(result: Any) -> str | None:
    if not result.is_error:
        return None
    return str(result.meta["dev.idemgate/problem"]["type"]).rsplit("/", 1)[-1]


async def one_session(url: str, tool: str, calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Every call of `calls` on one session, all at once: what each got, as
    ("result", CallToolResult) or ("error", MCPError) or ("cut", exception)."""
    out: list[tuple[str, Any]] = []
    try:
        async with session(url) as s:
            async def one(args: dict[str, Any]) -> tuple[str, Any]:
                try:
                    return ("result", await s.call_tool(tool, args, read_timeout_seconds=30))
                except MCPError as e:
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
    stand-in for an HTTP error status."""
    if kind == "error":
        error = answer.error
        assert error.message != "Server returned an error response", error
        assert error.code != -32603, error


def test_many_sessions_on_shared_keys_each_run_once(rig: PgRig) -> None:
    keys = [f"burst-{uuid.uuid4()}" for _ in range(KEYS)]

    async def go() -> list[list[tuple[str, Any]]]:
        plans = []
        for n in range(SESSIONS):
            order = keys[n % KEYS:] + keys[: n % KEYS]
            plans.append([{"customer": "storm", "amount": keys.index(k) + 1, "idempotency_key": k} for k in order])
        return list(await asyncio.gather(*(one_session(rig.url, "charge", p) for p in plans)))

    answers = [a for s in asyncio.run(go()) for a in s]
    assert len(answers) == SESSIONS * KEYS
    charges: dict[int, set[str]] = {}
    for kind, answer in answers:
        readable(kind, answer)
        assert kind == "result", answer
        assert not answer.is_error, answer
        content = answer.structured_content
        charges.setdefault(content["amount"], set()).add(content["charge"])
    # Every session got the one charge of each key.
    assert all(len(c) == 1 for c in charges.values()), charges
    ran = Counter(e["amount"] for e in rig.executions("charge"))
    assert ran == Counter({i + 1: 1 for i in range(KEYS)}), ran


def test_a_proxy_killed_in_a_storm_runs_nothing_twice(rig: PgRig) -> None:
    keys = [f"kill-{uuid.uuid4()}" for _ in range(KEYS)]

    def plan(n: int) -> list[dict[str, Any]]:
        order = keys[n % KEYS:] + keys[: n % KEYS]
        return [{"customer": "killed", "amount": keys.index(k) + 1, "seconds": 1.5, "idempotency_key": k}
                for k in order]

    async def storm() -> list[tuple[str, Any]]:
        sessions = [asyncio.create_task(one_session(rig.url, "slow_charge", plan(n))) for n in range(4)]
        await asyncio.sleep(0.7)
        assert rig.proxy is not None
        rig.proxy.send_signal(signal.SIGKILL)
        rig.proxy.wait()
        return [a for s in await asyncio.gather(*sessions) for a in s]

    first = asyncio.run(storm())
    for kind, answer in first:
        readable(kind, answer)
    rig.start_proxy()

    async def retries() -> list[tuple[str, Any]]:
        got = await asyncio.gather(*(one_session(rig.url, "slow_charge", plan(n)) for n in range(4)))
        return [a for s in got for a in s]

    again = asyncio.run(retries())
    for kind, answer in again:
        readable(kind, answer)
        assert kind == "result", answer
        # The keys whose calls the kill cut off: held (in flight under the
        # lease, then unknown) — never sent again by themselves.
        assert problem_of(answer) in (None, "request-in-flight", "outcome-unknown"), answer
    held = [a for _, a in again if problem_of(a) is not None]
    assert held, "the kill cut no call off: the storm tested nothing"
    ran = Counter(e["amount"] for e in rig.executions("slow_charge"))
    assert all(n == 1 for n in ran.values()), ran
