//! A key's life over time and under real concurrency: races across pools,
//! takeover after lease expiry, the zombie holder, TTL and pruning.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use idemgate::prune;
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

async fn two_apps(b: &Backend) -> Vec<Arc<TestApp>> {
    vec![
        Arc::new(TestApp::new(&b.url(), &[]).await),
        Arc::new(TestApp::new(&b.url(), &[]).await),
    ]
}

async fn sixty_four_racers_over_two_pools_one_winner(b: Backend) {
    let apps = two_apps(&b).await;
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

async fn racers_after_lease_expiry_make_exactly_one_takeover(b: Backend) {
    let apps = two_apps(&b).await;
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

async fn the_zombie_cannot_commit_over_the_new_holder(b: Backend) {
    let apps = two_apps(&b).await;
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

async fn takeover_requires_the_same_fingerprint(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
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

async fn expired_keys_are_new_before_pruning_and_pruning_deletes_them(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
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
    assert_eq!(b.counts().await.0, 1, "the row is still there");
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
    let pruned = prune::prune_once(app.store.as_ref()).await.unwrap();
    assert_eq!(pruned, 1);
    assert_eq!(
        b.counts().await,
        (0, 0),
        "the key and its reservation ids are gone"
    );
    // A pruned id is simply unknown now.
    app.act(&id, "commit", r#"{"status":200}"#)
        .await
        .assert_problem(404, "not-found");
}

async fn two_pruners_at_once_delete_each_row_once(b: Backend) {
    let apps = two_apps(&b).await;
    b.seed_expired(5_500).await;
    let (pa, pb) = (apps[0].clone(), apps[1].clone());
    let barrier = Arc::new(Barrier::new(2));
    let (ba, bb) = (barrier.clone(), barrier.clone());
    let ta = tokio::spawn(async move {
        ba.wait().await;
        prune::prune_once(pa.store.as_ref()).await.unwrap()
    });
    let tb = tokio::spawn(async move {
        bb.wait().await;
        prune::prune_once(pb.store.as_ref()).await.unwrap()
    });
    let (na, nb) = (ta.await.unwrap(), tb.await.unwrap());
    assert_eq!(na + nb, 5_500, "deleted {na} + {nb}");
    assert_eq!(b.counts().await, (0, 0));
}

/// PostgreSQL only: SQLite has no row locks (its pruner takes turns with
/// writers on the file lock instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_pruning_neither_blocks_nor_is_blocked_by_reservations() {
    let b = Backend::postgres().await;
    let app = TestApp::new(&b.url(), &[]).await;
    b.seed_expired(3_000).await;
    let pool = app.pg.as_ref().unwrap().pool();
    // A reservation in progress holds the lock on one expired row: the
    // pruner skips it instead of waiting.
    let mut tx = pool.begin().await.unwrap();
    // By tenant too, so that on Citus it is a one-shard query (it refuses a
    // FOR UPDATE across shards).
    sqlx::query(
        "SELECT 1 FROM idempotency_keys WHERE tenant = 'seed' AND key_hash = sha256('7'::bytea) \
         FOR UPDATE",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    let pruning = tokio::time::timeout(
        Duration::from_secs(10),
        prune::prune_once(app.store.as_ref()),
    );
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
    assert_eq!(prune::prune_once(app.store.as_ref()).await.unwrap(), 1);
    assert!(app.store.ping().await.is_ok());
}

both_stores! {
    serial: [
        takeover_requires_the_same_fingerprint,
        expired_keys_are_new_before_pruning_and_pruning_deletes_them,
    ],
    concurrent: [
        sixty_four_racers_over_two_pools_one_winner,
        racers_after_lease_expiry_make_exactly_one_takeover,
        the_zombie_cannot_commit_over_the_new_holder,
        two_pruners_at_once_delete_each_row_once,
    ],
}
