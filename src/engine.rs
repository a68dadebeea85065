//! The decisions of SPEC §2: what a key's record means for a request — new,
//! replay, in flight, mismatch, takeover, lease lost — independent of HTTP and
//! of SQL. Every door (reservation API, proxy, layer) goes through [`Engine`],
//! and so through its [replay cache](crate::replay_cache) of completed records.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio::time::Instant;
use uuid::Uuid;

use crate::durations::Durations;
pub use crate::replay_cache::{DEFAULT_REPLAY_CACHE_BYTES, ReplayCache};
use crate::seal::{self, Sealer};
use crate::store::{
    Batched, Claim, ClaimRequest, KeyState, Record, Recovery, Store, StoreError, StoredResponse,
};
use crate::telemetry;

/// Lease and TTL bounds, and how long a caller may wait on a holder.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Lease when the caller names none.
    pub default_lease: Duration,
    /// Longest lease a caller may ask for.
    pub max_lease: Duration,
    /// TTL when the caller names none.
    pub default_ttl: Duration,
    /// Longest TTL a caller may ask for.
    pub max_ttl: Duration,
    /// Cap on `Prefer: wait=N`.
    pub max_wait: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            default_lease: Duration::from_secs(30),
            max_lease: Duration::from_secs(3600),
            default_ttl: Duration::from_secs(86_400),
            max_ttl: Duration::from_secs(7 * 86_400),
            max_wait: Duration::from_secs(10),
        }
    }
}

/// A request to reserve a key.
#[derive(Debug, Clone)]
pub struct ReserveRequest {
    /// Scope of the key.
    pub tenant: String,
    /// SHA-256 of the raw key.
    pub key_hash: [u8; 32],
    /// The request's fingerprint, if known.
    pub fingerprint: Option<String>,
    /// Lease for a new holder (already within [`Limits`]).
    pub lease_seconds: u32,
    /// TTL for a new record (already within [`Limits`]).
    pub ttl_seconds: u32,
    /// How long to wait for an in-flight holder (`Prefer: wait`), capped by
    /// [`Limits::max_wait`].
    pub wait: Option<Duration>,
}

/// The caller now holds the key.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// The fencing token for commit, release, extend and checkpoint.
    pub reservation_id: Uuid,
    /// 1 for a new key; more for a takeover.
    pub attempt: i32,
    /// When the lease ends.
    pub lease_expires_at: DateTime<Utc>,
    /// When the key is forgotten.
    pub expires_at: DateTime<Utc>,
    /// The previous holder's last recovery point, on a takeover.
    pub recovery: Option<Recovery>,
}

/// What a reserve comes to.
#[derive(Debug, Clone)]
pub enum ReserveOutcome {
    /// New key, or takeover of one whose holder's lease ended.
    Reserved(Reservation),
    /// Completed before: replay the stored response.
    Completed(Record),
    /// Another holder's lease is alive.
    InFlight {
        /// Whole seconds until the holder will likely have finished, from
        /// how long this process's holders recently took (at least 1, never
        /// past the lease's end).
        retry_after: u64,
        /// When the holder's lease ends: the latest it can hold the key
        /// without news.
        lease_expires_at: DateTime<Utc>,
    },
    /// The key was used with another fingerprint.
    Mismatch,
    /// The key is new (or free to take over), but its tenant is at one of its
    /// [`TenantLimits`]: nothing was claimed.
    OverLimit {
        /// The limit that held the claim back.
        limit: TenantLimit,
        /// Whole seconds until room is likely (at least 1).
        retry_after: u64,
    },
}

/// How much of the store one tenant may hold, so that no tenant can exhaust
/// it for the others. `None`: no limit.
///
/// In-flight keys are counted by the claim itself: on SQLite exactly (under
/// the write lock); on PostgreSQL against the claim's snapshot, so claims of
/// one tenant running at the same instant can pass the limit by at most one
/// each (at most the number of database connections). Stored bytes are read
/// from the store at most every [`STORED_USAGE_REFRESH`] per tenant and
/// process, and this process's own commits are added in between: the limit
/// can be passed by what the tenant commits through other processes in that
/// time, and by the responses of keys already in flight, which are always
/// stored — an effect that happened is never refused its record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantLimits {
    /// Most keys a tenant may hold in flight (leases not ended).
    pub max_in_flight: Option<u32>,
    /// Most bytes of stored responses a tenant may keep (bodies and header
    /// lists, as stored, until their keys expire).
    pub max_stored_bytes: Option<u64>,
}

/// One of the [`TenantLimits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantLimit {
    /// [`TenantLimits::max_in_flight`].
    InFlightKeys,
    /// [`TenantLimits::max_stored_bytes`].
    StoredBytes,
}

impl TenantLimit {
    /// A sentence for the client.
    pub fn detail(self) -> &'static str {
        match self {
            TenantLimit::InFlightKeys => {
                "this tenant holds as many keys in flight as it may; retry once one completes"
            }
            TenantLimit::StoredBytes => {
                "this tenant's stored responses take as much room as it may; retry once some expire"
            }
        }
    }
}

/// How long a tenant's stored-bytes figure is used before it is read again.
pub const STORED_USAGE_REFRESH: Duration = Duration::from_secs(2);

/// Why a holder's write was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No reservation with that id exists for this tenant.
    NotFound,
    /// The id was taken over.
    TakenOver,
    /// The id was released, or the record expired.
    Expired,
    /// The key was completed by this id (with another response, for a commit).
    AlreadyCompleted,
}

/// What a reservation id shows ([`Engine::get`]).
#[derive(Debug, Clone)]
pub enum Lookup {
    /// The key's record, and whether the id holds it live.
    Record {
        /// The record.
        record: Box<Record>,
        /// True while the id holds a live reservation of the key.
        live: bool,
    },
    /// The id's key expired or was released (it is forgotten, even before
    /// pruning deletes its row), or was reserved afresh by another request:
    /// nothing of the id is left to show.
    Gone,
}

impl Refusal {
    /// A sentence for the client.
    pub fn detail(self) -> &'static str {
        match self {
            Refusal::NotFound => "no reservation with this id exists for this tenant",
            Refusal::TakenOver => {
                "the lease ended and another caller took the key over; this reservation id is dead"
            }
            Refusal::Expired => {
                "this reservation was released or its key expired; the key is new again"
            }
            Refusal::AlreadyCompleted => {
                "this reservation is already completed; a commit may only repeat the response it stored"
            }
        }
    }
}

/// What a commit comes to.
#[derive(Debug, Clone)]
pub enum CommitOutcome {
    /// Stored now.
    Committed(Record),
    /// The same response was stored before by this id.
    AlreadyCommitted(Record),
    /// Refused.
    Refused(Refusal),
}

/// An engine error: only the store can fail.
pub type EngineError = StoreError;

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
    /// Deferred work, which a shutdown waits for.
    deferred: Arc<Deferred>,
    /// Recent reserve→commit durations, for `Retry-After`.
    durations: Durations,
}

/// The count of deferred work — holders whose call runs on after (or
/// without) their client's answer, and commits retrying in the background —
/// and a wake-up when it falls.
#[derive(Default)]
struct Deferred {
    pending: std::sync::atomic::AtomicUsize,
    fell: Notify,
}

/// Held by deferred work for as long as it runs (see
/// [`Engine::hold_deferred`]).
pub(crate) struct DeferredGuard(Arc<Deferred>);

impl Drop for DeferredGuard {
    fn drop(&mut self) {
        self.0
            .pending
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.0.fell.notify_waiters();
    }
}

/// A tenant's stored bytes as last read, plus this process's commits since.
#[derive(Debug, Clone, Copy)]
struct StoredFigure {
    bytes: u64,
    /// Time from the reading until the first of its records expires.
    next_expiry_in: Option<Duration>,
    read_at: std::time::Instant,
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
            deferred: Arc::default(),
            durations: Durations::new(limits.max_lease),
            limits,
        }
    }

    /// Counts one piece of deferred work until the guard drops.
    pub(crate) fn hold_deferred(&self) -> DeferredGuard {
        self.deferred
            .pending
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        DeferredGuard(self.deferred.clone())
    }

    /// Deferred work right now: the layer's calls still running (their
    /// client may have hung up or had its timeout), and commits of responses
    /// given while the store was away, retrying in the background.
    pub fn deferred_work(&self) -> usize {
        self.deferred
            .pending
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Waits until all deferred work has ended (every call answered and
    /// settled, every background commit landed or given up), or until
    /// `within` has passed; returns how much is still running. A shutdown
    /// calls it after the listeners have drained, so that a call whose
    /// client already had its answer (or its `504`) is not cut off, nor its
    /// response left unstored.
    pub async fn finish_deferred(&self, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            // Created before the count is read: a guard dropped in between
            // still wakes it.
            let fell = self.deferred.fell.notified();
            let pending = self.deferred_work();
            if pending == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, fell).await.is_err() {
                return self.deferred_work();
            }
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

    /// Replaces a sealed response and sealed recovery data in `record` by
    /// what they hold. A record that cannot be opened is a store error: it is
    /// never replayed nor handed on.
    fn open(&self, record: &mut Record) -> Result<(), EngineError> {
        let opened = self
            .open_response(record)
            .and_then(|()| self.open_recovery(record));
        opened.map_err(|why| {
            tracing::error!(
                tenant = %record.tenant,
                key.hash = %crate::key::hash_prefix(&record.key_hash),
                error = %why,
                "a stored record cannot be opened; answering 500 instead of using it"
            );
            StoreError::Other(format!("sealed record: {why}"))
        })
    }

    fn open_response(&self, record: &mut Record) -> Result<(), seal::OpenError> {
        let Some(response) = record.response.as_mut() else {
            return Ok(());
        };
        if !seal::is_sealed(response) {
            return Ok(());
        }
        let sealer = self.sealer.as_ref().ok_or(seal::OpenError::NoKey)?;
        *response = sealer.open(&record.tenant, record.reservation_id, response)?;
        Ok(())
    }

    fn open_recovery(&self, record: &mut Record) -> Result<(), seal::OpenError> {
        let Some(recovery) = record.recovery.as_mut() else {
            return Ok(());
        };
        let Some(data) = recovery.data.as_mut() else {
            return Ok(());
        };
        if !seal::is_sealed_recovery(data) {
            return Ok(());
        }
        let sealer = self.sealer.as_ref().ok_or(seal::OpenError::NoKey)?;
        *data = sealer.open_recovery(
            &record.tenant,
            &record.key_hash,
            &recovery.recovery_point,
            data,
        )?;
        Ok(())
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
        self.open(&mut claim.record)?;
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

    /// How long the holder of a record that was not claimed has run, where
    /// that is known: this process handed it out, or it is the key's first
    /// attempt (which began at `created_at`, by the database's clock).
    fn holder_ran(&self, claim: &Claim) -> Option<Duration> {
        if claim.claimed || claim.record.state != KeyState::InFlight {
            return None;
        }
        let record = &claim.record;
        self.durations
            .running_for(record.reservation_id)
            .or_else(|| {
                (record.attempt == 1)
                    .then(|| (claim.now - record.created_at).to_std().ok())
                    .flatten()
            })
    }

    /// `Retry-After` for a duplicate of an in-flight key: when its holder
    /// will likely have finished, from the recent durations of this
    /// process's holders, at least 1 s and never past the lease's end
    /// (`until_lease_end`, whole seconds). With nothing measured yet, 1 s:
    /// a client that honours it asks again soon rather than waiting out a
    /// lease for a request that may take a moment.
    fn retry_after(&self, tenant: &str, holder_ran: Option<Duration>, until_lease_end: u64) -> u64 {
        let estimate = self
            .durations
            .remaining(tenant, holder_ran)
            .map_or(1, whole_seconds_up);
        estimate.min(until_lease_end).max(1)
    }

    /// The answer to a claim a tenant limit held back.
    async fn over_limit(
        &self,
        tenant: &str,
        stored_full: Option<u64>,
    ) -> Result<ReserveOutcome, EngineError> {
        if let Some(retry_after) = stored_full {
            return Ok(ReserveOutcome::OverLimit {
                limit: TenantLimit::StoredBytes,
                retry_after,
            });
        }
        let max = self.tenant_limits.max_in_flight.unwrap_or(0);
        let usage = self.store.in_flight_usage(tenant, max).await?;
        let wait = usage
            .next_lease_end
            .and_then(|end| (end - usage.now).to_std().ok());
        tracing::debug!(live = usage.keys, max, "tenant at its in-flight limit");
        Ok(ReserveOutcome::OverLimit {
            limit: TenantLimit::InFlightKeys,
            retry_after: whole_seconds_up(wait.unwrap_or(Duration::from_secs(1))),
        })
    }

    /// `Some(retry_after)` when the tenant's stored bytes reach `max`; reads
    /// them again when the figure is older than [`STORED_USAGE_REFRESH`].
    async fn stored_retry_after(&self, tenant: &str, max: u64) -> Result<Option<u64>, EngineError> {
        let slot = self
            .stored_usage
            .get_with_by_ref(tenant, || Arc::new(tokio::sync::Mutex::new(None)));
        // One reader per tenant: the others wait and use its figure.
        let mut figure = slot.lock().await;
        let fresh = figure
            .as_ref()
            .is_some_and(|f| f.read_at.elapsed() < STORED_USAGE_REFRESH);
        if !fresh {
            let read_at = std::time::Instant::now();
            let usage = self.store.stored_usage(tenant).await?;
            *figure = Some(StoredFigure {
                bytes: usage.bytes,
                next_expiry_in: usage
                    .next_expiry
                    .and_then(|at| (at - usage.now).to_std().ok()),
                read_at,
            });
        }
        let Some(f) = figure.as_ref() else {
            return Ok(None);
        };
        if f.bytes < max {
            return Ok(None);
        }
        // Until the first stored record expires; if that is unknown (the
        // bytes are this process's own commits), until the next reading.
        let wait = f.next_expiry_in.map_or(STORED_USAGE_REFRESH, |d| {
            d.saturating_sub(f.read_at.elapsed())
        });
        Ok(Some(whole_seconds_up(wait)))
    }

    /// Adds a commit's stored size to its tenant's figure, if one is kept.
    fn count_stored(&self, tenant: &str, stored: &StoredResponse) {
        if self.tenant_limits.max_stored_bytes.is_none() {
            return;
        }
        let Some(slot) = self.stored_usage.get(tenant) else {
            return;
        };
        // Skipped while a reading is under way: it may or may not see this
        // commit, and the next one will.
        if let Ok(mut figure) = slot.try_lock()
            && let Some(f) = figure.as_mut()
        {
            f.bytes = f.bytes.saturating_add(stored_size(stored));
        }
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
        self.open(&mut record)?;
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
                self.open(&mut record)?;
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
        self.open(&mut found.record)?;
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

/// Classifies a record that a write by `id` could not touch.
fn refusal_for(record: &Record, id: Uuid, now: DateTime<Utc>) -> Refusal {
    if now >= record.expires_at {
        Refusal::Expired
    } else if record.reservation_id != id {
        // A takeover raises the attempt; a key that was released or expired
        // and then reserved afresh starts again at attempt 1.
        if record.attempt > 1 {
            Refusal::TakenOver
        } else {
            Refusal::Expired
        }
    } else if record.state == KeyState::Completed {
        Refusal::AlreadyCompleted
    } else {
        Refusal::Expired
    }
}

/// What the record returned by a claim means for this caller.
fn decide(claim: Claim, fingerprint: Option<&str>) -> ReserveOutcome {
    let record = claim.record;
    if claim.claimed {
        return ReserveOutcome::Reserved(Reservation {
            reservation_id: record.reservation_id,
            attempt: record.attempt,
            lease_expires_at: record.lease_expires_at.unwrap_or(claim.now),
            expires_at: record.expires_at,
            recovery: record.recovery,
        });
    }
    if reused(&record, fingerprint) {
        return ReserveOutcome::Mismatch;
    }
    match record.state {
        KeyState::Completed => ReserveOutcome::Completed(record),
        KeyState::InFlight => {
            let lease_expires_at = record.lease_expires_at.unwrap_or(claim.now);
            let left = (lease_expires_at - claim.now).num_milliseconds();
            // Whole seconds, rounded up, never 0: "retry now" would only spin.
            let retry_after = u64::try_from((left + 999) / 1000).unwrap_or(0).max(1);
            ReserveOutcome::InFlight {
                retry_after,
                lease_expires_at,
            }
        }
    }
}

/// Whether the claim would have applied to `record` (expired, or in flight
/// past its lease with a compatible fingerprint) had no limit held it back:
/// the store's claim conditions, read back.
fn claimable(record: &Record, now: DateTime<Utc>, fingerprint: Option<&str>) -> bool {
    now >= record.expires_at
        || (record.state == KeyState::InFlight
            && record.lease_expires_at.is_none_or(|end| end <= now)
            && !reused(record, fingerprint))
}

/// About what a stored response takes in the store: its body and its header
/// list.
fn stored_size(response: &StoredResponse) -> u64 {
    let headers: usize = response
        .headers
        .iter()
        .map(|(n, v)| n.len() + v.len() + 6)
        .sum();
    u64::try_from(response.body.len() + headers).unwrap_or(u64::MAX)
}

/// Whole seconds, rounded up, never 0: "retry now" would only spin.
fn whole_seconds_up(d: Duration) -> u64 {
    let ms = d.as_millis();
    u64::try_from(ms.div_ceil(1000)).unwrap_or(u64::MAX).max(1)
}

/// What a completed record that this caller did not claim means for it: the
/// decision of [`decide`], for a record from the replay cache.
fn decide_completed(record: Record, fingerprint: Option<&str>) -> ReserveOutcome {
    if reused(&record, fingerprint) {
        ReserveOutcome::Mismatch
    } else {
        ReserveOutcome::Completed(record)
    }
}

/// Both fingerprints known and different: the key was reused (any state).
fn reused(record: &Record, fingerprint: Option<&str>) -> bool {
    matches!(
        (record.fingerprint.as_deref(), fingerprint),
        (Some(stored), Some(given)) if stored != given
    )
}

type Slot = (String, [u8; 32]);

/// In-process wake-ups for callers waiting on a key (`Prefer: wait`).
#[derive(Default)]
struct Waiters {
    slots: Mutex<HashMap<Slot, Arc<Notify>>>,
}

// === impl Waiters ===

impl Waiters {
    /// The slot's notifier, shared by every waiter on the key; it stays in the
    /// map until the last of them leaves.
    fn subscribe(&self, slot: &Slot) -> Arc<Notify> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.entry(slot.clone()).or_default().clone()
    }

    /// Drops the slot when the last waiter leaves.
    fn unsubscribe(&self, slot: &Slot, notify: Arc<Notify>) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(current) = slots.get(slot)
            && Arc::ptr_eq(current, &notify)
            && Arc::strong_count(&notify) <= 2
        {
            slots.remove(slot);
        }
    }

    fn wake(&self, tenant: &str, key_hash: &[u8]) {
        let Ok(hash) = <[u8; 32]>::try_from(key_hash) else {
            return;
        };
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = slots.get(&(tenant.to_owned(), hash)) {
            n.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration as Span;

    fn record(state: KeyState, attempt: i32, fingerprint: Option<&str>) -> Record {
        let now = Utc::now();
        Record {
            tenant: "t".into(),
            key_hash: vec![0; 32],
            fingerprint: fingerprint.map(str::to_owned),
            state,
            reservation_id: Uuid::new_v4(),
            lease_expires_at: Some(now + Span::milliseconds(2_500)),
            attempt,
            recovery: None,
            response: None,
            created_at: now,
            completed_at: None,
            expires_at: now + Span::hours(1),
        }
    }

    fn claim(record: Record, claimed: bool) -> Claim {
        Claim {
            claimed,
            now: record.created_at,
            record,
        }
    }

    #[test]
    fn decide_classifies_every_unclaimed_state() {
        let in_flight = record(KeyState::InFlight, 1, Some("a"));
        assert!(matches!(
            decide(claim(in_flight.clone(), false), Some("a")),
            ReserveOutcome::InFlight { retry_after: 3, .. }
        ));
        // Unknown on either side: no mismatch can be detected.
        assert!(matches!(
            decide(claim(in_flight.clone(), false), None),
            ReserveOutcome::InFlight { .. }
        ));
        assert!(matches!(
            decide(claim(in_flight, false), Some("b")),
            ReserveOutcome::Mismatch
        ));
        let completed = record(KeyState::Completed, 1, None);
        assert!(matches!(
            decide(claim(completed.clone(), false), Some("b")),
            ReserveOutcome::Completed(_)
        ));
        let mut completed_a = completed;
        completed_a.fingerprint = Some("a".into());
        assert!(matches!(
            decide(claim(completed_a, false), Some("b")),
            ReserveOutcome::Mismatch
        ));
    }

    #[test]
    fn retry_after_is_never_zero() {
        let mut r = record(KeyState::InFlight, 1, None);
        r.lease_expires_at = Some(r.created_at);
        assert!(matches!(
            decide(claim(r, false), None),
            ReserveOutcome::InFlight { retry_after: 1, .. }
        ));
    }

    #[test]
    fn a_claim_hands_on_the_recovery_point() {
        let mut r = record(KeyState::InFlight, 2, Some("a"));
        r.recovery = Some(Recovery {
            recovery_point: "charged".into(),
            data: None,
        });
        let ReserveOutcome::Reserved(res) = decide(claim(r.clone(), true), Some("a")) else {
            panic!("not reserved");
        };
        assert_eq!(res.attempt, 2);
        assert_eq!(res.reservation_id, r.reservation_id);
        assert_eq!(res.recovery, r.recovery);
    }

    #[test]
    fn refusals_say_why_an_id_is_dead() {
        let r = record(KeyState::InFlight, 1, None);
        let now = r.created_at;
        let other = Uuid::new_v4();
        assert_eq!(
            refusal_for(&r, other, now),
            Refusal::Expired,
            "reserved afresh"
        );
        let mut taken = r.clone();
        taken.attempt = 2;
        assert_eq!(refusal_for(&taken, other, now), Refusal::TakenOver);
        let mut done = r.clone();
        done.state = KeyState::Completed;
        assert_eq!(
            refusal_for(&done, done.reservation_id, now),
            Refusal::AlreadyCompleted
        );
        assert_eq!(
            refusal_for(&r, r.reservation_id, r.expires_at),
            Refusal::Expired,
            "past expires_at the key is new again"
        );
    }
}
