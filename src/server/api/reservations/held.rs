//! What a reservation's holder calls after reserving: commit, release,
//! extend, checkpoint, mark unknown, and the lookup of a reservation by its
//! id.

use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::{MODE, bounded, reservation_id};
use crate::engine::{Committed, Lookup, Refusal};
use crate::problem::{ApiError, Problem, Result};
use crate::server::api::AppState;
use crate::server::api::extract::{ApiJson, Tenant};
use crate::server::api::problems::{
    InvalidRequest, LeaseLost, NotFound, PayloadTooLarge, StoreUnavailable, Unauthorized,
};
use crate::server::views::Recovery;
use crate::server::views::{
    CommitBody, CompletedView, ExtendBody, ExtendedView, RecordView, UnknownBody,
    completed_response, record_view, stored_response,
};
use crate::telemetry::{self, Outcome};

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
        InvalidRequest,
        Unauthorized,
        NotFound,
        (status = 409, description = "lease-lost: this id no longer holds the key", body = Problem, content_type = "application/problem+json"),
        PayloadTooLarge,
        StoreUnavailable,
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
        Ok(Committed::Now(record)) | Ok(Committed::Earlier(record)) => {
            tracing::info!(tenant.id = %tenant, reservation.id = %id, "commit");
            Ok(completed_response(&record))
        }
        Err(refusal) => Err(ApiError::from(refusal)),
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
        Unauthorized,
        NotFound,
        LeaseLost,
        StoreUnavailable,
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
        InvalidRequest,
        Unauthorized,
        NotFound,
        LeaseLost,
        StoreUnavailable,
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
        InvalidRequest,
        Unauthorized,
        NotFound,
        LeaseLost,
        PayloadTooLarge,
        StoreUnavailable,
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
    Ok(axum::Json(record_view(
        id,
        &record,
        true,
        chrono::Utc::now(),
    )))
}

/// The longest reason a holder's mark keeps, as an operator's resolve.
const MAX_UNKNOWN_REASON: usize = 1000;

/// Mark the key unknown: the holder cannot tell whether its effect happened
/// (its call to a provider timed out after sending). The key is held for an
/// operator at once, whatever its `on_lease_expiry`, instead of waiting out
/// its lease: every request with it gets `409 outcome-unknown` until this
/// holder's own late commit or release, or an operator, settles it. Marking
/// a key this id marked already is `200` again (its first reason stays).
#[utoipa::path(
    post,
    path = "/v1/reservations/{id}/unknown",
    tag = "reservations",
    params(("id" = Uuid, Path, description = "The reservation id")),
    request_body(content = UnknownBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Marked unknown: the record, with the reason.", body = RecordView),
        InvalidRequest,
        Unauthorized,
        NotFound,
        LeaseLost,
        StoreUnavailable,
    ),
    security((), ("bearer" = []))
)]
pub async fn mark_reservation_unknown(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<UnknownBody>,
) -> Result<axum::Json<RecordView>> {
    let id = reservation_id(&id)?;
    let reason = body.reason.trim();
    if reason.is_empty() || reason.chars().count() > MAX_UNKNOWN_REASON {
        return Err(ApiError::InvalidRequest(format!(
            "reason must hold 1 to {MAX_UNKNOWN_REASON} characters: what failed, so that an \
             operator can settle the key"
        )));
    }
    state
        .engine
        .mark_unknown(&tenant, id, reason)
        .await?
        .map_err(ApiError::from)?;
    tracing::warn!(
        tenant.id = %tenant,
        reservation.id = %id,
        "marked unknown by its holder: every request with the key gets 409 outcome-unknown until \
         it is settled"
    );
    match state.engine.get(&tenant, id).await? {
        Some(Lookup::Record { record, live, now }) => {
            Ok(axum::Json(record_view(id, &record, live, now)))
        }
        // Settled (released, or its key expired) between the two calls.
        None | Some(Lookup::Gone) => Err(ApiError::from(Refusal::Expired)),
    }
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
        Unauthorized,
        NotFound,
        (status = 410, description = "reservation-gone", body = Problem, content_type = "application/problem+json"),
        StoreUnavailable,
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
        Some(Lookup::Record { record, live, now }) => {
            Ok(axum::Json(record_view(id, &record, live, now)))
        }
    }
}
