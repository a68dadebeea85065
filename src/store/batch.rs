//! Group commit: claims, commits and releases share durable writes.
//!
//! One by one, every new key costs two transactions (its claim, then its
//! commit), each with its own round trip and its own flush to disk. [`Batched`]
//! puts a queue in front of a store: a writer takes whatever queued while its
//! previous batch was being written and hands it to [`Store::write_batch`] as
//! one transaction. The batches clock themselves, with no timer: a write that
//! finds the writer idle goes at once, alone (nothing waits for company), and
//! under load each flush carries everything that arrived during the last one.
//!
//! What one by one would have answered, each write still gets:
//!
//! * The writes of a batch had all been sent and none answered, so they ran
//!   at the same time; any order of them is one the clients could have seen.
//!   The store applies them in queue order, each seeing the ones before it.
//! * A second claim of a key the batch already claims is answered here, from
//!   the first one's record (in flight under the new holder's live lease: the
//!   engine makes it a 409 or, with another fingerprint, a 422); when the first
//!   did not claim, the second goes to the store alone after the batch.
//! * A write whose batch failed is written again alone, so one bad write
//!   never fails the others, and each gets its own answer (an outage makes
//!   that an `Unavailable` for each, so a 503).
//! * An answer is sent only after the batch's transaction committed: a 201
//!   or a commit's 200 is as durable as before.
//!
//! The queue is bounded: past [`QUEUE_BOUND`] waiting writes, a write is
//! refused at once as `Unavailable` (a 503 with `Retry-After` at the door)
//! rather than joining a queue that grows without limit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use super::{
    BatchStats, Claim, ClaimRequest, Found, InFlightUsage, KeyState, PoolStats, PruneBatch, Record,
    Recovery, Result, Store, StoreError, StoredResponse, StoredUsage, Write, Written, write_one,
};

/// Most writes waiting for a writer; past it a write is refused.
pub const QUEUE_BOUND: usize = 4096;

/// Most writes in one batch: enough to carry a full queue of busy
/// connections, few enough that one transaction stays short.
const MAX_BATCH: usize = 256;

/// A [`Store`] whose claims, commits and releases are written in batches;
/// every other operation goes straight to the store.
pub struct Batched {
    store: Arc<dyn Store>,
    bound: usize,
    /// The queue, with its writers started on first use (they need a
    /// runtime; the store may be built outside one).
    queue: OnceLock<mpsc::Sender<Job>>,
    stats: Arc<Counters>,
}

/// A write and where its answer goes.
struct Job {
    write: Write,
    answer: oneshot::Sender<Result<Written>>,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    writes: AtomicU64,
    largest: AtomicU64,
    refused: AtomicU64,
}

impl std::fmt::Debug for Batched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batched").finish_non_exhaustive()
    }
}

// === impl Batched ===

impl Batched {
    /// Batches the writes of `store`, with a queue of [`QUEUE_BOUND`].
    pub fn new(store: Arc<dyn Store>) -> Batched {
        Batched::with_queue_bound(store, QUEUE_BOUND)
    }

    /// Batches the writes of `store`, refusing writes past `bound` waiting.
    pub fn with_queue_bound(store: Arc<dyn Store>, bound: usize) -> Batched {
        Batched {
            store,
            bound: bound.max(1),
            queue: OnceLock::new(),
            stats: Arc::default(),
        }
    }

    /// `store` batched, unless it is already.
    pub fn wrap(store: Arc<dyn Store>) -> Arc<dyn Store> {
        if store.batch_stats().is_some() {
            store
        } else {
            Arc::new(Batched::new(store))
        }
    }

    fn queue(&self) -> &mpsc::Sender<Job> {
        self.queue.get_or_init(|| {
            let (tx, rx) = mpsc::channel(self.bound);
            let rx = Arc::new(tokio::sync::Mutex::new(rx));
            for _ in 0..self.store.batch_writers().max(1) {
                tokio::spawn(write_loop(
                    self.store.clone(),
                    rx.clone(),
                    self.stats.clone(),
                ));
            }
            tx
        })
    }

    /// Queues `write` and waits for its batch.
    async fn write(&self, write: Write) -> Result<Written> {
        let (answer, answered) = oneshot::channel();
        match self.queue().try_send(Job { write, answer }) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                return Err(StoreError::Unavailable(format!(
                    "{} writes are already waiting for the database",
                    self.bound
                )));
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                return Err(StoreError::Unavailable(
                    "the store's writers have stopped".into(),
                ));
            }
        }
        answered
            .await
            .unwrap_or_else(|_| Err(StoreError::Other("a batch ended without an answer".into())))
    }
}

/// One writer: takes what queued while it wrote the last batch, writes it,
/// answers, and goes again. Ends when the [`Batched`] is dropped.
async fn write_loop(
    store: Arc<dyn Store>,
    queue: Arc<tokio::sync::Mutex<mpsc::Receiver<Job>>>,
    stats: Arc<Counters>,
) {
    let mut jobs = Vec::with_capacity(MAX_BATCH);
    loop {
        {
            let mut queue = queue.lock().await;
            if queue.recv_many(&mut jobs, MAX_BATCH).await == 0 {
                return;
            }
        }
        let n = jobs.len() as u64;
        stats.batches.fetch_add(1, Ordering::Relaxed);
        stats.writes.fetch_add(n, Ordering::Relaxed);
        stats.largest.fetch_max(n, Ordering::Relaxed);
        flush(&*store, &mut jobs).await;
    }
}

/// Writes `jobs` and answers each; leaves `jobs` empty.
async fn flush(store: &dyn Store, jobs: &mut Vec<Job>) {
    if jobs.len() == 1 {
        let job = jobs.pop().expect("one job");
        let answer = write_one(store, &job.write).await;
        let _ = job.answer.send(answer);
        return;
    }
    // Claims of a key the batch claims already wait for the first one.
    let mut first_claim: HashMap<(&str, &[u8; 32]), usize> = HashMap::new();
    let mut sent = Vec::with_capacity(jobs.len());
    let mut later = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        match &job.write {
            Write::Claim(req) => match first_claim.get(&(req.tenant.as_str(), &req.key_hash)) {
                Some(&first) => later.push((i, first)),
                None => {
                    first_claim.insert((req.tenant.as_str(), &req.key_hash), sent.len());
                    sent.push(i);
                }
            },
            _ => sent.push(i),
        }
    }
    drop(first_claim);
    let mut answers: Vec<Option<Result<Written>>> = (0..jobs.len()).map(|_| None).collect();
    if sent.len() == 1 {
        answers[sent[0]] = Some(write_one(store, &jobs[sent[0]].write).await);
    } else {
        let writes: Vec<Write> = sent.iter().map(|&i| jobs[i].write.clone()).collect();
        let results = store.write_batch(&writes).await;
        let mut again = Vec::new();
        for (&i, result) in sent.iter().zip(results) {
            match result {
                // No row for a claim: the limit held it back from a key with
                // no record, or the record went away under it. The claim
                // alone tells the two apart.
                Ok(Written::Claim(None)) => again.push(i),
                Ok(written) => answers[i] = Some(Ok(written)),
                Err(e) => {
                    tracing::debug!(error = %e, "a batched write failed: writing it alone");
                    again.push(i);
                }
            }
        }
        let pending: &[Job] = jobs;
        let alone = futures::future::join_all(
            again
                .iter()
                .map(|&i| async move { (i, written_alone(store, &pending[i].write).await) }),
        )
        .await;
        for (i, answer) in alone {
            answers[i] = Some(answer);
        }
    }
    // The held-back claims: after a claim of their key, the record is the
    // one it left; otherwise they go to the store alone.
    let mut alone = Vec::new();
    for (i, first) in later {
        let first = sent[first];
        match &answers[first] {
            Some(Ok(Written::Claim(Some(claim)))) if claim.claimed => {
                answers[i] = Some(Ok(Written::Claim(Some(Claim {
                    claimed: false,
                    record: claim.record.clone(),
                    now: claim.now,
                }))));
            }
            _ => alone.push(i),
        }
    }
    for i in alone {
        answers[i] = Some(written_alone(store, &jobs[i].write).await);
    }
    for (job, answer) in jobs.drain(..).zip(answers) {
        let answer = answer
            .unwrap_or_else(|| Err(StoreError::Other("a batched write got no answer".into())));
        let _ = job.answer.send(answer);
    }
}

/// A write of a batch that failed, written alone. The batch's transaction
/// may have committed after all (its answer lost with the connection): a
/// claim that then finds the key held by its own reservation id holds it.
async fn written_alone(store: &dyn Store, write: &Write) -> Result<Written> {
    let written = write_one(store, write).await?;
    Ok(match (write, written) {
        (Write::Claim(req), Written::Claim(Some(mut claim)))
            if !claim.claimed
                && claim.record.reservation_id == req.reservation_id
                && claim.record.state == KeyState::InFlight =>
        {
            claim.claimed = true;
            Written::Claim(Some(claim))
        }
        (_, written) => written,
    })
}

#[async_trait]
impl Store for Batched {
    async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        match self.write(Write::Claim(req.clone())).await? {
            Written::Claim(claim) => Ok(claim),
            _ => Err(mismatched()),
        }
    }

    async fn complete(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        response: &StoredResponse,
    ) -> Result<Option<Record>> {
        let write = Write::Complete {
            tenant: tenant.to_owned(),
            reservation_id,
            response: response.clone(),
        };
        match self.write(write).await? {
            Written::Complete(record) => Ok(record),
            _ => Err(mismatched()),
        }
    }

    async fn release(&self, tenant: &str, reservation_id: Uuid) -> Result<Option<Vec<u8>>> {
        let write = Write::Release {
            tenant: tenant.to_owned(),
            reservation_id,
        };
        match self.write(write).await? {
            Written::Release(key_hash) => Ok(key_hash),
            _ => Err(mismatched()),
        }
    }

    async fn extend(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        lease_seconds: u32,
    ) -> Result<Option<DateTime<Utc>>> {
        self.store
            .extend(tenant, reservation_id, lease_seconds)
            .await
    }

    async fn checkpoint(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        recovery: &Recovery,
    ) -> Result<Option<Record>> {
        self.store
            .checkpoint(tenant, reservation_id, recovery)
            .await
    }

    async fn find_by_reservation(
        &self,
        tenant: &str,
        reservation_id: Uuid,
    ) -> Result<Option<Found>> {
        self.store.find_by_reservation(tenant, reservation_id).await
    }

    async fn prune_expired_batch(&self, limit: i64) -> Result<PruneBatch> {
        self.store.prune_expired_batch(limit).await
    }

    async fn in_flight_usage(&self, tenant: &str, up_to: u32) -> Result<InFlightUsage> {
        self.store.in_flight_usage(tenant, up_to).await
    }

    async fn stored_usage(&self, tenant: &str) -> Result<StoredUsage> {
        self.store.stored_usage(tenant).await
    }

    async fn ping(&self) -> Result<()> {
        self.store.ping().await
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        self.store.pool_stats()
    }

    async fn write_batch(&self, writes: &[Write]) -> Vec<Result<Written>> {
        self.store.write_batch(writes).await
    }

    fn batch_writers(&self) -> usize {
        self.store.batch_writers()
    }

    fn batch_stats(&self) -> Option<BatchStats> {
        Some(BatchStats {
            batches: self.stats.batches.load(Ordering::Relaxed),
            writes: self.stats.writes.load(Ordering::Relaxed),
            largest: self.stats.largest.load(Ordering::Relaxed),
            refused: self.stats.refused.load(Ordering::Relaxed),
        })
    }
}

fn mismatched() -> StoreError {
    StoreError::Other("a batched write got another kind of answer".into())
}
