"""An MCP tool server (the official `mcp` Python SDK) whose `create_charge`
tool takes an optional `idempotency_key` argument, strips it from the
arguments, and sends it as the `X-Idempotency-Key` header to a REST API
guarded by `idemgate proxy --key-header X-Idempotency-Key`.

The model never needs to understand the key: the agent runtime (or the
model, told to) passes the same key when it calls the tool again for the
same step, and the proxy answers a retry with the first charge.

    PAYMENTS_API=http://127.0.0.1:8081 .venv/bin/python examples/mcp-tool/server.py   # stdio (the venv of demo.py)
"""

from __future__ import annotations

import logging
import os
from typing import Any

import httpx
from mcp.server.mcpserver import MCPServer

server = MCPServer("payments")
# stdout is the protocol's; keep httpx's request lines off stderr too.
logging.getLogger("httpx").setLevel(logging.WARNING)


@server.tool(
    description=(
        "Charge a customer. Pass idempotency_key (the same one for every retry of this "
        "step) so that a retry never charges twice."
    )
)
def create_charge(customer: str, amount: int, idempotency_key: str | None = None) -> dict[str, Any]:
    api = os.environ["PAYMENTS_API"]
    # The key is not an argument of the API's: it travels as the header.
    headers = {"X-Idempotency-Key": idempotency_key} if idempotency_key else {}
    answer = httpx.post(f"{api}/charges", json={"customer": customer, "amount": amount}, headers=headers, timeout=30)
    body: Any = answer.json() if "json" in answer.headers.get("content-type", "") else answer.text
    return {
        "status": answer.status_code,
        "replayed": answer.headers.get("idempotent-replayed") == "true",
        "body": body,
    }


if __name__ == "__main__":
    server.run("stdio")
