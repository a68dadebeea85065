//! `IdempotencyLayer` (docs/layer.md) in front of an in-process service — the
//! counting origin's router — driven with `oneshot`. Every scenario is written
//! once over a [`Backend`] and runs against PostgreSQL and SQLite
//! (`both_stores!`), and asserts how often the origin ran.

use crate::common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use common::app::{TestResponse, fresh_key};
use common::backend::Backend;
use common::logs;
use common::upstream::{self, Counts};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use idemgate::IdempotencyLayer;
use idemgate::engine::{Engine, Limits};
use idemgate::layer::{Idempotency, LayerPolicy, NotExecuted, OutcomeUnknown, Route};
use serde_json::Value;
use tokio::sync::Barrier;
use tower::ServiceExt;

/// The counting origin behind the layer, over one store instance.
struct Gate {
    app: Router,
    counts: Arc<Counts>,
    /// Keys and tokens sent: none may show up in the logs.
    secrets: Mutex<Vec<String>>,
}

impl Gate {
    async fn new(backend: &Backend, policy: LayerPolicy) -> Gate {
        Gate::sharing(backend, policy, Arc::new(Counts::default())).await
    }

    /// Another instance (its own store pool and engine) in front of an
    /// origin that counts into `counts`.
    async fn sharing(backend: &Backend, policy: LayerPolicy, counts: Arc<Counts>) -> Gate {
        logs::init();
        let engine = Arc::new(Engine::new(backend.open().await, Limits::default()));
        let app = upstream::router(counts.clone()).layer(IdempotencyLayer::new(engine, policy));
        Gate {
            app,
            counts,
            secrets: Mutex::new(Vec::new()),
        }
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Body,
    ) -> TestResponse {
        let mut req = Request::builder().method(method).uri(path);
        for (name, value) in headers {
            if name.eq_ignore_ascii_case("idempotency-key")
                || name.eq_ignore_ascii_case("authorization")
            {
                self.secrets
                    .lock()
                    .unwrap()
                    .push(value.trim_matches('"').to_owned());
            }
            req = req.header(*name, *value);
        }
        read(
            self.app
                .clone()
                .oneshot(req.body(body).unwrap())
                .await
                .unwrap(),
        )
        .await
    }

    /// `POST path` with `key` and a JSON `body`, asking for the immediate
    /// answer (`Prefer: wait=0`): a duplicate in flight is its 409.
    async fn post_now(&self, path: &str, key: &str, body: &str) -> TestResponse {
        self.send(
            "POST",
            path,
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
                ("prefer", "wait=0"),
            ],
            Body::from(body.to_owned()),
        )
        .await
    }

    /// `POST path` with `key` and a JSON `body`.
    async fn post(&self, path: &str, key: &str, body: &str) -> TestResponse {
        self.send(
            "POST",
            path,
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ],
            Body::from(body.to_owned()),
        )
        .await
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let secrets = self.secrets.lock().unwrap().clone();
        let refs: Vec<&str> = secrets.iter().map(String::as_str).collect();
        logs::assert_absent(&refs);
    }
}

async fn read(res: Response<Body>) -> TestResponse {
    let status = res.status();
    let headers = res.headers().clone();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    TestResponse {
        status,
        headers,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

fn replayed(res: &TestResponse) -> bool {
    res.headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

// === scenarios ===

async fn executes_once_then_replays(b: Backend) {
    let gate = Gate::new(&b, LayerPolicy::default()).await;
    let key = fresh_key();
    let first = gate
        .post("/ok", &key, r#"{"amount": 500, "currency": "eur"}"#)
        .await;
    assert_eq!(first.status, 201, "{first:#?}");
    assert!(!replayed(&first));
    assert!(first.headers.contains_key("idempotency-expires"));
    // The first caller gets its own cookie.
    assert!(first.headers.contains_key("set-cookie"));

    // Re-ordered and re-indented: the same request.
    let retry = gate
        .post("/ok", &key, "{\n \"currency\":\"eur\",\"amount\":500}")
        .await;
    assert_eq!(retry.status, 201, "{retry:#?}");
    assert!(replayed(&retry));
    assert!(retry.headers.contains_key("idempotency-expires"));
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("x-origin"), "yes");
    for absent in [
        "set-cookie",
        "www-authenticate",
        "keep-alive",
        "connection",
        "x-hop",
    ] {
        assert!(
            !retry.headers.contains_key(absent),
            "{absent} replayed: {retry:#?}"
        );
    }
    assert_eq!(gate.counts.started(&key), 1);
}

async fn another_payload_is_422(b: Backend) {
    let gate = Gate::new(&b, LayerPolicy::default()).await;
    let key = fresh_key();
    assert_eq!(
        gate.post("/ok", &key, r#"{"amount":500}"#).await.status,
        201
    );
    gate.post("/ok", &key, r#"{"amount":900}"#)
        .await
        .assert_problem(422, "key-reused");
    // Another path is another request too.
    gate.post("/ok/other", &key, r#"{"amount":500}"#)
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(gate.counts.started(&key), 1);
}

async fn release_statuses_are_not_stored_but_500_is(b: Backend) {
    let gate = Gate::new(&b, LayerPolicy::default()).await;
    for code in [408u16, 425, 429, 503] {
        let key = fresh_key();
        let path = format!("/status/{code}");
        for round in 1..=2 {
            let res = gate.post(&path, &key, "{}").await;
            assert_eq!(res.status.as_u16(), code);
            assert!(!replayed(&res));
            assert_eq!(gate.counts.started(&key), round, "{code} was stored");
        }
    }
    let key = fresh_key();
    let first = gate.post("/status/500", &key, "{}").await;
    assert_eq!(first.status, 500);
    let retry = gate.post("/status/500", &key, "{}").await;
    assert_eq!(retry.status, 500);
    assert!(replayed(&retry), "{retry:#?}");
    assert_eq!(retry.text, "status 500");
    assert_eq!(gate.counts.started(&key), 1);
}

async fn request_body_over_the_limit_is_413_before_the_origin(b: Backend) {
    let policy = LayerPolicy::default().max_body_bytes(64);
    let gate = Gate::new(&b, policy).await;
    let key = fresh_key();
    let big = format!(r#"{{"pad":"{}"}}"#, "x".repeat(100));
    gate.post("/ok", &key, &big)
        .await
        .assert_problem(413, "payload-too-large");
    // No Content-Length: the body is cut off while it is read.
    let chunks = (0..10).map(|_| Ok::<_, Infallible>(Bytes::from(vec![b'y'; 10])));
    let streamed = Body::from_stream(futures::stream::iter(chunks));
    gate.send("POST", "/ok", &[("idempotency-key", &key)], streamed)
        .await
        .assert_problem(413, "payload-too-large");
    assert_eq!(gate.counts.total(), 0);
    // At the limit exactly, it goes through.
    let fits = format!(r#"{{"pad":"{}"}}"#, "x".repeat(64 - 10));
    assert_eq!(fits.len(), 64);
    assert_eq!(gate.post("/ok", &key, &fits).await.status, 201);
    assert_eq!(gate.counts.started(&key), 1);
}

async fn response_body_over_the_limit_is_passed_through_and_replayed_empty(b: Backend) {
    let policy = LayerPolicy::default().max_body_bytes(64);
    let gate = Gate::new(&b, policy).await;
    let key = fresh_key();
    let first = gate.post("/big/1000", &key, "{}").await;
    assert_eq!(first.status, 200);
    assert_eq!(first.text.len(), 1000, "the whole body passes through");
    assert!(!first.headers.contains_key("idempotency-body-omitted"));
    let retry = gate.post("/big/1000", &key, "{}").await;
    assert_eq!(retry.status, 200);
    assert!(replayed(&retry));
    assert_eq!(retry.header("idempotency-body-omitted"), "true");
    assert_eq!(retry.header("x-origin"), "yes");
    assert_eq!(retry.text, "");
    assert_eq!(gate.counts.started(&key), 1);

    // At the limit, the body is stored.
    let key = fresh_key();
    gate.post("/big/64", &key, "{}").await;
    let retry = gate.post("/big/64", &key, "{}").await;
    assert!(replayed(&retry));
    assert_eq!(retry.text.len(), 64);
    assert!(!retry.headers.contains_key("idempotency-body-omitted"));
    assert_eq!(gate.counts.started(&key), 1);
}

async fn unguarded_methods_pass_through_even_with_a_key(b: Backend) {
    let gate = Gate::new(&b, LayerPolicy::default()).await;
    let key = fresh_key();
    for method in ["GET", "HEAD", "PUT", "DELETE", "OPTIONS"] {
        for _ in 0..2 {
            let res = gate
                .send(method, "/ok", &[("idempotency-key", &key)], Body::empty())
                .await;
            assert_eq!(res.status, 201, "{method}");
            assert!(!replayed(&res), "{method}");
        }
    }
    assert_eq!(gate.counts.started(&key), 10, "executed every time");
    // PATCH is guarded.
    for _ in 0..2 {
        gate.send("PATCH", "/ok", &[("idempotency-key", &key)], Body::empty())
            .await;
    }
    assert_eq!(gate.counts.started(&key), 11);
}

async fn missing_key_passes_through_unless_required(b: Backend) {
    let open = Gate::new(&b, LayerPolicy::default()).await;
    for _ in 0..2 {
        let res = open.send("POST", "/ok", &[], Body::from("{}")).await;
        assert_eq!(res.status, 201);
    }
    assert_eq!(open.counts.total(), 2, "unguarded: executed every time");

    let strict = Gate::new(&b, LayerPolicy::default().require_key(true)).await;
    strict
        .send("POST", "/ok", &[], Body::from("{}"))
        .await
        .assert_problem(400, "key-missing");
    let key = fresh_key();
    strict
        .send(
            "POST",
            "/ok",
            &[("idempotency-key", &key), ("idempotency-key", &key)],
            Body::empty(),
        )
        .await
        .assert_problem(400, "key-invalid");
    strict
        .send(
            "POST",
            "/ok",
            &[("idempotency-key", "\"unterminated")],
            Body::empty(),
        )
        .await
        .assert_problem(400, "key-invalid");
    // A GET needs no key even then.
    assert_eq!(
        strict.send("GET", "/ok", &[], Body::empty()).await.status,
        201
    );
    assert_eq!(strict.counts.total(), 1);
}

/// A duplicate of a key in flight is held for the first answer and gets its
/// replay, without asking: clients in the wild send no `Prefer: wait`.
/// `Prefer: wait=0` asks for the immediate 409; a default wait of `None`
/// answers every duplicate at once.
async fn a_duplicate_in_flight_waits_for_the_replay_unless_it_asks_not_to(b: Backend) {
    let gate = Arc::new(Gate::new(&b, LayerPolicy::default()).await);
    let key = fresh_key();
    let first = {
        let (gate, key) = (gate.clone(), key.clone());
        tokio::spawn(async move { gate.post("/slow/700", &key, "{}").await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let dup = gate.post_now("/slow/700", &key, "{}").await;
    dup.assert_problem(409, "request-in-flight");
    assert!(dup.header("retry-after").parse::<u64>().unwrap() >= 1);
    let started = std::time::Instant::now();
    let waiter = gate.post("/slow/700", &key, "{}").await;
    assert_eq!(waiter.status, 201, "{waiter:#?}");
    assert!(replayed(&waiter));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "woken by the commit, not at the end of the wait"
    );
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(waiter.text, first.text, "the first answer, replayed");
    assert_eq!(gate.counts.started(&key), 1);

    let at_once = Arc::new(Gate::new(&b, LayerPolicy::default().default_wait(None)).await);
    let key = fresh_key();
    let first = {
        let (gate, key) = (at_once.clone(), key.clone());
        tokio::spawn(async move { gate.post("/slow/700", &key, "{}").await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    at_once
        .post("/slow/700", &key, "{}")
        .await
        .assert_problem(409, "request-in-flight");
    assert_eq!(first.await.unwrap().status, 201);
}

async fn a_client_that_hangs_up_does_not_cancel_the_call(b: Backend) {
    let gate = Arc::new(Gate::new(&b, LayerPolicy::default()).await);
    let key = fresh_key();
    let client = {
        let (gate, key) = (gate.clone(), key.clone());
        tokio::spawn(async move { gate.post("/slow/600", &key, "{}").await })
    };
    // Drop the response future once the origin is working on it.
    for _ in 0..200 {
        if gate.counts.started(&key) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    client.abort();
    assert!(
        client.await.unwrap_err().is_cancelled(),
        "dropped mid-flight"
    );
    assert_eq!(
        gate.counts.finished(&key),
        0,
        "the origin was still working"
    );

    let waiter = gate
        .send(
            "POST",
            "/slow/600",
            &[
                ("idempotency-key", &key),
                ("content-type", "application/json"),
                ("prefer", "wait=5"),
            ],
            Body::from("{}"),
        )
        .await;
    assert_eq!(waiter.status, 201, "{waiter:#?}");
    assert!(
        replayed(&waiter),
        "the call and its commit ran to their end"
    );
    assert_eq!(gate.counts.finished(&key), 1);
    assert_eq!(gate.counts.started(&key), 1);
}

async fn tenants_are_scoped_by_the_tenant_header(b: Backend) {
    let gate = Gate::new(&b, LayerPolicy::default()).await;
    let key = fresh_key();
    let as_tenant = |token: &'static str| {
        let key = key.clone();
        let gate = &gate;
        async move {
            gate.send(
                "POST",
                "/ok",
                &[("idempotency-key", &key), ("authorization", token)],
                Body::from("{}"),
            )
            .await
        }
    };
    assert!(!replayed(&as_tenant("Bearer tenant-one-secret").await));
    assert!(!replayed(&as_tenant("Bearer tenant-two-secret").await));
    assert!(replayed(&as_tenant("Bearer tenant-one-secret").await));
    // No tenant header: the anonymous tenant, a third scope.
    assert!(!replayed(&gate.post("/ok", &key, "{}").await));
    assert_eq!(gate.counts.started(&key), 3);
}

/// The principal an authentication layer in front of the layer found.
#[derive(Clone)]
struct Principal(&'static str);

async fn the_tenant_can_come_from_the_callers_identity(b: Backend) {
    let policy = LayerPolicy::default()
        .tenant_from(|head| head.extensions.get::<Principal>().map(|p| p.0.to_owned()));
    let mut gate = Gate::new(&b, policy).await;
    // The authentication in front: two tokens of alice's (one refreshed
    // between a timeout and its retry) and one of bob's.
    gate.app = gate.app.clone().layer(axum::middleware::map_request(
        |mut req: Request<Body>| async move {
            let who = match req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
            {
                Some("Bearer alice-token-before-refresh" | "Bearer alice-token-after-refresh") => {
                    Some(Principal("alice"))
                }
                Some("Bearer bob-token") => Some(Principal("bob")),
                _ => None,
            };
            if let Some(who) = who {
                req.extensions_mut().insert(who);
            }
            req
        },
    ));
    let key = fresh_key();
    let as_token = |token: &'static str| {
        let (key, gate) = (key.clone(), &gate);
        async move {
            gate.send(
                "POST",
                "/ok",
                &[("idempotency-key", &key), ("authorization", token)],
                Body::from("{}"),
            )
            .await
        }
    };
    let first = as_token("Bearer alice-token-before-refresh").await;
    assert_eq!(first.status, 201);
    let retry = as_token("Bearer alice-token-after-refresh").await;
    assert!(
        replayed(&retry),
        "the refreshed token is the same caller: {retry:#?}"
    );
    assert!(!replayed(&as_token("Bearer bob-token").await));
    assert_eq!(gate.counts.started(&key), 2, "once for alice, once for bob");
}

async fn problems_use_the_embedders_base_and_name_no_server_setting(b: Backend) {
    let base = "https://payments.example/errors/";
    let policy = LayerPolicy::default()
        .max_body_bytes(64)
        .require_key(true)
        .key_policy(idemgate::key::KeyPolicy {
            format: idemgate::key::KeyFormat::Uuid,
            ..Default::default()
        })
        .problem_base(base.into());
    let gate = Gate::new(&b, policy).await;
    let big = format!(r#"{{"pad":"{}"}}"#, "x".repeat(100));
    let answers = [
        gate.post("/ok", &uuid::Uuid::new_v4().to_string(), &big)
            .await,
        // Not a UUID, and unique: every key sent counts as a secret.
        gate.post("/ok", &fresh_key(), "{}").await,
        gate.send("POST", "/ok", &[], Body::from("{}")).await,
    ];
    for (res, slug) in answers
        .iter()
        .zip(["payload-too-large", "key-invalid", "key-missing"])
    {
        res.assert_problem(res.status.as_u16(), slug);
        assert_eq!(res.body["type"], format!("{base}{slug}"), "{res:#?}");
        // The embedding application set no IDEMGATE_* variable; naming one
        // would send its callers to a setting that does not exist there.
        assert!(!res.text.contains("IDEMGATE_"), "{}", res.text);
    }
    assert_eq!(gate.counts.total(), 0);
}

async fn the_key_header_is_configurable(b: Backend) {
    let policy =
        LayerPolicy::default().key_header(http::HeaderName::from_static("x-idempotency-key"));
    let gate = Gate::new(&b, policy).await;
    let key = fresh_key();
    gate.secrets.lock().unwrap().push(key.clone());
    for _ in 0..2 {
        gate.send(
            "POST",
            "/ok",
            &[("x-idempotency-key", &key)],
            Body::from("{}"),
        )
        .await;
    }
    assert_eq!(gate.counts.total(), 1);
    // The standard header is not looked at: unguarded.
    for _ in 0..2 {
        gate.send(
            "POST",
            "/ok",
            &[("idempotency-key", &key)],
            Body::from("{}"),
        )
        .await;
    }
    assert_eq!(gate.counts.total(), 3);
}

async fn route_rules_override_the_defaults(b: Backend) {
    let mut strict = Route::new("/ok/strict/").unwrap();
    strict.require_key = Some(true);
    let mut put_only = Route::new("/echo/*").unwrap();
    put_only.methods = Some(vec![Method::PUT]);
    let mut short = Route::new("/ok/short/").unwrap();
    short.ttl = Some(Duration::from_secs(1));
    let policy = LayerPolicy::default().routes(vec![strict, put_only, short]);
    let gate = Gate::new(&b, policy).await;

    gate.send("POST", "/ok/strict/1", &[], Body::from("{}"))
        .await
        .assert_problem(400, "key-missing");
    assert_eq!(gate.counts.total(), 0);
    assert_eq!(
        gate.send("POST", "/ok/lenient", &[], Body::from("{}"))
            .await
            .status,
        201
    );
    assert_eq!(gate.counts.total(), 1);

    let key = fresh_key();
    for _ in 0..2 {
        gate.send(
            "PUT",
            "/echo/a",
            &[("idempotency-key", &key)],
            Body::empty(),
        )
        .await;
    }
    assert_eq!(gate.counts.started(&key), 1, "PUT is guarded on /echo/*");
    for _ in 0..2 {
        gate.send(
            "POST",
            "/echo/a",
            &[("idempotency-key", &key)],
            Body::empty(),
        )
        .await;
    }
    assert_eq!(
        gate.counts.started(&key),
        3,
        "POST is not guarded on /echo/*"
    );

    let key = fresh_key();
    let first = gate.post("/ok/short/1", &key, "{}").await;
    let expires = httpdate::parse_http_date(first.header("idempotency-expires")).unwrap();
    assert!(expires <= std::time::SystemTime::now() + Duration::from_secs(2));
    assert!(replayed(&gate.post("/ok/short/1", &key, "{}").await));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(!replayed(&gate.post("/ok/short/1", &key, "{}").await));
    assert_eq!(
        gate.counts.started(&key),
        2,
        "the key expired after its route's TTL"
    );
}

/// An inner service that counts its calls and answers per path.
fn steering_service(
    calls: Arc<AtomicUsize>,
) -> impl tower::Service<
    Request<Body>,
    Response = Response<Body>,
    Error = std::io::Error,
    Future = impl Send + 'static,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |req: Request<Body>| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let mut res = Response::new(Body::from("steered"));
            *res.status_mut() = StatusCode::BAD_GATEWAY;
            match req.uri().path() {
                "/not-executed" => {
                    res.extensions_mut().insert(NotExecuted);
                }
                "/unknown" => {
                    res.extensions_mut().insert(OutcomeUnknown);
                }
                _ => return Err(std::io::Error::other("the inner service broke")),
            }
            Ok(res)
        }
    })
}

async fn the_inner_service_steers_the_key(b: Backend) {
    logs::init();
    let engine = Arc::new(Engine::new(b.open().await, Limits::default()));
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = Idempotency::new(
        steering_service(calls.clone()),
        engine,
        LayerPolicy::default(),
    );
    assert_eq!(svc.policy().release_statuses, vec![408, 425, 429, 503]);
    let _: &_ = svc.get_ref();
    let send = |path: &'static str, key: String| {
        let svc = svc.clone();
        async move {
            let req = Request::post(path)
                .header("idempotency-key", key)
                .body(Body::empty())
                .unwrap();
            read(svc.oneshot(req).await.unwrap()).await
        }
    };

    // NotExecuted: released, the retry runs.
    let key = fresh_key();
    assert_eq!(send("/not-executed", key.clone()).await.status, 502);
    assert_eq!(send("/not-executed", key.clone()).await.status, 502);
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // OutcomeUnknown: the key is held, and the retry, even one that asks
    // to wait, is told at once that the outcome is unknown.
    let key = fresh_key();
    assert_eq!(send("/unknown", key.clone()).await.status, 502);
    let retry = send("/unknown", key.clone()).await;
    retry.assert_problem(409, "outcome-unknown");
    assert!(retry.headers.get("retry-after").is_none(), "{retry:#?}");
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    // An error of the inner service: a 500 problem, and the outcome unknown.
    let key = fresh_key();
    send("/fails", key.clone())
        .await
        .assert_problem(500, "internal");
    send("/fails", key.clone())
        .await
        .assert_problem(409, "outcome-unknown");
    // Unguarded, the error is a 500 too.
    let req = Request::get("/fails").body(Body::empty()).unwrap();
    read(svc.clone().oneshot(req).await.unwrap())
        .await
        .assert_problem(500, "internal");
    assert_eq!(calls.load(Ordering::SeqCst), 5);
    let inner = svc.into_inner();
    let _ = inner;
}

async fn two_instances_on_one_database_execute_once(b: Backend) {
    let counts = Arc::new(Counts::default());
    let gates = [
        Arc::new(Gate::sharing(&b, LayerPolicy::default(), counts.clone()).await),
        Arc::new(Gate::sharing(&b, LayerPolicy::default(), counts.clone()).await),
    ];
    let key = fresh_key();
    let n = 40;
    let barrier = Arc::new(Barrier::new(n));
    let mut tasks = Vec::new();
    for i in 0..n {
        let gate = gates[i % 2].clone();
        let (key, barrier) = (key.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            gate.post("/slow/300", &key, "{}").await
        }));
    }
    let mut created = 0;
    for t in tasks {
        let res = t.await.unwrap();
        match res.status.as_u16() {
            201 if !replayed(&res) => created += 1,
            201 | 409 => {}
            other => panic!("unexpected {other}: {res:#?}"),
        }
    }
    assert_eq!(created, 1);
    assert_eq!(counts.started(&key), 1, "exactly once across two instances");
}

/// A handler slower than the lease keeps its key: the layer extends the
/// lease while it runs, so a retry after the first lease would have ended is
/// a 409, not a takeover and a second execution.
async fn a_handler_slower_than_its_lease_keeps_its_key(b: Backend) {
    let policy = LayerPolicy::default().lease(Duration::from_secs(2));
    let gate = Arc::new(Gate::new(&b, policy).await);
    let key = fresh_key();
    let first = {
        let (gate, key) = (gate.clone(), key.clone());
        tokio::spawn(async move { gate.post("/slow/4500", &key, "{}").await })
    };
    // Past the first lease (2 s), and past a second one had it been taken
    // at the start.
    for wait_ms in [2_600, 1_000] {
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        let dup = gate.post_now("/slow/4500", &key, "{}").await;
        dup.assert_problem(409, "request-in-flight");
        let retry: u64 = dup.header("retry-after").parse().unwrap();
        assert!((1..=2).contains(&retry), "Retry-After {retry}");
    }
    assert_eq!(first.await.unwrap().status, 201);
    let replay = gate.post("/slow/4500", &key, "{}").await;
    assert!(replayed(&replay), "{replay:#?}");
    assert_eq!(gate.counts.started(&key), 1, "executed once");
}

/// A response body that streams for longer than the lease: the lease is
/// kept alive while the body is read, so a retry meanwhile is a 409 (not a
/// takeover) and the whole body is stored and replayed.
async fn a_response_body_slower_than_its_lease_keeps_its_key(b: Backend) {
    let policy = LayerPolicy::default().lease(Duration::from_secs(1));
    let gate = Arc::new(Gate::new(&b, policy).await);
    let key = fresh_key();
    let first = {
        let (gate, key) = (gate.clone(), key.clone());
        tokio::spawn(async move { gate.post("/drip/5/750", &key, "{}").await })
    };
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    gate.post_now("/drip/5/750", &key, "{}")
        .await
        .assert_problem(409, "request-in-flight");
    let first = first.await.unwrap();
    assert_eq!(first.status, 200, "{first:#?}");
    assert_eq!(first.text, "piece 0\npiece 1\npiece 2\npiece 3\npiece 4\n");
    let replay = gate.post("/drip/5/750", &key, "{}").await;
    assert!(replayed(&replay), "{replay:#?}");
    assert_eq!(replay.text, first.text);
    assert_eq!(gate.counts.started(&key), 1, "executed once");
}

/// The layer's `Retry-After` estimates the holder's finish from how long
/// its recent requests took, not the end of the (default, 30 s) lease.
async fn retry_after_estimates_the_finish(b: Backend) {
    let gate = Arc::new(Gate::new(&b, LayerPolicy::default()).await);
    let mut warm = Vec::new();
    for _ in 0..5 {
        let gate = gate.clone();
        warm.push(tokio::spawn(async move {
            gate.post("/slow/1000", &fresh_key(), "{}").await
        }));
    }
    for w in warm {
        assert_eq!(w.await.unwrap().status, 201);
    }
    let key = fresh_key();
    let first = {
        let (gate, key) = (gate.clone(), key.clone());
        tokio::spawn(async move { gate.post("/slow/1000", &key, "{}").await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let dup = gate.post_now("/slow/1000", &key, "{}").await;
    dup.assert_problem(409, "request-in-flight");
    let told: u64 = dup.header("retry-after").parse().unwrap();
    assert_eq!(told, 1, "about 0.8 s left, rounded up: {dup:#?}");
    assert!(dup.body["lease_expires_at"].is_string(), "{dup:#?}");
    assert_eq!(first.await.unwrap().status, 201);
}

both_stores! {
    serial: [
        executes_once_then_replays,
        another_payload_is_422,
        release_statuses_are_not_stored_but_500_is,
        request_body_over_the_limit_is_413_before_the_origin,
        response_body_over_the_limit_is_passed_through_and_replayed_empty,
        unguarded_methods_pass_through_even_with_a_key,
        missing_key_passes_through_unless_required,
        tenants_are_scoped_by_the_tenant_header,
        the_tenant_can_come_from_the_callers_identity,
        problems_use_the_embedders_base_and_name_no_server_setting,
        the_key_header_is_configurable,
        route_rules_override_the_defaults,
        the_inner_service_steers_the_key,
    ],
    concurrent: [
        a_duplicate_in_flight_waits_for_the_replay_unless_it_asks_not_to,
        a_client_that_hangs_up_does_not_cancel_the_call,
        two_instances_on_one_database_execute_once,
        a_handler_slower_than_its_lease_keeps_its_key,
        a_response_body_slower_than_its_lease_keeps_its_key,
        retry_after_estimates_the_finish,
    ],
}
