//! A replay is framed by its own body, whoever wrote its record (docs/proxy.md):
//! an operator's completion that names a hop-by-hop or framing header is
//! refused at every operators' door, a record planted with one in the table
//! replays without it, and two requests pipelined on one connection read
//! two well-framed responses; an origin's answer of 200 header lines is
//! stored and replayed to a client with hyper's limits; `Set-Cookie2` is not
//! replayed; the HTML pages are never framed by another site; and the
//! origin sees the client's `Forwarded` with the proxy's own element last.
//! The stores' scenarios run on both stores.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use common::proxy::{TestProxy, replayed};
use http::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn hash_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Header lines an operator's completion, or a planted record, may hold
/// that must never be replayed: each breaks the framing of a response or of
/// its connection.
const FRAMING: [(&str, &str); 9] = [
    ("Content-Length", "2"),
    ("content-length", "99999"),
    ("Transfer-Encoding", "chunked"),
    ("Connection", "close"),
    ("Keep-Alive", "timeout=1"),
    ("TE", "trailers"),
    ("Trailer", "x-sum"),
    ("Upgrade", "h2c"),
    ("Proxy-Authenticate", "Basic"),
];

// === the origin ===

/// An origin of raw sockets, one request a connection, counting the
/// requests it read whole: `/hangup` acts and hangs up without an answer;
/// `/plain` answers `201` `hello-body`; `/many` answers `200` with 150
/// `Link` lines and 50 `X-Line-N` lines; `/cookie2` answers `201` with
/// `Set-Cookie2`, `Set-Cookie` and `X-Origin`.
struct Origin {
    url: String,
    calls: Arc<AtomicUsize>,
}

async fn origin() -> Origin {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(answer(conn, counted.clone()));
        }
    });
    Origin { url, calls }
}

async fn answer(mut conn: tokio::net::TcpStream, calls: Arc<AtomicUsize>) {
    let mut seen = Vec::new();
    let mut buf = vec![0; 8192];
    let head_end = loop {
        if let Some(at) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&seen[..head_end]).into_owned();
    let length: usize = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    while seen.len() < head_end + length {
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    calls.fetch_add(1, Ordering::SeqCst);
    let path = head.split(' ').nth(1).unwrap_or("/").to_owned();
    let (status, lines, body) = match path.as_str() {
        "/hangup" => {
            let _ = conn.shutdown().await;
            return;
        }
        "/plain" => (
            "201 Created",
            vec!["content-type: text/plain".to_owned()],
            "hello-body",
        ),
        "/many" => {
            let mut lines: Vec<String> = (0..150)
                .map(|i| format!("link: </asset-{i}.js>; rel=preload"))
                .collect();
            lines.extend((0..50).map(|i| format!("x-line-{i}: {i}")));
            ("200 OK", lines, "many")
        }
        "/cookie2" => (
            "201 Created",
            vec![
                "set-cookie2: sid2=origin-secret; Version=1".to_owned(),
                "set-cookie: sid=origin-secret".to_owned(),
                "x-origin: yes".to_owned(),
            ],
            "ok",
        ),
        _ => ("404 Not Found", Vec::new(), "no"),
    };
    let mut out = format!("HTTP/1.1 {status}\r\n");
    for line in lines {
        out.push_str(&line);
        out.push_str("\r\n");
    }
    out.push_str(&format!(
        "content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    ));
    let _ = conn.write_all(out.as_bytes()).await;
    let _ = conn.shutdown().await;
}

// === one connection, two requests ===

/// One response as read off a connection by its own framing.
#[derive(Debug)]
struct Framed {
    status: u16,
    headers: HeaderMap,
    body: Vec<u8>,
}

/// Writes `requests` to the proxy on one connection in one write (the last
/// asks for `Connection: close`), reads everything until the proxy closes,
/// and splits it into responses by their framing, as a client on a
/// keep-alive connection must: an `Err` says where the bytes stopped being
/// a response.
async fn pipelined(proxy: &TestProxy, requests: &[String]) -> Result<Vec<Framed>, String> {
    let mut socket = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    socket
        .write_all(requests.concat().as_bytes())
        .await
        .unwrap();
    let mut raw = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        socket.read_to_end(&mut raw),
    )
    .await;
    if read.is_err() {
        return Err(format!(
            "the connection stayed open after {} bytes: {:?}",
            raw.len(),
            String::from_utf8_lossy(&raw)
        ));
    }
    let mut rest = &raw[..];
    let mut responses = Vec::new();
    while !rest.is_empty() {
        let (framed, after) = frame(rest)?;
        responses.push(framed);
        rest = after;
    }
    Ok(responses)
}

/// The first response of `bytes`, and what follows it.
fn frame(bytes: &[u8]) -> Result<(Framed, &[u8]), String> {
    let shown = || String::from_utf8_lossy(bytes).into_owned();
    let end = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("no head in {:?}", shown()))?;
    let head = std::str::from_utf8(&bytes[..end]).map_err(|_| shown())?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .strip_prefix("HTTP/1.1 ")
        .and_then(|s| s.get(..3))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("not a status line: {status_line:?} in {:?}", shown()))?;
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| format!("not a header line: {line:?}"))?;
        headers.append(
            HeaderName::from_bytes(name.trim().as_bytes()).map_err(|e| e.to_string())?,
            HeaderValue::from_str(value.trim()).map_err(|e| e.to_string())?,
        );
    }
    let rest = &bytes[end + 4..];
    if headers.contains_key("transfer-encoding") {
        return Err(format!("a response with Transfer-Encoding: {headers:?}"));
    }
    let length: usize = headers
        .get("content-length")
        .ok_or_else(|| format!("a response without its length: {headers:?}"))?
        .to_str()
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("Content-Length lines: {headers:?}"))?;
    if length > rest.len() {
        return Err(format!(
            "Content-Length {length} over the {} bytes that came",
            rest.len()
        ));
    }
    let framed = Framed {
        status,
        headers,
        body: rest[..length].to_vec(),
    };
    Ok((framed, &rest[length..]))
}

/// `POST path` with `key` and a `{}` body, as written on the wire.
fn post(proxy: &TestProxy, path: &str, key: &str, close: bool) -> String {
    let connection = if close { "Connection: close\r\n" } else { "" };
    format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\n{connection}\r\n{{}}",
        proxy.addr
    )
}

/// Two replays of `key` pipelined on one connection: each is the stored
/// `201 hello-body`, framed by its own body, with none of the framing lines
/// and nothing a stored `Connection` named.
async fn two_replays_on_one_connection(proxy: &TestProxy, key: &str, what: &str) {
    let requests = [
        post(proxy, "/plain", key, false),
        post(proxy, "/plain", key, true),
    ];
    let responses = pipelined(proxy, &requests)
        .await
        .unwrap_or_else(|e| panic!("{what}: the connection desynchronised: {e}"));
    assert_eq!(responses.len(), 2, "{what}: {responses:#?}");
    for res in &responses {
        assert_eq!(res.status, 201, "{what}: {res:#?}");
        assert_eq!(res.body, b"hello-body", "{what}: {res:#?}");
        assert_eq!(res.headers["idempotent-replayed"], "true", "{what}");
        assert_eq!(res.headers["content-type"], "text/plain", "{what}");
        assert_eq!(
            res.headers.get_all("content-length").iter().count(),
            1,
            "{what}: {res:#?}"
        );
        for (name, _) in FRAMING {
            if !name.eq_ignore_ascii_case("content-length")
                && !name.eq_ignore_ascii_case("connection")
            {
                assert!(
                    !res.headers.contains_key(name),
                    "{what}: {name} in {res:#?}"
                );
            }
        }
        assert!(!res.headers.contains_key("x-secret"), "{what}: {res:#?}");
        assert!(
            !res.headers.contains_key("proxy-status"),
            "{what}: {res:#?}"
        );
    }
    assert!(
        !responses[0].headers.contains_key("connection"),
        "{what}: the first replay must keep the connection: {responses:#?}"
    );
}

/// Writes `headers` over the stored response headers of every completed
/// record, straight into the table, as an older release or a hand in the
/// database could have left them.
async fn plant(b: &Backend, headers: &Value) {
    let text = headers.to_string();
    match b {
        Backend::Postgres(db) => {
            let store = Backend::open_pg(db).await;
            sqlx::query(
                "UPDATE idempotency_keys SET response_headers = CAST($1 AS jsonb) \
                 WHERE state = 'completed'",
            )
            .bind(&text)
            .execute(store.pool())
            .await
            .expect("plant the headers");
            store.pool().close().await;
        }
        Backend::Sqlite(dir) => {
            let store = Backend::open_sqlite(dir).await;
            sqlx::query(
                "UPDATE idempotency_keys SET response_headers = ?1 WHERE state = 'completed'",
            )
            .bind(&text)
            .execute(store.pool())
            .await
            .expect("plant the headers");
            store.close().await;
        }
    }
}

// === the operator's completion ===

/// The attack as it was made: a key the proxy holds unknown (its origin
/// acted and hung up), completed by an operator with `Content-Length: 2`
/// over `hello-body` — whose replay, followed by a pipelined request, read
/// the rest of the body as the next response — or `99999`, which swallowed
/// the next response, or `Transfer-Encoding`, or `Connection: close`. Each
/// is now `400 invalid-request` naming the header, at the admin endpoint,
/// the console's settle form and `idemgate keys resolve`, and the key stays
/// stuck; completed without them, two replays pipelined on one connection
/// read as two responses.
async fn an_operators_completion_naming_framing_is_refused(b: Backend) {
    let origin = origin().await;
    let proxy = TestProxy::start(&b.url(), &origin.url, &[], Vec::new()).await;
    let key = fresh_key();
    let first = proxy.post("/hangup", &key, "{}").await;
    assert_eq!(first.status, 502, "{first:#?}");
    proxy
        .post_now("/hangup", &key, "{}")
        .await
        .assert_problem(409, "outcome-unknown");
    let hash = hash_hex(&key);
    let resolve = format!("{}/v1/admin/keys/anonymous/{hash}/resolve", proxy.admin);
    let completion = |headers: Value| {
        json!({
            "action": "complete",
            "reason": "the origin's log shows it",
            "response": {"status": 201, "headers": headers, "body": "hello-body"},
        })
    };

    for (name, value) in FRAMING {
        let res = proxy
            .http
            .post(&resolve)
            .json(&completion(json!([
                ["content-type", "text/plain"],
                [name, value]
            ])))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 400, "{name}");
        let problem: Value = res.json().await.unwrap();
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("/invalid-request"),
            "{problem}"
        );
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(name), "{name}: {detail}");
    }

    // The console's settle form, on the same listener.
    let form = "action=complete&status=201&headers=Content-Type%3A+text%2Fplain%0D%0A\
                Content-Length%3A+2&body=hello-body&reason=checked";
    let settled = proxy
        .http
        .post(format!(
            "{}/console/fragments/keys/anonymous/{hash}/resolve",
            proxy.admin
        ))
        .header("hx-request", "true")
        .header("sec-fetch-site", "same-origin")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form)
        .send()
        .await
        .unwrap();
    assert_eq!(settled.status(), 400);
    let text = settled.text().await.unwrap();
    assert!(text.contains("Content-Length"), "{text}");

    // The command line, straight on the database.
    let out = common::bin::keys(
        &b.url(),
        &[
            "resolve",
            "anonymous",
            &hash,
            "--complete",
            "--reason",
            "checked",
            "--status",
            "201",
            "--header",
            "Transfer-Encoding: chunked",
            "--body",
            "hello-body",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("Transfer-Encoding"), "{stderr}");

    // Nothing of it was stored: the key is still the operator's to settle.
    proxy
        .post_now("/hangup", &key, "{}")
        .await
        .assert_problem(409, "outcome-unknown");
    let res = proxy
        .http
        .post(&resolve)
        .json(&completion(json!([["content-type", "text/plain"]])))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    // Its replay is the key's `/hangup` request's: the origin is not called.
    let requests = [
        post(&proxy, "/hangup", &key, false),
        post(&proxy, "/hangup", &key, true),
    ];
    let responses = pipelined(&proxy, &requests).await.unwrap();
    assert_eq!(responses.len(), 2, "{responses:#?}");
    for res in &responses {
        assert_eq!(res.status, 201, "{res:#?}");
        assert_eq!(res.body, b"hello-body");
        assert!(replayed_framed(res));
    }
    assert_eq!(origin.calls.load(Ordering::SeqCst), 1);
}

fn replayed_framed(res: &Framed) -> bool {
    res.headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// A record written with framing headers before this release refused them
/// (or by a hand in the table) is replayed without them, by the proxy and
/// through the one replay every door shares: two replays pipelined on one
/// connection read as two responses, for `Content-Length: 2`, `99999`,
/// `Transfer-Encoding` with `Connection: close` and what it names, and the
/// rest of the hop-by-hop set.
async fn a_planted_record_replays_without_its_framing(b: Backend) {
    let origin = origin().await;
    // No replay cache: every replay reads the table.
    let proxy = TestProxy::start(
        &b.url(),
        &origin.url,
        &["--replay-cache-bytes", "0"],
        Vec::new(),
    )
    .await;
    let key = fresh_key();
    let first = proxy.post("/plain", &key, "{}").await;
    assert_eq!(first.status, 201, "{first:#?}");
    two_replays_on_one_connection(&proxy, &key, "as stored").await;

    let planted = [
        json!([["content-type", "text/plain"], ["content-length", "2"]]),
        json!([["content-length", "99999"], ["content-type", "text/plain"]]),
        json!([
            ["content-type", "text/plain"],
            ["transfer-encoding", "chunked"],
            ["connection", "close, x-secret"],
            ["x-secret", "s"]
        ]),
        json!([
            ["content-type", "text/plain"],
            ["keep-alive", "timeout=1"],
            ["te", "trailers"],
            ["trailer", "x-sum"],
            ["upgrade", "h2c"],
            ["proxy-status", "origin"],
            ["proxy-authenticate", "Basic"]
        ]),
    ];
    for headers in planted {
        plant(&b, &headers).await;
        two_replays_on_one_connection(&proxy, &key, &headers.to_string()).await;
    }
    assert_eq!(origin.calls.load(Ordering::SeqCst), 1);
}

/// A holder's commit through the reservation API comes after its effect, so
/// it is not refused for a framing header: the header is left out, never
/// stored, and the replay's JSON carries none — nor from a record planted
/// with them, in the replay or the record's view.
async fn a_commit_stores_no_framing_header(b: Backend) {
    // No replay cache: every replay reads the table.
    let app = TestApp::new(&b.url(), &["--replay-cache-bytes", "0"]).await;
    let key = fresh_key();
    let held = app.reserve(&key, r#"{"fingerprint":"fp"}"#).await;
    assert_eq!(held.status, 201, "{held:#?}");
    let commit = json!({
        "status": 201,
        "headers": [
            ["content-type", "text/plain"],
            ["Content-Length", "2"],
            ["transfer-encoding", "chunked"],
            ["connection", "close"],
            ["proxy-status", "x"]
        ],
        "body": "hello-body",
    });
    let committed = app
        .act(&held.reservation_id(), "commit", &commit.to_string())
        .await;
    assert_eq!(committed.status, 200, "{committed:#?}");
    let want = json!([["content-type", "text/plain"]]);
    assert_eq!(committed.body["response"]["headers"], want);
    let replay = app.reserve(&key, r#"{"fingerprint":"fp"}"#).await;
    assert_eq!(replay.status, 200, "{replay:#?}");
    assert_eq!(replay.body["response"]["headers"], want);

    plant(
        &b,
        &json!([
            ["content-type", "text/plain"],
            ["content-length", "2"],
            ["Transfer-Encoding", "chunked"]
        ]),
    )
    .await;
    let replay = app.reserve(&key, r#"{"fingerprint":"fp"}"#).await;
    assert_eq!(replay.status, 200, "{replay:#?}");
    assert_eq!(replay.body["response"]["headers"], want);
    let view = app
        .send(
            "GET",
            &format!("/v1/reservations/{}", held.reservation_id()),
            &[],
            None,
        )
        .await;
    assert_eq!(view.status, 200, "{view:#?}");
    assert_eq!(view.body["response"]["headers"], want);
}

// === the origin's answer ===

/// An origin's answer of 200 header lines (150 `Link`, 50 others) was a
/// `502` with the key held `outcome-unknown` although the origin had acted
/// (hyper's client reads 100). It is now passed on whole, stored, and
/// replayed to a client whose limits are hyper's own (reqwest's), the
/// `Link` lines joined into one: one origin call.
async fn an_answer_of_200_header_lines_is_stored_and_replayed(b: Backend) {
    let origin = origin().await;
    let proxy = TestProxy::start(&b.url(), &origin.url, &[], Vec::new()).await;
    let key = fresh_key();
    // The first answer is the origin's as it sent it: read off the socket.
    let first = proxy
        .send_raw("POST", "/many", &[("idempotency-key", &key)])
        .await;
    assert_eq!(first.status, 200, "{first:#?}");
    assert_eq!(first.headers.get_all("link").iter().count(), 150);
    assert_eq!(first.headers["x-line-49"], "49");
    assert_eq!(first.text, "many");

    let replay = proxy.post("/many", &key, "{}").await;
    assert_eq!(replay.status, 200, "{replay:#?}");
    assert!(replayed(&replay));
    assert_eq!(replay.text, "many");
    let links = replay.header("link");
    assert_eq!(links.split(", ").count(), 150, "{links}");
    assert!(links.starts_with("</asset-0.js>; rel=preload, </asset-1.js>"));
    for i in 0..50 {
        assert_eq!(replay.header(&format!("x-line-{i}")), i.to_string());
    }
    assert_eq!(origin.calls.load(Ordering::SeqCst), 1);
}

/// `Set-Cookie2`, like `Set-Cookie`, is not stored by default: the first
/// answer carries the origin's cookies to the client it was for, the
/// replay to nobody.
async fn set_cookie2_is_not_replayed(b: Backend) {
    let origin = origin().await;
    let proxy = TestProxy::start(&b.url(), &origin.url, &[], Vec::new()).await;
    let key = fresh_key();
    let first = proxy.post("/cookie2", &key, "{}").await;
    assert_eq!(first.status, 201, "{first:#?}");
    assert!(first.headers.contains_key("set-cookie2"));
    let replay = proxy.post("/cookie2", &key, "{}").await;
    assert_eq!(replay.status, 201, "{replay:#?}");
    assert!(replayed(&replay));
    assert_eq!(replay.header("x-origin"), "yes");
    assert!(!replay.headers.contains_key("set-cookie2"), "{replay:#?}");
    assert!(!replay.headers.contains_key("set-cookie"), "{replay:#?}");
    let (status, policy) = proxy.admin_get("/v1/policy").await;
    assert_eq!(status, 200);
    let policy: Value = serde_json::from_str(&policy).unwrap();
    let not_stored = &policy["stored_response"]["headers_not_stored"];
    assert!(
        not_stored
            .as_array()
            .unwrap()
            .contains(&json!("set-cookie2")),
        "{not_stored}"
    );
    assert_eq!(origin.calls.load(Ordering::SeqCst), 1);
}

both_stores! {
    serial: [
        an_operators_completion_naming_framing_is_refused,
        a_planted_record_replays_without_its_framing,
        a_commit_stores_no_framing_header,
        an_answer_of_200_header_lines_is_stored_and_replayed,
        set_cookie2_is_not_replayed,
    ],
    concurrent: [],
}

// === what is not about a store ===

/// The origin sees the client's `Forwarded` with the proxy's own `for=`
/// element appended, as `X-Forwarded-For` is: a client's claim is never
/// the last word.
#[tokio::test]
async fn the_origin_sees_forwarded_with_the_proxys_element_last() {
    let (_db, upstream, proxy) = common::proxy::setup(&[]).await;
    let seen = proxy
        .send(
            "GET",
            "/echo",
            &[
                ("forwarded", "for=203.0.113.9;proto=https"),
                ("x-forwarded-for", "203.0.113.9"),
            ],
            None,
        )
        .await;
    assert_eq!(seen.status, 200, "{seen:#?}");
    assert_eq!(
        seen.body["headers"]["forwarded"],
        json!(["for=203.0.113.9;proto=https, for=127.0.0.1"])
    );
    assert_eq!(
        seen.body["headers"]["x-forwarded-for"],
        json!(["203.0.113.9, 127.0.0.1"])
    );
    let bare = proxy.send("GET", "/echo", &[], None).await;
    assert_eq!(bare.body["headers"]["forwarded"], json!(["for=127.0.0.1"]));
    drop(upstream);
}

/// No HTML page idemgate serves — `/docs`, its reference pages, the console
/// — may be framed by another site's page (clickjacking): each carries
/// `X-Frame-Options: DENY` and a policy of `frame-ancestors 'none'`; the
/// console keeps its own, stricter policy.
#[tokio::test]
async fn no_page_is_framed_by_another_site() {
    let db = common::pg::TestDb::new().await;
    let app = TestApp::new(&db.url, &[]).await;
    for path in [
        "/docs",
        "/docs/",
        "/docs/proxy",
        "/docs/swagger-ui.css",
        "/console",
    ] {
        let res = app.send("GET", path, &[], None).await;
        assert_eq!(res.status, 200, "{path}: {res:#?}");
        assert_eq!(res.header("x-frame-options"), "DENY", "{path}");
        let csp = res.header("content-security-policy");
        assert!(csp.contains("frame-ancestors 'none'"), "{path}: {csp}");
    }
    let console = app.send("GET", "/console", &[], None).await;
    assert!(
        console
            .header("content-security-policy")
            .contains("default-src 'none'")
    );
}
