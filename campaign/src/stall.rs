//! How long N's `idemgate migrate` holds writes back (SPEC §14: a migration
//! never holds writes for longer than a second, whatever the table's size;
//! docs/operations.md, “Upgrading”).
//!
//! The previous release (N−1) makes its schema on an empty PostgreSQL
//! database, which is then filled with `--keys` records in the shape of
//! idemgate's (`INSERT … SELECT generate_series`, one in a thousand in
//! flight); N−1 serves it through the reservation API while `--concurrency`
//! clients each claim a new key and commit it, one after the other, and
//! every call's latency is recorded: first for `--baseline` seconds without
//! a migration, then while N's `migrate` runs, then one second more. The
//! run fails if `migrate` fails, if a call made while it ran failed (no
//! answer, or one that is not 201/200), if one took longer than
//! `--max-stall`, or if an index is left invalid.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tokio::process::Command;

/// What to run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// N−1's binary: it makes the schema and serves during the run.
    pub previous: PathBuf,
    /// N's binary: its `migrate` is measured.
    pub current: PathBuf,
    /// An empty PostgreSQL database.
    pub database_url: String,
    /// Records made before the run.
    pub keys: u64,
    /// Clients, each one claim and commit at a time.
    pub concurrency: usize,
    /// Seconds of writes without a migration, before it.
    pub baseline_secs: u64,
    /// The longest a write may take while `migrate` runs.
    pub max_stall: Duration,
    /// Where the logs, the latencies and the report go.
    pub out: PathBuf,
}

/// One call: when it started and ended (since the run's start), whether it
/// was answered as it should be.
#[derive(Debug, Clone, Copy)]
struct Call {
    start: Duration,
    end: Duration,
    ok: bool,
}

/// The latencies of a set of calls.
#[derive(Debug, Default)]
struct Figures {
    calls: usize,
    failed: usize,
    worst: Duration,
    p99: Duration,
    p50: Duration,
}

impl Figures {
    fn of(calls: &[&Call]) -> Figures {
        let mut took: Vec<Duration> = calls.iter().map(|c| c.end - c.start).collect();
        took.sort();
        let at = |q: f64| {
            took.get(((took.len() as f64 * q).ceil() as usize).saturating_sub(1))
                .copied()
                .unwrap_or_default()
        };
        Figures {
            calls: calls.len(),
            failed: calls.iter().filter(|c| !c.ok).count(),
            worst: took.last().copied().unwrap_or_default(),
            p99: at(0.99),
            p50: at(0.50),
        }
    }

    fn line(&self) -> String {
        format!(
            "{} writes, worst {} ms, p99 {} ms, p50 {} ms, {} failed",
            self.calls,
            self.worst.as_millis(),
            self.p99.as_millis(),
            self.p50.as_millis(),
            self.failed
        )
    }
}

/// Runs the measurement; `Ok(true)` if it passed.
pub async fn run(plan: &Plan) -> anyhow::Result<bool> {
    std::fs::create_dir_all(&plan.out)?;
    let started = Instant::now();
    let say = |what: String| println!("stall [{:>5.1}s]: {what}", started.elapsed().as_secs_f64());

    say(format!(
        "N-1's schema ({} migrate)",
        plan.previous.display()
    ));
    migrate(plan, &plan.previous, "previous").await?;
    say(format!("{} records", plan.keys));
    psql(plan, &fill(plan.keys)).await?;
    psql(plan, "VACUUM ANALYZE idempotency_keys").await?;
    let size = psql(
        plan,
        "SELECT pg_size_pretty(pg_total_relation_size('idempotency_keys'))",
    )
    .await?;
    say(format!("table and indexes: {}", size.trim()));

    let port = crate::cluster::free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    let log = std::fs::File::create(plan.out.join("previous-serve.log"))?;
    let mut serve = Command::new(&plan.previous)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &plan.database_url)
        .env("RUST_LOG", "info")
        .env_remove("IDEMGATE_TOKENS")
        .env_remove("IDEMGATE_LISTEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("starting N-1's serve")?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(plan.concurrency)
        .build()?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(res) = http.get(format!("{base}/readyz")).send().await
            && res.status() == 200
        {
            break;
        }
        if let Ok(Some(status)) = serve.try_wait() {
            bail!("N-1's serve exited at start ({status}): see previous-serve.log");
        }
        if Instant::now() > deadline {
            bail!("N-1's serve was not ready within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let calls: Arc<Mutex<Vec<Call>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let counter = Arc::new(AtomicUsize::new(0));
    let zero = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..plan.concurrency {
        let (http, base, calls, stop, counter) = (
            http.clone(),
            base.clone(),
            calls.clone(),
            stop.clone(),
            counter.clone(),
        );
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let i = counter.fetch_add(1, Ordering::Relaxed);
                write(&http, &base, i, zero, &calls).await;
            }
        }));
    }
    say(format!(
        "N-1 serving new keys, {} clients; {} s without a migration",
        plan.concurrency, plan.baseline_secs
    ));
    tokio::time::sleep(Duration::from_secs(plan.baseline_secs)).await;
    say(format!("N's migrate ({})", plan.current.display()));
    let from = zero.elapsed();
    let migrated = migrate(plan, &plan.current, "current").await;
    let until = zero.elapsed();
    say(format!(
        "migrate took {} ms; one second more of writes",
        (until - from).as_millis()
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    let _ = serve.start_kill();
    let _ = serve.wait().await;

    let calls = calls.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let before: Vec<&Call> = calls.iter().filter(|c| c.end <= from).collect();
    let during: Vec<&Call> = calls
        .iter()
        .filter(|c| c.start < until && c.end > from)
        .collect();
    let baseline = Figures::of(&before);
    let measured = Figures::of(&during);
    let invalid = psql(
        plan,
        "SELECT string_agg(indexrelid::regclass::text, ', ') FROM pg_index \
         WHERE NOT indisvalid AND indrelid = 'idempotency_keys'::regclass",
    )
    .await?;
    let mut csv = String::from("start_ms,latency_ms,ok,during_migrate\n");
    for c in &calls {
        csv.push_str(&format!(
            "{:.1},{:.1},{},{}\n",
            c.start.as_secs_f64() * 1e3,
            (c.end - c.start).as_secs_f64() * 1e3,
            c.ok,
            c.start < until && c.end > from
        ));
    }
    std::fs::write(plan.out.join("latencies.csv"), csv)?;

    let mut failures = Vec::new();
    if let Err(e) = &migrated {
        failures.push(format!("{e:#}"));
    }
    if measured.worst > plan.max_stall {
        failures.push(format!(
            "a write took {} ms while migrate ran (at most {} ms)",
            measured.worst.as_millis(),
            plan.max_stall.as_millis()
        ));
    }
    if measured.failed > 0 || baseline.failed > 0 {
        failures.push(format!(
            "{} writes failed ({} while migrate ran)",
            measured.failed + baseline.failed,
            measured.failed
        ));
    }
    if !invalid.trim().is_empty() {
        failures.push(format!("invalid indexes left: {}", invalid.trim()));
    }
    let report = format!(
        "keys: {} ({}), clients: {}\nmigrate: {} ms\nbaseline (no migrate): {}\nwhile migrate ran: {}\n{}\n",
        plan.keys,
        size.trim(),
        plan.concurrency,
        (until - from).as_millis(),
        baseline.line(),
        measured.line(),
        if failures.is_empty() {
            "stall: passed".to_owned()
        } else {
            format!("stall: FAILED: {}", failures.join("; "))
        }
    );
    std::fs::write(plan.out.join("report.txt"), &report)?;
    print!("{report}");
    Ok(failures.is_empty())
}

/// One key claimed and committed, each call recorded.
async fn write(
    http: &reqwest::Client,
    base: &str,
    i: usize,
    zero: Instant,
    calls: &Mutex<Vec<Call>>,
) {
    let key = format!("stall-{}-{i}", std::process::id());
    let record = |start: Duration, ok: bool| {
        calls.lock().unwrap_or_else(|e| e.into_inner()).push(Call {
            start,
            end: zero.elapsed(),
            ok,
        });
    };
    let start = zero.elapsed();
    let reserved = http
        .post(format!("{base}/v1/reservations"))
        .header("content-type", "application/json")
        .header("idempotency-key", &key)
        .timeout(Duration::from_secs(20))
        .body(
            serde_json::json!({
                "request": {"method": "POST", "path": format!("/charge/{i}"),
                            "body": format!(r#"{{"order":{i}}}"#)},
                "lease_seconds": 30,
            })
            .to_string(),
        )
        .send()
        .await;
    let reservation = match reserved {
        Ok(res) if res.status() == 201 => {
            let text = res.text().await.unwrap_or_default();
            let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            json["reservation_id"].as_str().map(str::to_owned)
        }
        _ => None,
    };
    record(start, reservation.is_some());
    let Some(reservation) = reservation else {
        tokio::time::sleep(Duration::from_millis(50)).await;
        return;
    };
    let start = zero.elapsed();
    let committed = http
        .post(format!("{base}/v1/reservations/{reservation}/commit"))
        .header("content-type", "application/json")
        .timeout(Duration::from_secs(20))
        .body(
            serde_json::json!({
                "status": 200,
                "headers": [["content-type", "application/json"]],
                "body": format!(r#"{{"order":{i},"charged":true}}"#),
            })
            .to_string(),
        )
        .send()
        .await;
    record(start, committed.is_ok_and(|r| r.status() == 200));
}

/// `bin migrate` on the database; its log kept in `migrate-LABEL.log`.
async fn migrate(plan: &Plan, bin: &PathBuf, label: &str) -> anyhow::Result<()> {
    let out = Command::new(bin)
        .arg("migrate")
        .env("DATABASE_URL", &plan.database_url)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {} migrate", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    std::fs::write(plan.out.join(format!("migrate-{label}.log")), &text)?;
    if !out.status.success() {
        bail!("{} migrate failed: {}", bin.display(), text.trim());
    }
    Ok(())
}

/// `sql` run by psql on the database; what it printed.
async fn psql(plan: &Plan, sql: &str) -> anyhow::Result<String> {
    let out = Command::new("psql")
        .args([
            "-qXAt",
            "-v",
            "ON_ERROR_STOP=1",
            &plan.database_url,
            "-c",
            sql,
        ])
        .stdin(Stdio::null())
        .output()
        .await
        .context("running psql")?;
    if !out.status.success() {
        bail!("psql: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `keys` records in the shape of idemgate's: in the tenant the API serves
/// without tokens, named by a SHA-256, completed with a small response and
/// the request they were for; one in a thousand in flight.
fn fill(keys: u64) -> String {
    format!(
        r#"INSERT INTO idempotency_keys
    (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt,
     response_status, response_headers, response_body, created_at, completed_at, expires_at,
     on_lease_expiry, request)
SELECT 'default', sha256(convert_to('stall-fill-' || i, 'UTF8')), md5(i::text),
       CASE WHEN i % 1000 = 0 THEN 'in_flight' ELSE 'completed' END,
       gen_random_uuid(),
       CASE WHEN i % 1000 = 0 THEN now() + interval '1 hour' END,
       1,
       CASE WHEN i % 1000 = 0 THEN NULL ELSE 200 END,
       CASE WHEN i % 1000 = 0 THEN NULL
            ELSE '[["content-type","application/json"]]'::jsonb END,
       CASE WHEN i % 1000 = 0 THEN NULL
            ELSE convert_to('{{"order":' || i || ',"charged":true,"receipt":"' || md5(i::text)
                            || md5((i + 1)::text) || md5((i + 2)::text) || '"}}', 'UTF8') END,
       now() - interval '1 hour',
       CASE WHEN i % 1000 = 0 THEN NULL ELSE now() - interval '59 minutes' END,
       now() + interval '1 day',
       'takeover',
       convert_to('{{"method":"POST","path":"/charge/' || i || '"}}', 'UTF8')
  FROM generate_series(1, {keys}) AS i"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_the_worst_and_the_quantiles_of_the_calls() {
        let calls: Vec<Call> = (1..=200)
            .map(|ms| Call {
                start: Duration::ZERO,
                end: Duration::from_millis(ms),
                ok: ms != 7,
            })
            .collect();
        let refs: Vec<&Call> = calls.iter().collect();
        let f = Figures::of(&refs);
        assert_eq!(f.calls, 200);
        assert_eq!(f.failed, 1);
        assert_eq!(f.worst, Duration::from_millis(200));
        assert_eq!(f.p99, Duration::from_millis(198));
        assert_eq!(f.p50, Duration::from_millis(100));
    }
}
