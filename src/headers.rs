//! The idempotency headers every door speaks: the replay marker, the
//! published expiry, the omitted-body marker, and `Prefer: wait`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use http::{HeaderMap, HeaderName, HeaderValue};

/// `Idempotent-Replayed: true` marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// Until this HTTP-date the key is remembered.
pub const IDEMPOTENCY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");
/// `Idempotency-Body-Omitted: true`: the response body was over the limit, so
/// its replay carries the status and headers with an empty body.
pub const IDEMPOTENCY_BODY_OMITTED: HeaderName =
    HeaderName::from_static("idempotency-body-omitted");

/// `Idempotency-Attempt: N` (N ≥ 2) on a request sent again by a takeover:
/// an earlier attempt with its key may have acted.
pub const IDEMPOTENCY_ATTEMPT: HeaderName = HeaderName::from_static("idempotency-attempt");

/// Sets `Idempotency-Expires` to `expires_at` as an HTTP-date.
pub fn set_expires(headers: &mut HeaderMap, expires_at: DateTime<Utc>) {
    let date = httpdate::fmt_http_date(std::time::SystemTime::from(expires_at));
    if let Ok(v) = HeaderValue::from_str(&date) {
        headers.insert(IDEMPOTENCY_EXPIRES, v);
    }
}

/// Answers a request of the OASIS Repeatable Requests dialect with
/// `Repeatability-Result: accepted` or `rejected`; nothing for a request of
/// the other dialect, or for no result.
pub fn set_repeatability_result(
    headers: &mut HeaderMap,
    dialect: crate::key::Dialect,
    result: Option<&'static str>,
) {
    if let (crate::key::Dialect::Repeatability, Some(result)) = (dialect, result) {
        headers.insert(
            crate::key::dialect::REPEATABILITY_RESULT,
            HeaderValue::from_static(result),
        );
    }
}

/// Marks a response as a replay.
pub fn mark_replayed(headers: &mut HeaderMap) {
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
}

/// `Prefer: wait=N` (RFC 7240), if the caller sent one.
pub fn prefer_wait(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split([',', ';']))
        .find_map(|pref| {
            let (name, value) = pref.split_once('=')?;
            name.trim()
                .eq_ignore_ascii_case("wait")
                .then(|| delta_seconds(value.trim().trim_matches('"')))?
        })
        .map(Duration::from_secs)
}

/// RFC 9111 §1.2.2 delta-seconds: digits only; a value too large to hold is
/// taken as 2^31, which every cap is below.
fn delta_seconds(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(text.parse::<u64>().unwrap_or(1 << 31))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefer_wait_reads_rfc_7240_preferences() {
        let cases = [
            ("wait=5", Some(5)),
            ("respond-async, wait=30", Some(30)),
            ("handling=lenient; wait=\"7\"", Some(7)),
            ("WAIT = 2", Some(2)),
            ("return=minimal", None),
            ("wait=soon", None),
            ("wait=-1", None),
            ("wait=+5", None),
            ("wait=", None),
            ("wait=99999999999999999999999", Some(1 << 31)),
        ];
        for (value, want) in cases {
            let mut headers = HeaderMap::new();
            headers.insert("prefer", HeaderValue::from_str(value).unwrap());
            assert_eq!(
                prefer_wait(&headers),
                want.map(Duration::from_secs),
                "{value}"
            );
        }
        assert_eq!(prefer_wait(&HeaderMap::new()), None);
    }
}
