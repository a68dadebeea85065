"""`idemgate proxy --protocol mcp` (SPEC §12) in front of an unmodified MCP
server made with the official Python SDK (server.py), driven by the official
Python client, in both of the server's answer forms (event stream and JSON).
The server logs every execution of a tool; each test counts them.

    IDEMGATE_BIN=target/debug/idemgate python -m pytest tests/mcp
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

HERE = Path(__file__).resolve().parent
BIN = os.environ.get("IDEMGATE_BIN", str(HERE.parents[1] / "target" / "debug" / "idemgate"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(url: str, what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start at {url}")


@dataclass
class Rig:
    """The MCP server, and idemgate proxy in front of it."""

    tmp: Path
    json_response: bool
    server: subprocess.Popen[bytes] | None = None
    proxy: subprocess.Popen[bytes] | None = None
    server_port: int = 0
    url: str = ""
    admin: str = ""

    @property
    def log(self) -> Path:
        return self.tmp / "executions.jsonl"

    def start_server(self) -> None:
        if not self.server_port:
            self.server_port = free_port()
        args = [sys.executable, str(HERE / "server.py"), str(self.server_port)]
        if self.json_response:
            args.append("--json-response")
        self.server = subprocess.Popen(
            args,
            env={**os.environ, "CHARGES_LOG": str(self.log)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(f"http://127.0.0.1:{self.server_port}/", "the MCP server")

    def start_proxy(self, *flags: str) -> None:
        port, admin = free_port(), free_port()
        self.proxy = subprocess.Popen(
            [
                BIN, "proxy", "--protocol", "mcp",
                "--upstream", f"http://127.0.0.1:{self.server_port}",
                "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
                "--database-url", f"sqlite://{self.tmp / 'keys.db'}",
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / "proxy.log", "ab"),
        )
        wait_for(f"http://127.0.0.1:{admin}/healthz", "idemgate proxy")
        self.url = f"http://127.0.0.1:{port}/mcp"
        self.admin = f"http://127.0.0.1:{admin}"

    def executions(self, tool: str | None = None) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = [json.loads(line) for line in self.log.read_text().splitlines() if line]
        return [e for e in lines if tool is None or e["tool"] == tool]

    def stop(self) -> None:
        for proc in (self.proxy, self.server):
            if proc and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()


@pytest.fixture(params=["event-stream", "json"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    rig = Rig(tmp_path, json_response=request.param == "json")
    rig.start_server()
    rig.start_proxy()
    try:
        yield rig
    finally:
        rig.stop()


@asynccontextmanager
async def session(url: str) -> AsyncIterator[ClientSession]:
    async with streamable_http_client(url) as (read, write, *_):
        async with ClientSession(read, write) as s:
            await s.initialize()
            yield s


def key() -> str:
    return f"step-{uuid.uuid4()}"


def problem_type(result: Any) -> str:
    """The problem's name of a refusal: from its _meta, which it always has,
    after checking its structuredContent says the same where there is one."""
    assert result.is_error, result
    problem = result.meta["dev.idemgate/problem"]
    if result.structured_content is not None:
        assert result.structured_content == problem
    return str(problem["type"]).rsplit("/", 1)[-1]


def test_tools_list_offers_the_key_to_write_tools_only(rig: Rig) -> None:
    async def go() -> dict[str, Any]:
        async with session(rig.url) as s:
            return {t.name: t.input_schema for t in (await s.list_tools()).tools}

    schemas = asyncio.run(go())
    assert "idempotency_key" in schemas["charge"]["properties"]
    assert "idempotency_key" not in schemas["charge"].get("required", [])
    assert "idempotency_key" in schemas["slow_charge"]["properties"]
    assert "idempotency_key" not in schemas["balance"]["properties"]


def test_a_repeated_call_runs_once_and_each_gets_the_result(rig: Rig) -> None:
    k = key()

    async def go() -> list[Any]:
        async with session(rig.url) as s:
            await s.list_tools()
            args = {"customer": "c1", "amount": 500, "idempotency_key": k}
            return [await s.call_tool("charge", args) for _ in range(3)]

    results = asyncio.run(go())
    assert [r.is_error for r in results] == [False, False, False]
    charges = {r.structured_content["charge"] for r in results}
    assert len(charges) == 1
    executed = rig.executions("charge")
    assert len(executed) == 1
    assert executed[0]["charge"] in charges
    # The server never sees the key: it is not one of its arguments.
    assert "idempotency_key" not in executed[0]


def test_the_key_in_meta_works_too_and_without_a_key_nothing_is_guarded(rig: Rig) -> None:
    k = key()

    async def go() -> list[Any]:
        async with session(rig.url) as s:
            meta = {"dev.idemgate/idempotency-key": k}
            guarded = [await s.call_tool("charge", {"customer": "c2", "amount": 1}, meta=meta) for _ in range(2)]
            unguarded = [await s.call_tool("charge", {"customer": "c3", "amount": 1}) for _ in range(2)]
            return guarded + unguarded

    results = asyncio.run(go())
    assert not any(r.is_error for r in results)
    assert results[0].structured_content == results[1].structured_content
    assert len(rig.executions("charge")) == 3


def test_another_amount_under_the_same_key_is_an_error_result(rig: Rig) -> None:
    k = key()

    async def go() -> tuple[Any, Any]:
        async with session(rig.url) as s:
            first = await s.call_tool("charge", {"customer": "c1", "amount": 500, "idempotency_key": k})
            other = await s.call_tool("charge", {"customer": "c1", "amount": 900, "idempotency_key": k})
            return first, other

    first, other = asyncio.run(go())
    assert not first.is_error
    assert problem_type(other) == "key-reused"
    assert "key-reused" in other.content[0].text
    assert len(rig.executions("charge")) == 1


def test_a_typed_tools_refusal_leaves_its_structured_content_alone(rig: Rig) -> None:
    """A tool with an outputSchema: clients check structuredContent against
    it (the TypeScript SDK even for error results), so a refusal carries its
    problem in _meta and text only."""
    k = key()

    async def go() -> tuple[Any, Any]:
        async with session(rig.url) as s:
            await s.list_tools()
            first = await s.call_tool("typed_charge", {"customer": "c8", "amount": 5, "idempotency_key": k})
            other = await s.call_tool("typed_charge", {"customer": "c8", "amount": 6, "idempotency_key": k})
            return first, other

    first, other = asyncio.run(go())
    assert not first.is_error and first.structured_content["amount"] == 5
    assert problem_type(other) == "key-reused"
    assert other.structured_content is None
    assert len(rig.executions("typed_charge")) == 1


def test_a_key_that_is_not_a_string_is_an_error_result(rig: Rig) -> None:
    async def go() -> Any:
        async with session(rig.url) as s:
            return await s.call_tool("charge", {"customer": "c1", "amount": 5, "idempotency_key": 42})

    assert problem_type(asyncio.run(go())) == "key-invalid"
    assert rig.executions("charge") == []


def test_a_repeat_during_a_slow_call_waits_and_gets_the_result(rig: Rig) -> None:
    k = key()
    args = {"customer": "c4", "amount": 300, "seconds": 2.0, "idempotency_key": k}

    async def go() -> list[Any]:
        async with session(rig.url) as first, session(rig.url) as second:
            one = asyncio.create_task(first.call_tool("slow_charge", args))
            await asyncio.sleep(0.5)
            two = asyncio.create_task(second.call_tool("slow_charge", args))
            return list(await asyncio.gather(one, two))

    results = asyncio.run(go())
    assert [r.is_error for r in results] == [False, False]
    assert results[0].structured_content == results[1].structured_content
    assert len(rig.executions("slow_charge")) == 1


def test_a_retry_on_a_new_session_is_the_same_caller(rig: Rig) -> None:
    k = key()
    args = {"customer": "c5", "amount": 700, "idempotency_key": k}

    async def call() -> Any:
        async with session(rig.url) as s:
            return await s.call_tool("charge", args)

    first, retry = asyncio.run(call()), asyncio.run(call())
    assert not first.is_error and not retry.is_error
    assert first.structured_content == retry.structured_content
    assert len(rig.executions("charge")) == 1


def test_read_only_tools_pass_through(rig: Rig) -> None:
    async def go() -> list[Any]:
        async with session(rig.url) as s:
            await s.list_tools()
            args = {"customer": "c6"}
            return [await s.call_tool("balance", args) for _ in range(2)]

    assert not any(r.is_error for r in asyncio.run(go()))
    assert len(rig.executions("balance")) == 2


def test_a_server_killed_during_a_call_leaves_the_key_unknown(rig: Rig) -> None:
    k = key()
    args = {"customer": "c7", "amount": 100, "seconds": 3.0, "idempotency_key": k}

    async def doomed() -> None:
        async with session(rig.url) as s:
            call = asyncio.create_task(s.call_tool("slow_charge", args, read_timeout_seconds=10))
            await asyncio.sleep(1.0)
            assert rig.server is not None
            rig.server.send_signal(signal.SIGKILL)
            rig.server.wait()
            try:
                await call
            except Exception:  # noqa: BLE001 - the call is cut off, however the client says so
                pass

    try:
        asyncio.run(doomed())
    except BaseException:  # noqa: BLE001 - the session's teardown against a dead server
        pass
    rig.start_server()

    async def again() -> Any:
        async with session(rig.url) as s:
            return await s.call_tool("slow_charge", args)

    result = asyncio.run(again())
    # Whether the charge was made is unknown: never run again by itself (§2).
    assert problem_type(result) == "outcome-unknown"
    assert rig.executions("slow_charge") == []

    # An operator looks (the server's own records) and settles the key with
    # what happened, the tool's result alone; every repeat then gets it.
    stuck = httpx.get(f"{rig.admin}/v1/admin/keys", params={"state": "unknown"}, timeout=10).json()["keys"]
    assert len(stuck) == 1, stuck
    settled = {"content": [{"type": "text", "text": "ch_ops"}],
               "structuredContent": {"charge": "ch_ops", "amount": 100}, "isError": False}
    answer = httpx.post(
        f"{rig.admin}/v1/admin/keys/{stuck[0]['tenant']}/{stuck[0]['key_hash']}/resolve",
        json={"action": "complete", "reason": "the ledger shows ch_ops",
              "response": {"status": 200, "headers": [["content-type", "application/json"]],
                           "body": json.dumps(settled)}},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    replayed = asyncio.run(again())
    assert not replayed.is_error, replayed
    assert replayed.structured_content == {"charge": "ch_ops", "amount": 100}
    assert rig.executions("slow_charge") == []
