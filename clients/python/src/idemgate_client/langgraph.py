"""LangGraph: a node's effect keyed by the task that runs it, at most once.

The key of a node's effect is derived from the **task** LangGraph runs the
node as — ``config["configurable"]["checkpoint_ns"]``, ``"<node>:<task id>"``
(``"<parent>:<id>|<node>:<id>"`` in a subgraph; LangGraph also puts it in
``config["metadata"]["langgraph_checkpoint_ns"]`` and in
``runtime.execution_info``) — and the thread::

    derive_key(tenant=tenant, run=thread_id, step=checkpoint_ns, tool=tool)

LangGraph computes the task id from the checkpoint the step starts from, so:

- it **survives a resume**: a retry of the node (``RetryPolicy``), a resume
  after an ``interrupt()``, after an exception, or after the process died
  (the checkpointer reloads the same checkpoint) runs the same task id, so the
  effect gets the same key and is replayed, never run again;
- it **differs per turn**: the next input on the same thread starts from a new
  checkpoint, so each turn's charge is a charge of its own.

One key per task and tool: a node that makes two charges names them apart
(``tool="charge-deposit"``, ``tool="charge-balance"``).

The wrong keys, measured (``clients/README.md``, "Which key?"): the thread and
the node's name is the same key on every turn of the thread (turn 2's real
charge is silently answered with turn 1's, turn 3 with other arguments gets
422); a run id (``execution_info.run_id``, one per ``invoke``) changes on
every resume, and a retry counter (``node_attempt``) on every retry, so each
charges again.

The task id survives a crash only if the checkpoint it was computed from was
stored before the effect ran: with ``durability="exit"`` nothing is stored
until the run ends, a killed process starts over from its input, its tasks
get new ids and the effect a new key — :func:`task_key` refuses that mode.
The default (``"async"``) stores the checkpoint while the step already runs,
so a process killed within those milliseconds can start the step over from
the checkpoint before; ``durability="sync"`` closes that window, and is what
a graph with effects should use.

::

    from idemgate_client import Guard, Client
    from idemgate_client.langgraph import guarded_node, retry_policy

    guard = Guard(Client(url, token=token))

    @guarded_node(guard, tenant="acme", tool="charge",
                  request=lambda state: {"method": "POST", "path": "/charges", "body": {"amount": state["amount"]}})
    def charge(holding, state):
        return {"charge_id": payments.charge(state["amount"])["id"]}

    graph.add_node("charge", charge, retry_policy=retry_policy())
    app = graph.compile(checkpointer=SqliteSaver(conn))
    app.invoke(inputs, {"configurable": {"thread_id": order_id}}, durability="sync")

Or, inside a node of your own, :func:`run_in_node` (:func:`arun_in_node`
for an async node) around the one call that acts. ``interrupt()`` goes
outside the guarded effect (before it, after it, or in a node of its own):
raised from inside, the guard cannot tell whether the effect acted first, so
it marks the key unknown (under the default ``hold``), never to run again
by itself.

An effect that raises is judged by the guard's ``classify_failure``
(:func:`idemgate_client.classify_failure` by default): a connection never
made releases the key, and the node's retry (:func:`retry_on` retries
``httpx.ConnectError``) runs the effect; anything else marks the key unknown
at once, and the retry or the resume gets ``OutcomeUnknown``, which is never
retried, instead of waiting out the lease.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, TypeVar

import httpx

from ._inflight import shielded, slot
from .errors import (
    IdemgateError,
    KeyReused,
    LeaseLost,
    OutcomeUnknown,
    RequestInFlight,
    ResultNotCommitted,
    StoreUnavailable,
)
from .guard import AsyncGuard, AsyncHolding, Guard, Holding, InFlight, NotExecuted, Reconciled
from .keys import derive_key
from .retry import Decision, classify

if TYPE_CHECKING:
    from langchain_core.runnables import RunnableConfig
    from langgraph.types import RetryPolicy

__all__ = ["arun_in_node", "guarded_node", "retry_on", "retry_policy", "run_in_node", "task_identity", "task_key"]

T = TypeVar("T")


def task_identity(source: Mapping[str, Any] | Any) -> tuple[str, str]:
    """``(thread_id, checkpoint_ns)`` of the node execution that ``source`` —
    the ``config`` LangGraph passes a node, or its ``runtime`` — belongs to.

    Raises ``ValueError`` when there is no task identity to key on: no
    thread (no checkpointer, or no ``thread_id`` in the run's config), not
    inside a node, or ``durability="exit"`` (nothing is stored before the
    run ends, so the task's id does not survive a crash)."""
    info = getattr(source, "execution_info", None)
    durability: object = None
    if info is not None:
        thread, namespace = info.thread_id, info.checkpoint_ns
    elif isinstance(source, Mapping):
        configurable = source.get("configurable") or {}
        metadata = source.get("metadata") or {}
        thread = configurable.get("thread_id") or metadata.get("thread_id")
        namespace = configurable.get("checkpoint_ns") or metadata.get("langgraph_checkpoint_ns")
        durability = configurable.get("__pregel_durability")
    else:
        raise TypeError(
            f"task_identity: pass the config (or the runtime) LangGraph gave the node, not a {type(source).__name__}"
        )
    if thread is None or str(thread) == "":
        raise ValueError(
            "idemgate: this node runs without a thread_id, so its effect has no key that survives a resume: "
            "compile the graph with a checkpointer and invoke it with "
            "config={'configurable': {'thread_id': ...}}"
        )
    if not namespace or ":" not in str(namespace).rsplit("|", 1)[-1]:
        raise ValueError(
            "idemgate: no task identity (checkpoint_ns 'node:<task id>') in this config: "
            "pass the config LangGraph gives the node (a `config: RunnableConfig` parameter), from inside the node"
        )
    if durability == "exit":
        raise ValueError(
            "idemgate: durability='exit' stores no checkpoint before the run ends, so a process that dies "
            "starts over with new task ids and the effect would get a new key: use durability='sync' (or 'async')"
        )
    return str(thread), str(namespace)


def task_key(source: Mapping[str, Any] | Any, *, tenant: str, tool: str) -> str:
    """The idempotency key of ``tool``'s effect in the node execution that
    ``source`` (the node's ``config``, or its ``runtime``) belongs to:
    ``derive_key(tenant=tenant, run=thread_id, step=checkpoint_ns, tool=tool)``.

    The same for every retry and every resume of that node execution; another
    on the thread's next turn (see the module's notes)."""
    thread, namespace = task_identity(source)
    return derive_key(tenant=tenant, run=thread, step=namespace, tool=tool)


def run_in_node(
    guard: Guard,
    config: Mapping[str, Any] | Any,
    effect: Callable[[Holding], T],
    *,
    tenant: str,
    tool: str,
    request: Mapping[str, Any] | None = None,
    fingerprint: str | None = None,
    reconcile: Callable[[Holding], Reconciled[T] | None] | None = None,
) -> T:
    """``guard.run`` under :func:`task_key` of the node ``config`` belongs to:
    the effect's result, run now or stored by an earlier execution of this
    task (a retry, a resume)."""
    key = task_key(config, tenant=tenant, tool=tool)
    return guard.run(key, effect, request=request, fingerprint=fingerprint, reconcile=reconcile)


async def arun_in_node(
    guard: AsyncGuard,
    config: Mapping[str, Any] | Any,
    effect: Callable[[AsyncHolding], Awaitable[T]],
    *,
    tenant: str,
    tool: str,
    request: Mapping[str, Any] | None = None,
    fingerprint: str | None = None,
    reconcile: Callable[[AsyncHolding], Awaitable[Reconciled[T] | None]] | None = None,
) -> T:
    """As :func:`run_in_node`, for an async node, with an :class:`AsyncGuard`.

    A node cancelled while its effect runs (``TimeoutPolicy``) stops waiting,
    but the effect runs on to its commit; the retry of the node waits for it
    and gets its result."""
    key = task_key(config, tenant=tenant, tool=tool)
    return await shielded(
        slot(key, request, fingerprint),
        lambda: guard.run(key, effect, request=request, fingerprint=fingerprint, reconcile=reconcile),
    )


def guarded_node(
    guard: Guard | AsyncGuard,
    *,
    tenant: str | Callable[[Mapping[str, Any]], str],
    tool: str | None = None,
    request: Callable[[Any], Mapping[str, Any]] | None = None,
    reconcile: Callable[..., Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A LangGraph node whose whole body is one guarded effect.

    The decorated function gets the :class:`Holding` and the state (and
    the node's ``config``, if it has a parameter of that name), and returns
    the node's state update; that update is what is stored (as JSON,
    or the guard's ``encode``) and what a retry or a resume of the same task
    gets back without running it again. ``tenant`` is a string or a function
    of the node's config; ``tool`` defaults to the function's name;
    ``request`` (a function of the state) gives the fingerprint, so the same
    task with other arguments is ``KeyReused``; ``reconcile(holding, state)``
    as in :meth:`Guard.run`. An ``async def`` needs an :class:`AsyncGuard`
    and makes an async node::

        @guarded_node(guard, tenant="acme", tool="charge")
        def charge(holding, state):
            return {"charge_id": payments.charge(state["amount"])["id"]}
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = tool or fn.__name__
        wants_config = "config" in inspect.signature(fn).parameters

        def call(holding: Any, state: Any, config: Any) -> Any:
            return fn(holding, state, config=config) if wants_config else fn(holding, state)

        def tenant_of(config: Mapping[str, Any]) -> str:
            return tenant(config) if callable(tenant) else tenant

        if inspect.iscoroutinefunction(fn):
            if not isinstance(guard, AsyncGuard):
                raise TypeError(f"guarded_node: {fn.__name__} is async: it needs an AsyncGuard")
            async_guard = guard

            async def async_node(state: Any, config: RunnableConfig) -> Any:
                async def effect(holding: AsyncHolding) -> Any:
                    return await call(holding, state, config)

                async def reconciled(holding: AsyncHolding) -> Any:
                    assert reconcile is not None
                    return await reconcile(holding, state)

                return await arun_in_node(
                    async_guard,
                    config,
                    effect,
                    tenant=tenant_of(config),
                    tool=name,
                    request=request(state) if request is not None else None,
                    reconcile=reconciled if reconcile is not None else None,
                )

            node: Callable[..., Any] = async_node
        else:
            if not isinstance(guard, Guard):
                raise TypeError(f"guarded_node: {fn.__name__} is not async: it needs a Guard")
            sync_guard = guard

            def sync_node(state: Any, config: RunnableConfig) -> Any:
                return run_in_node(
                    sync_guard,
                    config,
                    lambda holding: call(holding, state, config),
                    tenant=tenant_of(config),
                    tool=name,
                    request=request(state) if request is not None else None,
                    reconcile=(lambda holding: reconcile(holding, state)) if reconcile is not None else None,
                )

            node = sync_node
        # Not functools.wraps: LangGraph reads the node's own signature (it
        # passes `config` because the node asks for it), and __wrapped__
        # would show it the decorated function's instead.
        node.__name__ = fn.__name__
        node.__qualname__ = fn.__qualname__
        node.__doc__ = fn.__doc__
        return node

    return decorate


def retry_on(error: BaseException) -> bool:
    """Whether LangGraph should run a guarded node again after ``error``, per
    the package's retry table (``idemgate_client.retry``):

    - a timeout, a dropped connection, a 502/503/504/408/425/429 (an
      ``httpx.HTTPStatusError`` or ``httpx.TransportError``), idemgate's
      ``store-unavailable``, a node timeout: yes — the same task, so the same
      key; an effect that may have acted is never run again by the guard;
    - 409 ``request-in-flight`` (``RequestInFlight``, or the guard's
      ``InFlight`` after its wait budget): yes, to wait again on the same key;
    - 409 ``outcome-unknown``, 422 ``key-reused``, ``lease-lost``, and
      ``ResultNotCommitted`` (the effect acted; its result is in the error):
      never;
    - ``NotExecuted`` (the effect failed before acting; the key was released):
      as its cause (``raise NotExecuted(...) from error``), no cause no;
    - anything else: no.

    LangGraph's default ``retry_on`` retries none of the 409s that come as an
    ``httpx.HTTPStatusError`` (only 5xx), and retries ``OutcomeUnknown`` and
    ``KeyReused`` (any exception it does not know), pointlessly.
    """
    if isinstance(error, (OutcomeUnknown, KeyReused, LeaseLost, ResultNotCommitted)):
        return False
    if isinstance(error, (InFlight, RequestInFlight, StoreUnavailable)):
        return True
    if isinstance(error, NotExecuted):
        cause = error.__cause__
        return cause is not None and cause is not error and retry_on(cause)
    if isinstance(error, IdemgateError):
        return False
    if isinstance(error, httpx.HTTPStatusError):
        try:
            decision = classify(error.response).decision
        except httpx.ResponseNotRead:  # a streamed 409 whose body names neither: waited for, as classify does
            decision = Decision.WAIT
        return decision in (Decision.RETRY, Decision.WAIT)
    if isinstance(error, httpx.TransportError):
        return classify(error).decision is Decision.RETRY
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    try:
        from langgraph.errors import NodeTimeoutError
    except ImportError:  # a LangGraph without node timeouts
        return False
    return isinstance(error, NodeTimeoutError)


def retry_policy(
    *,
    max_attempts: int = 3,
    initial_interval: float = 0.5,
    backoff_factor: float = 2.0,
    max_interval: float = 10.0,
    jitter: bool = True,
) -> RetryPolicy:
    """A LangGraph ``RetryPolicy`` whose ``retry_on`` is :func:`retry_on`::

    graph.add_node("charge", charge, retry_policy=retry_policy())

    The guard already waits for a key in flight (``wait_budget``) before it
    raises ``InFlight``; each retry waits that long again."""
    from langgraph.types import RetryPolicy

    return RetryPolicy(
        initial_interval=initial_interval,
        backoff_factor=backoff_factor,
        max_interval=max_interval,
        max_attempts=max_attempts,
        jitter=jitter,
        retry_on=retry_on,
    )
