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
    /// The effect may or may not have happened, and nobody holds the key to
    /// find out: every request with it is refused until its holder's late
    /// commit or release, or an operator, settles it. Stored when a holder
    /// marks its key so; a key in flight under [`LeaseExpiry::Hold`] whose
    /// lease ended is unknown too (see [`Record::effective_state`]).
    Unknown,
}

impl KeyState {
    /// Reads the spelling stored in the database.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn parse(stored: &str) -> Result<KeyState> {
        match stored {
            "in_flight" => Ok(KeyState::InFlight),
            "completed" => Ok(KeyState::Completed),
            "unknown" => Ok(KeyState::Unknown),
            other => Err(StoreError::other(format!("unknown key state {other:?}"))),
        }
    }

    /// The spelling used in the database and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyState::InFlight => "in_flight",
            KeyState::Completed => "completed",
            KeyState::Unknown => "unknown",
        }
    }
}

/// What becomes of a key in flight whose lease ends without a commit or a
/// release: chosen by the holder when it reserves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseExpiry {
    /// The next request with the key takes it over (`attempt` + 1, the
    /// recovery point handed on): for a holder that reconciles before it
    /// mutates again, or an origin that dedupes on the key itself.
    #[default]
    Takeover,
    /// The key's outcome is unknown: it is never run again by itself, and
    /// waits for its holder's late commit or release, or an operator.
    Hold,
}

impl LeaseExpiry {
    /// Reads the spelling stored in the database and used in settings.
    pub fn parse(text: &str) -> std::result::Result<LeaseExpiry, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "takeover" => Ok(LeaseExpiry::Takeover),
            "hold" => Ok(LeaseExpiry::Hold),
            other => Err(format!("{other:?} is not `hold` or `takeover`")),
        }
    }

    /// The spelling used in the database, in JSON and in settings.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseExpiry::Takeover => "takeover",
            LeaseExpiry::Hold => "hold",
        }
    }
}

/// How an operator settled a stuck key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResolveAction {
    /// Nothing happened: the key is forgotten and the next request executes.
    Release,
    /// This is what happened: the given response is stored and replayed.
    Complete,
}

impl ResolveAction {
    /// Reads the spelling stored in the database.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn parse(stored: &str) -> Result<ResolveAction> {
        match stored {
            "release" => Ok(ResolveAction::Release),
            "complete" => Ok(ResolveAction::Complete),
            other => Err(StoreError::other(format!("unknown resolution {other:?}"))),
        }
    }

    /// The spelling used in the database and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            ResolveAction::Release => "release",
            ResolveAction::Complete => "complete",
        }
    }
}

/// Who settled a stuck key, when, how and why: kept with its record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolution {
    /// Released or completed.
    pub action: ResolveAction,
    /// Why, in the operator's words.
    pub reason: String,
    /// Who: the admin token's name, or the user of the command line.
    pub by: String,
    /// When, by the database's clock.
    pub at: DateTime<Utc>,
}

impl Resolution {
    /// Rebuilds a resolution from its columns; `None` when the record was
    /// never resolved.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn from_columns(
        action: Option<String>,
        reason: Option<String>,
        by: Option<String>,
        at: Option<DateTime<Utc>>,
    ) -> Result<Option<Resolution>> {
        let (Some(action), Some(at)) = (action, at) else {
            return Ok(None);
        };
        Ok(Some(Resolution {
            action: ResolveAction::parse(&action)?,
            reason: reason.unwrap_or_default(),
            by: by.unwrap_or_default(),
            at,
        }))
    }
}

/// Why and when a key's holder marked it unknown: kept with its record for
/// the operator who settles it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkedUnknown {
    /// The holder's words: what failed (an exception's type, never a body).
    pub reason: String,
    /// When, by the store's clock.
    pub at: DateTime<Utc>,
}

impl MarkedUnknown {
    /// Rebuilds the mark from its columns: `None` when the record was never
    /// marked, or was marked by a holder whose key has since been reserved
    /// afresh (`marked_by` is not the record's `holder`).
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn from_columns(
        reason: Option<String>,
        at: Option<DateTime<Utc>>,
        marked_by: Option<Uuid>,
        holder: Uuid,
    ) -> Option<MarkedUnknown> {
        match (reason, at, marked_by) {
            (Some(reason), Some(at), Some(by)) if by == holder => {
                Some(MarkedUnknown { reason, at })
            }
            _ => None,
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
    /// Body bytes: cloned by a reference count, not a copy, as the answer,
    /// the store's write and the replay cache each keep it.
    pub body: bytes::Bytes,
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
            body: body.map(bytes::Bytes::from).unwrap_or_default(),
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

/// What a key was for: the request that claimed it, kept with its record so
/// that an operator settling it can find that call in the provider's books
/// (its method and path), in the traces (its trace id) and in the caller's
/// own words (its label). Never its body or headers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimedRequest {
    /// The request's method, as sent; empty where the caller described no
    /// request (a reservation that gave only a label).
    #[serde(default)]
    pub method: String,
    /// Its path with its query, as sent; empty with the method.
    #[serde(default)]
    pub path: String,
    /// The W3C trace id of the request that claimed the key (32 lowercase
    /// hex digits), when it carried a `traceparent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// What the caller calls the key, for a person (an order id, a job
    /// name): the reservation API's `label`, at most
    /// [`ClaimedRequest::MAX_LABEL_CHARS`] characters. Never part of the
    /// fingerprint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
}

impl ClaimedRequest {
    /// A method and path as a door read them, with the trace id of a W3C
    /// `traceparent` value (`00-<trace id>-<parent id>-<flags>`), if it is
    /// one. The method is cut at 32 bytes and the path at 2048, at a
    /// character boundary: a label, not a copy.
    pub fn new(method: &str, path: &str, traceparent: Option<&str>) -> ClaimedRequest {
        ClaimedRequest {
            method: cut(method, 32).to_owned(),
            path: cut(path, 2048).to_owned(),
            trace_id: traceparent.and_then(trace_id),
            label: None,
        }
    }

    /// The most characters a label holds (SPEC §5).
    pub const MAX_LABEL_CHARS: usize = 200;

    /// The same, with the caller's `label`.
    pub fn labelled(self, label: Option<String>) -> ClaimedRequest {
        ClaimedRequest { label, ..self }
    }

    /// Whether it names a request (a method and path), rather than only a
    /// label or a trace.
    pub fn names_a_request(&self) -> bool {
        !self.method.is_empty()
    }

    /// Its stored form, unsealed: JSON.
    pub(crate) fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("strings serialize")
    }
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The trace id of a W3C `traceparent` header value: 32 lowercase hex
/// digits, not all zero, in a value of version `00` or a later one.
fn trace_id(traceparent: &str) -> Option<String> {
    let mut parts = traceparent.trim().split('-');
    let version = parts.next()?;
    let id = parts.next()?;
    let hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    (version.len() == 2
        && hex(version)
        && version != "ff"
        && id.len() == 32
        && hex(id)
        && id.bytes().any(|b| b != b'0'))
    .then(|| id.to_owned())
}

/// A [`ClaimedRequest`] as a store keeps it: in the clear, or sealed at rest
/// (see [`crate::seal`]) when responses are. The stores keep it as bytes:
/// JSON (an object: its first byte is `{`), or a sealed blob (whose first
/// byte is its format's version, 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeptRequest {
    /// In the clear.
    Open(ClaimedRequest),
    /// Sealed: opened by the engine with the seal key.
    Sealed(Vec<u8>),
}

impl KeptRequest {
    /// Reads the stored bytes.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn from_column(bytes: Option<Vec<u8>>) -> Option<KeptRequest> {
        let bytes = bytes?;
        if bytes.first() == Some(&b'{')
            && let Ok(open) = serde_json::from_slice(&bytes)
        {
            return Some(KeptRequest::Open(open));
        }
        Some(KeptRequest::Sealed(bytes))
    }

    /// The bytes to store.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn to_column(&self) -> Vec<u8> {
        match self {
            KeptRequest::Open(open) => open.to_json(),
            KeptRequest::Sealed(blob) => blob.clone(),
        }
    }

    /// The request, if it is in the clear.
    pub fn open(&self) -> Option<&ClaimedRequest> {
        match self {
            KeptRequest::Open(open) => Some(open),
            KeptRequest::Sealed(_) => None,
        }
    }
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
    /// In flight, completed or unknown, as stored (see
    /// [`Record::effective_state`]).
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
    /// What its lease's end without news means, as its holder chose.
    pub on_lease_expiry: LeaseExpiry,
    /// How an operator settled it, if one did.
    pub resolution: Option<Resolution>,
    /// Why and when its current holder marked it unknown, if it did. A
    /// record a claim hands back does not carry it (`None`): a claim that
    /// finds the key unknown answers so without needing why; a lookup
    /// ([`HotPath::find_by_reservation`](super::HotPath::find_by_reservation),
    /// [`Queries::find_key`](super::Queries::find_key), a listing) does.
    pub marked_unknown: Option<MarkedUnknown>,
    /// What the key was for, where the door that claimed it knew (the proxy
    /// and the layer always; the reservation API when the reserve described
    /// its request). Like [`Record::marked_unknown`], a record a claim or a
    /// commit hands back does not carry it: the operators' lookups do.
    pub request: Option<KeptRequest>,
}

impl Record {
    /// The state the record is in at `now`: a key in flight under
    /// [`LeaseExpiry::Hold`] whose lease has ended is [`KeyState::Unknown`]
    /// (nobody holds it, and its effect may have happened).
    pub fn effective_state(&self, now: DateTime<Utc>) -> KeyState {
        match self.state {
            KeyState::InFlight if self.held_past_lease(now) => KeyState::Unknown,
            state => state,
        }
    }

    /// In flight under [`LeaseExpiry::Hold`], its lease ended at `now`.
    pub fn held_past_lease(&self, now: DateTime<Utc>) -> bool {
        self.state == KeyState::InFlight
            && self.on_lease_expiry == LeaseExpiry::Hold
            && self.lease_expires_at.is_none_or(|end| end <= now)
    }

    /// Whether no claim can apply to it at `now`, whatever its fingerprint:
    /// alive, and completed, unknown, or in flight under a live lease or
    /// held past it. Only its holder's commit or release, or an operator,
    /// changes such a record.
    pub fn refuses_claims(&self, now: DateTime<Utc>) -> bool {
        now < self.expires_at
            && match self.state {
                KeyState::Completed | KeyState::Unknown => true,
                KeyState::InFlight => {
                    self.lease_expires_at.is_some_and(|end| end > now) || self.held_past_lease(now)
                }
            }
    }

    /// Whether an operator may settle it at `now`: alive, and unknown or in
    /// flight past its lease (nobody will settle it by themselves).
    pub fn is_stuck(&self, now: DateTime<Utc>) -> bool {
        now < self.expires_at
            && match self.state {
                KeyState::Unknown => true,
                KeyState::InFlight => self.lease_expires_at.is_none_or(|end| end <= now),
                KeyState::Completed => false,
            }
    }
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
    /// What the new holder's lease ending without news will mean.
    pub on_lease_expiry: LeaseExpiry,
    /// The tenant's limit of live in-flight keys: when set, the claim applies
    /// only while the tenant holds fewer (leases not ended). `Some(0)` claims
    /// nothing and only reads the record.
    pub max_in_flight: Option<u32>,
    /// What the key is for, kept with the record by the claim that applies
    /// (a new key, a reset, a takeover); `None` keeps nothing.
    pub request: Option<KeptRequest>,
}

/// What the store found or did for a [`ClaimRequest`].
///
/// The store claims the key — inserts it, resets an expired record, or takes
/// over an in-flight one whose lease ended under [`LeaseExpiry::Takeover`]
/// and whose fingerprint is compatible —
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

/// Which records an operator's listing asks for (see
/// [`Queries::list_keys`](super::Queries::list_keys)): alive ones only, oldest
/// first, in pages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyQuery {
    /// Only records in this effective state ([`Record::effective_state`]):
    /// `Unknown` includes keys held past their lease, `InFlight` excludes
    /// them.
    pub state: Option<KeyState>,
    /// Only records that wait for a person (with `state` `None`): unknown,
    /// or in flight past their lease under either choice — what
    /// [`Queries::count_stuck`](super::Queries::count_stuck) counts.
    pub stuck: bool,
    /// Only this tenant's.
    pub tenant: Option<String>,
    /// Only records created at least this long ago.
    pub older_than: Option<std::time::Duration>,
    /// At most this many (at least 1).
    pub limit: u32,
    /// Only records after this one in the listing's order.
    pub after: Option<KeyCursor>,
}

/// A place in the listing's order: (created_at, tenant, key hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyCursor {
    /// The last record's `created_at`.
    pub created_at: DateTime<Utc>,
    /// Its tenant.
    pub tenant: String,
    /// Its key hash.
    pub key_hash: Vec<u8>,
}

impl KeyQuery {
    /// The listing's filter as its statements spell it: a state, `stuck`,
    /// or none.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn state_text(&self) -> Option<&'static str> {
        match (self.state, self.stuck) {
            (Some(state), _) => Some(state.as_str()),
            (None, true) => Some("stuck"),
            (None, false) => None,
        }
    }
}

impl KeyCursor {
    /// The cursor just after `record`.
    pub fn after(record: &Record) -> KeyCursor {
        KeyCursor {
            created_at: record.created_at,
            tenant: record.tenant.clone(),
            key_hash: record.key_hash.clone(),
        }
    }
}

/// One page of a listing.
#[derive(Debug, Clone)]
pub struct KeyPage {
    /// The records, oldest first.
    pub records: Vec<Record>,
    /// The database's clock when they were read.
    pub now: DateTime<Utc>,
}

/// An operator's settlement of a stuck key, as the store applies it.
#[derive(Debug, Clone)]
pub struct Resolve {
    /// The key's tenant.
    pub tenant: String,
    /// Its key hash.
    pub key_hash: Vec<u8>,
    /// The reservation id the record had when the operator looked: the
    /// settlement applies only while it still has it.
    pub reservation_id: Uuid,
    /// Release or complete.
    pub action: ResolveAction,
    /// For [`ResolveAction::Complete`]: the response to store.
    pub response: Option<StoredResponse>,
    /// Why.
    pub reason: String,
    /// Who.
    pub by: String,
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

/// One write of a batch (see [`HotPath::write_batch`](super::HotPath::write_batch)).
#[derive(Debug, Clone)]
pub enum Write {
    /// [`HotPath::reserve`](super::HotPath::reserve).
    Claim(ClaimRequest),
    /// [`HotPath::complete`](super::HotPath::complete).
    Complete {
        /// The key's tenant.
        tenant: String,
        /// The holder's reservation id.
        reservation_id: Uuid,
        /// What to store.
        response: StoredResponse,
    },
    /// [`HotPath::release`](super::HotPath::release).
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
    /// As [`HotPath::reserve`](super::HotPath::reserve).
    Claim(Option<Claim>),
    /// As [`HotPath::complete`](super::HotPath::complete).
    Complete(Option<Record>),
    /// As [`HotPath::release`](super::HotPath::release).
    Release(Option<Vec<u8>>),
}
