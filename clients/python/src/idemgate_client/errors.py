"""idemgate's problem+json answers as exceptions, one class per problem type.

Each carries what the server said: the HTTP status, the problem's slug (the
last segment of its ``type``), ``title`` and ``detail``, and, where the
server sent them, ``retry_after`` (seconds) and ``lease_expires_at``.
:class:`OutcomeUnknown` also says why the step belongs in the caller's
dead-letter queue (``dead_letter_reason``).

A transport failure (no answer: refused, reset, timed out) is raised as
:class:`StoreUnavailable` too, with ``answered`` false and the httpx
exception as its ``__cause__``; :class:`ResultNotCommitted`, a
``StoreUnavailable``, is a guard's commit that found no server for its whole
budget, and carries the effect's ``result``.

Every exception here survives ``pickle`` and ``copy.deepcopy`` with its
class, message and fields (Celery and ``multiprocessing`` move exceptions by
pickle); the ``__cause__`` and the traceback do not travel, as for any
exception.
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
    "ResultNotCommitted",
    "Internal",
    "problem_from",
]


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An exception of ``cls`` with ``args`` and ``state``, without calling its
    ``__init__`` (whose parameters need not be its ``args``): unpickling."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class IdemgateError(Exception):
    """Anything this package raises about idemgate's answers."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own pickling calls ``cls(*self.args)``, which fails for
        # a class whose ``__init__`` takes other arguments than its message
        # (Problem, InFlight): rebuild from the message and every field.
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


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
    """503: idemgate's database is away (the server said so), or idemgate did
    not answer at all (``answered`` false: refused, reset, timed out; the
    httpx exception is the ``__cause__``). Retry later, the same key."""

    slug = "store-unavailable"

    @property
    def answered(self) -> bool:
        """False when no answer came (a transport failure), not a 503."""
        return bool(self.body.get("answered", True))

    @classmethod
    def unreachable(cls, method: str, path: str, error: BaseException) -> "StoreUnavailable":
        """The error for a call that got no answer; raise it ``from error``."""
        return cls(503, _unreachable_body(method, path, error), None)


def _unreachable_body(method: str, path: str, error: BaseException) -> dict[str, Any]:
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"
    return {
        "type": "store-unavailable",
        "title": "idemgate did not answer",
        # The exception's type only: its message could name a URL's secrets.
        "detail": f"no answer from idemgate to {method} {path} ({name})",
        "answered": False,
    }


class ResultNotCommitted(StoreUnavailable):
    """A guard's effect acted and returned ``result``, but its commit found no
    idemgate for the guard's whole ``commit_budget``. The key is still in
    flight under ``reservation_id``: under ``hold`` it turns unknown when its
    lease ends, and an operator completes it with this result
    (``encoded_result``, the body the guard tried to commit); a late commit
    by this holder is accepted as well. Not retried: the effect acted."""

    #: The reason the step is put in the dead-letter queue with.
    dead_letter_reason = "result_not_committed"

    @classmethod
    def of(
        cls, reservation_id: Any, result: Any, encoded_result: str | bytes, waited: float, last: Problem
    ) -> "ResultNotCommitted":
        error = cls(
            last.status,
            {
                "type": "store-unavailable",
                "title": "The result was not committed",
                "detail": f"the effect acted, but its result could not be committed for {waited:.1f} s "
                f"({last.detail or last.title}); it is kept in this error",
                "answered": last.answered if isinstance(last, StoreUnavailable) else True,
            },
            last.retry_after,
        )
        error.reservation_id = reservation_id
        error.result = result
        error.encoded_result = encoded_result
        error.waited = waited
        return error

    reservation_id: Any
    result: Any
    encoded_result: str | bytes
    waited: float


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


#: A call that got no answer (refused, reset, timed out, an unreadable answer).
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (httpx.RequestError,)


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
