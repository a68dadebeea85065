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

/// A [`Sink`] that writes in place, on the caller's thread: a store's own
/// writer thread, which must never wait on a future.
#[cfg(feature = "sqlite")]
pub(crate) trait BlockingSink {
    /// As [`Sink::together`].
    fn together(&self, writes: &[&Write]) -> Vec<Result<Written>>;
    /// As [`Sink::alone`].
    fn alone(&self, write: &Write) -> Result<Written>;
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
/// is the one the queue's order gives. The decisions are [`Flush`]'s; this
/// only writes what it asks for.
pub(crate) async fn flush<S: Sink>(sink: &S, jobs: &mut Vec<Job>) {
    let all: &[Job] = jobs;
    let mut flush = Flush::new(all);
    while let Some(run) = flush.next_run() {
        if let [i] = run[..] {
            let written = sink.alone(&all[i].write).await;
            flush.answer(i, written);
        } else {
            let writes: Vec<&Write> = run.iter().map(|&i| &all[i].write).collect();
            let again = flush.batch_answered(&run, sink.together(&writes).await);
            if again.outage {
                // Each alone waits for the database as long as the batch
                // did: side by side, so the wait is the batch's, not the sum.
                let alone = futures::future::join_all(
                    again
                        .writes
                        .iter()
                        .map(|&i| async move { (i, sink.alone(&all[i].write).await) }),
                )
                .await;
                for (i, written) in alone {
                    flush.answer_alone(i, written);
                }
            } else {
                // One write the database refused: the others, in queue order.
                for i in again.writes {
                    flush.answer_alone(i, sink.alone(&all[i].write).await);
                }
            }
        }
        flush.run_written(&run);
    }
    let answers = flush.into_answers();
    send(jobs, answers);
}

/// [`flush`] on the caller's thread, through a sink that writes in place:
/// nothing here awaits, so a writer thread may run it without a runtime.
#[cfg(feature = "sqlite")]
pub(crate) fn flush_blocking<S: BlockingSink>(sink: &S, jobs: &mut Vec<Job>) {
    let all: &[Job] = jobs;
    let mut flush = Flush::new(all);
    while let Some(run) = flush.next_run() {
        if let [i] = run[..] {
            flush.answer(i, sink.alone(&all[i].write));
        } else {
            let writes: Vec<&Write> = run.iter().map(|&i| &all[i].write).collect();
            let again = flush.batch_answered(&run, sink.together(&writes));
            // One thread, one connection: alone, in queue order, whatever
            // failed the batch.
            for i in again.writes {
                flush.answer_alone(i, sink.alone(&all[i].write));
            }
        }
        flush.run_written(&run);
    }
    let answers = flush.into_answers();
    send(jobs, answers);
}

/// Sends each job its answer; leaves `jobs` empty.
fn send(jobs: &mut Vec<Job>, answers: Vec<Option<Result<Written>>>) {
    for (job, answer) in jobs.drain(..).zip(answers) {
        let answer =
            answer.unwrap_or_else(|| Err(StoreError::other("a batched write got no answer")));
        let _ = job.answer.send(answer);
    }
}

/// Writes of a run whose transaction did not answer them, to be written
/// alone.
struct Again {
    writes: Vec<usize>,
    /// The transaction failed for an outage (each alone will wait as long).
    outage: bool,
}

/// What one flush decides, apart from the writing: which run of jobs goes
/// next in one transaction, which of its writes go again alone, and which
/// later claims are answered from what a run read. The drivers ([`flush`],
/// [`flush_blocking`]) write what it asks for and hand it the answers.
struct Flush<'j> {
    jobs: &'j [Job],
    answers: Vec<Option<Result<Written>>>,
    /// The last claim answer per key: the record as that write left it.
    read: HashMap<(&'j str, &'j [u8; 32]), (usize, Claim)>,
}

impl<'j> Flush<'j> {
    fn new(jobs: &'j [Job]) -> Flush<'j> {
        Flush {
            jobs,
            answers: (0..jobs.len()).map(|_| None).collect(),
            read: HashMap::new(),
        }
    }

    /// The next run: from the first write not answered yet, up to the first
    /// second claim of a key; `None` once every write has its answer.
    fn next_run(&self) -> Option<Vec<usize>> {
        let next = self.answers.iter().position(Option::is_none)?;
        let mut run = Vec::new();
        let mut keys = HashSet::new();
        for (i, job) in self.jobs.iter().enumerate().skip(next) {
            if self.answers[i].is_some() {
                continue;
            }
            if let Write::Claim(req) = &job.write
                && !keys.insert((req.tenant.as_str(), &req.key_hash))
            {
                break;
            }
            run.push(i);
        }
        Some(run)
    }

    /// Job `i`'s answer.
    fn answer(&mut self, i: usize, written: Result<Written>) {
        self.answers[i] = Some(written);
    }

    /// Job `i`'s answer written alone after its batch failed. The batch's
    /// transaction may have committed after all (its answer lost with the
    /// connection): a claim that then finds the key held by its own
    /// reservation id holds it.
    fn answer_alone(&mut self, i: usize, written: Result<Written>) {
        let written = written.map(|written| match (&self.jobs[i].write, written) {
            (Write::Claim(req), Written::Claim(Some(mut claim)))
                if !claim.claimed
                    && claim.record.reservation_id == req.reservation_id
                    && claim.record.state == KeyState::InFlight =>
            {
                claim.claimed = true;
                Written::Claim(Some(claim))
            }
            (_, written) => written,
        });
        self.answers[i] = Some(written);
    }

    /// The answers of `run`'s transaction: kept, but for the writes that
    /// must go again alone.
    fn batch_answered(&mut self, run: &[usize], results: Vec<Result<Written>>) -> Again {
        let mut again = Again {
            writes: Vec::new(),
            outage: false,
        };
        for (&i, result) in run.iter().zip(results) {
            match result {
                // No row for a claim without a limit: the record went away
                // under it (pruned at that instant); alone, the claim tries
                // again. Under a limit it is the answer: the limit held the
                // claim back from a key with no record.
                Ok(Written::Claim(None)) if matches!(&self.jobs[i].write, Write::Claim(req) if req.max_in_flight.is_none()) => {
                    again.writes.push(i)
                }
                Ok(written) => self.answers[i] = Some(Ok(written)),
                Err(e) => {
                    tracing::debug!(error = %e, "a batched write failed: writing it alone");
                    again.outage |= matches!(e, StoreError::Unavailable { .. });
                    again.writes.push(i);
                }
            }
        }
        again
    }

    /// After `run` is written: the later claims of keys it read, answered
    /// from what it read where nothing between can have changed it.
    fn run_written(&mut self, run: &[usize]) {
        let jobs = self.jobs;
        for &i in run {
            if let (Write::Claim(req), Some(Ok(Written::Claim(Some(claim))))) =
                (&jobs[i].write, &self.answers[i])
            {
                self.read
                    .insert((req.tenant.as_str(), &req.key_hash), (i, claim.clone()));
            }
        }
        if self.read.is_empty() {
            return;
        }
        for i in 0..jobs.len() {
            if self.answers[i].is_some() {
                continue;
            }
            let Write::Claim(req) = &jobs[i].write else {
                continue;
            };
            if let Some((at, claim)) = self.read.get(&(req.tenant.as_str(), &req.key_hash))
                && *at < i
                && settled(claim, &jobs[*at + 1..i])
            {
                self.answers[i] = Some(Ok(Written::Claim(Some(Claim {
                    claimed: false,
                    record: claim.record.clone(),
                    now: claim.now,
                }))));
            }
        }
    }

    fn into_answers(self) -> Vec<Option<Result<Written>>> {
        self.answers
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
