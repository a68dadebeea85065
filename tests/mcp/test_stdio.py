"""The MCP stdio door (`idemgate proxy --protocol mcp --stdio -- COMMAND`,
docs/mcp.md "stdio servers"): idemgate started as an MCP host starts a local
server, by the official Python client's stdio transport (in each of its ways
to connect), with tests/mcp/server.py on the SDK's stdio server as the
command. A repeated call runs once and replays, a changed one is refused as a
tool result, a tool that asks before it acts completes once (mid-call under
2025-11-25, over two rounds under 2026-07-28), a server
killed mid-call leaves its key unknown and never runs it again; stdout carries
nothing but JSON-RPC; the keys land in the user's data directory by default.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, types
from mcp.client.stdio import StdioServerParameters, stdio_client

from door_rig import BIN, HERE, SERVER_PYTHON, door_env
from official import LEGACY, MAJOR, MODERN, MODES, problem_type

if MAJOR >= 2:
    from mcp import Client

SERVER = str(HERE / "server.py")
DOOR = ["proxy", "--protocol", "mcp", "--stdio", "--", SERVER_PYTHON, SERVER, "--stdio"]


def key() -> str:
    return f"k-{uuid.uuid4().hex}"


class Stdio:
    """One test's environment for the door: its charges log, its data
    directory (XDG_DATA_HOME), the server's pid file."""

    def __init__(self, tmp: Path, **settings: str) -> None:
        self.tmp = tmp
        self.log = tmp / "executions.jsonl"
        self.data = tmp / "data"
        self.pidfile = tmp / "server.pid"
        self.env = door_env(CHARGES_LOG=str(self.log), XDG_DATA_HOME=str(self.data),
                            MCP_SERVER_PIDFILE=str(self.pidfile), **settings)
        if "DATABASE_URL" not in settings:
            self.env.pop("DATABASE_URL", None)

    def params(self) -> StdioServerParameters:
        return StdioServerParameters(command=BIN, args=DOOR, env=self.env)

    def executions(self, tool: str) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        return [e for e in lines if e["tool"] == tool]

    def wait_for(self, tool: str, within: float = 20.0) -> None:
        deadline = time.monotonic() + within
        while not self.executions(tool):
            assert time.monotonic() < deadline, f"{tool} was never logged"
            time.sleep(0.05)

    def server_pid(self) -> int:
        return int(self.pidfile.read_text())

    def keys(self, database_url: str, state: str | None = None) -> list[dict[str, Any]]:
        """The keys of the store, as `idemgate keys list` reads them."""
        cmd = [BIN, "keys", "list", "--json", "--database-url", database_url]
        if state:
            cmd += ["--state", state]
        out = subprocess.run(cmd, env=door_env(), capture_output=True, timeout=30, check=True)
        return list(json.loads(out.stdout)["keys"])


def wire(result: Any) -> dict[str, Any]:
    return dict(result.model_dump(by_alias=True, mode="json", exclude_none=True))


async def accept(_context: Any, params: Any) -> types.ElicitResult:
    return types.ElicitResult(action="accept", content={"confirm": True})


@asynccontextmanager
async def connect(door: Stdio, mode: str, **callbacks: Any) -> AsyncIterator[Any]:
    """The official client on the stdio door, connected as `mode` says; a
    session whose `call` gives the result's wire form."""
    if mode == "default":
        async with Client(door.params(), **callbacks) as client:
            assert client.protocol_version == MODERN, client.protocol_version
            yield Calls(client)
        return
    async with stdio_client(door.params()) as (read, write):
        async with ClientSession(read, write, **callbacks) as s:
            init = await s.initialize()
            assert init.protocol_version == LEGACY, init.protocol_version
            yield Calls(s)


class Calls:
    def __init__(self, client: Any) -> None:
        self.client = client

    async def call(self, name: str, arguments: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        kwargs = {"read_timeout_seconds": timeout} if timeout is not None else {}
        return wire(await self.client.call_tool(name, arguments, **kwargs))


def store_files(door: Stdio) -> list[Path]:
    return sorted((door.data / "idemgate").glob("stdio-*.db"))


@pytest.mark.parametrize("mode", MODES)
def test_a_repeat_replays_and_a_changed_call_is_refused(tmp_path: Path, mode: str) -> None:
    door = Stdio(tmp_path)
    k = key()
    args = {"customer": "c-1", "amount": 700, "idempotency_key": k}

    async def go() -> tuple[dict[str, Any], ...]:
        async with connect(door, mode) as s:
            tools = await s.client.list_tools()
            schema = {t.name: wire(t)["inputSchema"] for t in tools.tools}
            assert "idempotency_key" in schema["charge"]["properties"]
            assert "idempotency_key" not in schema["balance"]["properties"]
            first = await s.call("charge", args)
            again = await s.call("charge", args)
            other = await s.call("charge", {**args, "amount": 701})
        # A new idemgate and a new server: the key is still known.
        async with connect(door, mode) as s:
            later = await s.call("charge", args)
        return first, again, other, later

    first, again, other, later = asyncio.run(go())
    assert not first.get("isError"), first
    assert again == first
    assert later == first
    assert len(door.executions("charge")) == 1
    assert other["isError"] is True
    assert problem_type(other) == "key-reused"
    # The keys are in the user's data directory, in a file of this command's.
    files = store_files(door)
    assert len(files) == 1, files
    assert files[0].name.startswith("stdio-python"), files[0].name


@pytest.mark.skipif(MAJOR < 2, reason="mcp 2.x's elicitation through Resolve")
@pytest.mark.parametrize("mode", MODES)
def test_a_tool_that_asks_before_it_acts_completes_once(tmp_path: Path, mode: str) -> None:
    """Under 2025-11-25 the server asks for a confirmation while the call
    runs: the question reaches the client, its answer the server. Under
    2026-07-28 the call's first round answers input_required, and the
    client's second round, with its answer, completes it."""
    door = Stdio(tmp_path)
    args = {"customer": "c-2", "amount": 7, "idempotency_key": key()}

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        async with connect(door, mode, elicitation_callback=accept) as s:
            first = await s.call("confirmed_charge", args, timeout=20)
            again = await s.call("confirmed_charge", args, timeout=20)
            return first, again

    first, again = asyncio.run(go())
    assert not first.get("isError"), first
    assert first["structuredContent"]["charge"], first
    assert again == first
    assert len(door.executions("confirmed_charge")) == 1
    # Asked once per round the server saw (2026-07-28: the question's
    # round, then the answer's), and never for the replay.
    assert len(door.executions("confirmed_charge.asked")) == (1 if mode == "legacy" else 2)


@pytest.mark.parametrize("mode", MODES)
def test_a_server_killed_mid_call_leaves_the_key_unknown(tmp_path: Path, mode: str) -> None:
    database = f"sqlite://{tmp_path / 'keys.db'}"
    door = Stdio(tmp_path, DATABASE_URL=database)
    args = {"customer": "c-3", "amount": 900, "seconds": 5.0, "idempotency_key": key()}

    async def doomed() -> None:
        async with connect(door, mode) as s:
            call = asyncio.create_task(s.call("slow_charge", args, timeout=20))
            await asyncio.to_thread(door.wait_for, "slow_charge.started")
            os.kill(door.server_pid(), signal.SIGKILL)
            with pytest.raises(Exception):  # noqa: B017 - however the client says the call broke off
                await call

    try:
        asyncio.run(doomed())
    except BaseException:  # noqa: BLE001 - the transport's teardown after its server died
        pass
    # idemgate stopped with its server; the store is free to read.
    deadline = time.monotonic() + 20
    while True:
        try:
            unknown = door.keys(database, "unknown")
            break
        except subprocess.CalledProcessError:
            assert time.monotonic() < deadline, "the store stayed held"
            time.sleep(0.2)
    assert len(unknown) == 1, unknown
    # The user's data directory is not used when DATABASE_URL is set.
    assert store_files(door) == []

    async def again() -> dict[str, Any]:
        async with connect(door, mode) as s:
            return await s.call("slow_charge", args, timeout=20)

    result = asyncio.run(again())
    assert problem_type(result) == "outcome-unknown", result
    assert door.executions("slow_charge") == []
    assert len(door.executions("slow_charge.started")) == 1


class Raw:
    """idemgate's stdio door driven line by line, every stdout line kept."""

    def __init__(self, door: Stdio) -> None:
        self.stderr = door.tmp / f"idemgate-{uuid.uuid4().hex[:6]}.log"
        self.proc = subprocess.Popen([BIN, *DOOR], env=door.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr.open("wb"))
        self.lines: list[str] = []
        self.unclaimed: dict[Any, dict[str, Any]] = {}

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"jsonrpc": "2.0", **message}) + "\n").encode())
        self.proc.stdin.flush()

    def response(self, id: int) -> dict[str, Any]:
        """The response to request `id`, whenever it came: responses come in
        the order the door has them (a held repeat may answer before the
        first), so one read past is kept for its own turn."""
        assert self.proc.stdout is not None
        if id in self.unclaimed:
            return self.unclaimed.pop(id)
        while True:
            line = self.proc.stdout.readline().decode()
            assert line, f"stdout ended before the response to {id}; stderr: {self.stderr.read_text()}"
            self.lines.append(line)
            message = json.loads(line)
            if "method" in message or "id" not in message:
                continue
            if message["id"] == id:
                return dict(message)
            self.unclaimed[message["id"]] = dict(message)

    def end(self, within: float = 30) -> int:
        """Closes idemgate's stdin; its exit status, the rest of stdout read."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        rest = self.proc.stdout.read().decode()
        self.lines += rest.splitlines(keepends=True)
        return self.proc.wait(timeout=within)

    def only_jsonrpc(self) -> None:
        for line in self.lines:
            assert line.endswith("\n")
            message = json.loads(line)
            assert message["jsonrpc"] == "2.0", line

    def initialize(self) -> None:
        self.send({"id": 0, "method": "initialize", "params": {
            "protocolVersion": LEGACY, "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}})
        assert self.response(0)["result"]["protocolVersion"] == LEGACY
        self.send({"method": "notifications/initialized"})


def call(id: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": id, "method": "tools/call", "params": {"name": name, "arguments": arguments}}


def test_stdout_is_only_jsonrpc_and_a_call_in_flight_at_the_end_of_stdin_is_kept(tmp_path: Path) -> None:
    door = Stdio(tmp_path)
    raw = Raw(door)
    raw.initialize()
    raw.send({"id": 1, "method": "tools/list"})
    assert raw.response(1)["result"]["tools"]
    charge = {"customer": "c-4", "amount": 5, "idempotency_key": key()}
    raw.send(call(2, "charge", charge))
    raw.send(call(3, "charge", charge))
    first, again = raw.response(2), raw.response(3)
    assert again["result"] == first["result"]
    # Anything else passes through.
    raw.send({"id": 4, "method": "ping"})
    assert raw.response(4)["result"] == {}
    # A slow call, and at once the end of stdin: it runs to its end, and
    # its result is kept for the retry.
    slow = {"customer": "c-4", "amount": 6, "seconds": 1.5, "idempotency_key": key()}
    raw.send(call(5, "slow_charge", slow))
    door.wait_for("slow_charge.started")
    assert raw.end() == 0, raw.stderr.read_text()
    raw.only_jsonrpc()
    assert any(json.loads(line).get("id") == 5 for line in raw.lines)
    assert len(door.executions("slow_charge")) == 1
    assert len(door.executions("charge")) == 1
    logs = raw.stderr.read_text()
    assert "stdio door is running" in logs
    assert charge["idempotency_key"] not in logs

    retry = Raw(door)
    retry.initialize()
    retry.send(call(1, "slow_charge", slow))
    replayed = retry.response(1)
    assert retry.end() == 0
    retry.only_jsonrpc()
    assert replayed["result"]["structuredContent"]["charge"] == door.executions("slow_charge")[0]["charge"]
    assert len(door.executions("slow_charge")) == 1


def test_the_door_stops_with_its_server_naming_its_exit(tmp_path: Path) -> None:
    door = Stdio(tmp_path)
    raw = Raw(door)
    raw.initialize()
    raw.send(call(1, "slow_charge", {"customer": "c-5", "amount": 1, "seconds": 5.0, "idempotency_key": key()}))
    door.wait_for("slow_charge.started")
    os.kill(door.server_pid(), signal.SIGKILL)
    answer = raw.response(1)
    assert answer["error"]["code"] == -32000, answer
    status = raw.proc.wait(timeout=30)
    assert status != 0
    raw.end()
    raw.only_jsonrpc()
    assert "signal 9" in raw.stderr.read_text()


@pytest.mark.parametrize("argv, says", [
    (["proxy", "--stdio", "--", "true"], "--protocol mcp"),
    (["proxy", "--protocol", "mcp", "--stdio"], "command after `--`"),
    (["proxy", "--protocol", "mcp", "--stdio", "--upstream", "http://127.0.0.1:1", "--", "true"], "--upstream"),
    (["proxy", "--protocol", "mcp", "--stdio", "--listen", "127.0.0.1:0", "--", "true"], "--listen"),
    (["proxy", "--protocol", "mcp", "--upstream", "http://127.0.0.1:1", "--", "true"], "--stdio"),
])
def test_a_stdio_door_set_wrong_is_a_clear_error(tmp_path: Path, argv: list[str], says: str) -> None:
    env = door_env(XDG_DATA_HOME=str(tmp_path / "data"))
    env.pop("DATABASE_URL", None)
    done = subprocess.run([BIN, *argv], env=env, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert done.stdout == b""
    assert says in done.stderr.decode(), done.stderr.decode()
    assert not (tmp_path / "data").exists()
