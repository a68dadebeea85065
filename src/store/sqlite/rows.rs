//! Rows read back from the file: timestamps stored as milliseconds since the
//! epoch (SQLite has no timestamp type), decoded into the [`Record`] both
//! stores return, through the helpers they share.

use chrono::{DateTime, Utc};
use sqlx::FromRow;
use uuid::fmt::Hyphenated;

use crate::store::{
    KeyState, LeaseExpiry, Record, Recovery, Resolution, Result, StoreError, StoredResponse,
};

/// This process's clock in whole milliseconds, the stored precision, so that
/// the `now` handed to the engine is exactly the one the SQL compared with.
pub(super) fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

/// A stored millisecond count as a timestamp.
pub(super) fn ts(ms: i64) -> Result<DateTime<Utc>> {
    DateTime::from_timestamp_millis(ms)
        .ok_or_else(|| StoreError::other(format!("stored timestamp {ms} out of range")))
}

pub(super) fn ts_opt(ms: Option<i64>) -> Result<Option<DateTime<Utc>>> {
    ms.map(ts).transpose()
}

/// Seconds as milliseconds, for adding to a stored timestamp.
pub(super) fn secs_ms(seconds: u32) -> i64 {
    i64::from(seconds) * 1000
}

#[derive(FromRow)]
pub(super) struct KeyRow {
    pub(super) tenant: String,
    pub(super) key_hash: Vec<u8>,
    pub(super) fingerprint: Option<String>,
    pub(super) state: String,
    pub(super) reservation_id: Hyphenated,
    pub(super) lease_expires_at: Option<i64>,
    pub(super) attempt: i64,
    pub(super) recovery_point: Option<String>,
    pub(super) recovery_data: Option<String>,
    pub(super) response_status: Option<i64>,
    pub(super) response_headers: Option<String>,
    pub(super) response_body: Option<Vec<u8>>,
    pub(super) created_at: i64,
    pub(super) completed_at: Option<i64>,
    pub(super) expires_at: i64,
    pub(super) on_lease_expiry: String,
    pub(super) resolved_action: Option<String>,
    pub(super) resolved_reason: Option<String>,
    pub(super) resolved_by: Option<String>,
    pub(super) resolved_at: Option<i64>,
}

impl TryFrom<KeyRow> for Record {
    type Error = StoreError;

    fn try_from(r: KeyRow) -> Result<Record> {
        let state = KeyState::parse(&r.state)?;
        let response = StoredResponse::from_columns(
            r.response_status,
            r.response_headers
                .map(|h| serde_json::from_str(&h))
                .transpose()
                .map_err(|e| StoreError::other(format!("stored headers: {e}")).because(e))?,
            r.response_body,
        )?;
        let data = r
            .recovery_data
            .map(|d| serde_json::from_str(&d))
            .transpose()
            .map_err(|e| StoreError::other(format!("stored recovery data: {e}")).because(e))?;
        Ok(Record {
            tenant: r.tenant,
            key_hash: r.key_hash,
            fingerprint: r.fingerprint,
            state,
            reservation_id: r.reservation_id.into_uuid(),
            lease_expires_at: ts_opt(r.lease_expires_at)?,
            attempt: i32::try_from(r.attempt)
                .map_err(|_| StoreError::other(format!("stored attempt {}", r.attempt)))?,
            recovery: r.recovery_point.map(|recovery_point| Recovery {
                recovery_point,
                data,
            }),
            response,
            created_at: ts(r.created_at)?,
            completed_at: ts_opt(r.completed_at)?,
            expires_at: ts(r.expires_at)?,
            on_lease_expiry: LeaseExpiry::parse(&r.on_lease_expiry).map_err(StoreError::other)?,
            resolution: Resolution::from_columns(
                r.resolved_action,
                r.resolved_reason,
                r.resolved_by,
                ts_opt(r.resolved_at)?,
            )?,
        })
    }
}

pub(super) fn headers_json(headers: &[(String, String)]) -> Result<String> {
    // Pairs serialise as two-element arrays, the layout the PostgreSQL store
    // keeps in jsonb.
    serde_json::to_string(headers)
        .map_err(|e| StoreError::other(format!("headers: {e}")).because(e))
}

pub(super) fn data_json(data: &Option<serde_json::Value>) -> Result<Option<String>> {
    data.as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(|e| StoreError::other(format!("recovery data: {e}")).because(e))
}
