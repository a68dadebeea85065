//! The writer thread: clean-up after a failed or panicking command,
//! cancellation, closing.

use futures::FutureExt as _;
use rusqlite::params;

use super::*;
use crate::store::HotPath as _;

fn claim(key: u8) -> ClaimRequest {
    ClaimRequest {
        tenant: "t".into(),
        key_hash: [key; 32],
        fingerprint: None,
        reservation_id: uuid::Uuid::new_v4(),
        lease_seconds: 30,
        ttl_seconds: 60,
        on_lease_expiry: crate::store::LeaseExpiry::Takeover,
        max_in_flight: None,
        request: None,
    }
}

async fn fresh() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let store = SqliteStore::open(&url).await.expect("open");
    store.migrate().await.expect("migrate");
    (dir, store)
}

/// Inserts a reservation row of 100 kB (about 25 pages).
fn write_past(conn: &rusqlite::Connection) -> Result<()> {
    conn.execute(
        "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
         VALUES ('t', ?1, zeroblob(100000))",
        params![uuid::Uuid::new_v4().hyphenated().to_string()],
    )
    .map(|_| ())
    .map_err(super::errors::classify_rs)
}

fn pragma(conn: &rusqlite::Connection, name: &str) -> Result<i64> {
    conn.query_row(&format!("PRAGMA {name}"), [], |r| r.get(0))
        .map_err(super::errors::classify_rs)
}

async fn reservations(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_reservations")
        .fetch_one(&store.reader)
        .await
        .expect("count")
}

async fn records(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&store.reader)
        .await
        .expect("count")
}

#[tokio::test]
async fn a_write_that_failed_on_the_file_gets_a_fresh_connection() {
    let (_dir, store) = fresh().await;
    // A page limit on the write connection stands in for a full disk; it
    // belongs to the connection, so a fresh one has none.
    let pages = store
        .writer
        .write(|conn| {
            let pages = pragma(conn, "page_count")?;
            pragma(conn, &format!("max_page_count = {pages}"))?;
            Ok(pages)
        })
        .await
        .expect("limit");
    let err = store
        .writer
        .write(write_past)
        .await
        .expect_err("wrote past");
    assert!(err.is_unavailable(), "a full disk is an outage: {err:?}");
    let limit = store
        .writer
        .write(|conn| pragma(conn, "max_page_count"))
        .await
        .expect("max_page_count");
    assert!(limit > pages, "the same connection came back: {limit}");
    store
        .writer
        .write(write_past)
        .await
        .expect("a fresh connection writes");
    assert_eq!(reservations(&store).await, 1);
}

#[tokio::test]
async fn a_failed_write_in_memory_is_rolled_back_not_lost() {
    let store = SqliteStore::open("sqlite::memory:").await.expect("open");
    store.migrate().await.expect("migrate");
    store.reserve(&claim(1)).await.expect("reserve");
    let err = store
        .writer
        .write(|conn| {
            write_past(conn)?;
            Err::<(), _>(StoreError::other("changed its mind"))
        })
        .await
        .expect_err("failed");
    assert!(!err.is_unavailable());
    assert_eq!(reservations(&store).await, 0, "rolled back");
    assert_eq!(records(&store).await, 1, "the claim before it kept");
    assert!(
        store
            .reserve(&claim(2))
            .await
            .expect("reserve")
            .expect("no limit")
            .claimed
    );
    assert_eq!(records(&store).await, 2);
}

#[tokio::test]
async fn a_panicking_command_is_an_error_and_the_writer_goes_on() {
    let (_dir, store) = fresh().await;
    let err = store
        .writer
        .write(|conn| -> Result<()> {
            write_past(conn)?;
            panic!("a bug in a command")
        })
        .await
        .expect_err("panicked");
    assert!(!err.is_unavailable(), "{err:?}");
    assert_eq!(reservations(&store).await, 0, "rolled back");
    assert!(
        store
            .reserve(&claim(1))
            .await
            .expect("reserve")
            .expect("no limit")
            .claimed
    );
}

#[tokio::test]
async fn a_write_whose_request_went_away_still_commits() {
    let (_dir, store) = fresh().await;
    let req = claim(1);
    // Polled once: the command is sent, then the request is dropped.
    assert!(store.reserve(&req).now_or_never().is_none());
    // The writer runs commands in order: this one comes after it.
    store.writer.write(|_| Ok(())).await.expect("barrier");
    let found = store
        .find_by_reservation("t", req.reservation_id)
        .await
        .expect("find");
    assert!(found.is_some(), "the claim was dropped with its request");
}

#[tokio::test]
async fn a_closed_store_refuses_writes_as_unavailable() {
    let (_dir, store) = fresh().await;
    let other = store.clone();
    store.close().await;
    let err = other.reserve(&claim(1)).await.expect_err("wrote");
    assert!(err.is_unavailable(), "{err:?}");
}
