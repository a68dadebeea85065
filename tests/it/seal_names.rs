//! Keyed names under sealing (SPEC §1, §8; docs/security.md): with
//! `IDEMGATE_SEAL_KEY` a dump holds no plain SHA-256 of a key, of a
//! credential the proxy made a tenant of, or of a request's fingerprint, so a
//! dictionary over it finds nothing (without sealing it finds everything:
//! the control). And turning sealing on, running two namings at once, and a
//! process that lacks the key strand nothing and run nothing twice. Both
//! stores; the start refusal on the real binary.

use crate::common;

use std::sync::Arc;

use sha2::{Digest, Sha256};
use tokio::sync::Barrier;

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use common::bin::BIN;
use common::proxy::{TestProxy, replayed};
use common::upstream::Upstream;

const KEY_A: &str = "q1Rk0m7oV8WmK3mC0cQwX2b9tq1yZ4kPp5JrS6uE3aA=";

/// The words of the review's dictionary attack: keys, credentials, a body.
const KEY_1: &str = "CANARYKEY1";
const KEY_2: &str = "shared-key-1";
const API_KEY: &str = "CANARYKEY2";
/// `-u usera:Summer2026!`, as curl sends it.
const BASIC: &str = "Basic dXNlcmE6U3VtbWVyMjAyNiE=";
const BEARER: &str = "Bearer CANARYTOKEN";
const BODY: &str = r#"{"pan":"CANARYBODY1"}"#;
const OWN_FINGERPRINT: &str = "CANARYFP-of-the-caller";
const POINT: &str = "CANARYPOINT-charged";

/// Every row of both tables as one lowercase text: bytes in hex.
async fn dump(b: &Backend) -> String {
    let rows: Vec<(String,)> = match b {
        Backend::Postgres(db) => {
            let store = Backend::open_pg(db).await;
            let rows = sqlx::query_as(
                "SELECT row_to_json(k)::text FROM idempotency_keys k
                 UNION ALL SELECT row_to_json(r)::text FROM idempotency_reservations r",
            )
            .fetch_all(store.pool())
            .await
            .expect("dump");
            store.pool().close().await;
            rows
        }
        Backend::Sqlite(dir) => {
            let store = Backend::open_sqlite(dir).await;
            let rows = sqlx::query_as(
                "SELECT tenant || ' ' || hex(key_hash) || ' ' || coalesce(fingerprint, '')
                        || ' ' || coalesce(hex(request), '') || ' ' || coalesce(recovery_point, '')
                        || ' ' || coalesce(CAST(recovery_data AS TEXT), '')
                        || ' ' || coalesce(CAST(response_headers AS TEXT), '')
                        || ' ' || coalesce(hex(response_body), '')
                   FROM idempotency_keys
                 UNION ALL
                 SELECT tenant || ' ' || hex(key_hash) FROM idempotency_reservations",
            )
            .fetch_all(store.pool())
            .await
            .expect("dump");
            store.close().await;
            rows
        }
    };
    rows.into_iter()
        .map(|(r,)| r.to_lowercase())
        .collect::<Vec<_>>()
        .join("\n")
}

/// What the dictionary finds in `dump`: each word whose plain name (its
/// SHA-256, or the fingerprint the proxy computes of the body, or the word
/// itself) is in it.
fn dictionary_hits(dump: &str) -> Vec<&'static str> {
    let sha = |w: &str| hex::encode(Sha256::digest(w.as_bytes()));
    let body_fp = idemgate::fingerprint::fingerprint_request(
        "POST",
        "/ok",
        Some("application/json"),
        BODY.as_bytes(),
        &Default::default(),
    );
    let words: [(&'static str, String); 8] = [
        (KEY_1, sha(KEY_1)),
        (KEY_2, sha(KEY_2)),
        (API_KEY, sha(API_KEY)),
        (BASIC, sha(BASIC)),
        (BEARER, sha(BEARER)),
        (BODY, body_fp.to_lowercase()),
        (OWN_FINGERPRINT, OWN_FINGERPRINT.to_lowercase()),
        (POINT, POINT.to_lowercase()),
    ];
    words
        .into_iter()
        .filter(|(_, name)| dump.contains(name.as_str()))
        .map(|(word, _)| word)
        .collect()
}

/// The review's traffic: two credentials through the proxy with the
/// dictionary's keys and body, and a reservation with the caller's own
/// fingerprint and a checkpoint.
async fn traffic(b: &Backend, flags: &[&str]) {
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&b.url(), &upstream.url(), flags, Vec::new()).await;
    for (auth, key) in [(BASIC, KEY_1), (BEARER, KEY_2), (BASIC, KEY_2)] {
        let headers = [
            ("authorization", auth),
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ];
        let first = proxy.send("POST", "/ok", &headers, Some(BODY)).await;
        assert_eq!(first.status, 201, "{first:#?}");
        let again = proxy.send("POST", "/ok", &headers, Some(BODY)).await;
        assert!(replayed(&again), "{again:#?}");
    }
    assert_eq!(upstream.total(), 3);
    let api = TestApp::new(&b.url(), flags).await;
    let res = api
        .reserve(
            API_KEY,
            &format!(r#"{{"fingerprint":"{OWN_FINGERPRINT}","lease_seconds":60}}"#),
        )
        .await;
    assert_eq!(res.status, 201, "{res:#?}");
    let id = res.reservation_id();
    let checkpoint = format!(r#"{{"recovery_point":"{POINT}","data":{{"n":1}}}}"#);
    assert_eq!(api.act(&id, "checkpoint", &checkpoint).await.status, 200);
    // The caller's own fingerprint is still compared: a retry with another
    // is refused, the same one waits for the holder.
    let other = api
        .reserve(API_KEY, r#"{"fingerprint":"another","lease_seconds":60}"#)
        .await;
    other.assert_problem(422, "key-reused");
    let same = api
        .reserve(
            API_KEY,
            &format!(r#"{{"fingerprint":"{OWN_FINGERPRINT}","lease_seconds":60}}"#),
        )
        .await;
    same.assert_problem(409, "request-in-flight");
}

/// The review's attack 4: an offline dictionary over the table. Without
/// sealing it recovers every word (the control: the test can fail); with a
/// seal key, none.
async fn a_dictionary_over_a_sealed_dump_finds_nothing(b: Backend) {
    traffic(&b, &[]).await;
    let hits = dictionary_hits(&dump(&b).await);
    assert_eq!(hits.len(), 8, "the control found only {hits:?}");

    b.delete_all().await;
    traffic(&b, &["--seal-key", KEY_A]).await;
    let hits = dictionary_hits(&dump(&b).await);
    assert!(hits.is_empty(), "a sealed dump gave away {hits:?}");
}

/// Turning sealing on with the window setting, a process of each kind on
/// one database: the records from before replay, the window's records are
/// found by every process (the one without the key too), and after the
/// window a process that keys names still finds them; the one record in
/// the clear is refused, never run again. Every key runs once.
async fn turning_sealing_on_strands_and_repeats_nothing(b: Backend) {
    let url = b.url();
    let upstream = Upstream::start().await;
    let body = r#"{"amount":500}"#;
    let plain = TestProxy::start(&url, &upstream.url(), &[], Vec::new()).await;
    let before = fresh_key();
    assert_eq!(plain.post("/ok", &before, body).await.status, 201);

    let window = TestProxy::start(
        &url,
        &upstream.url(),
        &["--seal-key", KEY_A, "--seal-accept-plaintext"],
        Vec::new(),
    )
    .await;
    assert!(replayed(&window.post("/ok", &before, body).await));
    let during = fresh_key();
    assert_eq!(window.post("/ok", &during, body).await.status, 201);
    // The process without the key, still running, finds it: it cannot open
    // its sealed response (500), and does not run it again.
    assert_eq!(plain.post("/ok", &during, body).await.status, 500);

    let sealed = TestProxy::start(&url, &upstream.url(), &["--seal-key", KEY_A], Vec::new()).await;
    assert!(replayed(&sealed.post("/ok", &during, body).await));
    // In the clear, from before sealing: refused, not forwarded again.
    assert_eq!(sealed.post("/ok", &before, body).await.status, 500);
    let after = fresh_key();
    assert_eq!(sealed.post("/ok", &after, body).await.status, 201);
    // A process still in the window finds the keyed record.
    assert!(replayed(&window.post("/ok", &after, body).await));
    for key in [&before, &during, &after] {
        assert_eq!(upstream.started(key), 1, "{key} ran again");
    }
}

/// Two namings at once on one database (a process in the window after
/// sealing was turned on, which names records plainly, and one that keys
/// them), many clients sending the same keys through both at the same
/// moment: each key runs once.
async fn two_namings_at_once_run_each_key_once(b: Backend) {
    let url = b.url();
    let upstream = Upstream::start().await;
    let window = Arc::new(
        TestProxy::start(
            &url,
            &upstream.url(),
            &["--seal-key", KEY_A, "--seal-accept-plaintext"],
            Vec::new(),
        )
        .await,
    );
    let keyed =
        Arc::new(TestProxy::start(&url, &upstream.url(), &["--seal-key", KEY_A], Vec::new()).await);
    let keys: Vec<String> = (0..20).map(|_| fresh_key()).collect();
    let senders = 4;
    let barrier = Arc::new(Barrier::new(keys.len() * senders));
    let mut tasks = Vec::new();
    for key in &keys {
        for i in 0..senders {
            let proxy = if i % 2 == 0 {
                window.clone()
            } else {
                keyed.clone()
            };
            let (key, barrier) = (key.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                proxy.post("/slow/200", &key, r#"{"n":1}"#).await.status
            }));
        }
    }
    for task in tasks {
        let status = task.await.unwrap().as_u16();
        // The result, its replay, or a 409 for one that gave way while the
        // other ran past the wait: never a second run.
        assert!([201, 409].contains(&status), "status {status}");
    }
    for key in &keys {
        assert!(
            upstream.started(key) <= 1,
            "{key} ran {} times",
            upstream.started(key)
        );
        // Afterwards through both, one after the other: one runs it if all
        // gave way in the storm, the other replays.
        let first = window.post("/slow/200", key, r#"{"n":1}"#).await;
        assert_eq!(first.status, 201, "{first:#?}");
        assert!(replayed(&keyed.post("/slow/200", key, r#"{"n":1}"#).await));
        assert_eq!(
            upstream.started(key),
            1,
            "{key} ran {} times",
            upstream.started(key)
        );
    }
}

/// `keys show --key` and `--tenant-of` under sealing name the record as
/// stored: with the seal key they find it, without it they say why not.
async fn keys_show_names_a_keyed_record(b: Backend) {
    let url = b.url();
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&url, &upstream.url(), &["--seal-key", KEY_A], Vec::new()).await;
    let key = fresh_key();
    let headers = [
        ("authorization", BEARER),
        ("idempotency-key", key.as_str()),
        ("content-type", "application/json"),
    ];
    assert_eq!(
        proxy.send("POST", "/ok", &headers, Some("{}")).await.status,
        201
    );
    drop(proxy);
    let show = |seal: bool| {
        let mut cmd = std::process::Command::new(BIN);
        cmd.args([
            "keys",
            "show",
            "--key",
            &key,
            "--tenant-of",
            BEARER,
            "--json",
        ])
        .env("DATABASE_URL", &url)
        .env_remove("IDEMGATE_SEAL_KEY");
        if seal {
            cmd.env("IDEMGATE_SEAL_KEY", KEY_A);
        }
        cmd.output().unwrap()
    };
    let found = show(true);
    assert!(
        found.status.success(),
        "{}",
        String::from_utf8_lossy(&found.stderr)
    );
    let view: serde_json::Value = serde_json::from_slice(&found.stdout).unwrap();
    assert_eq!(view["state"], "completed", "{view}");
    // The view's hash is the stored one: not the key's plain SHA-256.
    let plain = hex::encode(Sha256::digest(key.as_bytes()));
    assert_ne!(view["key_hash"], plain.as_str());
    assert!(dump(&b).await.contains(view["key_hash"].as_str().unwrap()));

    let blind = show(false);
    assert!(!blind.status.success());
    let stderr = String::from_utf8_lossy(&blind.stderr);
    assert!(stderr.contains("--seal-key"), "{stderr}");
}

both_stores!(
    serial: [
        a_dictionary_over_a_sealed_dump_finds_nothing,
        turning_sealing_on_strands_and_repeats_nothing,
    ],
    concurrent: [two_namings_at_once_run_each_key_once],
);

/// On PostgreSQL: the command reads the database while nothing holds it.
#[tokio::test]
async fn keys_show_names_a_keyed_record_postgres() {
    keys_show_names_a_keyed_record(Backend::postgres().await).await;
}

/// A process that lacks the seal key others name records with refuses to
/// start (it would not find their records, and would run them again),
/// naming the setting.
#[tokio::test]
async fn a_process_without_the_seal_key_refuses_to_start() {
    let b = Backend::postgres().await;
    let url = b.url();
    let sealed = TestApp::new(&url, &["--seal-key", KEY_A]).await;
    assert_eq!(sealed.reserve(&fresh_key(), "").await.status, 201);
    drop(sealed);
    let port = common::free_port();
    let out = std::process::Command::new(BIN)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &url)
        .env_remove("IDEMGATE_SEAL_KEY")
        .env_remove("IDEMGATE_TOKENS")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started: {stderr}");
    assert!(stderr.contains("IDEMGATE_SEAL_KEY"), "{stderr}");
    assert!(!stderr.contains(KEY_A), "{stderr}");
}
