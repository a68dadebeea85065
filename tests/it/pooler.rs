//! `IDEMGATE_PG_POOLER=transaction` (docs/operations.md, “Behind a connection
//! pooler”): processes that keep no session state. Through the pooler
//! `IDEMGATE_TEST_PG_POOLER` names (`.ci/pgbouncer` starts Debian's PgBouncer
//! with `pool_mode = transaction` and nothing else changed), else on a direct
//! connection: the same assertions either way.

use std::time::{Duration, Instant};

use futures::future::join_all;

use crate::common::app::{TestApp, fresh_key};
use crate::common::bin::idemgate_at;
use crate::common::pg::{TestDb, through_pooler};
use crate::common::proxy::ProxyProcess;
use crate::common::upstream::Upstream;

const POOLER: [&str; 2] = ["--pg-pooler", "transaction"];

/// `idemgate migrate` on the direct connection, as docs/operations.md says to run it.
fn migrate(db: &TestDb) {
    let out = idemgate_at(&db.url)
        .args(["migrate"])
        .args(POOLER)
        .output()
        .expect("idemgate migrate runs");
    assert!(
        out.status.success(),
        "idemgate migrate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What one POST got: its status, or `None` for a connection cut (the proxy
/// it went to was killed).
async fn post(http: &reqwest::Client, url: String, key: String, wait: bool) -> Option<u16> {
    let mut req = http
        .post(url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":100}"#);
    if wait {
        req = req.header("prefer", "wait=15");
    }
    let res = req.send().await.ok()?;
    Some(res.status().as_u16())
}

/// Two proxies over shared keys, one killed with SIGKILL mid-storm, the
/// retries on the other: no key runs twice at the origin, no answer is a
/// 5xx, and every key the survivor answered 201 ran exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_proxies_and_a_kill_run_each_shared_key_once() {
    let db = TestDb::new().await;
    migrate(&db);
    let url = through_pooler(&db.url).unwrap_or_else(|| db.url.clone());
    let upstream = Upstream::start().await;
    let flags = [
        POOLER[0],
        POOLER[1],
        "--default-lease",
        "2",
        "--db-max-connections",
        "8",
    ];
    let mut doomed = ProxyProcess::start_at(&url, &upstream.url(), &flags).await;
    let survivor = ProxyProcess::start_at(&url, &upstream.url(), &flags).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(40))
        .build()
        .unwrap();
    let keys: Vec<String> = (0..120)
        .map(|i| format!("pooled-{i}-{}", uuid::Uuid::new_v4()))
        .collect();

    // Every key to both proxies at once, on an origin that takes 300 ms.
    let (doomed_base, survivor_base) = (doomed.base(), survivor.base());
    let storm = keys.iter().flat_map(|key| {
        [&doomed_base, &survivor_base]
            .map(|base| post(&http, format!("{base}/slow/300"), key.clone(), false))
    });
    let (first, ()) = tokio::join!(join_all(storm), async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        doomed.child.kill().expect("SIGKILL");
    });
    let cut = first.iter().filter(|a| a.is_none()).count();
    let failed: Vec<u16> = first
        .iter()
        .flatten()
        .copied()
        .filter(|s| *s >= 500)
        .collect();
    assert!(failed.is_empty(), "5xx in the storm: {failed:?}");

    // Every key again, on the survivor, waiting for what is in flight.
    let retries = keys.iter().map(|key| {
        post(
            &http,
            format!("{}/slow/300", survivor.base()),
            key.clone(),
            true,
        )
    });
    let retried = join_all(retries).await;
    // A key the killed proxy held is held for an operator (its lease ends
    // under `hold`: 409 outcome-unknown), whichever proxy a storm's race
    // gave it to; every other key completes on the survivor.
    let (mut done, mut held) = (0, 0);
    for (key, answer) in keys.iter().zip(&retried) {
        let status = answer.expect("the survivor answers");
        assert!(status < 500, "{key}: {status}");
        match status {
            201 => {
                done += 1;
                assert_eq!(upstream.started(key), 1, "{key} answered 201");
            }
            409 => held += 1,
            other => panic!("{key}: {other}"),
        }
    }
    let duplicates = keys.iter().filter(|k| upstream.started(k) > 1).count();
    eprintln!(
        "[pooler] {} keys over two proxies{}: {cut} calls cut by the kill, {done} answered 201 \
         on retry, {held} held unknown, {duplicates} duplicates",
        keys.len(),
        if url == db.url {
            " (direct)"
        } else {
            " (through the pooler)"
        },
    );
    assert_eq!(duplicates, 0, "keys executed twice");
    assert_eq!(done + held, keys.len(), "every key completed or held");
    assert!(done > 0, "no key completed on the survivor");
}

/// Under `transaction`, `serve` does not migrate: a database without the
/// tables refuses the start, naming the setting and `idemgate migrate`.
#[tokio::test]
async fn serve_behind_a_pooler_does_not_migrate_and_says_so() {
    let db = TestDb::new().await;
    let url = through_pooler(&db.url).unwrap_or_else(|| db.url.clone());
    let out = idemgate_at(&url)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(POOLER)
        .output()
        .expect("idemgate serve runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "serve started on an empty database: {stderr}"
    );
    assert!(
        stderr.contains("--pg-pooler transaction") || stderr.contains("pg_pooler"),
        "the setting is not named: {stderr}"
    );
    assert!(stderr.contains("idemgate migrate"), "{stderr}");
    assert!(stderr.contains("no migrations at start"), "{stderr}");
}

/// The statement timeout, carried by each statement's own transaction
/// (`SET LOCAL`) rather than by the session: a claim stuck behind a row lock
/// another session holds is cancelled by the database after 1 s (503, well
/// before the store's own 3 s wait for an answer), and the connection it ran
/// on serves the next request.
#[tokio::test]
async fn the_statement_timeout_holds_without_a_session() {
    use sqlx::Connection as _;

    let db = TestDb::new().await;
    let settings = idemgate::store::postgres::PgSettings {
        statement_timeout: Duration::from_secs(1),
        max_connections: 1,
        transaction_pooler: true,
        ..Default::default()
    };
    let app = TestApp::with_settings(&db.url, &[], settings).await;
    let key = fresh_key();
    let res = app.reserve(&key, "{}").await;
    assert_eq!(res.status, 201);
    assert_eq!(
        app.act(&res.reservation_id(), "release", "").await.status,
        204
    );

    let mut locker = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    sqlx::raw_sql("BEGIN; SELECT 1 FROM idempotency_keys FOR UPDATE")
        .execute(&mut locker)
        .await
        .expect("lock the rows");
    let started = Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(15), app.reserve(&key, "{}"))
        .await
        .expect("the claim hung");
    let waited = started.elapsed();
    res.assert_problem(503, "store-unavailable");
    assert!(
        waited < Duration::from_millis(2500),
        "the database's 1 s timeout, not the store's 3 s: waited {waited:?}"
    );
    // The one connection was cancelled, not dropped: it serves at once.
    assert_eq!(app.reserve(&fresh_key(), "{}").await.status, 201);
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("rollback");
    assert_eq!(app.reserve(&key, "{}").await.status, 201);
}

/// `keys show` and `keys list` (and `prune`) through the pooler, in any
/// order, again and again: none leaves a named prepared statement on the
/// pooled server connection for the next to trip over (`prepared statement
/// "sqlx_s_1" already exists`), the schema check at their start included.
#[tokio::test]
async fn keys_and_prune_keep_no_session_state_through_the_pooler() {
    let db = TestDb::new().await;
    migrate(&db);
    let app = TestApp::new(&db.url, &[]).await;
    let key = fresh_key();
    let body = r#"{"fingerprint":"fp","label":"order 1042","lease_seconds":60}"#;
    assert_eq!(app.reserve(&key, body).await.status, 201);
    drop(app);
    use sha2::Digest as _;
    let hash = hex::encode(sha2::Sha256::digest(key.as_bytes()));
    let url = through_pooler(&db.url).unwrap_or_else(|| db.url.clone());
    let show = ["keys", "show", "default", &hash[..12]];
    let list = ["keys", "list", "--state", "in_flight"];
    let prune = ["prune"];
    let rounds: [[&[&str]; 3]; 4] = [
        [&show, &list, &prune],
        [&list, &show, &show],
        [&show, &show, &list],
        [&prune, &list, &list],
    ];
    for (round, commands) in rounds.iter().enumerate() {
        for args in commands {
            let out = idemgate_at(&url)
                .args(*args)
                .args(POOLER)
                .output()
                .expect("idemgate runs");
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            assert!(
                out.status.success(),
                "round {round}, {args:?}: {stdout}{stderr}"
            );
            if args[0] == "keys" {
                assert!(stdout.contains("order 1042"), "{args:?}: {stdout}");
            }
        }
    }
}
