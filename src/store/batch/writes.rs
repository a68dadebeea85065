//! The three writes [`Batcher`] takes from the engine — claims, commits and
//! releases — each through the queue, or straight to the store when no
//! writer is busy or the store groups its own writes.

use uuid::Uuid;

use super::Batcher;
use super::same_key::{Turn, answer_of_first};
use crate::store::{
    Claim, ClaimRequest, Record, Result, StoreError, StoredResponse, Write, Written,
};

impl Batcher {
    /// Claims the key or returns its record as it stands, as
    /// [`HotPath::reserve`](crate::store::HotPath::reserve) does. A claim of
    /// a key whose claim this process is writing waits for that one's
    /// answer and, where it may stand for its own, takes it (see
    /// `same_key.rs`).
    pub async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        let first = match self.claims.turn(req) {
            Turn::First(first) => Some(first),
            Turn::Second(first) => match answer_of_first(first).await {
                Some(answer) => return Ok(Some(answer)),
                None => None,
            },
        };
        let answer = if self.grouped {
            self.store.reserve(req).await
        } else if let Some(_alone) = self.alone() {
            self.store.reserve(req).await
        } else {
            match self.queued(Write::Claim(req.clone())).await? {
                Written::Claim(claim) => Ok(claim),
                _ => Err(mismatched()),
            }
        };
        if let (Some(first), Ok(Some(claim))) = (&first, &answer) {
            first.publish(claim);
        }
        answer
    }

    /// Stores the response and completes the key, as
    /// [`HotPath::complete`](crate::store::HotPath::complete) does.
    pub async fn complete(
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

    /// Forgets an in-flight key, as
    /// [`HotPath::release`](crate::store::HotPath::release) does.
    pub async fn release(&self, tenant: &str, reservation_id: Uuid) -> Result<Option<Vec<u8>>> {
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
}

fn mismatched() -> StoreError {
    StoreError::other("a batched write got another kind of answer")
}
