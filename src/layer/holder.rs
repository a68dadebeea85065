//! The holder of a reserved key: calls the inner service, then
//! `response_filter` decides what becomes of the key — released, stored,
//! stored as a tombstone, or left in flight — and commits.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, StreamBody};
use tokio::time::Instant;
use uuid::Uuid;

use super::flow::Inner;
use super::headers::{IDEMPOTENCY_BODY_OMITTED, storable};
use super::layer::Shared;
use super::policy::Mode;
use super::{NotExecuted, OutcomeUnknown};
use crate::api::problem::ApiError;
use crate::engine::{CommitOutcome, Engine};
use crate::store::{StoreError, StoredResponse};

/// Longest pause between two background commit attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What became of the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// The response is stored for replay.
    Stored,
    /// Status and headers stored; the body was over the limit.
    Tombstone,
    /// The origin did not act: the key is new again.
    Released,
    /// The outcome is unknown: the key stays in flight until its lease ends.
    InFlight,
    /// The store was away: the commit is retried in the background.
    Deferred,
    /// The commit was refused (the lease ended and another caller took over)
    /// or failed: nothing is stored.
    NotStored,
}

impl Settled {
    /// For the log line.
    pub fn as_str(self) -> &'static str {
        match self {
            Settled::Stored => "stored",
            Settled::Tombstone => "tombstone",
            Settled::Released => "released",
            Settled::InFlight => "in_flight",
            Settled::Deferred => "deferred",
            Settled::NotStored => "not_stored",
        }
    }
}

/// A request that holds its key.
pub(crate) struct Holder {
    pub shared: Arc<Shared>,
    pub tenant: String,
    /// For logs only.
    pub key_hash: String,
    pub reservation_id: Uuid,
    /// When the lease ends, on this process's clock (no later than the
    /// store's).
    pub lease_ends: Instant,
}

/// The response body, read up to the limit.
enum Buffered {
    /// All of it.
    Whole(Bytes),
    /// Over the limit: what was read, then the rest, for the client.
    Over(Body),
    /// It broke off or did not finish within the lease.
    Failed(String),
}

// === impl Holder ===

impl Holder {
    /// Calls the inner service and settles the key.
    pub async fn run(mut self, inner: Inner, req: http::Request<Body>) -> (Settled, Response) {
        let call = inner(req);
        let answer = match self.shared.policy.mode {
            // A handler has no timeout of its own: the lease follows it.
            Mode::Layer => self.keeping_the_lease(call).await,
            // The upstream timeout bounds the call, and the lease outlasts it.
            Mode::Proxy => call.await,
        };
        let res = match answer {
            Ok(res) => res,
            // Whether the effect happened is unknown: keep the key in flight.
            Err(e) => {
                let e = ApiError::Internal(format!("the inner service failed: {e}"));
                return (Settled::InFlight, e.into_response());
            }
        };
        self.response_filter(res).await
    }

    /// Awaits `call`, extending the lease every third of its length while
    /// the call runs, so that a handler slower than the lease keeps its key:
    /// a retry meanwhile is a 409, not a takeover and a second execution. A
    /// process that dies or stalls stops extending, and its key can be taken
    /// over once the last lease ends. A refused extension (the key was
    /// already taken over) stops the heartbeat; a store that is away is tried
    /// again at the next beat.
    async fn keeping_the_lease<F: std::future::Future>(&mut self, call: F) -> F::Output {
        let lease = self.shared.policy.lease;
        let seconds = u32::try_from(lease.as_secs()).unwrap_or(u32::MAX).max(1);
        let beat = (lease / 3).max(Duration::from_millis(500));
        let mut call = std::pin::pin!(call);
        let mut beating = true;
        loop {
            let next = Instant::now() + beat;
            tokio::select! {
                out = &mut call => return out,
                () = tokio::time::sleep_until(next), if beating => {
                    // Read before the call: the store's lease ends no
                    // earlier than this + lease.
                    let asked = Instant::now();
                    match self.shared.engine.extend(&self.tenant, self.reservation_id, seconds).await {
                        Ok(Ok(_)) => self.lease_ends = asked + lease,
                        Ok(Err(refusal)) => {
                            tracing::warn!(
                                key.hash = %self.key_hash,
                                reason = refusal.detail(),
                                "the lease could not be extended; the handler runs on, but its response may not be stored"
                            );
                            beating = false;
                        }
                        Err(e) => tracing::warn!(
                            key.hash = %self.key_hash,
                            error = %e,
                            "the lease could not be extended; trying again at the next beat"
                        ),
                    }
                }
            }
        }
    }

    async fn response_filter(self, res: Response) -> (Settled, Response) {
        let policy = &self.shared.policy;
        let status = res.status().as_u16();
        if res.extensions().get::<NotExecuted>().is_some()
            || policy.release_statuses.contains(&status)
        {
            self.release().await;
            return (Settled::Released, res);
        }
        if res.extensions().get::<OutcomeUnknown>().is_some() {
            return (Settled::InFlight, res);
        }
        let (mut parts, body) = res.into_parts();
        let mut headers = storable(&parts.headers, &policy.store_headers_deny);
        match buffer(body, policy.max_body_bytes, self.lease_ends).await {
            Buffered::Whole(bytes) => {
                let stored = StoredResponse {
                    status,
                    headers,
                    body: bytes.to_vec(),
                };
                let settled = self.commit(stored, &mut parts.headers).await;
                (settled, Response::from_parts(parts, Body::from(bytes)))
            }
            Buffered::Over(body) => {
                headers.push((IDEMPOTENCY_BODY_OMITTED.as_str().to_owned(), "true".into()));
                let stored = StoredResponse {
                    status,
                    headers,
                    body: Vec::new(),
                };
                let settled = match self.commit(stored, &mut parts.headers).await {
                    Settled::Stored => Settled::Tombstone,
                    other => other,
                };
                (settled, Response::from_parts(parts, body))
            }
            Buffered::Failed(why) => {
                let e = match policy.mode {
                    Mode::Proxy => {
                        tracing::warn!(key.hash = %self.key_hash, error = %why, "upstream response failed; the key stays in flight until its lease ends");
                        ApiError::UpstreamUnavailable(
                            "the upstream's response broke off; whether it acted is unknown".into(),
                        )
                    }
                    Mode::Layer => ApiError::Internal(format!("the response body failed: {why}")),
                };
                (Settled::InFlight, e.into_response())
            }
        }
    }

    /// Forgets the key: the origin did not act.
    async fn release(&self) {
        match self
            .shared
            .engine
            .release(&self.tenant, self.reservation_id)
            .await
        {
            Ok(Ok(())) => {}
            Ok(Err(refusal)) => {
                tracing::debug!(key.hash = %self.key_hash, reason = refusal.detail(), "release refused");
            }
            Err(e) => tracing::warn!(
                key.hash = %self.key_hash,
                error = %e,
                "could not release the key; it stays in flight until its lease ends"
            ),
        }
    }

    /// Stores the response; on success adds `Idempotency-Expires` to the
    /// client's copy.
    async fn commit(&self, stored: StoredResponse, headers: &mut http::HeaderMap) -> Settled {
        let engine = &self.shared.engine;
        match engine
            .commit(&self.tenant, self.reservation_id, &stored)
            .await
        {
            Ok(CommitOutcome::Committed(record) | CommitOutcome::AlreadyCommitted(record)) => {
                crate::headers::set_expires(headers, record.expires_at);
                Settled::Stored
            }
            Ok(CommitOutcome::Refused(refusal)) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    reason = refusal.detail(),
                    "the response was not stored"
                );
                Settled::NotStored
            }
            Err(StoreError::Unavailable(why)) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    error = %why,
                    "store unavailable at commit: returning the response, retrying the commit in the background"
                );
                // Counted until it lands or gives up: a shutdown waits for it.
                let held = engine.hold_deferred();
                let retry = retry_commit(
                    engine.clone(),
                    self.tenant.clone(),
                    self.reservation_id,
                    stored,
                    self.lease_ends,
                    self.key_hash.clone(),
                );
                tokio::spawn(async move {
                    retry.await;
                    drop(held);
                });
                Settled::Deferred
            }
            Err(StoreError::Other(why)) => {
                tracing::error!(key.hash = %self.key_hash, error = %why, "the response was not stored");
                Settled::NotStored
            }
        }
    }
}

/// Retries a commit, backing off, until it lands or the lease ends.
async fn retry_commit(
    engine: Arc<Engine>,
    tenant: String,
    id: Uuid,
    stored: StoredResponse,
    lease_ends: Instant,
    key_hash: String,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let now = Instant::now();
        if now >= lease_ends {
            tracing::warn!(key.hash = %key_hash, "the lease ended before the store came back; the response was not stored");
            return;
        }
        tokio::time::sleep(backoff.min(lease_ends - now)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        match engine.commit(&tenant, id, &stored).await {
            Ok(CommitOutcome::Committed(_) | CommitOutcome::AlreadyCommitted(_)) => {
                tracing::info!(key.hash = %key_hash, "the deferred commit landed");
                return;
            }
            Ok(CommitOutcome::Refused(refusal)) => {
                tracing::warn!(key.hash = %key_hash, reason = refusal.detail(), "the deferred commit was refused");
                return;
            }
            Err(StoreError::Unavailable(_)) => {}
            Err(StoreError::Other(why)) => {
                tracing::error!(key.hash = %key_hash, error = %why, "the deferred commit failed");
                return;
            }
        }
    }
}

/// Reads `body` up to `limit` bytes, before `deadline`.
async fn buffer(mut body: Body, limit: usize, deadline: Instant) -> Buffered {
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut total = 0usize;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Buffered::Failed("it did not finish before the lease ended".into()),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Buffered::Failed(e.to_string()),
            Ok(Some(Ok(frame))) => frame,
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
