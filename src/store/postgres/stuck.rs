//! The count of stuck keys (alive, and unknown or in flight past their
//! lease) behind the `idemgate_keys_unknown` gauge, kept by each process
//! rather than read from every alive key on each pruning pass.
//!
//! No index reads a record's state, so that a commit is heap-only
//! (migration `20261210000001_heap_only_commit.sql`, its indexes built in
//! `20261210000003`); the stuck keys are
//! found instead through what a commit does not change. A key becomes
//! stuck when its lease ends, or when its holder marks it unknown. So each
//! count reads the keys whose lease ended since the last count stopped
//! (`idempotency_keys_lease_end`) and the keys marked unknown
//! (`idempotency_keys_marked_unknown`, few), adds the stuck ones to the keys
//! it already holds, and reads those again by primary key to drop the ones
//! settled, taken over, extended or pruned since. A process's first count
//! reads every alive key, once.
//!
//! The window starts [`OVERLAP`] before where the last count stopped: a
//! claim's lease end is the clock of its transaction's start, and the row
//! is seen only once the transaction commits, which a statement timeout
//! bounds. A lease end read twice is one key in the set.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::PgStore;
use super::sql::{STUCK_ALL, STUCK_SINCE, STUCK_STILL};
use crate::store::{Result, StoreError};

/// How far before the last count's end the next one starts reading: more
/// than any claim's transaction lasts (a statement timeout is 5 s by
/// default).
const OVERLAP: Duration = Duration::from_secs(60);

/// Keys read again by primary key in one statement.
const RECHECK_CHUNK: usize = 1000;

/// What the last count found, and where it stopped.
#[derive(Debug, Default)]
pub(super) struct Tally {
    /// The database's clock when the last count began; none before the
    /// first.
    until: Option<DateTime<Utc>>,
    /// The stuck keys by tenant.
    keys: HashMap<String, HashSet<Vec<u8>>>,
}

impl PgStore {
    /// The stuck keys now.
    pub(super) async fn count_stuck_kept(&self) -> Result<u64> {
        let mut tally = self.stuck.lock().await;
        let now = self.db_now().await?;
        // The keys counted before, read again: those still stuck stay.
        let mut keys: HashMap<String, HashSet<Vec<u8>>> = HashMap::new();
        for (tenant, known) in &tally.keys {
            let known: Vec<&Vec<u8>> = known.iter().collect();
            for chunk in known.chunks(RECHECK_CHUNK) {
                let rows: Vec<(Vec<u8>,)> = self
                    .fetch_all(
                        sqlx::query_as(STUCK_STILL)
                            .bind(tenant.as_str())
                            .bind(chunk.to_vec()),
                    )
                    .await?;
                if !rows.is_empty() {
                    keys.entry(tenant.clone())
                        .or_default()
                        .extend(rows.into_iter().map(|(h,)| h));
                }
            }
        }
        // The keys that became stuck since.
        let found: Vec<(String, Vec<u8>)> = match tally.until {
            None => self.fetch_all(sqlx::query_as(STUCK_ALL)).await?,
            Some(until) => {
                let from = until - chrono::Duration::from_std(OVERLAP).unwrap_or_default();
                self.fetch_all(sqlx::query_as(STUCK_SINCE).bind(from).bind(now))
                    .await?
            }
        };
        for (tenant, key_hash) in found {
            keys.entry(tenant).or_default().insert(key_hash);
        }
        *tally = Tally {
            until: Some(now),
            keys,
        };
        Ok(tally.keys.values().map(|k| k.len() as u64).sum())
    }

    async fn db_now(&self) -> Result<DateTime<Utc>> {
        let now: Option<DateTime<Utc>> = self
            .fetch_scalar(sqlx::query_scalar("SELECT now()"))
            .await?;
        now.ok_or_else(|| StoreError::other("SELECT now() returned no row"))
    }
}
