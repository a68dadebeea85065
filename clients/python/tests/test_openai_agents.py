"""The OpenAI Agents SDK (the real library; the model is a scripted
``agents.models.interface.Model``, no LLM, no network) calling MCP tools
through a real `idemgate proxy --protocol mcp` in front of an unmodified MCP
server (tests/mcp/server.py, the official `mcp` SDK, in both of its answer
forms), with ``idemgate_client.openai_agents``. The server logs every
execution of a write tool; each test counts its own (one customer per test).

The tests that kill a process start a server and a door of their own; the
others share one per answer form (per pytest-xdist worker), each on its own
ports and files."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from agents import Agent, RunConfig, Runner
from agents.exceptions import AgentsException
from agents.items import ModelResponse
from agents.mcp import MCPServerStreamableHttp
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from idemgate_client import InFlight, KeyReused, OutcomeUnknown, derive_key
from idemgate_client.openai_agents import KEY_ARGUMENT, MissingOperation, Operation, idempotent_mcp_server

SERVER = Path(__file__).resolve().parents[3] / "tests" / "mcp" / "server.py"
NO_TRACES = RunConfig(tracing_disabled=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(url: str, what: str, process: subprocess.Popen[bytes], within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited ({process.returncode})")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start at {url}")


@dataclass
class Rig:
    """The MCP server, and `idemgate proxy --protocol mcp` in front of it on a SQLite file."""

    tmp: Path
    json_response: bool
    flags: tuple[str, ...] = ()
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
        args = [sys.executable, str(SERVER), str(self.server_port)]
        if self.json_response:
            args.append("--json-response")
        self.server = subprocess.Popen(args, env={**os.environ, "CHARGES_LOG": str(self.log)},
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(f"http://127.0.0.1:{self.server_port}/", "the MCP server", self.server)

    def start_proxy(self) -> None:
        """A door on the rig's SQLite file (a new one after a kill: the same keys)."""
        binary = os.environ.get("IDEMGATE_BIN")
        if not binary:
            raise RuntimeError("set IDEMGATE_BIN to an idemgate binary (cargo build)")
        port, admin = free_port(), free_port()
        env = {**os.environ, "IDEMGATE_PRUNE_INTERVAL": "0", "RUST_LOG": "warn"}
        env.pop("IDEMGATE_CONFIG", None)
        with open(self.tmp / "proxy.log", "ab") as log:
            self.proxy = subprocess.Popen(
                [binary, "proxy", "--protocol", "mcp", "--upstream", f"http://127.0.0.1:{self.server_port}",
                 "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
                 "--database-url", f"sqlite://{self.tmp / 'keys.db'}", *self.flags],
                env=env, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
            )
        wait_for(f"http://127.0.0.1:{admin}/healthz", "idemgate proxy", self.proxy)
        self.url = f"http://127.0.0.1:{port}/mcp"
        self.admin = f"http://127.0.0.1:{admin}"

    async def in_flight(self, key: str, within: float = 30.0) -> None:
        """Until the door holds ``key`` in flight (its operators' view, by the
        key's hash): the call has reached the door, and goes on to the server."""
        key_hash = hashlib.sha256(key.encode()).hexdigest()
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() < deadline:
                answer = await http.get(f"{self.admin}/v1/admin/keys", params={"state": "in_flight"})
                if answer.status_code == 200 and any(k["key_hash"] == key_hash for k in answer.json()["keys"]):
                    await asyncio.sleep(0.3)
                    return
                await asyncio.sleep(0.05)
        raise AssertionError("the call never reached the door")

    def kill(self, process: subprocess.Popen[bytes] | None) -> None:
        assert process is not None
        process.send_signal(signal.SIGKILL)
        process.wait()

    def executions(self, tool: str, customer: str) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = [json.loads(line) for line in self.log.read_text().splitlines() if line]
        return [e for e in lines if e["tool"] == tool and e["customer"] == customer]

    def stop(self) -> None:
        for process in (self.proxy, self.server):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()


def rig_for(tmp: Path, form: str, *flags: str) -> Rig:
    rig = Rig(tmp, json_response=form == "json", flags=flags)
    try:
        rig.start_server()
        rig.start_proxy()
    except BaseException:
        rig.stop()
        raise
    return rig


@pytest.fixture(scope="module")
def rigs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Rig]]:
    """One shared rig per answer form, started when a test first asks for it."""
    made: dict[str, Rig] = {}
    try:
        yield made
    finally:
        for rig in made.values():
            rig.stop()


def shared(rigs: dict[str, Rig], form: str, tmp_path_factory: pytest.TempPathFactory) -> Rig:
    if form not in rigs:
        rigs[form] = rig_for(tmp_path_factory.mktemp(f"openai-agents-{form}"), form)
    return rigs[form]


@pytest.fixture(params=["event-stream", "json"])
def rig(request: pytest.FixtureRequest, rigs: dict[str, Rig], tmp_path_factory: pytest.TempPathFactory) -> Rig:
    """The shared rig, in each of the server's answer forms (the door replays
    and refuses in the form of the first answer)."""
    return shared(rigs, request.param, tmp_path_factory)


@pytest.fixture
def one_rig(rigs: dict[str, Rig], tmp_path_factory: pytest.TempPathFactory) -> Rig:
    """The shared rig, in one form: for what the form does not change."""
    return shared(rigs, "event-stream", tmp_path_factory)


@dataclass
class Script(Model):
    """The model: each turn, the next step of the script — a tool call
    (``(tool, arguments)``) or the final answer (a string). It writes down
    the tools it was offered and what each tool call returned."""

    steps: list[tuple[str, dict[str, Any]] | str]
    offered: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    turns: int = 0

    async def get_response(self, system_instructions: Any, input: Any, model_settings: Any, tools: Any,
                           output_schema: Any, handoffs: Any, tracing: Any, **_: Any) -> ModelResponse:
        self.turns += 1
        self.offered = {tool.name: tool.params_json_schema for tool in tools}
        if isinstance(input, list) and input and isinstance(input[-1], dict) \
                and input[-1].get("type") == "function_call_output":
            output = input[-1]["output"]  # a string, or a list of content parts
            self.outputs.append(output if isinstance(output, str) else "".join(part["text"] for part in output))
        step = self.steps.pop(0) if self.steps else "done"
        if isinstance(step, str):
            item: Any = ResponseOutputMessage(
                id="msg", type="message", role="assistant", status="completed",
                content=[ResponseOutputText(text=step, type="output_text", annotations=[])])
        else:
            tool, arguments = step
            # A new call id every time, as a model gives a repeated call.
            item = ResponseFunctionToolCall(id=f"fc-{self.turns}", call_id=f"call-{uuid.uuid4().hex[:8]}",
                                            type="function_call", name=tool, arguments=json.dumps(arguments))
        return ModelResponse(output=[item], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the tests run the agent with Runner.run")


def job() -> Operation:
    return Operation(tenant="acme", id=f"order-{uuid.uuid4().hex[:12]}")


def customer() -> str:
    return f"cus_{uuid.uuid4().hex[:12]}"


async def run(url: str, script: Script, context: Any, **server: Any) -> str:
    """One run of the job: its own connection to the door (a new process, say), the scripted model."""
    async with idempotent_mcp_server({"url": url}, **server) as payments:
        agent: Agent[Any] = Agent(name="billing", model=script, mcp_servers=[payments])
        result = await Runner.run(agent, "charge the order", context=context, run_config=NO_TRACES)
        return str(result.final_output)


def charge(who: str, amount: int = 500, **extra: Any) -> tuple[str, dict[str, Any]]:
    return "charge", {"customer": who, "amount": amount, **extra}


def slow_charge(who: str, seconds: float) -> tuple[str, dict[str, Any]]:
    return "slow_charge", {"customer": who, "amount": 300, "seconds": seconds}


def slow_key(order: Operation) -> str:
    """The key the module sends for the job's slow_charge."""
    return derive_key(tenant=order.tenant, run=order.id, step=1, tool="slow_charge")


def charge_ids(script: Script) -> set[str]:
    return {json.loads(output)["charge"] for output in script.outputs}


# --- the key: the job's, never the model's --------------------------------------------------


def test_two_runs_of_a_job_and_a_repeated_call_charge_once(rig: Rig) -> None:
    order, who = job(), customer()
    first, second = Script([charge(who), charge(who), "done"]), Script([charge(who), "done"])
    assert asyncio.run(run(rig.url, first, order)) == "done"
    assert asyncio.run(run(rig.url, second, order)) == "done"
    executed = rig.executions("charge", who)
    assert len(executed) == 1
    # Every call of the job, in both runs, got the one charge back.
    assert len(first.outputs) == 2 and len(second.outputs) == 1
    assert charge_ids(first) == charge_ids(second) == {executed[0]["charge"]}
    # Another job is another charge.
    asyncio.run(run(rig.url, Script([charge(who), "done"]), job()))
    assert len(rig.executions("charge", who)) == 2


def test_the_model_never_sees_the_key_and_a_key_it_makes_up_is_ignored(one_rig: Rig) -> None:
    order, who = job(), customer()
    first = Script([charge(who, idempotency_key="made-up-1"), "done"])
    second = Script([charge(who, idempotency_key="made-up-2"), charge(who, idempotency_key="made-up-3"), "done"])
    asyncio.run(run(one_rig.url, first, order))
    asyncio.run(run(one_rig.url, second, order))
    executed = one_rig.executions("charge", who)
    assert len(executed) == 1
    assert KEY_ARGUMENT not in executed[0]
    # The door offers the argument (IDEMGATE_MCP_ADVERTISE_KEY defaults to true); the model is not shown it.
    assert set(first.offered["charge"]["properties"]) == {"customer", "amount"}
    assert set(first.offered["slow_charge"]["properties"]) == {"customer", "amount", "seconds"}


def test_without_the_module_a_key_the_model_makes_up_charges_again(one_rig: Rig) -> None:
    """The contrast: the SDK's own MCPServerStreamableHttp shows the model
    the door's argument, and each key the model makes up charges again."""
    who = customer()

    async def plain(script: Script) -> None:
        async with MCPServerStreamableHttp({"url": one_rig.url}) as payments:
            agent: Agent[Any] = Agent(name="billing", model=script, mcp_servers=[payments])
            await Runner.run(agent, "charge the order", run_config=NO_TRACES)

    first = Script([charge(who, idempotency_key=f"made-up-{who}-1"), "done"])
    asyncio.run(plain(first))
    asyncio.run(plain(Script([charge(who, idempotency_key=f"made-up-{who}-2"), "done"])))
    assert KEY_ARGUMENT in first.offered["charge"]["properties"]
    assert len(one_rig.executions("charge", who)) == 2


def test_a_door_that_does_not_advertise_the_key_is_the_same(tmp_path: Path) -> None:
    rig = rig_for(tmp_path, "event-stream", "--mcp-advertise-key", "false")
    try:
        order, who = job(), customer()
        first = Script([charge(who, idempotency_key="made-up-1"), "done"])
        asyncio.run(run(rig.url, first, order))
        asyncio.run(run(rig.url, Script([charge(who, idempotency_key="made-up-2"), "done"]), order))
        assert set(first.offered["charge"]["properties"]) == {"customer", "amount"}
        assert len(rig.executions("charge", who)) == 1
    finally:
        rig.stop()


def test_steps_name_the_effects_of_one_job(one_rig: Rig) -> None:
    """A tool that acts more than once per job names its effects with ``step``
    (here: one charge per invoice), never a counter."""
    order, who = job(), customer()
    script = Script([charge(who, 100), charge(who, 200), charge(who, 100), "done"])
    asyncio.run(run(one_rig.url, script, order, step=lambda tool, arguments: f"invoice-{arguments['amount']}"))
    assert sorted(e["amount"] for e in one_rig.executions("charge", who)) == [100, 200]
    assert len(script.outputs) == 3 and len(charge_ids(script)) == 2


def test_a_run_without_the_job_does_not_call_the_tool(one_rig: Rig) -> None:
    who = customer()
    with pytest.raises(MissingOperation) as raised:
        asyncio.run(run(one_rig.url, Script([charge(who), "done"]), context=None))
    assert isinstance(raised.value, AgentsException)
    assert one_rig.executions("charge", who) == []


# --- refusals end the run -------------------------------------------------------------------


def test_a_second_run_with_another_amount_ends_in_key_reused(rig: Rig) -> None:
    order, who = job(), customer()
    asyncio.run(run(rig.url, Script([charge(who, 500), "done"]), order))
    again = Script([charge(who, 900), charge(who, 900), "done"])
    with pytest.raises(KeyReused) as raised:
        asyncio.run(run(rig.url, again, order))
    assert raised.value.status == 422
    assert isinstance(raised.value, AgentsException)
    # The run ended at the refusal: the model never got it as a tool output to try again with.
    assert again.turns == 1 and again.outputs == []
    assert [e["amount"] for e in rig.executions("charge", who)] == [500]


def test_a_repeat_while_the_first_call_runs_waits_for_its_result(rig: Rig) -> None:
    """The first run's slow charge takes 8 s, past the door's 4 s hold: the
    second run's call is refused request-in-flight, asked again under the
    same key, and gets the first charge."""
    order, who = job(), customer()
    first, second = Script([slow_charge(who, 8), "done"]), Script([slow_charge(who, 8), "done"])

    async def both() -> None:
        one = asyncio.create_task(run(rig.url, first, order))
        await rig.in_flight(slow_key(order))
        await asyncio.gather(one, run(rig.url, second, order))

    asyncio.run(both())
    executed = rig.executions("slow_charge", who)
    assert len(executed) == 1
    assert charge_ids(first) == charge_ids(second) == {executed[0]["charge"]}


def test_a_repeat_past_the_wait_budget_ends_in_in_flight(one_rig: Rig) -> None:
    order, who = job(), customer()

    async def both() -> None:
        one = asyncio.create_task(run(one_rig.url, Script([slow_charge(who, 7), "done"]), order))
        await one_rig.in_flight(slow_key(order))
        with pytest.raises(InFlight) as raised:
            await run(one_rig.url, Script([slow_charge(who, 7), "done"]), order, wait_budget=0)
        assert raised.value.dead_letter_reason == "idempotency_in_flight"
        assert isinstance(raised.value, AgentsException)
        await one

    asyncio.run(both())
    assert len(one_rig.executions("slow_charge", who)) == 1


@pytest.mark.parametrize("form", ["event-stream", "json"])
def test_a_server_killed_mid_call_ends_the_run_in_outcome_unknown(tmp_path: Path, form: str) -> None:
    """The MCP server dies while it runs a slow charge: the door answers the
    cut-off call with a JSON-RPC error (upstream-unavailable) and holds the
    key unknown; the SDK sends the call again under the same key
    (max_retry_attempts), and the door's outcome-unknown ends the run before
    the model hears of it. The next run of the job, with the server back,
    ends the same way."""
    rig = rig_for(tmp_path, form)
    try:
        order, who = job(), customer()
        first = Script([slow_charge(who, 3), "done"])

        async def doomed() -> None:
            call = asyncio.create_task(run(rig.url, first, order))
            await rig.in_flight(slow_key(order))
            rig.kill(rig.server)
            await call

        with pytest.raises(OutcomeUnknown) as raised:
            asyncio.run(doomed())
        assert raised.value.dead_letter_reason == "outcome_unknown"
        assert isinstance(raised.value, AgentsException)
        assert first.turns == 1 and first.outputs == []
        rig.start_server()
        retry = Script([slow_charge(who, 3), "done"])
        with pytest.raises(OutcomeUnknown):
            asyncio.run(run(rig.url, retry, order))
        assert retry.turns == 1 and retry.outputs == []
        assert rig.executions("slow_charge", who) == []  # killed before its charge, and never run again
    finally:
        rig.stop()


@pytest.mark.parametrize("form", ["event-stream", "json"])
def test_a_door_killed_mid_call_never_charges_twice(tmp_path: Path, form: str) -> None:
    """kill -9 of the door while the server runs a slow charge: nobody hears
    how it ended, and the key stays held. The retry — a new run on a new door
    on the same SQLite file — is refused request-in-flight until the dead
    door's lease ends, then outcome-unknown: never a second charge.
    (Whether the server finished the cut-off charge is its own affair: this
    one cancels a tool whose event-stream client went away, and finishes one
    it answers as JSON.)"""
    rig = rig_for(tmp_path, form, "--upstream-timeout", "2")  # the key's lease: 2 + 5 s
    try:
        order, who = job(), customer()

        async def doomed() -> str:
            call = asyncio.create_task(run(rig.url, Script([slow_charge(who, 2), "done"]), order))
            await rig.in_flight(slow_key(order))
            rig.kill(rig.proxy)
            return await call

        # The SDK ends the run itself: its next turn lists the tools on the
        # dead connection (MCPError "Connection closed").
        with pytest.raises(Exception) as cut_off:
            asyncio.run(doomed())
        assert not isinstance(cut_off.value, OutcomeUnknown)
        charged = 1 if form == "json" else 0
        deadline = time.monotonic() + (10 if charged else 2.5)  # past the slow charge's own end
        while len(rig.executions("slow_charge", who)) < charged and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        assert len(rig.executions("slow_charge", who)) == charged

        rig.start_proxy()
        retry = Script([slow_charge(who, 2), "done"])
        with pytest.raises(OutcomeUnknown):
            asyncio.run(run(rig.url, retry, order))
        assert retry.turns == 1 and retry.outputs == []
        assert len(rig.executions("slow_charge", who)) == charged
    finally:
        rig.stop()


# --- the stdio door: MCPServerStdio ------------------------------------------------------------


def test_through_the_stdio_door_two_runs_of_a_job_charge_once(tmp_path: Path) -> None:
    """``idempotent_mcp_server`` with stdio params is the SDK's
    ``MCPServerStdio`` running ``idemgate proxy --protocol mcp --stdio --
    server.py --stdio``, as an MCP host would: each run starts its own door
    and server, whose keys are kept in the data directory between them."""
    binary = os.environ.get("IDEMGATE_BIN")
    if not binary:
        raise RuntimeError("set IDEMGATE_BIN to an idemgate binary (cargo build)")
    log = tmp_path / "executions.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMGATE_") and k != "DATABASE_URL"}
    env.update(CHARGES_LOG=str(log), XDG_DATA_HOME=str(tmp_path / "data"), RUST_LOG="warn")
    params: Any = {"command": binary, "env": env,
                   "args": ["proxy", "--protocol", "mcp", "--stdio", "--", sys.executable, str(SERVER), "--stdio"]}
    order, who = job(), customer()

    async def one_run(script: Script) -> str:
        async with idempotent_mcp_server(params) as payments:
            assert payments.__class__.__name__ == "IdempotentMCPServerStdio"
            agent: Agent[Any] = Agent(name="billing", model=script, mcp_servers=[payments])
            result = await Runner.run(agent, "charge the order", context=order, run_config=NO_TRACES)
            return str(result.final_output)

    first, second = Script([charge(who), charge(who), "done"]), Script([charge(who), "done"])
    assert asyncio.run(one_run(first)) == "done"
    assert asyncio.run(one_run(second)) == "done"
    executed = [json.loads(line) for line in log.read_text().splitlines()]
    executed = [e for e in executed if e["tool"] == "charge" and e["customer"] == who]
    assert len(executed) == 1
    assert charge_ids(first) == charge_ids(second) == {executed[0]["charge"]}
    assert set(first.offered["charge"]["properties"]) == {"customer", "amount"}
    with pytest.raises(KeyReused):
        asyncio.run(one_run(Script([charge(who, amount=900), "done"])))
    assert list((tmp_path / "data" / "idemgate").glob("stdio-*.db"))
