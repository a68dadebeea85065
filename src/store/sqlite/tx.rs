//! The write transactions' work, run on the writer thread (see
//! [`writer`](super::writer)): the claim, completion and release (alone or in
//! a batch) with rusqlite's cached statements; and the direct-SQL pool's own
//! transaction guard.

#[cfg(test)]
use std::ops::{Deref, DerefMut};
#[cfg(test)]
use std::sync::Arc;
#[cfg(test)]
use std::sync::atomic::{AtomicBool, Ordering};

use rusqlite::{Connection, OptionalExtension, params};
#[cfg(test)]
use sqlx::Sqlite;
#[cfg(test)]
use sqlx::pool::PoolConnection;
use sqlx::sqlite::SqliteConnection;
use uuid::Uuid;

use super::errors::classify_rs;
use super::rows::*;
use super::sql::*;
use crate::store::{Claim, ClaimRequest, Record, Result, StoreError, StoredResponse};

/// A write transaction on the direct-SQL pool ([`SqliteStore::pool`](super::SqliteStore::pool)):
/// `BEGIN IMMEDIATE` … `COMMIT`, and when it ends any other way (an error, a
/// cancelled request), the pool's `after_release` hook ([`after_write`])
/// cleans up before anyone else gets the connection. The store's own writes
/// do not use it (they run on the writer thread, which cleans up the same
/// way); the tests drive the pool's clean-up through it.
///
/// Not sqlx's `Transaction`: after a write to the WAL failed at `COMMIT`
/// (read-only file, full disk), its rollback fails, its transaction depth
/// stays at 1, and every later write is a 500 until a restart; and a
/// connection opened during the fault stays read-only for good. So a write
/// that does not commit raises `abandoned` in `drop`, and the hook closes the
/// connection (rolling back whatever is open) instead of reusing it; an
/// in-memory database, which lives in its connections, rolls back
/// instead. The story and the tests that found it: RELIABILITY.md, SQLite
/// faults.
#[cfg(test)]
pub(super) struct WriteTx {
    pub(super) conn: PoolConnection<Sqlite>,
    pub(super) abandoned: Arc<AtomicBool>,
    pub(super) committed: bool,
}

// === impl WriteTx ===

#[cfg(test)]
impl WriteTx {
    pub(super) async fn commit(mut self) -> sqlx::Result<()> {
        sqlx::raw_sql("COMMIT").execute(&mut *self.conn).await?;
        self.committed = true;
        Ok(())
    }
}

#[cfg(test)]
impl Deref for WriteTx {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        &self.conn
    }
}

#[cfg(test)]
impl DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.conn
    }
}

#[cfg(test)]
impl Drop for WriteTx {
    fn drop(&mut self) {
        // Runs before the fields drop, so before `conn` goes back to the pool.
        if !self.committed {
            self.abandoned.store(true, Ordering::Release);
        }
    }
}

/// The direct-SQL pool's `after_release` hook: whether the connection may
/// serve the next user. After an abandoned [`WriteTx`], a file's connection
/// is closed (the pool opens a fresh one when next asked) and an in-memory
/// database's is rolled back.
pub(super) async fn after_write(
    conn: &mut SqliteConnection,
    abandoned: bool,
    in_memory: bool,
) -> sqlx::Result<bool> {
    if !abandoned {
        return Ok(true);
    }
    if !in_memory {
        tracing::debug!("a direct write did not commit: its connection is replaced");
        return Ok(false);
    }
    // "No transaction is active" when BEGIN failed or COMMIT got through.
    if let Err(e) = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await {
        tracing::debug!(error = %e, "rollback of an abandoned write");
    }
    Ok(true)
}

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
        // The reservation id's row came with it (a trigger: migration
        // `20261203000001_write_batch_trigger.sql`).
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
