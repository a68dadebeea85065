//! Graceful shutdown under load (issue 6, scenario 6), with the real binary
//! on one PostgreSQL database: SIGTERM a `serve` and a `proxy` while many
//! requests are running. Every in-flight request completes and its response
//! is committed (another process replays the same body), new connections
//! are refused after the signal, no key is left in flight, and the process
//! exits 0 within its grace period.
//!
//! Rerun: `cargo test --test it shutdown:: -- --nocapture`.

use crate::common::{self, http, until};

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::app::fresh_key;
use common::bin::{Served, count_state, drain_stderr, signal, wait_exit};
use common::pg::TestDb;
use common::proxy::ProxyProcess;
use common::upstream::Upstream;

const GRACE: u64 = 15;

/// A new connection to `base` is refused.
async fn assert_refused(base: &str) {
    // A fresh client: no pooled connection to reuse.
    let err = http()
        .get(format!("{base}/healthz"))
        .send()
        .await
        .expect_err("a new connection after SIGTERM must be refused");
    assert!(err.is_connect(), "not a refused connection: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_proxy_under_load_finishes_and_commits_every_request() {
    const N: usize = 100;
    let db = TestDb::new().await;
    let upstream = Upstream::start_numbered().await;
    let grace = GRACE.to_string();
    let mut victim =
        ProxyProcess::start_with(&db, &upstream.url(), &["--shutdown-grace", &grace]).await;
    let log = drain_stderr(&mut victim.child);
    let mut other = ProxyProcess::start_with(&db, &upstream.url(), &[]).await;
    drain_stderr(&mut other.child);
    let keys: Vec<String> = (0..N).map(|_| fresh_key()).collect();

    let mut clients = Vec::new();
    for key in &keys {
        let (url, key) = (format!("{}/numbered/2000", victim.base()), key.clone());
        clients.push(tokio::spawn(async move {
            let res = http()
                .post(url)
                .header("idempotency-key", key)
                .body("{}")
                .send()
                .await
                .expect("an in-flight request is answered");
            let status = res.status().as_u16();
            (status, res.json::<Value>().await.unwrap_or(Value::Null))
        }));
    }
    assert!(
        until(Duration::from_secs(10), || {
            keys.iter().all(|k| upstream.started(k) == 1)
        })
        .await,
        "the upstream did not start every request within 10 s"
    );
    let signalled = Instant::now();
    signal(victim.child.id(), "TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_refused(&victim.base()).await;

    let mut answers = Vec::new();
    for c in clients {
        answers.push(c.await.unwrap());
    }
    let status = wait_exit(&mut victim.child, Duration::from_secs(GRACE + 5))
        .await
        .expect("the proxy exits within its grace period");
    let exited_after = signalled.elapsed();
    assert!(
        status.success(),
        "exit status {status}:\n{}",
        log.lock().unwrap()
    );
    assert!(exited_after < Duration::from_secs(GRACE));

    for (key, (status, body)) in keys.iter().zip(&answers) {
        assert_eq!(*status, 201, "{body}");
        assert_eq!(body["execution"], 1);
        // Committed: another process replays the same body.
        let res = http()
            .post(format!("{}/numbered/2000", other.base()))
            .header("idempotency-key", key.as_str())
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        assert_eq!(res.headers()["idempotent-replayed"], "true");
        assert_eq!(&res.json::<Value>().await.unwrap(), body);
        assert_eq!(upstream.started(key), 1);
    }
    assert_eq!(count_state(&db, "in_flight").await, 0);
    assert_eq!(count_state(&db, "completed").await, N as i64);
    eprintln!(
        "[shutdown] proxy: SIGTERM with {N} requests at a 2 s origin: {N} answered 201, {N} \
         committed, {} executions, exit 0 after {exited_after:?} (grace {GRACE} s)",
        upstream.total()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_serve_under_load_finishes_every_request() {
    const N: usize = 100;
    let db = TestDb::new().await;
    let grace = GRACE.to_string();
    let mut victim = Served::start(&db, &["--shutdown-grace", &grace]).await;
    let log = drain_stderr(&mut victim.child);
    let mut other = Served::start(&db, &[]).await;
    drain_stderr(&mut other.child);
    let keys: Vec<String> = (0..N).map(|_| fresh_key()).collect();
    let reserve = json!({"fingerprint": "fp-shutdown", "lease_seconds": 60});

    // Holders on the other process.
    let mut ids = Vec::new();
    for key in &keys {
        let res = http()
            .post(format!("{}/v1/reservations", other.base()))
            .header("idempotency-key", key.as_str())
            .json(&reserve)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        let body: Value = res.json().await.unwrap();
        ids.push(body["reservation_id"].as_str().unwrap().to_owned());
    }
    // Waiters on the victim (Prefer: wait), running when the signal comes.
    let mut waiters = Vec::new();
    for key in &keys {
        let (url, key, body) = (
            format!("{}/v1/reservations", victim.base()),
            key.clone(),
            reserve.clone(),
        );
        waiters.push(tokio::spawn(async move {
            let res = http()
                .post(url)
                .header("idempotency-key", key)
                .header("prefer", "wait=10")
                .json(&body)
                .send()
                .await
                .expect("an in-flight request is answered");
            let status = res.status().as_u16();
            (status, res.json::<Value>().await.unwrap_or(Value::Null))
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let signalled = Instant::now();
    signal(victim.child.id(), "TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_refused(&victim.base()).await;

    // The holders commit (through the other process) while the victim drains.
    for (i, id) in ids.iter().enumerate() {
        let res = http()
            .post(format!("{}/v1/reservations/{id}/commit", other.base()))
            .json(&json!({"status": 201, "headers": [], "body": format!("done-{i}")}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
    }
    for (i, w) in waiters.into_iter().enumerate() {
        let (status, body) = w.await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["response"]["body"], format!("done-{i}"));
    }
    let status = wait_exit(&mut victim.child, Duration::from_secs(GRACE + 5))
        .await
        .expect("serve exits within its grace period");
    let exited_after = signalled.elapsed();
    assert!(
        status.success(),
        "exit status {status}:\n{}",
        log.lock().unwrap()
    );
    assert!(exited_after < Duration::from_secs(GRACE));
    assert_eq!(count_state(&db, "in_flight").await, 0);
    eprintln!(
        "[shutdown] serve: SIGTERM with {N} Prefer: wait reserves running: {N} answered with the \
         replay, exit 0 after {exited_after:?} (grace {GRACE} s)"
    );
}
