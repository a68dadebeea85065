//! The SQLite store against real files: locks, busy writers, classification.

use super::errors::{SQLITE_BUSY, SQLITE_FULL, SQLITE_READONLY};
use super::*;
use crate::store::{HotPath as _, Maintenance as _};
use sqlx::SqliteConnection;
use uuid::Uuid;

fn claim(key: u8) -> ClaimRequest {
    ClaimRequest {
        tenant: "t".into(),
        key_hash: [key; 32],
        fingerprint: None,
        reservation_id: Uuid::new_v4(),
        lease_seconds: 30,
        ttl_seconds: 60,
        on_lease_expiry: crate::store::LeaseExpiry::Takeover,
        max_in_flight: None,
        request: None,
    }
}

async fn fresh() -> (tempfile::TempDir, String, SqliteStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let store = SqliteStore::open(&url).await.expect("open");
    store.migrate().await.expect("migrate");
    (dir, url, store)
}

/// The SQLite primary result code of a database error.
fn primary(e: &sqlx::Error) -> Option<i32> {
    let code = e.as_database_error()?.code()?;
    code.parse::<i32>().ok().map(|c| c & 0xff)
}

async fn connect(url: &str, busy: Duration) -> SqliteConnection {
    SqliteConnectOptions::from_str(url)
        .expect("url")
        .busy_timeout(busy)
        .connect()
        .await
        .expect("connect")
}

#[tokio::test]
async fn a_file_that_cannot_be_opened_is_unavailable() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("no/such/dir.db").display());
    let err = SqliteStore::open(&url).await.expect_err("opened");
    // SQLITE_CANTOPEN: create_if_missing makes the file, not its directory.
    assert!(matches!(err, StoreError::Unavailable { .. }), "{err:?}");
}

#[tokio::test]
async fn a_write_lock_held_past_the_busy_timeout_is_unavailable() {
    let (_dir, url, _store) = fresh().await;
    let mut holder = connect(&url, BUSY_TIMEOUT).await;
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut holder)
        .await
        .expect("lock");
    let mut contender = connect(&url, Duration::ZERO).await;
    let err = sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut contender)
        .await
        .expect_err("second writer got the lock");
    assert_eq!(primary(&err), Some(SQLITE_BUSY));
    assert!(matches!(classify(err), StoreError::Unavailable { .. }));
}

#[tokio::test]
async fn a_writer_waits_for_another_connections_lock() {
    let (_dir, url, store) = fresh().await;
    let mut holder = connect(&url, BUSY_TIMEOUT).await;
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut holder)
        .await
        .expect("lock");
    let release = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        sqlx::query("COMMIT")
            .execute(&mut holder)
            .await
            .expect("unlock");
    };
    let req = claim(1);
    let (claimed, ()) = tokio::join!(store.reserve(&req), release);
    assert!(
        claimed
            .expect("reserve waited for the lock")
            .expect("no limit")
            .claimed
    );
}

#[tokio::test]
async fn a_full_disk_and_a_read_only_file_are_unavailable() {
    let (_dir, url, _store) = fresh().await;
    let insert = "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
                  VALUES ('t', '00000000-0000-4000-8000-000000000000', zeroblob(100000))";

    let mut full = connect(&url, BUSY_TIMEOUT).await;
    let pages: i64 = sqlx::query_scalar("PRAGMA page_count")
        .fetch_one(&mut full)
        .await
        .expect("page_count");
    // A page limit at the current size stands in for a full disk.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "PRAGMA max_page_count = {pages}"
    )))
    .execute(&mut full)
    .await
    .expect("max_page_count");
    let err = sqlx::query(insert)
        .execute(&mut full)
        .await
        .expect_err("wrote past the limit");
    assert_eq!(primary(&err), Some(SQLITE_FULL));
    assert!(matches!(classify(err), StoreError::Unavailable { .. }));

    let mut read_only = SqliteConnectOptions::from_str(&url)
        .expect("url")
        .read_only(true)
        .connect()
        .await
        .expect("connect");
    let err = sqlx::query(insert)
        .execute(&mut read_only)
        .await
        .expect_err("wrote to a read-only connection");
    assert_eq!(primary(&err), Some(SQLITE_READONLY));
    assert!(matches!(classify(err), StoreError::Unavailable { .. }));
}

#[tokio::test]
async fn a_constraint_violation_is_a_bug_not_an_outage() {
    let (_dir, _url, store) = fresh().await;
    let err = sqlx::query(
        "INSERT INTO idempotency_keys (tenant, key_hash, state, reservation_id, attempt,
                                       created_at, expires_at)
         VALUES ('t', x'00', 'bogus', '00000000-0000-4000-8000-000000000000', 1, 0, 0)",
    )
    .execute(store.pool())
    .await
    .expect_err("CHECK let a bad state in");
    assert_eq!(primary(&err), Some(19), "SQLITE_CONSTRAINT");
    assert!(matches!(classify(err), StoreError::Other { .. }));
}

#[tokio::test]
async fn an_in_memory_database_works_through_one_connection() {
    let store = SqliteStore::open("sqlite::memory:").await.expect("open");
    store.migrate().await.expect("migrate");
    let first = store
        .reserve(&claim(7))
        .await
        .expect("reserve")
        .expect("no limit");
    assert!(first.claimed);
    let second = store
        .reserve(&claim(7))
        .await
        .expect("reserve")
        .expect("no limit");
    assert!(!second.claimed);
    assert_eq!(second.record.reservation_id, first.record.reservation_id);
    let found = store
        .find_by_reservation("t", first.record.reservation_id)
        .await
        .expect("find");
    assert!(found.is_some());
    store.ping().await.expect("ping");
    let stats = store.pool_stats().expect("stats");
    assert_eq!(stats.size, 1);
}
