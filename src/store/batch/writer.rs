//! The writers behind [`Batched`](super::Batched): what goes into each
//! transaction, and how each write gets the answer one by one would have
//! given it.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc};

use super::{Counters, Job, MAX_BATCH};
use crate::store::{Claim, KeyState, Result, Store, StoreError, Write, Written, write_one};

/// The writer: takes what queued while the transactions in the database
/// were written, and as soon as one of them is done, writes it as the next
/// one, in a task of its own (so that a request that goes away never cuts a
/// batch of other requests' writes short). Ends when the [`Batched`](super::Batched) is
/// dropped.
pub(super) async fn write_loop(
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
pub(super) async fn flush(store: &dyn Store, jobs: &mut Vec<Job>) {
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
/// refuses claims ([`Record::refuses_claims`](crate::store::Record::refuses_claims):
/// completed, unknown, or held), and none of `between` completes or releases
/// its holder (the only writes of a batch that change such a record; a
/// claim of it leaves it as it is).
fn settled(claim: &Claim, between: &[Job]) -> bool {
    let record = &claim.record;
    record.refuses_claims(claim.now)
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
pub(super) async fn written_alone(store: &dyn Store, write: &Write) -> Result<Written> {
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
