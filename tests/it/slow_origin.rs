//! An origin slower than the proxy's upstream timeout: the client gets its
//! `504` in time, but the call is not abandoned. It runs on, its key's lease
//! kept alive, and its late answer is stored, so a retry after the lease
//! would once have ended is a replay and the origin ran once. Only the
//! abandon bound, or a proxy that dies, leaves the outcome unknown.

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
    let dup = proxy.post("/numbered/8000", &key, "{}").await;
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

/// Past `--upstream-abandon-after` the call is dropped: its outcome is
/// unknown, the key stays in flight until its last lease ends (a retry
/// meanwhile is a 409), and a retry after that takes it over.
async fn past_the_abandon_bound_the_key_waits_out_its_lease(b: Backend) {
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
    // Abandoned at 3 s; the lease was last extended at 2 s, so it ends at 8 s.
    at(t0, Duration::from_millis(4_000)).await;
    proxy
        .post("/numbered/20000", &key, "{}")
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
}

both_stores! {
    serial: [],
    concurrent: [
        a_slow_origin_runs_once_and_its_late_answer_is_replayed,
        past_the_abandon_bound_the_key_waits_out_its_lease,
    ],
}

/// The residual risk, as documented: a proxy killed while its call runs on
/// stops keeping the lease alive. Another proxy on the same database answers
/// a retry with 409 until the last lease ends, and takes the key over after
/// it: the origin, which may have acted, runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proxy_killed_during_the_wait_leaves_the_key_to_its_lease() {
    let db = TestDb::new().await;
    let origin = Upstream::start_numbered().await;
    let http = common::http();
    let mut first =
        ProxyProcess::start_with(&db, &origin.url(), &["--upstream-timeout", "1"]).await;
    let key = fresh_key();
    let t0 = Instant::now();
    post(&http, &first.base(), "/numbered/20000", &key)
        .await
        .assert_problem(504, "upstream-timeout");
    // The lease (6 s) was extended at 2 s; then the process dies.
    at(t0, Duration::from_millis(2_700)).await;
    let _ = first.child.kill();
    let _ = first.child.wait();

    let second = ProxyProcess::start_with(&db, &origin.url(), &["--upstream-timeout", "1"]).await;
    post(&http, &second.base(), "/numbered/20000", &key)
        .await
        .assert_problem(409, "request-in-flight");
    assert_eq!(origin.started(&key), 1);
    at(t0, Duration::from_millis(8_500)).await;
    // Taken over: sent upstream again (which answers no faster this time).
    post(&http, &second.base(), "/numbered/20000", &key)
        .await
        .assert_problem(504, "upstream-timeout");
    assert_eq!(origin.started(&key), 2, "the takeover ran the origin again");
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
