//! How long a caller is told to wait, and the tenant limits: the figures
//! the engine keeps beside the store's.
//!
//! Per-tenant limits (`IDEMGATE_TENANT_MAX_IN_FLIGHT`,
//! `IDEMGATE_TENANT_MAX_STORED_BYTES`, both off by default) keep one tenant
//! from exhausting the store. A new key over a limit, or the takeover of a
//! key whose lease ended (which would put it in flight again), is refused
//! with `tenant-limit` and a `Retry-After` (the end of the tenant's earliest
//! lease, or the expiry of its earliest stored record), and nothing is
//! reserved; replays, 409s and 422s are answered as always. In-flight keys
//! are counted by the claim itself through a partial index of in-flight
//! rows: exactly on SQLite (under the write lock); on PostgreSQL against the
//! claim's snapshot, so simultaneous claims of one tenant can pass the limit
//! by at most one per database connection. Stored bytes are read at most
//! every 2 s per tenant and process, with the process's own commits added in
//! between; a key already in flight may always store its response — an
//! effect that happened is never refused its record.

use std::sync::Arc;
use std::time::Duration;

use super::{Engine, EngineError, ReserveOutcome, STORED_USAGE_REFRESH, TenantLimit};
use crate::store::{Claim, KeyState, StoredResponse};

/// A tenant's stored bytes as last read, plus this process's commits since.
#[derive(Debug, Clone, Copy)]
pub(super) struct StoredFigure {
    pub(super) bytes: u64,
    /// Time from the reading until the first of its records expires.
    pub(super) next_expiry_in: Option<Duration>,
    pub(super) read_at: std::time::Instant,
}

// === impl Engine ===

impl Engine {
    /// How long the holder of a record that was not claimed has run, where
    /// that is known: this process handed it out, or it is the key's first
    /// attempt (which began at `created_at`, by the database's clock).
    pub(super) fn holder_ran(&self, claim: &Claim) -> Option<Duration> {
        if claim.claimed || claim.record.state != KeyState::InFlight {
            return None;
        }
        let record = &claim.record;
        self.durations
            .running_for(record.reservation_id)
            .or_else(|| {
                (record.attempt == 1)
                    .then(|| (claim.now - record.created_at).to_std().ok())
                    .flatten()
            })
    }

    /// `Retry-After` for a duplicate of an in-flight key: when its holder
    /// will likely have finished, from the recent durations of this
    /// process's holders, at least 1 s and never past the lease's end
    /// (`until_lease_end`, whole seconds). With nothing measured yet, 1 s:
    /// a client that honours it asks again soon rather than waiting out a
    /// lease for a request that may take a moment.
    pub(super) fn retry_after(
        &self,
        tenant: &str,
        holder_ran: Option<Duration>,
        until_lease_end: u64,
    ) -> u64 {
        let estimate = self
            .durations
            .remaining(tenant, holder_ran)
            .map_or(1, whole_seconds_up);
        estimate.min(until_lease_end).max(1)
    }

    /// The answer to a claim a tenant limit held back.
    pub(super) async fn over_limit(
        &self,
        tenant: &str,
        stored_full: Option<u64>,
    ) -> Result<ReserveOutcome, EngineError> {
        if let Some(retry_after) = stored_full {
            return Ok(ReserveOutcome::OverLimit {
                limit: TenantLimit::StoredBytes,
                retry_after,
            });
        }
        let max = self.tenant_limits.max_in_flight.unwrap_or(0);
        let usage = self.store.in_flight_usage(tenant, max).await?;
        let wait = usage
            .next_lease_end
            .and_then(|end| (end - usage.now).to_std().ok());
        tracing::debug!(live = usage.keys, max, "tenant at its in-flight limit");
        Ok(ReserveOutcome::OverLimit {
            limit: TenantLimit::InFlightKeys,
            retry_after: whole_seconds_up(wait.unwrap_or(Duration::from_secs(1))),
        })
    }

    /// `Some(retry_after)` when the tenant's stored bytes reach `max`; reads
    /// them again when the figure is older than [`STORED_USAGE_REFRESH`].
    pub(super) async fn stored_retry_after(
        &self,
        tenant: &str,
        max: u64,
    ) -> Result<Option<u64>, EngineError> {
        let slot = self
            .stored_usage
            .get_with_by_ref(tenant, || Arc::new(tokio::sync::Mutex::new(None)));
        // One reader per tenant: the others wait and use its figure.
        let mut figure = slot.lock().await;
        let fresh = figure
            .as_ref()
            .is_some_and(|f| f.read_at.elapsed() < STORED_USAGE_REFRESH);
        if !fresh {
            let read_at = std::time::Instant::now();
            let usage = self.store.stored_usage(tenant).await?;
            *figure = Some(StoredFigure {
                bytes: usage.bytes,
                next_expiry_in: usage
                    .next_expiry
                    .and_then(|at| (at - usage.now).to_std().ok()),
                read_at,
            });
        }
        let Some(f) = figure.as_ref() else {
            return Ok(None);
        };
        if f.bytes < max {
            return Ok(None);
        }
        // Until the first stored record expires; if that is unknown (the
        // bytes are this process's own commits), until the next reading.
        let wait = f.next_expiry_in.map_or(STORED_USAGE_REFRESH, |d| {
            d.saturating_sub(f.read_at.elapsed())
        });
        Ok(Some(whole_seconds_up(wait)))
    }

    /// Adds a commit's stored size to its tenant's figure, if one is kept.
    pub(super) fn count_stored(&self, tenant: &str, stored: &StoredResponse) {
        if self.tenant_limits.max_stored_bytes.is_none() {
            return;
        }
        let Some(slot) = self.stored_usage.get(tenant) else {
            return;
        };
        // Skipped while a reading is under way: it may or may not see this
        // commit, and the next one will.
        if let Ok(mut figure) = slot.try_lock()
            && let Some(f) = figure.as_mut()
        {
            f.bytes = f.bytes.saturating_add(stored_size(stored));
        }
    }
}

/// About what a stored response takes in the store: its body and its header
/// list.
pub(super) fn stored_size(response: &StoredResponse) -> u64 {
    let headers: usize = response
        .headers
        .iter()
        .map(|(n, v)| n.len() + v.len() + 6)
        .sum();
    u64::try_from(response.body.len() + headers).unwrap_or(u64::MAX)
}

/// Whole seconds, rounded up, never 0: "retry now" would only spin.
pub(super) fn whole_seconds_up(d: Duration) -> u64 {
    let ms = d.as_millis();
    u64::try_from(ms.div_ceil(1000)).unwrap_or(u64::MAX).max(1)
}
