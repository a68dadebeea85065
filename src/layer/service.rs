//! [`Idempotency`]: the service half of the middleware.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use http::{Request, Response};
use tower::{BoxError, Service};

use super::flow;
use super::future::ResponseFuture;
use super::policy::LayerPolicy;
use super::shared::{Inner, Shared};
use crate::engine::Engine;
use crate::problem::ApiError;

/// Guards `S`: a guarded request with a key executes at most once; its
/// retries get the stored response.
///
/// It never fails: every refusal is a problem+json response, and an error of
/// `S` becomes a `500 internal`.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    shared: Arc<Shared>,
    /// Why the inner service refused readiness, answered on the next call.
    broken: Option<String>,
}

// === impl Idempotency ===

impl<S> Idempotency<S> {
    /// Wraps `inner`, deciding through `engine` under `policy`.
    pub fn new(inner: S, engine: Arc<Engine>, policy: LayerPolicy) -> Idempotency<S> {
        Idempotency::from_shared(inner, Shared::new(engine, policy))
    }

    pub(crate) fn from_shared(inner: S, shared: Arc<Shared>) -> Idempotency<S> {
        Idempotency {
            inner,
            shared,
            broken: None,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The policy it enforces.
    pub fn policy(&self) -> &LayerPolicy {
        &self.shared.policy
    }
}

impl<S, B> Service<Request<Body>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = axum::body::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match self.inner.poll_ready(cx) {
            Poll::Ready(Err(e)) => {
                // Responses, not errors: the next call answers 500.
                self.broken = Some(e.into().to_string());
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        if let Some(why) = self.broken.take() {
            let res = ApiError::Internal(format!("the inner service is not ready: {why}"));
            return ResponseFuture::ready(self.shared.policy.problem(res));
        }
        // The clone-in-call pattern: the service that was polled ready is the
        // one that takes the request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let send: Inner = Box::new(move |req| {
            let fut = inner.call(req);
            Box::pin(async move {
                match fut.await {
                    Ok(res) => Ok(res.map(Body::new)),
                    Err(e) => Err(e.into()),
                }
            })
        });
        ResponseFuture::new(flow::handle(self.shared.clone(), send, req))
    }
}

impl<S> std::fmt::Debug for Idempotency<S>
where
    S: std::fmt::Debug,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("policy", &self.shared.policy)
            .finish_non_exhaustive()
    }
}
