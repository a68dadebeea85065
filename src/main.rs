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

use idemgate::cli::{Cli, CliError, Command};
use idemgate::config::{LogFormat, StoreArgs};
use idemgate::{api, proxy, prune, server, telemetry};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match Cli::try_parse_merged(std::env::args_os().collect()) {
        Ok(cli) => cli,
        Err(CliError::Clap(e)) => e.exit(),
        Err(CliError::Config(e)) => return fail(e.into()),
    };
    telemetry::init_tracing(cli.log_format == LogFormat::Json);
    let result = match cli.command {
        Command::Serve(args) => server::serve(*args).await,
        Command::Proxy(args) => proxy::run(*args, cli.config).await,
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
            std::fs::write(&path, text)
                .with_context(|| format!("cannot write {}", path.display()))?;
            eprintln!("idemgate: wrote {}", path.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}
