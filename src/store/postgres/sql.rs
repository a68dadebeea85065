//! The statements of the PostgreSQL store, each a `&'static str` put
//! together at compile time (`concat!`), as the SQLite store's are, from the
//! one column list both stores read (`key_columns!` in `store`). The pruning
//! statement alone is built once at run time: Citus needs the same text with
//! its shard placeholders and a per-shard limit (`citus::prune_shards_sql`).
//!
//! The public functions give tools the exact text the store sends (the
//! benchmark's raw-SQL bound, the Citus plan checks).

use std::sync::LazyLock;

use super::citus;
use crate::store::key_columns;

/// The columns of [`key_columns!`] as the claim functions return them: all
/// but the holder's mark (`unknown_*`, migration
/// `20261206000001_marked_unknown.sql`) and the request the key is for
/// (`20261209000001_claimed_request.sql`), which they do not return and
/// which read as none. A claim that finds its key unknown answers so without
/// needing why; the operator's lookups read the mark from the table.
macro_rules! claimed_columns {
    () => {
        concat!(
            "tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt, \
             recovery_point, recovery_data, response_status, response_headers, response_body, \
             created_at, completed_at, expires_at, on_lease_expiry, resolved_action, \
             resolved_reason, resolved_by, resolved_at, NULL::text AS unknown_reason, \
             NULL::timestamptz AS unknown_at, NULL::uuid AS unknown_reservation_id, \
             NULL::bytea AS request"
        )
    };
}

/// [`key_columns!`] as a commit returns them: the response's headers and
/// body as NULL, since the caller has just sent them, and no request (only
/// the operators' lookups read it).
macro_rules! completed_columns {
    () => {
        concat!(
            "tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt, \
             recovery_point, recovery_data, response_status, NULL::jsonb AS response_headers, \
             NULL::bytea AS response_body, created_at, completed_at, expires_at, on_lease_expiry, \
             resolved_action, resolved_reason, resolved_by, resolved_at, unknown_reason, unknown_at, \
             unknown_reservation_id, NULL::bytea AS request"
        )
    };
}

// The claim (migration `20261207000001_one_table.sql`): insert a new record,
// or, under its row lock, reset an expired one or take over an in-flight one
// whose lease ended under 'takeover', keeping the id it replaces; else read
// the record as it stands. `$7` is the tenant's limit of live in-flight keys,
// NULL for none; `$8` the new holder's `on_lease_expiry`; `$9` the request
// the key is for, as kept (migration `20261209000001_claimed_request.sql`). A function, so that
// it is one router call on Citus too: see the migration.
pub(super) const RESERVE: &str = concat!(
    "SELECT claimed, db_now, ",
    claimed_columns!(),
    " FROM idemgate_reserve($1, $2, $3, $4, $5, $6, $7, $8, $9)"
);

// Claims, commits and releases in one call (the same migration); the arrays
// hold one item per write, NULL where a kind of write has no such argument.
pub(super) const WRITE_BATCH: &str = concat!(
    "SELECT ord, claimed, db_now, ",
    claimed_columns!(),
    " FROM idemgate_write_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"
);

pub(super) static PRUNE: LazyLock<String> = LazyLock::new(|| {
    citus::prune_sql(
        "idempotency_keys",
        "idempotency_reservations",
        "now()",
        "$1",
    )
});

/// Restricts a statement on `idempotency_keys k` to the row whose current
/// holder is reservation `$2` of tenant `$1` (found by the index
/// `idempotency_keys_reservation`), while the record is alive and in one of
/// the `states` (an SQL list).
macro_rules! current_holder {
    ($states:literal) => {
        concat!(
            "k.tenant = $1 AND k.reservation_id = $2
           AND k.state IN (",
            $states,
            ") AND k.expires_at > now()"
        )
    };
}

// A commit or a release settles the key its holder marked unknown too: its
// reservation id is still the current one.
// Not returning the response it has just been sent (the caller has it): the
// store puts it back into the record.
// The lease's end stays, and `limited` is false over false unless a tenant
// limit applied: no column an index reads changes, so the update is
// heap-only (migration 20261210000001_heap_only_commit.sql).
pub(super) const COMPLETE: &str = concat!(
    "UPDATE idempotency_keys k SET state = 'completed', response_status = $3,
            response_headers = $4, response_body = $5, completed_at = now(),
            limited = false
      WHERE ",
    current_holder!("'in_flight', 'unknown'"),
    " RETURNING ",
    completed_columns!()
);

pub(super) const RELEASE: &str = concat!(
    "UPDATE idempotency_keys k SET expires_at = now(), lease_expires_at = now(), limited = false
      WHERE ",
    current_holder!("'in_flight', 'unknown'"),
    " RETURNING k.key_hash"
);

// `$3` the holder's reason. A key this holder marked already keeps its first
// reason and time; a mark an earlier holder left is overwritten. LEAST, not a
// CASE around now(): Citus refuses a function that is not immutable inside a
// CASE or COALESCE of a distributed UPDATE, and a first mark is never later
// than now().
pub(super) const MARK_UNKNOWN: &str = concat!(
    "UPDATE idempotency_keys k SET state = 'unknown',
            unknown_reason = CASE WHEN k.unknown_reservation_id IS NOT DISTINCT FROM $2
                                  AND k.state = 'unknown' THEN k.unknown_reason ELSE $3 END,
            unknown_at = LEAST(CASE WHEN k.unknown_reservation_id IS NOT DISTINCT FROM $2
                                    AND k.state = 'unknown' THEN k.unknown_at END, now()),
            unknown_reservation_id = $2
      WHERE ",
    current_holder!("'in_flight', 'unknown'"),
    " RETURNING k.key_hash"
);

// $4: what the lease's end will mean from now on, else as it was (NULL).
pub(super) const EXTEND: &str = concat!(
    "UPDATE idempotency_keys k SET lease_expires_at = now() + make_interval(secs => $3),
            on_lease_expiry = COALESCE($4, k.on_lease_expiry) WHERE ",
    current_holder!("'in_flight'"),
    " RETURNING k.lease_expires_at"
);

pub(super) const CHECKPOINT: &str = concat!(
    "UPDATE idempotency_keys k SET recovery_point = $3, recovery_data = $4 WHERE ",
    current_holder!("'in_flight'"),
    " RETURNING ",
    key_columns!()
);

// The record reservation `$2` holds, else the one it held before a claim
// superseded it (migration `20261207000001_one_table.sql`). Both ways lead
// to one record: an id is handed out once.
pub(super) const FIND: &str = concat!(
    "SELECT now() AS db_now, ",
    key_columns!(),
    " FROM idempotency_keys k
      WHERE k.tenant = $1
        AND (k.reservation_id = $2
             OR k.key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                               WHERE r.tenant = $1 AND r.reservation_id = $2))
      LIMIT 1"
);

pub(super) const FIND_KEY: &str = concat!(
    "SELECT now() AS db_now, ",
    key_columns!(),
    " FROM idempotency_keys k WHERE k.tenant = $1 AND k.key_hash = $2"
);

/// An alive record that is unknown: marked so, or in flight past its lease
/// under 'hold'.
macro_rules! unknown {
    () => {
        "(k.state = 'unknown'
          OR (k.state = 'in_flight' AND k.on_lease_expiry = 'hold'
              AND k.lease_expires_at <= now()))"
    };
}

/// The operators' listing: alive records, oldest first, after the cursor
/// `($5, $6, $7)` (NULLs: from the start). `$1` the effective state (NULL:
/// any), `$2` the tenant (NULL: any), `$3` the least age in seconds (NULL:
/// any), `$4` the page's size.
pub(super) const LIST_KEYS: &str = concat!(
    "SELECT now() AS db_now, ",
    key_columns!(),
    " FROM idempotency_keys k
      WHERE k.expires_at > now()
        AND ($2::text IS NULL OR k.tenant = $2)
        AND ($3::float8 IS NULL OR k.created_at <= now() - make_interval(secs => $3))
        AND ($5::timestamptz IS NULL OR (k.created_at, k.tenant, k.key_hash) > ($5, $6, $7))
        AND CASE $1::text
              WHEN 'unknown' THEN ",
    unknown!(),
    "
              WHEN 'in_flight' THEN k.state = 'in_flight' AND NOT ",
    unknown!(),
    "
              WHEN 'completed' THEN k.state = 'completed'
              WHEN 'stuck' THEN k.state = 'unknown' OR (k.state = 'in_flight' AND k.lease_expires_at <= now())
              ELSE true END
      ORDER BY k.created_at, k.tenant, k.key_hash
      LIMIT $4"
);

/// A record nobody will settle by itself: alive, and unknown or in flight
/// past its lease (under either choice).
macro_rules! stuck_now {
    () => {
        "k.expires_at > now()
         AND (k.state = 'unknown' OR (k.state = 'in_flight' AND k.lease_expires_at <= now()))"
    };
}

/// Every stuck key, by reading every alive one: a process's first count
/// (`stuck.rs`).
pub(super) const STUCK_ALL: &str = concat!(
    "SELECT k.tenant, k.key_hash FROM idempotency_keys k WHERE ",
    stuck_now!()
);

/// The stuck keys among those whose lease ended in `($1, $2]` (through
/// `idempotency_keys_lease_end`) or that a holder marked unknown (through
/// `idempotency_keys_marked_unknown`).
pub(super) const STUCK_SINCE: &str = concat!(
    "SELECT k.tenant, k.key_hash FROM idempotency_keys k
      WHERE ((k.lease_expires_at > $1 AND k.lease_expires_at <= $2)
             OR k.unknown_at IS NOT NULL)
        AND ",
    stuck_now!()
);

/// Which of tenant `$1`'s keys `$2` (key hashes) are still stuck.
pub(super) const STUCK_STILL: &str = concat!(
    "SELECT k.key_hash FROM idempotency_keys k
      WHERE k.tenant = $1 AND k.key_hash = ANY($2) AND ",
    stuck_now!()
);

/// The settlement applies to the record of `($1, $2)` while it still has
/// reservation id `$3` and is stuck: alive, and unknown or in flight past
/// its lease.
macro_rules! stuck {
    () => {
        "k.tenant = $1 AND k.key_hash = $2 AND k.reservation_id = $3
           AND k.expires_at > now()
           AND (k.state = 'unknown'
                OR (k.state = 'in_flight' AND k.lease_expires_at <= now()))"
    };
}

// `$4` reason, `$5` who. The record's `resolved_at` is the clock of the
// update (Citus refuses `now()` in a RETURNING list).
pub(super) const RESOLVE_RELEASE: &str = concat!(
    "UPDATE idempotency_keys k SET expires_at = now(), lease_expires_at = now(),
            limited = false, resolved_action = 'release', resolved_reason = $4, resolved_by = $5,
            resolved_at = now()
      WHERE ",
    stuck!(),
    " RETURNING ",
    key_columns!()
);

// `$4` reason, `$5` who, `$6` status, `$7` headers, `$8` body.
pub(super) const RESOLVE_COMPLETE: &str = concat!(
    "UPDATE idempotency_keys k SET state = 'completed', response_status = $6,
            response_headers = $7, response_body = $8, completed_at = now(),
            lease_expires_at = NULL, limited = false, resolved_action = 'complete',
            resolved_reason = $4,
            resolved_by = $5, resolved_at = now()
      WHERE ",
    stuck!(),
    " RETURNING ",
    key_columns!()
);

/// A tenant's live in-flight keys, up to `$2`; the partial index
/// `idempotency_keys_limited` holds the rows claimed under a limit, which
/// these are whenever the limit is set.
pub(super) const IN_FLIGHT_USAGE: &str = "SELECT count(*), min(lease_expires_at), now() FROM (
        SELECT lease_expires_at FROM idempotency_keys
         WHERE tenant = $1 AND limited AND state = 'in_flight' AND lease_expires_at > now()
           AND expires_at > now()
         ORDER BY lease_expires_at
         LIMIT $2) live";

/// What a tenant's completed records take. `octet_length` of a bytea and
/// `pg_column_size` of a jsonb read the stored size without decompressing.
pub(super) const STORED_USAGE: &str = "SELECT coalesce(sum(coalesce(octet_length(response_body), 0)
                         + coalesce(pg_column_size(response_headers), 0)), 0)::int8,
                min(expires_at), now()
           FROM idempotency_keys
          WHERE tenant = $1 AND state = 'completed' AND expires_at > now()";

/// The statement behind [`HotPath::reserve`](crate::store::HotPath::reserve): one
/// round trip that claims a key or reads it as it stands. Binds: tenant
/// (text), key hash (bytea), fingerprint (text, null allowed), new
/// reservation id (uuid), lease and TTL seconds (float8), the tenant's limit
/// of in-flight keys (int8, null for none), what the lease's end means
/// (text: `hold` or `takeover`).
pub fn reserve() -> &'static str {
    RESERVE
}

/// The statement behind [`HotPath::complete`](crate::store::HotPath::complete):
/// one round trip that stores the response and completes the key. Binds:
/// tenant, reservation id, status (int4), headers (jsonb array of `[name,
/// value]`), body (bytea).
pub fn complete() -> &'static str {
    COMPLETE
}

/// Every per-request statement, by name, for tests that check how a
/// distributed database plans each. Binds, after tenant (text): `reserve`
/// and `complete` as above; `release`, `mark_unknown`: reservation id;
/// `extend`: reservation id, lease seconds (float8), what the lease's end
/// means from now on (text, or NULL for as it was); `checkpoint`:
/// reservation id, recovery point (text), data (jsonb); `find`: reservation
/// id; `find_key`: key hash (bytea); `in_flight_usage`: limit (int8);
/// `stored_usage`: nothing.
pub fn per_request() -> [(&'static str, &'static str); 10] {
    [
        ("reserve", RESERVE),
        ("complete", COMPLETE),
        ("release", RELEASE),
        ("mark_unknown", MARK_UNKNOWN),
        ("extend", EXTEND),
        ("checkpoint", CHECKPOINT),
        ("find", FIND),
        ("find_key", FIND_KEY),
        ("in_flight_usage", IN_FLIGHT_USAGE),
        ("stored_usage", STORED_USAGE),
    ]
}
