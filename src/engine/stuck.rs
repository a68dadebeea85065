//! Keys nobody will settle by themselves — unknown, or in flight past their
//! lease — as an operator sees and settles them: find one, list them, and
//! resolve one by releasing it (nothing happened) or completing it with the
//! response that really happened.

use chrono::{DateTime, Utc};

use super::{Engine, EngineError};
use crate::store::{
    Found, KeyPage, KeyQuery, KeyState, Record, Resolve, ResolveAction, StoredResponse,
};

/// What an operator asks of a stuck key.
#[derive(Debug, Clone)]
pub struct Settlement {
    /// Release or complete.
    pub action: ResolveAction,
    /// For [`ResolveAction::Complete`]: the response every retry replays.
    pub response: Option<StoredResponse>,
    /// Why (kept with the record and logged).
    pub reason: String,
    /// Who (kept with the record and logged).
    pub by: String,
}

/// What a resolve came to.
#[derive(Debug, Clone)]
pub enum Resolved {
    /// Settled: the record as it now is.
    Settled(Found),
    /// The key has no record, or it has expired (it is new again).
    NotFound,
    /// The key is not stuck (completed, or in flight under a live lease):
    /// the record as it is.
    NotStuck(Found),
}

// === impl Engine ===

impl Engine {
    /// Up to `limit` key hashes of `tenant` from `low` to `high`, in order
    /// ([`Queries::key_hashes_between`](crate::store::Queries::key_hashes_between)).
    pub async fn key_hashes_between(
        &self,
        tenant: &str,
        low: &[u8],
        high: &[u8],
        limit: i64,
    ) -> Result<Vec<Vec<u8>>, EngineError> {
        self.store
            .key_hashes_between(tenant, low, high, limit)
            .await
    }

    /// A key's record, opened (unsealed); `None` when it has none or it has
    /// expired (the key is new again, whether or not pruning has deleted
    /// the row).
    pub async fn find_key(
        &self,
        tenant: &str,
        key_hash: &[u8],
    ) -> Result<Option<Found>, EngineError> {
        let Some(mut found) = self.store.find_key(tenant, key_hash).await? else {
            return Ok(None);
        };
        if found.now >= found.record.expires_at {
            return Ok(None);
        }
        crate::seal::open_record(self.sealer.as_deref(), &mut found.record)?;
        Ok(Some(found))
    }

    /// A page of alive records, oldest first, opened.
    pub async fn list_keys(&self, query: &KeyQuery) -> Result<KeyPage, EngineError> {
        let mut page = self.store.list_keys(query).await?;
        for record in &mut page.records {
            crate::seal::open_record(self.sealer.as_deref(), record)?;
        }
        Ok(page)
    }

    /// Settles the stuck key `(tenant, key_hash)` as `settlement` says, and
    /// logs it at WARN: released, the next request with it executes;
    /// completed, every retry replays the response. Only a key that is
    /// unknown or in flight past its lease can be settled, and only as it
    /// was when looked at (a holder that commits meanwhile wins).
    pub async fn resolve(
        &self,
        tenant: &str,
        key_hash: &[u8],
        settlement: &Settlement,
    ) -> Result<Resolved, EngineError> {
        let Some(found) = self.find_key(tenant, key_hash).await? else {
            return self.not_stuck_or_not_found(tenant, key_hash).await;
        };
        if !found.record.is_stuck(found.now) {
            return Ok(Resolved::NotStuck(found));
        }
        let id = found.record.reservation_id;
        let response = match (&self.sealer, &settlement.response) {
            (Some(sealer), Some(response)) => Some(sealer.seal(tenant, id, response)),
            (None, response) => response.clone(),
            (Some(_), None) => None,
        };
        let applied = self
            .store
            .resolve(&Resolve {
                tenant: tenant.to_owned(),
                key_hash: key_hash.to_vec(),
                reservation_id: id,
                action: settlement.action,
                response,
                reason: settlement.reason.clone(),
                by: settlement.by.clone(),
            })
            .await?;
        let Some(mut settled) = applied else {
            // Changed since it was read: its holder settled it, or another
            // operator did.
            return match self.find_key(tenant, key_hash).await? {
                Some(found) => Ok(Resolved::NotStuck(found)),
                None => self.not_stuck_or_not_found(tenant, key_hash).await,
            };
        };
        let before = found.record.effective_state(found.now);
        crate::seal::open_record(self.sealer.as_deref(), &mut settled.record)?;
        if let Some(completed_at) = settled.record.completed_at {
            self.remember(&settled.record, std::time::Instant::now(), completed_at);
        }
        self.waiters.wake(tenant, key_hash);
        self.durations.forget(id);
        tracing::warn!(
            tenant.id = %&tenant[..tenant.len().min(12)],
            key.hash = %crate::key::hash_prefix(key_hash),
            was = before.as_str(),
            action = settlement.action.as_str(),
            status = settlement.response.as_ref().map(|r| r.status),
            by = %settlement.by,
            reason = %settlement.reason,
            "a stuck key was resolved by an operator"
        );
        Ok(Resolved::Settled(settled))
    }
}

impl Engine {
    /// How many keys wait for a person: unknown, or in flight past their
    /// lease ([`Queries::count_stuck`](crate::store::Queries::count_stuck)).
    pub async fn count_stuck(&self) -> Result<u64, EngineError> {
        self.store.count_stuck().await
    }

    /// The answer to settling a key [`find_key`](Engine::find_key) does not
    /// find: one an operator released (its row kept, with who released it,
    /// until pruning or the next claim) is not stuck — settled already —
    /// rather than unknown to the store, so that settling twice says by
    /// whom; any other (never reserved, expired at its TTL, pruned) is not
    /// found.
    async fn not_stuck_or_not_found(
        &self,
        tenant: &str,
        key_hash: &[u8],
    ) -> Result<Resolved, EngineError> {
        match self.store.find_key(tenant, key_hash).await? {
            Some(found)
                if found
                    .record
                    .resolution
                    .as_ref()
                    .is_some_and(|r| r.action == crate::store::ResolveAction::Release) =>
            {
                Ok(Resolved::NotStuck(found))
            }
            _ => Ok(Resolved::NotFound),
        }
    }
}

/// The state an operator's view shows for `record` at `now`: its effective
/// state, or `None` for a record an operator released (it is forgotten:
/// the next request executes).
pub fn shown_state(record: &Record, now: DateTime<Utc>) -> Option<KeyState> {
    if now >= record.expires_at {
        return None;
    }
    Some(record.effective_state(now))
}
