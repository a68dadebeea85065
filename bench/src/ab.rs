//! A/B: two idemgate binaries (before and after a change) serving side by
//! side on one database, loaded in turns, so that a change is measured under
//! the same conditions as what it replaces. Reports throughput and the CPU
//! time each process spent per operation, which the machine's noise disturbs
//! far less than throughput.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::load::{self, Sample, median};
use crate::procs::{self, Door, Proc};
use crate::workers::{ApiPair, Keys, ProxyPost};

/// What to compare.
#[derive(Debug, Clone, clap::Args)]
pub struct AbArgs {
    /// The idemgate binary before the change.
    #[arg(long)]
    pub before: PathBuf,
    /// The idemgate binary after the change.
    #[arg(long)]
    pub after: PathBuf,
    /// `api-pair` (serve: reserve + commit) or `proxy-new` (proxy: a new key).
    #[arg(long, default_value = "api-pair")]
    pub kind: String,
    /// Concurrent workers.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Turns each binary gets.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Seconds per turn (after one second of warm-up).
    #[arg(long, default_value_t = 4.0)]
    pub seconds: f64,
    /// A PostgreSQL database with idemgate's schema (or one it may migrate).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres",
        hide_env_values = true
    )]
    pub database_url: String,
}

struct Side {
    name: &'static str,
    proc: Proc,
    addr: SocketAddr,
    rates: Vec<f64>,
    p50s: Vec<f64>,
    cpu_us: Vec<f64>,
}

async fn start(
    name: &'static str,
    bin: &std::path::Path,
    args: &AbArgs,
    origin: SocketAddr,
    log: &std::path::Path,
) -> anyhow::Result<Side> {
    let door = match args.kind.as_str() {
        "api-pair" => Door::Serve,
        "proxy-new" => Door::Proxy(origin),
        other => anyhow::bail!("--kind: expected api-pair or proxy-new, got {other:?}"),
    };
    // The schema is the newer binary's (see `run`); the older one serves it
    // as it is, as in a rolling upgrade.
    let extra = [("IDEMGATE_NO_MIGRATE", "true".to_owned())];
    let (proc, addr) = procs::idemgate(name, bin, &door, &args.database_url, &extra, log).await?;
    Ok(Side {
        name,
        proc,
        addr,
        rates: Vec::new(),
        p50s: Vec::new(),
        cpu_us: Vec::new(),
    })
}

async fn turn(side: &mut Side, args: &AbArgs, round: usize) -> anyhow::Result<()> {
    let prefix = format!("ab-{}-{}-{round}", uuid::Uuid::new_v4().simple(), side.name);
    let (warmup, measure) = (
        Duration::from_secs(1),
        Duration::from_secs_f64(args.seconds),
    );
    let before = side.proc.cpu_ticks();
    let sample: Sample = if args.kind == "api-pair" {
        let w = (0..args.concurrency)
            .map(|w| ApiPair::new(side.addr, &prefix, w))
            .collect();
        load::run_for(w, warmup, measure).await?
    } else {
        let keys = Keys::Fresh(prefix);
        let w = (0..args.concurrency)
            .map(|w| ProxyPost::new(side.addr, "/v1/charges", keys.clone(), w))
            .collect();
        load::run_for(w, warmup, measure).await?
    };
    let after = side.proc.cpu_ticks();
    let cpu = match (before, after) {
        (Some(b), Some(a)) if sample.all_ops > 0 => {
            (a - b) as f64 * 10_000.0 / sample.all_ops as f64
        }
        _ => f64::NAN,
    };
    println!(
        "  {:6} {:.0}/s  p50 {:.2} ms  {cpu:.0} µs CPU/op  ({} errors)",
        side.name,
        sample.rate(),
        sample.p50_us as f64 / 1000.0,
        sample.errors
    );
    side.rates.push(sample.rate());
    side.p50s.push(sample.p50_us as f64 / 1000.0);
    side.cpu_us.push(cpu);
    Ok(())
}

/// Runs the comparison and prints the medians.
pub async fn run(args: AbArgs) -> anyhow::Result<()> {
    let work = std::env::temp_dir().join(format!("idemgate-ab-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let origin_addr = procs::free_addr()?;
    let mut origin = Proc::spawn(
        "origin",
        &std::env::current_exe()?,
        &["origin", "--listen", &origin_addr.to_string()],
        &[],
        None,
        &work.join("origin.log"),
    )?;
    origin.wait_ready(origin_addr, None).await?;
    // The newer binary's migrations, once: the older one would refuse a
    // database with a migration it does not know.
    let migrated = std::process::Command::new(&args.after)
        .arg("migrate")
        .env("DATABASE_URL", &args.database_url)
        .status()?;
    anyhow::ensure!(
        migrated.success(),
        "`{} migrate` failed",
        args.after.display()
    );
    let mut a = start(
        "before",
        &args.before,
        &args,
        origin_addr,
        &work.join("before.log"),
    )
    .await?;
    let mut b = start(
        "after",
        &args.after,
        &args,
        origin_addr,
        &work.join("after.log"),
    )
    .await?;
    for round in 0..args.rounds {
        // Alternate who goes first, so neither always follows the other.
        if round % 2 == 0 {
            turn(&mut a, &args, round).await?;
            turn(&mut b, &args, round).await?;
        } else {
            turn(&mut b, &args, round).await?;
            turn(&mut a, &args, round).await?;
        }
    }
    let mut ratio: Vec<f64> = b.rates.iter().zip(&a.rates).map(|(b, a)| b / a).collect();
    let mut cpu_ratio: Vec<f64> = b.cpu_us.iter().zip(&a.cpu_us).map(|(b, a)| b / a).collect();
    println!(
        "{} c={}, {} rounds: before {:.0}/s p50 {:.2} ms {:.0} µs CPU/op; after {:.0}/s p50 {:.2} ms {:.0} µs CPU/op; \
         throughput after ÷ before {:.2} ×, CPU/op after ÷ before {:.2} × (medians)",
        args.kind,
        args.concurrency,
        args.rounds,
        median(&mut a.rates),
        median(&mut a.p50s),
        median(&mut a.cpu_us),
        median(&mut b.rates),
        median(&mut b.p50s),
        median(&mut b.cpu_us),
        median(&mut ratio),
        median(&mut cpu_ratio),
    );
    a.proc.stop().await;
    b.proc.stop().await;
    origin.stop().await;
    let _ = std::fs::remove_dir_all(&work);
    Ok(())
}
