//! The embedded SQLite store: the same transitions as the PostgreSQL store,
//! each one a `BEGIN IMMEDIATE` transaction, so the file's write lock makes
//! it atomic across every connection and process that opens the file.
//!
//! Design, and where it differs from PostgreSQL:
//!
//! * **Writes** run on one dedicated OS thread that owns the write
//!   connection (a `rusqlite::Connection`), fed through a channel: each
//!   operation, and each batch of the group commit
//!   ([`HotPath::write_batch`](crate::store::HotPath::write_batch)), is one
//!   command, one whole transaction (`BEGIN IMMEDIATE` … `COMMIT`) with
//!   prepared, cached statements, answered through a oneshot channel (see
//!   [`writer`]). Not sqlx's pool of one connection: sqlx made every
//!   statement an async round trip to its connection's thread, which cost a
//!   new key three times PostgreSQL's CPU; here a transaction is one hop
//!   there and one back. Within a process the commands queue fairly, first
//!   come first served, instead of spinning on SQLite's busy handler against
//!   one another; across processes (or two stores on one file) `BEGIN
//!   IMMEDIATE` takes the write lock before the first read, and the busy
//!   timeout makes a contender wait for it rather than fail. A transaction
//!   that fails (or a command that panics) is rolled back before the next
//!   command runs, and after a write that failed on a file the connection is
//!   replaced by a fresh one, so that the store recovers by itself from a
//!   full disk or a file made read-only once the fault is gone. A request
//!   that goes away only drops its answer. Dropping the last handle of the
//!   store ends the thread, which closes the connection and then lets go of
//!   the file lock. The thread takes every write that queued while it wrote
//!   the last group and plans their transactions with the PostgreSQL
//!   writer's algorithm (`batch/plan.rs`). A new key's claim is a plain
//!   `INSERT … ON CONFLICT DO NOTHING` and a commit a plain `UPDATE` and a
//!   read of the record without its response: SQLite runs a statement with
//!   `RETURNING` into a temporary b-tree of its own, and an `IN` list of
//!   three or more values too, which is why the table's CHECKs are
//!   comparisons. No trigger runs for a new key; the one on a change of a
//!   record's reservation id writes the id it supersedes. Its own parts:
//!   `writer.rs` (the thread), `tx.rs`, `lock.rs`.
//! * **Reads** (`find_by_reservation`, `ping`, and a reserve's look at the
//!   key when the write lock cannot be had) use a separate sqlx pool: in WAL
//!   mode readers never wait on the writer, so a file that cannot be written
//!   still replays. (Replays were already fast there; they stay as they
//!   were.)
//! * **Migrations** are sqlx's ([`MIGRATOR`], the `_sqlx_migrations` table),
//!   applied through the direct-SQL pool ([`SqliteStore::pool`]), which
//!   opens its one connection only when used.
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
//! * **In memory** (`sqlite::memory:`, `mode=memory`): the writer and one
//!   sqlx connection (reads and direct SQL) share one in-memory database
//!   through SQLite's shared cache; it lives while the store does.

use std::str::FromStr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use sqlx::ConnectOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions, SqliteSynchronous};

mod errors;
mod lock;
mod rows;
mod sql;
mod store;
mod tx;
mod writer;

use errors::classify;
use rows::{KeyRow, now_ms, ts};
use sql::SELECT_KEY;
use tx::write_in;
use writer::{Target, Writer};

use super::{Claim, ClaimRequest, Record, Result, StoreError, Write, Written};

/// A write answered with another kind of answer (never, but not a panic).
fn mismatched() -> StoreError {
    StoreError::other("a grouped write got another kind of answer")
}
use lock::FileLock;

/// The SQLite schema migrations (`migrations/sqlite`). Migrations a newer
/// release applied are no reason to refuse (a rollback to this one works on
/// them) unless one is a contract step ([`crate::store::schema`]).
/// Embedded by the build (build.rs), as `sqlx::migrate!` would.
pub static MIGRATOR: LazyLock<sqlx::migrate::Migrator> = LazyLock::new(|| {
    super::embedded_migrator(include!(concat!(env!("OUT_DIR"), "/migrations_sqlite.rs")))
});

/// How long a writer waits for another connection's write lock (another
/// process on the same file) before the store reports itself unavailable.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request waits for a pooled connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// Read connections: reads are short, and each connection is a thread.
const READERS: u32 = 4;

/// A [`Store`](crate::store::Store) over one SQLite file: one writer thread,
/// a few readers. Clones share all of it.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    /// The writer thread (see [`writer`]).
    writer: Writer,
    reader: SqlitePool,
    /// Direct SQL for tests and tools, and the migrations: one connection,
    /// opened when used (in memory: the readers' connection).
    direct: SqlitePool,
    /// True when `reader` is `direct` (in-memory databases).
    shared: bool,
    /// This process's hold on the file (none for an in-memory database):
    /// one idemgate process per file. The writer thread holds it too, until
    /// its connection is closed.
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
        SqliteStore::open_with(url, true).await
    }

    /// As [`SqliteStore::open`], but a file that is not there is an error
    /// naming its path, and nothing is created (neither the file nor its
    /// lock file): for the commands that read a database someone else set
    /// up (`keys`, `prune`, `serve --no-migrate`).
    pub async fn open_existing(url: &str) -> Result<SqliteStore> {
        SqliteStore::open_with(url, false).await
    }

    /// Says in the lock file of the database `url` names, where this
    /// process holds it, the URL at which this process answers the
    /// operators' endpoints: a second process refused the file (`idemgate
    /// keys`) then says where to ask instead. Nothing for an in-memory
    /// database, or a file this process has not opened.
    pub fn announce_admin(url: &str, admin_url: &str) {
        let Ok(options) = SqliteConnectOptions::from_str(url) else {
            return;
        };
        if is_in_memory(url, &options) {
            return;
        }
        if let Err(e) = lock::announce_admin(options.get_filename(), admin_url) {
            tracing::debug!(error = %e, "cannot write the admin URL into the lock file");
        }
    }

    async fn open_with(url: &str, create: bool) -> Result<SqliteStore> {
        let mut base = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::other(format!("invalid SQLite URL: {e}")).because(e))?
            .create_if_missing(create)
            .busy_timeout(BUSY_TIMEOUT)
            .synchronous(SqliteSynchronous::Full)
            .log_statements(tracing::log::LevelFilter::Trace);
        let in_memory = is_in_memory(url, &base);
        if in_memory {
            // The writer's connection and the readers' share the database.
            base = base.shared_cache(true);
        }
        // Before the first connection: a second process must not so much as
        // switch the journal mode or apply a migration under the first.
        if !in_memory && !create && !base.get_filename().exists() {
            return Err(StoreError::other(format!(
                "no SQLite database at {}: nothing was created; check the path, or create \
                 it with `idemgate migrate`",
                base.get_filename().display()
            )));
        }
        let lock = if in_memory {
            None
        } else {
            Some(Arc::new(FileLock::acquire(base.get_filename())?))
        };
        // The writer switches the file to WAL; the mode is stored in the
        // file, and readers opened afterwards find it there.
        let writer = Writer::start(
            Target {
                path: base.get_filename().to_path_buf(),
                in_memory,
                create: create || in_memory,
                busy_timeout: BUSY_TIMEOUT,
            },
            lock.clone(),
        )
        .await?;
        let direct = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .test_before_acquire(false);
        let (direct, reader) = if in_memory {
            // No WAL in memory (readers would take table locks against the
            // writer for longer): one connection for reads and direct SQL,
            // kept for the life of the store.
            let direct = direct
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(base)
                .await
                .map_err(classify)?;
            (direct.clone(), direct)
        } else {
            let reader = SqlitePoolOptions::new()
                .max_connections(READERS)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .test_before_acquire(false)
                .connect_lazy_with(base.clone());
            (direct.connect_lazy_with(base), reader)
        };
        Ok(SqliteStore {
            writer,
            reader,
            direct,
            shared: in_memory,
            _lock: lock,
        })
    }

    /// A pool of one connection on the database, for direct SQL from tests
    /// and tools (and the migrations). Its writes take the file's write
    /// lock as the store's do, waiting up to the busy timeout for the
    /// store's writer (and it for them): do not hold a transaction open on
    /// it across a call into the store.
    pub fn pool(&self) -> &SqlitePool {
        &self.direct
    }

    /// Applies the pending migrations; refuses a file on which a newer
    /// release applied a contract step (docs/operations.md, “Upgrading”).
    pub async fn migrate(&self) -> Result<()> {
        self.migrate_with(&MIGRATOR).await
    }

    /// [`SqliteStore::migrate`] with `migrator`'s migrations in place of
    /// this release's: for tests of the upgrade rules.
    pub async fn migrate_with(&self, migrator: &sqlx::migrate::Migrator) -> Result<()> {
        if let Some(why) = self.schema_status(migrator).await?.refusal() {
            return Err(StoreError::other(why));
        }
        migrator.run(&self.direct).await.map_err(|e| match e {
            sqlx::migrate::MigrateError::Execute(e) => classify(e),
            other => StoreError::other(other.to_string()).because(other),
        })
    }

    /// Why the file cannot serve without migrations, if it cannot: it has
    /// no idemgate tables, or misses some of this version's migrations. For
    /// a start with `--no-migrate`, which must refuse rather than answer
    /// every request 503.
    pub async fn not_set_up(&self) -> Result<Option<String>> {
        let table: Option<String> = sqlx::query_scalar(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
        )
        .fetch_optional(&self.direct)
        .await
        .map_err(classify)?;
        if table.is_none() {
            return Ok(Some("has no idemgate tables".into()));
        }
        let applied: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                .fetch_all(&self.direct)
                .await
                .map_err(classify)?;
        match super::missing_migrations(&MIGRATOR, &applied) {
            Some(why) => Ok(Some(why)),
            None => Ok(self.schema_status(&MIGRATOR).await?.refusal()),
        }
    }

    /// This release's SQLite migrations.
    pub fn migrator() -> &'static sqlx::migrate::Migrator {
        &MIGRATOR
    }

    /// The file's migrations beside `migrator`'s. No process but this one
    /// has the file open (its lock), so none is listed as connected.
    pub async fn schema_status(
        &self,
        migrator: &sqlx::migrate::Migrator,
    ) -> Result<crate::store::schema::SchemaStatus> {
        let mut conn = self.direct.acquire().await.map_err(classify)?;
        read_schema_status(&mut conn, migrator).await
    }

    /// As [`SqliteStore::schema_status`], read through a read-only
    /// connection of its own without the file's lock, so that `migrate
    /// --status`, which changes nothing, reads a file a running process
    /// holds. A file that is not there is an error naming its path, and
    /// nothing is created.
    pub async fn schema_status_of(
        url: &str,
        migrator: &sqlx::migrate::Migrator,
    ) -> Result<crate::store::schema::SchemaStatus> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::other(format!("invalid SQLite URL: {e}")).because(e))?
            .create_if_missing(false)
            .read_only(true)
            .busy_timeout(BUSY_TIMEOUT);
        if !is_in_memory(url, &options) && !options.get_filename().exists() {
            return Err(StoreError::other(format!(
                "no SQLite database at {}: nothing was created; check the path, or create \
                 it with `idemgate migrate`",
                options.get_filename().display()
            )));
        }
        let mut conn = options.connect().await.map_err(classify)?;
        let status = read_schema_status(&mut conn, migrator).await;
        let _ = sqlx::Connection::close(conn).await;
        status
    }

    /// Closes the pools and the writer, waiting for their connections to
    /// finish; the last connection to close checkpoints the WAL into the
    /// main file. Committed data is durable without this; it only tidies up
    /// on shutdown.
    pub async fn close(&self) {
        self.reader.close().await;
        self.direct.close().await;
        self.writer.close().await;
    }

    /// The claim, under the write lock (see [`HotPath::reserve`](crate::store::HotPath::reserve)).
    async fn claim(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        match self.writer.submit(Write::Claim(req.clone())).await? {
            Written::Claim(claim) => Ok(claim),
            _ => Err(mismatched()),
        }
    }

    /// `writes` in one write transaction, one clock reading for all: one
    /// fsync where one by one each took its own.
    async fn write_all(&self, writes: &[&Write]) -> Result<Vec<Written>> {
        let writes: Vec<Write> = writes.iter().map(|&w| w.clone()).collect();
        self.writer
            .write(move |conn| {
                let now = now_ms();
                writes.iter().map(|w| write_in(conn, w, now)).collect()
            })
            .await
    }

    /// Refuses claims, commits and releases past `bound` waiting for the
    /// writer thread, instead of [`QUEUE_BOUND`](crate::store::Batcher).
    pub fn with_write_queue_bound(self, bound: usize) -> SqliteStore {
        self.writer.bound_queue(bound);
        self
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
}

/// Whether `url` names an in-memory database (`sqlite::memory:`,
/// `mode=memory`), which the writer and the readers share (shared cache).
/// The migrations a SQLite database records, beside `migrator`'s.
async fn read_schema_status(
    conn: &mut sqlx::SqliteConnection,
    migrator: &sqlx::migrate::Migrator,
) -> Result<crate::store::schema::SchemaStatus> {
    let table: Option<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
    )
    .fetch_optional(&mut *conn)
    .await
    .map_err(classify)?;
    let applied: Vec<(i64, String, Option<chrono::DateTime<chrono::Utc>>)> = if table.is_some() {
        sqlx::query_as(
            "SELECT version, description, installed_on FROM _sqlx_migrations \
             WHERE success ORDER BY version",
        )
        .fetch_all(&mut *conn)
        .await
        .map_err(classify)?
    } else {
        Vec::new()
    };
    Ok(crate::store::schema::SchemaStatus::new(
        "the SQLite database".to_owned(),
        migrator,
        applied,
        Vec::new(),
        false,
    ))
}

fn is_in_memory(url: &str, options: &SqliteConnectOptions) -> bool {
    let name = options.get_filename().to_string_lossy();
    name == ":memory:" || name.starts_with("file:sqlx-in-memory-") || url.contains("mode=memory")
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod writer_tests;
