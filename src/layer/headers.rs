//! Hop-by-hop headers (RFC 9110 §7.6.1): never stored, never forwarded.
//! After linkerd2-proxy's `strip_connection_headers`.

use http::{HeaderMap, HeaderName, header};

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

/// idemgate's own headers, and `Content-Length` (the replay's body decides
/// it): never stored.
const NOT_STORED: [HeaderName; 3] = [
    header::CONTENT_LENGTH,
    IDEMPOTENT_REPLAYED,
    IDEMPOTENCY_EXPIRES,
];

/// The header lines of a response worth storing for replay: no hop-by-hop
/// header, none on the deny list, no `Content-Length` (the replay's body
/// decides it), and none of idemgate's own replay headers. Read in place:
/// the response's own map is not copied.
///
/// Public only for the fuzz targets (`fuzz/`); not part of the API.
#[doc(hidden)]
pub fn storable(headers: &HeaderMap, deny: &[HeaderName]) -> Vec<(String, String)> {
    let named = connection_named(headers);
    headers
        .iter()
        .filter(|(name, _)| {
            !HOP_BY_HOP.contains(name)
                && !NOT_STORED.contains(name)
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
}
