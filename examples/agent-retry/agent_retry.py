"""A toy agent whose `charge` tool goes through `idemgate proxy`: however it
retries, each step charges once.

No LLM: a fixed plan of six steps, each a charge. The payments API is a
small in-process server that counts charges per step, and misbehaves the way
real ones do:

  step 1  answers at once;
  step 2  takes 1.5 s, longer than the tool's 0.5 s timeout, so the tool
          retries (the same key: the proxy holds each retry for the first
          answer, then replays it);
  step 3  answers 503 the first time (the proxy releases the key, the tool
          retries after Retry-After);
  step 4  "the model decides to do it again": the agent calls the tool twice
          with the same arguments (the same key: the second is a replay);
  step 5  the agent process is killed while its charge is being made, and a
          new process resumes the run at step 5 (the same run id, so the same
          key: it gets the first attempt's answer);
  step 6  the API makes the charge and then drops the connection without
          answering: the proxy answers 502 and marks the key's outcome
          unknown, the tool's retry gets 409 outcome-unknown, and the agent
          parks the step in its dead-letter queue (reason outcome_unknown)
          instead of calling again, under this key or a new one. An operator
          finds the charge at the payments API, completes the key with it
          through the proxy's admin endpoint, and the run resumes at step 6:
          the replay.

Run it with an idemgate binary (IDEMGATE_BIN, else `idemgate` on PATH) and
the client package on PYTHONPATH (clients/python/src):

    cargo build --release                                   # target/release/idemgate
    python3 -m venv .venv && .venv/bin/pip install httpx    # PEP 668: not the system's pip
    IDEMGATE_BIN=target/release/idemgate PYTHONPATH=clients/python/src \\
        .venv/bin/python examples/agent-retry/agent_retry.py

It prints the charges the API made per step, and exits 1 unless every step
charged exactly once.
"""

from __future__ import annotations

import hashlib
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

from idemgate_client import Decision, InFlight, OutcomeUnknown, RetryTransport, classify, derive_key

TENANT = "acme"
STEPS = [1, 2, 3, 4, 5, 6]


# --- the agent ------------------------------------------------------------


class DeadLetter(Exception):
    """A step that must not be called again: for the dead-letter queue."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def charge_tool(http: httpx.Client, api: str, run: str, step: int, amount: int) -> dict[str, object]:
    """The tool the model calls. Its runtime, not the model, mints the key,
    from the attempt's identity: the same for every retry of this step."""
    key = derive_key(tenant=TENANT, run=run, step=step, tool="charge")
    answer = http.post(f"{api}/charges", json={"step": step, "amount": amount}, headers={"Idempotency-Key": key})
    verdict = classify(answer).decision
    if verdict is Decision.DEAD_LETTER:  # 409 outcome-unknown: never again, nor under a new key
        raise DeadLetter(OutcomeUnknown.dead_letter_reason)
    if verdict is Decision.WAIT:  # 409 request-in-flight past the retry budget
        raise DeadLetter(InFlight.dead_letter_reason)
    answer.raise_for_status()
    return answer.json()  # type: ignore[no-any-return]


def agent(api: str, run: str, first_step: int, *, dead_letters: str) -> None:
    transport = RetryTransport(httpx.HTTPTransport(), budget=20, backoff=0.1)
    with httpx.Client(transport=transport, timeout=0.5) as http:
        for step in STEPS[STEPS.index(first_step):]:
            try:
                result = charge_tool(http, api, run, step, amount=100 * step)
            except DeadLetter as parked:
                # The run stops here until the step is settled; the entry
                # names the step, never its key.
                entry = {"run": run, "step": step, "tool": "charge", "reason": parked.reason}
                with open(dead_letters, "a") as queue:
                    queue.write(json.dumps(entry) + "\n")
                print(f"  agent: step {step} -> dead-letter queue ({parked.reason})", flush=True)
                return
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
        #: The charge each step made, as the API's own records show it.
        self.made: dict[int, dict[str, object]] = {}
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
                    api.made[step] = {"charge": f"ch_{n}", "amount": body["amount"]}
                if step == 6:
                    self.close_connection = True  # charged, and the connection drops: no answer
                    return
                self.answer(201, api.made[step])

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


def start_proxy(binary: str, upstream: str, work: str) -> tuple[subprocess.Popen[bytes], str, str]:
    """``idemgate proxy`` in front of ``upstream``: the process, its URL and its admin listener's URL."""
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
                return proxy, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proxy.kill()
            sys.exit("idemgate proxy did not answer within 30 s")
        time.sleep(0.05)


def run_agent(api: PaymentsAPI, url: str, admin: str, work: str) -> None:
    """Steps 1-6 against ``url``: the agent killed during step 5 and resumed,
    then parked at step 6 until an operator settles it, and resumed again."""
    run = f"run-{uuid.uuid4()}"
    dead_letters = f"{work}/dead-letters.jsonl"
    me = [sys.executable, __file__, "agent", url, run, dead_letters]
    first = subprocess.Popen([*me, "1"])
    if not api.step5_started.wait(60):
        sys.exit("the agent never reached step 5")
    first.send_signal(signal.SIGKILL)
    first.wait()
    print("  (the agent process was killed during step 5; a new one resumes the run at step 5)")
    if subprocess.run([*me, "5"]).returncode != 0:
        sys.exit("the resumed agent failed")
    parked = []
    if os.path.exists(dead_letters):
        with open(dead_letters) as queue:
            parked = [json.loads(line) for line in queue]
    if [(p["step"], p["reason"]) for p in parked] != [(6, "outcome_unknown")]:
        sys.exit(f"expected step 6 in the dead-letter queue as outcome_unknown, found {parked}")
    operator_settles(api, admin, run, step=6)
    print("  (an operator completed step 6 with the charge the API made; the run resumes at step 6)")
    if subprocess.run([*me, "6"]).returncode != 0:
        sys.exit("the agent resumed at step 6 failed")


def operator_settles(api: PaymentsAPI, admin: str, run: str, step: int) -> None:
    """What the on-call person does with a dead-lettered step: find its key
    in the proxy's list of unknown keys (by hash), look at the payments API,
    and complete the key with the charge that really happened."""
    key_hash = hashlib.sha256(derive_key(tenant=TENANT, run=run, step=step, tool="charge").encode()).hexdigest()
    listed = httpx.get(f"{admin}/v1/admin/keys", params={"state": "unknown"}, timeout=10).json()["keys"]
    tenants = [k["tenant"] for k in listed if k["key_hash"] == key_hash]
    if not tenants:
        sys.exit(f"step {step}'s key is not among the proxy's unknown keys")
    charge = api.made[step]
    resolved = httpx.post(
        f"{admin}/v1/admin/keys/{tenants[0]}/{key_hash}/resolve",
        json={
            "action": "complete",
            "reason": f"the payments API shows {charge['charge']} for this step",
            "response": {"status": 201, "headers": [["content-type", "application/json"]], "body": json.dumps(charge)},
        },
        timeout=10,
    )
    if resolved.status_code != 200:
        sys.exit(f"the operator could not settle step {step}: {resolved.status_code} {resolved.text}")


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
    proxy, proxy_url, admin_url = start_proxy(binary, api.url, work)
    try:
        print("steps 1-6 through idemgate proxy")
        run_agent(api, proxy_url, admin_url, work)
    finally:
        proxy.terminate()
        proxy.wait(timeout=20)
        shutil.rmtree(work, ignore_errors=True)
    print("charges the payments API made, per step:")
    once = report(api)
    print("always one" if once else "NOT always one")
    return 0 if once else 1


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "agent":
        agent(sys.argv[2], sys.argv[3], int(sys.argv[5]), dead_letters=sys.argv[4])
    else:
        sys.exit(main())
