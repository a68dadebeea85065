//! The wire shapes the doors share: the reservation API's request bodies
//! and response views (its OpenAPI schemas), how records become those
//! views, and how a commit's body becomes the response to store. The
//! operations and every door that speaks JSON use them; they use no door.

use std::fmt;

use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::{DateTime, Utc};
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::headers::set_expires;
use crate::layer::headers::is_framing;
use crate::problem::ApiError;
use crate::store::{self, Record, StoredResponse};

/// Body of `POST /v1/reservations`; every field is optional.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReserveBody {
    /// An opaque fingerprint the caller computed (at most 512 characters).
    #[schema(min_length = 1, max_length = 512)]
    pub fingerprint: Option<String>,
    /// The request, for idemgate to fingerprint.
    pub request: Option<RequestDescription>,
    /// Lease in seconds (1..=max, default 30).
    #[schema(minimum = 1)]
    pub lease_seconds: Option<u32>,
    /// Seconds the key is remembered, from now (1..=max, default 86400).
    #[schema(minimum = 1)]
    pub ttl_seconds: Option<u32>,
    /// What the lease's end without a commit, release or extend means
    /// (default `takeover`: the next reserve takes the key over, with this
    /// reservation's recovery point; `hold`: the outcome is unknown, and
    /// every reserve of the key is `409 outcome-unknown` until this
    /// reservation's late commit or release, or an operator, settles it).
    pub on_lease_expiry: Option<LeaseExpiry>,
    /// What the key is, told for a person (an order id, a job name): at
    /// most 200 characters, no control characters. Kept with the key and
    /// shown to operators beside its request (sealed at rest with it when
    /// sealing is on); never part of the fingerprint. An empty label is no
    /// label.
    #[schema(max_length = 200)]
    pub label: Option<String>,
}

/// A request to fingerprint.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RequestDescription {
    /// HTTP method.
    pub method: String,
    /// Path with its query.
    pub path: String,
    /// JSON body (any JSON value), canonicalised (RFC 8785) with the ignored
    /// pointers left out.
    #[serde(default)]
    #[schema(value_type = Value, required = false)]
    pub body: Option<serde_json::Value>,
}

/// The `state` of a reserve's `201`: always `reserved`, where its `200`
/// replay says `completed`.
// A type of its own rather than a string: the document then names the one
// value allowed, and a generated client can tell the two answers of a reserve
// apart by `state` (a TypeScript union narrows on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReservedState {
    /// The caller holds the key.
    Reserved,
}

/// The `state` of a completed key's view: always `completed`, where a
/// reserve's `201` says `reserved`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CompletedState {
    /// The key's response is stored.
    Completed,
}

/// `201`: the caller holds the key and owns the effect.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReservedView {
    /// Always `reserved`: tells this answer from a [`CompletedView`].
    pub state: ReservedState,
    /// Fencing token for commit, release, extend and checkpoint.
    pub reservation_id: Uuid,
    /// 1 for a new key; more after a takeover.
    pub attempt: i32,
    /// When the lease ends; extend it for long work.
    pub lease_expires_at: DateTime<Utc>,
    /// When the key is forgotten.
    pub expires_at: DateTime<Utc>,
    /// On a takeover: the previous holder's last recovery point, to
    /// reconcile before mutating again.
    pub recovery: Option<Recovery>,
}

/// A stored response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ResponseView {
    /// HTTP status.
    pub status: u16,
    /// Header lines as `[name, value]` pairs.
    #[schema(schema_with = header_lines)]
    pub headers: Vec<(String, String)>,
    /// The body, when it is UTF-8 text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// The body in base64, when it is not UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
}

/// `200`: the key was completed; this is its stored response.
#[derive(Debug, Serialize, ToSchema)]
pub struct CompletedView {
    /// Always `completed`: tells this answer from a [`ReservedView`].
    pub state: CompletedState,
    /// The stored response.
    pub response: ResponseView,
    /// When it was stored.
    pub completed_at: Option<DateTime<Utc>>,
    /// When the key is forgotten.
    pub expires_at: DateTime<Utc>,
}

/// The schema of a `Retry-After` header: whole seconds, never 0 (a client
/// told 0 would retry at once, in a loop). The header itself is written with
/// each problem that carries `retry_after_seconds`.
pub struct RetryAfterSeconds;

impl utoipa::PartialSchema for RetryAfterSeconds {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
            .minimum(Some(1))
            .into()
    }
}

/// The schema of the `Idempotent-Replayed` header: only ever `true`. The
/// header itself is written by `mark_replayed`.
pub struct Replayed;

impl utoipa::PartialSchema for Replayed {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(["true"]))
            .into()
    }
}

/// The schema of the `Repeatability-Result` header (OASIS Repeatable
/// Requests 1.0): `accepted` or `rejected`.
pub struct RepeatabilityResult;

impl utoipa::PartialSchema for RepeatabilityResult {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(["accepted", "rejected"]))
            .into()
    }
}

/// Body of `POST /v1/reservations/{id}/commit`: the response to store.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CommitBody {
    /// HTTP status (100..=599).
    #[schema(minimum = 100, maximum = 599)]
    pub status: u16,
    /// Header lines as `[name, value]` pairs. Hop-by-hop and framing
    /// headers (`Connection` and what it names, `Keep-Alive`, `Proxy-*`,
    /// `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`, `Content-Length`)
    /// are never stored: a commit's are left out, and an operator's
    /// completion that names one is refused (`400 invalid-request`).
    #[serde(default, deserialize_with = "header_pairs")]
    #[schema(schema_with = header_lines)]
    pub headers: Vec<(String, String)>,
    /// The body as text.
    pub body: Option<String>,
    /// The body as base64, for bytes that are not text.
    pub body_base64: Option<String>,
}

/// The commit's body as the response to store, checked: a holder's commit,
/// or an operator's resolve that completes a key (which refuses a framing
/// header first, [`refuse_framing`]). Hop-by-hop and framing headers are
/// left out: never stored, whoever writes the record. A holder's commit
/// comes after its effect, so it is not refused for them (its key would be
/// left to its lease, and the effect without its record); what the holder
/// gets replayed is JSON, whose body a backend frames itself, and a
/// backend that copies a stored `Content-Length` or `Transfer-Encoding`
/// onto its own answer would desynchronise its own client.
pub(crate) fn stored_response(
    body: CommitBody,
    max_body: usize,
) -> Result<StoredResponse, ApiError> {
    if !(100..=599).contains(&body.status) {
        return Err(ApiError::InvalidRequest(format!(
            "status is {}; it must be between 100 and 599",
            body.status
        )));
    }
    for (name, value) in &body.headers {
        if HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(ApiError::InvalidRequest(format!(
                "{name:?} is not a valid header name"
            )));
        }
        if HeaderValue::from_str(value).is_err() {
            return Err(ApiError::InvalidRequest(format!(
                "the value of header {name:?} is not a valid header value"
            )));
        }
    }
    let bytes = match (body.body, body.body_base64) {
        (Some(_), Some(_)) => {
            return Err(ApiError::InvalidRequest(
                "send either body or body_base64, not both".into(),
            ));
        }
        (Some(text), None) => text.into_bytes(),
        (None, Some(b64)) => BASE64.decode(b64.as_bytes()).map_err(|e| {
            ApiError::InvalidRequest(format!("body_base64 is not valid base64: {e}"))
        })?,
        (None, None) => Vec::new(),
    };
    if bytes.len() > max_body {
        return Err(ApiError::PayloadTooLarge(format!(
            "the response body is {} bytes; the limit is {max_body} (IDEMGATE_MAX_BODY_BYTES)",
            bytes.len()
        )));
    }
    let mut headers = body.headers;
    headers.retain(|(name, _)| {
        HeaderName::from_bytes(name.as_bytes()).is_ok_and(|name| !is_framing(&name))
    });
    Ok(StoredResponse {
        status: body.status,
        headers,
        body: bytes.into(),
    })
}

/// `400 invalid-request` naming the first hop-by-hop or framing header of an
/// operator's completion (`Content-Length`, `Transfer-Encoding`,
/// `Connection`, …): idemgate frames a replay itself and never replays one,
/// so the completion is refused rather than stored as something it is not.
pub(crate) fn refuse_framing(headers: &[(String, String)]) -> Result<(), ApiError> {
    for (name, _) in headers {
        if HeaderName::from_bytes(name.as_bytes()).is_ok_and(|name| is_framing(&name)) {
            return Err(ApiError::InvalidRequest(format!(
                "header {name:?} is a hop-by-hop or framing header: a replay is framed by its \
                 own body and never carries it; leave it out"
            )));
        }
    }
    Ok(())
}

/// Body of `POST /v1/reservations/{id}/extend`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendBody {
    /// New lease, counted from now (default: the default lease).
    #[schema(minimum = 1)]
    pub lease_seconds: Option<u32>,
}

/// Body of `POST /v1/reservations/{id}/unknown`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UnknownBody {
    /// Why the holder cannot tell whether its effect happened: what failed
    /// (an exception's type, "the provider timed out after the request was
    /// sent"), never a body or a secret. Kept with the record for the
    /// operator who settles it (1 to 1000 characters).
    #[schema(min_length = 1, max_length = 1000)]
    pub reason: String,
}

/// Why and when a key's holder marked it unknown.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct MarkedUnknownView {
    /// The holder's reason.
    pub reason: String,
    /// When it was marked.
    pub at: DateTime<Utc>,
}

impl From<&store::MarkedUnknown> for MarkedUnknownView {
    fn from(mark: &store::MarkedUnknown) -> MarkedUnknownView {
        MarkedUnknownView {
            reason: mark.reason.clone(),
            at: mark.at,
        }
    }
}

/// `200` of extend.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExtendedView {
    /// The reservation.
    pub reservation_id: Uuid,
    /// The new end of the lease.
    pub lease_expires_at: DateTime<Utc>,
}

/// The public view of a record: never the raw key.
#[derive(Debug, Serialize, ToSchema)]
pub struct RecordView {
    /// The reservation id asked about.
    pub reservation_id: Uuid,
    /// True while this id holds a live reservation of the key.
    pub live: bool,
    /// `in_flight`, `completed` or `unknown` (marked so by its holder, or
    /// held past its lease).
    pub state: KeyState,
    /// 1 for the first holder, more after takeovers.
    pub attempt: i32,
    /// The first 12 hex digits of SHA-256(key).
    pub key_hash_prefix: String,
    /// The request fingerprint, if known.
    pub fingerprint: Option<String>,
    /// When the current lease ends (in flight).
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The last recovery point.
    pub recovery: Option<Recovery>,
    /// The stored response (completed).
    pub response: Option<ResponseView>,
    /// When the key was first reserved.
    pub created_at: DateTime<Utc>,
    /// When the response was stored.
    pub completed_at: Option<DateTime<Utc>>,
    /// When the key is forgotten.
    pub expires_at: DateTime<Utc>,
    /// Why and when its holder marked it unknown, if it did.
    pub marked_unknown: Option<MarkedUnknownView>,
}

// === views of records ===

/// A stored response as its holder's tenant is given it back (a replay's
/// JSON, the record's view): without a hop-by-hop or framing header, which
/// a record written before commits left them out may hold, so that a
/// backend that answers with these headers frames its body itself.
pub(super) fn response_view(response: &StoredResponse) -> ResponseView {
    let (body, body_base64) = match std::str::from_utf8(&response.body) {
        Ok(text) => (Some(text.to_owned()), None),
        Err(_) => (None, Some(BASE64.encode(&response.body))),
    };
    let headers = response
        .headers
        .iter()
        .filter(|(name, _)| {
            HeaderName::from_bytes(name.as_bytes()).is_ok_and(|name| !is_framing(&name))
        })
        .cloned()
        .collect();
    ResponseView {
        status: response.status,
        headers,
        body,
        body_base64,
    }
}

/// `200` with the completed record and `Idempotency-Expires`.
pub(super) fn completed_response(record: &Record) -> Response {
    let empty = StoredResponse {
        status: 0,
        headers: Vec::new(),
        body: bytes::Bytes::new(),
    };
    let view = CompletedView {
        state: CompletedState::Completed,
        response: response_view(record.response.as_ref().unwrap_or(&empty)),
        completed_at: record.completed_at,
        expires_at: record.expires_at,
    };
    let mut res = (StatusCode::OK, axum::Json(view)).into_response();
    set_expires(res.headers_mut(), record.expires_at);
    res
}

/// The public view of `record` at `now` as seen through reservation `id`.
pub(super) fn record_view(id: Uuid, record: &Record, live: bool, now: DateTime<Utc>) -> RecordView {
    RecordView {
        reservation_id: id,
        live,
        state: record.effective_state(now).into(),
        attempt: record.attempt,
        key_hash_prefix: crate::key::hash_prefix(&record.key_hash),
        fingerprint: record.fingerprint.clone(),
        lease_expires_at: record.lease_expires_at,
        recovery: record.recovery.clone().map(Recovery::from),
        response: record.response.as_ref().map(response_view),
        created_at: record.created_at,
        completed_at: record.completed_at,
        expires_at: record.expires_at,
        marked_unknown: record.marked_unknown.as_ref().map(MarkedUnknownView::from),
    }
}

/// The schema of header lines: an array of `[name, value]` pairs, each
/// exactly two strings.
///
/// A pair is a tuple (`prefixItems`), so that generators type it as
/// `[string, string]` rather than `string[]`. `maxItems` forbids a third
/// item, so `items` could be `false` and mean the same; it is
/// `{"type": "string"}` because openapi-python-client refuses a whole
/// document that holds a boolean schema.
fn header_lines() -> utoipa::openapi::schema::Array {
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Type};
    let string = || ObjectBuilder::new().schema_type(Type::String).build();
    let pair = ArrayBuilder::new()
        .prefix_items([string(), string()])
        .items(string())
        .min_items(Some(2))
        .max_items(Some(2));
    ArrayBuilder::new()
        .items(pair)
        .description(Some("Header lines as `[name, value]` pairs."))
        .build()
}

/// Reads the header lines of a commit, each exactly `[name, value]`; any
/// other line is refused with its index, where serde's own reading of a pair
/// said only `trailing characters` or `invalid length`, naming neither the
/// field nor the line.
fn header_pairs<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<(String, String)>, D::Error> {
    struct Lines;

    impl<'de> Visitor<'de> for Lines {
        type Value = Vec<(String, String)>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an array of [name, value] pairs")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut lines = Vec::new();
            // Each line is read whole as a JSON value first, so that a wrong
            // one is named by its index whatever shape it has.
            while let Some(line) = seq.next_element::<serde_json::Value>()? {
                let pair = serde_json::from_value::<(String, String)>(line).map_err(|_| {
                    de::Error::custom(format!(
                        "headers[{}] must be [name, value] (two strings)",
                        lines.len()
                    ))
                })?;
                lines.push(pair);
            }
            Ok(lines)
        }
    }

    deserializer.deserialize_seq(Lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn commit(json: &str) -> Result<CommitBody, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn header_lines_read_as_pairs_or_not_at_all() {
        let body = commit(r#"{"status":200,"headers":[["a","1"],["b",""]]}"#).unwrap();
        assert_eq!(
            body.headers,
            [("a".into(), "1".into()), ("b".into(), String::new())]
        );
        assert!(commit(r#"{"status":200}"#).unwrap().headers.is_empty());
        assert!(
            commit(r#"{"status":200,"headers":[]}"#)
                .unwrap()
                .headers
                .is_empty()
        );
        for (json, index) in [
            (r#"{"status":200,"headers":[["a","1","2"]]}"#, 0),
            (r#"{"status":200,"headers":[["a","1"],["b"]]}"#, 1),
            (
                r#"{"status":200,"headers":[["a","1"],["b","2"],[1,"3"]]}"#,
                2,
            ),
        ] {
            let error = commit(json).unwrap_err();
            assert!(
                error.starts_with(&format!("headers[{index}] must be [name, value]")),
                "{json}: {error}"
            );
        }
        assert!(commit(r#"{"status":200,"headers":{"a":"1"}}"#).is_err());
    }
}

// === the wire forms of the engine's and the store's types ===

/// The state of a key's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum KeyState {
    /// Reserved: a holder owns the effect and has not committed its result yet.
    InFlight,
    /// The result is stored and is replayed to every retry.
    Completed,
    /// Whether the effect happened is unknown (the holder said so, or its
    /// lease ended under `hold`): refused until its holder or an operator
    /// settles it.
    Unknown,
}

impl From<store::KeyState> for KeyState {
    fn from(state: store::KeyState) -> KeyState {
        match state {
            store::KeyState::InFlight => KeyState::InFlight,
            store::KeyState::Completed => KeyState::Completed,
            store::KeyState::Unknown => KeyState::Unknown,
        }
    }
}

/// What a lease that ends without news means for its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LeaseExpiry {
    /// The next request takes the key over, with the last recovery point.
    Takeover,
    /// The outcome is unknown: the key is not run again until settled.
    Hold,
}

impl From<LeaseExpiry> for store::LeaseExpiry {
    fn from(choice: LeaseExpiry) -> store::LeaseExpiry {
        match choice {
            LeaseExpiry::Takeover => store::LeaseExpiry::Takeover,
            LeaseExpiry::Hold => store::LeaseExpiry::Hold,
        }
    }
}

impl From<store::LeaseExpiry> for LeaseExpiry {
    fn from(choice: store::LeaseExpiry) -> LeaseExpiry {
        match choice {
            store::LeaseExpiry::Takeover => LeaseExpiry::Takeover,
            store::LeaseExpiry::Hold => LeaseExpiry::Hold,
        }
    }
}

/// Progress recorded by a holder inside a multi-step effect, handed to whoever
/// takes the key over after a crash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Recovery {
    /// The name of the last step that completed (1 to 255 characters).
    #[schema(min_length = 1, max_length = 255)]
    pub recovery_point: String,
    /// Whatever the holder needs to resume from that step: any JSON value.
    #[serde(default)]
    #[schema(value_type = Value, required = false)]
    pub data: Option<serde_json::Value>,
}

impl From<store::Recovery> for Recovery {
    fn from(r: store::Recovery) -> Recovery {
        Recovery {
            recovery_point: r.recovery_point,
            data: r.data,
        }
    }
}

impl From<Recovery> for store::Recovery {
    fn from(r: Recovery) -> store::Recovery {
        store::Recovery {
            recovery_point: r.recovery_point,
            data: r.data,
        }
    }
}

/// Which shape of key the server requires, beyond the generic rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum KeyFormat {
    /// Any key that satisfies the generic rules.
    Any,
    /// The key must be a UUID in its hyphenated form (`8e03978e-40d5-43e8-bc93-6894a57f9324`).
    Uuid,
}

impl From<crate::key::KeyFormat> for KeyFormat {
    fn from(format: crate::key::KeyFormat) -> KeyFormat {
        match format {
            crate::key::KeyFormat::Any => KeyFormat::Any,
            crate::key::KeyFormat::Uuid => KeyFormat::Uuid,
        }
    }
}
