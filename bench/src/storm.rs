//! A storm of duplicates: a fleet of clients retrying after a blip, all
//! sending one key sequence. `D` copies of one sequence of keys, each copy
//! walked by `c ÷ D` workers that take the next index from that copy's own
//! counter, so that key `n` is sent once per copy, at about the same moment.
//! One iteration reserves the key: a 201 is a winner, which commits; a 409
//! (in flight, or outcome unknown) or a 200 (a replay) is a duplicate
//! answered. Modelled on `wrk` with two threads sending one key sequence.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http::{Method, StatusCode};
use serde::Deserialize;
use sqlx::PgPool;

use crate::http::Conn;
use crate::load::Worker;
use crate::workers::{COMMIT_BODY, RESERVE_BODY};

/// How a storm's iterations ended, warm-up included.
#[derive(Debug, Default)]
pub struct Tally {
    /// 201, then committed: the key's one pair.
    pub winners: AtomicU64,
    /// 409 request-in-flight.
    pub in_flight: AtomicU64,
    /// 409 outcome-unknown.
    pub unknown: AtomicU64,
    /// 200: the stored response, replayed.
    pub replays: AtomicU64,
    /// Anything else, or a failed request or commit.
    pub errors: AtomicU64,
}

/// A [`Tally`] read at the end, with what the database said.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    pub winners: u64,
    pub in_flight: u64,
    pub unknown: u64,
    pub replays: u64,
    pub errors: u64,
    /// `pg_stat_database.deadlocks` after the storm less before (on Citus,
    /// the coordinator's and the workers' added up); none if unreadable.
    pub deadlocks: Option<i64>,
    /// Lines with "deadlock detected" that the storm added to idemgate's log.
    pub log_deadlocks: u64,
    /// The same in PostgreSQL's own log, where the suite found it.
    pub pg_log_deadlocks: Option<u64>,
}

impl Tally {
    pub fn read(&self) -> Outcome {
        Outcome {
            winners: self.winners.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            unknown: self.unknown.load(Ordering::Relaxed),
            replays: self.replays.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            ..Outcome::default()
        }
    }
}

#[derive(Deserialize)]
struct Reserved {
    reservation_id: uuid::Uuid,
}

/// One client of a storm.
pub struct StormWorker {
    conn: Conn,
    prefix: Arc<str>,
    next: Arc<AtomicU64>,
    tally: Arc<Tally>,
}

/// `c` workers in `copies` copies of one key sequence named `prefix` (at
/// least one worker per copy), sharing `tally`.
pub fn workers(
    addr: SocketAddr,
    prefix: &str,
    c: usize,
    copies: usize,
    tally: &Arc<Tally>,
) -> Vec<StormWorker> {
    let copies = copies.clamp(1, c.max(1));
    let prefix: Arc<str> = Arc::from(prefix);
    let counters: Vec<Arc<AtomicU64>> = (0..copies).map(|_| Arc::default()).collect();
    (0..c)
        .map(|w| StormWorker {
            conn: Conn::new(addr),
            prefix: prefix.clone(),
            next: counters[w % copies].clone(),
            tally: tally.clone(),
        })
        .collect()
}

impl StormWorker {
    async fn once(&mut self, key: &str) -> anyhow::Result<()> {
        let answer = self
            .conn
            .send(
                Method::POST,
                "/v1/reservations",
                &[
                    ("content-type", "application/json"),
                    ("idempotency-key", key),
                ],
                Bytes::from_static(RESERVE_BODY.as_bytes()),
            )
            .await?;
        match answer.status {
            StatusCode::CREATED => {
                let reserved: Reserved =
                    serde_json::from_slice(&answer.body).context("reserve answer")?;
                let path = format!("/v1/reservations/{}/commit", reserved.reservation_id);
                self.conn
                    .post_json(
                        &path,
                        &[],
                        Bytes::from_static(COMMIT_BODY.as_bytes()),
                        StatusCode::OK,
                    )
                    .await?;
                self.tally.winners.fetch_add(1, Ordering::Relaxed);
            }
            StatusCode::CONFLICT => {
                let unknown = String::from_utf8_lossy(&answer.body).contains("outcome-unknown");
                let counter = if unknown {
                    &self.tally.unknown
                } else {
                    &self.tally.in_flight
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
            StatusCode::OK => {
                self.tally.replays.fetch_add(1, Ordering::Relaxed);
            }
            other => anyhow::bail!(
                "POST /v1/reservations: {other}: {}",
                String::from_utf8_lossy(&answer.body)
            ),
        }
        Ok(())
    }
}

impl Worker for StormWorker {
    async fn call(&mut self, _seq: u64) -> anyhow::Result<()> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let key = format!("{}-{n}", self.prefix);
        let result = self.once(&key).await;
        if result.is_err() {
            self.tally.errors.fetch_add(1, Ordering::Relaxed);
        }
        result
    }
}

/// The database's count of deadlocks once its statistics have settled: the
/// backends flush theirs asynchronously (and at exit), so this clears the
/// snapshot and reads until two readings 0.5 s apart agree, at least
/// `settle` after the first. On Citus (`on_workers`) the workers' counts are
/// added. None if the counter cannot be read.
pub async fn settled_deadlocks(pool: &PgPool, on_workers: bool, settle: Duration) -> Option<i64> {
    let started = Instant::now();
    let mut last: Option<i64> = None;
    loop {
        let now = read_deadlocks(pool, on_workers).await?;
        if last == Some(now) && started.elapsed() >= settle {
            return Some(now);
        }
        if started.elapsed() > settle + Duration::from_secs(10) {
            return Some(now);
        }
        last = Some(now);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn read_deadlocks(pool: &PgPool, on_workers: bool) -> Option<i64> {
    let mut conn = pool.acquire().await.ok()?;
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await
        .ok()?;
    let mut n: i64 = sqlx::query_scalar(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&mut *conn)
    .await
    .ok()?;
    if on_workers {
        // Citus: each worker's own count, for the same database name.
        let results: Vec<String> = sqlx::query_scalar(
            "SELECT result FROM run_command_on_workers(
                 $$SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()$$)
              WHERE success",
        )
        .fetch_all(&mut *conn)
        .await
        .unwrap_or_default();
        n += results
            .iter()
            .filter_map(|r| r.trim().parse::<i64>().ok())
            .sum::<i64>();
    }
    Some(n)
}

/// How long `path` is now (0 if it does not exist): where a measurement's
/// lines will start.
pub fn log_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// Lines saying "deadlock detected" in `path` after byte `from` (and, when
/// `database` is given, naming it: PostgreSQL's log serves every database).
pub fn deadlock_lines(path: &Path, from: u64, database: Option<&str>) -> Option<u64> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path).ok()?;
    file.seek(SeekFrom::Start(from)).ok()?;
    let mut text = Vec::new();
    file.read_to_end(&mut text).ok()?;
    let text = String::from_utf8_lossy(&text);
    let n = text
        .lines()
        .filter(|l| l.contains("deadlock detected"))
        .filter(|l| database.is_none_or(|db| l.contains(&format!("@{db} "))))
        .count();
    Some(n as u64)
}

/// PostgreSQL's own log file, if this process can read it: the server's
/// current log file (with the logging collector on), else Debian's
/// `/var/log/postgresql/postgresql-VERSION-CLUSTER.log` named by
/// `cluster_name`. With it, whether its lines name the database (`%d` in
/// `log_line_prefix`).
pub async fn pg_log(pool: &PgPool) -> Option<(std::path::PathBuf, bool)> {
    let names_db = sqlx::query_scalar::<_, String>("SHOW log_line_prefix")
        .fetch_one(pool)
        .await
        .is_ok_and(|p| p.contains("%d"));
    let current: Option<String> = sqlx::query_scalar("SELECT pg_current_logfile()")
        .fetch_one(pool)
        .await
        .ok()
        .flatten();
    if let Some(file) = current {
        let mut path = std::path::PathBuf::from(&file);
        if path.is_relative() {
            let data: String = sqlx::query_scalar("SHOW data_directory")
                .fetch_one(pool)
                .await
                .ok()?;
            path = Path::new(&data).join(file);
        }
        if std::fs::File::open(&path).is_ok() {
            return Some((path, names_db));
        }
    }
    let cluster: String = sqlx::query_scalar("SHOW cluster_name")
        .fetch_one(pool)
        .await
        .ok()?;
    if cluster.is_empty() {
        return None;
    }
    let path = Path::new("/var/log/postgresql")
        .join(format!("postgresql-{}.log", cluster.replace('/', "-")));
    std::fs::File::open(&path)
        .is_ok()
        .then_some((path, names_db))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_share_a_counter_and_cover_every_worker() {
        let tally = Arc::new(Tally::default());
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let w = workers(addr, "p", 8, 2, &tally);
        assert_eq!(w.len(), 8);
        assert!(Arc::ptr_eq(&w[0].next, &w[2].next));
        assert!(!Arc::ptr_eq(&w[0].next, &w[1].next));
        // More copies than workers: one worker per copy.
        assert_eq!(workers(addr, "p", 1, 2, &tally).len(), 1);
    }

    #[test]
    fn counts_deadlock_lines_after_an_offset() {
        let path = std::env::temp_dir().join(format!("storm-log-{}", uuid::Uuid::new_v4()));
        std::fs::write(&path, "ERROR:  deadlock detected\n").unwrap();
        let from = log_len(&path);
        let more = "2026 [1] postgres@idemgate_bench ERROR:  deadlock detected\n\
                    2026 [2] postgres@other ERROR:  deadlock detected\nok\n";
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, more.as_bytes()))
            .unwrap();
        assert_eq!(deadlock_lines(&path, from, None), Some(2));
        assert_eq!(deadlock_lines(&path, from, Some("idemgate_bench")), Some(1));
        let _ = std::fs::remove_file(&path);
    }
}
