//! `Prefer: wait=N` (RFC 7240): a duplicate waits for the holder instead of
//! taking a 409, without holding a database connection while it waits.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use idemgate::store::postgres::PgSettings;

async fn a_waiter_gets_the_replay_when_the_holder_commits(b: Backend) {
    // One connection in the pool: if a waiter held it, the holder's commit
    // could not run and the wait would end in a 409.
    let settings = PgSettings {
        max_connections: 1,
        ..PgSettings::default()
    };
    let app = Arc::new(TestApp::with_settings(&b.url(), &[], settings).await);
    let key = fresh_key();
    let id = app.reserve(&key, "").await.reservation_id();
    let mut waiters = Vec::new();
    for _ in 0..5 {
        let (app, key) = (app.clone(), key.clone());
        waiters.push(tokio::spawn(async move {
            let started = Instant::now();
            let res = app
                .send(
                    "POST",
                    "/v1/reservations",
                    &[("idempotency-key", key.as_str()), ("prefer", "wait=8")],
                    Some(""),
                )
                .await;
            (res, started.elapsed())
        }));
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let commit = app
        .act(&id, "commit", r#"{"status":201,"body":"done"}"#)
        .await;
    assert_eq!(commit.status, 200, "{commit:#?}");
    for w in waiters {
        let (res, took) = w.await.unwrap();
        assert_eq!(res.status, 200, "{res:#?}");
        assert_eq!(res.header("idempotent-replayed"), "true");
        assert_eq!(res.body["response"]["body"], "done");
        assert!(
            took >= Duration::from_millis(300),
            "{took:?}: it did not wait"
        );
        assert!(took < Duration::from_secs(4), "{took:?}: woken late");
    }
}

async fn a_waiter_whose_holder_does_not_finish_gets_the_409(b: Backend) {
    let app = TestApp::new(&b.url(), &["--max-wait", "1"]).await;
    let key = fresh_key();
    app.reserve(&key, "").await;
    let started = Instant::now();
    // Asks for 30 s; the server caps it at its maximum of 1 s.
    let res = app
        .send(
            "POST",
            "/v1/reservations",
            &[
                ("idempotency-key", key.as_str()),
                ("prefer", "respond-async, wait=30"),
            ],
            Some(""),
        )
        .await;
    res.assert_problem(409, "request-in-flight");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "{took:?}"
    );
}

async fn a_holder_in_another_process_is_seen_by_polling(b: Backend) {
    let (a, b) = (
        TestApp::new(&b.url(), &[]).await,
        TestApp::new(&b.url(), &[]).await,
    );
    let key = fresh_key();
    let id = a.reserve(&key, "").await.reservation_id();
    let headers = [("idempotency-key", key.as_str()), ("prefer", "wait=5")];
    let waiting = b.send("POST", "/v1/reservations", &headers, Some(""));
    let committing = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        a.act(&id, "commit", r#"{"status":200,"body":"from a"}"#)
            .await
    };
    let (res, commit) = tokio::join!(waiting, committing);
    assert_eq!(commit.status, 200);
    assert_eq!(res.status, 200, "{res:#?}");
    assert_eq!(res.body["response"]["body"], "from a");
}

both_stores! {
    serial: [
        a_waiter_whose_holder_does_not_finish_gets_the_409,
        a_holder_in_another_process_is_seen_by_polling,
    ],
    concurrent: [
        a_waiter_gets_the_replay_when_the_holder_commits,
    ],
}
