//! Request bodies read whole by a door: the idle timeout a listener may put
//! on them, and how its expiry is recognised.

use std::time::Duration;

use tower_http::timeout::TimeoutBody;

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

/// True when `error`, or what caused it, is a request body that stopped
/// arriving (the idle timeout a listener puts on request bodies).
pub(crate) fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if e.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        cause = e.source();
    }
    false
}
