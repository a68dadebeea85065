//! A guarded request with its key, in a task of its own from the engine's
//! decision to the end of the call it may lead to: a client that hangs up
//! drops only the wait for its answer, never a claim half made (which would
//! leave its key held for a request that never ran), the call or its
//! commit.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use http::Request;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::holder::{Holder, SettledAs};
use super::shared::{Inner, Shared};
use crate::engine::{EngineError, ReserveOutcome, ReserveRequest};
use crate::telemetry::Outcome;

/// A guarded request with its key, on its way to the engine's decision and,
/// if it gets the key, to the inner service.
pub(super) struct Call {
    pub(super) shared: Arc<Shared>,
    pub(super) tenant: String,
    /// For logs only.
    pub(super) key_hash: String,
    pub(super) on_lease_expiry: crate::store::LeaseExpiry,
    pub(super) inner: Inner,
    pub(super) req: Request<Body>,
}

/// What [`Call::decide`] hands back to the request.
pub(super) struct Decided {
    /// From the request's start to the decision.
    pub(super) elapsed: Duration,
    pub(super) decision: Result<Decision, EngineError>,
}

/// The engine's decision as the request sees it.
pub(super) enum Decision {
    /// The request holds the key (`attempt` > 1: it took it over): the
    /// holder's answer comes on `answer`.
    Holding {
        attempt: i32,
        answer: oneshot::Receiver<(SettledAs, Response)>,
    },
    /// Anything else (a replay, a refusal).
    Other(ReserveOutcome),
}

impl Decision {
    pub(super) fn outcome(&self) -> Outcome {
        match self {
            Decision::Holding { attempt, .. } if *attempt > 1 => Outcome::Takeover,
            Decision::Holding { .. } => Outcome::Created,
            Decision::Other(decision) => decision.outcome(),
        }
    }
}

// === impl Call ===

impl Call {
    /// Asks the engine, sends its decision through `decided`, and when the
    /// request holds the key, runs the holder to its end whether or not
    /// anyone still waits for its answer.
    pub(super) async fn decide(
        self,
        request: ReserveRequest,
        started: Instant,
        decided: oneshot::Sender<Decided>,
    ) {
        let reserved_at = Instant::now();
        let decision = match self.req.extensions().get::<super::Resumes>() {
            // A later round of a call that asked its client for input holds
            // the key as that call did, if it still can.
            Some(&super::Resumes(id)) => match self.shared.engine.resume(&request, id).await {
                Ok(Some(reservation)) => Ok(ReserveOutcome::Reserved(reservation)),
                Ok(None) => self.shared.engine.reserve(&request).await,
                Err(e) => Err(e),
            },
            // The request looked in the replay cache before this task.
            None => self.shared.engine.reserve_after_miss(&request).await,
        };
        let elapsed = started.elapsed();
        let reservation = match decision {
            Ok(ReserveOutcome::Reserved(reservation)) => reservation,
            other => {
                let _ = decided.send(Decided {
                    elapsed,
                    decision: other.map(Decision::Other),
                });
                return;
            }
        };
        let policy = &self.shared.policy;
        let holder = Holder {
            shared: self.shared.clone(),
            // Keyed under sealing when derived from a credential.
            tenant: reservation.tenant.unwrap_or(self.tenant),
            key_hash: self.key_hash,
            reservation_id: reservation.reservation_id,
            attempt: reservation.attempt,
            on_lease_expiry: self.on_lease_expiry,
            lease_ends: reserved_at + policy.lease,
            expires_at: reservation.expires_at,
            lease_refused: false,
        };
        let (reply, answer) = oneshot::channel();
        let _ = decided.send(Decided {
            elapsed,
            decision: Ok(Decision::Holding {
                attempt: reservation.attempt,
                answer,
            }),
        });
        holder.run(self.inner, self.req, reply).await;
    }
}
