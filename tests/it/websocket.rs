//! Protocol upgrades (WebSocket) pass through unguarded, as through any
//! reverse proxy: through the real `idemgate proxy` to a real WebSocket
//! origin, past the proxy's keep-alive timeout and through its shutdown;
//! an origin that refuses is answered as it answered; a guarded method that
//! asks to upgrade is an ordinary keyed request; a `101` to a request that
//! did not ask for one is a `502`, never recorded; and behind the layer, an
//! axum WebSocket handler works.
//!
//! Rerun: `cargo test --test it websocket::`.

use crate::common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ws::{Message as AxumMessage, WebSocket, WebSocketUpgrade};
use axum::routing::{get, post};
use common::app::fresh_key;
use common::backend::Backend;
use common::bin::{drain_stderr, signal, wait_exit};
use common::logs;
use common::pg::TestDb;
use common::proxy::{ProxyProcess, TestProxy, replayed};
use common::upstream::Upstream;
use futures::{SinkExt, StreamExt};
use http::{HeaderMap, Request, StatusCode};
use idemgate::IdempotencyLayer;
use idemgate::engine::{Engine, Limits};
use idemgate::layer::LayerPolicy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::handshake::server::{Request as Handshake, Response as Accept};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream, connect_async};
use tower::ServiceExt;

type Client = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A WebSocket echo origin on 127.0.0.1, port 0, that remembers the head
/// of every handshake it accepted.
struct WsOrigin {
    addr: SocketAddr,
    handshakes: Arc<Mutex<Vec<(String, HeaderMap)>>>,
    task: JoinHandle<()>,
}

impl WsOrigin {
    async fn start() -> WsOrigin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handshakes = Arc::new(Mutex::new(Vec::new()));
        let seen = handshakes.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    #[expect(clippy::result_large_err, reason = "tungstenite's callback type")]
                    let remember = |req: &Handshake, res: Accept| {
                        seen.lock()
                            .unwrap()
                            .push((req.uri().to_string(), req.headers().clone()));
                        Ok(res)
                    };
                    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, remember).await
                    else {
                        return;
                    };
                    while let Some(Ok(msg)) = ws.next().await {
                        if (msg.is_text() || msg.is_binary()) && ws.send(msg).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        WsOrigin {
            addr,
            handshakes,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn handshakes(&self) -> Vec<(String, HeaderMap)> {
        self.handshakes.lock().unwrap().clone()
    }
}

impl Drop for WsOrigin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sends `msg` and expects it back within 5 s.
async fn echo(ws: &mut Client, msg: Message) {
    ws.send(msg.clone())
        .await
        .expect("the WebSocket takes a message");
    let back = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .expect("an echo within 5 s")
        .expect("the WebSocket is still open")
        .expect("a message, not an error");
    assert_eq!(back, msg);
}

/// Text and binary messages, a few round trips.
async fn chat(ws: &mut Client, round: &str) {
    for i in 0..3 {
        echo(ws, Message::text(format!("{round} text {i}"))).await;
        echo(ws, Message::binary(vec![0, 1, 2, 255, i])).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_through_the_proxy_outlives_its_connection_timers() {
    let db = TestDb::new().await;
    let origin = WsOrigin::start().await;
    // Both connection timers short: a switched connection must be under
    // neither (an idle one's, nor the one a request head gets from its first
    // byte).
    let timers = ["--keep-alive-timeout", "1", "--header-read-timeout", "1"];
    let mut proxy = ProxyProcess::start_with(&db, &origin.url(), &timers).await;
    let log = drain_stderr(&mut proxy.child);

    let url = format!("ws://127.0.0.1:{}/chat?room=7", proxy.port);
    let (mut ws, res) = connect_async(url).await.expect("the handshake succeeds");
    assert_eq!(res.status(), StatusCode::SWITCHING_PROTOCOLS);
    assert_eq!(res.headers()["upgrade"].to_str().unwrap(), "websocket");
    chat(&mut ws, "before").await;
    // Silence longer than either timeout: an idle HTTP connection would be
    // closed by now, a WebSocket is not.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    chat(&mut ws, "after").await;
    ws.close(None).await.unwrap();

    let handshakes = origin.handshakes();
    assert_eq!(handshakes.len(), 1, "{handshakes:?}");
    let (uri, headers) = &handshakes[0];
    assert_eq!(uri, "/chat?room=7");
    assert_eq!(headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(headers["x-forwarded-proto"], "http");
    assert!(
        !log.lock().unwrap().contains("panicked"),
        "{}",
        log.lock().unwrap()
    );
}

#[tokio::test]
async fn a_refused_upgrade_gets_the_origins_answer() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&db.url, &upstream.url(), &[], Vec::new()).await;
    for (path, status, body) in [
        ("/status/400", 400, "status 400"),
        ("/not-a-socket", 200, "upstream /not-a-socket"),
    ] {
        let url = format!("ws://{}{path}", proxy.addr);
        match connect_async(url).await {
            Err(WsError::Http(res)) => {
                assert_eq!(res.status().as_u16(), status, "{path}");
                if let Some(got) = res.body() {
                    assert_eq!(String::from_utf8_lossy(got), body, "{path}");
                }
            }
            Err(e) => panic!("{path}: not the origin's answer but {e}"),
            Ok(_) => panic!("{path}: the upgrade succeeded"),
        }
    }
    assert_eq!(upstream.total(), 2);
}

/// A POST that asks to switch to WebSocket, on a connection that closes
/// after it; `key` if any.
fn upgrade_post(proxy: &TestProxy, key: Option<&str>) -> String {
    let key = key.map_or(String::new(), |k| format!("Idempotency-Key: {k}\r\n"));
    format!(
        "POST /echo/ws HTTP/1.1\r\nHost: {}\r\nConnection: Upgrade, close\r\n\
         Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n{key}\
         Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}",
        proxy.addr
    )
}

#[tokio::test]
async fn a_guarded_upgrade_request_is_an_ordinary_keyed_request() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(
        &db.url,
        &upstream.url(),
        &["--require-key", "true"],
        Vec::new(),
    )
    .await;

    let res = proxy.send_raw_request(&upgrade_post(&proxy, None)).await;
    res.assert_problem(400, "key-missing");
    assert_eq!(
        upstream.total(),
        0,
        "a keyless POST must not reach the origin"
    );

    let key = fresh_key();
    let secret = key.trim_matches('"').to_owned();
    proxy.secrets.lock().unwrap().push(secret);
    let first = proxy
        .send_raw_request(&upgrade_post(&proxy, Some(&key)))
        .await;
    assert_eq!(first.status, 200, "{first:#?}");
    assert_eq!(first.body["method"], "POST");
    let seen = first.body["headers"].as_object().unwrap();
    assert!(seen.get("upgrade").is_none(), "{seen:?}");
    assert!(seen.get("connection").is_none(), "{seen:?}");
    assert_eq!(upstream.total(), 1);

    let retry = proxy
        .send_raw_request(&upgrade_post(&proxy, Some(&key)))
        .await;
    assert_eq!(retry.status, 200);
    assert!(replayed(&retry), "{retry:#?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.total(), 1);
}

/// An origin that answers `101 Switching Protocols` to every request, asked
/// or not, and counts them.
async fn switching_origin() -> (SocketAddr, Arc<Mutex<usize>>, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(Mutex::new(0));
    let counted = count.clone();
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                *counted.lock().unwrap() += 1;
                let _ = stream
                    .write_all(
                        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\
                          Connection: upgrade\r\n\r\n",
                    )
                    .await;
                // Holds the switched connection open for a while.
                let mut rest = [0u8; 1024];
                let _ = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut rest)).await;
            });
        }
    });
    (addr, count, task)
}

#[tokio::test]
async fn a_101_to_a_request_that_did_not_ask_is_a_502() {
    let db = TestDb::new().await;
    let (origin, count, task) = switching_origin().await;
    let proxy = TestProxy::start(&db.url, &format!("http://{origin}"), &[], Vec::new()).await;

    let key = fresh_key();
    let res = proxy.post("/pay", &key, r#"{"amount":5}"#).await;
    res.assert_problem(502, "upstream-unavailable");
    assert_eq!(*count.lock().unwrap(), 1);
    // The request was sent, its outcome unknown: the key is held, and a
    // retry does not reach the origin a second time.
    let retry = proxy.post("/pay", &key, r#"{"amount":5}"#).await;
    retry.assert_problem(409, "outcome-unknown");
    assert_eq!(*count.lock().unwrap(), 1);

    // Unguarded, it is not recorded either way, and still no 101.
    let res = proxy.send("GET", "/feed", &[], None).await;
    res.assert_problem(502, "upstream-unavailable");
    assert_eq!(*count.lock().unwrap(), 2);
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_does_not_wait_for_an_open_websocket() {
    const GRACE: u64 = 30;
    let db = TestDb::new().await;
    let origin = WsOrigin::start().await;
    let grace = GRACE.to_string();
    let mut proxy =
        ProxyProcess::start_with(&db, &origin.url(), &["--shutdown-grace", &grace]).await;
    let log = drain_stderr(&mut proxy.child);
    let url = format!("ws://127.0.0.1:{}/chat", proxy.port);
    let (mut ws, _) = connect_async(url).await.expect("the handshake succeeds");
    echo(&mut ws, Message::text("hello")).await;

    let signalled = Instant::now();
    signal(proxy.child.id(), "TERM");
    let status = wait_exit(&mut proxy.child, Duration::from_secs(10))
        .await
        .unwrap_or_else(|| {
            panic!(
                "still running 10 s after SIGTERM (grace {GRACE} s): the open WebSocket held \
                 the shutdown\n{}",
                log.lock().unwrap()
            )
        });
    assert!(status.success(), "exit {status}:\n{}", log.lock().unwrap());
    eprintln!(
        "[websocket] SIGTERM with an open WebSocket: exit 0 after {:?}",
        signalled.elapsed()
    );
    // The WebSocket ended with the process.
    let after = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .expect("the WebSocket ends with the proxy");
    assert!(!matches!(after, Some(Ok(Message::Text(_)))), "{after:?}");
}

/// An axum app with a WebSocket echo route and a POST route that reports
/// whether its connection could switch, behind the layer with a short
/// answer timeout.
async fn layered_app(backend: &Backend) -> Router {
    logs::init();
    let engine = Arc::new(Engine::new(backend.open().await, Limits::default()));
    let policy = LayerPolicy::default().answer_timeout(Some(Duration::from_secs(1)));
    Router::new()
        .route(
            "/ws",
            get(|upgrade: WebSocketUpgrade| async move { upgrade.on_upgrade(echo_socket) }),
        )
        .route(
            "/upgradable",
            post(|req: Request<Body>| async move {
                let can = req
                    .extensions()
                    .get::<hyper::upgrade::OnUpgrade>()
                    .is_some();
                format!("upgradable: {can}")
            }),
        )
        .route(
            "/switch",
            post(|| async {
                let mut res = http::Response::new(Body::empty());
                *res.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
                res
            }),
        )
        .layer(IdempotencyLayer::new(engine, policy))
}

async fn echo_socket(mut socket: WebSocket) {
    while let Some(Ok(msg)) = socket.recv().await {
        let echo = match msg {
            AxumMessage::Text(_) | AxumMessage::Binary(_) => msg,
            AxumMessage::Close(_) => return,
            AxumMessage::Ping(_) | AxumMessage::Pong(_) => continue,
        };
        if socket.send(echo).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_passes_a_websocket_handshake_to_an_axum_handler() {
    let backend = Backend::sqlite().await;
    let app = layered_app(&backend).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });

    let (mut ws, res) = connect_async(format!("ws://{addr}/ws"))
        .await
        .expect("the handshake succeeds behind the layer");
    assert_eq!(res.status(), StatusCode::SWITCHING_PROTOCOLS);
    chat(&mut ws, "layer").await;
    // Longer than the answer timeout, which bounds the wait for the 101 only.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    chat(&mut ws, "later").await;
    ws.close(None).await.unwrap();

    // A guarded request is never upgraded, whatever it asks for.
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let key = fresh_key();
    let ask = |path: &str, key: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade, close\r\n\
             Upgrade: websocket\r\nIdempotency-Key: {key}\r\nContent-Length: 0\r\n\r\n"
        )
    };
    stream
        .write_all(ask("/upgradable", &key).as_bytes())
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("upgradable: false"), "{answer}");
    server.abort();
}

#[tokio::test]
async fn layer_never_records_a_101() {
    let backend = Backend::sqlite().await;
    let app = layered_app(&backend).await;
    let switch = |key: &str| {
        Request::post("/switch")
            .header("idempotency-key", key)
            .body(Body::empty())
            .unwrap()
    };
    let key = fresh_key();
    let res = app.clone().oneshot(switch(&key)).await.unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    // Not stored: the key stays in flight, and a retry is not a replay.
    let retry = app.oneshot(switch(&key)).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CONFLICT);
    assert!(retry.headers().get("idempotent-replayed").is_none());
}
