//! What goes into each transaction of a batch, and how each write gets the
//! answer one by one would have given it: the one algorithm behind every
//! group commit, whoever drives it (the writer tasks of [`Batcher`](super::Batcher),
//! or a store's own writer thread).

use std::collections::{HashMap, HashSet};

use super::Job;
use crate::store::{Claim, HotPath, KeyState, Result, StoreError, Write, Written, write_one};

/// Where a batch's writes go: a whole run in one transaction, or one write
/// alone in its own.
pub(crate) trait Sink {
    /// `writes` in one transaction, in order, one answer each (see
    /// [`HotPath::write_batch`](crate::store::HotPath::write_batch)).
    async fn together(&self, writes: &[&Write]) -> Vec<Result<Written>>;
    /// `write` alone, in a transaction of its own.
    async fn alone(&self, write: &Write) -> Result<Written>;
}

/// A store's own batch and one-by-one operations ([`HotPath::write_batch`],
/// [`write_one`]).
pub(super) struct StoreSink<'a>(pub(super) &'a dyn HotPath);

impl Sink for StoreSink<'_> {
    async fn together(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        self.0.write_batch(writes).await
    }

    async fn alone(&self, write: &Write) -> Result<Written> {
        write_one(self.0, write).await
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
pub(crate) async fn flush<S: Sink>(sink: &S, jobs: &mut Vec<Job>) {
    let mut answers: Vec<Option<Result<Written>>> = (0..jobs.len()).map(|_| None).collect();
    // The last claim answer per key: the record as that write left it.
    let mut read: HashMap<(&str, &[u8; 32]), (usize, Claim)> = HashMap::new();
    let mut next = 0;
    while next < jobs.len() {
        // The run: from `next`, up to the first second claim of a key.
        let mut run = Vec::new();
        let mut keys = HashSet::new();
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
        write_run(sink, jobs, &run, &mut answers).await;
        for &i in &run {
            if let (Write::Claim(req), Some(Ok(Written::Claim(Some(claim))))) =
                (&jobs[i].write, &answers[i])
            {
                read.insert((req.tenant.as_str(), &req.key_hash), (i, claim.clone()));
            }
        }
        // Later claims of those keys, answered from what the run read.
        if !read.is_empty() {
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
async fn write_run<S: Sink>(
    sink: &S,
    jobs: &[Job],
    run: &[usize],
    answers: &mut [Option<Result<Written>>],
) {
    if let [i] = run {
        answers[*i] = Some(sink.alone(&jobs[*i].write).await);
        return;
    }
    let writes: Vec<&Write> = run.iter().map(|&i| &jobs[i].write).collect();
    let results = sink.together(&writes).await;
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
                .map(|&i| async move { (i, written_alone(sink, &jobs[i].write).await) }),
        )
        .await;
        for (i, answer) in alone {
            answers[i] = Some(answer);
        }
    } else {
        // One write the database refused: the others, in queue order.
        for i in again {
            answers[i] = Some(written_alone(sink, &jobs[i].write).await);
        }
    }
}

/// A write of a batch that failed, written alone. The batch's transaction
/// may have committed after all (its answer lost with the connection): a
/// claim that then finds the key held by its own reservation id holds it.
async fn written_alone<S: Sink>(sink: &S, write: &Write) -> Result<Written> {
    let written = sink.alone(write).await?;
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
