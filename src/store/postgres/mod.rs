//! The PostgreSQL store: every transition is one statement, made atomic across
//! processes by the primary key's row lock, with the database's `now()` as the
//! one clock all processes share.

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
mod tls;
mod write_batch;

use super::{Result, StoreError};
use citus::Layout;
use conns::{ANSWER_MARGIN, Conns};
use errors::{Target, classify, connect_failed};

/// The PostgreSQL schema migrations (`migrations/postgres`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

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
    /// One PostgreSQL or a Citus cluster: read once, by the migrations or by
    /// the first pruning batch.
    layout: Arc<tokio::sync::OnceCell<Layout>>,
}

// === impl PgStore ===

impl PgStore {
    /// Builds a pool for `url` without connecting yet: the server can start,
    /// and recover, while the database is away.
    pub fn connect_lazy(url: &str, settings: &PgSettings) -> Result<PgStore> {
        let attempts = tls::options(url)
            .map_err(|e| StoreError::other(format!("invalid PostgreSQL URL: {e}")))?;
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
            let options = options.log_statements(tracing::log::LevelFilter::Trace);
            if settings.transaction_pooler {
                options
                    .extra_float_digits(None)
                    .statement_cache_capacity(0)
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
        let options = with_session(attempts.first);
        let fallback = attempts.fallback.map(with_session);
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
            fallback,
            sslmode: attempts.given,
            idle: Mutex::new(Vec::with_capacity(max as usize)),
            permits: Semaphore::new(max as usize),
            acquire_timeout: settings.acquire_timeout,
            answer_timeout: settings.statement_timeout + ANSWER_MARGIN,
            open: AtomicU32::new(0),
            scope,
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
    pub async fn migrate(&self) -> Result<()> {
        self.run_migrations().await?;
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
        // Once per process: not kept prepared (a pooler in transaction mode
        // could not keep them).
        let table: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?;
        let why = if table {
            let applied: Result<Vec<i64>, sqlx::Error> =
                sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                    .persistent(false)
                    .fetch_all(&mut *conn)
                    .await;
            match applied {
                Ok(applied) => super::missing_migrations(&MIGRATOR, &applied),
                // insufficient_privilege: a role granted too little.
                Err(e)
                    if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("42501") =>
                {
                    Some(format!(
                        "keeps its list of migrations (_sqlx_migrations) where the role {} may \
                         not read it ({}): grant the role what README's \"Least privilege\" \
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
        let connected =
            tokio::time::timeout(self.conns.acquire_timeout, self.conns.connect()).await;
        match connected {
            Ok(Ok((conn, second))) => {
                if second && let Some(fallback) = &self.conns.fallback {
                    self.pool.set_connect_options(fallback.clone());
                }
                drop(conn);
                None
            }
            Ok(Err(e)) => tls::refusal(
                &e,
                self.conns.sslmode,
                &self.conns.options,
                &self.conns.target,
            ),
            Err(_) => None,
        }
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
        match tokio::time::timeout(self.conns.acquire_timeout, self.conns.connect()).await {
            Ok(Err(e)) => connect_failed(e, target),
            Ok(Ok(_)) => StoreError::unavailable(format!(
                "PostgreSQL at {} did not answer in time",
                target.server()
            )),
            Err(_) => target.no_answer(self.conns.acquire_timeout),
        }
    }

    async fn run_migrations(&self) -> Result<()> {
        let target = &self.conns.target;
        match MIGRATOR.run(&self.pool).await {
            Ok(()) => Ok(()),
            // The pool says only that it timed out; one direct attempt says
            // why it could not connect (refused, unknown host, bad password).
            Err(sqlx::migrate::MigrateError::Execute(sqlx::Error::PoolTimedOut)) => {
                Err(self.why_no_connection().await)
            }
            Err(sqlx::migrate::MigrateError::Execute(e)) => Err(classify(e, target)),
            Err(sqlx::migrate::MigrateError::ExecuteMigration(e, version)) => {
                Err(classify(e, target).reworded(|why| format!("migration {version}: {why}")))
            }
            Err(other) => Err(StoreError::other(other.to_string()).because(other)),
        }
    }
}
