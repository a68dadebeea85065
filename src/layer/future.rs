//! [`ResponseFuture`]: what [`Idempotency`](super::Idempotency) returns.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::Response;
use futures::future::BoxFuture;

/// The response of an [`Idempotency`](super::Idempotency) service; it never
/// fails.
///
/// Dropping it (a client that hangs up) does not cancel the inner service's
/// call once the key is reserved: that runs in a task of its own, so its
/// response is stored for the retry.
pub struct ResponseFuture {
    inner: BoxFuture<'static, Response>,
}

// === impl ResponseFuture ===

impl ResponseFuture {
    pub(crate) fn new(fut: impl Future<Output = Response> + Send + 'static) -> ResponseFuture {
        ResponseFuture {
            inner: Box::pin(fut),
        }
    }

    pub(crate) fn ready(res: Response) -> ResponseFuture {
        ResponseFuture::new(std::future::ready(res))
    }
}

impl Future for ResponseFuture {
    type Output = Result<Response, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx).map(Ok)
    }
}

impl std::fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
