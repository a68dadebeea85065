"""Calls that ask for input under MCP 2025-11-25 (docs/mcp.md, "Questions
mid-call"), through `idemgate proxy --protocol mcp` with a runtime's key: the
server (server.py, the official Python SDK's MCPServer) asks its question —
an elicitation, a sampling or a roots request — or reports progress on the
call's event stream, and the official Python client in its legacy handshake
(`ClientSession` over `streamable_http_client` + `initialize()`) answers.

The question reaches the client as it is sent, the client's answer reaches
the server, and only the call's result is the key's outcome: a repeat of the
whole call replays that result without asking again or charging. A question
declined or cancelled is answered by the SDK with a tool result (`isError`,
nothing charged); the door saw the client say no, so nothing is stored: the
key is released and a retry asks again. So with a client that goes away with
the question open (it answers the question with an error). In its
`--json-response` mode the server cannot ask mid-call (it answers the call
with a JSON-RPC error -32600, which says the tool never ran: the key is
released) and reports no progress.

    IDEMGATE_BIN=target/debug/idemgate python -m pytest tests/mcp/test_ask_legacy.py
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import (
    CreateMessageResult,
    ElicitResult,
    ListRootsResult,
    Root,
    TextContent,
)

from door_rig import Rig
from official import KEY_META, RawSession, RpcError, problem_type

LEGACY = "2025-11-25"
# The tests of questions asked: only a server that answers with an event
# stream can ask mid-call (the rig fixture's other form answers JSON).
EVENT_STREAM = pytest.mark.parametrize("rig", ["event-stream"], indirect=True)
MEMO = "Thanks for your order."


def key() -> str:
    return f"ask-{uuid.uuid4()}"


def wire(result: Any) -> dict[str, Any]:
    return dict(result.model_dump(by_alias=True, mode="json", exclude_none=True))


@dataclass
class Client:
    """What the client was asked, and how it answers: `action` to an
    elicitation (after `delay` seconds), a memo to sampling, one root."""

    action: str = "accept"
    delay: float = 0.0
    asked: list[tuple[str, float]] = field(default_factory=list)

    async def elicit(self, _ctx: Any, params: Any) -> ElicitResult:
        self.asked.append(("elicitation/create", time.monotonic()))
        await asyncio.sleep(self.delay)
        if self.action == "accept":
            return ElicitResult(action="accept", content={"confirm": True})
        return ElicitResult(action=self.action)  # type: ignore[arg-type]

    async def sample(self, _ctx: Any, params: Any) -> CreateMessageResult:
        self.asked.append(("sampling/createMessage", time.monotonic()))
        return CreateMessageResult(role="assistant", content=TextContent(type="text", text=MEMO), model="test")

    async def roots(self, _ctx: Any) -> ListRootsResult:
        self.asked.append(("roots/list", time.monotonic()))
        return ListRootsResult(roots=[Root(uri="file:///srv/shop", name="shop")])

    def questions(self) -> list[str]:
        return [q for q, _ in self.asked]


@asynccontextmanager
async def legacy(url: str, client: Client) -> AsyncIterator[ClientSession]:
    """The official client's legacy handshake, answering as `client` says."""
    async with streamable_http_client(url) as (read, write, *_):
        async with ClientSession(
            read, write,
            elicitation_callback=client.elicit,
            sampling_callback=client.sample,
            list_roots_callback=client.roots,
        ) as s:
            init = await s.initialize()
            assert init.protocol_version == LEGACY, init
            yield s


async def call(s: ClientSession, tool: str, arguments: dict[str, Any], k: str, **kwargs: Any) -> dict[str, Any]:
    return wire(await s.call_tool(tool, arguments, read_timeout_seconds=20, meta={KEY_META: k}, **kwargs))


def unknown_keys(rig: Rig) -> list[Any]:
    keys = httpx.get(f"{rig.admin}/v1/admin/keys", params={"state": "unknown"}, timeout=10).json()["keys"]
    return list(keys)


def test_an_accepted_question_reaches_the_client_once_and_the_call_charges_once(rig: Rig) -> None:
    k, first, again = key(), Client(), Client()
    args = {"customer": rig.who, "amount": 700}

    async def go() -> tuple[Any, Any]:
        async with legacy(rig.url, first) as s:
            one = await call(s, "confirmed_charge", args, k)
        # The whole call again, as a runtime retries it: a new session.
        async with legacy(rig.url, again) as s:
            two = await call(s, "confirmed_charge", args, k)
        return one, two

    if rig.json_response:
        # The server answers JSON and has no stream to ask on: it answers the
        # call with -32600, before the tool runs, so the key is released and
        # the retry is the server's to answer again, the same way.
        async def refused() -> list[str]:
            errors = []
            for client in (first, again):
                async with legacy(rig.url, client) as s:
                    with pytest.raises(RpcError) as raised:
                        await call(s, "confirmed_charge", args, k)
                    errors.append(str(raised.value))
            return errors

        errors = asyncio.run(refused())
        assert all("back-channel" in e for e in errors), errors
        assert first.asked == [] and again.asked == []
        assert rig.executions("confirmed_charge") == []
        assert len(rig.executions("confirmed_charge.asked")) == 2
        assert unknown_keys(rig) == []
        return

    one, two = asyncio.run(go())
    assert first.questions() == ["elicitation/create"]
    assert one.get("isError") is False, one
    charged = rig.executions("confirmed_charge")
    assert len(charged) == 1
    assert one["structuredContent"] == {"charge": charged[0]["charge"], "amount": 700}
    # The repeat replays: never asked, never charged again.
    assert again.asked == []
    assert two["structuredContent"] == one["structuredContent"]
    assert len(rig.executions("confirmed_charge.asked")) == 1
    assert len(rig.executions("confirmed_charge")) == 1


@EVENT_STREAM
@pytest.mark.parametrize("action", ["decline", "cancel"])
def test_a_declined_or_cancelled_question_stores_nothing_and_its_retry_asks_again(
    rig: Rig, action: str
) -> None:
    k, first, again = key(), Client(action=action), Client()
    args = {"customer": rig.who, "amount": 300}

    async def go() -> tuple[Any, Any]:
        async with legacy(rig.url, first) as s:
            one = await call(s, "confirmed_charge", args, k)
        async with legacy(rig.url, again) as s:
            two = await call(s, "confirmed_charge", args, k)
        return one, two

    one, two = asyncio.run(go())
    assert first.questions() == ["elicitation/create"]
    # The SDK's answer to a question not accepted: a tool result with
    # isError (the tool body never ran). The door saw the user say no: it
    # stores nothing and releases the key, so the retry is asked again, and
    # charges once when the user says yes; no key is left for an operator.
    assert one.get("isError") is True, one
    assert f"elicitation was {action}" in one["content"][0]["text"], one
    assert "dev.idemgate/problem" not in one.get("_meta", {}), one
    assert again.questions() == ["elicitation/create"]
    assert two.get("isError") is not True, two
    charged = rig.executions("confirmed_charge")
    assert [c["charge"] for c in charged] == [two["structuredContent"]["charge"]]
    assert len(rig.executions("confirmed_charge.asked")) == 2
    assert unknown_keys(rig) == []


@EVENT_STREAM
def test_a_repeat_gets_the_result_alone_with_its_own_id(rig: Rig) -> None:
    k, first = key(), Client()
    args = {"customer": rig.who, "amount": 25}

    async def go() -> tuple[Any, httpx.Response]:
        async with legacy(rig.url, first) as s:
            one = await call(s, "confirmed_charge", args, k)
        async with RawSession(rig.url, LEGACY) as raw:
            body = {"jsonrpc": "2.0", "id": "again-1", "method": "tools/call",
                    "params": {"name": "confirmed_charge", "arguments": args, "_meta": {KEY_META: k}}}
            return one, await raw.client.post(raw.url, json=body, headers=raw.headers("tools/call"))

    one, res = asyncio.run(go())
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("text/event-stream"), res.headers
    events = [e for e in res.text.replace("\r\n", "\n").split("\n\n") if e.strip()]
    # What the server asked is not part of the stored answer: one event,
    # the result, with the repeat's id.
    assert len(events) == 1, res.text
    assert '"again-1"' in events[0] and "elicitation" not in events[0], res.text
    assert one["structuredContent"]["charge"] in events[0]
    assert len(rig.executions("confirmed_charge")) == 1


@EVENT_STREAM
def test_sampling_and_roots_requests_mid_call_reach_the_client(rig: Rig) -> None:
    k, first, again = key(), Client(), Client()
    args = {"customer": rig.who, "amount": 40}

    async def go() -> tuple[Any, Any]:
        async with legacy(rig.url, first) as s:
            one = await call(s, "memo_charge", args, k)
        async with legacy(rig.url, again) as s:
            two = await call(s, "memo_charge", args, k)
        return one, two

    one, two = asyncio.run(go())
    assert first.questions() == ["sampling/createMessage", "roots/list"]
    assert one.get("isError") is False, one
    assert one["structuredContent"]["memo"] == MEMO
    assert one["structuredContent"]["roots"] == ["file:///srv/shop"]
    charged = rig.executions("memo_charge")
    assert len(charged) == 1 and charged[0]["memo"] == MEMO and charged[0]["roots"] == 1
    assert again.asked == [] and two == one
    assert len(rig.executions("memo_charge")) == 1


def test_progress_reaches_the_client_during_the_call(rig: Rig) -> None:
    k = key()
    args = {"customer": rig.who, "amount": 90, "steps": 4}
    progress: list[tuple[float, float]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, time.monotonic()))

    async def go() -> tuple[Any, float, Any]:
        async with legacy(rig.url, Client()) as s:
            one = await call(s, "progress_charge", args, k, progress_callback=on_progress)
            answered = time.monotonic()
            two = await call(s, "progress_charge", args, k, progress_callback=on_progress)
        return one, answered, two

    one, answered, two = asyncio.run(go())
    assert one.get("isError") is False, one
    assert two["structuredContent"] == one["structuredContent"]
    assert len(rig.executions("progress_charge")) == 1
    if rig.json_response:
        # A JSON answer has no stream to report progress on: the SDK drops it.
        assert progress == []
        return
    # Each report as it was sent, a quarter second apart, the first well
    # before the result (the tool reports for a second in all); the replay
    # reports nothing.
    assert [p for p, _ in progress] == [1, 2, 3, 4], progress
    assert answered - progress[0][1] > 0.5, (answered, progress)


@EVENT_STREAM
def test_a_repeat_while_the_first_waits_for_its_answer_is_held_and_replayed(rig: Rig) -> None:
    k = key()
    args = {"customer": rig.who, "amount": 55}
    # The first client takes a second to answer; its answer reaches the
    # server while the repeat is held on the key.
    first, second = Client(delay=1.0), Client()

    async def go() -> tuple[Any, Any]:
        async def one() -> Any:
            async with legacy(rig.url, first) as s:
                return await call(s, "confirmed_charge", args, k)

        async def two() -> Any:
            await asyncio.sleep(0.3)
            async with legacy(rig.url, second) as s:
                return await call(s, "confirmed_charge", args, k)

        a, b = await asyncio.gather(one(), two())
        return a, b

    a, b = asyncio.run(go())
    assert first.questions() == ["elicitation/create"] and second.asked == []
    assert a.get("isError") is False, a
    assert b["structuredContent"] == a["structuredContent"], (a, b)
    assert len(rig.executions("confirmed_charge")) == 1


@EVENT_STREAM
def test_a_client_gone_mid_question_stores_nothing_and_its_retry_asks_again(rig: Rig) -> None:
    """The official client, closing while a question is open, answers it with
    a JSON-RPC error (-32000 connection closed), and the SDK answers the call
    with that error. The door saw the client answer its question with an
    error, and the call then fail: the tool did not act, so the key is
    released (never left for an operator), and the retry is asked again and
    charges once."""
    k = key()
    args = {"customer": rig.who, "amount": 65}
    gone = Client(delay=3600)

    async def go() -> Any:
        async with legacy(rig.url, gone) as s:
            with pytest.raises(RpcError):
                await s.call_tool("confirmed_charge", args, read_timeout_seconds=1.5, meta={KEY_META: k})
        # The first call ends when the server has its answer to the error:
        # a retry meanwhile is held, and, on a busy machine, may be told
        # request-in-flight, and waits as a client does, for as long as
        # the first call may take to end there (a deadline, not a count
        # of tries: on two busy cores that end took over five seconds).
        deadline = time.monotonic() + 60
        while True:
            async with legacy(rig.url, Client()) as s:
                answer = await call(s, "confirmed_charge", args, k)
            if not answer.get("isError") or problem_type(answer) != "request-in-flight":
                return answer
            if time.monotonic() > deadline:
                return answer
            await asyncio.sleep(answer["structuredContent"].get("retry_after_seconds", 1))

    retried = asyncio.run(go())
    assert gone.questions() == ["elicitation/create"]
    assert retried.get("isError") is not True, retried
    charged = rig.executions("confirmed_charge")
    assert [c["charge"] for c in charged] == [retried["structuredContent"]["charge"]]
    assert unknown_keys(rig) == []


@pytest.mark.parametrize("own_rig", ["event-stream"], indirect=True)
def test_a_server_killed_after_it_reported_progress_leaves_the_key_unknown(own_rig: Rig) -> None:
    """A stream that breaks after messages passed on is no result: the
    client gets a JSON-RPC error saying the outcome is unknown, and the key
    is held outcome-unknown, never run again."""
    rig = own_rig
    k = key()
    args = {"customer": rig.who, "amount": 80, "steps": 8}
    progress: list[float] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)

    errors: list[str] = []

    async def doomed() -> None:
        async with legacy(rig.url, Client()) as s:
            call_ = asyncio.create_task(call(s, "progress_charge", args, k, progress_callback=on_progress))
            deadline = time.monotonic() + 5
            while not progress and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert rig.server is not None
            rig.server.send_signal(signal.SIGKILL)
            rig.server.wait()
            try:
                await call_
            except RpcError as e:
                errors.append(str(e))

    try:
        asyncio.run(doomed())
    except BaseException:  # noqa: BLE001 - the session's teardown against a dead server
        pass
    assert progress, "no progress reached the client before the kill"
    # The door's answer once the stream broke: a JSON-RPC error that says so.
    assert len(errors) == 1 and "unknown" in errors[0], errors
    rig.start_server()

    async def again() -> Any:
        async with legacy(rig.url, Client()) as s:
            return await call(s, "progress_charge", args, k)

    assert problem_type(asyncio.run(again())) == "outcome-unknown"
    assert rig.executions("progress_charge") == []
    assert len(unknown_keys(rig)) == 1
