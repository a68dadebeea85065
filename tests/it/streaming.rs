//! Streamed responses through the proxy and the layer: each chunk reaches
//! the client as the origin sends it, a copy is recorded as it passes, and
//! the key is settled when the stream ends (stored whole, a tombstone past
//! the body limit, or left in flight when it breaks off).
//!
//! The origin here is scripted: the test hands it each piece of its answer
//! in turn and reads what the client got before sending the next, so that
//! "the client had the first event before the origin sent the second" is
//! an observation, not a timing guess.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::response::Response;
use common::app::fresh_key;
use common::backend::Backend;
use common::proxy::{TestProxy, replayed};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idemgate::engine::{Engine, Limits};
use idemgate::{IdempotencyLayer, LayerPolicy};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tower::{Layer, ServiceExt};

/// One piece of a scripted answer.
enum Piece {
    Chunk(Bytes),
    /// The origin breaks the connection off here.
    Break,
}

/// A scripted answer: its head, and the pieces the test feeds it.
struct Script {
    content_type: &'static str,
    content_length: Option<usize>,
    pieces: mpsc::UnboundedReceiver<Piece>,
}

/// The test's end of a script.
struct Feed(Option<mpsc::UnboundedSender<Piece>>);

impl Feed {
    fn send(&self, text: &str) {
        let tx = self.0.as_ref().expect("the script is still open");
        tx.send(Piece::Chunk(Bytes::from(text.to_owned())))
            .expect("the origin reads its script");
    }

    fn break_off(&self) {
        let _ = self.0.as_ref().map(|tx| tx.send(Piece::Break));
    }

    /// Ends the answer cleanly.
    fn end(&mut self) {
        self.0 = None;
    }
}

#[derive(Default)]
struct Scripts {
    waiting: Mutex<HashMap<String, Script>>,
    /// Executions per script id.
    calls: Mutex<HashMap<String, usize>>,
}

/// An origin that answers `POST /stream/{id}` with script `id`.
struct Origin {
    url: String,
    scripts: Arc<Scripts>,
    _task: tokio::task::JoinHandle<()>,
}

impl Origin {
    async fn start() -> Origin {
        let scripts = Arc::new(Scripts::default());
        let app = Router::new()
            .route("/stream/{id}", axum::routing::post(scripted))
            .with_state(scripts.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Origin {
            url,
            scripts,
            _task: task,
        }
    }

    /// A new script; its id goes in the path.
    fn script(&self, content_type: &'static str, content_length: Option<usize>) -> (String, Feed) {
        let id = uuid::Uuid::new_v4().to_string();
        let (tx, pieces) = mpsc::unbounded_channel();
        self.scripts.waiting.lock().unwrap().insert(
            id.clone(),
            Script {
                content_type,
                content_length,
                pieces,
            },
        );
        (id, Feed(Some(tx)))
    }

    fn calls(&self, id: &str) -> usize {
        self.scripts
            .calls
            .lock()
            .unwrap()
            .get(id)
            .copied()
            .unwrap_or(0)
    }
}

async fn scripted(State(scripts): State<Arc<Scripts>>, Path(id): Path<String>) -> Response {
    *scripts.calls.lock().unwrap().entry(id.clone()).or_default() += 1;
    let Some(script) = scripts.waiting.lock().unwrap().remove(&id) else {
        // A second execution: the test sees it in the count.
        let mut res = Response::new(Body::from("executed again"));
        *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        return res;
    };
    let stream = futures::stream::unfold(script.pieces, |mut pieces| async move {
        match pieces.recv().await? {
            Piece::Chunk(bytes) => Some((Ok(bytes), pieces)),
            Piece::Break => Some((Err(std::io::Error::other("the origin broke off")), pieces)),
        }
    });
    let mut res = Response::new(Body::from_stream(stream));
    res.headers_mut()
        .insert("content-type", script.content_type.parse().unwrap());
    if let Some(len) = script.content_length {
        res.headers_mut().insert("content-length", len.into());
    }
    res
}

fn store_url(b: &Backend) -> String {
    match b {
        Backend::Postgres(db) => db.url.clone(),
        Backend::Sqlite(dir) => Backend::sqlite_url(dir),
    }
}

/// `POST /stream/{id}` through the proxy with `key`, answered as far as its
/// head.
async fn open(proxy: &TestProxy, id: &str, key: &str, extra: &[(&str, &str)]) -> reqwest::Response {
    let mut req = proxy
        .http
        .post(format!("{}/stream/{id}", proxy.base))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body("{}");
    for (name, value) in extra {
        req = req.header(*name, *value);
    }
    proxy.secrets.lock().unwrap().push(key.to_owned());
    req.send().await.expect("the proxy answers with a head")
}

/// The same request again, answered whole.
async fn again(proxy: &TestProxy, id: &str, key: &str) -> common::app::TestResponse {
    proxy
        .send(
            "POST",
            &format!("/stream/{id}"),
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ],
            Some("{}"),
        )
        .await
}

/// The next chunk of `res`, which must come.
async fn next_chunk(res: &mut reqwest::Response) -> String {
    let chunk = tokio::time::timeout(Duration::from_secs(10), res.chunk())
        .await
        .expect("a chunk within 10 s")
        .expect("the body goes on")
        .expect("a chunk, not the end");
    String::from_utf8(chunk.to_vec()).unwrap()
}

/// The rest of `res` to its clean end.
async fn rest(res: &mut reqwest::Response) -> String {
    let mut text = String::new();
    while let Some(chunk) = res.chunk().await.expect("the body ends cleanly") {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    text
}

async fn proxy_over(b: &Backend, origin: &Origin, flags: &[&str]) -> TestProxy {
    TestProxy::start(&store_url(b), &origin.url, flags, Vec::new()).await
}

// === the proxy ===

/// A server-sent-events stream: the client has each event as the origin
/// sends it; a duplicate that waits gets the whole stream once it ended; a
/// replay is the same bytes with the same content type.
async fn an_event_stream_is_streamed_and_replayed_whole(b: Backend) {
    let origin = Origin::start().await;
    let proxy = proxy_over(&b, &origin, &[]).await;
    let (id, mut feed) = origin.script("text/event-stream", None);
    let key = fresh_key();

    feed.send("event: token\ndata: Hello\n\n");
    let mut res = open(&proxy, &id, &key, &[]).await;
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    assert!(res.headers().contains_key("idempotency-expires"));
    assert!(!res.headers().contains_key("idempotent-replayed"));
    assert_eq!(next_chunk(&mut res).await, "event: token\ndata: Hello\n\n");

    // Still streaming: a duplicate is a 409, one that waits is held.
    let dup = again(&proxy, &id, &key).await;
    dup.assert_problem(409, "request-in-flight");
    let waiting = {
        let (base, key, id) = (proxy.base.clone(), key.clone(), id.clone());
        tokio::spawn(async move {
            common::http()
                .post(format!("{base}/stream/{id}"))
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .header("prefer", "wait=10")
                .body("{}")
                .send()
                .await
                .unwrap()
        })
    };

    feed.send("event: token\ndata: world\n\n");
    assert_eq!(next_chunk(&mut res).await, "event: token\ndata: world\n\n");
    feed.send("event: done\ndata: [DONE]\n\n");
    feed.end();
    let tail = rest(&mut res).await;
    let whole = format!("event: token\ndata: Hello\n\nevent: token\ndata: world\n\n{tail}");
    assert!(whole.ends_with("data: [DONE]\n\n"), "{whole:?}");

    let waited = waiting.await.unwrap();
    assert_eq!(waited.status(), 200);
    assert_eq!(waited.headers()["idempotent-replayed"], "true");
    assert_eq!(waited.headers()["content-type"], "text/event-stream");
    assert_eq!(waited.text().await.unwrap(), whole);

    let replay = again(&proxy, &id, &key).await;
    assert!(replayed(&replay), "{replay:#?}");
    assert_eq!(replay.header("content-type"), "text/event-stream");
    assert_eq!(replay.text, whole);
    assert_eq!(origin.calls(&id), 1, "executed once");
}

/// A client that hangs up mid-stream stops nothing: the upstream is read to
/// its end and the key completed, so the retry is replayed whole.
async fn a_client_that_hangs_up_mid_stream_does_not_stop_the_recording(b: Backend) {
    let origin = Origin::start().await;
    let proxy = proxy_over(&b, &origin, &[]).await;
    let (id, mut feed) = origin.script("text/event-stream", None);
    let key = fresh_key();

    feed.send("data: 1\n\n");
    let mut res = open(&proxy, &id, &key, &[]).await;
    assert_eq!(next_chunk(&mut res).await, "data: 1\n\n");
    drop(res);
    feed.send("data: 2\n\n");
    feed.send("data: 3\n\n");
    feed.end();

    let mut replay = None;
    // Poll the key (a 409 while the recording goes on) until it replays.
    for _ in 0..500 {
        let res = again(&proxy, &id, &key).await;
        if replayed(&res) {
            replay = Some(res);
            break;
        }
        res.assert_problem(409, "request-in-flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replay = replay.expect("the key completes although its client hung up");
    assert_eq!(replay.text, "data: 1\n\ndata: 2\n\ndata: 3\n\n");
    assert_eq!(origin.calls(&id), 1, "executed once");
}

/// Past the body limit the client gets the rest of the stream unchanged,
/// and the key completes as a tombstone.
async fn past_the_limit_the_stream_flows_on_and_the_key_is_a_tombstone(b: Backend) {
    let origin = Origin::start().await;
    let proxy = proxy_over(&b, &origin, &["--max-body-bytes", "64"]).await;
    let (id, mut feed) = origin.script("application/x-ndjson", None);
    let key = fresh_key();
    let line = |i: usize| format!("{{\"n\":{i},\"pad\":\"{}\"}}\n", "x".repeat(24));

    feed.send(&line(0));
    let mut res = open(&proxy, &id, &key, &[]).await;
    let mut got = next_chunk(&mut res).await;
    for i in 1..4 {
        feed.send(&line(i));
        got.push_str(&next_chunk(&mut res).await);
    }
    feed.end();
    got.push_str(&rest(&mut res).await);
    let sent: String = (0..4).map(line).collect();
    assert!(sent.len() > 64);
    assert_eq!(got, sent, "the client gets every byte");

    let replay = again(&proxy, &id, &key).await;
    assert!(replayed(&replay), "{replay:#?}");
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotency-body-omitted"), "true");
    assert_eq!(replay.text, "");
    assert_eq!(origin.calls(&id), 1, "executed once");
}

/// A stream that breaks off before its end: the client's body fails (it is
/// never passed off as whole), and the key's outcome is unknown: held, the
/// origin never called again for it.
async fn a_stream_that_breaks_off_leaves_the_outcome_unknown(b: Backend) {
    let origin = Origin::start().await;
    let proxy = proxy_over(&b, &origin, &[]).await;
    let (id, feed) = origin.script("text/event-stream", None);
    let key = fresh_key();

    feed.send("data: partial\n\n");
    let mut res = open(&proxy, &id, &key, &[]).await;
    assert_eq!(next_chunk(&mut res).await, "data: partial\n\n");
    feed.break_off();
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match res.chunk().await {
                Ok(Some(_)) => {}
                other => return other.map(|_| ()),
            }
        }
    })
    .await
    .expect("the body ends within 10 s");
    assert!(end.is_err(), "a broken stream must not end cleanly");

    again(&proxy, &id, &key)
        .await
        .assert_problem(409, "outcome-unknown");
    assert_eq!(origin.calls(&id), 1);
}

/// The client's response ends only once the key is settled: a client that
/// has the whole body and retries at once is replayed, for a body with a
/// Content-Length (whose last chunk waits for the commit) and a chunked one
/// (whose end does).
async fn a_client_with_the_whole_response_finds_the_key_completed(b: Backend) {
    let origin = Origin::start().await;
    let proxy = proxy_over(&b, &origin, &[]).await;
    for length in [Some(10), None] {
        let (id, mut feed) = origin.script("text/plain", length);
        let key = fresh_key();
        feed.send("01234");
        let mut res = open(&proxy, &id, &key, &[]).await;
        assert_eq!(next_chunk(&mut res).await, "01234", "{length:?}");
        feed.send("56789");
        feed.end();
        assert_eq!(rest(&mut res).await, "56789");
        let retry = again(&proxy, &id, &key).await;
        assert!(replayed(&retry), "{length:?}: {retry:#?}");
        assert_eq!(retry.text, "0123456789");
        assert_eq!(origin.calls(&id), 1);
    }
}

/// The upstream timeout bounds the wait for the response head; a stream
/// that goes on past it flows on to its end.
async fn a_stream_longer_than_the_upstream_timeout_flows_to_its_end(b: Backend) {
    let origin = Origin::start().await;
    let proxy = proxy_over(&b, &origin, &["--upstream-timeout", "1"]).await;
    let (id, mut feed) = origin.script("text/event-stream", None);
    let key = fresh_key();
    feed.send("data: a\n\n");
    let mut res = open(&proxy, &id, &key, &[]).await;
    assert_eq!(res.status(), 200);
    assert_eq!(next_chunk(&mut res).await, "data: a\n\n");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    feed.send("data: b\n\n");
    feed.end();
    assert_eq!(rest(&mut res).await, "data: b\n\n");
    let replay = again(&proxy, &id, &key).await;
    assert_eq!(replay.text, "data: a\n\ndata: b\n\n");
    assert_eq!(origin.calls(&id), 1);
}

// === the layer ===

/// The in-process layer streams too: the handler's first chunk reaches the
/// caller before its second is produced.
async fn the_layer_streams_a_handlers_body(b: Backend) {
    let engine = Arc::new(Engine::new(b.open().await, Limits::default()));
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    let rx = Arc::new(Mutex::new(Some(rx)));
    let calls = Arc::new(Mutex::new(0));
    let handler = {
        let (rx, calls) = (rx.clone(), calls.clone());
        tower::service_fn(move |_req: Request<Body>| {
            let rx = rx.lock().unwrap().take();
            *calls.lock().unwrap() += 1;
            async move {
                let rx = rx.expect("called once");
                let stream = futures::stream::unfold(rx, |mut rx| async move {
                    let bytes = rx.recv().await?;
                    Some((Ok::<_, std::io::Error>(bytes), rx))
                });
                let mut res = Response::new(Body::from_stream(stream));
                res.headers_mut()
                    .insert("content-type", "text/event-stream".parse().unwrap());
                Ok::<_, std::convert::Infallible>(res)
            }
        })
    };
    let svc = IdempotencyLayer::new(engine, LayerPolicy::default()).layer(handler);
    let key = fresh_key();
    let req = || {
        Request::post("/events")
            .header("idempotency-key", key.as_str())
            .body(Body::from("{}"))
            .unwrap()
    };
    tx.send(Bytes::from_static(b"data: 1\n\n")).unwrap();
    let res = svc.clone().oneshot(req()).await.unwrap();
    let mut body = res.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&first[..], b"data: 1\n\n");
    tx.send(Bytes::from_static(b"data: 2\n\n")).unwrap();
    drop(tx);
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(&rest[..], b"data: 2\n\n");
    let replay = svc.oneshot(req()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let replayed = replay.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&replayed[..], b"data: 1\n\ndata: 2\n\n");
    assert_eq!(*calls.lock().unwrap(), 1);
}

both_stores! {
    serial: [],
    concurrent: [
        an_event_stream_is_streamed_and_replayed_whole,
        a_client_that_hangs_up_mid_stream_does_not_stop_the_recording,
        past_the_limit_the_stream_flows_on_and_the_key_is_a_tombstone,
        a_stream_that_breaks_off_leaves_the_outcome_unknown,
        a_client_with_the_whole_response_finds_the_key_completed,
        a_stream_longer_than_the_upstream_timeout_flows_to_its_end,
        the_layer_streams_a_handlers_body,
    ],
}
