//! What a store holds and hands back: records, their states and stored
//! responses, and the requests and answers of its operations.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{Result, StoreError};

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
            other => Err(StoreError::other(format!("unknown key state {other:?}"))),
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
                .map_err(|e| StoreError::other(format!("stored headers: {e}")).because(e))?,
            None => Vec::new(),
        };
        Ok(Some(StoredResponse {
            status: u16::try_from(status)
                .map_err(|_| StoreError::other(format!("stored status {status}")))?,
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

/// One write of a batch (see [`Store::write_batch`](super::Store::write_batch)).
#[derive(Debug, Clone)]
pub enum Write {
    /// [`Store::reserve`](super::Store::reserve).
    Claim(ClaimRequest),
    /// [`Store::complete`](super::Store::complete).
    Complete {
        /// The key's tenant.
        tenant: String,
        /// The holder's reservation id.
        reservation_id: Uuid,
        /// What to store.
        response: StoredResponse,
    },
    /// [`Store::release`](super::Store::release).
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
    /// As [`Store::reserve`](super::Store::reserve).
    Claim(Option<Claim>),
    /// As [`Store::complete`](super::Store::complete).
    Complete(Option<Record>),
    /// As [`Store::release`](super::Store::release).
    Release(Option<Vec<u8>>),
}
