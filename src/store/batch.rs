//! Group commit: claims, commits and releases share durable writes.
//!
//! One by one, every new key costs two transactions (its claim, then its
//! commit), each with its own round trip and its own flush to disk. [`Batched`]
//! puts a queue in front of a store: a writer takes whatever queued while its
//! previous batch was being written and hands it to [`Store::write_batch`] as
//! one transaction. The batches clock themselves, with no timer: a write that
//! finds nothing being written goes at once, alone, in its own task (nothing
//! waits for company), and under load each flush carries everything that
//! arrived during the last one.
//!
//! What one by one would have answered, each write still gets:
//!
//! * The writes of a batch had all been sent and none answered, so they ran
//!   at the same time; any order of them is one the clients could have seen.
//!   The store applies them in queue order, each seeing the ones before it.
//! * A second claim of a key in one batch is answered here, from the record
//!   the first one left, where nothing between them can have changed it (in
//!   flight under a live lease, or completed: the engine makes it a 409, a
//!   replay or, with another fingerprint, a 422); otherwise it goes to the
//!   store in a transaction after the first's. Either way, no transaction
//!   holds two claims of one key.
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
use tokio::sync::{Semaphore, SemaphorePermit, mpsc, oneshot};
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
    /// One permit per transaction of writes in the database at once
    /// ([`Store::batch_writers`]); the queued writes gather behind them.
    writers: Arc<Semaphore>,
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

impl Counters {
    /// One transaction of `writes` writes.
    fn count(&self, writes: usize) {
        let n = writes as u64;
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.writes.fetch_add(n, Ordering::Relaxed);
        self.largest.fetch_max(n, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Batched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batched").finish_non_exhaustive()
    }
}

// === impl Batched ===

impl Batched {
    /// Batches the writes of `store`, with a queue of 4096 writes.
    pub fn new(store: Arc<dyn Store>) -> Batched {
        Batched::with_queue_bound(store, QUEUE_BOUND)
    }

    /// Batches the writes of `store`, refusing writes past `bound` waiting.
    pub fn with_queue_bound(store: Arc<dyn Store>, bound: usize) -> Batched {
        Batched {
            bound: bound.max(1),
            writers: Arc::new(Semaphore::new(store.batch_writers().max(1))),
            queue: OnceLock::new(),
            stats: Arc::default(),
            store,
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
            tokio::spawn(write_loop(
                self.store.clone(),
                rx,
                self.writers.clone(),
                self.stats.clone(),
            ));
            tx
        })
    }

    /// Writes `writes` as one batch, now, as a writer would have had they
    /// queued together: for tests and tools that need a batch of known
    /// content. The answers are in order.
    pub async fn write_together(&self, writes: Vec<Write>) -> Vec<Result<Written>> {
        let mut answered = Vec::with_capacity(writes.len());
        let mut jobs = Vec::with_capacity(writes.len());
        for write in writes {
            let (answer, rx) = oneshot::channel();
            jobs.push(Job { write, answer });
            answered.push(rx);
        }
        {
            let _writer = self.writers.acquire().await;
            self.stats.count(jobs.len());
            flush(&*self.store, &mut jobs).await;
        }
        let mut answers = Vec::with_capacity(answered.len());
        for rx in answered {
            answers.push(
                rx.await
                    .unwrap_or_else(|_| Err(StoreError::other("no answer"))),
            );
        }
        answers
    }

    /// Leave to write alone, now, in the calling task, when nothing else is
    /// being written or waits to: no hand-over to the writer and back, and
    /// no copy of the write, so a lone write costs what it did before
    /// batches. Held until the write is done.
    fn alone(&self) -> Option<SemaphorePermit<'_>> {
        let queue = self.queue();
        if queue.capacity() != queue.max_capacity() {
            return None;
        }
        let permit = self.writers.try_acquire().ok()?;
        self.stats.count(1);
        Some(permit)
    }

    /// Queues `write` and waits for its batch.
    async fn queued(&self, write: Write) -> Result<Written> {
        let (answer, answered) = oneshot::channel();
        match self.queue().try_send(Job { write, answer }) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                return Err(StoreError::unavailable(format!(
                    "{} writes are already waiting for the database",
                    self.bound
                )));
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                return Err(StoreError::unavailable("the store's writers have stopped"));
            }
        }
        answered
            .await
            .unwrap_or_else(|_| Err(StoreError::other("a batch ended without an answer")))
    }
}

/// The writer: takes what queued while the transactions in the database
/// were written, and as soon as one of them is done, writes it as the next
/// one, in a task of its own (so that a request that goes away never cuts a
/// batch of other requests' writes short). Ends when the [`Batched`] is
/// dropped.
async fn write_loop(
    store: Arc<dyn Store>,
    mut queue: mpsc::Receiver<Job>,
    writers: Arc<Semaphore>,
    stats: Arc<Counters>,
) {
    loop {
        let mut jobs = Vec::with_capacity(MAX_BATCH);
        if queue.recv_many(&mut jobs, MAX_BATCH).await == 0 {
            return;
        }
        let Ok(writer) = writers.clone().acquire_owned().await else {
            return;
        };
        // What queued while waiting for a writer comes along.
        while jobs.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        stats.count(jobs.len());
        let store = store.clone();
        tokio::spawn(async move {
            flush(&*store, &mut jobs).await;
            drop(writer);
        });
    }
}

/// Writes `jobs` and answers each; leaves `jobs` empty.
///
/// In queue order, as transactions of writes that hold no two claims of one
/// key: the longest run from the first write not answered yet. After each,
/// a later claim of a key whose record the run read is answered from that
/// record where the record cannot have changed before it (see [`settled`]).
/// So a storm of claims of one key costs one transaction, and every answer
/// is the one the queue's order gives.
async fn flush(store: &dyn Store, jobs: &mut Vec<Job>) {
    let mut answers: Vec<Option<Result<Written>>> = (0..jobs.len()).map(|_| None).collect();
    // The last claim answer per key: the record as that write left it.
    let mut read: HashMap<(&str, &[u8; 32]), (usize, Claim)> = HashMap::new();
    let mut next = 0;
    while next < jobs.len() {
        // The run: from `next`, up to the first second claim of a key.
        let mut run = Vec::new();
        let mut keys = std::collections::HashSet::new();
        for (i, job) in jobs.iter().enumerate().skip(next) {
            if answers[i].is_some() {
                continue;
            }
            if let Write::Claim(req) = &job.write
                && !keys.insert((req.tenant.as_str(), &req.key_hash))
            {
                break;
            }
            run.push(i);
        }
        write_run(store, jobs, &run, &mut answers).await;
        for &i in &run {
            if let (Write::Claim(req), Some(Ok(Written::Claim(Some(claim))))) =
                (&jobs[i].write, &answers[i])
            {
                read.insert((req.tenant.as_str(), &req.key_hash), (i, claim.clone()));
            }
        }
        // Later claims of those keys, answered from what the run read.
        for i in 0..jobs.len() {
            if answers[i].is_some() {
                continue;
            }
            let Write::Claim(req) = &jobs[i].write else {
                continue;
            };
            if let Some((at, claim)) = read.get(&(req.tenant.as_str(), &req.key_hash))
                && *at < i
                && settled(claim, &jobs[*at + 1..i])
            {
                answers[i] = Some(Ok(Written::Claim(Some(Claim {
                    claimed: false,
                    record: claim.record.clone(),
                    now: claim.now,
                }))));
            }
        }
        next = answers
            .iter()
            .position(Option::is_none)
            .unwrap_or(jobs.len());
    }
    drop(read);
    for (job, answer) in jobs.drain(..).zip(answers) {
        let answer =
            answer.unwrap_or_else(|| Err(StoreError::other("a batched write got no answer")));
        let _ = job.answer.send(answer);
    }
}

/// Whether a claim of the key `claim` read, placed after the writes
/// `between`, is bound to find the same record and claim nothing: the record
/// is alive and either completed or held under a live lease, and none of
/// `between` completes or releases its holder (the only writes that change
/// such a record; a claim of it leaves it as it is).
fn settled(claim: &Claim, between: &[Job]) -> bool {
    let record = &claim.record;
    let holds = match record.state {
        KeyState::Completed => true,
        KeyState::InFlight => record.lease_expires_at.is_some_and(|end| end > claim.now),
    };
    record.expires_at > claim.now
        && holds
        && !between.iter().any(|job| match &job.write {
            Write::Complete { reservation_id, .. } | Write::Release { reservation_id, .. } => {
                *reservation_id == record.reservation_id
            }
            Write::Claim(_) => false,
        })
}

/// Writes the jobs `run` (no two claims of one key) in one transaction,
/// and those the transaction could not answer alone.
async fn write_run(
    store: &dyn Store,
    jobs: &[Job],
    run: &[usize],
    answers: &mut [Option<Result<Written>>],
) {
    if let [i] = run {
        answers[*i] = Some(write_one(store, &jobs[*i].write).await);
        return;
    }
    let writes: Vec<&Write> = run.iter().map(|&i| &jobs[i].write).collect();
    let results = store.write_batch(&writes).await;
    let mut again = Vec::new();
    let mut outage = false;
    for (&i, result) in run.iter().zip(results) {
        match result {
            // No row for a claim without a limit: the record went away under
            // it (pruned at that instant); alone, the claim tries again.
            // Under a limit it is the answer: the limit held the claim back
            // from a key with no record.
            Ok(Written::Claim(None)) if matches!(&jobs[i].write, Write::Claim(req) if req.max_in_flight.is_none()) => {
                again.push(i)
            }
            Ok(written) => answers[i] = Some(Ok(written)),
            Err(e) => {
                tracing::debug!(error = %e, "a batched write failed: writing it alone");
                outage |= matches!(e, StoreError::Unavailable { .. });
                again.push(i);
            }
        }
    }
    if outage {
        // Each alone waits for the database as long as the batch did: side
        // by side, so the wait is the batch's, not the sum. (SQLite answers
        // a claim of a completed key from its readers all the same.)
        let alone = futures::future::join_all(
            again
                .iter()
                .map(|&i| async move { (i, written_alone(store, &jobs[i].write).await) }),
        )
        .await;
        for (i, answer) in alone {
            answers[i] = Some(answer);
        }
    } else {
        // One write the database refused: the others, in queue order.
        for i in again {
            answers[i] = Some(written_alone(store, &jobs[i].write).await);
        }
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
        if let Some(_alone) = self.alone() {
            return self.store.reserve(req).await;
        }
        match self.queued(Write::Claim(req.clone())).await? {
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
        if let Some(_alone) = self.alone() {
            return self.store.complete(tenant, reservation_id, response).await;
        }
        let write = Write::Complete {
            tenant: tenant.to_owned(),
            reservation_id,
            response: response.clone(),
        };
        match self.queued(write).await? {
            Written::Complete(record) => Ok(record),
            _ => Err(mismatched()),
        }
    }

    async fn release(&self, tenant: &str, reservation_id: Uuid) -> Result<Option<Vec<u8>>> {
        if let Some(_alone) = self.alone() {
            return self.store.release(tenant, reservation_id).await;
        }
        let write = Write::Release {
            tenant: tenant.to_owned(),
            reservation_id,
        };
        match self.queued(write).await? {
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

    async fn write_batch(&self, writes: &[&Write]) -> Vec<Result<Written>> {
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
    StoreError::other("a batched write got another kind of answer")
}
