//! Crashes (issue 6, scenario 2), with the real binary on one PostgreSQL
//! database and a real counting origin:
//!
//! * `kill -9` a proxy while its requests are at a slow origin: after a
//!   restart, a retry within the lease is a 409 `request-in-flight`; after
//!   it, under `hold` (the default), `409 outcome-unknown` and never a second
//!   execution, every key listed by `idemgate keys list --state unknown`
//!   until an operator settles it; under `takeover`, the retry executes
//!   exactly once more, with `Idempotency-Attempt: 2`;
//! * `kill -9` a `serve` while its clients hold checkpointed reservations: a
//!   retry within the lease is a 409, after it a takeover (attempt 2, the
//!   checkpoint handed on), and the dead holder's commit is `lease-lost`;
//! * a paused old holder: (a) over the reservation API, (b) a SIGSTOPped
//!   proxy whose request outlives its lease under `takeover`: neither
//!   overwrites the new holder's stored response; (c) under `hold`, the
//!   resumed proxy's late commit settles its key, which then replays.
//!
//! Rerun: `cargo test --test it crash:: -- --nocapture` (the figures go to stderr).

use crate::common::{self, http, until};

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::app::fresh_key;
use common::bin::{Served, count_state, drain_stderr, signal};
use common::pg::TestDb;
use common::proxy::ProxyProcess;
use common::upstream::Upstream;

/// The proxies' upstream timeout here; their lease is this + 5 s.
const UPSTREAM_TIMEOUT: u64 = 2;
const PROXY_LEASE: Duration = Duration::from_secs(UPSTREAM_TIMEOUT + 5);
const MARGIN: Duration = Duration::from_secs(5);

async fn post(base: &str, path: &str, key: &str) -> reqwest::Result<(u16, bool, Value)> {
    send(base, path, key, None).await
}

/// As [`post`], asking for the immediate answer: a duplicate in flight is
/// its 409 rather than a wait for the replay.
async fn post_now(base: &str, path: &str, key: &str) -> reqwest::Result<(u16, bool, Value)> {
    send(base, path, key, Some("wait=0")).await
}

async fn send(
    base: &str,
    path: &str,
    key: &str,
    prefer: Option<&str>,
) -> reqwest::Result<(u16, bool, Value)> {
    let mut req = http()
        .post(format!("{base}{path}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json");
    if let Some(prefer) = prefer {
        req = req.header("prefer", prefer);
    }
    let res = req.body(r#"{"amount":5}"#).send().await?;
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    Ok((status, replayed, res.json().await.unwrap_or(Value::Null)))
}

async fn proxy(db: &TestDb, upstream: &Upstream) -> ProxyProcess {
    proxy_with(db, upstream, "hold").await
}

/// A proxy whose keys' leases end as `on_lease_expiry` says.
async fn proxy_with(db: &TestDb, upstream: &Upstream, on_lease_expiry: &str) -> ProxyProcess {
    let t = UPSTREAM_TIMEOUT.to_string();
    let mut p = ProxyProcess::start_with(
        db,
        &upstream.url(),
        &[
            "--upstream-timeout",
            &t,
            "--db-max-connections",
            "8",
            "--on-lease-expiry",
            on_lease_expiry,
        ],
    )
    .await;
    // Keep the logs flowing; a full pipe would stall the process.
    drain_stderr(&mut p.child);
    p
}

fn slug(body: &Value) -> &str {
    body["type"]
        .as_str()
        .and_then(|t| t.rsplit('/').next())
        .unwrap_or_default()
}

/// `N` requests at a 1.5 s origin through `victim`, which is killed once
/// every one has reached the origin; their clients' errors are checked.
/// Returns when the requests were sent and when the victim died.
async fn kill_mid_request(
    victim: &mut ProxyProcess,
    upstream: &Upstream,
    keys: &[String],
) -> (Instant, Instant) {
    let reserved_at = Instant::now();
    let mut clients = Vec::new();
    for key in keys {
        let (base, key) = (victim.base(), key.clone());
        clients.push(tokio::spawn(async move {
            post(&base, "/numbered/1500", &key).await
        }));
    }
    assert!(
        until(Duration::from_secs(10), || {
            keys.iter().all(|k| upstream.started(k) == 1)
        })
        .await,
        "the upstream did not start every request within 10 s"
    );
    signal(victim.child.id(), "KILL");
    let _ = victim.child.wait();
    let killed_at = Instant::now();
    for c in clients {
        assert!(c.await.unwrap().is_err(), "a killed proxy cannot answer");
    }
    (reserved_at, killed_at)
}

/// Under `hold`, the default: the keys of a killed proxy are never sent
/// upstream again. Within the lease a retry is `409 request-in-flight`; a
/// retry that waits is told `409 outcome-unknown` as soon as the lease ends;
/// after it every retry is that, through any proxy; `idemgate keys list
/// --state unknown` lists every key; an operator completes half of them
/// (their retries replay what the operator gave) and releases the other
/// half (their retries execute afresh).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_proxy_mid_request_leaves_held_keys_for_an_operator() {
    const N: usize = 20;
    let db = TestDb::new().await;
    let upstream = Upstream::start_numbered().await;
    let mut victim = proxy(&db, &upstream).await;
    let survivor = proxy(&db, &upstream).await;
    let keys: Vec<String> = (0..N).map(|_| fresh_key()).collect();
    let (reserved_at, _) = kill_mid_request(&mut victim, &upstream, &keys).await;
    let restarted = proxy(&db, &upstream).await;

    let (status, _, body) = post_now(&restarted.base(), "/numbered/1500", &keys[0])
        .await
        .unwrap();
    assert_eq!((status, slug(&body)), (409, "request-in-flight"), "{body}");
    // A retry that waits (the default) is told the outcome is unknown at
    // the lease's end, not at the end of its wait.
    let (status, _, body) = post(&survivor.base(), "/numbered/1500", &keys[1])
        .await
        .unwrap();
    assert_eq!((status, slug(&body)), (409, "outcome-unknown"), "{body}");
    let told_at = reserved_at.elapsed();
    assert!(
        told_at >= PROXY_LEASE - Duration::from_millis(500) && told_at < PROXY_LEASE + MARGIN,
        "told {told_at:?} after the reservation; lease {PROXY_LEASE:?}"
    );
    for (i, key) in keys.iter().enumerate() {
        let base = [&restarted, &survivor][i % 2].base();
        let (status, _, body) = post(&base, "/numbered/1500", key).await.unwrap();
        assert_eq!((status, slug(&body)), (409, "outcome-unknown"), "{body}");
        assert_eq!(upstream.started(key), 1, "never sent upstream again");
    }

    let listed = common::bin::keys_json(&db.url, &["list", "--state", "unknown", "--all"]);
    let listed = listed["keys"].as_array().unwrap();
    assert_eq!(listed.len(), N, "{listed:#?}");
    assert!(
        listed
            .iter()
            .all(|k| k["state"] == "unknown" && k["attempt"] == 1)
    );
    // Each names the call it was for, as the killed proxy claimed it.
    assert!(
        listed
            .iter()
            .all(|k| k["request"] == json!({"method": "POST", "path": "/numbered/1500"})),
        "{listed:#?}"
    );
    let table = common::bin::keys(&db.url, &["list", "--state", "unknown"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("unknown")
            && table.contains("seconds")
            && table.contains("ended")
            && table.contains("REQUEST")
            && table.contains("POST /numbered/1500"),
        "{table}"
    );
    let tenant = listed[0]["tenant"].as_str().unwrap();
    let shown = common::bin::keys(&db.url, &["show", tenant, "--key", &keys[0]]);
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("request         POST /numbered/1500"),
        "{shown}"
    );
    for (i, key) in keys.iter().enumerate() {
        let tenant = listed[0]["tenant"].as_str().unwrap().to_owned();
        let out = if i % 2 == 0 {
            common::bin::keys(
                &db.url,
                &[
                    "resolve",
                    &tenant,
                    "--key",
                    key,
                    "--complete",
                    "--status",
                    "201",
                    "--header",
                    "content-type: application/json",
                    "--body",
                    r#"{"execution":1,"settled":true}"#,
                    "--reason",
                    "the origin's ledger shows the charge",
                    "--by",
                    "ops",
                ],
            )
        } else {
            common::bin::keys(
                &db.url,
                &[
                    "resolve",
                    &tenant,
                    "--key",
                    key,
                    "--release",
                    "--reason",
                    "the origin has no such charge",
                ],
            )
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for (i, key) in keys.iter().enumerate() {
        let (status, replayed, body) = post(&survivor.base(), "/numbered/1500", key).await.unwrap();
        if i % 2 == 0 {
            assert_eq!((status, replayed), (201, true), "{body}");
            assert_eq!(body["settled"], true, "the operator's response: {body}");
            assert_eq!(upstream.started(key), 1);
        } else {
            assert_eq!((status, replayed), (201, false), "{body}");
            assert_eq!(body["execution"], 2, "released: executed afresh");
            assert_eq!(
                upstream.attempts(key),
                [None, None],
                "a new key, not a takeover"
            );
        }
    }
    assert!(
        common::bin::keys_json(&db.url, &["list", "--state", "unknown"])["keys"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

/// Under `takeover`: a retry within the lease is a 409; after it each key
/// executes exactly once more, carrying `Idempotency-Attempt: 2`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_proxy_mid_request_then_keys_recover_after_the_lease() {
    const N: usize = 20;
    let db = TestDb::new().await;
    let upstream = Upstream::start_numbered().await;
    let mut victim = proxy_with(&db, &upstream, "takeover").await;
    let survivor = proxy_with(&db, &upstream, "takeover").await;
    let keys: Vec<String> = (0..N).map(|_| fresh_key()).collect();
    let (reserved_at, killed_at) = kill_mid_request(&mut victim, &upstream, &keys).await;
    assert_eq!(count_state(&db, "in_flight").await, N as i64);
    // Restart it (a new process on the same database).
    let restarted = proxy_with(&db, &upstream, "takeover").await;

    // Within the lease: 409, and nothing runs again.
    let (status, _, body) = post_now(&restarted.base(), "/numbered/1500", &keys[0])
        .await
        .unwrap();
    assert_eq!(status, 409, "{body}");
    assert_eq!(slug(&body), "request-in-flight");
    let (status, _, _) = post_now(&survivor.base(), "/numbered/1500", &keys[1])
        .await
        .unwrap();
    assert_eq!(status, 409);

    // After the lease: each retry executes exactly once more (the keys are
    // retried concurrently, as their clients would).
    let mut retries = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let base = if i % 2 == 0 {
            restarted.base()
        } else {
            survivor.base()
        };
        let key = key.clone();
        retries.push(tokio::spawn(async move {
            loop {
                let (status, replayed, body) =
                    post_now(&base, "/numbered/1500", &key).await.unwrap();
                if status == 409 {
                    assert_eq!(slug(&body), "request-in-flight");
                    assert!(
                        reserved_at.elapsed() < PROXY_LEASE + MARGIN,
                        "key still in flight {:?} after its reservation",
                        reserved_at.elapsed()
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                assert_eq!((status, replayed), (201, false), "{body}");
                assert_eq!(body["execution"], 2, "the takeover runs the effect again");
                // When the takeover was granted (the origin takes 1.5 s).
                return reserved_at.elapsed() - Duration::from_millis(1500);
            }
        }));
    }
    let mut recovered_after = Duration::ZERO;
    for r in retries {
        recovered_after = recovered_after.max(r.await.unwrap());
    }
    assert!(recovered_after >= PROXY_LEASE - Duration::from_millis(500));
    for key in &keys {
        assert_eq!(upstream.started(key), 2, "one more execution, not more");
        assert_eq!(
            upstream.attempts(key),
            [None, Some("2".to_owned())],
            "the takeover says which attempt it is"
        );
        // The retry of the retry is a replay of the second execution.
        let (status, replayed, body) = post(&survivor.base(), "/numbered/1500", key).await.unwrap();
        assert_eq!(
            (status, replayed, body["execution"].clone()),
            (201, true, json!(2))
        );
    }
    assert_eq!(upstream.total(), 2 * N);
    assert_eq!(count_state(&db, "in_flight").await, 0);
    eprintln!(
        "[crash] kill -9 proxy: {N} keys in flight, {} executions at the origin, all recovered \
         {recovered_after:?} after reserve ({:?} after the kill), lease {PROXY_LEASE:?}",
        upstream.total(),
        recovered_after.saturating_sub(killed_at - reserved_at)
    );
}

async fn api(base: &str, path: &str, key: Option<&str>, body: Value) -> (u16, Value) {
    let mut req = http().post(format!("{base}{path}")).json(&body);
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let res = req.send().await.expect("serve answers");
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or(Value::Null))
}

/// `POST /v1/reservations/{id}/commit` of a 201 with `body`.
async fn commit(base: &str, id: &str, body: &str) -> (u16, Value) {
    api(
        base,
        &format!("/v1/reservations/{id}/commit"),
        None,
        json!({"status": 201, "headers": [], "body": body}),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_serve_with_held_reservations_then_takeover_hands_on_the_checkpoint() {
    const N: usize = 20;
    const LEASE: u64 = 2;
    let db = TestDb::new().await;
    let mut victim = Served::start(&db, &["--db-max-connections", "8"]).await;
    drain_stderr(&mut victim.child);
    let keys: Vec<String> = (0..N).map(|_| fresh_key()).collect();
    let reserve = json!({"fingerprint": "fp-crash", "lease_seconds": LEASE});

    let reserved_at = Instant::now();
    let mut old_ids = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let (status, body) = api(
            &victim.base(),
            "/v1/reservations",
            Some(key),
            reserve.clone(),
        )
        .await;
        assert_eq!(status, 201, "{body}");
        let id = body["reservation_id"].as_str().unwrap().to_owned();
        let cp = json!({"recovery_point": "charged", "data": {"charge": format!("ch_{i}")}});
        let (status, body) = api(
            &victim.base(),
            &format!("/v1/reservations/{id}/checkpoint"),
            None,
            cp,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        old_ids.push(id);
    }
    signal(victim.child.id(), "KILL");
    let _ = victim.child.wait();
    let mut restarted = Served::start(&db, &["--db-max-connections", "8"]).await;
    drain_stderr(&mut restarted.child);

    // Within the lease: 409.
    let (status, body) = api(
        &restarted.base(),
        "/v1/reservations",
        Some(&keys[0]),
        reserve.clone(),
    )
    .await;
    if reserved_at.elapsed() < Duration::from_secs(LEASE) {
        assert_eq!(status, 409, "{body}");
        assert_eq!(slug(&body), "request-in-flight");
    }

    let mut recovered_after = Duration::ZERO;
    for (i, key) in keys.iter().enumerate() {
        let body = loop {
            let (status, body) = api(
                &restarted.base(),
                "/v1/reservations",
                Some(key),
                reserve.clone(),
            )
            .await;
            if status == 201 {
                break body;
            }
            assert_eq!(status, 409, "{body}");
            assert!(
                reserved_at.elapsed() < Duration::from_secs(LEASE) + MARGIN,
                "still in flight"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        recovered_after = recovered_after.max(reserved_at.elapsed());
        assert_eq!(body["attempt"], 2, "{body}");
        assert_eq!(body["recovery"]["recovery_point"], "charged", "{body}");
        assert_eq!(body["recovery"]["data"]["charge"], format!("ch_{i}"));
        let new_id = body["reservation_id"].as_str().unwrap().to_owned();
        assert_ne!(new_id, old_ids[i]);
        // The dead holder's commit is refused; the new holder's is stored.
        let (status, body) = commit(&restarted.base(), &old_ids[i], "old").await;
        assert_eq!(status, 409, "{body}");
        assert_eq!(slug(&body), "lease-lost");
        let (status, _) = commit(&restarted.base(), &new_id, &format!("new-{i}")).await;
        assert_eq!(status, 200);
    }
    for (i, key) in keys.iter().enumerate() {
        let (status, body) = api(
            &restarted.base(),
            "/v1/reservations",
            Some(key),
            reserve.clone(),
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(body["response"]["body"], format!("new-{i}"));
    }
    assert_eq!(count_state(&db, "in_flight").await, 0);
    eprintln!(
        "[crash] kill -9 serve: {N} checkpointed reservations (lease {LEASE} s), all taken over \
         (attempt 2, checkpoint handed on) {recovered_after:?} after reserve; {N} old commits lease-lost"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paused_holder_over_the_api_cannot_overwrite_the_new_holder() {
    let db = TestDb::new().await;
    let mut a = Served::start(&db, &["--db-max-connections", "8"]).await;
    let mut b = Served::start(&db, &["--db-max-connections", "8"]).await;
    drain_stderr(&mut a.child);
    drain_stderr(&mut b.child);
    let key = fresh_key();
    let reserve = json!({"fingerprint": "fp-paused", "lease_seconds": 1});

    let (status, body) = api(&a.base(), "/v1/reservations", Some(&key), reserve.clone()).await;
    assert_eq!(status, 201);
    let old = body["reservation_id"].as_str().unwrap().to_owned();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (status, body) = api(&b.base(), "/v1/reservations", Some(&key), reserve.clone()).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["attempt"], 2);
    let new = body["reservation_id"].as_str().unwrap().to_owned();

    // The old holder wakes up and commits first: refused.
    let (status, body) = commit(&a.base(), &old, "old holder").await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(slug(&body), "lease-lost");
    let (status, _) = commit(&b.base(), &new, "new holder").await;
    assert_eq!(status, 200);
    // And again after the new holder's commit: still refused.
    let (status, body) = commit(&a.base(), &old, "old holder").await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(slug(&body), "lease-lost");
    for base in [a.base(), b.base()] {
        let (status, body) = api(&base, "/v1/reservations", Some(&key), reserve.clone()).await;
        assert_eq!(status, 200);
        assert_eq!(body["response"]["body"], "new holder");
    }
}

/// `key`'s request at a 1 s origin through `old`, which is stopped
/// (`SIGSTOP`) once the origin has it; returns when the origin has answered
/// and the proxy's lease has ended, with the request's client.
async fn stopped_past_its_lease(
    old: &ProxyProcess,
    upstream: &Upstream,
    key: &str,
) -> tokio::task::JoinHandle<reqwest::Result<(u16, bool, Value)>> {
    let reserved_at = Instant::now();
    let first = {
        let (base, key) = (old.base(), key.to_owned());
        tokio::spawn(async move { post(&base, "/numbered/1000", &key).await })
    };
    assert!(
        until(Duration::from_secs(5), || upstream.started(key) == 1).await,
        "the first execution did not start"
    );
    signal(old.child.id(), "STOP");
    // The origin finishes the first execution while the proxy is stopped.
    assert!(
        until(Duration::from_secs(5), || upstream.finished(key) == 1).await,
        "the first execution did not finish"
    );
    tokio::time::sleep(
        (PROXY_LEASE + Duration::from_millis(300)).saturating_sub(reserved_at.elapsed()),
    )
    .await;
    first
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigstopped_proxy_past_its_lease_cannot_overwrite_the_takeover() {
    let db = TestDb::new().await;
    let upstream = Upstream::start_numbered().await;
    let mut old = ProxyProcess::start_with(
        &db,
        &upstream.url(),
        &[
            "--upstream-timeout",
            &UPSTREAM_TIMEOUT.to_string(),
            "--on-lease-expiry",
            "takeover",
        ],
    )
    .await;
    let old_log = drain_stderr(&mut old.child);
    let new = proxy_with(&db, &upstream, "takeover").await;
    let key = fresh_key();

    let first = stopped_past_its_lease(&old, &upstream, &key).await;

    // Another proxy takes the key over and completes it.
    let (status, replayed, second) = post(&new.base(), "/numbered/1000", &key).await.unwrap();
    assert_eq!((status, replayed), (201, false), "{second}");
    assert_eq!(second["execution"], 2);
    assert_eq!(upstream.started(&key), 2);

    // The old proxy resumes: whatever it answers its client, its late
    // commit must not replace the stored response.
    signal(old.child.id(), "CONT");
    let (old_status, _, old_body) = first.await.unwrap().expect("the resumed proxy answers");
    eprintln!("[crash] SIGCONT: the old proxy answered its client {old_status} {old_body}");
    assert!(
        old_status == 201 || old_status == 504,
        "{old_status} {old_body}"
    );
    for base in [old.base(), new.base()] {
        let (status, replayed, body) = post(&base, "/numbered/1000", &key).await.unwrap();
        assert_eq!((status, replayed), (201, true));
        assert_eq!(
            body["execution"], 2,
            "the stored response is the second execution's"
        );
    }
    assert_eq!(
        upstream.started(&key),
        2,
        "the origin counted two executions"
    );
    assert_eq!(count_state(&db, "in_flight").await, 0);
    if old_status == 201 {
        assert_eq!(old_body["execution"], 1);
        let log = old_log.lock().unwrap().clone();
        assert!(
            log.contains("the response was not stored"),
            "the old commit was not refused:\n{log}"
        );
    }
}

/// Under `hold`: a proxy stopped past its lease while its call runs leaves
/// its key unknown (another proxy answers `409 outcome-unknown`, and never
/// calls the origin again); when it resumes, its late commit still lands —
/// its reservation id is still the key's — and the key replays the one
/// execution through every proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigstopped_proxy_past_its_lease_settles_its_held_key_when_it_resumes() {
    let db = TestDb::new().await;
    let upstream = Upstream::start_numbered().await;
    let old = proxy(&db, &upstream).await;
    let new = proxy(&db, &upstream).await;
    let key = fresh_key();

    let first = stopped_past_its_lease(&old, &upstream, &key).await;
    let (status, _, body) = post(&new.base(), "/numbered/1000", &key).await.unwrap();
    assert_eq!((status, slug(&body)), (409, "outcome-unknown"), "{body}");
    let listed = common::bin::keys_json(&db.url, &["list", "--state", "unknown"]);
    assert_eq!(listed["keys"].as_array().unwrap().len(), 1, "{listed}");

    signal(old.child.id(), "CONT");
    // Its client gets the origin's answer, or its 504 if the resumed
    // process sees its answer timeout first; either way the call's answer
    // is committed.
    let (old_status, _, old_body) = first.await.unwrap().expect("the resumed proxy answers");
    match old_status {
        201 => assert_eq!(old_body["execution"], 1),
        504 => assert_eq!(slug(&old_body), "upstream-timeout"),
        _ => panic!("{old_status} {old_body}"),
    }
    let started = Instant::now();
    while post_now(&new.base(), "/numbered/1000", &key)
        .await
        .unwrap()
        .0
        == 409
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the late commit never landed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for base in [old.base(), new.base()] {
        let (status, replayed, body) = post(&base, "/numbered/1000", &key).await.unwrap();
        assert_eq!((status, replayed), (201, true), "{body}");
        assert_eq!(body["execution"], 1, "the one execution, replayed");
    }
    assert_eq!(upstream.started(&key), 1, "the origin ran once");
    assert!(
        common::bin::keys_json(&db.url, &["list", "--state", "unknown"])["keys"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}
