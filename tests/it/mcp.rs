//! The MCP door (`idemgate proxy --protocol mcp`, SPEC §12) in process, over
//! a minimal JSON-RPC upstream that counts the tool calls it gets. The
//! official SDKs drive it in `tests/mcp/` (`.ci/mcp`); these cover what
//! those cannot stage: a store that is away.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use http::Request;
use http_body_util::BodyExt;
use idemgate::server::proxy::Proxy;
use idemgate::server::wiring;
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
    let store = wiring::open_store(&args.store, true).await.unwrap();
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
