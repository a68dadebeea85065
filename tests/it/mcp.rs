//! The MCP door (`idemgate proxy --protocol mcp`, SPEC §12) in process, over
//! a minimal JSON-RPC upstream that counts the tool calls it gets. The
//! official SDKs drive it in `tests/mcp/` (`.ci/mcp`); these cover what
//! those cannot stage: a store that is away.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use http::Request;
use http_body_util::BodyExt;
use idemgate::server::open::open_store;
use idemgate::server::proxy::Proxy;
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::common;
use common::app::fresh_key;

/// An MCP-ish upstream: every POST is a tool call, answered with a result
/// that names how many it has had.
async fn upstream(calls: Arc<AtomicUsize>) -> String {
    let app = axum::Router::new().route(
        "/mcp",
        axum::routing::post(move |axum::Json(call): axum::Json<Value>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                axum::Json(json!({ "jsonrpc": "2.0", "id": call["id"],
                    "result": { "content": [{ "type": "text", "text": format!("call {n}") }] } }))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

async fn door(up: &str, faulty: Arc<common::faulty::Faulty>) -> axum::Router {
    let args = common::proxy::proxy_args(&[
        "--protocol",
        "mcp",
        "--upstream",
        up,
        "--database-url",
        "sqlite::memory:",
    ]);
    args.validate().unwrap();
    Proxy::build(&args, Vec::new(), faulty).unwrap().app
}

async fn call(app: &axum::Router, id: u64, key: &str) -> Value {
    let body = json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": { "name": "charge", "arguments": { "amount": 5, "idempotency_key": key } } });
    let res = app
        .clone()
        .oneshot(
            Request::post("/mcp")
                .header("content-type", "application/json")
                .header("accept", "application/json, text/event-stream")
                .body(Body::from(body.to_string()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test]
async fn a_repeat_gets_the_result_with_its_own_id_and_a_store_away_forwards_nothing() {
    common::logs::init();
    let calls = Arc::new(AtomicUsize::new(0));
    let up = upstream(calls.clone()).await;
    let args = common::proxy::proxy_args(&["--database-url", "sqlite::memory:"]);
    let store = open_store(&args.store, true).await.unwrap();
    let faulty = Arc::new(common::faulty::Faulty::new(store));
    let app = door(&up, faulty.clone()).await;
    let key = fresh_key();

    let first = call(&app, 1, &key).await;
    let repeat = call(&app, 2, &key).await;
    assert_eq!(first["id"], 1);
    assert_eq!(repeat["id"], 2, "the repeat's own id: {repeat}");
    assert_eq!(repeat["result"], first["result"]);
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // The store away: a JSON-RPC error, and the call is not forwarded.
    faulty.away.store(true, Ordering::SeqCst);
    let away = call(&app, 3, &fresh_key()).await;
    assert_eq!(away["id"], 3);
    assert_eq!(away["error"]["code"], -32000, "{away}");
    assert!(
        away["error"]["data"]["type"]
            .as_str()
            .unwrap()
            .ends_with("/store-unavailable"),
        "{away}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "nothing forwarded");
}

/// An MCP server that answers a tool call with an HTTP error status: `crash`
/// with a 500 and a plain-text body, `refuse` with a 400 whose body is a
/// JSON-RPC error, as a spec-correct server may.
async fn erring_upstream(calls: Arc<AtomicUsize>) -> String {
    let app = axum::Router::new().route(
        "/mcp",
        axum::routing::post(move |axum::Json(call): axum::Json<Value>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                use axum::response::IntoResponse;
                match call["params"]["name"].as_str() {
                    Some("crash") => (
                        http::StatusCode::INTERNAL_SERVER_ERROR,
                        [("content-type", "text/plain")],
                        "boom",
                    )
                        .into_response(),
                    _ => (
                        http::StatusCode::BAD_REQUEST,
                        axum::Json(json!({ "jsonrpc": "2.0", "id": call["id"],
                            "error": { "code": -32602, "message": "amount must be positive" } })),
                    )
                        .into_response(),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// One guarded call of `tool`: the HTTP status, the content type and the
/// message.
async fn call_tool(
    app: &axum::Router,
    id: u64,
    tool: &str,
    key: &str,
    accept: &str,
) -> (u16, String, Value) {
    let body = json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": { "name": tool, "arguments": { "amount": 5, "idempotency_key": key } } });
    let res = app
        .clone()
        .oneshot(
            Request::post("/mcp")
                .header("content-type", "application/json")
                .header("accept", accept)
                .body(Body::from(body.to_string()))
                .unwrap(),
        )
        .await
        .unwrap();
    let status = res.status().as_u16();
    let ct = res.headers()["content-type"].to_str().unwrap().to_owned();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let json = text
        .strip_prefix("event: message\ndata: ")
        .unwrap_or(&text)
        .trim();
    (
        status,
        ct,
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

/// The official clients take no HTTP error status as an answer (the Python
/// SDK makes it -32603 "Server returned an error response", the problem
/// lost): an MCP server's error status, first time and replayed, reaches the
/// client as a JSON-RPC message at 200, in the form it accepts, and the tool
/// is called once.
#[tokio::test]
async fn an_error_status_of_the_server_is_a_json_rpc_answer_first_and_replayed() {
    common::logs::init();
    let calls = Arc::new(AtomicUsize::new(0));
    let up = erring_upstream(calls.clone()).await;
    let args = common::proxy::proxy_args(&["--database-url", "sqlite::memory:"]);
    let store = open_store(&args.store, true).await.unwrap();
    let app = door(&up, Arc::new(common::faulty::Faulty::new(store))).await;

    let key = fresh_key();
    for (id, accept) in [
        (1, "application/json, text/event-stream"),
        (2, "text/event-stream"),
        (3, "application/json"),
    ] {
        let (status, ct, message) = call_tool(&app, id, "crash", &key, accept).await;
        assert_eq!(status, 200, "{message}");
        assert!(
            accept.contains(ct.as_str()) || ct == "application/json",
            "{ct} for {accept}"
        );
        assert_eq!(message["id"], id);
        assert_eq!(message["error"]["code"], -32000, "{message}");
        assert_eq!(message["error"]["data"]["upstream_status"], 500);
        assert_eq!(message["error"]["data"]["body"], "boom");
        assert_eq!(message["error"]["data"]["replayed"], id > 1);
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the 500 is stored: never run twice"
    );

    let key = fresh_key();
    for id in [4, 5] {
        let (status, _, message) = call_tool(
            &app,
            id,
            "refuse",
            &key,
            "application/json, text/event-stream",
        )
        .await;
        assert_eq!(status, 200, "{message}");
        assert_eq!(message["id"], id, "{message}");
        assert_eq!(
            message["error"]["code"], -32602,
            "the server's own error: {message}"
        );
    }
    // A 400 is the server refusing the request before any tool ran (no
    // session, a bad header): the key is released, so the repeat is sent.
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}
