"""LangGraph (the real library, no LLM) with a node that charges through a
guard on a real `idemgate serve`, against a payments API that counts its
charges: every scenario charges exactly once with the task key, and the
naive keys are shown to fail as measured.

Runs on the SQLite store only: what is tested here is which key a node
gets; the guard's behaviour on each store is test_guard.py's."""

from __future__ import annotations

import asyncio
import json
import operator
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Iterator, TypedDict

import httpx
import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.errors import NodeTimeoutError
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import Command, RetryPolicy, interrupt

from idemgate_client import (
    AsyncClient,
    AsyncGuard,
    Client,
    Guard,
    Holding,
    InFlight,
    KeyReused,
    NotExecuted,
    OutcomeUnknown,
    Reconciled,
    RequestInFlight,
    derive_key,
)
from idemgate_client.errors import LeaseLost, StoreUnavailable
from idemgate_client.langgraph import (
    arun_in_node,
    guarded_node,
    retry_on,
    retry_policy,
    run_in_node,
    task_identity,
    task_key,
)

from conftest import TOKEN, Origin, closed_port, settle

sqlite_only = pytest.mark.parametrize("server", ["sqlite"], indirect=True)


class State(TypedDict, total=False):
    amount: int
    charge: str
    confirmed: str
    log: Annotated[list[str], operator.add]


@pytest.fixture
def origin() -> Iterator[Origin]:
    payments = Origin()
    yield payments
    payments.close()


@pytest.fixture
def client(server: Any) -> Iterator[Client]:
    with Client(server.base_url, token=TOKEN) as c:
        yield c


def pay(origin: Origin, key: str, amount: int, path: str = "/charges") -> dict[str, Any]:
    """One charge at the payments API (which counts it under ``key``)."""
    answer = httpx.post(f"{origin.url}{path}", json={"amount": amount}, headers={"idempotency-key": key}, timeout=5)
    if answer.status_code in (429, 503):
        # Refused before charging: the key is released, and the cause says why.
        raise NotExecuted("the payments API is busy") from httpx.HTTPStatusError(
            "busy", request=answer.request, response=answer
        )
    answer.raise_for_status()
    charge: dict[str, Any] = answer.json()
    return charge


def find_charge(origin: Origin, key: str) -> Reconciled[dict[str, Any]] | None:
    """A reconcile: asks the payments API whether the earlier attempt charged."""
    answer = httpx.get(f"{origin.url}/charges", headers={"idempotency-key": key}, timeout=5)
    return Reconciled(answer.json()) if answer.status_code == 200 else None


def charge_request(amount: int) -> dict[str, Any]:
    return {"method": "POST", "path": "/charges", "body": {"amount": amount}}


def total(origin: Origin) -> int:
    return sum(origin.charges.values())


def thread() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"order-{uuid.uuid4()}"}}


# --- the key ---------------------------------------------------------------------------


def test_the_task_key_is_the_same_from_the_config_and_the_runtime_and_needs_a_thread():
    seen: list[tuple[str, str, str]] = []

    def node(state: State, config: RunnableConfig, runtime: Runtime) -> State:
        seen.append((
            task_key(config, tenant="acme", tool="charge"),
            task_key(runtime, tenant="acme", tool="charge"),
            task_identity(config)[1],
        ))
        return {}

    graph = StateGraph(State)
    graph.add_node("charge", node)
    graph.add_edge(START, "charge")
    graph.add_edge("charge", END)
    app = graph.compile(checkpointer=InMemorySaver())
    config = thread()
    app.invoke({"amount": 1}, config)
    app.invoke({"amount": 1}, config)
    (a, b, ns1), (c, _, ns2) = seen
    assert a == b and ns1.startswith("charge:") and ns2.startswith("charge:")
    assert a != c  # the next turn on the thread is another task
    thread_id = config["configurable"]["thread_id"]
    assert a == derive_key(tenant="acme", run=thread_id, step=ns1, tool="charge")

    # No thread, no key that survives a resume; durability="exit" loses the task id in a crash.
    with pytest.raises(ValueError, match="thread_id"):
        graph.compile().invoke({"amount": 1})
    with pytest.raises(ValueError, match="durability"):
        app.invoke({"amount": 1}, thread(), durability="exit")
    with pytest.raises(ValueError, match="task identity"):
        task_key({"configurable": {"thread_id": "t"}}, tenant="acme", tool="charge")


def test_retry_on_follows_the_retry_table():
    request = httpx.Request("POST", "http://payments/charges")

    def status(code: int, slug: str | None = None) -> httpx.HTTPStatusError:
        body = {"type": f"https://idemgate.dev/problems/{slug}"} if slug else {}
        response = httpx.Response(code, json=body, headers={"content-type": "application/problem+json"}, request=request)
        return httpx.HTTPStatusError(str(code), request=request, response=response)

    def problem(cls: type, slug: str, code: int = 409) -> Exception:
        return cls(code, {"type": slug}, None)

    def not_executed(cause: BaseException) -> NotExecuted:
        try:
            raise NotExecuted("refused before acting") from cause
        except NotExecuted as e:
            return e

    retried = [
        httpx.ReadTimeout("timed out", request=request),
        httpx.ConnectError("refused", request=request),
        httpx.RemoteProtocolError("hung up", request=request),
        status(502), status(503), status(504), status(429),
        status(409, "request-in-flight"), status(409),
        problem(RequestInFlight, "request-in-flight"), problem(StoreUnavailable, "store-unavailable", 503),
        InFlight("k", 30.0, None),
        ConnectionError("reset"), TimeoutError("slow"),
        NodeTimeoutError("charge", 31.0, kind="run", run_timeout=30.0),
        not_executed(status(503)),
    ]
    stopped = [
        status(409, "outcome-unknown"), status(422), status(400), status(500),
        problem(OutcomeUnknown, "outcome-unknown"), problem(KeyReused, "key-reused", 422),
        problem(LeaseLost, "lease-lost"),
        NotExecuted("declined"), not_executed(status(402)),
        ValueError("a bug"), KeyError("a bug"),
    ]
    assert [e for e in retried if not retry_on(e)] == []
    assert [e for e in stopped if retry_on(e)] == []
    policy = retry_policy()
    assert isinstance(policy, RetryPolicy) and policy.retry_on is retry_on

    # LangGraph's own default: no 409 at all, and OutcomeUnknown and KeyReused again and again.
    default = RetryPolicy().retry_on
    assert callable(default)
    assert not default(status(409, "request-in-flight"))
    assert default(problem(OutcomeUnknown, "outcome-unknown")) and default(problem(KeyReused, "key-reused", 422))


# --- (a) several turns on one thread ----------------------------------------------------


def charge_graph(guard: Guard, origin: Origin, key_of: Any = None, *, retry: RetryPolicy | None = None):
    """start → charge → end, the charge guarded under ``key_of(config, runtime)``
    (default: the task key)."""

    def charge(state: State, config: RunnableConfig, runtime: Runtime) -> State:
        key = key_of(config, runtime) if key_of else task_key(config, tenant="acme", tool="charge")
        result = guard.run(key, lambda _: pay(origin, key, state["amount"]), request=charge_request(state["amount"]))
        return {"charge": result["charge"]}

    graph = StateGraph(State)
    graph.add_node("charge", charge, retry_policy=retry)
    graph.add_edge(START, "charge")
    graph.add_edge("charge", END)
    return graph


@sqlite_only
def test_each_turn_on_a_thread_charges_once(client, origin):
    app = charge_graph(Guard(client), origin).compile(checkpointer=InMemorySaver())
    config = thread()
    charges = [app.invoke({"amount": amount}, config)["charge"] for amount in (500, 500, 700)]
    assert len(set(charges)) == 3
    assert sorted(origin.charges.values()) == [1, 1, 1]  # 3 turns, 3 charges, each once


@sqlite_only
def test_a_key_from_the_thread_and_the_node_name_replays_the_next_turn(client, origin):
    # The wrong key: the same on every turn of the thread.
    def naive(config: RunnableConfig, runtime: Runtime) -> str:
        return derive_key(tenant="acme", run=config["configurable"]["thread_id"], step="charge", tool="charge")

    app = charge_graph(Guard(client), origin, naive).compile(checkpointer=InMemorySaver())
    config = thread()
    first = app.invoke({"amount": 500}, config)["charge"]
    second = app.invoke({"amount": 500}, config)["charge"]
    # Turn 2's real charge is silently answered with turn 1's: never made.
    assert second == first and total(origin) == 1
    with pytest.raises(KeyReused):
        app.invoke({"amount": 700}, config)  # turn 3, another amount: 422
    assert total(origin) == 1


# --- (b) interrupt and resume ----------------------------------------------------------


def charge_then_confirm(guard: Guard, origin: Origin, key_of: Any = None):
    """A node that charges, then asks a person (interrupt); the resume runs the node again from its top."""
    runs = {"node": 0}

    def charge(state: State, config: RunnableConfig, runtime: Runtime) -> State:
        runs["node"] += 1
        if key_of is None:
            key = task_key(config, tenant="acme", tool="charge")
            result = run_in_node(guard, config, lambda _: pay(origin, key, state["amount"]),
                                 tenant="acme", tool="charge", request=charge_request(state["amount"]))
        else:
            key = key_of(config, runtime)
            result = guard.run(key, lambda _: pay(origin, key, state["amount"]), request=charge_request(state["amount"]))
        answer = interrupt({"charged": result["charge"], "question": "ship it?"})
        return {"charge": result["charge"], "confirmed": answer}

    graph = StateGraph(State)
    graph.add_node("charge", charge)
    graph.add_edge(START, "charge")
    graph.add_edge("charge", END)
    return graph.compile(checkpointer=InMemorySaver()), runs


@sqlite_only
def test_an_interrupt_and_its_resume_charge_once(client, origin):
    app, runs = charge_then_confirm(Guard(client), origin)
    config = thread()
    paused = app.invoke({"amount": 500}, config)
    charged = paused["__interrupt__"][0].value["charged"]
    done = app.invoke(Command(resume="yes"), config)
    assert done["charge"] == charged and done["confirmed"] == "yes"
    assert runs["node"] == 2 and total(origin) == 1


@sqlite_only
def test_a_key_from_the_run_id_charges_again_on_resume(client, origin):
    # The wrong key: each invoke is a run of its own (LangGraph Platform gives every run an id).
    def naive(config: RunnableConfig, runtime: Runtime) -> str:
        return derive_key(tenant="acme", run=str(runtime.execution_info.run_id), step="charge", tool="charge")

    app, _ = charge_then_confirm(Guard(client), origin, naive)
    config = thread()
    app.invoke({"amount": 500}, {**config, "run_id": uuid.uuid4()})
    app.invoke(Command(resume="yes"), {**config, "run_id": uuid.uuid4()})
    assert total(origin) == 2


# --- (c) RetryPolicy --------------------------------------------------------------------


@sqlite_only
def test_the_retry_policy_retries_a_refused_charge_and_it_charges_once(client, origin):
    attempts: list[int] = []

    @guarded_node(Guard(client), tenant="acme", tool="charge", request=lambda state: charge_request(state["amount"]))
    def charge(holding: Holding, state: State, config: RunnableConfig) -> State:
        attempts.append(1)
        key = task_key(config, tenant="acme", tool="charge")
        return {"charge": pay(origin, key, state["amount"], "/flaky")["charge"]}  # 503 first

    graph = StateGraph(State)
    graph.add_node("charge", charge, retry_policy=retry_policy(initial_interval=0.05))
    graph.add_edge(START, "charge")
    graph.add_edge("charge", END)
    done = graph.compile(checkpointer=InMemorySaver()).invoke({"amount": 500}, thread())
    assert done["charge"].startswith("ch_")
    assert len(attempts) == 2 and total(origin) == 1


@sqlite_only
def test_the_retry_policy_retries_a_refused_connection_and_it_charges_once(client, origin):
    # A connection refused proves the charge never went out: the guard
    # releases the key, and the retry of the same task runs the effect.
    attempts: list[int] = []
    nobody = f"http://127.0.0.1:{closed_port()}"

    @guarded_node(Guard(client), tenant="acme", tool="charge", request=lambda state: charge_request(state["amount"]))
    def charge(holding: Holding, state: State, config: RunnableConfig) -> State:
        attempts.append(1)
        key = task_key(config, tenant="acme", tool="charge")
        answer = httpx.post(f"{nobody if len(attempts) == 1 else origin.url}/charges",
                            json={"amount": state["amount"]}, headers={"idempotency-key": key}, timeout=5)
        return {"charge": answer.json()["charge"]}

    graph = StateGraph(State)
    graph.add_node("charge", charge, retry_policy=retry_policy(initial_interval=0.05))
    graph.add_edge(START, "charge")
    graph.add_edge("charge", END)
    done = graph.compile(checkpointer=InMemorySaver()).invoke({"amount": 500}, thread())
    assert done["charge"].startswith("ch_")
    assert len(attempts) == 2 and total(origin) == 1


@sqlite_only
def test_a_read_timeout_after_the_charge_is_outcome_unknown_on_the_retry_at_once(client, origin):
    # No reconcile: the guard marks the key unknown when the effect's read
    # times out, so the retry RetryPolicy makes gets OutcomeUnknown at once
    # (never retried) instead of waiting 30 s for a key nobody will commit.
    attempts: list[int] = []

    @guarded_node(Guard(client, lease_seconds=30, wait_budget=30), tenant="acme", tool="charge",
                  request=lambda state: charge_request(state["amount"]))
    def charge(holding: Holding, state: State, config: RunnableConfig) -> State:
        attempts.append(1)
        key = task_key(config, tenant="acme", tool="charge")
        answer = httpx.post(f"{origin.url}/stall/3000", json={"amount": state["amount"]},
                            headers={"idempotency-key": key}, timeout=httpx.Timeout(5.0, read=0.5))
        return {"charge": answer.json()["charge"]}

    graph = StateGraph(State)
    graph.add_node("charge", charge, retry_policy=retry_policy(initial_interval=0.05))
    graph.add_edge(START, "charge")
    graph.add_edge("charge", END)
    started = time.monotonic()
    with pytest.raises(OutcomeUnknown) as unknown:
        graph.compile(checkpointer=InMemorySaver()).invoke({"amount": 500}, thread())
    assert time.monotonic() - started < 5
    assert unknown.value.dead_letter_reason == "outcome_unknown"
    assert len(attempts) == 1 and total(origin) == 1


def lost_answer_graph(guard: Guard, origin: Origin, key_of: Any, attempts: list[int], retry: RetryPolicy):
    """The charge goes through, its answer is lost (the connection drops): the retry must not charge again."""

    def charge(state: State, config: RunnableConfig, runtime: Runtime) -> State:
        attempts.append(runtime.execution_info.node_attempt)
        key = key_of(config, runtime)
        result = guard.run(
            key,
            lambda _: pay(origin, key, state["amount"], "/hangup" if len(attempts) == 1 else "/charges"),
            request=charge_request(state["amount"]),
            reconcile=lambda _: find_charge(origin, key),
        )
        return {"charge": result["charge"]}

    graph = StateGraph(State)
    graph.add_node("charge", charge, retry_policy=retry)
    graph.add_edge(START, "charge")
    graph.add_edge("charge", END)
    return graph.compile(checkpointer=InMemorySaver())


@sqlite_only
def test_the_retry_policy_after_a_lost_answer_reconciles_and_charges_once(client, origin):
    attempts: list[int] = []
    app = lost_answer_graph(Guard(client, lease_seconds=1, wait_budget=15), origin,
                            lambda config, runtime: task_key(config, tenant="acme", tool="charge"),
                            attempts, retry_policy(initial_interval=0.05))
    done = app.invoke({"amount": 500}, thread())
    # Attempt 2 waits out attempt 1's lease, takes the key over and finds the charge.
    assert attempts == [1, 2] and total(origin) == 1
    assert done["charge"] == json.loads(next(iter(origin.answers.values())))["charge"]


@sqlite_only
def test_a_key_with_the_retry_counter_charges_again_on_retry(client, origin):
    attempts: list[int] = []

    def naive(config: RunnableConfig, runtime: Runtime) -> str:
        return derive_key(tenant="acme", run=config["configurable"]["thread_id"],
                          step=f"charge-{runtime.execution_info.node_attempt}", tool="charge")

    app = lost_answer_graph(Guard(client, lease_seconds=1), origin, naive, attempts, retry_policy(initial_interval=0.05))
    app.invoke({"amount": 500}, thread())
    assert attempts == [1, 2] and total(origin) == 2


# --- (d) an exception after the charge, and the resume from the checkpoint ---------------


@sqlite_only
def test_an_exception_after_the_guarded_charge_resumes_to_the_same_charge(client, origin):
    failures = {"left": 1}

    def charge(state: State, config: RunnableConfig) -> State:
        key = task_key(config, tenant="acme", tool="charge")
        result = run_in_node(Guard(client), config, lambda _: pay(origin, key, state["amount"]),
                             tenant="acme", tool="charge", request=charge_request(state["amount"]))
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("the receipt could not be rendered")  # after the charge, in the node
        return {"charge": result["charge"]}

    graph = StateGraph(State)
    graph.add_node("charge", charge)
    graph.add_edge(START, "charge")
    graph.add_edge("charge", END)
    app = graph.compile(checkpointer=InMemorySaver())
    config = thread()
    with pytest.raises(RuntimeError):
        app.invoke({"amount": 500}, config)
    done = app.invoke(None, config)  # resume from the checkpoint
    assert done["charge"].startswith("ch_") and total(origin) == 1


def crash_in_effect_graph(guard: Guard, origin: Origin, crashes: dict[str, int], reconcile: bool):
    """The effect charges and then raises, inside the guard: it may have acted (it did)."""

    def charge(state: State, config: RunnableConfig) -> State:
        key = task_key(config, tenant="acme", tool="charge")

        def effect(_: Holding) -> dict[str, Any]:
            result = pay(origin, key, state["amount"])
            if crashes["left"]:
                crashes["left"] -= 1
                raise RuntimeError("the answer could not be parsed")  # after the charge, in the effect
            return result

        result = run_in_node(guard, config, effect, tenant="acme", tool="charge",
                             request=charge_request(state["amount"]),
                             reconcile=(lambda _: find_charge(origin, key)) if reconcile else None)
        return {"charge": result["charge"]}

    graph = StateGraph(State)
    graph.add_node("charge", charge, retry_policy=retry_policy(initial_interval=0.05))
    graph.add_edge(START, "charge")
    graph.add_edge("charge", END)
    return graph.compile(checkpointer=InMemorySaver())


@sqlite_only
def test_an_effect_that_raised_after_charging_is_outcome_unknown_on_resume_until_settled(client, origin, server):
    # The default guard (hold): the resume never runs the effect again by itself.
    guard = Guard(client, lease_seconds=30, wait_budget=10)
    app = crash_in_effect_graph(guard, origin, {"left": 1}, reconcile=False)
    config = thread()
    with pytest.raises(RuntimeError):
        app.invoke({"amount": 500}, config)  # RuntimeError is not retried: not in the table
    started = time.monotonic()
    with pytest.raises(OutcomeUnknown) as unknown:
        # The guard marked the key unknown when the effect raised: no waiting
        # out the 30 s lease, and not retried.
        app.invoke(None, config)
    assert unknown.value.dead_letter_reason == "outcome_unknown"
    assert time.monotonic() - started < 3 and total(origin) == 1

    # An operator looks the charge up and completes the key with it; the resume gets it.
    (key,) = origin.charges
    settle(server.base_url, key, {"action": "complete", "reason": "the payments API shows the charge",
                                  "response": {"status": 200, "headers": [], "body": origin.answers[key].decode()}})
    done = app.invoke(None, config)
    assert done["charge"] == json.loads(origin.answers[key])["charge"] and total(origin) == 1


@sqlite_only
def test_an_effect_that_raised_after_charging_is_reconciled_on_resume(client, origin):
    app = crash_in_effect_graph(Guard(client, lease_seconds=1, wait_budget=10), origin, {"left": 1}, reconcile=True)
    config = thread()
    with pytest.raises(RuntimeError):
        app.invoke({"amount": 500}, config)
    done = app.invoke(None, config)  # takes the key over after its lease, finds the charge
    (key,) = origin.charges
    assert done["charge"] == json.loads(origin.answers[key])["charge"] and total(origin) == 1


# --- (e) SIGKILL mid-node, and the resume from SqliteSaver in a new process ----------------

AGENT = textwrap.dedent(
    """
    import json, sqlite3, sys, time
    from typing import TypedDict
    import httpx
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, StateGraph
    from idemgate_client import Client, Guard, Reconciled
    from idemgate_client.langgraph import run_in_node, task_key

    url, token, payments, db, thread_id, marker, where, step = sys.argv[1:9]

    class State(TypedDict, total=False):
        amount: int
        charge: str
        log: list

    def prepare(state):
        return {"log": ["prepared"]}

    def charge(state: State, config: RunnableConfig) -> State:
        key = task_key(config, tenant="acme", tool="charge")

        def effect(holding):
            answer = httpx.post(payments + "/charges", json={"amount": state["amount"]},
                                headers={"idempotency-key": key}, timeout=5)
            answer.raise_for_status()
            if step == "first" and where.startswith("in-effect"):
                open(marker, "w").write(key)   # charged; killed before the guard commits
                time.sleep(60)
            return answer.json()

        def find(holding):
            answer = httpx.get(payments + "/charges", headers={"idempotency-key": key}, timeout=5)
            return Reconciled(answer.json()) if answer.status_code == 200 else None

        guard = Guard(Client(url, token=token), lease_seconds=1, wait_budget=10)
        result = run_in_node(guard, config, effect, tenant="acme", tool="charge",
                             request={"method": "POST", "path": "/charges", "body": {"amount": state["amount"]}},
                             reconcile=find if where != "in-effect-hold" else None)
        if step == "first" and where == "after-commit":
            open(marker, "w").write(key)       # charged and committed; killed before the node returns
            time.sleep(60)
        return {"charge": result["charge"]}

    graph = StateGraph(State)
    graph.add_node("prepare", prepare)
    graph.add_node("charge", charge)
    graph.add_edge(START, "prepare")
    graph.add_edge("prepare", "charge")
    graph.add_edge("charge", END)
    app = graph.compile(checkpointer=SqliteSaver(sqlite3.connect(db, check_same_thread=False)))
    config = {"configurable": {"thread_id": thread_id}}
    try:
        done = app.invoke({"amount": 500} if step == "first" else None, config, durability="sync")
        print(json.dumps({"charge": done["charge"]}))
    except Exception as e:
        print(json.dumps({"error": type(e).__name__}))
    """
)


def agent(server: Any, origin: Origin, tmp_path: Path, where: str, step: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    args = [server.base_url, TOKEN, origin.url, str(tmp_path / "checkpoints.db"), f"order-{tmp_path.name}",
            str(tmp_path / "charged"), where, step]
    return subprocess.Popen([sys.executable, "-c", AGENT, *args], env=env, stdout=subprocess.PIPE, text=True)


def kill_then_resume(server: Any, origin: Origin, tmp_path: Path, where: str) -> dict[str, Any]:
    first = agent(server, origin, tmp_path, where, "first")
    deadline = time.monotonic() + 30
    while not (tmp_path / "charged").exists():
        assert first.poll() is None, "the agent exited before charging"
        assert time.monotonic() < deadline, "the agent did not charge within 30 s"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.communicate()
    assert total(origin) == 1
    resumed = agent(server, origin, tmp_path, where, "resume")
    out, _ = resumed.communicate(timeout=60)
    answer: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return answer


@sqlite_only
def test_a_process_killed_after_the_commit_resumes_from_sqlite_to_the_same_charge(server, origin, tmp_path):
    done = kill_then_resume(server, origin, tmp_path, "after-commit")
    assert done == json.loads(next(iter(origin.answers.values()))) and total(origin) == 1


@sqlite_only
def test_a_process_killed_inside_the_effect_resumes_and_reconciles(server, origin, tmp_path):
    done = kill_then_resume(server, origin, tmp_path, "in-effect")
    assert done == json.loads(next(iter(origin.answers.values()))) and total(origin) == 1


@sqlite_only
def test_a_process_killed_inside_the_effect_under_hold_resumes_to_outcome_unknown(server, origin, tmp_path):
    done = kill_then_resume(server, origin, tmp_path, "in-effect-hold")
    assert done == {"error": "OutcomeUnknown"} and total(origin) == 1


# --- an async node ------------------------------------------------------------------------


@sqlite_only
def test_async_nodes_charge_once_per_turn_and_once_per_resume(server, origin):
    runs = {"charge": 0, "ship": 0, "ship node": 0}

    async def post(path: str, key: str, amount: int) -> dict[str, Any]:
        async with httpx.AsyncClient() as http:
            answer = await http.post(f"{origin.url}{path}", json={"amount": amount}, headers={"idempotency-key": key})
        result: dict[str, Any] = answer.json()
        return result

    async def scenario() -> None:
        async with AsyncClient(server.base_url, token=TOKEN) as idem:
            guard = AsyncGuard(idem)

            @guarded_node(guard, tenant="acme", tool="charge", request=lambda state: charge_request(state["amount"]))
            async def charge(holding: Any, state: State, config: RunnableConfig) -> State:
                runs["charge"] += 1
                return {"charge": (await post("/charges", task_key(config, tenant="acme", tool="charge"),
                                              state["amount"]))["charge"]}

            async def ship(state: State, config: RunnableConfig) -> State:
                # Acts, then asks a person: the resume runs this node again from its top.
                runs["ship node"] += 1

                async def effect(_: Any) -> dict[str, Any]:
                    runs["ship"] += 1
                    return await post("/charges", task_key(config, tenant="acme", tool="ship"), state["amount"])

                await arun_in_node(guard, config, effect, tenant="acme", tool="ship")
                return {"confirmed": interrupt("delivered?")}

            graph = StateGraph(State)
            graph.add_node("charge", charge)
            graph.add_node("ship", ship)
            graph.add_edge(START, "charge")
            graph.add_edge("charge", "ship")
            graph.add_edge("ship", END)
            app = graph.compile(checkpointer=InMemorySaver())
            config = thread()
            for amount in (500, 700):
                await app.ainvoke({"amount": amount}, config)
                done = await app.ainvoke(Command(resume="yes"), config)
                assert done["confirmed"] == "yes"

    asyncio.run(scenario())
    assert runs == {"charge": 2, "ship": 2, "ship node": 4}
    assert sorted(origin.charges.values()) == [1, 1, 1, 1]
