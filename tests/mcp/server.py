"""An MCP server made with the official Python SDK (`mcp`), unchanged by
idemgate: a write tool that charges, a slow one, one that asks the user to
confirm first (elicitation: a multi-round-trip call under 2026-07-28, a
question mid-call under 2025-11-25), and a read-only one. Every
execution of a write tool appends a line to $CHARGES_LOG, so a test counts
what really ran; the slow one also logs its start (tool "slow_charge.started"),
so a test sees a call in flight and whether it ran to its end.

    CHARGES_LOG=/tmp/charges python3 tests/mcp/server.py PORT [--json-response]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from typing import Any

from typing import Annotated

from mcp.server.mcpserver import Elicit, ListRoots, MCPServer, Resolve, Sample
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


def _note(customer: str, amount: int) -> Sample:
    question = TextContent(type="text", text=f"A one-line note for charging {customer} {amount}.")
    return Sample([SamplingMessage(role="user", content=question)], max_tokens=50)


def _roots() -> ListRoots:
    return ListRoots()


@server.tool(description="Charge, with a note the client's model writes (sampling) and the client's roots.")
def noted_charge(
    customer: str,
    amount: int,
    note: Annotated[CreateMessageResult, Resolve(_note)],
    roots: Annotated[ListRootsResult, Resolve(_roots)],
) -> dict[str, Any]:
    text = note.content.text if isinstance(note.content, TextContent) else ""
    where = [str(r.uri) for r in roots.roots]
    return {"charge": _record("noted_charge", customer=customer, amount=amount, note=text, roots=where),
            "amount": amount, "note": text, "roots": where}


@server.tool(description="A customer's balance.", annotations=ToolAnnotations(readOnlyHint=True))
def balance(customer: str) -> dict[str, Any]:
    with open(os.environ["CHARGES_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps({"tool": "balance", "customer": customer}) + "\n")
    return {"customer": customer, "balance": 100}


if __name__ == "__main__":
    port = int(sys.argv[1])
    json_response = "--json-response" in sys.argv[2:]
    asyncio.run(server.run_streamable_http_async(port=port, json_response=json_response))
