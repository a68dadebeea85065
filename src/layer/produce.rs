//! What the inner service produced: its response, read as far as the key
//! needs it (the whole body, up to the limit, when it is to be stored), or
//! the error it failed with.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::response::Response;
use futures::StreamExt;
use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, StreamBody};

use super::shared::{Inner, Shared};
use super::{NotExecuted, OutcomeUnknown};

/// What the inner service produced, read as far as the key needs it.
pub(super) enum Produced {
    /// The service failed: whether the effect happened is unknown.
    Failed(String),
    /// The origin did not act ([`NotExecuted`], or a release status).
    NotExecuted(Response),
    /// Marked [`OutcomeUnknown`].
    Unknown(Response),
    /// The response with its whole body.
    Whole(http::response::Parts, Bytes),
    /// The body is over the limit: what was read, then the rest.
    Over(http::response::Parts, Body),
    /// The body broke off.
    BodyFailed(String),
}

/// The response body, read up to the limit.
pub(super) enum Buffered {
    /// All of it.
    Whole(Bytes),
    /// Over the limit: what was read, then the rest, for the client.
    Over(Body),
    /// It broke off.
    Failed(String),
}

// === impl Holder ===

/// Calls the inner service and reads its response as far as the key needs:
/// the whole body, up to the limit, when it is to be stored.
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
    let (parts, body) = res.into_parts();
    match buffer(body, policy.max_body_bytes).await {
        Buffered::Whole(bytes) => Produced::Whole(parts, bytes),
        Buffered::Over(body) => Produced::Over(parts, body),
        Buffered::Failed(why) => Produced::BodyFailed(why),
    }
}

/// Reads `body` up to `limit` bytes.
async fn buffer(mut body: Body, limit: usize) -> Buffered {
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut total = 0usize;
    loop {
        let frame = match body.frame().await {
            None => break,
            Some(Err(e)) => return Buffered::Failed(e.to_string()),
            Some(Ok(frame)) => frame,
        };
        // Trailers are neither stored nor replayed.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len();
        chunks.push(data);
        if total > limit {
            let prefix = futures::stream::iter(chunks.into_iter().map(|c| Ok(Frame::data(c))));
            let rest = BodyStream::new(body);
            return Buffered::Over(Body::new(StreamBody::new(prefix.chain(rest))));
        }
    }
    Buffered::Whole(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.swap_remove(0),
        _ => Bytes::from(chunks.concat()),
    })
}
