//! Property tests (issue 6, "hostile and malformed input"): the key parser,
//! the request fingerprint, and the engine's state machine against a model.
//!
//! Case counts are kept modest so the file runs in seconds; `PROPTEST_CASES=N`
//! raises every property (the state machine included) to N cases:
//!
//! ```text
//! PROPTEST_CASES=2000 cargo test --test it properties::
//! ```
//!
//! The long coverage-guided runs are the `cargo fuzz` targets in `fuzz/`.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use common::backend::Backend;
use idemgate::engine::{
    Committed, Engine, Refusal, ReserveOutcome, ReserveRequest, Resolved, Settlement, TenantLimit,
    TenantLimits,
};
use idemgate::fingerprint::{
    FingerprintPolicy, JsonPointer, canonical_json, fingerprint_json_request, fingerprint_request,
};
use idemgate::key::{KeyError, KeyFormat, KeyPolicy, parse_value};
use idemgate::store::{LeaseExpiry, Recovery, ResolveAction, StoredResponse};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Map, Number, Value};
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// `PROPTEST_CASES`, or `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn config(default_cases: u32) -> Config {
    Config {
        cases: cases(default_cases),
        // No regression files in the tree: a failure prints its minimal case.
        failure_persistence: None,
        ..Config::default()
    }
}

// =============================================================================================
// The key parser
// =============================================================================================

fn lenient() -> KeyPolicy {
    KeyPolicy::default()
}

fn strict() -> KeyPolicy {
    KeyPolicy {
        strict: true,
        ..KeyPolicy::default()
    }
}

/// `s` as an RFC 8941 sf-string.
fn sf_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

#[track_caller]
fn assert_invalid(raw: &[u8], policy: &KeyPolicy) -> Result<String, TestCaseError> {
    match parse_value(raw, policy) {
        Err(KeyError::Invalid(msg)) => Ok(msg),
        Err(KeyError::Missing) => Err(TestCaseError::fail("Missing instead of Invalid")),
        Ok(key) => Err(TestCaseError::fail(format!("accepted as {key:?}"))),
    }
}

/// Visible ASCII that does not start with `"`: a bare key.
fn bare_key(max: usize) -> impl Strategy<Value = String> {
    proptest::string::string_regex(&format!("[!#-~][!-~]{{0,{}}}", max - 1)).expect("regex")
}

/// One byte that is not ASCII.
fn non_ascii_byte() -> impl Strategy<Value = u8> {
    0x80u8..=0xFF
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn key_sf_string_round_trips(s in "[ -~]{1,255}", pad_l in "[ \t]{0,3}", pad_r in "[ \t]{0,3}") {
        let raw = format!("{pad_l}{}{pad_r}", sf_quote(&s));
        for policy in [lenient(), strict()] {
            let key = parse_value(raw.as_bytes(), &policy)
                .map_err(|e| TestCaseError::fail(format!("{e}")))?;
            prop_assert_eq!(key.as_str(), s.as_str());
            let want: [u8; 32] = Sha256::digest(s.as_bytes()).into();
            prop_assert_eq!(key.hash(), want);
        }
    }

    #[test]
    fn key_bare_is_itself_and_refused_in_strict_mode(s in bare_key(255)) {
        let bare = parse_value(s.as_bytes(), &lenient())
            .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(bare.as_str(), s.as_str());
        // "abc" and abc are the same key.
        let quoted = parse_value(sf_quote(&s).as_bytes(), &lenient())
            .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(&quoted, &bare);
        prop_assert_eq!(quoted.hash(), bare.hash());
        let msg = assert_invalid(s.as_bytes(), &strict())?;
        prop_assert!(msg.contains("strict mode"), "{}", msg);
    }

    #[test]
    fn key_over_the_limit_is_invalid(s in "[a-z0-9]{256,400}", max in 1usize..=255) {
        let policy = KeyPolicy { max_len: max, ..lenient() };
        for raw in [s.clone(), sf_quote(&s)] {
            let msg = assert_invalid(raw.as_bytes(), &policy)?;
            prop_assert!(msg.contains(&format!("the limit is {max}")), "{}", msg);
            // Never echoes the key.
            prop_assert!(!msg.contains(&s));
        }
        // The default limit is 255.
        assert_invalid(s.as_bytes(), &lenient())?;
    }

    #[test]
    fn key_empty_values_are_invalid(ows in "[ \t]{0,8}") {
        for policy in [lenient(), strict()] {
            assert_invalid(ows.as_bytes(), &policy)?;
            assert_invalid(format!("{ows}\"\"{ows}").as_bytes(), &policy)?;
        }
    }

    #[test]
    fn key_non_ascii_is_invalid(s in "[ -~]{0,40}", at in any::<prop::sample::Index>(), b in non_ascii_byte()) {
        for form in [s.clone(), sf_quote(&s)] {
            let mut raw = form.into_bytes();
            raw.insert(at.index(raw.len() + 1), b);
            for policy in [lenient(), strict()] {
                let msg = assert_invalid(&raw, &policy)?;
                prop_assert!(msg.contains("non-ASCII"), "{}", msg);
            }
        }
    }

    #[test]
    fn key_malformed_quoting_is_invalid(
        s in "[ -~]{0,40}",
        trailer in "[!-~]{1,5}",
        bad_escape in "[ -~]".prop_filter("not an escape", |c| c != "\"" && c != "\\"),
    ) {
        let quoted = sf_quote(&s);
        // Unterminated: the closing quote dropped.
        let unterminated = &quoted[..quoted.len() - 1];
        // Anything but OWS after the closing quote (parameters included).
        let trailing = format!("{quoted}{trailer}");
        // An escape other than \" and \\.
        let escaped = format!("{unterminated}\\{bad_escape}\"");
        for raw in [unterminated, trailing.as_str(), escaped.as_str()] {
            for policy in [lenient(), strict()] {
                assert_invalid(raw.as_bytes(), &policy)?;
            }
        }
    }

    #[test]
    fn key_arbitrary_bytes_never_panic(raw in prop::collection::vec(any::<u8>(), 0..300)) {
        let uuid = KeyPolicy { format: KeyFormat::Uuid, ..lenient() };
        for policy in [lenient(), strict(), uuid] {
            match parse_value(&raw, &policy) {
                Ok(key) => {
                    // Whatever is accepted is 1..=255 printable ASCII characters.
                    let k = key.as_str();
                    prop_assert!((1..=255).contains(&k.len()));
                    prop_assert!(k.bytes().all(|b| (0x20..=0x7E).contains(&b)));
                }
                Err(KeyError::Invalid(_)) => {}
                Err(KeyError::Missing) => prop_assert!(false, "Missing from parse_value"),
            }
        }
    }

    #[test]
    fn key_mostly_valid_bytes_never_panic(raw in r#"[ -~\t"\\;=]{0,60}"#) {
        // Denser in the interesting characters than arbitrary bytes.
        for policy in [lenient(), strict()] {
            let _ = parse_value(raw.as_bytes(), &policy);
        }
    }
}

// =============================================================================================
// The fingerprint
// =============================================================================================

/// JSON values with nested objects and arrays, unicode strings, integers of every size and
/// finite floats (including ones printed with exponents).
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| Value::Number(n.into())),
        any::<u64>().prop_map(|n| Value::Number(n.into())),
        any::<f64>()
            .prop_filter_map("finite", Number::from_f64)
            .prop_map(Value::Number),
        (-1000i32..1000, -30i32..30)
            .prop_filter_map("finite", |(m, e)| Number::from_f64(
                f64::from(m) * 10f64.powi(e)
            ))
            .prop_map(Value::Number),
        "\\PC{0,12}".prop_map(Value::String),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("\\PC{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A tiny deterministic generator for shuffles and whitespace, seeded by proptest.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn ws(&mut self) -> &'static str {
        [" ", "", "\n", "\t", "  ", "\r\n  "][self.below(6)]
    }
}

/// Writes `v` as JSON with object members shuffled, random insignificant whitespace, and
/// numbers spelled differently where the spelling keeps the value (`1.0` for `1`, exponent
/// form for floats).
fn render_scrambled(v: &Value, rng: &mut Lcg, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut members: Vec<_> = map.iter().collect();
            for i in (1..members.len()).rev() {
                members.swap(i, rng.below(i + 1));
            }
            out.push('{');
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(rng.ws());
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(rng.ws());
                out.push(':');
                out.push_str(rng.ws());
                render_scrambled(v, rng, out);
                out.push_str(rng.ws());
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(rng.ws());
                render_scrambled(v, rng, out);
            }
            out.push_str(rng.ws());
            out.push(']');
        }
        Value::Number(n) => {
            let exact_int = n
                .as_i64()
                .map(|i| i.unsigned_abs() < (1 << 53))
                .unwrap_or(false);
            match (exact_int, n.as_f64(), rng.below(2)) {
                (true, _, 0) => out.push_str(&format!("{n}.0")),
                (false, Some(f), 0) if n.is_f64() => out.push_str(&format!("{f:e}")),
                _ => out.push_str(&n.to_string()),
            }
        }
        other => out.push_str(&other.to_string()),
    }
}

fn fp_json_bytes(body: &[u8], policy: &FingerprintPolicy) -> String {
    fingerprint_request(
        "POST",
        "/orders?b=2&a=1",
        Some("application/json"),
        body,
        policy,
    )
}

/// Every leaf, as a JSON Pointer and the value there.
fn leaves(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                leaves(v, format!("{at}/{}", escape_token(k)), out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            for (i, v) in items.iter().enumerate() {
                leaves(v, format!("{at}/{i}"), out);
            }
        }
        _ => out.push(at),
    }
}

/// Every object member, as a JSON Pointer.
fn members(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                let p = format!("{at}/{}", escape_token(k));
                out.push(p.clone());
                members(v, p, out);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                members(v, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

fn escape_token(k: &str) -> String {
    k.replace('~', "~0").replace('/', "~1")
}

/// A value of another kind than `v`: certainly another canonical text.
fn other_kind(v: &Value) -> Value {
    match v {
        Value::Null => Value::Bool(false),
        Value::Bool(b) => Value::Bool(!b),
        Value::Number(n) => Value::String(n.to_string()),
        Value::String(_) => Value::Null,
        Value::Array(_) | Value::Object(_) => Value::Null,
    }
}

fn policy(pointers: &[&str]) -> FingerprintPolicy {
    FingerprintPolicy {
        ignore: pointers
            .iter()
            .map(|p| JsonPointer::parse(p).expect("valid pointer"))
            .collect(),
    }
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn fingerprint_ignores_member_order_and_whitespace(v in json_value(), seed in any::<u64>()) {
        let none = FingerprintPolicy::default();
        let compact = serde_json::to_vec(&v).expect("serialize");
        let pretty = serde_json::to_vec_pretty(&v).expect("serialize");
        let mut scrambled = String::new();
        render_scrambled(&v, &mut Lcg(seed), &mut scrambled);
        // The scrambled text is the same value once parsed (numbers compared canonically).
        let reparsed: Value = serde_json::from_str(&scrambled).expect("scrambled text parses");
        prop_assert_eq!(canonical_json(&reparsed, &none), canonical_json(&v, &none));

        let reference = fp_json_bytes(&compact, &none);
        prop_assert_eq!(&fp_json_bytes(&pretty, &none), &reference);
        prop_assert_eq!(&fp_json_bytes(scrambled.as_bytes(), &none), &reference, "{}", scrambled);
        prop_assert_eq!(
            &fingerprint_json_request("POST", "/orders?a=1&b=2", Some(&v), &none),
            &reference
        );
    }

    #[test]
    fn fingerprint_tells_different_values_apart(
        a in json_value(),
        b in json_value(),
        pick in any::<prop::sample::Index>(),
    ) {
        let none = FingerprintPolicy::default();
        // Two independent values: same fingerprint exactly when same canonical text.
        let same_text = canonical_json(&a, &none) == canonical_json(&b, &none);
        let fa = fingerprint_json_request("POST", "/x", Some(&a), &none);
        let fb = fingerprint_json_request("POST", "/x", Some(&b), &none);
        prop_assert_eq!(same_text, fa == fb);

        // One leaf changed anywhere in the tree changes the fingerprint.
        let mut paths = Vec::new();
        leaves(&a, String::new(), &mut paths);
        let path = &paths[pick.index(paths.len())];
        let mut changed = a.clone();
        let slot = changed.pointer_mut(path).expect("leaf exists");
        *slot = other_kind(slot);
        prop_assert_ne!(
            fingerprint_json_request("POST", "/x", Some(&changed), &none),
            fa,
            "changed at {:?}", path
        );
    }

    #[test]
    fn fingerprint_ignored_pointers_remove_exactly_their_members(
        v in json_value(),
        pick in any::<prop::sample::Index>(),
        extra in json_value(),
    ) {
        let mut found = Vec::new();
        members(&v, String::new(), &mut found);
        prop_assume!(!found.is_empty());
        let pointer = &found[pick.index(found.len())];
        let ignoring = policy(&[pointer]);
        let none = FingerprintPolicy::default();

        // The member removed by hand.
        let (parent, last) = pointer.rsplit_once('/').expect("pointer has a '/'");
        let last = last.replace("~1", "/").replace("~0", "~");
        let mut removed = v.clone();
        let parent_value = if parent.is_empty() {
            Some(&mut removed)
        } else {
            removed.pointer_mut(parent)
        };
        match parent_value {
            Some(Value::Object(map)) => {
                prop_assert!(map.remove(&last).is_some(), "{} names a member", pointer);
            }
            other => prop_assert!(false, "parent of {} is {:?}", pointer, other),
        }

        // Ignoring the pointer is removing that member, and nothing else.
        prop_assert_eq!(canonical_json(&v, &ignoring), canonical_json(&removed, &none));
        let body = serde_json::to_vec(&v).expect("serialize");
        let stripped = serde_json::to_vec(&removed).expect("serialize");
        prop_assert_eq!(fp_json_bytes(&body, &ignoring), fp_json_bytes(&stripped, &none));
        prop_assert_ne!(fp_json_bytes(&body, &ignoring), fp_json_bytes(&body, &none));

        // Whatever the ignored member holds, the fingerprint is the same.
        let mut other = v.clone();
        *other.pointer_mut(pointer).expect("member exists") = extra;
        let other_body = serde_json::to_vec(&other).expect("serialize");
        prop_assert_eq!(fp_json_bytes(&other_body, &ignoring), fp_json_bytes(&body, &ignoring));
    }

    #[test]
    fn fingerprint_form_bodies_ignore_pair_order(
        // U+FFFD excluded: the fingerprint takes it for a decoding error and hashes such a
        // form as bytes (see the module docs of `fingerprint`).
        pairs in prop::collection::vec(("\\PC{0,6}".prop_map(|s: String| s.replace('\u{FFFD}', "")), "\\PC{0,6}".prop_map(|s: String| s.replace('\u{FFFD}', ""))), 0..8),
        seed in any::<u64>(),
        pick in any::<prop::sample::Index>(),
    ) {
        let form = Some("application/x-www-form-urlencoded");
        let encode = |pairs: &[(String, String)]| {
            form_urlencoded::Serializer::new(String::new())
                .extend_pairs(pairs)
                .finish()
        };
        let fp = |body: &str| {
            fingerprint_request("POST", "/f", form, body.as_bytes(), &FingerprintPolicy::default())
        };
        let reference = fp(&encode(&pairs));
        let mut shuffled = pairs.clone();
        let mut rng = Lcg(seed);
        for i in (1..shuffled.len()).rev() {
            shuffled.swap(i, rng.below(i + 1));
        }
        prop_assert_eq!(fp(&encode(&shuffled)), reference.clone());
        // Percent-encoding every byte is the same form.
        let percent = shuffled
            .iter()
            .map(|(n, v)| {
                let enc = |s: &str| s.bytes().map(|b| format!("%{b:02X}")).collect::<String>();
                format!("{}={}", enc(n), enc(v))
            })
            .collect::<Vec<_>>()
            .join("&");
        prop_assert_eq!(fp(&percent), reference.clone());

        // A changed value is another form.
        if !pairs.is_empty() {
            let mut changed = pairs.clone();
            changed[pick.index(pairs.len())].1.push('!');
            prop_assert_ne!(fp(&encode(&changed)), reference);
        }
    }

    #[test]
    fn fingerprint_invalid_json_never_panics(
        body in prop::collection::vec(any::<u8>(), 0..200),
        ct in prop_oneof![
            Just("application/json"),
            Just("application/problem+json; charset=utf-8"),
            Just("application/x-www-form-urlencoded"),
        ],
    ) {
        let ignore = policy(&["/a", "/0", "/a/b"]);
        let got = fingerprint_request("POST", "/x", Some(ct), &body, &ignore);
        prop_assert_eq!(got.len(), 64);
        let is_json = ct.contains("json");
        if is_json && serde_json::from_slice::<Value>(&body).is_err() {
            // Hashed as bytes: the same as with no content type.
            prop_assert_eq!(
                got,
                fingerprint_request("POST", "/x", None, &body, &FingerprintPolicy::default())
            );
        }
    }

    #[test]
    fn fingerprint_jsonish_text_never_panics(body in r#"[\[\]{}",:0-9eE.+\- a-z\\]{0,80}"#) {
        let got = fp_json_bytes(body.as_bytes(), &policy(&["/a"]));
        prop_assert_eq!(got.len(), 64);
    }
}

// =============================================================================================
// The engine's state machine against a model
// =============================================================================================

const TENANT: &str = "props";
/// Every reservation's TTL, in seconds.
const TTL: i64 = 60;
/// Distinct keys the sequences use.
const KEYS: u8 = 2;
/// The id handle that stands for an id nobody issued.
const UNKNOWN: usize = usize::MAX;

/// Ids are named by how recently they were handed out (0: the latest), so
/// that most writes address a real reservation, current or stale; a handle
/// past those handed out, or [`UNKNOWN`], is an id nobody issued.
fn resolve(back: usize, issued: usize) -> usize {
    if back < issued {
        issued - 1 - back
    } else {
        UNKNOWN
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Reserve `key` with fingerprint `fp` (0: none) and a lease of `lease`
    /// s, choosing `hold` (or `takeover`) for its lease's end.
    Reserve {
        key: u8,
        fp: u8,
        lease: u32,
        hold: bool,
    },
    /// The holder `id` cannot tell what happened: it marks its key unknown.
    MarkUnknown {
        id: usize,
    },
    /// An operator settles `key`: completes it with response `tag`, or
    /// (`None`) releases it.
    Resolve {
        key: u8,
        tag: Option<u8>,
    },
    /// Commit reservation `id` (see [`resolve`]) with response `tag`.
    Commit {
        id: usize,
        tag: u8,
    },
    Release {
        id: usize,
    },
    Extend {
        id: usize,
        lease: u32,
    },
    Checkpoint {
        id: usize,
        point: u8,
    },
    /// The clock jumps forward by `secs`.
    Jump {
        secs: i64,
    },
    /// The pruning job's batch.
    Prune,
}

fn op() -> impl Strategy<Value = Op> {
    let id = prop_oneof![8 => 0usize..3, 1 => Just(UNKNOWN)];
    prop_oneof![
        5 => (0..KEYS, 0u8..3, prop::sample::select(vec![5u32, 10, 30]), any::<bool>())
            .prop_map(|(key, fp, lease, hold)| Op::Reserve { key, fp, lease, hold }),
        1 => id.clone().prop_map(|id| Op::MarkUnknown { id }),
        1 => (0..KEYS, prop::option::of(0u8..2)).prop_map(|(key, tag)| Op::Resolve { key, tag }),
        3 => (id.clone(), 0u8..2).prop_map(|(id, tag)| Op::Commit { id, tag }),
        1 => id.clone().prop_map(|id| Op::Release { id }),
        1 => (id.clone(), prop::sample::select(vec![5u32, 30])).prop_map(|(id, lease)| Op::Extend { id, lease }),
        1 => (id, 0u8..2).prop_map(|(id, point)| Op::Checkpoint { id, point }),
        2 => prop::sample::select(vec![3i64, 5, 12, 31, 61]).prop_map(|secs| Op::Jump { secs }),
        1 => Just(Op::Prune),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MState {
    InFlight,
    Completed,
    Unknown,
}

/// The model's record of one key. Times are seconds on the model's clock.
#[derive(Debug, Clone)]
struct MRecord {
    fp: Option<u8>,
    state: MState,
    /// Index of the current holder's id.
    holder: usize,
    lease_end: i64,
    attempt: i32,
    recovery: Option<u8>,
    response: Option<u8>,
    expires_at: i64,
    /// Its holder chose `hold` for its lease's end.
    hold: bool,
    /// An operator released it: expired at once, its row kept until pruned
    /// or claimed again, so settling it again is "not stuck".
    released: bool,
}

impl MRecord {
    /// Unknown at `now`: marked so, or held past its lease.
    fn unknown(&self, now: i64) -> bool {
        self.state == MState::Unknown
            || (self.state == MState::InFlight && self.hold && self.lease_end <= now)
    }
}

/// What each call must come to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expect {
    Reserved {
        attempt: i32,
        recovery: Option<u8>,
    },
    Completed {
        tag: u8,
    },
    /// A holder is in flight; its lease ends in this many seconds.
    InFlight {
        lease_left: i64,
    },
    Mismatch,
    Committed,
    AlreadyCommitted,
    Ok,
    Refused(Refusal),
    Pruned(u64),
    /// `429 tenant-limit` for in-flight keys.
    OverLimit {
        retry_after: u64,
    },
    /// `409 outcome-unknown`.
    Unknown,
    /// An operator's settlement applied.
    Resolved,
    /// An operator's settlement of a key that is not stuck.
    NotStuck,
    /// An operator's settlement of a key with no alive record.
    NoKey,
}

#[derive(Default)]
struct Model {
    /// The tenant's limit of live in-flight keys, if any.
    max_in_flight: Option<usize>,
    now: i64,
    records: HashMap<u8, MRecord>,
    /// The key of each id handed out, while its reservation row exists.
    ids: Vec<Option<u8>>,
}

impl Model {
    /// `Some(OverLimit)` when a claim now would pass the limit: the live
    /// in-flight keys (lease not ended, record not expired) fill it.
    fn over_limit(&self) -> Option<Expect> {
        let max = self.max_in_flight?;
        let live: Vec<i64> = self
            .records
            .values()
            .filter(|r| {
                r.state == MState::InFlight && r.lease_end > self.now && r.expires_at > self.now
            })
            .map(|r| r.lease_end)
            .collect();
        (live.len() >= max).then(|| Expect::OverLimit {
            retry_after: u64::try_from(live.iter().min().map_or(1, |end| end - self.now))
                .expect("live")
                .max(1),
        })
    }

    /// The key `id` holds in one of `states`, alive.
    fn holder_in(&self, id: usize, states: &[MState]) -> Option<u8> {
        let key = (*self.ids.get(id)?)?;
        let r = self.records.get(&key)?;
        (r.holder == id && states.contains(&r.state) && r.expires_at > self.now).then_some(key)
    }

    /// The key `id` holds in flight: what an extend, a checkpoint or a mark
    /// needs.
    fn live_holder(&self, id: usize) -> Option<u8> {
        self.holder_in(id, &[MState::InFlight])
    }

    /// The key `id` may settle by a commit or a release: in flight, or
    /// marked unknown by it.
    fn settling_holder(&self, id: usize) -> Option<u8> {
        self.holder_in(id, &[MState::InFlight, MState::Unknown])
    }

    /// Why a write by `id` is refused (the holder checks failed).
    fn refusal(&self, id: usize) -> Refusal {
        let Some(Some(key)) = self.ids.get(id) else {
            return Refusal::NotFound;
        };
        let Some(r) = self.records.get(key) else {
            return Refusal::NotFound;
        };
        if self.now >= r.expires_at {
            Refusal::Expired
        } else if r.holder != id {
            if r.attempt > 1 {
                Refusal::TakenOver
            } else {
                Refusal::Expired
            }
        } else if r.state == MState::Completed {
            Refusal::AlreadyCompleted
        } else {
            Refusal::Expired
        }
    }

    fn apply(&mut self, op: &Op) -> Expect {
        let now = self.now;
        match *op {
            Op::Reserve {
                key,
                fp,
                lease,
                hold,
            } => {
                let fp = (fp > 0).then_some(fp);
                let next_id = self.ids.len();
                let lease = i64::from(lease);
                let over_limit = self.over_limit();
                match self.records.get_mut(&key) {
                    Some(r) if r.expires_at > now => {
                        let compatible = r.fp.is_none() || fp.is_none() || r.fp == fp;
                        if r.state == MState::InFlight
                            && r.lease_end <= now
                            && !r.hold
                            && compatible
                        {
                            if let Some(limited) = over_limit {
                                return limited;
                            }
                            r.fp = r.fp.or(fp);
                            r.holder = next_id;
                            r.lease_end = now + lease;
                            r.attempt += 1;
                            r.hold = hold;
                            self.ids.push(Some(key));
                            Expect::Reserved {
                                attempt: r.attempt,
                                recovery: r.recovery,
                            }
                        } else if !compatible {
                            Expect::Mismatch
                        } else if r.unknown(now) {
                            Expect::Unknown
                        } else if r.state == MState::Completed {
                            Expect::Completed {
                                tag: r.response.expect("completed has a response"),
                            }
                        } else {
                            Expect::InFlight {
                                lease_left: r.lease_end - now,
                            }
                        }
                    }
                    // New, or expired: new again.
                    _ => {
                        if let Some(limited) = over_limit {
                            return limited;
                        }
                        self.records.insert(
                            key,
                            MRecord {
                                fp,
                                state: MState::InFlight,
                                holder: next_id,
                                lease_end: now + lease,
                                attempt: 1,
                                recovery: None,
                                response: None,
                                expires_at: now + TTL,
                                hold,
                                released: false,
                            },
                        );
                        self.ids.push(Some(key));
                        Expect::Reserved {
                            attempt: 1,
                            recovery: None,
                        }
                    }
                }
            }
            Op::Commit { id, tag } => {
                let id = resolve(id, self.ids.len());
                if let Some(key) = self.settling_holder(id) {
                    let r = self.records.get_mut(&key).expect("live");
                    r.state = MState::Completed;
                    r.response = Some(tag);
                    return Expect::Committed;
                }
                match self.refusal(id) {
                    Refusal::AlreadyCompleted => {
                        let key = self.ids[id].expect("found");
                        if self.records[&key].response == Some(tag) {
                            Expect::AlreadyCommitted
                        } else {
                            Expect::Refused(Refusal::AlreadyCompleted)
                        }
                    }
                    why => Expect::Refused(why),
                }
            }
            Op::Release { id } => {
                let id = resolve(id, self.ids.len());
                if let Some(key) = self.settling_holder(id) {
                    let r = self.records.get_mut(&key).expect("live");
                    r.expires_at = now;
                    r.lease_end = now;
                    return Expect::Ok;
                }
                Expect::Refused(self.refusal(id))
            }
            Op::Extend { id, lease } => {
                let id = resolve(id, self.ids.len());
                if let Some(key) = self.live_holder(id) {
                    self.records.get_mut(&key).expect("live").lease_end = now + i64::from(lease);
                    return Expect::Ok;
                }
                Expect::Refused(self.refusal(id))
            }
            Op::Checkpoint { id, point } => {
                let id = resolve(id, self.ids.len());
                if let Some(key) = self.live_holder(id) {
                    self.records.get_mut(&key).expect("live").recovery = Some(point);
                    return Expect::Ok;
                }
                Expect::Refused(self.refusal(id))
            }
            Op::MarkUnknown { id } => {
                let id = resolve(id, self.ids.len());
                // Marking again a key it marked already is no refusal.
                if let Some(key) = self.settling_holder(id) {
                    self.records.get_mut(&key).expect("live").state = MState::Unknown;
                    return Expect::Ok;
                }
                Expect::Refused(self.refusal(id))
            }
            Op::Resolve { key, tag } => {
                let Some(r) = self.records.get_mut(&key) else {
                    return Expect::NoKey;
                };
                if r.expires_at <= now {
                    return if r.released {
                        Expect::NotStuck
                    } else {
                        Expect::NoKey
                    };
                }
                let stuck = r.state == MState::Unknown
                    || (r.state == MState::InFlight && r.lease_end <= now);
                if !stuck {
                    return Expect::NotStuck;
                }
                match tag {
                    Some(tag) => {
                        r.state = MState::Completed;
                        r.response = Some(tag);
                    }
                    None => {
                        r.expires_at = now;
                        r.lease_end = now;
                        r.released = true;
                    }
                }
                Expect::Resolved
            }
            Op::Jump { secs } => {
                self.now += secs;
                Expect::Ok
            }
            Op::Prune => {
                let doomed: Vec<u8> = self
                    .records
                    .iter()
                    .filter(|(_, r)| r.expires_at <= now)
                    .map(|(k, _)| *k)
                    .collect();
                for key in &doomed {
                    self.records.remove(key);
                    for slot in &mut self.ids {
                        if *slot == Some(*key) {
                            *slot = None;
                        }
                    }
                }
                Expect::Pruned(doomed.len() as u64)
            }
        }
    }
}

/// The real engine, with a raw handle on its database to move the clock.
struct Subject {
    engine: Engine,
    raw: Raw,
    /// The ids handed out, by handle.
    ids: Vec<Uuid>,
}

enum Raw {
    Pg(idemgate::store::PgStore),
    Sqlite(idemgate::store::SqliteStore),
}

impl Raw {
    async fn exec(&self, pg: &'static str, sqlite: &'static str, secs: i64) {
        match self {
            Raw::Pg(s) => {
                sqlx::query(pg)
                    .bind(secs as f64)
                    .execute(s.pool())
                    .await
                    .expect("raw SQL");
            }
            Raw::Sqlite(s) => {
                sqlx::query(sqlite)
                    .bind(secs * 1000)
                    .execute(s.pool())
                    .await
                    .expect("raw SQL");
            }
        }
    }

    /// Every timestamp of every row moves `secs` into the past: as if the
    /// clock had jumped forward by `secs`.
    async fn jump(&self, secs: i64) {
        self.exec(
            "UPDATE idempotency_keys SET
                 lease_expires_at = lease_expires_at - make_interval(secs => $1),
                 expires_at = expires_at - make_interval(secs => $1),
                 created_at = created_at - make_interval(secs => $1),
                 completed_at = completed_at - make_interval(secs => $1)",
            "UPDATE idempotency_keys SET
                 lease_expires_at = lease_expires_at - ?1,
                 expires_at = expires_at - ?1,
                 created_at = created_at - ?1,
                 completed_at = completed_at - ?1",
            secs,
        )
        .await;
    }

    /// Empties both tables between cases.
    async fn reset(&self) {
        for sql in [
            "DELETE FROM idempotency_keys",
            "DELETE FROM idempotency_reservations",
        ] {
            match self {
                Raw::Pg(s) => sqlx::query(sql).execute(s.pool()).await.map(|_| ()),
                Raw::Sqlite(s) => sqlx::query(sql).execute(s.pool()).await.map(|_| ()),
            }
            .expect("reset");
        }
    }
}

fn store_err<T>(e: idemgate::store::StoreError) -> T {
    panic!("store error: {e}")
}

fn key_hash(key: u8) -> [u8; 32] {
    Sha256::digest([b'k', key]).into()
}

fn response(tag: u8) -> StoredResponse {
    StoredResponse {
        status: 200 + u16::from(tag),
        headers: vec![("x-tag".into(), tag.to_string())],
        body: vec![tag, 0xff].into(),
    }
}

impl Subject {
    fn id(&self, back: usize) -> Uuid {
        let handle = resolve(back, self.ids.len());
        self.ids.get(handle).copied().unwrap_or_else(Uuid::new_v4)
    }

    async fn apply(&mut self, op: &Op) -> Expect {
        match *op {
            Op::Reserve {
                key,
                fp,
                lease,
                hold,
            } => {
                let req = ReserveRequest {
                    on_lease_expiry: if hold {
                        LeaseExpiry::Hold
                    } else {
                        LeaseExpiry::Takeover
                    },
                    tenant: TENANT.into(),
                    tenant_from_credential: false,
                    key_hash: key_hash(key),
                    fingerprint: (fp > 0).then(|| format!("fp-{fp}")),
                    lease_seconds: lease,
                    ttl_seconds: TTL as u32,
                    wait: None,
                    request: None,
                };
                match self.engine.reserve(&req).await.unwrap_or_else(store_err) {
                    ReserveOutcome::Reserved(r) => {
                        self.ids.push(r.reservation_id);
                        Expect::Reserved {
                            attempt: r.attempt,
                            recovery: r.recovery.map(|rec| {
                                rec.recovery_point
                                    .strip_prefix("step-")
                                    .and_then(|n| n.parse().ok())
                                    .expect("a point this test wrote")
                            }),
                        }
                    }
                    ReserveOutcome::Completed(record) => {
                        let stored = record.response.expect("completed has a response");
                        let tag = stored.body[0];
                        assert_eq!(stored, response(tag), "the stored response round-trips");
                        Expect::Completed { tag }
                    }
                    ReserveOutcome::InFlight {
                        retry_after,
                        lease_expires_at,
                    } => {
                        // The lease's end is exact on the database's clock,
                        // which moves with the model's; this call took
                        // milliseconds, so the nearest second is the model's.
                        let ms = (lease_expires_at - chrono::Utc::now()).num_milliseconds();
                        let lease_left = (ms + 500).div_euclid(1000);
                        assert!(
                            retry_after >= 1
                                && i64::try_from(retry_after).unwrap() <= lease_left.max(1),
                            "Retry-After {retry_after} s, the lease ends in {lease_left} s"
                        );
                        Expect::InFlight { lease_left }
                    }
                    ReserveOutcome::Mismatch => Expect::Mismatch,
                    ReserveOutcome::Unknown { .. } => Expect::Unknown,
                    ReserveOutcome::OverLimit {
                        limit: TenantLimit::InFlightKeys,
                        retry_after,
                    } => Expect::OverLimit { retry_after },
                    ReserveOutcome::OverLimit { limit, .. } => panic!("no {limit:?} limit is set"),
                }
            }
            Op::Commit { id, tag } => {
                let id = self.id(id);
                match self.engine.commit(TENANT, id, &response(tag)).await {
                    Ok(Ok(Committed::Now(_))) => Expect::Committed,
                    Ok(Ok(Committed::Earlier(_))) => Expect::AlreadyCommitted,
                    Ok(Err(why)) => Expect::Refused(why),
                    Err(e) => store_err(e),
                }
            }
            Op::Release { id } => {
                let id = self.id(id);
                match self
                    .engine
                    .release(TENANT, id)
                    .await
                    .unwrap_or_else(store_err)
                {
                    Ok(()) => Expect::Ok,
                    Err(why) => Expect::Refused(why),
                }
            }
            Op::Extend { id, lease } => {
                let id = self.id(id);
                match self
                    .engine
                    .extend(TENANT, id, lease)
                    .await
                    .unwrap_or_else(store_err)
                {
                    Ok(_) => Expect::Ok,
                    Err(why) => Expect::Refused(why),
                }
            }
            Op::Checkpoint { id, point } => {
                let id = self.id(id);
                let recovery = Recovery {
                    recovery_point: format!("step-{point}"),
                    data: Some(serde_json::json!({ "point": point })),
                };
                match self
                    .engine
                    .checkpoint(TENANT, id, &recovery)
                    .await
                    .unwrap_or_else(store_err)
                {
                    Ok(record) => {
                        assert_eq!(record.recovery, Some(recovery), "checkpoint stored");
                        Expect::Ok
                    }
                    Err(why) => Expect::Refused(why),
                }
            }
            Op::MarkUnknown { id } => {
                let id = self.id(id);
                match self
                    .engine
                    .mark_unknown(TENANT, id, "the model marks it")
                    .await
                    .unwrap_or_else(store_err)
                {
                    Ok(()) => Expect::Ok,
                    Err(why) => Expect::Refused(why),
                }
            }
            Op::Resolve { key, tag } => {
                let settlement = Settlement {
                    action: match tag {
                        Some(_) => ResolveAction::Complete,
                        None => ResolveAction::Release,
                    },
                    response: tag.map(response),
                    reason: "the property test".into(),
                    by: "proptest".into(),
                };
                match self
                    .engine
                    .resolve(TENANT, &key_hash(key), &settlement)
                    .await
                    .unwrap_or_else(store_err)
                {
                    Resolved::Settled(found) => {
                        let resolution = found.record.resolution.expect("kept with the record");
                        assert_eq!(resolution.reason, "the property test");
                        assert_eq!(resolution.by, "proptest");
                        Expect::Resolved
                    }
                    Resolved::NotStuck(_) => Expect::NotStuck,
                    Resolved::NotFound => Expect::NoKey,
                }
            }
            Op::Jump { secs } => {
                self.raw.jump(secs).await;
                Expect::Ok
            }
            Op::Prune => Expect::Pruned(
                self.engine
                    .store()
                    .prune_expired_batch(1000)
                    .await
                    .map(|batch| batch.deleted)
                    .unwrap_or_else(store_err),
            ),
        }
    }
}

/// Runs the model-based property on `backend`: one database for the whole
/// test, emptied between cases.
fn state_machine(
    make: fn() -> std::pin::Pin<Box<dyn Future<Output = Backend>>>,
    max_in_flight: Option<u32>,
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let backend = rt.block_on(make());
    let (engine, raw) = rt.block_on(async {
        let raw = match &backend {
            Backend::Postgres(db) => Raw::Pg(Backend::open_pg(db).await),
            Backend::Sqlite(dir) => Raw::Sqlite(Backend::open_sqlite(dir).await),
        };
        // No replay cache: the clock jumps happen in the database only, and
        // every reserve must reach the store.
        (backend.engine().await, raw)
    });
    let engine: Arc<Engine> = Arc::new(engine);
    let raw = Arc::new(raw);

    let mut runner = TestRunner::new(config(64));
    let result = runner.run(&prop::collection::vec(op(), 1..=20), |ops| {
        rt.block_on(async {
            raw.reset().await;
            let mut model = Model {
                max_in_flight: max_in_flight.map(|m| m as usize),
                ..Model::default()
            };
            let mut subject = Subject {
                engine: Engine::new(Arc::clone(engine.store()), Default::default())
                    .with_replay_cache(0)
                    .with_tenant_limits(TenantLimits {
                        max_in_flight,
                        max_stored_bytes: None,
                    }),
                raw: match &*raw {
                    Raw::Pg(s) => Raw::Pg(s.clone()),
                    Raw::Sqlite(s) => Raw::Sqlite(s.clone()),
                },
                ids: Vec::new(),
            };
            for (step, op) in ops.iter().enumerate() {
                let want = model.apply(op);
                let got = subject.apply(op).await;
                prop_assert_eq!(&got, &want, "step {} {:?} of {:?}", step, op, ops);
            }
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    rt.block_on(async {
        drop(raw);
        drop(engine);
    });
    drop(backend);
}

#[test]
fn engine_matches_model_postgres() {
    state_machine(|| Box::pin(Backend::postgres()), None);
}

#[test]
fn engine_matches_model_sqlite() {
    state_machine(|| Box::pin(Backend::sqlite()), None);
}

/// The same, with the tenant limited to one live key in flight (of the two
/// keys): every claim the limit holds back is a 429 with the earliest
/// lease's end, and everything else is as without it.
#[test]
fn engine_with_an_in_flight_limit_matches_model_postgres() {
    state_machine(|| Box::pin(Backend::postgres()), Some(1));
}

#[test]
fn engine_with_an_in_flight_limit_matches_model_sqlite() {
    state_machine(|| Box::pin(Backend::sqlite()), Some(1));
}
