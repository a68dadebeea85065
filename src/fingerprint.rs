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
mod tests {
    use super::*;
    use serde_json::json;

    fn no_ignore() -> FingerprintPolicy {
        FingerprintPolicy::default()
    }

    fn ignoring(pointers: &[&str]) -> FingerprintPolicy {
        FingerprintPolicy {
            ignore: pointers
                .iter()
                .map(|p| JsonPointer::parse(p).expect("valid pointer"))
                .collect(),
        }
    }

    fn parse(text: &str) -> Value {
        serde_json::from_str(text).expect("valid JSON")
    }

    fn fp_json(body: &str, policy: &FingerprintPolicy) -> String {
        fingerprint_request(
            "POST",
            "/orders",
            Some("application/json"),
            body.as_bytes(),
            policy,
        )
    }

    #[test]
    fn rfc8785_section_3_2_2_example() {
        let input = r#"{
            "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
            "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
            "literals": [null, true, false]
        }"#;
        let want = "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"€$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";
        assert_eq!(canonical_json(&parse(input), &no_ignore()), want);
    }

    #[test]
    fn rfc8785_section_3_2_3_sorting() {
        let input = r#"{
            "\u20ac": "Euro Sign",
            "\r": "Carriage Return",
            "\ufb33": "Hebrew Letter Dalet With Dagesh",
            "1": "One",
            "\ud83d\ude00": "Emoji: Grinning Face",
            "\u0080": "Control",
            "\u00f6": "Latin Small Letter O With Diaeresis"
        }"#;
        let want = concat!(
            "{\"\\r\":\"Carriage Return\",",
            "\"1\":\"One\",",
            "\"\u{0080}\":\"Control\",",
            "\"\u{00f6}\":\"Latin Small Letter O With Diaeresis\",",
            "\"\u{20ac}\":\"Euro Sign\",",
            "\"\u{1f600}\":\"Emoji: Grinning Face\",",
            "\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
        );
        assert_eq!(canonical_json(&parse(input), &no_ignore()), want);
    }

    #[test]
    fn rfc8785_number_serialisation() {
        // Cases from RFC 8785 Appendix B and section 3.2.2.3.
        let cases = [
            ("0", "0"),
            ("-0", "0"),
            ("-0.0", "0"),
            ("1e21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("0.1", "0.1"),
            ("1e-7", "1e-7"),
            ("-1e-7", "-1e-7"),
            ("0.000001", "0.000001"),
            ("1.0", "1"),
            ("4.50", "4.5"),
            ("12e1", "120"),
            ("5e-324", "5e-324"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
            ("-1.7976931348623157e308", "-1.7976931348623157e+308"),
            ("9007199254740992", "9007199254740992"),
            ("295147905179352830000", "295147905179352830000"),
            ("333333333.33333329", "333333333.3333333"),
            ("1E30", "1e+30"),
            ("0.000000000000000000000000001", "1e-27"),
        ];
        for (input, want) in cases {
            assert_eq!(canonical_json(&parse(input), &no_ignore()), want, "{input}");
        }
    }

    #[test]
    fn reordered_and_reindented_json_matches() {
        let a = r#"{"amount":100,"currency":"EUR","items":[{"sku":"a","qty":1}]}"#;
        let b = "{\n  \"items\": [ { \"qty\": 1, \"sku\": \"a\" } ],\n  \"currency\": \"EUR\",\n  \"amount\": 1.0e2\n}\n";
        assert_eq!(fp_json(a, &no_ignore()), fp_json(b, &no_ignore()));
        let c = r#"{"amount":101,"currency":"EUR","items":[{"sku":"a","qty":1}]}"#;
        assert_ne!(fp_json(a, &no_ignore()), fp_json(c, &no_ignore()));
        // Array order is significant.
        assert_ne!(
            fp_json("[1,2]", &no_ignore()),
            fp_json("[2,1]", &no_ignore())
        );
    }

    #[test]
    fn json_media_types() {
        let compact = br#"{"a":1,"b":2}"#;
        let spaced = br#"{ "b": 2, "a": 1 }"#;
        let reference = fingerprint_request(
            "POST",
            "/x",
            Some("application/json"),
            compact,
            &no_ignore(),
        );
        for ct in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON;charset=UTF-8",
            " application/json ",
            "application/merge-patch+json",
            "application/problem+json; charset=utf-8",
            "APPLICATION/VND.API+JSON",
        ] {
            let got = fingerprint_request("POST", "/x", Some(ct), spaced, &no_ignore());
            assert_eq!(got, reference, "{ct}");
        }
        for ct in [
            "text/plain",
            "application/jsonx",
            "application/+json",
            "json",
            "application/octet-stream",
        ] {
            let got = fingerprint_request("POST", "/x", Some(ct), spaced, &no_ignore());
            assert_ne!(got, reference, "{ct} must not be treated as JSON");
        }
    }

    #[test]
    fn ignored_pointers() {
        let cases: Vec<(&str, &[&str], &str, &str)> = vec![
            (
                "top-level",
                &["/sent_at"],
                r#"{"a":1,"sent_at":"2024-01-01T00:00:00Z"}"#,
                r#"{"a":1}"#,
            ),
            (
                "nested",
                &["/metadata/trace_id"],
                r#"{"a":1,"metadata":{"trace_id":"x","k":"v"}}"#,
                r#"{"a":1,"metadata":{"k":"v"}}"#,
            ),
            ("~1 escape", &["/a~1b"], r#"{"a/b":1,"c":2}"#, r#"{"c":2}"#),
            ("~0 escape", &["/a~0b"], r#"{"a~b":1,"c":2}"#, r#"{"c":2}"#),
            (
                "~01 is ~1 literally",
                &["/a~01"],
                r#"{"a~1":1,"a/":2}"#,
                r#"{"a/":2}"#,
            ),
            (
                "array index",
                &["/items/1"],
                r#"{"items":[1,2,3]}"#,
                r#"{"items":[1,3]}"#,
            ),
            (
                "through an array",
                &["/items/0/ts"],
                r#"{"items":[{"ts":1,"v":2}]}"#,
                r#"{"items":[{"v":2}]}"#,
            ),
            ("empty member name", &["/"], r#"{"":1,"a":2}"#, r#"{"a":2}"#),
            ("missing member", &["/nope"], r#"{"a":1}"#, r#"{"a":1}"#),
            (
                "missing parent",
                &["/nope/deeper"],
                r#"{"a":1}"#,
                r#"{"a":1}"#,
            ),
            (
                "index out of range",
                &["/items/9"],
                r#"{"items":[1]}"#,
                r#"{"items":[1]}"#,
            ),
            (
                "leading-zero index",
                &["/items/01"],
                r#"{"items":[1,2]}"#,
                r#"{"items":[1,2]}"#,
            ),
            (
                "dash index",
                &["/items/-"],
                r#"{"items":[1,2]}"#,
                r#"{"items":[1,2]}"#,
            ),
            ("through a scalar", &["/a/b"], r#"{"a":1}"#, r#"{"a":1}"#),
            ("non-object document", &["/a"], "[1,2]", "[1,2]"),
            (
                "several, in order",
                &["/sent_at", "/metadata/trace_id"],
                r#"{"sent_at":1,"metadata":{"trace_id":2},"x":3}"#,
                r#"{"metadata":{},"x":3}"#,
            ),
        ];
        for (name, pointers, body, want) in cases {
            let policy = ignoring(pointers);
            assert_eq!(canonical_json(&parse(body), &policy), want, "{name}");
            assert_eq!(
                fp_json(body, &policy),
                fp_json(want, &no_ignore()),
                "{name}: fingerprint"
            );
        }
        // A retry differing only in an ignored member has the same fingerprint.
        let policy = ignoring(&["/sent_at"]);
        assert_eq!(
            fp_json(r#"{"a":1,"sent_at":"t1"}"#, &policy),
            fp_json(r#"{"sent_at":"t2","a":1}"#, &policy)
        );
        assert_ne!(
            fp_json(r#"{"a":1,"sent_at":"t1"}"#, &no_ignore()),
            fp_json(r#"{"a":1,"sent_at":"t2"}"#, &no_ignore())
        );
    }

    #[test]
    fn pointer_parsing() {
        let ok = JsonPointer::parse("/a~1b/~0/0").expect("valid");
        assert_eq!(ok.as_str(), "/a~1b/~0/0");
        assert_eq!(ok.tokens, ["a/b", "~", "0"]);
        assert_eq!(ok.to_string(), "/a~1b/~0/0");
        assert_eq!("/x".parse::<JsonPointer>(), JsonPointer::parse("/x"));

        let bad = [
            ("", "must not be empty"),
            ("sent_at", "must start with '/'"),
            ("/a~2", "'~'"),
            ("/a~", "'~'"),
        ];
        for (input, want) in bad {
            match JsonPointer::parse(input) {
                Ok(p) => panic!("{input:?} accepted as {p:?}"),
                Err(msg) => assert!(msg.contains(want), "{input:?}: {msg}"),
            }
        }
    }

    #[test]
    fn form_bodies() {
        let form = Some("application/x-www-form-urlencoded");
        let fp = |ct: Option<&str>, body: &str| {
            fingerprint_request("POST", "/f", ct, body.as_bytes(), &no_ignore())
        };
        let reference = fp(form, "a=1&b=2&b=1");
        assert_eq!(fp(form, "b=1&a=1&b=2"), reference);
        assert_eq!(fp(form, "b=2&b=1&a=1"), reference);
        assert_eq!(
            fp(
                Some("Application/X-WWW-Form-Urlencoded; charset=UTF-8"),
                "b=1&a=1&b=2"
            ),
            reference
        );
        // Encodings of the same text are the same pair.
        assert_eq!(fp(form, "q=a+b"), fp(form, "q=a%20b"));
        assert_ne!(fp(form, "a=1&b=2"), fp(form, "a=2&b=1"));
        assert_ne!(fp(form, "a=1"), fp(form, "a=1&a=1"));
        // Not a form type: order matters.
        assert_ne!(
            fp(Some("text/plain"), "a=1&b=2"),
            fp(Some("text/plain"), "b=2&a=1")
        );
        // Undecodable bytes fall back to raw bytes, so distinct ones stay distinct.
        assert_ne!(fp(form, "a=%FF"), fp(form, "a=%FE"));
        let raw = fingerprint_request("POST", "/f", form, b"a=\xff", &no_ignore());
        assert_eq!(
            raw,
            fingerprint_request("POST", "/f", None, b"a=\xff", &no_ignore())
        );
    }

    #[test]
    fn invalid_json_is_hashed_as_bytes() {
        let ct = Some("application/json");
        let bodies: [&[u8]; 6] = [b"{", b"{\"a\":1,}", b"\xff\xfe", b"1e400", b"[1] [2]", b""];
        for body in bodies {
            let a = fingerprint_request("POST", "/x", ct, body, &ignoring(&["/a"]));
            let b = fingerprint_request("POST", "/x", ct, body, &ignoring(&["/a"]));
            assert_eq!(a, b, "deterministic");
            assert_eq!(a.len(), 64);
            // Hashed as bytes: the same as without a content type.
            assert_eq!(
                a,
                fingerprint_request("POST", "/x", None, body, &no_ignore())
            );
        }
        assert_ne!(
            fingerprint_request("POST", "/x", ct, b"{", &no_ignore()),
            fingerprint_request("POST", "/x", ct, b"{{", &no_ignore())
        );
        // Nesting beyond serde_json's recursion limit is just invalid JSON here.
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        let _ = fingerprint_request("POST", "/x", ct, deep.as_bytes(), &no_ignore());
    }

    #[test]
    fn query_order_and_method_case() {
        let fp = |m: &str, p: &str| fingerprint_request(m, p, None, b"", &no_ignore());
        let reference = fp("POST", "/p?a=1&b=2");
        assert_eq!(fp("POST", "/p?b=2&a=1"), reference);
        assert_eq!(fp("POST", "/p?&b=2&&a=1&"), reference);
        assert_eq!(fp("post", "/p?a=1&b=2"), reference);
        assert_eq!(fp("Post", "/p?b=2&a=1"), reference);
        assert_ne!(fp("PUT", "/p?a=1&b=2"), reference);
        assert_ne!(fp("POST", "/p?a=1&b=3"), reference);
        assert_ne!(fp("POST", "/q?a=1&b=2"), reference);
        assert_eq!(fp("GET", "/p?"), fp("GET", "/p"));
        assert_eq!(fp("GET", "/p?&"), fp("GET", "/p"));
        // Raw segments: no decoding, so differently encoded queries differ.
        assert_ne!(fp("GET", "/p?q=a%20b"), fp("GET", "/p?q=a+b"));
        // Only the first '?' splits.
        assert_eq!(fp("GET", "/p?b=?&a=1"), fp("GET", "/p?a=1&b=?"));
        assert_eq!(canonical_target("/p?b=2&a=1&a=0"), "/p?a=0&a=1&b=2");
    }

    #[test]
    fn framing_is_unambiguous() {
        let fp =
            |m: &str, p: &str, body: &[u8]| fingerprint_request(m, p, None, body, &no_ignore());
        // Moving bytes between fields must change the digest.
        assert_ne!(fp("GET", "/a\n4:body", b""), fp("GET", "/a", b"body"));
        assert_ne!(fp("GE", "T/a", b""), fp("G", "ET/a", b""));
        // JSON, form and bytes with identical canonical bytes differ by their kind tag.
        let json = fingerprint_request("POST", "/", Some("application/json"), b"1", &no_ignore());
        let bytes = fingerprint_request("POST", "/", None, b"1", &no_ignore());
        assert_ne!(json, bytes);
    }

    #[test]
    fn output_is_lowercase_hex_sha256() {
        let got = fingerprint_request("GET", "/", None, b"", &no_ignore());
        assert_eq!(got.len(), 64);
        assert!(got.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
        // Pin the framing: this is the published v1 canonical form.
        let canonical = b"idemgate-fp-v1\n3:GET\n1:/\n5:bytes\n0:\n";
        assert_eq!(got, hex::encode(Sha256::digest(canonical)));
    }

    #[test]
    fn json_request_equals_request() {
        let policies = [no_ignore(), ignoring(&["/sent_at", "/items/0", "/m~1n"])];
        let values = [
            json!({"b": [1, 2.5, -0.0, 1e21], "a": "x", "sent_at": "t", "m/n": null}),
            json!({"items": [{"k": 1}, {"k": 2}], "u": 18_446_744_073_709_551_615u64}),
            json!([3, 2, 1]),
            json!("text"),
            json!(null),
            json!(1.0),
            json!({}),
        ];
        for policy in &policies {
            for value in &values {
                let bytes = serde_json::to_vec(value).expect("serialize");
                let via_request = fingerprint_request(
                    "post",
                    "/o?b=1&a=2",
                    Some("application/json"),
                    &bytes,
                    policy,
                );
                assert_eq!(
                    fingerprint_json_request("post", "/o?b=1&a=2", Some(value), policy),
                    via_request,
                    "{value}"
                );
                // And both are the canonical text, hashed as JSON.
                let canonical = canonical_json(value, policy);
                assert_eq!(
                    via_request,
                    digest("POST", "/o?b=1&a=2", "json", canonical.as_bytes())
                );
            }
            assert_eq!(
                fingerprint_json_request("GET", "/o", None, policy),
                fingerprint_request("GET", "/o", None, b"", policy)
            );
        }
    }

    #[test]
    fn method_constant() {
        assert!(METHOD.starts_with("sha256 over method, path with sorted query"));
    }
}
