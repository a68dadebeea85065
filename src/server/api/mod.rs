//! The reservation/commit HTTP door: routes, state and the OpenAPI document.
//!
//! The reserve is [`reservations`], and what a holder calls after it is
//! `reservations::held`; the operators' endpoints are [`admin`], the ones that
//! need no token (health, metrics, the published policy) [`ops`]; [`extract`]
//! reads tokens and JSON bodies into problems, not axum's plain text; and
//! `/docs` is [`docs`], the API's page, beside [`docs_pages`], the pages of
//! `docs/`.

pub mod admin;
pub mod docs;
pub mod docs_pages;
pub mod extract;
pub mod ops;
mod problems;
pub mod reservations;

use std::ops::Deref;
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::engine::Engine;
use crate::fingerprint::FingerprintPolicy;
use crate::key::KeyPolicy;
use crate::problem;
use crate::server::auth::Tokens;
use crate::server::config::{AdminAccess, PolicyArgs};

/// Everything a handler needs, built once at start-up.
pub struct App {
    /// The idempotency engine (the proxy's admin listener shares the
    /// proxy's).
    pub engine: Arc<Engine>,
    /// Bearer tokens; empty means open, single-tenant.
    pub tokens: Tokens,
    /// Key rules.
    pub key_policy: KeyPolicy,
    /// Fingerprint rules.
    pub fingerprint_policy: FingerprintPolicy,
    /// Largest stored response body.
    pub max_body_bytes: usize,
    /// Methods the proxy and layer guard (published in the policy).
    pub methods: Vec<String>,
    /// Who may use the operators' endpoints.
    pub admin: AdminAccess,
    /// Whether a reservation must send `fingerprint` or `request`
    /// (`IDEMGATE_REQUIRE_FINGERPRINT`).
    pub require_fingerprint: bool,
}

/// The shared, cheap-to-clone application state.
#[derive(Clone)]
pub struct AppState(pub Arc<App>);

impl AppState {
    /// The API's state over `engine`, checking `tokens` (and `admin` on the
    /// operators' endpoints), with the key and fingerprint rules of `policy`
    /// and what it publishes; `require_fingerprint` refuses a reservation
    /// that does not describe its request.
    pub fn new(
        engine: Arc<Engine>,
        tokens: Tokens,
        admin: AdminAccess,
        policy: &PolicyArgs,
        require_fingerprint: bool,
    ) -> AppState {
        AppState(Arc::new(App {
            engine,
            tokens,
            admin,
            require_fingerprint,
            key_policy: policy.key_policy(),
            fingerprint_policy: policy.fingerprint_policy(),
            max_body_bytes: policy.max_body_bytes,
            methods: policy.methods.iter().map(ToString::to_string).collect(),
        }))
    }
}

impl Deref for AppState {
    type Target = App;

    fn deref(&self) -> &App {
        &self.0
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "idemgate",
        description = "Server-side HTTP idempotency keys (draft-ietf-httpapi-idempotency-key-header-07). \
            Reserve a key before a side effect and commit its response after it; retries get the stored \
            response (Idempotent-Replayed: true), a concurrent duplicate gets 409 request-in-flight, a key \
            reused with another payload gets 422 key-reused. Every reserve, replay and commit carries \
            Idempotency-Expires, the HTTP-date until which the key is remembered; GET /v1/policy publishes \
            the key format, lease and TTL bounds. Errors are application/problem+json whose type is \
            https://idemgate.dev/problems/<slug>.",
        license(name = "Apache-2.0")
    ),
    modifiers(&BearerAuth),
    // A query parameter's schema is not collected from its `IntoParams`
    // type: named here, so that its `$ref` resolves.
    components(schemas(crate::server::operations::list::StateFilter)),
    tags(
        (name = "reservations", description = "Reserve, commit, release, extend, checkpoint, mark unknown"),
        (name = "operations", description = "Health, readiness, metrics and the published policy"),
        (name = "admin", description = "Operators: list, show and resolve stuck keys (unknown, or in flight past their lease). Bearer tokens of IDEMGATE_ADMIN_TOKENS; with none set, only on a loopback listener."),
    )
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        if let Some(components) = openapi.components.as_mut() {
            components.add_security_scheme(
                "bearer",
                SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
            );
            let mut admin = Http::new(HttpAuthScheme::Bearer);
            admin.description =
                Some("A token of IDEMGATE_ADMIN_TOKENS (a tenant's token is not one).".to_owned());
            components.add_security_scheme("admin", SecurityScheme::Http(admin));
        }
    }
}

fn openapi_router() -> OpenApiRouter<AppState> {
    let mut router = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(reservations::create_reservation))
        .routes(routes!(reservations::held::get_reservation))
        .routes(routes!(reservations::held::commit_reservation))
        .routes(routes!(reservations::held::release_reservation))
        .routes(routes!(reservations::held::extend_reservation))
        .routes(routes!(reservations::held::checkpoint_reservation))
        .routes(routes!(reservations::held::mark_reservation_unknown))
        .routes(routes!(ops::get_policy))
        .routes(routes!(ops::get_healthz))
        .routes(routes!(ops::get_readyz))
        .routes(routes!(ops::get_metrics))
        .routes(routes!(admin::list_keys))
        .routes(routes!(admin::show_key))
        .routes(routes!(admin::resolve_key));
    // The handlers' paths are only in the document once routed, after the
    // `ApiDoc` modifiers have run.
    optional_bodies(router.get_openapi_mut());
    router
}

/// Declares each request body given as `Option<T>` as an optional body of
/// schema `T`, the way generators read one that may be left out.
///
/// utoipa renders `Option<T>` as a body of schema `oneOf [T, null]` with no
/// `required`: openapi-python-client then sends its "unset" marker as the
/// JSON body of a call that leaves the body out, and crashes. The server
/// reads an absent body, or `null`, as `{}` (see [`extract::ApiJson`]), so
/// leaving it out is what such a body means.
fn optional_bodies(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::schema::{Schema, SchemaType, Type};
    use utoipa::openapi::{RefOr, Required};

    for item in doc.paths.paths.values_mut() {
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ];
        for body in
            operations
                .into_iter()
                .flatten()
                .filter_map(|op| match op.request_body.as_mut() {
                    Some(RefOr::T(body)) => Some(body),
                    _ => None,
                })
        {
            let mut optional = false;
            for content in body.content.values_mut() {
                let RefOr::T(content) = content else { continue };
                let Some(RefOr::T(Schema::OneOf(one_of))) = &content.schema else {
                    continue;
                };
                if let [inner, RefOr::T(Schema::Object(null))] = one_of.items.as_slice()
                    && null.schema_type == SchemaType::Type(Type::Null)
                {
                    content.schema = Some(inner.clone());
                    optional = true;
                }
            }
            if optional {
                body.required = Some(Required::False);
            }
        }
    }
}

/// The OpenAPI document, as generated from the handlers.
pub fn openapi() -> utoipa::openapi::OpenApi {
    openapi_router().split_for_parts().1
}

/// The document as committed under `openapi/openapi.json`.
pub fn openapi_json() -> String {
    let mut text = openapi().to_pretty_json().unwrap_or_default();
    text.push('\n');
    text
}

/// The reservation API's router over `state`.
pub fn router(state: AppState) -> Router {
    // Counters recorded before the recorder exists would be lost.
    crate::server::exporter::metrics_handle();
    reservations::register_metrics();
    let (routes, api) = openapi_router().split_for_parts();
    // The JSON envelope of a stored body may be larger than the body itself
    // (base64, escapes); the exact limit is checked on the decoded bytes.
    let envelope_limit = state
        .max_body_bytes
        .saturating_mul(4)
        .saturating_add(64 * 1024);
    routes
        .route(
            "/openapi.json",
            axum::routing::get(move || std::future::ready(axum::Json(api.clone()))),
        )
        .merge(docs::router())
        .fallback(|| async { problem::ApiError::NotFound("no such endpoint; see /docs".into()) })
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(envelope_limit))
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                refuse_declared_oversize(req, next, envelope_limit)
            },
        ))
        .layer(axum::middleware::from_fn(
            |req: axum::extract::Request, next: axum::middleware::Next| {
                crate::server::otel::door_span("api", req, next)
            },
        ))
        .layer(crate::server::serve::trace_layer())
        .with_state(state)
}

/// A path that exists, asked with a method it does not take: a problem like
/// every other error (axum adds the `Allow` header).
async fn method_not_allowed(method: http::Method) -> problem::ApiError {
    problem::ApiError::MethodNotAllowed(format!(
        "this endpoint does not take {method}; the Allow header lists what it takes"
    ))
}

/// Answers `413 payload-too-large` at once when the declared
/// `Content-Length` is over `limit`: the body limit alone would only trip
/// after reading that much, and a client that declares a terabyte and sends
/// a byte would hold its request open until it gave up.
async fn refuse_declared_oversize(
    req: axum::extract::Request,
    next: axum::middleware::Next,
    limit: usize,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|len| len > u64::try_from(limit).unwrap_or(u64::MAX)) {
        return problem::ApiError::PayloadTooLarge(format!(
            "the declared Content-Length is over the limit of {limit} bytes"
        ))
        .into_response();
    }
    next.run(req).await
}

/// The operational endpoints alone — `/healthz`, `/readyz`, `/metrics`,
/// `/v1/policy` and the operators' `/v1/admin/keys…` — for the proxy's admin
/// listener, so that they never shadow an upstream path.
pub fn admin_router(state: AppState) -> Router {
    crate::server::exporter::metrics_handle();
    Router::new()
        .route("/healthz", axum::routing::get(ops::get_healthz))
        .route("/readyz", axum::routing::get(ops::get_readyz))
        .route("/metrics", axum::routing::get(ops::get_metrics))
        .route("/v1/policy", axum::routing::get(ops::get_policy))
        .route("/v1/admin/keys", axum::routing::get(admin::list_keys))
        .route(
            "/v1/admin/keys/{tenant}/{key_hash}",
            axum::routing::get(admin::show_key),
        )
        .route(
            "/v1/admin/keys/{tenant}/{key_hash}/resolve",
            axum::routing::post(admin::resolve_key),
        )
        .fallback(|| async {
            problem::ApiError::NotFound(
                "no such endpoint: the admin listener serves /healthz, /readyz, /metrics, \
                 /v1/policy and /v1/admin/keys"
                    .into(),
            )
        })
        .method_not_allowed_fallback(method_not_allowed)
        .layer(crate::server::serve::trace_layer())
        .with_state(state)
}
