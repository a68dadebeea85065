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
ADMIN_TOKEN = "client-tests-token-operator"
#: The tenant TOKEN names: the one the operators' endpoints file its keys under.
TENANT = "acme"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(process: subprocess.Popen[bytes], url: str, log: Path, what: str) -> None:
    """Until ``url`` answers 200; fails with the log if the process exits or 30 s pass."""
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text(errors='replace')}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{what} did not answer within 30 s: {log.read_text(errors='replace')}")
        time.sleep(0.05)


class Server:
    def __init__(self, base_url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.base_url = base_url
        self.process = process
        self.log = log


def _postgres_url() -> str | None:
    """A fresh PostgreSQL database for the server, made with psql on the admin URL
    (IDEMGATE_CLIENT_TEST_PG, default postgres://postgres@127.0.0.1:5432/postgres);
    None when there is no PostgreSQL to use."""
    import shutil
    import uuid

    admin = os.environ.get("IDEMGATE_CLIENT_TEST_PG", "postgres://postgres@127.0.0.1:5432/postgres")
    if shutil.which("psql") is None:
        return None
    name = f"idemgate_clients_{uuid.uuid4().hex[:12]}"
    made = subprocess.run(["psql", admin, "-q", "-c", f'CREATE DATABASE "{name}"'],
                          capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return None
    return admin.rsplit("/", 1)[0] + f"/{name}"


def _drop(url: str) -> None:
    admin = os.environ.get("IDEMGATE_CLIENT_TEST_PG", "postgres://postgres@127.0.0.1:5432/postgres")
    name = url.rsplit("/", 1)[1]
    subprocess.run(["psql", admin, "-q", "-c", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'],
                   capture_output=True, timeout=30)


def _serve(binary: str, database_url: str, work: Path, port: int | None = None) -> Server:
    port = port or _free_port()
    log = work / "server.log"
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "IDEMGATE_LISTEN": f"127.0.0.1:{port}",
        "IDEMGATE_TOKENS": f"acme:{TOKEN},globex:{OTHER_TOKEN}",
        "IDEMGATE_ADMIN_TOKENS": f"ops:{ADMIN_TOKEN}",
        "IDEMGATE_PRUNE_INTERVAL": "0",
        "RUST_LOG": "warn",
    }
    env.pop("IDEMGATE_CONFIG", None)
    with open(log, "wb") as out:
        process = subprocess.Popen([binary, "serve"], env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    _wait_healthy(process, f"{base_url}/healthz", log, "idemgate serve")
    return Server(base_url, process, log)


def start_server(database_url: str, work: Path, port: int | None = None) -> Server:
    """An `idemgate serve` of a test's own on ``database_url`` (a test that
    stops it and starts another on the same store, on the same ``port`` if
    given); the caller terminates it."""
    binary = os.environ.get("IDEMGATE_BIN")
    if not binary:
        raise RuntimeError("set IDEMGATE_BIN to an idemgate binary (cargo build)")
    work.mkdir(parents=True, exist_ok=True)
    return _serve(binary, database_url, work, port)


def settle(base_url: str, key: str, body: dict[str, object], tenant: str = TENANT) -> dict[str, object]:
    """An operator settles a stuck key through ``POST /v1/admin/keys/{tenant}/{key_hash}/resolve``
    (with a token of IDEMGATE_ADMIN_TOKENS: a tenant's token is never an
    operator's): the key goes by its SHA-256, never in the clear."""
    import hashlib

    key_hash = hashlib.sha256(key.encode("utf-8")).hexdigest()
    answer = httpx.post(
        f"{base_url}/v1/admin/keys/{tenant}/{key_hash}/resolve",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    view: dict[str, object] = answer.json()
    return view


def admin_view(base_url: str, key: str, tenant: str = TENANT) -> dict[str, object]:
    """The operators' view of a key (``GET /v1/admin/keys/{tenant}/{key_hash}``)."""
    import hashlib

    key_hash = hashlib.sha256(key.encode("utf-8")).hexdigest()
    answer = httpx.get(
        f"{base_url}/v1/admin/keys/{tenant}/{key_hash}",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    view: dict[str, object] = answer.json()
    return view


def closed_port() -> int:
    """A loopback port nothing listens on: a connect to it is refused."""
    return _free_port()


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`idemgate serve` on each store: a SQLite file, and a PostgreSQL database
    of its own (required where IDEMGATE_CLIENT_TEST_REQUIRE_PG is set, as in CI)."""
    binary = os.environ.get("IDEMGATE_BIN")
    if not binary:
        raise RuntimeError(
            "set IDEMGATE_BIN to an idemgate binary (cargo build; IDEMGATE_BIN=target/debug/idemgate)"
        )
    work = tmp_path_factory.mktemp(f"idemgate-{request.param}")
    database_url = f"sqlite://{work / 'keys.db'}"
    if request.param == "postgres":
        made = _postgres_url()
        if made is None:
            if os.environ.get("IDEMGATE_CLIENT_TEST_REQUIRE_PG"):
                raise RuntimeError("no PostgreSQL to test on (psql on IDEMGATE_CLIENT_TEST_PG)")
            pytest.skip("no PostgreSQL (psql on IDEMGATE_CLIENT_TEST_PG); CI requires it")
        database_url = made
    served = _serve(binary, database_url, work)
    yield served
    served.process.terminate()
    try:
        served.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        served.process.kill()
    if request.param == "postgres":
        _drop(database_url)

class Origin:
    """A payments API that counts its charges, per idempotency key: ``/slow/MS``
    takes that long, ``/flaky`` answers 503 to a key's first call, ``/hangup``
    charges and then closes the connection without answering, ``/stall/MS``
    charges and then takes that long to answer, ``/events`` streams; ``GET /charges`` with the key finds the key's last charge (404:
    none), as a reconcile asks a payments API."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.charges: dict[str, int] = {}
        #: The last charge answered per key (GET /charges looks it up).
        self.answers: dict[str, bytes] = {}
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()
        # /events: when each event was sent, per key; a test releases each
        # event after the first by setting its gate.
        self.events_sent: dict[str, list[float]] = {}
        self.gates: dict[str, threading.Event] = {}
        origin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_GET(self) -> None:
                key = self.headers.get("idempotency-key", "")
                with origin.lock:
                    found = origin.answers.get(key)
                if found is None:
                    self._answer(404, b'{"error":"no charge"}')
                else:
                    self._answer(200, found)

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                key = self.headers.get("idempotency-key", "")
                with origin.lock:
                    origin.calls[key] = origin.calls.get(key, 0) + 1
                    call = origin.calls[key]
                if self.path.startswith("/events"):
                    self._events(key)
                    return
                if self.path.startswith("/hangup"):
                    # The charge is made, then the connection drops before
                    # any answer: whether it happened, the caller cannot tell.
                    with origin.lock:
                        origin.charges[key] = origin.charges.get(key, 0) + 1
                        origin.answers[key] = f'{{"charge":"ch_{sum(origin.charges.values())}"}}'.encode()
                    self.close_connection = True
                    return
                if self.path.startswith("/stall/"):
                    # The charge is made at once; the answer comes late (past
                    # the caller's read timeout): it acted, the caller cannot tell.
                    with origin.lock:
                        origin.charges[key] = origin.charges.get(key, 0) + 1
                        n = sum(origin.charges.values())
                        origin.answers[key] = f'{{"charge":"ch_{n}"}}'.encode()
                    time.sleep(int(self.path.rsplit("/", 1)[-1]) / 1000)
                    try:
                        self._answer(201, origin.answers[key])
                    except OSError:  # the caller gave up and closed its end
                        pass
                    return
                if self.path.startswith("/flaky") and call == 1:
                    self._answer(503, b'{"error":"busy"}', {"retry-after": "1"})
                    return
                if self.path.startswith("/slow/"):
                    time.sleep(int(self.path.rsplit("/", 1)[-1]) / 1000)
                with origin.lock:
                    origin.charges[key] = origin.charges.get(key, 0) + 1
                    n = sum(origin.charges.values())
                    origin.answers[key] = f'{{"charge":"ch_{n}"}}'.encode()
                self._answer(201, origin.answers[key])

            def _events(self, key: str) -> None:
                """Three server-sent events, each after the one before has been
                let through (the test's gate), the body ended by the close."""
                gate = origin.gates.setdefault(key, threading.Event())
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                for i in range(3):
                    if i > 0:
                        gate.wait(10)
                        gate.clear()
                    self.wfile.write(f"data: token {i}\n\n".encode())
                    self.wfile.flush()
                    origin.events_sent.setdefault(key, []).append(time.monotonic())
                self.close_connection = True

            def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="session")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Origin]]:
    """`idemgate proxy` in front of a counting origin: (the proxy's URL, the origin)."""
    binary = os.environ.get("IDEMGATE_BIN")
    if not binary:
        raise RuntimeError("set IDEMGATE_BIN to an idemgate binary (cargo build)")
    origin = Origin()
    work = tmp_path_factory.mktemp("proxy")
    port, admin = _free_port(), _free_port()
    log = work / "proxy.log"
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite://{work / 'proxy.db'}",
        "IDEMGATE_PRUNE_INTERVAL": "0",
        "RUST_LOG": "warn",
    }
    env.pop("IDEMGATE_CONFIG", None)
    args = [binary, "proxy", "--upstream", origin.url, "--listen", f"127.0.0.1:{port}",
            "--admin-listen", f"127.0.0.1:{admin}"]
    with open(log, "wb") as out:
        process = subprocess.Popen(args, env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    _wait_healthy(process, f"http://127.0.0.1:{admin}/healthz", log, "idemgate proxy")
    yield f"http://127.0.0.1:{port}", origin
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    origin.close()
