//! The attacks a security review made that held, made again as the attacker
//! would, so that they keep holding (docs/security.md is the threat model
//! they belong to). Each test says what it would have caught.
//!
//! Covered elsewhere, and not repeated here: a head that trickles in, or
//! never comes, cut at the header read timeout (`keep_alive.rs`,
//! `hostile.rs`); the reservation API's other routes and the proxy's tenants
//! under another tenant (`security.rs`, `tenants.rs`); every admin route
//! with every kind of caller (`admin_access.rs`); a route rule dodged by
//! spelling its path differently (`proxy.rs`); the secrets of `serve` and
//! `proxy` at the crate's trace level (`security.rs`); 1,000 holders of one
//! key over three processes on PostgreSQL (`storms.rs`, slow).
//!
//! Here: every reservation and admin route of the OpenAPI document under
//! another tenant; token comparison in constant time; request smuggling
//! over raw sockets; requests that try to make the proxy connect elsewhere;
//! path traversal on `/docs`, the console's assets and through the proxy;
//! many slow heads at once on both of the proxy's listeners; 300 holders of
//! one key released together, on both stores; and no secret in any log line
//! at `RUST_LOG=debug` for the whole process, the operators' doors
//! included.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Barrier;
use tokio::task::JoinHandle;

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use common::bin::{BIN, free_port};
use common::proxy::{TestProxy, replayed};
use common::upstream::Upstream;
use idemgate::server::serve;

const TOKENS: &str = "acme:acme-held-tok-71c2e0,globex:globex-held-tok-9a4d13";
const ACME: &str = "Bearer acme-held-tok-71c2e0";
const GLOBEX: &str = "Bearer globex-held-tok-9a4d13";
const ADMIN_TOKEN: &str = "ops-held-tok-2f8b66";
const SEAL: &str = "q1Rk0m7oV8WmK3mC0cQwX2b9tq1yZ4kPp5JrS6uE3aA=";

// === raw sockets ===

/// Writes `request` on a new connection to `addr` and reads until the server
/// closes it or `patience` passes. Returns what came back and whether the
/// server closed the connection.
async fn exchange(addr: SocketAddr, request: &[u8], patience: Duration) -> (String, bool) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut got = Vec::new();
    let closed = tokio::time::timeout(patience, stream.read_to_end(&mut got))
        .await
        .is_ok();
    (String::from_utf8_lossy(&got).into_owned(), closed)
}

/// The status codes of every response in a raw HTTP/1.1 answer, in order.
fn statuses(answer: &str) -> Vec<u16> {
    answer
        .match_indices("HTTP/1.")
        .filter(|(i, _)| *i == 0 || answer[..*i].ends_with('\n'))
        .filter_map(|(i, _)| answer[i..].split_whitespace().nth(1)?.parse().ok())
        .collect()
}

/// The JSON document in a raw answer holding one response (its body sent
/// whole or in one chunk).
fn json_in(answer: &str) -> Value {
    let body = body_of(answer);
    let (from, to) = (body.find('{').unwrap(), body.rfind('}').unwrap());
    serde_json::from_str(&body[from..=to]).unwrap_or_else(|e| panic!("{e}: {answer}"))
}

/// The body of a raw answer holding one response.
fn body_of(answer: &str) -> &str {
    answer.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}

/// `router` served by `serve::serve` on a socket (port 0), as `serve` and the
/// proxy serve theirs, with a header read timeout of `header_read`.
async fn serve_on_socket(
    router: axum::Router,
    header_read: Duration,
) -> (SocketAddr, JoinHandle<std::io::Result<()>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = serve::Serving {
        grace: Duration::from_secs(1),
        header_read_timeout: header_read,
        keep_alive_timeout: Duration::from_secs(30),
    };
    let task = tokio::spawn(serve::serve(
        listener,
        router,
        serving,
        std::future::pending(),
    ));
    (addr, task)
}

// === tenant isolation on every route ===

/// A body each reservation action accepts, so that a refusal is the tenant
/// check's and not the body's.
fn action_body(path: &str) -> &'static str {
    match path.rsplit('/').next().unwrap_or_default() {
        "commit" => r#"{"status":201,"body":"globex-wrote-this"}"#,
        "checkpoint" => r#"{"recovery_point":"stolen","data":{"by":"globex"}}"#,
        "unknown" => r#"{"reason":"globex says so"}"#,
        "extend" => r#"{"lease_seconds":30}"#,
        _ => "",
    }
}

/// Every route of the OpenAPI document that names a reservation, sent by
/// another tenant with acme's reservation id (in flight, then completed):
/// `404 not-found`, and acme's record is as it was. Every admin route, with
/// a tenant's token: `403`. The routes come from the document, so a route
/// added later is tried too.
///
/// Would have caught: a new reservation route (`/unknown` was added after
/// the tenant tests were written, and none of them tries it) that looks the
/// id up without the caller's tenant, so globex could mark acme's payment
/// unknown, commit a response of its own for it or read its recovery data;
/// an admin route that takes a tenant's token for an operator's.
async fn every_route_of_the_document_keeps_tenants_apart(b: Backend) {
    let admin = format!("ops:{ADMIN_TOKEN}");
    let app = TestApp::new(&b.url(), &["--tokens", TOKENS, "--admin-tokens", &admin]).await;
    let doc = app.send("GET", "/openapi.json", &[], None).await;
    assert_eq!(doc.status, 200);
    let paths = doc.body["paths"].as_object().expect("the document's paths");
    let mut reservation_routes = Vec::new();
    let mut admin_routes = Vec::new();
    for (path, item) in paths {
        for method in item.as_object().unwrap().keys() {
            let method = method.to_ascii_uppercase();
            if path.contains("{id}") {
                reservation_routes.push((method, path.clone()));
            } else if path.starts_with("/v1/admin/") {
                admin_routes.push((method, path.clone()));
            }
        }
    }
    // The routes this test knows of at least; more are tried too.
    for known in [
        "/v1/reservations/{id}",
        "/v1/reservations/{id}/commit",
        "/v1/reservations/{id}/release",
        "/v1/reservations/{id}/extend",
        "/v1/reservations/{id}/checkpoint",
        "/v1/reservations/{id}/unknown",
    ] {
        assert!(
            reservation_routes.iter().any(|(_, p)| p == known),
            "{known} is not in the document: {reservation_routes:?}"
        );
    }
    assert!(admin_routes.len() >= 3, "{admin_routes:?}");

    let key = fresh_key();
    let first = app
        .reserve_as(
            ACME,
            &key,
            r#"{"fingerprint":"acme-fp","lease_seconds":60}"#,
        )
        .await;
    assert_eq!(first.status, 201, "{first:#?}");
    let id = first.reservation_id();
    let checkpoint = app
        .act_as(
            ACME,
            &id,
            "checkpoint",
            r#"{"recovery_point":"charged","data":{"charge":"acme-private"}}"#,
        )
        .await;
    assert_eq!(checkpoint.status, 200, "{checkpoint:#?}");

    let try_all_as_globex = async |state: &str| {
        for (method, path) in &reservation_routes {
            let path = path.replace("{id}", &id);
            let body = (method != "GET").then(|| action_body(&path));
            let res = app
                .send(method, &path, &[("authorization", GLOBEX)], body)
                .await;
            res.assert_problem(404, "not-found");
            assert!(
                !res.text.contains("acme"),
                "{state}: {method} {path} told globex of acme: {}",
                res.text
            );
        }
    };
    try_all_as_globex("in flight").await;
    // Acme's record is untouched: still in flight, its recovery point its own.
    let view = app
        .send(
            "GET",
            &format!("/v1/reservations/{id}"),
            &[("authorization", ACME)],
            None,
        )
        .await;
    assert_eq!(view.body["state"], "in_flight", "{view:#?}");
    assert_eq!(view.body["attempt"], 1, "{view:#?}");
    let commit = app
        .act_as(
            ACME,
            &id,
            "commit",
            r#"{"status":201,"body":"acme-answer"}"#,
        )
        .await;
    assert_eq!(commit.status, 200, "acme's own commit: {commit:#?}");
    try_all_as_globex("completed").await;
    let replay = app
        .reserve_as(ACME, &key, r#"{"fingerprint":"acme-fp"}"#)
        .await;
    assert_eq!(
        replay.body["response"]["body"], "acme-answer",
        "{replay:#?}"
    );
    // The same key under globex is globex's own, new record.
    let theirs = app
        .reserve_as(GLOBEX, &key, r#"{"fingerprint":"other"}"#)
        .await;
    assert_eq!(theirs.status, 201, "{theirs:#?}");
    assert_eq!(theirs.body["attempt"], 1);

    // A tenant's token never opens an admin route, whatever it names.
    let hash = "0".repeat(64);
    for (method, path) in &admin_routes {
        let path = path
            .replace("{tenant}", "acme")
            .replace("{key_hash}", &hash);
        let body = (method != "GET")
            .then_some(r#"{"action":"release","reason":"globex wants it run again"}"#);
        for token in [ACME, GLOBEX] {
            let res = app
                .send(method, &path, &[("authorization", token)], body)
                .await;
            assert_eq!(
                res.status, 403,
                "{method} {path} with a tenant token: {res:#?}"
            );
        }
    }
}

// === token comparison ===

/// The least time each of `guesses` took of `rounds` calls of `check`, the
/// guesses taken in turn in each round, so that a moment of load on the
/// machine falls on all of them alike.
fn least_times<'a>(
    rounds: usize,
    guesses: &[(&'a str, &str)],
    check: impl Fn(&str),
) -> Vec<(&'a str, Duration)> {
    let mut least = vec![Duration::MAX; guesses.len()];
    for _ in 0..rounds {
        for (i, (_, guess)) in guesses.iter().enumerate() {
            let began = Instant::now();
            check(std::hint::black_box(guess));
            least[i] = least[i].min(began.elapsed());
        }
    }
    guesses.iter().map(|g| g.0).zip(least).collect()
}

/// Guesses of a long token that go wrong at its first byte, at its last, or
/// match it, and the token matched first or last of eight: each takes as
/// long as the others (the least of many runs, within a factor that noise
/// cannot reach and a leak would far exceed).
///
/// Would have caught: tokens compared with `==` (a guess that is right up
/// to its last byte takes the time of comparing 16 KiB, one wrong at its
/// first byte none: the position of the first wrong byte shows, and a token
/// is guessed byte by byte), and a lookup that stops at the first token that
/// matches (the eighth tenant's token takes eight comparisons, the first
/// one's one). The admin tokens are the same type.
#[test]
fn token_checks_take_the_same_time_wherever_a_guess_goes_wrong() {
    use idemgate::server::auth::Tokens;
    const LEN: usize = 16 * 1024;
    let token = |c: u8| {
        let mut t = vec![b'a'; LEN];
        t[LEN / 2] = c;
        String::from_utf8(t).unwrap()
    };
    let pairs: Vec<(String, String)> = (0..8u8)
        .map(|i| (format!("tenant{i}"), token(b'0' + i)))
        .collect();
    let secret = pairs[0].1.clone();
    let tokens = Tokens::new(pairs.clone());
    let mut first_wrong = secret.clone().into_bytes();
    first_wrong[0] = b'z';
    let first_wrong = String::from_utf8(first_wrong).unwrap();
    let mut last_wrong = secret.clone().into_bytes();
    last_wrong[LEN - 1] = b'z';
    let last_wrong = String::from_utf8(last_wrong).unwrap();
    let last_tenant = pairs[7].1.clone();
    assert_eq!(tokens.tenant_for(&secret), Some("tenant0"));
    assert_eq!(tokens.tenant_for(&last_tenant), Some("tenant7"));
    assert_eq!(tokens.tenant_for(&first_wrong), None);
    assert_eq!(tokens.tenant_for(&last_wrong), None);

    let times = least_times(
        20,
        &[
            ("wrong at its first byte", &first_wrong),
            ("wrong at its last byte", &last_wrong),
            ("the first tenant's", &secret),
            ("the last tenant's", &last_tenant),
        ],
        |guess| {
            std::hint::black_box(tokens.tenant_for(guess));
        },
    );
    let ratio = |times: &[(&str, Duration)]| {
        let fastest = times.iter().map(|t| t.1).min().unwrap();
        let slowest = times.iter().map(|t| t.1).max().unwrap();
        slowest.as_secs_f64() / fastest.as_secs_f64()
    };
    assert!(
        ratio(&times) < 1.6,
        "the time of a token check depends on the guess: {times:?}"
    );

    // The control: the same measure tells a lookup with `==` apart, on this
    // machine as it is loaded now; if it could not, the check above would
    // prove nothing.
    let naive = |guess: &str| {
        pairs
            .iter()
            .find(|(_, t)| t == guess)
            .map(|(n, _)| n.clone())
    };
    let naive_times = least_times(
        400,
        &[
            ("wrong at its first byte", &first_wrong),
            ("wrong at its last byte", &last_wrong),
        ],
        |guess| {
            std::hint::black_box(naive(guess));
        },
    );
    assert!(
        ratio(&naive_times) > 1.6,
        "the measure cannot tell `==` apart here: {naive_times:?}"
    );
}

// === request smuggling ===

/// A request with both `Content-Length` and `Transfer-Encoding`, and a second
/// request hidden behind its chunked end; two `Content-Length`s that differ;
/// a `Content-Length` list; HTTP/1.0 with chunked; a transfer coding that is
/// not `chunked`: on the proxy's listener and on `serve`'s. The hidden
/// request never runs, the conflicting ones are `400`, nothing reaches the
/// origin with both a length and a chunked coding, and no answer is a 5xx.
///
/// Would have caught: a front door that reads the body by one length and
/// leaves the rest on the connection as the next request (CL.TE / TE.CL
/// smuggling: the hidden request would run unguarded, as whoever sent the
/// next request on that connection, or under a key of its own); forwarding a
/// request with both headers, so an origin that prefers `Content-Length`
/// reads another body than idemgate fingerprinted.
#[tokio::test]
async fn smuggled_requests_never_run() {
    let dir = tempfile::tempdir().unwrap();
    let url = Backend::sqlite_url(&dir);
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&url, &upstream.url(), &[], Vec::new()).await;
    let app = TestApp::new(&url, &[]).await;
    let (api, api_task) = serve_on_socket(app.router.clone(), Duration::from_secs(5)).await;
    let patience = Duration::from_secs(5);

    // CL.TE and TE.CL, with a whole request hidden behind the chunked end.
    for (door, addr, path, hidden_path) in [
        ("proxy", proxy.addr, "/echo/outer", "/echo/hidden"),
        ("serve", api, "/v1/reservations", "/v1/reservations"),
    ] {
        for te_first in [false, true] {
            let outer = fresh_key();
            let hidden = fresh_key();
            let hidden_request = format!(
                "POST {hidden_path} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {hidden}\r\n\
                 Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
            );
            let (first, second) = ("Content-Length: 5", "Transfer-Encoding: chunked");
            let (first, second) = if te_first {
                (second, first)
            } else {
                (first, second)
            };
            let request = format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {outer}\r\n\
                 Content-Type: application/json\r\n{first}\r\n{second}\r\n\r\n\
                 0\r\n\r\n{hidden_request}"
            );
            let (answer, closed) = exchange(addr, request.as_bytes(), patience).await;
            let codes = statuses(&answer);
            assert!(
                codes.len() <= 1,
                "{door} (TE first: {te_first}): the hidden request was answered: {answer}"
            );
            assert!(
                closed,
                "{door} (TE first: {te_first}): the connection stayed open after a request \
                 with both Content-Length and Transfer-Encoding"
            );
            assert!(codes.iter().all(|c| *c < 500), "{door}: a 5xx: {answer}");
            if door == "proxy" {
                assert_eq!(
                    upstream.started(&hidden),
                    0,
                    "the hidden request reached the origin"
                );
                if upstream.started(&outer) == 1 {
                    // What reached the origin has one way to find its end.
                    let echoed = json_in(&answer);
                    let headers = &echoed["headers"];
                    assert!(
                        headers.get("content-length").is_none()
                            || headers.get("transfer-encoding").is_none(),
                        "the origin got both: {headers}"
                    );
                }
            } else {
                // Had the hidden reserve run, its key would be in flight now.
                let res = app.reserve(&hidden, "{}").await;
                assert_eq!(res.status, 201, "the hidden reserve ran: {res:#?}");
                assert_eq!(res.body["attempt"], 1);
            }
        }
    }

    // Heads whose body length cannot be told: 400, forwarded to nobody.
    let refused = [
        ("two lengths", "Content-Length: 2\r\nContent-Length: 7"),
        ("a length list", "Content-Length: 2, 7"),
        (
            "a coding that is not chunked",
            "Transfer-Encoding: identity\r\nContent-Length: 2",
        ),
        (
            "chunked misspelled",
            "Transfer-Encoding: xchunked\r\nContent-Length: 2",
        ),
        (
            "chunked not last",
            "Transfer-Encoding: chunked, gzip\r\nContent-Length: 2",
        ),
        (
            "a space before the colon",
            "Transfer-Encoding : chunked\r\nContent-Length: 2",
        ),
    ];
    for (door, addr, path) in [
        ("proxy", proxy.addr, "/echo/refused"),
        ("serve", api, "/v1/reservations"),
    ] {
        for (what, headers) in refused {
            let key = fresh_key();
            let request = format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n\
                 Content-Type: application/json\r\n{headers}\r\n\r\n{{}}\r\n\r\n"
            );
            let (answer, _) = exchange(addr, request.as_bytes(), patience).await;
            assert_eq!(statuses(&answer), [400], "{door}, {what}: {answer}");
            if door == "proxy" {
                assert_eq!(upstream.started(&key), 0, "{what} reached the origin");
            } else {
                let res = app.reserve(&key, "{}").await;
                assert_eq!(res.body["attempt"], 1, "{what} was reserved: {res:#?}");
            }
        }
        // HTTP/1.0 has no chunked coding: a body so framed is refused.
        let key = fresh_key();
        let request = format!(
            "POST {path} HTTP/1.0\r\nHost: x\r\nIdempotency-Key: {key}\r\n\
             Transfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"
        );
        let (answer, _) = exchange(addr, request.as_bytes(), patience).await;
        assert_eq!(
            statuses(&answer),
            [400],
            "{door}, HTTP/1.0 chunked: {answer}"
        );
        if door == "proxy" {
            assert_eq!(
                upstream.started(&key),
                0,
                "HTTP/1.0 chunked reached the origin"
            );
        }
    }
    api_task.abort();
}

// === the proxy connects to its upstream only ===

/// A listener that stands for a host the attacker wants reached (a database,
/// a metadata service): it counts the connections made to it.
struct Victim {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Victim {
    async fn start() -> Victim {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        let task = tokio::spawn(async move {
            while let Ok((_socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
            }
        });
        Victim {
            addr,
            connections,
            task,
        }
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Absolute-form targets naming another host (`POST http://127.0.0.1:5432/`,
/// `https://`, with user info), `CONNECT` to it (and bytes sent into the
/// would-be tunnel), and `Host`, `X-Forwarded-Host` and `Forwarded` naming
/// it: the other host is never connected to; what is forwarded goes to the
/// upstream, under its base path.
///
/// Would have caught: a proxy that takes the request target's authority as
/// where to connect (an open forward proxy into the network the proxy sits
/// in: a database's port, a cloud metadata address), or one that tunnels a
/// `CONNECT`, or routes by `Host`.
#[tokio::test]
async fn the_proxy_never_connects_anywhere_but_its_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let victim = Victim::start().await;
    let v = victim.addr;
    let proxy = TestProxy::start(
        &Backend::sqlite_url(&dir),
        &format!("{}/base", upstream.url()),
        &[],
        Vec::new(),
    )
    .await;
    let patience = Duration::from_secs(5);

    let key = fresh_key();
    let absolute = [
        format!(
            "POST http://{v}/echo/abs HTTP/1.1\r\nHost: {v}\r\nIdempotency-Key: {key}\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        ),
        format!("GET http://{v}/ HTTP/1.1\r\nHost: {v}\r\nConnection: close\r\n\r\n"),
        format!("GET https://{v}/ HTTP/1.1\r\nHost: {v}\r\nConnection: close\r\n\r\n"),
        format!("GET http://user:pw@{v}/ HTTP/1.1\r\nHost: {v}\r\nConnection: close\r\n\r\n"),
        format!("GET / HTTP/1.1\r\nHost: {v}\r\nConnection: close\r\n\r\n"),
        format!(
            "GET / HTTP/1.1\r\nHost: x\r\nX-Forwarded-Host: {v}\r\nForwarded: host={v}\r\n\
             Connection: close\r\n\r\n"
        ),
    ];
    for request in &absolute {
        let (answer, _) = exchange(proxy.addr, request.as_bytes(), patience).await;
        let codes = statuses(&answer);
        assert!(
            codes.iter().all(|c| *c < 500),
            "a 5xx for {request:?}: {answer}"
        );
        if codes == [200] || codes == [201] {
            // Answered by the upstream, under its base path.
            assert!(
                body_of(&answer).contains("upstream /base/"),
                "{request:?}: {answer}"
            );
        }
    }
    assert_eq!(
        upstream.started(&key),
        1,
        "the absolute-form POST went to the upstream"
    );

    // CONNECT, then bytes meant for the tunnel: the upstream may see the
    // CONNECT itself (a reverse proxy's every request goes there), never what
    // was sent after it.
    let before = upstream.total();
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let connect = format!("CONNECT {v} HTTP/1.1\r\nHost: {v}\r\n\r\n");
    stream.write_all(connect.as_bytes()).await.unwrap();
    let mut head = vec![0u8; 4096];
    let n = tokio::time::timeout(patience, stream.read(&mut head))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(0);
    let _ = stream
        .write_all(b"GET / HTTP/1.1\r\nHost: tunnel\r\n\r\n")
        .await;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_millis(500), stream.read_to_end(&mut rest)).await;
    let answer = String::from_utf8_lossy(&head[..n]);
    assert!(
        upstream.total() <= before + 1,
        "bytes sent after a CONNECT reached the upstream as a request"
    );
    assert!(
        statuses(&answer).iter().all(|c| *c < 500),
        "CONNECT: {answer}"
    );

    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        victim.connections.load(Ordering::SeqCst),
        0,
        "the proxy connected to a host other than its upstream"
    );
}

// === path traversal ===

/// Files a traversal would reach, by what they hold.
const FILE_MARKERS: &[&str] = &["[package]", "root:x:0:0", "fn main", "#![", "//!"];

/// `..` and its spellings under `/docs/` and `/console/assets/` on `serve`'s
/// listener: a 4xx, never a file of the disk or of the source, never a 5xx.
/// Through the proxy's listener, the same targets and `..` aimed at
/// idemgate's own routes go to the origin, under the upstream's base path,
/// exactly as sent: idemgate's operators' endpoints, metrics and console are
/// never reached from the proxy's listener.
///
/// Would have caught: `/docs` or the console's assets served from a
/// directory by a path joined from the request (`ServeDir` without its
/// checks, a `format!("assets/{file}")` read from disk): `..%2f` walks out
/// of it; a proxy listener that resolves `..` itself and hands
/// `/x/../v1/admin/keys` to its own admin router instead of the origin.
#[tokio::test]
async fn traversal_reaches_no_file_and_through_the_proxy_only_the_origin() {
    let dir = tempfile::tempdir().unwrap();
    let url = Backend::sqlite_url(&dir);
    let app = TestApp::new(&url, &[]).await;
    let (api, api_task) = serve_on_socket(app.router.clone(), Duration::from_secs(5)).await;
    let climbs = [
        "../Cargo.toml",
        "../../Cargo.toml",
        "..%2fCargo.toml",
        "..%2f..%2fCargo.toml",
        "%2e%2e/%2e%2e/Cargo.toml",
        "%2e%2e%2f%2e%2e%2fCargo.toml",
        "%2E%2E%2F%2E%2E%2Fsrc%2Fmain.rs",
        "..%5c..%5cCargo.toml",
        "%252e%252e%252fCargo.toml",
        "....//....//Cargo.toml",
        "../../../../../../../../etc/passwd",
        "..%2f..%2f..%2f..%2f..%2f..%2fetc%2fpasswd",
        "x/../../src/server/console/mod.rs",
        "./../mod.rs",
        "..",
        "%2e%2e",
    ];
    for base in ["/docs/", "/console/assets/"] {
        for climb in climbs {
            let target = format!("{base}{climb}");
            let request = format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            let (answer, _) = exchange(api, request.as_bytes(), Duration::from_secs(5)).await;
            let codes = statuses(&answer);
            assert!(
                codes.len() == 1 && (400..500).contains(&codes[0]),
                "{target}: {answer:.300}"
            );
            for marker in FILE_MARKERS {
                assert!(
                    !body_of(&answer).contains(marker),
                    "{target} served a file holding {marker:?}"
                );
            }
        }
    }
    api_task.abort();

    // Through the proxy: every one of them, and `..` aimed at idemgate's own
    // routes, reaches the origin as sent, under the base path.
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&url, &format!("{}/base", upstream.url()), &[], Vec::new()).await;
    let mut targets: Vec<String> = climbs.iter().map(|c| format!("/docs/{c}")).collect();
    targets.extend(
        [
            "/x/../v1/admin/keys",
            "/../v1/admin/keys?state=stuck",
            "/%2e%2e/metrics",
            "/./console",
            "/x/%2e%2e/console/assets/console.js",
            "/docs/../v1/policy",
        ]
        .map(str::to_owned),
    );
    for target in &targets {
        let request = format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let (answer, _) = exchange(proxy.addr, request.as_bytes(), Duration::from_secs(5)).await;
        assert_eq!(statuses(&answer), [200], "{target}: {answer:.300}");
        let (path, _) = target.split_once('?').unwrap_or((target, ""));
        assert_eq!(
            body_of(&answer),
            format!("upstream /base{path}"),
            "{target}: the origin did not get it as sent"
        );
    }
    assert_eq!(
        upstream.total(),
        targets.len(),
        "each went to the origin once"
    );
}

// === many slow heads ===

/// Forty connections that dribble a head, a byte at a time, on the proxy's
/// listener and forty on its admin listener: every one is closed at the
/// header read timeout, none is answered, and a request sent meanwhile on
/// each listener is answered at once.
///
/// Would have caught: a listener without a head timeout, or one whose timer
/// restarts with each byte (slowloris: a few hundred such connections hold a
/// server's every slot for ever); the admin listener served without the
/// timers the proxy's own has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_by_the_dozen_are_cut_and_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(
        &Backend::sqlite_url(&dir),
        &upstream.url(),
        &["--header-read-timeout", "1"],
        Vec::new(),
    )
    .await;
    let admin: SocketAddr = proxy.admin.trim_start_matches("http://").parse().unwrap();
    let began = Instant::now();
    let mut dribblers = Vec::new();
    for addr in [proxy.addr, admin] {
        for _ in 0..40 {
            dribblers.push(tokio::spawn(async move {
                let mut stream = TcpStream::connect(addr).await.unwrap();
                let head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
                for byte in head.iter().cycle().take(400) {
                    if stream.write_all(&[*byte]).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
                let mut got = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(1), stream.read_to_end(&mut got))
                    .await;
                (began.elapsed(), got)
            }));
        }
    }
    // While they dribble, others are served on both listeners.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = Instant::now();
    assert_eq!(proxy.send("GET", "/ok", &[], None).await.status, 201);
    assert_eq!(proxy.admin_get("/healthz").await.0, 200);
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "others waited {:?} behind the slow heads",
        asked.elapsed()
    );
    for dribbler in dribblers {
        let (cut_after, got) = dribbler.await.unwrap();
        assert!(
            got.is_empty()
                || statuses(&String::from_utf8_lossy(&got))
                    .iter()
                    .all(|c| *c >= 400),
            "a dribbled head was answered: {}",
            String::from_utf8_lossy(&got)
        );
        assert!(
            cut_after < Duration::from_secs(4),
            "a dribbled head was held {cut_after:?} (its 400 bytes take 10 s)"
        );
    }
}

// === 300 holders of one key ===

/// 300 identical requests with one key released together by a barrier
/// through the proxy (half of them asking not to wait), then 300 reserves of
/// one key on the reservation API: the origin runs once, one reserve holds
/// the key, every other answer is its replay or `409 request-in-flight`, no
/// 5xx; on both stores.
///
/// Would have caught: a check-then-insert claim (two callers both find no
/// row and both run), a waiter that re-claims when the holder finishes
/// instead of reading its result, a SQLite path that loses the race under
/// its write lock, or a 5xx under the crowd.
async fn three_hundred_holders_of_one_key_run_it_once(b: Backend) {
    const N: usize = 300;
    let upstream = Upstream::start_numbered().await;
    let proxy = Arc::new(TestProxy::start(&b.url(), &upstream.url(), &[], Vec::new()).await);
    let key = fresh_key();
    let barrier = Arc::new(Barrier::new(N));
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(N)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut tasks = Vec::with_capacity(N);
    for i in 0..N {
        let (proxy, key, barrier, http) =
            (proxy.clone(), key.clone(), barrier.clone(), http.clone());
        tasks.push(tokio::spawn(async move {
            let mut headers = vec![
                ("idempotency-key", key.as_str()),
                ("content-type", "application/json"),
            ];
            let now = i % 2 == 0;
            if now {
                headers.push(("prefer", "wait=0"));
            }
            barrier.wait().await;
            let res = proxy
                .send_with(
                    &http,
                    "POST",
                    "/numbered/300",
                    &headers,
                    Some(r#"{"amount":1}"#),
                )
                .await
                .expect("the proxy answers");
            (now, res)
        }));
    }
    let (mut executed, mut replays, mut conflicts) = (Vec::new(), Vec::new(), 0);
    for task in tasks {
        let (now, res) = task.await.unwrap();
        match (res.status.as_u16(), replayed(&res)) {
            (201, false) => executed.push(res.body),
            (201, true) => replays.push(res.body),
            (409, false) if now => {
                res.assert_problem(409, "request-in-flight");
                conflicts += 1;
            }
            other => panic!("unexpected {other:?}: {res:#?}"),
        }
    }
    assert_eq!(
        upstream.started(&key),
        1,
        "the origin ran the key more than once"
    );
    assert_eq!(executed.len(), 1, "{} executions answered", executed.len());
    assert_eq!(executed[0]["execution"], 1);
    assert!(
        replays.iter().all(|r| *r == executed[0]),
        "a replay differs"
    );
    assert_eq!(1 + replays.len() + conflicts, N);
    assert!(replays.len() >= N / 2 - 1, "every waiter got the replay");

    // The reservation API: one holder, then one stored response for all.
    let app = Arc::new(TestApp::new(&b.url(), &[]).await);
    let key = fresh_key();
    let reserve_all = async || {
        let barrier = Arc::new(Barrier::new(N));
        let mut tasks = Vec::with_capacity(N);
        for _ in 0..N {
            let (app, key, barrier) = (app.clone(), key.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                app.reserve(&key, r#"{"fingerprint":"one","lease_seconds":60}"#)
                    .await
            }));
        }
        let mut all = Vec::with_capacity(N);
        for task in tasks {
            all.push(task.await.unwrap());
        }
        all
    };
    let answers = reserve_all().await;
    let holders: Vec<_> = answers.iter().filter(|r| r.status == 201).collect();
    assert_eq!(holders.len(), 1, "holders of one key");
    for res in answers.iter().filter(|r| r.status != 201) {
        res.assert_problem(409, "request-in-flight");
    }
    let id = holders[0].reservation_id();
    let commit = app
        .act(&id, "commit", r#"{"status":201,"body":"once"}"#)
        .await;
    assert_eq!(commit.status, 200, "{commit:#?}");
    for res in reserve_all().await {
        assert_eq!(res.status, 200, "{res:#?}");
        assert_eq!(res.body["response"]["body"], "once");
    }
}

both_stores!(
    serial: [every_route_of_the_document_keeps_tenants_apart],
    concurrent: [three_hundred_holders_of_one_key_run_it_once],
);

// === no secret in a log line at RUST_LOG=debug ===

/// A real `idemgate` process at `RUST_LOG=debug` (every crate, not only
/// idemgate's), its stdout and stderr in files.
struct Debugged {
    child: std::process::Child,
    out: tempfile::NamedTempFile,
}

impl Debugged {
    async fn start(args: &[&str], env: &[(&str, &str)], ready: &str) -> Debugged {
        let out = tempfile::NamedTempFile::new().unwrap();
        // Both streams append to one file, neither overwriting the other.
        let append = || {
            std::fs::OpenOptions::new()
                .append(true)
                .open(out.path())
                .unwrap()
        };
        let child = std::process::Command::new(BIN)
            .args(args)
            .env_remove("IDEMGATE_TOKENS")
            .env_remove("IDEMGATE_ADMIN_TOKENS")
            .env_remove("IDEMGATE_CONFIG")
            .envs(env.iter().copied())
            .env("RUST_LOG", "debug")
            .stdin(std::process::Stdio::null())
            .stdout(append())
            .stderr(append())
            .spawn()
            .unwrap();
        let began = Instant::now();
        while !common::http()
            .get(ready)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            assert!(began.elapsed() < Duration::from_secs(20), "not ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Debugged { child, out }
    }

    /// Stops it; everything it wrote.
    fn finish(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::fs::read_to_string(self.out.path()).unwrap()
    }
}

#[track_caller]
fn assert_none_in(what: &str, text: &str, secrets: &[(&str, &str)]) {
    for (name, secret) in secrets {
        assert!(!text.contains(secret), "{name} appears in {what}");
    }
}

/// `serve` with tenant tokens, admin tokens and a seal key, and `proxy` with
/// credentials in `Authorization` and `Cookie`, both at `RUST_LOG=debug`:
/// reserves, commits, replays, a mismatch, a key marked unknown, the admin
/// list, show and resolve, the console's lookup by raw key, a wrong admin
/// token and a tenant's token on an admin route. No raw key, token, admin
/// token, seal key, cookie or body appears in any line the processes wrote,
/// nor in `/metrics`.
///
/// Would have caught: a dependency's debug line that prints a request's
/// headers or a statement's bound values (hyper, h2, sqlx, rustls, tower-http
/// at debug; `security.rs` runs them at info), an admin or console handler
/// that logs the raw key it was given to hash, or a resolution log line
/// that carries the operator's token instead of its name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_in_any_log_line_at_debug() {
    use reqwest::Method;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("debug.db").display());
    let id = || uuid::Uuid::new_v4().simple().to_string();
    let (stuck_key, done_key, proxy_key) = (
        format!("rawkey-stuck-{}", id()),
        format!("rawkey-done-{}", id()),
        format!("rawkey-proxy-{}", id()),
    );
    let (card, answer, reason, cookie, proxy_body, wrong_admin) = (
        format!("rawcard-{}", id()),
        format!("rawanswer-{}", id()),
        format!("rawreason-{}", id()),
        format!("rawcookie-{}", id()),
        format!("rawproxybody-{}", id()),
        format!("wrong-admin-{}", id()),
    );
    let proxy_token = format!("proxy-cred-{}", id());
    let http = common::http();
    let send = async |method: Method, url: &str, headers: &[(&str, &str)], body: String| {
        let mut req = http.request(method, url);
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        let res = req.body(body).send().await.unwrap();
        let status = res.status().as_u16();
        (status, res.text().await.unwrap())
    };

    // --- serve ---
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let listen = format!("127.0.0.1:{port}");
    let admin_tokens = format!("ops:{ADMIN_TOKEN}");
    let serve = Debugged::start(
        &["serve", "--listen", &listen],
        &[
            ("DATABASE_URL", &db),
            ("IDEMGATE_TOKENS", TOKENS),
            ("IDEMGATE_ADMIN_TOKENS", &admin_tokens),
            ("IDEMGATE_SEAL_KEY", SEAL),
        ],
        &format!("{base}/readyz"),
    )
    .await;
    let reserve = format!("{base}/v1/reservations");
    let admin_bearer = format!("Bearer {ADMIN_TOKEN}");
    let acme = [
        ("authorization", ACME),
        ("content-type", "application/json"),
    ];
    let admin = [("authorization", admin_bearer.as_str())];
    // A key whose effect is unknown, with a card number in its request.
    let body = format!(
        r#"{{"request":{{"method":"POST","path":"/pay","body":{{"card":"{card}"}}}},"on_lease_expiry":"hold"}}"#
    );
    let (s, text) = send(
        Method::POST,
        &reserve,
        &[acme[0], acme[1], ("idempotency-key", stuck_key.as_str())],
        body,
    )
    .await;
    assert_eq!(s, 201, "{text}");
    let rid = serde_json::from_str::<Value>(&text).unwrap()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (s, text) = send(
        Method::POST,
        &format!("{reserve}/{rid}/unknown"),
        &acme,
        format!(r#"{{"reason":"{reason}"}}"#),
    )
    .await;
    assert_eq!(s, 200, "{text}");
    // The operators' doors.
    let (s, text) = send(
        Method::GET,
        &format!("{base}/v1/admin/keys?state=stuck"),
        &admin,
        String::new(),
    )
    .await;
    assert_eq!(s, 200, "{text}");
    let listed: Value = serde_json::from_str(&text).unwrap();
    let hash = listed["keys"][0]["key_hash"].as_str().unwrap().to_owned();
    let (s, text) = send(
        Method::POST,
        &format!("{base}/console/fragments/lookup"),
        &[
            admin[0],
            ("content-type", "application/x-www-form-urlencoded"),
        ],
        format!("tenant=acme&kind=raw&key={stuck_key}"),
    )
    .await;
    assert!(s < 500, "{s}: {text}");
    let key_url = format!("{base}/v1/admin/keys/acme/{hash}");
    let (s, text) = send(Method::GET, &key_url, &admin, String::new()).await;
    assert_eq!(s, 200, "{text}");
    let resolve = format!(
        r#"{{"action":"complete","response":{{"status":201,"body":"{answer}"}},"reason":"{reason}"}}"#
    );
    let (s, text) = send(Method::POST, &format!("{key_url}/resolve"), &admin, resolve).await;
    assert_eq!(s, 200, "{text}");
    let wrong = format!("Bearer {wrong_admin}");
    let (s, _) = send(
        Method::GET,
        &format!("{base}/v1/admin/keys"),
        &[("authorization", &wrong)],
        String::new(),
    )
    .await;
    assert_eq!(s, 401);
    let (s, _) = send(
        Method::GET,
        &format!("{base}/v1/admin/keys"),
        &acme,
        String::new(),
    )
    .await;
    assert_eq!(s, 403);
    // A key done the ordinary way, replayed and mismatched.
    let (s, text) = send(
        Method::POST,
        &reserve,
        &[acme[0], acme[1], ("idempotency-key", done_key.as_str())],
        format!(r#"{{"request":{{"method":"POST","path":"/pay","body":{{"card":"{card}"}}}}}}"#),
    )
    .await;
    assert_eq!(s, 201, "{text}");
    let rid = serde_json::from_str::<Value>(&text).unwrap()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (s, _) = send(
        Method::POST,
        &format!("{reserve}/{rid}/commit"),
        &acme,
        format!(r#"{{"status":201,"body":"{answer}"}}"#),
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = send(
        Method::POST,
        &reserve,
        &[acme[0], acme[1], ("idempotency-key", done_key.as_str())],
        format!(r#"{{"request":{{"method":"POST","path":"/pay","body":{{"card":"{card}"}}}}}}"#),
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = send(
        Method::POST,
        &reserve,
        &[acme[0], acme[1], ("idempotency-key", done_key.as_str())],
        r#"{"fingerprint":"another"}"#.to_owned(),
    )
    .await;
    assert_eq!(s, 422);
    let (_, serve_metrics) =
        send(Method::GET, &format!("{base}/metrics"), &[], String::new()).await;
    let serve_log = serve.finish();
    assert!(
        serve_log.contains("DEBUG"),
        "the log is at debug: {serve_log:.2000}"
    );

    // --- proxy ---
    let upstream = Upstream::start().await;
    let (port, admin_port) = (free_port(), free_port());
    let base = format!("http://127.0.0.1:{port}");
    let admin_base = format!("http://127.0.0.1:{admin_port}");
    let proxy_db = format!("sqlite://{}", dir.path().join("proxy.db").display());
    let proxy = Debugged::start(
        &[
            "proxy",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin_port}"),
            "--upstream",
            &upstream.url(),
        ],
        &[("DATABASE_URL", &proxy_db), ("IDEMGATE_SEAL_KEY", SEAL)],
        &format!("{admin_base}/readyz"),
    )
    .await;
    let bearer = format!("Bearer {proxy_token}");
    let cookie_header = format!("session={cookie}");
    let headers = [
        ("authorization", bearer.as_str()),
        ("cookie", cookie_header.as_str()),
        ("idempotency-key", proxy_key.as_str()),
        ("content-type", "application/json"),
    ];
    let body = format!(r#"{{"card":"{proxy_body}"}}"#);
    for expected in [201, 201] {
        let (s, _) = send(
            Method::POST,
            &format!("{base}/ok/pay"),
            &headers,
            body.clone(),
        )
        .await;
        assert_eq!(s, expected);
    }
    let (s, _) = send(
        Method::POST,
        &format!("{base}/ok/pay"),
        &headers,
        r#"{"card":"other"}"#.to_owned(),
    )
    .await;
    assert_eq!(s, 422);
    assert_eq!(upstream.started(&proxy_key), 1);
    let (_, proxy_metrics) = send(
        Method::GET,
        &format!("{admin_base}/metrics"),
        &[],
        String::new(),
    )
    .await;
    let proxy_log = proxy.finish();

    let secrets = [
        ("acme's token", "acme-held-tok-71c2e0"),
        ("globex's token", "globex-held-tok-9a4d13"),
        ("the admin token", ADMIN_TOKEN),
        ("a wrong admin token", wrong_admin.as_str()),
        ("the seal key", SEAL),
        ("the stuck key", stuck_key.as_str()),
        ("the completed key", done_key.as_str()),
        ("the proxied key", proxy_key.as_str()),
        ("a request body", card.as_str()),
        ("a stored response", answer.as_str()),
        ("the proxy's credential", proxy_token.as_str()),
        ("a cookie", cookie.as_str()),
        ("a proxied body", proxy_body.as_str()),
    ];
    assert_none_in("serve's log", &serve_log, &secrets);
    // A log line may name a key by a short prefix of its hash, never the
    // whole of it (the admin routes carry it in their paths).
    assert_none_in("serve's log", &serve_log, &[("a key's whole hash", &hash)]);
    assert_none_in("the proxy's log", &proxy_log, &secrets);
    assert_none_in("serve's /metrics", &serve_metrics, &secrets);
    assert_none_in("the proxy's /metrics", &proxy_metrics, &secrets);
}
