"""The official Python MCP client as the door's tests drive it, whichever
release is installed: mcp 2.x (.ci/clients' pins) or mcp 1.x (the last 1.x
release, .ci/mcp's second virtualenv), and in each of its ways to connect.

- "default": mcp 2.x's `mcp.Client(url)` as it comes, which negotiates the
  newest protocol (2026-07-28): a `server/discover` probe, no `initialize`,
  no session id, the version in every request's `MCP-Protocol-Version`
  header and `_meta` — and falls back to `initialize` when the probe fails,
  so the session checks it really got 2026-07-28.
- "legacy": `ClientSession` over `streamable_http_client` and
  `initialize()` (2025-11-25), in both majors.

A session's results are handed back as the JSON object the client read
(`_meta`, `isError`, `structuredContent`, ... by their wire names), so the
tests read them the same way under either major. Whatever the client refuses
to read (a pydantic ValidationError: a result not valid under the negotiated
protocol) propagates: such an answer is a failure.

`RawSession` speaks the same protocol versions with httpx, for what the
clients hide: the raw JSON-RPC answer (its `resultType`, its `id`) and a
`notifications/cancelled` sent by hand.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from importlib.metadata import version
from typing import Any

import httpx
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

MCP_VERSION = version("mcp")
MAJOR = int(MCP_VERSION.split(".")[0])

if MAJOR >= 2:
    from mcp import Client
    from mcp.shared.exceptions import MCPError as RpcError
else:
    from mcp.shared.exceptions import McpError as RpcError  # type: ignore[no-redef,attr-defined]

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
# The modes this release has, and the protocol version each must negotiate.
MODES: tuple[str, ...] = ("default", "legacy") if MAJOR >= 2 else ("legacy",)
EXPECTED_VERSION = {"default": MODERN, "legacy": LEGACY}
KEY_META = "dev.idemgate/idempotency-key"
PROBLEM_META = "dev.idemgate/problem"

__all__ = [
    "EXPECTED_VERSION", "KEY_META", "MAJOR", "MODERN", "MODES",
    "RawSession", "RpcError", "Session", "problem_type", "session",
]


def _wire(result: Any) -> dict[str, Any]:
    return dict(result.model_dump(by_alias=True, mode="json", exclude_none=True))


def _timeout(seconds: float | None) -> Any:
    if seconds is None:
        return None
    return seconds if MAJOR >= 2 else timedelta(seconds=seconds)


@dataclass
class Session:
    """One connected session of the official client."""

    mode: str
    protocol_version: str
    _client: Any

    async def list_tools(self) -> dict[str, dict[str, Any]]:
        """Each tool's inputSchema, by name."""
        tools = (await self._client.list_tools()).tools
        return {t.name: _wire(t)["inputSchema"] for t in tools}

    async def call(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        meta: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The tool's result, as read by the client; a JSON-RPC error raises RpcError."""
        kwargs: dict[str, Any] = {}
        if meta is not None:
            kwargs["meta"] = meta
        if timeout is not None:
            kwargs["read_timeout_seconds"] = _timeout(timeout)
        return _wire(await self._client.call_tool(name, arguments, **kwargs))


@asynccontextmanager
async def session(url: str, mode: str) -> AsyncIterator[Session]:
    """A session with the MCP endpoint at `url`, connected as `mode` says."""
    if mode == "default":
        async with Client(url) as client:
            negotiated = client.protocol_version
            # The client falls back to initialize when discover fails: that
            # is not the default mode any more, and the test would not say so.
            assert negotiated == MODERN, f"the default client negotiated {negotiated}, not {MODERN}"
            yield Session(mode, negotiated, client)
        return
    assert mode == "legacy", mode
    async with streamable_http_client(url) as (read, write, *_):
        async with ClientSession(read, write) as s:
            init = _wire(await s.initialize())
            yield Session(mode, str(init["protocolVersion"]), s)


def problem_type(result: dict[str, Any]) -> str:
    """The problem's name of a refusal (an isError tool result): from its
    _meta, which a refusal always has, after checking its text names it and
    its structuredContent, where there is one, is the same problem."""
    assert result.get("isError") is True, result
    problem = result["_meta"][PROBLEM_META]
    name = str(problem["type"]).rsplit("/", 1)[-1]
    if "structuredContent" in result:
        assert result["structuredContent"] == problem, result
    assert any(name in c.get("text", "") for c in result["content"]), result
    return name


@dataclass
class RawSession:
    """The MCP wire at one protocol version, by hand (httpx): `initialize`
    and the session id for the handshake versions, the `_meta` envelope and
    headers of each request for 2026-07-28."""

    url: str
    protocol_version: str
    client: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=30))
    session_id: str | None = None
    next_id: int = 1

    async def __aenter__(self) -> RawSession:
        if self.protocol_version != MODERN:
            init = await self.request("initialize", {
                "protocolVersion": self.protocol_version,
                "capabilities": {},
                "clientInfo": {"name": "idemgate-door-test-raw", "version": "0"},
            })
            assert "result" in init, init
            await self.notify("notifications/initialized")
        return self

    async def __aexit__(self, *_: object) -> None:
        if self.session_id:
            await self.client.delete(self.url, headers=self.headers())
        await self.client.aclose()

    def headers(self, method: str | None = None, name: str | None = None) -> dict[str, str]:
        headers = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
        if self.session_id:
            headers["mcp-session-id"] = self.session_id
        if self.protocol_version == MODERN:
            headers["mcp-protocol-version"] = MODERN
            if method:
                headers["mcp-method"] = method
            if name:
                headers["mcp-name"] = name
        elif self.session_id:
            headers["mcp-protocol-version"] = self.protocol_version
        return headers

    def envelope(self, params: dict[str, Any]) -> dict[str, Any]:
        if self.protocol_version != MODERN:
            return params
        meta = {
            "io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientInfo": {"name": "idemgate-door-test-raw", "version": "0"},
            "io.modelcontextprotocol/clientCapabilities": {},
        }
        return {**params, "_meta": {**meta, **params.get("_meta", {})}}

    async def request(self, method: str, params: dict[str, Any], *, name: str | None = None,
                      rid: Any = None) -> dict[str, Any]:
        """The JSON-RPC answer to one request, from a JSON body or an event stream."""
        if rid is None:
            rid = f"raw-{self.next_id}-{uuid.uuid4().hex[:6]}"
            self.next_id += 1
        body = {"jsonrpc": "2.0", "id": rid, "method": method, "params": self.envelope(params)}
        response = await self.client.post(self.url, json=body, headers=self.headers(method, name))
        if method == "initialize" and "mcp-session-id" in response.headers:
            self.session_id = response.headers["mcp-session-id"]
        answer = answer_of(response, rid)
        answer["_http_status"] = response.status_code
        answer["_content_type"] = response.headers.get("content-type", "")
        return answer

    async def call(self, name: str, arguments: dict[str, Any], *, meta: dict[str, Any] | None = None,
                   rid: Any = None) -> dict[str, Any]:
        params: dict[str, Any] = {"name": name, "arguments": arguments}
        if meta:
            params["_meta"] = meta
        return await self.request("tools/call", params, name=name, rid=rid)

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> httpx.Response:
        body: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            body["params"] = params
        return await self.client.post(self.url, json=body, headers=self.headers(method))


def answer_of(response: httpx.Response, rid: Any) -> dict[str, Any]:
    """The JSON-RPC message answering `rid` in an HTTP response (JSON or SSE)."""
    kind = response.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        for event in response.text.replace("\r\n", "\n").split("\n\n"):
            data = "\n".join(line[5:].lstrip() for line in event.split("\n") if line.startswith("data:"))
            if data:
                message = json.loads(data)
                if message.get("id") == rid:
                    return dict(message)
        raise AssertionError(f"no answer to {rid!r} in the event stream: {response.text[:2000]}")
    assert kind.startswith("application/json"), (response.status_code, kind, response.text[:2000])
    return dict(json.loads(response.text))
