//! [`Store`] over the SQLite file: writes on the writer thread, each one
//! command, one `BEGIN IMMEDIATE` transaction; reads on the reader pool.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::SqliteStore;
use super::errors::{NO_TABLES, classify, classify_rs};
use super::rows::*;
use super::sql::*;
use super::tx::*;
use rusqlite::params;

use crate::store::{
    Claim, ClaimRequest, Found, HotPath, InFlightUsage, KeyPage, KeyQuery, LeaseExpiry,
    Maintenance, PoolStats, PruneBatch, Queries, Record, Recovery, Resolve, ResolveAction, Result,
    StoreError, StoredResponse, StoredUsage, Write, Written,
};

#[async_trait]
impl HotPath for SqliteStore {
    async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        match self.claim(req).await {
            // The file cannot be written (read-only, full disk) or the writer
            // is stuck: a record that needs no claim is still an answer.
            Err(e) if e.is_unavailable() => match self.settled(req).await {
                Ok(Some(settled)) => Ok(Some(settled)),
                _ => Err(e),
            },
            claimed => claimed,
        }
    }

    async fn complete(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        response: &StoredResponse,
    ) -> Result<Option<Record>> {
        let write = Write::Complete {
            tenant: tenant.to_owned(),
            reservation_id,
            response: response.clone(),
        };
        match self.writer.submit(write).await? {
            Written::Complete(record) => Ok(record),
            _ => Err(super::mismatched()),
        }
    }

    async fn release(&self, tenant: &str, reservation_id: Uuid) -> Result<Option<Vec<u8>>> {
        let write = Write::Release {
            tenant: tenant.to_owned(),
            reservation_id,
        };
        match self.writer.submit(write).await? {
            Written::Release(key_hash) => Ok(key_hash),
            _ => Err(super::mismatched()),
        }
    }

    async fn mark_unknown(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        reason: &str,
    ) -> Result<Option<Vec<u8>>> {
        let tenant = tenant.to_owned();
        let reason = reason.to_owned();
        self.writer
            .write(move |conn| {
                let mut buf = Uuid::encode_buffer();
                let id = uuid_text(reservation_id, &mut buf);
                value_row(conn, MARK_UNKNOWN, params![tenant, id, now_ms(), reason])
            })
            .await
    }

    async fn extend(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        lease_seconds: u32,
        on_lease_expiry: Option<LeaseExpiry>,
    ) -> Result<Option<DateTime<Utc>>> {
        let tenant = tenant.to_owned();
        let on_lease_expiry = on_lease_expiry.map(LeaseExpiry::as_str);
        let until: Option<Option<i64>> = self
            .writer
            .write(move |conn| {
                let mut buf = Uuid::encode_buffer();
                let id = uuid_text(reservation_id, &mut buf);
                value_row(
                    conn,
                    EXTEND,
                    params![
                        tenant,
                        id,
                        now_ms(),
                        secs_ms(lease_seconds),
                        on_lease_expiry
                    ],
                )
            })
            .await?;
        // The column is nullable in the schema, never NULL after this update.
        until.flatten().map(ts).transpose()
    }

    async fn checkpoint(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        recovery: &Recovery,
    ) -> Result<Option<Record>> {
        let data = data_json(&recovery.data)?;
        let tenant = tenant.to_owned();
        let point = recovery.recovery_point.clone();
        self.writer
            .write(move |conn| {
                let mut buf = Uuid::encode_buffer();
                let id = uuid_text(reservation_id, &mut buf);
                key_row(conn, CHECKPOINT, params![tenant, id, now_ms(), point, data])?
                    .map(Record::try_from)
                    .transpose()
            })
            .await
    }

    async fn find_by_reservation(
        &self,
        tenant: &str,
        reservation_id: Uuid,
    ) -> Result<Option<Found>> {
        // One statement reads one snapshot; the clock is read just before it,
        // so a record seen as live was live at `now`.
        let now = now_ms();
        let row: Option<KeyRow> = sqlx::query_as(FIND)
            .bind(tenant)
            .bind(reservation_id.hyphenated())
            .fetch_optional(&self.reader)
            .await
            .map_err(classify)?;
        row.map(|r| {
            Ok(Found {
                now: ts(now)?,
                record: r.try_into()?,
            })
        })
        .transpose()
    }

    async fn write_batch(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        match self.write_all(writes).await {
            Ok(written) => written.into_iter().map(Ok).collect(),
            Err(e) => writes.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    fn groups_own_writes(&self) -> bool {
        true
    }

    fn own_batches(&self) -> Option<crate::store::BatchStats> {
        Some(self.writer.stats())
    }

    async fn write_grouped(&self, writes: Vec<Write>) -> Vec<Result<Written>> {
        self.writer.submit_group(writes).await
    }
}

#[async_trait]
impl Queries for SqliteStore {
    async fn find_key(&self, tenant: &str, key_hash: &[u8]) -> Result<Option<Found>> {
        let now = now_ms();
        let row: Option<KeyRow> = sqlx::query_as(SELECT_KEY)
            .bind(tenant)
            .bind(key_hash)
            .fetch_optional(&self.reader)
            .await
            .map_err(classify)?;
        row.map(|r| {
            Ok(Found {
                now: ts(now)?,
                record: r.try_into()?,
            })
        })
        .transpose()
    }

    async fn key_hashes_between(
        &self,
        tenant: &str,
        low: &[u8],
        high: &[u8],
        limit: i64,
    ) -> Result<Vec<Vec<u8>>> {
        sqlx::query_scalar(
            "SELECT key_hash FROM idempotency_keys WHERE tenant = ?1
                AND key_hash BETWEEN ?2 AND ?3 AND expires_at > ?5
                ORDER BY key_hash LIMIT ?4",
        )
        .bind(tenant)
        .bind(low)
        .bind(high)
        .bind(limit)
        .bind(now_ms())
        .fetch_all(&self.reader)
        .await
        .map_err(classify)
    }

    async fn list_keys(&self, query: &KeyQuery) -> Result<KeyPage> {
        let now = now_ms();
        let created_by = query
            .older_than
            .map(|d| now.saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)));
        let after = query.after.as_ref();
        let rows: Vec<KeyRow> = sqlx::query_as(LIST_KEYS)
            .bind(now)
            .bind(query.state_text())
            .bind(query.tenant.as_deref())
            .bind(created_by)
            .bind(i64::from(query.limit.max(1)))
            .bind(after.map(|c| c.created_at.timestamp_millis()))
            .bind(after.map(|c| c.tenant.as_str()))
            .bind(after.map(|c| c.key_hash.as_slice()))
            .fetch_all(&self.reader)
            .await
            .map_err(classify)?;
        Ok(KeyPage {
            records: rows
                .into_iter()
                .map(Record::try_from)
                .collect::<Result<_>>()?,
            now: ts(now)?,
        })
    }

    async fn resolve(&self, resolve: &Resolve) -> Result<Option<Found>> {
        let headers = match (resolve.action, &resolve.response) {
            (ResolveAction::Complete, Some(response)) => Some(headers_json(&response.headers)?),
            (ResolveAction::Complete, None) => {
                return Err(StoreError::other("a completion without a response"));
            }
            (ResolveAction::Release, _) => None,
        };
        let resolve = resolve.clone();
        let (record, now) = self
            .writer
            .write(move |conn| {
                let now = now_ms();
                let mut buf = Uuid::encode_buffer();
                let id = uuid_text(resolve.reservation_id, &mut buf);
                let (tenant, hash) = (&resolve.tenant, &resolve.key_hash);
                let (reason, by) = (&resolve.reason, &resolve.by);
                let row = match (&resolve.response, headers) {
                    (Some(response), Some(headers)) => key_row(
                        conn,
                        RESOLVE_COMPLETE,
                        params![
                            tenant,
                            hash,
                            id,
                            now,
                            reason,
                            by,
                            i64::from(response.status),
                            headers,
                            &response.body[..],
                        ],
                    )?,
                    _ => key_row(
                        conn,
                        RESOLVE_RELEASE,
                        params![tenant, hash, id, now, reason, by],
                    )?,
                };
                Ok((row.map(Record::try_from).transpose()?, now))
            })
            .await?;
        record
            .map(|record| {
                Ok(Found {
                    record,
                    now: ts(now)?,
                })
            })
            .transpose()
    }

    async fn count_stuck(&self) -> Result<u64> {
        let n: i64 = sqlx::query_scalar(COUNT_STUCK)
            .bind(now_ms())
            .fetch_one(&self.reader)
            .await
            .map_err(classify)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn in_flight_usage(&self, tenant: &str, up_to: u32) -> Result<InFlightUsage> {
        let now = now_ms();
        let (keys, next): (i64, Option<i64>) = sqlx::query_as(
            "SELECT count(*), min(lease_expires_at) FROM (
                SELECT lease_expires_at FROM idempotency_keys
                 WHERE tenant = ?1 AND state = 'in_flight' AND lease_expires_at > ?2 AND expires_at > ?2
                 ORDER BY lease_expires_at
                 LIMIT ?3)",
        )
        .bind(tenant)
        .bind(now)
        .bind(i64::from(up_to))
        .fetch_one(&self.reader)
        .await
        .map_err(classify)?;
        Ok(InFlightUsage {
            keys: u64::try_from(keys).unwrap_or(0),
            next_lease_end: ts_opt(next)?,
            now: ts(now)?,
        })
    }

    async fn stored_usage(&self, tenant: &str) -> Result<StoredUsage> {
        let now = now_ms();
        let (bytes, next): (i64, Option<i64>) = sqlx::query_as(
            "SELECT coalesce(sum(coalesce(length(response_body), 0)
                                 + coalesce(length(response_headers), 0)), 0),
                    min(expires_at)
               FROM idempotency_keys
              WHERE tenant = ?1 AND state = 'completed' AND expires_at > ?2",
        )
        .bind(tenant)
        .bind(now)
        .fetch_one(&self.reader)
        .await
        .map_err(classify)?;
        Ok(StoredUsage {
            bytes: u64::try_from(bytes).unwrap_or(0),
            next_expiry: ts_opt(next)?,
            now: ts(now)?,
        })
    }
}

#[async_trait]
impl Maintenance for SqliteStore {
    async fn open_window(&self, name: &str, seconds: u64) -> Result<()> {
        let name = name.to_owned();
        let ms = i64::try_from(seconds.saturating_mul(1000)).unwrap_or(i64::MAX);
        self.writer
            .write(move |conn| {
                let until = now_ms().saturating_add(ms);
                conn.prepare_cached(
                    "INSERT INTO idemgate_windows (name, until) VALUES (?1, ?2)
                     ON CONFLICT (name) DO UPDATE SET until = max(until, excluded.until)",
                )
                .map_err(classify_rs)?
                .execute(params![name, until])
                .map_err(classify_rs)
            })
            .await?;
        Ok(())
    }

    async fn open_windows(&self) -> Result<Vec<String>> {
        sqlx::query_scalar("SELECT name FROM idemgate_windows WHERE until > ?1 ORDER BY name")
            .bind(now_ms())
            .fetch_all(&self.reader)
            .await
            .map_err(classify)
    }

    async fn prune_expired_batch(&self, limit: i64) -> Result<PruneBatch> {
        // SQLite reads a negative LIMIT as "no limit"; PostgreSQL refuses it.
        if limit <= 0 {
            return Ok(PruneBatch::default());
        }
        // Both deletes run under one write lock, so they see the same expired
        // rows and no reservation can touch them in between; a second pruner
        // (another process) waits for the lock and then finds them gone, so
        // each row is deleted exactly once. Small batches keep the lock short.
        let deleted = self
            .writer
            .write(move |conn| {
                let now = now_ms();
                let mut fences = conn.prepare_cached(PRUNE_FENCES).map_err(classify_rs)?;
                fences.execute(params![now, limit]).map_err(classify_rs)?;
                let mut keys = conn.prepare_cached(PRUNE_KEYS).map_err(classify_rs)?;
                keys.execute(params![now, limit]).map_err(classify_rs)
            })
            .await?;
        Ok(PruneBatch::of(deleted as u64, limit))
    }

    async fn ping(&self) -> Result<()> {
        // Reads the schema from the file, so a file that cannot be read fails
        // here, and so does one without the tables every request needs.
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM sqlite_master WHERE type = 'table'
                AND name IN ('idempotency_keys', 'idempotency_reservations')",
        )
        .fetch_all(&self.reader)
        .await
        .map_err(classify)?;
        match ["idempotency_keys", "idempotency_reservations"]
            .into_iter()
            .find(|t| !tables.iter().any(|have| have == t))
        {
            // In the words a request would get, so that both are one cause.
            Some(missing) => Err(StoreError::unavailable(format!(
                "no such table: {missing}: {NO_TABLES}"
            ))),
            None => Ok(()),
        }
    }

    /// The pools' connections: the readers and the direct-SQL connection
    /// (one and the same in memory). The writer thread's one connection is
    /// no pool's and is not counted.
    fn pool_stats(&self) -> Option<PoolStats> {
        let (size, idle) = if self.shared {
            (self.direct.size(), self.direct.num_idle())
        } else {
            (
                self.direct.size() + self.reader.size(),
                self.direct.num_idle() + self.reader.num_idle(),
            )
        };
        let idle = u32::try_from(idle).unwrap_or(u32::MAX);
        Some(PoolStats { size, idle })
    }
}
