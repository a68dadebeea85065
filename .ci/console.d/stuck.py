"""Making stuck keys the ways they get stuck in production: a reservation
whose holder went away (its lease lapses under `hold`), a holder that marks
its key unknown, and a proxy killed while the origin was acting.
"""

from __future__ import annotations

import http.client
import secrets
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from harness import Failed, Idemgate, Origin, bearer, call, key_hash


def described(request: dict | None, label: str | None) -> dict:
    """The reserve body's `request` and `label`, where given."""
    extra: dict = {"request": request} if request else {}
    if label is not None:
        extra["label"] = label
    return extra


def new_key(label: str = "order") -> str:
    return f"{label}-{secrets.token_hex(8)}"


def sf_string(key: str) -> str:
    """The key as an RFC 8941 sf-string, the header's form."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


class Serve:
    """A running `idemgate serve` and the tenants' and operators' tokens."""

    def __init__(self, proc: Idemgate, base: str, tokens: dict[str, str],
                 admin: dict[str, str]):
        self.proc = proc
        self.base = base
        self.tokens = tokens  # tenant -> token
        self.admin = admin  # operator name -> token

    def reserve(self, tenant: str, key: str, conn=None, **body) -> dict:
        headers = {"idempotency-key": sf_string(key)}
        if tenant in self.tokens:
            headers.update(bearer(self.tokens[tenant]))
        if "request" not in body:
            body.setdefault("fingerprint", f"fp-{key}")
        r = call("POST", f"{self.base}/v1/reservations", body, headers, conn=conn)
        if r.status != 201:
            raise Failed(f"reserve {key} for {tenant}: expected 201, got {r!r}")
        return r.json()

    def post(self, tenant: str, path: str, body: dict, conn=None):
        headers = bearer(self.tokens[tenant]) if tenant in self.tokens else {}
        return call("POST", f"{self.base}{path}", body, headers, conn=conn)

    def lapsed(self, tenant: str, key: str | None = None, lease: int = 1,
               checkpoint: str | None = None, request: dict | None = None,
               label: str | None = None) -> tuple[str, str]:
        """A key reserved under `hold` with a short lease and never settled:
        once the lease is over it is unknown. Returns (key, hash)."""
        key = key or new_key()
        extra = described(request, label)
        res = self.reserve(tenant, key, lease_seconds=lease, on_lease_expiry="hold", **extra)
        if checkpoint:
            r = self.post(tenant, f"/v1/reservations/{res['reservation_id']}/checkpoint",
                          {"recovery_point": checkpoint, "data": {"step": 2, "ledger": "ok"}})
            if r.status != 200:
                raise Failed(f"checkpoint on {key}: {r!r}")
        return key, key_hash(key)

    def marked_unknown(self, tenant: str, reason: str, key: str | None = None,
                       conn=None, checkpoint: str | None = None,
                       request: dict | None = None, label: str | None = None) -> tuple[str, str]:
        """A key whose holder said it cannot tell whether its effect happened."""
        key = key or new_key()
        extra = described(request, label)
        res = self.reserve(tenant, key, conn=conn, **extra)
        rid = res["reservation_id"]
        if checkpoint:
            r = self.post(tenant, f"/v1/reservations/{rid}/checkpoint",
                          {"recovery_point": checkpoint, "data": {"provider": "psp"}}, conn=conn)
            if r.status != 200:
                raise Failed(f"checkpoint on {key}: {r!r}")
        r = self.post(tenant, f"/v1/reservations/{rid}/unknown", {"reason": reason}, conn=conn)
        if r.status != 200:
            raise Failed(f"marking {key} unknown: expected 200, got {r!r}")
        return key, key_hash(key)

    def admin_get(self, path: str, operator: str = "ops"):
        return call("GET", f"{self.base}{path}", headers=bearer(self.admin[operator]))

    def many_unknown(self, tenants: list[str], count: int, workers: int = 12) -> list[tuple[str, str]]:
        """`count` keys marked unknown, spread over `tenants` in turn, made
        by a pool of workers that each keep one connection."""
        local = threading.local()
        parts = urllib.parse.urlsplit(self.base)

        def one(i: int):
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
            tenant = tenants[i % len(tenants)]
            for attempt in range(3):
                try:
                    key, h = self.marked_unknown(
                        tenant, f"bulk {i}: the provider timed out after sending", conn=conn)
                    return tenant, h
                except (OSError, http.client.HTTPException):
                    conn.close()
                    conn = local.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
                    if attempt == 2:
                        raise
                    time.sleep(0.2)

        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, range(count)))


class Proxy:
    """A running `idemgate proxy` in front of an origin, killed and started
    again on the same store."""

    def __init__(self, proc: Idemgate, port: int, admin_port: int, origin: Origin,
                 admin: dict[str, str], lease: int):
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.admin_base = f"http://127.0.0.1:{admin_port}"
        self.origin = origin
        self.admin = admin
        self.lease = lease
        self.reserved_at = 0.0

    def charge(self, key: str, amount: int = 500, timeout: float = 30):
        return call("POST", f"{self.url}/charges", {"amount": amount, "currency": "eur"},
                    {"idempotency-key": sf_string(key),
                     "authorization": "Bearer sk_test_console"}, timeout=timeout)

    def kill_mid_call(self, keys: list[str]) -> None:
        """Sends a charge for each key, kills the proxy (SIGKILL) while the
        origin works on them, and starts it again on the same store."""
        errors: list[str] = []

        def send(k: str):
            try:
                r = self.charge(k)
                errors.append(f"{k}: the charge was answered ({r!r}) before the kill")
            except (OSError, http.client.HTTPException):
                pass  # the proxy died under it: what a client sees

        threads = [threading.Thread(target=send, args=(k,), daemon=True) for k in keys]
        self.reserved_at = time.monotonic()
        for t in threads:
            t.start()
        self.origin.wait_arrived([sf_string(k) for k in keys])
        self.proc.kill9()
        for t in threads:
            t.join(10)
        if errors:
            raise Failed("; ".join(errors))
        self.proc.start().wait_ready()

    def admin_get(self, path: str, operator: str = "ops"):
        return call("GET", f"{self.admin_base}{path}", headers=bearer(self.admin[operator]))
