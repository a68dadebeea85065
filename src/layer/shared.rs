//! What every clone of the layer's service shares, and the shape of the
//! inner service a request is handed to.

use axum::body::Body;
use axum::response::Response;
use futures::future::BoxFuture;
use http::Request;
use std::sync::Arc;
use tower::BoxError;

use super::deferred::Deferred;
use super::policy::LayerPolicy;
use crate::engine::Engine;
use crate::telemetry;

/// The inner service, polled ready, waiting for its one request.
pub(crate) type Inner =
    Box<dyn FnOnce(Request<Body>) -> BoxFuture<'static, Result<Response, BoxError>> + Send>;

/// The engine, the policy, and the count of work that outlives its client's
/// answer.
pub(crate) struct Shared {
    pub engine: Arc<Engine>,
    pub policy: LayerPolicy,
    pub deferred: Deferred,
    /// Whether the anonymous tenant's WARN about a request with a `Cookie`
    /// was said.
    pub anonymous_cookie_warned: std::sync::atomic::AtomicBool,
}

impl Shared {
    pub(crate) fn new(engine: Arc<Engine>, policy: LayerPolicy) -> Arc<Shared> {
        // Every series of this door, at 0 from the start (with whatever
        // metrics recorder the application installed).
        telemetry::register_door(policy.door.as_str(), &telemetry::Outcome::ALL);
        Arc::new(Shared {
            engine,
            policy,
            deferred: Deferred::default(),
            anonymous_cookie_warned: std::sync::atomic::AtomicBool::new(false),
        })
    }
}
