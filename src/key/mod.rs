//! Parsing and validation of the `Idempotency-Key` request header (draft-ietf-httpapi-idempotency-key-header-07).
//!
//! The draft defines the value as an RFC 8941 sf-string (`"8e03978e-40d5-43e8-bc93-6894a57f9324"`).
//! Many clients (Stripe-style SDKs) send the key bare, without quotes, so a bare value of visible
//! ASCII is accepted too unless [`KeyPolicy::strict`] is set. The rules, in the order applied:
//!
//! 1. Optional whitespace (SP / HTAB) around the field value is trimmed, as for any HTTP field.
//! 2. An empty value, a non-ASCII byte or a control character makes the key invalid.
//! 3. A value starting with `"` is parsed as an sf-string, all or nothing: escapes other than
//!    `\"` and `\\`, a missing closing quote, trailing characters or parameters make it invalid.
//! 4. Any other value is a bare key: visible ASCII (0x21–0x7E) only, so no spaces; rejected in strict mode.
//! 5. The key is the unquoted value (`"abc"` and `abc` are the same key); it must be 1..=`max_len`
//!    characters long and, with [`KeyFormat::Uuid`], a hyphenated UUID.
//!
//! Error messages are shown to clients as problem details, so they are specific, but they never
//! echo the key: a key may carry data the client did not mean to have logged or reflected.
//! For the same reason [`IdempotencyKey`] prints only a prefix of the key's SHA-256.

use std::fmt;

use sha2::{Digest, Sha256};

pub mod dialect;

pub use dialect::{Dialect, Keyed};

/// Which shape of key the server requires, beyond the generic rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyFormat {
    /// Any key that satisfies the generic rules.
    #[default]
    Any,
    /// The key must be a UUID in its hyphenated form (`8e03978e-40d5-43e8-bc93-6894a57f9324`).
    Uuid,
}

/// How strictly keys are validated.
#[derive(Debug, Clone)]
pub struct KeyPolicy {
    /// When set, only the draft's sf-string form (`"abc"`) is accepted; a bare `abc` is invalid.
    pub strict: bool,
    /// The maximum length of the unquoted key, in characters (the key is ASCII, so also bytes).
    pub max_len: usize,
    /// The required key format.
    pub format: KeyFormat,
    /// Also take the key from `Repeatability-Request-ID` with
    /// `Repeatability-First-Sent` (OASIS Repeatable Requests 1.0), and
    /// answer those requests with `Repeatability-Result` ([`dialect`]).
    pub repeatability: bool,
}

impl Default for KeyPolicy {
    /// Lenient: bare keys accepted, at most 255 characters, any format.
    fn default() -> Self {
        Self {
            strict: false,
            max_len: 255,
            format: KeyFormat::Any,
            repeatability: false,
        }
    }
}

/// Why a request's idempotency key was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The header is absent.
    #[error("the Idempotency-Key header is required")]
    Missing,
    /// The header is present but malformed; the message is meant for the client and never
    /// contains the key itself.
    #[error("{0}")]
    Invalid(String),
}

fn invalid(msg: impl Into<String>) -> KeyError {
    KeyError::Invalid(msg.into())
}

/// A validated idempotency key.
///
/// Its `Debug` and `Display` output is `IdempotencyKey(<hash prefix>)`: the raw key is never
/// printed, so it cannot leak into logs by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    key: String,
    // Computed once: the hash is what storage and logs use, the raw key rarely.
    hash: [u8; 32],
}

impl IdempotencyKey {
    fn new(key: String) -> Self {
        let hash: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        Self { key, hash }
    }

    /// The unquoted key.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// SHA-256 of the unquoted key's bytes.
    #[must_use]
    pub fn hash(&self) -> [u8; 32] {
        self.hash
    }

    /// The key in the scope of keys a model chose ([`ModelKey`]): its hash
    /// becomes [`model_key_hash`]'s, which no key of the other scope has.
    #[must_use]
    pub fn in_model_scope(self) -> Self {
        let hash = model_key_hash(&self.key);
        Self {
            key: self.key,
            hash,
        }
    }

    /// The first 12 hex characters of [`hash`](Self::hash): the only form of the key logs may carry.
    #[must_use]
    pub fn hash_prefix(&self) -> String {
        hash_prefix(&self.hash)
    }
}

/// A request extension: the request's key was chosen by a model (an MCP
/// tool call's `idempotency_key` argument), not set by the client's code.
/// The layer keeps such keys in a scope of their own ([`model_key_hash`]),
/// so that a model can neither pre-empt, replay nor refuse a key a runtime
/// set, nor the other way round. Only a door inserts it; no header does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelKey;

/// What the hash of a model's key is taken over before the key: a NUL
/// byte, which no key has (keys are printable ASCII), so that no key's
/// plain SHA-256 is a model key's hash.
const MODEL_SCOPE: &[u8] = b"idemgate/model-key\0";

/// The hash a key a model chose is stored under: SHA-256 of
/// `idemgate/model-key`, a NUL byte, and the key. Keys a client's code
/// sends keep the SHA-256 of the key alone.
#[must_use]
pub fn model_key_hash(key: &str) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(MODEL_SCOPE);
    hasher.update(key.as_bytes());
    hasher.finalize().into()
}

/// The first 12 hex characters of a key hash (all of it, if shorter): the
/// only form of a key that logs and views may carry.
#[must_use]
pub fn hash_prefix(hash: &[u8]) -> String {
    hex::encode(&hash[..6.min(hash.len())])
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({})", self.hash_prefix())
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Parses and validates one `Idempotency-Key` field value.
///
/// `raw` is the field value's bytes as received (header values may hold any byte but CR, LF and NUL).
///
/// # Errors
/// [`KeyError::Invalid`] with a client-facing explanation when the value breaks any rule listed
/// in the [module documentation](self).
pub fn parse_value(raw: &[u8], policy: &KeyPolicy) -> Result<IdempotencyKey, KeyError> {
    let value = trim_ows(raw);
    if value.is_empty() {
        return Err(invalid("the Idempotency-Key header is empty"));
    }
    // Byte checks come first so that the messages below can assume printable ASCII.
    if !value.is_ascii() {
        return Err(invalid(
            "the key contains a non-ASCII byte; keys must be printable ASCII (0x20-0x7E)",
        ));
    }
    if value.iter().any(u8::is_ascii_control) {
        return Err(invalid(
            "the key contains a control character; keys must be printable ASCII (0x20-0x7E)",
        ));
    }

    let key = if value.first() == Some(&b'"') {
        parse_sf_string(value)?
    } else {
        parse_bare(value, policy)?
    };

    let len = key.len();
    if len == 0 {
        return Err(invalid(
            "the key is empty; it must be at least 1 character long",
        ));
    }
    if len > policy.max_len {
        return Err(invalid(format!(
            "the key is {len} characters long; the limit is {}",
            policy.max_len
        )));
    }
    if policy.format == KeyFormat::Uuid && !is_hyphenated_uuid(&key) {
        return Err(invalid(
            "the key must be a UUID in hyphenated form, e.g. \"8e03978e-40d5-43e8-bc93-6894a57f9324\" (this server takes UUID keys only)",
        ));
    }
    Ok(IdempotencyKey::new(key))
}

/// Reads the key from `headers` under `name`.
///
/// The proxy may be configured with another header name than `Idempotency-Key`, hence `name`.
///
/// # Errors
/// [`KeyError::Missing`] when no such header is present; [`KeyError::Invalid`] when it appears on
/// more than one line (the client's intent is ambiguous) or its value is invalid (see [`parse_value`]).
pub fn from_headers(
    headers: &http::HeaderMap,
    name: &http::HeaderName,
    policy: &KeyPolicy,
) -> Result<IdempotencyKey, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Err(KeyError::Missing);
    };
    if values.next().is_some() {
        return Err(invalid(format!(
            "the {} header appears more than once; send exactly one key",
            display_name(name)
        )));
    }
    parse_value(first.as_bytes(), policy)
}

/// `HeaderName` is stored lowercase; show the conventional spelling for the default name.
fn display_name(name: &http::HeaderName) -> &str {
    if name.as_str() == "idempotency-key" {
        "Idempotency-Key"
    } else {
        name.as_str()
    }
}

/// Strips HTTP optional whitespace (SP / HTAB) from both ends.
fn trim_ows(raw: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = raw.iter().position(|b| !is_ows(b)).unwrap_or(raw.len());
    let end = raw
        .iter()
        .rposition(|b| !is_ows(b))
        .map_or(start, |i| i + 1);
    raw.get(start..end).unwrap_or_default()
}

/// Parses a value that starts with `"` as an RFC 8941 item holding an sf-string, all or nothing.
fn parse_sf_string(value: &[u8]) -> Result<String, KeyError> {
    let item = sfv::Parser::new(value)
        .parse::<sfv::Item>()
        .map_err(|e| {
            // sfv's messages name the problem and a byte index, never the input itself.
            invalid(format!(
                "the key is not a valid sf-string: {e}; a quoted key is a single \"...\" string whose only escapes are \\\" and \\\\"
            ))
        })?;
    if !item.params.is_empty() {
        // The draft defines no parameters; accepting and dropping them would make `"a";x=1`
        // and `"a";x=2` silently collide.
        return Err(invalid(
            "the key must be a plain sf-string; parameters (\";name=value\") are not allowed",
        ));
    }
    match item.bare_item.as_string() {
        Some(s) => Ok(s.as_str().to_owned()),
        // Unreachable given the leading quote, but an error beats a panic.
        None => Err(invalid("the key must be an sf-string, e.g. \"abc\"")),
    }
}

/// Accepts a bare (unquoted) key of visible ASCII, outside strict mode.
fn parse_bare(value: &[u8], policy: &KeyPolicy) -> Result<String, KeyError> {
    if policy.strict {
        return Err(invalid(
            "a bare key is not accepted in strict mode: send it as a quoted sf-string, e.g. \"abc\"",
        ));
    }
    // Control and non-ASCII bytes were rejected already; what is left to refuse is the space.
    if value.contains(&b' ') {
        return Err(invalid(
            "a bare key cannot contain spaces; send it as a quoted sf-string, e.g. \"a b\"",
        ));
    }
    match std::str::from_utf8(value) {
        Ok(s) => Ok(s.to_owned()),
        Err(_) => Err(invalid("the key must be printable ASCII (0x20-0x7E)")),
    }
}

/// True for the 36-character hyphenated UUID form only; `uuid` alone would also accept the
/// simple, braced and URN forms, which would let one UUID be spelled several ways.
fn is_hyphenated_uuid(key: &str) -> bool {
    key.len() == 36 && uuid::Uuid::try_parse(key).is_ok()
}

#[cfg(test)]
mod tests;
