"""`idemgate proxy --protocol mcp` (docs/mcp.md) in front of an unmodified MCP
server made with the official Python SDK (server.py), driven by the official
Python client (official.py) in each of its ways to connect — mcp 2.x's
default `Client` (protocol 2026-07-28) and `ClientSession` + `initialize`
(2025-11-25) — against both of the server's answer forms (event stream and
JSON). The server logs every execution of a tool; each test counts them.

    IDEMGATE_BIN=target/debug/idemgate python -m pytest tests/mcp

With mcp 1.x installed (.ci/mcp's second virtualenv), `-m mcp1` runs the
tests marked so with its `ClientSession`; the server still runs on mcp 2.x
(MCP_SERVER_PYTHON names that Python).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from typing import Any

import pytest

from door_rig import Rig, door_env, settle
from official import (
    EXPECTED_VERSION,
    KEY_META,
    MAJOR,
    MODERN,
    RawSession,
    RpcError,
    problem_type,
    session,
)

mcp1 = pytest.mark.mcp1  # also run with mcp 1.x (.ci/mcp: -m mcp1)


def key() -> str:
    return f"step-{uuid.uuid4()}"


def door_result(answer: dict[str, Any], version: str) -> dict[str, Any]:
    """The tool result of a raw JSON-RPC answer, checked valid under
    `version`: under 2026-07-28 a result carries resultType "complete"."""
    assert "result" in answer, answer
    result = answer["result"]
    assert isinstance(result.get("content"), list), answer
    if version == MODERN:
        assert result.get("resultType") == "complete", f"no resultType under {version}: {answer}"
    return dict(result)


@mcp1
def test_tools_list_offers_the_key_to_write_tools_only(rig: Rig, mode: str) -> None:
    async def go() -> dict[str, Any]:
        async with session(rig.url, mode) as s:
            return await s.list_tools()

    schemas = asyncio.run(go())
    assert "idempotency_key" in schemas["charge"]["properties"]
    assert "idempotency_key" not in schemas["charge"].get("required", [])
    assert "idempotency_key" in schemas["slow_charge"]["properties"]
    assert "idempotency_key" not in schemas["balance"]["properties"]


@mcp1
def test_a_repeated_call_runs_once_and_each_gets_the_result(rig: Rig, mode: str) -> None:
    k = key()

    async def go() -> list[Any]:
        async with session(rig.url, mode) as s:
            await s.list_tools()
            args = {"customer": rig.who, "amount": 500, "idempotency_key": k}
            return [await s.call("charge", args) for _ in range(3)]

    results = asyncio.run(go())
    assert [r.get("isError") for r in results] == [False, False, False]
    charges = {r["structuredContent"]["charge"] for r in results}
    assert len(charges) == 1
    executed = rig.executions("charge")
    assert len(executed) == 1
    assert executed[0]["charge"] in charges
    # The server never sees the key: it is not one of its arguments.
    assert "idempotency_key" not in executed[0]


@mcp1
def test_the_key_in_meta_works_too_and_without_a_key_nothing_is_guarded(rig: Rig, mode: str) -> None:
    k = key()

    async def go() -> list[Any]:
        async with session(rig.url, mode) as s:
            meta = {KEY_META: k}
            guarded = [await s.call("charge", {"customer": rig.who, "amount": 1}, meta=meta) for _ in range(2)]
            unguarded = [await s.call("charge", {"customer": rig.who, "amount": 1}) for _ in range(2)]
            return guarded + unguarded

    results = asyncio.run(go())
    assert not any(r.get("isError") for r in results)
    assert results[0]["structuredContent"] == results[1]["structuredContent"]
    assert len(rig.executions("charge")) == 3


@mcp1
def test_another_amount_under_the_same_key_is_an_error_result(rig: Rig, mode: str) -> None:
    k = key()

    async def go() -> tuple[Any, Any]:
        async with session(rig.url, mode) as s:
            first = await s.call("charge", {"customer": rig.who, "amount": 500, "idempotency_key": k})
            other = await s.call("charge", {"customer": rig.who, "amount": 900, "idempotency_key": k})
            return first, other

    first, other = asyncio.run(go())
    assert not first.get("isError")
    assert problem_type(other) == "key-reused"
    assert len(rig.executions("charge")) == 1


def test_a_typed_tools_refusal_is_a_result_not_a_schema_error(rig: Rig, mode: str) -> None:
    """A tool with an outputSchema: clients check a result's
    structuredContent against it, so a refusal must still reach them as a
    tool result; under the handshake versions the door leaves
    structuredContent out, its problem in _meta and text."""
    k = key()

    async def go() -> tuple[Any, Any]:
        async with session(rig.url, mode) as s:
            await s.list_tools()
            first = await s.call("typed_charge", {"customer": rig.who, "amount": 5, "idempotency_key": k})
            other = await s.call("typed_charge", {"customer": rig.who, "amount": 6, "idempotency_key": k})
            return first, other

    first, other = asyncio.run(go())
    assert not first.get("isError") and first["structuredContent"]["amount"] == 5
    assert problem_type(other) == "key-reused"
    if EXPECTED_VERSION[mode] != MODERN:
        assert "structuredContent" not in other, other
    assert len(rig.executions("typed_charge")) == 1


def test_a_key_that_is_not_a_string_is_an_error_result(rig: Rig, mode: str) -> None:
    async def go() -> Any:
        async with session(rig.url, mode) as s:
            return await s.call("charge", {"customer": rig.who, "amount": 5, "idempotency_key": 42})

    assert problem_type(asyncio.run(go())) == "key-invalid"
    assert rig.executions("charge") == []


def test_a_repeat_during_a_slow_call_waits_and_gets_the_result(rig: Rig, mode: str) -> None:
    k = key()
    args = {"customer": rig.who, "amount": 300, "seconds": 2.0, "idempotency_key": k}

    async def go() -> list[Any]:
        async with session(rig.url, mode) as first, session(rig.url, mode) as second:
            one = asyncio.create_task(first.call("slow_charge", args))
            await asyncio.sleep(0.5)
            two = asyncio.create_task(second.call("slow_charge", args))
            return list(await asyncio.gather(one, two))

    results = asyncio.run(go())
    assert [r.get("isError") for r in results] == [False, False]
    assert results[0]["structuredContent"] == results[1]["structuredContent"]
    assert len(rig.executions("slow_charge")) == 1


def test_a_retry_on_a_new_session_is_the_same_caller(rig: Rig, mode: str) -> None:
    k = key()
    args = {"customer": rig.who, "amount": 700, "idempotency_key": k}

    async def call() -> Any:
        async with session(rig.url, mode) as s:
            return await s.call("charge", args)

    first, retry = asyncio.run(call()), asyncio.run(call())
    assert not first.get("isError") and not retry.get("isError")
    assert first["structuredContent"] == retry["structuredContent"]
    assert len(rig.executions("charge")) == 1


def test_read_only_tools_pass_through(rig: Rig, mode: str) -> None:
    async def go() -> list[Any]:
        async with session(rig.url, mode) as s:
            await s.list_tools()
            args = {"customer": rig.who}
            return [await s.call("balance", args) for _ in range(2)]

    assert not any(r.get("isError") for r in asyncio.run(go()))
    assert len(rig.executions("balance")) == 2


def test_a_server_killed_during_a_call_leaves_the_key_unknown(own_rig: Rig, mode: str) -> None:
    rig = own_rig
    k = key()
    args = {"customer": rig.who, "amount": 100, "seconds": 3.0, "idempotency_key": k}

    async def doomed() -> None:
        async with session(rig.url, mode) as s:
            call = asyncio.create_task(s.call("slow_charge", args, timeout=10))
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
        async with session(rig.url, mode) as s:
            return await s.call("slow_charge", args)

    result = asyncio.run(again())
    # Whether the charge was made is unknown: never run again by itself.
    assert problem_type(result) == "outcome-unknown"
    assert rig.executions("slow_charge") == []

    # An operator looks (the server's own records) and settles the key with
    # what happened, the tool's result alone; every repeat then gets it.
    settle(rig.admin, {"content": [{"type": "text", "text": "ch_ops"}],
                       "structuredContent": {"charge": "ch_ops", "amount": 100}, "isError": False},
           "the ledger shows ch_ops")
    replayed = asyncio.run(again())
    assert not replayed.get("isError"), replayed
    assert replayed["structuredContent"] == {"charge": "ch_ops", "amount": 100}
    assert rig.executions("slow_charge") == []


@mcp1
def test_every_refusal_and_the_operators_replay_read_as_tool_results(rig: Rig, mode: str) -> None:
    """Each result the door writes itself — key-invalid, key-reused,
    request-in-flight, outcome-unknown, and the replay of a response an
    operator entered — is read by the client as a tool result (never a
    validation error), and is valid on the wire under the protocol version
    the session negotiated: checked again by hand (httpx) at that version."""
    # No wait for a held repeat (request-in-flight at once: the MCP door's
    # default wait gives way to IDEMGATE_DEFAULT_WAIT), and a call still
    # running after 1 s is abandoned: its outcome is unknown.
    door = rig.start_proxy("--upstream-abandon-after", "1", env=door_env(IDEMGATE_DEFAULT_WAIT="0"))
    reused, slow = key(), key()
    slow_args = {"customer": rig.who, "amount": 900, "seconds": 2.5, "idempotency_key": slow}
    got: dict[str, dict[str, Any]] = {}
    raw: dict[str, dict[str, Any]] = {}

    async def refusals() -> str:
        async with session(door.url, mode) as s, session(door.url, mode) as other:
            assert s.protocol_version == EXPECTED_VERSION[mode]
            async with RawSession(door.url, s.protocol_version) as r:
                invalid = {"customer": rig.who, "amount": 1, "idempotency_key": 7}
                got["key-invalid"] = await s.call("charge", invalid)
                raw["key-invalid"] = await r.call("charge", invalid, rid=71)
                def amount(n: int) -> dict[str, Any]:
                    return {"customer": rig.who, "amount": n, "idempotency_key": reused}

                first = await s.call("charge", amount(1))
                assert not first.get("isError"), first
                got["key-reused"] = await s.call("charge", amount(2))
                raw["key-reused"] = await r.call("charge", amount(3))

                running = asyncio.create_task(s.call("slow_charge", slow_args, timeout=15))
                await asyncio.sleep(0.3)
                got["request-in-flight"] = await other.call("slow_charge", slow_args, timeout=5)
                raw["request-in-flight"] = await r.call("slow_charge", slow_args)
                try:
                    cut = await running
                    raise AssertionError(f"a call abandoned after 1 s got a result: {cut}")
                except RpcError:
                    pass  # the door's upstream-timeout error: idemgate's, as a JSON-RPC error
                got["outcome-unknown"] = await other.call("slow_charge", slow_args)
                raw["outcome-unknown"] = await r.call("slow_charge", slow_args)
                return s.protocol_version

    version = asyncio.run(refusals())
    for kind in ("key-invalid", "key-reused", "request-in-flight", "outcome-unknown"):
        assert problem_type(got[kind]) == kind, (kind, got[kind])
        assert problem_type(door_result(raw[kind], version)) == kind, (kind, raw[kind])
    assert raw["key-invalid"]["id"] == 71
    assert len(rig.executions("charge")) == 1
    # The abandoned call may have run to its end in the server or not: what
    # matters is that nothing runs it again.
    assert len(rig.executions("slow_charge")) <= 1

    # The operator's answer is the tool's result alone, as a handshake-era
    # server wrote it (no resultType): the door makes it valid for each.
    settle(door.admin, {"content": [{"type": "text", "text": "ch_ops9"}],
                        "structuredContent": {"charge": "ch_ops9", "amount": 900}, "isError": False},
           "the ledger shows ch_ops9")

    async def replay() -> tuple[dict[str, Any], dict[str, Any]]:
        async with session(door.url, mode) as s, RawSession(door.url, s.protocol_version) as r:
            return await s.call("slow_charge", slow_args), await r.call("slow_charge", slow_args, rid="replay-9")

    replayed, raw_replayed = asyncio.run(replay())
    assert replayed.get("isError") is False, replayed
    assert replayed["structuredContent"] == {"charge": "ch_ops9", "amount": 900}
    assert raw_replayed["id"] == "replay-9"
    assert door_result(raw_replayed, version)["structuredContent"] == {"charge": "ch_ops9", "amount": 900}
    assert len(rig.executions("slow_charge")) <= 1


@pytest.mark.skipif(MAJOR < 2, reason="needs mcp 2.x's default client (2026-07-28) and its legacy session")
def test_a_result_stored_under_one_protocol_replays_under_the_other(rig: Rig) -> None:
    """A result stored from a 2025-11-25 session replays to a 2026-07-28
    client (which requires resultType), and one stored from a 2026-07-28
    session to a 2025-11-25 client (without it); the same for the raw
    answers."""
    legacy_first, modern_first = key(), key()
    one = {"customer": rig.who, "amount": 1, "idempotency_key": legacy_first}
    two = {"customer": rig.who, "amount": 2, "idempotency_key": modern_first}

    async def go() -> list[dict[str, Any]]:
        async with session(rig.url, "legacy") as old, session(rig.url, "default") as new:
            stored = [await old.call("charge", one), await new.call("charge", two)]
            replays = [await new.call("charge", one), await old.call("charge", two)]
            async with RawSession(rig.url, MODERN) as r:
                raw_modern = door_result(await r.call("charge", one), MODERN)
            async with RawSession(rig.url, "2025-11-25") as r:
                raw_legacy = door_result(await r.call("charge", two), "2025-11-25")
            return [*stored, *replays, raw_modern, raw_legacy]

    stored_one, stored_two, replay_one, replay_two, raw_one, raw_two = asyncio.run(go())
    for result in (stored_one, stored_two, replay_one, replay_two, raw_one, raw_two):
        assert result.get("isError") is False, result
    assert replay_one["structuredContent"] == stored_one["structuredContent"] == raw_one["structuredContent"]
    assert replay_two["structuredContent"] == stored_two["structuredContent"] == raw_two["structuredContent"]
    # Fixed up the other way too: a 2026-07-28 result (resultType) replayed
    # on a 2025-11-25 session is the result as that version has it.
    assert "resultType" not in raw_two, raw_two
    assert len(rig.executions("charge")) == 2


@pytest.mark.parametrize("then", ["stays", "closes"])
def test_a_cancelled_call_runs_to_its_end_and_a_retry_gets_its_result(rig: Rig, mode: str, then: str) -> None:
    """The client gives up on a slow call: mcp 2.x's legacy session sends
    notifications/cancelled when its read times out; at 2026-07-28 it
    closes the request's stream instead. Either way the door keeps the call
    running (the tool runs once, to its end), stores its result and never a
    cancellation: a retry gets the real result. The session then stays
    open, or closes at once as an agent's does (the legacy session's close
    is a DELETE of its Mcp-Session-Id, on which the server ends whatever
    still runs in the session)."""
    k = key()
    args = {"customer": rig.who, "amount": 1100, "seconds": 2.0, "idempotency_key": k}

    async def give_up() -> None:
        async with session(rig.url, mode) as s:
            with pytest.raises(RpcError):
                await s.call("slow_charge", args, timeout=0.7)
            await asyncio.sleep(0.3 if then == "closes" else 2.5)

    asyncio.run(give_up())
    executed = rig.wait_for_executions("slow_charge", 1, within=5)
    assert len(executed) == 1, f"the call the client gave up on did not run to its end: {executed}"
    assert len(rig.executions("slow_charge.started")) == 1

    async def retry() -> dict[str, Any]:
        async with session(rig.url, mode) as s:
            return await s.call("slow_charge", args, timeout=10)

    result = asyncio.run(retry())
    assert result.get("isError") is False, result
    assert result["structuredContent"] == {"charge": executed[0]["charge"], "amount": 1100}
    assert len(rig.executions("slow_charge")) == 1
    assert len(rig.executions("slow_charge.started")) == 1


def test_a_notifications_cancelled_for_a_guarded_call_is_not_forwarded(rig: Rig) -> None:
    """By hand, on a 2025-11-25 session: the cancellation of a guarded call
    in flight is answered 202 by the door and the call goes on: its own
    answer is its result, stored; a retry replays it."""
    k = key()
    args = {"customer": rig.who, "amount": 1200, "seconds": 1.5, "idempotency_key": k}

    async def go() -> tuple[int, dict[str, Any], dict[str, Any]]:
        async with RawSession(rig.url, "2025-11-25") as r:
            call = asyncio.create_task(r.call("slow_charge", args, rid=12))
            await asyncio.sleep(0.5)
            cancelled = await r.notify("notifications/cancelled", {"requestId": 12, "reason": "the user gave up"})
            answer = await call
            retry = await r.call("slow_charge", args, rid=13)
            return cancelled.status_code, answer, retry

    status, answer, retry = asyncio.run(go())
    assert status == 202
    executed = rig.executions("slow_charge")
    assert len(executed) == 1, executed
    assert answer["id"] == 12 and door_result(answer, "2025-11-25").get("isError") is False, answer
    assert retry["id"] == 13, retry
    assert door_result(retry, "2025-11-25")["structuredContent"] == {"charge": executed[0]["charge"], "amount": 1200}


def test_a_sessions_delete_does_not_cut_its_guarded_calls_off(rig: Rig) -> None:
    """By hand, on a 2025-11-25 session: the client ends its session (DELETE,
    as mcp's streamable_http_client does on close) while a guarded call
    runs. The server ends whatever still runs in a session it is told to
    end; the door keeps the guarded call from that: it runs to its end, its
    answer arrives, and a retry on a new session replays it."""
    k = key()
    args = {"customer": rig.who, "amount": 1300, "seconds": 1.5, "idempotency_key": k}

    async def go() -> tuple[int, dict[str, Any], dict[str, Any]]:
        async with RawSession(rig.url, "2025-11-25") as r:
            call = asyncio.create_task(r.call("slow_charge", args, rid=14))
            await asyncio.sleep(0.5)
            ended = await r.client.delete(rig.url, headers=r.headers())
            r.session_id = None
            answer = await call
        async with RawSession(rig.url, "2025-11-25") as r:
            retry = await r.call("slow_charge", args, rid=15)
        return ended.status_code, answer, retry

    status, answer, retry = asyncio.run(go())
    assert status < 300, status
    executed = rig.executions("slow_charge")
    assert len(executed) == 1, executed
    assert door_result(answer, "2025-11-25").get("isError") is False, answer
    assert door_result(retry, "2025-11-25")["structuredContent"] == {"charge": executed[0]["charge"], "amount": 1300}


def test_the_runtimes_key_in_meta_comes_before_the_models_argument(rig: Rig, mode: str) -> None:
    """A runtime puts a stable key in _meta; the model makes up another
    idempotency_key argument on each try: the calls are one call (one
    execution), and the argument never reaches the server. Without the
    runtime's key the argument is the key."""
    k = key()

    async def go() -> list[dict[str, Any]]:
        async with session(rig.url, mode) as s:
            meta = {KEY_META: k}

            def args(model_key: str) -> dict[str, Any]:
                return {"customer": rig.who, "amount": 13, "idempotency_key": model_key}

            return [
                await s.call("charge", args("model-try-1"), meta=meta),
                await s.call("charge", args("model-try-2"), meta=meta),
                await s.call("charge", args("model-try-1")),
            ]

    runtime_first, runtime_again, model_only = asyncio.run(go())
    assert runtime_first.get("isError") is False, runtime_first
    assert runtime_again.get("isError") is False, runtime_again
    assert runtime_again["structuredContent"] == runtime_first["structuredContent"]
    assert model_only.get("isError") is False, model_only
    assert model_only["structuredContent"] != runtime_first["structuredContent"]
    executed = rig.executions("charge")
    assert len(executed) == 2, executed
    assert all("idempotency_key" not in e for e in executed)


def test_advertise_key_false_leaves_tools_list_as_the_server_wrote_it(rig: Rig, mode: str) -> None:
    door = rig.start_proxy(env=door_env(IDEMGATE_MCP_ADVERTISE_KEY="false"))
    k = key()

    async def go() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        async with session(door.url, mode) as s:
            schemas = await s.list_tools()
            calls = [await s.call("charge", {"customer": rig.who, "amount": 14}, meta={KEY_META: k}) for _ in range(2)]
            return schemas, calls

    schemas, calls = asyncio.run(go())
    assert not any("idempotency_key" in schema.get("properties", {}) for schema in schemas.values()), schemas
    assert calls[0]["structuredContent"] == calls[1]["structuredContent"]
    assert len(rig.executions("charge")) == 1


def test_a_held_duplicate_is_answered_within_the_agents_sdks_five_seconds(rig: Rig, mode: str) -> None:
    """The OpenAI Agents SDK reads an MCP session for 5 s: a repeat of a
    call still running (6 s) must get its answer before that — the door's
    default wait for MCP is 4 s — as a request-in-flight tool result, not a
    read timeout. The first call then gets its result, and so does a retry."""
    door = rig.start_proxy(env=door_env())  # no IDEMGATE_DEFAULT_WAIT: the MCP door's default
    k = key()
    args = {"customer": rig.who, "amount": 1500, "seconds": 6.0, "idempotency_key": k}

    async def go() -> tuple[dict[str, Any], float, dict[str, Any], dict[str, Any]]:
        async with session(door.url, mode) as a, session(door.url, mode) as b:
            first = asyncio.create_task(a.call("slow_charge", args, timeout=20))
            await asyncio.sleep(0.5)
            started = time.monotonic()
            held = await b.call("slow_charge", args, timeout=5)
            took = time.monotonic() - started
            result = await first
            retry = await b.call("slow_charge", args, timeout=5)
            return held, took, result, retry

    held, took, result, retry = asyncio.run(go())
    assert problem_type(held) == "request-in-flight"
    assert 3.0 <= took < 5.0, f"the held repeat was answered after {took:.1f} s"
    assert result.get("isError") is False, result
    assert retry["structuredContent"] == result["structuredContent"]
    assert len(rig.executions("slow_charge")) == 1


def test_an_upstream_given_as_the_servers_endpoint_url(rig: Rig, mode: str) -> None:
    """--upstream http://host:port/mcp: the door's /mcp is the server's
    /mcp, never /mcp/mcp."""
    door = rig.start_proxy(upstream=f"http://127.0.0.1:{rig.server_port}/mcp")
    k = key()

    async def go() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        async with session(door.url, mode) as s:
            schemas = await s.list_tools()
            args = {"customer": rig.who, "amount": 16, "idempotency_key": k}
            return schemas, [await s.call("charge", args) for _ in range(2)]

    schemas, calls = asyncio.run(go())
    assert "idempotency_key" in schemas["charge"]["properties"]
    assert calls[0].get("isError") is False, calls
    assert calls[0]["structuredContent"] == calls[1]["structuredContent"]
    assert len(rig.executions("charge")) == 1
