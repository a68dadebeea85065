//! Headers the proxy adds on the way upstream: `X-Forwarded-For`, `-Proto`
//! and `-Host`. (Hop-by-hop stripping is shared with the layer:
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

/// Appends the client's address to `X-Forwarded-For` (earlier hops kept, in
/// order), and sets `X-Forwarded-Proto` (`http`; the proxy's client makes
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
}
