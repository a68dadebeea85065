"""TLS on idemgate's own listeners (docs/configuration.md, “TLS on idemgate's
listeners”), from Python: `requests` against
`idemgate serve --tls-cert/--tls-key`, and the official MCP client over
https:// to `idemgate proxy --protocol mcp` in front of server.py. The
certificate authority and the server's certificate are made per run with openssl.

    IDEMGATE_BIN=target/debug/idemgate python -m pytest tests/mcp/test_tls.py
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import requests
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

HERE = Path(__file__).resolve().parent
BIN = os.environ.get("IDEMGATE_BIN", str(HERE.parents[1] / "target" / "debug" / "idemgate"))
CHARGE = {"request": {"method": "POST", "path": "/charges", "body": {"amount": 500}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Path]:
    """A CA, and a certificate it signs for localhost and 127.0.0.1."""
    ca_key, ca, key, csr, cert, ext = (
        tmp_path / n for n in ("ca.key", "ca.pem", "key.pem", "req.csr", "cert.pem", "san.ext")
    )
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", str(ca_key), "-out", str(ca), "-days", "1", "-subj", "/CN=idemgate test CA")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext))
    return {"ca": ca, "cert": cert, "key": key}


def wait_tls(url: str, ca: Path, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            requests.get(url, verify=str(ca), timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start at {url}")


def tls_flags(certs: dict[str, Path]) -> list[str]:
    return ["--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"])]


def test_requests_reserves_and_completes_over_https(certs: dict[str, Path], tmp_path: Path) -> None:
    port = free_port()
    serve = subprocess.Popen(
        [BIN, "serve", "--listen", f"127.0.0.1:{port}",
         "--database-url", f"sqlite://{tmp_path / 'keys.db'}", *tls_flags(certs)],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "serve.log", "ab"),
    )
    base = f"https://127.0.0.1:{port}"
    try:
        wait_tls(f"{base}/healthz", certs["ca"], "idemgate serve", serve)
        # verify on each call: a session's own is overridden by
        # REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE when the environment sets one.
        ca = str(certs["ca"])
        with requests.Session() as http:
            key = str(uuid.uuid4())
            first = http.post(f"{base}/v1/reservations", json=CHARGE, headers={"Idempotency-Key": key}, verify=ca)
            assert first.status_code == 201, first.text
            rid = first.json()["reservation_id"]
            done = http.post(
                f"{base}/v1/reservations/{rid}/commit",
                json={"status": 201, "body": '{"charge":"ch_1"}'},
                verify=ca,
            )
            assert done.status_code == 200, done.text
            assert done.json()["state"] == "completed", done.text
            replay = http.post(f"{base}/v1/reservations", json=CHARGE, headers={"Idempotency-Key": key}, verify=ca)
            assert replay.status_code == 200, replay.text
            assert replay.headers["idempotent-replayed"] == "true"
            assert replay.json()["response"]["body"] == '{"charge":"ch_1"}', replay.text
        # Without the CA, requests refuses the certificate.
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(f"{base}/healthz", timeout=5)
    finally:
        serve.terminate()
        serve.wait(timeout=10)
    log = (tmp_path / "serve.log").read_text()
    assert f"docs=https://127.0.0.1:{port}/docs" in log, log
    assert str(certs["cert"]) in log, log


def test_the_mcp_client_calls_once_over_https(certs: dict[str, Path], tmp_path: Path) -> None:
    server_port, port, admin = free_port(), free_port(), free_port()
    charges = tmp_path / "executions.jsonl"
    server = subprocess.Popen(
        [sys.executable, str(HERE / "server.py"), str(server_port)],
        env={**os.environ, "CHARGES_LOG": str(charges)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proxy = subprocess.Popen(
        [BIN, "proxy", "--protocol", "mcp", "--upstream", f"http://127.0.0.1:{server_port}",
         "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
         "--database-url", f"sqlite://{tmp_path / 'keys.db'}", *tls_flags(certs)],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "proxy.log", "ab"),
    )
    try:
        wait_tls(f"https://127.0.0.1:{admin}/healthz", certs["ca"], "idemgate proxy", proxy)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", server_port), timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        trust = ssl.create_default_context(cafile=str(certs["ca"]))
        k = f"step-{uuid.uuid4()}"

        async def go() -> list[Any]:
            async with httpx2.AsyncClient(verify=trust, timeout=httpx2.Timeout(30, read=300)) as client:
                async with streamable_http_client(f"https://127.0.0.1:{port}/mcp", http_client=client) as (
                    read,
                    write,
                    *_,
                ):
                    async with ClientSession(read, write) as s:
                        await s.initialize()
                        args = {"customer": "tls", "amount": 700, "idempotency_key": k}
                        return [await s.call_tool("charge", args) for _ in range(3)]

        results = asyncio.run(go())
        assert [r.is_error for r in results] == [False, False, False], results
        assert len({r.structured_content["charge"] for r in results}) == 1
        lines = [ln for ln in charges.read_text().splitlines() if ln]
        assert len(lines) == 1, lines
    finally:
        for proc in (proxy, server):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
