//! Reserving a key: the replay cache first, then the claim, and with
//! `Prefer: wait` the wait for another holder without a database connection
//! held in between.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::Instrument as _;
use uuid::Uuid;

use super::decide::{claimable, decide, decide_completed};
use super::{Engine, EngineError, ReserveOutcome, ReserveRequest};
use crate::seal::{Naming, Sealer};
use crate::spans;
use crate::store::{ClaimRequest, KeptRequest, Record};
use crate::telemetry;

impl Engine {
    /// Reserves a key; with `wait`, holds the caller while another holder's
    /// lease is alive, without holding a database connection in between.
    /// In a span of its own ([`spans::CLAIM`]), which records the decision.
    pub async fn reserve(&self, req: &ReserveRequest) -> Result<ReserveOutcome, EngineError> {
        self.reserve_looked(req, Looked::No).await
    }

    /// The decision for `req` if the replay cache holds its key's completed
    /// record (a replay, or `422` for another payload), made at once, with
    /// no store call and nothing claimed; `None` on a miss, counted by
    /// [`Engine::reserve_after_miss`], which the caller then asks. A door
    /// answers a cached replay in the request's own task with it: only a
    /// request that may claim needs a task that outlives its client.
    pub(crate) fn reserve_from_cache(&self, req: &ReserveRequest) -> Option<ReserveOutcome> {
        let cache = self.replay_cache.as_ref()?;
        let named;
        let req = match &self.sealer {
            None => req,
            Some(_) => {
                named = primary(self, req);
                &named
            }
        };
        let record = cache.get(&req.tenant, &req.key_hash)?;
        telemetry::record_replay_cache_hit();
        let span = spans::claim(
            || crate::key::hash_prefix(&req.key_hash),
            millis(bounded_wait(self, req)),
        );
        let outcome = decide_completed(record, req.fingerprint.as_deref());
        spans::claimed(&span, outcome.outcome().as_str(), None);
        Some(outcome)
    }

    /// [`Engine::reserve`] of a request whose key
    /// [`Engine::reserve_from_cache`] has just missed: the cache is not
    /// looked in again, and the miss is counted.
    pub(crate) async fn reserve_after_miss(
        &self,
        req: &ReserveRequest,
    ) -> Result<ReserveOutcome, EngineError> {
        self.reserve_looked(req, Looked::Missed).await
    }

    async fn reserve_looked(
        &self,
        req: &ReserveRequest,
        looked: Looked,
    ) -> Result<ReserveOutcome, EngineError> {
        let Some(sealer) = &self.sealer else {
            return self.reserve_named(req, &[], looked).await;
        };
        // Under sealing the record's names are keyed; during a window (a
        // rotation, the time after sealing was turned on) a key may be kept
        // under another naming, which a new claim looks for.
        let mut named = sealer
            .namings(self.plain_window())
            .into_iter()
            .map(|naming| named(sealer, req, naming));
        let primary = named
            .next()
            .expect("a sealer names records one way at least");
        let others: Vec<ReserveRequest> = named.collect();
        self.reserve_named(&primary, &others, looked).await
    }

    /// The reservation of a call that a later round continues (an MCP call
    /// that asked its client for input, `input_required`): `id`, if it still
    /// holds `req`'s key in flight under `req`'s fingerprint, its lease
    /// extended and its end meaning `req.on_lease_expiry` again (the round
    /// may act). `None` if `id` holds the key no longer (its lease ended, or
    /// the key was completed or taken by another call): the round is then
    /// reserved as any request is.
    pub async fn resume(
        &self,
        req: &ReserveRequest,
        id: Uuid,
    ) -> Result<Option<super::Reservation>, EngineError> {
        let named = primary(self, req);
        let Some(found) = self.store.find_by_reservation(&named.tenant, id).await? else {
            return Ok(None);
        };
        let record = &found.record;
        let held = record.state == crate::store::KeyState::InFlight
            && record.reservation_id == id
            && record.key_hash == named.key_hash
            && record.fingerprint == named.fingerprint
            && record.lease_expires_at.is_some_and(|end| end > found.now);
        if !held {
            return Ok(None);
        }
        let Some(lease_expires_at) = self
            .store
            .extend(
                &named.tenant,
                id,
                req.lease_seconds,
                Some(req.on_lease_expiry),
            )
            .await?
        else {
            return Ok(None);
        };
        Ok(Some(super::Reservation {
            reservation_id: id,
            attempt: record.attempt,
            lease_expires_at,
            expires_at: record.expires_at,
            recovery: None,
            tenant: (named.tenant != req.tenant).then_some(named.tenant),
        }))
    }

    /// [`Engine::reserve`] with the request's names as the store keeps them;
    /// `others` are the same request under the other namings a record of
    /// its key may be kept under.
    async fn reserve_named(
        &self,
        req: &ReserveRequest,
        others: &[ReserveRequest],
        looked: Looked,
    ) -> Result<ReserveOutcome, EngineError> {
        let wait = bounded_wait(self, req);
        let span = spans::claim(|| crate::key::hash_prefix(&req.key_hash), millis(wait));
        // The store's part runs in the span; the replay cache answers at once.
        let cached = match looked {
            Looked::No => self.cached_outcome(req),
            Looked::Missed => {
                if self.replay_cache.is_some() {
                    telemetry::record_replay_cache_miss();
                }
                None
            }
        };
        let decision = match cached {
            Some(outcome) => Ok(outcome),
            None if wait.is_zero() => self.claim(req, others).instrument(span.clone()).await,
            None => {
                let slot = (req.tenant.clone(), req.key_hash);
                let notify = self.waiters.subscribe(&slot);
                let outcome = self
                    .claim_waiting(req, others, Instant::now() + wait, &notify)
                    .instrument(span.clone())
                    .await;
                self.waiters.unsubscribe(&slot, notify);
                outcome
            }
        };
        match &decision {
            Ok(outcome) => {
                let attempt = match outcome {
                    ReserveOutcome::Reserved(reservation) => Some(reservation.attempt),
                    _ => None,
                };
                spans::claimed(&span, outcome.outcome().as_str(), attempt);
            }
            Err(_) => spans::failed(&span),
        }
        decision
    }

    /// The decision for a key whose completed record is in the replay cache.
    pub(super) fn cached_outcome(&self, req: &ReserveRequest) -> Option<ReserveOutcome> {
        let Some(record) = self.replay_cache.as_ref()?.get(&req.tenant, &req.key_hash) else {
            telemetry::record_replay_cache_miss();
            return None;
        };
        telemetry::record_replay_cache_hit();
        Some(decide_completed(record, req.fingerprint.as_deref()))
    }

    /// Caches `record` if it is completed; `started` was read before the
    /// store call that returned it, `db_now` is the database's clock then.
    pub(super) fn remember(
        &self,
        record: &Record,
        started: std::time::Instant,
        db_now: DateTime<Utc>,
    ) {
        if let Some(cache) = &self.replay_cache {
            cache.insert(record, started, db_now);
        }
    }

    pub(super) async fn claim(
        &self,
        req: &ReserveRequest,
        others: &[ReserveRequest],
    ) -> Result<ReserveOutcome, EngineError> {
        self.claim_at(req, others, 0).await
    }

    /// [`Engine::claim`], `depth` times given way to a record of the key
    /// under another name.
    async fn claim_at(
        &self,
        req: &ReserveRequest,
        others: &[ReserveRequest],
        depth: u8,
    ) -> Result<ReserveOutcome, EngineError> {
        // Over its stored bytes, a tenant may still read what it has: the
        // claim only reads (a limit of 0 keys in flight).
        let stored_full = match self.tenant_limits.max_stored_bytes {
            Some(max) => self.stored_retry_after(&req.tenant, max).await?,
            None => None,
        };
        let max_in_flight = match stored_full {
            Some(_) => Some(0),
            None => self.tenant_limits.max_in_flight,
        };
        // Before the store call: the database reads its clock after this.
        let started = std::time::Instant::now();
        let reservation_id = Uuid::now_v7();
        let claim = self
            .batcher
            .reserve(&ClaimRequest {
                tenant: req.tenant.clone(),
                key_hash: req.key_hash,
                fingerprint: req.fingerprint.clone(),
                reservation_id,
                lease_seconds: req.lease_seconds,
                ttl_seconds: req.ttl_seconds,
                on_lease_expiry: req.on_lease_expiry,
                max_in_flight,
                request: req.request.as_ref().map(|request| match &self.sealer {
                    None => KeptRequest::Open(request.clone()),
                    Some(sealer) => KeptRequest::Sealed(sealer.seal_request(
                        &req.tenant,
                        &req.key_hash,
                        request,
                    )),
                }),
            })
            .await;
        let claim = match claim {
            // The claim may have committed with its answer lost: nobody
            // would forward its request or settle its key.
            Err(e) if e.is_unavailable() => {
                self.lost.remember(&req.tenant, reservation_id);
                return Err(e);
            }
            claim => claim?,
        };
        let Some(mut claim) = claim else {
            return self.over_limit(&req.tenant, stored_full).await;
        };
        if claim.claimed && claim.record.attempt == 1 {
            // New under this naming; but if records may be named in a way
            // this process cannot look under, it may not be new at all.
            if let Err(e) = self.check_not_blind() {
                self.batcher.release(&req.tenant, reservation_id).await?;
                return Err(e);
            }
        }
        if claim.claimed && claim.record.attempt == 1 && !others.is_empty() {
            // New under this naming: it may be kept under another. Looked
            // for after the claim, which is committed, so that of two
            // processes naming one key two ways at once, at least the
            // second sees the first's record and gives way: never both run.
            if let Some(other) = self.kept_otherwise(others).await? {
                self.batcher.release(&req.tenant, reservation_id).await?;
                // Asked again under the name it is kept by; if it has gone
                // meanwhile (its holder gave way to this one), that claim is
                // new and looks again, here included. Giving way is always
                // safe; a few rounds of it are a 409 for the caller, which
                // waits or retries, never a second run.
                if depth >= MAX_GIVE_WAY {
                    return Ok(ReserveOutcome::InFlight {
                        retry_after: 1,
                        lease_expires_at: claim.now,
                    });
                }
                let rest: Vec<ReserveRequest> = others
                    .iter()
                    .filter(|o| !std::ptr::eq(*o, other))
                    .cloned()
                    .chain(std::iter::once(req.clone()))
                    .collect();
                return Box::pin(self.claim_at(other, &rest, depth + 1)).await;
            }
        }
        crate::seal::open_record(self.sealer.as_deref(), &mut claim.record)?;
        if !claim.claimed {
            self.remember(&claim.record, started, claim.now);
            if max_in_flight.is_some()
                && claimable(&claim.record, claim.now, req.fingerprint.as_deref())
            {
                return self.over_limit(&req.tenant, stored_full).await;
            }
        }
        let holder_ran = self.holder_ran(&claim);
        Ok(match decide(claim, req.fingerprint.as_deref()) {
            ReserveOutcome::Reserved(mut r) => {
                self.durations.started(&req.tenant, r.reservation_id);
                if req.tenant_from_credential && self.sealer.is_some() {
                    r.tenant = Some(req.tenant.clone());
                }
                ReserveOutcome::Reserved(r)
            }
            ReserveOutcome::InFlight {
                retry_after: until_lease_end,
                lease_expires_at,
            } => ReserveOutcome::InFlight {
                retry_after: self.retry_after(&req.tenant, holder_ran, until_lease_end),
                lease_expires_at,
            },
            other => other,
        })
    }

    /// The first of `others` whose record is alive in the store.
    async fn kept_otherwise<'a>(
        &self,
        others: &'a [ReserveRequest],
    ) -> Result<Option<&'a ReserveRequest>, EngineError> {
        for other in others {
            if let Some(found) = self.store.find_key(&other.tenant, &other.key_hash).await?
                && found.now < found.record.expires_at
            {
                return Ok(Some(other));
            }
        }
        Ok(None)
    }

    pub(super) async fn claim_waiting(
        &self,
        req: &ReserveRequest,
        others: &[ReserveRequest],
        deadline: Instant,
        notify: &Notify,
    ) -> Result<ReserveOutcome, EngineError> {
        let mut poll = Duration::from_millis(20);
        let mut first = true;
        loop {
            // Created before the read, so a commit that lands between the read
            // and the sleep still wakes us.
            let notified = notify.notified();
            // After a wake-up, a commit by this process is in the cache
            // ([`Engine::reserve`] looked before the first round).
            let cached = if first {
                None
            } else {
                self.cached_outcome(req)
            };
            first = false;
            let outcome = match cached {
                Some(outcome) => outcome,
                None => self.claim(req, others).await?,
            };
            let now = Instant::now();
            let ReserveOutcome::InFlight { retry_after, .. } = outcome else {
                return Ok(outcome);
            };
            if now >= deadline {
                return Ok(outcome);
            }
            // Sleep until a local commit, release or mark wakes us, the next
            // poll (a holder in another process), or the lease's end (when a
            // held key becomes unknown, or one under takeover claimable),
            // whichever is first; the poll interval grows so a long wait
            // stays cheap.
            let nap = poll
                .min(deadline - now)
                .min(Duration::from_secs(retry_after));
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(nap) => {}
            }
            poll = (poll * 2).min(Duration::from_millis(500));
        }
    }
}

/// How many times a new claim gives way to a record of its key under another
/// name before it answers "in flight" (both processes' claims can see each
/// other at once, and both give way).
const MAX_GIVE_WAY: u8 = 3;

/// Whether the replay cache was looked in before [`Engine::reserve`]'s own
/// look.
#[derive(Clone, Copy)]
enum Looked {
    /// Not yet: `reserve` looks.
    No,
    /// It was, and missed.
    Missed,
}

/// The wait `req` asks for, within the engine's bound.
fn bounded_wait(engine: &Engine, req: &ReserveRequest) -> Duration {
    req.wait
        .map_or(Duration::ZERO, |w| w.min(engine.limits.max_wait))
}

/// A wait as its claim span records it, in milliseconds.
fn millis(wait: Duration) -> u64 {
    u64::try_from(wait.as_millis()).unwrap_or(u64::MAX)
}

/// `req` under the naming new records are kept under.
fn primary(engine: &Engine, req: &ReserveRequest) -> ReserveRequest {
    match &engine.sealer {
        None => req.clone(),
        Some(sealer) => {
            let naming = sealer
                .namings(engine.plain_window())
                .into_iter()
                .next()
                .expect("a sealer names records one way at least");
            named(sealer, req, naming)
        }
    }
}

/// `req` with its names as `sealer` gives them under `naming`: the key hash,
/// the fingerprint and, if derived from a credential, the tenant.
fn named(sealer: &Sealer, req: &ReserveRequest, naming: Naming) -> ReserveRequest {
    ReserveRequest {
        tenant: if req.tenant_from_credential {
            sealer.tenant(naming, &req.tenant)
        } else {
            req.tenant.clone()
        },
        key_hash: sealer.key_hash(naming, &req.key_hash),
        fingerprint: req
            .fingerprint
            .as_deref()
            .map(|f| sealer.fingerprint(naming, f)),
        ..req.clone()
    }
}
