//! The engine's decisions: what a key's record means for a request — new,
//! replay, in flight, unknown, mismatch, takeover, lease lost — and how an
//! operator settles a stuck key, independent of HTTP and of SQL. Every door
//! (reservation API, proxy, layer) goes through [`Engine`], and so through
//! its [replay cache](ReplayCache) of completed records.
//!
//! `decide.rs` is the decisions with no I/O; `reserve.rs` the replay cache,
//! the claim and the wait; `holding.rs` what a holder does after (commit,
//! release, extend, checkpoint, mark unknown, get) and why its write was
//! refused; `stuck.rs` an operator's find, list and resolve; `lost.rs` claims
//! whose answer the store lost; `quotas.rs` the tenant limits and
//! `Retry-After`; `waiters.rs` the wake-ups of `Prefer: wait`; `types.rs`
//! what goes in and out.

use std::sync::Arc;
use std::time::Duration;

mod decide;
mod holding;
mod lost;
mod names;
mod quotas;
mod reserve;
mod stuck;
mod types;
mod waiters;

pub use names::MissingSealKey;
pub use stuck::{Resolved, Settlement, shown_state};
pub use types::*;

use lost::LostClaims;
use quotas::StoredFigure;
use waiters::Waiters;

use crate::durations::Durations;
pub use crate::replay_cache::{DEFAULT_REPLAY_CACHE_BYTES, ReplayCache};
use crate::seal::Sealer;
use crate::store::{BatchStats, Batcher, Store};

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
    /// The store's claims, commits and releases, written in batches; every
    /// other operation goes straight to `store`.
    batcher: Batcher,
    limits: Limits,
    waiters: Waiters,
    replay_cache: Option<ReplayCache>,
    /// Seals responses before they reach the store (`IDEMGATE_SEAL_KEY`).
    sealer: Option<Arc<Sealer>>,
    /// How records are named in the store, as far as this process knows
    /// ([`Engine::keep_naming_windows`]).
    windows: Arc<names::Windows>,
    tenant_limits: TenantLimits,
    /// Each tenant's last stored-bytes figure, behind a lock that lets one
    /// caller at a time read it again.
    stored_usage: moka::sync::Cache<String, Arc<tokio::sync::Mutex<Option<StoredFigure>>>>,
    /// Recent reserve→commit durations, for `Retry-After`.
    durations: Durations,
    /// Claims whose answer was lost, or whose request was never sent,
    /// settled once the store is back.
    lost: Arc<LostClaims>,
}

// === impl Engine ===

impl Engine {
    /// An engine over `store`, with a replay cache of
    /// [`DEFAULT_REPLAY_CACHE_BYTES`]. Its claims, commits and releases are
    /// written in batches ([`Batcher`]).
    pub fn new(store: Arc<dyn Store>, limits: Limits) -> Engine {
        Engine {
            lost: LostClaims::new(store.clone()),
            batcher: Batcher::new(store.clone()),
            store,
            waiters: Waiters::default(),
            replay_cache: ReplayCache::new(DEFAULT_REPLAY_CACHE_BYTES),
            sealer: None,
            windows: Arc::new(names::Windows::assume(false)),
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
    /// [`crate::seal`]), and naming records by keyed hashes; `None` stores
    /// them as they are. Sealed records open under any of the sealer's keys;
    /// records in the clear only while the sealer accepts them
    /// ([`Sealer::accepting_plaintext`]).
    pub fn with_sealer(mut self, sealer: Option<Sealer>) -> Engine {
        // Until the store has said which namings are in use
        // (`keep_naming_windows`), a process that keys names assumes plain
        // names are too: a new key then costs a look more, never a second run.
        let keys_names = sealer.as_ref().is_some_and(|s| !s.accepts_plaintext());
        self.windows = Arc::new(names::Windows::assume(keys_names));
        self.sealer = sealer.map(Arc::new);
        self
    }

    /// Whether responses are sealed at rest.
    pub fn seals(&self) -> bool {
        self.sealer.is_some()
    }

    /// Every name `tenant`'s key whose SHA-256 is `plain` may be kept under,
    /// the one new records get first ([`crate::seal::names_of`]): what an
    /// operator's look-up by raw key tries in turn.
    pub fn names_of(
        &self,
        tenant: &str,
        tenant_from_credential: bool,
        plain: &[u8; 32],
    ) -> Vec<(String, [u8; 32])> {
        crate::seal::names_of(
            self.sealer.as_deref(),
            tenant,
            tenant_from_credential,
            plain,
        )
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

    /// How the store's claims, commits and releases were grouped into
    /// transactions (the `idemgate_store_batch*` metrics).
    pub fn batch_stats(&self) -> BatchStats {
        self.batcher.stats()
    }
}
