//! A response whose body was not all there at once, recorded as it passes:
//! its head goes to the client at once, each chunk as it arrives, and a copy
//! is kept. When the body ends the copy is stored; past the body limit the
//! key is completed as a tombstone (status and headers, replayed with
//! `Idempotency-Body-Omitted: true`) and the rest flows on unchanged; a body
//! that breaks off leaves the key in flight, its outcome unknown.
//!
//! The client's response ends only after the commit, so a client that has
//! the whole response and retries at once is replayed, as if the response
//! had been buffered: a chunked body's end is sent after the commit, and of
//! a body with a `Content-Length` the chunk that completes it waits for the
//! commit. A client that hangs up changes nothing: the upstream is read to
//! its end and the key settled all the same.

use axum::body::{Body, Bytes};
use axum::response::Response;
use http::header::CONTENT_LENGTH;
use http::response::Parts;
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::{Holder, Reply, SettledAs};
use crate::headers::set_expires;
use crate::layer::headers::{IDEMPOTENCY_BODY_OMITTED, storable};
use crate::layer::produce::concat;
use crate::layer::tee::Tee;
use crate::store::StoredResponse;

/// How the body's pass through the holder ended.
enum Passed {
    /// It ended within the limit: every chunk of it.
    Whole(Vec<Bytes>),
    /// It passed the limit: the rest, still coming.
    Over(Body),
    /// It broke off.
    Broken(String),
}

/// Where the chunks go: the client's pipe, minus the chunk that completes a
/// declared length, held until the key is settled.
struct Outlet {
    tee: Tee,
    content_length: Option<u64>,
    sent: u64,
    held: Vec<Bytes>,
}

// === impl Holder ===

impl Holder {
    /// Sends the head to the client (if it is still waiting for its answer),
    /// then the body as it comes, recording it; settles the key when it ends.
    pub(super) async fn stream(
        mut self,
        parts: Parts,
        first: Vec<Bytes>,
        body: Body,
        reply: Option<Reply>,
        started: Instant,
    ) {
        let policy = &self.shared.policy;
        let limit = policy.max_body_bytes;
        let status = parts.status.as_u16();
        let headers = storable(&parts.headers, &policy.store_headers_deny);
        let content_length = parts
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let tee = match reply {
            Some(reply) => {
                let (tee, body) = Tee::new();
                let mut parts = parts;
                set_expires(&mut parts.headers, self.expires_at);
                let res = Response::from_parts(parts, Body::new(body));
                let _ = reply.send((SettledAs::Streaming, res));
                tee
            }
            // The client had its 504 at the answer timeout: record alone.
            None => Tee::nobody(),
        };
        let mut out = Outlet {
            tee,
            content_length,
            sent: 0,
            held: Vec::new(),
        };
        let passing = pass(first, body, &mut out, limit);
        let passed = self.keeping_the_lease(passing, &mut None, started).await;
        let mut ignored = http::HeaderMap::new();
        let settled = match passed {
            None => {
                // Dropping the outlet breaks the client's body.
                self.abandoned(None).await;
                return;
            }
            Some(Passed::Whole(chunks)) => {
                let stored = StoredResponse {
                    status,
                    headers,
                    body: concat(chunks),
                };
                let settled = self.commit(stored, &mut ignored).await;
                out.end();
                settled
            }
            Some(Passed::Over(rest)) => {
                let mut headers = headers;
                headers.push((IDEMPOTENCY_BODY_OMITTED.as_str().to_owned(), "true".into()));
                let stored = StoredResponse {
                    status,
                    headers,
                    body: Bytes::new(),
                };
                let settled = match self.commit(stored, &mut ignored).await {
                    SettledAs::Stored => SettledAs::Tombstone,
                    other => other,
                };
                self.pump(rest, out, started).await;
                settled
            }
            Some(Passed::Broken(why)) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    error = %why,
                    "the streamed response broke off before its end; whether it acted in full is \
                     unknown"
                );
                self.outcome_unknown("the streamed response broke off before its end")
                    .await
            }
        };
        tracing::info!(
            key.hash = %self.key_hash,
            settled = settled.as_str(),
            status,
            "the streamed response ended"
        );
    }

    /// Past the limit, the key settled: the rest of the body to the client
    /// as it takes it, and read to its end if the client is gone, within
    /// the abandon bound.
    async fn pump(&self, mut rest: Body, mut out: Outlet, started: Instant) {
        out.release();
        let to_the_end = async {
            loop {
                match rest.frame().await {
                    None => return true,
                    Some(Err(e)) => {
                        tracing::warn!(
                            key.hash = %self.key_hash,
                            error = %e,
                            "the streamed response broke off past the body limit; its status and \
                             headers are stored"
                        );
                        return false;
                    }
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            out.sent += data.len() as u64;
                            out.tee.push_bounded(data).await;
                        }
                    }
                }
            }
        };
        let ended = match self.shared.policy.abandon_after {
            Some(bound) => tokio::time::timeout_at(started + bound, to_the_end)
                .await
                .unwrap_or(false),
            None => to_the_end.await,
        };
        if ended {
            out.end();
        }
    }
}

/// Reads the body to its end or past `limit`, passing each chunk on and
/// keeping a copy; `first` are the chunks that were there with the head.
async fn pass(first: Vec<Bytes>, mut body: Body, out: &mut Outlet, limit: usize) -> Passed {
    let mut copy = Vec::new();
    let mut total = 0usize;
    let mut first = first.into_iter();
    loop {
        let chunk = match first.next() {
            Some(chunk) => chunk,
            None => match body.frame().await {
                None => return Passed::Whole(copy),
                Some(Err(e)) => return Passed::Broken(e.to_string()),
                // Trailers are neither stored nor replayed.
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => data,
                    Err(_) => continue,
                },
            },
        };
        total += chunk.len();
        out.forward(chunk.clone());
        if total > limit {
            for chunk in first {
                out.forward(chunk);
            }
            return Passed::Over(body);
        }
        copy.push(chunk);
    }
}

// === impl Outlet ===

impl Outlet {
    /// Passes `chunk` on, except the chunk that completes a declared
    /// `Content-Length` (and anything after it): that waits for
    /// [`release`](Self::release), after the commit.
    fn forward(&mut self, chunk: Bytes) {
        let completes = self
            .content_length
            .is_some_and(|len| self.sent + chunk.len() as u64 >= len);
        if completes || !self.held.is_empty() {
            self.held.push(chunk);
        } else {
            self.sent += chunk.len() as u64;
            self.tee.push(chunk);
        }
    }

    /// What was held for the commit.
    fn release(&mut self) {
        for chunk in self.held.drain(..) {
            self.sent += chunk.len() as u64;
            self.tee.push(chunk);
        }
    }

    /// The rest, and the body's clean end.
    fn end(mut self) {
        self.release();
        self.tee.end();
    }
}
