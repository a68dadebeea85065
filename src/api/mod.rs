//! The reservation/commit HTTP door (SPEC §5): routes, state, the OpenAPI
//! document, and serving with graceful shutdown.

pub mod extract;
pub mod ops;
pub mod problem;
pub mod reservations;
pub mod views;

use std::future::Future;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use tokio::net::TcpListener;
use tower_http::trace::TraceLayer;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use utoipa_scalar::{Scalar, Servable};

use crate::config::Tokens;
use crate::engine::Engine;
use crate::fingerprint::FingerprintPolicy;
use crate::key::KeyPolicy;

/// Everything a handler needs, built once at start-up.
pub struct App {
    /// The idempotency engine.
    pub engine: Engine,
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
}

/// The shared, cheap-to-clone application state.
#[derive(Clone)]
pub struct AppState(pub Arc<App>);

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
    tags(
        (name = "reservations", description = "Reserve, commit, release, extend, checkpoint"),
        (name = "operations", description = "Health, readiness, metrics and the published policy"),
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
        }
    }
}

fn openapi_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(reservations::create_reservation))
        .routes(routes!(reservations::get_reservation))
        .routes(routes!(reservations::commit_reservation))
        .routes(routes!(reservations::release_reservation))
        .routes(routes!(reservations::extend_reservation))
        .routes(routes!(reservations::checkpoint_reservation))
        .routes(routes!(ops::get_policy))
        .routes(routes!(ops::get_healthz))
        .routes(routes!(ops::get_readyz))
        .routes(routes!(ops::get_metrics))
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
    crate::telemetry::metrics_handle();
    let (routes, api) = openapi_router().split_for_parts();
    // The JSON envelope of a stored body may be larger than the body itself
    // (base64, escapes); the exact limit is checked on the decoded bytes.
    let envelope_limit = state
        .max_body_bytes
        .saturating_mul(4)
        .saturating_add(64 * 1024);
    let doc = api.clone();
    routes
        .route(
            "/openapi.json",
            axum::routing::get(move || std::future::ready(axum::Json(doc.clone()))),
        )
        .merge(Scalar::with_url("/docs", api))
        .fallback(|| async { problem::ApiError::NotFound("no such endpoint; see /docs".into()) })
        .layer(DefaultBodyLimit::max(envelope_limit))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// The operational endpoints alone — `/healthz`, `/readyz`, `/metrics` and
/// `/v1/policy` — for the proxy's admin listener, so that they never shadow
/// an upstream path.
pub fn admin_router(state: AppState) -> Router {
    crate::telemetry::metrics_handle();
    Router::new()
        .route("/healthz", axum::routing::get(ops::get_healthz))
        .route("/readyz", axum::routing::get(ops::get_readyz))
        .route("/metrics", axum::routing::get(ops::get_metrics))
        .route("/v1/policy", axum::routing::get(ops::get_policy))
        .fallback(|| async {
            problem::ApiError::NotFound(
                "no such endpoint: the admin listener serves /healthz, /readyz, /metrics and /v1/policy"
                    .into(),
            )
        })
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting,
/// lets in-flight requests finish for up to `grace`, and returns.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    grace: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    // The peer address goes into every request (ConnectInfo): the proxy
    // forwards it as X-Forwarded-For.
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let mut rx = rx;
        let _ = rx.wait_for(|stop| *stop).await;
    });
    let server = std::pin::pin!(server.into_future());
    let shutdown = std::pin::pin!(shutdown);
    let mut server = server;
    tokio::select! {
        res = &mut server => return res,
        () = shutdown => {}
    }
    tracing::info!(
        grace_seconds = grace.as_secs(),
        "shutting down: finishing in-flight requests"
    );
    let _ = tx.send(true);
    match tokio::time::timeout(grace, server).await {
        Ok(res) => res,
        Err(_) => {
            tracing::warn!("shutdown grace elapsed with requests still running");
            Ok(())
        }
    }
}

/// Resolves on SIGTERM or ctrl-c.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
