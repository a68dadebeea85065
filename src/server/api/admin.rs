//! The operators' endpoints: list, show and resolve stuck keys, on `serve`'s
//! listener and the proxy's admin listener, behind `IDEMGATE_ADMIN_TOKENS`.
//! The operations themselves are `crate::server::operations`, which the
//! `idemgate keys` command runs too.

use axum::extract::rejection::QueryRejection;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;

use super::AppState;
use super::extract::ApiJson;
use super::problems::{InvalidRequest, NotFound, StoreUnavailable};
use crate::problem::{ApiError, Problem, Result};
use crate::server::auth::{bearer_token, refuse_cross_site};
use crate::server::operations::{self, KeyList, KeyView, ListQuery, ResolveBody};

/// An operator: the name its token is recorded under.
#[derive(Debug, Clone)]
pub struct Operator(pub String);

impl FromRequestParts<AppState> for Operator {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        refuse_cross_site(&parts.headers)?;
        state
            .admin
            .authorize(|| {
                bearer_token(
                    &parts.headers,
                    "send one Authorization: Bearer <token> header, with a token of \
                     IDEMGATE_ADMIN_TOKENS",
                )
            })
            .map(Operator)
    }
}

/// `401 unauthorized`, `403 forbidden` or `403 admin-disabled`: no admin
/// token, a tenant's, or endpoints closed on this listener.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
enum Refused {
    #[response(
        status = 401,
        description = "unauthorized: no token, or not one of IDEMGATE_ADMIN_TOKENS",
        content_type = "application/problem+json"
    )]
    Unauthorized(Problem),
    #[response(
        status = 403,
        description = "forbidden: a tenant's token (always); admin-disabled: no IDEMGATE_ADMIN_TOKENS set on a server with tenant tokens, or on a listener that is not on loopback",
        content_type = "application/problem+json"
    )]
    Forbidden(Problem),
}

/// List keys, oldest first: by default every alive key; `state=unknown` is
/// the work queue of keys nobody will settle by themselves.
#[utoipa::path(
    get,
    path = "/v1/admin/keys",
    tag = "admin",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of keys; `next` is the cursor of the next page.", body = KeyList),
        InvalidRequest,
        Refused,
        StoreUnavailable,
    ),
    security((), ("admin" = []))
)]
pub async fn list_keys(
    State(state): State<AppState>,
    _operator: Operator,
    query: std::result::Result<Query<ListQuery>, QueryRejection>,
) -> Result<axum::Json<KeyList>> {
    let Query(query) = query.map_err(|e| ApiError::InvalidRequest(e.body_text()))?;
    Ok(axum::Json(operations::list(&state.engine, &query).await?))
}

/// Show one key.
#[utoipa::path(
    get,
    path = "/v1/admin/keys/{tenant}/{key_hash}",
    tag = "admin",
    params(
        ("tenant" = String, Path, description = "The key's tenant, as stored."),
        ("key_hash" = String, Path, description = "The lowercase hex SHA-256 of the key: all 64 digits, or a prefix of at least 8 that names one key of the tenant."),
    ),
    responses(
        (status = 200, description = "The key.", body = KeyView),
        InvalidRequest,
        Refused,
        NotFound,
        StoreUnavailable,
    ),
    security((), ("admin" = []))
)]
pub async fn show_key(
    State(state): State<AppState>,
    _operator: Operator,
    Path((tenant, key_hash)): Path<(String, String)>,
) -> Result<axum::Json<KeyView>> {
    let key_hash = operations::expand_key_hash(&state.engine, &tenant, &key_hash).await?;
    Ok(axum::Json(
        operations::show(&state.engine, &tenant, &key_hash).await?,
    ))
}

/// Settle a stuck key: `release` (nothing happened: the next request with
/// it executes) or `complete` with the response that really happened (every
/// retry replays it). The reason, the time and the operator are kept with
/// the record and logged.
#[utoipa::path(
    post,
    path = "/v1/admin/keys/{tenant}/{key_hash}/resolve",
    tag = "admin",
    params(
        ("tenant" = String, Path, description = "The key's tenant, as stored."),
        ("key_hash" = String, Path, description = "The lowercase hex SHA-256 of the key: all 64 digits, or a prefix of at least 8 that names one key of the tenant."),
    ),
    request_body(content = ResolveBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Settled: the key as it now is.", body = KeyView),
        InvalidRequest,
        Refused,
        NotFound,
        (status = 409, description = "key-not-stuck: the key is completed, or in flight under a live lease; only an unknown key or one in flight past its lease can be resolved", body = Problem, content_type = "application/problem+json"),
        StoreUnavailable,
    ),
    security((), ("admin" = []))
)]
pub async fn resolve_key(
    State(state): State<AppState>,
    Operator(by): Operator,
    Path((tenant, key_hash)): Path<(String, String)>,
    ApiJson(body): ApiJson<ResolveBody>,
) -> Result<axum::Json<KeyView>> {
    let key_hash = operations::expand_key_hash(&state.engine, &tenant, &key_hash).await?;
    let view = operations::resolve(
        &state.engine,
        &tenant,
        &key_hash,
        body,
        &by,
        state.max_body_bytes,
    )
    .await?;
    Ok(axum::Json(view))
}
