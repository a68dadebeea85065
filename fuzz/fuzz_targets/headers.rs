//! The header handling of the layer and the proxy on arbitrary header lines:
//! which response headers are stored for replay
//! (`storable`) and which request headers reach
//! the upstream (`to_upstream`, what `ProxyClient`
//! applies to every forwarded request). Never a panic; nothing hop-by-hop survives;
//! every stored line can be rebuilt by the replay.
#![no_main]

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue, header};
use idemgate::fuzzing::{prefer_wait, storable, to_upstream};
use idemgate::key::{KeyPolicy, from_headers};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authenticate",
    "proxy-authorization",
];

/// Names that make interesting collisions likely.
const NAMES: [&str; 14] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "upgrade",
    "te",
    "content-length",
    "set-cookie",
    "idempotent-replayed",
    "idempotency-expires",
    "idempotency-key",
    "prefer",
    "x-forwarded-for",
    "host",
    "x-custom",
];

#[derive(Debug, Arbitrary)]
enum Name {
    Known(u8),
    Raw(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
struct Input {
    lines: Vec<(Name, Vec<u8>)>,
    deny: Vec<Name>,
    client: Option<[u8; 4]>,
    host: Option<Vec<u8>>,
}

fn name(n: &Name) -> Option<HeaderName> {
    match n {
        Name::Known(i) => Some(HeaderName::from_static(
            NAMES[usize::from(*i) % NAMES.len()],
        )),
        Name::Raw(bytes) => HeaderName::from_bytes(bytes).ok(),
    }
}

/// What the `Connection` lines name, as a proxy must read them.
fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect()
}

fuzz_target!(|input: Input| {
    let mut headers = HeaderMap::new();
    for (n, value) in &input.lines {
        if let (Some(n), Ok(v)) = (name(n), HeaderValue::from_bytes(value)) {
            headers.append(n, v);
        }
    }
    let deny: Vec<HeaderName> = input.deny.iter().filter_map(name).collect();
    let named = connection_named(&headers);

    // Response side: what is stored for replay.
    let stored = storable(&headers, &deny);
    assert!(stored.len() <= headers.len());
    for (n, v) in &stored {
        let hn = HeaderName::from_bytes(n.as_bytes()).expect("stored name re-parses");
        HeaderValue::from_str(v).expect("stored value re-parses");
        assert!(!HOP_BY_HOP.contains(&n.as_str()), "stored hop-by-hop {n}");
        assert!(
            !named.contains(&hn),
            "stored a header Connection names: {n}"
        );
        assert!(!deny.contains(&hn), "stored a denied header: {n}");
        assert!(
            ![
                "content-length",
                "idempotent-replayed",
                "idempotency-expires"
            ]
            .contains(&n.as_str()),
            "stored {n}"
        );
        assert!(
            headers
                .get_all(&hn)
                .iter()
                .any(|x| x.as_bytes() == v.as_bytes()),
            "stored a line that was not in the response"
        );
    }

    // Request side: what reaches the upstream.
    let mut forwarded = headers.clone();
    let host = input
        .host
        .as_deref()
        .and_then(|h| HeaderValue::from_bytes(h).ok());
    let client = input.client.map(IpAddr::from);
    to_upstream(&mut forwarded, client, host.clone());
    for n in HOP_BY_HOP {
        assert!(!forwarded.contains_key(n), "forwarded hop-by-hop {n}");
    }
    for n in &named {
        if !n.as_str().starts_with("x-forwarded-") && n != "forwarded" {
            assert!(
                !forwarded.contains_key(n),
                "forwarded a header Connection names"
            );
        }
    }
    assert!(!forwarded.contains_key(header::HOST));
    assert_eq!(forwarded["x-forwarded-proto"], "http");
    assert_eq!(forwarded.get("x-forwarded-host"), host.as_ref());
    if let Some(ip) = client {
        let chain = forwarded["x-forwarded-for"].to_str().expect("ASCII chain");
        assert!(chain.ends_with(&ip.to_string()), "{chain}");
        assert_eq!(forwarded.get_all("x-forwarded-for").iter().count(), 1);
    }
    // `Forwarded` always ends with the proxy's own `for=` element.
    let last = forwarded["forwarded"].to_str().expect("ASCII elements");
    assert!(
        last.ends_with(&match client {
            Some(IpAddr::V6(ip)) => format!("for=\"[{ip}]\""),
            Some(ip) => format!("for={ip}"),
            None => "for=unknown".to_owned(),
        }),
        "{last}"
    );
    assert_eq!(forwarded.get_all("forwarded").iter().count(), 1);

    // The other request headers the doors read.
    let _ = prefer_wait(&headers);
    let key_header = HeaderName::from_static("idempotency-key");
    let _ = from_headers(&headers, &key_header, &KeyPolicy::default());
});
