//! The TTL job: deletes expired records in small batches, so it
//! never holds many locks at once and never waits on live traffic.

use std::sync::Arc;
use std::time::Duration;

use crate::store::{Maintenance, Store, StoreError};
use crate::telemetry;

/// Rows deleted per statement: small enough that a batch's locks are brief.
pub const BATCH: i64 = 1000;

/// The longest rest between two batches.
const MAX_PAUSE: Duration = Duration::from_millis(500);

/// Deletes every record expired now, batch after batch; returns how many.
/// Safe to run in several processes at once: each batch skips the rows
/// another one holds. When part of the database could not be reached (a
/// Citus worker that is down), the rest is pruned all the same and the pass
/// then fails, saying what it deleted and what it could not reach.
pub async fn prune_once(store: &dyn Maintenance) -> Result<u64, StoreError> {
    let mut total = 0;
    let mut unreachable = None;
    loop {
        let started = tokio::time::Instant::now();
        let batch = store.prune_expired_batch(BATCH).await?;
        total += batch.deleted;
        telemetry::record_pruned(batch.deleted);
        unreachable = batch.unreachable.or(unreachable);
        if !batch.more {
            return match unreachable {
                None => Ok(total),
                Some(why) => Err(StoreError::unavailable(format!(
                    "pruned {total} expired keys, but not everywhere: {why}"
                ))),
            };
        }
        // Rest as long as the batch took: pruning then holds at most half of
        // the database's time while live traffic runs. Without the pause a
        // backlog of a million rows doubled the live p99 (BENCHMARKS.md).
        tokio::time::sleep(started.elapsed().min(MAX_PAUSE)).await;
    }
}

/// Runs [`prune_once`] every `interval` until the task is dropped, and
/// after each pass counts the keys nobody will settle by themselves (unknown,
/// or in flight past their lease) into the gauge `idemgate_keys_unknown`.
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
        match store.count_stuck().await {
            Ok(n) => {
                telemetry::record_unknown(n);
                if n > 0 {
                    tracing::warn!(
                        stuck = n,
                        "keys nobody will settle by themselves (unknown, or in flight past their \
                         lease) wait for an operator: idemgate keys list --state unknown, and \
                         --state in_flight for leases that ended"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not count the unknown keys"),
        }
    }
}
