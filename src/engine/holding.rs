//! What a key's holder does with its reservation: commit, release, extend,
//! checkpoint, mark unknown, look it up; and why a write addressed by a reservation id was
//! refused.

use chrono::{DateTime, Utc};
use tracing::Instrument as _;
use uuid::Uuid;

use super::decide::refusal_for;
use super::{Committed, Engine, EngineError, Lookup, Refusal};
use crate::spans;
use crate::store::{KeyState, LeaseExpiry, Record, Recovery, StoredResponse};

impl Engine {
    /// Stores the response of reservation `id` and completes its key, in a
    /// span of its own ([`spans::COMMIT`]), which records the outcome.
    pub async fn commit(
        &self,
        tenant: &str,
        id: Uuid,
        response: &StoredResponse,
    ) -> Result<Result<Committed, Refusal>, EngineError> {
        let span = spans::commit(response.status);
        let outcome = async {
            // Before the store calls: the database reads its clock after this.
            let started = std::time::Instant::now();
            let sealed;
            let to_store = match &self.sealer {
                None => response,
                Some(sealer) => {
                    sealed = sealer.seal(tenant, id, response);
                    &sealed
                }
            };
            if let Some(mut record) = self.batcher.complete(tenant, id, to_store).await? {
                self.count_stored(tenant, to_store);
                if self.sealer.is_some() {
                    // What was just sealed: the replay cache holds the open form.
                    record.response = Some(response.clone());
                }
                // `completed_at` is the database's clock at this commit.
                if let Some(completed_at) = record.completed_at {
                    self.remember(&record, started, completed_at);
                }
                self.waiters.wake(&record.tenant, &record.key_hash);
                self.durations.finished(id);
                return Ok(Ok(Committed::Now(record)));
            }
            let Some(found) = self.store.find_by_reservation(tenant, id).await? else {
                return Ok(Err(Refusal::NotFound));
            };
            let mut record = found.record;
            crate::seal::open_record(self.sealer.as_deref(), &mut record)?;
            Ok::<_, EngineError>(match refusal_for(&record, id, found.now) {
                Refusal::AlreadyCompleted if record.response.as_ref() == Some(response) => {
                    // Its `completed_at` is an earlier commit's: the lookup's
                    // clock is the one read after `started`.
                    self.remember(&record, started, found.now);
                    Ok(Committed::Earlier(record))
                }
                refusal => Err(refusal),
            })
        }
        .instrument(span.clone())
        .await;
        match &outcome {
            Ok(Ok(Committed::Now(_))) => spans::committed(&span, "committed"),
            Ok(Ok(Committed::Earlier(_))) => spans::committed(&span, "already_committed"),
            Ok(Err(_)) => spans::committed(&span, "refused"),
            Err(_) => spans::failed(&span),
        }
        outcome
    }

    /// Forgets an in-flight key whose effect never started, in a span of its
    /// own ([`spans::RELEASE`]), which records the outcome.
    pub async fn release(
        &self,
        tenant: &str,
        id: Uuid,
    ) -> Result<Result<(), Refusal>, EngineError> {
        let span = spans::release();
        let outcome = async {
            if let Some(key_hash) = self.batcher.release(tenant, id).await? {
                self.durations.forget(id);
                self.waiters.wake(tenant, &key_hash);
                return Ok(Ok(()));
            }
            self.refusal(tenant, id).await.map(Err)
        }
        .instrument(span.clone())
        .await;
        match &outcome {
            Ok(Ok(())) => span.record("idemgate.outcome", "released"),
            Ok(Err(_)) => span.record("idemgate.outcome", "refused"),
            Err(_) => span.record("otel.status_code", "ERROR"),
        };
        outcome
    }

    /// Settles reservation `id`, whose request was never sent and whose
    /// holder cannot write to the store now, once the store is back: as a
    /// claim whose answer was lost (a first attempt released, a later one
    /// left to the attempt after it), so its key is not left held, or
    /// unknown, for a request that never ran.
    pub(crate) fn settle_unsent(&self, tenant: &str, id: Uuid) {
        self.lost.remember(tenant, id);
    }

    /// Marks the key reservation `id` holds as unknown: its holder cannot
    /// tell whether the effect happened (a connection that broke after the
    /// request went out, a call abandoned at its bound). Every request with
    /// the key is then refused until the holder's own late commit or
    /// release, or an operator, settles it; a waiter on it gets its answer
    /// at once. `reason` (what failed, never a body) is kept with the record
    /// for the operator; a key the same holder marked already keeps its
    /// first reason, and marking it again is no refusal.
    pub async fn mark_unknown(
        &self,
        tenant: &str,
        id: Uuid,
        reason: &str,
    ) -> Result<Result<(), Refusal>, EngineError> {
        if let Some(key_hash) = self.store.mark_unknown(tenant, id, reason).await? {
            self.durations.forget(id);
            self.waiters.wake(tenant, &key_hash);
            return Ok(Ok(()));
        }
        self.refusal(tenant, id).await.map(Err)
    }

    /// Extends the lease of reservation `id`.
    pub async fn extend(
        &self,
        tenant: &str,
        id: Uuid,
        lease_seconds: u32,
    ) -> Result<Result<DateTime<Utc>, Refusal>, EngineError> {
        self.extend_as(tenant, id, lease_seconds, None).await
    }

    /// [`Engine::extend`], the lease's end meaning `on_lease_expiry` from
    /// now on where it is given.
    async fn extend_as(
        &self,
        tenant: &str,
        id: Uuid,
        lease_seconds: u32,
        on_lease_expiry: Option<LeaseExpiry>,
    ) -> Result<Result<DateTime<Utc>, Refusal>, EngineError> {
        match self
            .store
            .extend(tenant, id, lease_seconds, on_lease_expiry)
            .await?
        {
            Some(until) => Ok(Ok(until)),
            None => self.refusal(tenant, id).await.map(Err),
        }
    }

    /// Keeps reservation `id`'s key held while its call waits for its
    /// client's input (an MCP `input_required` answer, which is not the
    /// call's outcome): its lease extended by `lease_seconds`, at whose end
    /// the key is released (taken over by the next request) rather than held
    /// unknown, for the call has said it has not completed. A round that
    /// continues the call ([`Engine::resume`]) holds it as before.
    pub async fn await_input(
        &self,
        tenant: &str,
        id: Uuid,
        lease_seconds: u32,
    ) -> Result<Result<DateTime<Utc>, Refusal>, EngineError> {
        self.extend_as(tenant, id, lease_seconds, Some(LeaseExpiry::Takeover))
            .await
    }

    /// Records a recovery point for reservation `id`; with a seal key, its
    /// data is sealed at rest like a stored response.
    pub async fn checkpoint(
        &self,
        tenant: &str,
        id: Uuid,
        recovery: &Recovery,
    ) -> Result<Result<Record, Refusal>, EngineError> {
        let sealed;
        let to_store = match (&self.sealer, &recovery.data) {
            (Some(sealer), data) if !sealer.accepts_plaintext() => {
                // Sealed whole, the point's name with its data; bound to
                // the key's record, as below.
                let Some(found) = self.store.find_by_reservation(tenant, id).await? else {
                    return Ok(Err(Refusal::NotFound));
                };
                let (recovery_point, data) = sealer.seal_checkpoint(
                    tenant,
                    &found.record.key_hash,
                    &recovery.recovery_point,
                    data.as_ref(),
                );
                sealed = Recovery {
                    recovery_point,
                    data: Some(data),
                };
                &sealed
            }
            (Some(sealer), Some(data)) => {
                // The blob is bound to the key's record: its hash is fixed
                // for the life of the reservation id.
                let Some(found) = self.store.find_by_reservation(tenant, id).await? else {
                    return Ok(Err(Refusal::NotFound));
                };
                sealed = Recovery {
                    recovery_point: recovery.recovery_point.clone(),
                    data: Some(sealer.seal_recovery(
                        tenant,
                        &found.record.key_hash,
                        &recovery.recovery_point,
                        data,
                    )),
                };
                &sealed
            }
            _ => recovery,
        };
        match self.store.checkpoint(tenant, id, to_store).await? {
            Some(mut record) => {
                crate::seal::open_record(self.sealer.as_deref(), &mut record)?;
                Ok(Ok(record))
            }
            None => self.refusal(tenant, id).await.map(Err),
        }
    }

    /// What reservation `id` shows: its key's record, with whether `id` is
    /// still its live holder (after a takeover the old id shows the key's
    /// record, not live), or [`Lookup::Gone`]; `None` for an unknown id.
    pub async fn get(&self, tenant: &str, id: Uuid) -> Result<Option<Lookup>, EngineError> {
        let Some(mut found) = self.store.find_by_reservation(tenant, id).await? else {
            return Ok(None);
        };
        let live = found.record.reservation_id == id
            && found.now < found.record.expires_at
            && matches!(found.record.state, KeyState::InFlight | KeyState::Unknown);
        // What a write by this id would be refused as `Expired`: its key
        // expired or was released (forgotten, whether or not pruning has
        // deleted the row yet), or was reserved afresh, and that record is
        // another request's, which an old id must not be shown.
        if !live && refusal_for(&found.record, id, found.now) == Refusal::Expired {
            return Ok(Some(Lookup::Gone));
        }
        crate::seal::open_record(self.sealer.as_deref(), &mut found.record)?;
        Ok(Some(Lookup::Record {
            record: Box::new(found.record),
            live,
            now: found.now,
        }))
    }

    /// Why a write by `id` did not apply.
    pub(super) async fn refusal(&self, tenant: &str, id: Uuid) -> Result<Refusal, EngineError> {
        Ok(match self.store.find_by_reservation(tenant, id).await? {
            None => Refusal::NotFound,
            Some(found) => refusal_for(&found.record, id, found.now),
        })
    }
}
