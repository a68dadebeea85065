//! The write transactions' work, run on the writer thread (see
//! [`writer`](super::writer)): the claim, completion and release (alone or in
//! a batch) with rusqlite's cached statements.

use rusqlite::{Connection, OptionalExtension, params};
use uuid::Uuid;

use super::errors::classify_rs;
use super::rows::*;
use super::sql::*;
use crate::store::{
    Claim, ClaimRequest, KeptRequest, KeyState, Record, Result, StoreError, StoredResponse, Write,
    Written,
};

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
    let times = [now, secs_ms(req.lease_seconds), secs_ms(req.ttl_seconds)];
    let request = req.request.as_ref().map(KeptRequest::to_column);
    if room && insert_new(conn, req, id, &times, &request)? {
        return Ok(Some(Claim {
            claimed: true,
            record: new_record(req, now)?,
            now: ts(now)?,
        }));
    }
    let claimed = if room {
        key_row(conn, RESERVE, claim_params(req, &id, &times, &request))?
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

/// The parameters `?1` to `?8` of [`RESERVE`] and [`INSERT_NEW`]: tenant, key
/// hash, fingerprint, reservation id, and `times` (now, the lease and the TTL
/// in milliseconds), then `on_lease_expiry` and `?9` the request as kept.
fn claim_params<'a>(
    req: &'a ClaimRequest,
    id: &'a &'a str,
    times: &'a [i64; 3],
    request: &'a Option<Vec<u8>>,
) -> [&'a dyn rusqlite::ToSql; 9] {
    [
        &req.tenant,
        &req.key_hash,
        &req.fingerprint,
        id,
        &times[0],
        &times[1],
        &times[2],
        &req.on_lease_expiry,
        request,
    ]
}

/// Inserts the record of a key that has none; false if it has one.
fn insert_new(
    conn: &Connection,
    req: &ClaimRequest,
    id: &str,
    times: &[i64; 3],
    request: &Option<Vec<u8>>,
) -> Result<bool> {
    let inserted = conn
        .prepare_cached(INSERT_NEW)
        .and_then(|mut stmt| stmt.execute(claim_params(req, &id, times, request)))
        .map_err(classify_rs)?;
    Ok(inserted == 1)
}

/// The record [`INSERT_NEW`] wrote, as reading it back would give it.
fn new_record(req: &ClaimRequest, now: i64) -> Result<Record> {
    Ok(Record {
        tenant: req.tenant.clone(),
        key_hash: req.key_hash.to_vec(),
        fingerprint: req.fingerprint.clone(),
        state: KeyState::InFlight,
        reservation_id: req.reservation_id,
        lease_expires_at: Some(ts(now + secs_ms(req.lease_seconds))?),
        attempt: 1,
        recovery: None,
        response: None,
        created_at: ts(now)?,
        completed_at: None,
        expires_at: ts(now + secs_ms(req.ttl_seconds))?,
        on_lease_expiry: req.on_lease_expiry,
        resolution: None,
        marked_unknown: None,
        request: None,
    })
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
    let id = uuid_text(reservation_id, &mut buf);
    let headers = headers_json(&response.headers)?;
    let changed = conn
        .prepare_cached(COMPLETE)
        .and_then(|mut stmt| {
            stmt.execute(params![
                tenant,
                id,
                now,
                i64::from(response.status),
                headers,
                &response.body[..],
            ])
        })
        .map_err(classify_rs)?;
    if changed == 0 {
        return Ok(None);
    }
    let Some(row) = key_row(conn, COMPLETED, params![tenant, id])? else {
        return Err(StoreError::other(
            "a completed record was not there to read",
        ));
    };
    let mut record = Record::try_from(row)?;
    record.response = Some(response.clone());
    Ok(Some(record))
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

/// A claim, commit or release inside a write transaction, at `now`.
pub(super) fn write_in(conn: &Connection, write: &Write, now: i64) -> Result<Written> {
    Ok(match write {
        Write::Claim(req) => Written::Claim(claim_in(conn, req, now)?),
        Write::Complete {
            tenant,
            reservation_id,
            response,
        } => Written::Complete(complete_in(conn, tenant, *reservation_id, response, now)?),
        Write::Release {
            tenant,
            reservation_id,
        } => Written::Release(release_in(conn, tenant, *reservation_id, now)?),
    })
}
