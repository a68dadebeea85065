"""The MCP door's tests (test_door.py, test_burst.py): their fixtures and marker."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from door_rig import Rig, SharedServer, free_port, start_mcp_server
from official import MODES


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mcp1: also run with the last mcp 1.x client (.ci/mcp: -m mcp1)")


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SharedServer]]:
    """One server.py per answer form, shared by the tests (of one worker):
    starting the SDK is what costs; each test has its customer."""
    tmp = tmp_path_factory.mktemp("servers")
    running: list[subprocess.Popen[bytes]] = []
    shared: dict[str, SharedServer] = {}
    try:
        for form in ("event-stream", "json"):
            port, log = free_port(), tmp / f"executions-{form}.jsonl"
            running.append(start_mcp_server(port, log, form == "json", tmp / f"server-{form}.log"))
            shared[form] = SharedServer(port, log)
        yield shared
    finally:
        for proc in running:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture(params=["event-stream", "json"])
def rig(request: pytest.FixtureRequest, tmp_path: Path, servers: dict[str, SharedServer]) -> Iterator[Rig]:
    """A proxy in front of the shared server of one answer form, for a
    customer of this test's own."""
    shared = servers[request.param]
    rig = Rig(tmp_path, json_response=request.param == "json", server_port=shared.port,
              shared_log=shared.log, who=f"c-{uuid.uuid4().hex[:10]}")
    try:
        rig.start_proxy()
        yield rig
    finally:
        rig.stop()


@pytest.fixture(params=["event-stream", "json"])
def own_rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    """A server of this test's own (it kills it), and a proxy in front."""
    rig = Rig(tmp_path, json_response=request.param == "json", who=f"c-{uuid.uuid4().hex[:10]}")
    try:
        rig.start_server()
        rig.start_proxy()
        yield rig
    finally:
        rig.stop()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """How the official client connects: "default" (mcp 2.x's `Client`,
    2026-07-28) or "legacy" (`ClientSession` + `initialize`)."""
    return str(request.param)
