//! The request fingerprint: a SHA-256 that tells a genuine retry from a key reused for another request.
//!
//! The published policy is [`METHOD`]. In detail, the fingerprint is the lowercase hex SHA-256 of
//! this byte string (`‖` is concatenation):
//!
//! ```text
//! "idemgate-fp-v1\n" ‖ field(method) ‖ field(target) ‖ field(kind) ‖ field(body)
//! field(x) = decimal byte length of x ‖ ":" ‖ x ‖ "\n"
//! ```
//!
//! The length prefixes make the framing unambiguous whatever bytes the fields hold (a path
//! given through the reservation API may contain anything, newlines included).
//!
//! - `method` is ASCII-uppercased.
//! - `target` is the path, then, if the query has any non-empty parameter, `?` and the
//!   `&`-separated parameters sorted bytewise as raw strings (no percent-decoding, empty
//!   segments dropped). The path is split at its first `?`.
//! - `kind` and `body` depend on the media type (parameters such as `charset` are ignored,
//!   matching is case-insensitive):
//!   - `json` for `application/json` or any `*/*+json` type whose body parses as JSON: the
//!     RFC 8785 (JCS) canonical text after removing the members named by the configured
//!     RFC 6901 JSON Pointers, so a re-ordered or re-indented retry has the same fingerprint;
//!   - `form` for `application/x-www-form-urlencoded` bodies that decode to UTF-8: the pairs
//!     sorted by (name, value) and re-encoded;
//!   - `bytes` otherwise, including JSON or form bodies that fail to parse: the raw bytes.
//!     Bad input never makes fingerprinting fail.
//!
//! Ignored pointers are applied in their configured order; an array index removes that element
//! (shifting the following ones), and a pointer that matches nothing is skipped.
//!
//! Integers beyond 2^53 are kept exact, as `serde_json` parsed them, rather than rounded to the
//! nearest double as strict JCS would: two bodies that differ only there stay distinct.

use std::fmt;
use std::str::FromStr;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The fingerprint method, as published in the policy document.
pub const METHOD: &str = "sha256 over method, path with sorted query, and the body (RFC 8785 JCS for JSON, sorted pairs for forms, raw bytes otherwise)";

/// Framing version; bump it whenever the canonical form changes, so old and new never collide.
const VERSION_TAG: &[u8] = b"idemgate-fp-v1\n";

/// What goes into the fingerprint besides the request itself.
#[derive(Debug, Clone, Default)]
pub struct FingerprintPolicy {
    /// JSON members removed before hashing, e.g. client timestamps that change on every retry.
    pub ignore: Vec<JsonPointer>,
}

/// A parsed RFC 6901 pointer.
///
/// Only non-empty pointers (starting with `/`) are accepted: the empty pointer names the whole
/// document, and ignoring the whole body is not a useful policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPointer {
    raw: String,
    // Reference tokens with `~1` and `~0` already decoded.
    tokens: Vec<String>,
}

impl JsonPointer {
    /// Parses a pointer such as `/metadata/trace_id` or `/a~1b` (the member `a/b`).
    ///
    /// # Errors
    /// A message naming the problem when the pointer does not start with `/` or has a `~` not
    /// followed by `0` or `1`.
    pub fn parse(s: &str) -> Result<JsonPointer, String> {
        let Some(rest) = s.strip_prefix('/') else {
            return Err(if s.is_empty() {
                "a JSON Pointer to ignore must not be empty; it must start with '/', e.g. /sent_at"
                    .to_owned()
            } else {
                format!("the JSON Pointer {s:?} must start with '/', e.g. /{s}")
            });
        };
        let tokens = rest
            .split('/')
            .map(|token| unescape_token(token).map_err(|e| format!("the JSON Pointer {s:?} {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(JsonPointer {
            raw: s.to_owned(),
            tokens,
        })
    }

    /// The pointer as written, escapes included.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.raw
    }
}

impl FromStr for JsonPointer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.raw)
    }
}

/// Decodes `~1` to `/` and `~0` to `~` in one left-to-right pass, so `~01` becomes `~1`, as RFC 6901 requires.
fn unescape_token(token: &str) -> Result<String, String> {
    let mut out = String::with_capacity(token.len());
    let mut chars = token.chars();
    while let Some(c) = chars.next() {
        if c == '~' {
            match chars.next() {
                Some('0') => out.push('~'),
                Some('1') => out.push('/'),
                _ => {
                    return Err(
                        "has a '~' not followed by '0' or '1' (write ~0 for '~' and ~1 for '/')"
                            .to_owned(),
                    );
                }
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// Parses an RFC 6901 array index: `0` or digits without a leading zero. `-` (past the end)
/// and anything else match no element.
fn array_index(token: &str) -> Option<usize> {
    let valid = !token.is_empty()
        && token.bytes().all(|b| b.is_ascii_digit())
        && (token == "0" || !token.starts_with('0'));
    if valid { token.parse().ok() } else { None }
}

/// Removes the member or element `pointer` names, if any.
fn remove_pointer(value: &mut Value, pointer: &JsonPointer) {
    let Some((last, parents)) = pointer.tokens.split_last() else {
        return;
    };
    let mut current = value;
    for token in parents {
        let next = match current {
            Value::Object(map) => map.get_mut(token.as_str()),
            Value::Array(items) => array_index(token).and_then(|i| items.get_mut(i)),
            _ => None,
        };
        match next {
            Some(v) => current = v,
            None => return,
        }
    }
    match current {
        Value::Object(map) => {
            map.remove(last.as_str());
        }
        Value::Array(items) => {
            if let Some(i) = array_index(last).filter(|&i| i < items.len()) {
                items.remove(i);
            }
        }
        _ => {}
    }
}

fn apply_ignores(value: &mut Value, policy: &FingerprintPolicy) {
    for pointer in &policy.ignore {
        remove_pointer(value, pointer);
    }
}

/// JCS text of `value`, already stripped of ignored members.
fn jcs(value: &Value) -> String {
    // A `serde_json::Value` always has string keys and finite numbers, so JCS cannot fail on
    // it; should it ever, the compact serde_json text is still deterministic.
    serde_json_canonicalizer::to_string(value).unwrap_or_else(|_| value.to_string())
}

/// RFC 8785 canonical text of a JSON value after removing the ignored members.
#[must_use]
pub fn canonical_json(value: &Value, policy: &FingerprintPolicy) -> String {
    if policy.ignore.is_empty() {
        return jcs(value);
    }
    let mut stripped = value.clone();
    apply_ignores(&mut stripped, policy);
    jcs(&stripped)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MediaKind {
    Json,
    Form,
    Other,
}

/// Classifies a `Content-Type` value by its essence (type/subtype), ignoring parameters and case.
fn media_kind(content_type: Option<&str>) -> MediaKind {
    let Some(ct) = content_type else {
        return MediaKind::Other;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let Some((ty, subtype)) = essence.split_once('/') else {
        return MediaKind::Other;
    };
    if ty.is_empty() {
        MediaKind::Other
    } else if (ty == "application" && subtype == "json")
        || (subtype.len() > "+json".len() && subtype.ends_with("+json"))
    {
        MediaKind::Json
    } else if ty == "application" && subtype == "x-www-form-urlencoded" {
        MediaKind::Form
    } else {
        MediaKind::Other
    }
}

/// Sorted, re-encoded form pairs, or `None` when the body does not decode to UTF-8.
fn canonical_form(body: &[u8]) -> Option<Vec<u8>> {
    // form_urlencoded decodes lossily: two different invalid byte sequences would both become
    // U+FFFD and collide. A body whose decoding holds U+FFFD is therefore hashed as bytes.
    let mut pairs = Vec::new();
    for (name, value) in form_urlencoded::parse(body) {
        if name.contains('\u{FFFD}') || value.contains('\u{FFFD}') {
            return None;
        }
        pairs.push((name, value));
    }
    pairs.sort();
    let encoded = form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish();
    Some(encoded.into_bytes())
}

/// The path followed by its query parameters sorted bytewise; no `?` when there are none.
fn canonical_target(path_and_query: &str) -> String {
    let Some((path, query)) = path_and_query.split_once('?') else {
        return path_and_query.to_owned();
    };
    let mut params: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
    if params.is_empty() {
        return path.to_owned();
    }
    params.sort_unstable();
    format!("{path}?{}", params.join("&"))
}

fn push_field(buf: &mut Vec<u8>, field: &[u8]) {
    buf.extend_from_slice(field.len().to_string().as_bytes());
    buf.push(b':');
    buf.extend_from_slice(field);
    buf.push(b'\n');
}

fn digest(method: &str, path_and_query: &str, kind: &str, body: &[u8]) -> String {
    let method = method.to_ascii_uppercase();
    let target = canonical_target(path_and_query);
    let mut buf =
        Vec::with_capacity(VERSION_TAG.len() + method.len() + target.len() + body.len() + 48);
    buf.extend_from_slice(VERSION_TAG);
    push_field(&mut buf, method.as_bytes());
    push_field(&mut buf, target.as_bytes());
    push_field(&mut buf, kind.as_bytes());
    push_field(&mut buf, body);
    hex::encode(Sha256::digest(&buf))
}

/// Fingerprints a request as received: `content_type` is the raw `Content-Type` value, if any.
///
/// Never fails: a body that does not parse as its media type says is hashed as bytes.
#[must_use]
pub fn fingerprint_request(
    method: &str,
    path_and_query: &str,
    content_type: Option<&str>,
    body: &[u8],
    policy: &FingerprintPolicy,
) -> String {
    match media_kind(content_type) {
        MediaKind::Json => {
            if let Ok(mut value) = serde_json::from_slice::<Value>(body) {
                apply_ignores(&mut value, policy);
                return digest(method, path_and_query, "json", jcs(&value).as_bytes());
            }
        }
        MediaKind::Form => {
            if let Some(form) = canonical_form(body) {
                return digest(method, path_and_query, "form", &form);
            }
        }
        MediaKind::Other => {}
    }
    digest(method, path_and_query, "bytes", body)
}

/// Fingerprints a request described through the reservation API, whose body is a JSON value.
///
/// Equal by construction to [`fingerprint_request`] with `application/json` and the value's
/// serialisation (or, for `None`, no content type and an empty body): the value is serialised
/// and goes through the same path, so even edge cases such as nesting beyond `serde_json`'s
/// parse depth fall back to bytes identically.
#[must_use]
pub fn fingerprint_json_request(
    method: &str,
    path_and_query: &str,
    body: Option<&Value>,
    policy: &FingerprintPolicy,
) -> String {
    match body {
        None => fingerprint_request(method, path_and_query, None, b"", policy),
        Some(value) => {
            // Serialising a Value cannot fail; the fallback only keeps this panic-free.
            let bytes =
                serde_json::to_vec(value).unwrap_or_else(|_| value.to_string().into_bytes());
            fingerprint_request(
                method,
                path_and_query,
                Some("application/json"),
                &bytes,
                policy,
            )
        }
    }
}

#[cfg(test)]
mod tests;
