//! The two ways a request can name its key, and when its first attempt was
//! sent.
//!
//! - **`Idempotency-Key`** (the IETF draft), with idemgate's optional
//!   `Idempotency-First-Sent: <HTTP-date>`: when the request's first attempt
//!   went out.
//! - **`Repeatability-Request-ID`** with `Repeatability-First-Sent` (OASIS
//!   Repeatable Requests 1.0, as Azure services use them), and optionally
//!   `Repeatability-Client-ID`, which scopes the request id. Opt in
//!   ([`KeyPolicy::repeatability`]); a server without it ignores these
//!   headers, as the standard says a server that does not support them does.
//!
//! A key is new again once it expires, so a retry that comes after its key
//! was forgotten would execute a second time. A first-sent time closes that
//! hole: a request whose first attempt is older than the window the server
//! remembers keys for ([`window`]) may have executed and been forgotten, and
//! is refused ([`too_old`], answered `412`) rather than executed.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName};

use super::{IdempotencyKey, KeyError, KeyFormat, KeyPolicy, invalid, is_hyphenated_uuid};

/// `Idempotency-First-Sent`: when the request's first attempt was sent (an
/// HTTP-date); idemgate's own, for `Idempotency-Key` clients.
pub const IDEMPOTENCY_FIRST_SENT: HeaderName = HeaderName::from_static("idempotency-first-sent");
/// OASIS Repeatable Requests: the request's id, unique for all time.
pub const REPEATABILITY_REQUEST_ID: HeaderName =
    HeaderName::from_static("repeatability-request-id");
/// OASIS Repeatable Requests: the client the request id is unique within.
pub const REPEATABILITY_CLIENT_ID: HeaderName = HeaderName::from_static("repeatability-client-id");
/// OASIS Repeatable Requests: when the request was first sent (IMF-fixdate).
pub const REPEATABILITY_FIRST_SENT: HeaderName =
    HeaderName::from_static("repeatability-first-sent");
/// OASIS Repeatable Requests, on the response: `accepted` or `rejected`.
pub const REPEATABILITY_RESULT: HeaderName = HeaderName::from_static("repeatability-result");

/// The most by which a client's clock may run ahead of the server's without
/// weakening the first-sent guard (less for a TTL under two minutes: half
/// of it).
pub const CLOCK_SKEW_ALLOWANCE: Duration = Duration::from_secs(60);

/// Which header named the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// `Idempotency-Key` (or the header configured in its place).
    IdempotencyKey,
    /// `Repeatability-Request-ID` and `Repeatability-First-Sent`.
    Repeatability,
}

/// A request's key, the header that named it, and its first attempt's time.
#[derive(Debug, Clone)]
pub struct Keyed {
    /// The key.
    pub key: IdempotencyKey,
    /// Which header named it.
    pub dialect: Dialect,
    /// When the request's first attempt was sent, as the client says.
    pub first_sent: Option<SystemTime>,
}

/// How old a request's first attempt is, against the window it had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooOld {
    /// How long ago it was first sent.
    pub age: Duration,
    /// The longest age accepted.
    pub window: Duration,
}

// === impl Dialect ===

impl Dialect {
    /// The dialect of a request under `policy`: OASIS's when the server
    /// takes it and the request carries `Repeatability-Request-ID`.
    pub fn of(headers: &HeaderMap, policy: &KeyPolicy) -> Dialect {
        if policy.repeatability && headers.contains_key(REPEATABILITY_REQUEST_ID) {
            Dialect::Repeatability
        } else {
            Dialect::IdempotencyKey
        }
    }
}

/// Reads the key of a request in `dialect` (from [`Dialect::of`]), the
/// `Idempotency-Key` dialect's key under `name`.
///
/// # Errors
/// [`KeyError::Missing`] without a key; [`KeyError::Invalid`] for a
/// malformed key or first-sent time, a `Repeatability-Request-ID` without
/// its `Repeatability-First-Sent`, or both dialects on one request.
pub fn read(
    headers: &HeaderMap,
    name: &HeaderName,
    policy: &KeyPolicy,
    dialect: Dialect,
) -> Result<Keyed, KeyError> {
    let span = crate::spans::key();
    let _in_span = span.enter();
    let keyed = match dialect {
        Dialect::IdempotencyKey => idempotency_key(headers, name, policy),
        Dialect::Repeatability => repeatability(headers, name, policy),
    };
    if !span.is_disabled() {
        match &keyed {
            Ok(keyed) => span.record("idemgate.key.hash", keyed.key.hash_prefix().as_str()),
            Err(KeyError::Missing) => span.record("idemgate.outcome", "missing"),
            Err(KeyError::Invalid(_)) => span.record("idemgate.outcome", "invalid"),
        };
    }
    keyed
}

/// The key of the `Idempotency-Key` dialect, under `name`, with its
/// `Idempotency-First-Sent` if sent.
fn idempotency_key(
    headers: &HeaderMap,
    name: &HeaderName,
    policy: &KeyPolicy,
) -> Result<Keyed, KeyError> {
    let key = super::from_headers(headers, name, policy)?;
    let first_sent = first_sent(headers, &IDEMPOTENCY_FIRST_SENT, "Idempotency-First-Sent")?;
    Ok(Keyed {
        key,
        dialect: Dialect::IdempotencyKey,
        first_sent,
    })
}

/// The key of the `Repeatability-*` dialect: the client id and the request
/// id, with the required `Repeatability-First-Sent`; a key under `name` as
/// well is refused.
fn repeatability(
    headers: &HeaderMap,
    name: &HeaderName,
    policy: &KeyPolicy,
) -> Result<Keyed, KeyError> {
    if headers.contains_key(name) {
        return Err(invalid(format!(
            "send either {} or Repeatability-Request-ID, not both",
            super::display_name(name)
        )));
    }
    let id = one(
        headers,
        &REPEATABILITY_REQUEST_ID,
        "Repeatability-Request-ID",
    )?
    .ok_or(KeyError::Missing)?;
    let id = token(id, "Repeatability-Request-ID", policy)?;
    let client = one(headers, &REPEATABILITY_CLIENT_ID, "Repeatability-Client-ID")?
        .map(|v| token(v, "Repeatability-Client-ID", &KeyPolicy::default()))
        .transpose()?;
    let first_sent = first_sent(
        headers,
        &REPEATABILITY_FIRST_SENT,
        "Repeatability-First-Sent",
    )?
    .ok_or_else(|| {
        invalid(
            "Repeatability-Request-ID needs Repeatability-First-Sent: the \
                     HTTP-date (IMF-fixdate) at which the request was first sent",
        )
    })?;
    // The request id is unique within its client: the client id, a
    // line feed (which neither may hold), then the id.
    let key = match client {
        Some(client) => format!("{client}\n{id}"),
        None => id,
    };
    Ok(Keyed {
        key: IdempotencyKey::new(key),
        dialect: Dialect::Repeatability,
        first_sent: Some(first_sent),
    })
}

/// The longest a first attempt may be in the past for a key remembered for
/// `ttl`: the TTL, less the allowance for a client's clock running ahead
/// ([`CLOCK_SKEW_ALLOWANCE`], or half a TTL under two minutes).
pub fn window(ttl: Duration) -> Duration {
    ttl.saturating_sub(CLOCK_SKEW_ALLOWANCE.min(ttl / 2))
}

/// Whether a request first sent at `first_sent` is too old to execute at
/// `now` with keys remembered for `ttl`: its first attempt may have executed
/// and been forgotten. A time in the future is not.
pub fn too_old(first_sent: SystemTime, ttl: Duration, now: SystemTime) -> Option<TooOld> {
    let age = now.duration_since(first_sent).ok()?;
    let window = window(ttl);
    (age > window).then_some(TooOld { age, window })
}

/// The value of `name`, if it is there once.
fn one<'h>(
    headers: &'h HeaderMap,
    name: &HeaderName,
    shown: &str,
) -> Result<Option<&'h [u8]>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(invalid(format!(
            "the {shown} header appears more than once; send it once"
        )));
    }
    Ok(Some(first.as_bytes()))
}

/// An opaque id of visible ASCII (no quoting: the standard's ids are bare),
/// within `policy`'s length and format.
fn token(raw: &[u8], shown: &str, policy: &KeyPolicy) -> Result<String, KeyError> {
    let value = super::trim_ows(raw);
    if value.is_empty() {
        return Err(invalid(format!("the {shown} header is empty")));
    }
    if !value.iter().all(u8::is_ascii_graphic) {
        return Err(invalid(format!(
            "{shown} must be visible ASCII (0x21-0x7E), without spaces"
        )));
    }
    if value.len() > policy.max_len {
        return Err(invalid(format!(
            "{shown} is {} characters long; the limit is {}",
            value.len(),
            policy.max_len
        )));
    }
    let value = String::from_utf8_lossy(value).into_owned();
    if policy.format == KeyFormat::Uuid && !is_hyphenated_uuid(&value) {
        return Err(invalid(format!(
            "{shown} must be a UUID in hyphenated form (this server takes UUID keys only)"
        )));
    }
    Ok(value)
}

/// The HTTP-date in `name`, if present.
fn first_sent(
    headers: &HeaderMap,
    name: &HeaderName,
    shown: &str,
) -> Result<Option<SystemTime>, KeyError> {
    let Some(raw) = one(headers, name, shown)? else {
        return Ok(None);
    };
    std::str::from_utf8(raw)
        .ok()
        .and_then(|v| httpdate::parse_http_date(v.trim()).ok())
        .map(Some)
        .ok_or_else(|| {
            invalid(format!(
                "{shown} is not an HTTP-date; send the time the request was first sent as an \
                 IMF-fixdate, e.g. \"Sun, 06 Nov 1994 08:49:37 GMT\""
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        h
    }

    fn on() -> KeyPolicy {
        KeyPolicy {
            repeatability: true,
            ..KeyPolicy::default()
        }
    }

    const KEY: HeaderName = HeaderName::from_static("idempotency-key");
    const SENT: &str = "Sun, 06 Nov 1994 08:49:37 GMT";

    fn read_with(pairs: &[(&str, &str)], policy: &KeyPolicy) -> Result<Keyed, KeyError> {
        let h = headers(pairs);
        read(&h, &KEY, policy, Dialect::of(&h, policy))
    }

    #[test]
    fn repeatability_is_opt_in() {
        let pairs = [
            ("repeatability-request-id", "a1"),
            ("repeatability-first-sent", SENT),
        ];
        assert_eq!(
            read_with(&pairs, &KeyPolicy::default()).unwrap_err(),
            KeyError::Missing
        );
        let keyed = read_with(&pairs, &on()).unwrap();
        assert_eq!(keyed.dialect, Dialect::Repeatability);
        assert_eq!(keyed.key.as_str(), "a1");
        assert_eq!(keyed.first_sent, httpdate::parse_http_date(SENT).ok());
    }

    #[test]
    fn the_client_id_scopes_the_request_id() {
        let a = read_with(
            &[
                ("repeatability-request-id", "r"),
                ("repeatability-client-id", "c1"),
                ("repeatability-first-sent", SENT),
            ],
            &on(),
        )
        .unwrap();
        let b = read_with(
            &[
                ("repeatability-request-id", "r"),
                ("repeatability-client-id", "c2"),
                ("repeatability-first-sent", SENT),
            ],
            &on(),
        )
        .unwrap();
        assert_ne!(a.key.hash(), b.key.hash());
    }

    #[test]
    fn malformed_repeatability_headers_are_invalid() {
        let cases: &[&[(&str, &str)]] = &[
            &[("repeatability-request-id", "r")],
            &[
                ("repeatability-request-id", "r"),
                ("repeatability-first-sent", "yesterday"),
            ],
            &[
                ("repeatability-request-id", "a b"),
                ("repeatability-first-sent", SENT),
            ],
            &[
                ("repeatability-request-id", ""),
                ("repeatability-first-sent", SENT),
            ],
            &[
                ("repeatability-request-id", "r"),
                ("repeatability-request-id", "s"),
                ("repeatability-first-sent", SENT),
            ],
            &[
                ("repeatability-request-id", "r"),
                ("repeatability-first-sent", SENT),
                ("idempotency-key", "k"),
            ],
        ];
        for pairs in cases {
            assert!(
                matches!(read_with(pairs, &on()), Err(KeyError::Invalid(_))),
                "{pairs:?}"
            );
        }
        let uuid_only = KeyPolicy {
            format: KeyFormat::Uuid,
            ..on()
        };
        assert!(
            read_with(
                &[
                    ("repeatability-request-id", "r"),
                    ("repeatability-first-sent", SENT)
                ],
                &uuid_only
            )
            .is_err()
        );
    }

    #[test]
    fn idempotency_first_sent_is_optional_and_checked() {
        let keyed = read_with(&[("idempotency-key", "\"k\"")], &KeyPolicy::default()).unwrap();
        assert_eq!(keyed.first_sent, None);
        let keyed = read_with(
            &[("idempotency-key", "k"), ("idempotency-first-sent", SENT)],
            &KeyPolicy::default(),
        )
        .unwrap();
        assert!(keyed.first_sent.is_some());
        assert!(
            read_with(
                &[("idempotency-key", "k"), ("idempotency-first-sent", "soon")],
                &KeyPolicy::default()
            )
            .is_err()
        );
    }

    #[test]
    fn the_window_is_the_ttl_less_the_skew_allowance() {
        let day = Duration::from_secs(86_400);
        assert_eq!(window(day), day - CLOCK_SKEW_ALLOWANCE);
        assert_eq!(window(Duration::from_secs(10)), Duration::from_secs(5));
        let now = SystemTime::now();
        let sent = now - Duration::from_secs(86_400 - 61);
        assert_eq!(too_old(sent, day, now), None);
        let sent = now - Duration::from_secs(86_400 - 59);
        assert!(too_old(sent, day, now).is_some());
        assert_eq!(too_old(now + Duration::from_secs(3600), day, now), None);
    }
}
