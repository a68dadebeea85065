//! The writer tasks behind [`Batcher`](super::Batcher): each batch taken
//! from the queue as soon as a transaction's place is free, and written
//! (see [`plan`](super::plan)) in a task of its own.

use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc};

use super::plan::{StoreSink, flush};
use super::{Counters, Job, MAX_BATCH};
use crate::store::HotPath;

/// The writer: takes what queued while the transactions in the database
/// were written, and as soon as one of them is done, writes it as the next
/// one, in a task of its own (so that a request that goes away never cuts a
/// batch of other requests' writes short). Ends when the [`Batcher`](super::Batcher) is
/// dropped.
pub(super) async fn write_loop(
    store: Arc<dyn HotPath>,
    mut queue: mpsc::Receiver<Job>,
    writers: Arc<Semaphore>,
    stats: Arc<Counters>,
) {
    loop {
        // Grown to what comes: a batch is mostly a few writes.
        let mut jobs = Vec::new();
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
            flush(&StoreSink(&*store), &mut jobs).await;
            drop(writer);
        });
    }
}
