"""The retry table, as a classifier and as a transport in front of a real idemgate proxy."""

from __future__ import annotations

import uuid

import httpx
import pytest

from idemgate_client import Decision, RetryTransport, classify, derive_key


def response(status: int, slug: str | None = None, retry_after: str | None = None) -> httpx.Response:
    headers = {"retry-after": retry_after} if retry_after else {}
    if slug is None:
        return httpx.Response(status, headers=headers)
    body = {"type": f"https://idemgate.dev/problems/{slug}", "status": status}
    return httpx.Response(status, json=body, headers={**headers, "content-type": "application/problem+json"})


REQUEST = httpx.Request("POST", "http://api.invalid/charges")


@pytest.mark.parametrize(
    ("outcome", "decision", "after"),
    [
        (httpx.ReadTimeout("timed out", request=REQUEST), Decision.RETRY, None),
        (httpx.ConnectError("refused", request=REQUEST), Decision.RETRY, None),
        (httpx.RemoteProtocolError("peer closed", request=REQUEST), Decision.RETRY, None),
        (response(502), Decision.RETRY, None),
        (response(504, "upstream-timeout"), Decision.RETRY, None),
        (response(503, "store-unavailable", "2"), Decision.RETRY, 2.0),
        (response(429, "tenant-limit", "3"), Decision.RETRY, 3.0),
        (response(408), Decision.RETRY, None),
        (response(425), Decision.RETRY, None),
        (response(409, "request-in-flight", "4"), Decision.WAIT, 4.0),
        (response(409, "outcome-unknown"), Decision.DEAD_LETTER, None),
        (response(409, "lease-lost"), Decision.ANSWER, None),
        # A 409 whose body names no problem of ours is waited for, as ever.
        (response(409), Decision.WAIT, None),
        (httpx.Response(409, json={"error": "conflict"}), Decision.WAIT, None),
        (httpx.Response(409, text="outcome-unknown"), Decision.WAIT, None),
        (response(422, "key-reused"), Decision.STOP, None),
        (response(500), Decision.ANSWER, None),
        (response(402), Decision.ANSWER, None),
        (response(400, "key-invalid"), Decision.ANSWER, None),
        (response(201), Decision.ANSWER, None),
        (ValueError("not a network error"), Decision.ANSWER, None),
    ],
)
def test_the_table(outcome, decision, after):
    verdict = classify(outcome)
    assert verdict.decision is decision
    assert verdict.after == after


def key() -> str:
    return derive_key(tenant="acme", run=f"run-{uuid.uuid4()}", step=1, tool="charge")


def client(budget: float = 10.0, timeout: float = 10.0) -> httpx.Client:
    return httpx.Client(transport=RetryTransport(httpx.HTTPTransport(), budget=budget, backoff=0.1), timeout=timeout)


def test_a_timeout_retries_the_same_key_and_gets_the_one_charge(proxied):
    url, origin = proxied
    k = key()
    with client(timeout=0.5) as http:
        # The origin takes 1.5 s; the client gives up after 0.5 s and sends
        # again: the proxy holds each retry for the first's answer (until the
        # client gives up on it too), then the replay.
        answer = http.post(f"{url}/slow/1500", json={"amount": 500}, headers={"Idempotency-Key": k})
    assert answer.status_code == 201
    assert origin.charges[k] == 1


def test_a_released_503_is_retried_and_charges_once(proxied):
    url, origin = proxied
    k = key()
    with client() as http:
        answer = http.post(f"{url}/flaky", json={"amount": 500}, headers={"Idempotency-Key": k})
    assert answer.status_code == 201
    assert origin.calls[k] == 2 and origin.charges[k] == 1


def test_key_reused_is_not_retried(proxied):
    url, origin = proxied
    k = key()
    with client() as http:
        assert http.post(f"{url}/charge", json={"amount": 500}, headers={"Idempotency-Key": k}).status_code == 201
        again = http.post(f"{url}/charge", json={"amount": 900}, headers={"Idempotency-Key": k})
    assert again.status_code == 422
    assert origin.calls[k] == 1


def test_in_flight_past_the_budget_returns_the_409(proxied):
    url, origin = proxied
    k = key()
    import threading

    first = threading.Thread(
        target=lambda: httpx.post(f"{url}/slow/3000", json={"amount": 1}, headers={"Idempotency-Key": k}, timeout=10)
    )
    first.start()
    import time

    time.sleep(0.3)
    with client(budget=1.0) as http:
        # The proxy would hold the duplicate until the first answers (its
        # default wait, 10 s) and replay it; this caller asks for the 409 at
        # once, as a client of a server without that default gets it.
        answer = http.post(
            f"{url}/slow/3000", json={"amount": 1}, headers={"Idempotency-Key": k, "Prefer": "wait=0"}
        )
    first.join()
    assert answer.status_code == 409
    assert origin.charges[k] == 1


def test_a_request_without_a_key_is_sent_once(proxied):
    url, origin = proxied
    before = origin.calls.get("", 0)
    with client() as http:
        answer = http.post(f"{url}/flaky", json={"amount": 1})
    # The origin's first keyless call is a 503; a retry would have made it 201.
    assert origin.calls[""] == before + 1
    assert answer.status_code == (503 if before == 0 else 201)


def test_the_async_transport_retries_a_timeout_too(proxied):
    import asyncio

    from idemgate_client import AsyncRetryTransport

    url, origin = proxied
    k = key()

    async def call() -> httpx.Response:
        transport = AsyncRetryTransport(httpx.AsyncHTTPTransport(), budget=10, backoff=0.1)
        async with httpx.AsyncClient(transport=transport, timeout=0.5) as http:
            return await http.post(f"{url}/slow/1500", json={"amount": 7}, headers={"Idempotency-Key": k})

    answer = asyncio.run(call())
    assert answer.status_code == 201
    assert origin.charges[k] == 1


class Recording(httpx.BaseTransport):
    """The transport under the retrying one: the key and the status of each attempt."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.attempts: list[tuple[str, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self.inner.handle_request(request)
        self.attempts.append((request.headers.get("idempotency-key", ""), answer.status_code))
        return answer

    def close(self) -> None:
        self.inner.close()


def test_an_unknown_outcome_is_retried_once_then_never_again(proxied):
    url, origin = proxied
    k = key()
    recording = Recording()
    with httpx.Client(transport=RetryTransport(recording, budget=10, backoff=0.1), timeout=10) as http:
        # The origin charges, then hangs up: the proxy answers 502 and, under
        # its default hold, marks the key's outcome unknown.
        answer = http.post(f"{url}/hangup", json={"amount": 500}, headers={"Idempotency-Key": k})
    assert answer.status_code == 409
    assert answer.json()["type"].endswith("/outcome-unknown")
    assert "retry-after" not in answer.headers
    assert classify(answer).decision is Decision.DEAD_LETTER
    # The 502 was retried under the same key; the 409 was not.
    assert recording.attempts == [(k, 502), (k, 409)]
    assert origin.calls[k] == 1 and origin.charges[k] == 1


def test_the_async_transport_stops_at_an_unknown_outcome_too(proxied):
    import asyncio

    from idemgate_client import AsyncRetryTransport

    url, origin = proxied
    k = key()
    statuses: list[int] = []

    class AsyncRecording(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            answer = await self.inner.handle_async_request(request)
            statuses.append(answer.status_code)
            return answer

        async def aclose(self) -> None:
            await self.inner.aclose()

    async def call() -> httpx.Response:
        transport = AsyncRetryTransport(AsyncRecording(), budget=10, backoff=0.1)
        async with httpx.AsyncClient(transport=transport, timeout=10) as http:
            return await http.post(f"{url}/hangup", json={"amount": 9}, headers={"Idempotency-Key": k})

    answer = asyncio.run(call())
    assert answer.status_code == 409 and answer.json()["type"].endswith("/outcome-unknown")
    assert statuses == [502, 409]
    assert origin.calls[k] == 1
