//! Measured floors: the least two durable writes per key can cost on each
//! store, on this machine, now. A new key is at least a claim made durable
//! before the effect and a response made durable after it, so its ceiling is
//! about `c ÷ (2 flushes + origin)` keys/s, raised by group commit; these
//! measure that ceiling rather than guess it.
//!
//! * SQLite: c client tasks, each key an `INSERT` of a claim row then an
//!   `UPDATE` storing a small response, through one writer thread that
//!   writes whatever is queued at each wake-up as one transaction
//!   (`BEGIN IMMEDIATE` … `COMMIT`), on a file kept as idemgate keeps its own
//!   (WAL, `synchronous = FULL`, a busy timeout).
//! * PostgreSQL: pgbench running `bench/pgbench/floor.sql`, the same two
//!   writes autocommitted, into a table of `idempotency_keys`'s columns with
//!   its primary key only (`-M prepared`); keys/s = tps.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};

use crate::load::{Sample, Worker};
use crate::workers::key;

/// The pgbench script of the PostgreSQL floor (kept in bench/pgbench/ so it
/// can be run by hand too).
pub const PGBENCH_SCRIPT: &str = include_str!("../pgbench/floor.sql");

/// The table the pgbench floor writes: `idempotency_keys`'s columns, its
/// primary key and no other index.
pub const PG_FLOOR_TABLE: &[&str] = &[
    "DROP TABLE IF EXISTS bench_floor_keys",
    "CREATE TABLE bench_floor_keys (LIKE idempotency_keys INCLUDING DEFAULTS)",
    "ALTER TABLE bench_floor_keys ADD PRIMARY KEY (tenant, key_hash)",
];

/// The name of the SQLite floor's writer thread: its CPU and switches are
/// the floor's database work, as idemgate's writer thread is its store's.
pub const WRITER_THREAD: &str = "sqlite-floor-writer";

/// The idemgate SQLite store's busy timeout.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The response the SQLite floor stores.
const RESPONSE_BODY: &[u8] = br#"{"id":"ch_000000000001","object":"charge","amount":1000,"currency":"eur","status":"succeeded"}"#;

/// One write of a key, queued for the writer thread.
enum Op {
    Claim {
        hash: Vec<u8>,
        reservation_id: String,
    },
    Complete {
        hash: Vec<u8>,
    },
}

struct Job {
    op: Op,
    done: oneshot::Sender<Result<(), String>>,
}

/// The SQLite floor's writer: one thread, one connection, one transaction per
/// wake-up holding every write queued by then.
pub struct SqliteFloor {
    queue: mpsc::UnboundedSender<Job>,
    thread: std::thread::JoinHandle<()>,
}

impl SqliteFloor {
    /// Creates a new file at `path` with the floor's table and starts the
    /// writer on it.
    pub fn create(path: &Path) -> anyhow::Result<SqliteFloor> {
        let conn =
            rusqlite::Connection::open(path).with_context(|| format!("open {}", path.display()))?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        anyhow::ensure!(mode.eq_ignore_ascii_case("wal"), "journal mode {mode}");
        conn.execute_batch(
            "PRAGMA synchronous = FULL;
             CREATE TABLE IF NOT EXISTS floor_keys (
                 tenant TEXT NOT NULL, key_hash BLOB NOT NULL, fingerprint TEXT,
                 state TEXT NOT NULL, reservation_id TEXT NOT NULL, lease_expires_at INTEGER,
                 attempt INTEGER NOT NULL, response_status INTEGER, response_headers TEXT,
                 response_body BLOB, created_at INTEGER NOT NULL, completed_at INTEGER,
                 expires_at INTEGER NOT NULL,
                 PRIMARY KEY (tenant, key_hash)) STRICT;",
        )?;
        let (queue, jobs) = mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name(WRITER_THREAD.into())
            .spawn(move || write_loop(conn, jobs))?;
        Ok(SqliteFloor { queue, thread })
    }

    /// The client tasks: `c` workers, each key a claim then a completion.
    pub fn workers(&self, prefix: &str, c: usize) -> Vec<SqliteFloorKey> {
        (0..c)
            .map(|worker| SqliteFloorKey {
                queue: self.queue.clone(),
                prefix: prefix.to_owned(),
                worker,
            })
            .collect()
    }

    /// Stops the writer once the workers are gone.
    pub async fn finish(self) {
        drop(self.queue);
        let thread = self.thread;
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
}

/// The writer thread: waits for a write, takes every other one queued by
/// then, and writes them all in one transaction with cached statements.
fn write_loop(conn: rusqlite::Connection, mut jobs: mpsc::UnboundedReceiver<Job>) {
    while let Some(first) = jobs.blocking_recv() {
        let mut batch = vec![first];
        while let Ok(job) = jobs.try_recv() {
            batch.push(job);
        }
        let mut results = Vec::with_capacity(batch.len());
        let committed = (|| -> rusqlite::Result<()> {
            conn.execute_batch("BEGIN IMMEDIATE")?;
            for job in &batch {
                results.push(write(&conn, &job.op));
            }
            conn.execute_batch("COMMIT")
        })();
        if let Err(e) = committed {
            let _ = conn.execute_batch("ROLLBACK");
            results = batch.iter().map(|_| Err(format!("{e}"))).collect();
        }
        for (job, result) in batch.into_iter().zip(results) {
            let _ = job.done.send(result);
        }
    }
}

/// One write inside the writer's transaction; it must touch one row.
fn write(conn: &rusqlite::Connection, op: &Op) -> Result<(), String> {
    let changed = match op {
        Op::Claim {
            hash,
            reservation_id,
        } => conn
            .prepare_cached(
                "INSERT INTO floor_keys (tenant, key_hash, fingerprint, state, reservation_id,
                     lease_expires_at, attempt, created_at, expires_at)
                 VALUES ('floor', ?1, 'fp', 'in_flight', ?2, unixepoch('subsec') * 1000 + 30000, 1,
                         unixepoch('subsec') * 1000, unixepoch('subsec') * 1000 + 86400000)
                 ON CONFLICT DO NOTHING",
            )
            .and_then(|mut s| s.execute(rusqlite::params![hash, reservation_id])),
        Op::Complete { hash } => conn
            .prepare_cached(
                "UPDATE floor_keys SET state = 'completed', response_status = 201,
                     response_headers = '[[\"content-type\",\"application/json\"]]',
                     response_body = ?2, completed_at = unixepoch('subsec') * 1000,
                     lease_expires_at = NULL
                  WHERE tenant = 'floor' AND key_hash = ?1",
            )
            .and_then(|mut s| s.execute(rusqlite::params![hash, RESPONSE_BODY])),
    };
    match changed {
        Ok(1) => Ok(()),
        Ok(n) => Err(format!("the write touched {n} rows, not 1")),
        Err(e) => Err(e.to_string()),
    }
}

/// One client of the SQLite floor: each call is one new key, its claim
/// then its completion, each acknowledged once its transaction committed.
pub struct SqliteFloorKey {
    queue: mpsc::UnboundedSender<Job>,
    prefix: String,
    worker: usize,
}

impl SqliteFloorKey {
    async fn send(&self, op: Op) -> anyhow::Result<()> {
        let (done, answer) = oneshot::channel();
        self.queue
            .send(Job { op, done })
            .ok()
            .context("the writer stopped")?;
        answer
            .await
            .context("the writer dropped a write")?
            .map_err(anyhow::Error::msg)
    }
}

impl Worker for SqliteFloorKey {
    async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
        let hash = Sha256::digest(key(&self.prefix, self.worker, seq).as_bytes()).to_vec();
        let reservation_id = uuid::Uuid::new_v4().to_string();
        self.send(Op::Claim {
            hash: hash.clone(),
            reservation_id,
        })
        .await?;
        self.send(Op::Complete { hash }).await
    }
}

/// The pgbench binary: on the PATH, else in PostgreSQL's own bin directory.
pub async fn find_pgbench() -> Option<PathBuf> {
    find_pg_program("pgbench").await
}

/// One of PostgreSQL's programs: on the PATH, else in PostgreSQL's own bin
/// directory (`pg_config --bindir`, or the newest of Debian's versioned
/// directories).
pub async fn find_pg_program(name: &str) -> Option<PathBuf> {
    if let Some(path) = crate::procs::output("sh", &["-c", &format!("command -v {name}")]).await
        && !path.is_empty()
    {
        return Some(PathBuf::from(path));
    }
    if let Some(dir) = crate::procs::output("pg_config", &["--bindir"]).await {
        let bin = Path::new(&dir).join(name);
        if bin.is_file() {
            return Some(bin);
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin").join(name);
            bin.is_file().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

/// Runs the pgbench floor at `c` clients for `seconds` (whole seconds, at
/// least one) against `url`, the script written at `script`; one pgbench
/// transaction is one key.
pub async fn pgbench(
    bin: &Path,
    url: &str,
    script: &Path,
    c: usize,
    seconds: f64,
) -> anyhow::Result<Sample> {
    let secs = seconds.round().max(1.0) as u64;
    let threads = c.min(2);
    let out = tokio::process::Command::new(bin)
        .args(["-n", "-M", "prepared", "-c"])
        .arg(c.to_string())
        .arg("-j")
        .arg(threads.to_string())
        .arg("-T")
        .arg(secs.to_string())
        .arg("-f")
        .arg(script)
        .arg(url)
        .output()
        .await
        .with_context(|| format!("run {}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.success(),
        "pgbench failed ({}): {}",
        out.status,
        stderr.trim()
    );
    parse_pgbench(&stdout).with_context(|| format!("pgbench's report: {stdout}"))
}

/// Reads keys (transactions), failures and tps from pgbench's report. The
/// window is set so that the sample's rate is pgbench's tps (which leaves
/// out the time to connect); pgbench reports no percentiles, so the
/// latencies are left at zero.
fn parse_pgbench(report: &str) -> anyhow::Result<Sample> {
    let field = |prefix: &str| {
        report
            .lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<f64>().ok())
    };
    let ops =
        field("number of transactions actually processed:").context("no count of transactions")?;
    let failed = field("number of failed transactions:").unwrap_or(0.0);
    let tps = field("tps =").context("no tps")?;
    anyhow::ensure!(tps > 0.0, "tps {tps}");
    Ok(Sample {
        ops: ops as u64,
        errors: failed as u64,
        secs: ops / tps,
        p50_us: 0,
        p99_us: 0,
        all_ops: (ops + failed) as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_pgbench_15s_report() {
        let report = "pgbench (15.20 (Debian 15.20-0+deb12u1))
transaction type: floor.sql
scaling factor: 1
query mode: prepared
number of clients: 8
number of threads: 2
maximum number of tries: 1
duration: 5 s
number of transactions actually processed: 21840
number of failed transactions: 0 (0.000%)
latency average = 1.830 ms
initial connection time = 12.345 ms
tps = 4370.561633 (without initial connection time)
";
        let s = parse_pgbench(report).unwrap();
        assert_eq!(s.ops, 21840);
        assert_eq!(s.errors, 0);
        assert!((s.rate() - 4370.561633).abs() < 0.01, "{s:?}");
    }

    #[tokio::test]
    async fn the_sqlite_floor_writes_both_rows_of_each_key() {
        let dir = std::env::temp_dir().join(format!("floor-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("floor.db");
        let floor = SqliteFloor::create(&path).unwrap();
        let mut workers = floor.workers("t", 4);
        let calls = workers
            .iter_mut()
            .enumerate()
            .map(|(i, w)| async move { w.call(i as u64).await });
        for r in futures::future::join_all(calls).await {
            r.unwrap();
        }
        drop(workers);
        floor.finish().await;
        let conn = rusqlite::Connection::open(&path).unwrap();
        let done: i64 = conn
            .query_row(
                "SELECT count(*) FROM floor_keys WHERE state = 'completed'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(done, 4);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
