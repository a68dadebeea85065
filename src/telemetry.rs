//! The metric series every door records, through the `metrics` facade: into
//! whatever recorder the application installed (the `server` feature's
//! Prometheus exporter in the binary). No key, token or body ever goes into a
//! log line or a label.

use std::time::Duration;

#[cfg(feature = "server")]
use crate::store::{BatchStats, PoolStats};

/// Describes every series to the installed recorder (help text and unit).
pub(crate) fn describe() {
    metrics::describe_counter!(
        "idemgate_requests_total",
        "Requests by door (mode) and idempotency outcome."
    );
    metrics::describe_histogram!(
        "idemgate_request_duration_seconds",
        metrics::Unit::Seconds,
        "Time spent deciding a request, by door and outcome."
    );
    metrics::describe_counter!("idemgate_pruned_total", "Expired records deleted.");
    metrics::describe_gauge!(
        "idemgate_keys_unknown",
        "Keys nobody will settle by themselves — unknown, or in flight past their lease — as \
         of the last pruning pass: they wait for an operator (idemgate keys list --state \
         unknown)."
    );
    metrics::describe_counter!(
        "idemgate_replay_cache_hits_total",
        "Reserves of a completed key answered from the in-process replay cache, without a \
         database round trip."
    );
    metrics::describe_counter!(
        "idemgate_replay_cache_misses_total",
        "Reserves the in-process replay cache could not answer (a new key, one in flight, or \
         a completed one not cached here), which went to the database; with \
         idemgate_replay_cache_hits_total, the cache's hit ratio. 0 with the cache off."
    );
    metrics::describe_counter!(
        "idemgate_store_errors_total",
        "Answers a store failure produced, by kind: unavailable (503 store-unavailable: the \
         database cannot be reached or timed out) or other (500: a bug or a schema mismatch)."
    );
    metrics::describe_gauge!(
        "idemgate_store_up",
        "1 if the store answered a ping at the last scrape of /metrics (or the last /readyz), \
         0 if not."
    );
    metrics::describe_counter!(
        "idemgate_store_batches_total",
        "Transactions that wrote claims, commits and releases (a write alone is one)."
    );
    metrics::describe_counter!(
        "idemgate_store_batched_writes_total",
        "Claims, commits and releases written in those transactions: divided by \
         idemgate_store_batches_total, the mean batch size."
    );
    metrics::describe_gauge!(
        "idemgate_store_batch_largest",
        "The most writes one transaction carried since start-up."
    );
    metrics::describe_counter!(
        "idemgate_store_writes_refused_total",
        "Writes refused with 503 because the store's write queue was full."
    );
    metrics::describe_gauge!(
        "idemgate_db_pool_connections",
        "Database pool connections by state (idle, active)."
    );
    metrics::describe_counter!(
        "idemgate_mcp_notifications_dropped_total",
        "Guarded MCP tool calls sent as JSON-RPC notifications (without an id, alone or in a \
         batch): answered 202 and never forwarded."
    );
    // Counters of the process, at 0 from start-up like the doors' series, so
    // that an alert on `rate()` or `increase()` works before the first event.
    metrics::counter!("idemgate_replay_cache_hits_total").increment(0);
    metrics::counter!("idemgate_replay_cache_misses_total").increment(0);
    metrics::counter!("idemgate_mcp_notifications_dropped_total").increment(0);
    for kind in StoreErrorKind::ALL {
        metrics::counter!("idemgate_store_errors_total", "kind" => kind.as_str()).increment(0);
    }
}

/// The outcome of a request, the `outcome` label of `idemgate_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A new key was reserved.
    Created,
    /// A stored response was replayed.
    Replayed,
    /// 409: another holder is in flight.
    Conflict,
    /// 422: the key was reused with another payload.
    Mismatch,
    /// 400: no key where one is required.
    Missing,
    /// 400: a malformed key (`key-invalid`), or on the reservation API a
    /// request body or field it cannot take (`invalid-request`).
    Invalid,
    /// An expired lease was taken over.
    Takeover,
    /// A key was released.
    Released,
    /// Not guarded: passed straight through.
    Passthrough,
    /// 429: the tenant is at one of its limits; nothing was reserved.
    Limited,
    /// 412: the request's first attempt is older than keys are remembered;
    /// nothing was reserved.
    TooOld,
}

impl Outcome {
    /// Every outcome.
    pub const ALL: [Outcome; 11] = [
        Outcome::Created,
        Outcome::Replayed,
        Outcome::Conflict,
        Outcome::Mismatch,
        Outcome::Missing,
        Outcome::Invalid,
        Outcome::Takeover,
        Outcome::Released,
        Outcome::Passthrough,
        Outcome::Limited,
        Outcome::TooOld,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Created => "created",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::Mismatch => "mismatch",
            Outcome::Missing => "missing",
            Outcome::Invalid => "invalid",
            Outcome::Takeover => "takeover",
            Outcome::Released => "released",
            Outcome::Passthrough => "passthrough",
            Outcome::Limited => "limited",
            Outcome::TooOld => "too_old",
        }
    }
}

impl Outcome {
    /// OASIS Repeatable Requests' `Repeatability-Result` for a request that
    /// came to this: `accepted` when the answer is the request's own result
    /// (its execution, its replay, or the `409` while it runs), `rejected`
    /// when its id or first-sent time was refused; none when the request was
    /// not considered at all (not guarded, or over a tenant limit).
    pub(crate) fn repeatability_result(self) -> Option<&'static str> {
        match self {
            Outcome::Created
            | Outcome::Replayed
            | Outcome::Conflict
            | Outcome::Takeover
            | Outcome::Released => Some("accepted"),
            Outcome::Mismatch | Outcome::Invalid | Outcome::Missing | Outcome::TooOld => {
                Some("rejected")
            }
            Outcome::Passthrough | Outcome::Limited => None,
        }
    }
}

/// Exports every `(mode, outcome)` series of a door at 0, so that a
/// dashboard or an alert on `rate()` works before the first request of each
/// kind. A no-op until a recorder is installed.
pub fn register_door(mode: &'static str, outcomes: &[Outcome]) {
    describe();
    for outcome in outcomes {
        let labels = [("mode", mode), ("outcome", outcome.as_str())];
        metrics::counter!("idemgate_requests_total", &labels).increment(0);
    }
}

/// Counts one request of door `mode` and how long its decision took.
pub fn record(mode: &'static str, outcome: Outcome, elapsed: Duration) {
    let labels = [("mode", mode), ("outcome", outcome.as_str())];
    metrics::counter!("idemgate_requests_total", &labels).increment(1);
    metrics::histogram!("idemgate_request_duration_seconds", &labels).record(elapsed.as_secs_f64());
}

/// Counts pruned records.
pub fn record_pruned(n: u64) {
    metrics::counter!("idemgate_pruned_total").increment(n);
}

/// Sets the gauge of keys whose outcome is unknown.
pub fn record_unknown(n: u64) {
    metrics::gauge!("idemgate_keys_unknown").set(n as f64);
}

/// Guarded MCP tool calls sent as notifications, dropped by the MCP door.
#[cfg(feature = "server")]
pub fn record_mcp_notifications_dropped(n: u64) {
    metrics::counter!("idemgate_mcp_notifications_dropped_total").increment(n);
}

/// Counts one reserve answered from the replay cache.
pub fn record_replay_cache_hit() {
    metrics::counter!("idemgate_replay_cache_hits_total").increment(1);
}

/// Counts one reserve the replay cache (when on) could not answer.
pub fn record_replay_cache_miss() {
    metrics::counter!("idemgate_replay_cache_misses_total").increment(1);
}

/// The `kind` label of `idemgate_store_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// The store cannot be reached or timed out: `503 store-unavailable`.
    Unavailable,
    /// Anything else: a `500`.
    Other,
}

impl StoreErrorKind {
    /// Every kind.
    pub const ALL: [StoreErrorKind; 2] = [StoreErrorKind::Unavailable, StoreErrorKind::Other];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreErrorKind::Unavailable => "unavailable",
            StoreErrorKind::Other => "other",
        }
    }
}

/// Counts one answer a store failure produced.
pub fn record_store_error(kind: StoreErrorKind) {
    metrics::counter!("idemgate_store_errors_total", "kind" => kind.as_str()).increment(1);
}

/// Sets the gauge of whether the store answered its last ping.
#[cfg(feature = "server")]
pub fn record_store_up(up: bool) {
    metrics::gauge!("idemgate_store_up").set(if up { 1.0 } else { 0.0 });
}

/// Publishes how the store batched its writes.
#[cfg(feature = "server")]
pub fn record_batches(stats: BatchStats) {
    metrics::counter!("idemgate_store_batches_total").absolute(stats.batches);
    metrics::counter!("idemgate_store_batched_writes_total").absolute(stats.writes);
    metrics::gauge!("idemgate_store_batch_largest").set(stats.largest as f64);
    metrics::counter!("idemgate_store_writes_refused_total").absolute(stats.refused);
}

/// Publishes the pool gauges.
#[cfg(feature = "server")]
pub fn record_pool(stats: PoolStats) {
    let idle = f64::from(stats.idle);
    let active = f64::from(stats.size.saturating_sub(stats.idle));
    metrics::gauge!("idemgate_db_pool_connections", "state" => "idle").set(idle);
    metrics::gauge!("idemgate_db_pool_connections", "state" => "active").set(active);
}
