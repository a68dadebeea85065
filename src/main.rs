//! The `idemgate` command line: parse, configure, call into the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use idemgate::config::{ServeArgs, StoreArgs};
use idemgate::{api, config, prune, server, telemetry};

/// Server-side HTTP idempotency keys (IETF draft-ietf-httpapi-idempotency-key-header-07).
///
/// Retries carry an Idempotency-Key; idemgate remembers each key with a
/// fingerprint of its request, replays the first result to a retry, answers
/// 409 to a duplicate still in flight and 422 to a key reused with another
/// payload. Every setting is a flag or an IDEMGATE_* environment variable.
#[derive(Debug, Parser)]
#[command(name = "idemgate", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the reservation/commit API (default 127.0.0.1:8080).
    Serve(Box<ServeArgs>),
    /// Apply pending database migrations and exit.
    Migrate(StoreArgs),
    /// Delete every expired key once and exit (for cron).
    Prune(StoreArgs),
    /// Print the OpenAPI document.
    Openapi {
        /// Write it to this file instead of standard output.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = match config::log_format_is_json() {
        Ok(json) => json,
        Err(e) => return fail(e.into()),
    };
    telemetry::init_tracing(json);
    let result = match cli.command {
        Command::Serve(args) => server::serve(*args).await,
        Command::Migrate(args) => migrate(args).await,
        Command::Prune(args) => prune_once(args).await,
        Command::Openapi { output } => openapi(output),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn fail(e: anyhow::Error) -> ExitCode {
    eprintln!("idemgate: error: {e:#}");
    ExitCode::FAILURE
}

async fn migrate(args: StoreArgs) -> anyhow::Result<()> {
    server::open_store(&args, true).await?;
    eprintln!("idemgate: migrations applied");
    Ok(())
}

async fn prune_once(args: StoreArgs) -> anyhow::Result<()> {
    let store = server::open_store(&args, !args.no_migrate).await?;
    let n = prune::prune_once(store.as_ref()).await?;
    eprintln!("idemgate: pruned {n} expired key(s)");
    Ok(())
}

fn openapi(output: Option<PathBuf>) -> anyhow::Result<()> {
    let text = api::openapi_json();
    match output {
        Some(path) => {
            std::fs::write(&path, text)?;
            eprintln!("idemgate: wrote {}", path.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}
