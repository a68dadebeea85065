//! The replay cache: completed records held in this process's memory, so that
//! a retry of a completed key is answered without a database round trip.
//!
//! A completed record cannot change before its `expires_at`: the store's
//! reserve only rewrites a row that has expired or whose lease ended while in
//! flight, the holder's writes (complete, release, extend, checkpoint) only
//! touch in-flight rows, and pruning only deletes expired rows. So a completed
//! record read once — or committed by this process — may be served from
//! memory for the rest of its life, and never a moment longer:
//!
//! * **Expiry.** Each entry carries a deadline on this process's monotonic
//!   clock: `t0 + (expires_at - db_now)`, where `t0` is read *before* the
//!   store call and `db_now` is the database's clock during that call (the
//!   claim's `now`, or a commit's `completed_at`). The database read its clock
//!   after `t0`, so the deadline is never later than the record's true expiry,
//!   whatever the skew between the two clocks; a further margin covers the
//!   stores' clock resolution. Every read checks the deadline itself, and the
//!   cache also evicts the entry then ([`moka::Expiry`]).
//! * **Tenants.** An entry is keyed by (tenant, SHA-256 of the key), as the
//!   store is: one tenant never sees another's record.
//! * **Memory.** The cache is bounded by bytes: an entry weighs its body, its
//!   header names and values, its fingerprint and recovery data, plus a fixed
//!   overhead. An entry heavier than the whole bound is never admitted.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use moka::Expiry;
use moka::sync::Cache;

use crate::store::{KeyState, Record};

/// The default bound of the replay cache: 64 MiB
/// (`IDEMGATE_REPLAY_CACHE_BYTES`).
pub const DEFAULT_REPLAY_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// What an entry costs beyond its variable-length parts: the record's fixed
/// fields, the key, the cache's own bookkeeping.
const ENTRY_OVERHEAD: u64 = 512;

/// Taken off every entry's life, for the resolution of the stores' clocks
/// (SQLite's is whole milliseconds) and any drift between them and ours
/// during a record's life.
const CLOCK_MARGIN: Duration = Duration::from_millis(10);

/// The SHA-256 of the key, then the tenant: (tenant, key) as one byte string,
/// unambiguous since the hash has a fixed length, and looked up as a slice
/// built on the stack, without allocating.
type CacheKey = Box<[u8]>;

/// Tenants up to this long are looked up without allocating.
const STACK_TENANT: usize = 128;

/// `key_hash` then `tenant`, as a [`CacheKey`] is, into `buf` when it fits.
fn lookup_key<'b>(
    buf: &'b mut [u8; 32 + STACK_TENANT],
    tenant: &str,
    key_hash: &[u8; 32],
) -> Option<&'b [u8]> {
    let tenant = tenant.as_bytes();
    let end = 32 + tenant.len();
    let slot = buf.get_mut(..end)?;
    slot[..32].copy_from_slice(key_hash);
    slot[32..].copy_from_slice(tenant);
    Some(slot)
}

fn cache_key(tenant: &str, key_hash: &[u8; 32]) -> CacheKey {
    let mut key = Vec::with_capacity(32 + tenant.len());
    key.extend_from_slice(key_hash);
    key.extend_from_slice(tenant.as_bytes());
    key.into_boxed_slice()
}

/// A cached record and when it must no longer be served.
struct Entry {
    record: Record,
    /// On this process's monotonic clock; never later than `expires_at`.
    deadline: Instant,
    /// Its weight in bytes, computed once.
    weight: u32,
}

/// A bounded, per-tenant cache of completed records (see the
/// engine's documentation).
pub struct ReplayCache {
    cache: Cache<CacheKey, Arc<Entry>>,
    max_bytes: u64,
}

// === impl ReplayCache ===

impl ReplayCache {
    /// A cache holding at most `max_bytes` of records; `None` when
    /// `max_bytes` is 0 (no cache).
    pub fn new(max_bytes: u64) -> Option<ReplayCache> {
        if max_bytes == 0 {
            return None;
        }
        let cache = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_: &CacheKey, entry: &Arc<Entry>| entry.weight)
            .expire_after(UntilDeadline)
            .build();
        Some(ReplayCache { cache, max_bytes })
    }

    /// The bound, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The bytes the cache holds now, once its pending evictions have run.
    pub fn weighted_size(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.weighted_size()
    }

    /// The records the cache holds now, once its pending evictions have run.
    pub fn entry_count(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.entry_count()
    }

    /// The completed record of `key_hash` under `tenant`, if it is cached and
    /// its deadline has not passed.
    pub(crate) fn get(&self, tenant: &str, key_hash: &[u8; 32]) -> Option<Record> {
        let mut buf = [0; 32 + STACK_TENANT];
        let entry = match lookup_key(&mut buf, tenant, key_hash) {
            Some(key) => self.cache.get(key)?,
            None => self.cache.get(&*cache_key(tenant, key_hash))?,
        };
        (Instant::now() < entry.deadline).then(|| entry.record.clone())
    }

    /// Remembers `record` if it is completed and still alive. `started` was
    /// read on this process's clock before the store call that returned it,
    /// and `db_now` is the database's clock during that call.
    pub(crate) fn insert(&self, record: &Record, started: Instant, db_now: DateTime<Utc>) {
        if record.state != KeyState::Completed || record.response.is_none() {
            return;
        }
        let Ok(key_hash) = <[u8; 32]>::try_from(record.key_hash.as_slice()) else {
            return;
        };
        // A non-positive remaining life (or one within the margin): not cached.
        let Some(deadline) = (record.expires_at - db_now)
            .to_std()
            .ok()
            .and_then(|left| left.checked_sub(CLOCK_MARGIN))
            .filter(|left| !left.is_zero())
            .and_then(|left| started.checked_add(left))
        else {
            return;
        };
        if deadline <= Instant::now() {
            return;
        }
        let weight = weigh(record);
        if weight > self.max_bytes {
            return;
        }
        let entry = Entry {
            record: record.clone(),
            deadline,
            weight: u32::try_from(weight).unwrap_or(u32::MAX),
        };
        self.cache
            .insert(cache_key(&record.tenant, &key_hash), Arc::new(entry));
    }
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("max_bytes", &self.max_bytes)
            .field("weighted_size", &self.cache.weighted_size())
            .finish_non_exhaustive()
    }
}

/// The bytes a record takes in the cache, approximately.
fn weigh(record: &Record) -> u64 {
    let len = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    let mut bytes = ENTRY_OVERHEAD
        .saturating_add(len(record.tenant.len()))
        .saturating_add(len(record.key_hash.len()))
        .saturating_add(len(record.fingerprint.as_ref().map_or(0, String::len)));
    if let Some(response) = &record.response {
        bytes = bytes.saturating_add(len(response.body.len()));
        for (name, value) in &response.headers {
            bytes = bytes.saturating_add(len(name.len() + value.len()));
        }
    }
    if let Some(recovery) = &record.recovery {
        bytes = bytes.saturating_add(len(recovery.recovery_point.len()));
        if let Some(data) = &recovery.data {
            let mut counter = ByteCounter(0);
            // Writing to the counter cannot fail; a value that will not
            // serialise weighs what was counted.
            let _ = serde_json::to_writer(&mut counter, data);
            bytes = bytes.saturating_add(counter.0);
        }
    }
    bytes
}

/// A writer that only counts.
struct ByteCounter(u64);

impl io::Write for ByteCounter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 = self
            .0
            .saturating_add(u64::try_from(buf.len()).unwrap_or(u64::MAX));
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Evicts each entry at its deadline.
struct UntilDeadline;

impl Expiry<CacheKey, Arc<Entry>> for UntilDeadline {
    fn expire_after_create(
        &self,
        _key: &CacheKey,
        entry: &Arc<Entry>,
        created_at: Instant,
    ) -> Option<Duration> {
        Some(entry.deadline.saturating_duration_since(created_at))
    }

    fn expire_after_update(
        &self,
        _key: &CacheKey,
        entry: &Arc<Entry>,
        updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(entry.deadline.saturating_duration_since(updated_at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoredResponse;
    use chrono::Duration as Span;
    use uuid::Uuid;

    fn completed(tenant: &str, body: usize, life: Span) -> (Record, DateTime<Utc>) {
        let now = Utc::now();
        let record = Record {
            tenant: tenant.into(),
            key_hash: vec![7; 32],
            fingerprint: Some("fp".into()),
            state: KeyState::Completed,
            reservation_id: Uuid::new_v4(),
            lease_expires_at: None,
            attempt: 1,
            recovery: None,
            response: Some(StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), "text/plain".into())],
                body: vec![b'x'; body].into(),
            }),
            created_at: now,
            completed_at: Some(now),
            expires_at: now + life,
            on_lease_expiry: crate::store::LeaseExpiry::Takeover,
            resolution: None,
            marked_unknown: None,
            request: None,
        };
        (record, now)
    }

    #[test]
    fn zero_bytes_is_no_cache() {
        assert!(ReplayCache::new(0).is_none());
    }

    #[test]
    fn serves_until_the_deadline_only() {
        let cache = ReplayCache::new(1 << 20).unwrap();
        let (record, now) = completed("a", 10, Span::hours(1));
        cache.insert(&record, Instant::now(), now);
        assert_eq!(cache.get("a", &[7; 32]), Some(record.clone()));
        assert_eq!(cache.get("b", &[7; 32]), None, "another tenant");
        assert_eq!(cache.get("a", &[8; 32]), None, "another key");

        // The database says it expires in 5 ms (within the margin): not cached.
        let (short, now) = completed("c", 10, Span::milliseconds(5));
        cache.insert(&short, Instant::now(), now);
        assert_eq!(cache.get("c", &[7; 32]), None);

        // Already dead by the database's clock.
        let (dead, now) = completed("d", 10, Span::seconds(-1));
        cache.insert(&dead, Instant::now(), now);
        assert_eq!(cache.get("d", &[7; 32]), None);

        // The database's clock far ahead of ours changes nothing: only the
        // remaining life counts.
        let (skewed, _) = completed("e", 10, Span::milliseconds(200));
        let db_now = skewed.expires_at - Span::milliseconds(200);
        cache.insert(&skewed, Instant::now(), db_now + Span::days(1));
        assert_eq!(cache.get("e", &[7; 32]), None, "expired by the db clock");
        cache.insert(&skewed, Instant::now(), db_now);
        assert!(cache.get("e", &[7; 32]).is_some());
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(cache.get("e", &[7; 32]), None, "past its deadline");
    }

    #[test]
    fn in_flight_records_are_never_cached() {
        let cache = ReplayCache::new(1 << 20).unwrap();
        let (mut record, now) = completed("a", 10, Span::hours(1));
        record.state = KeyState::InFlight;
        cache.insert(&record, Instant::now(), now);
        assert_eq!(cache.get("a", &[7; 32]), None);
    }

    #[test]
    fn the_bound_holds() {
        let cache = ReplayCache::new(8 * 1024).unwrap();
        let (big, now) = completed("a", 16 * 1024, Span::hours(1));
        cache.insert(&big, Instant::now(), now);
        assert_eq!(cache.get("a", &[7; 32]), None, "heavier than the bound");
        for i in 0..100u8 {
            let (mut r, now) = completed("a", 1000, Span::hours(1));
            r.key_hash = vec![i; 32];
            cache.insert(&r, Instant::now(), now);
        }
        assert!(cache.weighted_size() <= 8 * 1024);
        assert!(cache.entry_count() >= 1);
    }
}
