//! The PostgreSQL store: every transition is one statement, made atomic across
//! processes by the primary key's row lock, with the database's `now()` as the
//! one clock all processes share.
//!
//! The reserve is one call of the plpgsql function `idemgate_reserve` (one
//! round trip; on Citus one router call, run on the worker that holds the
//! tenant's shard). It first reads the key's record without a lock and
//! answers at once when the record refuses the claim (a replay, a 409, a
//! 422), so a storm of retries takes no row lock, writes nothing and waits
//! for no one's transaction; a new key is then one `INSERT … ON CONFLICT DO
//! NOTHING`, and only a claim that applies to an existing record locks it
//! (`SELECT … FOR UPDATE`, to learn the id it supersedes) and updates it.
//! `idemgate_write_batch` takes an advisory lock for every key it will
//! write, in one order, before writing in queue order, so two batches never
//! wait on each other in a cycle. The store keeps its own stack of
//! connections (`conns.rs`: each new connection checked for writability,
//! tried across the hosts of a multi-host `DATABASE_URL` that `hosts.rs`
//! cuts up) rather than sqlx's pool, whose unconditional ping on every
//! release cost one more round trip per statement (a quarter of the CPU per
//! reserve+commit, BENCHMARKS.md); a connection whose statement was
//! cancelled or failed at the connection level is closed, not reused. Also
//! here: `tls.rs` (libpq's `sslmode` and its files, and which TLS failures
//! refuse the start), `write_batch.rs`, `citus.rs`, `upgrade.rs` (the
//! schema's status, the processes connected, the compatibility write for
//! releases before 0.2.0).
//!
//! # The commit is a heap-only update
//!
//! No index reads a column the commit changes (migration
//! `20261210000001_heap_only_commit.sql`, its indexes built `CONCURRENTLY`
//! in `20261210000003`), and the table leaves room on each
//! page (fillfactor 85), so PostgreSQL writes the completed row beside the
//! in-flight one with no new index entry. That rules out an index on
//! `state`: the keys nobody settles are found instead through what the
//! commit leaves alone, the lease's end and the unknown mark (`stuck.rs`,
//! which keeps the gauge's count), and the tenant limit counts through
//! `idempotency_keys_limited`, which holds only keys claimed under a limit
//! (their commit is the one that is not heap-only).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, FromRow};
use tokio::sync::Semaphore;

mod citus;
mod conns;
mod errors;
mod hosts;
mod migrate;
mod rows;
pub mod sql;
mod store;
mod stuck;
mod tls;
mod upgrade;
mod write_batch;

use super::{Result, StoreError};
use citus::Layout;
use conns::{ANSWER_MARGIN, Conns, Host};
use errors::{Target, classify, connect_failed};

/// The PostgreSQL schema migrations (`migrations/postgres`). Migrations a
/// newer release applied are no reason to refuse (a rollback to this one
/// works on them) unless one is a contract step ([`crate::store::schema`]).
/// Embedded by the build (build.rs), as `sqlx::migrate!` would.
pub static MIGRATOR: LazyLock<sqlx::migrate::Migrator> = LazyLock::new(|| {
    super::embedded_migrator(include!(concat!(
        env!("OUT_DIR"),
        "/migrations_postgres.rs"
    )))
});

/// How the pool behaves; the defaults suit one idemgate process.
#[derive(Debug, Clone)]
pub struct PgSettings {
    /// Most connections the pool opens.
    pub max_connections: u32,
    /// How long a request waits for a connection before answering 503.
    pub acquire_timeout: Duration,
    /// Server-side limit on one statement, so a hung database gives a 503.
    pub statement_timeout: Duration,
    /// A pooler in transaction mode stands between the store and
    /// PostgreSQL (`IDEMGATE_PG_POOLER=transaction`): keep no session state.
    /// Each statement then runs unnamed, in a transaction of its own that
    /// sets the statement timeout with `SET LOCAL`, and nothing is sent at
    /// startup beyond what every pooler takes.
    pub transaction_pooler: bool,
}

impl Default for PgSettings {
    fn default() -> Self {
        PgSettings {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(3),
            statement_timeout: Duration::from_secs(5),
            transaction_pooler: false,
        }
    }
}

/// A [`Store`](crate::store::Store) over PostgreSQL connections.
#[derive(Debug, Clone)]
pub struct PgStore {
    /// For migrations and for tools; opens connections only when used.
    pool: PgPool,
    /// For every statement of the store.
    conns: Arc<Conns>,
    /// For the pool of the server that takes writes.
    settings: PgSettings,
    /// One PostgreSQL or a Citus cluster: read once, by the migrations or by
    /// the first pruning batch.
    layout: Arc<tokio::sync::OnceCell<Layout>>,
    /// The stuck keys the last count found (`stuck.rs`).
    stuck: Arc<tokio::sync::Mutex<stuck::Tally>>,
}

// === impl PgStore ===

impl PgStore {
    /// Builds a pool for `url` without connecting yet: the server can start,
    /// and recover, while the database is away.
    /// `url` may name several servers, as libpq takes them (see the `hosts`
    /// module): the store then uses the one that takes writes.
    pub fn connect_lazy(url: &str, settings: &PgSettings) -> Result<PgStore> {
        let hosts = hosts::split(url).map_err(StoreError::other)?;
        let timeout_ms = settings.statement_timeout.as_millis();
        // A pooler in transaction mode refuses startup parameters it does
        // not know (PgBouncer: `extra_float_digits`, `options`), and hands
        // each transaction to whichever server connection is free: a named
        // statement prepared on one is missing (or already there) on the
        // next. So nothing but what every pooler takes at startup, no
        // statement cache (and each query unnamed, see `Conns::persistent`),
        // and the settings carried by each statement's own transaction.
        // Floats come back in binary, so `extra_float_digits` changes
        // nothing read here.
        let scope = settings.transaction_pooler.then(|| {
            format!(
                "BEGIN; SET LOCAL statement_timeout = {timeout_ms}; \
                 SET LOCAL client_min_messages = warning"
            )
        });
        let with_session = |options: PgConnectOptions| {
            let options = options
                // Every connection names its release, for `idemgate migrate
                // --status` and its refusals (docs/operations.md, “Upgrading”).
                .application_name(crate::store::schema::APPLICATION_NAME)
                .log_statements(tracing::log::LevelFilter::Trace);
            if settings.transaction_pooler {
                options.extra_float_digits(None).statement_cache_capacity(0)
            } else {
                options.options([
                    ("statement_timeout", format!("{timeout_ms}")),
                    // The server's NOTICEs (the migrations' `relation
                    // "_sqlx_migrations" already exists, skipping`) are no
                    // news to an operator; warnings and errors still come
                    // through.
                    ("client_min_messages", "warning".to_owned()),
                ])
            }
        };
        let mut servers = Vec::with_capacity(hosts.urls.len());
        let mut sslmode = "prefer";
        for url in &hosts.urls {
            let attempts = tls::options(url)
                .map_err(|e| StoreError::other(format!("invalid PostgreSQL URL: {e}")))?;
            sslmode = attempts.given;
            let options = with_session(attempts.first);
            servers.push(Host {
                target: Target::of(&options),
                fallback: attempts.fallback.map(with_session),
                fell_back: AtomicBool::new(false),
                options,
            });
        }
        let pool = Self::pool_of(servers[0].options.clone(), settings);
        let max = settings.max_connections.max(1);
        let all: Vec<PgConnectOptions> = servers.iter().map(|h| h.options.clone()).collect();
        let conns = Arc::new(Conns {
            target: Target::of_all(&all),
            hosts: servers,
            current: AtomicUsize::new(0),
            sslmode,
            synchronous: AtomicBool::new(false),
            idle: Mutex::new(Vec::with_capacity(max as usize)),
            permits: Semaphore::new(max as usize),
            acquire_timeout: settings.acquire_timeout,
            answer_timeout: settings.statement_timeout + ANSWER_MARGIN,
            open: AtomicU32::new(0),
            scope,
        });
        Ok(PgStore {
            pool,
            settings: settings.clone(),
            conns,
            layout: Arc::default(),
            stuck: Arc::default(),
        })
    }

    /// The migrations' and tools' pool, for one server.
    fn pool_of(options: PgConnectOptions, settings: &PgSettings) -> PgPool {
        PgPoolOptions::new()
            .max_connections(2)
            .min_connections(0)
            .idle_timeout(Duration::from_secs(30))
            .acquire_timeout(settings.acquire_timeout)
            .connect_lazy_with(options)
    }

    /// The pool, for tests and tools: on the first server `DATABASE_URL`
    /// names.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A pool on the server that takes writes: the first one's when
    /// `DATABASE_URL` names one, else one on the server a connection of the
    /// store's just found.
    async fn writable_pool(&self) -> Result<PgPool> {
        if self.conns.hosts.len() == 1 {
            return Ok(self.pool.clone());
        }
        let deadline = tokio::time::Instant::now() + self.conns.acquire_timeout;
        let conn = self.conns.connect(deadline).await?;
        let _ = sqlx::Connection::close(conn).await;
        let host = &self.conns.hosts[self.conns.current.load(Ordering::Relaxed)];
        Ok(Self::pool_of(host.working_options(), &self.settings))
    }

    /// What an acknowledged write survives, as the server last connected to
    /// said: `SynchronousStandby` when a synchronous standby had it.
    pub fn durability(&self) -> crate::store::Durability {
        self.conns.durability()
    }

    /// Asks the server that takes writes what it streams to, and says at
    /// WARN when it streams to standbys none of which is synchronous (an
    /// acknowledged key is then lost if the primary is, and a standby
    /// promoted): for the start-up log.
    pub async fn report_durability(&self) -> Result<crate::store::Durability> {
        let deadline = tokio::time::Instant::now() + self.conns.acquire_timeout;
        let mut conn = self.conns.connect(deadline).await?;
        let row = sqlx::raw_sql(conns::WRITABLE).fetch_one(&mut conn).await;
        let _ = sqlx::Connection::close(conn).await;
        let row = row.map_err(|e| classify(e, &self.conns.target))?;
        let text = |i: usize| {
            sqlx::Row::try_get::<String, _>(&row, i)
                .map_err(|e| StoreError::other(format!("the replication check: {e}")))
        };
        let replication = conns::Replication {
            synchronous_standby_names: text(2)?,
            synchronous_commit: text(3)?,
            standbys: text(4)?.parse().unwrap_or(0),
        };
        let durability = replication.durability();
        if replication.standbys > 0 && durability == crate::store::Durability::Local {
            tracing::warn!(
                standbys = replication.standbys,
                synchronous_standby_names = %replication.synchronous_standby_names,
                synchronous_commit = %replication.synchronous_commit,
                "the primary streams to standbys, none of them synchronous: a key acknowledged \
                 here is lost if the primary is lost and a standby promoted before it had the \
                 key (set synchronous_standby_names on the primary, with synchronous_commit on, \
                 for acknowledged keys to survive a failover)"
            );
        } else {
            tracing::info!(
                standbys = replication.standbys,
                durability = durability.as_str(),
                "the database's durability"
            );
        }
        Ok(durability)
    }

    /// Runs a query returning rows on one of the store's connections; the
    /// first row, if any.
    async fn fetch_row<'q, O>(
        &self,
        query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> Result<Option<O>>
    where
        O: Send + Unpin + for<'r> FromRow<'r, sqlx::postgres::PgRow>,
    {
        let query = query.persistent(self.conns.persistent());
        let mut conn = self.conns.acquire().await?;
        let result = self
            .conns
            .answered(conn.scoped(async |c| query.fetch_optional(c).await))
            .await?;
        conn.done(&result);
        result.map_err(|e| classify(e, &self.conns.target))
    }

    /// Runs a query returning one column on one of the store's connections;
    /// the first row's value, if any.
    async fn fetch_scalar<'q, O>(
        &self,
        query: sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> Result<Option<O>>
    where
        O: Send + Unpin,
        (O,): for<'r> FromRow<'r, sqlx::postgres::PgRow>,
    {
        let query = query.persistent(self.conns.persistent());
        let mut conn = self.conns.acquire().await?;
        let result = self
            .conns
            .answered(conn.scoped(async |c| query.fetch_optional(c).await))
            .await?;
        conn.done(&result);
        result.map_err(|e| classify(e, &self.conns.target))
    }

    /// Applies the pending migrations; on a Citus cluster, then distributes
    /// the tables and the claim function (see the `citus` module).
    ///
    /// Refuses, naming it, a pending contract step that a connected process
    /// cannot work with, and a database on which a newer release applied a
    /// contract step (docs/operations.md, “Upgrading”).
    pub async fn migrate(&self) -> Result<()> {
        self.migrate_with(&MIGRATOR).await
    }

    /// [`PgStore::migrate`] with `migrator`'s migrations in place of this
    /// release's: for tests of the upgrade rules.
    pub async fn migrate_with(&self, migrator: &sqlx::migrate::Migrator) -> Result<()> {
        let status = match self.schema_status(migrator).await {
            Ok(status) => Some(status),
            // The server away: the migration's own attempt says why.
            Err(e) if e.is_unavailable() => None,
            Err(e) => return Err(e),
        };
        if let Some(why) = status.as_ref().and_then(|s| s.refusal()) {
            return Err(StoreError::other(why));
        }
        if let Some(status) = status.as_ref().filter(|s| s.bridged()) {
            let steps: Vec<String> = status.blocked.iter().map(|b| b.step.name()).collect();
            tracing::warn!(
                steps = %steps.join(", "),
                "processes of idemgate before 0.2.0 are connected: applying the migrations with \
                 a compatibility write for them, which `idemgate migrate` drops once none is \
                 connected"
            );
            self.migrate_bridged(migrator).await?;
        }
        let pool = self.writable_pool().await?;
        self.run_migrations(migrator, &pool).await?;
        if status.as_ref().is_some_and(|s| s.bridge_on || s.bridged()) {
            let now = self.schema_status(migrator).await?;
            if now.bridge_on && !now.older_connected() {
                match self.drop_bridge(migrator).await {
                    Ok(()) => tracing::info!(
                        "no process of idemgate before 0.2.0 is connected: the compatibility \
                         write for them is dropped"
                    ),
                    Err(e) => tracing::warn!(
                        error = e.reason(),
                        "could not drop the compatibility write for idemgate before 0.2.0"
                    ),
                }
            }
        }
        let layout = citus::distribute(&pool).await?;
        let _ = self.layout.set(layout);
        Ok(())
    }

    /// Why the database cannot serve without migrations, if it cannot: it
    /// does not exist, has no idemgate tables, or misses some of this
    /// version's migrations. For a start with `--no-migrate`, which must
    /// refuse rather than answer every request 503. An error is anything
    /// else (the server is down, unreachable, refuses the role): an outage
    /// the server may start through and recover from.
    pub async fn not_set_up(&self) -> Result<Option<String>> {
        let target = &self.conns.target;
        let pool = self.writable_pool().await?;
        let mut conn = match pool.acquire().await {
            Ok(conn) => conn,
            Err(sqlx::Error::PoolTimedOut) => return Err(self.why_no_connection().await),
            Err(e) => {
                let missing_database = e
                    .as_database_error()
                    .and_then(|d| d.code())
                    .is_some_and(|c| c == "3D000");
                if missing_database {
                    return Ok(Some(classify(e, target).reason().to_owned()));
                }
                return Err(connect_failed(e, target));
            }
        };
        // Once per process: not kept prepared, and in a transaction of its
        // own: a pooler in transaction mode keeps no prepared statement,
        // and may send an unnamed one's execution to another server
        // connection than its parse once the parse's sync found no
        // transaction open.
        let mut tx = sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?;
        let table: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .persistent(false)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| classify(e, target))?;
        let why = if table {
            let applied: Result<Vec<i64>, sqlx::Error> =
                sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                    .persistent(false)
                    .fetch_all(&mut *tx)
                    .await;
            match applied {
                Ok(applied) => match super::missing_migrations(&MIGRATOR, &applied) {
                    Some(why) => Some(why),
                    None => {
                        tx.rollback().await.map_err(|e| classify(e, target))?;
                        drop(conn);
                        return Ok(self.schema_status(&MIGRATOR).await?.refusal());
                    }
                },
                // insufficient_privilege: a role granted too little.
                Err(e)
                    if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("42501") =>
                {
                    Some(format!(
                        "keeps its list of migrations (_sqlx_migrations) where the role {} may \
                         not read it ({}): grant the role what docs/operations.md's \"Least privilege\" \
                         lists, SELECT on _sqlx_migrations among it",
                        errors::shell_word(&target.user),
                        e.as_database_error()
                            .map(|d| d.message())
                            .unwrap_or_default()
                    ))
                }
                Err(e) => return Err(classify(e, target)),
            }
        } else {
            Some("has no idemgate tables".into())
        };
        Ok(why.map(|why| {
            format!(
                "the database {} on {} {why}",
                errors::shell_word(&target.database),
                target.server()
            )
        }))
    }

    /// What no waiting mends, found at start with one connection: a TLS
    /// setting of `DATABASE_URL` the server does not satisfy (a certificate
    /// that does not verify under `verify-ca`/`verify-full`, a server without
    /// TLS under `require`, a client certificate refused), in words naming
    /// the setting. `None` when the connection was made, or failed as an
    /// outage does (down, unreachable, silent): the doors answer 503 until
    /// the server is back. When `sslmode`'s second attempt (`allow`,
    /// `prefer`) is the one that connected, the migrations' pool takes its
    /// options too.
    pub async fn refusal_at_start(&self) -> Option<String> {
        for host in &self.conns.hosts {
            let connected =
                tokio::time::timeout(self.conns.acquire_timeout, Conns::open(host)).await;
            match connected {
                Ok(Ok(conn)) => {
                    if std::ptr::eq(host, &self.conns.hosts[0]) {
                        self.pool.set_connect_options(host.working_options());
                    }
                    drop(conn);
                    return None;
                }
                Ok(Err(e)) => {
                    if let Some(refusal) =
                        tls::refusal(&e, self.conns.sslmode, &host.options, &host.target)
                    {
                        return Some(refusal);
                    }
                }
                Err(_) => {}
            }
        }
        None
    }

    /// How the tables are laid out, read once.
    async fn layout(&self) -> Result<Layout> {
        self.layout
            .get_or_try_init(|| async {
                let mut conn = self.conns.acquire().await?;
                let result = self
                    .conns
                    .answered(conn.scoped(async |c| citus::layout(c).await))
                    .await?;
                conn.done(&result);
                result.map_err(|e| classify(e, &self.conns.target))
            })
            .await
            .copied()
    }

    /// Why the pool timed out, which it does not say: one direct attempt
    /// says why it could not connect (refused, unknown host, bad password).
    async fn why_no_connection(&self) -> StoreError {
        let target = &self.conns.target;
        let deadline = tokio::time::Instant::now() + self.conns.acquire_timeout;
        match tokio::time::timeout_at(deadline, self.conns.connect(deadline)).await {
            Ok(Err(e)) => e,
            Ok(Ok(_)) => StoreError::unavailable(format!(
                "PostgreSQL at {} did not answer in time",
                target.server()
            )),
            Err(_) => target.no_answer(self.conns.acquire_timeout),
        }
    }

    /// Applies `migrator`'s pending migrations under sqlx's migration lock,
    /// each step without holding writes for long (the `migrate` module).
    async fn run_migrations(
        &self,
        migrator: &sqlx::migrate::Migrator,
        pool: &PgPool,
    ) -> Result<()> {
        let target = &self.conns.target;
        let mut conn = match pool.acquire().await {
            Ok(conn) => conn,
            // The pool says only that it timed out; one direct attempt says
            // why it could not connect (refused, unknown host, bad password).
            Err(sqlx::Error::PoolTimedOut) => return Err(self.why_no_connection().await),
            Err(e) => return Err(classify(e, target)),
        };
        let failed = |e: sqlx::migrate::MigrateError| match e {
            sqlx::migrate::MigrateError::Execute(e) => classify(e, target),
            sqlx::migrate::MigrateError::ExecuteMigration(e, version) => {
                classify(e, target).reworded(|why| format!("migration {version}: {why}"))
            }
            other => StoreError::other(other.to_string()).because(other),
        };
        migrate::lock(&mut conn).await.map_err(failed)?;
        let result =
            migrate::apply(&mut conn, migrator, None, !self.settings.transaction_pooler).await;
        let unlocked = migrate::unlock(&mut conn).await;
        result.map_err(failed)?;
        unlocked.map_err(failed)
    }
}
