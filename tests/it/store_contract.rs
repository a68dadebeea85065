//! The store contract: every scenario of a key's life that a [`Store`] must get
//! right, written once over `Arc<dyn Store>` and the engine, and run against
//! both PostgreSQL and the embedded SQLite store, so the two cannot drift.
//!
//! Each scenario is an async function taking a [`Backend`] (a fresh database
//! or file); the `contract!` macro at the bottom makes a `postgres::NAME` and a
//! `sqlite::NAME` test of each.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use common::backend::Backend;
use idemgate::engine::{
    Committed, Engine, Lookup, Refusal, Reservation, ReserveOutcome, ReserveRequest,
};
use idemgate::prune;
use idemgate::store::{KeyState, Record, Recovery, StoredResponse};
use sha2::{Digest, Sha256};
use tokio::sync::Barrier;
use uuid::Uuid;

const TENANT: &str = "acme";

/// Long enough for a 1-second lease or TTL to have ended.
const PAST_ONE_SECOND: Duration = Duration::from_millis(1100);

/// A key hash no other test uses.
fn fresh_key() -> [u8; 32] {
    Sha256::digest(Uuid::new_v4().as_bytes()).into()
}

fn request(key: [u8; 32], fingerprint: Option<&str>) -> ReserveRequest {
    ReserveRequest {
        on_lease_expiry: idemgate::store::LeaseExpiry::Takeover,
        tenant: TENANT.into(),
        tenant_from_credential: false,
        key_hash: key,
        fingerprint: fingerprint.map(str::to_owned),
        lease_seconds: 30,
        ttl_seconds: 86_400,
        wait: None,
        request: None,
    }
}

fn with_lease(mut req: ReserveRequest, seconds: u32) -> ReserveRequest {
    req.lease_seconds = seconds;
    req
}

fn with_ttl(mut req: ReserveRequest, seconds: u32) -> ReserveRequest {
    req.ttl_seconds = seconds;
    req
}

/// A response with headers and a body that is not UTF-8, so that every
/// encoding on the way to the database and back is exercised.
fn response(tag: &str) -> StoredResponse {
    let mut body = tag.as_bytes().to_vec();
    body.extend_from_slice(&[0, 0xff, 0xfe]);
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/octet-stream".into()),
            ("x-tag".into(), tag.into()),
            ("x-tag".into(), "repeated \"quoted\"".into()),
        ],
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

/// The whole seconds (rounded up) until the holder's lease ends; and
/// `Retry-After`, an estimate of the holder's finish, is within 1 and that.
#[track_caller]
fn in_flight(outcome: ReserveOutcome) -> u64 {
    match outcome {
        ReserveOutcome::InFlight {
            retry_after,
            lease_expires_at,
        } => {
            let ms = (lease_expires_at - Utc::now()).num_milliseconds().max(0);
            let lease_left = u64::try_from(ms).unwrap().div_ceil(1000).max(1);
            assert!(
                (1..=lease_left).contains(&retry_after),
                "Retry-After {retry_after} s, lease ends in {lease_left} s"
            );
            lease_left
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
}

#[track_caller]
fn completed(outcome: ReserveOutcome) -> idemgate::store::Record {
    match outcome {
        ReserveOutcome::Completed(record) => *record,
        other => panic!("expected Completed, got {other:?}"),
    }
}

#[track_caller]
fn mismatch(outcome: ReserveOutcome) {
    if !matches!(outcome, ReserveOutcome::Mismatch) {
        panic!("expected Mismatch, got {outcome:?}");
    }
}

async fn commit(engine: &Engine, id: Uuid, res: &StoredResponse) -> Result<Committed, Refusal> {
    engine.commit(TENANT, id, res).await.expect("commit")
}

/// The record `id` shows, and whether `id` holds it live.
async fn shown(engine: &Engine, id: Uuid) -> (Record, bool) {
    match engine.get(TENANT, id).await.expect("get") {
        Some(Lookup::Record { record, live, .. }) => (*record, live),
        other => panic!("{id} shows no record: {other:?}"),
    }
}

/// Asserts that every write by `id` is refused with `why`.
async fn assert_dead(engine: &Engine, id: Uuid, why: Refusal) {
    match commit(engine, id, &response("zombie")).await {
        Err(r) => assert_eq!(r, why, "commit"),
        other => panic!("commit by a dead id: {other:?}"),
    }
    assert_eq!(
        engine.extend(TENANT, id, 30).await.expect("extend"),
        Err(why),
        "extend"
    );
    let cp = engine
        .checkpoint(
            TENANT,
            id,
            &Recovery {
                recovery_point: "late".into(),
                data: None,
            },
        )
        .await
        .expect("checkpoint");
    assert_eq!(cp.err(), Some(why), "checkpoint");
    assert_eq!(
        engine.release(TENANT, id).await.expect("release"),
        Err(why),
        "release"
    );
}

// ---------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------

async fn reserve_classifies_new_replay_in_flight_and_mismatch(backend: Backend) {
    let engine = backend.engine().await;
    let key = fresh_key();
    let req = request(key, Some("fp-a"));

    let before = Utc::now();
    let first = reserved(reserve(&engine, &req).await);
    assert_eq!(first.attempt, 1);
    assert!(first.recovery.is_none());
    let lease = (first.lease_expires_at - before).num_milliseconds();
    assert!((29_000..=31_000).contains(&lease), "lease {lease} ms");
    let ttl = (first.expires_at - before).num_seconds();
    assert!((86_399..=86_401).contains(&ttl), "ttl {ttl} s");

    // Same fingerprint, or none: in flight, with the lease's remaining time.
    let retry = in_flight(reserve(&engine, &req).await);
    assert!((29..=30).contains(&retry), "retry after {retry}");
    in_flight(reserve(&engine, &request(key, None)).await);
    // Another fingerprint: reused, even while in flight.
    mismatch(reserve(&engine, &request(key, Some("fp-b"))).await);

    let res = response("first");
    assert!(matches!(
        commit(&engine, first.reservation_id, &res).await,
        Ok(Committed::Now(_))
    ));

    let record = completed(reserve(&engine, &req).await);
    assert_eq!(record.state, KeyState::Completed);
    assert_eq!(record.response.as_ref(), Some(&res));
    assert_eq!(record.reservation_id, first.reservation_id);
    assert_eq!(record.fingerprint.as_deref(), Some("fp-a"));
    assert_eq!(record.tenant, TENANT);
    assert_eq!(record.key_hash, key.to_vec());
    assert_eq!(record.expires_at, first.expires_at);
    assert!(record.completed_at.is_some());
    assert!(record.lease_expires_at.is_none());
    completed(reserve(&engine, &request(key, None)).await);
    mismatch(reserve(&engine, &request(key, Some("fp-b"))).await);

    // The same key under another tenant is another record.
    let mut other_tenant = req.clone();
    other_tenant.tenant = "globex".into();
    assert_eq!(reserved(reserve(&engine, &other_tenant).await).attempt, 1);
}

async fn commit_is_idempotent_for_the_same_response_only(backend: Backend) {
    let engine = backend.engine().await;
    let r = reserved(reserve(&engine, &request(fresh_key(), Some("fp"))).await);
    let res = response("once");
    let stored = match commit(&engine, r.reservation_id, &res).await {
        Ok(Committed::Now(record)) => record,
        other => panic!("first commit: {other:?}"),
    };
    assert_eq!(stored.response.as_ref(), Some(&res));
    match commit(&engine, r.reservation_id, &res).await {
        Ok(Committed::Earlier(record)) => {
            assert_eq!(record.response.as_ref(), Some(&res));
            assert_eq!(record.completed_at, stored.completed_at);
        }
        other => panic!("same response again: {other:?}"),
    }
    match commit(&engine, r.reservation_id, &response("twice")).await {
        Err(Refusal::AlreadyCompleted) => {}
        other => panic!("another response: {other:?}"),
    }
    // The holder's other writes are refused once it completed.
    assert_eq!(
        engine.extend(TENANT, r.reservation_id, 30).await.unwrap(),
        Err(Refusal::AlreadyCompleted)
    );
    assert_eq!(
        engine.release(TENANT, r.reservation_id).await.unwrap(),
        Err(Refusal::AlreadyCompleted)
    );
    let (record, live) = shown(&engine, r.reservation_id).await;
    assert!(!live);
    assert_eq!(record.response.as_ref(), Some(&res));
}

async fn release_makes_the_key_new_and_kills_the_id(backend: Backend) {
    let engine = backend.engine().await;
    let key = fresh_key();
    let old = reserved(reserve(&engine, &request(key, Some("fp-a"))).await);
    assert_eq!(
        engine.release(TENANT, old.reservation_id).await.unwrap(),
        Ok(())
    );

    // Released: the id is dead as "expired" until someone reserves again.
    assert_dead(&engine, old.reservation_id, Refusal::Expired).await;
    assert!(matches!(
        engine.get(TENANT, old.reservation_id).await.unwrap(),
        Some(Lookup::Gone)
    ));

    // New again, even with another payload: attempt 1, nothing carried over.
    let new = reserved(reserve(&engine, &request(key, Some("fp-b"))).await);
    assert_eq!(new.attempt, 1);
    assert!(new.recovery.is_none());
    assert_ne!(new.reservation_id, old.reservation_id);
    // The key was reserved afresh (attempt 1), not taken over: the old id
    // still reads as released.
    assert_dead(&engine, old.reservation_id, Refusal::Expired).await;
    assert!(matches!(
        commit(&engine, new.reservation_id, &response("new")).await,
        Ok(Committed::Now(_))
    ));
}

async fn takeover_after_the_lease_hands_on_recovery_and_fences_the_old_id(backend: Backend) {
    let engine = backend.engine().await;
    let key = fresh_key();
    let req = request(key, Some("fp"));
    let old = reserved(reserve(&engine, &with_lease(req.clone(), 1)).await);
    let recovery = Recovery {
        recovery_point: "charged".into(),
        data: Some(serde_json::json!({"charge": "ch_1", "amounts": [1, 2.5], "note": null})),
    };
    let record = engine
        .checkpoint(TENANT, old.reservation_id, &recovery)
        .await
        .unwrap()
        .expect("checkpoint by the holder");
    assert_eq!(record.recovery.as_ref(), Some(&recovery));
    in_flight(reserve(&engine, &req).await);

    tokio::time::sleep(PAST_ONE_SECOND).await;
    // The lease ended, but a takeover still needs a compatible fingerprint.
    mismatch(reserve(&engine, &request(key, Some("other"))).await);

    let new = reserved(reserve(&engine, &req).await);
    assert_eq!(new.attempt, 2);
    assert_eq!(new.recovery.as_ref(), Some(&recovery));
    assert_ne!(new.reservation_id, old.reservation_id);
    assert_eq!(
        new.expires_at, old.expires_at,
        "the TTL counts from the first reservation"
    );
    let lease = (new.lease_expires_at - Utc::now()).num_seconds();
    assert!((28..=30).contains(&lease), "new lease {lease} s");

    assert_dead(&engine, old.reservation_id, Refusal::TakenOver).await;
    let (old_view, live) = shown(&engine, old.reservation_id).await;
    assert!(!live, "a taken-over id shows its key's record, not live");
    assert_eq!(old_view.attempt, 2);
    assert!(
        shown(&engine, new.reservation_id).await.1,
        "the new holder is live"
    );

    let res = response("winner");
    assert!(matches!(
        commit(&engine, new.reservation_id, &res).await,
        Ok(Committed::Now(_))
    ));
    // After completion, the old id is still taken over, not a replay.
    match commit(&engine, old.reservation_id, &res).await {
        Err(Refusal::TakenOver) => {}
        other => panic!("zombie commit after completion: {other:?}"),
    }
    let replay = completed(reserve(&engine, &req).await);
    assert_eq!(replay.response.as_ref(), Some(&res));
    assert_eq!(replay.attempt, 2);
}

/// The count behind the `idemgate_keys_unknown` gauge, asked again and
/// again as keys become stuck (a lease that ends, a holder's mark) and are
/// settled (a late commit, a lease extended, a takeover): right each time,
/// and what a second process's first count says too.
async fn the_stuck_count_follows_keys_as_they_stick_and_settle(backend: Backend) {
    async fn count(engine: &Engine) -> u64 {
        engine.count_stuck().await.expect("count")
    }
    let engine = backend.engine().await;
    assert_eq!(count(&engine).await, 0);

    let hold = |req: ReserveRequest| ReserveRequest {
        on_lease_expiry: idemgate::store::LeaseExpiry::Hold,
        ..req
    };
    let lapsing = reserved(reserve(&engine, &with_lease(request(fresh_key(), None), 1)).await);
    let held = reserved(reserve(&engine, &hold(with_lease(request(fresh_key(), None), 1))).await);
    let taken_key = fresh_key();
    let taken = reserved(reserve(&engine, &with_lease(request(taken_key, None), 1)).await);
    let marked = reserved(reserve(&engine, &request(fresh_key(), None)).await);
    let live = reserved(reserve(&engine, &request(fresh_key(), None)).await);
    let done = reserved(reserve(&engine, &with_lease(request(fresh_key(), None), 1)).await);
    assert!(matches!(
        commit(&engine, done.reservation_id, &response("done")).await,
        Ok(Committed::Now(_))
    ));
    engine
        .mark_unknown(TENANT, marked.reservation_id, "the upstream hung up")
        .await
        .expect("mark")
        .expect("marked");
    assert_eq!(
        count(&engine).await,
        1,
        "the marked key, before any lease ends"
    );

    tokio::time::sleep(PAST_ONE_SECOND).await;
    assert_eq!(
        count(&engine).await,
        4,
        "three leases ended (under takeover and hold) and the marked key"
    );
    assert_eq!(count(&backend.engine().await).await, 4, "a second process");

    assert!(matches!(
        commit(&engine, lapsing.reservation_id, &response("late")).await,
        Ok(Committed::Now(_))
    ));
    engine
        .extend(TENANT, held.reservation_id, 30)
        .await
        .expect("extend")
        .expect("extended");
    let again = reserved(reserve(&engine, &request(taken_key, None)).await);
    assert_eq!(again.attempt, 2, "taken over");
    assert_eq!(
        count(&engine).await,
        1,
        "a late commit, an extension, a takeover"
    );

    assert!(matches!(
        commit(&engine, marked.reservation_id, &response("settled")).await,
        Ok(Committed::Now(_))
    ));
    assert_eq!(count(&engine).await, 0);
    let _ = (taken, live);

    // A lease that ends after many counts is found by the next one.
    let later = reserved(reserve(&engine, &with_lease(request(fresh_key(), None), 1)).await);
    assert_eq!(count(&engine).await, 0);
    tokio::time::sleep(PAST_ONE_SECOND).await;
    assert_eq!(count(&engine).await, 1);
    engine
        .release(TENANT, later.reservation_id)
        .await
        .expect("release")
        .expect("released");
    assert_eq!(count(&engine).await, 0);
    assert_eq!(count(&backend.engine().await).await, 0, "a second process");
}

async fn extend_keeps_the_key_held_past_the_original_lease(backend: Backend) {
    let engine = backend.engine().await;
    let req = request(fresh_key(), None);
    let r = reserved(reserve(&engine, &with_lease(req.clone(), 1)).await);
    let until = engine
        .extend(TENANT, r.reservation_id, 30)
        .await
        .unwrap()
        .expect("extend by the holder");
    let lease = (until - Utc::now()).num_seconds();
    assert!((29..=30).contains(&lease), "extended lease {lease} s");

    tokio::time::sleep(PAST_ONE_SECOND).await;
    // Past the original lease: still held, not a takeover.
    let retry = in_flight(reserve(&engine, &req).await);
    assert!(retry >= 28, "retry after {retry}");
    assert!(matches!(
        commit(&engine, r.reservation_id, &response("slow")).await,
        Ok(Committed::Now(_))
    ));
}

/// A call that asked its client for input (an MCP `input_required` round)
/// keeps its key for the round that continues it, which holds it as the call
/// did, and only with the same key and fingerprint; one that no round
/// continues is released at its lease's end, never held unknown, though
/// its key was claimed under `hold`.
async fn a_key_awaiting_input_is_resumed_by_its_call_or_released_at_its_lease_end(
    backend: Backend,
) {
    let engine = backend.engine().await;
    let hold = |req: ReserveRequest| ReserveRequest {
        on_lease_expiry: idemgate::store::LeaseExpiry::Hold,
        ..req
    };
    let continued = hold(request(fresh_key(), Some("call")));
    let asked = reserved(reserve(&engine, &continued).await);
    engine
        .await_input(TENANT, asked.reservation_id, 30)
        .await
        .unwrap()
        .expect("kept for the next round");
    // Another call with the key waits, as for any call in flight.
    in_flight(reserve(&engine, &continued).await);
    // Not with another fingerprint, nor for another key, nor another tenant.
    let other_call = hold(request(continued.key_hash, Some("other call")));
    assert!(
        engine
            .resume(&other_call, asked.reservation_id)
            .await
            .unwrap()
            .is_none()
    );
    let other_key = hold(request(fresh_key(), Some("call")));
    assert!(
        engine
            .resume(&other_key, asked.reservation_id)
            .await
            .unwrap()
            .is_none()
    );
    let other_tenant = ReserveRequest {
        tenant: "someone-else".into(),
        ..continued.clone()
    };
    assert!(
        engine
            .resume(&other_tenant, asked.reservation_id)
            .await
            .unwrap()
            .is_none()
    );
    // The round that continues the call holds the key as the call did.
    let resumed = engine
        .resume(&continued, asked.reservation_id)
        .await
        .unwrap()
        .expect("the call's own round continues it");
    assert_eq!(resumed.reservation_id, asked.reservation_id);
    assert_eq!(resumed.attempt, 1);
    assert!(matches!(
        commit(&engine, resumed.reservation_id, &response("confirmed")).await,
        Ok(Committed::Now(_))
    ));
    // Completed: a later round resumes nothing, and its reserve replays.
    assert!(
        engine
            .resume(&continued, asked.reservation_id)
            .await
            .unwrap()
            .is_none()
    );
    completed(reserve(&engine, &continued).await);

    // A round once more sent may act again: the lease's end means `hold`.
    let acting = hold(with_lease(request(fresh_key(), Some("call")), 1));
    let first = reserved(reserve(&engine, &acting).await);
    engine
        .await_input(TENANT, first.reservation_id, 1)
        .await
        .unwrap()
        .expect("kept");
    engine
        .resume(&acting, first.reservation_id)
        .await
        .unwrap()
        .expect("resumed");
    tokio::time::sleep(PAST_ONE_SECOND).await;
    assert!(
        matches!(
            reserve(&engine, &acting).await,
            ReserveOutcome::Unknown { .. }
        ),
        "a resumed round that may have acted is held unknown at its lease's end"
    );

    // Nobody continues this one: at its lease's end it is released.
    let abandoned = hold(with_lease(request(fresh_key(), Some("call")), 1));
    let left = reserved(reserve(&engine, &abandoned).await);
    engine
        .await_input(TENANT, left.reservation_id, 1)
        .await
        .unwrap()
        .expect("kept");
    tokio::time::sleep(PAST_ONE_SECOND).await;
    assert!(
        engine
            .resume(&abandoned, left.reservation_id)
            .await
            .unwrap()
            .is_none(),
        "past its lease the round is reserved afresh"
    );
    let again = reserved(reserve(&engine, &abandoned).await);
    assert_eq!(again.attempt, 2, "taken over, never unknown");
}

async fn expired_keys_are_new_again_and_pruning_deletes_them(backend: Backend) {
    let engine = backend.engine().await;
    let (renewed, abandoned) = (fresh_key(), fresh_key());
    let first = reserved(reserve(&engine, &with_ttl(request(renewed, Some("a")), 1)).await);
    assert!(matches!(
        commit(&engine, first.reservation_id, &response("short-lived")).await,
        Ok(Committed::Now(_))
    ));
    let gone = reserved(reserve(&engine, &with_ttl(request(abandoned, None), 1)).await);
    let live = reserved(reserve(&engine, &request(fresh_key(), None)).await);

    tokio::time::sleep(PAST_ONE_SECOND).await;
    assert_eq!(
        backend.counts().await,
        (3, 0),
        "expired rows are still there; no id was superseded yet"
    );
    assert_dead(&engine, first.reservation_id, Refusal::Expired).await;

    // New again, although the row exists, even with another payload.
    let again = reserved(reserve(&engine, &request(renewed, Some("b"))).await);
    assert_eq!(again.attempt, 1);
    assert_ne!(again.reservation_id, first.reservation_id);
    assert_dead(&engine, first.reservation_id, Refusal::Expired).await;

    // Only the record that is still expired goes. The id the new claim
    // superseded stays with its key, so that it answers as dead.
    assert_eq!(prune::prune_once(engine.store().as_ref()).await.unwrap(), 1);
    assert_eq!(backend.counts().await, (2, 1));
    assert_dead(&engine, first.reservation_id, Refusal::Expired).await;
    assert_dead(&engine, gone.reservation_id, Refusal::NotFound).await;
    assert_eq!(
        engine
            .get(TENANT, gone.reservation_id)
            .await
            .unwrap()
            .map(|_| ()),
        None
    );
    assert_eq!(
        engine
            .get(TENANT, live.reservation_id)
            .await
            .unwrap()
            .map(|l| matches!(l, Lookup::Record { live: true, .. })),
        Some(true),
        "a live record is untouched"
    );
    assert_eq!(prune::prune_once(engine.store().as_ref()).await.unwrap(), 0);
}

async fn unknown_ids_are_not_found(backend: Backend) {
    let engine = backend.engine().await;
    assert_dead(&engine, Uuid::new_v4(), Refusal::NotFound).await;
    assert!(engine.get(TENANT, Uuid::new_v4()).await.unwrap().is_none());

    // Another tenant's id is unknown too.
    let r = reserved(reserve(&engine, &request(fresh_key(), None)).await);
    match engine
        .commit("globex", r.reservation_id, &response("x"))
        .await
        .unwrap()
    {
        Err(Refusal::NotFound) => {}
        other => panic!("commit by another tenant: {other:?}"),
    }
    assert!(
        engine
            .get("globex", r.reservation_id)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        engine.release("globex", r.reservation_id).await.unwrap(),
        Err(Refusal::NotFound)
    );
    // ... and did not touch the record.
    assert!(matches!(
        commit(&engine, r.reservation_id, &response("mine")).await,
        Ok(Committed::Now(_))
    ));
}

async fn a_waiting_reserve_gets_the_replay_when_the_holder_commits(backend: Backend) {
    // The holder's engine, and another engine over another store instance, as
    // another process would be: one waiter is woken locally, the other polls.
    let holder = Arc::new(backend.engine().await);
    let elsewhere = Arc::new(backend.engine().await);
    let key = fresh_key();
    let req = request(key, Some("fp"));
    let r = reserved(reserve(&holder, &req).await);

    let mut waiting = req.clone();
    waiting.wait = Some(Duration::from_secs(5));
    let started = Instant::now();
    let waiters = [holder.clone(), elsewhere.clone()].map(|engine| {
        let waiting = waiting.clone();
        tokio::spawn(async move { engine.reserve(&waiting).await })
    });
    let res = response("waited for");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(
        commit(&holder, r.reservation_id, &res).await,
        Ok(Committed::Now(_))
    ));
    for waiter in waiters {
        let record = completed(waiter.await.unwrap().unwrap());
        assert_eq!(record.response.as_ref(), Some(&res));
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "waited {:?}",
        started.elapsed()
    );

    // A wait that runs out on a live holder still ends in flight.
    let other = request(fresh_key(), None);
    reserved(reserve(&holder, &other).await);
    let mut short = other.clone();
    short.wait = Some(Duration::from_millis(200));
    in_flight(reserve(&elsewhere, &short).await);
}

/// Fires `n` reserves of `req` at once, alternating between `engines`.
async fn race(engines: &[Arc<Engine>], n: usize, req: &ReserveRequest) -> Vec<ReserveOutcome> {
    let barrier = Arc::new(Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let engine = engines[i % engines.len()].clone();
            let barrier = barrier.clone();
            let req = req.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                engine.reserve(&req).await
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.expect("task").expect("reserve"));
    }
    out
}

async fn two_engines(backend: &Backend) -> Vec<Arc<Engine>> {
    vec![
        Arc::new(backend.engine().await),
        Arc::new(backend.engine().await),
    ]
}

async fn sixty_four_racers_over_two_instances_one_winner(backend: Backend) {
    let engines = two_engines(&backend).await;
    let results = race(&engines, 64, &request(fresh_key(), Some("same"))).await;
    let winners: Vec<_> = results
        .iter()
        .filter_map(|o| match o {
            ReserveOutcome::Reserved(r) => Some(r),
            _ => None,
        })
        .collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    assert_eq!(winners[0].attempt, 1);
    let in_flight = results
        .iter()
        .filter(|o| matches!(o, ReserveOutcome::InFlight { .. }))
        .count();
    assert_eq!(in_flight, 63, "{results:?}");
    assert_eq!(
        backend.counts().await,
        (1, 0),
        "one record, no superseded id"
    );
}

async fn racers_after_lease_expiry_make_exactly_one_takeover(backend: Backend) {
    let engines = two_engines(&backend).await;
    let req = request(fresh_key(), Some("same"));
    let first = reserved(reserve(&engines[0], &with_lease(req.clone(), 1)).await);
    tokio::time::sleep(PAST_ONE_SECOND).await;
    let results = race(&engines, 64, &req).await;
    let winners: Vec<_> = results
        .iter()
        .filter_map(|o| match o {
            ReserveOutcome::Reserved(r) => Some(r),
            _ => None,
        })
        .collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    assert_eq!(winners[0].attempt, 2);
    assert_ne!(winners[0].reservation_id, first.reservation_id);
    let in_flight = results
        .iter()
        .filter(|o| matches!(o, ReserveOutcome::InFlight { .. }))
        .count();
    assert_eq!(in_flight, 63, "{results:?}");
    assert_eq!(backend.counts().await, (1, 1), "the first id, superseded");
}

async fn two_pruners_at_once_delete_each_expired_row_once(backend: Backend) {
    // More than two batches (prune::BATCH), so the passes interleave.
    const SEEDED: i64 = 2_500;
    backend.seed_expired(SEEDED).await;
    let live = backend.engine().await;
    reserved(reserve(&live, &request(fresh_key(), None)).await);
    assert_eq!(backend.counts().await, (SEEDED + 1, SEEDED));

    let total = backend.prune_twice_at_once().await;
    assert_eq!(
        total,
        u64::try_from(SEEDED).unwrap(),
        "each row deleted once"
    );
    assert_eq!(backend.counts().await, (1, 0), "the live record stays");
}

async fn completed_keys_survive_a_restart(backend: Backend) {
    let (done, busy) = (fresh_key(), fresh_key());
    let res = response("durable");
    let (r, held) = {
        let engine = backend.engine().await;
        let r = reserved(reserve(&engine, &request(done, Some("fp"))).await);
        assert!(matches!(
            commit(&engine, r.reservation_id, &res).await,
            Ok(Committed::Now(_))
        ));
        let held = reserved(reserve(&engine, &request(busy, None)).await);
        (r, held)
        // The engine and its store are dropped here, without a clean close.
    };
    let engine = backend.engine().await;
    let record = completed(reserve(&engine, &request(done, Some("fp"))).await);
    assert_eq!(record.response.as_ref(), Some(&res));
    assert_eq!(record.reservation_id, r.reservation_id);
    in_flight(reserve(&engine, &request(busy, None)).await);
    // The holder's id still works through the reopened store.
    assert!(matches!(
        commit(&engine, held.reservation_id, &response("after restart")).await,
        Ok(Committed::Now(_))
    ));
}

/// The migration that keeps only superseded ids in
/// `idempotency_reservations`, over records an older version wrote (every
/// id in that table, current ones included): a live holder still commits, a
/// lapsed one is taken over and its id answers as taken over, and a
/// released key reserved afresh leaves its old id answering as expired.
async fn ids_an_older_version_recorded_stay_valid(backend: Backend) {
    use std::borrow::Cow;

    const ONE_TABLE: i64 = 20261207000001;
    let dir = match backend {
        Backend::Postgres(_) => "postgres",
        Backend::Sqlite(_) => "sqlite",
    };
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("migrations")
        .join(dir);
    let mut older = sqlx::migrate::Migrator::new(path)
        .await
        .expect("the migrations");
    older.migrations = Cow::Owned(
        older
            .migrations
            .iter()
            .filter(|m| m.version < ONE_TABLE)
            .cloned()
            .collect(),
    );
    let (live, lapsed, released) = (fresh_key(), fresh_key(), fresh_key());
    let (live_id, lapsed_id, released_id) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    match &backend {
        Backend::Postgres(db) => {
            let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
            older.run(&pool).await.expect("the older migrations");
            sqlx::query(
                "INSERT INTO idempotency_keys
                     (tenant, key_hash, state, reservation_id, lease_expires_at, attempt,
                      created_at, expires_at)
                 VALUES ($1, $2, 'in_flight', $3, now() + interval '1 minute', 1,
                         now(), now() + interval '1 hour'),
                        ($1, $4, 'in_flight', $5, now() - interval '1 minute', 1,
                         now() - interval '2 minutes', now() + interval '1 hour'),
                        ($1, $6, 'in_flight', $7, now(), 1,
                         now() - interval '2 minutes', now())",
            )
            .bind(TENANT)
            .bind(&live[..])
            .bind(live_id)
            .bind(&lapsed[..])
            .bind(lapsed_id)
            .bind(&released[..])
            .bind(released_id)
            .execute(&pool)
            .await
            .unwrap();
            sqlx::query(
                "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
                 SELECT tenant, reservation_id, key_hash FROM idempotency_keys",
            )
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
        }
        Backend::Sqlite(_) => {
            let pool = sqlx::SqlitePool::connect(&format!("{}?mode=rwc", backend.url()))
                .await
                .unwrap();
            older.run(&pool).await.expect("the older migrations");
            let now = Utc::now().timestamp_millis();
            // The older version's trigger writes each record's id.
            sqlx::query(
                "INSERT INTO idempotency_keys
                     (tenant, key_hash, state, reservation_id, lease_expires_at, attempt,
                      created_at, expires_at)
                 VALUES (?1, ?2, 'in_flight', ?3, ?8 + 60000, 1, ?8, ?8 + 3600000),
                        (?1, ?4, 'in_flight', ?5, ?8 - 60000, 1, ?8 - 120000, ?8 + 3600000),
                        (?1, ?6, 'in_flight', ?7, ?8, 1, ?8 - 120000, ?8)",
            )
            .bind(TENANT)
            .bind(&live[..])
            .bind(live_id.hyphenated().to_string())
            .bind(&lapsed[..])
            .bind(lapsed_id.hyphenated().to_string())
            .bind(&released[..])
            .bind(released_id.hyphenated().to_string())
            .bind(now)
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
        }
    }
    assert_eq!(backend.counts().await, (3, 3), "the older version's rows");

    let engine = backend.engine().await;
    assert!(
        shown(&engine, live_id).await.1,
        "the live holder shows live"
    );
    let taken = reserved(reserve(&engine, &request(lapsed, None)).await);
    assert_eq!(taken.attempt, 2);
    assert_dead(&engine, lapsed_id, Refusal::TakenOver).await;
    let fresh = reserved(reserve(&engine, &request(released, None)).await);
    assert_eq!(fresh.attempt, 1);
    assert_dead(&engine, released_id, Refusal::Expired).await;
    assert!(matches!(
        commit(&engine, live_id, &response("upgraded")).await,
        Ok(Committed::Now(_))
    ));
    assert!(matches!(
        commit(&engine, taken.reservation_id, &response("taken")).await,
        Ok(Committed::Now(_))
    ));
    // Nothing new for the superseded ids: the older rows hold them.
    assert_eq!(backend.counts().await, (3, 3));
}

// ---------------------------------------------------------------------------
// One test per scenario and backend
// ---------------------------------------------------------------------------

both_stores! {
    serial: [
        reserve_classifies_new_replay_in_flight_and_mismatch,
        commit_is_idempotent_for_the_same_response_only,
        release_makes_the_key_new_and_kills_the_id,
        takeover_after_the_lease_hands_on_recovery_and_fences_the_old_id,
        extend_keeps_the_key_held_past_the_original_lease,
        a_key_awaiting_input_is_resumed_by_its_call_or_released_at_its_lease_end,
        the_stuck_count_follows_keys_as_they_stick_and_settle,
        expired_keys_are_new_again_and_pruning_deletes_them,
        unknown_ids_are_not_found,
        completed_keys_survive_a_restart,
        ids_an_older_version_recorded_stay_valid,
    ],
    concurrent: [
        a_waiting_reserve_gets_the_replay_when_the_holder_commits,
        sixty_four_racers_over_two_instances_one_winner,
        racers_after_lease_expiry_make_exactly_one_takeover,
        two_pruners_at_once_delete_each_expired_row_once,
    ],
}
