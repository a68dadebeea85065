//! Every scenario of the benchmark, run `runs` times with each subject measured
//! right after its baseline, so that their ratio is taken under the same load
//! on a shared, noisy machine.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

use crate::costs::{self, Db, Meter, PerKey};
use crate::floor::{self, SqliteFloor};
use crate::http::Conn;
use crate::load::{self, Sample, Worker};
use crate::metrics::{self, Batches};
use crate::origin;
use crate::pgcluster::Cluster;
use crate::probe;
use crate::procs::{self, Door, Proc};
use crate::storm;
use crate::workers::{self, ApiPair, ApiReplay, FloorPair, Keys, ProxyPost, RawPair, RawSelect};

pub mod curve;
mod probes;
use probes::probes;

/// The concurrency levels of the proxy scenario: one client alone, then up to
/// where group commit has writes to share, and a fleet's many connections.
pub const PROXY_CONCURRENCY: [usize; 5] = [1, 8, 16, 32, MANY];

/// How the suite runs.
#[derive(Debug, Clone, clap::Args)]
pub struct SuiteArgs {
    /// A PostgreSQL URL the suite may create a database through; it creates
    /// (and drops first) the database `--bench-database` on that server.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres",
        hide_env_values = true
    )]
    pub database_url: String,

    /// The database the suite creates (dropping it first) on that server:
    /// give each suite running at once on one server its own.
    #[arg(
        long,
        env = "IDEMGATE_BENCH_DATABASE",
        default_value = "idemgate_bench"
    )]
    pub bench_database: String,

    /// Redis for idempotent-proxy.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,

    /// Runs of every scenario; medians are taken over them.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,

    /// Seconds measured per measurement.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,

    /// Seconds of warm-up (not measured) before each measurement.
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,

    /// Expired rows the pruning scenario inserts and prunes.
    #[arg(long, default_value_t = 1_000_000)]
    pub prune_rows: u64,

    /// Completed keys the replay scenarios cycle through.
    #[arg(long, default_value_t = 1000)]
    pub replay_keys: usize,

    /// The idemgate binary (default: beside this one).
    #[arg(long)]
    pub idemgate: Option<PathBuf>,

    /// The idempotent-proxy-server 1.2.2 binary; without it the comparison is
    /// skipped (bench/run installs it).
    #[arg(long, env = "IDEMPOTENT_PROXY_BIN")]
    pub idempotent_proxy: Option<PathBuf>,

    /// A Citus coordinator (with its workers added) for the scale-out
    /// scenario; it creates (and drops first) the schema `idemgate_bench` in
    /// that database. Without it the scenario is skipped.
    #[arg(long, env = "IDEMGATE_BENCH_CITUS_URL", hide_env_values = true)]
    pub citus_url: Option<String>,

    /// Scenarios to run (default: all): sql, replay, proxy, stream, curve,
    /// prune, sqlite, citus, storm, floor.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,

    /// The storm scenario's copies of its one key sequence, each walked by
    /// c ÷ copies workers.
    #[arg(long, default_value_t = 2)]
    pub storm_copies: usize,

    /// Where logs and SQLite files go (default: a new temporary directory).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,

    /// The Markdown file to write; the part between its generated markers is
    /// replaced, the rest kept.
    #[arg(long, default_value = "BENCHMARKS.md")]
    pub out: PathBuf,

    /// A short run that checks every scenario works (for CI): one run, short
    /// windows, few rows; fails if any operation failed.
    #[arg(long)]
    pub smoke: bool,

    /// Runs the suite on a PostgreSQL cluster of its own, created in the work
    /// directory with `pg_stat_statements` preloaded (fsync on), instead of
    /// the server DATABASE_URL names; stopped and removed at the end.
    /// `bench/run` asks for it when DATABASE_URL is not set.
    #[arg(long)]
    pub private_postgres: bool,

    /// The idemgate build the probe windows run (allocations, syscalls,
    /// flamegraphs): one built with `--features count-alloc`, with symbols
    /// for perf (default: the `--idemgate` binary).
    #[arg(long)]
    pub probe_idemgate: Option<PathBuf>,

    /// Skips the probe windows (allocations, `strace -c`, flamegraphs) at
    /// c = 8 after the first run's scenarios.
    #[arg(long)]
    pub no_probes: bool,

    /// Records a flamegraph of each idemgate door at c = 8 (`perf record`,
    /// folded and drawn with inferno's `inferno-collapse-perf` and
    /// `inferno-flamegraph`), written beside `--out` in
    /// `<its name>.flamegraphs/`; skipped with a note without perf or inferno.
    #[arg(long)]
    pub flamegraphs: bool,
}

/// Every measurement by label, one entry per run.
#[derive(Default)]
pub struct Results {
    pub samples: BTreeMap<String, Vec<Sample>>,
    pub rss_kib: BTreeMap<String, Vec<u64>>,
    /// CPU time of the process under test per operation, microseconds.
    pub cpu_us: BTreeMap<String, Vec<f64>>,
    /// How an idemgate process batched its writes over a measurement of new
    /// keys (warm-up included), read from its `/metrics` at the end.
    pub batches: BTreeMap<String, Vec<Batches>>,
    /// How each storm's iterations ended, and the deadlocks it caused.
    pub storm: BTreeMap<String, Vec<storm::Outcome>>,
    /// What each measurement of new keys cost per key: one entry per
    /// reading (a measurement, or a probe window), each with what it read.
    pub per_key: BTreeMap<String, Vec<PerKey>>,
    /// Syscalls by name per key, from the `strace -c` window of each door.
    pub syscalls: BTreeMap<String, Vec<(String, f64)>>,
    /// Each door's flamegraph, by label: the file, relative to the report.
    pub flamegraphs: BTreeMap<String, String>,
    /// Statements running at once in the benchmark database while a
    /// measurement of the `curve` scenario ran, one entry per run.
    pub active: BTreeMap<String, Vec<curve::Active>>,
    /// The share of the machine's cores busy (with anything) while a
    /// measurement of the `curve` scenario ran, one entry per run.
    pub busy: BTreeMap<String, Vec<f64>>,
    pub notes: Vec<String>,
}

impl Results {
    fn record(&mut self, label: &str, sample: Sample) {
        println!(
            "  {label}: {:.0}/s  p50 {:.2} ms  p99 {:.2} ms  ({} ops, {} errors)",
            sample.rate(),
            sample.p50_us as f64 / 1000.0,
            sample.p99_us as f64 / 1000.0,
            sample.ops,
            sample.errors
        );
        self.samples
            .entry(label.to_owned())
            .or_default()
            .push(sample);
    }

    /// Records `sample`, with the CPU `proc` used since `ticks_before`.
    fn record_with_cpu(
        &mut self,
        label: &str,
        sample: Sample,
        proc: &Proc,
        ticks_before: Option<u64>,
    ) {
        if let (Some(before), Some(after)) = (ticks_before, proc.cpu_ticks())
            && sample.all_ops > 0
        {
            let us = (after - before) as f64 * 10_000.0 / sample.all_ops as f64;
            println!("    {label}: {us:.0} µs of CPU per operation");
            self.cpu_us.entry(label.to_owned()).or_default().push(us);
        }
        self.record(label, sample);
        self.rss(label, proc);
    }

    /// Reads how `proc` batched its writes so far and records it under
    /// `label`: called after a measurement of new keys, before anything else
    /// writes through that process.
    async fn record_batches(&mut self, label: &str, proc: &Proc) -> anyhow::Result<()> {
        let addr = proc.metrics_addr().context("the process has no /metrics")?;
        let b = metrics::batches(addr)
            .await
            .with_context(|| format!("batch sizes of {label}"))?;
        println!(
            "    {label}: {:.2} writes per transaction, largest {}",
            b.mean().unwrap_or(f64::NAN),
            b.largest
        );
        if b.refused > 0.0 {
            self.notes.push(format!(
                "{label}: {} writes refused with 503 (the write queue was full)",
                b.refused
            ));
        }
        self.batches.entry(label.to_owned()).or_default().push(b);
        Ok(())
    }

    /// Records what `label`'s keys cost, from two readings around the
    /// `ops` operations it started.
    fn record_costs(
        &mut self,
        label: &str,
        before: &costs::Reading,
        after: &costs::Reading,
        ops: u64,
    ) {
        self.add_costs(label, costs::per_key(before, after, ops));
    }

    fn add_costs(&mut self, label: &str, k: PerKey) {
        let show = |name: &str, v: Option<f64>, digits: usize| {
            v.map(|v| format!(" {v:.digits$} {name}"))
                .unwrap_or_default()
        };
        let line = [
            show("µs CPU", k.proc_cpu_us, 0),
            show("switches", k.proc_switches, 1),
            show("µs database CPU", k.db_cpu_us, 0),
            show("database switches", k.db_switches, 1),
            show("allocations", k.allocs, 0),
            show("bytes allocated", k.alloc_bytes, 0),
            show("syscalls", k.syscalls, 1),
            show("statements", k.statements, 2),
            show("WAL bytes", k.wal_bytes, 0),
            show("buffers dirtied", k.dirtied, 2),
            show("transactions", k.xacts, 2),
        ]
        .concat();
        if !line.is_empty() {
            println!("    {label} per key:{line}");
        }
        self.per_key.entry(label.to_owned()).or_default().push(k);
    }

    fn rss(&mut self, label: &str, proc: &Proc) {
        if let Some(kib) = proc.peak_rss_kib() {
            self.rss_kib.entry(label.to_owned()).or_default().push(kib);
        }
    }
}

/// What the suite was given and found.
pub struct Env {
    pub args: SuiteArgs,
    pub idemgate: PathBuf,
    pub ipx: Option<PathBuf>,
    pub bench_url: String,
    pub work: PathBuf,
    pub pool: PgPool,
    /// The Citus schema's URL and a pool on it, for the scale-out scenario.
    pub citus: Option<(String, PgPool)>,
    pub prefix: String,
    counter: std::sync::atomic::AtomicU64,
    /// pgbench, for the PostgreSQL floor; none: that floor is skipped.
    pgbench: Option<PathBuf>,
    /// PostgreSQL's own log, where readable, and whether its lines name the
    /// database: the storm counts the deadlocks it reports.
    pg_log: Option<(PathBuf, bool)>,
    /// Whether `pg_stat_statements` is readable in the benchmark's database.
    pub statements: bool,
    /// The server's WAL, where `pg_waldump` can read it here.
    wal: Option<crate::pgstats::WalDump>,
    /// The Redis server's process, for its CPU beside idempotent-proxy.
    redis_pid: Option<u32>,
    /// The idemgate build of the probe windows.
    probe_idemgate: PathBuf,
    /// Whether strace runs here, for the syscall windows.
    strace: bool,
    /// Where the flamegraphs go, when they are drawn.
    pub flame_dir: Option<PathBuf>,
    /// The private cluster, when the suite runs on one; stopped when the
    /// environment is dropped.
    pub cluster: Option<Cluster>,
}

impl Env {
    fn measure(&self) -> Duration {
        Duration::from_secs_f64(self.args.seconds)
    }

    fn warmup(&self) -> Duration {
        Duration::from_secs_f64(self.args.warmup)
    }

    fn wants(&self, scenario: &str) -> bool {
        self.args.only.is_empty() || self.args.only.iter().any(|s| s == scenario)
    }

    /// A prefix no earlier key used.
    fn fresh_prefix(&self) -> String {
        let n = self
            .counter
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{}-{n}", self.prefix)
    }

    fn log(&self, name: &str) -> PathBuf {
        self.work.join(format!("{name}.log"))
    }

    /// Flushes dirty buffers now rather than in some later measurement (needs
    /// a superuser or pg_checkpoint; skipped without).
    async fn checkpoint(&self) {
        if let Err(e) = sqlx::query("CHECKPOINT").execute(&self.pool).await {
            println!("  note: CHECKPOINT failed ({e}); measurements may meet one");
        }
    }

    async fn truncate(&self) -> anyhow::Result<()> {
        sqlx::query("TRUNCATE idempotency_keys, idempotency_reservations")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// `idemgate serve` on `database_url`, ready.
    async fn serve(
        &self,
        database_url: &str,
        extra: &[(&str, String)],
    ) -> anyhow::Result<(Proc, SocketAddr)> {
        let log = self.log("idemgate-serve");
        procs::idemgate(
            "idemgate serve",
            &self.idemgate,
            &Door::Serve,
            database_url,
            extra,
            &log,
        )
        .await
    }

    /// The benchmark database's processes, and with `counters` PostgreSQL's
    /// own counts, for a [`Meter`].
    fn pg_db(&self, counters: bool) -> Db<'_> {
        Db::Postgres {
            pool: &self.pool,
            counters,
            statements: self.statements,
            wal: self.wal.as_ref(),
        }
    }

    /// The PostgreSQL floor (pgbench, [`floor::PGBENCH_SCRIPT`]) at `c`
    /// clients on an emptied table, recorded as `label` with the database's
    /// CPU and switches per key (and with `counters` PostgreSQL's own
    /// counts); nothing without pgbench.
    async fn pg_floor(
        &self,
        label: &str,
        c: usize,
        counters: bool,
        res: &mut Results,
    ) -> anyhow::Result<()> {
        let Some(bin) = &self.pgbench else {
            return Ok(());
        };
        sqlx::query("TRUNCATE bench_floor_keys")
            .execute(&self.pool)
            .await?;
        let script = self.work.join("floor.sql");
        std::fs::write(&script, floor::PGBENCH_SCRIPT)?;
        let meter = Meter {
            proc: None,
            metrics: None,
            db: self.pg_db(counters),
        };
        let before = meter.before().await;
        // pgbench's backends exit with it, before the reading after: their
        // usage is sampled while it runs.
        let pgbench = floor::pgbench(bin, &self.bench_url, &script, c, self.args.seconds);
        let (sample, seen) = costs::sampling_db(&self.pool, pgbench).await;
        let sample = sample?;
        let mut after = meter.after(&before).await;
        after.merge_db(seen);
        res.record_costs(label, &before, &after, sample.all_ops);
        res.record(label, sample);
        Ok(())
    }

    /// The SQLite floor at `c` clients on a new file in the work directory
    /// (the disk the SQLite scenarios use), recorded as `label` with its
    /// writer thread's CPU and switches per key as the database's.
    async fn sqlite_floor(&self, label: &str, c: usize, res: &mut Results) -> anyhow::Result<()> {
        let path = self
            .work
            .join(format!("sqlite-floor-{}.db", self.fresh_prefix()));
        let writer = SqliteFloor::create(&path)?;
        let meter = Meter {
            proc: None,
            metrics: None,
            db: Db::Threads(None, floor::WRITER_THREAD),
        };
        let before = meter.before_thread_named().await;
        let sample = measure(self, writer.workers(&self.fresh_prefix(), c)).await?;
        let after = meter.after(&before).await;
        writer.finish().await;
        res.record_costs(label, &before, &after, sample.all_ops);
        res.record(label, sample);
        Ok(())
    }

    /// `idemgate proxy` on `database_url` in front of `upstream`, ready.
    async fn proxy(
        &self,
        upstream: SocketAddr,
        database_url: &str,
    ) -> anyhow::Result<(Proc, SocketAddr)> {
        let log = self.log("idemgate-proxy");
        let door = Door::Proxy(upstream);
        procs::idemgate(
            "idemgate proxy",
            &self.idemgate,
            &door,
            database_url,
            &[],
            &log,
        )
        .await
    }

    /// The URL of a new SQLite file in the work directory, so that no
    /// measurement starts on rows (or a WAL) another one left.
    fn sqlite_url(&self, kind: &str) -> String {
        let file = format!("{kind}-{}.db", self.fresh_prefix());
        format!("sqlite://{}", self.work.join(file).display())
    }

    /// idempotent-proxy-server on Redis in front of `upstream`, ready.
    async fn ipx(&self, bin: &Path, upstream: SocketAddr) -> anyhow::Result<(Proc, SocketAddr)> {
        let addr = procs::free_addr()?;
        // It refuses to start without a .env file in its working directory.
        let dir = self.work.join("idempotent-proxy");
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(".env"), "")?;
        let env = [
            ("SERVER_ADDR", addr.to_string()),
            ("REDIS_URL", self.args.redis_url.clone()),
            ("URL_ORIGIN", format!("http://{upstream}/v1/charges")),
            // Its keys live as long as its request timeout (ms): long enough
            // for the replay measurement to find them.
            ("REQUEST_TIMEOUT", "600000".to_owned()),
            ("LOG_LEVEL", "warn".to_owned()),
        ];
        let mut proc = Proc::spawn(
            "idempotent-proxy",
            bin,
            &[],
            &env,
            Some(&dir),
            &self.log("idempotent-proxy"),
        )?;
        proc.wait_ready(addr, None).await?;
        Ok((proc, addr))
    }
}

async fn measure<W: Worker>(env: &Env, workers: Vec<W>) -> anyhow::Result<Sample> {
    load::run_for(workers, env.warmup(), env.measure()).await
}

/// Completes `n` keys through the reservation API and returns them.
pub async fn populate_api(
    addr: SocketAddr,
    prefix: &str,
    n: usize,
) -> anyhow::Result<Arc<Vec<String>>> {
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}-r{i}")).collect();
    let mut conn = Conn::new(addr);
    for key in &keys {
        workers::api_pair(&mut conn, key).await?;
    }
    Ok(Arc::new(keys))
}

/// Sends each key once through a proxy at `path`, so that the next send of it
/// is a replay.
pub(crate) async fn populate_proxy(
    addr: SocketAddr,
    path: &str,
    prefix: &str,
    n: usize,
) -> anyhow::Result<Arc<Vec<String>>> {
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}-r{i}")).collect();
    let mut conn = Conn::new(addr);
    for key in &keys {
        conn.post_json(
            path,
            &[("idempotency-key", key)],
            bytes::Bytes::from_static(workers::CHARGE_BODY.as_bytes()),
            http::StatusCode::CREATED,
        )
        .await?;
    }
    Ok(Arc::new(keys))
}

fn raw_pairs(env: &Env, c: usize) -> Vec<RawPair> {
    let prefix = env.fresh_prefix();
    (0..c)
        .map(|w| RawPair::new(env.pool.clone(), &prefix, w))
        .collect()
}

fn floor_pairs(env: &Env, c: usize) -> Vec<FloorPair> {
    let prefix = env.fresh_prefix();
    (0..c)
        .map(|w| FloorPair::new(env.pool.clone(), &prefix, w))
        .collect()
}

fn api_pairs(env: &Env, addr: SocketAddr, c: usize) -> Vec<ApiPair> {
    let prefix = env.fresh_prefix();
    (0..c).map(|w| ApiPair::new(addr, &prefix, w)).collect()
}

fn api_replays(addr: SocketAddr, keys: &Arc<Vec<String>>, c: usize) -> Vec<ApiReplay> {
    (0..c)
        .map(|w| ApiReplay::new(addr, keys.clone(), w))
        .collect()
}

fn posts(addr: SocketAddr, path: &str, keys: &Keys, c: usize) -> Vec<ProxyPost> {
    (0..c)
        .map(|w| ProxyPost::new(addr, path, keys.clone(), w))
        .collect()
}

/// What scenarios 1 and 2 measure at each concurrency.
#[derive(Clone, Copy)]
enum PairKind {
    /// idemgate's own reserve and commit statements through a pool.
    Raw,
    /// The two plainest statements a reservation could be.
    Floor,
    /// The reservation API.
    Api,
    /// The measured two-flush floor (pgbench).
    Pgbench,
}

/// Scenarios 1 and 2: the raw-SQL bound and the minimal-SQL floor, then the
/// reservation API.
async fn sql_and_api(env: &Env, run: usize, res: &mut Results) -> anyhow::Result<()> {
    use PairKind::{Api, Floor, Pgbench, Raw};
    for c in [8, 32] {
        // Alternate the order, so that a slow drift of the machine (a
        // checkpoint, another tenant) does not always fall on one side; the
        // floors stay next to the API either way.
        let order = if run % 2 == 1 {
            [Raw, Floor, Pgbench, Api]
        } else {
            [Api, Pgbench, Floor, Raw]
        };
        for kind in order {
            env.truncate().await?;
            match kind {
                Raw => res.record(
                    &format!("raw-pair c={c}"),
                    measure(env, raw_pairs(env, c)).await?,
                ),
                Floor => res.record(
                    &format!("floor-pair c={c}"),
                    measure(env, floor_pairs(env, c)).await?,
                ),
                Pgbench => {
                    let label = format!("pg-floor-api c={c}");
                    env.pg_floor(&label, c, true, res).await?;
                }
                Api => api_pair_costs(env, c, res).await?,
            }
        }
    }
    // Many connections (an agents' fleet): the API alone, on every answer's
    // status; the floors would need as many database connections.
    env.truncate().await?;
    api_pair_costs(env, MANY, res).await
}

/// The fleet's concurrency: many more connections than the store's pool.
pub const MANY: usize = 256;

/// The reservation API on PostgreSQL at `c`, with what each pair cost.
async fn api_pair_costs(env: &Env, c: usize, res: &mut Results) -> anyhow::Result<()> {
    let (proc, addr) = env.serve(&env.bench_url, &[]).await?;
    let label = format!("api-pair c={c}");
    let meter = Meter {
        proc: proc.pid(),
        metrics: proc.metrics_addr(),
        db: env.pg_db(c != MANY),
    };
    let costs_before = meter.before().await;
    let before = proc.cpu_ticks();
    let sample = measure(env, api_pairs(env, addr, c)).await?;
    res.record_with_cpu(&label, sample, &proc, before);
    let costs_after = meter.after(&costs_before).await;
    res.record_costs(&label, &costs_before, &costs_after, sample.all_ops);
    res.record_batches(&label, &proc).await?;
    proc.stop().await;
    Ok(())
}

/// Scenario 3: replays, beside a primary-key SELECT of the same rows.
async fn replays(env: &Env, res: &mut Results) -> anyhow::Result<()> {
    for c in [8, 32] {
        env.truncate().await?;
        let (proc, addr) = env.serve(&env.bench_url, &[]).await?;
        let keys = populate_api(addr, &env.fresh_prefix(), env.args.replay_keys).await?;
        let selects = (0..c)
            .map(|w| RawSelect::new(env.pool.clone(), &keys, w))
            .collect();
        res.record(&format!("raw-select c={c}"), measure(env, selects).await?);
        let label = format!("api-replay c={c}");
        let before = proc.cpu_ticks();
        let sample = measure(env, api_replays(addr, &keys, c)).await?;
        res.record_with_cpu(&label, sample, &proc, before);
        proc.stop().await;
    }
    Ok(())
}

/// Scenario 4: the proxy on PostgreSQL and on SQLite, beside the origin
/// alone and idempotent-proxy.
async fn proxy(env: &Env, origin: SocketAddr, res: &mut Results) -> anyhow::Result<()> {
    for c in PROXY_CONCURRENCY {
        if c == 1 {
            env.truncate().await?;
            res.record("raw-pair c=1", measure(env, raw_pairs(env, 1)).await?);
        }
        let fresh = Keys::Fresh(env.fresh_prefix());
        res.record(
            &format!("origin c={c}"),
            measure(env, posts(origin, "/v1/charges", &fresh, c)).await?,
        );

        // At c = 8, the measured floors of both stores beside the doors (and
        // at c = 1 SQLite's, whose latency pgbench does not give).
        if c == 8 {
            env.pg_floor("pg-floor-proxy c=8", c, true, res).await?;
        }
        env.truncate().await?;
        // idempotent-proxy between the two idemgate doors, so that each
        // ratio to it is taken from neighbouring measurements.
        let (proc, addr) = env.proxy(origin, &env.bench_url).await?;
        let db = env.pg_db(c == 8 || c == 32);
        proxy_door(env, "idemgate", proc, addr, "/v1/charges", c, db, res).await?;
        if let Some(bin) = &env.ipx {
            let (proc, addr) = env.ipx(bin, origin).await?;
            let db = env.redis_pid.map_or(Db::None, Db::Process);
            proxy_door(env, "ipx", proc, addr, "/URL_ORIGIN", c, db, res).await?;
        }
        if c == 1 || c == 8 {
            env.sqlite_floor(&format!("sqlite-floor-proxy c={c}"), c, res)
                .await?;
        }
        let (proc, addr) = env.proxy(origin, &env.sqlite_url("proxy")).await?;
        let door = "idemgate-sqlite";
        let db = Db::Threads(proc.pid(), procs::SQLITE_WRITER_THREAD);
        proxy_door(env, door, proc, addr, "/v1/charges", c, db, res).await?;
    }
    Ok(())
}

/// Scenario 10: the time to the first byte of a streamed answer, c = 1:
/// the origin directly, through idemgate proxy, and claims straight to the
/// store, in turn; on PostgreSQL, then on SQLite.
async fn streams(env: &Env, origin: SocketAddr, res: &mut Results) -> anyhow::Result<()> {
    env.truncate().await?;
    let prefix = env.fresh_prefix();
    let pg_claims: Vec<(&str, Box<dyn ClaimOnce>)> = vec![
        (
            "stream-claim c=1",
            Box::new(workers::FloorClaim::new(env.pool.clone(), &prefix)),
        ),
        (
            "stream-raw-claim c=1",
            Box::new(workers::RawClaim::new(env.pool.clone(), &prefix)),
        ),
    ];
    let sqlite_claims: Vec<(&str, Box<dyn ClaimOnce>)> = vec![(
        "stream-claim-sqlite c=1",
        Box::new(workers::SqliteClaim::create(&env.work.join("stream-claims.db"), &prefix).await?),
    )];
    let stores = [
        (
            env.bench_url.clone(),
            ["stream-origin c=1", "stream-idemgate c=1"],
            pg_claims,
        ),
        (
            env.sqlite_url("stream"),
            ["stream-origin-2 c=1", "stream-idemgate-sqlite c=1"],
            sqlite_claims,
        ),
    ];
    for (store, [origin_label, proxy_label], claims) in stores {
        let (proc, addr) = env.proxy(origin, &store).await?;
        let mut labels = vec![origin_label, proxy_label];
        let mut probes = vec![
            Probe::Stream(Conn::new(origin)),
            Probe::Stream(Conn::new(addr)),
        ];
        for (label, claim) in claims {
            labels.push(label);
            probes.push(Probe::Claim(claim));
        }
        let samples = first_bytes(env, probes).await;
        proc.stop().await;
        for (label, sample) in labels.into_iter().zip(samples?) {
            res.record(label, sample);
        }
    }
    Ok(())
}

/// What the stream scenario times, one at a time.
enum Probe {
    /// `POST /v1/stream` with a new key: the time to its first body byte
    /// (the stream is read to its end and checked).
    Stream(Conn),
    /// A durable claim of a new key, straight to the database: the time
    /// until it is acknowledged.
    Claim(Box<dyn ClaimOnce>),
}

/// A [`crate::load::Worker`] that can be boxed.
trait ClaimOnce: Send {
    fn once(&mut self, seq: u64) -> futures::future::BoxFuture<'_, anyhow::Result<()>>;
}

impl<W: crate::load::Worker> ClaimOnce for W {
    fn once(&mut self, seq: u64) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
        Box::pin(self.call(seq))
    }
}

impl Probe {
    async fn time(&mut self, key: &str, seq: u64, whole: &[u8]) -> anyhow::Result<Duration> {
        match self {
            Probe::Stream(conn) => {
                let (first, body) = conn
                    .first_byte(
                        "/v1/stream",
                        &[("idempotency-key", key)],
                        Bytes::from_static(workers::CHARGE_BODY.as_bytes()),
                    )
                    .await?;
                anyhow::ensure!(body == whole, "the stream came back changed: {body:?}");
                Ok(first)
            }
            Probe::Claim(claim) => {
                let at = Instant::now();
                claim.once(seq).await?;
                Ok(at.elapsed())
            }
        }
    }
}

/// One client timing each probe in turn (the origin, the proxy in front of
/// it, the store's bare claim), one request at a time with a new key each,
/// so that all three meet the same moments of a shared machine.
async fn first_bytes(env: &Env, probes: Vec<Probe>) -> anyhow::Result<Vec<Sample>> {
    struct Tally {
        probe: Probe,
        hist: hdrhistogram::Histogram<u64>,
        errors: u64,
        all_ops: u64,
        first_error: Option<String>,
    }
    let prefix = env.fresh_prefix();
    let whole = [origin::FIRST_EVENT, origin::LAST_EVENT].concat();
    let mut tallies = Vec::with_capacity(probes.len());
    for probe in probes {
        tallies.push(Tally {
            probe,
            hist: hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?,
            errors: 0,
            all_ops: 0,
            first_error: None,
        });
    }
    let started = Instant::now();
    let measure_from = started + env.warmup();
    let end = measure_from + env.measure();
    let mut seq = 0u64;
    while Instant::now() < end {
        for t in &mut tallies {
            let key = format!("{prefix}-s{seq}");
            seq += 1;
            let at = Instant::now();
            let result = t.probe.time(&key, seq, &whole).await;
            if at < measure_from {
                continue;
            }
            t.all_ops += 1;
            match result {
                Ok(took) => {
                    let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
                    t.hist.saturating_record(us.max(1));
                }
                Err(e) => {
                    t.errors += 1;
                    t.first_error.get_or_insert_with(|| format!("{e:#}"));
                }
            }
        }
    }
    let secs = (Instant::now() - measure_from).as_secs_f64();
    Ok(tallies
        .into_iter()
        .map(|t| {
            if let Some(first) = &t.first_error {
                eprintln!("    {} errors; the first: {first}", t.errors);
            }
            Sample {
                ops: t.hist.len(),
                errors: t.errors,
                secs,
                p50_us: t.hist.value_at_quantile(0.50),
                p99_us: t.hist.value_at_quantile(0.99),
                all_ops: t.all_ops,
            }
        })
        .collect())
}

/// New keys, then replays, through one proxy process (`{name}-new`,
/// `{name}-replay`); stops it after. An idemgate door's batch sizes are read
/// between the two, while only new keys have written through it. What each
/// new key cost is read around its measurement, the store's work where `db`
/// says.
#[allow(clippy::too_many_arguments)]
async fn proxy_door(
    env: &Env,
    name: &str,
    proc: Proc,
    addr: SocketAddr,
    path: &str,
    c: usize,
    db: Db<'_>,
    res: &mut Results,
) -> anyhow::Result<()> {
    let fresh = Keys::Fresh(env.fresh_prefix());
    let new_keys = posts(addr, path, &fresh, c);
    curve::measured(
        env,
        &format!("{name}-new"),
        c,
        &proc,
        db,
        None,
        new_keys,
        res,
    )
    .await?;
    let keys = populate_proxy(addr, path, &env.fresh_prefix(), env.args.replay_keys).await?;
    let before = proc.cpu_ticks();
    let sample = measure(env, posts(addr, path, &Keys::Replay(keys), c)).await?;
    res.record_with_cpu(&format!("{name}-replay c={c}"), sample, &proc, before);
    proc.stop().await;
    Ok(())
}

/// Inserts `n` expired records (with their reservation ids), as a day of
/// traffic whose keys have all run out would leave them.
async fn insert_expired(pool: &PgPool, n: u64) -> anyhow::Result<()> {
    let n = i64::try_from(n)?;
    sqlx::query(
        "INSERT INTO idempotency_keys
            (tenant, key_hash, fingerprint, state, reservation_id, attempt, response_status,
             response_headers, response_body, created_at, completed_at, expires_at)
         SELECT 'expired', sha256(('k' || i)::bytea), repeat('f', 64), 'completed',
                gen_random_uuid(), 1, 201, '[[\"content-type\",\"application/json\"]]'::jsonb,
                convert_to(repeat('x', 100), 'UTF8'), now() - interval '2 days',
                now() - interval '2 days', now() - interval '1 day' + i * interval '1 ms'
           FROM generate_series(1, $1) AS i",
    )
    .bind(n)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
         SELECT tenant, reservation_id, key_hash FROM idempotency_keys WHERE tenant = 'expired'",
    )
    .execute(pool)
    .await?;
    sqlx::query("VACUUM ANALYZE idempotency_keys")
        .execute(pool)
        .await?;
    sqlx::query("VACUUM ANALYZE idempotency_reservations")
        .execute(pool)
        .await?;
    Ok(())
}

/// Scenario 5: live traffic (scenario 2 at c = 8) with and without the
/// pruning job deleting a backlog of expired rows.
async fn prune(env: &Env, res: &mut Results) -> anyhow::Result<()> {
    let c = 8;
    env.truncate().await?;
    let (proc, addr) = env.serve(&env.bench_url, &[]).await?;
    res.record(
        "prune-off c=8",
        measure(env, api_pairs(env, addr, c)).await?,
    );
    proc.stop().await;

    env.truncate().await?;
    let t = Instant::now();
    insert_expired(&env.pool, env.args.prune_rows).await?;
    println!(
        "  inserted {} expired rows in {:.1} s",
        env.args.prune_rows,
        t.elapsed().as_secs_f64()
    );
    // The job starts with the process and passes every second until the
    // backlog is gone; the window lasts until then (at least `seconds`).
    let started = Instant::now();
    let (proc, addr) = env
        .serve(
            &env.bench_url,
            &[("IDEMGATE_PRUNE_INTERVAL", "1".to_owned())],
        )
        .await?;
    let pool = env.pool.clone();
    let min = env.measure();
    let pruned_in = Arc::new(std::sync::Mutex::new(None::<Duration>));
    let pruned_at = pruned_in.clone();
    let end = async move {
        let window = Instant::now();
        loop {
            let left: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE tenant = 'expired')",
            )
            .fetch_one(&pool)
            .await
            .unwrap_or(true);
            if !left {
                let mut at = pruned_at.lock().unwrap_or_else(|e| e.into_inner());
                at.get_or_insert(started.elapsed());
                if window.elapsed() >= min {
                    return;
                }
            }
            if window.elapsed() > Duration::from_secs(600) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    let before = proc.cpu_ticks();
    let sample = load::run(api_pairs(env, addr, c), env.warmup(), end).await?;
    res.record_with_cpu("prune-on c=8", sample, &proc, before);
    proc.stop().await;
    let took = *pruned_in.lock().unwrap_or_else(|e| e.into_inner());
    match took {
        Some(d) => {
            let note = format!(
                "{} expired rows (and their reservation ids) pruned in {:.1} s ({:.0} rows/s) while the live load ran",
                env.args.prune_rows,
                d.as_secs_f64(),
                env.args.prune_rows as f64 / d.as_secs_f64()
            );
            println!("  {note}");
            res.notes.push(note);
        }
        None => anyhow::bail!("the pruning job did not finish within 10 minutes"),
    }
    Ok(())
}

/// Scenario 6: scenarios 2 and 3 on the embedded SQLite store.
async fn sqlite(env: &Env, res: &mut Results) -> anyhow::Result<()> {
    for c in [8, 32] {
        // The measured floor on the same disk, right before.
        env.sqlite_floor(&format!("sqlite-floor-sqlite c={c}"), c, res)
            .await?;
        sqlite_pair_costs(env, c, res).await?;

        let (proc, addr) = env.serve(&env.sqlite_url("replays"), &[]).await?;
        let keys = populate_api(addr, &env.fresh_prefix(), env.args.replay_keys).await?;
        let label = format!("sqlite-replay c={c}");
        let before = proc.cpu_ticks();
        let sample = measure(env, api_replays(addr, &keys, c)).await?;
        res.record_with_cpu(&label, sample, &proc, before);
        proc.stop().await;
    }
    sqlite_pair_costs(env, MANY, res).await
}

/// The reservation API on a new SQLite file at `c`, with what each pair
/// cost (the store's work: its writer thread).
async fn sqlite_pair_costs(env: &Env, c: usize, res: &mut Results) -> anyhow::Result<()> {
    let (proc, addr) = env.serve(&env.sqlite_url("pairs"), &[]).await?;
    let label = format!("sqlite-pair c={c}");
    let meter = Meter {
        proc: proc.pid(),
        metrics: proc.metrics_addr(),
        db: Db::Threads(proc.pid(), procs::SQLITE_WRITER_THREAD),
    };
    let costs_before = meter.before_thread_named().await;
    let before = proc.cpu_ticks();
    let sample = measure(env, api_pairs(env, addr, c)).await?;
    res.record_with_cpu(&label, sample, &proc, before);
    let costs_after = meter.after(&costs_before).await;
    res.record_costs(&label, &costs_before, &costs_after, sample.all_ops);
    res.record_batches(&label, &proc).await?;
    proc.stop().await;
    Ok(())
}

/// Scenario 8: the reservation API on a Citus cluster beside one PostgreSQL,
/// the same measurement on each, alternating which goes first.
async fn citus_beside_single(env: &Env, run: usize, res: &mut Results) -> anyhow::Result<()> {
    let Some((citus_url, citus_pool)) = &env.citus else {
        return Ok(());
    };
    for c in [8, 32] {
        let order = if run % 2 == 1 {
            [false, true]
        } else {
            [true, false]
        };
        for on_citus in order {
            let (url, pool, name) = if on_citus {
                (citus_url.as_str(), citus_pool, "citus")
            } else {
                (env.bench_url.as_str(), &env.pool, "single")
            };
            sqlx::query("TRUNCATE idempotency_keys, idempotency_reservations")
                .execute(pool)
                .await?;
            let (proc, addr) = env.serve(url, &[]).await?;
            let label = format!("{name}-pair c={c}");
            let before = proc.cpu_ticks();
            let sample = measure(env, api_pairs(env, addr, c)).await?;
            res.record_with_cpu(&label, sample, &proc, before);
            res.record_batches(&label, &proc).await?;
            let keys = populate_api(addr, &env.fresh_prefix(), env.args.replay_keys).await?;
            let label = format!("{name}-replay c={c}");
            let before = proc.cpu_ticks();
            let sample = measure(env, api_replays(addr, &keys, c)).await?;
            res.record_with_cpu(&label, sample, &proc, before);
            proc.stop().await;
        }
    }
    Ok(())
}

/// Scenario 11: a storm of duplicates (one key sequence sent by every
/// client, in `--storm-copies` copies) beside distinct keys measured right
/// before it, at c = 8 and 32, on PostgreSQL and, when given, on Citus; with
/// the deadlocks the storm caused, from the database's statistics and from
/// the logs.
async fn storms(env: &Env, res: &mut Results) -> anyhow::Result<()> {
    let mut targets = vec![("", env.bench_url.clone(), env.pool.clone(), false)];
    if let Some((url, pool)) = &env.citus {
        targets.push(("citus-", url.clone(), pool.clone(), true));
    }
    // Statistics reach pg_stat_database asynchronously (a backend flushes
    // its own at most every second, and at exit): wait them out.
    let settle = Duration::from_secs_f64(if env.args.smoke { 0.5 } else { 1.5 });
    // A deadlock holds every write of the batches in it for PostgreSQL's
    // deadlock_timeout (1 s by default) before one is cancelled: a smoke
    // run's half-second storm could then see no iteration end at all.
    let window = if env.args.smoke {
        env.measure().max(Duration::from_secs(2))
    } else {
        env.measure()
    };
    for (name, url, pool, on_citus) in targets {
        let database: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(&pool)
            .await?;
        for c in [8, 32] {
            let truncate = "TRUNCATE idempotency_keys, idempotency_reservations";
            sqlx::query(truncate).execute(&pool).await?;
            let (proc, addr) = env.serve(&url, &[]).await?;
            let label = format!("{name}storm-distinct c={c}");
            let before = proc.cpu_ticks();
            let sample = measure(env, api_pairs(env, addr, c)).await?;
            res.record_with_cpu(&label, sample, &proc, before);
            proc.stop().await;

            sqlx::query(truncate).execute(&pool).await?;
            let deadlocks_before = storm::settled_deadlocks(&pool, on_citus, settle).await;
            let log = env.log(&format!("idemgate-{name}storm"));
            let log_from = storm::log_len(&log);
            // PostgreSQL's own log is the single server's, not Citus's.
            let pg_log = env.pg_log.as_ref().filter(|_| !on_citus);
            let pg_log_from = pg_log.map(|(path, _)| storm::log_len(path));
            // The batch writer says at debug level why a batch failed (and
            // was written again one write at a time): a deadlock among them.
            let logging = [("RUST_LOG", "info,idemgate::store=debug".to_owned())];
            let (proc, addr) = procs::idemgate(
                "idemgate serve",
                &env.idemgate,
                &Door::Serve,
                &url,
                &logging,
                &log,
            )
            .await?;
            let tally = Arc::new(storm::Tally::default());
            let label = format!("{name}storm c={c}");
            let prefix = env.fresh_prefix();
            let workers = storm::workers(addr, &prefix, c, env.args.storm_copies, &tally);
            let before = proc.cpu_ticks();
            let sample = load::run_for(workers, env.warmup(), window).await?;
            res.record_with_cpu(&label, sample, &proc, before);
            res.record_batches(&label, &proc).await?;
            proc.stop().await;
            let deadlocks_after = storm::settled_deadlocks(&pool, on_citus, settle).await;

            let mut outcome = tally.read();
            outcome.deadlocks = deadlocks_before
                .zip(deadlocks_after)
                .map(|(before, after)| after - before);
            outcome.log_deadlocks = storm::deadlock_lines(&log, log_from, None).unwrap_or(0);
            outcome.pg_log_deadlocks =
                pg_log
                    .zip(pg_log_from)
                    .and_then(|((path, names_db), from)| {
                        storm::deadlock_lines(path, from, names_db.then_some(database.as_str()))
                    });
            println!(
                "    {label}: {} winners, {} in flight, {} outcome unknown, {} replays, {} errors; \
                 deadlocks {} (statistics), {} (idemgate's log), {} (PostgreSQL's log)",
                outcome.winners,
                outcome.in_flight,
                outcome.unknown,
                outcome.replays,
                outcome.errors,
                outcome.deadlocks.map_or("?".into(), |d| d.to_string()),
                outcome.log_deadlocks,
                outcome
                    .pg_log_deadlocks
                    .map_or("?".into(), |d| d.to_string()),
            );
            res.storm.entry(label).or_default().push(outcome);
        }
    }
    Ok(())
}

/// Scenario 12: the measured floors alone, c = 1, 8, 32: pgbench's two
/// autocommitted writes per key on PostgreSQL, and two group-committed
/// writes per key through one writer thread on SQLite.
async fn floors(env: &Env, res: &mut Results) -> anyhow::Result<()> {
    for c in [1, 8, 32] {
        env.pg_floor(&format!("pg-floor c={c}"), c, false, res)
            .await?;
        env.sqlite_floor(&format!("sqlite-floor c={c}"), c, res)
            .await?;
    }
    Ok(())
}

/// Creates (dropping it first) the schema `idemgate_bench` on the Citus
/// coordinator at `url`; returns the URL that uses it.
async fn create_citus_schema(url: &str) -> anyhow::Result<String> {
    let options = PgConnectOptions::from_str(url).context("--citus-url")?;
    let mut admin = options
        .connect()
        .await
        .context("connect to the Citus coordinator")?;
    sqlx::query("DROP SCHEMA IF EXISTS idemgate_bench CASCADE")
        .execute(&mut admin)
        .await?;
    sqlx::query("CREATE SCHEMA idemgate_bench")
        .execute(&mut admin)
        .await?;
    let sep = if url.contains('?') { '&' } else { '?' };
    Ok(format!("{url}{sep}options[search_path]=idemgate_bench"))
}

/// Creates the benchmark database `name` beside `admin_url` (dropping it
/// first) and returns its URL.
async fn create_database(admin_url: &str, name: &str) -> anyhow::Result<String> {
    anyhow::ensure!(
        !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
        "--bench-database: lower-case letters, digits and underscores only, got {name:?}"
    );
    let options = PgConnectOptions::from_str(admin_url).context("DATABASE_URL")?;
    let mut admin = options.connect().await.context("connect to PostgreSQL")?;
    // `name` is checked above: a plain identifier.
    let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
    sqlx::query(sqlx::AssertSqlSafe(drop))
        .execute(&mut admin)
        .await?;
    let create = format!("CREATE DATABASE {name}");
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(&mut admin)
        .await?;
    let mut url = url::Url::parse(admin_url).context("DATABASE_URL")?;
    url.set_path(&format!("/{name}"));
    Ok(url.to_string())
}

/// Runs the suite and returns its results and environment.
pub async fn run(mut args: SuiteArgs) -> anyhow::Result<(Env, Results)> {
    if args.smoke {
        args.runs = 1;
        args.seconds = args.seconds.min(0.5);
        args.warmup = args.warmup.min(0.2);
        args.prune_rows = args.prune_rows.min(5000);
        args.replay_keys = args.replay_keys.min(50);
    }
    let idemgate = match &args.idemgate {
        Some(p) => p.clone(),
        None => procs::sibling("idemgate")?,
    };
    let idemgate = std::fs::canonicalize(&idemgate).with_context(|| {
        format!(
            "no idemgate binary at {} (build it with `cargo build --release`, or pass --idemgate)",
            idemgate.display()
        )
    })?;
    let ipx = args
        .idempotent_proxy
        .as_deref()
        .and_then(|p| std::fs::canonicalize(p).ok());
    let work = match &args.work_dir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!("idemgate-bench-{}", std::process::id())),
    };
    std::fs::create_dir_all(&work)?;
    let probe_idemgate = match &args.probe_idemgate {
        Some(p) => std::fs::canonicalize(p)
            .with_context(|| format!("no --probe-idemgate binary at {}", p.display()))?,
        None => idemgate.clone(),
    };

    let cluster = if args.private_postgres {
        let cluster = Cluster::start(&work)?;
        println!("a private PostgreSQL for the suite at {}", cluster.url());
        args.database_url = cluster.url();
        Some(cluster)
    } else {
        None
    };
    let bench_url = create_database(&args.database_url, &args.bench_database).await?;
    let status = tokio::process::Command::new(&idemgate)
        .arg("migrate")
        .env("DATABASE_URL", &bench_url)
        .status()
        .await?;
    anyhow::ensure!(status.success(), "idemgate migrate failed");
    // The same pool size idemgate opens by default, so the bound is fair.
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&bench_url)
        .await?;
    let citus = match args.citus_url.as_deref() {
        Some(url)
            if args.only.is_empty() || args.only.iter().any(|s| s == "citus" || s == "storm") =>
        {
            let url = create_citus_schema(url).await?;
            let status = tokio::process::Command::new(&idemgate)
                .arg("migrate")
                .env("DATABASE_URL", &url)
                .status()
                .await?;
            anyhow::ensure!(status.success(), "idemgate migrate on Citus failed");
            let pool = PgPoolOptions::new()
                .max_connections(2)
                .connect(&url)
                .await?;
            Some((url, pool))
        }
        _ => None,
    };

    // The PostgreSQL floor's table, beside idemgate's.
    for &statement in floor::PG_FLOOR_TABLE {
        sqlx::query(statement).execute(&pool).await?;
    }
    let wants = |s: &str| args.only.is_empty() || args.only.iter().any(|o| o == s);
    let pgbench = if ["sql", "proxy", "floor", "curve"].iter().any(|s| wants(s)) {
        floor::find_pgbench().await
    } else {
        None
    };
    let pg_log = match &cluster {
        Some(c) => Some((c.log.clone(), true)),
        None if wants("storm") => storm::pg_log(&pool).await,
        None => None,
    };
    let statements = crate::pgstats::enable_statements(&pool).await;
    let wal = crate::pgstats::WalDump::find(&pool).await;
    let redis_pid = costs::redis_pid(&args.redis_url).await;
    let strace = !args.no_probes && probe::available("strace", "--version").await;
    let flame_dir = if args.flamegraphs && !args.no_probes {
        let tools = [
            ("perf", probe::available("perf", "--version").await),
            (
                "inferno-flamegraph",
                probe::available("inferno-flamegraph", "--help").await,
            ),
            (
                "inferno-collapse-perf",
                probe::available("inferno-collapse-perf", "--help").await,
            ),
        ];
        let missing: Vec<&str> = tools.iter().filter(|t| !t.1).map(|t| t.0).collect();
        missing
            .is_empty()
            .then(|| probe::flamegraph_dir(&args.out))
            .or_else(|| {
                println!("note: no flamegraphs: {} not found", missing.join(", "));
                None
            })
    } else {
        None
    };

    let env = Env {
        pgbench,
        pg_log,
        statements,
        wal,
        redis_pid,
        probe_idemgate,
        strace,
        flame_dir,
        cluster,
        prefix: uuid::Uuid::new_v4().simple().to_string()[..12].to_owned(),
        args,
        idemgate,
        ipx,
        bench_url,
        work,
        pool,
        citus,
        counter: Default::default(),
    };
    let mut res = Results::default();
    if env.citus.is_none() && (env.wants("citus") || env.wants("storm")) {
        res.notes.push(
            "no Citus cluster was given (--citus-url): the scale-out comparison and the storm on \
             Citus were skipped"
                .to_owned(),
        );
    }
    if env.pgbench.is_none()
        && ["sql", "proxy", "floor", "curve"]
            .iter()
            .any(|s| env.wants(s))
    {
        res.notes.push(
            "pgbench was not found (on the PATH or in PostgreSQL's bin directory): the measured \
             PostgreSQL floor was skipped"
                .to_owned(),
        );
    }
    if env.ipx.is_none() && (env.wants("proxy") || env.wants("curve")) {
        res.notes.push(
            "idempotent-proxy-server was not available: its comparison was skipped".to_owned(),
        );
    }
    if !env.statements {
        res.notes.push(
            "statements and shared buffers dirtied per key: n/a (pg_stat_statements not loaded: \
             the server does not preload it; `--private-postgres` starts one that does)"
                .to_owned(),
        );
    }
    if env.cluster.is_none() {
        res.notes.push(
            "WAL and transactions per key are the whole server's (its WAL position and \
             transaction ids): on a shared server, other databases' writes during a \
             measurement count too"
                .to_owned(),
        );
    }
    if env.wal.is_none() {
        res.notes.push(
            "WAL records per key: n/a (pg_waldump cannot read the server's WAL directory here)"
                .to_owned(),
        );
    }
    if !env.args.no_probes && !env.strace {
        res.notes
            .push("syscalls per key: n/a (strace not found)".to_owned());
    }
    if env.args.flamegraphs && env.flame_dir.is_none() {
        res.notes.push(
            "no flamegraphs: perf or inferno (inferno-collapse-perf, inferno-flamegraph) not \
             found"
                .to_owned(),
        );
    }

    let origin_addr = procs::free_addr()?;
    let mut origin = Proc::spawn(
        "origin",
        &std::env::current_exe()?,
        &["origin", "--listen", &origin_addr.to_string()],
        &[],
        None,
        &env.log("origin"),
    )?;
    origin.wait_ready(origin_addr, None).await?;

    for run in 1..=env.args.runs {
        println!("run {run} of {}", env.args.runs);
        env.checkpoint().await;
        if env.wants("sql") {
            sql_and_api(&env, run, &mut res).await?;
        }
        if env.wants("replay") {
            replays(&env, &mut res).await?;
        }
        if env.wants("proxy") {
            proxy(&env, origin_addr, &mut res).await?;
        }
        if env.wants("stream") {
            streams(&env, origin_addr, &mut res).await?;
        }
        if env.wants("curve") {
            curve::curve(&env, origin_addr, &mut res).await?;
        }
        if env.wants("sqlite") {
            sqlite(&env, &mut res).await?;
        }
        if env.wants("citus") {
            citus_beside_single(&env, run, &mut res).await?;
        }
        if env.wants("storm") {
            storms(&env, &mut res).await?;
        }
        if env.wants("floor") {
            floors(&env, &mut res).await?;
        }
        if run == 1 && !env.args.no_probes {
            probes(&env, origin_addr, &mut res).await?;
        }
    }
    // Pruning writes and deletes a million rows: it runs after every other
    // scenario, and a checkpoint after each pass flushes what it dirtied, so
    // that its I/O never falls into another measurement.
    if env.wants("prune") {
        for run in 1..=env.args.runs {
            println!("pruning, run {run} of {}", env.args.runs);
            env.checkpoint().await;
            prune(&env, &mut res).await?;
            env.truncate().await?;
            env.checkpoint().await;
        }
    }
    origin.stop().await;
    Ok((env, res))
}
