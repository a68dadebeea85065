//! The embedded SQLite store: the same transitions as the PostgreSQL store,
//! each one a `BEGIN IMMEDIATE` transaction, so the file's write lock makes
//! it atomic across every connection and process that opens the file.
//!
//! Design, and where it differs from PostgreSQL:
//!
//! * **Writes** go through a pool of exactly one connection. Within a process
//!   that queues writers fairly (the pool's acquire is first come, first
//!   served) instead of letting them spin on SQLite's busy handler against one
//!   another; across processes (or two stores on one file) `BEGIN IMMEDIATE`
//!   takes the write lock before the first read, and the busy timeout makes a
//!   contender wait for it rather than fail. Every write transaction is a
//!   [`WriteTx`], which rolls back unless committed (an error, or a cancelled
//!   request), so no connection goes back to the pool with a transaction open;
//!   and after a write that failed on a file, the connection is replaced by a
//!   fresh one (see [`WriteTx`]), so that the store recovers by itself from a
//!   full disk or a file made read-only once the fault is gone.
//! * **Reads** (`find_by_reservation`, `ping`, and a reserve's look at the
//!   key when the write lock cannot be had) use a separate pool: in WAL mode
//!   readers never wait on the writer, so a file that cannot be written still
//!   replays.
//! * **The clock** is this process's `Utc::now()`, read after the write lock is
//!   taken, so within a transaction nobody else can act between the clock
//!   reading and the decision. The contract is one process per file; processes
//!   on one machine share its clock anyway.
//! * **Durability**: WAL with `synchronous = FULL`, so a commit is on disk
//!   before it is acknowledged, as PostgreSQL's default `synchronous_commit =
//!   on`. `NORMAL` would survive a process crash but could lose the last
//!   commits on power loss: a lost completion would let a retry execute the
//!   effect a second time, which is the one thing this service exists to
//!   prevent. The price is one fsync per write transaction.
//! * **Encodings** (see `migrations/sqlite`): timestamps are INTEGER
//!   milliseconds since the Unix epoch, uuids lowercase hyphenated TEXT, JSON
//!   TEXT. Timestamps therefore have millisecond precision, where PostgreSQL
//!   keeps microseconds.

use std::ops::{Deref, DerefMut};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{ConnectOptions, FromRow, Sqlite};
use uuid::Uuid;
use uuid::fmt::Hyphenated;

mod lock;

use super::{
    Claim, ClaimRequest, Found, InFlightUsage, KeyState, PoolStats, PruneBatch, Record, Recovery,
    Result, Store, StoreError, StoredResponse, StoredUsage, Write, Written,
};
use lock::FileLock;

/// The SQLite schema migrations (`migrations/sqlite`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

/// How long a writer waits for another connection's write lock (another
/// process on the same file) before the store reports itself unavailable.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request waits for this process's write connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// Read connections: reads are short, and each connection is a thread.
const READERS: u32 = 4;

/// A [`Store`] over one SQLite file: one write connection, a few readers.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    writer: SqlitePool,
    reader: SqlitePool,
    /// True when `reader` is `writer` (in-memory databases).
    shared: bool,
    /// Raised by a write transaction that ended without a commit, for the
    /// pool to clean up after it (see [`WriteTx`]).
    abandoned: Arc<AtomicBool>,
    /// This process's hold on the file (none for an in-memory database):
    /// one idemgate process per file.
    _lock: Option<Arc<FileLock>>,
}

// === impl SqliteStore ===

impl SqliteStore {
    /// Opens (creating it if missing) the database at `url` (`sqlite://path`),
    /// in WAL mode. The write connection is opened at once, so a file that
    /// cannot be created or opened is reported here rather than on the first
    /// request.
    ///
    /// A file is first locked for this process, through `FILE.lock` beside
    /// it: while another process holds that, the open fails, naming the
    /// process. Stores of one process share the lock, which lasts until the
    /// last of them is dropped (or the process ends, however it ends).
    pub async fn open(url: &str) -> Result<SqliteStore> {
        let base = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::Other(format!("invalid SQLite URL: {e}")))?
            .create_if_missing(true)
            .busy_timeout(BUSY_TIMEOUT)
            .synchronous(SqliteSynchronous::Full)
            .log_statements(tracing::log::LevelFilter::Trace);
        let in_memory = is_in_memory(url, &base);
        // Before the first connection: a second process must not so much as
        // switch the journal mode or apply a migration under the first.
        let lock = if in_memory {
            None
        } else {
            Some(Arc::new(FileLock::acquire(base.get_filename())?))
        };
        // Switching to WAL needs an exclusive lock that the busy timeout does
        // not wait for, so only the writer asks; the mode is stored in the
        // file, and readers opened afterwards find it there.
        let writer_options = base.clone().journal_mode(SqliteJournalMode::Wal);
        let mut writer = SqlitePoolOptions::new()
            .max_connections(1)
            // `connect_with` opens the connection at once all the same; none
            // at all keeps a replaced one (see `WriteTx`) from being reopened
            // in the background while a fault lasts: the next write opens
            // it, and sees the file as it is then.
            .min_connections(0)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            // Keep the one connection for the life of the store: reopening
            // costs, and an in-memory database would vanish with it. Only a
            // write that failed on a file replaces it.
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false);
        let abandoned = Arc::new(AtomicBool::new(false));
        let flag = abandoned.clone();
        writer = writer.after_release(move |conn, _| {
            let abandoned = flag.swap(false, Ordering::AcqRel);
            Box::pin(after_write(conn, abandoned, in_memory))
        });
        let writer = writer
            .connect_with(writer_options)
            .await
            .map_err(classify)?;
        let reader = if in_memory {
            // An in-memory database has no WAL (readers would take table
            // locks against the writer) and lives only while a connection to
            // it is open: the writer's one connection, never closed while the
            // store lives, serves reads too.
            writer.clone()
        } else {
            SqlitePoolOptions::new()
                .max_connections(READERS)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .test_before_acquire(false)
                .connect_lazy_with(base)
        };
        Ok(SqliteStore {
            writer,
            reader,
            shared: in_memory,
            abandoned,
            _lock: lock,
        })
    }

    /// The write pool (one connection), for tests and tools. Direct SQL
    /// through it queues behind the store's own writes: do not hold a
    /// connection from it across a call into the store.
    pub fn pool(&self) -> &SqlitePool {
        &self.writer
    }

    /// Applies the pending migrations.
    pub async fn migrate(&self) -> Result<()> {
        MIGRATOR.run(&self.writer).await.map_err(|e| match e {
            sqlx::migrate::MigrateError::Execute(e) => classify(e),
            other => StoreError::Other(other.to_string()),
        })
    }

    /// Closes both pools, waiting for their connections to finish; the last
    /// connection to close checkpoints the WAL into the main file. Committed
    /// data is durable without this; it only tidies up on shutdown.
    pub async fn close(&self) {
        self.reader.close().await;
        self.writer.close().await;
    }

    /// The claim, under the write lock (see [`Store::reserve`]).
    async fn claim(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        let mut tx = self.begin_write().await?;
        let claim = claim_in(&mut tx, req, now_ms()).await?;
        tx.commit().await.map_err(classify)?;
        Ok(claim)
    }

    /// `writes` in one write transaction, one clock reading for all: one
    /// fsync where one by one each took its own.
    async fn write_all(&self, writes: &[&Write]) -> Result<Vec<Written>> {
        let mut tx = self.begin_write().await?;
        let now = now_ms();
        let mut written = Vec::with_capacity(writes.len());
        for write in writes {
            written.push(match write {
                Write::Claim(req) => Written::Claim(claim_in(&mut tx, req, now).await?),
                Write::Complete {
                    tenant,
                    reservation_id,
                    response,
                } => Written::Complete(
                    complete_in(&mut tx, tenant, *reservation_id, response, now).await?,
                ),
                Write::Release {
                    tenant,
                    reservation_id,
                } => Written::Release(release_in(&mut tx, tenant, *reservation_id, now).await?),
            });
        }
        tx.commit().await.map_err(classify)?;
        Ok(written)
    }

    /// The key's record when no claim can apply to it now — completed, or in
    /// flight under a live lease, and not expired — read without the write
    /// lock, for when the claim cannot be made: a file that cannot be
    /// written still replays and answers 409s. (Not read first on every
    /// reserve: that cost new keys 13 % more CPU, RELIABILITY.md §3.) A
    /// record that turns claimable after this read was not claimable at
    /// `now`, the moment the answer speaks for.
    async fn settled(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        let now = now_ms();
        let row: Option<KeyRow> = sqlx::query_as(SELECT_KEY)
            .bind(&req.tenant)
            .bind(&req.key_hash[..])
            .fetch_optional(&self.reader)
            .await
            .map_err(classify)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let record = Record::try_from(row)?;
        let now = ts(now)?;
        let live = record.expires_at > now
            && match record.state {
                KeyState::Completed => true,
                KeyState::InFlight => record.lease_expires_at.is_some_and(|end| end > now),
            };
        Ok(live.then_some(Claim {
            claimed: false,
            record,
            now,
        }))
    }

    /// Starts a write transaction holding the database's write lock.
    async fn begin_write(&self) -> Result<WriteTx> {
        let conn = self.writer.acquire().await.map_err(classify)?;
        // Armed before BEGIN: a BEGIN that fails is a failed write too.
        let mut tx = WriteTx {
            conn,
            abandoned: self.abandoned.clone(),
            committed: false,
        };
        // IMMEDIATE takes the write lock now, waiting up to the busy timeout.
        // A deferred BEGIN takes it at the first write; a transaction that
        // read before that, while another connection committed, cannot
        // upgrade (SQLITE_BUSY_SNAPSHOT, which the busy timeout does not
        // retry). Taking it first also lets us read the clock under the lock.
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut *tx)
            .await
            .map_err(classify)?;
        Ok(tx)
    }
}

/// A write transaction on the write connection: `BEGIN IMMEDIATE` …
/// `COMMIT`, and when it ends any other way (an error, a cancelled request),
/// the pool's `after_release` hook ([`after_write`]) cleans up before anyone
/// else gets the connection.
///
/// Not sqlx's `Transaction`, which rolls back and hands the connection back
/// to the pool as if nothing had happened. After an I/O error that
/// connection is broken for good. When a write to the WAL fails at COMMIT
/// (`SQLITE_IOERR_WRITE` on a file made immutable or a filesystem gone
/// read-only, `SQLITE_FULL` or `EFBIG` on a full disk), SQLite has already
/// rolled back; sqlx's ROLLBACK then fails ("no transaction is active"), its
/// transaction depth stays at 1, and every later `BEGIN IMMEDIATE` fails with
/// "attempted to call begin_with at non-zero transaction depth": a 500 for
/// every write, for ever, even once the disk has room again. And a
/// connection opened while the file or its WAL could not be written is
/// read-only for good (SQLite falls back to read-only without a word), so
/// it refuses every write after the file is writable again.
///
/// So the transaction is plain `BEGIN IMMEDIATE` and `COMMIT`, which keep
/// sqlx's bookkeeping out of it, and a write that does not commit raises
/// `abandoned`, in `drop`, before the connection goes back to the pool; the
/// hook then closes the connection (closing rolls back whatever is open) and
/// the next write opens a fresh one, which sees the file as it is now. That
/// costs a reopen, on the failure path only. An in-memory database lives in
/// its one connection, so there the hook rolls back instead.
struct WriteTx {
    conn: PoolConnection<Sqlite>,
    abandoned: Arc<AtomicBool>,
    committed: bool,
}

// === impl WriteTx ===

impl WriteTx {
    async fn commit(mut self) -> sqlx::Result<()> {
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
async fn after_write(
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
async fn claim_in(
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
                    return Err(StoreError::Other(
                        "the claim neither applied nor found the record".into(),
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
async fn complete_in(
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
async fn release_in(
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

/// Whether `url` names an in-memory database (`sqlite::memory:`,
/// `mode=memory`), which the store serves through its one write connection.
fn is_in_memory(url: &str, options: &SqliteConnectOptions) -> bool {
    let name = options.get_filename().to_string_lossy();
    name == ":memory:" || name.starts_with("file:sqlx-in-memory-") || url.contains("mode=memory")
}

/// This process's clock in whole milliseconds, the stored precision, so that
/// the `now` handed to the engine is exactly the one the SQL compared with.
fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

/// A stored millisecond count as a timestamp.
fn ts(ms: i64) -> Result<DateTime<Utc>> {
    DateTime::from_timestamp_millis(ms)
        .ok_or_else(|| StoreError::Other(format!("stored timestamp {ms} out of range")))
}

fn ts_opt(ms: Option<i64>) -> Result<Option<DateTime<Utc>>> {
    ms.map(ts).transpose()
}

/// Seconds as milliseconds, for adding to a stored timestamp.
fn secs_ms(seconds: u32) -> i64 {
    i64::from(seconds) * 1000
}

/// Every column of `idempotency_keys`, in the order [`KeyRow`] reads them: a
/// macro, so that `concat!` can build each statement as a `&'static str`.
macro_rules! key_columns {
    () => {
        "tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt, \
         recovery_point, recovery_data, response_status, response_headers, response_body, \
         created_at, completed_at, expires_at"
    };
}

/// Restricts a statement on `idempotency_keys` to the row whose current holder
/// is reservation `?2` of tenant `?1`, while the record is alive at `?3`.
macro_rules! current_holder {
    () => {
        "tenant = ?1 AND reservation_id = ?2
           AND key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                            WHERE r.tenant = ?1 AND r.reservation_id = ?2)
           AND state = 'in_flight' AND expires_at > ?3"
    };
}

#[derive(FromRow)]
struct KeyRow {
    tenant: String,
    key_hash: Vec<u8>,
    fingerprint: Option<String>,
    state: String,
    reservation_id: Hyphenated,
    lease_expires_at: Option<i64>,
    attempt: i64,
    recovery_point: Option<String>,
    recovery_data: Option<String>,
    response_status: Option<i64>,
    response_headers: Option<String>,
    response_body: Option<Vec<u8>>,
    created_at: i64,
    completed_at: Option<i64>,
    expires_at: i64,
}

impl TryFrom<KeyRow> for Record {
    type Error = StoreError;

    fn try_from(r: KeyRow) -> Result<Record> {
        let state = KeyState::parse(&r.state)?;
        let response = StoredResponse::from_columns(
            r.response_status,
            r.response_headers
                .map(|h| serde_json::from_str(&h))
                .transpose()
                .map_err(|e| StoreError::Other(format!("stored headers: {e}")))?,
            r.response_body,
        )?;
        let data = r
            .recovery_data
            .map(|d| serde_json::from_str(&d))
            .transpose()
            .map_err(|e| StoreError::Other(format!("stored recovery data: {e}")))?;
        Ok(Record {
            tenant: r.tenant,
            key_hash: r.key_hash,
            fingerprint: r.fingerprint,
            state,
            reservation_id: r.reservation_id.into_uuid(),
            lease_expires_at: ts_opt(r.lease_expires_at)?,
            attempt: i32::try_from(r.attempt)
                .map_err(|_| StoreError::Other(format!("stored attempt {}", r.attempt)))?,
            recovery: r.recovery_point.map(|recovery_point| Recovery {
                recovery_point,
                data,
            }),
            response,
            created_at: ts(r.created_at)?,
            completed_at: ts_opt(r.completed_at)?,
            expires_at: ts(r.expires_at)?,
        })
    }
}

// SQLite primary result codes (the low byte of an extended code) that mean
// "try again later" rather than "broken".
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
const SQLITE_NOMEM: i32 = 7;
const SQLITE_READONLY: i32 = 8;
const SQLITE_IOERR: i32 = 10;
const SQLITE_FULL: i32 = 13;
const SQLITE_CANTOPEN: i32 = 14;
const SQLITE_PROTOCOL: i32 = 15;

/// What to do about a file without idemgate's tables. `idemgate migrate` is
/// another process on the file, which one process per file rules out while
/// a server runs.
const NO_TABLES: &str = "the file has no idemgate tables: start idemgate without --no-migrate \
     (it applies the migrations at start), or stop it and run `idemgate migrate` on the file";

/// Sorts sqlx errors into "try again later" and "broken", as the PostgreSQL
/// store does: a lock still held after the busy timeout, an I/O error, a full
/// disk, a read-only or unopenable file, all answer 503, and so does a file
/// without the tables (a setup step not taken yet, not a bug: it heals once
/// the migrations are applied); anything else (constraint, schema mismatch,
/// bad SQL) is a bug.
fn classify(e: sqlx::Error) -> StoreError {
    if let sqlx::Error::Database(db) = &e
        && db.message().starts_with("no such table")
    {
        return StoreError::Unavailable(format!("{}: {NO_TABLES}", db.message()));
    }
    match &e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(e.to_string()),
        sqlx::Error::Database(db) => {
            // sqlx reports SQLite's extended result code, in decimal.
            let primary = db
                .code()
                .and_then(|c| c.parse::<i32>().ok())
                .map(|c| c & 0xff);
            match primary {
                Some(
                    SQLITE_BUSY | SQLITE_LOCKED | SQLITE_NOMEM | SQLITE_READONLY | SQLITE_IOERR
                    | SQLITE_FULL | SQLITE_CANTOPEN | SQLITE_PROTOCOL,
                ) => StoreError::Unavailable(e.to_string()),
                _ => StoreError::Other(e.to_string()),
            }
        }
        _ => StoreError::Other(e.to_string()),
    }
}

fn headers_json(headers: &[(String, String)]) -> Result<String> {
    // Pairs serialise as two-element arrays, the layout the PostgreSQL store
    // keeps in jsonb.
    serde_json::to_string(headers).map_err(|e| StoreError::Other(format!("headers: {e}")))
}

fn data_json(data: &Option<serde_json::Value>) -> Result<Option<String>> {
    data.as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(|e| StoreError::Other(format!("recovery data: {e}")))
}

// The claim, the PostgreSQL statement's twin: insert a new record, or reset an
// expired one, or take over an in-flight one whose lease ended (fingerprints
// compatible). When neither applies the DO UPDATE is skipped and nothing is
// returned; the caller then reads the record as it stands, inside the same
// write transaction. SET expressions see the row as it was before the update.
// ?1 tenant, ?2 key hash, ?3 fingerprint, ?4 reservation id, ?5 now,
// ?6 lease (ms), ?7 ttl (ms).
const RESERVE: &str = concat!(
    "INSERT INTO idempotency_keys AS k
        (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt,
         created_at, expires_at)
    VALUES (?1, ?2, ?3, 'in_flight', ?4, ?5 + ?6, 1, ?5, ?5 + ?7)
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
        expires_at = CASE WHEN k.expires_at <= ?5 THEN excluded.expires_at ELSE k.expires_at END
    WHERE k.expires_at <= ?5
       OR (k.state = 'in_flight' AND k.lease_expires_at <= ?5
           AND (k.fingerprint IS NULL OR excluded.fingerprint IS NULL
                OR k.fingerprint = excluded.fingerprint))
    RETURNING ",
    key_columns!()
);

// ?1 tenant, ?2 now, ?3 the most worth counting.
const COUNT_IN_FLIGHT: &str = "SELECT count(*) FROM (
        SELECT 1 FROM idempotency_keys
         WHERE tenant = ?1 AND state = 'in_flight' AND lease_expires_at > ?2 AND expires_at > ?2
         LIMIT ?3)";

const SELECT_KEY: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM idempotency_keys WHERE tenant = ?1 AND key_hash = ?2"
);

// ?4 status, ?5 headers, ?6 body.
const COMPLETE: &str = concat!(
    "UPDATE idempotency_keys SET state = 'completed', response_status = ?4,
            response_headers = ?5, response_body = ?6, completed_at = ?3,
            lease_expires_at = NULL
      WHERE ",
    current_holder!(),
    " RETURNING ",
    key_columns!()
);

const RELEASE: &str = concat!(
    "UPDATE idempotency_keys SET expires_at = ?3, lease_expires_at = ?3 WHERE ",
    current_holder!(),
    " RETURNING key_hash"
);

// ?4 lease (ms).
const EXTEND: &str = concat!(
    "UPDATE idempotency_keys SET lease_expires_at = ?3 + ?4 WHERE ",
    current_holder!(),
    " RETURNING lease_expires_at"
);

// ?4 recovery point, ?5 recovery data.
const CHECKPOINT: &str = concat!(
    "UPDATE idempotency_keys SET recovery_point = ?4, recovery_data = ?5 WHERE ",
    current_holder!(),
    " RETURNING ",
    key_columns!()
);

const FIND: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM idempotency_keys
      WHERE tenant = ?1
        AND key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                         WHERE r.tenant = ?1 AND r.reservation_id = ?2)"
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

const PRUNE_FENCES: &str = concat!(
    "DELETE FROM idempotency_reservations WHERE (tenant, key_hash) IN (",
    doomed!("tenant, key_hash"),
    ")"
);

const PRUNE_KEYS: &str = concat!(
    "DELETE FROM idempotency_keys WHERE rowid IN (",
    doomed!("rowid"),
    ")"
);

#[async_trait]
impl Store for SqliteStore {
    async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        match self.claim(req).await {
            // The file cannot be written (read-only, full disk) or the writer
            // is stuck: a record that needs no claim is still an answer.
            Err(StoreError::Unavailable(why)) => match self.settled(req).await {
                Ok(Some(settled)) => Ok(Some(settled)),
                _ => Err(StoreError::Unavailable(why)),
            },
            claimed => claimed,
        }
    }

    async fn complete(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        response: &StoredResponse,
    ) -> Result<Option<Record>> {
        let mut tx = self.begin_write().await?;
        let record = complete_in(&mut tx, tenant, reservation_id, response, now_ms()).await?;
        tx.commit().await.map_err(classify)?;
        Ok(record)
    }

    async fn release(&self, tenant: &str, reservation_id: Uuid) -> Result<Option<Vec<u8>>> {
        let mut tx = self.begin_write().await?;
        let key_hash = release_in(&mut tx, tenant, reservation_id, now_ms()).await?;
        tx.commit().await.map_err(classify)?;
        Ok(key_hash)
    }

    async fn extend(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        lease_seconds: u32,
    ) -> Result<Option<DateTime<Utc>>> {
        let mut tx = self.begin_write().await?;
        let until: Option<Option<i64>> = sqlx::query_scalar(EXTEND)
            .bind(tenant)
            .bind(reservation_id.hyphenated())
            .bind(now_ms())
            .bind(secs_ms(lease_seconds))
            .fetch_optional(&mut *tx)
            .await
            .map_err(classify)?;
        tx.commit().await.map_err(classify)?;
        // The column is nullable in the schema, never NULL after this update.
        until.flatten().map(ts).transpose()
    }

    async fn checkpoint(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        recovery: &Recovery,
    ) -> Result<Option<Record>> {
        let data = data_json(&recovery.data)?;
        let mut tx = self.begin_write().await?;
        let row: Option<KeyRow> = sqlx::query_as(CHECKPOINT)
            .bind(tenant)
            .bind(reservation_id.hyphenated())
            .bind(now_ms())
            .bind(&recovery.recovery_point)
            .bind(data)
            .fetch_optional(&mut *tx)
            .await
            .map_err(classify)?;
        let record = row.map(Record::try_from).transpose()?;
        tx.commit().await.map_err(classify)?;
        Ok(record)
    }

    async fn find_by_reservation(
        &self,
        tenant: &str,
        reservation_id: Uuid,
    ) -> Result<Option<Found>> {
        // One statement reads one snapshot; the clock is read just before it,
        // so a record seen as live was live at `now`.
        let now = now_ms();
        let row: Option<KeyRow> = sqlx::query_as(FIND)
            .bind(tenant)
            .bind(reservation_id.hyphenated())
            .fetch_optional(&self.reader)
            .await
            .map_err(classify)?;
        row.map(|r| {
            Ok(Found {
                now: ts(now)?,
                record: r.try_into()?,
            })
        })
        .transpose()
    }

    async fn prune_expired_batch(&self, limit: i64) -> Result<PruneBatch> {
        // SQLite reads a negative LIMIT as "no limit"; PostgreSQL refuses it.
        if limit <= 0 {
            return Ok(PruneBatch::default());
        }
        // Both deletes run under one write lock, so they see the same expired
        // rows and no reservation can touch them in between; a second pruner
        // (another process) waits for the lock and then finds them gone, so
        // each row is deleted exactly once. Small batches keep the lock short.
        let mut tx = self.begin_write().await?;
        let now = now_ms();
        sqlx::query(PRUNE_FENCES)
            .bind(now)
            .bind(limit)
            .execute(&mut *tx)
            .await
            .map_err(classify)?;
        let deleted = sqlx::query(PRUNE_KEYS)
            .bind(now)
            .bind(limit)
            .execute(&mut *tx)
            .await
            .map_err(classify)?
            .rows_affected();
        tx.commit().await.map_err(classify)?;
        Ok(PruneBatch::of(deleted, limit))
    }

    async fn in_flight_usage(&self, tenant: &str, up_to: u32) -> Result<InFlightUsage> {
        let now = now_ms();
        let (keys, next): (i64, Option<i64>) = sqlx::query_as(
            "SELECT count(*), min(lease_expires_at) FROM (
                SELECT lease_expires_at FROM idempotency_keys
                 WHERE tenant = ?1 AND state = 'in_flight' AND lease_expires_at > ?2 AND expires_at > ?2
                 ORDER BY lease_expires_at
                 LIMIT ?3)",
        )
        .bind(tenant)
        .bind(now)
        .bind(i64::from(up_to))
        .fetch_one(&self.reader)
        .await
        .map_err(classify)?;
        Ok(InFlightUsage {
            keys: u64::try_from(keys).unwrap_or(0),
            next_lease_end: ts_opt(next)?,
            now: ts(now)?,
        })
    }

    async fn stored_usage(&self, tenant: &str) -> Result<StoredUsage> {
        let now = now_ms();
        let (bytes, next): (i64, Option<i64>) = sqlx::query_as(
            "SELECT coalesce(sum(coalesce(length(response_body), 0)
                                 + coalesce(length(response_headers), 0)), 0),
                    min(expires_at)
               FROM idempotency_keys
              WHERE tenant = ?1 AND state = 'completed' AND expires_at > ?2",
        )
        .bind(tenant)
        .bind(now)
        .fetch_one(&self.reader)
        .await
        .map_err(classify)?;
        Ok(StoredUsage {
            bytes: u64::try_from(bytes).unwrap_or(0),
            next_expiry: ts_opt(next)?,
            now: ts(now)?,
        })
    }

    async fn ping(&self) -> Result<()> {
        // Reads the schema from the file, so a file that cannot be read fails
        // here, and so does one without the tables every request needs.
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM sqlite_master WHERE type = 'table'
                AND name IN ('idempotency_keys', 'idempotency_reservations')",
        )
        .fetch_all(&self.reader)
        .await
        .map_err(classify)?;
        match ["idempotency_keys", "idempotency_reservations"]
            .into_iter()
            .find(|t| !tables.iter().any(|have| have == t))
        {
            // In the words a request would get, so that both are one cause.
            Some(missing) => Err(StoreError::Unavailable(format!(
                "no such table: {missing}: {NO_TABLES}"
            ))),
            None => Ok(()),
        }
    }

    async fn write_batch(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        match self.write_all(writes).await {
            Ok(written) => written.into_iter().map(Ok).collect(),
            Err(e) => writes.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        let (size, idle) = if self.shared {
            (self.writer.size(), self.writer.num_idle())
        } else {
            (
                self.writer.size() + self.reader.size(),
                self.writer.num_idle() + self.reader.num_idle(),
            )
        };
        let idle = u32::try_from(idle).unwrap_or(u32::MAX);
        Some(PoolStats { size, idle })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::SqliteConnection;

    fn claim(key: u8) -> ClaimRequest {
        ClaimRequest {
            tenant: "t".into(),
            key_hash: [key; 32],
            fingerprint: None,
            reservation_id: Uuid::new_v4(),
            lease_seconds: 30,
            ttl_seconds: 60,
            max_in_flight: None,
        }
    }

    async fn fresh() -> (tempfile::TempDir, String, SqliteStore) {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let store = SqliteStore::open(&url).await.expect("open");
        store.migrate().await.expect("migrate");
        (dir, url, store)
    }

    /// The SQLite primary result code of a database error.
    fn primary(e: &sqlx::Error) -> Option<i32> {
        let code = e.as_database_error()?.code()?;
        code.parse::<i32>().ok().map(|c| c & 0xff)
    }

    async fn connect(url: &str, busy: Duration) -> SqliteConnection {
        SqliteConnectOptions::from_str(url)
            .expect("url")
            .busy_timeout(busy)
            .connect()
            .await
            .expect("connect")
    }

    #[tokio::test]
    async fn a_file_that_cannot_be_opened_is_unavailable() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("no/such/dir.db").display());
        let err = SqliteStore::open(&url).await.expect_err("opened");
        // SQLITE_CANTOPEN: create_if_missing makes the file, not its directory.
        assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    }

    #[tokio::test]
    async fn a_write_lock_held_past_the_busy_timeout_is_unavailable() {
        let (_dir, url, _store) = fresh().await;
        let mut holder = connect(&url, BUSY_TIMEOUT).await;
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut holder)
            .await
            .expect("lock");
        let mut contender = connect(&url, Duration::ZERO).await;
        let err = sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut contender)
            .await
            .expect_err("second writer got the lock");
        assert_eq!(primary(&err), Some(SQLITE_BUSY));
        assert!(matches!(classify(err), StoreError::Unavailable(_)));
    }

    #[tokio::test]
    async fn a_writer_waits_for_another_connections_lock() {
        let (_dir, url, store) = fresh().await;
        let mut holder = connect(&url, BUSY_TIMEOUT).await;
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut holder)
            .await
            .expect("lock");
        let release = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            sqlx::query("COMMIT")
                .execute(&mut holder)
                .await
                .expect("unlock");
        };
        let req = claim(1);
        let (claimed, ()) = tokio::join!(store.reserve(&req), release);
        assert!(
            claimed
                .expect("reserve waited for the lock")
                .expect("no limit")
                .claimed
        );
    }

    #[tokio::test]
    async fn a_full_disk_and_a_read_only_file_are_unavailable() {
        let (_dir, url, _store) = fresh().await;
        let insert = "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
                      VALUES ('t', '00000000-0000-4000-8000-000000000000', zeroblob(100000))";

        let mut full = connect(&url, BUSY_TIMEOUT).await;
        let pages: i64 = sqlx::query_scalar("PRAGMA page_count")
            .fetch_one(&mut full)
            .await
            .expect("page_count");
        // A page limit at the current size stands in for a full disk.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "PRAGMA max_page_count = {pages}"
        )))
        .execute(&mut full)
        .await
        .expect("max_page_count");
        let err = sqlx::query(insert)
            .execute(&mut full)
            .await
            .expect_err("wrote past the limit");
        assert_eq!(primary(&err), Some(SQLITE_FULL));
        assert!(matches!(classify(err), StoreError::Unavailable(_)));

        let mut read_only = SqliteConnectOptions::from_str(&url)
            .expect("url")
            .read_only(true)
            .connect()
            .await
            .expect("connect");
        let err = sqlx::query(insert)
            .execute(&mut read_only)
            .await
            .expect_err("wrote to a read-only connection");
        assert_eq!(primary(&err), Some(SQLITE_READONLY));
        assert!(matches!(classify(err), StoreError::Unavailable(_)));
    }

    #[tokio::test]
    async fn a_constraint_violation_is_a_bug_not_an_outage() {
        let (_dir, _url, store) = fresh().await;
        let err = sqlx::query(
            "INSERT INTO idempotency_keys (tenant, key_hash, state, reservation_id, attempt,
                                           created_at, expires_at)
             VALUES ('t', x'00', 'bogus', '00000000-0000-4000-8000-000000000000', 1, 0, 0)",
        )
        .execute(store.pool())
        .await
        .expect_err("CHECK let a bad state in");
        assert_eq!(primary(&err), Some(19), "SQLITE_CONSTRAINT");
        assert!(matches!(classify(err), StoreError::Other(_)));
    }

    #[tokio::test]
    async fn an_in_memory_database_works_through_one_connection() {
        let store = SqliteStore::open("sqlite::memory:").await.expect("open");
        store.migrate().await.expect("migrate");
        let first = store
            .reserve(&claim(7))
            .await
            .expect("reserve")
            .expect("no limit");
        assert!(first.claimed);
        let second = store
            .reserve(&claim(7))
            .await
            .expect("reserve")
            .expect("no limit");
        assert!(!second.claimed);
        assert_eq!(second.record.reservation_id, first.record.reservation_id);
        let found = store
            .find_by_reservation("t", first.record.reservation_id)
            .await
            .expect("find");
        assert!(found.is_some());
        store.ping().await.expect("ping");
        let stats = store.pool_stats().expect("stats");
        assert_eq!(stats.size, 1);
    }

    /// A write of 100 kB, about 25 pages.
    async fn write_past(tx: &mut WriteTx) -> sqlx::Result<()> {
        sqlx::query(
            "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
             VALUES (?1, ?2, ?3)",
        )
        .bind("t")
        .bind(Uuid::new_v4().hyphenated())
        .bind(vec![0u8; 100_000])
        .execute(&mut **tx)
        .await
        .map(|_| ())
    }

    #[tokio::test]
    async fn a_write_that_failed_leaves_its_connection_behind() {
        let (_dir, _url, store) = fresh().await;
        // A page limit on the write connection stands in for a full disk;
        // it belongs to the connection, so a fresh one has none.
        let pages: i64 = sqlx::query_scalar("PRAGMA page_count")
            .fetch_one(store.pool())
            .await
            .expect("page_count");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "PRAGMA max_page_count = {pages}"
        )))
        .execute(store.pool())
        .await
        .expect("max_page_count");
        let mut tx = store.begin_write().await.expect("begin");
        let err = write_past(&mut tx).await.expect_err("wrote past the limit");
        assert_eq!(primary(&err), Some(SQLITE_FULL));
        drop(tx);
        let limit: i64 = sqlx::query_scalar("PRAGMA max_page_count")
            .fetch_one(store.pool())
            .await
            .expect("max_page_count");
        assert!(limit > pages, "the same connection came back: {limit}");
        let mut tx = store.begin_write().await.expect("begin");
        write_past(&mut tx)
            .await
            .expect("a fresh connection writes");
        tx.commit().await.expect("commit");
    }

    #[tokio::test]
    async fn an_abandoned_write_in_memory_is_rolled_back_not_lost() {
        let store = SqliteStore::open("sqlite::memory:").await.expect("open");
        store.migrate().await.expect("migrate");
        let kept = store
            .reserve(&claim(1))
            .await
            .expect("reserve")
            .expect("no limit");
        let mut tx = store.begin_write().await.expect("begin");
        write_past(&mut tx).await.expect("write");
        drop(tx);
        let fences: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_reservations")
            .fetch_one(&store.reader)
            .await
            .expect("count");
        assert_eq!(
            fences, 1,
            "the abandoned write was rolled back, the rest kept"
        );
        let found = store
            .find_by_reservation("t", kept.record.reservation_id)
            .await
            .expect("find");
        assert!(found.is_some());
        assert!(
            store
                .reserve(&claim(2))
                .await
                .expect("reserve")
                .expect("no limit")
                .claimed
        );
    }
}
