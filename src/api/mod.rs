//! The reservation/commit HTTP door (SPEC §5): routes, state, the OpenAPI
//! document, and serving with graceful shutdown.

mod conn;
pub mod docs;
pub mod extract;
pub mod ops;
pub mod problem;
pub mod reservations;
pub mod views;

use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use tokio::net::TcpListener;
use tower_http::classify::{ServerErrorsAsFailures, SharedClassifier};
use tower_http::timeout::TimeoutBody;
use tower_http::trace::{DefaultOnFailure, TraceLayer};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

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
    let mut router = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(reservations::create_reservation))
        .routes(routes!(reservations::get_reservation))
        .routes(routes!(reservations::commit_reservation))
        .routes(routes!(reservations::release_reservation))
        .routes(routes!(reservations::extend_reservation))
        .routes(routes!(reservations::checkpoint_reservation))
        .routes(routes!(ops::get_policy))
        .routes(routes!(ops::get_healthz))
        .routes(routes!(ops::get_readyz))
        .routes(routes!(ops::get_metrics));
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
    crate::telemetry::metrics_handle();
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
        .layer(trace_layer())
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
        .method_not_allowed_fallback(method_not_allowed)
        .layer(trace_layer())
        .with_state(state)
}

/// How a listener treats its connections.
#[derive(Debug, Clone, Copy)]
pub struct Serving {
    /// How long in-flight requests get to finish after the shutdown signal.
    pub grace: Duration,
    /// How long a client has to send a request's headers (a slower one's
    /// connection is closed), and at most between two pieces of its body (a
    /// slower one gets `408 request-timeout`): slow clients cannot hold
    /// connections open. A fresh connection's clock starts at the accept, a
    /// kept-alive one's at the first byte of its next request.
    pub header_read_timeout: Duration,
    /// How long a connection may wait idle, its last response sent, for its
    /// next request before it is closed.
    pub keep_alive_timeout: Duration,
}

/// Request tracing for every listener. A 5xx is logged at WARN, not
/// tower-http's ERROR: the error itself is logged where it happens (a 500 at
/// ERROR with its cause, a lost upstream or store at WARN), and during an
/// outage every request, and every `/readyz` probe, is a 503.
pub fn trace_layer() -> TraceLayer<SharedClassifier<ServerErrorsAsFailures>> {
    TraceLayer::new_for_http().on_failure(DefaultOnFailure::new().level(tracing::Level::WARN))
}

/// Request extension: the longest a body read whole may go without a piece
/// arriving. It is not put on every body, because a wrapped body no longer
/// says that it is empty or how long it is, and a request passed through to
/// the upstream would then go out chunked.
#[derive(Debug, Clone, Copy)]
pub struct BodyIdleTimeout(pub Duration);

impl BodyIdleTimeout {
    /// `body`, failing with a timeout once no piece of it has come for the
    /// duration in `extensions` (unchanged where there is none).
    pub fn apply(extensions: &http::Extensions, body: axum::body::Body) -> axum::body::Body {
        match extensions.get::<BodyIdleTimeout>() {
            Some(BodyIdleTimeout(idle)) => axum::body::Body::new(TimeoutBody::new(*idle, body)),
            None => body,
        }
    }
}

/// Largest request head (request line and headers) a client may send; a
/// bigger one is answered `431 Request Header Fields Too Large`.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Serves `app` on `listener` until `shutdown` resolves; then closes the
/// listener at once, lets in-flight requests finish for up to `grace`, and
/// returns.
///
/// hyper's connection builder is used directly rather than `axum::serve`,
/// which has no timeouts, so that a client that trickles its headers cannot
/// hold its connection for ever. Those timers are ours (`conn`), not
/// hyper's: hyper's header read timeout also runs while a kept-alive
/// connection waits for its next request, and so closed every idle
/// connection after it.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    serving: Serving,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    // Off: `conn` times heads and idle connections apart.
    http.header_read_timeout(None)
        .max_header_size(MAX_HEAD_BYTES);
    let timeouts = conn::Timeouts {
        header_read: serving.header_read_timeout,
        keep_alive: serving.keep_alive_timeout,
    };
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: say so, breathe,
                    // go on serving the connections already open.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        // The peer address goes into every request (ConnectInfo): the proxy
        // forwards it as X-Forwarded-For. Whoever reads a body whole reads it
        // under the idle timeout (`BodyIdleTimeout`). The connection is busy
        // from the service call until hyper drops the response body, and
        // only then does its keep-alive clock start.
        let idle = BodyIdleTimeout(serving.header_read_timeout);
        let tracker = conn::Tracker::new();
        let io = conn::TimedIo::new(stream, tracker.clone(), timeouts);
        let app = app.clone();
        let service = tower::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            let busy = tracker.request();
            req.extensions_mut()
                .insert(axum::extract::ConnectInfo(peer));
            req.extensions_mut().insert(idle);
            let call = tower::ServiceExt::oneshot(app.clone(), req.map(axum::body::Body::new));
            async move {
                let res = call.await?;
                Ok::<_, std::convert::Infallible>(
                    res.map(|body| conn::TrackedBody::new(body, busy)),
                )
            }
        });
        let conn = http.serve_connection(
            hyper_util::rt::TokioIo::new(io),
            hyper_util::service::TowerToHyperService::new(service),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    tracing::info!(
        grace_seconds = serving.grace.as_secs(),
        "shutting down: finishing in-flight requests"
    );
    if tokio::time::timeout(serving.grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("shutdown grace elapsed with requests still running");
    }
    Ok(())
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
