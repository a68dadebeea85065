"""A real `idemgate serve` for the tests: the binary named by IDEMGATE_BIN
(.ci/clients builds it and sets it), on a SQLite file of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

TOKEN = "client-tests-token-acme"
OTHER_TOKEN = "client-tests-token-globex"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base_url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.base_url = base_url
        self.process = process
        self.log = log


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    binary = os.environ.get("IDEMGATE_BIN")
    if not binary:
        raise RuntimeError(
            "set IDEMGATE_BIN to an idemgate binary (cargo build; IDEMGATE_BIN=target/debug/idemgate)"
        )
    work = tmp_path_factory.mktemp("idemgate")
    port = _free_port()
    log = work / "server.log"
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite://{work / 'keys.db'}",
        "IDEMGATE_LISTEN": f"127.0.0.1:{port}",
        "IDEMGATE_TOKENS": f"acme:{TOKEN},globex:{OTHER_TOKEN}",
        "IDEMGATE_PRUNE_INTERVAL": "0",
        "RUST_LOG": "warn",
    }
    env.pop("IDEMGATE_CONFIG", None)
    with open(log, "wb") as out:
        process = subprocess.Popen([binary, "serve"], env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"idemgate serve exited: {log.read_text(errors='replace')}")
        try:
            if httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"idemgate serve did not answer within 30 s: {log.read_text(errors='replace')}")
        time.sleep(0.05)
    yield Server(base_url, process, log)
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
