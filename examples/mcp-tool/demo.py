"""Calls the MCP tool server (server.py) as an MCP client would, in front of
`idemgate proxy --key-header X-Idempotency-Key` and a payments API that
counts its charges:

  1. create_charge with a key: charged;
  2. the same call again, as a client that timed out or a model that "is not
     sure it worked" would make it: the first charge, replayed;
  3. the same key with another amount: 422 key-reused, nothing charged;
  4. another key: a second charge.

    cargo build --release                                      # target/release/idemgate
    python3 -m venv .venv && .venv/bin/pip install httpx mcp   # PEP 668: not the system's pip
    IDEMGATE_BIN=target/release/idemgate PYTHONPATH=clients/python/src \\
        .venv/bin/python examples/mcp-tool/demo.py

Exits 1 unless the API charged exactly twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from idemgate_client import derive_key


class PaymentsAPI:
    def __init__(self) -> None:
        self.charges: list[dict[str, object]] = []
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                with api.lock:
                    api.charges.append(body)
                    n = len(api.charges)
                data = json.dumps({"charge": f"ch_{n}", **body}).encode()
                self.send_response(201)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_proxy(binary: str, upstream: str, work: str) -> tuple[subprocess.Popen[bytes], str]:
    port, admin = free_port(), free_port()
    env = {**os.environ, "DATABASE_URL": f"sqlite://{work}/keys.db", "IDEMGATE_PRUNE_INTERVAL": "0", "RUST_LOG": "warn"}
    env.pop("IDEMGATE_CONFIG", None)
    with open(f"{work}/proxy.log", "wb") as log:
        proxy = subprocess.Popen(
            [binary, "proxy", "--upstream", upstream, "--key-header", "X-Idempotency-Key",
             "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}"],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )
    deadline = time.monotonic() + 30
    while True:
        if proxy.poll() is not None:
            sys.exit("idemgate proxy exited: " + open(f"{work}/proxy.log", errors="replace").read())
        try:
            if httpx.get(f"http://127.0.0.1:{admin}/healthz", timeout=1).status_code == 200:
                return proxy, f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proxy.kill()
            sys.exit("idemgate proxy did not answer within 30 s")
        time.sleep(0.05)


async def calls(proxy_url: str) -> list[dict[str, object]]:
    env = {**os.environ, "PAYMENTS_API": proxy_url}
    params = StdioServerParameters(command=sys.executable, args=[str(Path(__file__).with_name("server.py"))], env=env)
    key = derive_key(tenant="acme", run=f"run-{uuid.uuid4()}", step=1, tool="create_charge")
    other = derive_key(tenant="acme", run=f"run-{uuid.uuid4()}", step=1, tool="create_charge")
    plan = [
        ("a charge", {"customer": "cus_1", "amount": 500, "idempotency_key": key}),
        ("the same call again", {"customer": "cus_1", "amount": 500, "idempotency_key": key}),
        ("the same key, another amount", {"customer": "cus_1", "amount": 900, "idempotency_key": key}),
        ("another key", {"customer": "cus_1", "amount": 500, "idempotency_key": other}),
    ]
    out = []
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            for what, arguments in plan:
                result = await session.call_tool("create_charge", arguments)
                answer = json.loads(result.content[0].text)  # type: ignore[union-attr]
                print(f"  {what}: {answer['status']}{' (replayed)' if answer['replayed'] else ''} {answer['body']}")
                out.append(answer)
    return out


def main() -> int:
    binary = os.environ.get("IDEMGATE_BIN") or shutil.which("idemgate")
    if not binary:
        sys.exit("set IDEMGATE_BIN to an idemgate binary (or put idemgate on PATH)")
    work = tempfile.mkdtemp(prefix="mcp-tool-")
    api = PaymentsAPI()
    proxy, proxy_url = start_proxy(binary, api.url, work)
    try:
        print("create_charge through an MCP tool server and idemgate proxy:")
        answers = asyncio.run(calls(proxy_url))
    finally:
        proxy.terminate()
        proxy.wait(timeout=20)
        shutil.rmtree(work, ignore_errors=True)
    statuses = [a["status"] for a in answers]
    print(f"charges the payments API made: {len(api.charges)}")
    ok = statuses == [201, 201, 422, 201] and answers[1]["replayed"] and len(api.charges) == 2
    print("two charges, the retry replayed, the changed amount refused" if ok else "UNEXPECTED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
