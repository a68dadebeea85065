//! Every door's errors as RFC 9457 `application/problem+json`, with fixed
//! slugs, and the sentences that tell a client what happened and what to do.
//! Internal error text never reaches a client. A problem's `type` is its
//! slug under a base, [`DEFAULT_PROBLEM_BASE`] unless an embedder sets
//! another.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::engine::{Refusal, ReserveOutcome, TenantLimit};
use crate::key::KeyError;
use crate::store::StoreError;
use crate::telemetry::{self, StoreErrorKind};

/// The base of every problem `type` unless an embedder sets another
/// ([`LayerPolicy::problem_base`](crate::layer::LayerPolicy::problem_base)); the
/// slug (`key-reused`, `request-in-flight`, …) follows it.
pub const DEFAULT_PROBLEM_BASE: &str = "https://idemgate.dev/problems/";

/// The problem document.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "server", derive(utoipa::ToSchema))]
pub struct Problem {
    /// `https://idemgate.dev/problems/<slug>`.
    #[serde(rename = "type")]
    pub type_: String,
    /// A short summary of the problem type.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// What went wrong in this occurrence, and what to do.
    pub detail: String,
    /// Seconds to wait before retrying (request-in-flight, tenant-limit,
    /// store-unavailable). For request-in-flight it estimates when the first
    /// request will have finished, from how long recent ones took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<u64>,
    /// request-in-flight: when the first request's lease ends, the latest it
    /// can hold the key without news (a bound, not an estimate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_expires_at: Option<DateTime<Utc>>,
}

/// Every error an HTTP door answers with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400 key-missing.
    #[error("the Idempotency-Key header is required")]
    KeyMissing,
    /// 400 key-invalid.
    #[error("{0}")]
    KeyInvalid(String),
    /// 400 invalid-request.
    #[error("{0}")]
    InvalidRequest(String),
    /// 401 unauthorized.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    #[error("{0}")]
    Unauthorized(&'static str),
    /// 404 not-found.
    #[error("{0}")]
    NotFound(String),
    /// 405 method-not-allowed: the path exists, the method does not (the
    /// `Allow` header lists the ones that do).
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    #[error("{0}")]
    MethodNotAllowed(String),
    /// 410 reservation-gone: the reservation's key expired, was released, or
    /// was reserved afresh by another request.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    #[error("{0}")]
    Gone(&'static str),
    /// 408 request-timeout: the request body stopped arriving.
    #[error("{0}")]
    RequestTimeout(String),
    /// 409 request-in-flight.
    #[error("a request with this key is still being processed")]
    InFlight {
        /// Seconds until the holder will likely have finished.
        retry_after: u64,
        /// When the holder's lease ends.
        lease_expires_at: DateTime<Utc>,
    },
    /// 409 outcome-unknown: whether the key's effect happened is unknown,
    /// and it is not run again until its holder or an operator settles it.
    #[error(
        "whether the request with this key took effect is unknown (its first attempt was cut \
         off and nobody holds the key now), so it is not run again: do not retry it, under \
         this key or another; it waits for an operator to settle it (see /v1/admin/keys)"
    )]
    OutcomeUnknown,
    /// 409 lease-lost.
    #[error("{0}")]
    LeaseLost(&'static str),
    /// 409 key-not-stuck: an operator asked to settle a key that will be
    /// settled without one (completed, or in flight under a live lease).
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    #[error("{0}")]
    NotStuck(String),
    /// 403 forbidden: a valid credential, but not one for this endpoint.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    #[error("{0}")]
    Forbidden(&'static str),
    /// 403 admin-disabled: the operators' endpoints are closed on this
    /// listener (tenant tokens and no admin tokens, or no loopback), whoever
    /// asks.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    #[error("{0}")]
    AdminDisabled(&'static str),
    /// 421 misdirected-request: the request's `Host` is neither the
    /// listener's own address nor a name it was told to answer
    /// (`IDEMGATE_ALLOWED_HOSTS`): a page whose name was rebound to it.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    #[error("{0}")]
    MisdirectedRequest(&'static str),
    /// 412 first-sent-too-old: the request's first attempt is older than
    /// the window keys are remembered for, so it may have executed and been
    /// forgotten; it is not executed.
    #[error("{0}")]
    FirstSentTooOld(String),
    /// 422 key-reused.
    #[error(
        "this key was already used with a different request payload; a key names one \
         operation: send this request under a new key, or send the first request's payload \
         unchanged to get its result (a retry must repeat the request as it was)"
    )]
    KeyReused,
    /// 413 payload-too-large.
    #[error("{0}")]
    PayloadTooLarge(String),
    /// 429 tenant-limit: the tenant is at one of its limits.
    #[error("{}", tenant_limit_detail(*limit))]
    TenantLimit {
        /// The limit reached.
        limit: TenantLimit,
        /// Seconds until room is likely.
        retry_after: u64,
    },
    /// 503 store-unavailable.
    #[error("the idempotency store is unavailable; retry shortly")]
    StoreUnavailable,
    /// 502 upstream-unavailable: the proxy's upstream could not be reached
    /// (or its response broke off).
    #[error("{0}")]
    UpstreamUnavailable(String),
    /// 504 upstream-timeout: the upstream did not answer in time.
    #[error("{0}")]
    UpstreamTimeout(String),
    /// 500 internal: a bug. The text is logged, never sent.
    #[error("internal error")]
    Internal(String),
}

/// The answer to a request body that stopped arriving.
pub(crate) fn body_timeout() -> ApiError {
    ApiError::RequestTimeout(
        "the request body stopped arriving (longer between two pieces than this server waits)"
            .into(),
    )
}

/// Result of a handler.
#[cfg(feature = "server")]
pub type Result<T, E = ApiError> = std::result::Result<T, E>;

/// Seconds a client is told to wait while the store is away.
const STORE_RETRY_AFTER: u64 = 2;

// === impl ApiError ===

impl ApiError {
    /// The status code.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::KeyMissing | ApiError::KeyInvalid(_) | ApiError::InvalidRequest(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Gone(_) => StatusCode::GONE,
            ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::InFlight { .. }
            | ApiError::OutcomeUnknown
            | ApiError::LeaseLost(_)
            | ApiError::NotStuck(_) => StatusCode::CONFLICT,
            ApiError::Forbidden(_) | ApiError::AdminDisabled(_) => StatusCode::FORBIDDEN,
            ApiError::MisdirectedRequest(_) => StatusCode::MISDIRECTED_REQUEST,
            ApiError::FirstSentTooOld(_) => StatusCode::PRECONDITION_FAILED,
            ApiError::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::TenantLimit { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::UpstreamUnavailable(_) => StatusCode::BAD_GATEWAY,
            ApiError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The slug that ends the problem `type`.
    pub fn slug(&self) -> &'static str {
        match self {
            ApiError::KeyMissing => "key-missing",
            ApiError::KeyInvalid(_) => "key-invalid",
            ApiError::InvalidRequest(_) => "invalid-request",
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::NotFound(_) => "not-found",
            ApiError::MethodNotAllowed(_) => "method-not-allowed",
            ApiError::Gone(_) => "reservation-gone",
            ApiError::RequestTimeout(_) => "request-timeout",
            ApiError::InFlight { .. } => "request-in-flight",
            ApiError::OutcomeUnknown => "outcome-unknown",
            ApiError::LeaseLost(_) => "lease-lost",
            ApiError::NotStuck(_) => "key-not-stuck",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::AdminDisabled(_) => "admin-disabled",
            ApiError::MisdirectedRequest(_) => "misdirected-request",
            ApiError::FirstSentTooOld(_) => "first-sent-too-old",
            ApiError::KeyReused => "key-reused",
            ApiError::PayloadTooLarge(_) => "payload-too-large",
            ApiError::TenantLimit { .. } => "tenant-limit",
            ApiError::StoreUnavailable => "store-unavailable",
            ApiError::UpstreamUnavailable(_) => "upstream-unavailable",
            ApiError::UpstreamTimeout(_) => "upstream-timeout",
            ApiError::Internal(_) => "internal",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            ApiError::KeyMissing => "Idempotency-Key missing",
            ApiError::KeyInvalid(_) => "Idempotency-Key invalid",
            ApiError::InvalidRequest(_) => "Invalid request",
            ApiError::Unauthorized(_) => "Unauthorized",
            ApiError::NotFound(_) => "Not found",
            ApiError::MethodNotAllowed(_) => "Method not allowed",
            ApiError::Gone(_) => "Reservation gone",
            ApiError::RequestTimeout(_) => "Request timeout",
            ApiError::InFlight { .. } => "Request in flight",
            ApiError::OutcomeUnknown => "Outcome unknown",
            ApiError::LeaseLost(_) => "Lease lost",
            ApiError::NotStuck(_) => "Key not stuck",
            ApiError::Forbidden(_) => "Forbidden",
            ApiError::AdminDisabled(_) => "Admin endpoints disabled",
            ApiError::MisdirectedRequest(_) => "Misdirected request",
            ApiError::FirstSentTooOld(_) => "First attempt too old",
            ApiError::KeyReused => "Idempotency-Key reused",
            ApiError::PayloadTooLarge(_) => "Payload too large",
            ApiError::TenantLimit { .. } => "Tenant limit reached",
            ApiError::StoreUnavailable => "Store unavailable",
            ApiError::UpstreamUnavailable(_) => "Upstream unavailable",
            ApiError::UpstreamTimeout(_) => "Upstream timeout",
            ApiError::Internal(_) => "Internal error",
        }
    }

    fn retry_after(&self) -> Option<u64> {
        match self {
            ApiError::InFlight { retry_after, .. } | ApiError::TenantLimit { retry_after, .. } => {
                Some(*retry_after)
            }
            ApiError::StoreUnavailable => Some(STORE_RETRY_AFTER),
            _ => None,
        }
    }

    /// The problem document, its `type` under `base`.
    pub fn problem(&self, base: &str) -> Problem {
        Problem {
            type_: format!("{base}{}", self.slug()),
            title: self.title().into(),
            status: self.status().as_u16(),
            detail: self.to_string(),
            retry_after_seconds: self.retry_after(),
            lease_expires_at: match self {
                ApiError::InFlight {
                    lease_expires_at, ..
                } => Some(*lease_expires_at),
                _ => None,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.into_response_at(DEFAULT_PROBLEM_BASE)
    }
}

impl ApiError {
    /// The response, its problem `type` under `base`.
    pub fn into_response_at(self, base: &str) -> Response {
        if let ApiError::Internal(reason) = &self {
            tracing::error!(error = %reason, "internal error");
        }
        let problem = self.problem(base);
        let body = serde_json::to_vec(&problem).unwrap_or_default();
        let mut res = (self.status(), body).into_response();
        let headers = res.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = problem.retry_after_seconds {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if matches!(self, ApiError::Unauthorized(_)) {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"idemgate\""),
            );
        }
        res.extensions_mut().insert(OwnProblem(self.slug()));
        res
    }
}

/// Response extension: the problem is idemgate's own (not an upstream's
/// answer passed on), with its slug. The MCP door turns these into tool
/// results and JSON-RPC errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnProblem(pub &'static str);

impl From<KeyError> for ApiError {
    fn from(e: KeyError) -> Self {
        match e {
            KeyError::Missing => ApiError::KeyMissing,
            KeyError::Invalid(why) => ApiError::KeyInvalid(why),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable { why, .. } => {
                crate::store::report_unavailable(&why);
                telemetry::record_store_error(StoreErrorKind::Unavailable);
                ApiError::StoreUnavailable
            }
            StoreError::Other { why, .. } => {
                telemetry::record_store_error(StoreErrorKind::Other);
                ApiError::Internal(why)
            }
        }
    }
}

impl From<Refusal> for ApiError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::NotFound => ApiError::NotFound(refusal_detail(refusal).into()),
            other => ApiError::LeaseLost(refusal_detail(other)),
        }
    }
}

/// The refusal of a request first sent too long ago: `first_sent` by
/// the header `shown`.
pub(crate) fn first_sent_too_old(
    shown: &str,
    too_old: crate::key::dialect::TooOld,
    ttl: std::time::Duration,
) -> ApiError {
    ApiError::FirstSentTooOld(format!(
        "{shown} says this request was first sent {} s ago; keys here are remembered for {} s, \
         and a first attempt more than {} s old may have executed and been forgotten, so it is \
         not executed again. Send it under a new key, with a new first-sent time, only if you \
         know the first attempt did not act",
        too_old.age.as_secs(),
        ttl.as_secs(),
        too_old.window.as_secs(),
    ))
}

/// The sentence for a client whose tenant is at `limit`.
pub(crate) fn tenant_limit_detail(limit: TenantLimit) -> &'static str {
    match limit {
        TenantLimit::InFlightKeys => {
            "this tenant holds as many keys in flight as it may; retry once one completes"
        }
        TenantLimit::StoredBytes => {
            "this tenant's stored responses take as much room as it may; retry once some expire"
        }
    }
}

/// The sentence for a holder whose write was refused.
pub(crate) fn refusal_detail(refusal: Refusal) -> &'static str {
    match refusal {
        Refusal::NotFound => "no reservation with this id exists for this tenant",
        Refusal::TakenOver => {
            "the lease ended and another caller took the key over; this reservation id is dead"
        }
        Refusal::Expired => {
            "this reservation was released or its key expired; the key is new again"
        }
        Refusal::AlreadyCompleted => {
            "this reservation is already completed; a commit may only repeat the response it stored"
        }
    }
}

impl ApiError {
    /// The refusal a door answers for the engine's decision; `None` for a
    /// reservation or a replay, which each door answers in its own way.
    pub(crate) fn refusing(decision: &ReserveOutcome) -> Option<ApiError> {
        match decision {
            ReserveOutcome::Reserved(_) | ReserveOutcome::Completed(_) => None,
            &ReserveOutcome::InFlight {
                retry_after,
                lease_expires_at,
            } => Some(ApiError::InFlight {
                retry_after,
                lease_expires_at,
            }),
            ReserveOutcome::Mismatch => Some(ApiError::KeyReused),
            ReserveOutcome::Unknown { .. } => Some(ApiError::OutcomeUnknown),
            &ReserveOutcome::OverLimit { limit, retry_after } => {
                Some(ApiError::TenantLimit { limit, retry_after })
            }
        }
    }
}
