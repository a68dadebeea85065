"""idemgate's problem+json answers as exceptions, one class per problem type.

Each carries what the server said: the HTTP status, the problem's slug (the
last segment of its ``type``), ``title`` and ``detail``, and, where the
server sent them, ``retry_after`` (seconds) and ``lease_expires_at``.
:class:`OutcomeUnknown` also says why the step belongs in the caller's
dead-letter queue (``dead_letter_reason``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx

__all__ = [
    "IdemgateError",
    "Problem",
    "InvalidRequest",
    "KeyMissing",
    "KeyInvalid",
    "Unauthorized",
    "NotFound",
    "MisdirectedRequest",
    "RequestInFlight",
    "OutcomeUnknown",
    "LeaseLost",
    "ReservationGone",
    "PayloadTooLarge",
    "KeyReused",
    "TenantLimit",
    "StoreUnavailable",
    "Internal",
    "problem_from",
]


class IdemgateError(Exception):
    """Anything this package raises about idemgate's answers."""


class Problem(IdemgateError):
    """A problem+json answer (RFC 9457); subclasses name the problem types."""

    slug: str = ""

    def __init__(self, status: int, body: dict[str, Any], retry_after: float | None) -> None:
        self.status = status
        self.type: str = str(body.get("type", ""))
        self.title: str = str(body.get("title", ""))
        self.detail: str = str(body.get("detail", ""))
        self.retry_after = retry_after
        lease = body.get("lease_expires_at")
        self.lease_expires_at: datetime | None = _datetime(lease) if lease else None
        self.body = body
        super().__init__(f"{status} {self.type.rsplit('/', 1)[-1] or 'problem'}: {self.detail or self.title}")


class InvalidRequest(Problem):
    slug = "invalid-request"


class KeyMissing(Problem):
    slug = "key-missing"


class KeyInvalid(Problem):
    slug = "key-invalid"


class Unauthorized(Problem):
    slug = "unauthorized"


class NotFound(Problem):
    slug = "not-found"


class MisdirectedRequest(Problem):
    """421: the server answers only requests addressed to its own address or
    a name of its ``IDEMGATE_ALLOWED_HOSTS``; use the address it listens on."""

    slug = "misdirected-request"


class RequestInFlight(Problem):
    """409: the key's first request is still running; wait and retry the same key."""

    slug = "request-in-flight"


class OutcomeUnknown(Problem):
    """409: whether the key's first request took effect is unknown (its holder
    was cut off), so nothing runs it again. Never retried, under this key or a
    new one: the step goes to the dead-letter queue, and an operator settles
    the key (``idemgate keys``): released, the next request executes;
    completed, every retry replays the response that really happened."""

    slug = "outcome-unknown"
    #: The reason the step is put in the dead-letter queue with.
    dead_letter_reason = "outcome_unknown"


class LeaseLost(Problem):
    """409: this reservation id no longer holds its key."""

    slug = "lease-lost"


class ReservationGone(Problem):
    slug = "reservation-gone"


class PayloadTooLarge(Problem):
    slug = "payload-too-large"


class KeyReused(Problem):
    """422: the key was used with another payload. Never retried."""

    slug = "key-reused"


class TenantLimit(Problem):
    slug = "tenant-limit"


class StoreUnavailable(Problem):
    slug = "store-unavailable"


class Internal(Problem):
    slug = "internal"


_BY_SLUG = {
    cls.slug: cls
    for cls in (
        InvalidRequest,
        KeyMissing,
        KeyInvalid,
        Unauthorized,
        NotFound,
        MisdirectedRequest,
        RequestInFlight,
        OutcomeUnknown,
        LeaseLost,
        ReservationGone,
        PayloadTooLarge,
        KeyReused,
        TenantLimit,
        StoreUnavailable,
        Internal,
    )
}


def _datetime(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def problem_from(response: httpx.Response) -> Problem:
    """The exception for an answer that is not a success."""
    try:
        body = response.json()
        if not isinstance(body, dict):
            body = {}
    except ValueError:
        body = {}
    slug = str(body.get("type", "")).rsplit("/", 1)[-1]
    retry_after: float | None = None
    header = response.headers.get("retry-after")
    if header is not None and header.strip().isdigit():
        retry_after = float(header.strip())
    cls = _BY_SLUG.get(slug, Problem)
    if not body:
        body = {"title": response.reason_phrase, "detail": response.text[:200]}
    return cls(response.status_code, body, retry_after)
