//! The command line's shape: the subcommands and their settings, as clap
//! parses them. The parse itself, which merges the `--config` file, is the
//! binary's `cli` module.

use std::path::PathBuf;

use clap::{Arg, CommandFactory, Parser, Subcommand};

use super::keys::KeysCommand;
use super::{LogFormat, ProxyArgs, ServeArgs, StoreArgs};

/// Server-side HTTP idempotency keys (IETF draft-ietf-httpapi-idempotency-key-header-07).
///
/// Retries carry an Idempotency-Key; idemgate remembers each key with a
/// fingerprint of its request, replays the first result to a retry, answers
/// 409 to a duplicate still in flight and 422 to a key reused with another
/// payload. Every setting is a flag, an IDEMGATE_* environment variable, or a
/// key in the TOML file named by --config, in that order of precedence.
#[derive(Debug, Parser)]
#[command(
    name = "idemgate",
    version = env!("IDEMGATE_LONG_VERSION"),
    propagate_version = true
)]
pub struct Cli {
    /// TOML file of settings (keys are the flags' names with `_`; see
    /// idemgate.example.toml). Flags and IDEMGATE_* variables override it.
    #[arg(long, global = true, env = "IDEMGATE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Log lines: `human` (coloured only on a terminal) or `json` (one
    /// object per line). The level comes from RUST_LOG (default info).
    #[arg(
        long,
        global = true,
        env = "IDEMGATE_LOG_FORMAT",
        value_name = "human|json",
        default_value = "human",
        value_parser = super::parse_log_format
    )]
    pub log_format: LogFormat,

    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the reservation/commit API (default 127.0.0.1:8080).
    Serve(Box<ServeArgs>),
    /// Run the reverse proxy in front of --upstream (default 127.0.0.1:8081,
    /// admin endpoints on 127.0.0.1:9090), or the MCP door in front of a
    /// stdio MCP server (--protocol mcp --stdio -- COMMAND ARGS…).
    Proxy(Box<ProxyArgs>),
    /// Apply pending database migrations and exit; with --status, say what
    /// is applied, pending and connected, and change nothing.
    ///
    /// A migration that removes what an older release uses (a contract
    /// step) is refused, naming it and the processes, while a process that
    /// cannot work with it is connected to the database: upgrade them first
    /// (docs/operations.md, Upgrading). Processes of 0.2.0 and later name themselves
    /// (application_name idemgate/VERSION); a connection without a name
    /// whose last statement used idemgate's tables is taken for a process
    /// of an earlier release.
    #[command(mut_args = one_shot_help)]
    Migrate(MigrateArgs),
    /// Delete every expired key once and exit (for cron). A SQLite file's
    /// pending migrations are applied first; a PostgreSQL database must have
    /// them already (`idemgate migrate`, as the schema's owner).
    #[command(mut_args = one_shot_help)]
    Prune(StoreArgs),
    /// See and settle stuck keys (unknown, or in flight past their lease)
    /// straight in the database: list, show, resolve.
    Keys {
        /// What to do.
        #[command(subcommand)]
        command: Box<KeysCommand>,
    },
    /// Print the OpenAPI document.
    Openapi {
        /// Write it to this file instead of standard output.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
}

/// `idemgate migrate`'s settings.
#[derive(Debug, Clone, clap::Args)]
pub struct MigrateArgs {
    /// Print the migrations applied and pending, the idemgate versions
    /// connected to the database (PostgreSQL), and whether `migrate` would
    /// apply or refuse; change nothing.
    #[arg(long)]
    pub status: bool,

    #[command(flatten)]
    pub store: StoreArgs,
}

/// The store settings' help for a command that runs once and exits
/// (`migrate`, `prune`): it answers no request, so a timeout makes the
/// command fail, where `serve` and `proxy` answer 503.
fn one_shot_help(arg: Arg) -> Arg {
    let help = match arg.get_id().as_str() {
        "db_max_connections" => "Most database connections the command opens",
        "db_acquire_timeout" => "Seconds to wait for a database connection; then the command fails",
        "db_statement_timeout" => {
            "Seconds one statement may run before the database cancels it and the command fails"
        }
        _ => return arg,
    };
    arg.help(help).long_help(None::<&str>)
}

/// The whole command line, built: every subcommand holds the global flags
/// too. What a message looks a setting up in.
pub fn built() -> clap::Command {
    let mut cmd = Cli::command();
    cmd.build();
    cmd
}
