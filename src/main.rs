//! The `idemgate` command line: parse, configure, call into the library.

/// mimalloc instead of the system allocator: the request path allocates and
/// frees many small buffers (headers, JSON, rows), and glibc's malloc, free and
/// memmove were the largest user-space items in its profile. Only the binary
/// chooses; the library leaves the allocator to whoever embeds it.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;

use idemgate::cli::{Cli, CliError, Command, ERROR_PREFIX};
use idemgate::config::{LogFormat, StoreArgs};
use idemgate::{api, proxy, prune, server, telemetry};

#[tokio::main]
async fn main() -> ExitCode {
    let mut cli = match Cli::try_parse_merged(std::env::args_os().collect()) {
        Ok(cli) => cli,
        Err(CliError::Clap(e)) => e.exit(),
        // A usage error, as clap's own exit with.
        Err(CliError::Config(message)) => {
            eprintln!("{ERROR_PREFIX}{message}");
            return ExitCode::from(2);
        }
    };
    // Names a refused setting as it was set (flag, variable, file key).
    let sources = std::mem::take(&mut cli.sources);
    let json = cli.log_format == LogFormat::Json;
    telemetry::init_tracing(json);
    let result = match cli.command {
        Command::Serve(args) => server::serve(*args).await,
        Command::Proxy(args) => proxy::run(*args, cli.config).await,
        Command::Migrate(args) => migrate(args, json).await,
        Command::Prune(args) => prune_once(args, json).await,
        Command::Openapi { output } => openapi(output, json),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if json => {
            tracing::error!(error = sources.explain(&e), "idemgate stopped");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{ERROR_PREFIX}{}", sources.explain(&e));
            ExitCode::FAILURE
        }
    }
}

/// What a one-shot command did: a log line with JSON logs, so that every
/// line on stderr parses; a plain one otherwise.
fn report(json: bool, what: &str) {
    if json {
        tracing::info!("{what}");
    } else {
        eprintln!("idemgate: {what}");
    }
}

async fn migrate(args: StoreArgs, json: bool) -> anyhow::Result<()> {
    server::open_store(&args, true).await?;
    report(json, "migrations applied");
    Ok(())
}

async fn prune_once(args: StoreArgs, json: bool) -> anyhow::Result<()> {
    let store = server::open_store(&args, true).await?;
    let n = prune::prune_once(store.as_ref()).await?;
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
        None => print!("{text}"),
    }
    Ok(())
}
