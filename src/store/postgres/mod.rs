//! The PostgreSQL store: every transition is one statement, made atomic across
//! processes by the primary key's row lock, with the database's `now()` as the
//! one clock all processes share.

use std::str::FromStr;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, FromRow};
use tokio::sync::Semaphore;

mod citus;
mod conns;
mod errors;
mod rows;
pub mod sql;
mod store;
mod upgrade;
mod write_batch;

use super::{Result, StoreError};
use citus::Layout;
use conns::{ANSWER_MARGIN, Conns};
use errors::{Target, classify, connect_failed};

/// The PostgreSQL schema migrations (`migrations/postgres`). Migrations a
/// newer release applied are no reason to refuse (a rollback to this one
/// works on them) unless one is a contract step ([`crate::store::schema`]).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations/postgres")
};

/// How the pool behaves; the defaults suit one idemgate process.
#[derive(Debug, Clone)]
pub struct PgSettings {
    /// Most connections the pool opens.
    pub max_connections: u32,
    /// How long a request waits for a connection before answering 503.
    pub acquire_timeout: Duration,
    /// Server-side limit on one statement, so a hung database gives a 503.
    pub statement_timeout: Duration,
}

impl Default for PgSettings {
    fn default() -> Self {
        PgSettings {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(3),
            statement_timeout: Duration::from_secs(5),
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
    /// One PostgreSQL or a Citus cluster: read once, by the migrations or by
    /// the first pruning batch.
    layout: Arc<tokio::sync::OnceCell<Layout>>,
}

// === impl PgStore ===

impl PgStore {
    /// Builds a pool for `url` without connecting yet: the server can start,
    /// and recover, while the database is away.
    pub fn connect_lazy(url: &str, settings: &PgSettings) -> Result<PgStore> {
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::other(format!("invalid PostgreSQL URL: {e}")).because(e))?
            .options([
                (
                    "statement_timeout",
                    format!("{}", settings.statement_timeout.as_millis()),
                ),
                // The server's NOTICEs (the migrations' `relation
                // "_sqlx_migrations" already exists, skipping`) are no news
                // to an operator; warnings and errors still come through.
                ("client_min_messages", "warning".to_owned()),
            ])
            // Every connection names its release, for `idemgate migrate
            // --status` and its refusals (SPEC §14).
            .application_name(crate::store::schema::APPLICATION_NAME)
            .log_statements(tracing::log::LevelFilter::Trace);
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .min_connections(0)
            .idle_timeout(Duration::from_secs(30))
            .acquire_timeout(settings.acquire_timeout)
            .connect_lazy_with(options.clone());
        let max = settings.max_connections.max(1);
        let conns = Arc::new(Conns {
            target: Target::of(&options),
            options,
            idle: Mutex::new(Vec::with_capacity(max as usize)),
            permits: Semaphore::new(max as usize),
            acquire_timeout: settings.acquire_timeout,
            answer_timeout: settings.statement_timeout + ANSWER_MARGIN,
            open: AtomicU32::new(0),
        });
        Ok(PgStore {
            pool,
            conns,
            layout: Arc::default(),
        })
    }

    /// The pool, for tests and tools.
    pub fn pool(&self) -> &PgPool {
        &self.pool
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
        let mut conn = self.conns.acquire().await?;
        let result = self
            .conns
            .answered(query.fetch_optional(&mut *conn))
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
        let mut conn = self.conns.acquire().await?;
        let result = self
            .conns
            .answered(query.fetch_optional(&mut *conn))
            .await?;
        conn.done(&result);
        result.map_err(|e| classify(e, &self.conns.target))
    }

    /// Applies the pending migrations; on a Citus cluster, then distributes
    /// the tables and the claim function (see the `citus` module).
    ///
    /// Refuses, naming it, a pending contract step that a connected process
    /// cannot work with, and a database on which a newer release applied a
    /// contract step (SPEC §14).
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
        self.run_migrations(migrator).await?;
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
        let layout = citus::distribute(&self.pool).await?;
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
        let mut conn = match self.pool.acquire().await {
            Ok(conn) => conn,
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
        let table: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?;
        let why = if table {
            let applied: Vec<i64> =
                sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                    .fetch_all(&mut *conn)
                    .await
                    .map_err(|e| classify(e, target))?;
            match super::missing_migrations(&MIGRATOR, &applied) {
                Some(why) => Some(why),
                None => {
                    drop(conn);
                    return Ok(self.schema_status(&MIGRATOR).await?.refusal());
                }
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

    /// How the tables are laid out, read once.
    async fn layout(&self) -> Result<Layout> {
        self.layout
            .get_or_try_init(|| async {
                let mut conn = self.conns.acquire().await?;
                let result = self.conns.answered(citus::layout(&mut conn)).await?;
                conn.done(&result);
                result.map_err(|e| classify(e, &self.conns.target))
            })
            .await
            .copied()
    }

    async fn run_migrations(&self, migrator: &sqlx::migrate::Migrator) -> Result<()> {
        let target = &self.conns.target;
        match migrator.run(&self.pool).await {
            Ok(()) => Ok(()),
            // The pool says only that it timed out; one direct attempt says
            // why it could not connect (refused, unknown host, bad password).
            Err(sqlx::migrate::MigrateError::Execute(sqlx::Error::PoolTimedOut)) => {
                match tokio::time::timeout(self.conns.acquire_timeout, self.conns.options.connect())
                    .await
                {
                    Ok(Err(e)) => Err(connect_failed(e, target)),
                    Ok(Ok(_)) => Err(StoreError::unavailable(format!(
                        "PostgreSQL at {} did not answer in time",
                        target.server()
                    ))),
                    Err(_) => Err(target.no_answer(self.conns.acquire_timeout)),
                }
            }
            Err(sqlx::migrate::MigrateError::Execute(e)) => Err(classify(e, target)),
            Err(sqlx::migrate::MigrateError::ExecuteMigration(e, version)) => {
                Err(classify(e, target).reworded(|why| format!("migration {version}: {why}")))
            }
            Err(other) => Err(StoreError::other(other.to_string()).because(other)),
        }
    }
}
