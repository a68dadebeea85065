//! What each new key costs, beside how many go through: read before and
//! after a measurement, divided by the operations it started (warm-up
//! included, as the CPU figures always were). The process under test's CPU
//! and context switches; the database's (PostgreSQL's processes, a SQLite
//! writer thread, or Redis); the allocator's counts where the build has
//! them; and PostgreSQL's own counts of statements, WAL and transactions.

use std::net::SocketAddr;
use std::time::Duration;

use sqlx::PgPool;

use crate::metrics::{self, Allocations};
use crate::pgstats::{self, PgCounters, WalDump};
use crate::procs;
use crate::usage::{self, Usage};

/// Per-key figures of one reading (a measurement, or a probe window); none
/// where not read.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PerKey {
    pub proc_cpu_us: Option<f64>,
    pub proc_switches: Option<f64>,
    pub db_cpu_us: Option<f64>,
    pub db_switches: Option<f64>,
    pub allocs: Option<f64>,
    pub alloc_bytes: Option<f64>,
    pub syscalls: Option<f64>,
    pub statements: Option<f64>,
    pub wal_bytes: Option<f64>,
    pub wal_records: Option<f64>,
    pub dirtied: Option<f64>,
    pub xacts: Option<f64>,
}

/// Where a measurement's database work happens, to read what it used.
#[derive(Clone, Copy)]
pub enum Db<'a> {
    /// Not read.
    None,
    /// The PostgreSQL processes working for this pool's database
    /// ([`procs::db_processes`]); with `counters`, PostgreSQL's own counts
    /// too (`statements`: from `pg_stat_statements`; `wal`: the WAL's
    /// records, where readable).
    Postgres {
        pool: &'a PgPool,
        counters: bool,
        statements: bool,
        wal: Option<&'a WalDump>,
    },
    /// Threads named with this prefix, of a process (of this one with
    /// none): a SQLite writer.
    Threads(Option<u32>, &'static str),
    /// A process of its own (Redis).
    Process(u32),
}

/// What to read around one measurement.
pub struct Meter<'a> {
    /// The process under test (idemgate, idempotent-proxy).
    pub proc: Option<u32>,
    /// Its `/metrics`, for the allocator's counts (when its build counts).
    pub metrics: Option<SocketAddr>,
    pub db: Db<'a>,
}

/// One reading of a [`Meter`].
#[derive(Default)]
pub struct Reading {
    proc: Option<Usage>,
    db: Option<usage::Processes>,
    allocs: Option<Allocations>,
    pg: Option<PgCounters>,
    /// WAL records since the reading before (a reading after only).
    wal_records: Option<f64>,
}

impl Meter<'_> {
    async fn usage(&self, into: &mut Reading) {
        into.proc = self.proc.and_then(usage::of_process);
        into.db = match self.db {
            Db::None => None,
            Db::Postgres { pool, .. } => procs::db_processes(pool).await,
            Db::Threads(pid, prefix) => usage::of_threads(pid, prefix).map(|u| [(0, u)].into()),
            Db::Process(pid) => usage::of_process(pid).map(|u| [(pid, u)].into()),
        };
        if let Some(addr) = self.metrics {
            into.allocs = metrics::allocations(addr).await;
        }
    }

    async fn counters(&self, into: &mut Reading, before: Option<&Reading>) {
        if let Db::Postgres {
            pool,
            counters: true,
            statements,
            wal,
        } = self.db
        {
            into.pg = pgstats::read(pool, statements).await;
            let span = before.and_then(|b| b.pg.as_ref()).zip(into.pg.as_ref());
            if let (Some(wal), Some((from, to))) = (wal, span) {
                into.wal_records = pgstats::wal_records(wal, &from.lsn, &to.lsn).await;
            }
        }
    }

    /// Reads before a measurement: PostgreSQL's counters, then the
    /// processes.
    pub async fn before(&self) -> Reading {
        let mut r = Reading::default();
        self.counters(&mut r, None).await;
        self.usage(&mut r).await;
        r
    }

    /// [`Meter::before`], once the threads it reads exist: a thread names
    /// itself as it starts, a moment after it was spawned.
    pub async fn before_thread_named(&self) -> Reading {
        if let Db::Threads(pid, prefix) = self.db {
            for _ in 0..100 {
                if usage::of_threads(pid, prefix).is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        self.before().await
    }

    /// Reads after a measurement: the processes at once (before anything
    /// else runs through them, and before their connections close), then
    /// PostgreSQL's counters, and the WAL records since `before`.
    pub async fn after(&self, before: &Reading) -> Reading {
        let mut r = Reading::default();
        self.usage(&mut r).await;
        self.counters(&mut r, Some(before)).await;
        r
    }
}

impl Reading {
    /// Adds processes seen while the measurement ran (by
    /// [`sampling_db`]) that are gone now, with what they had used when
    /// last seen.
    pub fn merge_db(&mut self, seen: Option<usage::Processes>) {
        let Some(seen) = seen else { return };
        let db = self.db.get_or_insert_with(Default::default);
        for (pid, u) in seen {
            db.entry(pid).or_insert(u);
        }
    }
}

/// Runs `work` while reading the database's processes every 100 ms, and
/// returns its output with the last reading of each process seen: for
/// clients whose backends exit with them (pgbench), whose usage would
/// otherwise be lost; each loses at most its last 100 ms.
pub async fn sampling_db<T>(
    pool: &PgPool,
    work: impl Future<Output = T>,
) -> (T, Option<usage::Processes>) {
    let mut seen = usage::Processes::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut work = std::pin::pin!(work);
    loop {
        tokio::select! {
            out = &mut work => {
                return (out, (!seen.is_empty()).then_some(seen));
            }
            _ = tick.tick() => {
                if let Some(now) = procs::db_processes(pool).await {
                    seen.extend(now);
                }
            }
        }
    }
}

/// Per-key figures from two readings around `ops` operations.
pub fn per_key(before: &Reading, after: &Reading, ops: u64) -> PerKey {
    if ops == 0 {
        return PerKey::default();
    }
    let n = ops as f64;
    let proc = before.proc.zip(after.proc).map(|(b, a)| a.since(b));
    let db = before
        .db
        .as_ref()
        .zip(after.db.as_ref())
        .map(|(b, a)| usage::processes_since(b, a));
    let allocs = before.allocs.zip(after.allocs).map(|(b, a)| a.since(b));
    let pg = before
        .pg
        .as_ref()
        .zip(after.pg.as_ref())
        .map(|(b, a)| a.since(b));
    PerKey {
        proc_cpu_us: proc.and_then(|u| u.cpu_us_per(ops)),
        proc_switches: proc.and_then(|u| u.switches_per(ops)),
        db_cpu_us: db.and_then(|u| u.cpu_us_per(ops)),
        db_switches: db.and_then(|u| u.switches_per(ops)),
        allocs: allocs.map(|a| a.calls / n),
        alloc_bytes: allocs.map(|a| a.bytes / n),
        syscalls: None,
        statements: pg.and_then(|p| p.statements).map(|s| s / n),
        wal_bytes: pg.map(|p| p.wal_bytes / n),
        wal_records: after.wal_records.filter(|_| pg.is_some()).map(|r| r / n),
        dirtied: pg.and_then(|p| p.dirtied).map(|d| d / n),
        xacts: pg.map(|p| p.xacts / n),
    }
}

/// The process id of the Redis server at `url` (its `INFO server`).
pub async fn redis_pid(url: &str) -> Option<u32> {
    let info = procs::output("redis-cli", &["-u", url, "INFO", "server"]).await?;
    parse_redis_pid(&info)
}

fn parse_redis_pid(info: &str) -> Option<u32> {
    info.lines()
        .find_map(|l| l.trim().strip_prefix("process_id:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_redis_process_id() {
        let info = "# Server\r\nredis_version:7.0.15\r\nprocess_id:2274\r\nrun_id:abc\r\n";
        assert_eq!(parse_redis_pid(info), Some(2274));
        assert_eq!(parse_redis_pid("# Server\r\n"), None);
    }

    #[test]
    fn per_key_divides_each_difference_by_the_operations() {
        let before = Reading {
            proc: Some(Usage {
                ticks: 100,
                switches: 1000,
            }),
            db: Some([(7, Usage::default())].into()),
            allocs: Some(Allocations {
                calls: 10.0,
                bytes: 100.0,
            }),
            pg: None,
            wal_records: None,
        };
        let after = Reading {
            proc: Some(Usage {
                ticks: 100 + usage::ticks_per_second(),
                switches: 5000,
            }),
            db: Some(
                [(
                    7,
                    Usage {
                        ticks: 0,
                        switches: 200,
                    },
                )]
                .into(),
            ),
            allocs: Some(Allocations {
                calls: 2010.0,
                bytes: 64_100.0,
            }),
            pg: None,
            wal_records: None,
        };
        let k = per_key(&before, &after, 1000);
        assert_eq!(k.proc_cpu_us, Some(1000.0));
        assert_eq!(k.proc_switches, Some(4.0));
        assert_eq!(k.db_switches, Some(0.2));
        assert_eq!(k.allocs, Some(2.0));
        assert_eq!(k.alloc_bytes, Some(64.0));
        assert_eq!(k.statements, None);
        assert_eq!(per_key(&before, &after, 0), PerKey::default());
    }
}
