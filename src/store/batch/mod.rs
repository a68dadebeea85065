//! Group commit: claims, commits and releases share durable writes.
//!
//! One by one, every new key costs two transactions (its claim, then its
//! commit), each with its own round trip and its own flush to disk. The
//! engine sends its claims, commits and releases through a [`Batcher`],
//! which puts a queue in front of the store: a writer takes whatever queued
//! while its previous batch was being written and hands it to
//! [`HotPath::write_batch`](crate::store::HotPath::write_batch) as one
//! transaction. The batches clock themselves, with no timer: a write that
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
//! * A claim sent while this process's claim of the same key is being
//!   written waits for that one's answer, and takes it where nothing can
//!   have changed the record since (see `same_key.rs`).
//! * A write whose batch failed is written again alone, so one bad write
//!   never fails the others, and each gets its own answer (an outage makes
//!   that an `Unavailable` for each, so a 503).
//! * An answer is sent only after the batch's transaction committed: a 201
//!   or a commit's 200 is as durable as before.
//!
//! The queue is bounded: past [`QUEUE_BOUND`] waiting writes, a write is
//! refused at once as `Unavailable` (a 503 with `Retry-After` at the door)
//! rather than joining a queue that grows without limit.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::{Semaphore, SemaphorePermit, mpsc, oneshot};

mod plan;
mod same_key;
mod writer;
mod writes;

use plan::StoreSink;
pub(crate) use plan::flush;
#[cfg(feature = "sqlite")]
pub(crate) use plan::{BlockingSink, flush_blocking};
use writer::write_loop;

use super::{BatchStats, HotPath, Result, StoreError, Write, Written};

/// Most writes waiting for a writer; past it a write is refused.
pub const QUEUE_BOUND: usize = 4096;

/// Most writes in one batch: enough to carry a full queue of busy
/// connections, few enough that one transaction stays short.
pub(crate) const MAX_BATCH: usize = 256;

/// The claims, commits and releases of a store, written in batches: the
/// engine holds one next to its store, sends those three writes through it
/// and everything else straight to the store. A store that groups its
/// writes itself ([`HotPath::groups_own_writes`](crate::store::HotPath::groups_own_writes):
/// SQLite, on its writer thread) gets them straight too: only the wait of a
/// duplicate claim for its key's claim being written (`same_key.rs`) is
/// done here.
pub struct Batcher {
    store: Arc<dyn HotPath>,
    /// The store groups its writes itself.
    grouped: bool,
    bound: usize,
    /// One permit per transaction of writes in the database at once
    /// ([`HotPath::batch_writers`](crate::store::HotPath::batch_writers));
    /// the queued writes gather behind them.
    writers: Arc<Semaphore>,
    /// The queue, with its writers started on first use (they need a
    /// runtime; the store may be built outside one).
    queue: OnceLock<mpsc::Sender<Job>>,
    stats: Arc<Counters>,
    /// The claims being written, for their duplicates to wait on.
    claims: same_key::InFlight,
}

/// A write and where its answer goes.
pub(crate) struct Job {
    pub(crate) write: Write,
    pub(crate) answer: oneshot::Sender<Result<Written>>,
}

/// How writes were grouped: [`BatchStats`](crate::store::BatchStats), as it is counted.
#[derive(Default, Debug)]
pub(crate) struct Counters {
    batches: AtomicU64,
    writes: AtomicU64,
    largest: AtomicU64,
    pub(crate) refused: AtomicU64,
}

impl Counters {
    /// The figures as they stand.
    pub(crate) fn stats(&self) -> crate::store::BatchStats {
        crate::store::BatchStats {
            batches: self.batches.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            largest: self.largest.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }

    /// One transaction of `writes` writes.
    pub(crate) fn count(&self, writes: usize) {
        let n = writes as u64;
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.writes.fetch_add(n, Ordering::Relaxed);
        self.largest.fetch_max(n, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").finish_non_exhaustive()
    }
}

// === impl Batcher ===

impl Batcher {
    /// Batches the writes of `store`, with a queue of 4096 writes.
    pub fn new(store: Arc<dyn HotPath>) -> Batcher {
        Batcher::with_queue_bound(store, QUEUE_BOUND)
    }

    /// Batches the writes of `store`, refusing writes past `bound` waiting.
    /// A store that groups its writes itself keeps its own bound
    /// ([`SqliteStore::with_write_queue_bound`](crate::store::SqliteStore::with_write_queue_bound)).
    pub fn with_queue_bound(store: Arc<dyn HotPath>, bound: usize) -> Batcher {
        Batcher {
            grouped: store.groups_own_writes(),
            bound: bound.max(1),
            writers: Arc::new(Semaphore::new(store.batch_writers().max(1))),
            queue: OnceLock::new(),
            stats: Arc::default(),
            claims: same_key::InFlight::default(),
            store,
        }
    }

    /// How the writes were grouped: by the store itself where it groups
    /// its own, else here.
    pub fn stats(&self) -> BatchStats {
        match self.store.own_batches() {
            Some(own) => own,
            None => self.stats.stats(),
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
        if self.grouped {
            return self.store.write_grouped(writes).await;
        }
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
            flush(&StoreSink(&*self.store), &mut jobs).await;
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
        if self.grouped {
            return None;
        }
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
