//! An origin slower than the proxy's upstream timeout: the client gets its
//! `504` in time, but the call is not abandoned. It runs on, its key's lease
//! kept alive, and its late answer is stored, so a retry after the lease
//! would once have ended is a replay and the origin ran once. Only the
//! abandon bound, or a proxy that dies, leaves the outcome unknown: under
//! `hold` (the default) the key is then never sent upstream again; under
//! `takeover` the retry after the lease is, with `Idempotency-Attempt: 2`.

use crate::common;

use std::time::{Duration, Instant};

use common::app::{TestResponse, fresh_key};
use common::backend::Backend;
use common::pg::TestDb;
use common::proxy::{ProxyProcess, TestProxy, replayed};
use common::upstream::Upstream;

/// `POST path` with `key` through `base`, as a plain client would.
async fn post(http: &reqwest::Client, base: &str, path: &str, key: &str) -> TestResponse {
    let res = http
        .post(format!("{base}{path}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body("{\"amount\":500}")
        .send()
        .await
        .expect("the proxy answers");
    let status = res.status();
    let headers = res.headers().clone();
    let bytes = res.bytes().await.unwrap();
    TestResponse {
        status,
        headers,
        body: serde_json::from_slice(&bytes).unwrap_or_default(),
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// Sleeps until `at` after `t0`.
async fn at(t0: Instant, at: Duration) {
    tokio::time::sleep(at.saturating_sub(t0.elapsed())).await;
}

/// With `--upstream-timeout 1` the lease is 6 s. The origin takes 8 s: the
/// client gets 504 at 1 s; a retry at 6.5 s, past the lease as it was first
/// taken, is a 409 (the lease was kept alive), not a takeover; once the
/// origin has answered, the retry gets that answer, replayed.
async fn a_slow_origin_runs_once_and_its_late_answer_is_replayed(b: Backend) {
    let origin = Upstream::start_numbered().await;
    let proxy = TestProxy::start(
        &b.url(),
        &origin.url(),
        &["--upstream-timeout", "1"],
        Vec::new(),
    )
    .await;
    let key = fresh_key();
    let t0 = Instant::now();
    let first = proxy.post("/numbered/8000", &key, "{}").await;
    first.assert_problem(504, "upstream-timeout");
    assert!(t0.elapsed() < Duration::from_secs(3), "504 at the timeout");

    at(t0, Duration::from_millis(6_500)).await;
    let dup = proxy.post_now("/numbered/8000", &key, "{}").await;
    dup.assert_problem(409, "request-in-flight");
    assert_eq!(origin.started(&key), 1, "no takeover while the call runs");

    at(t0, Duration::from_millis(8_600)).await;
    let retry = proxy.post("/numbered/8000", &key, "{}").await;
    assert_eq!(retry.status, 201, "{retry:#?}");
    assert!(replayed(&retry), "the late answer was stored: {retry:#?}");
    assert_eq!(retry.body["execution"], 1, "{retry:#?}");
    assert_eq!(origin.started(&key), 1, "the origin ran once");
    assert_eq!(origin.finished(&key), 1, "and was not hung up on");
}

/// Past `--upstream-abandon-after` the call is dropped, its outcome
/// unknown: under `hold` (the default) the key is marked so at once — a
/// retry, even one that would wait, is `409 outcome-unknown` — and never
/// sent upstream again, before or after its lease would have ended.
async fn past_the_abandon_bound_the_key_is_held_unknown(b: Backend) {
    let origin = Upstream::start_numbered().await;
    let proxy = TestProxy::start(
        &b.url(),
        &origin.url(),
        &["--upstream-timeout", "1", "--upstream-abandon-after", "3"],
        Vec::new(),
    )
    .await;
    let key = fresh_key();
    let t0 = Instant::now();
    proxy
        .post("/numbered/20000", &key, "{}")
        .await
        .assert_problem(504, "upstream-timeout");
    at(t0, Duration::from_millis(2_000)).await;
    proxy
        .post_now("/numbered/20000", &key, "{}")
        .await
        .assert_problem(409, "request-in-flight");
    // Abandoned at 3 s: a retry that would wait is told at once.
    at(t0, Duration::from_millis(3_500)).await;
    let asked = Instant::now();
    let retry = proxy.post("/numbered/20000", &key, "{}").await;
    retry.assert_problem(409, "outcome-unknown");
    assert!(retry.headers.get("retry-after").is_none(), "{retry:#?}");
    assert!(asked.elapsed() < Duration::from_secs(1), "not held");
    // Past the lease (last extended at 2 s, so ended at 8 s): still held.
    at(t0, Duration::from_millis(8_500)).await;
    proxy
        .post("/numbered/20000", &key, "{}")
        .await
        .assert_problem(409, "outcome-unknown");
    assert_eq!(origin.started(&key), 1, "never sent upstream again");
}

/// Under `takeover`, the abandoned key stays in flight until its last lease
/// ends (a retry meanwhile is a 409), and a retry after that takes it over:
/// the origin is called again, told `Idempotency-Attempt: 2`.
async fn past_the_abandon_bound_a_takeover_says_its_attempt(b: Backend) {
    let origin = Upstream::start_numbered().await;
    let proxy = TestProxy::start(
        &b.url(),
        &origin.url(),
        &[
            "--upstream-timeout",
            "1",
            "--upstream-abandon-after",
            "3",
            "--on-lease-expiry",
            "takeover",
        ],
        Vec::new(),
    )
    .await;
    let key = fresh_key();
    let t0 = Instant::now();
    proxy
        .post("/numbered/20000", &key, "{}")
        .await
        .assert_problem(504, "upstream-timeout");
    // Abandoned at 3 s; the lease was last extended at 2 s, so it ends at 8 s.
    at(t0, Duration::from_millis(4_000)).await;
    proxy
        .post_now("/numbered/20000", &key, "{}")
        .await
        .assert_problem(409, "request-in-flight");
    at(t0, Duration::from_millis(8_500)).await;
    proxy
        .post("/numbered/20000", &key, "{}")
        .await
        .assert_problem(504, "upstream-timeout");
    assert_eq!(
        origin.started(&key),
        2,
        "after its lease the abandoned key was taken over"
    );
    assert_eq!(origin.attempts(&key), [None, Some("2".to_owned())]);
}

both_stores! {
    serial: [],
    concurrent: [
        a_slow_origin_runs_once_and_its_late_answer_is_replayed,
        past_the_abandon_bound_the_key_is_held_unknown,
        past_the_abandon_bound_a_takeover_says_its_attempt,
    ],
}

/// A proxy killed while its call runs on stops keeping the lease alive.
/// Another proxy on the same database answers a retry `409
/// request-in-flight` until the last lease ends; after it, under `hold`
/// (the default), `409 outcome-unknown`: the origin, which may have acted,
/// is never called again, and the key is listed for an operator. Under
/// `takeover` the retry after the lease runs again, with
/// `Idempotency-Attempt: 2`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proxy_killed_during_the_wait_leaves_the_key_to_its_choice() {
    for choice in ["hold", "takeover"] {
        let db = TestDb::new().await;
        let origin = Upstream::start_numbered().await;
        let http = common::http();
        let flags = ["--upstream-timeout", "1", "--on-lease-expiry", choice];
        let mut first = ProxyProcess::start_with(&db, &origin.url(), &flags).await;
        let key = fresh_key();
        let t0 = Instant::now();
        post(&http, &first.base(), "/numbered/20000", &key)
            .await
            .assert_problem(504, "upstream-timeout");
        // The lease (6 s) was extended at 2 s; then the process dies.
        at(t0, Duration::from_millis(2_700)).await;
        let _ = first.child.kill();
        let _ = first.child.wait();

        let second = ProxyProcess::start_with(&db, &origin.url(), &flags).await;
        let now = http
            .post(format!("{}/numbered/20000", second.base()))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .header("prefer", "wait=0")
            .body("{\"amount\":500}")
            .send()
            .await
            .unwrap();
        assert_eq!(now.status(), 409, "{choice}");
        assert_eq!(origin.started(&key), 1);
        at(t0, Duration::from_millis(8_500)).await;
        let retry = post(&http, &second.base(), "/numbered/20000", &key).await;
        if choice == "hold" {
            retry.assert_problem(409, "outcome-unknown");
            assert_eq!(origin.started(&key), 1, "never sent upstream again");
            let listed = common::bin::keys_json(&db.url, &["list", "--state", "unknown"]);
            assert_eq!(listed["keys"].as_array().unwrap().len(), 1, "{listed}");
        } else {
            // Taken over: sent upstream again (which answers no faster).
            retry.assert_problem(504, "upstream-timeout");
            assert_eq!(origin.started(&key), 2, "the takeover ran the origin again");
            assert_eq!(origin.attempts(&key), [None, Some("2".to_owned())]);
        }
    }
}

/// SIGTERM while a call runs on after its client's 504: the proxy waits for
/// the call (within the shutdown grace), stores its answer, and exits 0; a
/// retry through the next proxy gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shutdown_waits_for_a_call_that_runs_on() {
    let db = TestDb::new().await;
    let origin = Upstream::start_numbered().await;
    let http = common::http();
    let flags = ["--upstream-timeout", "1", "--shutdown-grace", "10"];
    let mut first = ProxyProcess::start_with(&db, &origin.url(), &flags).await;
    let key = fresh_key();
    post(&http, &first.base(), "/numbered/3000", &key)
        .await
        .assert_problem(504, "upstream-timeout");
    common::bin::signal(first.child.id(), "TERM");
    let status = common::bin::wait_exit(&mut first.child, Duration::from_secs(10))
        .await
        .expect("the proxy exits within its grace");
    assert!(status.success(), "{status}");
    assert_eq!(origin.finished(&key), 1, "the call ran to its end");

    let second = ProxyProcess::start_with(&db, &origin.url(), &flags).await;
    let retry = post(&http, &second.base(), "/numbered/3000", &key).await;
    assert_eq!(retry.status, 201, "{retry:#?}");
    assert!(replayed(&retry), "{retry:#?}");
    assert_eq!(origin.started(&key), 1);
}
