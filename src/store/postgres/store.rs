//! [`Store`] over PostgreSQL: each operation one statement on one of the
//! store's connections.

use std::sync::atomic::Ordering;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::PgStore;
use super::citus::{self, Layout};
use super::errors::no_tables;
use super::rows::{ClaimRow, FoundRow, KeyRow, headers_json};
use super::sql::*;
use super::write_batch::BATCH_WRITERS;
use crate::store::{
    Claim, ClaimRequest, Found, HotPath, InFlightUsage, KeptRequest, KeyPage, KeyQuery,
    LeaseExpiry, Maintenance, PoolStats, PruneBatch, Queries, Record, Recovery, Resolve,
    ResolveAction, Result, StoreError, StoredResponse, StoredUsage, Write, Written,
};

#[async_trait]
impl HotPath for PgStore {
    async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        // The function's read has a snapshot of its own, taken after the
        // claim, so it sees what a concurrent claim committed; a record gone
        // between the two (pruned at that instant) is tried again. Under a
        // limit, nothing twice running means the limit held the claim back
        // from a key with no record.
        for round in 0..5 {
            let query = sqlx::query_as(RESERVE)
                .bind(&req.tenant)
                .bind(&req.key_hash[..])
                .bind(&req.fingerprint)
                .bind(req.reservation_id)
                .bind(f64::from(req.lease_seconds))
                .bind(f64::from(req.ttl_seconds))
                .bind(req.max_in_flight.map(i64::from))
                .bind(req.on_lease_expiry.as_str())
                .bind(req.request.as_ref().map(KeptRequest::to_column));
            let row: Option<ClaimRow> = self.fetch_row(query).await?;
            match row {
                Some(row) => {
                    return Ok(Some(Claim {
                        claimed: row.claimed,
                        now: row.db_now,
                        record: row.row.try_into()?,
                    }));
                }
                None if req.max_in_flight.is_some() && round > 0 => return Ok(None),
                None => {}
            }
        }
        Err(StoreError::unavailable(
            "the record kept changing under the claim; try again",
        ))
    }

    async fn complete(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        response: &StoredResponse,
    ) -> Result<Option<Record>> {
        let row: Option<KeyRow> = self
            .fetch_row(
                sqlx::query_as(COMPLETE)
                    .bind(tenant)
                    .bind(reservation_id)
                    .bind(i32::from(response.status))
                    .bind(headers_json(&response.headers))
                    .bind(&response.body[..]),
            )
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        Ok(Some(Record {
            response: Some(response.clone()),
            ..Record::try_from(row)?
        }))
    }

    async fn release(&self, tenant: &str, reservation_id: Uuid) -> Result<Option<Vec<u8>>> {
        // Expiring the record at once makes the key new again and
        // kills the id; the pruning job deletes the row later.
        self.fetch_scalar(
            sqlx::query_scalar(RELEASE)
                .bind(tenant)
                .bind(reservation_id),
        )
        .await
    }

    async fn mark_unknown(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        reason: &str,
    ) -> Result<Option<Vec<u8>>> {
        self.fetch_scalar(
            sqlx::query_scalar(MARK_UNKNOWN)
                .bind(tenant)
                .bind(reservation_id)
                .bind(reason),
        )
        .await
    }

    async fn extend(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        lease_seconds: u32,
        on_lease_expiry: Option<LeaseExpiry>,
    ) -> Result<Option<DateTime<Utc>>> {
        self.fetch_scalar(
            sqlx::query_scalar(EXTEND)
                .bind(tenant)
                .bind(reservation_id)
                .bind(f64::from(lease_seconds))
                .bind(on_lease_expiry.map(LeaseExpiry::as_str)),
        )
        .await
    }

    async fn checkpoint(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        recovery: &Recovery,
    ) -> Result<Option<Record>> {
        let row: Option<KeyRow> = self
            .fetch_row(
                sqlx::query_as(CHECKPOINT)
                    .bind(tenant)
                    .bind(reservation_id)
                    .bind(&recovery.recovery_point)
                    .bind(&recovery.data),
            )
            .await?;
        row.map(Record::try_from).transpose()
    }

    async fn find_by_reservation(
        &self,
        tenant: &str,
        reservation_id: Uuid,
    ) -> Result<Option<Found>> {
        let row: Option<FoundRow> = self
            .fetch_row(sqlx::query_as(FIND).bind(tenant).bind(reservation_id))
            .await?;
        row.map(Found::try_from).transpose()
    }

    async fn write_batch(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        let layout = match self.layout().await {
            Ok(layout) => layout,
            Err(e) => return writes.iter().map(|_| Err(e.clone())).collect(),
        };
        match layout {
            Layout::Single => self.write_batch_call(writes).await,
            // The function runs on the node that holds its tenant's shard: a
            // call per tenant, each its own transaction there.
            Layout::Citus { .. } => {
                let mut by_tenant: Vec<(&str, Vec<usize>)> = Vec::new();
                for (i, write) in writes.iter().enumerate() {
                    match by_tenant.iter_mut().find(|(t, _)| *t == write.tenant()) {
                        Some((_, items)) => items.push(i),
                        None => by_tenant.push((write.tenant(), vec![i])),
                    }
                }
                let mut answers: Vec<Option<Result<Written>>> =
                    (0..writes.len()).map(|_| None).collect();
                for (_, items) in by_tenant {
                    let group: Vec<&Write> = items.iter().map(|&i| writes[i]).collect();
                    for (&i, answer) in items.iter().zip(self.write_batch_call(&group).await) {
                        answers[i] = Some(answer);
                    }
                }
                answers
                    .into_iter()
                    .map(|a| a.unwrap_or_else(|| Err(StoreError::other("no answer"))))
                    .collect()
            }
        }
    }

    fn batch_writers(&self) -> usize {
        BATCH_WRITERS
    }
}

#[async_trait]
impl Queries for PgStore {
    async fn find_key(&self, tenant: &str, key_hash: &[u8]) -> Result<Option<Found>> {
        let row: Option<FoundRow> = self
            .fetch_row(sqlx::query_as(FIND_KEY).bind(tenant).bind(key_hash))
            .await?;
        row.map(Found::try_from).transpose()
    }

    async fn key_hashes_between(
        &self,
        tenant: &str,
        low: &[u8],
        high: &[u8],
        limit: i64,
    ) -> Result<Vec<Vec<u8>>> {
        let rows: Vec<(Vec<u8>,)> = self
            .fetch_all(
                sqlx::query_as(
                    "SELECT key_hash FROM idempotency_keys WHERE tenant = $1
                        AND key_hash BETWEEN $2 AND $3 AND expires_at > now()
                        ORDER BY key_hash LIMIT $4",
                )
                .bind(tenant)
                .bind(low)
                .bind(high)
                .bind(limit),
            )
            .await?;
        Ok(rows.into_iter().map(|(h,)| h).collect())
    }

    async fn list_keys(&self, query: &KeyQuery) -> Result<KeyPage> {
        let after = query.after.as_ref();
        let rows: Vec<FoundRow> = self
            .fetch_all(
                sqlx::query_as(LIST_KEYS)
                    .bind(query.state_text())
                    .bind(query.tenant.as_deref())
                    .bind(query.older_than.map(|d| d.as_secs_f64()))
                    .bind(i64::from(query.limit.max(1)))
                    .bind(after.map(|c| c.created_at))
                    .bind(after.map(|c| c.tenant.as_str()))
                    .bind(after.map(|c| c.key_hash.as_slice())),
            )
            .await?;
        let now = match rows.first() {
            Some(row) => row.db_now,
            None => self
                .fetch_scalar(sqlx::query_scalar("SELECT now()"))
                .await?
                .ok_or_else(|| StoreError::other("now() returned no row"))?,
        };
        let records = rows
            .into_iter()
            .map(|row| Record::try_from(row.row))
            .collect::<Result<_>>()?;
        Ok(KeyPage { records, now })
    }

    async fn resolve(&self, resolve: &Resolve) -> Result<Option<Found>> {
        let query = match resolve.action {
            ResolveAction::Release => sqlx::query_as(RESOLVE_RELEASE),
            ResolveAction::Complete => sqlx::query_as(RESOLVE_COMPLETE),
        }
        .bind(&resolve.tenant)
        .bind(&resolve.key_hash)
        .bind(resolve.reservation_id)
        .bind(&resolve.reason)
        .bind(&resolve.by);
        let query = match (resolve.action, &resolve.response) {
            (ResolveAction::Complete, Some(response)) => query
                .bind(i32::from(response.status))
                .bind(headers_json(&response.headers))
                .bind(&response.body[..]),
            (ResolveAction::Complete, None) => {
                return Err(StoreError::other("a completion without a response"));
            }
            (ResolveAction::Release, _) => query,
        };
        let row: Option<KeyRow> = self.fetch_row(query).await?;
        let Some(record) = row.map(Record::try_from).transpose()? else {
            return Ok(None);
        };
        let now = record
            .resolution
            .as_ref()
            .map(|r| r.at)
            .ok_or_else(|| StoreError::other("a resolution without its time"))?;
        Ok(Some(Found { record, now }))
    }

    async fn count_stuck(&self) -> Result<u64> {
        self.count_stuck_kept().await
    }

    async fn in_flight_usage(&self, tenant: &str, up_to: u32) -> Result<InFlightUsage> {
        // The count stops at `up_to`.
        let row: Option<(i64, Option<DateTime<Utc>>, DateTime<Utc>)> = self
            .fetch_row(
                sqlx::query_as(IN_FLIGHT_USAGE)
                    .bind(tenant)
                    .bind(i64::from(up_to)),
            )
            .await?;
        let (keys, next_lease_end, now) =
            row.ok_or_else(|| StoreError::other("count returned no row"))?;
        Ok(InFlightUsage {
            keys: u64::try_from(keys).unwrap_or(0),
            next_lease_end,
            now,
        })
    }

    async fn stored_usage(&self, tenant: &str) -> Result<StoredUsage> {
        let row: Option<(i64, Option<DateTime<Utc>>, DateTime<Utc>)> = self
            .fetch_row(sqlx::query_as(STORED_USAGE).bind(tenant))
            .await?;
        let (bytes, next_expiry, now) =
            row.ok_or_else(|| StoreError::other("sum returned no row"))?;
        Ok(StoredUsage {
            bytes: u64::try_from(bytes).unwrap_or(0),
            next_expiry,
            now,
        })
    }
}

#[async_trait]
impl Maintenance for PgStore {
    async fn open_window(&self, name: &str, seconds: u64) -> Result<()> {
        self.fetch_scalar::<bool>(
            sqlx::query_scalar(
                "INSERT INTO idemgate_windows (name, until)
                 VALUES ($1, now() + make_interval(secs => $2))
                 ON CONFLICT (name) DO UPDATE
                    SET until = greatest(idemgate_windows.until, EXCLUDED.until)
                 RETURNING true",
            )
            .bind(name)
            .bind(seconds as f64),
        )
        .await?;
        Ok(())
    }

    async fn open_windows(&self) -> Result<Vec<String>> {
        let open: Option<Vec<String>> = self
            .fetch_scalar(sqlx::query_scalar(
                "SELECT coalesce(array_agg(name ORDER BY name), '{}') FROM idemgate_windows
                  WHERE until > now()",
            ))
            .await?;
        Ok(open.unwrap_or_default())
    }

    async fn prune_expired_batch(&self, limit: i64) -> Result<PruneBatch> {
        if limit <= 0 {
            return Ok(PruneBatch::default());
        }
        // SKIP LOCKED: rows a reservation (or another pruner) holds are left
        // for the next pass, so pruning never waits on live traffic and two
        // pruners never delete the same row. On Citus, the same statement
        // runs shard by shard.
        match self.layout().await? {
            Layout::Single => {
                let deleted: Option<i64> = self
                    .fetch_scalar(sqlx::query_scalar(PRUNE.as_str()).bind(limit))
                    .await?;
                let deleted = deleted.and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
                Ok(PruneBatch::of(deleted, limit))
            }
            Layout::Citus { .. } => {
                let per_shard = citus::per_shard(limit);
                let sql = citus::prune_shards_sql(per_shard);
                let row: Option<citus::ShardsPruned> = self
                    .fetch_row(sqlx::query_as(sqlx::AssertSqlSafe(sql)))
                    .await?;
                let row = row.ok_or_else(|| StoreError::other("pruning returned no row"))?;
                Ok(row.batch(per_shard))
            }
        }
    }

    async fn ping(&self) -> Result<()> {
        // What every request needs beyond a connection: the two tables and
        // the claim function. Catalog lookups, evaluated at each execution (a
        // cached plan would keep the answer of its first run), reading
        // neither table.
        // And whether the server still takes writes: a connection made to
        // it did, but a server set read-only since would fail every write
        // while reads still pass.
        let found: Option<(bool, bool, bool, bool, bool)> = self
            .fetch_row(
                sqlx::query_as(
                    "SELECT to_regclass('idempotency_keys') IS NOT NULL,
                        to_regclass('idempotency_reservations') IS NOT NULL,
                        to_regprocedure($1) IS NOT NULL,
                        to_regprocedure($2) IS NOT NULL,
                        pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'",
                )
                .bind(citus::RESERVE_SIGNATURE)
                .bind(citus::WRITE_BATCH_SIGNATURE),
            )
            .await?;
        match found {
            Some((.., true)) => {
                // Its connections are no use: the next one made finds the
                // server that takes writes, if one does.
                self.conns.drop_idle();
                Err(StoreError::unavailable(format!(
                    "the database server ({}) no longer takes writes (a standby, or a primary \
                     demoted or set read-only)",
                    self.conns.target.server()
                )))
            }
            Some((true, true, true, true, false)) => Ok(()),
            // In the words a request would get, so that both are one cause.
            Some((keys, reservations, reserve, _, false)) => {
                let missing = if !keys {
                    "relation \"idempotency_keys\" does not exist (SQLSTATE 42P01)"
                } else if !reservations {
                    "relation \"idempotency_reservations\" does not exist (SQLSTATE 42P01)"
                } else if !reserve {
                    "function idemgate_reserve does not exist (SQLSTATE 42883)"
                } else {
                    "function idemgate_write_batch does not exist (SQLSTATE 42883)"
                };
                Err(no_tables(missing, &self.conns.target))
            }
            None => Err(StoreError::other("the readiness query returned no row")),
        }
    }

    fn durability(&self) -> crate::store::Durability {
        PgStore::durability(self)
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        let size = self.conns.open.load(Ordering::Relaxed);
        let idle = self.conns.idle.lock().map_or(0, |idle| idle.len());
        let idle = u32::try_from(idle).unwrap_or(u32::MAX);
        Some(PoolStats { size, idle })
    }
}
