//! Work that outlives its client's answer — a call that runs on past the
//! answer timeout, a commit retried in the background while the store is
//! away — counted, so that a shutdown can wait for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use uuid::Uuid;

use crate::engine::{Committed, Engine};
use crate::store::{StoreError, StoredResponse};

/// Longest pause between two background commit attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The count of deferred work, and a wake-up when it falls.
#[derive(Default, Clone)]
pub(crate) struct Deferred(Arc<Count>);

#[derive(Default)]
struct Count {
    pending: AtomicUsize,
    fell: Notify,
}

/// Held by one piece of deferred work for as long as it runs.
pub(crate) struct Held(Arc<Count>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::AcqRel);
        self.0.fell.notify_waiters();
    }
}

impl Deferred {
    /// Counts one piece of work until the guard drops.
    pub(crate) fn hold(&self) -> Held {
        self.0.pending.fetch_add(1, Ordering::AcqRel);
        Held(self.0.clone())
    }

    /// Work running right now.
    pub(crate) fn pending(&self) -> usize {
        self.0.pending.load(Ordering::Acquire)
    }

    /// Waits until no work is left or `within` has passed; returns how much
    /// is still running.
    pub(crate) async fn finish(&self, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            // Created before the count is read: a guard dropped in between
            // still wakes it.
            let fell = self.0.fell.notified();
            let pending = self.pending();
            if pending == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, fell).await.is_err() {
                return self.pending();
            }
        }
    }
}

/// Retries a commit, backing off, until it lands or `until` (the lease's
/// end, or under `hold` the key's expiry).
pub(crate) async fn retry_commit(
    engine: Arc<Engine>,
    tenant: String,
    id: Uuid,
    stored: StoredResponse,
    until: Instant,
    key_hash: String,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let now = Instant::now();
        if now >= until {
            tracing::warn!(key.hash = %key_hash, "the store did not come back in time; the response was not stored");
            return;
        }
        tokio::time::sleep(backoff.min(until - now)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        match engine.commit(&tenant, id, &stored).await {
            Ok(Ok(Committed::Now(_)) | Ok(Committed::Earlier(_))) => {
                tracing::info!(key.hash = %key_hash, "the deferred commit landed");
                return;
            }
            Ok(Err(refusal)) => {
                tracing::warn!(key.hash = %key_hash, reason = ?refusal, "the deferred commit was refused");
                return;
            }
            Err(StoreError::Unavailable { .. }) => {}
            Err(StoreError::Other { why, .. }) => {
                tracing::error!(key.hash = %key_hash, error = %why, "the deferred commit failed");
                return;
            }
        }
    }
}
