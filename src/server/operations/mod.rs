//! What an operator runs on stuck keys — `list`, `show`, `resolve`, and the
//! queue's `counts` — one implementation behind every operators' door: the
//! admin endpoints (`/v1/admin/keys…`), the `idemgate keys` command and the
//! console. Each takes the engine and what the operator asked, and returns
//! the `KeyView`s they all print.
//!
//! A key is named by its tenant, as stored, and its key hash (the lowercase
//! hex SHA-256 of the key); the raw key is never shown.

pub mod counts;
pub mod list;
pub mod resolve;
pub mod show;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::problem::ApiError;
use crate::server::views::{LeaseExpiry, MarkedUnknownView, Recovery};
use crate::store::{self, KeyCursor, Record};

pub use counts::{Counts, counts};
pub use list::{KeyList, ListQuery, list};
pub use resolve::{ResolveBody, resolve};
pub use show::{Shown, show, show_with_response};

/// What an operator sees of one key: never the raw key.
#[derive(Debug, Clone, Serialize, serde::Deserialize, ToSchema)]
pub struct KeyView {
    /// The tenant, as stored (the proxy's is the hex SHA-256 of its tenant
    /// header, or `anonymous`).
    pub tenant: String,
    /// The lowercase hex SHA-256 of the key.
    pub key_hash: String,
    /// The key's state now: `unknown` for one marked so or held past its
    /// lease; `released` once an operator released it (it is forgotten).
    pub state: ShownState,
    /// 1 for the first holder, more after takeovers.
    pub attempt: i32,
    /// The current holder's reservation id.
    pub reservation_id: Uuid,
    /// What the lease's end without news means for it.
    pub on_lease_expiry: LeaseExpiry,
    /// When the key was first reserved.
    pub created_at: DateTime<Utc>,
    /// When the current lease ends (or ended); `null` once completed.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// When the key is forgotten.
    pub expires_at: DateTime<Utc>,
    /// When its response was stored.
    pub completed_at: Option<DateTime<Utc>>,
    /// The last recovery point its holder recorded.
    pub recovery: Option<Recovery>,
    /// The stored response's status, once completed.
    pub status: Option<u16>,
    /// Why and when its holder marked it unknown, if it did (a key held
    /// past its lease was not marked: it has none).
    pub marked_unknown: Option<MarkedUnknownView>,
    /// How an operator settled it, if one did.
    pub resolution: Option<ResolutionView>,
    /// What the key was for, where the door that claimed it knew: the proxy
    /// and the layer always, the reservation API when the reserve described
    /// its `request`. `null` for a key claimed without one, or by a release
    /// that did not keep it.
    pub request: Option<RequestView>,
    /// The W3C trace id of the request that claimed the key, when it came
    /// with a `traceparent`: where to look for it in the traces.
    #[schema(pattern = "^[0-9a-f]{32}$")]
    pub trace_id: Option<String>,
    /// What the caller called the key when it reserved it (the reservation
    /// API's `label`: an order id, a job name), where it gave one.
    #[schema(max_length = 200)]
    pub label: Option<String>,
}

/// The request a key was for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, ToSchema)]
pub struct RequestView {
    /// Its method.
    pub method: String,
    /// Its path, with its query.
    pub path: String,
}

/// A key's state, as an operator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ShownState {
    /// A holder owns it under a live lease (or, under `takeover`, its lease
    /// ended and the next request takes it over).
    InFlight,
    /// Its response is stored and replayed.
    Completed,
    /// Whether its effect happened is unknown: refused until settled.
    Unknown,
    /// An operator released it: forgotten, the next request executes.
    Released,
}

impl ShownState {
    /// The state as the JSON view spells it (`in_flight`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            ShownState::InFlight => "in_flight",
            ShownState::Completed => "completed",
            ShownState::Unknown => "unknown",
            ShownState::Released => "released",
        }
    }
}

/// Who settled a key, how, when and why.
#[derive(Debug, Clone, Serialize, serde::Deserialize, ToSchema)]
pub struct ResolutionView {
    /// `release` or `complete`.
    pub action: Action,
    /// Why, in the operator's words.
    pub reason: String,
    /// Who: the admin token's name, or the command line's user.
    pub by: String,
    /// When.
    pub at: DateTime<Utc>,
}

/// How a stuck key is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Nothing happened: the key is forgotten and the next request executes.
    Release,
    /// This is what happened: the response given is stored, and every retry
    /// replays it.
    Complete,
}

impl Action {
    /// The action as the JSON spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Release => "release",
            Action::Complete => "complete",
        }
    }
}

impl From<Action> for store::ResolveAction {
    fn from(action: Action) -> store::ResolveAction {
        match action {
            Action::Release => store::ResolveAction::Release,
            Action::Complete => store::ResolveAction::Complete,
        }
    }
}

impl From<store::ResolveAction> for Action {
    fn from(action: store::ResolveAction) -> Action {
        match action {
            store::ResolveAction::Release => Action::Release,
            store::ResolveAction::Complete => Action::Complete,
        }
    }
}

/// `record` as an operator sees it at `now`.
pub fn view(record: &Record, now: DateTime<Utc>) -> KeyView {
    let state = match crate::engine::shown_state(record, now) {
        Some(store::KeyState::InFlight) => ShownState::InFlight,
        Some(store::KeyState::Completed) => ShownState::Completed,
        Some(store::KeyState::Unknown) => ShownState::Unknown,
        None => ShownState::Released,
    };
    let opened = record.request.as_ref().and_then(store::KeptRequest::open);
    KeyView {
        tenant: record.tenant.clone(),
        key_hash: hex::encode(&record.key_hash),
        state,
        attempt: record.attempt,
        reservation_id: record.reservation_id,
        on_lease_expiry: record.on_lease_expiry.into(),
        created_at: record.created_at,
        lease_expires_at: record.lease_expires_at,
        expires_at: record.expires_at,
        completed_at: record.completed_at,
        recovery: record.recovery.clone().map(Recovery::from),
        status: record.response.as_ref().map(|r| r.status),
        marked_unknown: record.marked_unknown.as_ref().map(MarkedUnknownView::from),
        resolution: record.resolution.as_ref().map(|r| ResolutionView {
            action: r.action.into(),
            reason: r.reason.clone(),
            by: r.by.clone(),
            at: r.at,
        }),
        request: opened.filter(|r| r.names_a_request()).map(|r| RequestView {
            method: r.method.clone(),
            path: r.path.clone(),
        }),
        trace_id: opened.and_then(|r| r.trace_id.clone()),
        label: opened.and_then(|r| r.label.clone()),
    }
}

/// A key hash as an operator writes it: 64 hex digits.
pub fn key_hash(hex_text: &str) -> Result<Vec<u8>, ApiError> {
    let text = hex_text.trim();
    match hex::decode(text) {
        Ok(bytes) if bytes.len() == 32 => Ok(bytes),
        _ => Err(ApiError::InvalidRequest(format!(
            "the key hash must be the 64 hex digits of the key's SHA-256; got {} characters",
            text.len()
        ))),
    }
}

/// The shortest key hash prefix taken (as `git` takes a commit id's).
pub const MIN_PREFIX: usize = 8;

/// The whole key hash `text` names: its 64 hex digits, or a prefix of at
/// least [`MIN_PREFIX`] that matches one key of `tenant` (`keys list` shows
/// 12). One prefix that matches several is refused, listing them; one that
/// matches none is `404 not-found`. Looked up as a range of the primary
/// key, not a scan.
pub async fn expand_key_hash(
    engine: &crate::engine::Engine,
    tenant: &str,
    text: &str,
) -> Result<String, ApiError> {
    let text = text.trim().to_ascii_lowercase();
    if text.len() == 64 {
        return key_hash(&text).map(hex::encode);
    }
    if text.is_empty() || text.len() > 64 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::InvalidRequest(format!(
            "the key hash must be hex digits of the key's SHA-256 (all 64, or a prefix of at \
             least {MIN_PREFIX}); got {text:?}"
        )));
    }
    if text.len() < MIN_PREFIX {
        return Err(ApiError::InvalidRequest(format!(
            "the key hash prefix {text:?} is {} hex digits; give at least {MIN_PREFIX} (as \
             `keys list` shows them) or all 64",
            text.len()
        )));
    }
    let bound = |pad: char| {
        let mut full = text.clone();
        full.extend(std::iter::repeat_n(pad, 64 - text.len()));
        hex::decode(full).expect("64 hex digits")
    };
    let found = engine
        .key_hashes_between(tenant, &bound('0'), &bound('f'), 11)
        .await?;
    match found.as_slice() {
        [] => Err(ApiError::NotFound(format!(
            "tenant {tenant:?} has no key whose hash starts with {text}"
        ))),
        [one] => Ok(hex::encode(one)),
        many => Err(ApiError::InvalidRequest(format!(
            "the key hash prefix {text} is ambiguous: it matches {}{} keys of tenant {tenant:?}: \
             {}; give more digits",
            if many.len() > 10 { "more than " } else { "" },
            many.len().min(10),
            many.iter()
                .take(10)
                .map(hex::encode)
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// A cursor as the listing hands it out: opaque to the caller.
pub(crate) fn encode_cursor(cursor: &KeyCursor) -> String {
    let text = format!(
        "{}.{}.{}",
        cursor.created_at.timestamp_micros(),
        hex::encode(cursor.tenant.as_bytes()),
        hex::encode(&cursor.key_hash)
    );
    URL_SAFE_NO_PAD.encode(text)
}

/// A cursor handed out by `encode_cursor`.
pub(crate) fn decode_cursor(text: &str) -> Result<KeyCursor, ApiError> {
    let bad = || ApiError::InvalidRequest("cursor is not one this listing handed out".into());
    let bytes = URL_SAFE_NO_PAD.decode(text.trim()).map_err(|_| bad())?;
    let text = String::from_utf8(bytes).map_err(|_| bad())?;
    let mut parts = text.splitn(3, '.');
    let (Some(micros), Some(tenant), Some(hash)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let created_at = micros
        .parse::<i64>()
        .ok()
        .and_then(DateTime::from_timestamp_micros)
        .ok_or_else(bad)?;
    let tenant = hex::decode(tenant)
        .ok()
        .and_then(|t| String::from_utf8(t).ok())
        .ok_or_else(bad)?;
    let key_hash = hex::decode(hash).map_err(|_| bad())?;
    Ok(KeyCursor {
        created_at,
        tenant,
        key_hash,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_read_back_what_they_wrote() {
        let cursor = KeyCursor {
            created_at: DateTime::from_timestamp_micros(1_764_000_000_123_456).unwrap(),
            tenant: "acme.eu".into(),
            key_hash: vec![0xab; 32],
        };
        assert_eq!(decode_cursor(&encode_cursor(&cursor)).unwrap(), cursor);
        for bad in ["", "x", "MTIz", "!!"] {
            assert!(decode_cursor(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn key_hashes_are_64_hex_digits() {
        assert_eq!(key_hash(&"0a".repeat(32)).unwrap(), vec![10; 32]);
        assert!(key_hash("0a").is_err());
        assert!(key_hash(&"zz".repeat(32)).is_err());
    }
}
