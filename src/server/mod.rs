//! The `idemgate` binary (feature `server`): its command line, its doors —
//! the reservation API ([`api`]) and the reverse proxy ([`proxy`], with the
//! MCP door) — the operators' work on stuck keys behind the admin endpoints,
//! `idemgate keys` ([`keys`]) and the console ([`console`]), the listeners
//! they are served on, and the Prometheus exporter.
//!
//! Bottom to top, a module here imports from its own group or an earlier one
//! only: the settings ([`config`], and [`auth`]'s tokens); what a door runs on
//! ([`serve`], [`open`], [`tls`], [`otel`], [`exporter`]); what an operator
//! does and the wire shapes ([`operations`], [`views`]); the doors ([`api`],
//! [`proxy`], [`console`], [`keys`]); and on top the parse ([`cli`]),
//! `idemgate serve`'s wiring ([`wiring`]) and [`run`]. ARCHITECTURE.md draws
//! the same.
//!
//! [`run`] is the whole binary. The modules below it are public only so that
//! the binary and this crate's tests reach them: they are the doors'
//! internals, hidden from the documentation and not an interface to build on.

#[cfg(feature = "count-alloc")]
#[doc(hidden)]
pub mod alloc_count;
#[doc(hidden)]
pub mod api;
#[doc(hidden)]
pub mod auth;
#[doc(hidden)]
pub mod cli;
#[doc(hidden)]
pub mod config;
#[doc(hidden)]
pub mod console;
#[doc(hidden)]
pub mod exporter;
#[doc(hidden)]
pub mod keys;
#[doc(hidden)]
pub mod open;
#[doc(hidden)]
pub mod operations;
#[doc(hidden)]
pub mod otel;
#[doc(hidden)]
pub mod proxy;
#[doc(hidden)]
pub mod serve;
#[doc(hidden)]
pub mod tls;
#[doc(hidden)]
pub mod views;
#[doc(hidden)]
pub mod wiring;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;

use cli::{CliError, Command, ERROR_PREFIX};
use config::{LogFormat, StoreArgs};

/// Runs the `idemgate` command line `argv` (program name first) to its end:
/// parses it, then serves, proxies, migrates, prunes or writes the OpenAPI
/// document. A refused setting is reported as it was set (flag, variable or
/// file key), with exit status 2.
pub async fn run(argv: Vec<OsString>) -> ExitCode {
    let (cli, sources) = match cli::parse(argv) {
        Ok(parsed) => parsed,
        Err(CliError::Clap(e)) => e.exit(),
        // A usage error, as clap's own exit with.
        Err(CliError::Config(message)) => {
            say(&format!("{ERROR_PREFIX}{message}"));
            return ExitCode::from(2);
        }
    };
    let json = cli.log_format == LogFormat::Json;
    let otlp = match &cli.command {
        Command::Serve(args) => args.run.otlp_endpoint.clone(),
        Command::Proxy(args) => args.run.otlp_endpoint.clone(),
        _ => None,
    };
    let exporting = exporter::init_tracing(json, otlp.as_deref());
    let result = match cli.command {
        Command::Serve(args) => wiring::serve(*args).await,
        Command::Proxy(args) if args.stdio => stdio(*args, cli.config, &sources).await,
        Command::Proxy(args) => proxy::run(*args, cli.config).await,
        Command::Migrate(args) => migrate(args, json).await,
        Command::Prune(args) => prune_once(args, json).await,
        Command::Keys { command } => keys::run(*command).await,
        Command::Openapi { output } => openapi(output, json),
    };
    // The spans of the last requests, before the process ends.
    if let Some(exporting) = exporting {
        exporting.shutdown().await;
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of standard output went away (`| head`): end quietly,
        // with the status a shell shows for a Unix tool ended by SIGPIPE.
        Err(e) if broken_pipe(&e) => ExitCode::from(BROKEN_PIPE_EXIT),
        Err(e) if json => {
            tracing::error!(error = sources.explain(&e), "idemgate stopped");
            ExitCode::FAILURE
        }
        Err(e) => {
            say(&format!("{ERROR_PREFIX}{}", sources.explain(&e)));
            ExitCode::FAILURE
        }
    }
}

/// The exit status of a command whose reader went away: 128 + SIGPIPE, as
/// a shell reports a Unix tool that SIGPIPE ended.
pub const BROKEN_PIPE_EXIT: u8 = 141;

/// Whether `e` is a write to a pipe whose reader is gone.
fn broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        let kind = cause
            .downcast_ref::<std::io::Error>()
            .map(std::io::Error::kind)
            .or_else(|| {
                cause
                    .downcast_ref::<serde_json::Error>()
                    .and_then(serde_json::Error::io_error_kind)
            });
        kind == Some(std::io::ErrorKind::BrokenPipe)
    })
}

/// Writes `line` to standard error. A reader gone away (`2>&1 | head`) is
/// no reason to panic as `eprintln!` does: the line is dropped, quietly.
fn say(line: &str) {
    use std::io::Write as _;
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}").and_then(|()| err.flush());
}

/// What a one-shot command did: a log line with JSON logs, so that every
/// line on stderr parses; a plain one otherwise.
fn report(json: bool, what: &str) {
    if json {
        tracing::info!("{what}");
    } else {
        say(&format!("idemgate: {what}"));
    }
}

/// `idemgate proxy --protocol mcp --stdio`: its store, unless one is set,
/// in the user's data directory.
async fn stdio(
    mut args: config::ProxyArgs,
    config: Option<PathBuf>,
    sources: &config::Sources,
) -> anyhow::Result<()> {
    let unset = |setting: &str| {
        matches!(
            sources.origin(setting),
            None | Some(config::Origin::Default(_))
        )
    };
    args.validate()?;
    for setting in ["listen", "admin_listen"] {
        if !unset(setting) {
            return Err(config::ConfigError {
                setting,
                problem: "is set, and so is {stdio}: the stdio door speaks MCP on stdin and \
                          stdout, and opens no listener; set one"
                    .into(),
            }
            .into());
        }
    }
    if unset("database_url") {
        args.store.database_url = proxy::stdio::default_database_url(&args.command)?;
    }
    proxy::stdio::run(args, config).await
}

async fn migrate(args: config::command::MigrateArgs, json: bool) -> anyhow::Result<()> {
    if args.status {
        let status = open::schema_status(&args.store).await?;
        let text = if json {
            serde_json::to_string(&status)? + "\n"
        } else {
            status.lines().join("\n") + "\n"
        };
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
        return Ok(());
    }
    open::open_store_as(&args.store, open::Opening::Migration).await?;
    report(json, "migrations applied");
    Ok(())
}

async fn prune_once(args: StoreArgs, json: bool) -> anyhow::Result<()> {
    let store = open::open_store_as(&args, open::Opening::Existing).await?;
    let n = crate::prune::prune_once(store.as_ref()).await?;
    report(json, &format!("pruned {n} expired key(s)"));
    Ok(())
}

fn openapi(output: Option<PathBuf>, json: bool) -> anyhow::Result<()> {
    let text = api::openapi_json();
    match output {
        Some(path) => {
            std::fs::write(&path, text)
                .with_context(|| format!("cannot write {}", path.display()))?;
            report(json, &format!("wrote {}", path.display()));
        }
        None => {
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes())?;
            out.flush()?;
        }
    }
    Ok(())
}
