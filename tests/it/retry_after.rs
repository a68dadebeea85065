//! `Retry-After` on a `409 request-in-flight` estimates when the first
//! request will have finished, from how long this door's requests recently
//! took, instead of naming the end of the lease: a client that honours it
//! (urllib3's `Retry` does) waits about as long as the origin takes, not 35 s.
//! The problem body carries the lease's end as the bound.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use common::app::{TestApp, TestResponse, fresh_key};
use common::backend::Backend;
use common::proxy::{TestProxy, replayed};
use common::upstream::Upstream;
use tokio::sync::Barrier;

#[track_caller]
fn retry_after(res: &TestResponse) -> u64 {
    res.assert_problem(409, "request-in-flight");
    let header: u64 = res.header("retry-after").parse().unwrap();
    assert_eq!(res.body["retry_after_seconds"], header, "{res:#?}");
    header
}

#[track_caller]
fn lease_end(res: &TestResponse) -> DateTime<Utc> {
    let text = res.body["lease_expires_at"]
        .as_str()
        .unwrap_or_else(|| panic!("no lease_expires_at in {res:#?}"));
    text.parse().unwrap()
}

/// Through the proxy (lease 35 s by default): after a few requests that
/// took 1.5 s, 50 concurrent duplicates of a key in flight that ask for the
/// immediate answer (`Prefer: wait=0`; by default they would be held for the
/// replay) are told 1-2 s, and each one that waits what it was told and asks
/// again gets the replay within a few seconds; the origin ran once.
async fn the_proxy_estimates_the_finish_not_the_lease(b: Backend) {
    let origin = Upstream::start().await;
    let proxy = Arc::new(TestProxy::start(&b.url(), &origin.url(), &[], Vec::new()).await);
    let mut warm = Vec::new();
    for _ in 0..5 {
        let proxy = proxy.clone();
        warm.push(tokio::spawn(async move {
            proxy.post("/slow/1500", &fresh_key(), "{}").await
        }));
    }
    for w in warm {
        assert_eq!(w.await.unwrap().status, 201);
    }

    let key = fresh_key();
    let t0 = Instant::now();
    let first = {
        let (proxy, key) = (proxy.clone(), key.clone());
        tokio::spawn(async move { proxy.post("/slow/1500", &key, "{}").await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n = 50;
    let barrier = Arc::new(Barrier::new(n));
    let mut dups = Vec::new();
    for _ in 0..n {
        let (proxy, key, barrier) = (proxy.clone(), key.clone(), barrier.clone());
        dups.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut told = Vec::new();
            loop {
                let res = proxy.post_now("/slow/1500", &key, "{}").await;
                if res.status == 409 {
                    let wait = retry_after(&res);
                    let bound = lease_end(&res);
                    assert!(
                        bound > Utc::now() + chrono::Duration::seconds(25),
                        "{res:#?}"
                    );
                    told.push(wait);
                    tokio::time::sleep(Duration::from_secs(wait)).await;
                    continue;
                }
                assert_eq!(res.status, 201, "{res:#?}");
                assert!(replayed(&res));
                return told;
            }
        }));
    }
    for d in dups {
        let told = d.await.unwrap();
        assert!(
            !told.is_empty() && told.iter().all(|&s| (1..=2).contains(&s)),
            "{told:?}"
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(6),
        "every duplicate had its replay soon after the origin answered: {:?}",
        t0.elapsed()
    );
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(origin.started(&key), 1);
}

/// The reservation API times its own reservations from reserve to commit.
/// Before anything is measured a duplicate is told 1 s (not the 30 s lease);
/// after commits that took 1.5 s, 2 s at most.
async fn the_reservation_api_estimates_from_its_commits(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
    let body = r#"{"fingerprint":"fp"}"#;
    let key = fresh_key();
    let held = app.reserve(&key, body).await;
    assert_eq!(held.status, 201);
    let dup = app.reserve(&key, body).await;
    assert_eq!(retry_after(&dup), 1, "nothing measured yet");
    let lease: DateTime<Utc> = held.body["lease_expires_at"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(lease_end(&dup), lease, "the bound is the holder's lease");

    let ids: Vec<String> = reserve_fresh(&app, 5, body).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for id in &ids {
        let res = app.act(id, "commit", r#"{"status":201,"body":"ok"}"#).await;
        assert_eq!(res.status, 200, "{res:#?}");
    }
    let key = fresh_key();
    assert_eq!(app.reserve(&key, body).await.status, 201);
    let told = retry_after(&app.reserve(&key, body).await);
    assert!((1..=2).contains(&told), "told {told}, lease 30 s");
}

/// Reserves `n` fresh keys; their reservation ids.
async fn reserve_fresh(app: &TestApp, n: usize, body: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let res = app.reserve(&fresh_key(), body).await;
        assert_eq!(res.status, 201);
        ids.push(res.reservation_id());
    }
    ids
}

both_stores! {
    serial: [the_reservation_api_estimates_from_its_commits],
    concurrent: [the_proxy_estimates_the_finish_not_the_lease],
}
