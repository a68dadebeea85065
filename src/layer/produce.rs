//! What the inner service produced: its response, with as much of its body
//! as was there at once (all of it, for most answers of an in-process
//! service), or the error it failed with.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::response::Response;
use futures::FutureExt;
use http_body_util::BodyExt;

use super::shared::{Inner, Shared};
use super::{AwaitingInput, NotExecuted, OutcomeUnknown};

/// What the inner service produced.
pub(super) enum Produced {
    /// The service failed: whether the effect happened is unknown.
    Failed(String),
    /// The origin did not act ([`NotExecuted`], or a release status).
    NotExecuted(Response),
    /// Marked [`OutcomeUnknown`].
    Unknown(Response),
    /// Marked [`AwaitingInput`]: not the call's outcome.
    AwaitingInput(Response),
    /// The response with its whole body, which was there at once and is
    /// within the limit: stored before the client gets it.
    Whole(http::response::Parts, Bytes),
    /// The response, the chunks of its body that were there at once, and
    /// the rest, still coming (or over the limit): streamed to the client
    /// as it arrives, and recorded as it passes.
    Streaming(http::response::Parts, Vec<Bytes>, Body),
    /// The body broke off before the head was answered.
    BodyFailed(String),
}

/// Calls the inner service and takes, without waiting, what of its
/// response body is already there.
pub(super) async fn produce(
    shared: Arc<Shared>,
    inner: Inner,
    req: http::Request<Body>,
) -> Produced {
    let res = match inner(req).await {
        Ok(res) => res,
        Err(e) => return Produced::Failed(e.to_string()),
    };
    let policy = &shared.policy;
    if res.extensions().get::<NotExecuted>().is_some()
        || policy.release_statuses.contains(&res.status().as_u16())
    {
        return Produced::NotExecuted(res);
    }
    if res.extensions().get::<OutcomeUnknown>().is_some() {
        return Produced::Unknown(res);
    }
    if res.extensions().get::<AwaitingInput>().is_some() {
        return Produced::AwaitingInput(res);
    }
    if res.status() == http::StatusCode::SWITCHING_PROTOCOLS {
        // Whatever the switched connection does is out of the layer's
        // sight: there is nothing to store, and a replayed 101 would switch
        // nothing.
        return Produced::Failed(
            "it answered 101 Switching Protocols to a guarded request, which cannot be \
             recorded"
                .into(),
        );
    }
    let (parts, mut body) = res.into_parts();
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut total = 0usize;
    loop {
        // Only what is ready: a stream's first byte goes to the client as
        // soon as it comes, never held back for the rest.
        let Some(frame) = body.frame().now_or_never() else {
            return Produced::Streaming(parts, chunks, body);
        };
        match frame {
            None => break,
            Some(Err(e)) => return Produced::BodyFailed(e.to_string()),
            Some(Ok(frame)) => {
                // Trailers are neither stored nor replayed.
                if let Ok(data) = frame.into_data() {
                    total += data.len();
                    chunks.push(data);
                    if total > policy.max_body_bytes {
                        return Produced::Streaming(parts, chunks, body);
                    }
                }
            }
        }
    }
    Produced::Whole(parts, concat(chunks))
}

/// The chunks as one buffer (without a copy for one chunk).
pub(super) fn concat(mut chunks: Vec<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.swap_remove(0),
        _ => Bytes::from(chunks.concat()),
    }
}
