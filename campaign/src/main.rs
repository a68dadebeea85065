//! `idemgate-campaign`: a Jepsen-style fault campaign that proves idemgate
//! never runs a key twice under `hold`, and announces every second run under
//! `takeover`, while proxies are killed, paused and cut off from their
//! database, the database restarts, and the origin hangs up and stalls.
//!
//! `run` drives a whole campaign and checks it; `check` checks a finished
//! run's directory (or history file) on its own; `clean` removes what a run
//! that was killed outright left behind; `upgrade` runs a rolling upgrade from
//! the previous release under load, and `stall` measures how long N's
//! `migrate` holds writes on a table of many keys.

mod checker;
mod clients;
mod cluster;
mod faults;
mod history;
mod operator;
mod origin;
mod run;
mod stall;
mod upgrade;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(name = "idemgate-campaign", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a campaign against the idemgate binary, then check it (exit 1 on
    /// any violation).
    Run(RunArgs),
    /// A rolling upgrade under load: the previous release and this one on
    /// one database (or, on SQLite, one file after the other) through both
    /// doors, this one's migrate in the middle, then a rollback; checked
    /// (exit 1 on any key run twice, stranded, or answered 500).
    Upgrade(UpgradeArgs),
    /// How long N's `migrate` holds writes back: a table of many keys made
    /// under N−1's schema, N−1 serving new keys while N migrates it; fails
    /// if any write stalls longer than --max-stall-ms.
    Stall(StallArgs),
    /// Remove the network namespaces and links that campaigns no longer
    /// running left behind (each run also does so when it starts).
    Clean,
    /// Check a finished run: its directory, or its history.jsonl (the key
    /// listings are read from beside it).
    Check {
        path: PathBuf,
        /// Check against this promise instead of the one the proxies were
        /// started with.
        #[arg(long, value_name = "hold|takeover")]
        expect: Option<String>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum StoreArg {
    Postgres,
    Sqlite,
}

/// Sizes for CI (a minute or so a run) and for a long soak.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Preset {
    Short,
    Long,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    #[arg(long, value_enum, default_value = "postgres")]
    store: StoreArg,
    /// Defaults for --keys, --duration, --clients and the fault rate.
    #[arg(long, value_enum, default_value = "short")]
    preset: Preset,
    /// Keys in the pool (short 300, long 10000).
    #[arg(long)]
    keys: Option<usize>,
    /// Seconds of traffic and faults (short 25, long 900).
    #[arg(long)]
    duration: Option<u64>,
    /// Proxies on PostgreSQL (SQLite has one: one process per file).
    #[arg(long, default_value_t = 3)]
    proxies: usize,
    /// Concurrent clients (short 64, long 48).
    #[arg(long)]
    clients: Option<usize>,
    /// The seed of every random choice; printed, so a run can be repeated.
    #[arg(long)]
    seed: Option<u64>,
    /// What the proxies are started with.
    #[arg(long, default_value = "hold", value_parser = ["hold", "takeover"])]
    on_lease_expiry: String,
    /// Faults to inject.
    #[arg(long, value_delimiter = ',', default_value = "kill,stop,pg-restart,partition,origin",
          value_parser = ["kill", "stop", "pg-restart", "partition", "origin"])]
    faults: Vec<String>,
    /// While faults are on, the share of origin requests answered 503
    /// (release), hung up on after acting, stalled past the abandon bound,
    /// and slow past the upstream timeout.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "RELEASE,HANGUP,STALL,SLOW",
        default_value = "0.03,0.02,0.01,0.06"
    )]
    origin_rates: Vec<f64>,
    /// The proxies' --upstream-timeout, in seconds; the lease is 5 more.
    #[arg(long, default_value_t = 1)]
    upstream_timeout: u64,
    /// Where the history, the listings, the logs and the report go.
    #[arg(long)]
    out: PathBuf,
    /// The idemgate binary under test.
    #[arg(long)]
    idemgate: PathBuf,
    /// The directory of initdb, pg_ctl and postgres (default: from PATH).
    #[arg(long)]
    pg_bindir: Option<PathBuf>,
    /// Skip the operator's phase (settling unknown keys, then asking again).
    #[arg(long)]
    no_operator: bool,
}

#[derive(Debug, clap::Args)]
struct StallArgs {
    /// The previous release's binary (N−1): makes the schema, serves.
    #[arg(long)]
    previous: PathBuf,
    /// This release's binary (N): its `migrate` is measured.
    #[arg(long)]
    idemgate: PathBuf,
    /// An empty PostgreSQL database to run on.
    #[arg(long)]
    database_url: String,
    /// Records in the table before N migrates it.
    #[arg(long, default_value_t = 1_000_000)]
    keys: u64,
    /// Clients, each claiming a new key and committing it, one at a time.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Seconds of writes before the migration, for the baseline.
    #[arg(long, default_value_t = 5)]
    baseline: u64,
    /// The longest a write may take while N's migrate runs.
    #[arg(long, default_value_t = 1000)]
    max_stall_ms: u64,
    /// Where the logs, the latencies (CSV) and the report go.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Debug, clap::Args)]
struct UpgradeArgs {
    /// The previous release's binary (N−1).
    #[arg(long)]
    previous: PathBuf,
    /// This release's binary (N).
    #[arg(long)]
    idemgate: PathBuf,
    /// An empty PostgreSQL database to run on; without it, a SQLite file in
    /// --out.
    #[arg(long)]
    database_url: Option<String>,
    /// Concurrent clients, half on each door.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Seconds each step of the timeline lasts.
    #[arg(long, default_value_t = 5)]
    step: u64,
    /// The seed of every random choice.
    #[arg(long)]
    seed: Option<u64>,
    /// N's migrate must refuse while N−1 is connected (an upgrade across a
    /// contract step): N−1 is then stopped first, and nothing is rolled back.
    #[arg(long)]
    expect_refusal: bool,
    /// No rollback to N−1 at the end.
    #[arg(long)]
    no_rollback: bool,
    /// Where the history, the logs, the statuses and the report go.
    #[arg(long)]
    out: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { path, expect } => check(&path, expect.as_deref()),
        Command::Clean => {
            if cluster::running_as_root() {
                for name in cluster::netns::sweep_leftovers() {
                    println!("removed {name}");
                }
            }
            ExitCode::SUCCESS
        }
        Command::Upgrade(args) => {
            let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
            let code = runtime.block_on(upgrade(args));
            runtime.shutdown_timeout(Duration::from_secs(30));
            code
        }
        Command::Stall(a) => {
            let absolute = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
            let plan = stall::Plan {
                previous: absolute(&a.previous),
                current: absolute(&a.idemgate),
                database_url: a.database_url,
                keys: a.keys,
                concurrency: a.concurrency.max(1),
                baseline_secs: a.baseline,
                max_stall: Duration::from_millis(a.max_stall_ms),
                out: a.out,
            };
            let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
            let code = match runtime.block_on(stall::run(&plan)) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(1),
                Err(e) => {
                    eprintln!("idemgate-campaign stall: the run failed: {e:#}");
                    ExitCode::from(2)
                }
            };
            runtime.shutdown_timeout(Duration::from_secs(10));
            code
        }
        Command::Run(args) => {
            let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
            let code = runtime.block_on(run(args));
            // Whatever is still running (a client, a fault) is dropped, so
            // the cluster's cleanup runs before we exit.
            runtime.shutdown_timeout(Duration::from_secs(30));
            code
        }
    }
}

async fn upgrade(a: UpgradeArgs) -> ExitCode {
    let absolute = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
    let plan = upgrade::Plan {
        previous: absolute(&a.previous),
        current: absolute(&a.idemgate),
        database_url: a.database_url,
        clients: a.clients,
        step_secs: a.step.max(1),
        seed: a.seed.unwrap_or_else(rand::random),
        out: a.out,
        expect_refusal: a.expect_refusal,
        no_rollback: a.no_rollback || a.expect_refusal,
    };
    println!("upgrade: seed {}", plan.seed);
    match upgrade::run(&plan).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!(
                "idemgate-campaign upgrade: the run failed (seed {}): {e:#}",
                plan.seed
            );
            ExitCode::from(2)
        }
    }
}

fn check(path: &std::path::Path, expect: Option<&str>) -> ExitCode {
    let dir = if path.is_file() {
        path.parent().unwrap_or(path).to_path_buf()
    } else {
        path.to_path_buf()
    };
    let result = expect
        .map(checker::Expect::parse)
        .transpose()
        .and_then(|expect| checker::check_dir(&dir, expect));
    match result {
        Ok(report) => {
            print!("{}", report.render());
            if report.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("idemgate-campaign check: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(a: RunArgs) -> ExitCode {
    let (keys, duration, clients, budget, every) = match a.preset {
        Preset::Short => (300, 25, 64, 30, (1000, 2500)),
        Preset::Long => (10_000, 900, 48, 60, (1500, 3500)),
    };
    let store = match a.store {
        StoreArg::Postgres => cluster::Store::Postgres,
        StoreArg::Sqlite => cluster::Store::Sqlite,
    };
    let rates = a.origin_rates.as_slice();
    if rates.len() != 4
        || rates.iter().any(|r| !(0.0..=1.0).contains(r))
        || rates.iter().sum::<f64>() > 1.0
    {
        eprintln!(
            "idemgate-campaign: --origin-rates takes four shares between 0 and 1, summing to at most 1"
        );
        return ExitCode::from(2);
    }
    let plan = run::Plan {
        store,
        proxies: if matches!(a.store, StoreArg::Sqlite) {
            1
        } else {
            a.proxies.max(1)
        },
        keys: a.keys.unwrap_or(keys),
        clients: a.clients.unwrap_or(clients),
        duration: Duration::from_secs(a.duration.unwrap_or(duration)),
        budget: Duration::from_secs(budget),
        seed: a.seed.unwrap_or_else(rand::random),
        on_lease_expiry: a.on_lease_expiry,
        faults: a.faults,
        fault_every_ms: every,
        origin_rates: [rates[0], rates[1], rates[2], rates[3]],
        upstream_timeout: a.upstream_timeout.max(1),
        out: a.out,
        // Absolute: the proxies run in a directory of their own.
        idemgate: match std::path::absolute(&a.idemgate) {
            Ok(path) => path,
            Err(e) => {
                eprintln!(
                    "idemgate-campaign: --idemgate {}: {e}",
                    a.idemgate.display()
                );
                return ExitCode::from(2);
            }
        },
        pg_bindir: a.pg_bindir,
        operator: !a.no_operator,
    };
    let mut terminate =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("idemgate-campaign: {e}");
                return ExitCode::from(2);
            }
        };
    let result = tokio::select! {
        r = run::run(&plan) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
        _ = terminate.recv() => Err(anyhow::anyhow!("terminated")),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!(
                "idemgate-campaign: the checker found violations (seed {})",
                plan.seed
            );
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!(
                "idemgate-campaign: the run failed (seed {}): {e:#}",
                plan.seed
            );
            ExitCode::from(2)
        }
    }
}
