//! PostgreSQL's own counts of the work a measurement made it do, read
//! before and after, from sources that are current the moment a statement
//! ends (the cumulative statistics views are not: a backend that goes idle
//! reports what it counted up to ten seconds later):
//!
//! * statements and shared buffers dirtied: `pg_stat_statements`, where
//!   the server preloads it;
//! * WAL bytes: the WAL insert position (`pg_current_wal_insert_lsn()`);
//! * WAL records: `pg_waldump --stats` over the same span, where the WAL
//!   directory is readable here;
//! * transactions: transaction ids handed out (`pg_current_snapshot()`'s
//!   xmax), so the transactions that wrote; read-only ones take none.
//!
//! The WAL and the transaction ids are the whole server's: on a shared
//! server, other databases' writes count too.

use std::path::{Path, PathBuf};

use sqlx::PgPool;

/// Counts so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PgCounters {
    /// Top-level statements executed in the benchmark's database (utility
    /// statements such as `BEGIN` and `COMMIT` included), leaving out the
    /// harness's own reads of the statistics; none without
    /// `pg_stat_statements`.
    pub statements: Option<f64>,
    /// Shared buffers those statements dirtied.
    pub dirtied: Option<f64>,
    /// The WAL insert position, as PostgreSQL writes it (`0/184FEA48`).
    pub lsn: String,
    /// The same, in bytes.
    pub wal_bytes: f64,
    /// The next transaction id to be handed out.
    pub next_xid: f64,
}

/// What was counted between two readings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PgDelta {
    pub statements: Option<f64>,
    pub dirtied: Option<f64>,
    pub wal_bytes: f64,
    /// Filled in by [`wal_records`] where it can read the WAL.
    pub wal_records: Option<f64>,
    pub xacts: f64,
}

impl PgCounters {
    /// What was counted since `before`.
    pub fn since(&self, before: &PgCounters) -> PgDelta {
        let sub = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a - b);
        PgDelta {
            statements: sub(self.statements, before.statements),
            dirtied: sub(self.dirtied, before.dirtied),
            wal_bytes: self.wal_bytes - before.wal_bytes,
            wal_records: None,
            xacts: self.next_xid - before.next_xid,
        }
    }
}

/// The harness's own statements, left out of the count: its reads of the
/// statistics and of its backend's process id.
const STATEMENTS: &str =
    "SELECT coalesce(sum(calls), 0)::float8, coalesce(sum(shared_blks_dirtied), 0)::float8
       FROM pg_stat_statements
      WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND query NOT LIKE '%pg\\_stat%' AND query NOT LIKE '%pg\\_backend\\_pid%'
        AND query NOT LIKE '%pg\\_current\\_%'";

/// Makes `pg_stat_statements` readable in `pool`'s database where the
/// server preloads it; false (and nothing changed) where it does not.
pub async fn enable_statements(pool: &PgPool) -> bool {
    let preloaded: Option<String> = sqlx::query_scalar("SHOW shared_preload_libraries")
        .fetch_one(pool)
        .await
        .ok();
    if !preloaded.is_some_and(|l| l.contains("pg_stat_statements")) {
        return false;
    }
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(pool)
        .await
        .is_ok()
        && sqlx::query(STATEMENTS).fetch_one(pool).await.is_ok()
}

/// Reads the counters; `statements` says whether to read
/// `pg_stat_statements`. None if the server cannot say (`pg_current_snapshot`
/// needs PostgreSQL 13).
pub async fn read(pool: &PgPool, statements: bool) -> Option<PgCounters> {
    let mut conn = pool.acquire().await.ok()?;
    let (lsn, wal_bytes, next_xid): (String, f64, i64) = sqlx::query_as(
        "SELECT pg_current_wal_insert_lsn()::text,
                pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::float8,
                pg_snapshot_xmax(pg_current_snapshot())::text::int8",
    )
    .fetch_one(&mut *conn)
    .await
    .ok()?;
    let (calls, dirtied) = if statements {
        sqlx::query_as::<_, (f64, f64)>(STATEMENTS)
            .fetch_one(&mut *conn)
            .await
            .ok()
            .map_or((None, None), |(c, d)| (Some(c), Some(d)))
    } else {
        (None, None)
    };
    Some(PgCounters {
        statements: calls,
        dirtied,
        lsn,
        wal_bytes,
        next_xid: next_xid as f64,
    })
}

/// Where `pg_waldump` can read the server's WAL: its binary and the
/// server's `pg_wal` directory.
#[derive(Debug, Clone)]
pub struct WalDump {
    bin: PathBuf,
    dir: PathBuf,
}

impl WalDump {
    /// The server's WAL directory, if this process can read it, and a
    /// `pg_waldump` to read it with.
    pub async fn find(pool: &PgPool) -> Option<WalDump> {
        let data: String = sqlx::query_scalar("SHOW data_directory")
            .fetch_one(pool)
            .await
            .ok()?;
        let dir = Path::new(&data).join("pg_wal");
        std::fs::read_dir(&dir).ok()?;
        let bin = crate::floor::find_pg_program("pg_waldump").await?;
        Some(WalDump { bin, dir })
    }
}

/// The WAL records written between two insert positions, by `pg_waldump
/// --stats`; none if it cannot read them.
pub async fn wal_records(wal: &WalDump, from: &str, to: &str) -> Option<f64> {
    if from == to {
        return Some(0.0);
    }
    let out = tokio::process::Command::new(&wal.bin)
        .arg("--path")
        .arg(&wal.dir)
        .args(["--start", from, "--end", to, "--stats"])
        .output()
        .await
        .ok()?;
    parse_waldump_total(&String::from_utf8_lossy(&out.stdout))
}

/// The record count of `pg_waldump --stats`'s `Total` line.
fn parse_waldump_total(stats: &str) -> Option<f64> {
    stats
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("Total"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_keep_what_each_reading_had() {
        let before = PgCounters {
            statements: Some(100.0),
            dirtied: Some(10.0),
            lsn: "0/1000".into(),
            wal_bytes: 64_000.0,
            next_xid: 50.0,
        };
        let after = PgCounters {
            statements: Some(4100.0),
            dirtied: Some(1010.0),
            lsn: "0/F5E00".into(),
            wal_bytes: 1_064_000.0,
            next_xid: 2050.0,
        };
        let d = after.since(&before);
        assert_eq!(d.statements, Some(4000.0));
        assert_eq!(d.dirtied, Some(1000.0));
        assert_eq!(d.wal_bytes, 1_000_000.0);
        assert_eq!(d.xacts, 2000.0);
        let without = PgCounters {
            statements: None,
            dirtied: None,
            ..after
        };
        assert_eq!(without.since(&before).statements, None);
    }

    #[test]
    fn reads_the_record_count_of_waldump_stats() {
        let stats = "\
Type                                           N      (%)          Record size      (%)             FPI size      (%)        Combined size      (%)
----                                           -      ---          -----------      ---             --------      ---        -------------      ---
XLOG                                           2 (  3.39)                  228 (  4.32)                    0 (  0.00)                  228 (  0.25)
Transaction                                    1 (  1.69)                   34 (  0.64)                    0 (  0.00)                   34 (  0.04)
Heap                                          56 ( 94.92)                 5021 ( 95.04)                87364 (100.00)                92385 ( 99.72)
                                        --------                      --------                      --------                      --------
Total                                         59                          5283 [5.70%]                 87364 [94.30%]                92647 [100%]
";
        assert_eq!(parse_waldump_total(stats), Some(59.0));
        assert_eq!(
            parse_waldump_total("pg_waldump: error: could not find file\n"),
            None
        );
    }
}
