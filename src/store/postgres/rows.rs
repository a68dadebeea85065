//! The rows the PostgreSQL store reads back: every statement that returns a
//! record returns the columns of [`key_columns!`](crate::store::key_columns)
//! in that order, read here into a [`KeyRow`] and turned into a [`Record`]
//! by the helpers both stores share.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::store::{
    Found, KeptRequest, KeyState, LeaseExpiry, MarkedUnknown, Record, Recovery, Resolution, Result,
    StoreError, StoredResponse,
};

crate::store::from_row! {
    /// One row of `idempotency_keys`, as [`key_columns!`](crate::store::key_columns) lists it.
    pub(super) struct KeyRow from sqlx::postgres::PgRow {
        pub(super) tenant: String,
        pub(super) key_hash: Vec<u8>,
        pub(super) fingerprint: Option<String>,
        pub(super) state: String,
        pub(super) reservation_id: Uuid,
        pub(super) lease_expires_at: Option<DateTime<Utc>>,
        pub(super) attempt: i32,
        pub(super) recovery_point: Option<String>,
        pub(super) recovery_data: Option<serde_json::Value>,
        pub(super) response_status: Option<i32>,
        pub(super) response_headers: Option<serde_json::Value>,
        pub(super) response_body: Option<Vec<u8>>,
        pub(super) created_at: DateTime<Utc>,
        pub(super) completed_at: Option<DateTime<Utc>>,
        pub(super) expires_at: DateTime<Utc>,
        pub(super) on_lease_expiry: String,
        pub(super) resolved_action: Option<String>,
        pub(super) resolved_reason: Option<String>,
        pub(super) resolved_by: Option<String>,
        pub(super) resolved_at: Option<DateTime<Utc>>,
        pub(super) unknown_reason: Option<String>,
        pub(super) unknown_at: Option<DateTime<Utc>>,
        pub(super) unknown_reservation_id: Option<Uuid>,
        pub(super) request: Option<Vec<u8>>,
    }
}

crate::store::from_row! {
    pub(super) struct ClaimRow from sqlx::postgres::PgRow {
        pub(super) claimed: bool,
        pub(super) db_now: DateTime<Utc>,
        @flatten pub(super) row: KeyRow,
    }
}

crate::store::from_row! {
    pub(super) struct BatchRow from sqlx::postgres::PgRow {
        pub(super) ord: i32,
        pub(super) claimed: bool,
        pub(super) db_now: DateTime<Utc>,
        @flatten pub(super) row: KeyRow,
    }
}

crate::store::from_row! {
    pub(super) struct FoundRow from sqlx::postgres::PgRow {
        pub(super) db_now: DateTime<Utc>,
        @flatten pub(super) row: KeyRow,
    }
}

impl TryFrom<FoundRow> for Found {
    type Error = StoreError;

    fn try_from(r: FoundRow) -> Result<Found> {
        Ok(Found {
            now: r.db_now,
            record: r.row.try_into()?,
        })
    }
}

impl TryFrom<KeyRow> for Record {
    type Error = StoreError;

    fn try_from(r: KeyRow) -> Result<Record> {
        let state = KeyState::parse(&r.state)?;
        let response = StoredResponse::from_columns(
            r.response_status.map(i64::from),
            r.response_headers,
            r.response_body,
        )?;
        let on_lease_expiry = LeaseExpiry::parse(&r.on_lease_expiry).map_err(StoreError::other)?;
        let resolution = Resolution::from_columns(
            r.resolved_action,
            r.resolved_reason,
            r.resolved_by,
            r.resolved_at,
        )?;
        Ok(Record {
            tenant: r.tenant,
            key_hash: r.key_hash,
            fingerprint: r.fingerprint,
            state,
            reservation_id: r.reservation_id,
            // A commit keeps the lease's end, so that it stays heap-only
            // (sql.rs, COMPLETE); a completed record has no lease.
            lease_expires_at: r.lease_expires_at.filter(|_| state != KeyState::Completed),
            attempt: r.attempt,
            recovery: r.recovery_point.map(|recovery_point| Recovery {
                recovery_point,
                data: r.recovery_data,
            }),
            response,
            created_at: r.created_at,
            completed_at: r.completed_at,
            expires_at: r.expires_at,
            on_lease_expiry,
            resolution,
            marked_unknown: MarkedUnknown::from_columns(
                r.unknown_reason,
                r.unknown_at,
                r.unknown_reservation_id,
                r.reservation_id,
            ),
            request: KeptRequest::from_column(r.request),
        })
    }
}

pub(super) fn headers_json(headers: &[(String, String)]) -> serde_json::Value {
    serde_json::Value::Array(
        headers
            .iter()
            .map(|(n, v)| serde_json::json!([n, v]))
            .collect(),
    )
}
