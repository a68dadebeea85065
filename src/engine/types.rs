//! What goes into the engine and what comes out of it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::store::{ClaimedRequest, LeaseExpiry, Record, Recovery, StoreError};

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
    /// Whether `tenant` is derived from a credential (the hex SHA-256 the
    /// proxy and the layer make of it) rather than a name an operator gave
    /// (the reservation API's tokens): under sealing the engine keys such a
    /// tenant as it keys the key hash, so that a dump and a dictionary
    /// reveal no credential.
    pub tenant_from_credential: bool,
    /// SHA-256 of the raw key.
    pub key_hash: [u8; 32],
    /// The request's fingerprint, if known.
    pub fingerprint: Option<String>,
    /// Lease for a new holder (already within [`Limits`]).
    pub lease_seconds: u32,
    /// TTL for a new record (already within [`Limits`]).
    pub ttl_seconds: u32,
    /// How long to wait for an in-flight holder (`Prefer: wait`), capped by
    /// [`Limits::max_wait`]; `None` or zero answers at once.
    pub wait: Option<Duration>,
    /// What the caller's lease ending without news will mean, should it get
    /// the key.
    pub on_lease_expiry: LeaseExpiry,
    /// What the key is for, kept with its record if the caller gets it
    /// (sealed at rest when responses are): shown to the operator who
    /// settles the key should it get stuck.
    pub request: Option<ClaimedRequest>,
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
    /// The tenant the key's record is kept under, where that is not the
    /// request's own: a tenant derived from a credential is keyed under
    /// sealing ([`ReserveRequest::tenant_from_credential`]). The holder's
    /// commit, extend, release and checkpoint name this one.
    pub tenant: Option<String>,
}

/// What a reserve comes to.
#[derive(Debug, Clone)]
pub enum ReserveOutcome {
    /// New key, or takeover of one whose holder's lease ended.
    Reserved(Reservation),
    /// Completed before: replay the stored response.
    Completed(Box<Record>),
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
    /// Whether the key's effect happened is unknown (its holder marked it
    /// so, or its lease ended under [`LeaseExpiry::Hold`]): it is not run
    /// again until its holder or an operator settles it.
    Unknown {
        /// The record as it stands.
        record: Box<Record>,
    },
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

/// What a reservation id shows ([`Engine::get`](super::Engine::get)).
#[derive(Debug, Clone)]
pub enum Lookup {
    /// The key's record, and whether the id holds it live.
    Record {
        /// The record.
        record: Box<Record>,
        /// True while the id holds a live reservation of the key.
        live: bool,
        /// The database's clock when it was read.
        now: DateTime<Utc>,
    },
    /// The id's key expired or was released (it is forgotten, even before
    /// pruning deletes its row), or was reserved afresh by another request:
    /// nothing of the id is left to show.
    Gone,
}

/// A commit that stored its response: like every write of a holder, a
/// commit answers `Ok(Ok(_))`, `Ok(Err(Refusal))` (the id no longer holds
/// the key), or `Err` (the store could not answer).
#[derive(Debug, Clone)]
pub enum Committed {
    /// Stored now.
    Now(Record),
    /// The same response was stored earlier by this id: a commit sent again.
    Earlier(Record),
}

/// An engine error: only the store can fail.
pub type EngineError = StoreError;

impl ReserveOutcome {
    /// The outcome a door records for this decision: a reservation with
    /// `attempt > 1` took an abandoned key over.
    pub(crate) fn outcome(&self) -> crate::telemetry::Outcome {
        use crate::telemetry::Outcome;
        match self {
            ReserveOutcome::Reserved(r) if r.attempt > 1 => Outcome::Takeover,
            ReserveOutcome::Reserved(_) => Outcome::Created,
            ReserveOutcome::Completed(_) => Outcome::Replayed,
            ReserveOutcome::InFlight { .. } | ReserveOutcome::Unknown { .. } => Outcome::Conflict,
            ReserveOutcome::Mismatch => Outcome::Mismatch,
            ReserveOutcome::OverLimit { .. } => Outcome::Limited,
        }
    }
}
