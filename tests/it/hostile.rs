//! Hostile and malformed input at the HTTP level, against the real binary
//! (serve and proxy): slow clients, oversized heads, lying or huge
//! `Content-Length`, bytes that are not UTF-8, JSON that does not parse. Each
//! gets a clear 4xx (or its connection closed), never a 5xx, the upstream
//! never sees a guarded request that was refused, and the server keeps serving
//! everyone else.

use crate::common;

use std::time::{Duration, Instant};

use common::bin::Served;
use common::pg::TestDb;
use common::proxy::ProxyProcess;
use common::upstream::Upstream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Writes `request` on a new connection and reads until the server closes it
/// or `patience` passes; returns what came back. Its `Host: x` is sent as
/// the listener's own address, the one name an open listener answers.
async fn raw(port: u16, request: &[u8], patience: Duration) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream.write_all(&own_host(request, port)).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(patience, stream.read_to_end(&mut got)).await;
    String::from_utf8_lossy(&got).into_owned()
}

/// `request` with its `Host: x` line naming `127.0.0.1:port`.
fn own_host(request: &[u8], port: u16) -> Vec<u8> {
    const PLACEHOLDER: &[u8] = b"Host: x\r\n";
    match request
        .windows(PLACEHOLDER.len())
        .position(|w| w == PLACEHOLDER)
    {
        Some(at) => [
            &request[..at],
            format!("Host: 127.0.0.1:{port}\r\n").as_bytes(),
            &request[at + PLACEHOLDER.len()..],
        ]
        .concat(),
        None => request.to_vec(),
    }
}

/// The status code of a raw HTTP/1.1 answer (0 when there was none).
fn status(answer: &str) -> u16 {
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Proof that the server still answers: `GET /healthz` (serve) or a plain
/// GET through the proxy.
async fn still_serving(port: u16, path: &str) {
    let answer = raw(
        port,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status(&answer), 200, "still serving {path}: {answer}");
}

fn post(path: &str, headers: &[&str], body: &[u8]) -> Vec<u8> {
    let mut req = format!("POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

#[tokio::test]
async fn a_slow_client_is_cut_off_and_everyone_else_is_served() {
    let db = TestDb::new().await;
    let served = Served::start(&db, &["--header-read-timeout", "1"]).await;
    let port = served.port;
    let mut slow = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    slow.write_all(b"POST /v1/reservations HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let began = Instant::now();
    // While it dawdles, others are answered.
    still_serving(port, "/healthz").await;
    // Its connection is closed once the timeout passes, not held for ever.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut rest)).await;
    assert!(
        closed.is_ok(),
        "the slow client's connection was never closed"
    );
    assert!(
        began.elapsed() >= Duration::from_millis(500),
        "closed before the client had its time"
    );
    still_serving(port, "/healthz").await;
}

/// A body that stops arriving: `408 request-timeout` once no piece of it
/// has come for the header read timeout, from serve and from the proxy;
/// nothing is reserved or forwarded.
#[tokio::test]
async fn a_body_that_stops_arriving_gets_408_and_nothing_is_forwarded() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let slow = ["--header-read-timeout", "1"];
    let served = Served::start(&db, &slow).await;
    let proxy = ProxyProcess::start_with(&db, &upstream.url(), &slow).await;
    for (port, path) in [(served.port, "/v1/reservations"), (proxy.port, "/charges")] {
        let mut request = post(path, &["Idempotency-Key: k-slow-body"], &[b' '; 100]);
        request.truncate(request.len() - 90);
        let began = Instant::now();
        let answer = raw(port, &request, Duration::from_secs(10)).await;
        let waited = began.elapsed();
        assert_eq!(status(&answer), 408, "{path}: {answer}");
        assert!(answer.contains("request-timeout"), "{path}: {answer}");
        assert!(
            waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
            "{path}: answered after {waited:?}"
        );
    }
    assert_eq!(upstream.total(), 0, "the upstream never saw it");
    // The key was never reserved: the complete request is new.
    let answer = raw(
        served.port,
        &post("/v1/reservations", &["Idempotency-Key: k-slow-body"], b"{}"),
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status(&answer), 201, "{answer}");
    still_serving(proxy.port, "/anything").await;
}

#[tokio::test]
async fn oversized_heads_get_431_and_the_servers_go_on() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let served = Served::start(&db, &[]).await;
    let proxy = ProxyProcess::start(&db, &upstream.url()).await;
    let big = format!("X-Filler: {}", "a".repeat(100 * 1024));
    for (port, path) in [(served.port, "/v1/reservations"), (proxy.port, "/charges")] {
        let answer = raw(
            port,
            &post(path, &["Idempotency-Key: big-head", &big], b"{}"),
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(status(&answer), 431, "{path}: {answer:.200}");
    }
    assert_eq!(upstream.total(), 0, "the upstream never saw it");
    still_serving(served.port, "/healthz").await;
    still_serving(proxy.port, "/anything").await;
}

#[tokio::test]
async fn a_huge_content_length_is_413_before_any_body_is_read() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let served = Served::start(&db, &[]).await;
    let proxy = ProxyProcess::start(&db, &upstream.url()).await;
    for (port, path) in [(served.port, "/v1/reservations"), (proxy.port, "/charges")] {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nIdempotency-Key: huge\r\n\
             Content-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n{{"
        );
        let answer = raw(port, head.as_bytes(), Duration::from_secs(5)).await;
        assert_eq!(status(&answer), 413, "{path}: {answer}");
        assert!(answer.contains("payload-too-large"), "{path}: {answer}");
    }
    assert_eq!(upstream.total(), 0, "the upstream never saw it");
    // The key was never reserved: it is new on the next request.
    let res = common::http()
        .post(format!("{}/v1/reservations", served.base()))
        .header("Idempotency-Key", "huge")
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
}

#[tokio::test]
async fn a_body_shorter_than_its_content_length_is_never_a_5xx_nor_forwarded() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let served = Served::start(&db, &[]).await;
    let proxy = ProxyProcess::start(&db, &upstream.url()).await;
    for (port, path) in [(served.port, "/v1/reservations"), (proxy.port, "/charges")] {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: liar\r\n\
             Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"a\":"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        // The client gives up half-way.
        stream.shutdown().await.unwrap();
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut got)).await;
        let answer = String::from_utf8_lossy(&got);
        let code = status(&answer);
        assert!(code == 0 || (400..500).contains(&code), "{path}: {answer}");
    }
    assert_eq!(
        upstream.total(),
        0,
        "an incomplete request is never forwarded"
    );
    // Nothing was reserved: the key is new.
    let res = common::http()
        .post(format!("{}/v1/reservations", served.base()))
        .header("Idempotency-Key", "liar")
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    still_serving(proxy.port, "/anything").await;
}

#[tokio::test]
async fn bytes_that_are_not_utf8_and_json_that_does_not_parse_are_400() {
    let db = TestDb::new().await;
    let served = Served::start(&db, &[]).await;
    let json = "Content-Type: application/json";
    let cases: [(&str, Vec<u8>, &[&str], &str); 7] = [
        (
            "body not UTF-8",
            vec![0xff, 0xfe, b'{', b'}'],
            &["Idempotency-Key: k-utf8", json],
            "invalid-request",
        ),
        (
            "JSON cut short",
            br#"{"fingerprint":"#.to_vec(),
            &["Idempotency-Key: k-cut", json],
            "invalid-request",
        ),
        (
            "wrong field type",
            br#"{"lease_seconds":"soon"}"#.to_vec(),
            &["Idempotency-Key: k-type", json],
            "invalid-request",
        ),
        // serde reads a struct from a JSON array of its fields in order; the
        // document says an object, so an array is refused (schemathesis found
        // `[null, null, null, null]` answered 201).
        (
            "an array where the object goes",
            b"[null, null, null, null]".to_vec(),
            &["Idempotency-Key: k-array", json],
            "invalid-request",
        ),
        (
            "an empty array",
            b"[]".to_vec(),
            &["Idempotency-Key: k-empty-array", json],
            "invalid-request",
        ),
        (
            "a number",
            b" 7 ".to_vec(),
            &["Idempotency-Key: k-number", json],
            "invalid-request",
        ),
        (
            "key not ASCII",
            b"{}".to_vec(),
            &["Idempotency-Key: caf\u{e9}", json],
            "key-invalid",
        ),
    ];
    for (what, body, headers, slug) in cases {
        let answer = raw(
            served.port,
            &post("/v1/reservations", headers, &body),
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(status(&answer), 400, "{what}: {answer}");
        assert!(
            answer.contains("application/problem+json") && answer.contains(slug),
            "{what}: {answer}"
        );
    }
    // A header value with a raw 0xff byte.
    let mut req = b"POST /v1/reservations HTTP/1.1\r\nHost: x\r\nConnection: close\r\nIdempotency-Key: ab\xffcd\r\nContent-Length: 2\r\n\r\n{}".to_vec();
    req.shrink_to_fit();
    let answer = raw(served.port, &req, Duration::from_secs(5)).await;
    assert_eq!(status(&answer), 400, "raw 0xff in the key: {answer}");
    assert!(answer.contains("key-invalid"), "{answer}");
    still_serving(served.port, "/healthz").await;
}
