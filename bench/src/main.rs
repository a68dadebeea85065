//! idemgate's benchmark harness: a closed-loop HTTP load generator, the
//! raw-SQL baselines, a small origin server, and the suite that runs every
//! scenario and writes BENCHMARKS.md. `bench/run` builds and runs it.

mod ab;
mod costs;
mod floor;
mod http;
mod load;
mod metrics;
mod origin;
mod pgcluster;
mod pgstats;
mod probe;
mod procs;
mod report;
mod storm;
mod suite;
mod usage;
mod workers;

use std::net::SocketAddr;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs every scenario against PostgreSQL (and SQLite, Redis) on this
    /// machine and writes the results into BENCHMARKS.md.
    Suite(suite::SuiteArgs),
    /// Drives one kind of load at a running server and prints what it
    /// measured: for profiling one path by hand.
    Load(LoadArgs),
    /// Measures a change: two idemgate binaries side by side, loaded in turns.
    Ab(ab::AbArgs),
    /// Serves the origin the proxy scenarios forward to: any POST gets a 201
    /// with a small JSON body.
    Origin {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:3000")]
        listen: SocketAddr,
    },
}

#[derive(clap::Args)]
struct LoadArgs {
    /// What to send: `api-pair` (reserve + commit on the reservation API),
    /// `api-replay` (reserves of keys completed first, 1000 of them) or
    /// `proxy-new` (a POST with a new key through a proxy).
    #[arg(long)]
    kind: String,
    /// The server's address.
    #[arg(long)]
    addr: SocketAddr,
    /// Concurrent workers.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Seconds measured (after one second of warm-up).
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// The path a `proxy-new` request goes to.
    #[arg(long, default_value = "/v1/charges")]
    path: String,
}

async fn load(args: LoadArgs) -> anyhow::Result<()> {
    use std::time::Duration;
    let prefix = format!("load-{}", uuid::Uuid::new_v4().simple());
    let (warmup, measure) = (
        Duration::from_secs(1),
        Duration::from_secs_f64(args.seconds),
    );
    let sample = match args.kind.as_str() {
        "api-pair" => {
            let w = (0..args.concurrency)
                .map(|w| workers::ApiPair::new(args.addr, &prefix, w))
                .collect();
            load::run_for(w, warmup, measure).await?
        }
        "proxy-new" => {
            let keys = workers::Keys::Fresh(prefix);
            let w = (0..args.concurrency)
                .map(|w| workers::ProxyPost::new(args.addr, &args.path, keys.clone(), w))
                .collect();
            load::run_for(w, warmup, measure).await?
        }
        "api-replay" => {
            let keys = suite::populate_api(args.addr, &prefix, 1000).await?;
            let w = (0..args.concurrency)
                .map(|w| workers::ApiReplay::new(args.addr, keys.clone(), w))
                .collect();
            load::run_for(w, warmup, measure).await?
        }
        other => {
            anyhow::bail!("--kind: expected api-pair, api-replay or proxy-new, got {other:?}")
        }
    };
    println!(
        "{:.0}/s  p50 {:.3} ms  p99 {:.3} ms  ({} ops, {} errors)",
        sample.rate(),
        sample.p50_us as f64 / 1000.0,
        sample.p99_us as f64 / 1000.0,
        sample.ops,
        sample.errors
    );
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Load(args) => load(args).await,
        Command::Ab(args) => ab::run(args).await,
        Command::Origin { listen } => origin::serve(listen).await,
        Command::Suite(args) => {
            let out = args.out.clone();
            let smoke = args.smoke;
            let keep_work = args.work_dir.is_some() || !smoke;
            let (mut env, results) = suite::run(args).await?;
            let markdown = report::render(&env, &results).await;
            report::write(&out, &markdown)?;
            // Before the work directory (which holds its data) goes.
            if let Some(mut cluster) = env.cluster.take() {
                env.pool.close().await;
                cluster.stop();
            }
            println!("wrote {}", out.display());
            if keep_work {
                println!("logs and SQLite files are in {}", env.work.display());
            } else {
                let _ = std::fs::remove_dir_all(&env.work);
            }
            let failed: u64 = results.samples.values().flatten().map(|s| s.errors).sum();
            let empty = results
                .samples
                .iter()
                .filter(|(_, s)| s.iter().any(|s| s.ops == 0));
            let empty: Vec<&String> = empty.map(|(label, _)| label).collect();
            if smoke && (failed > 0 || !empty.is_empty()) {
                anyhow::bail!("smoke run: {failed} failed operations; no successes in {empty:?}");
            }
            Ok(())
        }
    }
}
