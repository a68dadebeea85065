"""An MCP server made with the official Python SDK (`mcp`), unchanged by
idemgate: a write tool that charges, a slow one, one that asks the user to
confirm first (elicitation: a multi-round-trip call under 2026-07-28, a
question mid-call under 2025-11-25), and a read-only one. Every
execution of a write tool appends a line to $CHARGES_LOG, so a test counts
what really ran; the slow one also logs its start (tool "slow_charge.started"),
so a test sees a call in flight and whether it ran to its end.

    CHARGES_LOG=/tmp/charges python3 tests/mcp/server.py PORT [--json-response]
    CHARGES_LOG=/tmp/charges python3 tests/mcp/server.py --stdio
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from typing import Any

from typing import Annotated

from mcp.server.mcpserver import Context, Elicit, ListRoots, MCPServer, Resolve, Sample
from mcp.types import CreateMessageResult, ListRootsResult, SamplingMessage, TextContent, ToolAnnotations
from pydantic import BaseModel

server = MCPServer("payments")


def _record(tool: str, **arguments: Any) -> str:
    charge = f"ch_{uuid.uuid4().hex[:12]}"
    with open(os.environ["CHARGES_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps({"tool": tool, "charge": charge, **arguments}) + "\n")
    return charge


@server.tool(description="Charge a customer an amount in cents.")
def charge(customer: str, amount: int) -> dict[str, Any]:
    return {"charge": _record("charge", customer=customer, amount=amount), "amount": amount}


@server.tool(description="Charge, slowly: the charge is made after `seconds`.")
async def slow_charge(customer: str, amount: int, seconds: float) -> dict[str, Any]:
    with open(os.environ["CHARGES_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps({"tool": "slow_charge.started", "customer": customer, "amount": amount}) + "\n")
    await asyncio.sleep(seconds)
    return {"charge": _record("slow_charge", customer=customer, amount=amount), "amount": amount}


class Charge(BaseModel):
    charge: str
    amount: int


@server.tool(description="Charge, with a typed result (the tool declares an outputSchema).")
def typed_charge(customer: str, amount: int) -> Charge:
    return Charge(charge=_record("typed_charge", customer=customer, amount=amount), amount=amount)


class Confirmation(BaseModel):
    confirm: bool


def _ask(customer: str, amount: int) -> Elicit[Confirmation]:
    # Logged when asked, so a test sees the question reach the server.
    with open(os.environ["CHARGES_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps({"tool": "confirmed_charge.asked", "customer": customer, "amount": amount}) + "\n")
    return Elicit(f"Charge {customer} {amount}?", Confirmation)


@server.tool(description="Charge, after asking the user to confirm (elicitation).")
def confirmed_charge(
    customer: str, amount: int, confirmation: Annotated[Confirmation, Resolve(_ask)]
) -> dict[str, Any]:
    if not confirmation.confirm:
        return {"charge": None, "amount": amount}
    return {"charge": _record("confirmed_charge", customer=customer, amount=amount), "amount": amount}


@server.tool(description="A customer's balance.", annotations=ToolAnnotations(readOnlyHint=True))
def balance(customer: str) -> dict[str, Any]:
    with open(os.environ["CHARGES_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps({"tool": "balance", "customer": customer}) + "\n")
    return {"customer": customer, "balance": 100}


# Tools that tell or ask the client something mid-call (under 2025-11-25, on
# the call's event stream; under 2026-07-28 a question is an input_required
# round): progress notifications, a sampling request and a roots request.


@server.tool(description="Charge, reporting progress `steps` times (a quarter second apart) first.")
async def progress_charge(customer: str, amount: int, steps: int, ctx: Context) -> dict[str, Any]:
    for step in range(steps):
        await ctx.report_progress(step + 1, steps + 1, f"step {step + 1}")
        await asyncio.sleep(0.25)
    return {"charge": _record("progress_charge", customer=customer, amount=amount), "amount": amount}


def _memo(customer: str, amount: int) -> Sample:
    text = TextContent(type="text", text=f"A memo for charging {customer} {amount}.")
    return Sample([SamplingMessage(role="user", content=text)], max_tokens=20)


def _roots() -> ListRoots:
    return ListRoots()


@server.tool(description="Charge with a memo the client's model writes (sampling) and its roots (roots/list).")
def memo_charge(
    customer: str,
    amount: int,
    memo: Annotated[CreateMessageResult, Resolve(_memo)],
    roots: Annotated[ListRootsResult, Resolve(_roots)],
) -> dict[str, Any]:
    text = memo.content.text if isinstance(memo.content, TextContent) else ""
    charge = _record("memo_charge", customer=customer, amount=amount, memo=text, roots=len(roots.roots))
    return {"charge": charge, "amount": amount, "memo": text, "roots": [str(r.uri) for r in roots.roots]}


if __name__ == "__main__":
    if sys.argv[1:] == ["--stdio"]:
        # The SDK's stdio server: MCP on stdin and stdout, as an MCP host
        # starts a local server (tests/mcp/test_stdio.py, behind idemgate's
        # stdio door). $MCP_SERVER_PIDFILE, if set, gets this process's pid:
        # a test kills it mid-call.
        if os.environ.get("MCP_SERVER_PIDFILE"):
            with open(os.environ["MCP_SERVER_PIDFILE"], "w", encoding="utf-8") as f:
                f.write(str(os.getpid()))
        asyncio.run(server.run_stdio_async())
    else:
        port = int(sys.argv[1])
        json_response = "--json-response" in sys.argv[2:]
        asyncio.run(server.run_streamable_http_async(port=port, json_response=json_response))
