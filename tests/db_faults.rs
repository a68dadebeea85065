//! A database that hangs rather than goes away (issue 6, scenario 3): a row
//! lock held by another session, or every connection busy. The statement and
//! acquire timeouts must turn both into a prompt `503 store-unavailable` with
//! `Retry-After`, never a hung client and never a 500, and the server must
//! work again as soon as the database does.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::app::{TestApp, fresh_key};
use common::pg::TestDb;
use idemgate::store::postgres::PgSettings;
use sqlx::Connection;

/// Another session that holds every row of `idempotency_keys` locked until
/// it is rolled back.
async fn lock_every_key(url: &str) -> sqlx::PgConnection {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut conn)
        .await
        .expect("begin");
    sqlx::query("SELECT 1 FROM idempotency_keys FOR UPDATE")
        .execute(&mut conn)
        .await
        .expect("lock the rows");
    conn
}

/// A request that hangs fails the test instead of hanging it.
async fn bounded<T>(request: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(15), request)
        .await
        .expect("the request hung: no timeout bounded it")
}

async fn release(mut conn: sqlx::PgConnection) {
    sqlx::query("ROLLBACK")
        .execute(&mut conn)
        .await
        .expect("rollback");
}

#[tokio::test]
async fn a_held_row_lock_gives_a_prompt_503_not_a_hung_client() {
    let db = TestDb::new().await;
    let settings = PgSettings {
        statement_timeout: Duration::from_secs(1),
        ..PgSettings::default()
    };
    let app = TestApp::with_settings(&db.url, &[], settings).await;
    let key = fresh_key();
    assert_eq!(app.reserve(&key, "{}").await.status, 201);

    let locker = lock_every_key(&db.url).await;
    let started = Instant::now();
    let res = bounded(app.reserve(&key, "{}")).await;
    let waited = started.elapsed();
    res.assert_problem(503, "store-unavailable");
    assert!(res.header("retry-after").parse::<u64>().is_ok(), "{res:#?}");
    assert!(
        waited < Duration::from_secs(5),
        "bounded by the statement timeout, not the lock: waited {waited:?}"
    );
    // Keys the lock does not touch are served meanwhile.
    assert_eq!(app.reserve(&fresh_key(), "{}").await.status, 201);

    release(locker).await;
    // The database answers again: so does the server, with the true state.
    app.reserve(&key, "{}")
        .await
        .assert_problem(409, "request-in-flight");
}

#[tokio::test]
async fn every_connection_busy_gives_a_503_after_the_acquire_timeout() {
    let db = TestDb::new().await;
    let settings = PgSettings {
        max_connections: 1,
        acquire_timeout: Duration::from_secs(1),
        statement_timeout: Duration::from_secs(4),
    };
    let app = Arc::new(TestApp::with_settings(&db.url, &[], settings).await);
    let key = fresh_key();
    assert_eq!(app.reserve(&key, "{}").await.status, 201);

    let locker = lock_every_key(&db.url).await;
    // The one connection waits on the lock…
    let stuck = {
        let app = app.clone();
        let key = key.clone();
        tokio::spawn(async move { bounded(app.reserve(&key, "{}")).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // …so another request waits for a connection, and gives up in time.
    let started = Instant::now();
    let res = bounded(app.reserve(&fresh_key(), "{}")).await;
    let waited = started.elapsed();
    res.assert_problem(503, "store-unavailable");
    assert!(
        waited >= Duration::from_millis(800) && waited < Duration::from_secs(3),
        "bounded by the acquire timeout: waited {waited:?}"
    );
    // The stuck one ends at its statement timeout, also a 503.
    stuck
        .await
        .unwrap()
        .assert_problem(503, "store-unavailable");

    release(locker).await;
    assert_eq!(app.reserve(&fresh_key(), "{}").await.status, 201);
}
