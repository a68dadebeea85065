"""pydantic-ai: a tool's effect keyed by the application's own id, at most once.

The key of a tool's effect comes from what the **application** calls the
work the agent does for it — an order, a ticket, a job — passed in the
agent's ``deps``, never from what pydantic-ai numbers inside a run:

- ``ctx.tool_call_id`` is new for every call the model makes, and a model
  that repeats a call, or calls again after a ``ModelRetry`` or a timeout,
  makes a new one;
- ``ctx.run_step`` moves on with every model request;
- ``ctx.run_id`` is new every time the application runs the agent again
  (after a crash, a deploy, a user's "try again").

Measured (``clients/README.md``, "Which key?"): each of those charged two to
six times where the application's id charged once.

::

    from idemgate_client import AsyncClient, AsyncGuard
    from idemgate_client.pydantic_ai import Operation, idempotent_tool

    @dataclass
    class Deps:
        operation: Operation          # Operation(tenant="acme", id=order.id)

    guard = AsyncGuard(AsyncClient(url, token=token))
    agent = Agent(model, deps_type=Deps)

    @agent.tool(timeout=30)
    @idempotent_tool(guard)
    async def charge(ctx: RunContext[Deps], amount: int) -> dict:
        return await payments.charge(amount)

    await agent.run("charge the order", deps=Deps(Operation("acme", order.id)))

The key is ``derive_key(tenant=operation.tenant, run=operation.id,
step=step, tool=tool)``; the tool's arguments are the request's fingerprint,
so the same operation's tool called with other arguments is ``KeyReused``
(422), raised out of the run and never retried. A tool that acts more than
once per operation says on what with ``step`` (a function of the
arguments: ``step=lambda args: args["invoice_id"]``), never a counter.

Waiting, not a storm of 409s: a call of a key that is still running waits
for its result (the same event loop: the same task; elsewhere: idemgate's
``Prefer: wait``, up to the guard's ``wait_budget``) and returns it. A call
that pydantic-ai cancels at its ``timeout`` stops waiting, but its effect
runs on to its commit, so the model's next call of the tool gets that
result instead of a second charge (as long as the event loop runs:
``asyncio.run`` cancels what is left when its main returns, and a charge cut
off that way leaves its key to the guard's ``hold``). Past the wait budget
``InFlight`` is raised out of the run, and a key whose outcome is unknown
``OutcomeUnknown``: both for the application's dead-letter queue
(``dead_letter_reason``), never turned into a ``ModelRetry``.

A ``ModelRetry`` that the tool raises says it did not act (pydantic-ai's
"call me again with other arguments"): the key is released and the model's
corrected call runs. Raise it only before the effect acted (as
``NotExecuted``). Any other exception is judged by the guard's
``classify_failure``: a connection never made releases the key; anything
else (a read timeout after the request went out) marks it unknown at once,
so the model's next call gets ``OutcomeUnknown``, raised out of the run for
the dead-letter queue. What the tool returns is stored as JSON and is what a
repeated call returns; a sync tool needs a :class:`Guard`, an async one an
:class:`AsyncGuard`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar, cast

from ._inflight import shielded, slot
from .guard import AsyncGuard, AsyncHolding, Guard, Holding, NotExecuted
from .keys import derive_key

__all__ = ["MissingOperation", "Operation", "idempotent_tool", "operation_of"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Operation:
    """The application's own identity of the work an agent run does: the same
    when the application runs the agent again for it."""

    tenant: str
    id: str
    """The business id: the order, the ticket, the job. Never the run's id."""


class MissingOperation(LookupError):
    """The agent's deps carry no :class:`Operation`: the tool has no key, and
    does not run."""


def operation_of(deps: Any) -> Operation:
    """The :class:`Operation` in the agent's deps: ``deps.operation``, or the
    deps themselves. Raises :class:`MissingOperation`."""
    found = deps if isinstance(deps, Operation) else getattr(deps, "operation", None)
    if not isinstance(found, Operation):
        raise MissingOperation(
            "idemgate: this tool's effect needs the application's own id for the work it does, "
            "in the agent's deps (deps.operation = Operation(tenant=..., id=order_id)); got "
            f"{type(deps).__name__} without one. The key is never made from tool_call_id, run_step or "
            "run_id: the model's repeated call, a retry and a re-run of the agent each get new ones"
        )
    if not found.tenant or not found.id:
        raise MissingOperation(f"idemgate: the deps' Operation has an empty tenant or id: {found!r}")
    return found


def _arguments(signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The tool's arguments (all but the context) as JSON values: the fingerprint."""
    from pydantic_core import to_jsonable_python

    bound = signature.bind(None, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.pop(next(iter(signature.parameters)))
    jsonable: dict[str, Any] = to_jsonable_python(named)
    return jsonable


def idempotent_tool(
    guard: Guard | AsyncGuard,
    *,
    tool: str | None = None,
    step: str | int | Callable[[Mapping[str, Any]], str | int] = 1,
    operation: Callable[[Any], Operation | None] | None = None,
) -> Callable[[F], F]:
    """A pydantic-ai tool (a function taking ``RunContext`` first) whose
    body runs at most once per (operation, ``tool``, ``step``).

    ``operation`` reads the :class:`Operation` from ``ctx.deps`` (default:
    :func:`operation_of`); ``tool`` defaults to the function's name; ``step``
    is a constant or a function of the arguments. Put it under
    ``@agent.tool``; the tool keeps its signature, so its schema is the
    same."""

    def decorate(fn: F) -> F:
        from pydantic_ai import ModelRetry

        name = tool or fn.__name__
        signature = inspect.signature(fn)
        if not signature.parameters:
            raise TypeError(f"idempotent_tool: {fn.__name__} must take the RunContext first")

        def identify(ctx: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
            deps = getattr(ctx, "deps", None)
            found = operation(deps) if operation is not None else operation_of(deps)
            if found is None:
                raise MissingOperation(f"idemgate: no Operation for tool {name!r} in the agent's deps")
            found = operation_of(found)
            arguments = _arguments(signature, args, kwargs)
            step_value = step(arguments) if callable(step) else step
            key = derive_key(tenant=found.tenant, run=found.id, step=step_value, tool=name)
            return key, {"method": "POST", "path": f"/tools/{name}", "body": arguments}

        def asked_again(refused: NotExecuted) -> BaseException | None:
            """The tool's own ModelRetry (its key now released), to raise as it was."""
            return refused.__cause__ if isinstance(refused.__cause__, ModelRetry) else None

        if inspect.iscoroutinefunction(fn):
            if not isinstance(guard, AsyncGuard):
                raise TypeError(f"idempotent_tool: {fn.__name__} is async: it needs an AsyncGuard")
            async_guard = guard

            @functools.wraps(fn)
            async def async_tool(ctx: Any, *args: Any, **kwargs: Any) -> Any:
                key, request = identify(ctx, args, kwargs)

                async def effect(_: AsyncHolding) -> Any:
                    from pydantic_core import to_jsonable_python

                    try:
                        result = await fn(ctx, *args, **kwargs)
                    except ModelRetry as asked:
                        raise NotExecuted(str(asked)) from asked
                    return to_jsonable_python(result)

                try:
                    return await shielded(slot(key, request, None), lambda: async_guard.run(key, effect, request=request))
                except NotExecuted as refused:
                    asked = asked_again(refused)
                    if asked is None:
                        raise
                    raise asked from None

            return cast(F, async_tool)

        if not isinstance(guard, Guard):
            raise TypeError(f"idempotent_tool: {fn.__name__} is not async: it needs a Guard")
        sync_guard = guard

        @functools.wraps(fn)
        def sync_tool(ctx: Any, *args: Any, **kwargs: Any) -> Any:
            # pydantic-ai runs a sync tool in a thread and abandons the thread
            # at its timeout: the effect runs on to its commit all the same.
            key, request = identify(ctx, args, kwargs)

            def effect(_: Holding) -> Any:
                from pydantic_core import to_jsonable_python

                try:
                    result = fn(ctx, *args, **kwargs)
                except ModelRetry as asked:
                    raise NotExecuted(str(asked)) from asked
                return to_jsonable_python(result)

            try:
                return sync_guard.run(key, effect, request=request)
            except NotExecuted as refused:
                asked = asked_again(refused)
                if asked is None:
                    raise
                raise asked from None

        return cast(F, sync_tool)

    return decorate
