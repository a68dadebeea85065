//! The SQLite store's statements, each a `&'static str` put together at
//! compile time (`concat!`), from the column list both stores read
//! ([`key_columns!`](crate::store::key_columns)). Parameters are numbered
//! (`?1`), and the clock is this process's, passed in as milliseconds.

use crate::store::key_columns;

/// Restricts a statement on `idempotency_keys` to the row whose current holder
/// is reservation `?2` of tenant `?1` (found by the index
/// `idempotency_keys_reservation`), while the record is alive at `?3` and in
/// one of the `states` (an SQL list).
macro_rules! current_holder {
    ($states:literal) => {
        concat!(
            "tenant = ?1 AND reservation_id = ?2
           AND state IN (",
            $states,
            ") AND expires_at > ?3"
        )
    };
}

// The claim, the PostgreSQL statement's twin: insert a new record, or reset an
// expired one, or take over an in-flight one whose lease ended under
// 'takeover' (fingerprints compatible). When neither applies the DO UPDATE is
// skipped and nothing is returned; the caller then reads the record as it
// stands, inside the same write transaction. SET expressions see the row as
// it was before the update. A change of the record's id writes the id it
// replaces into idempotency_reservations (a trigger: migration
// `20261207000001_one_table.sql`); a new key writes nothing more. ?1 tenant, ?2 key hash, ?3 fingerprint, ?4
// reservation id, ?5 now, ?6 lease (ms), ?7 ttl (ms), ?8 on_lease_expiry,
// ?9 the request the key is for, as kept.
pub(super) const RESERVE: &str = concat!(
    "INSERT INTO idempotency_keys AS k
        (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt,
         created_at, expires_at, on_lease_expiry, request)
    VALUES (?1, ?2, ?3, 'in_flight', ?4, ?5 + ?6, 1, ?5, ?5 + ?7, ?8, ?9)
    ON CONFLICT (tenant, key_hash) DO UPDATE SET
        fingerprint = CASE WHEN k.expires_at <= ?5 THEN excluded.fingerprint
                           ELSE COALESCE(k.fingerprint, excluded.fingerprint) END,
        state = 'in_flight',
        reservation_id = excluded.reservation_id,
        lease_expires_at = excluded.lease_expires_at,
        attempt = CASE WHEN k.expires_at <= ?5 THEN 1 ELSE k.attempt + 1 END,
        recovery_point = CASE WHEN k.expires_at <= ?5 THEN NULL ELSE k.recovery_point END,
        recovery_data = CASE WHEN k.expires_at <= ?5 THEN NULL ELSE k.recovery_data END,
        response_status = NULL,
        response_headers = NULL,
        response_body = NULL,
        created_at = CASE WHEN k.expires_at <= ?5 THEN ?5 ELSE k.created_at END,
        completed_at = NULL,
        expires_at = CASE WHEN k.expires_at <= ?5 THEN excluded.expires_at ELSE k.expires_at END,
        on_lease_expiry = excluded.on_lease_expiry,
        request = excluded.request,
        resolved_action = NULL,
        resolved_reason = NULL,
        resolved_by = NULL,
        resolved_at = NULL
    WHERE k.expires_at <= ?5
       OR (k.state = 'in_flight' AND k.lease_expires_at <= ?5
           AND k.on_lease_expiry = 'takeover'
           AND (k.fingerprint IS NULL OR excluded.fingerprint IS NULL
                OR k.fingerprint = excluded.fingerprint))
    RETURNING ",
    key_columns!()
);

// A new key's record, when the key has none: the claim of a new key, which
// needs nothing read back (the caller knows every column it wrote). Without
// RETURNING, which makes SQLite collect the rows in a temporary b-tree of
// their own on every run. ?1 tenant, ?2 key hash, ?3 fingerprint,
// ?4 reservation id, ?5 now, ?6 lease (ms), ?7 ttl (ms), ?8 on_lease_expiry,
// ?9 the request.
pub(super) const INSERT_NEW: &str = "INSERT INTO idempotency_keys
        (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt,
         created_at, expires_at, on_lease_expiry, request)
    VALUES (?1, ?2, ?3, 'in_flight', ?4, ?5 + ?6, 1, ?5, ?5 + ?7, ?8, ?9)
    ON CONFLICT (tenant, key_hash) DO NOTHING";

// ?1 tenant, ?2 now, ?3 the most worth counting.
pub(super) const COUNT_IN_FLIGHT: &str = "SELECT count(*) FROM (
        SELECT 1 FROM idempotency_keys
         WHERE tenant = ?1 AND state = 'in_flight' AND lease_expires_at > ?2 AND expires_at > ?2
         LIMIT ?3)";

pub(super) const SELECT_KEY: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM idempotency_keys WHERE tenant = ?1 AND key_hash = ?2"
);

// ?4 status, ?5 headers, ?6 body. A commit or a release settles the key its
// holder marked unknown too: its reservation id is still the current one.
// Without RETURNING (see INSERT_NEW): the record is read back by
// COMPLETED, without the response the caller has just sent.
pub(super) const COMPLETE: &str = concat!(
    "UPDATE idempotency_keys SET state = 'completed', response_status = ?4,
            response_headers = ?5, response_body = ?6, completed_at = ?3,
            lease_expires_at = NULL
      WHERE ",
    current_holder!("'in_flight', 'unknown'")
);

// The record COMPLETE left, but its response (NULL here: the caller has it).
// ?1 tenant, ?2 reservation id.
pub(super) const COMPLETED: &str = "SELECT tenant, key_hash, fingerprint, state, reservation_id,
        lease_expires_at, attempt, recovery_point, recovery_data, response_status,
        NULL, NULL, created_at, completed_at, expires_at, on_lease_expiry, resolved_action,
        resolved_reason, resolved_by, resolved_at, unknown_reason, unknown_at,
        unknown_reservation_id, NULL
   FROM idempotency_keys WHERE tenant = ?1 AND reservation_id = ?2";

pub(super) const RELEASE: &str = concat!(
    "UPDATE idempotency_keys SET expires_at = ?3, lease_expires_at = ?3 WHERE ",
    current_holder!("'in_flight', 'unknown'"),
    " RETURNING key_hash"
);

// ?4 the holder's reason. A key this holder marked already keeps its first
// reason and time; a mark an earlier holder left is overwritten.
pub(super) const MARK_UNKNOWN: &str = concat!(
    "UPDATE idempotency_keys SET state = 'unknown',
            unknown_reason = CASE WHEN unknown_reservation_id IS ?2 AND state = 'unknown'
                                  THEN unknown_reason ELSE ?4 END,
            unknown_at = CASE WHEN unknown_reservation_id IS ?2 AND state = 'unknown'
                              THEN unknown_at ELSE ?3 END,
            unknown_reservation_id = ?2
      WHERE ",
    current_holder!("'in_flight', 'unknown'"),
    " RETURNING key_hash"
);

// ?4 lease (ms); ?5 what the lease's end will mean from now on, else as it
// was (NULL).
pub(super) const EXTEND: &str = concat!(
    "UPDATE idempotency_keys SET lease_expires_at = ?3 + ?4,
            on_lease_expiry = COALESCE(?5, on_lease_expiry) WHERE ",
    current_holder!("'in_flight'"),
    " RETURNING lease_expires_at"
);

// ?4 recovery point, ?5 recovery data.
pub(super) const CHECKPOINT: &str = concat!(
    "UPDATE idempotency_keys SET recovery_point = ?4, recovery_data = ?5 WHERE ",
    current_holder!("'in_flight'"),
    " RETURNING ",
    key_columns!()
);

// The record reservation ?2 holds, else the one it held before a claim
// superseded it (migration `20261207000001_one_table.sql`). Both ways lead to
// one record: an id is handed out once.
pub(super) const FIND: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM idempotency_keys
      WHERE tenant = ?1
        AND (reservation_id = ?2
             OR key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                             WHERE r.tenant = ?1 AND r.reservation_id = ?2))
      LIMIT 1"
);

/// An alive record that is unknown at `?1`: marked so, or in flight past its
/// lease under 'hold'.
macro_rules! unknown {
    () => {
        "(state = 'unknown'
          OR (state = 'in_flight' AND on_lease_expiry = 'hold' AND lease_expires_at <= ?1))"
    };
}

// The operators' listing, the PostgreSQL statement's twin: alive records at
// ?1, oldest first, after the cursor (?6, ?7, ?8; NULLs: from the start). ?2
// the effective state (NULL: any), ?3 the tenant (NULL: any), ?4 the latest
// creation time (NULL: any), ?5 the page's size.
pub(super) const LIST_KEYS: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM idempotency_keys
      WHERE expires_at > ?1
        AND (?3 IS NULL OR tenant = ?3)
        AND (?4 IS NULL OR created_at <= ?4)
        AND (?6 IS NULL OR (created_at, tenant, key_hash) > (?6, ?7, ?8))
        AND CASE ?2
              WHEN 'unknown' THEN ",
    unknown!(),
    "
              WHEN 'in_flight' THEN state = 'in_flight' AND NOT ",
    unknown!(),
    "
              WHEN 'completed' THEN state = 'completed'
              WHEN 'stuck' THEN state = 'unknown' OR (state = 'in_flight' AND lease_expires_at <= ?1)
              ELSE 1 END
      ORDER BY created_at, tenant, key_hash
      LIMIT ?5"
);

// The keys nobody will settle by themselves at ?1: alive, and unknown or in
// flight past their lease (under either choice).
pub(super) const COUNT_STUCK: &str = "SELECT count(*) FROM idempotency_keys
      WHERE expires_at > ?1
        AND (state = 'unknown' OR (state = 'in_flight' AND lease_expires_at <= ?1))";

/// The settlement applies to the record of `(?1, ?2)` while it still has
/// reservation id `?3` and is stuck at `?4`: alive, and unknown or in flight
/// past its lease.
macro_rules! stuck {
    () => {
        "tenant = ?1 AND key_hash = ?2 AND reservation_id = ?3
           AND expires_at > ?4
           AND (state = 'unknown' OR (state = 'in_flight' AND lease_expires_at <= ?4))"
    };
}

// ?5 reason, ?6 who.
pub(super) const RESOLVE_RELEASE: &str = concat!(
    "UPDATE idempotency_keys SET expires_at = ?4, lease_expires_at = ?4,
            resolved_action = 'release', resolved_reason = ?5, resolved_by = ?6,
            resolved_at = ?4
      WHERE ",
    stuck!(),
    " RETURNING ",
    key_columns!()
);

// ?5 reason, ?6 who, ?7 status, ?8 headers, ?9 body.
pub(super) const RESOLVE_COMPLETE: &str = concat!(
    "UPDATE idempotency_keys SET state = 'completed', response_status = ?7,
            response_headers = ?8, response_body = ?9, completed_at = ?4,
            lease_expires_at = NULL, resolved_action = 'complete', resolved_reason = ?5,
            resolved_by = ?6, resolved_at = ?4
      WHERE ",
    stuck!(),
    " RETURNING ",
    key_columns!()
);

// The batch to prune: the oldest expired rows, in a total order (rowid breaks
// ties) so that both statements below pick the same rows. ?1 now, ?2 limit.
macro_rules! doomed {
    ($cols:literal) => {
        concat!(
            "SELECT ",
            $cols,
            " FROM idempotency_keys WHERE expires_at <= ?1 ORDER BY expires_at, rowid LIMIT ?2"
        )
    };
}

pub(super) const PRUNE_FENCES: &str = concat!(
    "DELETE FROM idempotency_reservations WHERE (tenant, key_hash) IN (",
    doomed!("tenant, key_hash"),
    ")"
);

pub(super) const PRUNE_KEYS: &str = concat!(
    "DELETE FROM idempotency_keys WHERE rowid IN (",
    doomed!("rowid"),
    ")"
);
