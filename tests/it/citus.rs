//! Scale-out (docs/operations.md, “Scaling out”): on a Citus cluster the
//! migrations distribute both tables by tenant, colocated, every per-request
//! statement runs on the tenant's shard alone, pruning goes shard by shard, and
//! a worker that is down is 503 for its tenants only, with nothing acknowledged
//! lost.
//!
//! Each test starts a private cluster (a coordinator and two workers), so it
//! needs the Citus extension installed; see `common::citus::available`. The
//! other suites run against a cluster too, through `IDEMGATE_TEST_CITUS_URL`
//! (see `common::pg`).

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use common::bin::idemgate_at;
use common::citus::{self, TempCitus};
use common::pg::TestDb;
use idemgate::prune;
use idemgate::store::postgres::sql;
use idemgate::store::{HotPath, Maintenance, PgStore, StoreError};
use sqlx::{Connection as _, PgConnection};
use tokio::sync::OnceCell;

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

/// A connection of the test's own, named so that `idemgate migrate` does
/// not take it for a process of an idemgate before 0.2.0 (those set no
/// `application_name`) and refuse a contract step for it.
async fn connect(url: &str) -> PgConnection {
    use sqlx::ConnectOptions as _;
    let options: sqlx::postgres::PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    options
        .application_name("idemgate tests")
        .connect()
        .await
        .expect("connect")
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
          WHERE objid = 'idemgate_reserve(text, bytea, text, uuid, float8, float8, int8, text)'::regprocedure",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(function, (Some(0), Some(tables[0].3)));
    let batch_function: (Option<i32>, Option<i32>) = sqlx::query_as(
        "SELECT distribution_argument_index, colocationid FROM pg_dist_object
          WHERE objid = 'idemgate_write_batch(text, text[], text[], bytea[], text[], uuid[],
                         float8[], float8[], int8[], int4[], jsonb[], bytea[], text[])'::regprocedure",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(batch_function, (Some(0), Some(tables[0].3)));
}

/// A batch of claims and commits of tenants whose shards are on different
/// workers: split by tenant, each part on its own worker, every answer as
/// one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_spanning_tenants_on_two_workers_answers_each_write() {
    use idemgate::store::{Batcher, ClaimRequest, StoredResponse, Write, Written};
    if !citus::available("a_batch_spanning_tenants_on_two_workers_answers_each_write") {
        return;
    }
    let db = fresh_schema().await;
    migrate(&db.url);
    let mut conn = connect(&db.url).await;
    // Two tenants whose shards are placed on different workers.
    let mut by_node: std::collections::BTreeMap<i32, String> = Default::default();
    for i in 0..64 {
        let tenant = format!("spread-{i}");
        let node: i32 = sqlx::query_scalar(
            "SELECT p.nodeport FROM pg_dist_shard_placement p
              WHERE p.shardid = get_shard_id_for_distribution_column('idempotency_keys', $1)",
        )
        .bind(&tenant)
        .fetch_one(&mut conn)
        .await
        .unwrap();
        by_node.entry(node).or_insert(tenant);
    }
    assert!(
        by_node.len() >= 2,
        "every tenant tried on one node: {by_node:?}"
    );
    let tenants: Vec<String> = by_node.into_values().take(2).collect();
    let store = Arc::new(PgStore::connect_lazy(&db.url, &Default::default()).unwrap());
    let batched = Batcher::new(store.clone());
    let claim = |tenant: &str, key: u8, fingerprint: &str| ClaimRequest {
        on_lease_expiry: idemgate::store::LeaseExpiry::Takeover,
        tenant: tenant.to_owned(),
        key_hash: [key; 32],
        fingerprint: Some(fingerprint.to_owned()),
        reservation_id: uuid::Uuid::new_v4(),
        lease_seconds: 60,
        ttl_seconds: 3600,
        max_in_flight: None,
        request: None,
    };
    let writes = vec![
        Write::Claim(claim(&tenants[0], 1, "a")),
        Write::Claim(claim(&tenants[1], 1, "a")),
        Write::Claim(claim(&tenants[0], 1, "b")),
        Write::Claim(claim(&tenants[1], 2, "a")),
    ];
    let answers = batched.write_together(writes).await;
    let claims: Vec<_> = answers
        .into_iter()
        .map(|a| match a.expect("answered") {
            Written::Claim(Some(c)) => c,
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(claims[0].claimed && claims[1].claimed && claims[3].claimed);
    assert!(!claims[2].claimed, "the second claim of a key in the batch");
    assert_eq!(
        claims[2].record.reservation_id,
        claims[0].record.reservation_id
    );
    assert_eq!(claims[2].record.fingerprint.as_deref(), Some("a"));
    let response = |tag: &str| StoredResponse {
        status: 201,
        headers: vec![("x-tag".into(), tag.into())],
        body: tag.as_bytes().to_vec().into(),
    };
    let commits = [0, 1, 3].map(|i| Write::Complete {
        tenant: claims[i].record.tenant.clone(),
        reservation_id: claims[i].record.reservation_id,
        response: response(&format!("r{i}")),
    });
    for (i, answer) in [0, 1, 3]
        .iter()
        .zip(batched.write_together(commits.to_vec()).await)
    {
        match answer.expect("answered") {
            Written::Complete(Some(record)) => {
                assert_eq!(record.response, Some(response(&format!("r{i}"))));
            }
            other => panic!("{other:?}"),
        }
    }
    for i in [0, 1, 3] {
        let found = store
            .find_by_reservation(&claims[i].record.tenant, claims[i].record.reservation_id)
            .await
            .unwrap()
            .expect("the record");
        assert_eq!(found.record.response, Some(response(&format!("r{i}"))));
    }
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
            .bind(None::<i64>)
            .bind("hold")
            .bind(br#"{"method":"POST","path":"/charges"}"#.to_vec()),
        "complete" => query
            .bind(id)
            .bind(201_i32)
            .bind(serde_json::json!([]))
            .bind(b"done".to_vec()),
        "release" | "find" => query.bind(id),
        "mark_unknown" => query.bind(id).bind("the provider timed out after sending"),
        "find_key" => query.bind(vec![7_u8; 32]),
        "extend" => query.bind(id).bind(30.0_f64).bind(Some("takeover")),
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
    assert_eq!(backend.counts().await, (3_501, 3_500));

    let total = backend.prune_twice_at_once().await;
    assert_eq!(total, 3_500, "each row deleted once");
    assert_eq!(backend.counts().await, (1, 0), "the live record stays");
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

/// What load on some tenants saw: each pair's start, reserve and commit
/// status, by token; and the keys whose commit was acknowledged.
struct Seen {
    pairs: Vec<(&'static str, Instant, u16, u16)>,
    acknowledged: Vec<(&'static str, String)>,
}

/// Runs reserve+commit pairs, two tasks per token, while `during` runs,
/// and for `after` once it is done.
async fn load_while(
    app: &Arc<TestApp>,
    tokens: [&'static str; 2],
    during: impl std::future::Future<Output = ()>,
    after: Duration,
) -> Seen {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for token in [tokens[0], tokens[1], tokens[0], tokens[1]] {
        let (app, stop) = (app.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let mut pairs = Vec::new();
            let mut acknowledged = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let started = Instant::now();
                let (reserved, committed, key) = pair(&app, token).await;
                if committed == 200 {
                    acknowledged.push((token, key));
                }
                pairs.push((token, started, reserved, committed));
            }
            (pairs, acknowledged)
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    during.await;
    tokio::time::sleep(after).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut seen = Seen {
        pairs: Vec::new(),
        acknowledged: Vec::new(),
    };
    for task in load {
        let (pairs, acknowledged) = task.await.unwrap();
        seen.pairs.extend(pairs);
        seen.acknowledged.extend(acknowledged);
    }
    seen
}

/// Every acknowledged commit is in the database, completed, and a retry of
/// the last ones is a replay.
async fn all_acknowledged_present(
    app: &TestApp,
    url: &str,
    seen: &Seen,
    tenant_of: impl Fn(&str) -> String,
) {
    assert!(seen.acknowledged.len() > 20, "{}", seen.acknowledged.len());
    let mut conn = connect(url).await;
    let stored: std::collections::HashSet<(String, Vec<u8>)> =
        sqlx::query_as("SELECT tenant, key_hash FROM idempotency_keys WHERE state = 'completed'")
            .fetch_all(&mut conn)
            .await
            .unwrap()
            .into_iter()
            .collect();
    for (token, key) in &seen.acknowledged {
        let tenant = tenant_of(token);
        let hash = <sha2::Sha256 as sha2::Digest>::digest(key.as_bytes()).to_vec();
        assert!(
            stored.contains(&(tenant.clone(), hash)),
            "an acknowledged commit of {tenant} is missing"
        );
    }
    for (token, key) in seen.acknowledged.iter().rev().take(10) {
        let replay = app
            .reserve_as(&format!("Bearer {token}"), key, r#"{"fingerprint":"f1"}"#)
            .await;
        assert_eq!(replay.status, 200, "{replay:#?}");
        assert_eq!(replay.body["state"], "completed", "{replay:#?}");
    }
    let _ = conn.close().await;
}

/// A cluster, migrated, and an app whose two tokens name a tenant on each
/// worker (in the workers' order).
async fn cluster_with_a_tenant_per_worker() -> (TempCitus, Arc<TestApp>, Vec<String>) {
    let cluster = TempCitus::start(2).await.expect("a Citus cluster");
    // Migrated first: a tenant's worker is known once the tables are
    // distributed.
    drop(TestApp::new(&cluster.url(), &[]).await);
    let tenants = cluster.tenant_per_worker("tenant").await.unwrap();
    let tokens = format!("{}:token-0,{}:token-1", tenants[0], tenants[1]);
    let app = Arc::new(TestApp::new(&cluster.url(), &["--tokens", &tokens]).await);
    (cluster, app, tenants)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_worker_is_503_for_its_tenants_only_and_nothing_acknowledged_is_lost() {
    if !citus::available("a_stopped_worker_is_503_for_its_tenants_only") {
        return;
    }
    let (cluster, app, tenants) = cluster_with_a_tenant_per_worker().await;
    let (up, down) = ("token-0", "token-1");
    let stopped_at = std::sync::Mutex::new(None);
    let restarted_at = std::sync::Mutex::new(None);
    let outage = async {
        *stopped_at.lock().unwrap() = Some(Instant::now());
        cluster.workers[1].stop().await.expect("stop a worker");
        tokio::time::sleep(Duration::from_secs(3)).await;
        cluster.workers[1].restart().await.expect("start it again");
        *restarted_at.lock().unwrap() = Some(Instant::now());
    };
    let seen = load_while(&app, [up, down], outage, Duration::from_secs(3)).await;
    let stopped_at = stopped_at.lock().unwrap().unwrap();
    let restarted_at = restarted_at.lock().unwrap().unwrap();

    let mut down_failed = 0;
    let mut down_recovered = 0;
    for &(token, at, reserved, committed) in &seen.pairs {
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
    assert!(
        down_failed > 0,
        "the stopped worker's tenant never saw a 503"
    );
    assert!(
        down_recovered > 0,
        "the stopped worker's tenant made no request after recovery"
    );
    all_acknowledged_present(&app, &cluster.url(), &seen, |token| {
        tenants[usize::from(token == down)].clone()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shard_moving_under_load_is_never_a_500_and_loses_nothing() {
    if !citus::available("a_shard_moving_under_load_is_never_a_500_and_loses_nothing") {
        return;
    }
    let (cluster, app, tenants) = cluster_with_a_tenant_per_worker().await;
    let mut conn = connect(&cluster.url()).await;
    let shard: i64 =
        sqlx::query_scalar("SELECT get_shard_id_for_distribution_column('idempotency_keys', $1)")
            .bind(&tenants[0])
            .fetch_one(&mut conn)
            .await
            .unwrap();
    let (from, to) = (cluster.workers[0].port(), cluster.workers[1].port());
    // The tenant's shard (and its colocated reservations shard with it) moves
    // to the other worker while both tenants' requests run.
    let moving = async {
        sqlx::query(
            "SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3,
                                               shard_transfer_mode => 'block_writes')",
        )
        .bind(shard)
        .bind(i32::from(from))
        .bind(i32::from(to))
        .execute(&mut conn)
        .await
        .expect("move the shard");
    };
    let seen = load_while(&app, ["token-0", "token-1"], moving, Duration::from_secs(2)).await;
    // Every pair succeeded or was a 503 (`pair` fails on anything else), and
    // the moved tenant's requests succeed on its new worker.
    let moved_ok = seen
        .pairs
        .iter()
        .rev()
        .filter(|(token, ..)| *token == "token-0")
        .take(5)
        .all(|&(_, _, reserved, committed)| reserved == 201 && committed == 200);
    assert!(
        moved_ok,
        "the moved tenant does not recover on its new worker"
    );
    assert_eq!(cluster.worker_port_of(&tenants[0]).await.unwrap(), to);
    all_acknowledged_present(&app, &cluster.url(), &seen, |token| {
        tenants[usize::from(token == "token-1")].clone()
    })
    .await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_with_a_worker_down_prunes_the_rest_and_says_what_it_skipped() {
    if !citus::available("pruning_with_a_worker_down_prunes_the_rest_and_says_what_it_skipped") {
        return;
    }
    let (cluster, app, tenants) = cluster_with_a_tenant_per_worker().await;
    let mut conn = connect(&cluster.url()).await;
    for tenant in &tenants {
        sqlx::query(
            "INSERT INTO idempotency_keys
                 (tenant, key_hash, state, reservation_id, attempt, created_at, expires_at)
             SELECT $1, sha256(i::text::bytea), 'completed', gen_random_uuid(), 1,
                    now() - interval '2 hours', now() - interval '1 hour'
               FROM generate_series(1, 50) AS i",
        )
        .bind(tenant)
        .execute(&mut conn)
        .await
        .unwrap();
    }
    cluster.workers[1].stop().await.expect("stop a worker");
    let pass = prune::prune_once(app.store.as_ref()).await;
    let Err(StoreError::Unavailable { why, .. }) = &pass else {
        panic!("a pass with a worker down must fail: {pass:?}");
    };
    assert!(
        why.contains("pruned 50 expired keys, but not everywhere")
            && why.contains("could not be pruned")
            && why.contains(&cluster.workers[1].port().to_string()),
        "{why}"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE tenant = $1")
        .bind(&tenants[0])
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, 0, "the running worker's shards were pruned");
    cluster.workers[1].restart().await.expect("start it again");
    assert_eq!(prune::prune_once(app.store.as_ref()).await.unwrap(), 50);
    let _ = conn.close().await;
}

/// Operators on a cluster: unknown keys of forty tenants, on every shard of
/// both workers, listed page by page in one order (a multi-shard query
/// merged by the coordinator), counted for the gauge, and resolved on their
/// tenant's shard: the completed one replays, the released one is new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_list_and_resolve_unknown_keys_across_shards() {
    use idemgate::engine::{ReserveOutcome, ReserveRequest, Resolved, Settlement};
    use idemgate::server::operations::{self, ListQuery, list::StateFilter};
    use idemgate::store::{LeaseExpiry, ResolveAction, StoredResponse};

    if !citus::available("operators_list_and_resolve_unknown_keys_across_shards") {
        return;
    }
    let db = fresh_schema().await;
    migrate(&db.url);
    let backend = Backend::Postgres(db);
    let engine = backend.engine().await;
    let request = |tenant: usize| ReserveRequest {
        tenant: format!("tenant-{tenant}"),
        tenant_from_credential: false,
        key_hash: [u8::try_from(tenant).unwrap(); 32],
        fingerprint: None,
        lease_seconds: 1,
        ttl_seconds: 600,
        wait: None,
        on_lease_expiry: LeaseExpiry::Hold,
        request: None,
    };
    for tenant in 0..40 {
        assert!(matches!(
            engine.reserve(&request(tenant)).await.unwrap(),
            ReserveOutcome::Reserved(_)
        ));
    }
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_eq!(engine.store().count_stuck().await.unwrap(), 40);

    let mut seen = Vec::new();
    let mut query = ListQuery {
        state: Some(StateFilter::Unknown),
        limit: Some(7),
        ..ListQuery::default()
    };
    loop {
        let page = operations::list(&engine, &query).await.expect("a page");
        seen.extend(page.keys.into_iter().map(|k| (k.created_at, k.tenant)));
        match page.next {
            Some(next) => query.cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(seen.len(), 40, "{seen:?}");
    assert!(
        seen.windows(2).all(|w| w[0] <= w[1]),
        "oldest first: {seen:?}"
    );
    let mut tenants: Vec<&String> = seen.iter().map(|(_, t)| t).collect();
    tenants.sort();
    tenants.dedup();
    assert_eq!(tenants.len(), 40);

    let settle = |action: ResolveAction| Settlement {
        action,
        response: (action == ResolveAction::Complete).then(|| StoredResponse {
            status: 201,
            headers: vec![],
            body: bytes::Bytes::from_static(b"settled"),
        }),
        reason: "a test on the cluster".into(),
        by: "ops".into(),
    };
    let completed = engine
        .resolve("tenant-3", &[3; 32], &settle(ResolveAction::Complete))
        .await
        .unwrap();
    assert!(matches!(completed, Resolved::Settled(_)), "{completed:?}");
    let released = engine
        .resolve("tenant-4", &[4; 32], &settle(ResolveAction::Release))
        .await
        .unwrap();
    assert!(matches!(released, Resolved::Settled(_)), "{released:?}");
    assert_eq!(engine.store().count_stuck().await.unwrap(), 38);
    match engine.reserve(&request(3)).await.unwrap() {
        ReserveOutcome::Completed(record) => {
            assert_eq!(record.response.unwrap().body, &b"settled"[..]);
            assert_eq!(record.resolution.unwrap().by, "ops");
        }
        other => panic!("{other:?}"),
    }
    match engine.reserve(&request(4)).await.unwrap() {
        ReserveOutcome::Reserved(r) => assert_eq!(r.attempt, 1),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        engine.reserve(&request(5)).await.unwrap(),
        ReserveOutcome::Unknown { .. }
    ));
}

/// A cluster the previous version migrated and distributed takes the
/// migration that brings unknown outcomes: the ALTERs reach every shard, the
/// new function signatures are distributed by tenant, and the records
/// written before keep their meaning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_of_a_distributed_database_keeps_its_records() {
    use std::borrow::Cow;

    use idemgate::engine::{ReserveOutcome, ReserveRequest};
    use idemgate::store::LeaseExpiry;

    if !citus::available("an_upgrade_of_a_distributed_database_keeps_its_records") {
        return;
    }
    let db = fresh_schema().await;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/postgres");
    let mut older = sqlx::migrate::Migrator::new(path).await.unwrap();
    older.migrations = Cow::Owned(
        older
            .migrations
            .iter()
            .filter(|m| m.version < 20261204000001)
            .cloned()
            .collect(),
    );
    let mut conn = connect(&db.url).await;
    older.run(&mut conn).await.expect("the older migrations");
    for sql in [
        "SELECT create_distributed_table('idempotency_keys', 'tenant')",
        "SELECT create_distributed_table('idempotency_reservations', 'tenant', \
         colocate_with => 'idempotency_keys')",
        "SET citus.multi_shard_modify_mode TO 'sequential'",
        "SELECT create_distributed_function('idemgate_reserve(text, bytea, text, uuid, float8, \
         float8, int8)'::regprocedure, 'p_tenant', colocate_with => 'idempotency_keys')",
        "SELECT create_distributed_function('idemgate_write_batch(text, text[], text[], bytea[], \
         text[], uuid[], float8[], float8[], int8[], int4[], jsonb[], bytea[])'::regprocedure, \
         'p_tenant', colocate_with => 'idempotency_keys')",
        "INSERT INTO idempotency_keys (tenant, key_hash, state, reservation_id, lease_expires_at, \
         attempt, created_at, expires_at) \
         SELECT 'old-' || i, sha256(i::text::bytea), 'in_flight', gen_random_uuid(), \
                now() - interval '1 minute', 1, now() - interval '2 minutes', now() + interval '1 hour' \
           FROM generate_series(1, 20) AS i",
        "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash) \
         SELECT tenant, reservation_id, key_hash FROM idempotency_keys",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let log = migrate(&db.url);
    assert!(log.contains("idemgate_reserve"), "{log}");
    let function: (Option<i32>,) = sqlx::query_as(
        "SELECT distribution_argument_index FROM pg_dist_object
          WHERE objid = 'idemgate_reserve(text, bytea, text, uuid, float8, float8, int8, text)'::regprocedure",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(function, (Some(0),));
    // Kept to the end: dropping it drops the schema.
    let backend = Backend::Postgres(db);
    let engine = backend.engine().await;
    for i in 1..=20u32 {
        let hash: [u8; 32] = sha2::Digest::finalize(sha2::Digest::chain_update(
            <sha2::Sha256 as sha2::Digest>::new(),
            i.to_string().as_bytes(),
        ))
        .into();
        let got = engine
            .reserve(&ReserveRequest {
                tenant: format!("old-{i}"),
                tenant_from_credential: false,
                key_hash: hash,
                fingerprint: None,
                lease_seconds: 30,
                ttl_seconds: 600,
                wait: None,
                on_lease_expiry: LeaseExpiry::Hold,
                request: None,
            })
            .await
            .unwrap();
        match got {
            ReserveOutcome::Reserved(r) => {
                assert_eq!(r.attempt, 2, "old-{i}: taken over as before")
            }
            other => panic!("old-{i}: {other:?}"),
        }
    }
}
