//! The counting origin: a real axum server on 127.0.0.1 (port 0 by default)
//! that records how often it ran, per `Idempotency-Key` and in total, so the
//! proxy and layer tests assert executions, not only what the client saw.
//!
//! Routes (any method):
//! * `/ok/...` — 201 JSON, with `Set-Cookie`, `WWW-Authenticate`, and
//!   hop-by-hop headers (`Keep-Alive`, and `X-Hop` named by `Connection`);
//! * `/slow/{ms}` — sleeps, then 201;
//! * `/status/{code}` — answers that status;
//! * `/big/{n}` — a 200 body of `n` bytes;
//! * `/drip/{pieces}/{ms}` — a 200 body streamed in `pieces` lines, `ms`
//!   apart (the first at once);
//! * `/echo/...` — the request as JSON: method, URI, headers, body;
//! * `/gzip` — 201 JSON of a few hundred bytes, gzip-encoded when the
//!   request's `Accept-Encoding` takes gzip (tower-http's compression);
//! * `/charges` — POST: 201 `{"charge":"ch_N","amount":…}`; GET: `{"charges":N}`,
//!   as `examples/origin.rs`;
//! * anything else — 200 `upstream <path>`.
//!
//! [`Counts::started`] counts a request when its handler starts,
//! [`Counts::finished`] when it has produced its response: a handler whose
//! caller hung up and was cancelled is started but never finished.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Executions of the origin.
#[derive(Debug, Default)]
pub struct Counts {
    started: Mutex<HashMap<String, usize>>,
    finished: Mutex<HashMap<String, usize>>,
    /// The `Idempotency-Attempt` each request with a key carried, in order.
    attempts: Mutex<HashMap<String, Vec<Option<String>>>>,
    total: AtomicUsize,
    charges: AtomicUsize,
}

impl Counts {
    /// Requests that reached a handler with this `Idempotency-Key` value
    /// (as sent, quotes included).
    pub fn started(&self, key: &str) -> usize {
        self.started.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// Requests with this key whose handler ran to its end.
    pub fn finished(&self, key: &str) -> usize {
        self.finished.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// Every request that reached a handler.
    pub fn total(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }

    /// The `Idempotency-Attempt` header of each request with this key that
    /// reached a handler, in order (`None`: it carried none).
    pub fn attempts(&self, key: &str) -> Vec<Option<String>> {
        self.attempts
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .unwrap_or_default()
    }
}

/// The origin's routes, counting into `counts`; usable in-process (the
/// layer's tests) or served ([`Upstream`]).
pub fn router(counts: Arc<Counts>) -> Router {
    Router::new()
        .route("/ok", any(ok))
        .route("/ok/{*rest}", any(ok))
        .route("/slow/{ms}", any(slow))
        .route("/status/{code}", any(status))
        .route("/big/{n}", any(big))
        .route(
            "/gzip",
            any(gzip_doc).layer(tower_http::compression::CompressionLayer::new()),
        )
        .route("/drip/{pieces}/{ms}", any(drip))
        .route("/echo", any(echo))
        .route("/echo/{*rest}", any(echo))
        .route("/charges", axum::routing::post(charge).get(count_charges))
        .fallback(|uri: Uri| async move { format!("upstream {}", uri.path()) })
        .layer(axum::middleware::from_fn_with_state(counts.clone(), count))
        .with_state(counts)
}

async fn count(State(counts): State<Arc<Counts>>, req: Request, next: Next) -> Response {
    counts.total.fetch_add(1, Ordering::SeqCst);
    let key = req
        .headers()
        .get("idempotency-key")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    if let Some(key) = &key {
        *counts
            .started
            .lock()
            .unwrap()
            .entry(key.clone())
            .or_default() += 1;
        let attempt = req
            .headers()
            .get("idempotency-attempt")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        counts
            .attempts
            .lock()
            .unwrap()
            .entry(key.clone())
            .or_default()
            .push(attempt);
    }
    let res = next.run(req).await;
    if let Some(key) = key {
        *counts.finished.lock().unwrap().entry(key).or_default() += 1;
    }
    res
}

async fn ok(State(counts): State<Arc<Counts>>, method: Method, uri: Uri, body: Bytes) -> Response {
    let doc = json!({
        "execution": counts.total(),
        "method": method.as_str(),
        "path": uri.path(),
        "body": String::from_utf8_lossy(&body),
    });
    let mut res = (StatusCode::CREATED, axum::Json(doc)).into_response();
    let h = res.headers_mut();
    h.insert(
        "set-cookie",
        HeaderValue::from_static("sid=origin-cookie; HttpOnly"),
    );
    h.insert(
        "www-authenticate",
        HeaderValue::from_static("Bearer realm=\"origin\""),
    );
    h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
    h.insert("connection", HeaderValue::from_static("x-hop"));
    h.insert("x-hop", HeaderValue::from_static("1"));
    h.insert("x-origin", HeaderValue::from_static("yes"));
    res
}

async fn charge(State(counts): State<Arc<Counts>>, body: Bytes) -> Response {
    let n = counts.charges.fetch_add(1, Ordering::SeqCst) + 1;
    let amount = serde_json::from_slice::<serde_json::Value>(&body)
        .map(|b| b["amount"].clone())
        .unwrap_or_default();
    let doc = json!({ "charge": format!("ch_{n}"), "amount": amount });
    (StatusCode::CREATED, axum::Json(doc)).into_response()
}

async fn count_charges(State(counts): State<Arc<Counts>>) -> Response {
    let n = counts.charges.load(Ordering::SeqCst);
    axum::Json(json!({ "charges": n })).into_response()
}

async fn slow(Path(ms): Path<u64>) -> Response {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    (StatusCode::CREATED, axum::Json(json!({ "slept_ms": ms }))).into_response()
}

async fn status(Path(code): Path<u16>) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
    (status, format!("status {code}")).into_response()
}

async fn big(Path(n): Path<usize>) -> Response {
    (
        [("content-type", "text/plain"), ("x-origin", "yes")],
        vec![b'x'; n],
    )
        .into_response()
}

/// The body `/gzip` answers with, before any encoding.
pub fn gzip_doc_text() -> String {
    let doc = json!({ "charge": "ch_gzip", "note": "x".repeat(300) });
    doc.to_string()
}

async fn gzip_doc() -> Response {
    (
        StatusCode::CREATED,
        [("content-type", "application/json"), ("etag", "\"v1\"")],
        gzip_doc_text(),
    )
        .into_response()
}

async fn drip(Path((pieces, ms)): Path<(u32, u64)>) -> Response {
    let lines = futures::stream::unfold(0, move |i| async move {
        if i == pieces {
            return None;
        }
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let line = Bytes::from(format!("piece {i}\n"));
        Some((Ok::<_, std::convert::Infallible>(line), i + 1))
    });
    ([("content-type", "text/plain")], Body::from_stream(lines)).into_response()
}

async fn echo(method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in &headers {
        map.entry(name.as_str().to_owned())
            .or_default()
            .push(String::from_utf8_lossy(value.as_bytes()).into_owned());
    }
    axum::Json(json!({
        "method": method.as_str(),
        "uri": uri.to_string(),
        "headers": map,
        "body": String::from_utf8_lossy(&body),
    }))
    .into_response()
}

/// [`router`] plus `/numbered/{ms}`: sleeps `ms`, then answers 201
/// `{"execution": n, "slept_ms": ms}` where `n` counts the executions of this
/// route with the request's `Idempotency-Key` (1 for the first), so two
/// executions of one key give two different bodies.
pub fn numbered_router(counts: Arc<Counts>) -> Router {
    let numbered = Router::new()
        .route("/numbered/{ms}", any(numbered))
        .layer(axum::middleware::from_fn_with_state(counts.clone(), count))
        .with_state(counts.clone());
    router(counts).merge(numbered)
}

async fn numbered(
    State(counts): State<Arc<Counts>>,
    Path(ms): Path<u64>,
    headers: HeaderMap,
) -> Response {
    let key = headers
        .get("idempotency-key")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    // `count` has already counted this request as started.
    let n = counts.started(&key);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    let doc = json!({ "execution": n, "slept_ms": ms });
    (StatusCode::CREATED, axum::Json(doc)).into_response()
}

/// The origin, served on a real socket until dropped.
pub struct Upstream {
    pub addr: SocketAddr,
    pub counts: Arc<Counts>,
    task: JoinHandle<()>,
}

impl Upstream {
    /// Serves on 127.0.0.1, port 0.
    pub async fn start() -> Upstream {
        Upstream::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    /// Serves on `addr`.
    pub async fn start_on(addr: SocketAddr) -> Upstream {
        let listener = TcpListener::bind(addr).await.expect("bind the upstream");
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Counts::default());
        let app = router(counts.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Upstream { addr, counts, task }
    }

    /// As [`Upstream::start`], serving [`numbered_router`].
    pub async fn start_numbered() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the upstream");
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Counts::default());
        let app = numbered_router(counts.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Upstream { addr, counts, task }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn started(&self, key: &str) -> usize {
        self.counts.started(key)
    }

    pub fn finished(&self, key: &str) -> usize {
        self.counts.finished(key)
    }

    pub fn total(&self) -> usize {
        self.counts.total()
    }

    pub fn attempts(&self, key: &str) -> Vec<Option<String>> {
        self.counts.attempts(key)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}
