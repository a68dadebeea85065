"""The caller's half of idemgate: keys derived from an attempt's identity,
and typed calls of the reservation API."""

from .api import AsyncClient, Client, Completed, Extended, Record, RecoveryPoint, Reserved, StoredResponse
from .errors import (
    IdemgateError,
    InvalidRequest,
    KeyInvalid,
    KeyMissing,
    KeyReused,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    Problem,
    RequestInFlight,
    ReservationGone,
    StoreUnavailable,
    TenantLimit,
    Unauthorized,
)
from .guard import Guard, Holding, InFlight, NotExecuted
from .keys import DERIVE_KEY_TAG, derive_key
from .retry import AsyncRetryTransport, Decision, RetryTransport, classify

__all__ = [
    "AsyncClient",
    "AsyncRetryTransport",
    "Decision",
    "RetryTransport",
    "classify",
    "Client",
    "Completed",
    "DERIVE_KEY_TAG",
    "Extended",
    "Guard",
    "Holding",
    "IdemgateError",
    "InFlight",
    "InvalidRequest",
    "KeyInvalid",
    "KeyMissing",
    "KeyReused",
    "LeaseLost",
    "NotExecuted",
    "NotFound",
    "PayloadTooLarge",
    "Problem",
    "Record",
    "RecoveryPoint",
    "RequestInFlight",
    "ReservationGone",
    "Reserved",
    "StoreUnavailable",
    "StoredResponse",
    "TenantLimit",
    "Unauthorized",
    "derive_key",
]
