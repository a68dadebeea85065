//! The TTL job (SPEC §8): deletes expired records in small batches, so it
//! never holds many locks at once and never waits on live traffic.

use std::sync::Arc;
use std::time::Duration;

use crate::store::{Store, StoreError};
use crate::telemetry;

/// Rows deleted per statement: small enough that a batch's locks are brief.
pub const BATCH: i64 = 1000;

/// The longest rest between two batches.
const MAX_PAUSE: Duration = Duration::from_millis(500);

/// Deletes every record expired now, batch after batch; returns how many.
/// Safe to run in several processes at once: each batch skips the rows
/// another one holds.
pub async fn prune_once(store: &dyn Store) -> Result<u64, StoreError> {
    let mut total = 0;
    loop {
        let started = tokio::time::Instant::now();
        let n = store.prune_expired_batch(BATCH).await?;
        total += n;
        telemetry::record_pruned(n);
        if n < u64::try_from(BATCH).unwrap_or(u64::MAX) {
            return Ok(total);
        }
        // Rest as long as the batch took: pruning then holds at most half of
        // the database's time while live traffic runs. Without the pause a
        // backlog of a million rows doubled the live p99 (BENCHMARKS.md).
        tokio::time::sleep(started.elapsed().min(MAX_PAUSE)).await;
    }
}

/// Runs [`prune_once`] every `interval` until the task is dropped.
pub async fn run(store: Arc<dyn Store>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match prune_once(store.as_ref()).await {
            Ok(0) => tracing::debug!("prune: nothing expired"),
            Ok(n) => tracing::info!(pruned = n, "prune: deleted expired keys"),
            Err(e) => tracing::warn!(error = %e, "prune pass failed; retrying next interval"),
        }
    }
}
