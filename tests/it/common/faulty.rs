//! A store with faults of its choosing in front of a real one: claims that
//! take their time, and claims that commit but whose answer is lost (the
//! caller is told the store is away), as a connection that breaks after its
//! statement went out would leave them; and claims whose answer comes late,
//! as to a process paused between its claim and its call.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use idemgate::store::{
    Claim, ClaimRequest, Found, HotPath, InFlightUsage, KeyPage, KeyQuery, Maintenance, PoolStats,
    PruneBatch, Queries, Record, Recovery, Resolve, Store, StoreError, StoredResponse, StoredUsage,
};
use uuid::Uuid;

/// `inner` with claims delayed by `claim_delay`, the answers of the next
/// `lose` claims lost after they applied, those of the next `late` claims
/// given `late_by` after they applied, the next `refuse_extends` lease
/// extensions failed as if the store were away, and, while `away`, every
/// claim failed so before it reaches the store.
pub struct Faulty {
    pub inner: Arc<dyn Store>,
    pub claim_delay: Duration,
    pub lose: AtomicUsize,
    pub late: AtomicUsize,
    pub late_by: Duration,
    pub refuse_extends: AtomicUsize,
    pub away: std::sync::atomic::AtomicBool,
}

impl Faulty {
    pub fn new(inner: Arc<dyn Store>) -> Faulty {
        Faulty {
            inner,
            claim_delay: Duration::ZERO,
            lose: AtomicUsize::new(0),
            late: AtomicUsize::new(0),
            late_by: Duration::ZERO,
            refuse_extends: AtomicUsize::new(0),
            away: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

#[async_trait]
impl HotPath for Faulty {
    async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>, StoreError> {
        tokio::time::sleep(self.claim_delay).await;
        if self.away.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable("the store is away"));
        }
        let claim = self.inner.reserve(req).await?;
        let lose = self
            .lose
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lose {
            return Err(StoreError::unavailable(
                "the connection broke before the answer",
            ));
        }
        let late = self
            .late
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if late {
            tokio::time::sleep(self.late_by).await;
        }
        Ok(claim)
    }

    async fn complete(
        &self,
        tenant: &str,
        id: Uuid,
        response: &StoredResponse,
    ) -> Result<Option<Record>, StoreError> {
        self.inner.complete(tenant, id, response).await
    }

    async fn release(&self, tenant: &str, id: Uuid) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.release(tenant, id).await
    }

    async fn extend(
        &self,
        tenant: &str,
        id: Uuid,
        lease_seconds: u32,
        on_lease_expiry: Option<idemgate::store::LeaseExpiry>,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        let refuse = self
            .refuse_extends
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if refuse {
            return Err(StoreError::unavailable("the store is away"));
        }
        self.inner
            .extend(tenant, id, lease_seconds, on_lease_expiry)
            .await
    }

    async fn checkpoint(
        &self,
        tenant: &str,
        id: Uuid,
        recovery: &Recovery,
    ) -> Result<Option<Record>, StoreError> {
        self.inner.checkpoint(tenant, id, recovery).await
    }

    async fn mark_unknown(
        &self,
        tenant: &str,
        id: Uuid,
        reason: &str,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.mark_unknown(tenant, id, reason).await
    }

    async fn find_by_reservation(
        &self,
        tenant: &str,
        id: Uuid,
    ) -> Result<Option<Found>, StoreError> {
        self.inner.find_by_reservation(tenant, id).await
    }
}

#[async_trait]
impl Queries for Faulty {
    async fn find_key(&self, tenant: &str, key_hash: &[u8]) -> Result<Option<Found>, StoreError> {
        self.inner.find_key(tenant, key_hash).await
    }

    async fn list_keys(&self, query: &KeyQuery) -> Result<KeyPage, StoreError> {
        self.inner.list_keys(query).await
    }

    async fn resolve(&self, resolve: &Resolve) -> Result<Option<Found>, StoreError> {
        self.inner.resolve(resolve).await
    }

    async fn count_stuck(&self) -> Result<u64, StoreError> {
        self.inner.count_stuck().await
    }

    async fn in_flight_usage(&self, tenant: &str, up_to: u32) -> Result<InFlightUsage, StoreError> {
        self.inner.in_flight_usage(tenant, up_to).await
    }

    async fn stored_usage(&self, tenant: &str) -> Result<StoredUsage, StoreError> {
        self.inner.stored_usage(tenant).await
    }
}

#[async_trait]
impl Maintenance for Faulty {
    async fn prune_expired_batch(&self, limit: i64) -> Result<PruneBatch, StoreError> {
        self.inner.prune_expired_batch(limit).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        self.inner.pool_stats()
    }

    async fn open_window(&self, name: &str, seconds: u64) -> Result<(), StoreError> {
        self.inner.open_window(name, seconds).await
    }

    async fn open_windows(&self) -> Result<Vec<String>, StoreError> {
        self.inner.open_windows().await
    }
}
