//! Scenario `curve`: latency against concurrency. Every door and floor at
//! c = 1, 2, 4, … 64 and a fleet's 256, each measurement with what it cost
//! per key (the CPU of the process under test and of the store), and, on
//! PostgreSQL, how many of the benchmark database's statements were running
//! at once while it was measured: a curve that bends while the cores and the
//! database idle says that requests wait for each other, not for the
//! hardware; the machine's busy share of its cores says which.

use std::net::SocketAddr;
use std::time::Duration;

use sqlx::PgPool;

use super::{Env, MANY, Results, api_pairs, measure, posts};
use crate::costs::{Db, Meter};
use crate::load::Worker;
use crate::procs::{self, Proc};
use crate::workers::Keys;

/// The concurrency levels: doubling from one client, then a fleet.
pub const CURVE: [usize; 8] = [1, 2, 4, 8, 16, 32, 64, MANY];

/// A smoke run's levels: one of each kind.
const SMOKE_CURVE: [usize; 3] = [1, 8, MANY];

/// What is measured at each level, in that order: label stem, and its name in
/// the report. The floors open a connection (or a writer's client) per
/// client, so they stop at 64.
pub const SUBJECTS: [(&str, &str); 7] = [
    (
        "curve-pg-floor",
        "floor: pgbench's two statements, PostgreSQL",
    ),
    ("curve-api-pair", "reservation API pairs, PostgreSQL"),
    ("curve-idemgate-new", "proxy new keys, PostgreSQL"),
    ("curve-ipx-new", "idempotent-proxy new keys (Redis)"),
    ("curve-sqlite-floor", "floor: one writer thread, SQLite"),
    ("curve-sqlite-pair", "reservation API pairs, SQLite"),
    ("curve-idemgate-sqlite-new", "proxy new keys, SQLite"),
];

/// The label of `stem` at `c`.
pub fn label(stem: &str, c: usize) -> String {
    format!("{stem} c={c}")
}

/// The levels this run measures.
pub fn levels(smoke: bool) -> &'static [usize] {
    if smoke { &SMOKE_CURVE } else { &CURVE }
}

pub(super) async fn curve(env: &Env, origin: SocketAddr, res: &mut Results) -> anyhow::Result<()> {
    for &c in levels(env.args.smoke) {
        if c < MANY {
            env.pg_floor(&label("curve-pg-floor", c), c, false, res)
                .await?;
        }
        env.truncate().await?;
        let (proc, addr) = env.serve(&env.bench_url, &[]).await?;
        let pairs = api_pairs(env, addr, c);
        let db = env.pg_db(false);
        measured(
            env,
            "curve-api-pair",
            c,
            &proc,
            db,
            Some(&env.pool),
            pairs,
            res,
        )
        .await?;
        proc.stop().await;

        env.truncate().await?;
        let (proc, addr) = env.proxy(origin, &env.bench_url).await?;
        let fresh = Keys::Fresh(env.fresh_prefix());
        let new_keys = posts(addr, "/v1/charges", &fresh, c);
        let db = env.pg_db(false);
        measured(
            env,
            "curve-idemgate-new",
            c,
            &proc,
            db,
            Some(&env.pool),
            new_keys,
            res,
        )
        .await?;
        proc.stop().await;

        if let Some(bin) = &env.ipx {
            let (proc, addr) = env.ipx(bin, origin).await?;
            let fresh = Keys::Fresh(env.fresh_prefix());
            let new_keys = posts(addr, "/URL_ORIGIN", &fresh, c);
            let db = env.redis_pid.map_or(Db::None, Db::Process);
            measured(env, "curve-ipx-new", c, &proc, db, None, new_keys, res).await?;
            proc.stop().await;
        }

        if c < MANY {
            env.sqlite_floor(&label("curve-sqlite-floor", c), c, res)
                .await?;
        }
        let (proc, addr) = env.serve(&env.sqlite_url("curve-pairs"), &[]).await?;
        let pairs = api_pairs(env, addr, c);
        let db = Db::Threads(proc.pid(), procs::SQLITE_WRITER_THREAD);
        measured(env, "curve-sqlite-pair", c, &proc, db, None, pairs, res).await?;
        proc.stop().await;

        let (proc, addr) = env.proxy(origin, &env.sqlite_url("curve-proxy")).await?;
        let fresh = Keys::Fresh(env.fresh_prefix());
        let new_keys = posts(addr, "/v1/charges", &fresh, c);
        let db = Db::Threads(proc.pid(), procs::SQLITE_WRITER_THREAD);
        let stem = "curve-idemgate-sqlite-new";
        measured(env, stem, c, &proc, db, None, new_keys, res).await?;
        proc.stop().await;
    }
    Ok(())
}

/// Measures `workers` against `proc` as `stem` at `c`, with what each key
/// cost the process and the store, how the process batched its writes, and,
/// given the benchmark database's pool, its statements running at once.
#[allow(clippy::too_many_arguments)]
pub(super) async fn measured<W: Worker>(
    env: &Env,
    stem: &str,
    c: usize,
    proc: &Proc,
    db: Db<'_>,
    active: Option<&PgPool>,
    workers: Vec<W>,
    res: &mut Results,
) -> anyhow::Result<()> {
    let label = label(stem, c);
    let meter = Meter {
        proc: proc.pid(),
        metrics: proc.metrics_addr(),
        db,
    };
    let costs_before = meter.before_thread_named().await;
    let ticks = proc.cpu_ticks();
    let machine = machine_ticks();
    let sample = match active {
        Some(pool) => {
            let (sample, seen) = sampling_active(pool, measure(env, workers)).await;
            res.active.entry(label.clone()).or_default().push(seen);
            sample?
        }
        None => measure(env, workers).await?,
    };
    if let (Some((busy0, all0)), Some((busy1, all1))) = (machine, machine_ticks())
        && all1 > all0
    {
        let busy = (busy1 - busy0) as f64 / (all1 - all0) as f64;
        res.busy.entry(label.clone()).or_default().push(busy);
    }
    res.record_with_cpu(&label, sample, proc, ticks);
    let costs_after = meter.after(&costs_before).await;
    res.record_costs(&label, &costs_before, &costs_after, sample.all_ops);
    if proc.metrics_addr().is_some() {
        res.record_batches(&label, proc).await?;
    }
    Ok(())
}

/// The machine's CPU time so far, busy and in all, in ticks of every core
/// (`/proc/stat`'s first line; idle and waiting for I/O are not busy).
fn machine_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|t| t.parse().ok())
        .collect();
    let all: u64 = ticks.iter().sum();
    let idle = ticks.get(3)? + ticks.get(4).copied().unwrap_or(0);
    Some((all.saturating_sub(idle), all))
}

/// Statements of one database running at once, sampled while work ran.
#[derive(Debug, Clone, Copy, Default)]
pub struct Active {
    /// The mean over the samples.
    pub mean: f64,
    /// The most seen in one sample.
    pub max: i64,
}

/// Runs `work` while counting, every 50 ms, the statements running in
/// `pool`'s database (`pg_stat_activity`, state `active`, the sampler's
/// own left out). Warm-up included: the whole of `work` is sampled.
pub async fn sampling_active<T>(pool: &PgPool, work: impl Future<Output = T>) -> (T, Active) {
    let mut counts = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut work = std::pin::pin!(work);
    loop {
        tokio::select! {
            out = &mut work => {
                let active = Active {
                    mean: counts.iter().sum::<i64>() as f64 / counts.len().max(1) as f64,
                    max: counts.iter().copied().max().unwrap_or(0),
                };
                return (out, active);
            }
            _ = tick.tick() => {
                let n: Result<i64, _> = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND state = 'active'
                        AND pid <> pg_backend_pid()",
                )
                .fetch_one(pool)
                .await;
                if let Ok(n) = n {
                    counts.push(n);
                }
            }
        }
    }
}
