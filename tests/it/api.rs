//! The reservation/commit API (docs/reservation-api.md) against a real
//! PostgreSQL: every outcome of a reserve, every 404, 409 lease-lost and 413
//! path.

use crate::common;

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use serde_json::json;

const CHARGE: &str =
    r#"{"request":{"method":"POST","path":"/charges","body":{"amount":500,"currency":"eur"}}}"#;

async fn app(b: &Backend) -> TestApp {
    TestApp::new(&b.url(), &[]).await
}

async fn new_key_is_reserved_with_expiry_and_location(b: Backend) {
    let app = app(&b).await;
    let res = app.reserve(&fresh_key(), CHARGE).await;
    assert_eq!(res.status, 201, "{res:#?}");
    assert_eq!(res.body["state"], "reserved");
    assert_eq!(res.body["attempt"], 1);
    assert!(res.body["recovery"].is_null());
    assert!(res.body.as_object().unwrap().contains_key("recovery"));
    let id = res.reservation_id();
    assert_eq!(res.header("location"), format!("/v1/reservations/{id}"));
    let expires = httpdate::parse_http_date(res.header("idempotency-expires")).unwrap();
    let in_a_day = std::time::SystemTime::now() + std::time::Duration::from_secs(86_400);
    let skew = in_a_day
        .duration_since(expires)
        .unwrap_or_else(|e| e.duration());
    assert!(skew.as_secs() <= 5, "expiry {expires:?} is not a day away");
}

async fn commit_then_retry_replays_the_stored_response(b: Backend) {
    let app = app(&b).await;
    let key = fresh_key();
    let id = app.reserve(&key, CHARGE).await.reservation_id();
    let commit = app
        .act(
            &id,
            "commit",
            r#"{"status":201,"headers":[["content-type","application/json"],["x-charge","ch_1"]],"body":"{\"id\":\"ch_1\"}"}"#,
        )
        .await;
    assert_eq!(commit.status, 200, "{commit:#?}");
    assert_eq!(commit.body["state"], "completed");
    assert!(commit.headers.contains_key("idempotency-expires"));

    // The same key, quoted this time: the same key.
    let replay = app.reserve(&format!("\"{key}\""), CHARGE).await;
    assert_eq!(replay.status, 200, "{replay:#?}");
    assert_eq!(replay.header("idempotent-replayed"), "true");
    assert!(replay.headers.contains_key("idempotency-expires"));
    assert_eq!(replay.body["state"], "completed");
    assert_eq!(replay.body["response"]["status"], 201);
    assert_eq!(replay.body["response"]["body"], r#"{"id":"ch_1"}"#);
    assert_eq!(
        replay.body["response"]["headers"],
        json!([["content-type", "application/json"], ["x-charge", "ch_1"]])
    );
    assert!(replay.body["completed_at"].is_string());
    assert_eq!(replay.body["expires_at"], commit.body["expires_at"]);

    // A re-ordered, re-indented body is the same request.
    let reordered = r#"{ "request": { "body": { "currency": "eur", "amount": 500 },
                         "path": "/charges", "method": "post" } }"#;
    assert_eq!(app.reserve(&key, reordered).await.status, 200);
}

async fn binary_bodies_round_trip_as_base64(b: Backend) {
    let app = app(&b).await;
    let key = fresh_key();
    let id = app.reserve(&key, "").await.reservation_id();
    let commit = app
        .act(&id, "commit", r#"{"status":200,"body_base64":"AP8Q"}"#)
        .await;
    assert_eq!(commit.status, 200, "{commit:#?}");
    let replay = app.reserve(&key, "").await;
    assert_eq!(replay.body["response"]["body_base64"], "AP8Q");
    assert!(replay.body["response"].get("body").is_none());
}

async fn duplicate_in_flight_is_409_with_retry_after(b: Backend) {
    let app = app(&b).await;
    let key = fresh_key();
    let first = app.reserve(&key, r#"{"lease_seconds":20}"#).await;
    assert_eq!(first.status, 201);
    let dup = app.reserve(&key, r#"{"lease_seconds":20}"#).await;
    dup.assert_problem(409, "request-in-flight");
    // Nothing measured yet: ask again in a second rather than wait out the
    // lease; the lease's end is in the body as the bound.
    let retry_after: u64 = dup.header("retry-after").parse().unwrap();
    assert_eq!(retry_after, 1, "Retry-After {retry_after}");
    assert_eq!(dup.body["retry_after_seconds"], retry_after);
    assert_eq!(dup.body["lease_expires_at"], first.body["lease_expires_at"]);
}

async fn other_payload_is_422_in_flight_and_completed(b: Backend) {
    let app = app(&b).await;
    let key = fresh_key();
    let id = app.reserve(&key, CHARGE).await.reservation_id();
    let other =
        r#"{"request":{"method":"POST","path":"/charges","body":{"amount":501,"currency":"eur"}}}"#;
    let reused = app.reserve(&key, other).await;
    reused.assert_problem(422, "key-reused");
    // What to do next: a new key for a new request, or the first payload.
    let detail = reused.body["detail"].as_str().unwrap();
    assert!(
        detail.contains("under a new key") && detail.contains("unchanged"),
        "{detail}"
    );
    // Another path, another method: another request too.
    let other_path = CHARGE.replace("/charges", "/refunds");
    app.reserve(&key, &other_path)
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(
        app.act(&id, "commit", r#"{"status":200}"#).await.status,
        200
    );
    app.reserve(&key, other)
        .await
        .assert_problem(422, "key-reused");

    // Caller-computed fingerprints are compared as given.
    let key = fresh_key();
    assert_eq!(
        app.reserve(&key, r#"{"fingerprint":"v1:abc"}"#)
            .await
            .status,
        201
    );
    app.reserve(&key, r#"{"fingerprint":"v1:abd"}"#)
        .await
        .assert_problem(422, "key-reused");
}

async fn ignored_json_pointers_do_not_change_the_fingerprint(b: Backend) {
    let app = TestApp::new(&b.url(), &["--fingerprint-ignore", "/sent_at,/meta/trace"]).await;
    let key = fresh_key();
    let a = r#"{"request":{"method":"POST","path":"/m","body":{"to":"x","sent_at":1,"meta":{"trace":"a","n":1}}}}"#;
    let b = r#"{"request":{"method":"POST","path":"/m","body":{"to":"x","sent_at":2,"meta":{"trace":"b","n":1}}}}"#;
    let c = r#"{"request":{"method":"POST","path":"/m","body":{"to":"x","sent_at":2,"meta":{"trace":"b","n":2}}}}"#;
    assert_eq!(app.reserve(&key, a).await.status, 201);
    app.reserve(&key, b)
        .await
        .assert_problem(409, "request-in-flight");
    app.reserve(&key, c).await.assert_problem(422, "key-reused");
    let policy = app.send("GET", "/v1/policy", &[], None).await;
    assert_eq!(
        policy.body["fingerprint"]["ignored_pointers"],
        json!(["/sent_at", "/meta/trace"])
    );
}

async fn missing_and_malformed_keys_are_400(b: Backend) {
    let app = app(&b).await;
    app.send("POST", "/v1/reservations", &[], Some("{}"))
        .await
        .assert_problem(400, "key-missing");
    let too_long = "k".repeat(256);
    let cases: Vec<Vec<(&str, &str)>> = vec![
        vec![("idempotency-key", "")],
        vec![("idempotency-key", "\"unterminated")],
        vec![("idempotency-key", "\"a\";p=1")],
        vec![("idempotency-key", "has space")],
        vec![("idempotency-key", too_long.as_str())],
        vec![("idempotency-key", "one"), ("idempotency-key", "two")],
    ];
    for headers in cases {
        let res = app
            .send("POST", "/v1/reservations", &headers, Some("{}"))
            .await;
        res.assert_problem(400, "key-invalid");
    }
    // A non-ASCII byte, which `http` lets through as an opaque header value.
    let req = http::Request::builder()
        .method("POST")
        .uri("/v1/reservations")
        .header(
            "idempotency-key",
            http::HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        )
        .body(axum::body::Body::empty())
        .unwrap();
    let res = tower::ServiceExt::oneshot(app.router.clone(), req)
        .await
        .unwrap();
    assert_eq!(res.status(), 400);
}

async fn strict_mode_and_uuid_format(b: Backend) {
    let app = TestApp::new(&b.url(), &["--strict-key", "true", "--key-format", "uuid"]).await;
    let uuid = uuid::Uuid::new_v4().to_string();
    app.reserve(&uuid, "")
        .await
        .assert_problem(400, "key-invalid");
    app.reserve(&format!("\"{}\"", fresh_key()), "")
        .await
        .assert_problem(400, "key-invalid");
    assert_eq!(app.reserve(&format!("\"{uuid}\""), "").await.status, 201);
}

async fn bad_bodies_and_fields_are_400_invalid_request(b: Backend) {
    let app = app(&b).await;
    let long_fp = format!(r#"{{"fingerprint":"{}"}}"#, "f".repeat(513));
    for body in [
        "{not json",
        "[1,2]",
        r#"{"lease_seconds":0}"#,
        r#"{"lease_seconds":100000}"#,
        r#"{"ttl_seconds":0}"#,
        r#"{"ttl_seconds":"soon"}"#,
        r#"{"unknown":1}"#,
        r#"{"fingerprint":"a","request":{"method":"POST","path":"/"}}"#,
        r#"{"fingerprint":""}"#,
        long_fp.as_str(),
        r#"{"request":{"method":"PO ST","path":"/"}}"#,
        r#"{"request":{"method":"POST","path":"no-slash"}}"#,
    ] {
        let res = app.reserve(&fresh_key(), body).await;
        res.assert_problem(400, "invalid-request");
    }
    let id = app.reserve(&fresh_key(), "").await.reservation_id();
    for body in [
        r#"{}"#,
        r#"{"status":99}"#,
        r#"{"status":600}"#,
        r#"{"status":200,"body":"a","body_base64":"YQ=="}"#,
        r#"{"status":200,"body_base64":"***"}"#,
        r#"{"status":200,"headers":[["bad name","v"]]}"#,
        r#"{"status":200,"headers":[["x-ok","line\nbreak"]]}"#,
        r#"{"status":200,"body":{"json":"object"}}"#,
    ] {
        app.act(&id, "commit", body)
            .await
            .assert_problem(400, "invalid-request");
    }
    // A type error names its field, and for a body sent as an object, what
    // to send instead.
    let object = app
        .act(&id, "commit", r#"{"status":200,"body":{"json":"object"}}"#)
        .await;
    let detail = object.body["detail"].as_str().unwrap();
    assert!(
        detail.contains("the field `body`") && detail.contains("body_base64"),
        "{detail}"
    );
    let nested = app
        .reserve(&fresh_key(), r#"{"request":{"method":7,"path":"/"}}"#)
        .await;
    nested.assert_problem(400, "invalid-request");
    let detail = nested.body["detail"].as_str().unwrap();
    assert!(detail.contains("the field `request.method`"), "{detail}");
    let ttl = app.reserve(&fresh_key(), r#"{"ttl_seconds":"soon"}"#).await;
    assert!(
        ttl.body["detail"]
            .as_str()
            .unwrap()
            .contains("`ttl_seconds`"),
        "{ttl:#?}"
    );
    app.act(&id, "checkpoint", r#"{"recovery_point":""}"#)
        .await
        .assert_problem(400, "invalid-request");
    app.act(&id, "extend", r#"{"lease_seconds":0}"#)
        .await
        .assert_problem(400, "invalid-request");
}

/// A commit's header line that is not exactly two strings is refused with
/// its index, and refusing it stores nothing: the same reservation then
/// commits a correct body.
async fn a_header_line_that_is_not_a_pair_is_400_naming_it(b: Backend) {
    let app = app(&b).await;
    let id = app.reserve(&fresh_key(), "").await.reservation_id();
    for (headers, index) in [
        (r#"[["a","1"],["x","y","z"]]"#, 1),
        (r#"[["x"]]"#, 0),
        (r#"[[]]"#, 0),
        (r#"[["a","1"],["b","2"],["c",3]]"#, 2),
        (r#"[["a","1"],"x-charge: ch_1"]"#, 1),
        (r#"[{"name":"x-charge","value":"ch_1"}]"#, 0),
        (r#"[["a","1"],null]"#, 1),
    ] {
        let res = app
            .act(
                &id,
                "commit",
                &format!(r#"{{"status":200,"headers":{headers}}}"#),
            )
            .await;
        res.assert_problem(400, "invalid-request");
        let detail = res.body["detail"].as_str().unwrap();
        let want = format!("headers[{index}] must be [name, value]");
        assert!(
            detail.contains(&want),
            "{headers}: {detail:?} does not say {want:?}"
        );
    }
    let commit = app
        .act(
            &id,
            "commit",
            r#"{"status":200,"headers":[["x-charge","ch_1"]]}"#,
        )
        .await;
    assert_eq!(commit.status, 200, "{commit:#?}");
    assert_eq!(
        commit.body["response"]["headers"],
        json!([["x-charge", "ch_1"]])
    );
}

/// The reserve and extend bodies are optional: none at all, or `null`, is
/// `{}`, as the document declares them.
async fn optional_bodies_may_be_left_out_or_null(b: Backend) {
    let app = app(&b).await;
    for body in ["", "null", " null\n"] {
        let res = app.reserve(&fresh_key(), body).await;
        assert_eq!(res.status, 201, "{body:?}: {res:#?}");
        let extended = app.act(&res.reservation_id(), "extend", body).await;
        assert_eq!(extended.status, 200, "{body:?}: {extended:#?}");
    }
}

/// Every response header the document declares on an answer is on that
/// answer (the 503s are the outage tests').
async fn the_response_headers_the_document_declares_are_sent(b: Backend) {
    let doc = serde_json::to_value(idemgate::server::api::openapi()).unwrap();
    let check = |res: &common::app::TestResponse, path: &str, status: u16| {
        assert_eq!(res.status, status, "{res:#?}");
        let declared = doc["paths"][path]["post"]["responses"][status.to_string()]["headers"]
            .as_object()
            .unwrap_or_else(|| panic!("POST {path} {status} declares no headers"));
        // `Repeatability-Result` answers OASIS's dialect only
        // (repeatability.rs checks it is sent there).
        for name in declared.keys().filter(|n| *n != "Repeatability-Result") {
            assert!(
                res.headers.contains_key(name.as_str()),
                "POST {path} {status} declares {name}, which is not sent: {res:#?}"
            );
        }
    };
    let app = TestApp::new(&b.url(), &["--tenant-max-in-flight", "1"]).await;
    let key = fresh_key();
    let reserved = app.reserve(&key, "").await;
    check(&reserved, "/v1/reservations", 201);
    let id = reserved.reservation_id();
    assert_eq!(
        reserved.header("location"),
        format!("/v1/reservations/{id}")
    );
    check(&app.reserve(&key, "").await, "/v1/reservations", 409);
    check(
        &app.reserve(&fresh_key(), "").await,
        "/v1/reservations",
        429,
    );
    let commit = app.act(&id, "commit", r#"{"status":204}"#).await;
    check(&commit, "/v1/reservations/{id}/commit", 200);
    let replay = app.reserve(&key, "").await;
    check(&replay, "/v1/reservations", 200);
    assert_eq!(replay.header("idempotent-replayed"), "true");
}

async fn unknown_ids_and_paths_are_404(b: Backend) {
    let app = app(&b).await;
    let unknown = uuid::Uuid::new_v4().to_string();
    for id in [unknown.as_str(), "not-a-uuid"] {
        for (action, body) in [
            ("commit", r#"{"status":200}"#),
            ("release", ""),
            ("extend", ""),
            ("checkpoint", r#"{"recovery_point":"p"}"#),
        ] {
            app.act(id, action, body)
                .await
                .assert_problem(404, "not-found");
        }
        app.send("GET", &format!("/v1/reservations/{id}"), &[], None)
            .await
            .assert_problem(404, "not-found");
    }
    app.send("GET", "/v2/nothing", &[], None)
        .await
        .assert_problem(404, "not-found");
    // A path that exists with a method it does not take: a problem too, and
    // the Allow header says which methods it takes.
    for (method, path, allow) in [
        ("PUT", "/v1/reservations", "POST"),
        ("GET", &format!("/v1/reservations/{unknown}/commit"), "POST"),
        ("POST", "/healthz", "GET"),
        ("DELETE", "/v1/policy", "GET"),
    ] {
        let res = app.send(method, path, &[], None).await;
        res.assert_problem(405, "method-not-allowed");
        assert!(
            res.header("allow").contains(allow),
            "{method} {path}: {res:#?}"
        );
    }
}

async fn commit_is_idempotent_for_the_same_response_only(b: Backend) {
    let app = app(&b).await;
    let id = app.reserve(&fresh_key(), "").await.reservation_id();
    let body = r#"{"status":202,"body":"accepted"}"#;
    assert_eq!(app.act(&id, "commit", body).await.status, 200);
    let again = app.act(&id, "commit", body).await;
    assert_eq!(again.status, 200, "{again:#?}");
    assert_eq!(again.body["response"]["body"], "accepted");
    app.act(&id, "commit", r#"{"status":500,"body":"different"}"#)
        .await
        .assert_problem(409, "lease-lost");
    // A completed key cannot be released, extended or checkpointed.
    app.act(&id, "release", "")
        .await
        .assert_problem(409, "lease-lost");
    app.act(&id, "extend", "")
        .await
        .assert_problem(409, "lease-lost");
    app.act(&id, "checkpoint", r#"{"recovery_point":"p"}"#)
        .await
        .assert_problem(409, "lease-lost");
}

async fn bodies_over_the_limit_are_413(b: Backend) {
    let app = TestApp::new(&b.url(), &["--max-body-bytes", "1024"]).await;
    let id = app.reserve(&fresh_key(), "").await.reservation_id();
    let big = format!(r#"{{"status":200,"body":"{}"}}"#, "x".repeat(1025));
    app.act(&id, "commit", &big)
        .await
        .assert_problem(413, "payload-too-large");
    let big64 = format!(
        r#"{{"status":200,"body_base64":"{}"}}"#,
        "QUJD".repeat(400) // 1200 bytes decoded
    );
    app.act(&id, "commit", &big64)
        .await
        .assert_problem(413, "payload-too-large");
    // Far over even the JSON envelope's allowance: refused while reading.
    let huge = format!(r#"{{"status":200,"body":"{}"}}"#, "x".repeat(200_000));
    app.act(&id, "commit", &huge)
        .await
        .assert_problem(413, "payload-too-large");
    let big_checkpoint = format!(r#"{{"recovery_point":"p","data":"{}"}}"#, "x".repeat(2000));
    app.act(&id, "checkpoint", &big_checkpoint)
        .await
        .assert_problem(413, "payload-too-large");
    // Exactly at the limit is fine, and the key is still held.
    let exact = format!(r#"{{"status":200,"body":"{}"}}"#, "x".repeat(1024));
    assert_eq!(app.act(&id, "commit", &exact).await.status, 200);
}

async fn release_makes_the_key_new_again(b: Backend) {
    let app = app(&b).await;
    let key = fresh_key();
    let id = app.reserve(&key, CHARGE).await.reservation_id();
    let released = app.act(&id, "release", "").await;
    assert_eq!(released.status, 204, "{released:#?}");
    // Released: the id is dead for every write.
    app.act(&id, "release", "")
        .await
        .assert_problem(409, "lease-lost");
    app.act(&id, "commit", r#"{"status":200}"#)
        .await
        .assert_problem(409, "lease-lost");
    let again = app.reserve(&key, CHARGE).await;
    assert_eq!(again.status, 201, "{again:#?}");
    assert_eq!(again.body["attempt"], 1);
    assert_ne!(again.reservation_id(), id);
    // Even another payload may use it now: the first one never happened.
    let id2 = again.reservation_id();
    assert_eq!(app.act(&id2, "release", "").await.status, 204);
    let other = CHARGE.replace("500", "900");
    let id3 = app.reserve(&key, &other).await.reservation_id();
    let cp = r#"{"recovery_point":"p","data":{"of":"the third request"}}"#;
    assert_eq!(app.act(&id3, "checkpoint", cp).await.status, 200);
    // A released id shows nothing (410): its key was forgotten, and the
    // record the key has now belongs to another request. The live id still
    // shows it.
    let path = |id: &str| format!("/v1/reservations/{id}");
    for dead in [&id, &id2] {
        app.send("GET", &path(dead), &[], None)
            .await
            .assert_problem(410, "reservation-gone");
    }
    let live = app.send("GET", &path(&id3), &[], None).await;
    assert_eq!(live.body["recovery"]["data"]["of"], "the third request");
    assert_eq!(app.act(&id3, "release", "").await.status, 204);
    app.send("GET", &path(&id3), &[], None)
        .await
        .assert_problem(410, "reservation-gone");
}

async fn extend_moves_the_lease_end(b: Backend) {
    let app = app(&b).await;
    let key = fresh_key();
    let first = app.reserve(&key, r#"{"lease_seconds":1}"#).await;
    let id = first.reservation_id();
    let extended = app.act(&id, "extend", r#"{"lease_seconds":60}"#).await;
    assert_eq!(extended.status, 200, "{extended:#?}");
    assert_eq!(extended.body["reservation_id"], id);
    let before: chrono::DateTime<chrono::Utc> = first.body["lease_expires_at"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let after: chrono::DateTime<chrono::Utc> = extended.body["lease_expires_at"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(after - before > chrono::Duration::seconds(50));
    // Past the original lease, the key is still held: no takeover.
    TestApp::outlive(1).await;
    app.reserve(&key, "")
        .await
        .assert_problem(409, "request-in-flight");
}

async fn checkpoint_and_get_show_the_public_record(b: Backend) {
    let app = app(&b).await;
    let key = fresh_key();
    let id = app.reserve(&key, CHARGE).await.reservation_id();
    let cp = app
        .act(
            &id,
            "checkpoint",
            r#"{"recovery_point":"charged","data":{"charge":"ch_9"}}"#,
        )
        .await;
    assert_eq!(cp.status, 200, "{cp:#?}");
    assert_eq!(cp.body["recovery"]["recovery_point"], "charged");
    let view = app
        .send("GET", &format!("/v1/reservations/{id}"), &[], None)
        .await;
    assert_eq!(view.status, 200, "{view:#?}");
    assert_eq!(view.body["state"], "in_flight");
    assert_eq!(view.body["live"], true);
    assert_eq!(view.body["attempt"], 1);
    assert_eq!(view.body["recovery"]["data"]["charge"], "ch_9");
    assert_eq!(view.body["key_hash_prefix"].as_str().unwrap().len(), 12);
    assert!(
        !view.text.contains(&key),
        "the raw key leaked: {}",
        view.text
    );
    app.act(&id, "commit", r#"{"status":200,"body":"ok"}"#)
        .await;
    let view = app
        .send("GET", &format!("/v1/reservations/{id}"), &[], None)
        .await;
    assert_eq!(view.body["state"], "completed");
    assert_eq!(view.body["live"], false);
    assert_eq!(view.body["response"]["body"], "ok");
}

async fn operations_endpoints(b: Backend) {
    let app = app(&b).await;
    let health = app.send("GET", "/healthz", &[], None).await;
    assert_eq!(health.status, 200);
    let ready = app.send("GET", "/readyz", &[], None).await;
    assert_eq!(ready.status, 200);
    app.reserve(&fresh_key(), "").await;
    let metrics = app.send("GET", "/metrics", &[], None).await;
    assert_eq!(metrics.status, 200);
    assert!(
        metrics.text.contains("idemgate_requests_total{"),
        "{}",
        metrics.text
    );
    assert!(metrics.text.contains("outcome=\"created\""));
    assert!(metrics.text.contains("idemgate_db_pool_connections"));
    assert!(
        metrics
            .text
            .contains("idemgate_request_duration_seconds_bucket")
    );
    let policy = app.send("GET", "/v1/policy", &[], None).await;
    assert_eq!(policy.status, 200);
    assert_eq!(policy.body["header"], "Idempotency-Key");
    assert_eq!(policy.body["key"]["max_length"], 255);
    assert_eq!(policy.body["ttl_seconds"]["default"], 86_400);
    assert_eq!(policy.body["guarded_methods"], json!(["POST", "PATCH"]));
    docs_page_needs_nothing_but_the_server(&app).await;
    let spec = app.send("GET", "/openapi.json", &[], None).await;
    assert_eq!(
        spec.body,
        serde_json::to_value(idemgate::server::api::openapi()).unwrap()
    );
}

/// `/docs` answers 200 itself, links to `/openapi.json` in plain HTML, and
/// every script and stylesheet it names is served by idemgate: none comes
/// from elsewhere (`.ci/docs-browser` renders it in a browser with no
/// internet).
async fn docs_page_needs_nothing_but_the_server(app: &TestApp) {
    let docs = app.send("GET", "/docs", &[], None).await;
    assert_eq!(docs.status, 200);
    assert!(docs.header("content-type").starts_with("text/html"));
    assert!(
        docs.text.contains(r#"<a href="/openapi.json">"#),
        "{}",
        docs.text
    );
    let assets: Vec<&str> = docs
        .text
        .split(['"', '\''])
        .filter(|s| s.ends_with(".js") || s.ends_with(".css"))
        .collect();
    assert!(assets.len() >= 3, "{assets:?}");
    for asset in assets {
        assert!(
            asset.starts_with("/docs/"),
            "{asset} is not served by idemgate"
        );
        let res = app.send("GET", asset, &[], None).await;
        assert_eq!(res.status, 200, "{asset}");
        assert!(res.text.len() > 100, "{asset}: {}", res.text);
    }
    let init = app
        .send("GET", "/docs/swagger-initializer.js", &[], None)
        .await;
    assert!(init.text.contains(r#""/openapi.json""#), "{}", init.text);
    let missing = app.send("GET", "/docs/nothing-here.js", &[], None).await;
    missing.assert_problem(404, "not-found");
}

/// `--require-fingerprint`: a reserve with neither `fingerprint` nor
/// `request` is refused, naming the setting and what to send; one with
/// either is reserved; the policy says so. Off (the default), the key alone
/// is enough and the policy says that.
async fn a_required_fingerprint_refuses_a_reserve_without_one(b: Backend) {
    let strict = TestApp::new(&b.url(), &["--require-fingerprint"]).await;
    for body in ["", "{}", r#"{"lease_seconds":5}"#] {
        let res = strict.reserve(&fresh_key(), body).await;
        res.assert_problem(400, "invalid-request");
        let detail = res.body["detail"].as_str().unwrap();
        for want in ["IDEMGATE_REQUIRE_FINGERPRINT", "`request`", "`fingerprint`"] {
            assert!(detail.contains(want), "{body:?}: {detail:?} lacks {want}");
        }
    }
    let key = fresh_key();
    let with_fp = strict.reserve(&key, r#"{"fingerprint":"fp-1"}"#).await;
    assert_eq!(with_fp.status, 201, "{with_fp:#?}");
    strict
        .reserve(&key, r#"{"fingerprint":"fp-2"}"#)
        .await
        .assert_problem(422, "key-reused");
    let with_request = strict.reserve(&fresh_key(), CHARGE).await;
    assert_eq!(with_request.status, 201, "{with_request:#?}");
    let policy = strict.send("GET", "/v1/policy", &[], None).await;
    assert_eq!(policy.body["fingerprint"]["required"], true, "{policy:#?}");

    let open = app(&b).await;
    let key = fresh_key();
    assert_eq!(open.reserve(&key, "").await.status, 201);
    let again = open.reserve(&key, "{}").await;
    again.assert_problem(409, "request-in-flight");
    let policy = open.send("GET", "/v1/policy", &[], None).await;
    assert_eq!(policy.body["fingerprint"]["required"], false, "{policy:#?}");
}

async fn logs_carry_the_key_hash_prefix_never_the_key(b: Backend) {
    let app = app(&b).await;
    let key = fresh_key();
    app.reserve(&key, CHARGE).await;
    let parsed = idemgate::key::parse_value(key.as_bytes(), &Default::default()).unwrap();
    let logs = common::logs::captured();
    assert!(
        logs.contains(&parsed.hash_prefix()),
        "the reserve was not logged with its hash prefix"
    );
    common::logs::assert_absent(&[&key]);
}

both_stores! {
    serial: [
        new_key_is_reserved_with_expiry_and_location,
        commit_then_retry_replays_the_stored_response,
        binary_bodies_round_trip_as_base64,
        duplicate_in_flight_is_409_with_retry_after,
        other_payload_is_422_in_flight_and_completed,
        ignored_json_pointers_do_not_change_the_fingerprint,
        missing_and_malformed_keys_are_400,
        strict_mode_and_uuid_format,
        bad_bodies_and_fields_are_400_invalid_request,
        a_header_line_that_is_not_a_pair_is_400_naming_it,
        optional_bodies_may_be_left_out_or_null,
        the_response_headers_the_document_declares_are_sent,
        unknown_ids_and_paths_are_404,
        commit_is_idempotent_for_the_same_response_only,
        bodies_over_the_limit_are_413,
        release_makes_the_key_new_again,
        extend_moves_the_lease_end,
        checkpoint_and_get_show_the_public_record,
        operations_endpoints,
        logs_carry_the_key_hash_prefix_never_the_key,
        a_required_fingerprint_refuses_a_reserve_without_one,
    ],
    concurrent: [
    ],
}
