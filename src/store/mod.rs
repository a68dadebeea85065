//! Where idempotency records live: the [`Store`] trait the engine drives, and its
//! implementations. SQL lives only below this module.

mod batch;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use batch::Batched;
#[cfg(feature = "postgres")]
pub use postgres::{PgSettings, PgStore};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;

/// The state of a key's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyState {
    /// Reserved: a holder owns the effect and has not committed its result yet.
    InFlight,
    /// The result is stored and is replayed to every retry.
    Completed,
}

impl KeyState {
    /// Reads the spelling stored in the database.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn parse(stored: &str) -> Result<KeyState> {
        match stored {
            "in_flight" => Ok(KeyState::InFlight),
            "completed" => Ok(KeyState::Completed),
            other => Err(StoreError::Other(format!("unknown key state {other:?}"))),
        }
    }

    /// The spelling used in the database and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyState::InFlight => "in_flight",
            KeyState::Completed => "completed",
        }
    }
}

/// A response as stored for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// Header lines in order, names as given.
    pub headers: Vec<(String, String)>,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// Rebuilds a stored response from its columns (headers as a JSON array
    /// of `[name, value]` pairs); `None` while the key is in flight.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn from_columns(
        status: Option<i64>,
        headers: Option<serde_json::Value>,
        body: Option<Vec<u8>>,
    ) -> Result<Option<StoredResponse>> {
        let Some(status) = status else {
            return Ok(None);
        };
        let headers = match headers {
            Some(h) => serde_json::from_value(h)
                .map_err(|e| StoreError::Other(format!("stored headers: {e}")))?,
            None => Vec::new(),
        };
        Ok(Some(StoredResponse {
            status: u16::try_from(status)
                .map_err(|_| StoreError::Other(format!("stored status {status}")))?,
            headers,
            body: body.unwrap_or_default(),
        }))
    }
}

/// Progress recorded by a holder inside a multi-step effect, handed to whoever
/// takes the key over after a crash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recovery {
    /// The name of the last step that completed (1 to 255 characters).
    pub recovery_point: String,
    /// Whatever the holder needs to resume from that step: any JSON value.
    #[serde(default)]
    pub data: Option<serde_json::Value>,
}

/// One key's record, as read from the store.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The tenant that owns the key.
    pub tenant: String,
    /// SHA-256 of the raw key.
    pub key_hash: Vec<u8>,
    /// The request fingerprint, when the first caller gave or implied one.
    pub fingerprint: Option<String>,
    /// In flight or completed.
    pub state: KeyState,
    /// The fencing token of the current holder.
    pub reservation_id: Uuid,
    /// When the current lease ends (in flight only).
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// 1 for the first holder, +1 for every takeover.
    pub attempt: i32,
    /// The last recovery point, if the holder recorded one.
    pub recovery: Option<Recovery>,
    /// The stored response (completed only).
    pub response: Option<StoredResponse>,
    /// When the key was first reserved; the TTL counts from here.
    pub created_at: DateTime<Utc>,
    /// When the response was stored.
    pub completed_at: Option<DateTime<Utc>>,
    /// Until then the key is remembered; from then on it is new again.
    pub expires_at: DateTime<Utc>,
}

/// What a reserve asks the store to do atomically.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// Scope of the key.
    pub tenant: String,
    /// SHA-256 of the raw key.
    pub key_hash: [u8; 32],
    /// The request's fingerprint, if any.
    pub fingerprint: Option<String>,
    /// The id to hand out if the claim succeeds.
    pub reservation_id: Uuid,
    /// Lease length for the new holder.
    pub lease_seconds: u32,
    /// TTL of a new record.
    pub ttl_seconds: u32,
    /// The tenant's limit of live in-flight keys: when set, the claim applies
    /// only while the tenant holds fewer (leases not ended). `Some(0)` claims
    /// nothing and only reads the record.
    pub max_in_flight: Option<u32>,
}

/// What the store found or did for a [`ClaimRequest`].
///
/// The store claims the key — inserts it, resets an expired record, or takes
/// over an in-flight one whose lease ended and whose fingerprint is compatible —
/// in one atomic step; otherwise it returns the record untouched. What the
/// record means for the caller is the engine's decision.
#[derive(Debug, Clone)]
pub struct Claim {
    /// True when this request now holds the key.
    pub claimed: bool,
    /// The record after the step.
    pub record: Record,
    /// The database's clock at the step: every process agrees on it.
    pub now: DateTime<Utc>,
}

/// A record found through one of its reservation ids (current or dead).
#[derive(Debug, Clone)]
pub struct Found {
    /// The key's record as it is now.
    pub record: Record,
    /// The database's clock.
    pub now: DateTime<Utc>,
}

/// A tenant's live in-flight keys: those whose lease has not ended.
#[derive(Debug, Clone, Copy)]
pub struct InFlightUsage {
    /// How many there are (counted up to the limit asked for).
    pub keys: u64,
    /// When the first of their leases ends.
    pub next_lease_end: Option<DateTime<Utc>>,
    /// The database's clock.
    pub now: DateTime<Utc>,
}

/// What a tenant's completed, unexpired records take in the store.
#[derive(Debug, Clone, Copy)]
pub struct StoredUsage {
    /// Bytes of stored responses: bodies and header lists, as stored.
    pub bytes: u64,
    /// When the first of those records expires, and its bytes stop counting.
    pub next_expiry: Option<DateTime<Utc>>,
    /// The database's clock.
    pub now: DateTime<Utc>,
}

/// What one pruning batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PruneBatch {
    /// Records deleted (with their reservation ids).
    pub deleted: u64,
    /// A full batch somewhere: more expired records may be left.
    pub more: bool,
    /// Parts of the database this batch could not reach (a Citus worker that
    /// is down): what went wrong there. Everything else was pruned.
    pub unreachable: Option<String>,
}

impl PruneBatch {
    /// A batch of one table: full when it deleted `limit` records.
    pub fn of(deleted: u64, limit: i64) -> PruneBatch {
        PruneBatch {
            deleted,
            more: deleted >= u64::try_from(limit).unwrap_or(0) && limit > 0,
            unreachable: None,
        }
    }
}

/// Connection pool figures for the metrics endpoint.
#[derive(Debug, Clone, Copy)]
pub struct PoolStats {
    /// Open connections.
    pub size: u32,
    /// Open connections not in use.
    pub idle: u32,
}

/// How the writes were batched, since the store was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Batches written (a write alone counts as one).
    pub batches: u64,
    /// Writes in them.
    pub writes: u64,
    /// The most writes in one batch.
    pub largest: u64,
    /// Writes refused because the queue was full.
    pub refused: u64,
}

/// One write of a batch (see [`Store::write_batch`]).
#[derive(Debug, Clone)]
pub enum Write {
    /// [`Store::reserve`].
    Claim(ClaimRequest),
    /// [`Store::complete`].
    Complete {
        /// The key's tenant.
        tenant: String,
        /// The holder's reservation id.
        reservation_id: Uuid,
        /// What to store.
        response: StoredResponse,
    },
    /// [`Store::release`].
    Release {
        /// The key's tenant.
        tenant: String,
        /// The holder's reservation id.
        reservation_id: Uuid,
    },
}

impl Write {
    /// The tenant the write is for.
    pub fn tenant(&self) -> &str {
        match self {
            Write::Claim(req) => &req.tenant,
            Write::Complete { tenant, .. } | Write::Release { tenant, .. } => tenant,
        }
    }
}

/// What one write of a batch did: what the one-by-one operation returns.
#[derive(Debug, Clone)]
pub enum Written {
    /// As [`Store::reserve`].
    Claim(Option<Claim>),
    /// As [`Store::complete`].
    Complete(Option<Record>),
    /// As [`Store::release`].
    Release(Option<Vec<u8>>),
}

/// Why a store operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or timed out: the caller should retry later.
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    /// Anything else: a bug or a schema mismatch.
    #[error("store error: {0}")]
    Other(String),
}

impl StoreError {
    /// What went wrong, without the "unavailable" / "store error" prefix:
    /// for a message that names the cause in its own words.
    pub fn reason(&self) -> &str {
        match self {
            StoreError::Unavailable(why) | StoreError::Other(why) => why,
        }
    }
}

/// Result of a store operation.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// How long the same cause of unavailability stays quiet after it was logged.
const REPEAT_AFTER: Duration = Duration::from_secs(60);

/// How many causes are remembered at once: enough for the few that can
/// alternate (a request's and `/readyz`'s view of one fault).
const CAUSES_KEPT: usize = 8;

/// A cause of unavailability logged at WARN: when, and how many times it
/// came back since without a line of its own.
struct Reported {
    why: String,
    at: Instant,
    quiet: u64,
}

static REPORTED: Mutex<Vec<Reported>> = Mutex::new(Vec::new());

/// Logs why the store is unavailable: at WARN the first time a cause comes
/// up, then at most once a minute while it lasts, with how many times it
/// came back meanwhile; DEBUG otherwise. During an outage every request
/// fails the same way, and one line per request would bury the line that
/// says what to do.
pub fn report_unavailable(why: &str) {
    let warn = {
        let mut reported = REPORTED.lock().unwrap_or_else(|e| e.into_inner());
        decide(&mut reported, why, Instant::now())
    };
    match warn {
        Some(0) => tracing::warn!(error = %why, "store unavailable"),
        Some(repeated) => tracing::warn!(error = %why, repeated, "store unavailable, still"),
        None => tracing::debug!(error = %why, "store unavailable (logged already)"),
    }
}

/// Whether `why`, seen at `now`, gets a WARN line: `Some(times it came back
/// unlogged since its last line)`, or `None` to stay quiet.
fn decide(reported: &mut Vec<Reported>, why: &str, now: Instant) -> Option<u64> {
    if let Some(r) = reported.iter_mut().find(|r| r.why == why) {
        if now.duration_since(r.at) < REPEAT_AFTER {
            r.quiet += 1;
            return None;
        }
        let repeated = r.quiet;
        r.at = now;
        r.quiet = 0;
        return Some(repeated);
    }
    if reported.len() >= CAUSES_KEPT
        && let Some(oldest) = (0..reported.len()).min_by_key(|&i| reported[i].at)
    {
        reported.swap_remove(oldest);
    }
    reported.push(Reported {
        why: why.to_owned(),
        at: now,
        quiet: 0,
    });
    Some(0)
}

/// The operations the engine needs, each one atomic across every process that
/// shares the database. Writes addressed by reservation id apply only while that
/// id is the key's current holder and the record has not expired; they return
/// `None` otherwise, and the engine asks [`Store::find_by_reservation`] why.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims the key or returns its record as it stands (see [`Claim`]).
    /// `None` only under [`ClaimRequest::max_in_flight`]: the limit kept the
    /// claim from applying and the key has no record.
    async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>>;
    /// Stores the response and completes the key.
    async fn complete(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        response: &StoredResponse,
    ) -> Result<Option<Record>>;
    /// Forgets an in-flight key: it is new again at once. Returns its key hash.
    async fn release(&self, tenant: &str, reservation_id: Uuid) -> Result<Option<Vec<u8>>>;
    /// Moves the lease end to now + `lease_seconds`.
    async fn extend(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        lease_seconds: u32,
    ) -> Result<Option<DateTime<Utc>>>;
    /// Records a recovery point.
    async fn checkpoint(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        recovery: &Recovery,
    ) -> Result<Option<Record>>;
    /// The record a reservation id belongs or belonged to, if it still exists.
    async fn find_by_reservation(
        &self,
        tenant: &str,
        reservation_id: Uuid,
    ) -> Result<Option<Found>>;
    /// Deletes up to about `limit` expired records without waiting on locked
    /// rows; says how many it deleted and whether more may be left.
    async fn prune_expired_batch(&self, limit: i64) -> Result<PruneBatch>;
    /// The tenant's live in-flight keys, counted up to `up_to`.
    async fn in_flight_usage(&self, tenant: &str, up_to: u32) -> Result<InFlightUsage>;
    /// What the tenant's completed, unexpired records take; this reads every
    /// one of them, so callers keep the answer a while.
    async fn stored_usage(&self, tenant: &str) -> Result<StoredUsage>;
    /// Succeeds when the database answers and holds the tables that every
    /// request needs: what readiness means.
    async fn ping(&self) -> Result<()>;
    /// Pool figures, where the store has a pool.
    fn pool_stats(&self) -> Option<PoolStats>;

    /// Applies `writes` in the order given, as if one by one (each sees what
    /// the ones before it did), in one transaction that has committed when
    /// this returns: one durable write for all of them. One answer per write,
    /// in order; an `Err` says that write's transaction failed and nothing is
    /// known of it (the caller then writes it alone). A store without
    /// transactions of its own keeps this default, which writes one by one.
    async fn write_batch(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        let mut answers = Vec::with_capacity(writes.len());
        for write in writes {
            answers.push(write_one(self, write).await);
        }
        answers
    }

    /// How many transactions of batched writes the store runs at once: one
    /// where there is one writer anyway (SQLite); more where a transaction
    /// that waits (on a row lock another process holds) must not hold up
    /// every other write of the process (PostgreSQL).
    fn batch_writers(&self) -> usize {
        1
    }

    /// How writes were batched, where they are (see [`Batched`]).
    fn batch_stats(&self) -> Option<BatchStats> {
        None
    }
}

/// `write` on its own, through the one-by-one operation of `store`
/// ([`Store::reserve`], [`Store::complete`] or [`Store::release`]).
pub async fn write_one<S: Store + ?Sized>(store: &S, write: &Write) -> Result<Written> {
    Ok(match write {
        Write::Claim(req) => Written::Claim(store.reserve(req).await?),
        Write::Complete {
            tenant,
            reservation_id,
            response,
        } => Written::Complete(store.complete(tenant, *reservation_id, response).await?),
        Write::Release {
            tenant,
            reservation_id,
        } => Written::Release(store.release(tenant, *reservation_id).await?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_is_logged_when_new_then_once_a_minute_while_it_lasts() {
        let mut reported = Vec::new();
        let t0 = Instant::now();
        let at = |secs| t0 + Duration::from_secs(secs);
        assert_eq!(decide(&mut reported, "a", t0), Some(0));
        for i in 1..=5 {
            assert_eq!(decide(&mut reported, "a", at(i)), None);
        }
        assert_eq!(
            decide(&mut reported, "b", at(6)),
            Some(0),
            "another cause is news"
        );
        assert_eq!(
            decide(&mut reported, "a", at(7)),
            None,
            "two causes that alternate are each logged once, not at every turn"
        );
        assert_eq!(
            decide(&mut reported, "a", at(61)),
            Some(6),
            "a minute on: one line, with the count of the quiet ones"
        );
        assert_eq!(decide(&mut reported, "a", at(62)), None);
        for (i, cause) in ["c", "d", "e", "f", "g", "h", "i", "j"].iter().enumerate() {
            assert_eq!(decide(&mut reported, cause, at(70 + i as u64)), Some(0));
        }
        assert!(reported.len() <= CAUSES_KEPT, "the memory is bounded");
    }
}
