"""Retrying calls to an API behind ``idemgate proxy`` (or any server of the
Idempotency-Key draft) without executing anything twice.

:func:`classify` is the table a caller follows, as the agent builders'
guides have it:

========================================  ==========================================
what came back                            what to do
========================================  ==========================================
a timeout, a closed socket, 502/504       retry, the same key and the same body
408, 425, 429, 503 (not stored: the       retry the same key after ``Retry-After``
proxy released the key)
409 ``request-in-flight``                 wait (``Retry-After``), retry the same key;
                                          past the budget, the dead-letter queue
409 ``outcome-unknown``                   stop: never retried, never a new key; to
                                          the dead-letter queue (reason
                                          ``outcome_unknown``), an operator settles
                                          the key (``idemgate keys``)
422 ``key-reused``                        stop: never retried (a new key only when
                                          a person changed the arguments)
anything else (2xx, 4xx, 500)             the answer: a replayed 4xx or 500 is this
                                          step's result
========================================  ==========================================

:class:`RetryTransport` applies it to every request that carries an
idempotency key, as an httpx transport::

    http = httpx.Client(transport=RetryTransport(httpx.HTTPTransport(), budget=30))
    http.post(url, json=args, headers={"Idempotency-Key": derive_key(...)})

A request without a key is sent once: retrying it could execute it twice.

``idemgate proxy`` holds a duplicate until the first answer by default (up to
10 s) and replays it, so a 409 ``request-in-flight`` is the rarer case: a
first request that runs longer than that, or a caller that asked for the
immediate answer (``Prefer: wait=0``).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

import httpx

__all__ = ["Decision", "classify", "RetryTransport", "AsyncRetryTransport"]

#: Statuses the proxy returns without storing them, releasing the key.
RELEASED = frozenset({408, 425, 429, 503})
#: Gateway statuses that say nothing of whether the origin acted.
UNKNOWN = frozenset({502, 504})


class Decision(enum.Enum):
    RETRY = "retry the same key"
    WAIT = "wait, then retry the same key"
    STOP = "stop: the key was used with another payload"
    DEAD_LETTER = "stop: whether it took effect is unknown; to the dead-letter queue, never a new key"
    ANSWER = "the answer"


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    #: Seconds to wait first, when the server said (``Retry-After``).
    after: float | None = None


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "").strip()
    return float(value) if value.isdigit() else None


def _slug(response: httpx.Response) -> str:
    if "json" not in response.headers.get("content-type", ""):
        return ""
    try:
        body = response.json()
    except ValueError:
        return ""
    kind = body.get("type", "") if isinstance(body, dict) else ""
    return str(kind).rsplit("/", 1)[-1]


def classify(outcome: httpx.Response | Exception) -> Verdict:
    """What to do about one attempt's outcome (see the module's table).

    Only a 409's body is read (to tell ``request-in-flight`` from
    ``outcome-unknown`` and ``lease-lost``; a 409 whose body names neither is
    waited for): a streamed answer is never consumed here."""
    if isinstance(outcome, Exception):
        if isinstance(outcome, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)):
            return Verdict(Decision.RETRY)
        return Verdict(Decision.ANSWER)
    status = outcome.status_code
    if status == 409:
        slug = _slug(outcome)
        if slug == "outcome-unknown":
            return Verdict(Decision.DEAD_LETTER)
        if slug == "lease-lost":
            return Verdict(Decision.ANSWER)
        return Verdict(Decision.WAIT, _retry_after(outcome))
    if status == 422:
        return Verdict(Decision.STOP)
    if status in RELEASED:
        return Verdict(Decision.RETRY, _retry_after(outcome))
    if status in UNKNOWN:
        return Verdict(Decision.RETRY, _retry_after(outcome))
    return Verdict(Decision.ANSWER)


def _next(outcome: httpx.Response | Exception, left: float, pause: float) -> float | None:
    """Seconds to wait before the next attempt, or None when ``outcome`` is final."""
    verdict = classify(outcome)
    if verdict.decision in (Decision.ANSWER, Decision.STOP, Decision.DEAD_LETTER) or left <= 0:
        return None
    wait = verdict.after if verdict.after is not None else pause
    return max(0.0, min(wait, left))


class RetryTransport(httpx.BaseTransport):
    """Retries a keyed request per :func:`classify`, within ``budget`` seconds.

    The request goes again as it was (same key, same body). A 409
    ``outcome-unknown`` is returned at once, never sent again (the dead-letter
    queue's case). When the budget runs out, the last response is returned (a
    409 ``request-in-flight`` says the step is still in flight: the dead-letter
    queue's case too) or the last error raised.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport,
        *,
        budget: float = 30.0,
        key_header: str = "idempotency-key",
        backoff: float = 0.2,
        max_backoff: float = 5.0,
    ) -> None:
        self._transport = transport
        self.budget = budget
        self.key_header = key_header
        self.backoff = backoff
        self.max_backoff = max_backoff

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.key_header not in request.headers:
            return self._transport.handle_request(request)
        request.read()  # the body goes again, byte for byte
        started = time.monotonic()
        pause = self.backoff
        while True:
            try:
                outcome: httpx.Response | Exception = self._transport.handle_request(request)
            except httpx.TransportError as e:
                outcome = e
            if isinstance(outcome, httpx.Response) and outcome.status_code == 409:
                outcome.read()  # a small problem body: which 409 it is
            wait = _next(outcome, self.budget - (time.monotonic() - started), pause)
            if wait is None:
                if isinstance(outcome, Exception):
                    raise outcome
                return outcome
            if isinstance(outcome, httpx.Response):
                outcome.close()
            time.sleep(wait)
            pause = min(pause * 2, self.max_backoff)

    def close(self) -> None:
        self._transport.close()


class AsyncRetryTransport(httpx.AsyncBaseTransport):
    """As :class:`RetryTransport`, for ``httpx.AsyncClient``."""

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport,
        *,
        budget: float = 30.0,
        key_header: str = "idempotency-key",
        backoff: float = 0.2,
        max_backoff: float = 5.0,
    ) -> None:
        self._transport = transport
        self.budget = budget
        self.key_header = key_header
        self.backoff = backoff
        self.max_backoff = max_backoff

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.key_header not in request.headers:
            return await self._transport.handle_async_request(request)
        await request.aread()
        started = time.monotonic()
        pause = self.backoff
        while True:
            try:
                outcome: httpx.Response | Exception = await self._transport.handle_async_request(request)
            except httpx.TransportError as e:
                outcome = e
            if isinstance(outcome, httpx.Response) and outcome.status_code == 409:
                await outcome.aread()  # a small problem body: which 409 it is
            wait = _next(outcome, self.budget - (time.monotonic() - started), pause)
            if wait is None:
                if isinstance(outcome, Exception):
                    raise outcome
                return outcome
            if isinstance(outcome, httpx.Response):
                await outcome.aclose()
            await asyncio.sleep(wait)
            pause = min(pause * 2, self.max_backoff)

    async def aclose(self) -> None:
        await self._transport.aclose()
