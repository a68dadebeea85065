//! Hop-by-hop and framing headers (RFC 9110 §7.6.1, and `Content-Length`):
//! never forwarded as they came, never stored, never replayed from a
//! record, whoever wrote it. After linkerd2-proxy's
//! `strip_connection_headers` and nginx's `proxy_hide_header` set.
//!
//! A replay's head is written here too ([`replay_headers`]): from the
//! record's lines, what it must never carry left out, and lines of one name
//! joined into one, so that a client that reads no more header lines than
//! hyper's 100 reads a replay of many.

use http::{HeaderMap, HeaderName, HeaderValue, header};

pub use crate::headers::{
    IDEMPOTENCY_ATTEMPT, IDEMPOTENCY_BODY_OMITTED, IDEMPOTENCY_EXPIRES, IDEMPOTENT_REPLAYED,
};

/// The standard hop-by-hop set, besides whatever `Connection` names.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
];

/// Removes `Connection`, every header it names, and the standard hop-by-hop
/// set.
pub fn strip_connection_headers(headers: &mut HeaderMap) {
    for name in connection_named(headers) {
        headers.remove(&name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The header names listed in the `Connection` header(s) (its options:
/// `upgrade`, `close`, or the names of further hop-by-hop headers).
pub(crate) fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect()
}

/// Whether a header is hop-by-hop or framing: the standard hop-by-hop set,
/// any `Proxy-*` header (what a proxy said to its neighbour), and
/// `Content-Length`. Such a header describes one connection's message, not
/// the response: a replay's framing is its own body's, written by hyper, and
/// a stored `Content-Length: 2` over a longer body, or a stored
/// `Transfer-Encoding`, would make the client read the next response as this
/// one's rest. Never stored, never replayed (the `Connection` header's own
/// names are left out besides, where a response or record has one).
pub fn is_framing(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name)
        || name == header::CONTENT_LENGTH
        || name.as_str().starts_with("proxy-")
}

/// idemgate's own replay headers: never stored (a replay sets its own).
const OWN: [HeaderName; 2] = [IDEMPOTENT_REPLAYED, IDEMPOTENCY_EXPIRES];

/// The header lines of a response worth storing for replay: no hop-by-hop
/// or framing header ([`is_framing`]) nor one its `Connection` names, none
/// on the deny list, and none of idemgate's own replay headers. Read in
/// place: the response's own map is not copied.
///
/// Public only for the fuzz targets (`fuzz/`); not part of the API.
#[doc(hidden)]
pub fn storable(headers: &HeaderMap, deny: &[HeaderName]) -> Vec<(String, String)> {
    let named = connection_named(headers);
    headers
        .iter()
        .filter(|(name, _)| {
            !is_framing(name)
                && !OWN.contains(name)
                && !named.contains(name)
                && !deny.contains(name)
        })
        .filter_map(|(name, value)| {
            // Stored as text; a value that is not visible ASCII is dropped
            // rather than mangled.
            let value = value.to_str().ok()?;
            Some((name.as_str().to_owned(), value.to_owned()))
        })
        .collect()
}

/// Header lines a client reads one by one, never joined: each `Set-Cookie`
/// line is a cookie of its own, and a cookie's value may hold a comma (an
/// `Expires` date) (RFC 9110 §5.3, RFC 6265 §3).
const NEVER_JOINED: [&str; 2] = ["set-cookie", "set-cookie2"];

/// A replay's head from a record's header lines, whoever wrote them (the
/// layer, an operator, a database written by an older release or by hand):
/// no hop-by-hop or framing header, none that a stored `Connection` names,
/// none of idemgate's own (the replay sets them), and no line that is not a
/// valid header. Lines of one name are joined into one, comma-separated in
/// their order (RFC 9110 §5.3: a recipient may combine them), but for
/// `Set-Cookie`: an origin's answer of 200 lines, 150 of them `Link`, is
/// replayed in 51, which a client that reads at most hyper's 100 header
/// lines takes. A record of more names than a header map holds is replayed
/// with those it holds.
pub(crate) fn replay_headers(stored: &[(String, String)]) -> HeaderMap {
    let lines = stored.iter().filter_map(|(name, value)| {
        let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
        Some((name, HeaderValue::from_str(value).ok()?))
    });
    let named: Vec<HeaderName> = stored
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case(header::CONNECTION.as_str()))
        .flat_map(|(_, value)| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    // A map keeps each name once, in the order it first came, with all its
    // values in theirs.
    let mut grouped = HeaderMap::new();
    for (name, value) in lines {
        if is_framing(&name) || OWN.contains(&name) || named.contains(&name) {
            continue;
        }
        if grouped.try_append(name, value).is_err() {
            break;
        }
    }
    if grouped.len() == grouped.keys_len() {
        return grouped;
    }
    let mut joined = HeaderMap::with_capacity(grouped.keys_len());
    for name in grouped.keys() {
        let mut values = grouped.get_all(name).iter();
        if NEVER_JOINED.contains(&name.as_str()) {
            for value in values {
                joined.append(name.clone(), value.clone());
            }
            continue;
        }
        let mut line = values
            .next()
            .map(|v| v.as_bytes().to_vec())
            .unwrap_or_default();
        for value in values {
            line.extend_from_slice(b", ");
            line.extend_from_slice(value.as_bytes());
        }
        if let Ok(value) = HeaderValue::from_bytes(&line) {
            joined.append(name.clone(), value);
        }
    }
    joined
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn strips_the_connection_set_and_what_it_names() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, X-Secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("proxy-authorization", HeaderValue::from_static("basic x"));
        h.insert("x-kept", HeaderValue::from_static("yes"));
        strip_connection_headers(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn storable_drops_the_deny_list() {
        let mut h = HeaderMap::new();
        h.insert("set-cookie", HeaderValue::from_static("sid=1"));
        h.insert("content-length", HeaderValue::from_static("3"));
        h.insert("content-type", HeaderValue::from_static("text/plain"));
        h.insert("upgrade", HeaderValue::from_static("h2c"));
        let kept = storable(&h, &[header::SET_COOKIE]);
        assert_eq!(kept, vec![("content-type".into(), "text/plain".into())]);
    }

    #[test]
    fn storable_drops_what_connection_names_and_keeps_the_order() {
        let mut h = HeaderMap::new();
        h.insert("x-first", HeaderValue::from_static("1"));
        h.insert("connection", HeaderValue::from_static("close, X-Secret"));
        h.insert("x-secret", HeaderValue::from_static("s"));
        h.insert("idempotent-replayed", HeaderValue::from_static("true"));
        h.append("x-last", HeaderValue::from_static("a"));
        h.append("x-last", HeaderValue::from_static("b"));
        let kept = storable(&h, &[]);
        assert_eq!(
            kept,
            vec![
                ("x-first".into(), "1".into()),
                ("x-last".into(), "a".into()),
                ("x-last".into(), "b".into()),
            ]
        );
    }

    #[test]
    fn storable_drops_framing_and_every_proxy_header() {
        let mut h = HeaderMap::new();
        h.insert("proxy-status", HeaderValue::from_static("origin; error=x"));
        h.insert("content-length", HeaderValue::from_static("2"));
        h.insert("trailer", HeaderValue::from_static("x-sum"));
        h.insert("x-kept", HeaderValue::from_static("yes"));
        assert_eq!(storable(&h, &[]), vec![("x-kept".into(), "yes".into())]);
    }

    fn pairs(lines: &[(&str, &str)]) -> Vec<(String, String)> {
        lines
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn a_replay_carries_no_framing_whoever_stored_it() {
        let stored = pairs(&[
            ("Content-Length", "2"),
            ("transfer-encoding", "chunked"),
            ("connection", "close, x-secret"),
            ("x-secret", "s"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("trailer", "x-sum"),
            ("upgrade", "h2c"),
            ("proxy-authenticate", "Basic"),
            ("proxy-anything", "1"),
            ("idempotent-replayed", "false"),
            ("bad name", "x"),
            ("x-bad-value", "a\nb"),
            ("content-type", "text/plain"),
        ]);
        let h = replay_headers(&stored);
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h["content-type"], "text/plain");
    }

    #[test]
    fn a_replay_joins_lines_of_one_name_but_cookies() {
        let stored = pairs(&[
            ("link", "</a.js>; rel=preload"),
            ("set-cookie", "a=1; Expires=Wed, 21 Oct 2015 07:28:00 GMT"),
            ("x-one", "1"),
            ("Link", "</b.js>; rel=preload"),
            ("set-cookie", "b=2"),
        ]);
        let h = replay_headers(&stored);
        assert_eq!(h["link"], "</a.js>; rel=preload, </b.js>; rel=preload");
        let cookies: Vec<_> = h.get_all("set-cookie").iter().collect();
        assert_eq!(cookies.len(), 2);
        assert_eq!(
            h.keys().map(HeaderName::as_str).collect::<Vec<_>>(),
            ["link", "set-cookie", "x-one"]
        );
    }

    #[test]
    fn a_replay_of_more_names_than_a_map_holds_keeps_what_it_holds() {
        let stored: Vec<(String, String)> = (0..40_000)
            .map(|i| (format!("x-{i}"), "v".to_owned()))
            .collect();
        let h = replay_headers(&stored);
        assert!(h.len() > 20_000 && h.len() < 40_000, "{}", h.len());
    }
}
