//! A/B: two idemgate binaries (before and after a change) serving side by
//! side, loaded in turns, so that a change is measured under the same
//! conditions as what it replaces. On PostgreSQL both serve one database
//! (or, for a change of the schema, each its own on one server:
//! `--before-database-url`); on SQLite each has a fresh file of its own in a
//! temporary directory. Reports throughput and, per operation, what each
//! turn cost: the CPU time and the context switches of the idemgate process,
//! the CPU of the store (the database's processes on PostgreSQL, the store's
//! writer thread on SQLite), the server's WAL on PostgreSQL, and, where the binary was built with the `count-alloc` feature,
//! its allocations. The machine's noise disturbs these far less than
//! throughput.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::load::{self, Sample, median};
use crate::metrics::{self, Allocations};
use crate::procs::{self, Door, Proc};
use crate::usage::{self, Usage};
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
    /// `api-pair` (serve: reserve + commit), `proxy-new` (proxy: a new key)
    /// or `proxy-replay` (proxy: a retry of one of 1,000 keys completed
    /// before the turn).
    #[arg(long, default_value = "api-pair")]
    pub kind: String,
    /// The store: `postgres` (both sides on `--database-url`) or `sqlite`
    /// (each side a fresh file of its own in a temporary directory).
    #[arg(long, default_value = "postgres")]
    pub store: String,
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
    /// A database of its own for the older binary, on the same server,
    /// which it migrates itself: for a change of the schema, where one
    /// database would give both sides the newer schema.
    #[arg(long)]
    pub before_database_url: Option<String>,
}

/// The store both sides use.
enum Store {
    /// One database for both, or one each: pools to find their server
    /// processes (the older binary's second when it has its own).
    Postgres(PgPool, Option<PgPool>),
    /// A file each, in this directory.
    Sqlite(PathBuf),
}

/// One turn's figures; NaN where not readable.
#[derive(Clone, Copy)]
struct Turn {
    rate: f64,
    p50_ms: f64,
    cpu_us: f64,
    switches: f64,
    store_cpu_us: f64,
    allocs: f64,
    alloc_bytes: f64,
    wal_bytes: f64,
}

struct Side {
    name: &'static str,
    proc: Proc,
    addr: SocketAddr,
    turns: Vec<Turn>,
}

impl Side {
    /// The median over turns of one figure.
    fn med(&self, f: fn(&Turn) -> f64) -> f64 {
        median(&mut self.turns.iter().map(f).collect::<Vec<_>>())
    }
}

async fn start(
    name: &'static str,
    bin: &Path,
    args: &AbArgs,
    store: &Store,
    origin: SocketAddr,
    work: &Path,
) -> anyhow::Result<Side> {
    let door = match args.kind.as_str() {
        "api-pair" => Door::Serve,
        "proxy-new" | "proxy-replay" => Door::Proxy(origin),
        other => {
            anyhow::bail!("--kind: expected api-pair, proxy-new or proxy-replay, got {other:?}")
        }
    };
    let (url, extra) = match store {
        // The schema is the newer binary's (see `run`); the older one serves
        // it as it is, as in a rolling upgrade, unless it has a database of
        // its own.
        Store::Postgres(..) => match (&args.before_database_url, name) {
            (Some(url), "before") => (url.clone(), Vec::new()),
            _ => (
                args.database_url.clone(),
                vec![("IDEMGATE_NO_MIGRATE", "true".to_owned())],
            ),
        },
        // Each binary creates and migrates its own file.
        Store::Sqlite(dir) => (
            format!("sqlite://{}", dir.join(format!("{name}.db")).display()),
            Vec::new(),
        ),
    };
    let log = work.join(format!("{name}.log"));
    let (proc, addr) = procs::idemgate(name, bin, &door, &url, &extra, &log).await?;
    Ok(Side {
        name,
        proc,
        addr,
        turns: Vec::new(),
    })
}

/// What the side's process and its store have used so far, and its
/// allocator's counts where its build has them.
struct Reading {
    proc: Option<Usage>,
    store: Option<usage::Processes>,
    allocs: Option<Allocations>,
    /// The server's WAL position, in bytes.
    wal: Option<f64>,
}

async fn read(side: &Side, on: &Store) -> Reading {
    let pid = side.proc.pid();
    let pool = match on {
        Store::Postgres(_, Some(before)) if side.name == "before" => Some(before),
        Store::Postgres(pool, _) => Some(pool),
        Store::Sqlite(_) => None,
    };
    let store = match (on, pool) {
        (_, Some(pool)) => procs::db_processes(pool).await,
        _ => pid
            .and_then(|pid| usage::of_threads(Some(pid), procs::SQLITE_WRITER_THREAD))
            .map(|u| [(0, u)].into()),
    };
    let allocs = match side.proc.metrics_addr() {
        Some(addr) => metrics::allocations(addr).await,
        None => None,
    };
    let wal = match pool {
        Some(pool) => sqlx::query_scalar::<_, f64>(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8",
        )
        .fetch_one(pool)
        .await
        .ok(),
        None => None,
    };
    Reading {
        proc: pid.and_then(usage::of_process),
        store,
        allocs,
        wal,
    }
}

async fn turn(side: &mut Side, args: &AbArgs, store: &Store, round: usize) -> anyhow::Result<()> {
    let prefix = format!("ab-{}-{}-{round}", uuid::Uuid::new_v4().simple(), side.name);
    let (warmup, measure) = (
        Duration::from_secs(1),
        Duration::from_secs_f64(args.seconds),
    );
    // Replays are of keys completed before the turn is read, as a retry
    // finds them.
    let keys = match args.kind.as_str() {
        "proxy-replay" => {
            let keys = crate::suite::populate_proxy(side.addr, "/v1/charges", &prefix, 1000);
            Keys::Replay(keys.await?)
        }
        _ => Keys::Fresh(prefix.clone()),
    };
    let before = read(side, store).await;
    let sample: Sample = if args.kind == "api-pair" {
        let w = (0..args.concurrency)
            .map(|w| ApiPair::new(side.addr, &prefix, w))
            .collect();
        load::run_for(w, warmup, measure).await?
    } else {
        let w = (0..args.concurrency)
            .map(|w| ProxyPost::new(side.addr, "/v1/charges", keys.clone(), w))
            .collect();
        load::run_for(w, warmup, measure).await?
    };
    let after = read(side, store).await;
    let ops = sample.all_ops;
    let used = before.proc.zip(after.proc).map(|(b, a)| a.since(b));
    let store_used = before
        .store
        .zip(after.store)
        .map(|(b, a)| usage::processes_since(&b, &a));
    let allocs = before.allocs.zip(after.allocs).map(|(b, a)| a.since(b));
    let per = |x: f64| if ops > 0 { x / ops as f64 } else { f64::NAN };
    let t = Turn {
        rate: sample.rate(),
        p50_ms: sample.p50_us as f64 / 1000.0,
        cpu_us: used.and_then(|u| u.cpu_us_per(ops)).unwrap_or(f64::NAN),
        switches: used.and_then(|u| u.switches_per(ops)).unwrap_or(f64::NAN),
        store_cpu_us: store_used
            .and_then(|u| u.cpu_us_per(ops))
            .unwrap_or(f64::NAN),
        allocs: allocs.map_or(f64::NAN, |a| per(a.calls)),
        alloc_bytes: allocs.map_or(f64::NAN, |a| per(a.bytes)),
        wal_bytes: before
            .wal
            .zip(after.wal)
            .map_or(f64::NAN, |(b, a)| per(a - b)),
    };
    println!(
        "  {:6} {:.0}/s  p50 {:.2} ms  {:.0} µs CPU/op  {:.1} switches/op  store {:.0} µs CPU/op{}  ({} errors)",
        side.name,
        t.rate,
        t.p50_ms,
        t.cpu_us,
        t.switches,
        t.store_cpu_us,
        if t.allocs.is_nan() {
            String::new()
        } else {
            format!("  {:.0} allocations/op ({:.0} B)", t.allocs, t.alloc_bytes)
        },
        sample.errors
    );
    side.turns.push(t);
    Ok(())
}

/// A figure of the summary: its name, how to read it from a turn, and the
/// digits it is printed with.
type Row = (&'static str, fn(&Turn) -> f64, usize);

/// Median over rounds of after ÷ before of one figure, each pair from one
/// round.
fn ratio(a: &Side, b: &Side, f: fn(&Turn) -> f64) -> f64 {
    let mut r: Vec<f64> = b
        .turns
        .iter()
        .zip(&a.turns)
        .map(|(b, a)| f(b) / f(a))
        .filter(|r| r.is_finite())
        .collect();
    median(&mut r)
}

/// Runs the comparison and prints the medians.
pub async fn run(args: AbArgs) -> anyhow::Result<()> {
    let work = std::env::temp_dir().join(format!("idemgate-ab-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let store = match args.store.as_str() {
        "postgres" => {
            // The newer binary's migrations, once: the older one would
            // refuse a database with a migration it does not know.
            let mut migrations = vec![(&args.after, &args.database_url)];
            if let Some(url) = &args.before_database_url {
                migrations.push((&args.before, url));
            }
            for (bin, url) in migrations {
                let migrated = std::process::Command::new(bin)
                    .arg("migrate")
                    .env("DATABASE_URL", url)
                    .status()?;
                anyhow::ensure!(migrated.success(), "`{} migrate` failed", bin.display());
            }
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .connect(&args.database_url)
                .await?;
            let before = match &args.before_database_url {
                Some(url) => Some(PgPoolOptions::new().max_connections(1).connect(url).await?),
                None => None,
            };
            Store::Postgres(pool, before)
        }
        "sqlite" => Store::Sqlite(work.clone()),
        other => anyhow::bail!("--store: expected postgres or sqlite, got {other:?}"),
    };
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
    let mut a = start("before", &args.before, &args, &store, origin_addr, &work).await?;
    let mut b = start("after", &args.after, &args, &store, origin_addr, &work).await?;
    for round in 0..args.rounds {
        // Alternate who goes first, so neither always follows the other.
        if round % 2 == 0 {
            turn(&mut a, &args, &store, round).await?;
            turn(&mut b, &args, &store, round).await?;
        } else {
            turn(&mut b, &args, &store, round).await?;
            turn(&mut a, &args, &store, round).await?;
        }
    }
    let store_name = match store {
        Store::Postgres(..) => "PostgreSQL",
        Store::Sqlite(_) => "SQLite",
    };
    println!(
        "{} on {store_name}, c={}, {} rounds (medians; per operation):",
        args.kind, args.concurrency, args.rounds
    );
    let rows: [Row; 8] = [
        ("throughput, /s", |t| t.rate, 0),
        ("p50, ms", |t| t.p50_ms, 2),
        ("idemgate CPU, µs", |t| t.cpu_us, 0),
        ("idemgate context switches", |t| t.switches, 1),
        ("store CPU, µs", |t| t.store_cpu_us, 0),
        ("WAL, bytes", |t| t.wal_bytes, 0),
        ("allocations", |t| t.allocs, 0),
        ("bytes allocated", |t| t.alloc_bytes, 0),
    ];
    for (name, f, digits) in rows {
        let (before, after) = (a.med(f), b.med(f));
        if before.is_nan() && after.is_nan() {
            continue;
        }
        let cell = |x: f64| {
            if x.is_nan() {
                "—".to_owned()
            } else {
                format!("{x:.digits$}")
            }
        };
        let r = ratio(&a, &b, f);
        println!(
            "  {name:28} before {:>10}  after {:>10}  after ÷ before {}",
            cell(before),
            cell(after),
            if r.is_nan() {
                "—".to_owned()
            } else {
                format!("{r:.2} ×")
            }
        );
    }
    a.proc.stop().await;
    b.proc.stop().await;
    origin.stop().await;
    let _ = std::fs::remove_dir_all(&work);
    Ok(())
}
