//! Stored responses sealed at rest (`IDEMGATE_SEAL_KEY`, AES-256-GCM;
//! docs/configuration.md, “Sealing at rest”). The raw rows are read with SQL:
//! no body or header value of a sealed response appears in them; replays are
//! correct; keys rotate through `IDEMGATE_SEAL_KEY_PREVIOUS`; a record that
//! cannot be opened (key gone, bytes tampered with) is a 500 problem, never
//! garbage. Both stores.

use crate::common;

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use common::bin::BIN;
use common::proxy::{TestProxy, replayed};
use common::upstream::Upstream;
use idemgate::seal::Sealer;

// `openssl rand -base64 32`, twice.
const KEY_A: &str = "q1Rk0m7oV8WmK3mC0cQwX2b9tq1yZ4kPp5JrS6uE3aA=";
const KEY_B: &str = "Zx8vN2pQ7rT1yU4wE6iO9aS3dF5gH0jK2lM8nB1cV7E=";

const BODY_NEEDLE: &str = "plaintext-body-needle-7f3a";
const HEADER_NEEDLE: &str = "plaintext-header-needle-91c4";

fn key_id(key: &str) -> String {
    Sealer::from_settings(key, None).unwrap().key_id()
}

fn commit_body() -> String {
    format!(
        r#"{{"status":201,"headers":[["content-type","application/json"],["x-secret","{HEADER_NEEDLE}"]],"body":"{{\"card\":\"{BODY_NEEDLE}\"}}"}}"#
    )
}

/// Every stored column that could hold response data, per row, as bytes:
/// headers, body, recovery data, recovery point, fingerprint.
async fn raw_rows(b: &Backend) -> Vec<(String, Vec<u8>)> {
    type Row = (String, Vec<u8>, String, String, String);
    let rows: Vec<Row> = match b {
        Backend::Postgres(db) => {
            let store = Backend::open_pg(db).await;
            let rows = sqlx::query_as(
                "SELECT coalesce(response_headers::text, ''), coalesce(response_body, ''::bytea),
                        coalesce(recovery_data::text, ''), coalesce(recovery_point, ''),
                        coalesce(fingerprint, '')
                   FROM idempotency_keys",
            )
            .fetch_all(store.pool())
            .await;
            store.pool().close().await;
            rows.expect("read rows")
        }
        Backend::Sqlite(dir) => {
            let store = Backend::open_sqlite(dir).await;
            let rows = sqlx::query_as(
                "SELECT coalesce(CAST(response_headers AS TEXT), ''), coalesce(response_body, X''),
                        coalesce(CAST(recovery_data AS TEXT), ''), coalesce(recovery_point, ''),
                        coalesce(fingerprint, '')
                   FROM idempotency_keys",
            )
            .fetch_all(store.pool())
            .await;
            store.close().await;
            rows.expect("read rows")
        }
    };
    rows.into_iter()
        .map(|(headers, body, data, point, fp)| {
            let mut all = body.clone();
            all.extend_from_slice(headers.as_bytes());
            all.extend_from_slice(data.as_bytes());
            all.extend_from_slice(point.as_bytes());
            all.extend_from_slice(fp.as_bytes());
            (headers, all)
        })
        .collect()
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

fn rows_holding(rows: &[(String, Vec<u8>)], needle: &str) -> usize {
    rows.iter().filter(|(_, all)| contains(all, needle)).count()
}

/// Flips one bit in the middle of every stored response body.
async fn tamper_bodies(b: &Backend) {
    match b {
        Backend::Postgres(db) => {
            let store = Backend::open_pg(db).await;
            sqlx::query(
                "UPDATE idempotency_keys
                    SET response_body = set_byte(response_body, length(response_body) / 2,
                                                 get_byte(response_body, length(response_body) / 2) # 1)
                  WHERE response_body IS NOT NULL",
            )
            .execute(store.pool())
            .await
            .expect("tamper");
            store.pool().close().await;
        }
        Backend::Sqlite(dir) => {
            let store = Backend::open_sqlite(dir).await;
            let rows: Vec<(Vec<u8>, Vec<u8>)> = sqlx::query_as(
                "SELECT key_hash, response_body FROM idempotency_keys WHERE response_body IS NOT NULL",
            )
            .fetch_all(store.pool())
            .await
            .expect("read bodies");
            for (hash, mut body) in rows {
                let mid = body.len() / 2;
                body[mid] ^= 1;
                sqlx::query("UPDATE idempotency_keys SET response_body = ?1 WHERE key_hash = ?2")
                    .bind(body)
                    .bind(hash)
                    .execute(store.pool())
                    .await
                    .expect("tamper");
            }
            store.close().await;
        }
    }
}

/// The downgrade as an attacker with write access to the database makes it:
/// every stored response replaced by one in the clear, with a cookie and a
/// page of the attacker's.
async fn plant_plaintext(b: &Backend) {
    const HEADERS: &str = r#"[["set-cookie","planted=1"],["content-type","text/html"]]"#;
    const BODY: &[u8] = b"<script>planted()</script>";
    match b {
        Backend::Postgres(db) => {
            let store = Backend::open_pg(db).await;
            sqlx::query(
                "UPDATE idempotency_keys SET response_headers = $1::jsonb, response_body = $2
                  WHERE response_body IS NOT NULL",
            )
            .bind(HEADERS)
            .bind(BODY)
            .execute(store.pool())
            .await
            .expect("plant");
            store.pool().close().await;
        }
        Backend::Sqlite(dir) => {
            let store = Backend::open_sqlite(dir).await;
            sqlx::query(
                "UPDATE idempotency_keys SET response_headers = ?1, response_body = ?2
                  WHERE response_body IS NOT NULL",
            )
            .bind(HEADERS)
            .bind(BODY)
            .execute(store.pool())
            .await
            .expect("plant");
            store.close().await;
        }
    }
}

async fn commit(app: &TestApp, key: &str) -> String {
    let id = app.reserve(key, "").await.reservation_id();
    let res = app.act(&id, "commit", &commit_body()).await;
    assert_eq!(res.status, 200, "{res:#?}");
    id
}

#[track_caller]
fn assert_replay(res: &common::app::TestResponse) {
    assert_eq!(res.status, 200, "{res:#?}");
    assert_eq!(res.header("idempotent-replayed"), "true");
    assert_eq!(res.body["response"]["status"], 201);
    assert_eq!(
        res.body["response"]["body"],
        format!(r#"{{"card":"{BODY_NEEDLE}"}}"#)
    );
    assert_eq!(res.body["response"]["headers"][1][1], HEADER_NEEDLE);
}

/// A 500 problem that shows nothing of the stored record.
#[track_caller]
fn assert_unopenable(res: &common::app::TestResponse) {
    res.assert_problem(500, "internal");
    for leak in [BODY_NEEDLE, HEADER_NEEDLE, "@idemgate-sealed", KEY_A, KEY_B] {
        assert!(!res.text.contains(leak), "{leak} in {}", res.text);
    }
}

/// The reservation API with a key: nothing readable at rest, replay correct;
/// an unsealed record from before the key was set replays only while
/// `--seal-accept-plaintext` is set, and is refused (never run again)
/// without it.
async fn api_responses_are_sealed_at_rest(b: Backend) {
    let url = b.url();
    let plain = TestApp::new(&url, &[]).await;
    let old_key = fresh_key();
    commit(&plain, &old_key).await;
    // The search finds plaintext where there is some.
    assert_eq!(rows_holding(&raw_rows(&b).await, BODY_NEEDLE), 1);
    assert_eq!(rows_holding(&raw_rows(&b).await, HEADER_NEEDLE), 1);

    let sealed = TestApp::new(&url, &["--seal-key", KEY_A]).await;
    let key = fresh_key();
    let id = commit(&sealed, &key).await;
    assert_replay(&sealed.reserve(&key, "").await);
    let got = sealed
        .send("GET", &format!("/v1/reservations/{id}"), &[], None)
        .await;
    assert_eq!(got.status, 200, "{got:#?}");
    assert_eq!(got.body["response"]["headers"][1][1], HEADER_NEEDLE);

    let rows = raw_rows(&b).await;
    assert_eq!(rows.len(), 2);
    // Only the record stored before the key holds plaintext.
    assert_eq!(rows_holding(&rows, BODY_NEEDLE), 1);
    assert_eq!(rows_holding(&rows, HEADER_NEEDLE), 1);
    assert_eq!(
        rows_holding(&rows, "x-secret"),
        1,
        "header names are sealed too"
    );
    assert_eq!(rows_holding(&rows, &format!("v1 key={}", key_id(KEY_A))), 1);

    // A fresh process (no replay cache) in the window after sealing was
    // turned on opens both: the table is mixed.
    let window = TestApp::new(&url, &["--seal-key", KEY_A, "--seal-accept-plaintext"]).await;
    assert_replay(&window.reserve(&key, "").await);
    assert_replay(&window.reserve(&old_key, "").await);

    // After the window: the record in the clear is refused, twice (never
    // reserved again), and the sealed one still replays.
    let after = TestApp::new(&url, &["--seal-key", KEY_A]).await;
    assert_replay(&after.reserve(&key, "").await);
    assert_unopenable(&after.reserve(&old_key, "").await);
    assert_unopenable(&after.reserve(&old_key, "").await);
}

/// Sealing cannot be downgraded (finding 5 of the adversarial review): a
/// response replaced in the database by one in the clear — a cookie and a
/// script of the attacker's — is never replayed by a sealed deployment,
/// through the API or the proxy, and the request is not run again either.
async fn planted_plaintext_is_never_replayed(b: Backend) {
    let url = b.url();
    let api = TestApp::new(&url, &["--seal-key", KEY_A]).await;
    let api_key = fresh_key();
    commit(&api, &api_key).await;

    let upstream = Upstream::start().await;
    let body = r#"{"amount":500}"#;
    let proxy = TestProxy::start(&url, &upstream.url(), &["--seal-key", KEY_A], Vec::new()).await;
    let proxy_key = fresh_key();
    assert_eq!(proxy.post("/ok", &proxy_key, body).await.status, 201);
    assert_eq!(upstream.started(&proxy_key), 1);

    plant_plaintext(&b).await;

    // The restart: nothing cached.
    let api = TestApp::new(&url, &["--seal-key", KEY_A]).await;
    for _ in 0..2 {
        let res = api.reserve(&api_key, "").await;
        assert_unopenable(&res);
        assert!(!res.text.contains("planted"), "{}", res.text);
    }
    let proxy = TestProxy::start(&url, &upstream.url(), &["--seal-key", KEY_A], Vec::new()).await;
    for _ in 0..2 {
        let res = proxy.post("/ok", &proxy_key, body).await;
        assert_eq!(res.status, 500, "{res:#?}");
        assert!(!res.text.contains("planted"), "{}", res.text);
        assert!(res.headers.get("set-cookie").is_none(), "{res:#?}");
    }
    assert_eq!(upstream.started(&proxy_key), 1, "run again");
}

/// Key A, then B with A as previous, then B alone.
async fn keys_rotate(b: Backend) {
    let url = b.url();
    let a = TestApp::new(&url, &["--seal-key", KEY_A]).await;
    let old = fresh_key();
    commit(&a, &old).await;

    let b_and_a = TestApp::new(&url, &["--seal-key", KEY_B, "--seal-key-previous", KEY_A]).await;
    assert_replay(&b_and_a.reserve(&old, "").await);
    let new = fresh_key();
    commit(&b_and_a, &new).await;
    let rows = raw_rows(&b).await;
    assert_eq!(rows_holding(&rows, &format!("v1 key={}", key_id(KEY_A))), 1);
    assert_eq!(rows_holding(&rows, &format!("v1 key={}", key_id(KEY_B))), 1);
    assert_eq!(rows_holding(&rows, BODY_NEEDLE), 0);

    // Key A dropped too early: records named under it are alive, and this
    // process cannot name them. What it can find replays; a key it cannot
    // find is refused (503), never reserved again — twice.
    let b_only = TestApp::new(&url, &["--seal-key", KEY_B]).await;
    assert_replay(&b_only.reserve(&new, "").await);
    b_only
        .reserve(&old, "")
        .await
        .assert_problem(503, "store-unavailable");
    b_only
        .reserve(&old, "")
        .await
        .assert_problem(503, "store-unavailable");

    // Without any key, no key is found by its keyed name: none is taken.
    let none = TestApp::new(&url, &[]).await;
    none.reserve(&new, "")
        .await
        .assert_problem(503, "store-unavailable");
    none.reserve(&fresh_key(), "")
        .await
        .assert_problem(503, "store-unavailable");

    // With both keys back, both replay: nothing was run again.
    let both = TestApp::new(&url, &["--seal-key", KEY_B, "--seal-key-previous", KEY_A]).await;
    assert_replay(&both.reserve(&old, "").await);
    assert_replay(&both.reserve(&new, "").await);
}

/// One flipped bit in a sealed body: a 500, never garbage.
async fn tampering_is_detected(b: Backend) {
    let url = b.url();
    let a = TestApp::new(&url, &["--seal-key", KEY_A]).await;
    let key = fresh_key();
    let id = commit(&a, &key).await;
    tamper_bodies(&b).await;
    let fresh = TestApp::new(&url, &["--seal-key", KEY_A]).await;
    assert_unopenable(&fresh.reserve(&key, "").await);
    assert_unopenable(
        &fresh
            .send("GET", &format!("/v1/reservations/{id}"), &[], None)
            .await,
    );
}

const RECOVERY_NEEDLE: &str = "plaintext-recovery-needle-5b2e";

/// Checkpoint recovery data is sealed too, with its recovery point's name:
/// nothing of either at rest; the holder that takes over after a crash gets
/// both back, under a rotated key as well; a process without the key takes
/// no key at all (503), never hands bytes on.
async fn recovery_data_is_sealed_at_rest(b: Backend) {
    let url = b.url();
    let a = TestApp::new(&url, &["--seal-key", KEY_A]).await;
    let key = fresh_key();
    let id = a
        .reserve(&key, r#"{"lease_seconds": 1}"#)
        .await
        .reservation_id();
    let checkpoint = format!(
        r#"{{"recovery_point": "charged", "data": {{"charge": "{RECOVERY_NEEDLE}", "n": 3}}}}"#
    );
    let res = a.act(&id, "checkpoint", &checkpoint).await;
    assert_eq!(res.status, 200, "{res:#?}");
    assert_eq!(res.body["recovery"]["data"]["charge"], RECOVERY_NEEDLE);
    let got = a
        .send("GET", &format!("/v1/reservations/{id}"), &[], None)
        .await;
    assert_eq!(
        got.body["recovery"]["data"]["charge"], RECOVERY_NEEDLE,
        "{got:#?}"
    );

    let rows = raw_rows(&b).await;
    assert_eq!(
        rows_holding(&rows, RECOVERY_NEEDLE),
        0,
        "recovery data in the clear"
    );
    assert_eq!(
        rows_holding(&rows, "charged"),
        0,
        "the point's name in the clear"
    );
    assert_eq!(rows_holding(&rows, &format!("v2 key={}", key_id(KEY_A))), 1);
    let policy = a.send("GET", "/v1/policy", &[], None).await.body;
    assert_eq!(policy["stored_response"]["sealed_at_rest"], true);

    // The crash: the lease ends; a process without the key cannot name the
    // key's record, so it takes no key at all (it would take this one as
    // new, and run it again).
    TestApp::outlive(1).await;
    let none = TestApp::new(&url, &[]).await;
    none.reserve(&key, r#"{"lease_seconds": 1}"#)
        .await
        .assert_problem(503, "store-unavailable");
    // After a rotation, the new holder takes the key over and gets the data
    // back.
    let rotated = TestApp::new(&url, &["--seal-key", KEY_B, "--seal-key-previous", KEY_A]).await;
    let takeover = rotated.reserve(&key, "").await;
    assert_eq!(takeover.status, 201, "{takeover:#?}");
    assert_eq!(takeover.body["attempt"], 2);
    assert_eq!(takeover.body["recovery"]["recovery_point"], "charged");
    assert_eq!(takeover.body["recovery"]["data"]["charge"], RECOVERY_NEEDLE);
    assert_eq!(takeover.body["recovery"]["data"]["n"], 3);
}

/// The proxy (the tower layer underneath) seals what it stores, replays it
/// opened, and still replays a record stored unsealed.
async fn proxy_responses_are_sealed_at_rest(b: Backend) {
    let url = b.url();
    let upstream = Upstream::start().await;
    let body = format!(r#"{{"amount":500,"card":"{BODY_NEEDLE}"}}"#);

    let plain = TestProxy::start(&url, &upstream.url(), &[], Vec::new()).await;
    let old_key = fresh_key();
    assert_eq!(plain.post("/ok", &old_key, &body).await.status, 201);
    let rows = raw_rows(&b).await;
    assert_eq!(
        rows_holding(&rows, BODY_NEEDLE),
        1,
        "control: plaintext found"
    );
    assert_eq!(rows_holding(&rows, "x-origin"), 1, "control: headers found");

    let sealed = TestProxy::start(&url, &upstream.url(), &["--seal-key", KEY_A], Vec::new()).await;
    let key = fresh_key();
    let first = sealed.post("/ok", &key, &body).await;
    assert_eq!(first.status, 201, "{first:#?}");
    let again = sealed.post("/ok", &key, &body).await;
    assert!(replayed(&again), "{again:#?}");
    assert_eq!(again.text, first.text);
    assert_eq!(again.header("x-origin"), "yes");
    assert_eq!(upstream.started(&key), 1);

    let rows = raw_rows(&b).await;
    assert_eq!(
        rows_holding(&rows, BODY_NEEDLE),
        1,
        "only the unsealed record"
    );
    assert_eq!(
        rows_holding(&rows, "x-origin"),
        1,
        "only the unsealed record"
    );

    // A fresh proxy with the key, in the window after sealing was turned
    // on, replays both from the store; after it, the one in the clear is
    // refused and not forwarded again.
    let fresh = TestProxy::start(
        &url,
        &upstream.url(),
        &["--seal-key", KEY_A, "--seal-accept-plaintext"],
        Vec::new(),
    )
    .await;
    let again = fresh.post("/ok", &key, &body).await;
    assert!(replayed(&again), "{again:#?}");
    assert_eq!(again.text, first.text);
    assert!(replayed(&fresh.post("/ok", &old_key, &body).await));
    let after = TestProxy::start(&url, &upstream.url(), &["--seal-key", KEY_A], Vec::new()).await;
    assert!(replayed(&after.post("/ok", &key, &body).await));
    assert_eq!(after.post("/ok", &old_key, &body).await.status, 500);
    assert_eq!(upstream.started(&old_key), 1);

    // Tampered: a 500 problem, and the request is not forwarded again.
    tamper_bodies(&b).await;
    let other = TestProxy::start(&url, &upstream.url(), &["--seal-key", KEY_A], Vec::new()).await;
    let res = other.post("/ok", &key, &body).await;
    assert_eq!(res.status, 500, "{res:#?}");
    assert!(!res.text.contains(BODY_NEEDLE), "{}", res.text);
    assert_eq!(upstream.started(&key), 1);
}

both_stores!(
    serial: [
        api_responses_are_sealed_at_rest,
        keys_rotate,
        tampering_is_detected,
        proxy_responses_are_sealed_at_rest,
        recovery_data_is_sealed_at_rest,
        planted_plaintext_is_never_replayed,
    ],
    concurrent: [],
);

/// A bad seal setting refuses to start, naming the setting and not its value,
/// from a flag, the environment or the config file.
#[test]
fn bad_seal_keys_refuse_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("x.db").display());
    let short = "c2hvcnQta2V5LW9mLTE2Yg=="; // 16 bytes
    let config = dir.path().join("idemgate.toml");
    std::fs::write(&config, format!("seal_key = \"{short}\"\n")).unwrap();
    type Case<'a> = (Vec<(&'a str, &'a str)>, Vec<&'a str>, &'a str, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec![("IDEMGATE_SEAL_KEY", "not*base64*at-all")],
            vec![],
            "IDEMGATE_SEAL_KEY",
            "not*base64*at-all",
        ),
        (vec![], vec!["--seal-key", short], "--seal-key", short),
        (
            vec![
                ("IDEMGATE_SEAL_KEY", KEY_A),
                ("IDEMGATE_SEAL_KEY_PREVIOUS", "bad*prev*key"),
            ],
            vec![],
            "IDEMGATE_SEAL_KEY_PREVIOUS",
            "bad*prev*key",
        ),
        (
            vec![],
            vec!["--config", config.to_str().unwrap()],
            "key `seal_key`",
            short,
        ),
    ];
    for (env, flags, setting, value) in cases {
        for command in [
            vec!["serve", "--listen", "127.0.0.1:0"],
            vec![
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:9",
            ],
        ] {
            let out = std::process::Command::new(BIN)
                .args(&command)
                .args(&flags)
                .envs(env.iter().copied())
                .env("DATABASE_URL", &db)
                .env_remove("IDEMGATE_TOKENS")
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{command:?} {flags:?} started");
            assert!(stderr.contains(setting), "{stderr}");
            assert!(!stderr.contains(value), "the value leaked: {stderr}");
            assert!(!stderr.contains("panicked"), "{stderr}");
        }
    }
}
