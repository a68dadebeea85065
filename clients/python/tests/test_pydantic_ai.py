"""pydantic-ai (the real library; the model is a FunctionModel that follows a
script, no LLM) with a tool that charges through a guard on a real `idemgate
serve`, against a payments API that counts its charges: with the key from
the application's own id every scenario charges once, and the keys that
pydantic-ai numbers (tool_call_id, run_step, run_id) are shown to charge
again, as measured.

Runs on the SQLite store only (which key a tool gets is what is tested here;
the guard's behaviour per store is test_guard.py's). No `from __future__
import annotations`: pydantic-ai reads the tools' annotations."""

import asyncio
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

import httpx
import pytest
from pydantic_ai import Agent, ModelRetry, RunContext
from pydantic_ai.exceptions import UnexpectedModelBehavior
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from idemgate_client import AsyncClient, AsyncGuard, Client, Guard, InFlight, KeyReused, derive_key
from idemgate_client.pydantic_ai import MissingOperation, Operation, idempotent_tool

from conftest import TOKEN, Origin

sqlite_only = pytest.mark.parametrize("server", ["sqlite"], indirect=True)
pytestmark = sqlite_only


@dataclass
class Deps:
    payments: str
    operation: Operation | None = None


@pytest.fixture
def origin() -> Iterator[Origin]:
    payments = Origin()
    yield payments
    payments.close()


def order() -> Operation:
    return Operation(tenant="acme", id=f"order-{time.monotonic_ns()}")


def total(origin: Origin) -> int:
    return sum(origin.charges.values())


def settled(origin: Origin, expected: int, within: float = 3.0) -> int:
    """The charge count once the payments API's slow charges have landed."""
    deadline = time.monotonic() + within
    while total(origin) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    return total(origin)


class Script:
    """The model: each request gets the next response of the script; it
    writes down what the tools returned (and whether it was a retry prompt)."""

    def __init__(self, *steps: dict[str, Any] | str) -> None:
        self.steps = list(steps)
        self.returns: list[tuple[Any, bool]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        for part in messages[-1].parts:
            if isinstance(part, ToolReturnPart):
                self.returns.append((part.content, part.retry is not None))
        step = self.steps.pop(0) if self.steps else "done"
        if isinstance(step, str):
            return ModelResponse(parts=[TextPart(step)])
        return ModelResponse(parts=[ToolCallPart("charge", step)])

    def charges(self) -> list[Any]:
        """What the successful tool calls returned."""
        return [content for content, retry in self.returns if not retry]


def charge_body(path: str = "/charges") -> Callable[..., Awaitable[dict[str, Any]]]:
    """The tool's body: refuses a bad amount before acting (ModelRetry), else charges."""

    async def charge(ctx: RunContext[Deps], amount: int) -> dict[str, Any]:
        if amount <= 0:
            raise ModelRetry("the amount must be positive")
        op = ctx.deps.operation
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(f"{ctx.deps.payments}{path}", json={"amount": amount},
                                     headers={"idempotency-key": op.id if op else "none"})
        answer.raise_for_status()
        result: dict[str, Any] = answer.json()
        return result

    return charge


def keyed_on(guard: AsyncGuard, source: str) -> Callable[[Any], Any]:
    """The wrong adapter: a key from what pydantic-ai numbers: the ``tool_call_id``;
    the run's ``run_step`` (in its ``run_id``); the ``run_id``."""

    def decorate(fn: Any) -> Any:
        @functools.wraps(fn)
        async def tool(ctx: RunContext[Deps], amount: int) -> Any:
            run, step = {
                "tool_call_id": (ctx.tool_call_id, 1),
                "run_step": (ctx.run_id, ctx.run_step),
                "run_id": (ctx.run_id, 1),
            }[source]
            key = derive_key(tenant="acme", run=str(run), step=step, tool="charge")
            return await guard.run(key, lambda _: fn(ctx, amount),
                                   request={"method": "POST", "path": "/tools/charge", "body": {"amount": amount}})

        return tool

    return decorate


def agent_with(script: Script, wrap: Callable[[Any], Any], body: Any, *, timeout: float | None = None,
               retries: int = 3) -> "Agent[Deps, str]":
    agent: Agent[Deps, str] = Agent(FunctionModel(script), deps_type=Deps)
    agent.tool(timeout=timeout, retries=retries)(wrap(body))
    return agent


def run(server: Any, scenario: Callable[[AsyncGuard], Awaitable[Any]], **guard: Any) -> Any:
    async def main() -> Any:
        async with AsyncClient(server.base_url, token=TOKEN) as idem:
            return await scenario(AsyncGuard(idem, **guard))

    return asyncio.run(main())


# --- a model that repeats the call ---------------------------------------------------------


def test_a_model_that_repeats_the_call_charges_once(server, origin):
    script = Script({"amount": 500}, {"amount": 500}, {"amount": 500}, "done")

    async def scenario(guard: AsyncGuard) -> None:
        agent = agent_with(script, idempotent_tool(guard), charge_body())
        await agent.run("charge the order", deps=Deps(origin.url, order()))

    run(server, scenario)
    assert total(origin) == 1
    first, *again = script.charges()
    assert again == [first, first]  # the repeats get the first charge back


@pytest.mark.parametrize("source", ["tool_call_id", "run_step"])
def test_a_key_from_the_tool_call_id_or_the_run_step_charges_every_repeat(server, origin, source):
    script = Script({"amount": 500}, {"amount": 500}, {"amount": 500}, "done")

    async def scenario(guard: AsyncGuard) -> None:
        agent = agent_with(script, keyed_on(guard, source), charge_body())
        await agent.run("charge the order", deps=Deps(origin.url, order()))

    run(server, scenario)
    assert total(origin) == 3


def test_the_same_operation_with_another_amount_is_key_reused_out_of_the_run(server, origin):
    script = Script({"amount": 500}, {"amount": 700}, "done")

    async def scenario(guard: AsyncGuard) -> None:
        agent = agent_with(script, idempotent_tool(guard), charge_body())
        with pytest.raises(KeyReused):
            await agent.run("charge the order", deps=Deps(origin.url, order()))

    run(server, scenario)
    assert total(origin) == 1


# --- ModelRetry --------------------------------------------------------------------------


def model_retry_after_the_charge(server: Any, origin: Origin, wrap: Callable[[AsyncGuard], Any]) -> Script:
    """The output validator refuses the first answer (ModelRetry): the model plans again and calls the tool again."""
    script = Script({"amount": 500}, "done", {"amount": 500}, "done with the charge id")

    async def scenario(guard: AsyncGuard) -> None:
        agent = agent_with(script, wrap(guard), charge_body())
        refused = {"left": 1}

        @agent.output_validator
        def validate(output: str) -> str:
            if refused["left"]:
                refused["left"] -= 1
                raise ModelRetry("say which charge you made")
            return output

        await agent.run("charge the order", deps=Deps(origin.url, order()))

    run(server, scenario)
    return script


def test_a_model_retry_after_the_charge_charges_once(server, origin):
    script = model_retry_after_the_charge(server, origin, idempotent_tool)
    assert total(origin) == 1 and len(set(map(str, script.charges()))) == 1


def test_a_key_from_the_run_step_charges_again_after_a_model_retry(server, origin):
    model_retry_after_the_charge(server, origin, lambda guard: keyed_on(guard, "run_step"))
    assert total(origin) == 2


def test_a_model_retry_the_tool_raises_before_acting_releases_the_key(server, origin):
    script = Script({"amount": -5}, {"amount": 500}, "done")

    async def scenario(guard: AsyncGuard) -> None:
        agent = agent_with(script, idempotent_tool(guard), charge_body())
        await agent.run("charge the order", deps=Deps(origin.url, order()))

    run(server, scenario)
    # The refused call was a retry prompt; the corrected one charged, under the same key (no 422).
    assert [retry for _, retry in script.returns] == [True, False] and total(origin) == 1


# --- a timeout ---------------------------------------------------------------------------


def test_a_tool_timeout_waits_for_the_charge_instead_of_charging_again(server, origin):
    script = Script({"amount": 500}, {"amount": 500}, "done")

    async def scenario(guard: AsyncGuard) -> None:
        # The second call must get the charge within its own timeout: it starts
        # when the first times out (1 s) and the charge ends at 1.3 s, which
        # leaves it 0.7 s on a busy machine (0.1 s with 0.5 s and 900 ms did not).
        agent = agent_with(script, idempotent_tool(guard), charge_body("/slow/1300"), timeout=1.0)
        await agent.run("charge the order", deps=Deps(origin.url, order()))

    run(server, scenario)
    # The first call timed out (a retry prompt); its charge ran on, and the model's
    # second call waited for it and got it.
    assert [retry for _, retry in script.returns] == [True, False]
    assert script.charges()[0]["charge"] == "ch_1" and settled(origin, 1) == 1


def test_a_key_from_the_tool_call_id_charges_again_after_a_timeout(server, origin):
    script = Script({"amount": 500}, {"amount": 500}, "done")

    async def scenario(guard: AsyncGuard) -> None:
        agent = agent_with(script, keyed_on(guard, "tool_call_id"), charge_body("/slow/900"), timeout=0.5)
        await agent.run("charge the order", deps=Deps(origin.url, order()))

    run(server, scenario)
    assert settled(origin, 2) == 2


def test_without_a_wait_a_timeout_becomes_409s_that_exhaust_the_tool_retries(server, origin):
    # The right key, but a 409 handed to the model as a ModelRetry at once, and
    # the timed-out call cut off: the run fails, though the charge went through.
    script = Script(*([{"amount": 500}] * 6), "done")

    def no_wait(guard: AsyncGuard) -> Callable[[Any], Any]:
        def decorate(fn: Any) -> Any:
            @functools.wraps(fn)
            async def tool(ctx: RunContext[Deps], amount: int) -> Any:
                key = derive_key(tenant="acme", run=ctx.deps.operation.id, step=1, tool="charge")
                try:
                    return await guard.run(key, lambda _: fn(ctx, amount),
                                           request={"method": "POST", "path": "/tools/charge", "body": {"amount": amount}})
                except InFlight as busy:
                    raise ModelRetry("the charge is in flight (409): try again") from busy

            return tool

        return decorate

    async def scenario(guard: AsyncGuard) -> None:
        agent = agent_with(script, no_wait(guard), charge_body("/slow/900"), timeout=0.5, retries=3)
        with pytest.raises(UnexpectedModelBehavior, match="exceeded max retries"):
            await agent.run("charge the order", deps=Deps(origin.url, order()))

    run(server, scenario, wait_budget=0)
    assert len(script.returns) == 3  # the timeout, then 409s, until the retries ran out
    assert settled(origin, 1) == 1


# --- the application runs the agent again ----------------------------------------------


def rerun(server: Any, origin: Origin, wrap: Callable[[AsyncGuard], Any]) -> list[Any]:
    operation = order()
    seen: list[Any] = []

    async def scenario(guard: AsyncGuard) -> None:
        for _ in range(2):  # the first run "crashed" after its charge; the application runs it again
            script = Script({"amount": 500}, "done")
            agent = agent_with(script, wrap(guard), charge_body())
            await agent.run("charge the order", deps=Deps(origin.url, operation))
            seen.extend(script.charges())

    run(server, scenario)
    return seen


def test_the_application_running_the_agent_again_charges_once(server, origin):
    first, second = rerun(server, origin, idempotent_tool)
    assert first == second and total(origin) == 1


def test_a_key_from_the_run_id_charges_again_when_the_agent_runs_again(server, origin):
    first, second = rerun(server, origin, lambda guard: keyed_on(guard, "run_id"))
    assert first != second and total(origin) == 2


def test_two_runs_at_once_for_one_operation_charge_once_the_second_waits(server, origin):
    # Two workers (threads, each with its own event loop and client) run the
    # agent for the same order at once: the second waits through idemgate.
    operation, results, errors = order(), [], []

    def worker() -> None:
        script = Script({"amount": 500}, "done")

        async def scenario(guard: AsyncGuard) -> None:
            agent = agent_with(script, idempotent_tool(guard), charge_body("/slow/600"))
            await agent.run("charge the order", deps=Deps(origin.url, operation))

        try:
            run(server, scenario)
            results.extend(script.charges())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    workers = [threading.Thread(target=worker) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == [] and len(results) == 2 and results[0] == results[1] and total(origin) == 1


# --- no application id -------------------------------------------------------------------


def test_without_an_operation_in_the_deps_the_tool_refuses_clearly(server, origin):
    script = Script({"amount": 500}, "done")

    async def scenario(guard: AsyncGuard) -> None:
        agent = agent_with(script, idempotent_tool(guard), charge_body())
        with pytest.raises(MissingOperation, match="never made from tool_call_id"):
            await agent.run("charge the order", deps=Deps(origin.url, None))

    run(server, scenario)
    assert total(origin) == 0


def test_a_sync_tool_with_a_guard_charges_once_per_operation(server, origin):
    script = Script({"amount": 500}, {"amount": 500}, "done")

    def charge(ctx: RunContext[Deps], amount: int) -> dict[str, Any]:
        answer = httpx.post(f"{ctx.deps.payments}/charges", json={"amount": amount},
                            headers={"idempotency-key": ctx.deps.operation.id}, timeout=5)
        result: dict[str, Any] = answer.json()
        return result

    with Client(server.base_url, token=TOKEN) as idem:
        agent: Agent[Deps, str] = Agent(FunctionModel(script), deps_type=Deps)
        agent.tool(idempotent_tool(Guard(idem), tool="charge")(charge))
        agent.run_sync("charge the order", deps=Deps(origin.url, order()))
    assert total(origin) == 1 and script.charges()[0] == script.charges()[1]
