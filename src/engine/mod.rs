//! The engine's decisions: what a key's record means for a request — new,
//! replay, in flight, mismatch, takeover, lease lost — independent of HTTP and
//! of SQL. Every door (reservation API, proxy, layer) goes through [`Engine`],
//! and so through its [replay cache](ReplayCache) of completed records.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio::time::Instant;
use uuid::Uuid;

mod decide;
mod quotas;
mod types;
mod waiters;

pub use types::*;

use decide::{claimable, decide, decide_completed, refusal_for};
use quotas::StoredFigure;
use waiters::Waiters;

use crate::durations::Durations;
pub use crate::replay_cache::{DEFAULT_REPLAY_CACHE_BYTES, ReplayCache};
use crate::seal::Sealer;
use crate::store::{Batched, ClaimRequest, KeyState, Record, Recovery, Store, StoredResponse};
use crate::telemetry;

/// The idempotency engine: one per process, cheap to share behind an `Arc`.
///
/// It keeps the completed records it reads or commits in a bounded
/// [`ReplayCache`], so a retry of a completed key is replayed without a
/// database round trip (never past the record's `expires_at`, never across
/// tenants). [`Engine::new`] gives it a cache of
/// [`DEFAULT_REPLAY_CACHE_BYTES`]; [`Engine::with_replay_cache`] changes the
/// bound or, with 0, turns the cache off.
pub struct Engine {
    store: Arc<dyn Store>,
    limits: Limits,
    waiters: Waiters,
    replay_cache: Option<ReplayCache>,
    /// Seals responses before they reach the store (`IDEMGATE_SEAL_KEY`).
    sealer: Option<Arc<Sealer>>,
    tenant_limits: TenantLimits,
    /// Each tenant's last stored-bytes figure, behind a lock that lets one
    /// caller at a time read it again.
    stored_usage: moka::sync::Cache<String, Arc<tokio::sync::Mutex<Option<StoredFigure>>>>,
    /// Recent reserve→commit durations, for `Retry-After`.
    durations: Durations,
}

// === impl Engine ===

impl Engine {
    /// An engine over `store`, with a replay cache of
    /// [`DEFAULT_REPLAY_CACHE_BYTES`]. Its claims, commits and releases are
    /// written in batches ([`Batched`]).
    pub fn new(store: Arc<dyn Store>, limits: Limits) -> Engine {
        Engine {
            store: Batched::wrap(store),
            waiters: Waiters::default(),
            replay_cache: ReplayCache::new(DEFAULT_REPLAY_CACHE_BYTES),
            sealer: None,
            tenant_limits: TenantLimits::default(),
            // Bounded: the proxy's tenants are whatever credentials arrive.
            stored_usage: moka::sync::Cache::builder()
                .max_capacity(10_000)
                .time_to_idle(Duration::from_secs(600))
                .build(),
            durations: Durations::new(limits.max_lease),
            limits,
        }
    }

    /// The same engine holding each tenant to `limits`.
    pub fn with_tenant_limits(mut self, limits: TenantLimits) -> Engine {
        self.tenant_limits = limits;
        self
    }

    /// The limits each tenant is held to.
    pub fn tenant_limits(&self) -> TenantLimits {
        self.tenant_limits
    }

    /// The same engine sealing stored responses with `sealer` (see
    /// [`crate::seal`]); `None` stores them as they are. Records already
    /// stored in the other form stay readable: unsealed ones always, sealed
    /// ones under any of the sealer's keys.
    pub fn with_sealer(mut self, sealer: Option<Sealer>) -> Engine {
        self.sealer = sealer.map(Arc::new);
        self
    }

    /// Whether responses are sealed at rest.
    pub fn seals(&self) -> bool {
        self.sealer.is_some()
    }

    /// The same engine with a replay cache of at most `max_bytes` (0: no
    /// cache, every reserve asks the store), in place of the one it had.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idemgate::engine::{Engine, Limits};
    /// # use idemgate::store::SqliteStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let store = SqliteStore::open("sqlite::memory:").await?;
    /// let engine = Engine::new(Arc::new(store), Limits::default()).with_replay_cache(0);
    /// assert!(engine.replay_cache().is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_replay_cache(mut self, max_bytes: u64) -> Engine {
        self.replay_cache = ReplayCache::new(max_bytes);
        self
    }

    /// The replay cache, unless it is turned off.
    pub fn replay_cache(&self) -> Option<&ReplayCache> {
        self.replay_cache.as_ref()
    }

    /// The bounds it enforces.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The store underneath.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Reserves a key; with `wait`, holds the caller while another holder's
    /// lease is alive, without holding a database connection in between.
    pub async fn reserve(&self, req: &ReserveRequest) -> Result<ReserveOutcome, EngineError> {
        if let Some(outcome) = self.cached_outcome(req) {
            return Ok(outcome);
        }
        let Some(wait) = req.wait.map(|w| w.min(self.limits.max_wait)) else {
            return self.claim(req).await;
        };
        let slot = (req.tenant.clone(), req.key_hash);
        let notify = self.waiters.subscribe(&slot);
        let outcome = self
            .claim_waiting(req, Instant::now() + wait, &notify)
            .await;
        self.waiters.unsubscribe(&slot, notify);
        outcome
    }

    /// The decision for a key whose completed record is in the replay cache.
    fn cached_outcome(&self, req: &ReserveRequest) -> Option<ReserveOutcome> {
        let record = self
            .replay_cache
            .as_ref()?
            .get(&req.tenant, &req.key_hash)?;
        telemetry::record_replay_cache_hit();
        Some(decide_completed(record, req.fingerprint.as_deref()))
    }

    /// Caches `record` if it is completed; `started` was read before the
    /// store call that returned it, `db_now` is the database's clock then.
    fn remember(&self, record: &Record, started: std::time::Instant, db_now: DateTime<Utc>) {
        if let Some(cache) = &self.replay_cache {
            cache.insert(record, started, db_now);
        }
    }

    async fn claim(&self, req: &ReserveRequest) -> Result<ReserveOutcome, EngineError> {
        // Over its stored bytes, a tenant may still read what it has: the
        // claim only reads (a limit of 0 keys in flight).
        let stored_full = match self.tenant_limits.max_stored_bytes {
            Some(max) => self.stored_retry_after(&req.tenant, max).await?,
            None => None,
        };
        let max_in_flight = match stored_full {
            Some(_) => Some(0),
            None => self.tenant_limits.max_in_flight,
        };
        // Before the store call: the database reads its clock after this.
        let started = std::time::Instant::now();
        let claim = self
            .store
            .reserve(&ClaimRequest {
                tenant: req.tenant.clone(),
                key_hash: req.key_hash,
                fingerprint: req.fingerprint.clone(),
                reservation_id: Uuid::new_v4(),
                lease_seconds: req.lease_seconds,
                ttl_seconds: req.ttl_seconds,
                max_in_flight,
            })
            .await?;
        let Some(mut claim) = claim else {
            return self.over_limit(&req.tenant, stored_full).await;
        };
        crate::seal::open_record(self.sealer.as_deref(), &mut claim.record)?;
        if !claim.claimed {
            self.remember(&claim.record, started, claim.now);
            if max_in_flight.is_some()
                && claimable(&claim.record, claim.now, req.fingerprint.as_deref())
            {
                return self.over_limit(&req.tenant, stored_full).await;
            }
        }
        let holder_ran = self.holder_ran(&claim);
        Ok(match decide(claim, req.fingerprint.as_deref()) {
            ReserveOutcome::Reserved(r) => {
                self.durations.started(&req.tenant, r.reservation_id);
                ReserveOutcome::Reserved(r)
            }
            ReserveOutcome::InFlight {
                retry_after: until_lease_end,
                lease_expires_at,
            } => ReserveOutcome::InFlight {
                retry_after: self.retry_after(&req.tenant, holder_ran, until_lease_end),
                lease_expires_at,
            },
            other => other,
        })
    }

    async fn claim_waiting(
        &self,
        req: &ReserveRequest,
        deadline: Instant,
        notify: &Notify,
    ) -> Result<ReserveOutcome, EngineError> {
        let mut poll = Duration::from_millis(20);
        let mut first = true;
        loop {
            // Created before the read, so a commit that lands between the read
            // and the sleep still wakes us.
            let notified = notify.notified();
            // After a wake-up, a commit by this process is in the cache
            // ([`Engine::reserve`] looked before the first round).
            let cached = if first {
                None
            } else {
                self.cached_outcome(req)
            };
            first = false;
            let outcome = match cached {
                Some(outcome) => outcome,
                None => self.claim(req).await?,
            };
            let now = Instant::now();
            let ReserveOutcome::InFlight { retry_after, .. } = outcome else {
                return Ok(outcome);
            };
            if now >= deadline {
                return Ok(outcome);
            }
            // Sleep until a local commit or release wakes us, the next poll (a
            // holder in another process), or the lease's end, whichever is
            // first; the poll interval grows so a long wait stays cheap.
            let nap = poll
                .min(deadline - now)
                .min(Duration::from_secs(retry_after));
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(nap) => {}
            }
            poll = (poll * 2).min(Duration::from_millis(500));
        }
    }

    /// Stores the response of reservation `id` and completes its key.
    pub async fn commit(
        &self,
        tenant: &str,
        id: Uuid,
        response: &StoredResponse,
    ) -> Result<CommitOutcome, EngineError> {
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
        if let Some(mut record) = self.store.complete(tenant, id, to_store).await? {
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
            return Ok(CommitOutcome::Committed(record));
        }
        let Some(found) = self.store.find_by_reservation(tenant, id).await? else {
            return Ok(CommitOutcome::Refused(Refusal::NotFound));
        };
        let mut record = found.record;
        crate::seal::open_record(self.sealer.as_deref(), &mut record)?;
        Ok(match refusal_for(&record, id, found.now) {
            Refusal::AlreadyCompleted if record.response.as_ref() == Some(response) => {
                // Its `completed_at` is an earlier commit's: the lookup's
                // clock is the one read after `started`.
                self.remember(&record, started, found.now);
                CommitOutcome::AlreadyCommitted(record)
            }
            refusal => CommitOutcome::Refused(refusal),
        })
    }

    /// Forgets an in-flight key whose effect never started.
    pub async fn release(
        &self,
        tenant: &str,
        id: Uuid,
    ) -> Result<Result<(), Refusal>, EngineError> {
        if let Some(key_hash) = self.store.release(tenant, id).await? {
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
        match self.store.extend(tenant, id, lease_seconds).await? {
            Some(until) => Ok(Ok(until)),
            None => self.refusal(tenant, id).await.map(Err),
        }
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
            && found.record.state == KeyState::InFlight;
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
        }))
    }

    /// Why a write by `id` did not apply.
    async fn refusal(&self, tenant: &str, id: Uuid) -> Result<Refusal, EngineError> {
        Ok(match self.store.find_by_reservation(tenant, id).await? {
            None => Refusal::NotFound,
            Some(found) => refusal_for(&found.record, id, found.now),
        })
    }
}
