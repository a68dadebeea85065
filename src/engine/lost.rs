//! Claims whose answer was lost: the store failed to answer a reserve (the
//! connection broke, the database restarted) after it may have committed
//! it. The caller was told the store is away and never learned the
//! reservation id, so nobody will forward the request or settle the key;
//! left alone it would stay in flight, and under `hold` turn unknown, for a
//! request that never ran. This process remembers each such id, and one
//! task settles it once the store answers again, as a holder whose call did
//! not act would:
//!
//! * a first attempt is released: the key is new again;
//! * a takeover (attempt 2 or more) is not, for an earlier attempt may have
//!   acted: under `takeover` its lease ends at once, so the next request
//!   takes the key over as the attempt after it; under `hold` the key is
//!   unknown. Releasing it would send the next request upstream as a first
//!   attempt, without `Idempotency-Attempt`, to an origin that may already
//!   have acted on the key.
//!
//! Each write applies only while that id still holds the key, so one that
//! never committed, or a key taken over meanwhile, is left as it is. The
//! attempt read first cannot change under it: only a claim changes a
//! record's attempt, and a claim changes its holder too.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use crate::store::{HotPath, KeyState, LeaseExpiry, StoreError};

/// The most ids remembered; past it the oldest are given up (logged).
const MOST: usize = 10_000;
/// How long an id is tried: past it, a key it did claim is left to its
/// lease and to the operators.
const TRY_FOR: Duration = Duration::from_secs(600);
/// The pause between two sweeps.
const EVERY: Duration = Duration::from_secs(1);

/// The ids of claims whose answer was lost, and the task that releases them.
pub(super) struct LostClaims {
    /// The store itself, not the engine's batcher: the sweep writes one id
    /// at a time, in the background.
    store: Arc<dyn HotPath>,
    ids: Mutex<VecDeque<Lost>>,
    sweeper: OnceLock<()>,
}

struct Lost {
    tenant: String,
    id: Uuid,
    until: Instant,
}

// === impl LostClaims ===

impl LostClaims {
    pub(super) fn new(store: Arc<dyn HotPath>) -> Arc<LostClaims> {
        Arc::new(LostClaims {
            store,
            ids: Mutex::new(VecDeque::new()),
            sweeper: OnceLock::new(),
        })
    }

    /// Remembers reservation `id` of `tenant`, whose claim may have
    /// committed without its caller knowing.
    pub(super) fn remember(self: &Arc<Self>, tenant: &str, id: Uuid) {
        {
            let mut ids = self.ids.lock().unwrap_or_else(|e| e.into_inner());
            if ids.len() >= MOST {
                ids.pop_front();
                tracing::warn!(
                    "too many claims with a lost answer to remember: the oldest is given up (its \
                     key, if it was claimed, is left to its lease)"
                );
            }
            ids.push_back(Lost {
                tenant: tenant.to_owned(),
                id,
                until: Instant::now() + TRY_FOR,
            });
        }
        // The store may be built outside a runtime; the task starts with the
        // first id, which comes from within one.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            self.sweeper.get_or_init(|| {
                runtime.spawn(sweep(Arc::downgrade(self)));
            });
        }
    }
}

/// Releases the remembered ids, one by one, every [`EVERY`]; a store still
/// away ends the sweep where it is, to try again at the next.
async fn sweep(lost: Weak<LostClaims>) {
    loop {
        tokio::time::sleep(EVERY).await;
        let Some(lost) = lost.upgrade() else {
            return;
        };
        loop {
            let next = lost
                .ids
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
            let Some(entry) = next else {
                break;
            };
            if Instant::now() >= entry.until {
                tracing::warn!(
                    reservation.id = %entry.id,
                    "a claim whose answer was lost could not be released in time; if it committed, \
                     its key is left to its lease (and, under hold, to the operators)"
                );
                continue;
            }
            match settle(&*lost.store, &entry.tenant, entry.id).await {
                Ok(Some((key_hash, LostClaimSettledAs::Released))) => tracing::info!(
                    key.hash = %crate::key::hash_prefix(&key_hash),
                    "a claim whose answer was lost had committed: released, for its request was \
                     never sent"
                ),
                Ok(Some((key_hash, LostClaimSettledAs::LeaseEnded))) => tracing::info!(
                    key.hash = %crate::key::hash_prefix(&key_hash),
                    "a takeover whose answer was lost had committed: its lease ended, so the next \
                     request takes the key over as a later attempt (an earlier one may have acted)"
                ),
                Ok(Some((key_hash, LostClaimSettledAs::Unknown))) => tracing::warn!(
                    key.hash = %crate::key::hash_prefix(&key_hash),
                    "a takeover whose answer was lost had committed under hold: the key is \
                     unknown, for an earlier attempt may have acted"
                ),
                Ok(None) => {}
                Err(e) if e.is_unavailable() => {
                    lost.ids
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push_front(entry);
                    break;
                }
                Err(e) => tracing::warn!(
                    reservation.id = %entry.id,
                    error = %e,
                    "a claim whose answer was lost could not be released"
                ),
            }
        }
    }
}

/// What became of a lost claim's key.
enum LostClaimSettledAs {
    Released,
    LeaseEnded,
    Unknown,
}

/// Settles the key reservation `id` holds, if it holds one still in flight,
/// as a holder whose call never went out would (see the module's docs); the
/// key's hash, and what was done.
async fn settle(
    store: &dyn HotPath,
    tenant: &str,
    id: Uuid,
) -> Result<Option<(Vec<u8>, LostClaimSettledAs)>, StoreError> {
    let Some(found) = store.find_by_reservation(tenant, id).await? else {
        return Ok(None);
    };
    let record = found.record;
    if record.reservation_id != id || record.state != KeyState::InFlight {
        return Ok(None);
    }
    if record.attempt <= 1 {
        return Ok(store
            .release(tenant, id)
            .await?
            .map(|key_hash| (key_hash, LostClaimSettledAs::Released)));
    }
    let key_hash = record.key_hash.clone();
    let settled = match record.on_lease_expiry {
        LeaseExpiry::Takeover => store
            .extend(tenant, id, 0, None)
            .await?
            .map(|_| LostClaimSettledAs::LeaseEnded),
        LeaseExpiry::Hold => store
            .mark_unknown(
                tenant,
                id,
                "a later attempt's claim was lost with the store; an earlier attempt may have acted",
            )
            .await?
            .map(|_| LostClaimSettledAs::Unknown),
    };
    Ok(settled.map(|settled| (key_hash, settled)))
}
