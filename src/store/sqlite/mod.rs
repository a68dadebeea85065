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

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::ConnectOptions;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

mod errors;
mod lock;
mod rows;
mod sql;
mod store;
mod tx;

use errors::classify;
use rows::{KeyRow, now_ms, ts};
use sql::SELECT_KEY;
use tx::{WriteTx, after_write, claim_in, complete_in, release_in};

use super::{Claim, ClaimRequest, Record, Result, StoreError, Write, Written};
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

/// A [`Store`](crate::store::Store) over one SQLite file: one write connection, a few readers.
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
            .map_err(|e| StoreError::other(format!("invalid SQLite URL: {e}")).because(e))?
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
            other => StoreError::other(other.to_string()).because(other),
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
        Ok(record.refuses_claims(now).then_some(Claim {
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

/// Whether `url` names an in-memory database (`sqlite::memory:`,
/// `mode=memory`), which the store serves through its one write connection.
fn is_in_memory(url: &str, options: &SqliteConnectOptions) -> bool {
    let name = options.get_filename().to_string_lossy();
    name == ":memory:" || name.starts_with("file:sqlx-in-memory-") || url.contains("mode=memory")
}

#[cfg(test)]
mod tests;
