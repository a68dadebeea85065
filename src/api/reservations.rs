//! The reservation/commit API of SPEC §5: a backend reserves a key before its
//! side effect and commits the result after it.

use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::AppState;
use super::extract::{ApiJson, Tenant};
use super::problem::{ApiError, Problem, Result};
use crate::engine::{CommitOutcome, Refusal, ReserveOutcome, ReserveRequest};
use crate::fingerprint;
use crate::key::{self, KeyError};
use crate::store::{KeyState, Record, Recovery, StoredResponse};
use crate::telemetry::{self, Outcome};

/// `Idempotent-Replayed: true` marks a replay.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// Until this HTTP-date the key is remembered.
pub const IDEMPOTENCY_EXPIRES: &str = "idempotency-expires";
/// Longest caller-computed fingerprint.
const MAX_FINGERPRINT_LEN: usize = 512;
const MODE: &str = "api";

/// Body of `POST /v1/reservations`; every field is optional.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReserveBody {
    /// An opaque fingerprint the caller computed (at most 512 characters).
    pub fingerprint: Option<String>,
    /// The request, for idemgate to fingerprint (SPEC §3).
    pub request: Option<RequestDescription>,
    /// Lease in seconds (1..=max, default 30).
    pub lease_seconds: Option<u32>,
    /// Seconds the key is remembered, from now (1..=max, default 86400).
    pub ttl_seconds: Option<u32>,
}

/// A request to fingerprint.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RequestDescription {
    /// HTTP method.
    pub method: String,
    /// Path with its query.
    pub path: String,
    /// JSON body, canonicalised (RFC 8785) with the ignored pointers left out.
    #[schema(value_type = Object, nullable)]
    pub body: Option<serde_json::Value>,
}

/// `201`: the caller holds the key and owns the effect.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReservedView {
    /// Always `reserved`.
    #[schema(example = "reserved")]
    pub state: &'static str,
    /// Fencing token for commit, release, extend and checkpoint.
    pub reservation_id: Uuid,
    /// 1 for a new key; more after a takeover.
    pub attempt: i32,
    /// When the lease ends; extend it for long work.
    pub lease_expires_at: DateTime<Utc>,
    /// When the key is forgotten.
    pub expires_at: DateTime<Utc>,
    /// On a takeover: the previous holder's last recovery point, to
    /// reconcile before mutating again.
    pub recovery: Option<Recovery>,
}

/// A stored response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ResponseView {
    /// HTTP status.
    pub status: u16,
    /// Header lines as `[name, value]` pairs.
    #[schema(value_type = Vec<Vec<String>>)]
    pub headers: Vec<(String, String)>,
    /// The body, when it is UTF-8 text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// The body in base64, when it is not UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
}

/// `200`: the key was completed; this is its stored response.
#[derive(Debug, Serialize, ToSchema)]
pub struct CompletedView {
    /// Always `completed`.
    #[schema(example = "completed")]
    pub state: &'static str,
    /// The stored response.
    pub response: ResponseView,
    /// When it was stored.
    pub completed_at: Option<DateTime<Utc>>,
    /// When the key is forgotten.
    pub expires_at: DateTime<Utc>,
}

/// Body of `POST /v1/reservations/{id}/commit`: the response to store.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CommitBody {
    /// HTTP status (100..=599).
    pub status: u16,
    /// Header lines as `[name, value]` pairs.
    #[serde(default)]
    #[schema(value_type = Vec<Vec<String>>)]
    pub headers: Vec<(String, String)>,
    /// The body as text.
    pub body: Option<String>,
    /// The body as base64, for bytes that are not text.
    pub body_base64: Option<String>,
}

/// Body of `POST /v1/reservations/{id}/extend`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendBody {
    /// New lease, counted from now (default: the default lease).
    pub lease_seconds: Option<u32>,
}

/// `200` of extend.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExtendedView {
    /// The reservation.
    pub reservation_id: Uuid,
    /// The new end of the lease.
    pub lease_expires_at: DateTime<Utc>,
}

/// The public view of a record: never the raw key.
#[derive(Debug, Serialize, ToSchema)]
pub struct RecordView {
    /// The reservation id asked about.
    pub reservation_id: Uuid,
    /// True while this id holds a live reservation of the key.
    pub live: bool,
    /// `in_flight` or `completed`.
    pub state: KeyState,
    /// 1 for the first holder, more after takeovers.
    pub attempt: i32,
    /// The first 12 hex digits of SHA-256(key).
    pub key_hash_prefix: String,
    /// The request fingerprint, if known.
    pub fingerprint: Option<String>,
    /// When the current lease ends (in flight).
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The last recovery point.
    pub recovery: Option<Recovery>,
    /// The stored response (completed).
    pub response: Option<ResponseView>,
    /// When the key was first reserved.
    pub created_at: DateTime<Utc>,
    /// When the response was stored.
    pub completed_at: Option<DateTime<Utc>>,
    /// When the key is forgotten.
    pub expires_at: DateTime<Utc>,
}

// === handlers ===

/// Reserve an idempotency key before performing the side effect.
#[utoipa::path(
    post,
    path = "/v1/reservations",
    tag = "reservations",
    params(
        ("Idempotency-Key" = String, Header, description = "The key: an RFC 8941 sf-string (a bare token is accepted unless strict mode is on)."),
        ("Prefer" = Option<String>, Header, description = "`wait=N`: hold the request up to N seconds (capped) while another holder is in flight."),
    ),
    request_body(content = Option<ReserveBody>, content_type = "application/json"),
    responses(
        (status = 201, description = "Reserved: perform the effect, then commit.", body = ReservedView,
         headers(("Idempotency-Expires" = String, description = "HTTP-date until which the key is remembered"))),
        (status = 200, description = "Completed before: the stored response, replayed.", body = CompletedView,
         headers(("Idempotent-Replayed" = String), ("Idempotency-Expires" = String))),
        (status = 400, description = "key-missing, key-invalid or invalid-request", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "unauthorized", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "request-in-flight", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = u64))),
        (status = 413, description = "payload-too-large", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "key-reused: the key was used with another payload", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json"),
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
    let (metric, response) = match outcome {
        ReserveOutcome::Reserved(r) => {
            let metric = if r.attempt > 1 {
                Outcome::Takeover
            } else {
                Outcome::Created
            };
            let mut res = (
                StatusCode::CREATED,
                axum::Json(ReservedView {
                    state: "reserved",
                    reservation_id: r.reservation_id,
                    attempt: r.attempt,
                    lease_expires_at: r.lease_expires_at,
                    expires_at: r.expires_at,
                    recovery: r.recovery,
                }),
            )
                .into_response();
            set_expires(&mut res, r.expires_at);
            if let Ok(v) = HeaderValue::from_str(&format!("/v1/reservations/{}", r.reservation_id))
            {
                res.headers_mut().insert(header::LOCATION, v);
            }
            (metric, Ok(res))
        }
        ReserveOutcome::Completed(record) => {
            let mut res = completed_response(&record);
            res.headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            (Outcome::Replayed, Ok(res))
        }
        ReserveOutcome::InFlight { retry_after } => {
            (Outcome::Conflict, Err(ApiError::InFlight { retry_after }))
        }
        ReserveOutcome::Mismatch => (Outcome::Mismatch, Err(ApiError::KeyReused)),
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
         headers(("Idempotency-Expires" = String))),
        (status = 400, description = "invalid-request", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "unauthorized", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "not-found", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "lease-lost: this id no longer holds the key", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "payload-too-large", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json"),
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
        CommitOutcome::Refused(refusal) => Err(refused(refusal)),
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
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json"),
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
    state.engine.release(&tenant, id).await?.map_err(refused)?;
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
    request_body(content = Option<ExtendBody>, content_type = "application/json"),
    responses(
        (status = 200, description = "Extended.", body = ExtendedView),
        (status = 400, description = "invalid-request", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "unauthorized", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "not-found", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "lease-lost", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json"),
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
        .map_err(refused)?;
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
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json"),
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
    if body.recovery_point.is_empty() || body.recovery_point.len() > 255 {
        return Err(ApiError::InvalidRequest(
            "recovery_point must hold 1 to 255 bytes".into(),
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
        .checkpoint(&tenant, id, &body)
        .await?
        .map_err(refused)?;
    Ok(axum::Json(record_view(id, &record, true)))
}

/// The public view of the record a reservation belongs to.
#[utoipa::path(
    get,
    path = "/v1/reservations/{id}",
    tag = "reservations",
    params(("id" = Uuid, Path, description = "The reservation id")),
    responses(
        (status = 200, description = "The record.", body = RecordView),
        (status = 401, description = "unauthorized", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "not-found", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "store-unavailable", body = Problem, content_type = "application/problem+json"),
    ),
    security((), ("bearer" = []))
)]
pub async fn get_reservation(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<axum::Json<RecordView>> {
    let id = reservation_id(&id)?;
    let (record, refusal) = state
        .engine
        .get(&tenant, id)
        .await?
        .ok_or_else(|| refused(Refusal::NotFound))?;
    Ok(axum::Json(record_view(id, &record, refusal.is_none())))
}

// === helpers ===

static KEY_HEADER: HeaderName = HeaderName::from_static("idempotency-key");

fn reservation_id(raw: &str) -> Result<Uuid> {
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound(Refusal::NotFound.detail().into()))
}

fn refused(refusal: Refusal) -> ApiError {
    match refusal {
        Refusal::NotFound => ApiError::NotFound(refusal.detail().into()),
        other => ApiError::LeaseLost(other.detail()),
    }
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

/// `Prefer: wait=N` (RFC 7240), if the caller sent one.
pub fn prefer_wait(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split([',', ';']))
        .find_map(|pref| {
            let (name, value) = pref.split_once('=')?;
            name.trim()
                .eq_ignore_ascii_case("wait")
                .then(|| value.trim().trim_matches('"').parse::<u64>().ok())?
        })
        .map(Duration::from_secs)
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

fn response_view(response: &StoredResponse) -> ResponseView {
    let (body, body_base64) = match std::str::from_utf8(&response.body) {
        Ok(text) => (Some(text.to_owned()), None),
        Err(_) => (None, Some(BASE64.encode(&response.body))),
    };
    ResponseView {
        status: response.status,
        headers: response.headers.clone(),
        body,
        body_base64,
    }
}

fn completed_response(record: &Record) -> Response {
    let empty = StoredResponse {
        status: 0,
        headers: Vec::new(),
        body: Vec::new(),
    };
    let view = CompletedView {
        state: "completed",
        response: response_view(record.response.as_ref().unwrap_or(&empty)),
        completed_at: record.completed_at,
        expires_at: record.expires_at,
    };
    let mut res = (StatusCode::OK, axum::Json(view)).into_response();
    set_expires(&mut res, record.expires_at);
    res
}

fn record_view(id: Uuid, record: &Record, live: bool) -> RecordView {
    RecordView {
        reservation_id: id,
        live,
        state: record.state,
        attempt: record.attempt,
        key_hash_prefix: hex::encode(&record.key_hash[..6.min(record.key_hash.len())]),
        fingerprint: record.fingerprint.clone(),
        lease_expires_at: record.lease_expires_at,
        recovery: record.recovery.clone(),
        response: record.response.as_ref().map(response_view),
        created_at: record.created_at,
        completed_at: record.completed_at,
        expires_at: record.expires_at,
    }
}

/// `Idempotency-Expires`: an HTTP-date.
pub fn set_expires(res: &mut Response, expires_at: DateTime<Utc>) {
    let date = httpdate::fmt_http_date(std::time::SystemTime::from(expires_at));
    if let Ok(v) = HeaderValue::from_str(&date) {
        res.headers_mut().insert(IDEMPOTENCY_EXPIRES, v);
    }
}
