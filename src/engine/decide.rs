//! What a key's record means for the caller that asked: the decisions
//! themselves, apart from any I/O.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{Refusal, Reservation, ReserveOutcome};
use crate::store::{Claim, KeyState, LeaseExpiry, Record};

/// Classifies a record that a write by `id` could not touch.
pub(super) fn refusal_for(record: &Record, id: Uuid, now: DateTime<Utc>) -> Refusal {
    if now >= record.expires_at {
        Refusal::Expired
    } else if record.reservation_id != id {
        // A takeover raises the attempt; a key that was released or expired
        // and then reserved afresh starts again at attempt 1.
        if record.attempt > 1 {
            Refusal::TakenOver
        } else {
            Refusal::Expired
        }
    } else if record.state == KeyState::Completed {
        Refusal::AlreadyCompleted
    } else {
        Refusal::Expired
    }
}

/// What the record returned by a claim means for this caller.
pub(super) fn decide(claim: Claim, fingerprint: Option<&str>) -> ReserveOutcome {
    let record = claim.record;
    if claim.claimed {
        return ReserveOutcome::Reserved(Reservation {
            reservation_id: record.reservation_id,
            attempt: record.attempt,
            lease_expires_at: record.lease_expires_at.unwrap_or(claim.now),
            expires_at: record.expires_at,
            recovery: record.recovery,
            tenant: None,
        });
    }
    if reused(&record, fingerprint) {
        return ReserveOutcome::Mismatch;
    }
    if record.effective_state(claim.now) == KeyState::Unknown {
        return ReserveOutcome::Unknown {
            record: Box::new(record),
        };
    }
    match record.state {
        KeyState::Completed => ReserveOutcome::Completed(Box::new(record)),
        KeyState::InFlight | KeyState::Unknown => {
            let lease_expires_at = record.lease_expires_at.unwrap_or(claim.now);
            let left = (lease_expires_at - claim.now).num_milliseconds();
            // Whole seconds, rounded up, never 0: "retry now" would only spin.
            let retry_after = u64::try_from((left + 999) / 1000).unwrap_or(0).max(1);
            ReserveOutcome::InFlight {
                retry_after,
                lease_expires_at,
            }
        }
    }
}

/// Whether the claim would have applied to `record` (expired, or in flight
/// past its lease under `takeover` with a compatible fingerprint) had no
/// limit held it back: the store's claim conditions, read back.
pub(super) fn claimable(record: &Record, now: DateTime<Utc>, fingerprint: Option<&str>) -> bool {
    now >= record.expires_at
        || (record.state == KeyState::InFlight
            && record.on_lease_expiry == LeaseExpiry::Takeover
            && record.lease_expires_at.is_none_or(|end| end <= now)
            && !reused(record, fingerprint))
}

/// What a completed record that this caller did not claim means for it: the
/// decision of [`decide`], for a record from the replay cache.
pub(super) fn decide_completed(record: Record, fingerprint: Option<&str>) -> ReserveOutcome {
    if reused(&record, fingerprint) {
        ReserveOutcome::Mismatch
    } else {
        ReserveOutcome::Completed(Box::new(record))
    }
}

/// Both fingerprints known and different: the key was reused (any state).
pub(super) fn reused(record: &Record, fingerprint: Option<&str>) -> bool {
    matches!(
        (record.fingerprint.as_deref(), fingerprint),
        (Some(stored), Some(given)) if stored != given
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Recovery;
    use chrono::Duration as Span;

    fn record(state: KeyState, attempt: i32, fingerprint: Option<&str>) -> Record {
        let now = Utc::now();
        Record {
            tenant: "t".into(),
            key_hash: vec![0; 32],
            fingerprint: fingerprint.map(str::to_owned),
            state,
            reservation_id: Uuid::new_v4(),
            lease_expires_at: Some(now + Span::milliseconds(2_500)),
            attempt,
            recovery: None,
            response: None,
            created_at: now,
            completed_at: None,
            expires_at: now + Span::hours(1),
            on_lease_expiry: LeaseExpiry::Takeover,
            resolution: None,
            marked_unknown: None,
            request: None,
        }
    }

    fn claim(record: Record, claimed: bool) -> Claim {
        Claim {
            claimed,
            now: record.created_at,
            record,
        }
    }

    #[test]
    fn decide_classifies_every_unclaimed_state() {
        let in_flight = record(KeyState::InFlight, 1, Some("a"));
        assert!(matches!(
            decide(claim(in_flight.clone(), false), Some("a")),
            ReserveOutcome::InFlight { retry_after: 3, .. }
        ));
        // Unknown on either side: no mismatch can be detected.
        assert!(matches!(
            decide(claim(in_flight.clone(), false), None),
            ReserveOutcome::InFlight { .. }
        ));
        assert!(matches!(
            decide(claim(in_flight, false), Some("b")),
            ReserveOutcome::Mismatch
        ));
        let completed = record(KeyState::Completed, 1, None);
        assert!(matches!(
            decide(claim(completed.clone(), false), Some("b")),
            ReserveOutcome::Completed(_)
        ));
        let mut completed_a = completed;
        completed_a.fingerprint = Some("a".into());
        assert!(matches!(
            decide(claim(completed_a, false), Some("b")),
            ReserveOutcome::Mismatch
        ));
    }

    #[test]
    fn an_unknown_outcome_is_held_whatever_the_lease() {
        let mut marked = record(KeyState::Unknown, 1, Some("a"));
        assert!(matches!(
            decide(claim(marked.clone(), false), Some("a")),
            ReserveOutcome::Unknown { .. }
        ));
        // Another payload is still a reuse of the key.
        assert!(matches!(
            decide(claim(marked.clone(), false), Some("b")),
            ReserveOutcome::Mismatch
        ));
        // Held past its lease: unknown; within it: in flight.
        marked.state = KeyState::InFlight;
        marked.on_lease_expiry = LeaseExpiry::Hold;
        assert!(matches!(
            decide(claim(marked.clone(), false), Some("a")),
            ReserveOutcome::InFlight { .. }
        ));
        let mut ended = marked.clone();
        ended.lease_expires_at = Some(ended.created_at);
        assert!(matches!(
            decide(claim(ended.clone(), false), Some("a")),
            ReserveOutcome::Unknown { .. }
        ));
        // Neither a held key past its lease nor an unknown one is claimable;
        // one under takeover is.
        assert!(!claimable(&ended, ended.created_at, Some("a")));
        ended.on_lease_expiry = LeaseExpiry::Takeover;
        assert!(claimable(&ended, ended.created_at, Some("a")));
        ended.state = KeyState::Unknown;
        assert!(!claimable(&ended, ended.created_at, Some("a")));
    }

    #[test]
    fn retry_after_is_never_zero() {
        let mut r = record(KeyState::InFlight, 1, None);
        r.lease_expires_at = Some(r.created_at);
        assert!(matches!(
            decide(claim(r, false), None),
            ReserveOutcome::InFlight { retry_after: 1, .. }
        ));
    }

    #[test]
    fn a_claim_hands_on_the_recovery_point() {
        let mut r = record(KeyState::InFlight, 2, Some("a"));
        r.recovery = Some(Recovery {
            recovery_point: "charged".into(),
            data: None,
        });
        let ReserveOutcome::Reserved(res) = decide(claim(r.clone(), true), Some("a")) else {
            panic!("not reserved");
        };
        assert_eq!(res.attempt, 2);
        assert_eq!(res.reservation_id, r.reservation_id);
        assert_eq!(res.recovery, r.recovery);
    }

    #[test]
    fn refusals_say_why_an_id_is_dead() {
        let r = record(KeyState::InFlight, 1, None);
        let now = r.created_at;
        let other = Uuid::new_v4();
        assert_eq!(
            refusal_for(&r, other, now),
            Refusal::Expired,
            "reserved afresh"
        );
        let mut taken = r.clone();
        taken.attempt = 2;
        assert_eq!(refusal_for(&taken, other, now), Refusal::TakenOver);
        let mut done = r.clone();
        done.state = KeyState::Completed;
        assert_eq!(
            refusal_for(&done, done.reservation_id, now),
            Refusal::AlreadyCompleted
        );
        assert_eq!(
            refusal_for(&r, r.reservation_id, r.expires_at),
            Refusal::Expired,
            "past expires_at the key is new again"
        );
    }
}
