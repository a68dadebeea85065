//! A retry that comes after its key expired, and OASIS Repeatable Requests
//! as a second dialect: `Repeatability-Request-ID` with
//! `Repeatability-First-Sent` (opt in, `--repeatability`), and our own
//! `Idempotency-First-Sent` for `Idempotency-Key` clients, on every door.
//!
//! The hole these close: a key is new again once it expires, so a retry
//! that comes later would execute a second time. A request that says when
//! it was first sent is refused with `412 first-sent-too-old` instead, and
//! nothing runs.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use axum::body::Body;
use common::app::{TestApp, TestResponse, fresh_key};
use common::backend::Backend;
use common::proxy::{TestProxy, replayed};
use common::upstream::Upstream;
use http::Request;
use http_body_util::BodyExt;
use idemgate::engine::{Engine, Limits};
use idemgate::{IdempotencyLayer, LayerPolicy};
use tower::{Layer, ServiceExt};

fn store_url(b: &Backend) -> String {
    match b {
        Backend::Postgres(db) => db.url.clone(),
        Backend::Sqlite(dir) => Backend::sqlite_url(dir),
    }
}

/// An HTTP-date `ago` before now.
fn sent_ago(ago: Duration) -> String {
    httpdate::fmt_http_date(SystemTime::now() - ago)
}

fn now() -> String {
    sent_ago(Duration::ZERO)
}

const DAY: Duration = Duration::from_secs(86_400);

fn result(res: &TestResponse) -> Option<&str> {
    res.headers
        .get("repeatability-result")
        .map(|v| v.to_str().unwrap())
}

// === the proxy ===

/// The OASIS dialect through the proxy: executed once, replayed, a changed
/// payload rejected, a first attempt older than the keys' window refused
/// without reaching the origin, each answer with its `Repeatability-Result`.
async fn the_proxy_speaks_oasis_repeatable_requests(b: Backend) {
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(
        &store_url(&b),
        &upstream.url(),
        &["--repeatability"],
        Vec::new(),
    )
    .await;
    let id = uuid::Uuid::new_v4().to_string();
    let first_sent = now();
    let send = |body: &'static str, first_sent: String, client: Option<&'static str>| {
        let id = id.clone();
        let proxy = &proxy;
        async move {
            let mut headers = vec![
                ("repeatability-request-id", id.clone()),
                ("repeatability-first-sent", first_sent),
                ("content-type", "application/json".to_owned()),
            ];
            if let Some(client) = client {
                headers.push(("repeatability-client-id", client.to_owned()));
            }
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            proxy.send("POST", "/ok", &headers, Some(body)).await
        }
    };

    let created = send(r#"{"amount":1}"#, first_sent.clone(), None).await;
    assert_eq!(created.status, 201, "{created:#?}");
    assert_eq!(result(&created), Some("accepted"));
    assert_eq!(upstream.total(), 1);

    let replay = send(r#"{"amount":1}"#, first_sent.clone(), None).await;
    assert!(replayed(&replay), "{replay:#?}");
    assert_eq!(result(&replay), Some("accepted"));
    assert_eq!(replay.text, created.text);

    let changed = send(r#"{"amount":2}"#, first_sent.clone(), None).await;
    changed.assert_problem(422, "key-reused");
    assert_eq!(result(&changed), Some("rejected"));

    // The same id within another client is another request.
    let other_client = send(r#"{"amount":1}"#, first_sent.clone(), Some("client-b")).await;
    assert_eq!(other_client.status, 201, "{other_client:#?}");
    assert_eq!(result(&other_client), Some("accepted"));
    assert_eq!(upstream.total(), 2);

    // A first attempt two days ago, against keys kept one day: it may have
    // run and been forgotten; refused, not executed.
    let late = uuid::Uuid::new_v4().to_string();
    let too_old = proxy
        .send(
            "POST",
            "/ok",
            &[
                ("repeatability-request-id", &late),
                ("repeatability-first-sent", &sent_ago(2 * DAY)),
            ],
            Some("{}"),
        )
        .await;
    too_old.assert_problem(412, "first-sent-too-old");
    assert_eq!(result(&too_old), Some("rejected"));
    assert!(
        too_old.body["detail"]
            .as_str()
            .unwrap()
            .contains("Repeatability-First-Sent"),
        "{too_old:#?}"
    );
    assert_eq!(
        upstream.total(),
        2,
        "a too-old request never reaches the origin"
    );

    // The request id needs its first-sent time; both dialects at once are
    // refused; a malformed date is refused.
    let bare = proxy
        .send(
            "POST",
            "/ok",
            &[("repeatability-request-id", &late)],
            Some("{}"),
        )
        .await;
    bare.assert_problem(400, "key-invalid");
    assert_eq!(result(&bare), Some("rejected"));
    let both = proxy
        .send(
            "POST",
            "/ok",
            &[
                ("repeatability-request-id", &late),
                ("repeatability-first-sent", &now()),
                ("idempotency-key", &fresh_key()),
            ],
            Some("{}"),
        )
        .await;
    both.assert_problem(400, "key-invalid");
    let garbled = proxy
        .send(
            "POST",
            "/ok",
            &[
                ("repeatability-request-id", &late),
                ("repeatability-first-sent", "yesterday"),
            ],
            Some("{}"),
        )
        .await;
    garbled.assert_problem(400, "key-invalid");
    assert_eq!(upstream.total(), 2);

    // An Idempotency-Key request on the same server has no
    // Repeatability-Result.
    let plain = proxy.post("/ok", &fresh_key(), "{}").await;
    assert_eq!(plain.status, 201);
    assert_eq!(result(&plain), None);

    // A method that is not guarded passes through without a result.
    let get = proxy
        .send(
            "GET",
            "/ok",
            &[
                ("repeatability-request-id", &late),
                ("repeatability-first-sent", &now()),
            ],
            None,
        )
        .await;
    assert_eq!(get.status, 201);
    assert_eq!(result(&get), None);
}

/// Without `--repeatability` the OASIS headers are ignored, as the standard
/// says a server that does not support them does: the request is keyless.
async fn without_the_option_the_oasis_headers_are_ignored(b: Backend) {
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&store_url(&b), &upstream.url(), &[], Vec::new()).await;
    let id = uuid::Uuid::new_v4().to_string();
    for _ in 0..2 {
        let res = proxy
            .send(
                "POST",
                "/ok",
                &[
                    ("repeatability-request-id", &id),
                    ("repeatability-first-sent", &sent_ago(2 * DAY)),
                ],
                Some("{}"),
            )
            .await;
        assert_eq!(res.status, 201, "{res:#?}");
        assert_eq!(result(&res), None);
    }
    assert_eq!(upstream.total(), 2, "keyless: passed through each time");
    let (_, policy) = proxy.admin_get("/v1/policy").await;
    let policy: serde_json::Value = serde_json::from_str(&policy).unwrap();
    assert_eq!(policy["repeatability"]["enabled"], false);
}

/// `Idempotency-First-Sent` closes the hole for `Idempotency-Key` clients:
/// once the key has expired, a retry that says when it was first sent is
/// refused (a retry that does not is executed again: the hole itself).
async fn a_late_retry_after_its_key_expired_is_refused_not_executed(b: Backend) {
    let upstream = Upstream::start().await;
    // Keys live 4 s: the window is 4 s less half of it, 2 s.
    let proxy = TestProxy::start(
        &store_url(&b),
        &upstream.url(),
        &["--default-ttl", "4"],
        Vec::new(),
    )
    .await;
    let (guarded, unguarded) = (fresh_key(), fresh_key());
    let first_sent = now();
    let send = |key: &str, first_sent: Option<&str>| {
        let mut headers = vec![("idempotency-key", key.to_owned())];
        if let Some(at) = first_sent {
            headers.push(("idempotency-first-sent", at.to_owned()));
        }
        let proxy = &proxy;
        async move {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            proxy.send("POST", "/ok", &headers, Some("{}")).await
        }
    };
    assert_eq!(send(&guarded, Some(&first_sent)).await.status, 201);
    assert_eq!(send(&unguarded, None).await.status, 201);
    let early = send(&guarded, Some(&first_sent)).await;
    assert!(replayed(&early), "{early:#?}");
    assert_eq!(upstream.started(&guarded), 1);

    tokio::time::sleep(Duration::from_millis(4_300)).await;

    let late = send(&guarded, Some(&first_sent)).await;
    late.assert_problem(412, "first-sent-too-old");
    assert!(
        late.body["detail"]
            .as_str()
            .unwrap()
            .contains("Idempotency-First-Sent"),
        "{late:#?}"
    );
    assert_eq!(upstream.started(&guarded), 1, "never twice");
    let again = send(&unguarded, None).await;
    assert_eq!(
        again.status, 201,
        "without a first-sent time, an expired key is new"
    );
    assert_eq!(upstream.started(&unguarded), 2);

    // Malformed: a 400 naming the header. A time in the future is not old.
    let garbled = send(&fresh_key(), Some("last tuesday")).await;
    garbled.assert_problem(400, "key-invalid");
    assert!(
        garbled.text.contains("Idempotency-First-Sent"),
        "{garbled:#?}"
    );
    let ahead = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(30));
    assert_eq!(send(&fresh_key(), Some(&ahead)).await.status, 201);
}

// === the reservation API ===

/// The reservation API takes both headers too, judged against the TTL the
/// reservation asks for.
async fn the_api_refuses_a_too_old_reservation_and_speaks_oasis(b: Backend) {
    let app = TestApp::new(&store_url(&b), &["--repeatability"]).await;
    let key = fresh_key();
    let old = sent_ago(Duration::from_secs(600));
    let short = app
        .send(
            "POST",
            "/v1/reservations",
            &[("idempotency-key", &key), ("idempotency-first-sent", &old)],
            Some(r#"{"ttl_seconds": 300}"#),
        )
        .await;
    short.assert_problem(412, "first-sent-too-old");
    // The same age under a longer TTL is within the window.
    let long = app
        .send(
            "POST",
            "/v1/reservations",
            &[("idempotency-key", &key), ("idempotency-first-sent", &old)],
            Some(r#"{"ttl_seconds": 3600}"#),
        )
        .await;
    assert_eq!(long.status, 201, "{long:#?}");
    assert_eq!(result(&long), None);

    let id = uuid::Uuid::new_v4().to_string();
    let reserve = |first_sent: String| {
        let id = id.clone();
        let app = &app;
        async move {
            app.send(
                "POST",
                "/v1/reservations",
                &[
                    ("repeatability-request-id", &id),
                    ("repeatability-first-sent", &first_sent),
                ],
                Some("{}"),
            )
            .await
        }
    };
    let first_sent = now();
    let created = reserve(first_sent.clone()).await;
    assert_eq!(created.status, 201, "{created:#?}");
    assert_eq!(result(&created), Some("accepted"));
    let reservation = created.reservation_id();
    let committed = app
        .act(
            &reservation,
            "commit",
            r#"{"status": 201, "body": "charged"}"#,
        )
        .await;
    assert_eq!(committed.status, 200, "{committed:#?}");
    let replay = reserve(first_sent).await;
    assert_eq!(replay.status, 200, "{replay:#?}");
    assert_eq!(replay.header("idempotent-replayed"), "true");
    assert_eq!(result(&replay), Some("accepted"));
    let too_old = reserve(sent_ago(2 * DAY)).await;
    too_old.assert_problem(412, "first-sent-too-old");
    assert_eq!(result(&too_old), Some("rejected"));

    let policy = app.send("GET", "/v1/policy", &[], None).await;
    assert_eq!(policy.status, 200);
    let rules = &policy.body;
    assert_eq!(rules["first_sent"]["header"], "Idempotency-First-Sent");
    assert_eq!(rules["first_sent"]["clock_skew_allowance_seconds"], 60);
    assert_eq!(rules["first_sent"]["default_window_seconds"], 86_400 - 60);
    assert_eq!(rules["repeatability"]["enabled"], true);
    assert_eq!(
        rules["repeatability"]["request_id_header"],
        "Repeatability-Request-ID"
    );
    assert_eq!(
        rules["repeatability"]["result_header"],
        "Repeatability-Result"
    );
}

// === the layer ===

/// The tower layer, with `KeyPolicy::repeatability` on: one execution per
/// request id, and the too-old refusal before the handler.
async fn the_layer_speaks_both(b: Backend) {
    let engine = Arc::new(Engine::new(b.open().await, Limits::default()));
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        tower::service_fn(move |_req: Request<Body>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                Ok::<_, std::convert::Infallible>(http::Response::new(Body::from(format!(
                    "call {n}"
                ))))
            }
        })
    };
    let mut policy = LayerPolicy::default();
    policy.key_policy.repeatability = true;
    let svc = IdempotencyLayer::new(engine, policy).layer(handler);
    let id = uuid::Uuid::new_v4().to_string();
    let first_sent = now();
    let call = |headers: Vec<(&'static str, String)>| {
        let svc = svc.clone();
        async move {
            let mut req = Request::post("/charges");
            for (name, value) in headers {
                req = req.header(name, value);
            }
            let res = svc
                .oneshot(req.body(Body::from("{}")).unwrap())
                .await
                .unwrap();
            let status = res.status().as_u16();
            let result = res
                .headers()
                .get("repeatability-result")
                .map(|v| v.to_str().unwrap().to_owned());
            let body = res.into_body().collect().await.unwrap().to_bytes();
            (status, result, String::from_utf8_lossy(&body).into_owned())
        }
    };
    let oasis = |at: &str| {
        vec![
            ("repeatability-request-id", id.clone()),
            ("repeatability-first-sent", at.to_owned()),
        ]
    };
    let first = call(oasis(&first_sent)).await;
    assert_eq!(first, (200, Some("accepted".into()), "call 1".into()));
    let again = call(oasis(&first_sent)).await;
    assert_eq!(again, (200, Some("accepted".into()), "call 1".into()));
    let late = call(oasis(&sent_ago(2 * DAY))).await;
    assert_eq!((late.0, late.1.as_deref()), (412, Some("rejected")));
    assert!(late.2.contains("first-sent-too-old"), "{late:?}");
    let plain_late = call(vec![
        ("idempotency-key", fresh_key()),
        ("idempotency-first-sent", sent_ago(2 * DAY)),
    ])
    .await;
    assert_eq!((plain_late.0, plain_late.1), (412, None));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "never twice, never too late"
    );
}

both_stores! {
    serial: [],
    concurrent: [
        the_proxy_speaks_oasis_repeatable_requests,
        without_the_option_the_oasis_headers_are_ignored,
        a_late_retry_after_its_key_expired_is_refused_not_executed,
        the_api_refuses_a_too_old_reservation_and_speaks_oasis,
        the_layer_speaks_both,
    ],
}
