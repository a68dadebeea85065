//! Where the records live: the database and its pool.

use std::time::Duration;

use clap::Args;

use super::{boolean_style, seconds};

/// Where the records live.
#[derive(Debug, Clone, Args)]
#[command(mut_args = boolean_style)]
pub struct StoreArgs {
    /// Database URL: postgres://… (any number of idemgate processes) or
    /// sqlite://… (one process per file).
    #[arg(
        long,
        env = "DATABASE_URL",
        value_name = "URL",
        default_value = "sqlite://idemgate.db",
        hide_env_values = true
    )]
    pub database_url: String,

    /// Most database connections this process opens.
    #[arg(
        long,
        env = "IDEMGATE_DB_MAX_CONNECTIONS",
        value_name = "N",
        default_value_t = 16
    )]
    pub db_max_connections: u32,

    /// Seconds a request waits for a database connection before it answers
    /// 503 store-unavailable.
    #[arg(
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
        long,
        env = "IDEMGATE_DB_STATEMENT_TIMEOUT",
        value_name = "SECONDS",
        default_value = "5",
        value_parser = seconds
    )]
    pub db_statement_timeout: Duration,
}
