//! Failover (docs/operations.md, “A primary and its standbys: failover”): a
//! primary and a streaming hot standby, each a throwaway cluster on its own
//! loopback port (initdb, then `pg_basebackup -R -X stream` of it), and
//! `DATABASE_URL` naming both with `target_session_attrs=read-write`. Two
//! proxies over a counting origin, each key sent through both at once, and
//! `serve`'s reservation door, all under load; then `kill -9` of the primary's
//! postmaster and, 2 s later, `pg_ctl promote` of the standby. Measured: every
//! door answers 503 `store-unavailable` with Retry-After during the gap (never
//! a 500), and each is back within 5 s of the promotion, without a restart.
//! Then every key is sent again: with a synchronous standby every acknowledged
//! key replays and none ran twice at the origin; with an asynchronous one the
//! start-up log warns, and the test prints how many acknowledged keys the
//! promotion lost (it does not assert it: that is what asynchronous replication
//! allows).
//!
//! Rerun: `cargo test --test it failover:: -- --nocapture --test-threads 1`
//! (figures on stderr; RELIABILITY.md, "Failover").

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sqlx::Connection as _;

use crate::common::app::fresh_key;
use crate::common::bin::{Served, drain_stderr, idemgate_at};
use crate::common::http;
use crate::common::pg::TempCluster;
use crate::common::proxy::ProxyProcess;
use crate::common::upstream::Upstream;

/// How long the primary is gone before the standby is promoted.
const GAP: Duration = Duration::from_secs(2);
/// How soon after the promotion every door must answer again.
const RECOVERY: Duration = Duration::from_secs(5);
/// Clients sending keys through the proxies.
const WORKERS: usize = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn promoted_synchronous_standby_keeps_every_acknowledged_key() {
    let figures = run(true).await;
    assert_eq!(
        figures.lost, 0,
        "a synchronous standby had every acknowledged key, yet {} of {} were lost",
        figures.lost, figures.acknowledged
    );
    assert_eq!(
        figures.twice, 0,
        "a key ran twice at the origin after a failover to a synchronous standby"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn promoted_asynchronous_standby_is_warned_of_and_its_losses_counted() {
    let figures = run(false).await;
    // Reported, not asserted: asynchronous replication may lose what it
    // had not yet sent.
    eprintln!(
        "[failover async] acknowledged keys lost by the promotion: {} of {} ({} ran twice)",
        figures.lost, figures.acknowledged, figures.twice
    );
}

/// `serve` whose `DATABASE_URL` reaches a hot standby alone (what a failover
/// leaves behind for a while): it starts, `/readyz` is 503 and a reserve is
/// `503 store-unavailable` with Retry-After, never a 500; and a
/// `target_session_attrs` that asks for a standby refuses the start, naming
/// the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_standby_alone_is_store_unavailable_never_a_500() {
    let primary = TempCluster::start().await.expect("the primary");
    let standby = TempCluster::standby_of(&primary, "")
        .await
        .expect("the standby");
    streaming(&primary, false).await;
    let migrated = idemgate_at(&primary.url()).arg("migrate").output().unwrap();
    assert!(migrated.status.success(), "{migrated:?}");
    // The migrations reach the standby: it has replayed the primary's WAL.
    let mut conn = sqlx::PgConnection::connect(&primary.url()).await.unwrap();
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
    let mut conn = sqlx::PgConnection::connect(&standby.url()).await.unwrap();
    let started = Instant::now();
    while !sqlx::query_scalar::<_, bool>("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn")
        .bind(&lsn)
        .fetch_one(&mut conn)
        .await
        .unwrap()
    {
        assert!(started.elapsed() < Duration::from_secs(20), "no replay");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = conn.close().await;

    let port = crate::common::free_port();
    let mut child = idemgate_at(&standby.url())
        .args([
            "serve",
            "--no-migrate",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let log = drain_stderr(&mut child);
    let base = format!("http://127.0.0.1:{port}");
    let client = http();
    let started = Instant::now();
    while client.get(format!("{base}/healthz")).send().await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "serve did not come up: {}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503, "/readyz over a standby");
    let res = client
        .post(format!("{base}/v1/reservations"))
        .header("idempotency-key", fresh_key())
        .json(&reserve_body())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 503, "a reserve over a standby");
    assert!(res.headers().contains_key("retry-after"));
    let body: Value = res.json().await.unwrap();
    assert!(
        body["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("/store-unavailable")),
        "{body}"
    );
    let _ = child.kill();
    let _ = child.wait();
    let said = log.lock().unwrap().clone();
    assert!(said.contains("does not take writes"), "{said}");

    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=standby",
        primary.port(),
        standby.port()
    );
    let refused = idemgate_at(&url).arg("migrate").output().unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        stderr.contains("target_session_attrs=standby") && stderr.contains("DATABASE_URL"),
        "{stderr}"
    );
}

/// What one run measured.
struct Figures {
    acknowledged: usize,
    lost: usize,
    twice: usize,
}

/// One answer of a door.
#[derive(Debug, Clone)]
struct Answer {
    door: &'static str,
    sent: Instant,
    done: Instant,
    status: u16,
    retry_after: bool,
    slug: String,
}

type Answers = Arc<Mutex<Vec<Answer>>>;

async fn run(synchronous: bool) -> Figures {
    let label = if synchronous { "sync" } else { "async" };
    let primary_conf = if synchronous {
        "synchronous_commit = on\nsynchronous_standby_names = '*'\n"
    } else {
        "synchronous_commit = on\n"
    };
    let primary = TempCluster::start_with(primary_conf)
        .await
        .expect("the primary");
    // Promoted, it has no standby of its own: it must not wait for one.
    let standby = TempCluster::standby_of(&primary, "synchronous_standby_names = ''\n")
        .await
        .expect("the standby");
    streaming(&primary, synchronous).await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port(),
        standby.port()
    );

    // The standby first in the list: the store must pass over it.
    let reversed = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        standby.port(),
        primary.port()
    );
    let migrated = idemgate_at(&reversed).arg("migrate").output().unwrap();
    assert!(
        migrated.status.success(),
        "idemgate migrate over both hosts: {}",
        String::from_utf8_lossy(&migrated.stderr)
    );

    let upstream = Upstream::start().await;
    let mut served = Served::spawn(idemgate_at(&url), &["--no-migrate"]).await;
    let serve_log = drain_stderr(&mut served.child);
    let mut a = ProxyProcess::start_at(&url, &upstream.url(), &["--no-migrate"]).await;
    let mut b = ProxyProcess::start_at(&reversed, &upstream.url(), &["--no-migrate"]).await;
    let _a_log = drain_stderr(&mut a.child);
    let _b_log = drain_stderr(&mut b.child);

    // The durability line.
    let policy: Value = http()
        .get(format!("{}/v1/policy", served.base()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let expected = if synchronous {
        "synchronous-standby"
    } else {
        "local"
    };
    assert_eq!(policy["durability"], expected, "{policy}");
    let warned = serve_log
        .lock()
        .unwrap()
        .contains("none of them synchronous");
    assert_eq!(
        warned,
        !synchronous,
        "the start-up warning of an asynchronous standby:\n{}",
        serve_log.lock().unwrap()
    );

    // Load.
    let answers: Answers = Arc::default();
    // Each proxied key, its body and whether it was acknowledged.
    let proxied: Arc<Mutex<Vec<(String, String, bool)>>> = Arc::default();
    let served_keys: Arc<Mutex<Vec<(String, bool)>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (answers, proxied, stop) = (answers.clone(), proxied.clone(), stop.clone());
        let bases = [(a.base(), "proxy a"), (b.base(), "proxy b")];
        tasks.push(tokio::spawn(async move {
            let client = http();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let key = fresh_key();
                let body = format!("{{\"worker\": {w}, \"n\": {n}}}");
                let sends = bases
                    .iter()
                    .map(|(base, door)| proxy_post(&client, base, door, &key, &body, &answers));
                let statuses = futures::future::join_all(sends).await;
                let acked = statuses.iter().any(|s| (200..300).contains(s));
                proxied.lock().unwrap().push((key, body, acked));
                if !acked {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }));
    }
    {
        let (answers, served_keys, stop, base) = (
            answers.clone(),
            served_keys.clone(),
            stop.clone(),
            served.base(),
        );
        tasks.push(tokio::spawn(async move {
            let client = http();
            while !stop.load(Ordering::Relaxed) {
                let key = fresh_key();
                let acked = reserve_commit(&client, &base, &key, &answers).await;
                served_keys.lock().unwrap().push((key, acked));
                let sent = Instant::now();
                if let Ok(res) = client.get(format!("{base}/readyz")).send().await {
                    let status = res.status().as_u16();
                    answers.lock().unwrap().push(Answer {
                        door: "serve /readyz",
                        sent,
                        done: Instant::now(),
                        status,
                        retry_after: res.headers().contains_key("retry-after"),
                        slug: String::new(),
                    });
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }

    tokio::time::sleep(Duration::from_millis(1500)).await;
    primary.kill9().expect("kill -9 of the primary");
    let killed = Instant::now();
    tokio::time::sleep(GAP).await;
    standby.promote().await.expect("pg_ctl promote");
    let promoted = Instant::now();
    let doors = ["proxy a", "proxy b", "serve reserve", "serve /readyz"];
    let back = |answers: &[Answer], door: &str| {
        answers
            .iter()
            .filter(|x| x.door == door && x.sent >= promoted && (200..300).contains(&x.status))
            .map(|x| x.done - promoted)
            .min()
    };
    let limit = promoted + Duration::from_secs(15);
    while Instant::now() < limit {
        let all_back = {
            let seen = answers.lock().unwrap();
            doors.iter().all(|d| back(&seen, d).is_some())
        };
        if all_back {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }

    // The gap and the recovery.
    let seen = answers.lock().unwrap().clone();
    let internal: Vec<&Answer> = seen.iter().filter(|x| x.status == 500).collect();
    assert!(internal.is_empty(), "500s: {internal:?}");
    // A backend of the killed primary that was kept busy (a connection used
    // statement after statement never waits for its client, which is where
    // a backend notices its postmaster's death) may commit a little longer:
    // with an asynchronous standby on a disk the promotion leaves behind
    // (those keys are lost, and counted below); with a synchronous one only
    // once the standby has it (its walsender, busy too, may still stream).
    // Those answers are counted, not refused; every other answer in the gap
    // must be a 503 store-unavailable with Retry-After.
    let in_gap: Vec<&Answer> = seen
        .iter()
        .filter(|x| x.sent >= killed + Duration::from_millis(300) && x.done < promoted)
        .collect();
    let orphaned = seen
        .iter()
        .filter(|x| x.sent >= killed && x.done < promoted && (200..300).contains(&x.status))
        .count();
    let in_gap: Vec<&Answer> = in_gap
        .into_iter()
        .filter(|x| !(200..300).contains(&x.status))
        .collect();
    assert!(
        in_gap.len() >= 10,
        "only {} requests were refused during the gap",
        in_gap.len()
    );
    for x in &in_gap {
        assert_eq!(x.status, 503, "during the gap: {x:?}");
        if x.door != "serve /readyz" {
            assert!(x.retry_after, "a 503 without Retry-After: {x:?}");
            assert_eq!(x.slug, "store-unavailable", "{x:?}");
        }
    }
    let mut recovery = Vec::new();
    for door in doors {
        let after = back(&seen, door)
            .unwrap_or_else(|| panic!("{door} did not answer 2xx within 15 s of the promotion"));
        recovery.push(format!("{door} {} ms", after.as_millis()));
        assert!(
            after <= RECOVERY,
            "{door} answered again {} ms after the promotion (limit {} s)",
            after.as_millis(),
            RECOVERY.as_secs()
        );
    }
    let gap_503 = in_gap.len();
    let first_fail = seen
        .iter()
        .filter(|x| x.done >= killed && !(200..300).contains(&x.status))
        .map(|x| x.done - killed)
        .min()
        .unwrap_or_default();

    // Every key again, through proxy b: an acknowledged one replays, and the
    // origin has run each at most once.
    let keys = proxied.lock().unwrap().clone();
    let client = http();
    let mut lost = 0;
    let retried = futures::future::join_all(keys.iter().map(|(key, body, acked)| {
        let (client, base) = (client.clone(), b.base());
        async move {
            let res = client
                .post(format!("{base}/ok/failover"))
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await;
            let replayed = res.as_ref().is_ok_and(|r| {
                r.headers()
                    .get("idempotent-replayed")
                    .is_some_and(|v| v == "true")
            });
            let status = res.map(|r| r.status().as_u16()).unwrap_or(0);
            (key, *acked, status, replayed)
        }
    }))
    .await;
    let mut answers_after: HashMap<u16, usize> = HashMap::new();
    for (key, acked, status, replayed) in &retried {
        *answers_after.entry(*status).or_default() += 1;
        if *acked && (upstream.started(key) > 1 || !replayed) {
            lost += 1;
        }
    }
    let twice = keys
        .iter()
        .filter(|(key, ..)| upstream.started(key) > 1)
        .count();
    let acknowledged = keys.iter().filter(|(.., acked)| *acked).count();

    // serve's keys: a committed one is a replay (200), never new (201).
    let reserved = served_keys.lock().unwrap().clone();
    let mut served_lost = 0;
    for (key, _) in reserved.iter().filter(|(_, acked)| *acked) {
        let (status, _) = post(
            &client,
            &served.base(),
            "/v1/reservations",
            Some(key),
            reserve_body(),
        )
        .await;
        if status != 200 {
            served_lost += 1;
        }
    }
    let served_acked = reserved.iter().filter(|(_, acked)| *acked).count();

    eprintln!(
        "[failover {label}] {} proxied keys ({acknowledged} acknowledged), {} serve keys \
         ({served_acked} committed); first failure {} ms after the kill; {orphaned} answers \
         acknowledged by the killed primary's backends after the kill; {gap_503} other \
         answers in the {} s gap, all 503; back after the promotion: {}; retries of every proxied key: \
         {answers_after:?}; acknowledged keys lost: {lost} through the proxies, {served_lost} \
         on serve; keys run twice: {twice}",
        keys.len(),
        reserved.len(),
        first_fail.as_millis(),
        GAP.as_secs(),
        recovery.join(", "),
    );
    if synchronous {
        assert_eq!(served_lost, 0, "serve lost committed keys");
    }
    drop((a, b, served));
    Figures {
        acknowledged: acknowledged + served_acked,
        lost: lost + served_lost,
        twice,
    }
}

/// Waits until the primary streams to the standby (synchronously, if asked).
async fn streaming(primary: &TempCluster, synchronous: bool) {
    let mut conn = sqlx::PgConnection::connect(&primary.url())
        .await
        .expect("the primary");
    let started = Instant::now();
    loop {
        let states: Vec<String> = sqlx::query_scalar(
            "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        if states
            .iter()
            .any(|s| !synchronous || s == "sync" || s == "quorum")
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the standby did not stream within 30 s: {states:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = conn.close().await;
}

/// A POST with `key` through a proxy to the origin; its status (0: no answer).
async fn proxy_post(
    client: &reqwest::Client,
    base: &str,
    door: &'static str,
    key: &str,
    body: &str,
    answers: &Answers,
) -> u16 {
    let sent = Instant::now();
    let res = client
        .post(format!("{base}/ok/failover"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .timeout(Duration::from_secs(10))
        .body(body.to_owned())
        .send()
        .await;
    record(door, sent, res, answers).await.0
}

/// A reserve and, when it is granted, a commit on serve: whether the commit
/// was acknowledged.
async fn reserve_commit(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    answers: &Answers,
) -> bool {
    let sent = Instant::now();
    let res = client
        .post(format!("{base}/v1/reservations"))
        .header("idempotency-key", key)
        .json(&reserve_body())
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    let (status, body) = record("serve reserve", sent, res, answers).await;
    if status != 201 {
        return false;
    }
    let Some(id) = body["reservation_id"].as_str() else {
        return false;
    };
    let (status, _) = post(
        client,
        base,
        &format!("/v1/reservations/{id}/commit"),
        None,
        json!({"status": 201, "headers": [], "body": "done"}),
    )
    .await;
    status == 200
}

fn reserve_body() -> Value {
    json!({"fingerprint": "fp-failover", "lease_seconds": 30})
}

async fn post(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    key: Option<&str>,
    body: Value,
) -> (u16, Value) {
    let mut req = client
        .post(format!("{base}{path}"))
        .json(&body)
        .timeout(Duration::from_secs(10));
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    match req.send().await {
        Ok(res) => {
            let status = res.status().as_u16();
            (status, res.json().await.unwrap_or(Value::Null))
        }
        Err(_) => (0, Value::Null),
    }
}

/// Records an answer; its status (0: none) and JSON body.
async fn record(
    door: &'static str,
    sent: Instant,
    res: reqwest::Result<reqwest::Response>,
    answers: &Answers,
) -> (u16, Value) {
    let (status, retry_after, body) = match res {
        Ok(res) => {
            let status = res.status().as_u16();
            let retry_after = res.headers().contains_key("retry-after");
            (
                status,
                retry_after,
                res.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
        Err(_) => (0, false, Value::Null),
    };
    let slug = body["type"]
        .as_str()
        .and_then(|t| t.rsplit('/').next())
        .unwrap_or_default()
        .to_owned();
    answers.lock().unwrap().push(Answer {
        door,
        sent,
        done: Instant::now(),
        status,
        retry_after,
        slug,
    });
    (status, body)
}
