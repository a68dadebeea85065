//! How long this process's holders recently took, from reserve to commit,
//! and the `Retry-After` a duplicate is told from that: an estimate of when
//! the first request will have finished, not the end of its lease.
//!
//! Each reservation this process hands out is timed until its commit; the
//! durations go into a small ring per tenant and one for the whole process.
//! A duplicate that meets a holder in flight is told the ring's 90th
//! percentile minus what the holder has already run (when that is known),
//! rounded up to whole seconds, at least 1 — and the engine caps it at the
//! lease's end, the latest moment the key can still be held without news.
//! Releases are not timed (the effect never ran), nor are holders whose
//! commit another process made.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moka::sync::Cache;
use uuid::Uuid;

/// Durations kept per ring: enough for a stable 90th percentile, few enough
/// that a change of pace shows within a minute of traffic.
const RING: usize = 64;

/// Older durations no longer describe how the origin behaves now.
const WINDOW: Duration = Duration::from_secs(600);

/// A tenant's own ring is used once it holds this many recent durations;
/// before that, the whole process's.
const MIN_TENANT_SAMPLES: usize = 5;

/// Reservations timed at once; beyond it the oldest are forgotten (their
/// commits are then simply not timed).
const MAX_RUNNING: u64 = 100_000;

/// Tenants with a ring of their own.
const MAX_TENANTS: u64 = 10_000;

/// Recent reserve→commit durations (see the module documentation).
pub(crate) struct Durations {
    /// When each reservation of this process was handed out.
    running: Cache<Uuid, (Arc<str>, Instant)>,
    tenants: Cache<Arc<str>, Arc<Mutex<Ring>>>,
    all: Mutex<Ring>,
}

/// The last [`RING`] durations and when each was taken.
#[derive(Default)]
struct Ring {
    samples: VecDeque<(Instant, Duration)>,
}

// === impl Ring ===

impl Ring {
    fn push(&mut self, at: Instant, took: Duration) {
        if self.samples.len() == RING {
            self.samples.pop_front();
        }
        self.samples.push_back((at, took));
    }

    /// The 90th percentile of the durations taken within [`WINDOW`], if at
    /// least `min` are.
    fn p90(&self, now: Instant, min: usize) -> Option<Duration> {
        let mut recent: Vec<Duration> = self
            .samples
            .iter()
            .filter(|(at, _)| now.saturating_duration_since(*at) < WINDOW)
            .map(|(_, took)| *took)
            .collect();
        if recent.len() < min.max(1) {
            return None;
        }
        recent.sort_unstable();
        // Nearest rank: the smallest value at or above 90 % of the samples.
        let rank = (recent.len() * 9).div_ceil(10).max(1);
        Some(recent[rank - 1])
    }
}

// === impl Durations ===

impl Durations {
    pub(crate) fn new(max_lease: Duration) -> Durations {
        Durations {
            // A holder that never commits is forgotten after the longest
            // lease it could have held without news.
            running: Cache::builder()
                .max_capacity(MAX_RUNNING)
                .time_to_live(max_lease.max(Duration::from_secs(60)))
                .build(),
            tenants: Cache::builder()
                .max_capacity(MAX_TENANTS)
                .time_to_idle(WINDOW)
                .build(),
            all: Mutex::new(Ring::default()),
        }
    }

    /// Reservation `id` of `tenant` was handed out now.
    pub(crate) fn started(&self, tenant: &str, id: Uuid) {
        self.running.insert(id, (Arc::from(tenant), Instant::now()));
    }

    /// Reservation `id` was released: its effect never ran.
    pub(crate) fn forget(&self, id: Uuid) {
        self.running.invalidate(&id);
    }

    /// Reservation `id` committed now: its duration is recorded.
    pub(crate) fn finished(&self, id: Uuid) {
        let Some((tenant, at)) = self.running.remove(&id) else {
            return;
        };
        let now = Instant::now();
        let took = now.saturating_duration_since(at);
        let ring = self
            .tenants
            .get_with_by_ref(&tenant, || Arc::new(Mutex::new(Ring::default())));
        ring.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(now, took);
        self.all
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(now, took);
    }

    /// How long reservation `id` has run, if this process handed it out.
    pub(crate) fn running_for(&self, id: Uuid) -> Option<Duration> {
        self.running.get(&id).map(|(_, at)| at.elapsed())
    }

    /// When a holder of `tenant` that has run for `elapsed` (unknown: `None`)
    /// will likely have finished, from now; `None` without recent durations.
    pub(crate) fn remaining(&self, tenant: &str, elapsed: Option<Duration>) -> Option<Duration> {
        let now = Instant::now();
        let own = self.tenants.get(tenant).and_then(|ring| {
            ring.lock()
                .unwrap_or_else(|e| e.into_inner())
                .p90(now, MIN_TENANT_SAMPLES)
        });
        let p90 = own.or_else(|| {
            self.all
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .p90(now, 1)
        })?;
        Some(p90.saturating_sub(elapsed.unwrap_or_default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(ms: &[u64]) -> Ring {
        let mut r = Ring::default();
        let now = Instant::now();
        for &m in ms {
            r.push(now, Duration::from_millis(m));
        }
        r
    }

    #[test]
    fn the_ninetieth_percentile_by_nearest_rank() {
        let now = Instant::now();
        let ten: Vec<u64> = (1..=10).map(|i| i * 100).collect();
        assert_eq!(ring(&ten).p90(now, 1), Some(Duration::from_millis(900)));
        assert_eq!(ring(&[1500]).p90(now, 1), Some(Duration::from_millis(1500)));
        assert_eq!(ring(&[1500]).p90(now, 5), None, "too few samples");
        assert_eq!(Ring::default().p90(now, 1), None);
    }

    #[test]
    fn the_ring_keeps_the_latest_durations() {
        let mut r = Ring::default();
        let now = Instant::now();
        for _ in 0..RING {
            r.push(now, Duration::from_secs(30));
        }
        for _ in 0..RING {
            r.push(now, Duration::from_millis(200));
        }
        assert_eq!(r.p90(now, 1), Some(Duration::from_millis(200)));
    }

    #[test]
    fn a_tenant_with_few_durations_borrows_the_process_figure() {
        let d = Durations::new(Duration::from_secs(60));
        assert_eq!(d.remaining("a", None), None, "nothing measured yet");
        for _ in 0..3 {
            let id = Uuid::new_v4();
            d.started("b", id);
            d.finished(id);
        }
        let borrowed = d.remaining("a", None).expect("the process's ring");
        assert!(borrowed < Duration::from_secs(1), "{borrowed:?}");
        let id = Uuid::new_v4();
        d.started("a", id);
        d.forget(id);
        d.finished(id);
        assert!(d.running_for(id).is_none(), "a released id is not timed");
    }

    #[test]
    fn what_a_holder_already_ran_is_taken_off() {
        let d = Durations::new(Duration::from_secs(60));
        let now = Instant::now();
        d.all.lock().unwrap().push(now, Duration::from_millis(1500));
        assert_eq!(
            d.remaining("t", Some(Duration::from_millis(500))),
            Some(Duration::from_millis(1000))
        );
        assert_eq!(
            d.remaining("t", Some(Duration::from_secs(5))),
            Some(Duration::ZERO)
        );
    }
}
