//! The reservation API's own extractors: JSON bodies and bearer-token tenants
//! whose rejections are problem+json, never axum's plain text.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::AppState;
use crate::problem::ApiError;
use crate::server::auth::bearer_token;

/// A JSON body. An empty body reads as `{}`, so a reservation needs no body
/// at all; the `Content-Type` is not insisted on, so `curl -d` works as is.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let (parts, body) = req.into_parts();
        let body = crate::body::BodyIdleTimeout::apply(&parts.extensions, body);
        let bytes = Bytes::from_request(Request::from_parts(parts, body), state)
            .await
            .map_err(|e: BytesRejection| {
                if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::PayloadTooLarge("the request body is over the limit".into())
                } else if crate::body::timed_out(&e) {
                    crate::problem::body_timeout()
                } else {
                    ApiError::InvalidRequest(format!("could not read the request body: {e}"))
                }
            })?;
        // No body, or a JSON `null`, means "no fields": every field of these
        // bodies is optional or checked by its handler.
        // Every body here is an object. serde would also read a struct from
        // an array of its fields in order, which the document does not allow.
        let text: &[u8] = match bytes.trim_ascii() {
            b"" | b"null" => b"{}",
            [b'{', ..] => &bytes,
            _ => {
                return Err(ApiError::InvalidRequest(
                    "the request body must be a JSON object".into(),
                ));
            }
        };
        let mut json = serde_json::Deserializer::from_slice(text);
        serde_path_to_error::deserialize(&mut json)
            .map(ApiJson)
            .map_err(|e| ApiError::InvalidRequest(body_error(&e)))
    }
}

/// A body's error in words that name the field it is in (`body`, or
/// `request.method`), where it is in one.
fn body_error(e: &serde_path_to_error::Error<serde_json::Error>) -> String {
    let inner = e.inner();
    let path = e.path().to_string();
    if path.is_empty() || path == "." {
        return format!("invalid JSON body: {inner}");
    }
    let hint = if path == "body" && inner.to_string().contains("expected a string") {
        ": a body is stored as text, so send a JSON answer as its text (\"body\": \
         \"{\\\"id\\\":1}\"), or bytes as body_base64"
    } else {
        ""
    };
    format!("invalid JSON body: the field `{path}`: {inner}{hint}")
}

/// The tenant a request acts for: the one its bearer token belongs to.
#[derive(Debug, Clone)]
pub struct Tenant(pub String);

/// The tenant of an open, single-tenant server.
pub const DEFAULT_TENANT: &str = "default";

impl FromRequestParts<AppState> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let tokens = &state.tokens;
        if tokens.is_empty() {
            return Ok(Tenant(DEFAULT_TENANT.into()));
        }
        let token = bearer_token(
            &parts.headers,
            "send one Authorization: Bearer <token> header",
        )?;
        // The tenant's name, as the logs show it (never the token).
        tokens
            .tenant_for(token)
            .inspect(|t| crate::spans::record_request(None, None, Some(t)))
            .map(|t| Tenant(t.to_owned()))
            .ok_or(ApiError::Unauthorized("the bearer token is not valid"))
    }
}
