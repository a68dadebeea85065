"""The Stripe Python SDK, at its defaults, through `idemgate proxy` in front
of an origin slower than the SDK's timeout: every call must come back with
its charge, and the origin must have charged each key once.

The SDK is used as its documentation shows, through the module's globals
(`stripe.Charge.create`), changed in three things only: `api_base` (the
proxy), an API key, and the HTTP client's timeout (the default client class,
made by `stripe.new_default_http_client(timeout=...)`), shorter than the
origin takes. `stripe.max_network_retries` stays at the default this script
asserts (2); the SDK makes an Idempotency-Key for each create() and sends it
again with each retry, and it retries a timeout, a 409 and a 5xx after
0.5 s, then 0.5 to 1 s (it does not read Retry-After). (`StripeClient`, the
SDK's newer entry point, does not retry at all unless told to: its
max_network_retries defaults to None, which means 0, in 16.1.0.)

The timeline of one call, with SDK_TIMEOUT = 3 s and ORIGIN_DELAY = 5.5 s:

  0 s     the first attempt reaches the origin through the proxy;
  3 s     the SDK times out and hangs up (the proxy keeps the call running);
  3.5 s   the first retry: the proxy holds it (IDEMGATE_DEFAULT_WAIT, 10 s)
  5.5 s   and, when the origin answers, replays that answer: the charge.

With `--default-wait 0` (the proxy as it was before holding duplicates) the
first retry gets 409 request-in-flight at 3.5 s, the second another at 4 to
4.5 s, and the SDK raises, a second before the origin charges. That trial
runs too, and must fail to get every charge back: it shows the check can
fail. Each gap is at least a second, so a slow machine does not change the
outcome.

    python stripe_trial.py IDEMGATE_BIN [POSTGRES_URL]

Runs on a SQLite file of its own, then on POSTGRES_URL (an empty database the
caller made and drops) when given; then the `--default-wait 0` trial on a
SQLite file. Exits 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# Loopback only, whatever proxy the environment names.
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"

import stripe  # noqa: E402

CALLS = 4
SDK_TIMEOUT = 3.0
ORIGIN_DELAY = 5.5
DEFAULT_RETRIES = 2


class CheckFailed(Exception):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the origin -------------------------------------------------------------


class Origin:
    """A fake Stripe: `POST /v1/charges` (form-encoded, as the SDK sends it)
    takes ORIGIN_DELAY seconds, records the execution under its
    Idempotency-Key, and answers a charge as Stripe shapes one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executions: dict[str, list[str]] = {}  # key -> charge ids made
        self.running = 0
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                if self.path != "/v1/charges":
                    self.answer(404, {"error": {"type": "invalid_request_error", "message": "no such route"}})
                    return
                key = self.headers.get("idempotency-key") or "(none)"
                charge_id = "ch_" + secrets.token_hex(12)
                with origin.lock:
                    origin.executions.setdefault(key, []).append(charge_id)
                    origin.running += 1
                try:
                    time.sleep(ORIGIN_DELAY)
                finally:
                    with origin.lock:
                        origin.running -= 1
                amount = int(form.get("amount", ["0"])[0])
                self.answer(
                    200,
                    {
                        "id": charge_id,
                        "object": "charge",
                        "amount": amount,
                        "amount_captured": amount,
                        "amount_refunded": 0,
                        "captured": True,
                        "created": int(time.time()),
                        "currency": form.get("currency", ["usd"])[0],
                        "livemode": False,
                        "metadata": {},
                        "paid": True,
                        "refunded": False,
                        "status": "succeeded",
                    },
                )

            def answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("request-id", "req_" + secrets.token_hex(8))
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def idle(self) -> bool:
        with self.lock:
            return self.running == 0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- the proxy --------------------------------------------------------------


class Proxy:
    """`idemgate proxy` at its defaults: only its addresses and database are
    given (and whatever `extra` flags a trial names)."""

    def __init__(self, binary: str, upstream: str, database_url: str, log: Path, extra: list[str]) -> None:
        port, admin = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        # No IDEMGATE_* setting from the caller's environment: the defaults.
        env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMGATE_") and k != "DATABASE_URL"}
        env["RUST_LOG"] = "warn"
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [binary, "proxy", "--upstream", upstream, "--listen", f"127.0.0.1:{port}",
                 "--admin-listen", f"127.0.0.1:{admin}", "--database-url", database_url, *extra],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            )
        deadline = time.monotonic() + 60
        while True:
            check(self.process.poll() is None, f"idemgate proxy exited:\n{self.log_text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            check(time.monotonic() < deadline, f"idemgate proxy not ready within 60 s:\n{self.log_text()}")
            time.sleep(0.05)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# --- the SDK ----------------------------------------------------------------


class Attempts:
    """What each HTTP attempt of the SDK got, per idempotency key: the SDK's
    own client, its request method wrapped to take notes, nothing else
    changed."""

    def __init__(self, client: Any) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[str, list[str]] = {}
        self.last = threading.local()  # the key of this thread's call
        inner = client.request

        def request(method: str, url: str, headers: Any, post_data: Any = None, **kwargs: Any) -> Any:
            key = (headers or {}).get("Idempotency-Key", "(none)")
            self.last.key = key
            try:
                body, status, rheaders = inner(method, url, headers, post_data, **kwargs)
            except stripe.APIConnectionError as e:
                cause = type(e.__cause__).__name__ if e.__cause__ else "connection error"
                self.note(key, "timeout" if "Timeout" in cause else cause)
                raise
            replayed = rheaders.get("idempotent-replayed") == "true"
            self.note(key, f"{status}{' replayed' if replayed else ''}")
            return body, status, rheaders

        client.request = request

    def note(self, key: str, what: str) -> None:
        with self.lock:
            self.by_key.setdefault(key, []).append(what)


def charge(i: int, attempts: Attempts) -> tuple[Any, str | None, str]:
    """One create(), as an application makes it: the charge, or the error the
    SDK raised (the class and the HTTP status); and the key the SDK sent."""
    attempts.last.key = "(none)"
    try:
        made, error = stripe.Charge.create(amount=1000 + i, currency="usd", source="tok_visa"), None
    except stripe.StripeError as e:
        made, error = None, f"{type(e).__name__} {e.http_status}" if e.http_status else type(e).__name__
    return made, error, attempts.last.key


def trial(binary: str, store: str, database_url: str, log: Path, extra: list[str]) -> dict[str, Any]:
    origin = Origin()
    proxy = None
    try:
        proxy = Proxy(binary, origin.url, database_url, log, extra)
        stripe.api_base = proxy.url
        stripe.default_http_client = stripe.new_default_http_client(
            timeout=SDK_TIMEOUT, verify_ssl_certs=stripe.verify_ssl_certs, proxy=stripe.proxy
        )
        attempts = Attempts(stripe.default_http_client)
        with ThreadPoolExecutor(CALLS) as pool:
            results = list(pool.map(lambda i: charge(i, attempts), range(CALLS)))
        # Let every execution finish (and the proxy store it) before
        # counting: an SDK that gave up has not waited for it.
        deadline = time.monotonic() + ORIGIN_DELAY + 5
        while not origin.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        return {"results": results, "executions": dict(origin.executions), "attempts": dict(attempts.by_key)}
    finally:
        if proxy is not None:
            proxy.close()
        origin.close()


def pattern(attempts: dict[str, list[str]]) -> str:
    """The attempts of every call, counted by their sequence."""
    seen: dict[str, int] = {}
    for seq in attempts.values():
        line = " -> ".join(seq)
        seen[line] = seen.get(line, 0) + 1
    return "; ".join(f"{n}x {line}" for line, n in sorted(seen.items()))


def judge(store: str, run: dict[str, Any], want_all: bool, label: str) -> str:
    results, executions, attempts = run["results"], run["executions"], run["attempts"]
    ok = [(c, key) for c, _, key in results if c is not None]
    errors = sorted({err for _, err, _ in results if err is not None})
    check(len(attempts) == CALLS and "(none)" not in attempts,
          f"{label} on {store}: expected {CALLS} idempotency keys from the SDK, got {attempts}")
    # Whatever the client was told, the origin charged each key once: the
    # proxy's own promise, in both trials.
    check(sorted(executions) == sorted(attempts),
          f"{label} on {store}: the origin saw keys {sorted(executions)}, the SDK sent {sorted(attempts)}")
    for key, ids in executions.items():
        check(len(ids) == 1, f"{label} on {store}: key {key} executed {len(ids)} times ({attempts[key]})")
    total = sum(len(ids) for ids in executions.values())
    line = (f"stripe-python {stripe.VERSION}, {label}: {len(ok)}/{CALLS} succeeded, {total} executions, "
            f"on {store} (attempts: {pattern(attempts)}{'; raised: ' + ', '.join(errors) if errors else ''})")
    if want_all:
        check(len(ok) == CALLS, f"{line}\n  expected every call to return its charge")
        for c, key in ok:
            check(isinstance(c, stripe.Charge), f"{label} on {store}: got a {type(c).__name__}, not a Charge")
            check(executions.get(key) == [c.id],
                  f"{label} on {store}: the call with key {key} got charge {c.id}; the origin made {executions.get(key)}")
    else:
        check(len(ok) < CALLS, f"{line}\n  expected the SDK to give up on some call, as the issue describes; "
                               "the check could not tell a proxy that holds duplicates from one that does not")
    return line


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    binary = sys.argv[1]
    stores = [("sqlite", None)] + ([("postgres", sys.argv[2])] if len(sys.argv) == 3 else [])

    # Run the `finally`s on a SIGTERM too (the script's trap sends one).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if stripe.max_network_retries != DEFAULT_RETRIES:
        print(f"stripe: FAILED: stripe-python {stripe.VERSION}: max_network_retries defaults to "
              f"{stripe.max_network_retries}, not {DEFAULT_RETRIES}, which the trials' timeline assumes",
              file=sys.stderr)
        return 1
    stripe.api_key = "sk_test_idemgate_ci_" + secrets.token_hex(8)

    with tempfile.TemporaryDirectory(prefix="idemgate-stripe-") as tmp:
        work = Path(tmp)
        trials = [(store, url or f"sqlite://{work / 'keys.db'}", [], True, f"defaults ({DEFAULT_RETRIES} retries)")
                  for store, url in stores]
        trials.append(("sqlite", f"sqlite://{work / 'nowait.db'}", ["--default-wait", "0"], False,
                       "proxy --default-wait 0"))
        for n, (store, url, extra, want_all, label) in enumerate(trials):
            log = work / f"proxy-{n}.log"
            try:
                run = trial(binary, store, url, log, extra)
                print(judge(store, run, want_all, label), flush=True)
                check("panicked" not in log.read_text(errors="replace"), f"{label} on {store}: the proxy panicked")
            except Exception as e:
                if not isinstance(e, CheckFailed):
                    traceback.print_exc()
                    e = CheckFailed(f"{label} on {store}: the exception above")
                if log.exists() and log.stat().st_size:
                    print(f"--- the proxy's log ({label} on {store}):\n{log.read_text(errors='replace')}",
                          file=sys.stderr)
                print(f"stripe: FAILED: {e}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
