//! The one write connection's transactions: `BEGIN IMMEDIATE` … `COMMIT`,
//! cleaned up when they end any other way, and the claim, completion and
//! release that run inside one (alone or in a batch).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::Sqlite;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::SqliteConnection;
use uuid::Uuid;

use super::errors::classify;
use super::rows::*;
use super::sql::*;
use crate::store::{Claim, ClaimRequest, Record, Result, StoreError, StoredResponse};

/// A write transaction on the write connection: `BEGIN IMMEDIATE` …
/// `COMMIT`, and when it ends any other way (an error, a cancelled request),
/// the pool's `after_release` hook ([`after_write`]) cleans up before anyone
/// else gets the connection.
///
/// Not sqlx's `Transaction`: after a write to the WAL failed at `COMMIT`
/// (read-only file, full disk), its rollback fails, its transaction depth
/// stays at 1, and every later write is a 500 until a restart; and a
/// connection opened during the fault stays read-only for good. So a write
/// that does not commit raises `abandoned` in `drop`, and the hook closes the
/// connection (rolling back whatever is open) instead of reusing it; an
/// in-memory database, which lives in its one connection, rolls back
/// instead. The story and the tests that found it: RELIABILITY.md, SQLite
/// faults.
pub(super) struct WriteTx {
    pub(super) conn: PoolConnection<Sqlite>,
    pub(super) abandoned: Arc<AtomicBool>,
    pub(super) committed: bool,
}

// === impl WriteTx ===

impl WriteTx {
    pub(super) async fn commit(mut self) -> sqlx::Result<()> {
        sqlx::raw_sql("COMMIT").execute(&mut *self.conn).await?;
        self.committed = true;
        Ok(())
    }
}

impl Deref for WriteTx {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        &self.conn
    }
}

impl DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.conn
    }
}

impl Drop for WriteTx {
    fn drop(&mut self) {
        // Runs before the fields drop, so before `conn` goes back to the pool.
        if !self.committed {
            self.abandoned.store(true, Ordering::Release);
        }
    }
}

/// The write pool's `after_release` hook: whether the connection may serve
/// the next write. After an abandoned [`WriteTx`], a file's connection is
/// closed (the pool opens a fresh one on the next write) and an in-memory
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
        tracing::debug!("a write did not commit: the write connection is replaced");
        return Ok(false);
    }
    // "No transaction is active" when BEGIN failed or COMMIT got through.
    if let Err(e) = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await {
        tracing::debug!(error = %e, "rollback of an abandoned write");
    }
    Ok(true)
}

/// The claim inside a write transaction, at `now` (read under the lock).
pub(super) async fn claim_in(
    tx: &mut SqliteConnection,
    req: &ClaimRequest,
    now: i64,
) -> Result<Option<Claim>> {
    let id = req.reservation_id.hyphenated();
    // Under the write lock the count cannot change before the claim: the
    // limit is exact here.
    let room = match req.max_in_flight {
        None => true,
        Some(max) => {
            let live: i64 = sqlx::query_scalar(COUNT_IN_FLIGHT)
                .bind(&req.tenant)
                .bind(now)
                .bind(i64::from(max))
                .fetch_one(&mut *tx)
                .await
                .map_err(classify)?;
            live < i64::from(max)
        }
    };
    let claimed: Option<KeyRow> = if room {
        sqlx::query_as(RESERVE)
            .bind(&req.tenant)
            .bind(&req.key_hash[..])
            .bind(&req.fingerprint)
            .bind(id)
            .bind(now)
            .bind(secs_ms(req.lease_seconds))
            .bind(secs_ms(req.ttl_seconds))
            .bind(req.on_lease_expiry.as_str())
            .fetch_optional(&mut *tx)
            .await
            .map_err(classify)?
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
            let row: Option<KeyRow> = sqlx::query_as(SELECT_KEY)
                .bind(&req.tenant)
                .bind(&req.key_hash[..])
                .fetch_optional(&mut *tx)
                .await
                .map_err(classify)?;
            match row {
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
pub(super) async fn complete_in(
    tx: &mut SqliteConnection,
    tenant: &str,
    reservation_id: Uuid,
    response: &StoredResponse,
    now: i64,
) -> Result<Option<Record>> {
    let row: Option<KeyRow> = sqlx::query_as(COMPLETE)
        .bind(tenant)
        .bind(reservation_id.hyphenated())
        .bind(now)
        .bind(i64::from(response.status))
        .bind(headers_json(&response.headers)?)
        .bind(&response.body)
        .fetch_optional(&mut *tx)
        .await
        .map_err(classify)?;
    row.map(Record::try_from).transpose()
}

/// The release inside a write transaction, at `now`: expiring the record at
/// once makes the key new again and kills the id; the pruning job
/// deletes the row later.
pub(super) async fn release_in(
    tx: &mut SqliteConnection,
    tenant: &str,
    reservation_id: Uuid,
    now: i64,
) -> Result<Option<Vec<u8>>> {
    sqlx::query_scalar(RELEASE)
        .bind(tenant)
        .bind(reservation_id.hyphenated())
        .bind(now)
        .fetch_optional(&mut *tx)
        .await
        .map_err(classify)
}
