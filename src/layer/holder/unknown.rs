//! What a holder does when it cannot know whether its call acted — it
//! failed after it was sent, its response broke off, it ran past its bound
//! — or when a takeover's call did not act though an earlier attempt may
//! have: the key is held unknown (`hold`), or left to the next attempt
//! (`takeover`), never forgotten.

use super::{Holder, Reply, SettledAs, timed_out};
use crate::store::LeaseExpiry;

// === impl Holder ===

impl Holder {
    /// The call ran past its bound and was dropped.
    pub(super) async fn abandoned(&self, reply: Option<Reply>) {
        tracing::warn!(
            key.hash = %self.key_hash,
            "the call ran past its bound and was abandoned; whether it acted is unknown"
        );
        let settled = self
            .outcome_unknown("the call ran past its bound and was abandoned")
            .await;
        if let Some(reply) = reply {
            let after = self.shared.policy.abandon_after.unwrap_or_default();
            let res = timed_out(&self.shared.policy, after, false);
            let _ = reply.send((settled, res));
        }
    }

    /// Whether the call acted cannot be known (it failed after it was sent,
    /// its response broke off, it ran past its bound). Under `hold` the key
    /// is marked unknown, so no request runs it again; under `takeover` it
    /// stays in flight until its lease ends.
    /// `why` is kept with the record for the operator who settles it.
    pub(super) async fn outcome_unknown(&self, why: &'static str) -> SettledAs {
        if self.on_lease_expiry == LeaseExpiry::Takeover {
            tracing::warn!(
                key.hash = %self.key_hash,
                "the outcome is unknown; the key stays in flight until its lease ends, then a \
                 retry takes it over (on_lease_expiry = takeover)"
            );
            return SettledAs::InFlight;
        }
        match self
            .shared
            .engine
            .mark_unknown(&self.tenant, self.reservation_id, why)
            .await
        {
            Ok(Ok(())) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    "the outcome is unknown: the key is held, and every request with it gets \
                     409 outcome-unknown until it is settled"
                );
                SettledAs::Unknown
            }
            Ok(Err(refusal)) => {
                tracing::warn!(key.hash = %self.key_hash, reason = ?refusal, "the key could not be marked unknown");
                SettledAs::NotStored
            }
            Err(e) => {
                tracing::warn!(
                    key.hash = %self.key_hash,
                    error = %e,
                    "the key could not be marked unknown; it is held all the same, and becomes \
                     unknown when its lease ends"
                );
                SettledAs::Unknown
            }
        }
    }

    /// A takeover's call did not act (a release status, a connect failure),
    /// but an earlier attempt may have: the key is not forgotten, for the
    /// next request must still be sent as a later attempt. Under `takeover`
    /// its lease ends now, so the next request takes it over with the next
    /// `Idempotency-Attempt`; under `hold` its outcome is unknown.
    pub(super) async fn not_executed_again(&self) -> SettledAs {
        if self.on_lease_expiry == LeaseExpiry::Hold {
            return self
                .outcome_unknown("a later attempt did not act, but an earlier one may have")
                .await;
        }
        match self
            .shared
            .engine
            .extend(&self.tenant, self.reservation_id, 0)
            .await
        {
            Ok(Ok(_)) => tracing::info!(
                key.hash = %self.key_hash,
                attempt = self.attempt,
                "a later attempt did not act; the key is left to the next attempt, for an earlier \
                 one may have"
            ),
            Ok(Err(refusal)) => {
                tracing::debug!(key.hash = %self.key_hash, reason = ?refusal, "the lease could not be ended");
            }
            Err(e) => tracing::warn!(
                key.hash = %self.key_hash,
                error = %e,
                "the lease could not be ended; the next attempt takes the key over once it ends"
            ),
        }
        SettledAs::InFlight
    }
}
