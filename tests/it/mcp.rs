//! The MCP door (`idemgate proxy --protocol mcp`, docs/mcp.md) in process, over
//! a minimal JSON-RPC upstream that counts the tool calls it gets. The official
//! SDKs drive it in `tests/mcp/` (`.ci/mcp`); these cover what those cannot
//! stage: a store that is away.

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

/// What the calls-and-cancels upstream has seen.
#[derive(Default)]
struct Seen {
    calls: AtomicUsize,
    cancels: AtomicUsize,
    /// The arguments of the last tool call.
    arguments: std::sync::Mutex<Value>,
    /// Sessions ended (`DELETE`), and how many calls had ended by then.
    deleted: std::sync::Mutex<Vec<usize>>,
    /// Tool calls answered.
    answered: AtomicUsize,
}

/// An MCP-ish upstream at `/mcp`: `slow` answers its result after 300 ms,
/// `cancelled` answers `-32800` (the tool stopped after it began, as a
/// server does on a client's cancel), anything else its result at once; a
/// `notifications/cancelled` is counted and answered 202.
async fn cancelling_upstream(seen: Arc<Seen>) -> String {
    let deletes = seen.clone();
    let app = axum::Router::new().route(
        "/mcp",
        axum::routing::delete(move || {
            let seen = deletes.clone();
            async move {
                let answered = seen.answered.load(Ordering::SeqCst);
                seen.deleted.lock().unwrap().push(answered);
                http::StatusCode::OK
            }
        })
        .post(move |axum::Json(message): axum::Json<Value>| {
            let seen = seen.clone();
            async move {
                use axum::response::IntoResponse;
                if message["method"] == "notifications/cancelled" {
                    seen.cancels.fetch_add(1, Ordering::SeqCst);
                    return http::StatusCode::ACCEPTED.into_response();
                }
                let n = seen.calls.fetch_add(1, Ordering::SeqCst) + 1;
                *seen.arguments.lock().unwrap() = message["params"]["arguments"].clone();
                let answer = match message["params"]["name"].as_str() {
                    Some("cancelled") => json!({ "jsonrpc": "2.0", "id": message["id"],
                        "error": { "code": -32800, "message": "Request cancelled" } }),
                    Some("slow") => {
                        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                        json!({ "jsonrpc": "2.0", "id": message["id"],
                            "result": { "content": [{ "type": "text", "text": format!("call {n}") }] } })
                    }
                    _ => json!({ "jsonrpc": "2.0", "id": message["id"],
                        "result": { "content": [{ "type": "text", "text": format!("call {n}") }] } }),
                };
                seen.answered.fetch_add(1, Ordering::SeqCst);
                axum::Json(answer).into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// A door on a new in-memory store in front of `up` (given as is: a base
/// URL, or the endpoint's own).
async fn plain_door(up: &str) -> axum::Router {
    let args = common::proxy::proxy_args(&["--database-url", "sqlite::memory:"]);
    let store = open_store(&args.store, true).await.unwrap();
    door(up, Arc::new(common::faulty::Faulty::new(store))).await
}

/// `message` POSTed to the door as a client of `version` (none: no
/// `MCP-Protocol-Version`); the status and the JSON message, if any.
async fn post(app: &axum::Router, message: &Value, version: Option<&str>) -> (u16, Value) {
    post_in(app, message, version, None).await
}

/// [`post`] on the MCP session `session`.
async fn post_in(
    app: &axum::Router,
    message: &Value,
    version: Option<&str>,
    session: Option<&str>,
) -> (u16, Value) {
    let mut req = Request::post("/mcp")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream");
    if let Some(version) = version {
        req = req.header("mcp-protocol-version", version);
    }
    if let Some(session) = session {
        req = req.header("mcp-session-id", session);
    }
    let res = app
        .clone()
        .oneshot(req.body(Body::from(message.to_string())).unwrap())
        .await
        .unwrap();
    let status = res.status().as_u16();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

fn tool_call(id: u64, tool: &str, arguments: Value, meta: Option<&str>) -> Value {
    let mut message = json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": { "name": tool, "arguments": arguments } });
    if let Some(key) = meta {
        message["params"]["_meta"] = json!({ "dev.idemgate/idempotency-key": key });
    }
    message
}

/// A client's cancel of a guarded call is not forwarded: the tool runs to
/// its end, its result is stored, and the retry gets it; a cancel of a call
/// the door is not running goes to the server as it came.
#[tokio::test]
async fn a_cancel_of_a_running_guarded_call_is_absorbed_and_its_result_kept() {
    common::logs::init();
    let seen = Arc::new(Seen::default());
    let app = plain_door(&cancelling_upstream(seen.clone()).await).await;
    let key = fresh_key();

    let first = {
        let app = app.clone();
        let call = tool_call(7, "slow", json!({ "amount": 5 }), Some(&key));
        tokio::spawn(async move { post(&app, &call, None).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let cancel = json!({ "jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": { "requestId": 7, "reason": "timed out" } });
    let (status, _) = post(&app, &cancel, None).await;
    assert_eq!(status, 202);
    assert_eq!(seen.cancels.load(Ordering::SeqCst), 0, "not forwarded");

    let (_, first) = first.await.unwrap();
    assert_eq!(first["result"]["content"][0]["text"], "call 1", "{first}");
    let (_, retry) = post(
        &app,
        &tool_call(8, "slow", json!({ "amount": 5 }), Some(&key)),
        None,
    )
    .await;
    assert_eq!(retry["id"], 8);
    assert_eq!(retry["result"], first["result"], "the replay: {retry}");
    assert_eq!(seen.calls.load(Ordering::SeqCst), 1);

    // Nothing of that id runs now: this cancel is the server's to read.
    let (status, _) = post(&app, &cancel, None).await;
    assert_eq!(status, 202);
    assert_eq!(seen.cancels.load(Ordering::SeqCst), 1, "forwarded");
}

/// A JSON-RPC error that is not the call's result (`-32800` request
/// cancelled: the tool began, then stopped) is never stored as the key's
/// outcome: the key is held unknown, and no retry runs the tool again.
#[tokio::test]
async fn an_error_answer_after_the_tool_began_is_not_stored_and_holds_the_key() {
    common::logs::init();
    let seen = Arc::new(Seen::default());
    let app = plain_door(&cancelling_upstream(seen.clone()).await).await;
    let key = fresh_key();

    let call = |id| tool_call(id, "cancelled", json!({ "amount": 5 }), Some(&key));
    let (_, first) = post(&app, &call(1), None).await;
    assert_eq!(
        first["error"]["code"], -32800,
        "the first gets the server's answer"
    );
    for (id, version) in [(2, None), (3, Some("2026-07-28"))] {
        let (status, retry) = post(&app, &call(id), version).await;
        assert_eq!(status, 200);
        assert_eq!(retry["id"], id);
        assert_eq!(retry["result"]["isError"], true, "{retry}");
        let kind = retry["result"]["structuredContent"]["type"]
            .as_str()
            .unwrap();
        assert!(kind.ends_with("/outcome-unknown"), "{retry}");
    }
    assert_eq!(seen.calls.load(Ordering::SeqCst), 1, "never run again");
}

/// Under 2026-07-28 every result the door writes carries
/// `"resultType": "complete"` (a refusal, a replay of a result stored under
/// an older version); under earlier versions none does.
#[tokio::test]
async fn results_the_door_writes_carry_result_type_under_2026_07_28_only() {
    common::logs::init();
    let seen = Arc::new(Seen::default());
    let app = plain_door(&cancelling_upstream(seen.clone()).await).await;
    let key = fresh_key();
    let call = |id, amount| tool_call(id, "charge", json!({ "amount": amount }), Some(&key));

    let (_, first) = post(&app, &call(1, 5), Some("2025-11-25")).await;
    assert!(first["result"].get("resultType").is_none(), "{first}");
    for version in ["2026-07-28", "2025-11-25", "2025-06-18"] {
        let typed = version >= "2026-07-28";
        let (_, replay) = post(&app, &call(2, 5), Some(version)).await;
        assert_eq!(
            replay["result"].get("resultType").is_some(),
            typed,
            "{version}: {replay}"
        );
        let (_, refusal) = post(&app, &call(3, 6), Some(version)).await;
        assert_eq!(refusal["result"]["isError"], true, "{refusal}");
        assert_eq!(
            refusal["result"].get("resultType").and_then(Value::as_str),
            typed.then_some("complete"),
            "{version}: {refusal}"
        );
    }
    // The version may be named in the request's `_meta` alone.
    let mut by_meta = call(4, 7);
    by_meta["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"] = json!("2026-07-28");
    let (_, refusal) = post(&app, &by_meta, None).await;
    assert_eq!(refusal["result"]["resultType"], "complete", "{refusal}");
    assert_eq!(seen.calls.load(Ordering::SeqCst), 1);
}

/// The runtime's key (`_meta`) beats the one a model invents per call,
/// which never reaches the server; the server's endpoint URL as
/// `--upstream` maps the door's `/mcp` onto it.
#[tokio::test]
async fn the_runtimes_key_beats_the_models_and_the_endpoint_url_is_an_upstream() {
    common::logs::init();
    let seen = Arc::new(Seen::default());
    let up = cancelling_upstream(seen.clone()).await;
    let app = plain_door(&format!("{up}/mcp")).await;
    let key = fresh_key();
    for id in 1..=3 {
        let invented = format!("model-{id}");
        let arguments = json!({ "amount": 5, "idempotency_key": invented });
        let (status, answer) =
            post(&app, &tool_call(id, "charge", arguments, Some(&key)), None).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["result"]["content"][0]["text"], "call 1", "{answer}");
    }
    assert_eq!(seen.calls.load(Ordering::SeqCst), 1);
    assert_eq!(*seen.arguments.lock().unwrap(), json!({ "amount": 5 }));
}

#[test]
fn the_mcp_doors_default_wait_is_four_seconds_unless_set() {
    let wait = |flags: &[&str]| {
        let mut all = vec!["--upstream", "http://127.0.0.1:1"];
        all.extend_from_slice(flags);
        common::proxy::proxy_args(&all).default_wait().as_secs()
    };
    assert_eq!(wait(&["--protocol", "mcp"]), 4);
    assert_eq!(wait(&["--protocol", "mcp", "--default-wait", "7"]), 7);
    assert_eq!(wait(&["--protocol", "mcp", "--max-wait", "2"]), 2);
    assert_eq!(wait(&[]), 10);
}

/// A client that gives up on a call closes its session (the Python SDK's
/// DELETE on close), and a server ends a session's running calls with it:
/// the door answers that DELETE itself and sends it once the session's
/// guarded calls have ended, so the tool runs to its end and the retry gets
/// its result. A session with nothing running is ended at once.
#[tokio::test]
async fn a_sessions_delete_waits_for_its_guarded_calls() {
    common::logs::init();
    let seen = Arc::new(Seen::default());
    let app = plain_door(&cancelling_upstream(seen.clone()).await).await;
    let key = fresh_key();
    let delete = |session: &'static str| {
        let app = app.clone();
        async move {
            let req = Request::delete("/mcp")
                .header("mcp-session-id", session)
                .body(Body::empty())
                .unwrap();
            app.oneshot(req).await.unwrap().status().as_u16()
        }
    };

    let first = {
        let app = app.clone();
        let call = tool_call(1, "slow", json!({ "amount": 5 }), Some(&key));
        tokio::spawn(async move { post_in(&app, &call, None, Some("s1")).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(delete("s1").await, 200);
    assert!(
        seen.deleted.lock().unwrap().is_empty(),
        "held while the call runs"
    );
    let (_, first) = first.await.unwrap();
    assert_eq!(first["result"]["content"][0]["text"], "call 1", "{first}");
    for _ in 0..50 {
        if !seen.deleted.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        *seen.deleted.lock().unwrap(),
        vec![1],
        "sent after the call ended"
    );

    let (_, retry) = post(
        &app,
        &tool_call(2, "slow", json!({ "amount": 5 }), Some(&key)),
        None,
    )
    .await;
    assert_eq!(retry["result"], first["result"], "the replay: {retry}");
    assert_eq!(seen.calls.load(Ordering::SeqCst), 1);

    assert_eq!(delete("s2").await, 200);
    assert_eq!(
        seen.deleted.lock().unwrap().len(),
        2,
        "nothing ran: at once"
    );
}
