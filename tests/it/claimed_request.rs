//! What a key was for: the request that claimed it — its method, its path
//! with the query, and the trace id of its `traceparent` — kept with the
//! record and shown where an operator looks (the admin view, the console's
//! queue, key page and look-up box; `idemgate keys` is in `crash.rs`, after
//! a proxy killed for real). The request's log line names the method and
//! the path by their OpenTelemetry names, never the query, whose values may
//! be secrets. Sealed at rest with the responses when they are. Both
//! stores; on PostgreSQL, the previous release's signatures of the claim
//! functions keep working beside the new ones and keep no stale request.

use crate::common;

use common::app::{TestApp, TestResponse, fresh_key};
use common::backend::Backend;
use common::proxy::TestProxy;
use common::upstream::Upstream;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SEAL_KEY: &str = "q1Rk0m7oV8WmK3mC0cQwX2b9tq1yZ4kPp5JrS6uE3aA=";

fn traceparent() -> String {
    format!("00-{TRACE_ID}-00f067aa0ba902b7-01")
}

fn hash_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// The key hash a sealing process stores for `key`: keyed under the seal key.
fn sealed_hash_hex(key: &str) -> String {
    let sealer = idemgate::seal::Sealer::from_settings(SEAL_KEY, None).unwrap();
    let plain: [u8; 32] = Sha256::digest(key.as_bytes()).into();
    hex::encode(sealer.key_hash(idemgate::seal::Naming::Keyed(0), &plain))
}

/// A query value no log line may hold.
fn secret_query() -> String {
    format!("token=tok-{}", uuid::Uuid::new_v4().simple())
}

async fn admin_view(proxy: &TestProxy, tenant: &str, key: &str) -> Value {
    admin_view_of(proxy, tenant, &hash_hex(key)).await
}

async fn admin_view_of(proxy: &TestProxy, tenant: &str, hash: &str) -> Value {
    let (status, text) = proxy
        .admin_get(&format!("/v1/admin/keys/{tenant}/{hash}"))
        .await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// A reserve of `key` on `app` with `body`, in the trace of [`traceparent`].
async fn reserve_traced(app: &TestApp, key: &str, body: &Value) -> TestResponse {
    let tp = traceparent();
    let body = body.to_string();
    let res = app
        .send(
            "POST",
            "/v1/reservations",
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
                ("traceparent", &tp),
            ],
            Some(&body),
        )
        .await;
    assert_eq!(res.status, 201, "{res:#?}");
    res
}

/// The admin view of tenant `default`'s key named by `hash` (or a prefix).
async fn view_of(app: &TestApp, hash: &str) -> Value {
    let view = app
        .send("GET", &format!("/v1/admin/keys/default/{hash}"), &[], None)
        .await;
    assert_eq!(view.status, 200, "{view:#?}");
    view.body
}

/// Every raw `request` column, as bytes.
async fn raw_requests(b: &Backend) -> Vec<Vec<u8>> {
    match b {
        Backend::Postgres(db) => {
            let store = Backend::open_pg(db).await;
            let rows: Vec<(Vec<u8>,)> =
                sqlx::query_as("SELECT request FROM idempotency_keys WHERE request IS NOT NULL")
                    .fetch_all(store.pool())
                    .await
                    .expect("read rows");
            store.pool().close().await;
            rows.into_iter().map(|(r,)| r).collect()
        }
        Backend::Sqlite(dir) => {
            let store = Backend::open_sqlite(dir).await;
            let rows: Vec<(Vec<u8>,)> =
                sqlx::query_as("SELECT request FROM idempotency_keys WHERE request IS NOT NULL")
                    .fetch_all(store.pool())
                    .await
                    .expect("read rows");
            store.close().await;
            rows.into_iter().map(|(r,)| r).collect()
        }
    }
}

fn holds(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// Through the proxy: the key's view names its method, its path with the
/// query, and its trace id, in the list and alone; the request's log line
/// names the method and the path, without the query.
async fn the_proxy_keeps_what_each_key_was_for(b: Backend) {
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&b.url(), &upstream.url(), &[], vec![]).await;
    let key = fresh_key();
    let query = secret_query();
    let path = format!("/charges?customer=cus_1&{query}");
    let tp = traceparent();
    let res = proxy
        .send(
            "POST",
            &path,
            &[
                ("idempotency-key", &key),
                ("content-type", "application/json"),
                ("traceparent", &tp),
            ],
            Some(r#"{"amount":5}"#),
        )
        .await;
    assert_eq!(res.status, 201, "{res:#?}");

    let view = admin_view(&proxy, "anonymous", &key).await;
    assert_eq!(view["request"], json!({"method": "POST", "path": path}));
    assert_eq!(view["trace_id"], TRACE_ID);
    let (status, text) = proxy
        .admin_get("/v1/admin/keys?state=completed&limit=1000")
        .await;
    assert_eq!(status, 200, "{text}");
    let list: Value = serde_json::from_str(&text).unwrap();
    let listed = list["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["key_hash"] == hash_hex(&key))
        .expect("listed");
    assert_eq!(listed["request"]["path"], path);

    // Without a traceparent (or with one that is not W3C's), no trace id.
    let plain = fresh_key();
    for (key, header) in [(&plain, None), (&fresh_key(), Some("00-zz-00-01"))] {
        let mut headers = vec![("idempotency-key", key.as_str())];
        headers.extend(header.map(|h| ("traceparent", h)));
        let res = proxy.send("POST", "/charges", &headers, Some("{}")).await;
        assert_eq!(res.status, 201, "{res:#?}");
        let view = admin_view(&proxy, "anonymous", key).await;
        assert_eq!(view["request"]["path"], "/charges");
        assert_eq!(view["trace_id"], Value::Null, "{header:?}");
    }

    let logs = common::logs::captured();
    let hash = &hash_hex(&key)[..12];
    let line = logs
        .lines()
        .find(|l| l.contains(&format!(" key.hash={hash}")) && l.contains("flow: idempotency "))
        .unwrap_or_else(|| panic!("the request's log line, with key.hash {hash}"));
    assert!(
        line.contains("http.request.method=POST") && line.contains("url.path=/charges "),
        "{line}"
    );
    assert!(!logs.contains(&query), "a query value reached the logs");
}

/// The reservation API keeps the request its reserve described (and the
/// trace of the reserve); a reserve that described none has `null`.
async fn the_reservation_api_keeps_the_described_request(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
    let key = fresh_key();
    let body = json!({"request": {"method": "POST", "path": "/v1/charges?currency=eur", "body": {"amount": 5}}});
    reserve_traced(&app, &key, &body).await;
    let view = view_of(&app, &hash_hex(&key)).await;
    assert_eq!(
        view["request"],
        json!({"method": "POST", "path": "/v1/charges?currency=eur"})
    );
    assert_eq!(view["trace_id"], TRACE_ID);

    let bare = fresh_key();
    assert_eq!(
        app.reserve(&bare, r#"{"fingerprint":"fp"}"#).await.status,
        201
    );
    let view = view_of(&app, &hash_hex(&bare)[..12]).await;
    assert_eq!(view["request"], Value::Null);
    assert_eq!(view["trace_id"], Value::Null);
}

/// The reserve's `label` (SPEC §5): kept with the key beside the request it
/// described (or alone, with the reserve's trace), in the view, the list
/// and the console's queue and key page; never part of the fingerprint
/// (another label on a retry is the same call); sealed at rest with the
/// request; refused, naming the field, past 200 characters or with a
/// character that would rewrite what an operator's screen shows.
async fn the_reservation_api_keeps_the_callers_label(b: Backend) {
    let url = b.url();
    let app = TestApp::new(&url, &[]).await;
    let key = fresh_key();
    let body = json!({
        "request": {"method": "POST", "path": "/v1/charges", "body": {"amount": 5}},
        "label": "order 1042 — Zoë's café",
        "lease_seconds": 1,
        "on_lease_expiry": "hold"
    });
    reserve_traced(&app, &key, &body).await;
    let hash = hash_hex(&key);
    let view = view_of(&app, &hash).await;
    assert_eq!(view["label"], "order 1042 — Zoë's café");
    assert_eq!(
        view["request"],
        json!({"method": "POST", "path": "/v1/charges"})
    );

    // Another label on the same call is the same call: while it runs,
    // request-in-flight (not key-reused); the first label stays.
    let relabelled = json!({
        "request": {"method": "POST", "path": "/v1/charges", "body": {"amount": 5}},
        "label": "someone else's words"
    });
    let again = app.reserve(&key, &relabelled.to_string()).await;
    again.assert_problem(409, "request-in-flight");
    assert_eq!(
        view_of(&app, &hash).await["label"],
        "order 1042 — Zoë's café"
    );

    // A label alone: no request, the reserve's trace.
    let bare = fresh_key();
    reserve_traced(
        &app,
        &bare,
        &json!({"fingerprint": "fp", "label": "nightly export"}),
    )
    .await;
    let view = view_of(&app, &hash_hex(&bare)).await;
    assert_eq!(view["label"], "nightly export");
    assert_eq!(view["request"], Value::Null);
    assert_eq!(view["trace_id"], TRACE_ID);

    // The list, the console's queue and its key page show it.
    TestApp::outlive(1).await;
    let list = app
        .send("GET", "/v1/admin/keys?state=stuck", &[], None)
        .await;
    assert_eq!(list.status, 200, "{list:#?}");
    assert!(
        list.body["keys"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["key_hash"] == hash.as_str() && k["label"] == "order 1042 — Zoë's café"),
        "{list:#?}"
    );
    let queue = fragment(&app, "GET", "/console/fragments/queue", None).await;
    assert_eq!(queue.status, 200, "{queue:#?}");
    assert!(
        queue.text.contains("order 1042 — Zoë&#39;s café")
            || queue.text.contains("order 1042 — Zoë's café"),
        "{}",
        queue.text
    );
    let page = fragment(
        &app,
        "GET",
        &format!("/console/fragments/keys/default/{hash}"),
        None,
    )
    .await;
    assert_eq!(page.status, 200, "{page:#?}");
    assert!(page.text.contains("caller-label"), "{}", page.text);

    // Refused, naming the field: too long (counted in characters), or
    // holding a control character or a bidirectional override.
    let at_most = "é".repeat(200);
    let ok = app
        .reserve(&fresh_key(), &json!({"label": at_most}).to_string())
        .await;
    assert_eq!(ok.status, 201, "200 characters are a label: {ok:#?}");
    for (label, says) in [
        ("x".repeat(201), "at most 200"),
        ("order 7\u{1b}[2Jcleared".to_owned(), "U+001B"),
        ("order 7\nforged line".to_owned(), "U+000A"),
        ("order \u{202e}7001".to_owned(), "U+202E"),
    ] {
        let refused = app
            .reserve(&fresh_key(), &json!({"label": label}).to_string())
            .await;
        refused.assert_problem(400, "invalid-request");
        let detail = refused.body["detail"].as_str().unwrap();
        assert!(
            detail.contains("label") && detail.contains(says),
            "{detail}"
        );
    }
    drop(app);

    // Sealed at rest with the request: the column holds no byte of it, and
    // the sealing process shows it.
    let sealing = TestApp::new(&url, &["--seal-key", SEAL_KEY]).await;
    let sealed_key = fresh_key();
    let needle = format!("order-{}", uuid::Uuid::new_v4().simple());
    let body = json!({"request": {"method": "POST", "path": "/v1/charges"}, "label": needle});
    assert_eq!(
        sealing.reserve(&sealed_key, &body.to_string()).await.status,
        201
    );
    let label_only = fresh_key();
    let needle2 = format!("job-{}", uuid::Uuid::new_v4().simple());
    let body = json!({"label": needle2});
    assert_eq!(
        sealing.reserve(&label_only, &body.to_string()).await.status,
        201
    );
    assert_eq!(
        view_of(&sealing, &sealed_hash_hex(&sealed_key)).await["label"],
        needle.as_str()
    );
    assert_eq!(
        view_of(&sealing, &sealed_hash_hex(&label_only)).await["label"],
        needle2.as_str()
    );
    let raw = raw_requests(&b).await;
    assert!(
        raw.iter()
            .all(|r| !holds(r, &needle) && !holds(r, &needle2)),
        "a label is readable at rest"
    );
}

/// Sealed at rest: the column holds no byte of the path, and the view
/// shows it; a process without the seal key shows the key without it (no
/// 500 for a label).
async fn the_request_is_sealed_with_the_responses(b: Backend) {
    let url = b.url();
    let upstream = Upstream::start().await;
    let sealed = TestProxy::start(&url, &upstream.url(), &["--seal-key", SEAL_KEY], vec![]).await;
    let key = fresh_key();
    let needle = format!("needle-{}", uuid::Uuid::new_v4().simple());
    let path = format!("/charges?order={needle}");
    let res = sealed
        .send("POST", &path, &[("idempotency-key", &key)], Some("{}"))
        .await;
    assert_eq!(res.status, 201, "{res:#?}");
    let view = admin_view_of(&sealed, "anonymous", &sealed_hash_hex(&key)).await;
    assert_eq!(view["request"]["path"], path);
    let raw = raw_requests(&b).await;
    assert!(!raw.is_empty());
    assert!(
        raw.iter()
            .all(|r| !holds(r, &needle) && !holds(r, "/charges")),
        "the path is readable at rest"
    );
    drop(sealed);

    // An in-flight key (nothing else sealed) read without the key.
    let app = TestApp::new(&url, &[]).await;
    let held = fresh_key();
    let sealing_app = TestApp::new(&url, &["--seal-key", SEAL_KEY]).await;
    let body = json!({"request": {"method": "PUT", "path": "/orders/7"}}).to_string();
    assert_eq!(sealing_app.reserve(&held, &body).await.status, 201);
    assert_eq!(
        view_of(&app, &sealed_hash_hex(&held)).await["request"],
        Value::Null
    );
    assert_eq!(
        view_of(&sealing_app, &sealed_hash_hex(&held)).await["request"]["path"],
        "/orders/7"
    );
}

/// A request as the console page's htmx sends it.
async fn fragment(app: &TestApp, method: &str, path: &str, form: Option<&str>) -> TestResponse {
    let mut headers = vec![("hx-request", "true"), ("sec-fetch-site", "same-origin")];
    if form.is_some() {
        headers.push(("content-type", "application/x-www-form-urlencoded"));
    }
    app.send(method, path, &headers, form).await
}

/// The console's queue and key page name the request, the trace id and the
/// recovery point's data; its look-up box finds a key by the raw key (sent
/// in a form, hashed, never logged), by its hash or by a prefix, and says
/// what is wrong otherwise.
async fn the_console_shows_and_finds_keys_by_what_they_were_for(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
    let key = fresh_key();
    let body = json!({
        "request": {"method": "POST", "path": "/v1/charges?currency=eur"},
        "lease_seconds": 1,
        "on_lease_expiry": "hold"
    });
    let res = reserve_traced(&app, &key, &body).await;
    let id = res.reservation_id();
    let checkpoint = app
        .act(
            &id,
            "checkpoint",
            r#"{"recovery_point":"charged","data":{"charge":"ch_99"}}"#,
        )
        .await;
    assert_eq!(checkpoint.status, 200, "{checkpoint:#?}");
    TestApp::outlive(1).await;

    let queue = fragment(&app, "GET", "/console/fragments/queue", None).await;
    assert_eq!(queue.status, 200, "{queue:#?}");
    assert!(
        queue.text.contains("POST /v1/charges?currency=eur"),
        "{}",
        queue.text
    );
    let hash = hash_hex(&key);
    let page = fragment(
        &app,
        "GET",
        &format!("/console/fragments/keys/default/{hash}"),
        None,
    )
    .await;
    assert_eq!(page.status, 200, "{page:#?}");
    for shown in [
        "POST /v1/charges?currency=eur",
        TRACE_ID,
        "charged",
        "ch_99",
    ] {
        assert!(page.text.contains(shown), "{shown} not on the key page");
    }

    let encoded = |pairs: &[(&str, &str)]| {
        form_urlencoded::Serializer::new(String::new())
            .extend_pairs(pairs)
            .finish()
    };
    let href = format!("/console/keys/default/{hash}");
    for (kind, text) in [
        ("raw", key.as_str()),
        ("hash", &hash[..]),
        ("hash", &hash[..10]),
    ] {
        let found = fragment(
            &app,
            "POST",
            "/console/fragments/lookup",
            Some(&encoded(&[
                ("tenant", "default"),
                ("key", text),
                ("kind", kind),
            ])),
        )
        .await;
        assert_eq!(found.status, 200, "{kind} {text}: {found:#?}");
        assert_eq!(found.header("hx-redirect"), href, "{kind}");
    }
    for (form, status, says) in [
        (
            vec![
                ("tenant", "default"),
                ("key", fresh_key().leak() as &str),
                ("kind", "raw"),
            ],
            404,
            "no such key",
        ),
        (
            vec![("tenant", "default"), ("key", "abc"), ("kind", "hash")],
            400,
            "at least 8",
        ),
        (
            vec![("tenant", ""), ("key", key.as_str()), ("kind", "raw")],
            400,
            "tenant",
        ),
        (
            vec![("tenant", "default"), ("key", ""), ("kind", "raw")],
            400,
            "give the key",
        ),
        (
            vec![("tenant", "other"), ("key", key.as_str()), ("kind", "raw")],
            404,
            "no such key",
        ),
    ] {
        let res = fragment(
            &app,
            "POST",
            "/console/fragments/lookup",
            Some(&encoded(&form)),
        )
        .await;
        assert_eq!(res.status, status, "{form:?}: {res:#?}");
        assert!(res.text.contains(says), "{form:?}: {}", res.text);
        assert!(res.headers.get("hx-redirect").is_none());
    }
    // The look-up asks the admin rule like every fragment.
    let closed = TestApp::new(&b.url(), &["--tokens", "acme:acme-tok-77c1"]).await;
    let refused = fragment(
        &closed,
        "POST",
        "/console/fragments/lookup",
        Some(&encoded(&[
            ("tenant", "default"),
            ("key", key.as_str()),
            ("kind", "raw"),
        ])),
    )
    .await;
    assert_eq!(refused.status, 403, "{refused:#?}");
}

crate::both_stores!(
    serial: [
        the_reservation_api_keeps_the_described_request,
        the_reservation_api_keeps_the_callers_label,
        the_request_is_sealed_with_the_responses,
        the_console_shows_and_finds_keys_by_what_they_were_for,
    ],
    concurrent: [the_proxy_keeps_what_each_key_was_for],
);

/// The previous release calls the claim functions by their old signatures
/// (eight arguments, thirteen for the batch): they still claim, and a key
/// they claim afresh or take over keeps no request from its earlier life.
#[tokio::test]
async fn the_previous_releases_signatures_claim_and_keep_no_stale_request() {
    let db = common::pg::TestDb::new().await;
    let store = Backend::open_pg(&db).await;
    let pool = store.pool();
    let hash = Sha256::digest(b"an old process's key").to_vec();
    let claim_new =
        "SELECT claimed FROM idemgate_reserve($1, $2, NULL, $3, $4, 60, NULL, 'takeover', $5)";
    let claimed: bool = sqlx::query_scalar(claim_new)
        .bind("acme")
        .bind(&hash)
        .bind(uuid::Uuid::new_v4())
        .bind(0.2_f64)
        .bind(br#"{"method":"POST","path":"/a"}"#.to_vec())
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(claimed);
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let claimed: bool = sqlx::query_scalar(
        "SELECT claimed FROM idemgate_reserve($1, $2, NULL, $3, 30, 60, NULL, 'takeover')",
    )
    .bind("acme")
    .bind(&hash)
    .bind(uuid::Uuid::new_v4())
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(claimed, "the old signature takes the lapsed lease over");
    let (attempt, request): (i32, Option<Vec<u8>>) = sqlx::query_as(
        "SELECT attempt, request FROM idempotency_keys WHERE tenant = 'acme' AND key_hash = $1",
    )
    .bind(&hash)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((attempt, request), (2, None));

    let other = Sha256::digest(b"a batch of the previous release").to_vec();
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idemgate_write_batch('acme', ARRAY['claim'], ARRAY['acme'],
                ARRAY[$1::bytea], ARRAY[NULL::text], ARRAY[$2::uuid], ARRAY[30::float8],
                ARRAY[60::float8], ARRAY[NULL::int8], ARRAY[NULL::int4], ARRAY[NULL::jsonb],
                ARRAY[NULL::bytea], ARRAY['takeover']) WHERE claimed",
    )
    .bind(&other)
    .bind(uuid::Uuid::new_v4())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(rows, 1);
    store.pool().close().await;
}
