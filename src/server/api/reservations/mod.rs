//! The reservation/commit API: a backend reserves a key before its
//! side effect and commits the result after it.

use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use uuid::Uuid;

pub mod held;

use super::AppState;
use super::extract::{ApiJson, Tenant};
use super::problems::{PayloadTooLarge, StoreUnavailable, Unauthorized};
use crate::admission::{self, NotAdmitted};
use crate::engine::{Refusal, ReserveOutcome, ReserveRequest};
use crate::fingerprint;
use crate::headers::{mark_replayed, prefer_wait, set_expires, set_repeatability_result};
use crate::key::Dialect;
use crate::problem::{ApiError, Problem, Result};
use crate::server::views::Recovery;
use crate::server::views::{
    CompletedView, RepeatabilityResult, Replayed, RequestDescription, ReserveBody, ReservedState,
    ReservedView, RetryAfterSeconds, completed_response,
};
use crate::store::ClaimedRequest;
use crate::telemetry::{self, Outcome};

static KEY_HEADER: HeaderName = HeaderName::from_static("idempotency-key");

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
        ("Idempotency-First-Sent" = Option<String>, Header, description = "HTTP-date at which the request's first attempt was sent. A request first sent longer ago than its key would be remembered (the TTL, less a minute's allowance for clock skew) is refused with 412 `first-sent-too-old`: its key may have expired, so it is not reserved afresh."),
        ("Repeatability-Request-ID" = Option<String>, Header, description = "OASIS Repeatable Requests 1.0, when the server takes it (`IDEMGATE_REPEATABILITY`): the request's id, sent instead of `Idempotency-Key` (visible ASCII, the key's length and format rules). Needs `Repeatability-First-Sent`; answered with `Repeatability-Result`."),
        ("Repeatability-First-Sent" = Option<String>, Header, description = "With `Repeatability-Request-ID`: the IMF-fixdate at which the request was first sent; too old is 412 `first-sent-too-old`."),
        ("Repeatability-Client-ID" = Option<String>, Header, description = "With `Repeatability-Request-ID`: the client the request id is unique within (it scopes the id)."),
    ),
    request_body(content = Option<ReserveBody>, content_type = "application/json",
        description = "Optional: no body, or `null`, is `{}` (every field takes its default). A server that requires fingerprints (`fingerprint.required` in `GET /v1/policy`) refuses a reservation without `fingerprint` or `request` with 400 invalid-request."),
    responses(
        (status = 201, description = "Reserved: perform the effect, then commit.", body = ReservedView,
         headers(
            ("Idempotency-Expires" = String, description = "HTTP-date until which the key is remembered."),
            ("Location" = String, description = "`/v1/reservations/{id}`: the reservation's record."),
            ("Repeatability-Result" = inline(RepeatabilityResult), description = "To a `Repeatability-Request-ID` request only."),
         )),
        (status = 200, description = "Completed before: the stored response, replayed.", body = CompletedView,
         headers(
            ("Idempotent-Replayed" = inline(Replayed), description = "Always `true`: the answer is the stored response, and nothing was reserved."),
            ("Idempotency-Expires" = String, description = "HTTP-date until which the key is remembered."),
            ("Repeatability-Result" = inline(RepeatabilityResult), description = "To a `Repeatability-Request-ID` request only."),
         )),
        (status = 400, description = "key-missing, key-invalid or invalid-request", body = Problem, content_type = "application/problem+json",
         headers(("Repeatability-Result" = inline(RepeatabilityResult), description = "To a `Repeatability-Request-ID` request only."))),
        Unauthorized,
        (status = 409, description = "request-in-flight: another holder's lease is alive (with Retry-After); or outcome-unknown: whether the key's effect happened is unknown (its holder marked it so, or its lease ended under `hold`), and it is not run again until its holder's late commit or release, or an operator, settles it (no Retry-After: waiting will not settle it)", body = Problem, content_type = "application/problem+json",
         headers(
            ("Retry-After" = inline(RetryAfterSeconds), description = "request-in-flight only: whole seconds until the holder has likely finished (at least 1, never past its lease)."),
            ("Repeatability-Result" = inline(RepeatabilityResult), description = "To a `Repeatability-Request-ID` request only."),
         )),
        (status = 412, description = "first-sent-too-old: the request's first attempt is older than its key would be remembered; nothing was reserved", body = Problem, content_type = "application/problem+json",
         headers(("Repeatability-Result" = inline(RepeatabilityResult), description = "To a `Repeatability-Request-ID` request only."))),
        PayloadTooLarge,
        (status = 422, description = "key-reused: the key was used with another payload", body = Problem, content_type = "application/problem+json",
         headers(("Repeatability-Result" = inline(RepeatabilityResult), description = "To a `Repeatability-Request-ID` request only."))),
        (status = 429, description = "tenant-limit: the tenant holds as many keys in flight, or as many stored bytes, as it may; nothing was reserved", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = inline(RetryAfterSeconds), description = "Whole seconds until room is likely (at least 1)."))),
        StoreUnavailable,
    ),
    security((), ("bearer" = []))
)]
pub async fn create_reservation(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    headers: HeaderMap,
    body: std::result::Result<ApiJson<ReserveBody>, ApiError>,
) -> Response {
    let dialect = Dialect::of(&headers, &state.key_policy);
    let started = Instant::now();
    let (outcome, counted, mut res) = match reserve(&state, tenant, &headers, body, dialect).await {
        Ok((outcome, res)) => (Some(outcome), Some(outcome), res),
        // A body or field it cannot take (400 invalid-request) is counted as
        // `invalid`, the outcome of a malformed request (docs/operations.md,
        // “Metrics”), like a malformed key; its Repeatability-Result stays unset. A store that cannot
        // answer is no outcome of the request's.
        Err(Unreserved { outcome, error }) => {
            let counted = outcome.or_else(|| {
                matches!(error, ApiError::InvalidRequest(_)).then_some(Outcome::Invalid)
            });
            (outcome, counted, error.into_response())
        }
    };
    if let Some(counted) = counted {
        telemetry::record(MODE, counted, started.elapsed());
    }
    let result = outcome.and_then(Outcome::repeatability_result);
    set_repeatability_result(res.headers_mut(), dialect, result);
    res
}

/// A reservation not made: the outcome it came to, where it came to one
/// (a refused key, a key reused, a tenant over its limit), and the problem
/// answered.
struct Unreserved {
    outcome: Option<Outcome>,
    error: ApiError,
}

impl From<ApiError> for Unreserved {
    fn from(error: ApiError) -> Self {
        Unreserved {
            outcome: None,
            error,
        }
    }
}

impl From<NotAdmitted> for Unreserved {
    fn from(refusal: NotAdmitted) -> Self {
        Unreserved {
            outcome: Some(refusal.outcome()),
            error: refusal.into_problem(),
        }
    }
}

impl From<crate::store::StoreError> for Unreserved {
    fn from(e: crate::store::StoreError) -> Self {
        ApiError::from(e).into()
    }
}

/// The reservation, and the outcome it came to.
async fn reserve(
    state: &AppState,
    tenant: String,
    headers: &HeaderMap,
    body: std::result::Result<ApiJson<ReserveBody>, ApiError>,
    dialect: Dialect,
) -> std::result::Result<(Outcome, Response), Unreserved> {
    let keyed = admission::read_key(headers, &KEY_HEADER, &state.key_policy, dialect)?;
    let key = &keyed.key;
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
    // What the key is for, kept with its record for an operator: the
    // request the reserve described, and the trace it came in.
    // With the caller's label, kept the same way even where no request was
    // described.
    let label = label(body.label)?;
    let traceparent = headers.get("traceparent").and_then(|v| v.to_str().ok());
    let claimed = match (&body.request, label) {
        (Some(r), label) => {
            Some(ClaimedRequest::new(&r.method, &r.path, traceparent).labelled(label))
        }
        (None, Some(label)) => Some(ClaimedRequest::new("", "", traceparent).labelled(Some(label))),
        (None, None) => None,
    };
    let fingerprint = match (body.fingerprint, body.request) {
        (Some(_), Some(_)) => {
            return Err(ApiError::InvalidRequest(
                "send either fingerprint or request, not both".into(),
            )
            .into());
        }
        (Some(fp), None) => {
            if fp.is_empty() || fp.chars().count() > MAX_FINGERPRINT_LEN {
                return Err(ApiError::InvalidRequest(format!(
                    "fingerprint must hold 1 to {MAX_FINGERPRINT_LEN} characters"
                ))
                .into());
            }
            Some(fp)
        }
        (None, Some(req)) => Some(fingerprint_of(&req, state)?),
        (None, None) if state.require_fingerprint => {
            return Err(ApiError::InvalidRequest(
                "this server requires every reservation to describe its request \
                 (IDEMGATE_REQUIRE_FINGERPRINT=true): send `request` ({\"method\", \"path\", \
                 \"body\"}, fingerprinted here) or `fingerprint` (one you computed, at most 512 \
                 characters), so that the key reused with another payload is refused (422 \
                 key-reused) rather than replayed"
                    .into(),
            )
            .into());
        }
        (None, None) => None,
    };
    admission::check_first_sent(&keyed, Duration::from_secs(u64::from(ttl_seconds)))?;
    let wait = prefer_wait(headers);
    let decision = state
        .engine
        .reserve(&ReserveRequest {
            tenant: tenant.clone(),
            // A name from the token settings, not a credential.
            tenant_from_credential: false,
            key_hash: key.hash(),
            fingerprint,
            lease_seconds,
            ttl_seconds,
            wait,
            on_lease_expiry: body
                .on_lease_expiry
                .map_or(crate::store::LeaseExpiry::Takeover, Into::into),
            request: claimed,
        })
        .await?;
    let outcome = decision.outcome();
    let res = match decision {
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
            res
        }
        ReserveOutcome::Completed(record) => {
            let mut res = completed_response(&record);
            mark_replayed(res.headers_mut());
            res
        }
        refused => ApiError::refusing(&refused)
            .unwrap_or_else(|| ApiError::Internal("a decision without an answer".into()))
            .into_response(),
    };
    tracing::info!(
        tenant.id = %tenant,
        key.hash = %key.hash_prefix(),
        outcome = outcome.as_str(),
        "reserve"
    );
    Ok((outcome, res))
}

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

/// The caller's label as kept: none for an empty one; refused (naming the
/// field) when it is longer than the SPEC allows or holds a character that
/// would rewrite what an operator's terminal or page shows around it (a
/// control character, or a bidirectional override or isolate).
fn label(given: Option<String>) -> Result<Option<String>> {
    let Some(label) = given.filter(|l| !l.is_empty()) else {
        return Ok(None);
    };
    let max = ClaimedRequest::MAX_LABEL_CHARS;
    let chars = label.chars().count();
    if chars > max {
        return Err(ApiError::InvalidRequest(format!(
            "label holds {chars} characters; it may hold at most {max} (an order id, a job name)"
        )));
    }
    if let Some(c) = label
        .chars()
        .find(|&c| c.is_control() || is_bidi_control(c))
    {
        return Err(ApiError::InvalidRequest(format!(
            "label holds the character U+{:04X}; a label is shown to operators as it is, so \
             control characters and bidirectional overrides are refused",
            u32::from(c)
        )));
    }
    Ok(Some(label))
}

/// The characters that reorder the text around them (Unicode's explicit
/// bidirectional formatting characters).
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{061C}')
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
