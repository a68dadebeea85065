//! The reverse proxy (docs/proxy.md) on real sockets, in front of the counting
//! origin (`common::upstream`), over a real PostgreSQL database. Every test
//! asserts how often the origin ran, not only what the client saw.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::app::fresh_key;
use common::pg::{TempCluster, TestDb};
use common::proxy::{ProxyProcess, TestProxy, replayed, setup};
use common::upstream::Upstream;
use idemgate::server::proxy::routes;
use serde_json::Value;
use tokio::sync::Barrier;

// === docs/proxy.md, bullet by bullet ===

#[tokio::test]
async fn a_new_key_executes_once_and_its_retry_is_replayed() {
    let (_db, upstream, proxy) = setup(&[]).await;
    let key = fresh_key();
    let first = proxy
        .send(
            "POST",
            "/ok",
            &[
                ("idempotency-key", &key),
                ("content-type", "application/json"),
                ("authorization", "Bearer proxy-test-secret-token"),
            ],
            Some(r#"{"amount":500,"currency":"eur"}"#),
        )
        .await;
    assert_eq!(first.status, 201, "{first:#?}");
    assert!(!replayed(&first));
    assert!(first.headers.contains_key("idempotency-expires"));
    assert!(
        first.headers.contains_key("set-cookie"),
        "the first caller gets its cookie"
    );
    for hop in ["keep-alive", "x-hop", "connection"] {
        assert!(
            !first.headers.contains_key(hop),
            "{hop} passed to the client"
        );
    }
    assert_eq!(first.body["body"], r#"{"amount":500,"currency":"eur"}"#);

    let retry = proxy
        .send(
            "POST",
            "/ok",
            &[
                ("idempotency-key", &key),
                ("content-type", "application/json"),
                ("authorization", "Bearer proxy-test-secret-token"),
            ],
            Some(r#"{ "currency": "eur", "amount": 500 }"#),
        )
        .await;
    assert_eq!(retry.status, 201);
    assert!(replayed(&retry), "{retry:#?}");
    let expires = httpdate::parse_http_date(retry.header("idempotency-expires")).unwrap();
    assert!(expires > std::time::SystemTime::now() + Duration::from_secs(86_000));
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("x-origin"), "yes");
    for absent in ["set-cookie", "www-authenticate", "keep-alive", "x-hop"] {
        assert!(!retry.headers.contains_key(absent), "{absent} replayed");
    }
    assert_eq!(upstream.started(&key), 1);

    // Another payload: 422, and the origin is not called.
    proxy
        .send(
            "POST",
            "/ok",
            &[
                ("idempotency-key", &key),
                ("content-type", "application/json"),
                ("authorization", "Bearer proxy-test-secret-token"),
            ],
            Some(r#"{"amount":9999}"#),
        )
        .await
        .assert_problem(422, "key-reused");
    // Another credential is another tenant: the key is new there.
    let other = proxy
        .send(
            "POST",
            "/ok",
            &[
                ("idempotency-key", &key),
                ("authorization", "Bearer another-secret-token"),
            ],
            Some(r#"{"amount":9999}"#),
        )
        .await;
    assert_eq!(other.status, 201);
    assert!(!replayed(&other));
    assert_eq!(upstream.started(&key), 2);
}

#[tokio::test]
async fn release_statuses_are_returned_not_stored_and_500_is_stored() {
    let (_db, upstream, proxy) = setup(&[]).await;
    for code in [408u16, 425, 429, 503] {
        let key = fresh_key();
        let path = format!("/status/{code}");
        assert_eq!(proxy.post(&path, &key, "{}").await.status.as_u16(), code);
        let retry = proxy.post(&path, &key, "{}").await;
        assert_eq!(retry.status.as_u16(), code);
        assert!(!replayed(&retry));
        assert_eq!(
            upstream.started(&key),
            2,
            "{code}: the retry executes again"
        );
    }
    let key = fresh_key();
    assert_eq!(proxy.post("/status/500", &key, "{}").await.status, 500);
    let retry = proxy.post("/status/500", &key, "{}").await;
    assert_eq!(retry.status, 500);
    assert!(replayed(&retry));
    assert_eq!(upstream.started(&key), 1, "a 500 is stored, as Stripe does");
}

#[tokio::test]
async fn a_request_body_over_the_limit_is_413_and_never_forwarded() {
    let (_db, upstream, proxy) = setup(&["--max-body-bytes", "1024"]).await;
    let key = fresh_key();
    let body = format!(r#"{{"pad":"{}"}}"#, "x".repeat(2000));
    proxy
        .post("/ok", &key, &body)
        .await
        .assert_problem(413, "payload-too-large");
    assert_eq!(upstream.total(), 0);
    // The key was never reserved: a fitting request executes.
    assert_eq!(proxy.post("/ok", &key, "{}").await.status, 201);
    assert_eq!(upstream.started(&key), 1);
}

#[tokio::test]
async fn a_response_body_over_the_limit_passes_through_and_is_replayed_empty() {
    let (_db, upstream, proxy) = setup(&["--max-body-bytes", "1024"]).await;
    let key = fresh_key();
    let first = proxy.post("/big/5000", &key, "{}").await;
    assert_eq!(first.status, 200);
    assert_eq!(first.text.len(), 5000);
    let retry = proxy.post("/big/5000", &key, "{}").await;
    assert_eq!(retry.status, 200);
    assert!(replayed(&retry));
    assert_eq!(retry.header("idempotency-body-omitted"), "true");
    assert!(retry.headers.contains_key("idempotency-expires"));
    assert_eq!(retry.header("content-type"), "text/plain");
    assert_eq!(retry.text, "");
    assert_eq!(upstream.started(&key), 1, "never a second execution");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_does_not_cancel_the_upstream_call() {
    let (_db, upstream, proxy) = setup(&[]).await;
    let proxy = Arc::new(proxy);
    let key = fresh_key();
    let client = {
        let (proxy, key) = (proxy.clone(), key.clone());
        tokio::spawn(async move { proxy.post("/slow/1000", &key, "{}").await })
    };
    // Hang up once the origin is working on it.
    for _ in 0..200 {
        if upstream.started(&key) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(upstream.started(&key), 1);
    client.abort();
    assert!(
        client.await.unwrap_err().is_cancelled(),
        "the client hung up mid-flight"
    );
    assert_eq!(upstream.finished(&key), 0, "the origin was still working");

    // The retry waits for the first call and gets its stored response.
    let retry = proxy
        .send(
            "POST",
            "/slow/1000",
            &[
                ("idempotency-key", &key),
                ("content-type", "application/json"),
                ("prefer", "wait=5"),
            ],
            Some("{}"),
        )
        .await;
    assert_eq!(retry.status, 201, "{retry:#?}");
    assert!(replayed(&retry));
    assert_eq!(
        upstream.finished(&key),
        1,
        "the upstream call ran to its end"
    );
    assert_eq!(upstream.started(&key), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_down_is_503_and_nothing_guarded_is_forwarded() {
    let cluster = TempCluster::start().await.expect("a private PostgreSQL");
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(
        &cluster.url(),
        &upstream.url(),
        &["--db-acquire-timeout", "1"],
        Vec::new(),
    )
    .await;
    let before = fresh_key();
    assert_eq!(proxy.post("/ok", &before, "{}").await.status, 201);

    // A request whose origin answers while the database is going away: the
    // client still gets the answer, and the commit lands later.
    let during = fresh_key();
    let slow = {
        let (http, url, key) = (
            proxy.http.clone(),
            format!("{}/slow/1500", proxy.base),
            during.clone(),
        );
        proxy.secrets.lock().unwrap().push(key.clone());
        tokio::spawn(async move {
            http.post(url)
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body("{}")
                .send()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.stop().await.unwrap();

    let key = fresh_key();
    let res = proxy.post("/ok", &key, "{}").await;
    res.assert_problem(503, "store-unavailable");
    assert!(res.headers.contains_key("retry-after"));
    assert_eq!(upstream.started(&key), 0, "not forwarded unguarded");
    // Unguarded traffic still flows.
    assert_eq!(proxy.send("GET", "/ok", &[], None).await.status, 201);
    let (status, _) = proxy.admin_get("/readyz").await;
    assert_eq!(status, 503);

    let answered = slow.await.unwrap().expect("the origin's answer");
    assert_eq!(
        answered.status(),
        201,
        "the effect happened: the client sees it"
    );
    assert_eq!(upstream.started(&during), 1);

    cluster.restart().await.unwrap();
    let mut retry = proxy.post("/slow/1500", &during, "{}").await;
    for _ in 0..100 {
        if replayed(&retry) {
            break;
        }
        assert!(
            [409, 503].contains(&retry.status.as_u16()),
            "the retry must not execute: {retry:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = proxy.post("/slow/1500", &during, "{}").await;
    }
    assert!(replayed(&retry), "the deferred commit landed: {retry:#?}");
    assert_eq!(upstream.started(&during), 1);
    assert!(replayed(&proxy.post("/ok", &before, "{}").await));
    assert_eq!(upstream.started(&before), 1);
}

#[tokio::test]
async fn an_unreachable_upstream_is_502_and_the_key_is_released() {
    let db = TestDb::new().await;
    let port = common::bin::free_port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let proxy = TestProxy::start(&db.url, &format!("http://{addr}"), &[], Vec::new()).await;
    let key = fresh_key();
    proxy
        .post("/ok", &key, "{}")
        .await
        .assert_problem(502, "upstream-unavailable");
    let upstream = Upstream::start_on(addr).await;
    let retry = proxy.post("/ok", &key, "{}").await;
    assert_eq!(retry.status, 201, "{retry:#?}");
    assert!(
        !replayed(&retry),
        "the key was released: the retry executes"
    );
    assert_eq!(upstream.started(&key), 1);
}

#[tokio::test]
async fn an_upstream_timeout_is_504_and_the_key_stays_in_flight() {
    let (_db, upstream, proxy) = setup(&["--upstream-timeout", "1"]).await;
    let key = fresh_key();
    proxy
        .post("/slow/2500", &key, "{}")
        .await
        .assert_problem(504, "upstream-timeout");
    let retry = proxy.post_now("/slow/2500", &key, "{}").await;
    retry.assert_problem(409, "request-in-flight");
    let wait: u64 = retry.header("retry-after").parse().unwrap();
    assert!((1..=6).contains(&wait), "lease = timeout + 5 s: {wait}");
    // A retry that does not ask otherwise is held for the late answer.
    let waited = proxy.post("/slow/2500", &key, "{}").await;
    assert_eq!(waited.status, 201, "{waited:#?}");
    assert!(replayed(&waited), "{waited:#?}");
    assert_eq!(upstream.started(&key), 1, "no second execution");
}

/// A response stored gzip-encoded (the first request accepted gzip) is
/// decoded for a retry that does not accept it, and replayed as stored to
/// one that does; a response stored plain is plain to every retry.
#[tokio::test]
async fn a_replay_is_decoded_for_a_retry_that_does_not_accept_its_encoding() {
    let (_db, upstream, proxy) = setup(&[]).await;
    let send = |key: String, accept: Option<&'static str>| {
        let proxy = &proxy;
        async move {
            let mut headers = vec![("idempotency-key", key.as_str())];
            if let Some(accept) = accept {
                headers.push(("accept-encoding", accept));
            }
            proxy.send("POST", "/gzip", &headers, Some("{}")).await
        }
    };
    let plain = common::upstream::gzip_doc_text();

    let key = fresh_key();
    let first = send(key.clone(), Some("gzip")).await;
    assert_eq!(first.status, 201, "{first:#?}");
    assert_eq!(first.header("content-encoding"), "gzip");
    assert_ne!(first.text, plain, "the origin sent it encoded");
    for accept in [Some("identity"), None, Some("gzip;q=0, br")] {
        let retry = send(key.clone(), accept).await;
        assert!(replayed(&retry), "{accept:?}: {retry:#?}");
        assert!(
            retry.headers.get("content-encoding").is_none(),
            "{accept:?}: {retry:#?}"
        );
        assert_eq!(retry.text, plain, "{accept:?}: decoded for this retry");
        assert_eq!(retry.header("etag"), "W/\"v1\"", "another representation");
    }
    let as_stored = send(key.clone(), Some("br, gzip")).await;
    assert!(replayed(&as_stored));
    assert_eq!(as_stored.header("content-encoding"), "gzip");
    assert_eq!(as_stored.text, first.text, "replayed as stored");
    assert_eq!(as_stored.header("etag"), "\"v1\"");

    // The other direction: stored plain, plain to a retry that takes gzip.
    let key = fresh_key();
    let first = send(key.clone(), Some("identity")).await;
    assert!(first.headers.get("content-encoding").is_none());
    let retry = send(key.clone(), Some("gzip")).await;
    assert!(replayed(&retry));
    assert!(retry.headers.get("content-encoding").is_none());
    assert_eq!(retry.text, plain);
    assert_eq!(upstream.total(), 2, "each key ran once");
}

#[tokio::test]
async fn a_post_without_a_key_passes_through_unless_the_key_is_required() {
    let (_db, upstream, proxy) = setup(&[]).await;
    for _ in 0..2 {
        assert_eq!(proxy.send("POST", "/ok", &[], Some("{}")).await.status, 201);
    }
    assert_eq!(upstream.total(), 2);

    let (_db, upstream, proxy) = setup(&["--require-key", "true"]).await;
    proxy
        .send("POST", "/ok", &[], Some("{}"))
        .await
        .assert_problem(400, "key-missing");
    proxy
        .send("PATCH", "/ok", &[("idempotency-key", "")], Some("{}"))
        .await
        .assert_problem(400, "key-invalid");
    assert_eq!(upstream.total(), 0, "the upstream never sees them");
}

#[tokio::test]
async fn get_head_put_delete_and_options_pass_through_even_with_a_key() {
    let (_db, upstream, proxy) = setup(&[]).await;
    let key = fresh_key();
    for method in ["GET", "HEAD", "PUT", "DELETE", "OPTIONS"] {
        for _ in 0..2 {
            let res = proxy
                .send(method, "/ok", &[("idempotency-key", &key)], None)
                .await;
            assert_eq!(res.status, 201, "{method}");
            assert!(!replayed(&res));
        }
    }
    assert_eq!(upstream.started(&key), 10, "executed every time");
}

#[tokio::test]
async fn per_route_rules_from_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    std::fs::write(
        &path,
        r#"
[[routes]]
path = "/ok/payments/"
require_key = true

[[routes]]
path = "/ok/*/charges"
ttl_seconds = 1

[[routes]]
path = "/echo/"
methods = ["PUT"]
"#,
    )
    .unwrap();
    let routes = routes::from_file(&path, 604_800).expect("routes");
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&db.url, &upstream.url(), &[], routes).await;

    proxy
        .send("POST", "/ok/payments/1", &[], Some("{}"))
        .await
        .assert_problem(400, "key-missing");
    assert_eq!(upstream.total(), 0);
    assert_eq!(
        proxy
            .send("POST", "/ok/orders/1", &[], Some("{}"))
            .await
            .status,
        201
    );
    assert_eq!(upstream.total(), 1, "required on /ok/payments/ only");

    let key = fresh_key();
    let first = proxy.post("/ok/acme/charges", &key, "{}").await;
    let expires = httpdate::parse_http_date(first.header("idempotency-expires")).unwrap();
    assert!(expires <= std::time::SystemTime::now() + Duration::from_secs(2));
    assert!(replayed(&proxy.post("/ok/acme/charges", &key, "{}").await));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(!replayed(&proxy.post("/ok/acme/charges", &key, "{}").await));
    assert_eq!(upstream.started(&key), 2, "the route's TTL of 1 s");

    let key = fresh_key();
    for _ in 0..2 {
        proxy
            .send("PUT", "/echo/x", &[("idempotency-key", &key)], Some("{}"))
            .await;
        proxy
            .send("POST", "/echo/x", &[("idempotency-key", &key)], Some("{}"))
            .await;
    }
    assert_eq!(upstream.started(&key), 3, "PUT guarded there, POST not");
}

#[tokio::test]
async fn a_route_rule_is_not_dodged_by_spelling_the_path_differently() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    std::fs::write(&path, "[[routes]]\npath = \"/pay\"\nrequire_key = true\n").unwrap();
    let routes = routes::from_file(&path, 604_800).expect("routes");
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&db.url, &upstream.url(), &[], routes).await;

    for target in [
        "/pay",
        "//pay",
        "/x/../pay",
        "/./pay",
        "/%70ay",
        "/%2e%2E/pay",
        "/x//..//pay?via=query",
    ] {
        proxy
            .send_raw("POST", target, &[])
            .await
            .assert_problem(400, "key-missing");
    }
    assert_eq!(upstream.total(), 0, "the upstream never sees them");

    // Matched normalized, forwarded as sent.
    let key = fresh_key();
    let res = proxy
        .send_raw("POST", "/x/../%70ay", &[("idempotency-key", &key)])
        .await;
    assert_eq!(res.status, 200, "{res:#?}");
    assert_eq!(res.text, "upstream /x/../%70ay");
    assert_eq!(upstream.started(&key), 1);

    // `%2F` is not decoded: not the route, so no key needed.
    let res = proxy.send_raw("POST", "/%2Fpay", &[]).await;
    assert_eq!(res.status, 200, "{res:#?}");
    assert_eq!(upstream.total(), 2);
}

#[tokio::test]
async fn forwarded_headers_are_added_and_hop_by_hop_headers_stripped_upstream() {
    let (_db, upstream, proxy) = setup(&[]).await;
    let request = "POST /echo/path?b=2&a=1 HTTP/1.1\r\n\
        Host: shop.example\r\n\
        Connection: close, X-Drop-Me\r\n\
        X-Drop-Me: 1\r\n\
        Keep-Alive: timeout=5\r\n\
        Proxy-Authorization: Basic c2VjcmV0\r\n\
        TE: trailers\r\n\
        Upgrade: h2c\r\n\
        X-Forwarded-For: 203.0.113.7\r\n\
        X-Forwarded-Proto: https\r\n\
        Idempotency-Key: \"forwarded-key-1\"\r\n\
        Content-Type: application/json\r\n\
        Content-Length: 2\r\n\
        \r\n\
        {}";
    proxy.secrets.lock().unwrap().push("forwarded-key-1".into());
    let res = proxy.send_raw_request(request).await;
    assert_eq!(res.status, 200, "{res:#?}");
    let headers = &res.body["headers"];
    for gone in [
        "connection",
        "x-drop-me",
        "keep-alive",
        "proxy-authorization",
        "te",
        "upgrade",
    ] {
        assert!(
            headers.get(gone).is_none(),
            "{gone} went upstream: {headers}"
        );
    }
    assert_eq!(headers["x-forwarded-for"][0], "203.0.113.7, 127.0.0.1");
    assert_eq!(headers["x-forwarded-proto"][0], "http");
    assert_eq!(headers["x-forwarded-host"][0], "shop.example");
    assert_eq!(
        headers["host"][0], "shop.example",
        "the client's Host, by default"
    );
    assert_eq!(
        headers["idempotency-key"][0], "\"forwarded-key-1\"",
        "intact"
    );
    assert_eq!(res.body["uri"], "/echo/path?b=2&a=1");
    assert_eq!(upstream.started("\"forwarded-key-1\""), 1);
}

/// `--preserve-host false`: the upstream gets its own authority as `Host`
/// (and the client's in `X-Forwarded-Host`).
#[tokio::test]
async fn the_upstream_host_is_sent_when_the_clients_is_not_preserved() {
    let (_db, upstream, proxy) = setup(&["--preserve-host", "false"]).await;
    let res = proxy
        .send_raw_request("GET /echo/h HTTP/1.1\r\nHost: shop.example\r\nConnection: close\r\n\r\n")
        .await;
    assert_eq!(res.status, 200, "{res:#?}");
    assert_eq!(res.body["headers"]["host"][0], upstream.addr.to_string());
    assert_eq!(res.body["headers"]["x-forwarded-host"][0], "shop.example");
}

#[tokio::test]
async fn the_admin_listener_serves_the_operational_endpoints() {
    let (_db, upstream, proxy) = setup(&["--key-header", "X-Idempotency-Key"]).await;
    let key = fresh_key();
    proxy.secrets.lock().unwrap().push(key.clone());
    proxy
        .send("POST", "/ok", &[("x-idempotency-key", &key)], Some("{}"))
        .await;
    let (status, body) = proxy.admin_get("/healthz").await;
    assert_eq!((status, body.contains("ok")), (200, true));
    assert_eq!(proxy.admin_get("/readyz").await.0, 200);
    let (status, metrics) = proxy.admin_get("/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains(r#"idemgate_requests_total{mode="proxy",outcome="created"}"#),
        "{metrics}"
    );
    let (status, policy) = proxy.admin_get("/v1/policy").await;
    assert_eq!(status, 200);
    let policy: Value = serde_json::from_str(&policy).unwrap();
    assert_eq!(policy["header"], "X-Idempotency-Key");
    // Every guarded request is fingerprinted: no key goes unchecked.
    assert_eq!(policy["fingerprint"]["required"], true, "{policy}");
    assert_eq!(
        policy["guarded_methods"],
        serde_json::json!(["POST", "PATCH"])
    );
    assert_eq!(
        policy["proxy"]["release_statuses"],
        serde_json::json!([408, 425, 429, 503])
    );
    assert_eq!(policy["lease_seconds"]["default"], 35);
    assert_eq!(
        proxy.admin_get("/ok").await.0,
        404,
        "the admin listener proxies nothing"
    );
    let res = proxy
        .http
        .post(format!("{}/metrics", proxy.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 405);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    assert!(res.text().await.unwrap().contains("method-not-allowed"));

    // On the main listener the same paths belong to the upstream.
    let before = upstream.total();
    for path in ["/healthz", "/readyz", "/metrics", "/v1/policy"] {
        let res = proxy.send("GET", path, &[], None).await;
        assert_eq!(res.text, format!("upstream {path}"));
    }
    assert_eq!(upstream.total(), before + 4);
}

// === concurrency ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_identical_posts_executes_once() {
    let (_db, upstream, proxy) = setup(&[]).await;
    let proxy = Arc::new(proxy);
    let key = fresh_key();
    let n = 100;
    let barrier = Arc::new(Barrier::new(n));
    let mut tasks = Vec::new();
    for i in 0..n {
        let (proxy, key, barrier) = (proxy.clone(), key.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let wait = i % 2 == 0;
            let mut headers = vec![("idempotency-key", key.as_str())];
            if wait {
                headers.push(("prefer", "wait=8"));
            }
            barrier.wait().await;
            let res = proxy.send("POST", "/slow/1000", &headers, Some("{}")).await;
            (wait, res)
        }));
    }
    let (mut executed, mut conflicts, mut replays) = (0, 0, 0);
    for t in tasks {
        let (waited, res) = t.await.unwrap();
        match (res.status.as_u16(), replayed(&res)) {
            (201, false) => executed += 1,
            (201, true) => replays += 1,
            (409, _) if !waited => conflicts += 1,
            other => panic!("unexpected {other:?} (waited: {waited}): {res:#?}"),
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(upstream.started(&key), 1, "the upstream ran exactly once");
    assert!(replays >= n / 2 - 1, "every waiter got the replay");
    assert_eq!(executed + conflicts + replays, n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_on_one_database_execute_once() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let proxies = [
        Arc::new(TestProxy::start(&db.url, &upstream.url(), &[], Vec::new()).await),
        Arc::new(TestProxy::start(&db.url, &upstream.url(), &[], Vec::new()).await),
    ];
    let key = fresh_key();
    let n = 20;
    let barrier = Arc::new(Barrier::new(n));
    let mut tasks = Vec::new();
    for i in 0..n {
        let (proxy, key, barrier) = (proxies[i % 2].clone(), key.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            proxy.post("/slow/500", &key, "{}").await
        }));
    }
    let mut executed = 0;
    for t in tasks {
        let res = t.await.unwrap();
        match (res.status.as_u16(), replayed(&res)) {
            (201, false) => executed += 1,
            (201, true) | (409, _) => {}
            other => panic!("unexpected {other:?}: {res:#?}"),
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(upstream.started(&key), 1);
}

// === the binary, the README and the example file ===

const README: &str = include_str!("../../README.md");
const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/idemgate.example.toml");

/// The ```sh blocks after `heading`, up to the next `## ` heading.
fn sh_blocks_after(heading: &str) -> Vec<&'static str> {
    let from = README.find(heading).expect("heading in README") + heading.len();
    let section = &README[from..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    section
        .split("```sh\n")
        .skip(1)
        .map(|b| &b[..b.find("```").expect("the block ends")])
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_runs_the_readme_quick_start_and_exits_zero_on_sigterm() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let mut proxy = ProxyProcess::start(&db, &upstream.url()).await;
    let blocks = sh_blocks_after("## Reverse proxy");
    assert!(blocks[0].contains("proxy --upstream http://127.0.0.1:3000"));
    assert!(blocks[0].contains("DATABASE_URL=sqlite://proxy.db"));
    let script = blocks[1]
        .replace("localhost:8081", &format!("127.0.0.1:{}", proxy.port))
        .replace("localhost:3000", &upstream.addr.to_string());
    // Twice: a fresh key per run, so the block can be pasted again (the
    // origin's charge number goes on; the block counts one charge per run).
    for n in 1..=2 {
        let charge = format!(r#""charge":"ch_{n}""#);
        let expected = [
            "HTTP/1.1 201 Created",
            "idempotency-expires: ",
            charge.as_str(),
            "idempotent-replayed: true",
            charge.as_str(),
            "HTTP/1.1 422 Unprocessable Entity",
            "/key-reused",
            "\ncharges this run: 1\n",
        ];
        common::bin::run_script_expecting(&script, &expected);
    }

    let kill = std::process::Command::new("kill")
        .args(["-TERM", &proxy.child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = proxy.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let stderr = proxy.stderr();
    assert!(status.success(), "exit status {status:?}\n{stderr}");
    assert!(stderr.contains("idemgate proxy stopped"), "{stderr}");
    assert!(!stderr.contains("order-"), "a raw key was logged");
}

#[test]
fn the_binary_refuses_to_start_without_a_usable_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("keys.db").display());
    for args in [
        vec![],
        vec!["--upstream", "ftp://origin.example"],
        vec!["--upstream", "not a url"],
        vec!["--upstream", "http://127.0.0.1:3000/?q=1"],
        vec!["--upstream", "http://user:hunter2@127.0.0.1:3000"],
    ] {
        let out = std::process::Command::new(common::bin::BIN)
            .arg("proxy")
            .args(&args)
            .env_remove("IDEMGATE_UPSTREAM")
            .env("DATABASE_URL", &db)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        // Named as it was set: the flag; both names when it is not set.
        assert!(stderr.contains("--upstream"), "{args:?}: {stderr}");
        assert!(
            !args.is_empty() || stderr.contains("IDEMGATE_UPSTREAM"),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains("hunter2"),
            "a password was echoed: {stderr}"
        );
    }
}

fn proxy_debug(argv: &[&str]) -> String {
    let argv = argv.iter().map(Into::into).collect();
    match idemgate::server::cli::Cli::try_parse_merged(argv) {
        Ok(idemgate::server::cli::Cli {
            command: idemgate::server::cli::Command::Proxy(args),
            ..
        }) => format!("{args:?}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_example_file_holds_the_proxy_defaults_and_a_routes_example() {
    assert_eq!(
        proxy_debug(&["idemgate", "proxy", "--config", EXAMPLE]),
        proxy_debug(&["idemgate", "proxy"]),
    );
    assert!(
        routes::from_file(EXAMPLE.as_ref(), 604_800)
            .unwrap()
            .is_empty()
    );
    // The commented [[routes]] example, uncommented, is valid.
    let example = std::fs::read_to_string(EXAMPLE).unwrap();
    let from = example.find("# [[routes]]").expect("a [[routes]] example");
    let uncommented: String = example[from..]
        .lines()
        .map(|l| l.strip_prefix("# ").or(l.strip_prefix('#')).unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let routes = routes::from_table(&uncommented.parse().unwrap(), 604_800).unwrap();
    assert_eq!(routes.len(), 2);
    assert!(routes[1].matches("/v1/acme/charges"));
}
