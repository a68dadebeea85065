//! Unknown outcomes held, and operators who settle them (docs/operations.md,
//! “Operators: stuck keys”): the reservation API's `on_lease_expiry`, the
//! layer's default `hold` and its takeover's `Idempotency-Attempt`, the proxy's
//! key whose upstream hung up after acting, and the admin endpoints that list,
//! show and resolve such keys — on both stores.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use common::app::{TestApp, TestResponse, fresh_key};
use common::backend::Backend;
use common::proxy::ProxyProcess;
use http::Request;
use http_body_util::BodyExt;
use idemgate::engine::{Engine, Limits, ReserveOutcome, ReserveRequest};
use idemgate::layer::LayerPolicy;
use idemgate::store::LeaseExpiry;
use idemgate::{IdempotencyLayer, LeaseExpiry as RootLeaseExpiry};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

fn hash_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

fn reserve_body(extra: Value) -> String {
    let mut body = json!({"fingerprint": "fp"});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body.to_string()
}

// === the reservation API ===

/// Reserved with `hold`, a key past its lease without news is `409
/// outcome-unknown` (no `Retry-After`: waiting will not settle it) to every
/// reserve, and its holder's late commit, release or extend still applies.
async fn a_held_key_past_its_lease_waits_for_its_holder(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
    let held = reserve_body(json!({"lease_seconds": 1, "on_lease_expiry": "hold"}));

    // The late commit settles it: a replay.
    let key = fresh_key();
    let first = app.reserve(&key, &held).await;
    assert_eq!(first.status, 201, "{first:#?}");
    let id = first.reservation_id();
    app.reserve(&key, &held)
        .await
        .assert_problem(409, "request-in-flight");
    TestApp::outlive(1).await;
    let unknown = app.reserve(&key, &held).await;
    unknown.assert_problem(409, "outcome-unknown");
    assert!(unknown.headers.get("retry-after").is_none(), "{unknown:#?}");
    assert!(unknown.body.get("retry_after_seconds").is_none());
    // Another payload is still a reuse of the key.
    app.reserve(&key, &reserve_body(json!({"fingerprint": "other"})))
        .await
        .assert_problem(422, "key-reused");
    let view = app
        .send("GET", &format!("/v1/reservations/{id}"), &[], None)
        .await;
    assert_eq!(view.body["state"], "unknown", "{view:#?}");
    assert_eq!(view.body["live"], true, "its holder may still settle it");
    let commit = app
        .act(&id, "commit", r#"{"status":201,"body":"late"}"#)
        .await;
    assert_eq!(commit.status, 200, "{commit:#?}");
    let replay = app.reserve(&key, &held).await;
    assert_eq!(replay.status, 200, "{replay:#?}");
    assert_eq!(replay.body["response"]["body"], "late");

    // The late release: the key is new again.
    let key = fresh_key();
    let id = app.reserve(&key, &held).await.reservation_id();
    TestApp::outlive(1).await;
    app.reserve(&key, &held)
        .await
        .assert_problem(409, "outcome-unknown");
    assert_eq!(app.act(&id, "release", "").await.status, 204);
    let again = app.reserve(&key, &held).await;
    assert_eq!(
        (again.status.as_u16(), again.body["attempt"].clone()),
        (201, json!(1))
    );

    // The late extend: its holder is alive after all, and holds it again.
    let key = fresh_key();
    let id = app.reserve(&key, &held).await.reservation_id();
    TestApp::outlive(1).await;
    let extended = app.act(&id, "extend", r#"{"lease_seconds":30}"#).await;
    assert_eq!(extended.status, 200, "{extended:#?}");
    app.reserve(&key, &held)
        .await
        .assert_problem(409, "request-in-flight");
}

/// The reservation API keeps `takeover` unless asked (its holder gets the
/// recovery point), and refuses a choice it does not know.
async fn the_reservation_api_takes_over_by_default(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
    let key = fresh_key();
    let body = reserve_body(json!({"lease_seconds": 1}));
    assert_eq!(app.reserve(&key, &body).await.status, 201);
    TestApp::outlive(1).await;
    let taken = app.reserve(&key, &body).await;
    assert_eq!(taken.status, 201, "{taken:#?}");
    assert_eq!(taken.body["attempt"], 2);
    app.reserve(&fresh_key(), r#"{"on_lease_expiry":"retry"}"#)
        .await
        .assert_problem(400, "invalid-request");
    let policy = app.send("GET", "/v1/policy", &[], None).await;
    assert_eq!(policy.body["on_lease_expiry"]["default"], "takeover");
    assert_eq!(policy.body["default_wait_seconds"], 0);
}

/// A caller waiting on a key (`Prefer: wait`) is told as soon as the key
/// becomes unknown, not at the end of its wait.
async fn a_waiter_is_told_at_once_when_the_key_becomes_unknown(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
    let key = fresh_key();
    let held = reserve_body(json!({"lease_seconds": 2, "on_lease_expiry": "hold"}));
    assert_eq!(app.reserve(&key, &held).await.status, 201);
    let asked = Instant::now();
    let waited = app
        .send(
            "POST",
            "/v1/reservations",
            &[("idempotency-key", &key), ("prefer", "wait=10")],
            Some(&held),
        )
        .await;
    waited.assert_problem(409, "outcome-unknown");
    let took = asked.elapsed();
    assert!(
        took >= Duration::from_millis(1_500) && took < Duration::from_secs(4),
        "told {took:?} after asking; the lease ended at 2 s"
    );
}

// === operators ===

async fn admin(
    app: &TestApp,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: Option<Value>,
) -> TestResponse {
    let headers: Vec<(&str, &str)> = auth.map(|a| ("authorization", a)).into_iter().collect();
    let body = body.map(|b| b.to_string());
    app.send(method, path, &headers, body.as_deref()).await
}

/// Four keys — completed, in flight, unknown, in flight past its lease under
/// takeover — listed by state, tenant, age and page; shown one by one;
/// resolved only when stuck: completed with the response that happened
/// (every retry replays it) or released (the next request executes).
async fn operators_list_show_and_resolve_stuck_keys(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
    let (done, live, held, lapsed) = (fresh_key(), fresh_key(), fresh_key(), fresh_key());
    let id = app
        .reserve(&done, &reserve_body(json!({})))
        .await
        .reservation_id();
    assert_eq!(
        app.act(&id, "commit", r#"{"status":200,"body":"ok"}"#)
            .await
            .status,
        200
    );
    let held_body = reserve_body(json!({"lease_seconds": 1, "on_lease_expiry": "hold"}));
    let lapsed_body = reserve_body(json!({"lease_seconds": 1}));
    // The listing is oldest first, and SQLite keeps a key's creation to the
    // millisecond: two keys made within one would be ordered by their
    // hashes, so each is made in a millisecond of its own.
    let next_millisecond = || tokio::time::sleep(Duration::from_millis(3));
    next_millisecond().await;
    assert_eq!(app.reserve(&held, &held_body).await.status, 201);
    next_millisecond().await;
    assert_eq!(app.reserve(&lapsed, &lapsed_body).await.status, 201);
    next_millisecond().await;
    assert_eq!(
        app.reserve(&live, &reserve_body(json!({}))).await.status,
        201
    );
    TestApp::outlive(1).await;
    // What the gauge counts: the held key and the lapsed one, not the
    // completed one nor the one under a live lease.
    assert_eq!(app.store.count_stuck().await.unwrap(), 2);

    let list = |query: &'static str| {
        let app = &app;
        async move {
            let res = admin(app, "GET", &format!("/v1/admin/keys{query}"), None, None).await;
            assert_eq!(res.status, 200, "{query}: {res:#?}");
            res.body
        }
    };
    let hashes = |body: &Value| -> Vec<String> {
        body["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["key_hash"].as_str().unwrap().to_owned())
            .collect()
    };
    let unknown = list("?state=unknown").await;
    assert_eq!(hashes(&unknown), [hash_hex(&held)], "{unknown:#}");
    let view = &unknown["keys"][0];
    assert_eq!(view["state"], "unknown");
    assert_eq!(view["tenant"], "default");
    assert_eq!(view["on_lease_expiry"], "hold");
    assert_eq!(view["attempt"], 1);
    assert!(view["lease_expires_at"].is_string() && view["reservation_id"].is_string());
    assert_eq!(unknown["next"], Value::Null);
    let in_flight = list("?state=in_flight").await;
    assert_eq!(hashes(&in_flight), [hash_hex(&lapsed), hash_hex(&live)]);
    assert_eq!(hashes(&list("?state=completed").await), [hash_hex(&done)]);
    let all = hashes(&list("").await);
    assert_eq!(all.len(), 4, "oldest first: {all:?}");
    assert_eq!(all[0], hash_hex(&done));
    assert!(hashes(&list("?older_than=3600").await).is_empty());
    assert!(hashes(&list("?tenant=nobody").await).is_empty());
    assert_eq!(hashes(&list("?tenant=default&older_than=1").await).len(), 4);
    // Page by page, with the cursor each page hands out.
    let mut paged = Vec::new();
    let mut cursor = None::<String>;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/admin/keys?limit=1&cursor={c}"),
            None => "/v1/admin/keys?limit=1".to_owned(),
        };
        let page = admin(&app, "GET", &path, None, None).await;
        assert_eq!(page.status, 200, "{page:#?}");
        paged.extend(hashes(&page.body));
        match page.body["next"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
        assert!(paged.len() <= 4, "the pages do not end: {paged:?}");
    }
    assert_eq!(paged, all);
    for bad in [
        "?limit=0",
        "?limit=1001",
        "?state=lost",
        "?cursor=nope",
        "?nope=1",
    ] {
        admin(&app, "GET", &format!("/v1/admin/keys{bad}"), None, None)
            .await
            .assert_problem(400, "invalid-request");
    }

    let show = admin(
        &app,
        "GET",
        &format!("/v1/admin/keys/default/{}", hash_hex(&done)),
        None,
        None,
    )
    .await;
    assert_eq!(show.status, 200, "{show:#?}");
    assert_eq!(
        (show.body["state"].clone(), show.body["status"].clone()),
        (json!("completed"), json!(200))
    );
    admin(
        &app,
        "GET",
        &format!("/v1/admin/keys/default/{}", hash_hex(&fresh_key())),
        None,
        None,
    )
    .await
    .assert_problem(404, "not-found");
    admin(&app, "GET", "/v1/admin/keys/default/abc", None, None)
        .await
        .assert_problem(400, "invalid-request");

    let resolve = |key: &str, body: Value| {
        let path = format!("/v1/admin/keys/default/{}/resolve", hash_hex(key));
        let app = &app;
        async move { admin(app, "POST", &path, None, Some(body)).await }
    };
    let complete = json!({
        "action": "complete",
        "reason": "the ledger shows charge ch_9",
        "response": {"status": 201, "headers": [["content-type", "application/json"]], "body": "{\"charge\":\"ch_9\"}"},
    });
    // Not stuck: completed, or in flight under a live lease.
    resolve(&done, complete.clone())
        .await
        .assert_problem(409, "key-not-stuck");
    resolve(&live, complete.clone())
        .await
        .assert_problem(409, "key-not-stuck");
    resolve(&fresh_key(), complete.clone())
        .await
        .assert_problem(404, "not-found");
    for bad in [
        json!({"action": "complete", "reason": "no response"}),
        json!({"action": "release", "reason": "x", "response": {"status": 200}}),
        json!({"action": "release", "reason": " "}),
        json!({"action": "forget", "reason": "x"}),
        json!({"action": "release"}),
    ] {
        resolve(&held, bad.clone())
            .await
            .assert_problem(400, "invalid-request");
    }
    let settled = resolve(&held, complete.clone()).await;
    assert_eq!(settled.status, 200, "{settled:#?}");
    assert_eq!(settled.body["state"], "completed");
    assert_eq!(settled.body["status"], 201);
    assert_eq!(settled.body["resolution"]["action"], "complete");
    assert_eq!(
        settled.body["resolution"]["reason"],
        "the ledger shows charge ch_9"
    );
    assert_eq!(settled.body["resolution"]["by"], "loopback");
    assert!(settled.body["resolution"]["at"].is_string());
    let replay = app.reserve(&held, &held_body).await;
    assert_eq!(replay.status, 200, "{replay:#?}");
    assert_eq!(replay.body["response"]["body"], "{\"charge\":\"ch_9\"}");
    resolve(&held, complete.clone())
        .await
        .assert_problem(409, "key-not-stuck");

    let released = resolve(
        &lapsed,
        json!({"action": "release", "reason": "the charge never happened"}),
    )
    .await;
    assert_eq!(released.status, 200, "{released:#?}");
    assert_eq!(released.body["state"], "released");
    assert_eq!(released.body["resolution"]["action"], "release");
    let fresh = app.reserve(&lapsed, &lapsed_body).await;
    assert_eq!(fresh.status, 201, "{fresh:#?}");
    assert_eq!(fresh.body["attempt"], 1, "a new key, not a takeover");
    assert!(hashes(&list("?state=unknown").await).is_empty());
}

/// With `IDEMGATE_ADMIN_TOKENS`, the operators' endpoints need one of them:
/// none is `401`, a tenant's token `403`; the name of the token used is
/// recorded with the resolution. Without any, on a server with tenant
/// tokens, they answer `403 admin-disabled` (tests/it/admin_access.rs walks
/// every route and caller).
async fn the_admin_endpoints_need_an_admin_token(b: Backend) {
    let app = TestApp::new(
        &b.url(),
        &[
            "--tokens",
            "acme:tenant-secret-1",
            "--admin-tokens",
            "alice:admin-secret-1",
        ],
    )
    .await;
    let key = fresh_key();
    let held = reserve_body(json!({"lease_seconds": 1, "on_lease_expiry": "hold"}));
    assert_eq!(
        app.reserve_as("Bearer tenant-secret-1", &key, &held)
            .await
            .status,
        201
    );
    TestApp::outlive(1).await;
    admin(&app, "GET", "/v1/admin/keys", None, None)
        .await
        .assert_problem(401, "unauthorized");
    admin(&app, "GET", "/v1/admin/keys", Some("Bearer wrong"), None)
        .await
        .assert_problem(401, "unauthorized");
    admin(
        &app,
        "GET",
        "/v1/admin/keys",
        Some("Bearer tenant-secret-1"),
        None,
    )
    .await
    .assert_problem(403, "forbidden");
    let listed = admin(
        &app,
        "GET",
        "/v1/admin/keys?state=unknown",
        Some("Bearer admin-secret-1"),
        None,
    )
    .await;
    assert_eq!(listed.status, 200, "{listed:#?}");
    assert_eq!(listed.body["keys"][0]["tenant"], "acme");
    let path = format!("/v1/admin/keys/acme/{}/resolve", hash_hex(&key));
    let settled = admin(
        &app,
        "POST",
        &path,
        Some("Bearer admin-secret-1"),
        Some(json!({"action": "release", "reason": "refunded by hand"})),
    )
    .await;
    assert_eq!(settled.status, 200, "{settled:#?}");
    assert_eq!(settled.body["resolution"]["by"], "alice");

    let exposed = TestApp::new(
        &b.url(),
        &[
            "--tokens",
            "acme:tenant-secret-1",
            "--listen",
            "0.0.0.0:8080",
        ],
    )
    .await;
    admin(&exposed, "GET", "/v1/admin/keys", None, None)
        .await
        .assert_problem(403, "admin-disabled");
}

// === the layer ===

/// An engine over `b`'s store that reserves `key` as a holder that then
/// dies: its lease of 1 s ends without news.
async fn a_dead_holder(b: &Backend, key: &str, choice: LeaseExpiry) {
    let engine = Engine::new(b.open().await, Limits::default());
    let reserved = engine
        .reserve(&ReserveRequest {
            tenant: "anonymous".into(),
            tenant_from_credential: false,
            key_hash: Sha256::digest(key.as_bytes()).into(),
            fingerprint: None,
            lease_seconds: 1,
            ttl_seconds: 60,
            wait: None,
            on_lease_expiry: choice,
            request: None,
        })
        .await
        .unwrap();
    assert!(matches!(reserved, ReserveOutcome::Reserved(_)));
}

/// The layer holds by default: a key whose holder died is never run again;
/// with `on_lease_expiry(Takeover)` it is, and the inner service is told
/// `Idempotency-Attempt: 2`. A client's own `Idempotency-Attempt` is never
/// passed on.
async fn the_layer_holds_by_default_and_a_takeover_says_its_attempt(b: Backend) {
    common::logs::init();
    let calls = Arc::new(AtomicUsize::new(0));
    let layer_over = |policy: LayerPolicy| {
        let calls = calls.clone();
        let store = b.open();
        async move {
            let engine = Arc::new(Engine::new(store.await, Limits::default()));
            axum::Router::new()
                .route(
                    "/charge",
                    axum::routing::post(move |headers: http::HeaderMap| {
                        let calls = calls.clone();
                        async move {
                            calls.fetch_add(1, Ordering::SeqCst);
                            let attempt = headers
                                .get("idempotency-attempt")
                                .map(|v| v.to_str().unwrap().to_owned());
                            axum::Json(json!({ "attempt": attempt }))
                        }
                    }),
                )
                .layer(IdempotencyLayer::new(engine, policy))
        }
    };
    let post = |app: axum::Router, key: String, attempt: Option<&'static str>| async move {
        let mut req = Request::post("/charge").header("idempotency-key", key);
        if let Some(a) = attempt {
            req = req.header("idempotency-attempt", a);
        }
        let res = app.oneshot(req.body(Body::empty()).unwrap()).await.unwrap();
        let status = res.status().as_u16();
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice::<Value>(&bytes).unwrap())
    };

    let holding = layer_over(LayerPolicy::default()).await;
    assert_eq!(
        LayerPolicy::default().on_lease_expiry,
        RootLeaseExpiry::Hold
    );
    let key = fresh_key();
    a_dead_holder(&b, &key, LeaseExpiry::Hold).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let (status, body) = post(holding.clone(), key.clone(), None).await;
    assert_eq!(status, 409, "{body}");
    assert!(body["type"].as_str().unwrap().ends_with("/outcome-unknown"));
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    let taking = layer_over(LayerPolicy::default().on_lease_expiry(LeaseExpiry::Takeover)).await;
    let key = fresh_key();
    a_dead_holder(&b, &key, LeaseExpiry::Takeover).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let (status, body) = post(taking.clone(), key.clone(), Some("7")).await;
    assert_eq!((status, body["attempt"].clone()), (200, json!("2")));
    let (status, body) = post(taking.clone(), fresh_key(), Some("7")).await;
    assert_eq!(
        (status, body["attempt"].clone()),
        (200, Value::Null),
        "a first attempt says none, whatever the client sent"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

// === the proxy ===

/// An origin that acts, then hangs up without an answer; it counts its
/// executions.
async fn hang_up_origin() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let acted = count.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let acted = acted.clone();
            tokio::spawn(async move {
                let mut buf = vec![0; 8192];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                acted.fetch_add(1, Ordering::SeqCst);
                let _ = conn.shutdown().await;
            });
        }
    });
    (format!("http://{addr}"), count)
}

/// A proxy whose upstream hung up after acting holds the key (`hold`, the
/// default): the retry is `409 outcome-unknown`, never a second execution;
/// the admin listener lists it (with its admin token), an operator
/// completes it with what happened, and the retry replays that; the gauge
/// `idemgate_keys_unknown` counts it on each pruning pass. A process of its
/// own, for the gauge is the process's.
async fn a_key_whose_upstream_hung_up_waits_for_an_operator(b: Backend) {
    let (origin, acted) = hang_up_origin().await;
    let mut proxy = ProxyProcess::start_at(
        &b.url(),
        &origin,
        &[
            "--admin-tokens",
            "ops:proxy-admin-secret",
            "--prune-interval",
            "1",
        ],
    )
    .await;
    common::bin::drain_stderr(&mut proxy.child);
    let http = common::http();
    let base = proxy.base();
    let admin_base = format!("http://127.0.0.1:{}", proxy.admin);
    let policy: Value = http
        .get(format!("{admin_base}/v1/policy"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(policy["on_lease_expiry"]["default"], "hold", "{policy:#}");
    assert_eq!(policy["default_wait_seconds"], 10, "{policy:#}");
    let key = fresh_key();
    let post = || {
        http.post(format!("{base}/charge"))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(r#"{"amount":5}"#)
            .send()
    };
    let first = post().await.unwrap();
    assert_eq!(first.status(), 502);
    let retry = post().await.unwrap();
    assert_eq!(retry.status(), 409);
    assert!(retry.headers().get("retry-after").is_none());
    let retry: Value = retry.json().await.unwrap();
    assert!(
        retry["type"]
            .as_str()
            .unwrap()
            .ends_with("/outcome-unknown"),
        "{retry}"
    );
    assert_eq!(acted.load(Ordering::SeqCst), 1, "never sent upstream again");

    let admin = |method: reqwest::Method, path: &str, auth: bool, body: Option<Value>| {
        let mut req = http.request(method, format!("{admin_base}{path}"));
        if auth {
            req = req.header("authorization", "Bearer proxy-admin-secret");
        }
        if let Some(body) = body {
            req = req.json(&body);
        }
        async move {
            let res = req.send().await.unwrap();
            (
                res.status().as_u16(),
                res.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let (status, _) = admin(reqwest::Method::GET, "/v1/admin/keys", false, None).await;
    assert_eq!(status, 401);
    let (status, listed) = admin(
        reqwest::Method::GET,
        "/v1/admin/keys?state=unknown",
        true,
        None,
    )
    .await;
    assert_eq!(status, 200, "{listed}");
    let keys = listed["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 1, "{listed}");
    assert_eq!(keys[0]["tenant"], "anonymous");
    assert_eq!(keys[0]["key_hash"], hash_hex(&key));

    let gauge = || async {
        let text = http
            .get(format!("{admin_base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("idemgate_keys_unknown "))
            .map(|v| v.trim().to_owned())
    };
    let started = Instant::now();
    while gauge().await.as_deref() != Some("1") {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the gauge never said 1"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let path = format!("/v1/admin/keys/anonymous/{}/resolve", hash_hex(&key));
    let (status, settled) = admin(
        reqwest::Method::POST,
        &path,
        true,
        Some(json!({
            "action": "complete",
            "reason": "the origin's log shows the charge",
            "response": {"status": 201, "headers": [["content-type", "application/json"]], "body": "{\"charge\":\"ch_1\"}"},
        })),
    )
    .await;
    assert_eq!(status, 200, "{settled}");
    assert_eq!(settled["resolution"]["by"], "ops");
    let replay = post().await.unwrap();
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let replay: Value = replay.json().await.unwrap();
    assert_eq!(replay["charge"], "ch_1");
    assert_eq!(acted.load(Ordering::SeqCst), 1);
    let started = Instant::now();
    while gauge().await.as_deref() != Some("0") {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the gauge never fell to 0"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A proxy cut off from its database for longer than the lease, while the
/// origin answers its call: the client gets the origin's answer, the
/// commit is retried in the background, and the key, held meanwhile (every
/// other proxy would answer `409 outcome-unknown`), becomes a replay once
/// the database is back — where a takeover would have lost the answer and
/// run the origin again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_deferred_past_the_lease_turns_the_held_key_into_a_replay() {
    use common::pg::TempCluster;
    use common::upstream::Upstream;

    let cluster = TempCluster::start().await.expect("a private PostgreSQL");
    let upstream = Upstream::start_numbered().await;
    let mut cut_off = ProxyProcess::start_at(
        &cluster.url(),
        &upstream.url(),
        &["--upstream-timeout", "1", "--db-acquire-timeout", "1"],
    )
    .await;
    let log = common::bin::drain_stderr(&mut cut_off.child);
    let http = common::http();
    let key = fresh_key();
    let post = |base: String| {
        http.post(format!("{base}/numbered/800"))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body("{}")
            .send()
    };
    let first = tokio::spawn(post(cut_off.base()));
    let started = Instant::now();
    while upstream.started(&key) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never forwarded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cluster.stop().await.expect("stop");
    let first = first.await.unwrap().expect("the proxy answers");
    assert_eq!(
        first.status(),
        201,
        "the origin's answer reaches its client"
    );
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["execution"], 1);
    // Past the lease (the upstream timeout + 5 s) with the database away.
    tokio::time::sleep(Duration::from_secs(7)).await;
    cluster.restart().await.expect("restart");

    let other = ProxyProcess::start_at(
        &cluster.url(),
        &upstream.url(),
        &["--upstream-timeout", "1"],
    )
    .await;
    let started = Instant::now();
    let replay = loop {
        let res = post(other.base()).await.unwrap();
        let status = res.status().as_u16();
        let body: Value = res.json().await.unwrap();
        if status == 201 {
            break body;
        }
        assert_eq!(status, 409, "{body}");
        assert!(
            body["type"].as_str().unwrap().ends_with("/outcome-unknown"),
            "held, not in flight: {body}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the deferred commit never landed:\n{}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(replay, first, "the first answer, replayed");
    assert_eq!(upstream.started(&key), 1, "the origin ran once");
    assert!(log.lock().unwrap().contains("the deferred commit landed"));
}

/// The migration that brings unknown outcomes, applied to a database the
/// previous version wrote: its records keep their meaning — an in-flight
/// key whose lease ended is taken over as before (`takeover`), a completed
/// one replays.
async fn an_upgrade_keeps_what_existing_records_meant(b: Backend) {
    use std::borrow::Cow;

    const BRINGS_UNKNOWN: i64 = 20261204000001;
    let dir = match b {
        Backend::Postgres(_) => "postgres",
        Backend::Sqlite(_) => "sqlite",
    };
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("migrations")
        .join(dir);
    let mut older = sqlx::migrate::Migrator::new(path)
        .await
        .expect("the migrations");
    older.migrations = Cow::Owned(
        older
            .migrations
            .iter()
            .filter(|m| m.version < BRINGS_UNKNOWN)
            .cloned()
            .collect(),
    );
    let (lapsed, done) = (fresh_key(), fresh_key());
    let lapsed_hash = Sha256::digest(lapsed.as_bytes()).to_vec();
    let done_hash = Sha256::digest(done.as_bytes()).to_vec();
    match &b {
        Backend::Postgres(db) => {
            let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
            older.run(&pool).await.expect("the older migrations");
            sqlx::query(
                "INSERT INTO idempotency_keys
                     (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at,
                      attempt, response_status, response_headers, response_body, created_at,
                      completed_at, expires_at)
                 VALUES ('t', $1, NULL, 'in_flight', gen_random_uuid(), now() - interval '1 minute',
                         1, NULL, NULL, NULL, now() - interval '2 minutes', NULL, now() + interval '1 hour'),
                        ('t', $2, NULL, 'completed', gen_random_uuid(), NULL,
                         1, 200, '[]', 'old', now() - interval '2 minutes', now(), now() + interval '1 hour')",
            )
            .bind(&lapsed_hash)
            .bind(&done_hash)
            .execute(&pool)
            .await
            .unwrap();
            sqlx::query(
                "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
                 SELECT tenant, reservation_id, key_hash FROM idempotency_keys",
            )
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
        }
        Backend::Sqlite(_) => {
            let pool = sqlx::SqlitePool::connect(&format!("{}?mode=rwc", b.url()))
                .await
                .unwrap();
            older.run(&pool).await.expect("the older migrations");
            let now = chrono::Utc::now().timestamp_millis();
            // A trigger writes each record's reservation row.
            sqlx::query(
                "INSERT INTO idempotency_keys
                     (tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at,
                      attempt, response_status, response_headers, response_body, created_at,
                      completed_at, expires_at)
                 VALUES ('t', ?1, NULL, 'in_flight', '00000000-0000-4000-8000-000000000001', ?3 - 60000,
                         1, NULL, NULL, NULL, ?3 - 120000, NULL, ?3 + 3600000),
                        ('t', ?2, NULL, 'completed', '00000000-0000-4000-8000-000000000002', NULL,
                         1, 200, '[]', X'6f6c64', ?3 - 120000, ?3, ?3 + 3600000)",
            )
            .bind(&lapsed_hash)
            .bind(&done_hash)
            .bind(now)
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
        }
    }

    let engine = b.engine().await;
    let request = |key_hash: &[u8]| ReserveRequest {
        tenant: "t".into(),
        tenant_from_credential: false,
        key_hash: key_hash.try_into().unwrap(),
        fingerprint: None,
        lease_seconds: 30,
        ttl_seconds: 60,
        wait: None,
        on_lease_expiry: LeaseExpiry::Hold,
        request: None,
    };
    match engine.reserve(&request(&lapsed_hash)).await.unwrap() {
        ReserveOutcome::Reserved(r) => assert_eq!(r.attempt, 2, "taken over, as it was meant"),
        other => panic!("the lapsed key was not taken over: {other:?}"),
    }
    match engine.reserve(&request(&done_hash)).await.unwrap() {
        ReserveOutcome::Completed(record) => {
            assert_eq!(record.response.unwrap().body, &b"old"[..]);
            assert_eq!(record.on_lease_expiry, LeaseExpiry::Takeover);
            assert!(record.resolution.is_none());
        }
        other => panic!("the completed key does not replay: {other:?}"),
    }
}

/// A client that hangs up while its key is being claimed drops only its
/// wait: the claim, and the call it won, run on, so the key is not left
/// held for a request that never ran; the retry gets the one execution.
async fn a_client_gone_during_the_claim_leaves_no_orphan(b: Backend) {
    common::logs::init();
    let mut faulty = common::faulty::Faulty::new(b.open().await);
    faulty.claim_delay = Duration::from_millis(500);
    let engine = Arc::new(Engine::new(Arc::new(faulty), Limits::default()));
    let counts = Arc::new(common::upstream::Counts::default());
    let app = common::upstream::router(counts.clone())
        .layer(IdempotencyLayer::new(engine, LayerPolicy::default()));
    let key = fresh_key();
    let post = || {
        Request::post("/ok")
            .header("idempotency-key", &key)
            .body(Body::from("{}"))
            .unwrap()
    };
    let gone = tokio::time::timeout(Duration::from_millis(100), app.clone().oneshot(post())).await;
    assert!(gone.is_err(), "the client hung up during the claim");
    let started = Instant::now();
    while counts.finished(&key) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the call never ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let retry = app.oneshot(post()).await.unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(counts.started(&key), 1);
}

/// A claim that commits but whose answer is lost (the caller is told the
/// store is away, and never learns its reservation id) is released by the
/// engine once the store answers: its key is new again, not held for a
/// request that never ran.
async fn a_claim_whose_answer_was_lost_is_released(b: Backend) {
    let faulty = common::faulty::Faulty::new(b.open().await);
    faulty.lose.store(1, Ordering::SeqCst);
    let engine = Engine::new(Arc::new(faulty), Limits::default()).with_replay_cache(0);
    let request = ReserveRequest {
        tenant: "t".into(),
        tenant_from_credential: false,
        key_hash: Sha256::digest(fresh_key().as_bytes()).into(),
        fingerprint: None,
        lease_seconds: 30,
        ttl_seconds: 600,
        wait: None,
        on_lease_expiry: LeaseExpiry::Hold,
        request: None,
    };
    let lost = engine.reserve(&request).await;
    assert!(matches!(&lost, Err(e) if e.is_unavailable()), "{lost:?}");
    match once_settled(&engine, &request, "the lost claim").await {
        ReserveOutcome::Reserved(r) => assert_eq!(r.attempt, 1, "new again, not a takeover"),
        other => panic!("{other:?}"),
    }
}

/// What a claim of `request` gets once its key is no longer in flight (a
/// lost claim settled by the engine's sweep), within 5 s.
async fn once_settled(engine: &Engine, request: &ReserveRequest, what: &str) -> ReserveOutcome {
    let started = Instant::now();
    loop {
        match engine.reserve(request).await.unwrap() {
            ReserveOutcome::InFlight { .. } => {
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "{what} was never settled"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// A takeover whose answer was lost is not released when the store is
/// back: an earlier attempt may have acted, so a release (which makes the
/// key new) would send the next request upstream as a first attempt. Under
/// `takeover` its lease ends, and the next request is the attempt after it;
/// under `hold` the key is unknown. (The fault campaign found the release:
/// a key executed as attempt 1 twice.)
async fn a_lost_takeover_is_not_released(b: Backend) {
    for on_lease_expiry in [LeaseExpiry::Takeover, LeaseExpiry::Hold] {
        let faulty = Arc::new(common::faulty::Faulty::new(b.open().await));
        let engine = Engine::new(faulty.clone(), Limits::default()).with_replay_cache(0);
        let key = fresh_key();
        let request = |lease_seconds, on_lease_expiry| ReserveRequest {
            tenant: "t".into(),
            tenant_from_credential: false,
            key_hash: Sha256::digest(key.as_bytes()).into(),
            fingerprint: None,
            lease_seconds,
            ttl_seconds: 600,
            wait: None,
            on_lease_expiry,
            request: None,
        };
        // Attempt 1 goes out (and may act), then its holder goes quiet.
        match engine
            .reserve(&request(1, LeaseExpiry::Takeover))
            .await
            .unwrap()
        {
            ReserveOutcome::Reserved(r) => assert_eq!(r.attempt, 1),
            other => panic!("{other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // Attempt 2 takes it over, but its answer is lost.
        faulty.lose.store(1, Ordering::SeqCst);
        let lost = engine.reserve(&request(30, on_lease_expiry)).await;
        assert!(matches!(&lost, Err(e) if e.is_unavailable()), "{lost:?}");
        let what = format!("the lost takeover ({on_lease_expiry:?})");
        match once_settled(&engine, &request(30, on_lease_expiry), &what).await {
            ReserveOutcome::Reserved(r) if on_lease_expiry == LeaseExpiry::Takeover => {
                assert_eq!(
                    r.attempt, 3,
                    "the attempt after the lost takeover, not a first attempt"
                );
            }
            ReserveOutcome::Unknown { record } if on_lease_expiry == LeaseExpiry::Hold => {
                assert_eq!(record.attempt, 2);
            }
            other => panic!("{on_lease_expiry:?}: {other:?}"),
        }
    }
}

/// A holder held up between its claim and its call past its lease (a
/// process paused while its claim's answer waited) does not send its
/// request once another has taken the key over and sent its own: that one
/// would reach the origin after attempt 2, as a first attempt. Its client
/// gets a 409, and the origin the one call. (The fault campaign found it: a
/// proxy stopped with SIGSTOP during a claim sent attempt 1 after attempt 2.)
async fn a_holder_held_up_past_its_lease_does_not_send(b: Backend) {
    common::logs::init();
    let faulty = Arc::new(common::faulty::Faulty {
        late_by: Duration::from_millis(2_500),
        ..common::faulty::Faulty::new(b.open().await)
    });
    faulty.late.store(1, Ordering::SeqCst);
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    // Two processes on one store: the held-up one over `faulty`, the other
    // over the store itself.
    let app = |store: &Arc<dyn idemgate::store::Store>| {
        let seen = calls.clone();
        axum::Router::new()
            .route(
                "/charge",
                axum::routing::post(move |headers: http::HeaderMap| {
                    let attempt = headers
                        .get("idempotency-attempt")
                        .map(|v| v.to_str().unwrap().to_owned());
                    seen.lock().unwrap().push(attempt.clone());
                    async move {
                        (
                            http::StatusCode::CREATED,
                            axum::Json(json!({ "attempt": attempt })),
                        )
                    }
                }),
            )
            .layer(IdempotencyLayer::new(
                Arc::new(Engine::new(store.clone(), Limits::default())),
                LayerPolicy::default()
                    .on_lease_expiry(LeaseExpiry::Takeover)
                    .lease(Duration::from_secs(1)),
            ))
    };
    let key = fresh_key();
    let post = || {
        Request::post("/charge")
            .header("idempotency-key", &key)
            .body(Body::empty())
            .unwrap()
    };
    // Attempt 1's claim applies at once, its answer comes 2.5 s later.
    let held: Arc<dyn idemgate::store::Store> = faulty.clone();
    let held_up = tokio::spawn(app(&held).oneshot(post()));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    // Past its lease: the next request takes the key over, and is sent.
    let takeover = app(&faulty.inner).oneshot(post()).await.unwrap();
    let status = takeover.status();
    let body = takeover.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, 201, "{body:?}");
    let held_up = held_up.await.unwrap().unwrap();
    assert_eq!(held_up.status(), 409, "the key moved on: not sent");
    assert_eq!(
        *calls.lock().unwrap(),
        vec![Some("2".to_owned())],
        "the origin got attempt 2 only"
    );
    let replay = app(&faulty.inner).oneshot(post()).await.unwrap();
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

/// A holder held up past its lease that nobody took the key from sends its
/// request after all, once the store has renewed its lease.
async fn a_holder_held_up_past_its_lease_sends_once_renewed(b: Backend) {
    let (app, counts) = held_up(&b, LeaseExpiry::Takeover, 0).await;
    let key = fresh_key();
    let res = app.oneshot(post_ok(&key)).await.unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(counts.started(&key), 1);
}

/// The layer over a store that answers its first claim 1.5 s late, under a
/// 1 s lease, and fails its first `failed_extends` lease extensions.
async fn held_up(
    b: &Backend,
    on_lease_expiry: LeaseExpiry,
    failed_extends: usize,
) -> (axum::Router, Arc<common::upstream::Counts>) {
    common::logs::init();
    let faulty = common::faulty::Faulty {
        late_by: Duration::from_millis(1_500),
        ..common::faulty::Faulty::new(b.open().await)
    };
    faulty.late.store(1, Ordering::SeqCst);
    faulty
        .refuse_extends
        .store(failed_extends, Ordering::SeqCst);
    let engine = Arc::new(Engine::new(Arc::new(faulty), Limits::default()));
    let counts = Arc::new(common::upstream::Counts::default());
    let app = common::upstream::router(counts.clone()).layer(IdempotencyLayer::new(
        engine,
        LayerPolicy::default()
            .on_lease_expiry(on_lease_expiry)
            .lease(Duration::from_secs(1))
            .default_wait(None),
    ));
    (app, counts)
}

fn post_ok(key: &str) -> Request<Body> {
    Request::post("/ok")
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .unwrap()
}

/// A holder held up past its lease that cannot reach the store to renew it
/// does not send its request, and does not leave its key held for it
/// either: once the store is back the engine releases the claim (a first
/// attempt), and the retry runs the request once.
async fn a_holder_held_up_while_the_store_is_away_leaves_no_held_key(b: Backend) {
    let (app, counts) = held_up(&b, LeaseExpiry::Hold, 1).await;
    let key = fresh_key();
    let post = || post_ok(&key);
    let res = app.clone().oneshot(post()).await.unwrap();
    assert_eq!(res.status(), 503, "not sent while the store is away");
    assert_eq!(counts.started(&key), 0);
    // Under hold, a key left in flight past its lease would be unknown:
    // the engine releases it instead, for its request never went out.
    let started = Instant::now();
    loop {
        let res = app.clone().oneshot(post()).await.unwrap();
        if res.status() == 201 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the unsent claim was never settled: {}",
            res.status()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(counts.started(&key), 1);
}

/// Under `takeover`, a takeover whose call did not act (the origin answered
/// a release status) does not forget that an earlier attempt may have: the
/// next request is sent as attempt 3, not as a first attempt.
async fn a_takeover_that_did_not_act_leaves_the_key_to_the_next_attempt(b: Backend) {
    common::logs::init();
    let calls = Arc::new(AtomicUsize::new(0));
    let engine = Arc::new(Engine::new(b.open().await, Limits::default()));
    let seen = calls.clone();
    let app = axum::Router::new()
        .route(
            "/charge",
            axum::routing::post(move |headers: http::HeaderMap| {
                let n = seen.fetch_add(1, Ordering::SeqCst);
                let attempt = headers
                    .get("idempotency-attempt")
                    .map(|v| v.to_str().unwrap().to_owned());
                async move {
                    let status = if n == 0 {
                        http::StatusCode::SERVICE_UNAVAILABLE
                    } else {
                        http::StatusCode::OK
                    };
                    (status, axum::Json(json!({ "attempt": attempt })))
                }
            }),
        )
        .layer(IdempotencyLayer::new(
            engine,
            LayerPolicy::default().on_lease_expiry(LeaseExpiry::Takeover),
        ));
    let key = fresh_key();
    a_dead_holder(&b, &key, LeaseExpiry::Takeover).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let post = || {
        Request::post("/charge")
            .header("idempotency-key", &key)
            .body(Body::empty())
            .unwrap()
    };
    let read = |res: http::Response<Body>| async move {
        let status = res.status().as_u16();
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice::<Value>(&bytes).unwrap())
    };
    let (status, body) = read(app.clone().oneshot(post()).await.unwrap()).await;
    assert_eq!((status, body["attempt"].clone()), (503, json!("2")));
    let (status, body) = read(app.clone().oneshot(post()).await.unwrap()).await;
    assert_eq!(
        (status, body["attempt"].clone()),
        (200, json!("3")),
        "attempt 1 may have acted: the next is attempt 3"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// `POST /v1/reservations/{id}/unknown`: the key is unknown at once, under
/// `takeover` too (a duplicate gets `409 outcome-unknown`, no
/// `Retry-After`); the view keeps why; a missing or empty reason is `400`;
/// the holder's own late commit still settles it.
async fn a_holder_marks_its_key_unknown_at_once(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
    let key = fresh_key();
    let body = reserve_body(json!({}));
    let id = app.reserve(&key, &body).await.reservation_id();
    app.act(&id, "unknown", "{}")
        .await
        .assert_problem(400, "invalid-request");
    app.act(&id, "unknown", r#"{"reason":"  "}"#)
        .await
        .assert_problem(400, "invalid-request");
    let marked = app
        .act(&id, "unknown", r#"{"reason":"ReadTimeout after sending"}"#)
        .await;
    assert_eq!(marked.status, 200, "{marked:#?}");
    assert_eq!(marked.body["state"], "unknown", "{marked:#?}");
    assert_eq!(
        marked.body["marked_unknown"]["reason"],
        "ReadTimeout after sending"
    );
    let dup = app.reserve(&key, &body).await;
    dup.assert_problem(409, "outcome-unknown");
    assert!(dup.headers.get("retry-after").is_none(), "{dup:#?}");
    let commit = app
        .act(&id, "commit", r#"{"status":200,"body":"late"}"#)
        .await;
    assert_eq!(commit.status, 200, "{commit:#?}");
    assert_eq!(app.reserve(&key, &body).await.status, 200);
}

both_stores! {
    serial: [
        an_upgrade_keeps_what_existing_records_meant,
        the_reservation_api_takes_over_by_default,
        operators_list_show_and_resolve_stuck_keys,
        the_admin_endpoints_need_an_admin_token,
    ],
    concurrent: [
        a_holder_marks_its_key_unknown_at_once,
        a_held_key_past_its_lease_waits_for_its_holder,
        a_waiter_is_told_at_once_when_the_key_becomes_unknown,
        the_layer_holds_by_default_and_a_takeover_says_its_attempt,
        a_client_gone_during_the_claim_leaves_no_orphan,
        a_claim_whose_answer_was_lost_is_released,
        a_lost_takeover_is_not_released,
        a_holder_held_up_past_its_lease_does_not_send,
        a_holder_held_up_past_its_lease_sends_once_renewed,
        a_holder_held_up_while_the_store_is_away_leaves_no_held_key,
        a_takeover_that_did_not_act_leaves_the_key_to_the_next_attempt,
        a_key_whose_upstream_hung_up_waits_for_an_operator,
    ],
}
