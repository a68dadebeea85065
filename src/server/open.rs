//! What a command runs on, opened from its settings: the store
//! `DATABASE_URL` names (created and migrated, or not, as the command
//! needs), the engine over it, and the pruning job. `serve`, `proxy`,
//! `migrate`, `prune` and `keys` all open their store here.

use std::sync::Arc;

use crate::engine::{Engine, Limits};
use crate::seal::Sealer;
use crate::server::config::{ConfigError, RunArgs, StoreArgs};
use crate::store::Store;

/// How a command opens its store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening {
    /// Creates a SQLite file that is not there, and applies the pending
    /// migrations: `serve`, `proxy`. Behind a pooler in transaction mode
    /// (`IDEMGATE_PG_POOLER=transaction`), as [`Opening::NoMigrate`]:
    /// migrations need a session.
    Migrate,
    /// `idemgate migrate`: as [`Opening::Migrate`], on a session whatever
    /// `IDEMGATE_PG_POOLER` says (its `DATABASE_URL` must then be a direct
    /// connection).
    Migration,
    /// `serve` and `proxy` with `--no-migrate`: nothing is created or
    /// migrated, and a database that cannot serve without migrations (none
    /// there, no tables, migrations missing) refuses the start, saying what
    /// to run. A server that is merely down is no refusal: the door answers
    /// 503 until it is back.
    NoMigrate,
    /// A command that reads a database someone else set up (`keys`,
    /// `prune`): a SQLite file that is not there is an error naming its
    /// path, and nothing is created; one that is there is migrated. A
    /// PostgreSQL database is never migrated (the role may own nothing): one
    /// without the tables, or behind this version's migrations, is an error
    /// that names `idemgate migrate`.
    Existing,
}

/// Opens the store `DATABASE_URL` names, applying migrations unless told not to.
pub async fn open_store(args: &StoreArgs, migrate: bool) -> anyhow::Result<Arc<dyn Store>> {
    open_for_serving(args, migrate)
        .await
        .map(|(store, _)| store)
}

/// [`open_store`] for `serve` and `proxy`, with what it opened and did, for
/// their start-up log.
pub async fn open_for_serving(
    args: &StoreArgs,
    migrate: bool,
) -> anyhow::Result<(Arc<dyn Store>, Opened)> {
    let opening = if migrate {
        Opening::Migrate
    } else {
        Opening::NoMigrate
    };
    open_reporting(args, opening).await
}

/// What a store was opened on, and what became of its migrations: what
/// `serve` and `proxy` say when they start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    /// The database: a PostgreSQL URL with its password masked, or the
    /// SQLite file's path.
    pub database: String,
    /// The migrations at the opening.
    pub migrations: Migrations,
}

/// What became of the migrations when a store was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Migrations {
    /// This many were pending and are now applied.
    Applied(usize),
    /// Applied, how many not known (the count could not be read first).
    Done,
    /// None was pending.
    Current,
    /// Not applied, for the reason given (the setting that said so).
    Skipped(&'static str),
}

impl std::fmt::Display for Migrations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Migrations::Applied(1) => f.write_str("applied 1 migration"),
            Migrations::Applied(n) => write!(f, "applied {n} migrations"),
            Migrations::Done => f.write_str("migrations applied"),
            Migrations::Current => f.write_str("already current: no migration pending"),
            Migrations::Skipped(why) => write!(f, "not migrated at start ({why})"),
        }
    }
}

/// What applying the migrations did, `pending` of them found first (if
/// the count could be read).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn applied(pending: Option<usize>) -> Migrations {
    match pending {
        Some(0) => Migrations::Current,
        Some(n) => Migrations::Applied(n),
        None => Migrations::Done,
    }
}

/// The database `url` names as a log line may show it: a PostgreSQL URL
/// with any password masked, a SQLite file's absolute path.
fn shown_database(url: &str) -> String {
    #[cfg(feature = "sqlite")]
    if url.starts_with("sqlite:") {
        use std::str::FromStr as _;
        return match sqlx::sqlite::SqliteConnectOptions::from_str(url) {
            Ok(_) if url.contains(":memory:") => format!("{url} (in memory)"),
            Ok(options) => {
                let file = options.get_filename();
                std::path::absolute(file)
                    .unwrap_or_else(|_| file.to_path_buf())
                    .display()
                    .to_string()
            }
            Err(_) => crate::server::config::source::mask_password(url),
        };
    }
    crate::server::config::source::mask_password(url)
}

/// A `--no-migrate` start's refusal of a database that cannot serve: `why`
/// names it; the rest says what to run.
fn not_set_up(why: &str) -> anyhow::Error {
    ConfigError {
        setting: "no_migrate",
        problem: format!(
            "{why}: run `idemgate migrate` on it first (with the same DATABASE_URL), or start \
             without --no-migrate (the migrations are then applied at start)"
        ),
    }
    .into()
}

/// Opens the store `DATABASE_URL` names, as `opening` says.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres")),
    allow(unused_variables)
)]
pub async fn open_store_as(args: &StoreArgs, opening: Opening) -> anyhow::Result<Arc<dyn Store>> {
    open_reporting(args, opening).await.map(|(store, _)| store)
}

/// [`open_store_as`], with what it opened and did.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres")),
    allow(unused_variables)
)]
async fn open_reporting(
    args: &StoreArgs,
    opening: Opening,
) -> anyhow::Result<(Arc<dyn Store>, Opened)> {
    let url = args.database_url.trim();
    let database = shown_database(url);
    let migrate = opening != Opening::NoMigrate;
    // `sqlite:rel.db` and `sqlite::memory:` are SQLite URLs too (sqlx reads
    // them), so the scheme ends at the first colon.
    let scheme = url.split_once(':').map(|(s, _)| s).unwrap_or_default();
    match scheme {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            use std::time::Duration;

            use crate::server::config::PgPooler;
            use crate::store::{PgSettings, PgStore};
            let pooled = args.pg_pooler == PgPooler::Transaction;
            if pooled && opening == Opening::Migration {
                tracing::info!(
                    "IDEMGATE_PG_POOLER=transaction: `idemgate migrate` holds a session (an \
                     advisory lock while it applies the migrations), so its DATABASE_URL must \
                     reach PostgreSQL directly, not through the pooler"
                );
            } else if pooled && migrate {
                tracing::info!(
                    "IDEMGATE_PG_POOLER=transaction: no migrations at start (they need a \
                     session, which a pooler in transaction mode does not keep), as with \
                     --no-migrate; run `idemgate migrate` on a direct connection to PostgreSQL"
                );
            }
            let skipped = if migrate {
                Migrations::Skipped("IDEMGATE_PG_POOLER=transaction")
            } else {
                Migrations::Skipped("--no-migrate")
            };
            let migrate = migrate && !(pooled && opening != Opening::Migration);
            let settings = PgSettings {
                max_connections: args.db_max_connections.max(1),
                acquire_timeout: args.db_acquire_timeout.max(Duration::from_secs(1)),
                statement_timeout: args.db_statement_timeout.max(Duration::from_secs(1)),
                transaction_pooler: pooled && opening != Opening::Migration,
            };
            let store = PgStore::connect_lazy(url, &settings).map_err(|e| ConfigError {
                setting: "database_url",
                problem: format!("not a usable PostgreSQL URL: {}", e.reason()),
            })?;
            // A TLS setting the server does not satisfy is no outage to wait
            // out: refused now, naming the setting.
            if let Some(why) = store.refusal_at_start().await {
                return Err(ConfigError {
                    setting: "database_url",
                    problem: why,
                }
                .into());
            }
            let mut migrations = skipped;
            if opening == Opening::Existing {
                // `prune` and `keys` never migrate: the role they run as may
                // own nothing (only `idemgate migrate` needs the owner).
                match store.not_set_up().await {
                    Ok(None) => {}
                    Ok(Some(why)) => {
                        return Err(ConfigError {
                            setting: "database_url",
                            problem: format!(
                                "{why}: run `idemgate migrate` on it first (with the same \
                                 DATABASE_URL, as the role that owns the schema)"
                            ),
                        }
                        .into());
                    }
                    // Named as the operator set it, as a SQLite file that
                    // cannot be opened is.
                    Err(e) => {
                        return Err(ConfigError {
                            setting: "database_url",
                            problem: format!("cannot read the PostgreSQL database: {}", e.reason()),
                        }
                        .into());
                    }
                }
            } else if migrate {
                let pending = store
                    .schema_status(&crate::store::postgres::MIGRATOR)
                    .await
                    .ok()
                    .map(|status| status.pending.len());
                // The store's message names the cause and what to do about it.
                store.migrate().await.map_err(|e| {
                    // insufficient_privilege: a role granted only what serving needs.
                    let owner = if e.reason().contains("SQLSTATE 42501") {
                        ": migrations need a role that owns the schema (docs/operations.md, Least privilege)"
                    } else {
                        ""
                    };
                    anyhow::anyhow!(
                        "could not apply migrations to the PostgreSQL database named by \
                         DATABASE_URL (`serve` and `proxy` skip this step with --no-migrate): \
                         {}{owner}",
                        e.reason()
                    )
                })?;
                migrations = applied(pending);
            } else {
                match store.not_set_up().await {
                    Ok(None) => {}
                    Ok(Some(why)) if pooled => {
                        return Err(ConfigError {
                            setting: "pg_pooler",
                            problem: format!(
                                "{why}: with IDEMGATE_PG_POOLER=transaction nothing is migrated \
                                 at start; run `idemgate migrate` first, with a DATABASE_URL \
                                 that reaches PostgreSQL directly (not through the pooler)"
                            ),
                        }
                        .into());
                    }
                    Ok(Some(why)) => return Err(not_set_up(&why)),
                    // Down or unreachable: the door answers 503 until it is
                    // back, and the log says why.
                    Err(e) => tracing::warn!(
                        error = e.reason(),
                        "the database cannot be reached at start; requests answer 503 \
                         store-unavailable until it can"
                    ),
                }
            }
            // Whether an acknowledged key survives the loss of the primary:
            // WARN when it streams to standbys none of which is synchronous.
            // A server away now says nothing: the doors answer 503 meanwhile.
            if let Err(e) = store.report_durability().await {
                tracing::debug!(error = e.reason(), "the durability check did not run");
            }
            Ok((
                Arc::new(store),
                Opened {
                    database,
                    migrations,
                },
            ))
        }
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            let opened = match opening {
                Opening::Migrate | Opening::Migration => crate::store::SqliteStore::open(url).await,
                Opening::NoMigrate | Opening::Existing => {
                    crate::store::SqliteStore::open_existing(url).await
                }
            };
            let store = opened.map_err(|e| {
                let why = e.reason();
                if opening == Opening::NoMigrate && why.starts_with("no SQLite database at ") {
                    return not_set_up(why.split(": nothing was created").next().unwrap_or(why));
                }
                ConfigError {
                    setting: "database_url",
                    problem: format!("cannot open the SQLite database: {why}"),
                }
                .into()
            })?;
            let mut migrations = Migrations::Skipped("--no-migrate");
            if migrate {
                let pending = store
                    .schema_status(crate::store::SqliteStore::migrator())
                    .await
                    .ok()
                    .map(|status| status.pending.len());
                store.migrate().await.map_err(|e| {
                    anyhow::anyhow!(
                        "could not apply migrations to the SQLite database {url} \
                         (`serve` and `proxy` skip this step with --no-migrate): {}",
                        e.reason()
                    )
                })?;
                migrations = applied(pending);
            } else {
                let why = store.not_set_up().await.map_err(|e| {
                    anyhow::anyhow!("cannot read the SQLite database {url}: {}", e.reason())
                })?;
                if let Some(why) = why {
                    return Err(not_set_up(&format!("the SQLite database {url} {why}")));
                }
            }
            tracing::info!(database = %url, "embedded SQLite store: one idemgate process per file");
            Ok((
                Arc::new(store),
                Opened {
                    database,
                    migrations,
                },
            ))
        }
        _ => Err(unsupported(scheme).into()),
    }
}

/// The schema's status in the database `DATABASE_URL` names, beside this
/// release's migrations, with the idemgate processes connected to it
/// (`idemgate migrate --status`): nothing is created or migrated.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub async fn schema_status(args: &StoreArgs) -> anyhow::Result<crate::store::schema::SchemaStatus> {
    let url = args.database_url.trim();
    let scheme = url.split_once(':').map(|(s, _)| s).unwrap_or_default();
    match scheme {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            use crate::store::{PgSettings, PgStore};
            let settings = PgSettings {
                max_connections: 1,
                acquire_timeout: args
                    .db_acquire_timeout
                    .max(std::time::Duration::from_secs(1)),
                statement_timeout: args
                    .db_statement_timeout
                    .max(std::time::Duration::from_secs(1)),
                // `migrate --status` reads what `migrate` would do: on a
                // direct connection, as `migrate` runs.
                transaction_pooler: false,
            };
            let store = PgStore::connect_lazy(url, &settings).map_err(|e| ConfigError {
                setting: "database_url",
                problem: format!("not a usable PostgreSQL URL: {}", e.reason()),
            })?;
            store
                .schema_status(&crate::store::postgres::MIGRATOR)
                .await
                .map_err(|e| {
                    ConfigError {
                        setting: "database_url",
                        problem: format!(
                            "cannot read the schema of the PostgreSQL database: {}",
                            e.reason()
                        ),
                    }
                    .into()
                })
        }
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            // Read-only and without the file's lock: a file a running
            // `serve` holds is read too (nothing is written).
            let mut status = crate::store::SqliteStore::schema_status_of(
                url,
                crate::store::SqliteStore::migrator(),
            )
            .await
            .map_err(|e| ConfigError {
                setting: "database_url",
                problem: format!("cannot read the SQLite database: {}", e.reason()),
            })?;
            status.database = format!("the SQLite database {url}");
            Ok(status)
        }
        _ => Err(unsupported(scheme).into()),
    }
}

/// Refuses a `DATABASE_URL` this build cannot open, before anything is bound
/// or opened: a start refused for its URL names the URL, not a port in use.
pub fn check_database_url(args: &StoreArgs) -> Result<(), ConfigError> {
    let url = args.database_url.trim();
    let scheme = url.split_once(':').map(|(s, _)| s).unwrap_or_default();
    match scheme {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(()),
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(()),
        _ => Err(unsupported(scheme)),
    }
}

/// Why `scheme` names no store of this build.
fn unsupported(scheme: &str) -> ConfigError {
    match scheme {
        #[cfg(not(feature = "postgres"))]
        "postgres" | "postgresql" => ConfigError {
            setting: "database_url",
            problem: "this idemgate was built without PostgreSQL (its `postgres` feature)".into(),
        },
        #[cfg(not(feature = "sqlite"))]
        "sqlite" => ConfigError {
            setting: "database_url",
            problem: "this idemgate was built without SQLite (its `sqlite` feature)".into(),
        },
        _ => ConfigError {
            setting: "database_url",
            problem: format!(
                "expected a postgres://… URL, or a SQLite one (sqlite://PATH, sqlite:PATH, \
                 sqlite::memory:), got scheme {scheme:?}"
            ),
        },
    }
}

/// The engine over `store` within `limits`, with the replay cache, seal keys
/// and tenant limits of `run`.
pub fn engine(run: &RunArgs, store: Arc<dyn Store>, limits: Limits) -> Result<Engine, ConfigError> {
    Ok(engine_sealed(run, run.sealer()?, store, limits))
}

/// The engine of `run`'s settings with `sealer`, the seal settings already
/// read.
pub fn engine_sealed(
    run: &RunArgs,
    sealer: Option<Sealer>,
    store: Arc<dyn Store>,
    limits: Limits,
) -> Engine {
    if sealer.is_none() && run.seal.seal_accept_plaintext {
        tracing::warn!(
            "IDEMGATE_SEAL_ACCEPT_PLAINTEXT is set without IDEMGATE_SEAL_KEY: it has no effect \
             (nothing is sealed)"
        );
    }
    if sealer.as_ref().is_some_and(Sealer::accepts_plaintext) {
        tracing::warn!(
            "IDEMGATE_SEAL_ACCEPT_PLAINTEXT is set: records stored in the clear (from before \
             sealing was turned on, or written into the database by hand) are still replayed; \
             remove it once the key window since sealing was turned on has passed"
        );
    }
    Engine::new(store, limits)
        .with_replay_cache(run.replay_cache_bytes)
        .with_sealer(sealer)
        .with_tenant_limits(run.tenant_limits())
}

/// Keeps the store's windows of namings ([`Engine::keep_naming_windows`])
/// now and then every minute. A start refuses when records are named under
/// a seal key this process lacks (it would not find them, and would run
/// their requests again); later, such a naming turns new keys away with
/// `503` until it ends. A store that does not answer leaves the engine as
/// careful as it starts.
pub async fn watch_naming(engine: &Arc<Engine>) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    match engine.keep_naming_windows().await {
        Ok(Ok(())) => {}
        Ok(Err(missing)) => {
            return Err(ConfigError {
                setting: if engine.seals() {
                    "seal_key_previous"
                } else {
                    "seal_key"
                },
                problem: format!(
                    "records in this database are named under seal key id {} (another process \
                     seals with it, or did within the key window): without that key this \
                     process would not find them and would run their requests again; give it \
                     that key, as {{seal_key}} or in {{seal_key_previous}}",
                    missing.key_id
                ),
            }
            .into());
        }
        Err(e) => tracing::warn!(
            error = %e,
            "cannot read the store's naming windows yet; trying again in a minute"
        ),
    }
    let engine = engine.clone();
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(60));
        tick.tick().await;
        loop {
            tick.tick().await;
            if let Err(e) = engine.keep_naming_windows().await {
                tracing::warn!(error = %e, "cannot read or keep the store's naming windows; trying again in a minute");
            }
        }
    }))
}

/// Starts the pruning job over `store`, unless `run` turns it off.
pub fn spawn_pruner(run: &RunArgs, store: Arc<dyn Store>) -> Option<tokio::task::JoinHandle<()>> {
    (!run.prune_interval.is_zero())
        .then(|| tokio::spawn(crate::prune::run(store, run.prune_interval)))
}
