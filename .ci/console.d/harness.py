"""What the console's browser tests stand on: free ports, idemgate processes
(started, killed with SIGKILL, started again), a small origin that charges,
a TCP forwarder to PostgreSQL that can be cut and restored, throwaway
PostgreSQL databases, plain HTTP calls, and the record of checks.

Nothing here knows the console's page; console_test.py drives that.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STARTED = time.monotonic()


def elapsed() -> int:
    return int(time.monotonic() - STARTED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key_hash(key: str) -> str:
    """The hex SHA-256 of a raw key: how idemgate names it."""
    return hashlib.sha256(key.encode()).hexdigest()


def wait_until(fn, timeout: float, interval: float = 0.25, what: str = "a condition"):
    """Calls fn until it returns something truthy, and returns that; raises
    Failed naming `what` when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    last_error = None
    while True:
        try:
            value = fn()
            if value:
                return value
        except Failed:
            raise
        except Exception as e:  # the page or a server mid-change: try again
            last_error = e
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise Failed(f"waited {timeout:g} s for {what}{detail}")
        time.sleep(interval)


# === checks =================================================================


class Failed(Exception):
    """A check failed; the message says what was expected and what was seen."""


class Checks:
    """One line per check, `ok` or `FAIL`, with the seconds since the start."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0
        self.failures: list[str] = []
        self.case = ""  # the case running, named in the summary of failures

    def ok(self, what: str) -> None:
        self.passed += 1
        print(f"ok   [{elapsed():3d}s] {what}", flush=True)

    def fail(self, what: str) -> None:
        self.failed += 1
        first = what.splitlines()[0] if what else what
        self.failures.append(f"{self.case}: {first[:300]}" if self.case else first[:300])
        print(f"FAIL [{elapsed():3d}s] {what}", flush=True)

    def that(self, condition, what: str, detail: str = "") -> None:
        """Records `what` as checked; a false condition stops the case."""
        if condition:
            self.ok(what)
        else:
            raise Failed(f"{what}: {detail}" if detail else what)

    def soft(self, condition, what: str, detail: str = "") -> None:
        """Records `what`; a false condition is a failure, but the case goes on."""
        if condition:
            self.ok(what)
        else:
            self.fail(f"{what}: {detail}" if detail else what)

    def note(self, text: str) -> None:
        print(f"     [{elapsed():3d}s] {text}", flush=True)


# === HTTP ===================================================================


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"{self.status} {self.text[:300]!r}"


def call(method: str, url: str, body=None, headers: dict | None = None,
         timeout: float = 30, conn: http.client.HTTPConnection | None = None) -> Response:
    """One HTTP request; a dict or list body is sent as JSON."""
    parts = urllib.parse.urlsplit(url)
    headers = dict(headers or {})
    data = None
    if body is not None:
        if isinstance(body, (dict, list)):
            data = json.dumps(body).encode()
            headers.setdefault("content-type", "application/json")
        elif isinstance(body, str):
            data = body.encode()
        else:
            data = body
    own = conn is None
    if own:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        payload = r.read()
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, payload)
    finally:
        if own:
            conn.close()


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


# === idemgate processes =====================================================


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any IDEMGATE_* setting or DATABASE_URL of the
    caller's, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("IDEMGATE_") and k != "DATABASE_URL"}
    env.update({"RUST_LOG": "warn", "IDEMGATE_PRUNE_INTERVAL": "0", "NO_COLOR": "1"})
    env.update(extra)
    return env


class Idemgate:
    """One `idemgate serve` or `idemgate proxy`, its output in a log file."""

    all: list["Idemgate"] = []

    def __init__(self, binary: str, name: str, args: list[str], env: dict[str, str],
                 workdir: str, ready_url: str):
        self.binary = binary
        self.name = name
        self.args = args
        self.env = env
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.ready_url = ready_url
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        Idemgate.all.append(self)

    def start(self) -> "Idemgate":
        self.starts += 1
        log = open(self.log_path, "a")
        log.write(f"---- start {self.starts}: idemgate {' '.join(self.args)}\n")
        log.flush()
        self.proc = subprocess.Popen([self.binary, *self.args], env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        return self

    def wait_ready(self, timeout: float = 30) -> "Idemgate":
        def up():
            if self.proc.poll() is not None:
                raise Failed(f"{self.name} exited with {self.proc.returncode} at start:\n"
                             + self.log_tail())
            return call("GET", self.ready_url, timeout=2).status == 200
        wait_until(up, timeout, 0.1, f"{self.name} to answer {self.ready_url}")
        return self

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def log_text(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    @classmethod
    def stop_all(cls) -> None:
        for p in cls.all:
            try:
                p.stop()
            except Exception as e:
                print(f"note: stopping {p.name}: {e}", file=sys.stderr)


# === the origin =============================================================


class Origin:
    """An origin that charges: `POST /charges` sleeps, then records one
    charge and answers 201 `{"charge": N}`, whether or not anyone still
    listens; `GET /charges` answers `{"charges": total, "by_key": {key: n}}`,
    keyed by the Idempotency-Key header as the origin received it."""

    def __init__(self, sleep: float = 3.0):
        self.sleep = sleep
        self.lock = threading.Condition()
        self.total = 0
        self.by_key: dict[str, int] = {}
        self.arrived: list[str] = []
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def send(self, status: int, payload: dict) -> None:
                body = json.dumps(payload, separators=(",", ":")).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the proxy was killed while we slept

            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                key = self.headers.get("idempotency-key") or ""
                with origin.lock:
                    origin.arrived.append(key)
                    origin.lock.notify_all()
                if self.path.split("?")[0] != "/charges":
                    return self.send(404, {"error": "no such path"})
                time.sleep(origin.sleep)
                with origin.lock:
                    origin.total += 1
                    origin.by_key[key] = origin.by_key.get(key, 0) + 1
                    n = origin.total
                    origin.lock.notify_all()
                self.send(201, {"charge": n})

            def do_GET(self):
                with origin.lock:
                    payload = {"charges": origin.total, "by_key": dict(origin.by_key)}
                self.send(200, payload)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a connection the killed proxy left half-open

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_arrived(self, keys: list[str], timeout: float = 15) -> None:
        with self.lock:
            if not self.lock.wait_for(lambda: all(k in self.arrived for k in keys), timeout):
                raise Failed(f"the origin did not receive {keys} within {timeout} s "
                             f"(it received {self.arrived})")

    def wait_charged(self, keys: list[str], timeout: float = 15) -> None:
        with self.lock:
            if not self.lock.wait_for(lambda: all(k in self.by_key for k in keys), timeout):
                raise Failed(f"the origin did not finish charging {keys} within {timeout} s")

    def charges(self) -> dict:
        """`GET /charges`, over HTTP as any client would ask."""
        return call("GET", f"{self.url}/charges", timeout=5).json()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# === the forwarder ==========================================================


class Forwarder:
    """127.0.0.1:port → target, byte for byte. `stop()` closes the listener
    and every connection (the database is away for whoever used it);
    `start()` listens again on the same port."""

    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.port = free_port()
        self.lock = threading.Lock()
        self.sockets: set[socket.socket] = set()
        self.listener: socket.socket | None = None
        self.running = False

    def start(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 10
        while True:
            try:
                s.bind(("127.0.0.1", self.port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        s.listen(64)
        s.settimeout(0.2)
        self.listener = s
        self.running = True
        self.acceptor = threading.Thread(target=self._accept, args=(s,), daemon=True)
        self.acceptor.start()

    def _accept(self, listener: socket.socket) -> None:
        while self.running and self.listener is listener:
            try:
                client, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                if not self.running:
                    client.close()
                    upstream.close()
                    return
                self.sockets.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            with self.lock:
                self.sockets.discard(src)
                self.sockets.discard(dst)

    def stop(self) -> None:
        with self.lock:
            self.running = False
            listener, self.listener = self.listener, None
            open_sockets = list(self.sockets)
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # stops listening now, wakes accept
            except OSError:
                pass
            self.acceptor.join(5)
            listener.close()
        for s in open_sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# === PostgreSQL =============================================================


class Postgres:
    """Throwaway databases on the server of `admin_url`, made with psql and
    dropped (WITH FORCE) at the end."""

    def __init__(self, admin_url: str):
        self.admin_url = admin_url
        self.made: list[str] = []
        parts = urllib.parse.urlsplit(admin_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 5432

    def psql(self, sql: str) -> None:
        if shutil.which("psql") is None:
            raise Failed("psql is not installed (Debian's postgresql-client)")
        r = subprocess.run(["psql", "-q", "-v", "ON_ERROR_STOP=1", self.admin_url, "-c", sql],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise Failed(f"psql {sql!r} on {self.redacted()}: {r.stderr.strip()}")

    def redacted(self) -> str:
        p = urllib.parse.urlsplit(self.admin_url)
        netloc = p.hostname or ""
        if p.username:
            netloc = f"{p.username}@{netloc}"
        if p.port:
            netloc += f":{p.port}"
        return urllib.parse.urlunsplit((p.scheme, netloc, p.path, "", ""))

    def create(self, name: str) -> str:
        """A new database; returns its URL."""
        self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.psql(f'CREATE DATABASE "{name}"')
        self.made.append(name)
        return self.url_of(name)

    def url_of(self, name: str, host: str | None = None, port: int | None = None) -> str:
        p = urllib.parse.urlsplit(self.admin_url)
        netloc = p.netloc
        if host is not None or port is not None:
            userinfo = netloc.rsplit("@", 1)[0] + "@" if "@" in netloc else ""
            netloc = f"{userinfo}{host or self.host}:{port or self.port}"
        return urllib.parse.urlunsplit((p.scheme, netloc, "/" + name, p.query, ""))

    def drop_all(self) -> None:
        for name in self.made:
            try:
                self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            except Exception as e:
                print(f"note: could not drop database {name}: {e}", file=sys.stderr)
        self.made.clear()
