"""The rig of the MCP door's tests: server.py (an unmodified MCP server made
with the official Python SDK, which logs every execution of a tool to
$CHARGES_LOG) and `idemgate proxy --protocol mcp` processes in front of it.
The fixtures that make them are in conftest.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
BIN = os.environ.get("IDEMGATE_BIN", str(HERE.parents[1] / "target" / "debug" / "idemgate"))
# The server runs on mcp 2.x: under the mcp 1.x client, .ci/mcp names the Python that has it.
SERVER_PYTHON = os.environ.get("MCP_SERVER_PYTHON", sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(url: str, what: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start at {url}")


def door_env(**settings: str) -> dict[str, str]:
    """The proxy's environment: this one without any IDEMGATE_ setting (each
    test says what it sets), plus `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMGATE_")}
    env.update(settings)
    return env


@dataclass
class Door:
    """One `idemgate proxy --protocol mcp`: its MCP endpoint and admin URLs."""

    url: str
    admin: str
    process: subprocess.Popen[bytes]


def start_mcp_server(port: int, log: Path, json_response: bool, stderr: Path) -> subprocess.Popen[bytes]:
    """server.py on `port`, logging each execution of a tool to `log`."""
    args = [SERVER_PYTHON, str(HERE / "server.py"), str(port)]
    if json_response:
        args.append("--json-response")
    server = subprocess.Popen(
        args,
        env={**os.environ, "CHARGES_LOG": str(log), "PYTHONDONTWRITEBYTECODE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=open(stderr, "ab"),
    )
    try:
        wait_for(f"http://127.0.0.1:{port}/", "the MCP server")
    except BaseException:
        server.kill()
        server.wait()
        raise
    return server


@dataclass
class Rig:
    """The MCP server, and the idemgate proxies in front of it (`url` and
    `admin` are the last one's). The server is the rig's own (start_server)
    or one shared by the tests (`who` then names the customer of this test,
    whose executions are the rig's)."""

    tmp: Path
    json_response: bool
    server: subprocess.Popen[bytes] | None = None
    proxy: subprocess.Popen[bytes] | None = None
    server_port: int = 0
    url: str = ""
    admin: str = ""
    doors: list[Door] = field(default_factory=list)
    shared_log: Path | None = None
    who: str | None = None

    @property
    def log(self) -> Path:
        return self.shared_log or self.tmp / "executions.jsonl"

    def start_server(self) -> None:
        if not self.server_port:
            self.server_port = free_port()
        self.server = start_mcp_server(self.server_port, self.log, self.json_response, self.tmp / "server.log")

    def database_url(self) -> str:
        return f"sqlite://{self.tmp / f'keys-{len(self.doors)}.db'}"

    def start_proxy(self, *flags: str, env: dict[str, str] | None = None, upstream: str | None = None) -> Door:
        """A proxy in front of the server, on a database of its own (a new
        SQLite file; PgRig: its PostgreSQL database)."""
        port, admin = free_port(), free_port()
        process = subprocess.Popen(
            [
                BIN, "proxy", "--protocol", "mcp",
                "--upstream", upstream or f"http://127.0.0.1:{self.server_port}",
                "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
                "--database-url", self.database_url(),
                *flags,
            ],
            env=env if env is not None else door_env(),
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / "proxy.log", "ab"),
        )
        door = Door(f"http://127.0.0.1:{port}/mcp", f"http://127.0.0.1:{admin}", process)
        self.doors.append(door)  # stopped with the rig, even if it never answers
        try:
            wait_for(f"http://127.0.0.1:{admin}/healthz", "idemgate proxy")
        except RuntimeError as e:
            log = (self.tmp / "proxy.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{e}: {log}") from None
        self.proxy, self.url, self.admin = process, door.url, door.admin
        return door

    def executions(self, tool: str | None = None) -> list[dict[str, Any]]:
        """What the server ran (of `tool`), for this rig's customer if it has one."""
        if not self.log.exists():
            return []
        lines = [json.loads(line) for line in self.log.read_text().splitlines() if line]
        return [e for e in lines
                if (tool is None or e["tool"] == tool) and (self.who is None or e.get("customer") == self.who)]

    def wait_for_executions(self, tool: str, n: int, within: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + within
        while len(self.executions(tool)) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.executions(tool)

    def stop(self) -> None:
        for proc in [*(d.process for d in self.doors), self.proxy, self.server]:
            if proc and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()


@dataclass
class SharedServer:
    port: int
    log: Path


def settle(admin: str, response: dict[str, Any], reason: str) -> None:
    """An operator settles the one unknown key with `response` (the tool's
    result alone, as the server's records show it), through the admin API."""
    stuck = httpx.get(f"{admin}/v1/admin/keys", params={"state": "unknown"}, timeout=10).json()["keys"]
    assert len(stuck) == 1, stuck
    answer = httpx.post(
        f"{admin}/v1/admin/keys/{stuck[0]['tenant']}/{stuck[0]['key_hash']}/resolve",
        json={"action": "complete", "reason": reason,
              "response": {"status": 200, "headers": [["content-type", "application/json"]],
                           "body": json.dumps(response)}},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
