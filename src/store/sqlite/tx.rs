//! The write transactions' work, run on the writer thread (see
//! [`writer`](super::writer)): the claim, completion and release (alone or in
//! a batch) with rusqlite's cached statements.

use rusqlite::{Connection, OptionalExtension, params};
use uuid::Uuid;

use super::errors::classify_rs;
use super::rows::*;
use super::sql::*;
use crate::store::{Claim, ClaimRequest, Record, Result, StoreError, StoredResponse};

/// A uuid as the stored TEXT (lowercase, hyphenated), without allocating.
pub(super) fn uuid_text(id: Uuid, buf: &mut [u8; uuid::fmt::Urn::LENGTH]) -> &str {
    id.hyphenated().encode_lower(buf)
}

/// A statement returning at most one key row, the row if any.
pub(super) fn key_row<P: rusqlite::Params>(
    conn: &Connection,
    sql: &str,
    params: P,
) -> Result<Option<KeyRow>> {
    conn.prepare_cached(sql)
        .and_then(|mut stmt| stmt.query_row(params, KeyRow::read).optional())
        .map_err(classify_rs)
}

/// A statement returning at most one value, the value if any.
pub(super) fn value_row<T: rusqlite::types::FromSql, P: rusqlite::Params>(
    conn: &Connection,
    sql: &str,
    params: P,
) -> Result<Option<T>> {
    conn.prepare_cached(sql)
        .and_then(|mut stmt| stmt.query_row(params, |r| r.get(0)).optional())
        .map_err(classify_rs)
}

/// The claim inside a write transaction, at `now` (read under the lock).
pub(super) fn claim_in(conn: &Connection, req: &ClaimRequest, now: i64) -> Result<Option<Claim>> {
    let mut buf = Uuid::encode_buffer();
    let id = uuid_text(req.reservation_id, &mut buf);
    // Under the write lock the count cannot change before the claim: the
    // limit is exact here.
    let room = match req.max_in_flight {
        None => true,
        Some(max) => {
            let live: i64 = value_row(
                conn,
                COUNT_IN_FLIGHT,
                params![req.tenant, now, i64::from(max)],
            )?
            .unwrap_or(0);
            live < i64::from(max)
        }
    };
    let claimed = if room {
        key_row(
            conn,
            RESERVE,
            params![
                req.tenant,
                &req.key_hash[..],
                req.fingerprint,
                id,
                now,
                secs_ms(req.lease_seconds),
                secs_ms(req.ttl_seconds),
                req.on_lease_expiry.as_str(),
            ],
        )?
    } else {
        None
    };
    let (claimed, row) = match claimed {
        // An id it superseded was kept with it (a trigger: migration
        // `20261207000001_one_table.sql`).
        Some(row) => (true, row),
        None => {
            // We hold the write lock: the row the upsert conflicted with is
            // still there, unchanged.
            match key_row(conn, SELECT_KEY, params![req.tenant, &req.key_hash[..]])? {
                Some(row) => (false, row),
                None if !room => return Ok(None),
                None => {
                    return Err(StoreError::other(
                        "the claim neither applied nor found the record",
                    ));
                }
            }
        }
    };
    Ok(Some(Claim {
        claimed,
        record: Record::try_from(row)?,
        now: ts(now)?,
    }))
}

/// The commit inside a write transaction, at `now`.
pub(super) fn complete_in(
    conn: &Connection,
    tenant: &str,
    reservation_id: Uuid,
    response: &StoredResponse,
    now: i64,
) -> Result<Option<Record>> {
    let mut buf = Uuid::encode_buffer();
    let row = key_row(
        conn,
        COMPLETE,
        params![
            tenant,
            uuid_text(reservation_id, &mut buf),
            now,
            i64::from(response.status),
            headers_json(&response.headers)?,
            response.body,
        ],
    )?;
    row.map(Record::try_from).transpose()
}

/// The release inside a write transaction, at `now`: expiring the record at
/// once makes the key new again and kills the id; the pruning job
/// deletes the row later.
pub(super) fn release_in(
    conn: &Connection,
    tenant: &str,
    reservation_id: Uuid,
    now: i64,
) -> Result<Option<Vec<u8>>> {
    let mut buf = Uuid::encode_buffer();
    value_row(
        conn,
        RELEASE,
        params![tenant, uuid_text(reservation_id, &mut buf), now],
    )
}
