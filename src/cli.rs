//! The command line: subcommands, and the parse that merges flags, the
//! environment and the `--config` file.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Arg, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::config::{self, ConfigError, LogFormat, ProxyArgs, ServeArgs, StoreArgs};

/// Server-side HTTP idempotency keys (IETF draft-ietf-httpapi-idempotency-key-header-07).
///
/// Retries carry an Idempotency-Key; idemgate remembers each key with a
/// fingerprint of its request, replays the first result to a retry, answers
/// 409 to a duplicate still in flight and 422 to a key reused with another
/// payload. Every setting is a flag, an IDEMGATE_* environment variable, or a
/// key in the TOML file named by --config, in that order of precedence.
#[derive(Debug, Parser)]
#[command(name = "idemgate", version, propagate_version = true)]
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
        value_parser = config::parse_log_format
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
    /// admin endpoints on 127.0.0.1:9090).
    Proxy(Box<ProxyArgs>),
    /// Apply pending database migrations and exit.
    #[command(mut_args = one_shot_help)]
    Migrate(StoreArgs),
    /// Delete every expired key once and exit (for cron). Pending migrations
    /// are applied first.
    #[command(mut_args = one_shot_help)]
    Prune(StoreArgs),
    /// Print the OpenAPI document.
    Openapi {
        /// Write it to this file instead of standard output.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
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

/// Why the command line could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// clap's own report (including --help and --version, which exit 0).
    #[error(transparent)]
    Clap(#[from] clap::Error),
    /// The config file is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

impl Cli {
    /// Parses `argv` with the `--config` file's settings below flags and
    /// environment variables.
    pub fn try_parse_merged(argv: Vec<OsString>) -> Result<Cli, CliError> {
        let plain = Cli::command().try_get_matches_from(&argv);
        let merged = config::file::merge(Cli::command(), argv)?;
        match Cli::command().try_get_matches_from(merged) {
            Ok(matches) => Ok(Cli::from_arg_matches(&matches)?),
            // Without the file the arguments parse: the file's value is at fault.
            Err(e) if plain.is_ok() => Err(CliError::Config(blame_file(&e))),
            Err(e) => Err(e.into()),
        }
    }
}

/// Names the config-file key behind a value clap refused.
fn blame_file(e: &clap::Error) -> ConfigError {
    use clap::error::ContextKind;
    let key = e
        .get(ContextKind::InvalidArg)
        .map(|arg| {
            let flag = arg.to_string();
            let name = flag.trim_start_matches("--");
            name.split([' ', '='])
                .next()
                .unwrap_or(name)
                .replace('-', "_")
        })
        .unwrap_or_default();
    let reason = e.render().to_string();
    let reason = reason
        .lines()
        .next()
        .unwrap_or_default()
        .trim_start_matches("error: ");
    ConfigError {
        setting: "--config",
        problem: format!("key `{key}`: {reason}"),
    }
}
