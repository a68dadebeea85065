//! Batched writes on PostgreSQL: the claims, commits and releases queued
//! together, in one call of `idemgate_write_batch` (one transaction, one
//! round trip).
//!
//! Two batches never wait on each other in a cycle, in one process or
//! across many: the function first takes an advisory lock for every key the
//! batch will write, all in one order (a hash of the tenant, then the key
//! hash), and writes in queue order only then (migration
//! `20261205000001_batch_lock_order`). A retry storm, where every key comes
//! twice at about the same moment, is then the cheap case it should be: a
//! batch waits for another's key, never for `deadlock_timeout`.

use sqlx::FromRow;

use super::PgStore;
use super::errors::classify;
use super::rows::{BatchRow, headers_json};
use super::sql::WRITE_BATCH;
use crate::store::{Claim, KeptRequest, Record, Result, Write, Written};

/// Transactions of batched writes at once, per process: two, so that one
/// waiting on a row lock (a claim of a key another process's transaction
/// holds) or on a slow statement does not hold up every other write; the
/// other gathers what queued meanwhile. More let writes go side by side but
/// cost CPU per key (more transactions, each with its commit): 4 and 8 were
/// 6 % to 18 % slower on two cores (BENCHMARKS.md, "Latency against
/// concurrency").
pub(super) const BATCH_WRITERS: usize = 2;

impl PgStore {
    /// `writes` in one call of `idemgate_write_batch`: one transaction.
    pub(super) async fn write_batch_call(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        let n = writes.len();
        let mut ops = Vec::with_capacity(n);
        let mut tenants = Vec::with_capacity(n);
        let mut key_hashes: Vec<Option<&[u8]>> = Vec::with_capacity(n);
        let mut fingerprints: Vec<Option<&str>> = Vec::with_capacity(n);
        let mut ids = Vec::with_capacity(n);
        let mut leases: Vec<Option<f64>> = Vec::with_capacity(n);
        let mut ttls: Vec<Option<f64>> = Vec::with_capacity(n);
        let mut limits: Vec<Option<i64>> = Vec::with_capacity(n);
        let mut statuses: Vec<Option<i32>> = Vec::with_capacity(n);
        let mut headers: Vec<Option<serde_json::Value>> = Vec::with_capacity(n);
        let mut bodies: Vec<Option<&[u8]>> = Vec::with_capacity(n);
        let mut on_lease_expiry: Vec<Option<&str>> = Vec::with_capacity(n);
        let mut requests: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
        for write in writes {
            let (op, id) = match write {
                Write::Claim(req) => ("claim", req.reservation_id),
                Write::Complete { reservation_id, .. } => ("complete", *reservation_id),
                Write::Release { reservation_id, .. } => ("release", *reservation_id),
            };
            ops.push(op);
            tenants.push(write.tenant());
            ids.push(id);
            let claim = match write {
                Write::Claim(req) => Some(req),
                _ => None,
            };
            on_lease_expiry.push(claim.map(|r| r.on_lease_expiry.as_str()));
            key_hashes.push(claim.map(|r| &r.key_hash[..]));
            requests.push(claim.and_then(|r| r.request.as_ref().map(KeptRequest::to_column)));
            fingerprints.push(claim.and_then(|r| r.fingerprint.as_deref()));
            leases.push(claim.map(|r| f64::from(r.lease_seconds)));
            ttls.push(claim.map(|r| f64::from(r.ttl_seconds)));
            limits.push(claim.and_then(|r| r.max_in_flight.map(i64::from)));
            let response = match write {
                Write::Complete { response, .. } => Some(response),
                _ => None,
            };
            statuses.push(response.map(|r| i32::from(r.status)));
            headers.push(response.map(|r| headers_json(&r.headers)));
            bodies.push(response.map(|r| &r.body[..]));
        }
        let query = sqlx::query_as(WRITE_BATCH)
            .bind(tenants.first().copied().unwrap_or_default())
            .bind(&ops)
            .bind(&tenants)
            .bind(&key_hashes)
            .bind(&fingerprints)
            .bind(&ids)
            .bind(&leases)
            .bind(&ttls)
            .bind(&limits)
            .bind(&statuses)
            .bind(&headers)
            .bind(&bodies)
            .bind(&on_lease_expiry)
            .bind(&requests);
        let rows: Vec<BatchRow> = match self.fetch_all(query).await {
            Ok(rows) => rows,
            Err(e) => return writes.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut answers: Vec<Result<Written>> = writes
            .iter()
            .map(|w| {
                Ok(match w {
                    Write::Claim(_) => Written::Claim(None),
                    Write::Complete { .. } => Written::Complete(None),
                    Write::Release { .. } => Written::Release(None),
                })
            })
            .collect();
        for row in rows {
            let Some(i) = usize::try_from(row.ord)
                .ok()
                .and_then(|ord| ord.checked_sub(1))
                .filter(|&i| i < n)
            else {
                continue;
            };
            let now = row.db_now;
            let claimed = row.claimed;
            answers[i] = Record::try_from(row.row).map(|record| match &writes[i] {
                Write::Claim(_) => Written::Claim(Some(Claim {
                    claimed,
                    record,
                    now,
                })),
                Write::Complete { response, .. } => Written::Complete(Some(Record {
                    response: Some(response.clone()),
                    ..record
                })),
                Write::Release { .. } => Written::Release(Some(record.key_hash)),
            });
        }
        answers
    }

    /// Runs a query on one of the store's connections; every row.
    pub(super) async fn fetch_all<'q, O>(
        &self,
        query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<O>>
    where
        O: Send + Unpin + for<'r> FromRow<'r, sqlx::postgres::PgRow>,
    {
        let query = query.persistent(self.conns.persistent());
        let mut conn = self.conns.acquire().await?;
        let result = self
            .conns
            .answered(conn.scoped(async |c| query.fetch_all(c).await))
            .await?;
        conn.done(&result);
        result.map_err(|e| classify(e, &self.conns.target))
    }
}
