"""Typed calls of idemgate's reservation API (``/v1/reservations``).

A backend reserves the key before its side effect and commits the
response after it::

    with Client("http://127.0.0.1:8080", token="…") as idem:
        answer = idem.reserve(key, request={"method": "POST", "path": "/charges", "body": body})
        if isinstance(answer, Completed):
            return answer.response          # a retry: the first result, nothing runs again
        result = charge(...)                # answer is a Reserved: run the effect once
        idem.commit(answer.reservation_id, status=201, body=json.dumps(result))

Errors are the exceptions of :mod:`idemgate_client.errors` (``KeyReused``,
``RequestInFlight``, ``OutcomeUnknown``, …); the HTTP is httpx's, and a
call that gets no answer (refused, reset, timed out) raises
``StoreUnavailable`` (``answered`` false) with httpx's exception as its
``__cause__``, never the raw httpx exception.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Generic, Literal, Mapping, TypeVar, Union
from uuid import UUID

import httpx

from .errors import TRANSPORT_ERRORS, StoreUnavailable, problem_from

__all__ = [
    "Client",
    "AsyncClient",
    "Reserved",
    "Completed",
    "StoredResponse",
    "RecoveryPoint",
    "Extended",
    "LeaseExpiry",
    "Record",
    "MarkedUnknown",
]

#: What a lease that ends without a commit, release or extend means:
#: ``takeover`` (the server's default for the reservation API) gives the key
#: to the next caller, with the recovery point; ``hold`` makes its outcome
#: unknown, and every reserve of it ``OutcomeUnknown`` until it is settled.
LeaseExpiry = Literal["takeover", "hold"]


@dataclass(frozen=True)
class RecoveryPoint:
    """How far an earlier holder of the key got (``checkpoint``)."""

    recovery_point: str
    data: Any = None


@dataclass(frozen=True)
class Reserved:
    """201: this caller holds the key and runs the effect."""

    reservation_id: UUID
    attempt: int
    """1 for a new key; more for a takeover, which must reconcile first."""
    lease_expires_at: datetime
    expires_at: datetime
    recovery: RecoveryPoint | None


@dataclass(frozen=True)
class StoredResponse:
    """A response as committed."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8")


@dataclass(frozen=True)
class Completed:
    """The key's stored response; ``replayed`` when an earlier call stored it."""

    response: StoredResponse
    completed_at: datetime | None
    expires_at: datetime
    replayed: bool


@dataclass(frozen=True)
class Extended:
    reservation_id: UUID
    lease_expires_at: datetime


@dataclass(frozen=True)
class MarkedUnknown:
    """Why and when the key's holder marked it unknown (``mark_unknown``)."""

    reason: str
    at: datetime


@dataclass(frozen=True)
class Record:
    """What a reservation id shows (``get``, ``checkpoint``)."""

    reservation_id: UUID
    live: bool
    state: str
    """``in_flight``, ``completed`` or ``unknown`` (its holder was cut off under ``hold``)."""
    attempt: int
    key_hash_prefix: str
    fingerprint: str | None
    lease_expires_at: datetime | None
    recovery: RecoveryPoint | None
    response: StoredResponse | None
    created_at: datetime
    completed_at: datetime | None
    expires_at: datetime
    marked_unknown: MarkedUnknown | None = None
    """Set once the holder marked the key unknown (:meth:`Client.mark_unknown`)."""


Reservation = Union[Reserved, Completed]


def _dt(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def _recovery(value: Any) -> RecoveryPoint | None:
    if not value:
        return None
    return RecoveryPoint(recovery_point=value["recovery_point"], data=value.get("data"))


def _response(value: Mapping[str, Any]) -> StoredResponse:
    if value.get("body_base64") is not None:
        body = base64.b64decode(value["body_base64"])
    else:
        body = (value.get("body") or "").encode("utf-8")
    headers = [(str(n), str(v)) for n, v in value.get("headers", [])]
    return StoredResponse(status=int(value["status"]), headers=headers, body=body)


def _completed(value: Mapping[str, Any], replayed: bool) -> Completed:
    return Completed(
        response=_response(value["response"]),
        completed_at=_dt(value.get("completed_at")),
        expires_at=_dt(value["expires_at"]),  # type: ignore[arg-type]
        replayed=replayed,
    )


def _marked(value: Any) -> MarkedUnknown | None:
    if not value:
        return None
    return MarkedUnknown(reason=str(value["reason"]), at=_dt(value["at"]))  # type: ignore[arg-type]


def _record(value: Mapping[str, Any]) -> Record:
    return Record(
        reservation_id=UUID(value["reservation_id"]),
        live=bool(value["live"]),
        state=str(value["state"]),
        attempt=int(value["attempt"]),
        key_hash_prefix=str(value["key_hash_prefix"]),
        fingerprint=value.get("fingerprint"),
        lease_expires_at=_dt(value.get("lease_expires_at")),
        recovery=_recovery(value.get("recovery")),
        response=_response(value["response"]) if value.get("response") else None,
        created_at=_dt(value["created_at"]),  # type: ignore[arg-type]
        completed_at=_dt(value.get("completed_at")),
        expires_at=_dt(value["expires_at"]),  # type: ignore[arg-type]
        marked_unknown=_marked(value.get("marked_unknown")),
    )


def _ok(response: httpx.Response) -> httpx.Response:
    if response.is_success:
        return response
    raise problem_from(response)


def _reserve_body(
    request: Mapping[str, Any] | None,
    fingerprint: str | None,
    lease_seconds: int | None,
    ttl_seconds: int | None,
    on_lease_expiry: LeaseExpiry | None,
    label: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if request is not None:
        body["request"] = dict(request)
    if fingerprint is not None:
        body["fingerprint"] = fingerprint
    if lease_seconds is not None:
        body["lease_seconds"] = lease_seconds
    if ttl_seconds is not None:
        body["ttl_seconds"] = ttl_seconds
    if on_lease_expiry is not None:
        body["on_lease_expiry"] = on_lease_expiry
    if label is not None:
        body["label"] = label
    return body


def _reservation(response: httpx.Response) -> Reservation:
    value = _ok(response).json()
    if response.status_code == 201:
        return Reserved(
            reservation_id=UUID(value["reservation_id"]),
            attempt=int(value["attempt"]),
            lease_expires_at=_dt(value["lease_expires_at"]),  # type: ignore[arg-type]
            expires_at=_dt(value["expires_at"]),  # type: ignore[arg-type]
            recovery=_recovery(value.get("recovery")),
        )
    return _completed(value, replayed=response.headers.get("idempotent-replayed") == "true")


def _commit_body(status: int, headers: list[tuple[str, str]] | None, body: str | bytes | None) -> dict[str, Any]:
    out: dict[str, Any] = {"status": status, "headers": [list(h) for h in headers or []]}
    if isinstance(body, bytes):
        out["body_base64"] = base64.b64encode(body).decode("ascii")
    elif body is not None:
        out["body"] = body
    return out


def _headers(key: str, wait: int | None) -> dict[str, str]:
    headers = {"Idempotency-Key": key}
    if wait is not None:
        headers["Prefer"] = f"wait={wait}"
    return headers


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


T = TypeVar("T")


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One operation: the request to send and how to read its answer. The
    sync and the async client send the same calls; only the I/O differs."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    headers: Mapping[str, str] = field(default_factory=dict)
    json: Any = None


def _reserve_call(
    key: str,
    request: Mapping[str, Any] | None,
    fingerprint: str | None,
    lease_seconds: int | None,
    ttl_seconds: int | None,
    wait: int | None,
    on_lease_expiry: LeaseExpiry | None,
    label: str | None,
) -> _Call[Reservation]:
    body = _reserve_body(request, fingerprint, lease_seconds, ttl_seconds, on_lease_expiry, label)
    return _Call("POST", "/v1/reservations", _reservation, _headers(key, wait), body)


def _commit_call(
    reservation_id: UUID | str, status: int, headers: list[tuple[str, str]] | None, body: str | bytes | None
) -> _Call[Completed]:
    return _Call(
        "POST",
        f"/v1/reservations/{reservation_id}/commit",
        lambda r: _completed(_ok(r).json(), replayed=False),
        json=_commit_body(status, headers, body),
    )


def _no_content(response: httpx.Response) -> None:
    _ok(response)


def _release_call(reservation_id: UUID | str) -> _Call[None]:
    return _Call("POST", f"/v1/reservations/{reservation_id}/release", _no_content)


def _unknown_call(reservation_id: UUID | str, reason: str) -> _Call[Record]:
    return _Call(
        "POST",
        f"/v1/reservations/{reservation_id}/unknown",
        lambda r: _record(_ok(r).json()),
        json={"reason": reason},
    )


def _extended(response: httpx.Response) -> Extended:
    value = _ok(response).json()
    return Extended(UUID(value["reservation_id"]), _dt(value["lease_expires_at"]))  # type: ignore[arg-type]


def _extend_call(reservation_id: UUID | str, lease_seconds: int | None) -> _Call[Extended]:
    body = {} if lease_seconds is None else {"lease_seconds": lease_seconds}
    return _Call("POST", f"/v1/reservations/{reservation_id}/extend", _extended, json=body)


def _checkpoint_call(reservation_id: UUID | str, recovery_point: str, data: Any) -> _Call[Record]:
    body: dict[str, Any] = {"recovery_point": recovery_point}
    if data is not None:
        body["data"] = data
    return _Call(
        "POST", f"/v1/reservations/{reservation_id}/checkpoint", lambda r: _record(_ok(r).json()), json=body
    )


def _get_call(reservation_id: UUID | str) -> _Call[Record]:
    return _Call("GET", f"/v1/reservations/{reservation_id}", lambda r: _record(_ok(r).json()))


class Client:
    """The reservation API over an ``httpx.Client``. With ``http=`` (your own
    client, its transport, retries or instrumentation) ``base_url`` and
    ``timeout`` are that client's to set."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        http: httpx.Client | None = None,
    ) -> None:
        self._http = http or httpx.Client(base_url=base_url, timeout=timeout)
        self._owned = http is None
        self._auth = _auth(token)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            self._http.close()

    def _do(self, call: _Call[T]) -> T:
        kwargs: dict[str, Any] = {"headers": {**self._auth, **call.headers}}
        if call.json is not None:
            kwargs["json"] = call.json
        try:
            response = self._http.request(call.method, call.path, **kwargs)
        except TRANSPORT_ERRORS as error:
            raise StoreUnavailable.unreachable(call.method, call.path, error) from error
        return call.parse(response)

    def reserve(
        self,
        key: str,
        *,
        request: Mapping[str, Any] | None = None,
        fingerprint: str | None = None,
        lease_seconds: int | None = None,
        ttl_seconds: int | None = None,
        wait: int | None = None,
        on_lease_expiry: LeaseExpiry | None = None,
        label: str | None = None,
    ) -> Reservation:
        """Reserves ``key`` (``Reserved``) or returns its stored response (``Completed``).

        Raises ``RequestInFlight`` while another holder runs (with ``wait``,
        the server holds the call up to that many seconds first),
        ``OutcomeUnknown`` when a holder was cut off and nobody knows whether
        its effect happened (never retried: the dead-letter queue's case),
        ``KeyReused`` for another payload under the key.

        ``on_lease_expiry`` says what this reservation's lease ending without
        a commit or release means (see :data:`LeaseExpiry`); unset, the
        server's default (``takeover``).

        ``label`` (at most 200 characters) tells the key apart for a person:
        an order id, a job's name. The operators' views show it beside the
        request; it is never part of the fingerprint, and is sent only when
        given.
        """
        return self._do(
            _reserve_call(key, request, fingerprint, lease_seconds, ttl_seconds, wait, on_lease_expiry, label)
        )

    def commit(
        self,
        reservation_id: UUID | str,
        *,
        status: int,
        headers: list[tuple[str, str]] | None = None,
        body: str | bytes | None = None,
    ) -> Completed:
        """Stores the effect's response and completes the key."""
        return self._do(_commit_call(reservation_id, status, headers, body))

    def release(self, reservation_id: UUID | str) -> None:
        """Gives the key up: the effect did not happen, a retry may run it."""
        self._do(_release_call(reservation_id))

    def mark_unknown(self, reservation_id: UUID | str, reason: str) -> Record:
        """Says that the holder cannot tell whether its effect happened (its
        call timed out after the request went out): the key turns ``unknown``
        at once, whatever its ``on_lease_expiry``, and every reserve of it
        raises ``OutcomeUnknown`` until this holder's late commit or release,
        or an operator, settles it. ``reason`` (1 to 1000 characters) is kept
        for that operator: what failed, never a body or a secret. Marking a
        key this id marked already returns the record again (its first reason
        stays); a dead id raises ``LeaseLost``."""
        return self._do(_unknown_call(reservation_id, reason))

    def extend(self, reservation_id: UUID | str, *, lease_seconds: int | None = None) -> Extended:
        """Keeps holding the key while a long effect runs."""
        return self._do(_extend_call(reservation_id, lease_seconds))

    def checkpoint(self, reservation_id: UUID | str, *, recovery_point: str, data: Any = None) -> Record:
        """Records how far a multi-step effect got, for a holder that takes over."""
        return self._do(_checkpoint_call(reservation_id, recovery_point, data))

    def get(self, reservation_id: UUID | str) -> Record:
        """What the reservation id shows now."""
        return self._do(_get_call(reservation_id))


class AsyncClient:
    """As :class:`Client`, over an ``httpx.AsyncClient``."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self._http = http or httpx.AsyncClient(base_url=base_url, timeout=timeout)
        self._owned = http is None
        self._auth = _auth(token)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def _do(self, call: _Call[T]) -> T:
        kwargs: dict[str, Any] = {"headers": {**self._auth, **call.headers}}
        if call.json is not None:
            kwargs["json"] = call.json
        try:
            response = await self._http.request(call.method, call.path, **kwargs)
        except TRANSPORT_ERRORS as error:
            raise StoreUnavailable.unreachable(call.method, call.path, error) from error
        return call.parse(response)

    async def reserve(
        self,
        key: str,
        *,
        request: Mapping[str, Any] | None = None,
        fingerprint: str | None = None,
        lease_seconds: int | None = None,
        ttl_seconds: int | None = None,
        wait: int | None = None,
        on_lease_expiry: LeaseExpiry | None = None,
        label: str | None = None,
    ) -> Reservation:
        return await self._do(
            _reserve_call(key, request, fingerprint, lease_seconds, ttl_seconds, wait, on_lease_expiry, label)
        )

    async def commit(
        self,
        reservation_id: UUID | str,
        *,
        status: int,
        headers: list[tuple[str, str]] | None = None,
        body: str | bytes | None = None,
    ) -> Completed:
        return await self._do(_commit_call(reservation_id, status, headers, body))

    async def release(self, reservation_id: UUID | str) -> None:
        await self._do(_release_call(reservation_id))

    async def mark_unknown(self, reservation_id: UUID | str, reason: str) -> Record:
        return await self._do(_unknown_call(reservation_id, reason))

    async def extend(self, reservation_id: UUID | str, *, lease_seconds: int | None = None) -> Extended:
        return await self._do(_extend_call(reservation_id, lease_seconds))

    async def checkpoint(self, reservation_id: UUID | str, *, recovery_point: str, data: Any = None) -> Record:
        return await self._do(_checkpoint_call(reservation_id, recovery_point, data))

    async def get(self, reservation_id: UUID | str) -> Record:
        return await self._do(_get_call(reservation_id))
