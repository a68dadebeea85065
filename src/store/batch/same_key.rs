//! Duplicates in flight through one process: a claim of a key whose claim
//! by this process is still being written waits for that one's answer and,
//! where the answer cannot have changed since, is answered from it, with no
//! write of its own. A retry storm, where each key comes twice or more at
//! about the same moment, then costs the database one claim per key, and no
//! duplicate's transaction waits on the first one's row.
//!
//! Exact, as one by one would answer: the second claim was sent before the
//! first was answered, so they ran at the same time, and the second may be
//! placed right after the first. It is answered from the first's record
//! only when nothing can have changed that record between the first's
//! commit and now:
//!
//! * the first claimed the key: its holder is the first's caller, who has
//!   not been told yet, so nobody can have committed or released it; its
//!   lease has just begun (another claim, an operator, pruning all leave a
//!   record under a live lease alone);
//! * or the first found it completed: only its expiry changes that.
//!
//! Either way with [`MARGIN`] to spare before the lease's or the record's
//! end, read on the first answer's database clock. Any other answer (in
//! flight under someone else's lease, which its holder may settle at any
//! moment; unknown; an error; a claim that went away) sends the second claim
//! to the database as before.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::TimeDelta;
use tokio::sync::watch;

use crate::store::{Claim, ClaimRequest, KeyState};

/// How far from its lease's or its record's end an answer must be to stand
/// for a duplicate's.
const MARGIN: TimeDelta = TimeDelta::seconds(2);

type Slot = (String, [u8; 32]);

/// The claims this process is writing, by key, each with where its answer
/// will be published.
#[derive(Default)]
pub(super) struct InFlight {
    claims: Mutex<HashMap<Slot, watch::Receiver<Option<Arc<Claim>>>>>,
}

/// What a claim is to do: write, and publish its answer; or wait for the
/// answer of the claim of its key being written.
pub(super) enum Turn<'a> {
    First(Publisher<'a>),
    Second(watch::Receiver<Option<Arc<Claim>>>),
}

/// The first claim's hold on its key's slot: removed when dropped (answered
/// or not), which lets the waiters go on if nothing was published.
pub(super) struct Publisher<'a> {
    in_flight: &'a InFlight,
    slot: Option<Slot>,
    answer: watch::Sender<Option<Arc<Claim>>>,
}

impl InFlight {
    pub(super) fn turn(&self, req: &ClaimRequest) -> Turn<'_> {
        let slot = (req.tenant.clone(), req.key_hash);
        let mut claims = self.claims.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(answer) = claims.get(&slot) {
            return Turn::Second(answer.clone());
        }
        let (answer, rx) = watch::channel(None);
        claims.insert(slot.clone(), rx);
        Turn::First(Publisher {
            in_flight: self,
            slot: Some(slot),
            answer,
        })
    }
}

impl Publisher<'_> {
    /// Tells the waiting duplicates the first claim's answer, if any wait
    /// (the slot's own receiver aside): a new key, the common case, is
    /// not copied for nobody.
    pub(super) fn publish(&self, claim: &Claim) {
        if self.answer.receiver_count() > 1 {
            self.answer.send_replace(Some(Arc::new(claim.clone())));
        }
    }
}

impl Drop for Publisher<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            let mut claims = self
                .in_flight
                .claims
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            claims.remove(&slot);
        }
    }
}

/// The first claim's answer, as the answer of a duplicate sent while it was
/// written, if it may stand for it (see the module's docs).
pub(super) async fn answer_of_first(
    mut first: watch::Receiver<Option<Arc<Claim>>>,
) -> Option<Claim> {
    let claim = first.wait_for(Option::is_some).await.ok()?.clone()?;
    let record = &claim.record;
    let settled_until = match record.state {
        KeyState::InFlight if claim.claimed => record
            .lease_expires_at
            .map_or(record.expires_at, |end| end.min(record.expires_at)),
        KeyState::Completed => record.expires_at,
        _ => return None,
    };
    (claim.now + MARGIN < settled_until).then(|| Claim {
        claimed: false,
        record: record.clone(),
        now: claim.now,
    })
}
