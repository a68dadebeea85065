"""OpenAI Agents SDK: MCP tools through ``idemgate proxy --protocol mcp``,
keyed by the job, run at most once.

:func:`idempotent_mcp_server` is the SDK's ``MCPServerStreamableHttp``,
pointed at idemgate's MCP door (``idemgate proxy --protocol mcp``), or its
``MCPServerStdio``, running idemgate's stdio door in front of a local server
(``{"command": "idemgate", "args": ["proxy", "--protocol", "mcp", "--stdio",
"--", ...]}``), with the caller's half of the key:

- **The runtime mints the key**, never the model. Every ``tools/call``
  carries ``_meta["dev.idemgate/idempotency-key"]`` (through the SDK's
  ``tool_meta_resolver``): ``derive_key(tenant=op.tenant, run=op.id,
  step=1, tool=tool_name)``, where ``op`` is the application's own
  :class:`Operation` for the job (the order, the ticket: the same when the
  job runs again), taken from the run's context (``Runner.run(...,
  context=...)``: ``context.operation``, or the context itself). One effect
  per job and tool; the arguments are the fingerprint. So a model that
  repeats the call, or a second run of the job, gets the first result back,
  and the same job's tool with other arguments is ``KeyReused``. Not the
  call's ordinal in the run (a repeated call, or a run planned in another
  order, would shift it and charge again), not a hash of the arguments (a
  second run with another amount would charge again instead of being
  refused), never the model's ``call_id``. A tool that acts more than once
  per job says on what: ``step=lambda tool, args: args["invoice_id"]``.
- **The model never sees or sets a key**: the ``idempotency_key`` property
  the door adds to ``tools/list`` is removed from the input schemas, and a
  value the model makes up anyway is removed from the arguments (the door
  also prefers the ``_meta`` key). A tool whose own schema *requires* an
  ``idempotency_key`` is left alone.
- **Refusals end the run**, instead of reaching the model as "try again":
  the door's ``outcome-unknown``, ``key-reused`` and ``key-invalid`` are
  raised out of ``Runner.run`` as :class:`~idemgate_client.OutcomeUnknown`
  (``dead_letter_reason`` ``outcome_unknown``), :class:`~idemgate_client.KeyReused`
  and :class:`~idemgate_client.KeyInvalid`. ``request-in-flight`` (the
  first call still runs past the door's wait) is asked again under the same
  key until ``wait_budget`` is spent, then :class:`~idemgate_client.InFlight`
  (``dead_letter_reason`` ``idempotency_in_flight``). A context without an
  :class:`Operation` raises :class:`MissingOperation`, and nothing is
  called. Each is also the SDK's ``AgentsException``, which the SDK lets
  out of the run as it is (it wraps any other in a ``UserError``).
- **The session waits longer than the door holds**: the SDK's MCP session
  gives up on a request after 5 s by default, and the door holds a repeated
  call up to 4 s (``IDEMGATE_DEFAULT_WAIT``, at most ``IDEMGATE_MAX_WAIT``)
  before it answers. This server waits 30 s
  (``client_session_timeout_seconds``): keep it above the door's wait.

::

    from agents import Agent, Runner
    from idemgate_client import InFlight, KeyReused, OutcomeUnknown
    from idemgate_client.openai_agents import Operation, idempotent_mcp_server

    async with idempotent_mcp_server({"url": "http://127.0.0.1:8081/mcp"}) as payments:
        agent = Agent(name="billing", instructions="...", mcp_servers=[payments])
        try:
            await Runner.run(agent, "charge order 42", context=Operation("acme", "order-42"))
        except (OutcomeUnknown, InFlight) as stuck:   # never run again, never under a new key
            dead_letter("order-42", reason=stuck.dead_letter_reason)

A call whose answer is lost (the server died mid-call, the door's
connection closed, a read timeout) is sent again by the SDK under the same
key (``max_retry_attempts=2`` here, the SDK's default being 0): the door
replays the first result, holds the call, or refuses it ``outcome-unknown``,
which ends the run. Past those retries the failure is the SDK's: the model
is told the tool failed (its next call carries the same key), or the run
ends in the SDK's own exception (a door that is gone: ``MCPError``
"Connection closed" when the next turn lists the tools). Other tool errors
go to ``failure_error_function`` (the SDK's default message unless you pass
one; ``None`` raises them).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, TypeVar, cast

from .errors import _BY_SLUG, IdemgateError, Problem
from .guard import InFlight
from .keys import derive_key
from .pydantic_ai import MissingOperation, Operation

if TYPE_CHECKING:
    from agents.mcp import MCPServerStdio, MCPServerStdioParams, MCPServerStreamableHttp, MCPServerStreamableHttpParams
    from agents.mcp.util import MCPToolMetaContext
    from agents.run_context import RunContextWrapper
    from agents.tool import ToolErrorFunction
    from mcp.types import CallToolResult, Tool

__all__ = [
    "KEY_ARGUMENT",
    "KEY_META",
    "PROBLEM_META",
    "MissingOperation",
    "Operation",
    "idempotent_mcp_server",
    "operation_in",
]

KEY_META = "dev.idemgate/idempotency-key"
"""The ``_meta`` entry of a ``tools/call`` that carries the runtime's key."""
PROBLEM_META = "dev.idemgate/problem"
"""The ``_meta`` entry of the door's refusals: the problem document."""
KEY_ARGUMENT = "idempotency_key"
"""The argument the door offers a model; hidden from it here."""

_STATUS = {"key-reused": 422, "key-invalid": 400}
E = TypeVar("E", bound=BaseException)
_in_run_classes: dict[type[BaseException], type[BaseException]] = {}


def _in_run(cls: type[E]) -> type[E]:
    """``cls``, made also the SDK's ``AgentsException``: the SDK lets such an
    exception out of the run as it is (any other it wraps in a ``UserError``
    of its own), so the caller catches ``OutcomeUnknown`` itself."""
    from agents.exceptions import AgentsException

    made = _in_run_classes.get(cls)
    if made is None:
        made = type(cls.__name__, (cls, AgentsException), {"__module__": __name__, "__doc__": cls.__doc__})
        _in_run_classes[cls] = made
    return cast("type[E]", made)


def operation_in(context: Any) -> Operation:
    """The :class:`Operation` in the run's context (``Runner.run(...,
    context=...)``): ``context.operation``, or the context itself. Raises
    :class:`MissingOperation`."""
    found = context if isinstance(context, Operation) else getattr(context, "operation", None)
    if not isinstance(found, Operation):
        raise _in_run(MissingOperation)(
            "idemgate: this MCP tool call needs the application's own id for the job, in the run's "
            "context (Runner.run(..., context=Operation(tenant=..., id=job_id)), or a context with an "
            f"`operation`); got {type(context).__name__} without one. The key is never made from the "
            "model's call_id or the run: a repeated call and a second run of the job get new ones"
        )
    if not found.tenant or not found.id:
        raise _in_run(MissingOperation)(f"idemgate: the run's Operation has an empty tenant or id: {found!r}")
    return found


def _without_key(arguments: Mapping[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in arguments.items() if name != KEY_ARGUMENT}


def _refusal(result: CallToolResult) -> dict[str, Any] | None:
    """The door's problem document, when ``result`` is one of its refusals."""
    if not result.is_error or not isinstance(result.meta, dict):
        return None
    problem = result.meta.get(PROBLEM_META)
    return problem if isinstance(problem, dict) else None


def _refused(problem: dict[str, Any]) -> Problem:
    """The refusal as this package's exception (``OutcomeUnknown``, ``KeyReused``, …)."""
    slug = str(problem.get("type", "")).rsplit("/", 1)[-1]
    status = problem.get("status")
    retry = problem.get("retry_after_seconds")
    return _in_run(_BY_SLUG.get(slug, Problem))(
        status if isinstance(status, int) else _STATUS.get(slug, 409),
        problem,
        float(retry) if isinstance(retry, (int, float)) else None,
    )


def _lease_end(problem: Mapping[str, Any]) -> datetime | None:
    text = problem.get("lease_expires_at")
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")) if isinstance(text, str) else None
    except ValueError:
        return None


def _stop_in(error: BaseException) -> BaseException | None:
    """The idemgate exception ``error`` is, or was raised from (the SDK wraps
    what a tool call raises in exceptions of its own)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (IdemgateError, MissingOperation)):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def idempotent_mcp_server(
    params: MCPServerStreamableHttpParams | MCPServerStdioParams,
    *,
    operation: Operation | Callable[[Any], Operation] | None = None,
    step: Callable[[str, Mapping[str, Any]], str | int] | None = None,
    wait_budget: float = 30.0,
    client_session_timeout_seconds: float | None = 30.0,
    max_retry_attempts: int = 2,
    failure_error_function: ToolErrorFunction | None | Literal["default"] = "default",
    **options: Any,
) -> MCPServerStreamableHttp | MCPServerStdio:
    """An ``agents.mcp.MCPServerStreamableHttp`` for ``params`` (its ``url``
    the door's endpoint, ``http://host:port/mcp``) whose tool calls carry the
    job's keys, with the model kept away from them (see the module's notes);
    for stdio ``params`` (a ``command``: ``idemgate`` with ``["proxy",
    "--protocol", "mcp", "--stdio", "--", SERVER, ...]``, the stdio door
    in front of a local server), the same as an ``agents.mcp.MCPServerStdio``.

    ``operation``: the job's :class:`Operation`, or a function of the run's
    context that returns it (default: :func:`operation_in` of the context).
    ``step``: a function of the tool's name and arguments (without any
    ``idempotency_key``), for a tool that acts more than once per job
    (default: ``1``). ``wait_budget``: seconds to keep asking again for a call
    still in flight before :class:`~idemgate_client.InFlight`.
    ``client_session_timeout_seconds``: the session's wait for an answer,
    above the door's. ``max_retry_attempts``: the SDK's own retries of a
    failed call, under the same key. ``failure_error_function``: what the model is told of any other tool error
    (``"default"``: the SDK's own message; ``None``: such errors are raised).
    Every other keyword goes to ``MCPServerStreamableHttp`` (or
    ``MCPServerStdio``); a
    ``tool_meta_resolver``'s ``_meta`` is sent too, with the key over it."""
    from agents.mcp import MCPServerStdio, MCPServerStreamableHttp
    from agents.tool import default_tool_error_function

    if wait_budget < 0:
        raise ValueError("idempotent_mcp_server: wait_budget must be zero or more seconds")
    if client_session_timeout_seconds is not None and 0 < client_session_timeout_seconds <= 4:
        raise ValueError(
            "idempotent_mcp_server: client_session_timeout_seconds must be more than the door's wait "
            "(4 s by default), or None: the door holds a repeated call that long before it answers, and "
            "a session that gives up first turns the answer into a timeout"
        )
    theirs = options.pop("tool_meta_resolver", None)
    fallback = default_tool_error_function if failure_error_function == "default" else failure_error_function

    def job(context: Any) -> Operation:
        if isinstance(operation, Operation):
            return operation_in(operation)
        return operation_in(operation(context) if operation is not None else context)

    async def resolve(context: MCPToolMetaContext) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        if theirs is not None:
            found = theirs(context)
            meta.update((await found if inspect.isawaitable(found) else found) or {})
        op = job(context.run_context.context)
        at = step(context.tool_name, _without_key(context.arguments or {})) if step is not None else 1
        meta[KEY_META] = derive_key(tenant=op.tenant, run=op.id, step=at, tool=context.tool_name)
        return meta

    async def on_failure(context: RunContextWrapper[Any], error: Exception) -> str:
        stop = _stop_in(error)
        if stop is not None:
            raise stop
        if fallback is None or isinstance(fallback, str):
            raise error
        message = fallback(context, error)
        return await message if inspect.isawaitable(message) else message

    async def listed(server: Any, tools: list[Tool]) -> list[Tool]:
        for tool in tools:
            schema = tool.input_schema
            if KEY_ARGUMENT not in (schema.get("properties") or {}):
                continue
            if KEY_ARGUMENT in (schema.get("required") or []):
                server.keyed_by_the_tool = server.keyed_by_the_tool | {tool.name}
                continue
            schema["properties"] = _without_key(schema["properties"])
        return tools

    async def called(
        server: Any,
        call: Callable[[str, dict[str, Any] | None, dict[str, Any] | None], Any],
        tool_name: str,
        arguments: dict[str, Any] | None,
        meta: dict[str, Any] | None,
    ) -> CallToolResult:
        if arguments and tool_name not in server.keyed_by_the_tool:
            arguments = _without_key(arguments)
        started = time.monotonic()
        while True:
            result = cast("CallToolResult", await call(tool_name, arguments, meta))
            problem = _refusal(result)
            if problem is None:
                return result
            refused = _refused(problem)
            if refused.slug != "request-in-flight":
                raise refused
            waited = time.monotonic() - started
            pause = max(refused.retry_after or 1.0, 0.2)
            if waited + pause > wait_budget:
                raise _in_run(InFlight)(str((meta or {}).get(KEY_META, "")), waited, _lease_end(problem))
            await asyncio.sleep(pause)

    class IdempotentMCPServer(MCPServerStreamableHttp):
        """``MCPServerStreamableHttp`` with the job's keys (``idempotent_mcp_server``)."""

        #: Tools whose own schema requires an ``idempotency_key``: left as they are.
        keyed_by_the_tool: frozenset[str] = frozenset()

        async def list_tools(self, run_context: RunContextWrapper[Any] | None = None, agent: Any = None) -> list[Tool]:
            return await listed(self, await super().list_tools(run_context, agent))

        async def call_tool(
            self, tool_name: str, arguments: dict[str, Any] | None, meta: dict[str, Any] | None = None
        ) -> CallToolResult:
            return await called(self, super().call_tool, tool_name, arguments, meta)

    class IdempotentMCPServerStdio(MCPServerStdio):
        """``MCPServerStdio`` with the job's keys (``idempotent_mcp_server``), for
        ``idemgate proxy --protocol mcp --stdio -- COMMAND`` as its command."""

        #: Tools whose own schema requires an ``idempotency_key``: left as they are.
        keyed_by_the_tool: frozenset[str] = frozenset()

        async def list_tools(self, run_context: RunContextWrapper[Any] | None = None, agent: Any = None) -> list[Tool]:
            return await listed(self, await super().list_tools(run_context, agent))

        async def call_tool(
            self, tool_name: str, arguments: dict[str, Any] | None, meta: dict[str, Any] | None = None
        ) -> CallToolResult:
            return await called(self, super().call_tool, tool_name, arguments, meta)

    if "command" in params:
        return IdempotentMCPServerStdio(
            cast("MCPServerStdioParams", params),
            client_session_timeout_seconds=client_session_timeout_seconds,
            max_retry_attempts=max_retry_attempts,
            tool_meta_resolver=resolve,
            failure_error_function=on_failure,
            **options,
        )
    return IdempotentMCPServer(
        params,
        client_session_timeout_seconds=client_session_timeout_seconds,
        max_retry_attempts=max_retry_attempts,
        tool_meta_resolver=resolve,
        failure_error_function=on_failure,
        **options,
    )
