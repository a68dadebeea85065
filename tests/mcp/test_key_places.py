"""Where the door reads a call's key (IDEMGATE_MCP_KEY_FROM, docs/mcp.md "Where
the key is read from"), through the official Python client in each of its ways
to connect, against both of the server's answer forms: the agentic commerce
protocols' `_meta["idempotency-key"]` (UCP) and `_meta.idempotency_key` (ACP),
a camelCase `idempotencyKey` argument, a runtime's key beating a model's in
one call, and a list of the operator's own.

    IDEMGATE_BIN=target/debug/idemgate python -m pytest tests/mcp/test_key_places.py
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from door_rig import Rig
from official import problem_type, session

mcp1 = pytest.mark.mcp1  # also run with mcp 1.x (.ci/mcp: -m mcp1)


def key() -> str:
    return f"step-{uuid.uuid4()}"


def charges(results: list[dict[str, Any]]) -> list[str]:
    assert not any(r.get("isError") for r in results), results
    return [r["structuredContent"]["charge"] for r in results]


@mcp1
@pytest.mark.parametrize("meta_key", ["idempotency-key", "idempotency_key"])
def test_the_commerce_protocols_meta_keys_are_guarded(rig: Rig, mode: str, meta_key: str) -> None:
    k = key()

    async def go() -> list[dict[str, Any]]:
        async with session(rig.url, mode) as s:
            args = {"customer": rig.who, "amount": 300}
            calls = [await s.call("charge", args, meta={meta_key: k}) for _ in range(2)]
            calls.append(await s.call("charge", {**args, "amount": 301}, meta={meta_key: k}))
            return calls

    first, repeat, other = asyncio.run(go())
    assert charges([first]) == charges([repeat])
    assert problem_type(other) == "key-reused"
    assert len(rig.executions("charge")) == 1


@mcp1
def test_a_camel_case_argument_is_guarded_and_never_reaches_the_server(rig: Rig, mode: str) -> None:
    k = key()

    async def go() -> list[dict[str, Any]]:
        async with session(rig.url, mode) as s:
            await s.list_tools()
            args = {"customer": rig.who, "amount": 400, "idempotencyKey": k}
            return [await s.call("charge", args) for _ in range(3)]

    results = asyncio.run(go())
    assert len(set(charges(results))) == 1
    executed = rig.executions("charge")
    assert len(executed) == 1
    assert "idempotencyKey" not in executed[0]


def test_a_runtimes_key_beats_a_models_and_they_never_meet(rig: Rig, mode: str) -> None:
    runtime, model = key(), key()

    async def go() -> list[dict[str, Any]]:
        async with session(rig.url, mode) as s:
            args = {"customer": rig.who, "amount": 500}
            return [
                # Both: the runtime's key is the call's, the model's is dropped.
                await s.call("charge", {**args, "idempotencyKey": model}, meta={"idempotency-key": runtime}),
                # The runtime's key alone: the same call, replayed.
                await s.call("charge", args, meta={"idempotency-key": runtime}),
                # The model's key alone: no call had it, so this one runs.
                await s.call("charge", {**args, "idempotencyKey": model}),
                # The runtime's key sent by a model: its own scope, it runs.
                await s.call("charge", {**args, "idempotencyKey": runtime}),
                await s.call("charge", {**args, "idempotencyKey": runtime}),
            ]

    both, runtime_again, model_alone, model_runtime, model_runtime_again = charges(asyncio.run(go()))
    assert runtime_again == both
    assert len({both, model_alone, model_runtime}) == 3
    assert model_runtime_again == model_runtime
    assert len(rig.executions("charge")) == 3


def test_a_list_of_ones_own_is_read_as_it_says(rig: Rig, mode: str) -> None:
    rig.start_proxy("--mcp-key-from", "meta:order-key,argument:requestId")
    k = key()

    async def go() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        async with session(rig.url, mode) as s:
            schemas = await s.list_tools()
            args = {"customer": rig.who, "amount": 600}
            calls = [await s.call("charge", args, meta={"order-key": k}) for _ in range(2)]
            calls += [await s.call("charge", {**args, "requestId": k}) for _ in range(2)]
            # idemgate's own _meta key is not in this list: no key, each runs.
            calls += [await s.call("charge", args, meta={"dev.idemgate/idempotency-key": k}) for _ in range(2)]
            return schemas, calls

    schemas, calls = asyncio.run(go())
    assert "requestId" in schemas["charge"]["properties"]
    assert "idempotency_key" not in schemas["charge"]["properties"]
    ran = charges(calls)
    assert ran[0] == ran[1]
    assert ran[2] == ran[3] != ran[0]
    assert len(set(ran[4:])) == 2
    assert len(rig.executions("charge")) == 4
