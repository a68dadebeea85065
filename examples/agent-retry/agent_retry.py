"""A toy agent whose `charge` tool goes through `idemgate proxy`: however it
retries, each step charges once.

No LLM: a fixed plan of five steps, each a charge. The payments API is a
small in-process server that counts charges per step, and misbehaves the way
real ones do:

  step 1  answers at once;
  step 2  takes 1.5 s, longer than the tool's 0.5 s timeout, so the tool
          retries (the same key: the proxy answers 409, then the replay);
  step 3  answers 503 the first time (the proxy releases the key, the tool
          retries after Retry-After);
  step 4  "the model decides to do it again": the agent calls the tool twice
          with the same arguments (the same key: the second is a replay);
  step 5  the agent process is killed while its charge is being made, and a
          new process resumes the run at step 5 (the same run id, so the same
          key: it gets the first attempt's answer).

Run it with an idemgate binary (IDEMGATE_BIN, else `idemgate` on PATH) and
the client package on PYTHONPATH (clients/python/src):

    IDEMGATE_BIN=target/debug/idemgate PYTHONPATH=clients/python/src \\
        python3 examples/agent-retry/agent_retry.py

It prints the charges the API made per step, and exits 1 unless every step
charged exactly once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from idemgate_client import RetryTransport, derive_key

TENANT = "acme"
STEPS = [1, 2, 3, 4, 5]


# --- the agent ------------------------------------------------------------


def charge_tool(http: httpx.Client, api: str, run: str, step: int, amount: int) -> dict[str, object]:
    """The tool the model calls. Its runtime, not the model, mints the key,
    from the attempt's identity: the same for every retry of this step."""
    key = derive_key(tenant=TENANT, run=run, step=step, tool="charge")
    answer = http.post(f"{api}/charges", json={"step": step, "amount": amount}, headers={"Idempotency-Key": key})
    answer.raise_for_status()
    return answer.json()  # type: ignore[no-any-return]


def agent(api: str, run: str, first_step: int) -> None:
    transport = RetryTransport(httpx.HTTPTransport(), budget=20, backoff=0.1)
    with httpx.Client(transport=transport, timeout=0.5) as http:
        for step in STEPS[STEPS.index(first_step):]:
            result = charge_tool(http, api, run, step, amount=100 * step)
            print(f"  agent: step {step} -> {result['charge']}", flush=True)
            if step == 4:
                # The model is not sure it worked, and does it again.
                again = charge_tool(http, api, run, step, amount=100 * step)
                print(f"  agent: step {step} again -> {again['charge']}", flush=True)


# --- the payments API -------------------------------------------------------


class PaymentsAPI:
    def __init__(self) -> None:
        self.charges: dict[int, int] = {}
        self.calls: dict[int, int] = {}
        self.lock = threading.Lock()
        self.step5_started = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                step = int(body["step"])
                with api.lock:
                    api.calls[step] = api.calls.get(step, 0) + 1
                    call = api.calls[step]
                if step == 3 and call == 1:
                    self.answer(503, {"error": "try again"}, {"retry-after": "1"})
                    return
                if step == 2:
                    time.sleep(1.5)
                if step == 5:
                    api.step5_started.set()
                    time.sleep(1.0)  # the agent is killed meanwhile
                with api.lock:
                    api.charges[step] = api.charges.get(step, 0) + 1
                    n = sum(api.charges.values())
                self.answer(201, {"charge": f"ch_{n}", "amount": body["amount"]})

            def answer(self, status: int, value: object, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for name, v in (headers or {}).items():
                    self.send_header(name, v)
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


# --- the run ----------------------------------------------------------------


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
            [binary, "proxy", "--upstream", upstream, "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}"],
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


def run_agent(api: PaymentsAPI, url: str) -> None:
    """Steps 1-5 against ``url``, the agent killed during step 5 and resumed."""
    run = f"run-{uuid.uuid4()}"
    me = [sys.executable, __file__, "agent", url, run]
    first = subprocess.Popen([*me, "1"])
    if not api.step5_started.wait(60):
        sys.exit("the agent never reached step 5")
    first.send_signal(signal.SIGKILL)
    first.wait()
    print("  (the agent process was killed during step 5; a new one resumes the run at step 5)")
    if subprocess.run([*me, "5"]).returncode != 0:
        sys.exit("the resumed agent failed")


def report(api: PaymentsAPI) -> bool:
    for step in STEPS:
        print(f"  step {step}: {api.charges.get(step, 0)} (calls that reached the API: {api.calls.get(step, 0)})")
    return all(api.charges.get(step, 0) == 1 for step in STEPS)


def main() -> int:
    binary = os.environ.get("IDEMGATE_BIN") or shutil.which("idemgate")
    if not binary:
        sys.exit("set IDEMGATE_BIN to an idemgate binary (or put idemgate on PATH)")
    work = tempfile.mkdtemp(prefix="agent-retry-")
    api = PaymentsAPI()
    proxy, proxy_url = start_proxy(binary, api.url, work)
    try:
        print("steps 1-5 through idemgate proxy")
        run_agent(api, proxy_url)
    finally:
        proxy.terminate()
        proxy.wait(timeout=20)
        shutil.rmtree(work, ignore_errors=True)
    print("charges the payments API made, per step:")
    once = report(api)
    print("always one" if once else "NOT always one")
    return 0 if once else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "agent":
        agent(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(main())
