//! The holder of a reserved key: calls the inner service while keeping the
//! key's lease alive, answers its client (at the answer timeout with a `504`
//! if the response head is slower, and the call then runs on), and settles
//! the key: released, stored, stored as a tombstone, or left in flight. A
//! body that is not all there at once is streamed to the client and
//! recorded as it passes ([`streaming`]); a call whose outcome cannot be
//! known is held or left to the next attempt ([`unknown`]).

mod streaming;
mod unknown;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use chrono::{DateTime, Utc};
use http::HeaderValue;
use tokio::sync::oneshot;
use tokio::time::Instant;
use uuid::Uuid;

use crate::engine::Committed;
use crate::headers::IDEMPOTENCY_ATTEMPT;
use crate::layer::deferred::retry_commit;
use crate::layer::headers::storable;
use crate::layer::policy::{Door, LayerPolicy};
use crate::layer::produce::{Produced, produce};
use crate::layer::shared::{Inner, Shared};
use crate::problem::ApiError;
use crate::store::{LeaseExpiry, StoreError, StoredResponse};

/// How far from its lease's end a holder asks the store before it sends its
/// request ([`Holder::fence`]); a quarter of the lease where that is less.
const FENCE: Duration = Duration::from_secs(1);

/// What became of the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SettledAs {
    /// The response is stored for replay.
    Stored,
    /// Status and headers stored; the body was over the limit.
    Tombstone,
    /// The origin did not act: the key is new again.
    Released,
    /// The outcome is unknown, under `takeover`: the key stays in flight
    /// until its lease ends, and the next request after that runs again.
    InFlight,
    /// The outcome is unknown, under `hold`: the key is marked so, and every
    /// request with it is refused until someone settles it.
    Unknown,
    /// The store was away: the commit is retried in the background.
    Deferred,
    /// The client got its `504` at the answer timeout; the call runs on,
    /// and its answer will be stored.
    RunningOn,
    /// The client got the head; the body streams to it and is recorded as
    /// it passes, the key settled when it ends.
    Streaming,
    /// The commit was refused (the lease ended and another caller took over)
    /// or failed: nothing is stored.
    NotStored,
    /// The lease ended before the request was sent (this process was held
    /// up past it), and the key could not be kept: the request was not sent.
    NotSent,
    /// The answer asks the client for input ([`AwaitingInput`]): nothing is
    /// stored, and the key stays held for the round that continues the call
    /// until its lease ends, then is released.
    ///
    /// [`AwaitingInput`]: crate::layer::AwaitingInput
    AwaitingInput,
}

impl SettledAs {
    /// For the log line.
    pub fn as_str(self) -> &'static str {
        match self {
            SettledAs::Stored => "stored",
            SettledAs::Tombstone => "tombstone",
            SettledAs::Released => "released",
            SettledAs::InFlight => "in_flight",
            SettledAs::Unknown => "unknown",
            SettledAs::Deferred => "deferred",
            SettledAs::RunningOn => "running_on",
            SettledAs::Streaming => "streaming",
            SettledAs::NotStored => "not_stored",
            SettledAs::NotSent => "not_sent",
            SettledAs::AwaitingInput => "awaiting_input",
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
    /// 1 for a new key; more for a takeover, said to the inner service in
    /// `Idempotency-Attempt`.
    pub attempt: i32,
    /// What the lease's end without news means for this key.
    pub on_lease_expiry: LeaseExpiry,
    /// When the lease ends, on this process's clock (no later than the
    /// store's).
    pub lease_ends: Instant,
    /// When the key is forgotten: the `Idempotency-Expires` of a streamed
    /// response, whose head goes out before its commit.
    pub expires_at: DateTime<Utc>,
    /// The store refused to extend the lease (the key was taken over): no
    /// more beats.
    pub lease_refused: bool,
}

/// What the holder answers its client with, and what became of the key.
pub(crate) type Reply = oneshot::Sender<(SettledAs, Response)>;

impl Holder {
    /// Calls the inner service, answers the client through `reply`, and
    /// settles the key — after the client's answer, when the call outlives
    /// [`LayerPolicy::answer_timeout`](super::LayerPolicy::answer_timeout)
    /// or its body streams. Counted as background work until it ends, so a
    /// shutdown waits for it
    /// ([`IdempotencyLayer::finish_deferred`](super::IdempotencyLayer::finish_deferred)).
    pub async fn run(mut self, inner: Inner, mut req: http::Request<Body>, reply: Reply) {
        let _held = self.shared.deferred.hold();
        let started = Instant::now();
        let mut reply = Some(reply);
        if self.attempt > 1 {
            req.headers_mut()
                .insert(IDEMPOTENCY_ATTEMPT, HeaderValue::from(self.attempt));
        }
        if let Err(not_sent) = self.fence().await {
            if let Some(reply) = reply {
                let _ = reply.send(not_sent);
            }
            return;
        }
        let call = produce(self.shared.clone(), inner, req);
        let Some(produced) = self.keeping_the_lease(call, &mut reply, started).await else {
            self.abandoned(reply).await;
            return;
        };
        let (settled, res) = match produced {
            Produced::Streaming(parts, first, body) => {
                self.stream(parts, first, body, reply, started).await;
                return;
            }
            produced => self.settle(produced).await,
        };
        match reply {
            Some(reply) => {
                // The client may have hung up: the key is settled all the same.
                let _ = reply.send((settled, res));
            }
            None => tracing::info!(
                key.hash = %self.key_hash,
                settled = settled.as_str(),
                status = res.status().as_u16(),
                "the call answered after its client's timeout"
            ),
        }
    }

    /// Whether this holder may still send its request. A pause between the
    /// claim and the call (the process stopped, starved or swapped out while
    /// the claim's answer waited) can outlast the lease, and another process
    /// may meanwhile have taken the key over and sent its own attempt: sent
    /// now, this one would reach the origin after it, as an earlier attempt,
    /// without `Idempotency-Attempt`. So a holder whose lease ends within
    /// [`FENCE`] (on this process's monotonic clock, which runs on through a
    /// pause) sends only once the store has extended its lease, which it
    /// does only while this id still holds the key.
    ///
    /// A refusal (taken over) is the client's `409 request-in-flight`, the
    /// key left to its new holder; a store that cannot answer leaves the id
    /// with the engine, which settles it as a request never sent once the
    /// store is back, and the client gets the `503`. A pause after this
    /// check, before the request's bytes leave, is not caught: that window
    /// is the origin's to fence, with the key and the attempt it is sent.
    async fn fence(&mut self) -> Result<(), (SettledAs, Response)> {
        let policy = &self.shared.policy;
        let lease = policy.lease;
        if Instant::now() + FENCE.min(lease / 4) < self.lease_ends {
            return Ok(());
        }
        let seconds = u32::try_from(lease.as_secs()).unwrap_or(u32::MAX).max(1);
        let asked = Instant::now();
        let engine = &self.shared.engine;
        match engine
            .extend(&self.tenant, self.reservation_id, seconds)
            .await
        {
            Ok(Ok(_)) => {
                self.lease_ends = asked + lease;
                Ok(())
            }
            Ok(Err(refusal)) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    reason = ?refusal,
                    "the lease ended before the request was sent (this process was held up) and \
                     the key has moved on: the request is not sent"
                );
                self.lease_refused = true;
                let e = ApiError::InFlight {
                    retry_after: 1,
                    lease_expires_at: Utc::now()
                        + chrono::TimeDelta::from_std(lease).unwrap_or_default(),
                };
                Err((SettledAs::NotSent, policy.problem(e)))
            }
            Err(e) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    error = %e,
                    "the lease ended before the request was sent (this process was held up) and \
                     the store cannot say whether the key is still held: the request is not sent, \
                     and the key is settled once the store is back"
                );
                engine.settle_unsent(&self.tenant, self.reservation_id);
                Err((SettledAs::NotSent, policy.problem(ApiError::from(e))))
            }
        }
    }

    /// Drives `call` while extending the lease every third of its length,
    /// so that a handler or origin slower than the lease keeps its key: a
    /// retry meanwhile is a 409, not a takeover and a second execution. A
    /// process that dies or stalls stops extending, and its key can be taken
    /// over once the last lease ends. A refused extension (the key was
    /// already taken over) stops the heartbeat; a store that is away is tried
    /// again at the next beat.
    ///
    /// At the answer timeout (counted from `started`) the client gets its
    /// `504` through `reply`, if it has not had its answer, and the call goes
    /// on; at the abandon bound the call is dropped (`None`).
    pub(super) async fn keeping_the_lease<F: Future>(
        &mut self,
        call: F,
        reply: &mut Option<Reply>,
        started: Instant,
    ) -> Option<F::Output> {
        let policy = &self.shared.policy;
        let answer_by = policy.answer_timeout.map(|t| started + t);
        let give_up = policy.abandon_after.map(|t| started + t);
        let lease = policy.lease;
        let seconds = u32::try_from(lease.as_secs()).unwrap_or(u32::MAX).max(1);
        let beat = (lease / 3).max(Duration::from_millis(500));
        // The first beat a third of a lease after the last one the store
        // heard of (the claim, or the beat before a streamed body).
        let now = Instant::now();
        let mut next_beat = self
            .lease_ends
            .checked_sub(lease)
            .map_or(now, |heard| (heard + beat).max(now));
        let mut call = std::pin::pin!(call);
        loop {
            let beating = !self.lease_refused;
            tokio::select! {
                out = &mut call => return Some(out),
                () = tokio::time::sleep_until(next_beat), if beating => {
                    // Read before the call: the store's lease ends no
                    // earlier than this + lease.
                    let asked = Instant::now();
                    next_beat = asked + beat;
                    match self.shared.engine.extend(&self.tenant, self.reservation_id, seconds).await {
                        Ok(Ok(_)) => self.lease_ends = asked + lease,
                        Ok(Err(refusal)) => {
                            tracing::warn!(
                                key.hash = %self.key_hash,
                                reason = ?refusal,
                                "the lease could not be extended; the call runs on, but its response may not be stored"
                            );
                            self.lease_refused = true;
                        }
                        Err(e) => tracing::warn!(
                            key.hash = %self.key_hash,
                            error = %e,
                            "the lease could not be extended; trying again at the next beat"
                        ),
                    }
                }
                () = until(answer_by), if reply.is_some() => {
                    tracing::warn!(
                        key.hash = %self.key_hash,
                        timeout_seconds = policy.answer_timeout.unwrap_or_default().as_secs(),
                        "no answer within the timeout: the client gets 504, the call runs on and \
                         its answer will be stored"
                    );
                    if let Some(reply) = reply.take() {
                        let after = policy.answer_timeout.unwrap_or_default();
                        let res = timed_out(policy, after, true);
                        let _ = reply.send((SettledAs::RunningOn, res));
                    }
                }
                () = until(give_up) => return None,
            }
        }
    }

    /// Releases, stores or leaves the key as `produced` says.
    async fn settle(&self, produced: Produced) -> (SettledAs, Response) {
        let policy = &self.shared.policy;
        match produced {
            Produced::Failed(e) => {
                let e = ApiError::Internal(format!("the inner service failed: {e}"));
                let settled = self
                    .outcome_unknown("the call failed after it was sent")
                    .await;
                (settled, policy.problem(e))
            }
            Produced::NotExecuted(res) if self.attempt > 1 => {
                (self.not_executed_again().await, res)
            }
            Produced::NotExecuted(res) => {
                self.release().await;
                (SettledAs::Released, res)
            }
            Produced::AwaitingInput(mut res) => {
                let settled = self.await_input().await;
                if settled == SettledAs::AwaitingInput {
                    res.extensions_mut()
                        .insert(crate::layer::HeldFor(self.reservation_id));
                }
                (settled, res)
            }
            Produced::Unknown(res) => (
                self.outcome_unknown("the inner service said its outcome is unknown")
                    .await,
                res,
            ),
            Produced::Whole(mut parts, read) => {
                // One copy, which the record and the answer share: what was
                // read may be a slice of the upstream connection's read
                // buffer, which hyper reuses for the next answer on that
                // connection only once no slice of it is held. Held through
                // the commit and the answer's write, it cost a new buffer
                // per key (10 % more CPU per proxied key, BENCHMARKS.md).
                let body = bytes::Bytes::copy_from_slice(&read);
                drop(read);
                let stored = StoredResponse {
                    status: parts.status.as_u16(),
                    headers: storable(&parts.headers, &policy.store_headers_deny),
                    body: body.clone(),
                };
                let settled = self.commit(stored, &mut parts.headers).await;
                (settled, Response::from_parts(parts, Body::from(body)))
            }
            Produced::BodyFailed(why) => {
                let e = match policy.door {
                    Door::Proxy => {
                        tracing::warn!(key.hash = %self.key_hash, error = %why, "upstream response failed");
                        ApiError::UpstreamUnavailable(
                            "the upstream's response broke off; whether it acted is unknown".into(),
                        )
                    }
                    Door::Layer => ApiError::Internal(format!("the response body failed: {why}")),
                };
                let settled = self
                    .outcome_unknown("the response broke off before its end")
                    .await;
                (settled, policy.problem(e))
            }
            // Taken by `run` before it settles anything.
            Produced::Streaming(..) => (
                SettledAs::InFlight,
                policy.problem(ApiError::Internal("a stream settled as a whole".into())),
            ),
        }
    }

    /// Keeps the key held for the round that continues the call, until the
    /// lease's end, when it is released. A store that cannot answer leaves
    /// the key as the claim made it (its lease's end then means what the
    /// claim said), and the round can still continue it until then.
    async fn await_input(&self) -> SettledAs {
        let seconds = u32::try_from(self.shared.policy.lease.as_secs())
            .unwrap_or(u32::MAX)
            .max(1);
        match self
            .shared
            .engine
            .await_input(&self.tenant, self.reservation_id, seconds)
            .await
        {
            Ok(Ok(_)) => SettledAs::AwaitingInput,
            Ok(Err(refusal)) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    reason = ?refusal,
                    "the call asks its client for input, but its key has moved on: the next round \
                     is reserved afresh"
                );
                SettledAs::NotStored
            }
            Err(e) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    error = %e,
                    "the call asks its client for input, and the store could not extend its \
                     lease; the next round can continue it until the lease ends"
                );
                SettledAs::AwaitingInput
            }
        }
    }

    /// Forgets the key: the origin did not act.
    pub(super) async fn release(&self) {
        match self
            .shared
            .engine
            .release(&self.tenant, self.reservation_id)
            .await
        {
            Ok(Ok(())) => {}
            Ok(Err(refusal)) => {
                tracing::debug!(key.hash = %self.key_hash, reason = ?refusal, "release refused");
            }
            Err(e) => tracing::warn!(
                key.hash = %self.key_hash,
                error = %e,
                "could not release the key; it stays in flight until its lease ends"
            ),
        }
    }

    /// Until when a commit the store refused for being away is retried:
    /// under `takeover`, the lease's end (then another request may take the
    /// key over); under `hold`, the key's expiry, for nobody else will run
    /// it, and a commit that lands late turns the held key into a replay.
    fn commit_bound(&self) -> Instant {
        match self.on_lease_expiry {
            LeaseExpiry::Takeover => self.lease_ends,
            LeaseExpiry::Hold => {
                let left = (self.expires_at - Utc::now()).to_std().unwrap_or_default();
                Instant::now() + left
            }
        }
    }

    /// Stores the response; on success adds `Idempotency-Expires` to the
    /// client's copy.
    pub(super) async fn commit(
        &self,
        stored: StoredResponse,
        headers: &mut http::HeaderMap,
    ) -> SettledAs {
        let engine = &self.shared.engine;
        match engine
            .commit(&self.tenant, self.reservation_id, &stored)
            .await
        {
            Ok(Ok(Committed::Now(record)) | Ok(Committed::Earlier(record))) => {
                crate::headers::set_expires(headers, record.expires_at);
                SettledAs::Stored
            }
            Ok(Err(refusal)) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    reason = ?refusal,
                    "the response was not stored"
                );
                SettledAs::NotStored
            }
            Err(StoreError::Unavailable { why, .. }) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    error = %why,
                    "store unavailable at commit: returning the response, retrying the commit in the background"
                );
                // Counted until it lands or gives up: a shutdown waits for it.
                let held = self.shared.deferred.hold();
                let retry = retry_commit(
                    engine.clone(),
                    self.tenant.clone(),
                    self.reservation_id,
                    stored,
                    self.commit_bound(),
                    self.key_hash.clone(),
                );
                // In the request's trace: its commit spans are this one's.
                let span = tracing::Span::current();
                tokio::spawn(tracing::Instrument::instrument(
                    async move {
                        retry.await;
                        drop(held);
                    },
                    span,
                ));
                SettledAs::Deferred
            }
            Err(StoreError::Other { why, .. }) => {
                tracing::error!(key.hash = %self.key_hash, error = %why, "the response was not stored");
                SettledAs::NotStored
            }
        }
    }
}

/// The `504 upstream-timeout` of a call that has not answered within
/// `after`; `runs_on` says whether the call goes on (a guarded one at the
/// answer timeout) or was given up (one that holds no key, or a guarded one
/// at the abandon bound).
pub(crate) fn timed_out(policy: &LayerPolicy, after: Duration, runs_on: bool) -> Response {
    let secs = after.as_secs();
    let setting = if runs_on {
        policy.door.setting("IDEMGATE_UPSTREAM_TIMEOUT")
    } else {
        ""
    };
    let detail = if runs_on {
        format!(
            "the upstream did not answer within {secs} s{setting}; it may still be working: its \
             call runs on, and its answer, when it comes, is stored and replayed to a retry with \
             this key (until then a retry gets 409)"
        )
    } else {
        format!("the upstream did not answer within {secs} s{setting}; whether it acted is unknown")
    };
    policy.problem(ApiError::UpstreamTimeout(detail))
}

/// Resolves at `at`, or never.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
