"""A tool that asks before it acts, through the door, under 2026-07-28 (the
official Python client's default protocol): the server answers the first
round `input_required` with its question, and the client answers it in a
second round of the same call (`inputResponses`, `requestState`). SPEC §12:
an `input_required` answer is never stored; the key stays with the call
across rounds; the completing round is stored; a declined or cancelled
question leaves nothing stored and nothing charged; a call nobody continues
is released at its lease's end.

The tool is server.py's `confirmed_charge`, whose confirmation is
`Resolve(ask)` -> `Elicit(...)`: it logs each question it asks
("confirmed_charge.asked") and each charge ("confirmed_charge").
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import httpx
import pytest
from mcp import Client
from mcp.types import ElicitResult

from door_rig import Rig
from test_burst import database  # noqa: F401 (a fixture: a PostgreSQL database of the test's own)
from official import KEY_META, MODERN, RawSession, answer_of, problem_type

pytestmark = pytest.mark.anyio

ASKED = "confirmed_charge.asked"
CHARGED = "confirmed_charge"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class User:
    """An elicitation callback that answers `action`, and counts the questions."""

    def __init__(self, action: str = "accept", delay: float = 0.0) -> None:
        self.action = action
        self.delay = delay
        self.questions: list[str] = []

    async def __call__(self, _ctx: Any, params: Any) -> ElicitResult:
        self.questions.append(params.message)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.action == "accept":
            return ElicitResult(action="accept", content={"confirm": True})
        return ElicitResult(action=self.action)


async def call(url: str, who: str, key: str, user: User, amount: int = 7) -> dict[str, Any]:
    """confirmed_charge through the official client's default connect, keyed by a runtime."""
    async with Client(url, elicitation_callback=user) as client:
        assert client.protocol_version == MODERN, client.protocol_version
        result = await client.call_tool(
            "confirmed_charge", {"customer": who, "amount": amount},
            meta={KEY_META: key}, read_timeout_seconds=20,
        )
        return dict(result.model_dump(by_alias=True, mode="json", exclude_none=True))


def charge_of(result: dict[str, Any]) -> str:
    assert result.get("isError") is not True, result
    return str(result["structuredContent"]["charge"])


async def test_a_confirmed_call_runs_once_and_its_repeat_replays_without_asking(rig: Rig) -> None:
    key = f"order-{uuid.uuid4()}"
    first = User()
    result = await call(rig.url, rig.who or "", key, first)
    charge = charge_of(result)
    assert first.questions == [f"Charge {rig.who} 7?"]
    assert [e["charge"] for e in rig.executions(CHARGED)] == [charge]

    again = User()
    repeat = await call(rig.url, rig.who or "", key, again)
    assert charge_of(repeat) == charge, repeat
    assert again.questions == [], "a completed call is replayed, never asked again"
    assert len(rig.executions(CHARGED)) == 1
    # The server asked once per round it saw: the first call's two rounds, no more.
    assert len(rig.executions(ASKED)) <= 2


@pytest.mark.parametrize("action", ["decline", "cancel"])
async def test_a_declined_or_cancelled_question_stores_nothing_and_charges_nothing(rig: Rig, action: str) -> None:
    key = f"order-{uuid.uuid4()}"
    no = User(action)
    result = await call(rig.url, rig.who or "", key, no)
    assert result.get("isError") is True, result
    assert len(no.questions) == 1
    assert rig.executions(CHARGED) == []

    # Nothing was stored: the same call with the same key is asked again,
    # and this time the user says yes.
    yes = User()
    charge = charge_of(await call(rig.url, rig.who or "", key, yes))
    assert len(yes.questions) == 1, "the key was released: the call is asked again"
    assert [e["charge"] for e in rig.executions(CHARGED)] == [charge]


async def test_two_clients_racing_one_key_charge_once(rig: Rig) -> None:
    key = f"order-{uuid.uuid4()}"
    users = [User(delay=0.5), User(delay=0.5)]
    results = await asyncio.gather(*(call(rig.url, rig.who or "", key, u) for u in users))
    charged = rig.executions(CHARGED)
    assert len(charged) == 1, charged
    for result in results:
        if result.get("isError"):
            # Held past the door's wait while the other waited for its user.
            assert problem_type(result) == "request-in-flight", result
        else:
            assert charge_of(result) == charged[0]["charge"]
    assert any(not r.get("isError") for r in results), results


async def round_one(url: str, who: str, key: str) -> tuple[RawSession, dict[str, Any]]:
    raw = await RawSession(url, MODERN).__aenter__()
    caps = {"io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}}}
    answer = await raw.call("confirmed_charge", {"customer": who, "amount": 7}, meta={KEY_META: key, **caps})
    return raw, answer


async def round_two(raw: RawSession, who: str, key: str | None, first: dict[str, Any],
                    action: str = "accept") -> dict[str, Any]:
    result = first["result"]
    [question] = result["inputRequests"]
    response = {"action": "accept", "content": {"confirm": True}} if action == "accept" else {"action": action}
    caps = {"io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}}}
    params = raw.envelope({
        "name": "confirmed_charge", "arguments": {"customer": who, "amount": 7},
        "_meta": {**({KEY_META: key} if key else {}), **caps},
        "inputResponses": {question: response}, "requestState": result["requestState"],
    })
    body = {"jsonrpc": "2.0", "id": f"round-2-{uuid.uuid4().hex[:6]}", "method": "tools/call", "params": params}
    answer = await raw.client.post(raw.url, json=body, headers=raw.headers("tools/call", "confirmed_charge"))
    return answer_of(answer, body["id"])


async def test_the_question_passes_as_it_came_and_the_state_names_the_call(rig: Rig) -> None:
    key = f"order-{uuid.uuid4()}"
    raw, first = await round_one(rig.url, rig.who or "", key)
    try:
        result = first["result"]
        assert result["resultType"] == "input_required", first
        assert result["inputRequests"], first
        assert result["requestState"].startswith("idemgate.1."), result["requestState"][:40]
        # The second round continues the call, with the server's own state.
        done = await round_two(raw, rig.who or "", key, first)
        assert done["result"]["resultType"] == "complete", done
        charge = done["result"]["structuredContent"]["charge"]
        assert [e["charge"] for e in rig.executions(CHARGED)] == [charge]
        # The round repeated (its answer lost, say) is the completed call's replay.
        again = await round_two(raw, rig.who or "", key, first)
        assert again["result"]["structuredContent"]["charge"] == charge, again
        assert len(rig.executions(CHARGED)) == 1
    finally:
        await raw.__aexit__()


async def test_a_forged_state_or_a_round_without_its_key_is_refused_and_never_forwarded(rig: Rig) -> None:
    key = f"order-{uuid.uuid4()}"
    raw, first = await round_one(rig.url, rig.who or "", key)
    try:
        state = first["result"]["requestState"]
        first["result"]["requestState"] = "idemgate.1.not-a-call.x"
        refused = await round_two(raw, rig.who or "", key, first)
        assert problem_type(refused["result"]) == "invalid-request", refused
        # Nor a round that drops the key: unguarded, it would act outside its call.
        first["result"]["requestState"] = state
        keyless = await round_two(raw, rig.who or "", None, first)
        assert problem_type(keyless["result"]) == "invalid-request", keyless
        assert rig.executions(CHARGED) == []
    finally:
        await raw.__aexit__()


async def test_a_call_nobody_continues_is_released_at_its_lease_end(tmp_path: Any, servers: Any) -> None:
    """Lease of 6 s (--upstream-timeout 1, plus 5): until it ends the key is
    the asking call's (a whole new call with it is refused in flight, and the
    key is not unknown); after, a whole new call is asked afresh and charges once."""
    shared = servers["json"]
    rig = Rig(tmp_path, json_response=True, server_port=shared.port, shared_log=shared.log,
              who=f"c-{uuid.uuid4().hex[:10]}")
    try:
        rig.start_proxy("--upstream-timeout", "1", "--default-wait", "0")
        key = f"order-{uuid.uuid4()}"
        raw, first = await round_one(rig.url, rig.who or "", key)
        await raw.__aexit__()
        assert first["result"]["resultType"] == "input_required", first
        started = time.monotonic()
        refused = await call(rig.url, rig.who or "", key, User())
        assert problem_type(refused) == "request-in-flight", refused
        keys = httpx.get(f"{rig.admin}/v1/admin/keys", timeout=10).json()["keys"]
        assert [k["state"] for k in keys] == ["in_flight"], keys
        await asyncio.sleep(max(0.0, 7.5 - (time.monotonic() - started)))
        keys = httpx.get(f"{rig.admin}/v1/admin/keys", params={"state": "unknown"}, timeout=10).json()["keys"]
        assert keys == [], f"a call that asked and was not continued is released, never unknown: {keys}"
        yes = User()
        charge = charge_of(await call(rig.url, rig.who or "", key, yes))
        assert len(yes.questions) == 1
        assert [e["charge"] for e in rig.executions(CHARGED)] == [charge]
    finally:
        rig.stop()


async def test_another_door_on_the_same_store_continues_the_call(tmp_path: Any, servers: Any, database: str) -> None:
    """The reservation is in the store, not in the door's memory: the second
    round through another proxy process on the same PostgreSQL database
    continues the call."""
    shared = servers["event-stream"]
    rig = Rig(tmp_path, json_response=False, server_port=shared.port, shared_log=shared.log,
              who=f"c-{uuid.uuid4().hex[:10]}")
    try:
        rig.database_url = lambda: database  # type: ignore[method-assign]
        door_a = rig.start_proxy()
        door_b = rig.start_proxy()
        key = f"order-{uuid.uuid4()}"
        raw_a, first = await round_one(door_a.url, rig.who or "", key)
        await raw_a.__aexit__()
        raw_b = await RawSession(door_b.url, MODERN).__aenter__()
        try:
            done = await round_two(raw_b, rig.who or "", key, first)
        finally:
            await raw_b.__aexit__()
        charge = done["result"]["structuredContent"]["charge"]
        assert [e["charge"] for e in rig.executions(CHARGED)] == [charge]
        log = (tmp_path / "proxy.log").read_text()
        assert log.count('settled="awaiting_input"') == 1, log[-3000:]
        assert json.dumps(key) not in log, "a raw key never reaches the log"
    finally:
        rig.stop()


async def test_sampling_and_roots_ride_the_same_rounds(rig: Rig) -> None:
    """memo_charge asks the client's model for a memo (sampling) and the
    client for its roots, both in one input_required round: charged once,
    with what the client answered, and the repeat replays without asking."""
    from mcp.types import CreateMessageResult, ListRootsResult, Root, TextContent

    asked: list[str] = []

    async def sampling(_ctx: Any, params: Any) -> CreateMessageResult:
        asked.append("sampling")
        return CreateMessageResult(role="assistant", model="test-model",
                                   content=TextContent(type="text", text="for the blue order"))

    async def roots(_ctx: Any) -> ListRootsResult:
        asked.append("roots")
        return ListRootsResult(roots=[Root(uri="file:///srv/orders")])

    async def noted(key: str) -> dict[str, Any]:
        async with Client(rig.url, sampling_callback=sampling, list_roots_callback=roots) as client:
            assert client.protocol_version == MODERN, client.protocol_version
            result = await client.call_tool("memo_charge", {"customer": rig.who, "amount": 9},
                                            meta={KEY_META: key}, read_timeout_seconds=20)
            return dict(result.model_dump(by_alias=True, mode="json", exclude_none=True))

    key = f"order-{uuid.uuid4()}"
    first = await noted(key)
    assert first.get("isError") is not True, first
    assert first["structuredContent"]["memo"] == "for the blue order", first
    assert first["structuredContent"]["roots"] == ["file:///srv/orders"], first
    assert sorted(asked) == ["roots", "sampling"], asked
    asked.clear()
    repeat = await noted(key)
    assert repeat["structuredContent"] == first["structuredContent"], repeat
    assert asked == [], "a completed call is replayed, never asked again"
    assert len(rig.executions("memo_charge")) == 1
