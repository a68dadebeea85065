//! The reservation/commit API: a backend reserves a key before its
//! side effect and commits the result after it.

use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use uuid::Uuid;

use super::AppState;
use super::extract::{ApiJson, Tenant};
use super::views::Recovery;
use super::views::{
    CommitBody, CompletedView, ExtendBody, ExtendedView, RecordView, Replayed, RequestDescription,
    ReserveBody, ReservedState, ReservedView, RetryAfterSeconds, completed_response, record_view,
};
use crate::engine::{CommitOutcome, Lookup, Refusal, ReserveOutcome, ReserveRequest};
use crate::fingerprint;
use crate::headers::{mark_replayed, prefer_wait, set_expires};
use crate::key::{self, KeyError};
use crate::problem::{ApiError, Problem, Result};
use crate::store::StoredResponse;
use crate::telemetry::{self, Outcome};

/// Longest caller-computed fingerprint.
const MAX_FINGERPRINT_LEN: usize = 512;
const MODE: &str = "api";

/// Exports the series of this door's outcomes at 0 (every outcome but
/// `passthrough`, which only the proxy and the layer have).
pub(super) fn register_metrics() {
    let outcomes: Vec<Outcome> = Outcome::ALL
        .into_iter()
        .filter(|o| *o != Outcome::Passthrough)
        .collect();
    telemetry::register_door(MODE, &outcomes);
}

// === handlers ===

/// Reserve an idempotency key before performing the side effect.
#[utoipa::path(
    post,
    path = "/v1/reservations",
    tag = "reservations",
    params(
        ("Idempotency-Key" = String, Header, min_length = 1, description = "The key: an RFC 8941 sf-string (a bare token is accepted unless strict mode is on)."),
        ("Prefer" = Option<String>, Header, description = "`wait=N`: hold the request up to N seconds (capped) while another holder is in flight."),
    ),
    request_body(content = Option<ReserveBody>, content_type = "application/json",
        description = "Optional: no body, or `null`, is `{}` (every field takes its default)."),
    responses(
        (status = 201, description = "Reserved: perform the effect, then commit.", body = ReservedView,
         headers(
            ("Idempotency-Expires" = String, description = "HTTP-date until which the key is remembered."),
            ("Location" = String, description = "`/v1/reservations/{id}`: the reservation's record."),
         )),
        (status = 200, description = "Completed before: the stored response, replayed.", body = CompletedView,
         headers(
            ("Idempotent-Replayed" = inline(Replayed), description = "Always `true`: the answer is the stored response, and nothing was reserved."),
            ("Idempotency-Expires" = String, description = "HTTP-date until which the key is remembered."),
         )),
        (status = 400, description = "key-missing, key-invalid or invalid-request", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "unauthorized", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "request-in-flight", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = inline(RetryAfterSeconds), description = "Whole seconds until the holder has likely finished (at least 1, never past its lease)."))),
        (status = 413, description = "payload-too-large", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "key-reused: the key was used with another payload", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "tenant-limit: the tenant holds as many keys in flight, or as many stored bytes, as it may; nothing was reserved", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = inline(RetryAfterSeconds), description = "Whole seconds until room is likely (at least 1)."))),
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = inline(RetryAfterSeconds), description = "Whole seconds to wait before retrying (at least 1)."))),
    ),
    security((), ("bearer" = []))
)]
pub async fn create_reservation(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    headers: HeaderMap,
    body: std::result::Result<ApiJson<ReserveBody>, ApiError>,
) -> Result<Response> {
    let started = Instant::now();
    let key = match key::from_headers(&headers, &KEY_HEADER, &state.key_policy) {
        Ok(key) => key,
        Err(e) => {
            let outcome = match e {
                KeyError::Missing => Outcome::Missing,
                KeyError::Invalid(_) => Outcome::Invalid,
            };
            telemetry::record(MODE, outcome, started.elapsed());
            return Err(e.into());
        }
    };
    let ApiJson(body) = body?;
    let limits = state.engine.limits();
    let lease_seconds = bounded(
        "lease_seconds",
        body.lease_seconds,
        limits.default_lease,
        limits.max_lease,
    )?;
    let ttl_seconds = bounded(
        "ttl_seconds",
        body.ttl_seconds,
        limits.default_ttl,
        limits.max_ttl,
    )?;
    let fingerprint = match (body.fingerprint, body.request) {
        (Some(_), Some(_)) => {
            return Err(ApiError::InvalidRequest(
                "send either fingerprint or request, not both".into(),
            ));
        }
        (Some(fp), None) => {
            if fp.is_empty() || fp.chars().count() > MAX_FINGERPRINT_LEN {
                return Err(ApiError::InvalidRequest(format!(
                    "fingerprint must hold 1 to {MAX_FINGERPRINT_LEN} characters"
                )));
            }
            Some(fp)
        }
        (None, Some(req)) => Some(fingerprint_of(&req, &state)?),
        (None, None) => None,
    };
    let wait = prefer_wait(&headers);
    let outcome = state
        .engine
        .reserve(&ReserveRequest {
            tenant: tenant.clone(),
            key_hash: key.hash(),
            fingerprint,
            lease_seconds,
            ttl_seconds,
            wait,
        })
        .await?;
    let metric = outcome.outcome();
    let response = match outcome {
        ReserveOutcome::Reserved(r) => {
            let mut res = (
                StatusCode::CREATED,
                axum::Json(ReservedView {
                    state: ReservedState::Reserved,
                    reservation_id: r.reservation_id,
                    attempt: r.attempt,
                    lease_expires_at: r.lease_expires_at,
                    expires_at: r.expires_at,
                    recovery: r.recovery.map(Recovery::from),
                }),
            )
                .into_response();
            set_expires(res.headers_mut(), r.expires_at);
            if let Ok(v) = HeaderValue::from_str(&format!("/v1/reservations/{}", r.reservation_id))
            {
                res.headers_mut().insert(header::LOCATION, v);
            }
            Ok(res)
        }
        ReserveOutcome::Completed(record) => {
            let mut res = completed_response(&record);
            mark_replayed(res.headers_mut());
            Ok(res)
        }
        refused => Err(ApiError::refusing(&refused)
            .unwrap_or_else(|| ApiError::Internal("a decision without an answer".into()))),
    };
    telemetry::record(MODE, metric, started.elapsed());
    tracing::info!(
        tenant.id = %tenant,
        key.hash = %key.hash_prefix(),
        outcome = metric.as_str(),
        "reserve"
    );
    response
}

/// Store the response of the side effect and complete the key.
#[utoipa::path(
    post,
    path = "/v1/reservations/{id}/commit",
    tag = "reservations",
    params(("id" = Uuid, Path, description = "The reservation id")),
    request_body(content = CommitBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Stored (or stored before, identically).", body = CompletedView,
         headers(("Idempotency-Expires" = String, description = "HTTP-date until which the key is remembered."))),
        (status = 400, description = "invalid-request", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "unauthorized", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "not-found", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "lease-lost: this id no longer holds the key", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "payload-too-large", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = inline(RetryAfterSeconds), description = "Whole seconds to wait before retrying (at least 1)."))),
    ),
    security((), ("bearer" = []))
)]
pub async fn commit_reservation(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<CommitBody>,
) -> Result<Response> {
    let id = reservation_id(&id)?;
    let response = stored_response(body, state.max_body_bytes)?;
    match state.engine.commit(&tenant, id, &response).await? {
        CommitOutcome::Committed(record) | CommitOutcome::AlreadyCommitted(record) => {
            tracing::info!(tenant.id = %tenant, reservation.id = %id, "commit");
            Ok(completed_response(&record))
        }
        CommitOutcome::Refused(refusal) => Err(ApiError::from(refusal)),
    }
}

/// Forget an in-flight key whose effect never started: the next request with
/// it executes afresh.
#[utoipa::path(
    post,
    path = "/v1/reservations/{id}/release",
    tag = "reservations",
    params(("id" = Uuid, Path, description = "The reservation id")),
    responses(
        (status = 204, description = "Released."),
        (status = 401, description = "unauthorized", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "not-found", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "lease-lost", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = inline(RetryAfterSeconds), description = "Whole seconds to wait before retrying (at least 1)."))),
    ),
    security((), ("bearer" = []))
)]
pub async fn release_reservation(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<StatusCode> {
    let started = Instant::now();
    let id = reservation_id(&id)?;
    state
        .engine
        .release(&tenant, id)
        .await?
        .map_err(ApiError::from)?;
    telemetry::record(MODE, Outcome::Released, started.elapsed());
    tracing::info!(tenant.id = %tenant, reservation.id = %id, "release");
    Ok(StatusCode::NO_CONTENT)
}

/// Extend the lease of a reservation (a heartbeat for long work).
#[utoipa::path(
    post,
    path = "/v1/reservations/{id}/extend",
    tag = "reservations",
    params(("id" = Uuid, Path, description = "The reservation id")),
    request_body(content = Option<ExtendBody>, content_type = "application/json",
        description = "Optional: no body, or `null`, is `{}` (the default lease)."),
    responses(
        (status = 200, description = "Extended.", body = ExtendedView),
        (status = 400, description = "invalid-request", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "unauthorized", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "not-found", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "lease-lost", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = inline(RetryAfterSeconds), description = "Whole seconds to wait before retrying (at least 1)."))),
    ),
    security((), ("bearer" = []))
)]
pub async fn extend_reservation(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ExtendBody>,
) -> Result<axum::Json<ExtendedView>> {
    let id = reservation_id(&id)?;
    let limits = state.engine.limits();
    let lease = bounded(
        "lease_seconds",
        body.lease_seconds,
        limits.default_lease,
        limits.max_lease,
    )?;
    let until = state
        .engine
        .extend(&tenant, id, lease)
        .await?
        .map_err(ApiError::from)?;
    Ok(axum::Json(ExtendedView {
        reservation_id: id,
        lease_expires_at: until,
    }))
}

/// Record a recovery point inside a multi-step effect; a holder that takes
/// over after a crash receives it.
#[utoipa::path(
    post,
    path = "/v1/reservations/{id}/checkpoint",
    tag = "reservations",
    params(("id" = Uuid, Path, description = "The reservation id")),
    request_body(content = Recovery, content_type = "application/json"),
    responses(
        (status = 200, description = "Recorded.", body = RecordView),
        (status = 400, description = "invalid-request", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "unauthorized", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "not-found", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "lease-lost", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "payload-too-large", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = inline(RetryAfterSeconds), description = "Whole seconds to wait before retrying (at least 1)."))),
    ),
    security((), ("bearer" = []))
)]
pub async fn checkpoint_reservation(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<Recovery>,
) -> Result<axum::Json<RecordView>> {
    let id = reservation_id(&id)?;
    if body.recovery_point.is_empty() || body.recovery_point.chars().count() > 255 {
        return Err(ApiError::InvalidRequest(
            "recovery_point must hold 1 to 255 characters".into(),
        ));
    }
    let data_len = body.data.as_ref().map_or(0, |d| d.to_string().len());
    if data_len > state.max_body_bytes {
        return Err(ApiError::PayloadTooLarge(format!(
            "checkpoint data is {data_len} bytes; the limit is {} (IDEMGATE_MAX_BODY_BYTES)",
            state.max_body_bytes
        )));
    }
    let record = state
        .engine
        .checkpoint(&tenant, id, &body.into())
        .await?
        .map_err(ApiError::from)?;
    Ok(axum::Json(record_view(id, &record, true)))
}

/// The public view of the record a reservation belongs to.
///
/// An id taken over still shows its key's record (`live` false). An id whose
/// key expired or was released, or has since been reserved by another
/// request, is `410 reservation-gone`: the key is forgotten, and its record,
/// if any, is another request's. Once pruning deletes the key, the id is
/// unknown: `404`.
#[utoipa::path(
    get,
    path = "/v1/reservations/{id}",
    tag = "reservations",
    params(("id" = Uuid, Path, description = "The reservation id")),
    responses(
        (status = 200, description = "The record.", body = RecordView),
        (status = 401, description = "unauthorized", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "not-found", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "reservation-gone", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = inline(RetryAfterSeconds), description = "Whole seconds to wait before retrying (at least 1)."))),
    ),
    security((), ("bearer" = []))
)]
pub async fn get_reservation(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<axum::Json<RecordView>> {
    let id = reservation_id(&id)?;
    match state.engine.get(&tenant, id).await? {
        None => Err(ApiError::from(Refusal::NotFound)),
        Some(Lookup::Gone) => Err(ApiError::Gone(
            "this reservation's key expired or was released, or another request holds it now",
        )),
        Some(Lookup::Record { record, live }) => Ok(axum::Json(record_view(id, &record, live))),
    }
}

// === helpers ===

static KEY_HEADER: HeaderName = HeaderName::from_static("idempotency-key");

fn reservation_id(raw: &str) -> Result<Uuid> {
    Uuid::parse_str(raw).map_err(|_| ApiError::from(Refusal::NotFound))
}

/// A caller's number of seconds, or the default, within 1..=max.
fn bounded(field: &str, given: Option<u32>, default: Duration, max: Duration) -> Result<u32> {
    let max = u32::try_from(max.as_secs()).unwrap_or(u32::MAX);
    match given {
        None => Ok(u32::try_from(default.as_secs()).unwrap_or(max)),
        Some(v) if (1..=max).contains(&v) => Ok(v),
        Some(v) => Err(ApiError::InvalidRequest(format!(
            "{field} is {v}; it must be between 1 and {max}"
        ))),
    }
}

fn fingerprint_of(req: &RequestDescription, state: &AppState) -> Result<String> {
    let method = req.method.trim().to_ascii_uppercase();
    if http::Method::from_bytes(method.as_bytes()).is_err() {
        return Err(ApiError::InvalidRequest(
            "request.method is not an HTTP method".into(),
        ));
    }
    if !req.path.starts_with('/') {
        return Err(ApiError::InvalidRequest(
            "request.path must start with '/'".into(),
        ));
    }
    Ok(fingerprint::fingerprint_json_request(
        &method,
        &req.path,
        req.body.as_ref(),
        &state.fingerprint_policy,
    ))
}

fn stored_response(body: CommitBody, max_body: usize) -> Result<StoredResponse> {
    if !(100..=599).contains(&body.status) {
        return Err(ApiError::InvalidRequest(format!(
            "status is {}; it must be between 100 and 599",
            body.status
        )));
    }
    for (name, value) in &body.headers {
        if HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(ApiError::InvalidRequest(format!(
                "{name:?} is not a valid header name"
            )));
        }
        if HeaderValue::from_str(value).is_err() {
            return Err(ApiError::InvalidRequest(format!(
                "the value of header {name:?} is not a valid header value"
            )));
        }
    }
    let bytes = match (body.body, body.body_base64) {
        (Some(_), Some(_)) => {
            return Err(ApiError::InvalidRequest(
                "send either body or body_base64, not both".into(),
            ));
        }
        (Some(text), None) => text.into_bytes(),
        (None, Some(b64)) => BASE64.decode(b64.as_bytes()).map_err(|e| {
            ApiError::InvalidRequest(format!("body_base64 is not valid base64: {e}"))
        })?,
        (None, None) => Vec::new(),
    };
    if bytes.len() > max_body {
        return Err(ApiError::PayloadTooLarge(format!(
            "the response body is {} bytes; the limit is {max_body} (IDEMGATE_MAX_BODY_BYTES)",
            bytes.len()
        )));
    }
    Ok(StoredResponse {
        status: body.status,
        headers: body.headers,
        body: bytes,
    })
}
