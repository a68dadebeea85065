//! The problem responses several operations share, each described once for
//! the OpenAPI document (`responses(…, Unauthorized, StoreUnavailable)`).
//! The structs are never built: their field names the body's schema.
#![allow(dead_code)]

use utoipa::IntoResponses;

use crate::problem::Problem;
use crate::server::views::RetryAfterSeconds;

/// `400 invalid-request`.
#[derive(IntoResponses)]
#[response(
    status = 400,
    description = "invalid-request",
    content_type = "application/problem+json"
)]
pub struct InvalidRequest(Problem);

/// `401 unauthorized`.
#[derive(IntoResponses)]
#[response(
    status = 401,
    description = "unauthorized",
    content_type = "application/problem+json"
)]
pub struct Unauthorized(Problem);

/// `404 not-found`.
#[derive(IntoResponses)]
#[response(
    status = 404,
    description = "not-found",
    content_type = "application/problem+json"
)]
pub struct NotFound(Problem);

/// `409 lease-lost`.
#[derive(IntoResponses)]
#[response(
    status = 409,
    description = "lease-lost",
    content_type = "application/problem+json"
)]
pub struct LeaseLost(Problem);

/// `413 payload-too-large`.
#[derive(IntoResponses)]
#[response(
    status = 413,
    description = "payload-too-large",
    content_type = "application/problem+json"
)]
pub struct PayloadTooLarge(Problem);

/// `503 store-unavailable`, with `Retry-After`.
#[derive(IntoResponses)]
#[response(
    status = 503,
    description = "store-unavailable",
    content_type = "application/problem+json",
    headers(
        ("Retry-After" = inline(RetryAfterSeconds),
         description = "Whole seconds to wait before retrying (at least 1).")
    )
)]
pub struct StoreUnavailable(Problem);
