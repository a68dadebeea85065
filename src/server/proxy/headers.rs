//! Headers the proxy adds on the way upstream: `X-Forwarded-For`, `-Proto`
//! and `-Host`, and `Forwarded`'s `for=` element (RFC 7239). (Hop-by-hop stripping is shared with the layer:
//! [`crate::layer::strip_connection_headers`].)

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue, header};

use crate::layer::strip_connection_headers;

/// A request's headers as the upstream gets them: hop-by-hop headers (and
/// those its `Connection` lines name) stripped, `Host` dropped (the client
/// sets it from the upstream URI, unless the proxy puts the client's back),
/// `X-Forwarded-*` added for `client` and the original `host`.
pub fn to_upstream(headers: &mut HeaderMap, client: Option<IpAddr>, host: Option<HeaderValue>) {
    strip_connection_headers(headers);
    headers.remove(header::HOST);
    add_forwarded(headers, client, host);
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const FORWARDED: HeaderName = HeaderName::from_static("forwarded");

/// Appends the client's address to `X-Forwarded-For` and, as a `for=`
/// element, to `Forwarded` (earlier hops kept, in order: the last is the
/// proxy's own, never a client's claim), and sets `X-Forwarded-Proto` (`http`; the proxy's client makes
/// it `https` for a request that came over a TLS listener) and `X-Forwarded-Host` (the `Host` the client asked for). Proto and
/// Host are overwritten rather than trusted from the client.
pub fn add_forwarded(headers: &mut HeaderMap, client: Option<IpAddr>, host: Option<HeaderValue>) {
    if let Some(ip) = client {
        let prior: Vec<&str> = headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .collect();
        let chain = if prior.is_empty() {
            ip.to_string()
        } else {
            format!("{}, {ip}", prior.join(", "))
        };
        if let Ok(v) = HeaderValue::from_str(&chain) {
            headers.insert(X_FORWARDED_FOR, v);
        }
    }
    append_forwarded_for(headers, client);
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    match host {
        Some(host) => {
            headers.insert(X_FORWARDED_HOST, host);
        }
        None => {
            headers.remove(X_FORWARDED_HOST);
        }
    }
}

/// Appends `for=ADDRESS` to `Forwarded` as one more element after those the
/// client's own lines hold (RFC 7239 §4: an IPv6 address quoted and
/// bracketed; `for=unknown` where the address is not known, so the last
/// element is still the proxy's). A client's line that is not text is left
/// out, as with `X-Forwarded-For`.
fn append_forwarded_for(headers: &mut HeaderMap, client: Option<IpAddr>) {
    let node = match client {
        Some(IpAddr::V4(ip)) => ip.to_string(),
        Some(IpAddr::V6(ip)) => format!("\"[{ip}]\""),
        None => "unknown".to_owned(),
    };
    let mut elements: Vec<&str> = headers
        .get_all(&FORWARDED)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .collect();
    let own = format!("for={node}");
    elements.push(&own);
    if let Ok(v) = HeaderValue::from_str(&elements.join(", ")) {
        headers.insert(FORWARDED, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_to_the_chain() {
        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", HeaderValue::from_static("203.0.113.7"));
        h.append("x-forwarded-for", HeaderValue::from_static("198.51.100.2"));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        add_forwarded(
            &mut h,
            Some("127.0.0.1".parse().unwrap()),
            Some(HeaderValue::from_static("api.example")),
        );
        assert_eq!(h["x-forwarded-for"], "203.0.113.7, 198.51.100.2, 127.0.0.1");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "api.example");
    }

    #[test]
    fn forwarded_gets_the_proxys_element_last() {
        let mut h = HeaderMap::new();
        h.append(
            "forwarded",
            HeaderValue::from_static("for=1.2.3.4;by=proxy"),
        );
        h.append("forwarded", HeaderValue::from_static("for=5.6.7.8"));
        add_forwarded(&mut h, Some("2001:db8::1".parse().unwrap()), None);
        assert_eq!(
            h["forwarded"],
            "for=1.2.3.4;by=proxy, for=5.6.7.8, for=\"[2001:db8::1]\""
        );
        let mut h = HeaderMap::new();
        add_forwarded(&mut h, Some("127.0.0.1".parse().unwrap()), None);
        assert_eq!(h["forwarded"], "for=127.0.0.1");
        let mut h = HeaderMap::new();
        h.insert("forwarded", HeaderValue::from_static("for=10.0.0.1"));
        add_forwarded(&mut h, None, None);
        assert_eq!(h["forwarded"], "for=10.0.0.1, for=unknown");
    }
}
