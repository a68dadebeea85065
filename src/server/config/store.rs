//! Where the records live: the database and its pool.

use std::time::Duration;

use clap::Args;

use super::{boolean_style, heading, seconds};

/// Where the records live.
#[derive(Debug, Clone, Args)]
#[command(mut_args = boolean_style)]
pub struct StoreArgs {
    /// Database URL: postgres://… (any number of idemgate processes) or
    /// sqlite://… (one process per file).
    // Among the first settings of every command's --help.
    #[arg(
        long,
        display_order = 0,
        env = "DATABASE_URL",
        value_name = "URL",
        default_value = "sqlite://idemgate.db",
        hide_env_values = true
    )]
    pub database_url: String,

    /// Most database connections this process opens.
    #[arg(
        help_heading = heading::DATABASE,
        long,
        env = "IDEMGATE_DB_MAX_CONNECTIONS",
        value_name = "N",
        default_value_t = 16
    )]
    pub db_max_connections: u32,

    /// Seconds a request waits for a database connection before it answers
    /// 503 store-unavailable.
    #[arg(
        help_heading = heading::DATABASE,
        long,
        env = "IDEMGATE_DB_ACQUIRE_TIMEOUT",
        value_name = "SECONDS",
        default_value = "3",
        value_parser = seconds
    )]
    pub db_acquire_timeout: Duration,

    /// Seconds one statement may run before the database cancels it (and the
    /// request answers 503 store-unavailable).
    #[arg(
        help_heading = heading::DATABASE,
        long,
        env = "IDEMGATE_DB_STATEMENT_TIMEOUT",
        value_name = "SECONDS",
        default_value = "5",
        value_parser = seconds
    )]
    pub db_statement_timeout: Duration,

    /// The connection pooler between idemgate and PostgreSQL: `none`, or
    /// `transaction` for one in transaction mode (PgBouncer, RDS Proxy,
    /// Supavisor). `transaction` keeps no session state: no named prepared
    /// statements, no startup options, every setting inside each statement's
    /// own transaction; `serve` and `proxy` then do not migrate at start
    /// (run `idemgate migrate` on a direct connection).
    #[arg(
        help_heading = heading::DATABASE,
        long,
        env = "IDEMGATE_PG_POOLER",
        value_name = "none|transaction",
        default_value = "none",
        value_parser = parse_pg_pooler
    )]
    pub pg_pooler: PgPooler,
}

/// What sits between idemgate and PostgreSQL (`IDEMGATE_PG_POOLER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PgPooler {
    /// A direct connection, or a pooler in session mode: a connection is one
    /// session for as long as it is open.
    #[default]
    None,
    /// A pooler in transaction mode: a session lasts one transaction.
    Transaction,
}

fn parse_pg_pooler(s: &str) -> Result<PgPooler, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "none" => Ok(PgPooler::None),
        "transaction" => Ok(PgPooler::Transaction),
        _ => Err("expected `none` or `transaction`".into()),
    }
}
