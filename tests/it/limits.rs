//! Per-tenant limits (RELIABILITY.md §5): one tenant cannot exhaust the store.
//! Over `IDEMGATE_TENANT_MAX_IN_FLIGHT` or `IDEMGATE_TENANT_MAX_STORED_BYTES`
//! a new key is answered `429 tenant-limit` with `Retry-After`, nothing is
//! reserved or forwarded, and replays, 409s and other tenants go on.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::app::{TestApp, TestResponse, fresh_key};
use common::backend::Backend;
use common::proxy::TestProxy;
use common::upstream::Upstream;
use idemgate::store::postgres::PgSettings;
use serde_json::Value;

const TOKENS: &str = "acme:acme-secret-token-1,globex:globex-secret-token-2";
const ACME: &str = "Bearer acme-secret-token-1";
const GLOBEX: &str = "Bearer globex-secret-token-2";

/// The 429's promises: the slug, a `Retry-After` within `1..=max`, and the
/// same figure in the body.
fn assert_limited(res: &TestResponse, max_retry: u64) -> u64 {
    res.assert_problem(429, "tenant-limit");
    let header: u64 = res.header("retry-after").parse().expect("Retry-After");
    assert!(
        (1..=max_retry).contains(&header),
        "Retry-After {header} not in 1..={max_retry}"
    );
    assert_eq!(res.body["retry_after_seconds"], Value::from(header));
    header
}

async fn in_flight_limit_refuses_new_keys_only(b: Backend) {
    let app = TestApp::new(
        &b.url(),
        &["--tokens", TOKENS, "--tenant-max-in-flight", "3"],
    )
    .await;
    let keys: Vec<String> = (0..3).map(|_| fresh_key()).collect();
    let mut ids = Vec::new();
    for key in &keys {
        let res = app.reserve_as(ACME, key, r#"{"lease_seconds": 20}"#).await;
        assert_eq!(res.status, 201, "{}", res.text);
        ids.push(res.reservation_id());
    }

    // A fourth key: refused, and not reserved.
    let fourth = fresh_key();
    let res = app
        .reserve_as(ACME, &fourth, r#"{"lease_seconds": 20}"#)
        .await;
    assert_limited(&res, 20);
    assert!(res.text.contains("in flight"), "{}", res.text);
    let usage = app.store.in_flight_usage("acme", 100).await.expect("usage");
    assert_eq!(usage.keys, 3, "the refused key is not in flight");

    // A retry of a key in flight is still a 409, not a 429; another tenant
    // is untouched.
    app.reserve_as(ACME, &keys[0], r#"{"lease_seconds": 20}"#)
        .await
        .assert_problem(409, "request-in-flight");
    assert_eq!(
        app.reserve_as(GLOBEX, &fourth, "{}").await.status,
        201,
        "globex has its own room"
    );

    // A commit frees a slot, and the committed key replays at the limit.
    let commit = app
        .act_as(
            ACME,
            &ids[0],
            "commit",
            r#"{"status": 201, "body": "done"}"#,
        )
        .await;
    assert_eq!(commit.status, 200, "{}", commit.text);
    let res = app
        .reserve_as(ACME, &fourth, r#"{"lease_seconds": 20}"#)
        .await;
    assert_eq!(res.status, 201, "{}", res.text);
    assert_limited(&app.reserve_as(ACME, &fresh_key(), "{}").await, 20);
    let replay = app.reserve_as(ACME, &keys[0], "{}").await;
    assert_eq!(
        replay.status, 200,
        "a replay is never limited: {}",
        replay.text
    );

    // A release frees one too.
    assert_eq!(app.act_as(ACME, &ids[1], "release", "").await.status, 204);
    assert_eq!(app.reserve_as(ACME, &fresh_key(), "{}").await.status, 201);
    assert_limited(&app.reserve_as(ACME, &fresh_key(), "{}").await, 30);
}

async fn ended_leases_do_not_count(b: Backend) {
    let app = TestApp::new(&b.url(), &["--tenant-max-in-flight", "2"]).await;
    for _ in 0..2 {
        let res = app.reserve(&fresh_key(), r#"{"lease_seconds": 1}"#).await;
        assert_eq!(res.status, 201, "{}", res.text);
    }
    let limited = app.reserve(&fresh_key(), r#"{"lease_seconds": 1}"#).await;
    assert_limited(&limited, 1);
    TestApp::outlive(1).await;
    // Both holders are presumed dead: their keys wait for a takeover and
    // hold no room.
    let res = app.reserve(&fresh_key(), "{}").await;
    assert_eq!(res.status, 201, "{}", res.text);
    assert_eq!(
        app.act(&res.reservation_id(), "release", "").await.status,
        204
    );

    // Nor does an expired key whose lease outlived it: the key is new again.
    let app = TestApp::new(&b.url(), &["--tenant-max-in-flight", "1"]).await;
    let res = app
        .reserve(&fresh_key(), r#"{"lease_seconds": 30, "ttl_seconds": 1}"#)
        .await;
    assert_eq!(res.status, 201, "{}", res.text);
    assert_limited(&app.reserve(&fresh_key(), "{}").await, 30);
    TestApp::outlive(1).await;
    let res = app.reserve(&fresh_key(), "{}").await;
    assert_eq!(
        res.status, 201,
        "an expired key holds no room: {}",
        res.text
    );
}

/// Many reserves of distinct keys released together: the limit holds — to
/// the key on SQLite, whose claim counts under the write lock; within one
/// claim per connection on PostgreSQL, whose claims count against their own
/// snapshots. Every refusal is a 429, never a 5xx.
async fn in_flight_limit_holds_under_a_storm(b: Backend) {
    const LIMIT: usize = 10;
    const CLIENTS: usize = 200;
    let app =
        Arc::new(TestApp::new(&b.url(), &["--tenant-max-in-flight", &LIMIT.to_string()]).await);
    let barrier = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (app, barrier) = (app.clone(), barrier.clone());
            tokio::spawn(async move {
                let key = fresh_key();
                barrier.wait().await;
                app.reserve(&key, "{}").await
            })
        })
        .collect();
    let (mut reserved, mut limited) = (0, 0);
    for t in tasks {
        let res = t.await.expect("task");
        match res.status.as_u16() {
            201 => reserved += 1,
            429 => {
                assert_limited(&res, 30);
                limited += 1;
            }
            other => panic!("unexpected {other}: {}", res.text),
        }
    }
    let live = app
        .store
        .in_flight_usage("default", 1000)
        .await
        .expect("usage")
        .keys;
    eprintln!(
        "storm of {CLIENTS} at limit {LIMIT}: {reserved} reserved, {limited} × 429, {live} in flight"
    );
    assert_eq!(reserved + limited, CLIENTS);
    assert_eq!(live as usize, reserved, "every 201 is one key in flight");
    assert!(reserved >= LIMIT, "the limit lets {LIMIT} through");
    let slack = match b {
        Backend::Sqlite(_) => 0,
        // One claim per connection may count against a snapshot that
        // misses the others (the pool's default size is 16).
        Backend::Postgres(_) => 16,
    };
    assert!(
        reserved <= LIMIT + slack,
        "{reserved} reserved past a limit of {LIMIT} (+{slack})"
    );
}

async fn stored_bytes_limit_refuses_new_keys_until_records_expire(b: Backend) {
    let app = TestApp::new(
        &b.url(),
        &["--tokens", TOKENS, "--tenant-max-stored-bytes", "3000"],
    )
    .await;
    let body = format!(r#"{{"status": 200, "body": "{}"}}"#, "x".repeat(2000));
    let mut done = Vec::new();
    // Under the limit at each reserve: 0, then about 2,000 bytes.
    for _ in 0..2 {
        let key = fresh_key();
        let res = app.reserve_as(ACME, &key, r#"{"ttl_seconds": 3}"#).await;
        assert_eq!(res.status, 201, "{}", res.text);
        let commit = app
            .act_as(ACME, &res.reservation_id(), "commit", &body)
            .await;
        assert_eq!(commit.status, 200, "{}", commit.text);
        done.push(key);
    }
    // About 4,000 bytes now: new keys wait for the first record to expire.
    let res = app.reserve_as(ACME, &fresh_key(), "{}").await;
    let retry = assert_limited(&res, 3);
    assert!(res.text.contains("stored"), "{}", res.text);
    // Replays go on; so does another tenant.
    let replay = app.reserve_as(ACME, &done[1], "{}").await;
    assert_eq!(replay.status, 200, "{}", replay.text);
    assert_eq!(app.reserve_as(GLOBEX, &fresh_key(), "{}").await.status, 201);

    // Once the records expire (and the figure is read again), there is room.
    tokio::time::sleep(Duration::from_secs(retry) + Duration::from_millis(300)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let res = app.reserve_as(ACME, &fresh_key(), "{}").await;
        if res.status == 201 {
            break;
        }
        assert_limited(&res, 3);
        assert!(
            tokio::time::Instant::now() < deadline,
            "still limited 5 s after the records expired"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn policy_publishes_the_limits(b: Backend) {
    let app = TestApp::new(
        &b.url(),
        &[
            "--tenant-max-in-flight",
            "7",
            "--tenant-max-stored-bytes",
            "1000000",
        ],
    )
    .await;
    let policy = app.send("GET", "/v1/policy", &[], None).await.body;
    assert_eq!(policy["tenant_limits"]["max_in_flight_keys"], 7);
    assert_eq!(policy["tenant_limits"]["max_stored_bytes"], 1_000_000);
    assert_eq!(policy["stored_response"]["sealed_at_rest"], false);

    let open = TestApp::new(&b.url(), &[]).await;
    let policy = open.send("GET", "/v1/policy", &[], None).await.body;
    assert_eq!(policy["tenant_limits"]["max_in_flight_keys"], Value::Null);
    assert_eq!(policy["tenant_limits"]["max_stored_bytes"], Value::Null);
}

both_stores!(
    serial: [
        in_flight_limit_refuses_new_keys_only,
        ended_leases_do_not_count,
        stored_bytes_limit_refuses_new_keys_until_records_expire,
        policy_publishes_the_limits,
    ],
    concurrent: [in_flight_limit_holds_under_a_storm],
);

/// Three engines (processes) on one PostgreSQL database: the in-flight
/// limit holds across them within one claim per connection, and stored bytes
/// committed through one are seen by the others within the refresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limits_hold_across_engines_on_one_database() {
    const LIMIT: usize = 10;
    const CLIENTS: usize = 150;
    const CONNECTIONS: u32 = 8;
    let db = common::pg::TestDb::new().await;
    let flags = [
        "--tenant-max-in-flight",
        "10",
        "--tenant-max-stored-bytes",
        "3000",
    ];
    let mut apps = Vec::new();
    for _ in 0..3 {
        // Eight connections each: the three engines, and whatever runs
        // beside this test, stay well within PostgreSQL's 100.
        let pg = PgSettings {
            max_connections: CONNECTIONS,
            ..PgSettings::default()
        };
        apps.push(Arc::new(TestApp::with_settings(&db.url, &flags, pg).await));
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (app, barrier) = (apps[i % 3].clone(), barrier.clone());
            tokio::spawn(async move {
                let key = fresh_key();
                barrier.wait().await;
                app.reserve(&key, r#"{"lease_seconds": 10}"#).await
            })
        })
        .collect();
    let mut reserved = Vec::new();
    let mut limited = 0;
    for t in tasks {
        let res = t.await.expect("task");
        match res.status.as_u16() {
            201 => reserved.push(res.reservation_id()),
            429 => {
                assert_limited(&res, 10);
                limited += 1;
            }
            other => panic!("unexpected {other}: {}", res.text),
        }
    }
    eprintln!(
        "{CLIENTS} clients over 3 engines at limit {LIMIT}: {} reserved, {limited} × 429",
        reserved.len()
    );
    assert!(reserved.len() >= LIMIT);
    assert!(
        reserved.len() <= LIMIT + 3 * CONNECTIONS as usize,
        "{} reserved past {LIMIT} + one per connection",
        reserved.len()
    );

    // Stored bytes: commit 4,000 bytes through engine 0 (the limit was not
    // reached when they were reserved); engine 1 refuses new keys once it
    // reads the figure again.
    let body = format!(r#"{{"status": 200, "body": "{}"}}"#, "y".repeat(2000));
    for id in &reserved[..2] {
        let res = apps[0].act(id, "commit", &body).await;
        assert_eq!(res.status, 200, "{}", res.text);
    }
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let res = apps[1].reserve(&fresh_key(), "{}").await;
    assert_limited(&res, 86_400);
    assert!(res.text.contains("stored"), "{}", res.text);
}

/// The proxy: a credential at its limit gets the 429 and the origin never
/// sees the request; another credential passes.
#[tokio::test]
async fn proxy_answers_429_without_forwarding() {
    let db = common::pg::TestDb::new().await;
    let upstream = Upstream::start().await;
    let proxy = Arc::new(
        TestProxy::start(
            &db.url,
            &upstream.url(),
            &["--tenant-max-in-flight", "1"],
            Vec::new(),
        )
        .await,
    );
    let slow_key = fresh_key();
    let holder = {
        let (proxy, key) = (proxy.clone(), slow_key.clone());
        tokio::spawn(async move {
            proxy
                .send(
                    "POST",
                    "/slow/1500",
                    &[
                        ("idempotency-key", key.as_str()),
                        ("authorization", "Bearer one"),
                    ],
                    Some("{}"),
                )
                .await
        })
    };
    // Wait until the first request reached the origin.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while upstream.started(&slow_key) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never reached the origin"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused_key = fresh_key();
    let res = proxy
        .send(
            "POST",
            "/ok",
            &[
                ("idempotency-key", refused_key.as_str()),
                ("authorization", "Bearer one"),
            ],
            Some("{}"),
        )
        .await;
    // The proxy's lease: the upstream timeout (30 s) plus 5.
    assert_limited(&res, 35);
    assert_eq!(
        upstream.started(&refused_key),
        0,
        "a 429 is never forwarded"
    );
    let other = proxy
        .send(
            "POST",
            "/ok",
            &[
                ("idempotency-key", refused_key.as_str()),
                ("authorization", "Bearer two"),
            ],
            Some("{}"),
        )
        .await;
    assert_eq!(
        other.status, 201,
        "another credential is another tenant: {}",
        other.text
    );
    assert_eq!(holder.await.expect("task").status, 201);
    // The slot is free again once the first request is stored.
    let again = proxy
        .send(
            "POST",
            "/ok",
            &[
                ("idempotency-key", fresh_key().as_str()),
                ("authorization", "Bearer one"),
            ],
            Some("{}"),
        )
        .await;
    assert_eq!(again.status, 201, "{}", again.text);
    let (status, policy) = proxy.admin_get("/v1/policy").await;
    assert_eq!(status, 200);
    let policy: Value = serde_json::from_str(&policy).expect("policy JSON");
    assert_eq!(policy["tenant_limits"]["max_in_flight_keys"], 1);
    assert_eq!(policy["stored_response"]["sealed_at_rest"], false);
}
