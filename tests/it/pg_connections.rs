//! The PostgreSQL store's own connections (no ping when a connection goes
//! back): a statement cancelled half-way must not leave a connection that
//! would answer the next statement with the previous one's messages (the store
//! closes such a connection; sqlx would also drain it), and a connection the
//! database killed must not be handed out again (this one failed before
//! `broken` knew SQLSTATE 57P01).

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::pg::TestDb;
use idemgate::store::postgres::PgSettings;
use idemgate::store::{ClaimRequest, HotPath, Maintenance, PgStore, StoreError, StoredResponse};
use sha2::{Digest, Sha256};
use uuid::Uuid;

fn claim(key: &str) -> ClaimRequest {
    ClaimRequest {
        on_lease_expiry: idemgate::store::LeaseExpiry::Takeover,
        tenant: "acme".into(),
        key_hash: Sha256::digest(key.as_bytes()).into(),
        fingerprint: Some("fp".into()),
        reservation_id: Uuid::new_v4(),
        lease_seconds: 30,
        ttl_seconds: 3600,
        max_in_flight: None,
        request: None,
    }
}

async fn one_connection_store(db: &TestDb) -> Arc<PgStore> {
    let settings = PgSettings {
        max_connections: 1,
        ..PgSettings::default()
    };
    let store = PgStore::connect_lazy(&db.url, &settings).expect("store");
    store.migrate().await.expect("migrate");
    Arc::new(store)
}

#[tokio::test]
async fn a_statement_cancelled_half_way_leaves_no_desynchronised_connection() {
    let db = TestDb::new().await;
    let store = one_connection_store(&db).await;
    let first = store
        .reserve(&claim("blocked"))
        .await
        .expect("reserve")
        .expect("no limit");
    assert!(first.claimed);
    // Released, its record takes the next claim, which must lock the row (a
    // claim that the record refuses reads it without a lock).
    store
        .release("acme", first.record.reservation_id)
        .await
        .expect("release")
        .expect("the holder releases");

    // Another session locks the key's row, so the next reserve of it waits
    // inside PostgreSQL; cancel it there by dropping its future.
    let mut locker = sqlx::PgConnection::connect_with_url(&db.url).await;
    sqlx::query("BEGIN")
        .execute(&mut locker)
        .await
        .expect("begin");
    sqlx::query("SELECT 1 FROM idempotency_keys FOR UPDATE")
        .execute(&mut locker)
        .await
        .expect("lock");
    let cancelled =
        tokio::time::timeout(Duration::from_millis(300), store.reserve(&claim("blocked"))).await;
    assert!(
        cancelled.is_err(),
        "the reserve should still be waiting on the lock"
    );
    sqlx::query("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("rollback");

    // With one connection allowed, every later statement must get a clean
    // one and its own answer.
    for i in 0..20 {
        let c = store
            .reserve(&claim(&format!("after-{i}")))
            .await
            .expect("reserve")
            .expect("no limit");
        assert!(c.claimed, "key after-{i} is new");
        let done = store
            .complete(
                "acme",
                c.record.reservation_id,
                &StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: format!("body {i}").into(),
                },
            )
            .await
            .expect("complete")
            .expect("the holder completes");
        assert_eq!(
            done.response.expect("stored").body,
            format!("body {i}").into_bytes()
        );
    }
    let stats = store.pool_stats().expect("stats");
    assert_eq!(
        (stats.size, stats.idle),
        (1, 1),
        "one clean connection, back at rest"
    );
}

#[tokio::test]
async fn a_connection_the_database_killed_is_not_handed_out_again() {
    let db = TestDb::new().await;
    let store = one_connection_store(&db).await;
    store.ping().await.expect("ping");
    let mut admin = sqlx::PgConnection::connect_with_url(&db.url).await;
    let killed = common::pg::end_other_sessions(&mut admin).await;
    assert!(killed >= 1, "the store's connection was terminated");

    // The first statement may find the dead connection (503, never 500);
    // from then on the store works again.
    match store.ping().await {
        Ok(()) | Err(StoreError::Unavailable { .. }) => {}
        Err(other) => panic!("a dead connection must read as unavailable, got {other}"),
    }
    store.ping().await.expect("a fresh connection");
    assert!(
        store
            .reserve(&claim("after-kill"))
            .await
            .expect("reserve")
            .expect("no limit")
            .claimed
    );
}

trait ConnectWithUrl {
    async fn connect_with_url(url: &str) -> sqlx::PgConnection;
}

impl ConnectWithUrl for sqlx::PgConnection {
    async fn connect_with_url(url: &str) -> sqlx::PgConnection {
        use sqlx::Connection;
        sqlx::PgConnection::connect(url).await.expect("connect")
    }
}
