//! A replay its retry can read: a response stored with a `Content-Encoding`
//! that the retry's `Accept-Encoding` does not take is decoded on the way
//! out (gzip, deflate and br, by tower-http's decompression), instead of
//! handing `identity`-only clients bytes they cannot read.
//!
//! The first request's `Accept-Encoding` decided what the origin sent, and so
//! what was stored; the retry may differ (another client library, another
//! setting) and is still the same request, since `Accept-Encoding` is not
//! part of the fingerprint. A coding is taken when the retry lists it (or
//! `*`) with a non-zero weight; a retry without `Accept-Encoding` is treated
//! as taking none, as origins do in practice (RFC 9110 would allow any, but
//! such clients are usually the ones that cannot decode). A coding this
//! build cannot decode is replayed as stored.

use std::convert::Infallible;

use axum::body::Body;
use axum::response::Response;
use http::header::{ACCEPT_ENCODING, CONTENT_ENCODING, ETAG};
use http::{HeaderMap, HeaderValue, Request};
use tower::{Service, ServiceExt};

/// The codings [`for_retry`] can decode.
const DECODABLE: [&str; 3] = ["gzip", "deflate", "br"];

/// `res` as the retry whose headers are `request` can read it.
pub(crate) async fn for_retry(request: &HeaderMap, res: Response) -> Response {
    let Some(coding) = res
        .headers()
        .get(CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase())
    else {
        return res;
    };
    if accepts(request, &coding) || !DECODABLE.contains(&coding.as_str()) {
        return res;
    }
    let mut res = res;
    // The decoded bytes are another representation: a strong validator of
    // the encoded one no longer matches them byte for byte.
    if let Some(weak) = res
        .headers()
        .get(ETAG)
        .and_then(|v| v.to_str().ok())
        .filter(|tag| tag.starts_with('"'))
        .and_then(|tag| HeaderValue::from_str(&format!("W/{tag}")).ok())
    {
        res.headers_mut().insert(ETAG, weak);
    }
    let mut stored = Some(res);
    let once = tower::service_fn(move |_: Request<()>| {
        let res = stored.take().unwrap_or_default();
        std::future::ready(Ok::<_, Infallible>(res))
    });
    let mut decoding = tower_http::decompression::Decompression::new(once);
    let Ok(service) = decoding.ready().await;
    let Ok(decoded) = service.call(Request::new(())).await;
    decoded.map(Body::new)
}

/// Whether the `Accept-Encoding` of `request` takes `coding` (lowercase).
fn accepts(request: &HeaderMap, coding: &str) -> bool {
    let mut listed = None;
    let mut any = None;
    for item in request
        .get_all(ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
    {
        let mut parts = item.split(';');
        let name = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
        let weight = parts
            .filter_map(|p| p.trim().split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            .and_then(|(_, q)| q.trim().parse::<f32>().ok())
            .unwrap_or(1.0);
        let taken = weight > 0.0;
        // `x-gzip` is gzip (RFC 9110 §8.4.1.3).
        if name == coding || (coding == "gzip" && name == "x-gzip") {
            listed = Some(taken);
        } else if name == "*" {
            any = Some(taken);
        }
    }
    listed.or(any).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(accept: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for a in accept {
            h.append(ACCEPT_ENCODING, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    #[test]
    fn accept_encoding_with_weights() {
        assert!(accepts(&headers(&["gzip, deflate"]), "gzip"));
        assert!(accepts(&headers(&["br;q=1.0, gzip;q=0.8"]), "gzip"));
        assert!(accepts(&headers(&["x-gzip"]), "gzip"));
        assert!(accepts(&headers(&["identity", "GZIP"]), "gzip"));
        assert!(accepts(&headers(&["*"]), "br"));
        assert!(!accepts(&headers(&["identity"]), "gzip"));
        assert!(!accepts(&headers(&["gzip;q=0"]), "gzip"));
        assert!(!accepts(&headers(&["*, gzip;q=0"]), "gzip"));
        assert!(!accepts(&headers(&["*;q=0"]), "br"));
        assert!(!accepts(&headers(&[]), "gzip"), "no header: none taken");
    }
}
