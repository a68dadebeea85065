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

// The claim (migration `20261202000001_reserve_function.sql`): insert a new
// record, or, under the row lock that ON CONFLICT takes, reset an expired one
// or take over an in-flight one whose lease ended; else read the record as it
// stands. `$7` is the tenant's limit of live in-flight keys, NULL for none. A
// function, so that it is one router call on Citus too: see the migration.
pub(super) const RESERVE: &str = concat!(
    "SELECT claimed, db_now, ",
    key_columns!(),
    " FROM idemgate_reserve($1, $2, $3, $4, $5, $6, $7)"
);

// Claims, commits and releases in one call (migration
// `20261203000001_write_batch_function.sql`); the arrays hold one item per
// write, NULL where a kind of write has no such argument.
pub(super) const WRITE_BATCH: &str = concat!(
    "SELECT ord, claimed, db_now, ",
    key_columns!(),
    " FROM idemgate_write_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
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
/// holder is reservation `$2` of tenant `$1`, while the record is alive.
macro_rules! current_holder {
    () => {
        "k.tenant = $1 AND k.reservation_id = $2
           AND k.key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                              WHERE r.tenant = $1 AND r.reservation_id = $2)
           AND k.state = 'in_flight' AND k.expires_at > now()"
    };
}

pub(super) const COMPLETE: &str = concat!(
    "UPDATE idempotency_keys k SET state = 'completed', response_status = $3,
            response_headers = $4, response_body = $5, completed_at = now(),
            lease_expires_at = NULL
      WHERE ",
    current_holder!(),
    " RETURNING ",
    key_columns!()
);

pub(super) const RELEASE: &str = concat!(
    "UPDATE idempotency_keys k SET expires_at = now(), lease_expires_at = now() WHERE ",
    current_holder!(),
    " RETURNING k.key_hash"
);

pub(super) const EXTEND: &str = concat!(
    "UPDATE idempotency_keys k SET lease_expires_at = now() + make_interval(secs => $3) WHERE ",
    current_holder!(),
    " RETURNING k.lease_expires_at"
);

pub(super) const CHECKPOINT: &str = concat!(
    "UPDATE idempotency_keys k SET recovery_point = $3, recovery_data = $4 WHERE ",
    current_holder!(),
    " RETURNING ",
    key_columns!()
);

pub(super) const FIND: &str = concat!(
    "SELECT now() AS db_now, ",
    key_columns!(),
    " FROM idempotency_keys k
      WHERE k.tenant = $1
        AND k.key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                           WHERE r.tenant = $1 AND r.reservation_id = $2)"
);

/// A tenant's live in-flight keys, up to `$2`; the partial index
/// `idempotency_keys_in_flight` holds exactly these rows.
pub(super) const IN_FLIGHT_USAGE: &str = "SELECT count(*), min(lease_expires_at), now() FROM (
        SELECT lease_expires_at FROM idempotency_keys
         WHERE tenant = $1 AND state = 'in_flight' AND lease_expires_at > now()
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

/// The statement behind [`Store::reserve`](crate::store::Store::reserve): one
/// round trip that claims a key or reads it as it stands. Binds: tenant
/// (text), key hash (bytea), fingerprint (text, null allowed), new
/// reservation id (uuid), lease and TTL seconds (float8), the tenant's limit
/// of in-flight keys (int8, null for none).
pub fn reserve() -> &'static str {
    RESERVE
}

/// The statement behind [`Store::complete`](crate::store::Store::complete):
/// one round trip that stores the response and completes the key. Binds:
/// tenant, reservation id, status (int4), headers (jsonb array of `[name,
/// value]`), body (bytea).
pub fn complete() -> &'static str {
    COMPLETE
}

/// Every per-request statement, by name, for tests that check how a
/// distributed database plans each. Binds, after tenant (text): `reserve`
/// and `complete` as above; `release`: reservation id; `extend`: reservation
/// id, lease seconds (float8); `checkpoint`: reservation id, recovery point
/// (text), data (jsonb); `find`: reservation id; `in_flight_usage`: limit
/// (int8); `stored_usage`: nothing.
pub fn per_request() -> [(&'static str, &'static str); 8] {
    [
        ("reserve", RESERVE),
        ("complete", COMPLETE),
        ("release", RELEASE),
        ("extend", EXTEND),
        ("checkpoint", CHECKPOINT),
        ("find", FIND),
        ("in_flight_usage", IN_FLIGHT_USAGE),
        ("stored_usage", STORED_USAGE),
    ]
}
