//! SPEC §2 over time and under real concurrency: races across pools,
//! takeover after lease expiry, the zombie holder, TTL and pruning.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::app::{TestApp, fresh_key};
use common::pg::TestDb;
use idemgate::prune;
use idemgate::store::Store;
use tokio::sync::Barrier;

/// Fires `n` reserves of `key` at once, alternating between `apps` (separate
/// pools, as separate processes would have); returns (status, body) of each.
async fn race(
    apps: &[Arc<TestApp>],
    n: usize,
    key: &str,
    body: &str,
) -> Vec<(u16, serde_json::Value)> {
    let barrier = Arc::new(Barrier::new(n));
    let mut tasks = Vec::new();
    for i in 0..n {
        let app = apps[i % apps.len()].clone();
        let barrier = barrier.clone();
        let key = key.to_owned();
        let body = body.to_owned();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let res = app.reserve(&key, &body).await;
            (res.status.as_u16(), res.body)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

async fn two_apps(db: &TestDb) -> Vec<Arc<TestApp>> {
    vec![
        Arc::new(TestApp::new(&db.url, &[]).await),
        Arc::new(TestApp::new(&db.url, &[]).await),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_racers_over_two_pools_one_winner() {
    let db = TestDb::new().await;
    let apps = two_apps(&db).await;
    let key = fresh_key();
    let results = race(&apps, 64, &key, r#"{"fingerprint":"same"}"#).await;
    let winners: Vec<_> = results.iter().filter(|(s, _)| *s == 201).collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    assert!(
        results.iter().all(|(s, _)| [201, 409, 200].contains(s)),
        "{results:?}"
    );
    assert_eq!(results.iter().filter(|(s, _)| *s == 409).count(), 63);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racers_after_lease_expiry_make_exactly_one_takeover() {
    let db = TestDb::new().await;
    let apps = two_apps(&db).await;
    let key = fresh_key();
    let first = apps[0].reserve(&key, r#"{"lease_seconds":1}"#).await;
    assert_eq!(first.status, 201);
    TestApp::outlive(1).await;
    let results = race(&apps, 64, &key, r#"{"lease_seconds":30}"#).await;
    let winners: Vec<_> = results.iter().filter(|(s, _)| *s == 201).collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    assert_eq!(winners[0].1["attempt"], 2);
    assert_eq!(results.iter().filter(|(s, _)| *s == 409).count(), 63);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_zombie_cannot_commit_over_the_new_holder() {
    let db = TestDb::new().await;
    let apps = two_apps(&db).await;
    let (a, b) = (&apps[0], &apps[1]);
    let key = fresh_key();
    let old = a
        .reserve(&key, r#"{"lease_seconds":1}"#)
        .await
        .reservation_id();
    let cp = a
        .act(
            &old,
            "checkpoint",
            r#"{"recovery_point":"charged","data":{"charge":"ch_1"}}"#,
        )
        .await;
    assert_eq!(cp.status, 200);
    TestApp::outlive(1).await;

    let takeover = b.reserve(&key, "").await;
    assert_eq!(takeover.status, 201, "{takeover:#?}");
    assert_eq!(takeover.body["attempt"], 2);
    assert_eq!(takeover.body["recovery"]["recovery_point"], "charged");
    assert_eq!(takeover.body["recovery"]["data"]["charge"], "ch_1");
    let new = takeover.reservation_id();

    // The old holder wakes up: every write it tries is refused.
    for (action, body) in [
        ("commit", r#"{"status":200,"body":"zombie"}"#),
        ("extend", ""),
        ("checkpoint", r#"{"recovery_point":"late"}"#),
        ("release", ""),
    ] {
        a.act(&old, action, body)
            .await
            .assert_problem(409, "lease-lost");
    }
    let old_view = a
        .send("GET", &format!("/v1/reservations/{old}"), &[], None)
        .await;
    assert_eq!(old_view.body["live"], false);
    assert_eq!(
        b.act(&new, "commit", r#"{"status":200,"body":"winner"}"#)
            .await
            .status,
        200
    );
    // After completion, the zombie's commit is still lease-lost, not a replay.
    a.act(&old, "commit", r#"{"status":200,"body":"winner"}"#)
        .await
        .assert_problem(409, "lease-lost");
    let replay = a.reserve(&key, "").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.body["response"]["body"], "winner");
}

#[tokio::test]
async fn takeover_requires_the_same_fingerprint() {
    let db = TestDb::new().await;
    let app = TestApp::new(&db.url, &[]).await;
    let key = fresh_key();
    app.reserve(&key, r#"{"fingerprint":"a","lease_seconds":1}"#)
        .await;
    TestApp::outlive(1).await;
    app.reserve(&key, r#"{"fingerprint":"b"}"#)
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(
        app.reserve(&key, r#"{"fingerprint":"a"}"#).await.status,
        201
    );
}

#[tokio::test]
async fn expired_keys_are_new_before_pruning_and_pruning_deletes_them() {
    let db = TestDb::new().await;
    let app = TestApp::new(&db.url, &[]).await;
    let key = fresh_key();
    let id = app
        .reserve(&key, r#"{"fingerprint":"a","ttl_seconds":1}"#)
        .await
        .reservation_id();
    assert_eq!(
        app.act(&id, "commit", r#"{"status":200}"#).await.status,
        200
    );
    TestApp::outlive(1).await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(app.store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 1, "the row is still there");
    // New again, even with another payload; the old id is dead.
    let again = app
        .reserve(&key, r#"{"fingerprint":"b","ttl_seconds":1}"#)
        .await;
    assert_eq!(again.status, 201, "{again:#?}");
    assert_eq!(again.body["attempt"], 1);
    app.act(&id, "commit", r#"{"status":200}"#)
        .await
        .assert_problem(409, "lease-lost");
    TestApp::outlive(1).await;
    let pruned = prune::prune_once(&app.store).await.unwrap();
    assert_eq!(pruned, 1);
    let (keys, fences): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM idempotency_keys), (SELECT count(*) FROM idempotency_reservations)",
    )
    .fetch_one(app.store.pool())
    .await
    .unwrap();
    assert_eq!(
        (keys, fences),
        (0, 0),
        "the key and its reservation ids are gone"
    );
    // A pruned id is simply unknown now.
    app.act(&id, "commit", r#"{"status":200}"#)
        .await
        .assert_problem(404, "not-found");
}

/// Inserts `n` records that expired an hour ago.
async fn seed_expired(app: &TestApp, n: i64) {
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant, key_hash, state, reservation_id, attempt, created_at, expires_at)
         SELECT 'seed', sha256(i::text::bytea), 'completed', gen_random_uuid(), 1,
                now() - interval '2 hours', now() - interval '1 hour'
           FROM generate_series(1, $1) AS i",
    )
    .bind(n)
    .execute(app.store.pool())
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_pruners_at_once_delete_each_row_once() {
    let db = TestDb::new().await;
    let apps = two_apps(&db).await;
    seed_expired(&apps[0], 5_500).await;
    let (a, b) = (apps[0].clone(), apps[1].clone());
    let barrier = Arc::new(Barrier::new(2));
    let (ba, bb) = (barrier.clone(), barrier.clone());
    let ta = tokio::spawn(async move {
        ba.wait().await;
        prune::prune_once(&a.store).await.unwrap()
    });
    let tb = tokio::spawn(async move {
        bb.wait().await;
        prune::prune_once(&b.store).await.unwrap()
    });
    let (na, nb) = (ta.await.unwrap(), tb.await.unwrap());
    assert_eq!(na + nb, 5_500, "deleted {na} + {nb}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(apps[0].store.pool())
        .await
        .unwrap();
    assert_eq!(left, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pruning_neither_blocks_nor_is_blocked_by_reservations() {
    let db = TestDb::new().await;
    let app = TestApp::new(&db.url, &[]).await;
    seed_expired(&app, 3_000).await;
    // A reservation in progress holds the lock on one expired row: the
    // pruner skips it instead of waiting.
    let mut tx = app.store.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE key_hash = sha256('7'::bytea) FOR UPDATE")
        .execute(&mut *tx)
        .await
        .unwrap();
    let pruning = tokio::time::timeout(Duration::from_secs(10), prune::prune_once(&app.store));
    // Reservations run while the pruner works, and all succeed.
    let reserving = async {
        let mut statuses = Vec::new();
        for _ in 0..20 {
            statuses.push(app.reserve(&fresh_key(), "").await.status.as_u16());
        }
        statuses
    };
    let (pruned, statuses) = tokio::join!(pruning, reserving);
    let pruned = pruned.expect("the pruner waited on a locked row").unwrap();
    assert_eq!(pruned, 2_999, "the locked row was skipped");
    assert!(statuses.iter().all(|s| *s == 201), "{statuses:?}");
    tx.rollback().await.unwrap();
    assert_eq!(prune::prune_once(&app.store).await.unwrap(), 1);
    assert!(app.store.ping().await.is_ok());
}
