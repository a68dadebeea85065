//! SPEC §8, scale-out: on a Citus cluster the migrations distribute both
//! tables by tenant, colocated, every per-request statement runs on the
//! tenant's shard alone, pruning goes shard by shard, and a worker that is
//! down is 503 for its tenants only, with nothing acknowledged lost.
//!
//! Each test starts a private cluster (a coordinator and two workers), so it
//! needs the Citus extension installed; see `common::citus::available`. The
//! other suites run against a cluster too, through `IDEMGATE_TEST_CITUS_URL`
//! (see `common::pg`).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use common::bin::idemgate_at;
use common::citus::{self, TempCitus};
use common::pg::TestDb;
use idemgate::prune;
use idemgate::store::postgres::sql;
use idemgate::store::{PgStore, Store};
use sqlx::{Connection as _, PgConnection};
use tokio::sync::{Barrier, OnceCell};

/// One cluster for the tests that do not stop a node, each in a schema of its
/// own.
static SHARED: OnceCell<TempCitus> = OnceCell::const_new();

async fn shared() -> &'static TempCitus {
    SHARED
        .get_or_init(|| async { TempCitus::start(2).await.expect("a Citus cluster") })
        .await
}

async fn fresh_schema() -> TestDb {
    TestDb::schema_on(shared().await.url()).await
}

async fn connect(url: &str) -> PgConnection {
    PgConnection::connect(url).await.expect("connect")
}

fn migrate(url: &str) -> String {
    let out = idemgate_at(url)
        .arg("migrate")
        .output()
        .expect("idemgate migrate");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "idemgate migrate failed: {stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migrations_distribute_both_tables_and_the_claim_by_tenant() {
    if !citus::available("the_migrations_distribute_both_tables_and_the_claim_by_tenant") {
        return;
    }
    let db = fresh_schema().await;
    let first = migrate(&db.url);
    assert!(
        first.contains(
            "citus: distributed idempotency_keys and idempotency_reservations by tenant, colocated"
        ),
        "{first}"
    );
    assert!(first.contains("nodes=2"), "{first}");
    let again = migrate(&db.url);
    assert!(
        again.contains("are distributed by tenant, colocated"),
        "{again}"
    );

    let mut conn = connect(&db.url).await;
    let tables: Vec<(String, String, String, i32)> = sqlx::query_as(
        "SELECT logicalrelid::regclass::text, partmethod::text,
                column_to_column_name(logicalrelid, partkey), colocationid
           FROM pg_dist_partition
          WHERE logicalrelid IN ('idempotency_keys'::regclass,
                                 'idempotency_reservations'::regclass)
          ORDER BY 1",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(tables.len(), 2, "{tables:?}");
    for (table, method, column, _) in &tables {
        assert_eq!(
            (method.as_str(), column.as_str()),
            ("h", "tenant"),
            "{table}"
        );
    }
    assert_eq!(tables[0].3, tables[1].3, "colocated: {tables:?}");
    let function: (Option<i32>, Option<i32>) = sqlx::query_as(
        "SELECT distribution_argument_index, colocationid FROM pg_dist_object
          WHERE objid = 'idemgate_reserve(text, bytea, text, uuid, float8, float8, int8)'::regprocedure",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(function, (Some(0), Some(tables[0].3)));
}

/// Binds the sample values of each statement of `sql::per_request`.
fn bound<'q>(
    name: &str,
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    id: uuid::Uuid,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let query = query.bind("acme");
    match name {
        "reserve" => query
            .bind(vec![7_u8; 32])
            .bind(Some("fp"))
            .bind(id)
            .bind(30.0_f64)
            .bind(60.0_f64)
            .bind(None::<i64>),
        "complete" => query
            .bind(id)
            .bind(201_i32)
            .bind(serde_json::json!([]))
            .bind(b"done".to_vec()),
        "release" | "find" => query.bind(id),
        "extend" => query.bind(id).bind(30.0_f64),
        "checkpoint" => query.bind(id).bind("step").bind(serde_json::json!({})),
        "in_flight_usage" => query.bind(10_i64),
        "stored_usage" => query,
        other => panic!("no sample values for {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_per_request_statement_runs_on_the_tenants_shard_alone() {
    if !citus::available("every_per_request_statement_runs_on_the_tenants_shard_alone") {
        return;
    }
    let db = fresh_schema().await;
    migrate(&db.url);
    let mut conn = connect(&db.url).await;
    let id = uuid::Uuid::new_v4();
    for (name, statement) in sql::per_request() {
        let explain = format!("EXPLAIN (COSTS OFF) {statement}");
        let rows: Vec<String> = bound(name, sqlx::query(sqlx::AssertSqlSafe(explain.as_str())), id)
            .fetch_all(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("EXPLAIN {name}: {e}"))
            .into_iter()
            .map(|row| sqlx::Row::get::<String, _>(&row, 0))
            .collect();
        let plan = rows.join("\n");
        // One task on one worker, no subplan whose results go through the
        // coordinator: a router query.
        assert!(plan.contains("Task Count: 1"), "{name}:\n{plan}");
        assert!(!plan.contains("Subplan"), "{name}:\n{plan}");
        assert!(!plan.contains("INSERT ... SELECT"), "{name}:\n{plan}");
        if name == "reserve" {
            // The call itself is what runs on the worker.
            assert!(
                plan.contains("Function Scan on idemgate_reserve"),
                "{name}:\n{plan}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pruning_goes_shard_by_shard_and_two_pruners_delete_each_row_once() {
    if !citus::available("pruning_goes_shard_by_shard_and_two_pruners_delete_each_row_once") {
        return;
    }
    let db = fresh_schema().await;
    migrate(&db.url);
    let backend = Backend::Postgres(db);
    // Expired records of 40 tenants, so on every shard of both workers; one
    // tenant with more than a batch on one shard.
    let mut conn = connect(&backend.url()).await;
    sqlx::query(
        "INSERT INTO idempotency_keys
             (tenant, key_hash, state, reservation_id, attempt, created_at, expires_at)
         SELECT 'tenant-' || (i % 40), sha256(i::text::bytea), 'completed', gen_random_uuid(), 1,
                now() - interval '2 hours', now() - interval '1 hour'
           FROM generate_series(1, 2000) AS i",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    backend.seed_expired(1_500).await;
    sqlx::query(
        "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
         SELECT tenant, reservation_id, key_hash FROM idempotency_keys WHERE tenant <> 'seed'",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let live = TestApp::new(&backend.url(), &[]).await;
    assert_eq!(live.reserve(&fresh_key(), "").await.status, 201);
    assert_eq!(backend.counts().await, (3_501, 3_501));

    let stores: [Arc<dyn Store>; 2] = [backend.open().await, backend.open().await];
    let barrier = Arc::new(Barrier::new(2));
    let passes = stores.map(|store| {
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            prune::prune_once(store.as_ref()).await
        })
    });
    let mut total = 0;
    for pass in passes {
        total += pass.await.unwrap().expect("prune pass");
    }
    assert_eq!(total, 3_500, "each row deleted once");
    assert_eq!(backend.counts().await, (1, 1), "the live record stays");
    let _ = conn.close().await;
}

/// Reserve and commit one fresh key as `token`; the commit's status, or the
/// reserve's when it failed, with the key.
async fn pair(app: &TestApp, token: &str) -> (u16, u16, String) {
    let key = fresh_key();
    let auth = format!("Bearer {token}");
    let reserved = app.reserve_as(&auth, &key, r#"{"fingerprint":"f1"}"#).await;
    if reserved.status != 201 {
        if reserved.status != 503 {
            panic!("reserve: {reserved:#?}");
        }
        reserved.assert_problem(503, "store-unavailable");
        return (503, 0, key);
    }
    let id = reserved.reservation_id();
    let committed = app
        .act_as(
            &auth,
            &id,
            "commit",
            r#"{"status":201,"body_base64":"b2s="}"#,
        )
        .await;
    if committed.status != 200 {
        committed.assert_problem(503, "store-unavailable");
    }
    (201, committed.status.as_u16(), key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_worker_is_503_for_its_tenants_only_and_nothing_acknowledged_is_lost() {
    if !citus::available("a_stopped_worker_is_503_for_its_tenants_only") {
        return;
    }
    let cluster = TempCitus::start(2).await.expect("a Citus cluster");
    // Migrated first: a tenant's worker is known once the tables are
    // distributed.
    drop(TestApp::new(&cluster.url(), &[]).await);
    let tenants = cluster.tenant_per_worker("tenant").await.unwrap();
    let tokens = format!("{}:token-up,{}:token-down", tenants[0], tenants[1]);
    let app = Arc::new(TestApp::new(&cluster.url(), &["--tokens", &tokens]).await);
    let (up, down) = ("token-up", "token-down");

    // Load on both tenants while the second one's worker stops and starts.
    let acknowledged = Arc::new(std::sync::Mutex::new(Vec::<(String, String)>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for (token, _) in [(up, 0), (down, 1), (up, 2), (down, 3)] {
        let (app, acknowledged, stop) = (app.clone(), acknowledged.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let started = Instant::now();
                let (reserved, committed, key) = pair(&app, token).await;
                if committed == 200 {
                    acknowledged.lock().unwrap().push((token.to_owned(), key));
                }
                seen.push((started, reserved, committed));
            }
            (token, seen)
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stopped_at = Instant::now();
    cluster.workers[1].stop().await.expect("stop a worker");
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.workers[1].restart().await.expect("start it again");
    let restarted_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);

    let mut down_failed = 0;
    let mut down_recovered = 0;
    for task in load {
        let (token, seen) = task.await.unwrap();
        for (at, reserved, committed) in seen {
            let ok = reserved == 201 && committed == 200;
            if token == up {
                assert!(
                    ok,
                    "the healthy worker's tenant failed: {reserved} {committed}"
                );
            } else if at > stopped_at + Duration::from_millis(200) && at < restarted_at {
                down_failed += usize::from(!ok);
            } else if at > restarted_at + Duration::from_secs(2) {
                assert!(ok, "no recovery after the restart: {reserved} {committed}");
                down_recovered += 1;
            }
        }
    }
    assert!(
        down_failed > 0,
        "the stopped worker's tenant never saw a 503"
    );
    assert!(
        down_recovered > 0,
        "the stopped worker's tenant made no request after recovery"
    );

    // Every acknowledged commit is there, completed.
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert!(acknowledged.len() > 20, "{}", acknowledged.len());
    let mut conn = connect(&cluster.url()).await;
    let stored: std::collections::HashSet<(String, Vec<u8>)> = sqlx::query_as(
        "SELECT tenant, key_hash FROM idempotency_keys
          WHERE tenant = ANY($1) AND state = 'completed'",
    )
    .bind(&tenants)
    .fetch_all(&mut conn)
    .await
    .unwrap()
    .into_iter()
    .collect();
    for (token, key) in &acknowledged {
        let tenant = if token == up {
            &tenants[0]
        } else {
            &tenants[1]
        };
        let hash = <sha2::Sha256 as sha2::Digest>::digest(key.as_bytes()).to_vec();
        assert!(
            stored.contains(&(tenant.clone(), hash)),
            "an acknowledged commit of {tenant} is missing"
        );
    }
    // And a retry of one of them is a replay.
    for (token, key) in acknowledged.iter().rev().take(10) {
        let replay = app
            .reserve_as(&format!("Bearer {token}"), key, r#"{"fingerprint":"f1"}"#)
            .await;
        assert_eq!(replay.status, 200, "{replay:#?}");
        assert_eq!(replay.body["state"], "completed", "{replay:#?}");
    }
    let _ = conn.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_over_the_cluster_pings_and_reads_its_layout() {
    if !citus::available("a_store_over_the_cluster_pings_and_reads_its_layout") {
        return;
    }
    let db = fresh_schema().await;
    migrate(&db.url);
    let store = PgStore::connect_lazy(&db.url, &Default::default()).unwrap();
    store.ping().await.expect("ready");
    // No migration in this process: pruning finds the layout itself.
    let batch = store.prune_expired_batch(10).await.expect("prune");
    assert_eq!(batch.deleted, 0);
    assert!(!batch.more);
    assert_eq!(batch.unreachable, None);
}
