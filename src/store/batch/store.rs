//! [`Store`] for [`Batched`]: claims, commits and releases through the
//! queue (or straight to the store when no writer is busy), everything else
//! straight to the store.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::Batched;
use super::same_key::{Turn, answer_of_first};
use crate::store::{
    BatchStats, Claim, ClaimRequest, Found, HotPath, InFlightUsage, KeyPage, KeyQuery, Maintenance,
    PoolStats, PruneBatch, Queries, Record, Recovery, Resolve, Result, StoreError, StoredResponse,
    StoredUsage, Write, Written,
};

#[async_trait]
impl HotPath for Batched {
    async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        let first = match self.claims.turn(req) {
            Turn::First(first) => first,
            Turn::Second(first) => {
                if let Some(answer) = answer_of_first(first).await {
                    return Ok(Some(answer));
                }
                return self.claim(req).await;
            }
        };
        let answer = self.claim(req).await;
        if let Ok(Some(claim)) = &answer {
            first.publish(claim);
        }
        answer
    }

    async fn complete(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        response: &StoredResponse,
    ) -> Result<Option<Record>> {
        if self.grouped {
            return self.store.complete(tenant, reservation_id, response).await;
        }
        if let Some(_alone) = self.alone() {
            return self.store.complete(tenant, reservation_id, response).await;
        }
        let write = Write::Complete {
            tenant: tenant.to_owned(),
            reservation_id,
            response: response.clone(),
        };
        match self.queued(write).await? {
            Written::Complete(record) => Ok(record),
            _ => Err(mismatched()),
        }
    }

    async fn release(&self, tenant: &str, reservation_id: Uuid) -> Result<Option<Vec<u8>>> {
        if self.grouped {
            return self.store.release(tenant, reservation_id).await;
        }
        if let Some(_alone) = self.alone() {
            return self.store.release(tenant, reservation_id).await;
        }
        let write = Write::Release {
            tenant: tenant.to_owned(),
            reservation_id,
        };
        match self.queued(write).await? {
            Written::Release(key_hash) => Ok(key_hash),
            _ => Err(mismatched()),
        }
    }

    async fn mark_unknown(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        reason: &str,
    ) -> Result<Option<Vec<u8>>> {
        self.store
            .mark_unknown(tenant, reservation_id, reason)
            .await
    }

    async fn extend(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        lease_seconds: u32,
    ) -> Result<Option<DateTime<Utc>>> {
        self.store
            .extend(tenant, reservation_id, lease_seconds)
            .await
    }

    async fn checkpoint(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        recovery: &Recovery,
    ) -> Result<Option<Record>> {
        self.store
            .checkpoint(tenant, reservation_id, recovery)
            .await
    }

    async fn find_by_reservation(
        &self,
        tenant: &str,
        reservation_id: Uuid,
    ) -> Result<Option<Found>> {
        self.store.find_by_reservation(tenant, reservation_id).await
    }

    async fn write_batch(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        self.store.write_batch(writes).await
    }

    fn batch_writers(&self) -> usize {
        self.store.batch_writers()
    }

    fn batch_stats(&self) -> Option<BatchStats> {
        match self.store.own_batches() {
            Some(own) => Some(own),
            None => Some(self.stats.stats()),
        }
    }
}

#[async_trait]
impl Queries for Batched {
    async fn find_key(&self, tenant: &str, key_hash: &[u8]) -> Result<Option<Found>> {
        self.store.find_key(tenant, key_hash).await
    }

    async fn list_keys(&self, query: &KeyQuery) -> Result<KeyPage> {
        self.store.list_keys(query).await
    }

    async fn key_hashes_between(
        &self,
        tenant: &str,
        low: &[u8],
        high: &[u8],
        limit: i64,
    ) -> Result<Vec<Vec<u8>>> {
        self.store
            .key_hashes_between(tenant, low, high, limit)
            .await
    }

    async fn resolve(&self, resolve: &Resolve) -> Result<Option<Found>> {
        self.store.resolve(resolve).await
    }

    async fn count_stuck(&self) -> Result<u64> {
        self.store.count_stuck().await
    }

    async fn in_flight_usage(&self, tenant: &str, up_to: u32) -> Result<InFlightUsage> {
        self.store.in_flight_usage(tenant, up_to).await
    }

    async fn stored_usage(&self, tenant: &str) -> Result<StoredUsage> {
        self.store.stored_usage(tenant).await
    }
}

#[async_trait]
impl Maintenance for Batched {
    async fn prune_expired_batch(&self, limit: i64) -> Result<PruneBatch> {
        self.store.prune_expired_batch(limit).await
    }

    async fn ping(&self) -> Result<()> {
        self.store.ping().await
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        self.store.pool_stats()
    }

    fn durability(&self) -> crate::store::Durability {
        self.store.durability()
    }
}

impl Batched {
    /// A claim written: alone when nothing else is, else through the queue.
    async fn claim(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        if self.grouped {
            return self.store.reserve(req).await;
        }
        if let Some(_alone) = self.alone() {
            return self.store.reserve(req).await;
        }
        match self.queued(Write::Claim(req.clone())).await? {
            Written::Claim(claim) => Ok(claim),
            _ => Err(mismatched()),
        }
    }
}

fn mismatched() -> StoreError {
    StoreError::other("a batched write got another kind of answer")
}
