//! The replay cache: completed records served from memory, so a replay skips
//! the database — and never past the record's `expires_at`, never across
//! tenants, never beyond its bound in bytes. Each scenario makes the database
//! unable to answer (its rows deleted straight from the tables) or waits for
//! expiry, so a cache that is wrong fails; every one runs against PostgreSQL
//! and SQLite, and the doors (reservation API, layer, proxy) are checked too.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::body::Body;
use chrono::{DateTime, Utc};
use clap::CommandFactory;
use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use common::pg::TestDb;
use common::proxy::proxy_args;
use common::upstream::{self, Counts};
use http::Request;
use idemgate::IdempotencyLayer;
use idemgate::engine::{
    Committed, DEFAULT_REPLAY_CACHE_BYTES, Engine, Limits, Reservation, ReserveOutcome,
    ReserveRequest,
};
use idemgate::layer::LayerPolicy;
use idemgate::server::cli::{Cli, Command};
use idemgate::server::proxy::Proxy;
use idemgate::store::{
    Claim, ClaimRequest, Found, HotPath, InFlightUsage, Maintenance, PoolStats, Queries, Record,
    Recovery, Store, StoreError, StoredResponse, StoredUsage,
};
use sha2::{Digest, Sha256};
use tower::ServiceExt;
use uuid::Uuid;

const TENANT: &str = "acme";

/// A key hash no other test uses.
fn fresh_hash() -> [u8; 32] {
    Sha256::digest(Uuid::new_v4().as_bytes()).into()
}

fn request(tenant: &str, key: [u8; 32], fingerprint: Option<&str>) -> ReserveRequest {
    ReserveRequest {
        on_lease_expiry: idemgate::store::LeaseExpiry::Takeover,
        tenant: tenant.into(),
        tenant_from_credential: false,
        key_hash: key,
        fingerprint: fingerprint.map(str::to_owned),
        lease_seconds: 30,
        ttl_seconds: 86_400,
        wait: None,
        request: None,
    }
}

fn response(tag: &str, body_len: usize) -> StoredResponse {
    let mut body = tag.as_bytes().to_vec();
    body.resize(body_len.max(tag.len()), b'.');
    StoredResponse {
        status: 201,
        headers: vec![("x-tag".into(), tag.into())],
        body: body.into(),
    }
}

async fn reserve(engine: &Engine, req: &ReserveRequest) -> ReserveOutcome {
    engine.reserve(req).await.expect("reserve")
}

#[track_caller]
fn reserved(outcome: ReserveOutcome) -> Reservation {
    match outcome {
        ReserveOutcome::Reserved(r) => r,
        other => panic!("expected Reserved, got {other:?}"),
    }
}

#[track_caller]
fn completed(outcome: ReserveOutcome) -> Record {
    match outcome {
        ReserveOutcome::Completed(record) => *record,
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// Reserves `req` (a new key) and commits `res` through `engine`; returns
/// the committed record.
async fn reserve_and_commit(engine: &Engine, req: &ReserveRequest, res: &StoredResponse) -> Record {
    let r = reserved(reserve(engine, req).await);
    match engine
        .commit(&req.tenant, r.reservation_id, res)
        .await
        .expect("commit")
    {
        Ok(Committed::Now(record)) => record,
        other => panic!("expected Committed, got {other:?}"),
    }
}

fn cached_entries(engine: &Engine) -> u64 {
    engine
        .replay_cache()
        .expect("the engine has a replay cache")
        .entry_count()
}

// ---------------------------------------------------------------------------
// Scenarios over the engine
// ---------------------------------------------------------------------------

/// With the rows gone, only memory can replay the key; without a cache the
/// key is new again.
async fn a_replay_is_served_from_memory(b: Backend) {
    let engine = b.engine_with_cache(DEFAULT_REPLAY_CACHE_BYTES).await;
    let key = fresh_hash();
    let req = request(TENANT, key, Some("fp"));
    let res = response("first", 64);
    let stored = reserve_and_commit(&engine, &req, &res).await;
    assert_eq!(cached_entries(&engine), 1, "the commit is cached");

    b.delete_all().await;
    let replay = completed(reserve(&engine, &req).await);
    assert_eq!(
        replay, stored,
        "the committed record, as the database had it"
    );
    assert_eq!(replay.response.as_ref(), Some(&res));
    // And the wait path (`Prefer: wait`) reads the cache before the store.
    let waiting = ReserveRequest {
        on_lease_expiry: idemgate::store::LeaseExpiry::Takeover,
        wait: Some(Duration::from_secs(5)),
        ..req.clone()
    };
    let started = Instant::now();
    assert_eq!(completed(reserve(&engine, &waiting).await), stored);
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(b.counts().await, (0, 0), "the cache wrote nothing back");

    // The same sequence without a cache: the key is new again.
    let uncached = b.engine_with_cache(0).await;
    assert!(uncached.replay_cache().is_none());
    let key = fresh_hash();
    let req = request(TENANT, key, Some("fp"));
    reserve_and_commit(&uncached, &req, &res).await;
    completed(reserve(&uncached, &req).await);
    b.delete_all().await;
    assert_eq!(reserved(reserve(&uncached, &req).await).attempt, 1);
}

/// A cached replay is only ever given to a call that started before the
/// record's `expires_at`; after it, the key is new again.
async fn never_past_expiry(b: Backend) {
    let engine = b.engine_with_cache(DEFAULT_REPLAY_CACHE_BYTES).await;
    let req = ReserveRequest {
        on_lease_expiry: idemgate::store::LeaseExpiry::Takeover,
        ttl_seconds: 2,
        ..request(TENANT, fresh_hash(), Some("fp"))
    };
    let stored = reserve_and_commit(&engine, &req, &response("short", 16)).await;
    assert_eq!(cached_entries(&engine), 1);
    completed(reserve(&engine, &req).await);

    let mut replays = 0;
    let fresh = loop {
        let called_at = Utc::now();
        match reserve(&engine, &req).await {
            ReserveOutcome::Completed(record) => {
                assert_eq!(*record, stored);
                assert!(
                    called_at < stored.expires_at,
                    "replayed at {called_at}, after expires_at {}",
                    stored.expires_at
                );
                replays += 1;
            }
            other => break reserved(other),
        }
        assert!(
            Utc::now() < stored.expires_at + chrono::Duration::seconds(2),
            "still replayed long after expiry"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(Utc::now() >= stored.expires_at);
    assert!(replays > 10, "only {replays} replays in two seconds");
    assert_eq!(fresh.attempt, 1, "a new key, not a takeover");
    assert_ne!(fresh.reservation_id, stored.reservation_id);
}

/// The same key under two tenants: two records, each replayed to its own
/// tenant only, from memory too.
async fn never_across_tenants(b: Backend) {
    let engine = b.engine_with_cache(DEFAULT_REPLAY_CACHE_BYTES).await;
    let key = fresh_hash();
    let a = request("tenant-a", key, Some("fp"));
    let b_req = request("tenant-b", key, Some("fp"));
    let res_a = response("for-a", 32);
    let res_b = response("for-b", 32);
    reserve_and_commit(&engine, &a, &res_a).await;
    completed(reserve(&engine, &a).await);

    let b_holds = reserved(reserve(&engine, &b_req).await);
    assert_eq!(b_holds.attempt, 1, "tenant b's key is new");
    match engine
        .commit("tenant-b", b_holds.reservation_id, &res_b)
        .await
        .expect("commit")
    {
        Ok(Committed::Now(_)) => {}
        other => panic!("tenant b's commit: {other:?}"),
    }

    // Only memory can answer now.
    b.delete_all().await;
    for _ in 0..2 {
        let for_a = completed(reserve(&engine, &a).await);
        assert_eq!(for_a.tenant, "tenant-a");
        assert_eq!(for_a.response.as_ref(), Some(&res_a));
        let for_b = completed(reserve(&engine, &b_req).await);
        assert_eq!(for_b.tenant, "tenant-b");
        assert_eq!(for_b.response.as_ref(), Some(&res_b));
    }
    // A third tenant was never cached: its key is new.
    let c = request("tenant-c", key, Some("fp"));
    assert_eq!(reserved(reserve(&engine, &c).await).attempt, 1);
}

/// A cached key asked for with another fingerprint is a mismatch (422);
/// without one, or with the same, it is the replay.
async fn another_fingerprint_is_a_mismatch(b: Backend) {
    let engine = b.engine_with_cache(DEFAULT_REPLAY_CACHE_BYTES).await;
    let key = fresh_hash();
    let res = response("once", 8);
    reserve_and_commit(&engine, &request(TENANT, key, Some("fp-a")), &res).await;
    b.delete_all().await;

    let outcome = reserve(&engine, &request(TENANT, key, Some("fp-b"))).await;
    assert!(
        matches!(outcome, ReserveOutcome::Mismatch),
        "expected Mismatch, got {outcome:?}"
    );
    let same = completed(reserve(&engine, &request(TENANT, key, Some("fp-a"))).await);
    assert_eq!(same.response.as_ref(), Some(&res));
    completed(reserve(&engine, &request(TENANT, key, None)).await);

    // A record stored without a fingerprint matches every caller.
    let open = fresh_hash();
    reserve_and_commit(&engine, &request(TENANT, open, None), &res).await;
    b.delete_all().await;
    completed(reserve(&engine, &request(TENANT, open, Some("anything"))).await);
}

/// Two processes on one database: the second learns the record from the
/// database on its first reserve, and keeps it.
async fn a_second_engine_caches_what_it_reads(b: Backend) {
    let one = b.engine_with_cache(DEFAULT_REPLAY_CACHE_BYTES).await;
    let two = b.engine_with_cache(DEFAULT_REPLAY_CACHE_BYTES).await;
    let key = fresh_hash();
    let req = request(TENANT, key, Some("fp"));
    let res = response("from-one", 128);
    let stored = reserve_and_commit(&one, &req, &res).await;
    assert_eq!(cached_entries(&two), 0, "engine two has seen nothing yet");

    assert_eq!(
        completed(reserve(&two, &req).await),
        stored,
        "from the database"
    );
    assert_eq!(cached_entries(&two), 1, "and now cached");

    b.delete_all().await;
    assert_eq!(completed(reserve(&two, &req).await), stored, "from memory");
    assert_eq!(completed(reserve(&one, &req).await), stored, "from memory");
    // A process that never saw it finds the key new: the rows are gone.
    let three = b.engine_with_cache(DEFAULT_REPLAY_CACHE_BYTES).await;
    assert_eq!(reserved(reserve(&three, &req).await).attempt, 1);
}

/// A commit answered "already committed" caches the record too.
async fn an_identical_second_commit_is_cached(b: Backend) {
    let writer = b.engine_with_cache(0).await;
    let engine = b.engine_with_cache(DEFAULT_REPLAY_CACHE_BYTES).await;
    let req = request(TENANT, fresh_hash(), Some("fp"));
    let res = response("twice", 8);
    let r = reserved(reserve(&writer, &req).await);
    writer
        .commit(TENANT, r.reservation_id, &res)
        .await
        .expect("commit")
        .expect("the first commit stores");
    match engine
        .commit(TENANT, r.reservation_id, &res)
        .await
        .expect("commit")
    {
        Ok(Committed::Earlier(_)) => {}
        other => panic!("expected Committed::Earlier, got {other:?}"),
    }
    b.delete_all().await;
    assert_eq!(
        completed(reserve(&engine, &req).await).response.as_ref(),
        Some(&res)
    );
}

/// The cache never holds more than its bound: records heavier than the bound
/// are not kept at all, lighter ones only up to it.
async fn the_cache_holds_no_more_than_its_bound(b: Backend) {
    const BOUND: u64 = 4 * 1024;
    let engine = b.engine_with_cache(BOUND).await;
    let cache = engine.replay_cache().expect("a cache");
    assert_eq!(cache.max_bytes(), BOUND);

    let mut heavy = Vec::new();
    for i in 0..20 {
        let req = request(TENANT, fresh_hash(), None);
        reserve_and_commit(&engine, &req, &response(&format!("heavy-{i}"), 8 * 1024)).await;
        completed(reserve(&engine, &req).await);
        heavy.push(req);
        assert!(cache.weighted_size() <= BOUND);
    }
    assert_eq!(cache.entry_count(), 0, "nothing heavier than the bound");

    let mut light = Vec::new();
    for i in 0..40 {
        let req = request(TENANT, fresh_hash(), None);
        reserve_and_commit(&engine, &req, &response(&format!("light-{i}"), 1024)).await;
        completed(reserve(&engine, &req).await);
        light.push(req);
        let size = cache.weighted_size();
        assert!(size <= BOUND, "{size} bytes held, bound {BOUND}");
    }
    let kept = cache.entry_count();
    assert!(
        (1..=3).contains(&kept),
        "{kept} records of over 1 KiB in 4 KiB"
    );

    // What memory can still answer once the rows are gone: at most what fits.
    b.delete_all().await;
    for req in &heavy {
        assert_eq!(reserved(reserve(&engine, req).await).attempt, 1);
    }
    let mut replayed = 0;
    for req in &light {
        if let ReserveOutcome::Completed(_) = reserve(&engine, req).await {
            replayed += 1;
        }
    }
    assert!(
        replayed <= 3,
        "{replayed} light records replayed from 4 KiB"
    );
}

/// A store over the backend whose clock reads an hour ahead of this
/// process's: every time it returns is shifted, as a database server with
/// a skewed clock would return them. The rows and the SQL are the real ones.
struct AnHourAhead(Arc<dyn Store>);

const SKEW: chrono::TimeDelta = chrono::TimeDelta::hours(1);

fn skew(mut record: Record) -> Record {
    record.lease_expires_at = record.lease_expires_at.map(|t| t + SKEW);
    record.created_at += SKEW;
    record.completed_at = record.completed_at.map(|t| t + SKEW);
    record.expires_at += SKEW;
    record
}

#[async_trait]
impl HotPath for AnHourAhead {
    async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>, StoreError> {
        Ok(self.0.reserve(req).await?.map(|claim| Claim {
            claimed: claim.claimed,
            record: skew(claim.record),
            now: claim.now + SKEW,
        }))
    }

    async fn complete(
        &self,
        tenant: &str,
        id: Uuid,
        response: &StoredResponse,
    ) -> Result<Option<Record>, StoreError> {
        Ok(self.0.complete(tenant, id, response).await?.map(skew))
    }

    async fn release(&self, tenant: &str, id: Uuid) -> Result<Option<Vec<u8>>, StoreError> {
        self.0.release(tenant, id).await
    }

    async fn extend(
        &self,
        tenant: &str,
        id: Uuid,
        lease_seconds: u32,
        on_lease_expiry: Option<idemgate::store::LeaseExpiry>,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        Ok(self
            .0
            .extend(tenant, id, lease_seconds, on_lease_expiry)
            .await?
            .map(|t| t + SKEW))
    }

    async fn checkpoint(
        &self,
        tenant: &str,
        id: Uuid,
        recovery: &Recovery,
    ) -> Result<Option<Record>, StoreError> {
        Ok(self.0.checkpoint(tenant, id, recovery).await?.map(skew))
    }

    async fn find_by_reservation(
        &self,
        tenant: &str,
        id: Uuid,
    ) -> Result<Option<Found>, StoreError> {
        Ok(self
            .0
            .find_by_reservation(tenant, id)
            .await?
            .map(|found| Found {
                record: skew(found.record),
                now: found.now + SKEW,
            }))
    }

    async fn mark_unknown(
        &self,
        tenant: &str,
        id: Uuid,
        reason: &str,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.0.mark_unknown(tenant, id, reason).await
    }
}

#[async_trait]
impl Queries for AnHourAhead {
    async fn find_key(&self, tenant: &str, key_hash: &[u8]) -> Result<Option<Found>, StoreError> {
        Ok(self.0.find_key(tenant, key_hash).await?.map(|found| Found {
            record: skew(found.record),
            now: found.now + SKEW,
        }))
    }

    async fn list_keys(
        &self,
        query: &idemgate::store::KeyQuery,
    ) -> Result<idemgate::store::KeyPage, StoreError> {
        let page = self.0.list_keys(query).await?;
        Ok(idemgate::store::KeyPage {
            records: page.records.into_iter().map(skew).collect(),
            now: page.now + SKEW,
        })
    }

    async fn resolve(
        &self,
        resolve: &idemgate::store::Resolve,
    ) -> Result<Option<Found>, StoreError> {
        Ok(self.0.resolve(resolve).await?.map(|found| Found {
            record: skew(found.record),
            now: found.now + SKEW,
        }))
    }

    async fn count_stuck(&self) -> Result<u64, StoreError> {
        self.0.count_stuck().await
    }

    async fn in_flight_usage(&self, tenant: &str, up_to: u32) -> Result<InFlightUsage, StoreError> {
        let usage = self.0.in_flight_usage(tenant, up_to).await?;
        Ok(InFlightUsage {
            next_lease_end: usage.next_lease_end.map(|t| t + SKEW),
            now: usage.now + SKEW,
            ..usage
        })
    }

    async fn stored_usage(&self, tenant: &str) -> Result<StoredUsage, StoreError> {
        let usage = self.0.stored_usage(tenant).await?;
        Ok(StoredUsage {
            next_expiry: usage.next_expiry.map(|t| t + SKEW),
            now: usage.now + SKEW,
            ..usage
        })
    }
}

#[async_trait]
impl Maintenance for AnHourAhead {
    async fn prune_expired_batch(
        &self,
        limit: i64,
    ) -> Result<idemgate::store::PruneBatch, StoreError> {
        self.0.prune_expired_batch(limit).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.0.ping().await
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        self.0.pool_stats()
    }

    async fn open_window(&self, name: &str, seconds: u64) -> Result<(), StoreError> {
        self.0.open_window(name, seconds).await
    }

    async fn open_windows(&self) -> Result<Vec<String>, StoreError> {
        self.0.open_windows().await
    }
}

/// The database's clock an hour ahead of ours: an entry's life is the
/// record's remaining life by the database's clock, so it still ends by the
/// record's real expiry (reading it against our clock would keep it an
/// hour too long).
async fn a_skewed_database_clock_changes_nothing(b: Backend) {
    let engine = Engine::new(Arc::new(AnHourAhead(b.open().await)), Limits::default());
    let req = ReserveRequest {
        on_lease_expiry: idemgate::store::LeaseExpiry::Takeover,
        ttl_seconds: 1,
        ..request(TENANT, fresh_hash(), Some("fp"))
    };
    let stored = reserve_and_commit(&engine, &req, &response("skewed", 16)).await;
    // When the key really expires, by the database's (and our) clock.
    let expires_at = stored.expires_at - SKEW;
    completed(reserve(&engine, &req).await);
    assert_eq!(cached_entries(&engine), 1);
    loop {
        let called_at = Utc::now();
        match reserve(&engine, &req).await {
            ReserveOutcome::Completed(_) => assert!(
                called_at < expires_at,
                "replayed at {called_at}, after the real expiry {expires_at}"
            ),
            other => {
                assert_eq!(reserved(other).attempt, 1);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(Utc::now() >= expires_at);
}

both_stores! {
    serial: [
        a_replay_is_served_from_memory,
        never_past_expiry,
        never_across_tenants,
        another_fingerprint_is_a_mismatch,
        a_second_engine_caches_what_it_reads,
        an_identical_second_commit_is_cached,
        the_cache_holds_no_more_than_its_bound,
        a_skewed_database_clock_changes_nothing,
    ],
    concurrent: [],
}

// ---------------------------------------------------------------------------
// The doors
// ---------------------------------------------------------------------------

/// `idemgate_replay_cache_hits_total` as `/metrics` shows it (0 while absent).
fn hits(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("idemgate_replay_cache_hits_total "))
        .map_or(0, |v| v.trim().parse::<f64>().expect("a number") as u64)
}

async fn delete_rows(app: &TestApp) {
    let pool = app.pg.as_ref().expect("PostgreSQL").pool();
    for sql in [
        "DELETE FROM idempotency_keys",
        "DELETE FROM idempotency_reservations",
    ] {
        sqlx::query(sql).execute(pool).await.expect("delete rows");
    }
}

#[tokio::test]
async fn the_reservation_api_replays_from_memory_and_counts_hits() {
    let db = TestDb::new().await;
    let app = TestApp::new(&db.url, &[]).await;
    let key = fresh_key();
    let body = r#"{"fingerprint":"fp-1"}"#;
    let id = app.reserve(&key, body).await.reservation_id();
    let commit = app
        .act(&id, "commit", r#"{"status":201,"body":"charged"}"#)
        .await;
    assert_eq!(commit.status, 200, "{commit:#?}");

    let before = hits(&app.send("GET", "/metrics", &[], None).await.text);
    delete_rows(&app).await;
    for _ in 0..2 {
        let replay = app.reserve(&key, body).await;
        assert_eq!(replay.status, 200, "{replay:#?}");
        assert_eq!(replay.header("idempotent-replayed"), "true");
        assert!(!replay.header("idempotency-expires").is_empty());
        assert_eq!(replay.body["state"], "completed");
        assert_eq!(replay.body["response"]["status"], 201);
        assert_eq!(replay.body["response"]["body"], "charged");
    }
    app.reserve(&key, r#"{"fingerprint":"fp-2"}"#)
        .await
        .assert_problem(422, "key-reused");
    let metrics = app.send("GET", "/metrics", &[], None).await.text;
    assert!(
        metrics.contains("# HELP idemgate_replay_cache_hits_total"),
        "{metrics}"
    );
    assert!(
        hits(&metrics) >= before + 3,
        "hits {} -> {}",
        before,
        hits(&metrics)
    );
    // The counter has no labels: no key, no tenant.
    assert!(!metrics.contains("idemgate_replay_cache_hits_total{"));
}

#[tokio::test]
async fn replay_cache_bytes_zero_turns_the_cache_off() {
    let db = TestDb::new().await;
    let app = TestApp::new(&db.url, &["--replay-cache-bytes", "0"]).await;
    assert!(app.state.engine.replay_cache().is_none());
    let key = fresh_key();
    let id = app.reserve(&key, "").await.reservation_id();
    app.act(&id, "commit", r#"{"status":200,"body":"done"}"#)
        .await;
    assert_eq!(app.reserve(&key, "").await.status, 200, "from the database");
    delete_rows(&app).await;
    let again = app.reserve(&key, "").await;
    assert_eq!(again.status, 201, "{again:#?}");
    assert_eq!(again.body["attempt"], 1);
}

/// Sends a guarded `POST /ok` with `key` through `app`; returns the replay
/// header, if any.
async fn post_through(app: &axum::Router, key: &str) -> Option<String> {
    let req = Request::post("/ok")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"amount":1}"#))
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    assert!(res.status().is_success(), "{res:?}");
    res.headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap().to_owned())
}

#[tokio::test]
async fn the_layer_has_a_cache_by_default_and_its_engine_sets_it() {
    let b = Backend::postgres().await;
    common::logs::init();
    let counts = Arc::new(Counts::default());
    let engine = Arc::new(Engine::new(b.open().await, Limits::default()));
    assert_eq!(
        engine.replay_cache().map(|c| c.max_bytes()),
        Some(DEFAULT_REPLAY_CACHE_BYTES)
    );
    let cached = upstream::router(counts.clone())
        .layer(IdempotencyLayer::new(engine, LayerPolicy::default()));
    let off = Arc::new(Engine::new(b.open().await, Limits::default()).with_replay_cache(0));
    let uncached =
        upstream::router(counts.clone()).layer(IdempotencyLayer::new(off, LayerPolicy::default()));

    let (k1, k2) = (
        format!("\"{}\"", fresh_key()),
        format!("\"{}\"", fresh_key()),
    );
    assert_eq!(post_through(&cached, &k1).await, None);
    assert_eq!(post_through(&uncached, &k2).await, None);
    b.delete_all().await;
    assert_eq!(post_through(&cached, &k1).await.as_deref(), Some("true"));
    assert_eq!(
        counts.started(&k1),
        1,
        "replayed from memory, not run again"
    );
    assert_eq!(post_through(&uncached, &k2).await, None);
    assert_eq!(counts.started(&k2), 2, "no cache: the key was new again");
}

#[tokio::test]
async fn the_proxy_takes_its_bound_from_the_settings() {
    let db = TestDb::new().await;
    for (flags, want) in [
        (&[][..], Some(DEFAULT_REPLAY_CACHE_BYTES)),
        (&["--replay-cache-bytes", "4096"][..], Some(4096)),
        (&["--replay-cache-bytes", "0"][..], None),
    ] {
        let mut all = vec![
            "--upstream",
            "http://127.0.0.1:9",
            "--database-url",
            db.url.as_str(),
        ];
        all.extend_from_slice(flags);
        let args = proxy_args(&all);
        let store = idemgate::server::open::open_store(&args.store, true)
            .await
            .expect("store");
        let proxy = Proxy::build(&args, Vec::new(), store).expect("proxy");
        assert_eq!(
            proxy.engine.replay_cache().map(|c| c.max_bytes()),
            want,
            "{flags:?}"
        );
    }
}

#[test]
fn the_setting_is_a_flag_a_variable_and_a_file_key_of_serve_and_proxy() {
    let cmd = Cli::command();
    for sub in ["serve", "proxy"] {
        let arg = cmd
            .find_subcommand(sub)
            .unwrap()
            .get_arguments()
            .find(|a| a.get_id() == "replay_cache_bytes")
            .unwrap_or_else(|| panic!("{sub} has no replay_cache_bytes"));
        assert_eq!(arg.get_long(), Some("replay-cache-bytes"));
        assert_eq!(
            arg.get_env().and_then(|e| e.to_str()),
            Some("IDEMGATE_REPLAY_CACHE_BYTES")
        );
        let defaults: Vec<_> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        assert_eq!(defaults, ["67108864"]);
    }

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    std::fs::write(
        &path,
        "replay_cache_bytes = 4096\n[proxy]\nreplay_cache_bytes = 0\n",
    )
    .unwrap();
    let parse = |argv: &[&str]| {
        Cli::try_parse_merged(argv.iter().map(Into::into).collect()).expect("parses")
    };
    let file = path.to_str().unwrap();
    match parse(&["idemgate", "serve", "--config", file]).command {
        Command::Serve(args) => assert_eq!(args.run.replay_cache_bytes, 4096),
        other => panic!("{other:?}"),
    }
    match parse(&[
        "idemgate",
        "proxy",
        "--upstream",
        "http://127.0.0.1:3000",
        "--config",
        file,
    ])
    .command
    {
        Command::Proxy(args) => assert_eq!(args.run.replay_cache_bytes, 0),
        other => panic!("{other:?}"),
    }
    match parse(&[
        "idemgate",
        "serve",
        "--config",
        file,
        "--replay-cache-bytes",
        "1",
    ])
    .command
    {
        Command::Serve(args) => assert_eq!(args.run.replay_cache_bytes, 1, "flag over file"),
        other => panic!("{other:?}"),
    }
}
