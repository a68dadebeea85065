//! Rows read back from the file: timestamps stored as milliseconds since the
//! epoch (SQLite has no timestamp type), decoded into the [`Record`] both
//! stores return, through the helpers they share.

use chrono::{DateTime, Utc};
use uuid::Uuid;
use uuid::fmt::Hyphenated;

use crate::store::{
    KeptRequest, KeyState, LeaseExpiry, MarkedUnknown, Record, Recovery, Resolution, Result,
    StoreError, StoredResponse,
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

/// Stored as its name, as the schema's CHECK spells it.
impl rusqlite::ToSql for LeaseExpiry {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        Ok(self.as_str().into())
    }
}

/// Seconds as milliseconds, for adding to a stored timestamp.
pub(super) fn secs_ms(seconds: u32) -> i64 {
    i64::from(seconds) * 1000
}

crate::store::from_row! {
    pub(super) struct KeyRow from sqlx::sqlite::SqliteRow {
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
        pub(super) unknown_reason: Option<String>,
        pub(super) unknown_at: Option<i64>,
        pub(super) unknown_reservation_id: Option<String>,
        pub(super) request: Option<Vec<u8>>,
    }
}

impl KeyRow {
    /// The row the writer thread read, its columns in
    /// [`key_columns!`](crate::store::key_columns) order.
    pub(super) fn read(r: &rusqlite::Row<'_>) -> rusqlite::Result<KeyRow> {
        let id = text(r, 4)?;
        let reservation_id = Uuid::parse_str(&id)
            .map_err(|e| {
                rusqlite::Error::FromSqlConversionFailure(4, rusqlite::types::Type::Text, e.into())
            })?
            .hyphenated();
        Ok(KeyRow {
            tenant: text(r, 0)?,
            key_hash: bytes(r, 1)?,
            fingerprint: text_opt(r, 2)?,
            state: text(r, 3)?,
            reservation_id,
            lease_expires_at: r.get(5)?,
            attempt: r.get(6)?,
            recovery_point: text_opt(r, 7)?,
            recovery_data: text_opt(r, 8)?,
            response_status: r.get(9)?,
            response_headers: text_opt(r, 10)?,
            response_body: bytes_opt(r, 11)?,
            created_at: r.get(12)?,
            completed_at: r.get(13)?,
            expires_at: r.get(14)?,
            on_lease_expiry: text(r, 15)?,
            resolved_action: text_opt(r, 16)?,
            resolved_reason: text_opt(r, 17)?,
            resolved_by: text_opt(r, 18)?,
            resolved_at: r.get(19)?,
            unknown_reason: text_opt(r, 20)?,
            unknown_at: r.get(21)?,
            unknown_reservation_id: text_opt(r, 22)?,
            request: bytes_opt(r, 23)?,
        })
    }
}

/// A TEXT column (a BLOB of UTF-8 reads the same, as sqlx read it).
fn text_opt(r: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<Option<String>> {
    use rusqlite::types::ValueRef;
    match r.get_ref(i)? {
        ValueRef::Null => Ok(None),
        ValueRef::Text(t) | ValueRef::Blob(t) => {
            String::from_utf8(t.to_vec()).map(Some).map_err(|e| {
                rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, e.into())
            })
        }
        other => Err(rusqlite::Error::InvalidColumnType(
            i,
            format!("column {i}"),
            other.data_type(),
        )),
    }
}

fn text(r: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<String> {
    text_opt(r, i)?.ok_or(rusqlite::Error::InvalidColumnType(
        i,
        format!("column {i}"),
        rusqlite::types::Type::Null,
    ))
}

/// A BLOB column (TEXT reads as its bytes, as sqlx read it).
fn bytes_opt(r: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<Option<Vec<u8>>> {
    use rusqlite::types::ValueRef;
    match r.get_ref(i)? {
        ValueRef::Null => Ok(None),
        ValueRef::Text(b) | ValueRef::Blob(b) => Ok(Some(b.to_vec())),
        other => Err(rusqlite::Error::InvalidColumnType(
            i,
            format!("column {i}"),
            other.data_type(),
        )),
    }
}

fn bytes(r: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<Vec<u8>> {
    bytes_opt(r, i)?.ok_or(rusqlite::Error::InvalidColumnType(
        i,
        format!("column {i}"),
        rusqlite::types::Type::Null,
    ))
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
            marked_unknown: MarkedUnknown::from_columns(
                r.unknown_reason,
                ts_opt(r.unknown_at)?,
                r.unknown_reservation_id
                    .as_deref()
                    .and_then(|id| Uuid::parse_str(id).ok()),
                r.reservation_id.into_uuid(),
            ),
            request: KeptRequest::from_column(r.request),
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
