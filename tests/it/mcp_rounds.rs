//! Calls that ask for input (MCP 2026-07-28's multi-round-trip results, SPEC
//! §12) through the real binary on both stores, over a hand-written server
//! whose `confirm` tool asks its question once or twice before it acts, and
//! which keeps no state of its own: it sends `inputRequests` and no
//! `requestState`, and records what each round carried. The official SDKs'
//! servers always send a state (tests/mcp/test_ask_modern.py covers them).

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::response::IntoResponse;
use serde_json::{Value, json};

use crate::common;
use common::backend::Backend;
use common::proxy::ProxyProcess;

/// Every round the server saw (`params`), and the calls it acted on.
#[derive(Default)]
struct Seen {
    rounds: Mutex<Vec<Value>>,
    acted: Mutex<u32>,
}

/// `confirm {questions: N}` answers `input_required` until its round carries
/// N answers (`inputResponses` with keys `q1`..`qN`), then acts and completes.
async fn asking_upstream(seen: Arc<Seen>) -> String {
    let handle = move |body: Bytes| {
        let seen = seen.clone();
        async move {
            let message: Value = serde_json::from_slice(&body).unwrap();
            let Some(id) = message.get("id").cloned() else {
                return http::StatusCode::ACCEPTED.into_response();
            };
            let params = message["params"].clone();
            seen.rounds.lock().unwrap().push(params.clone());
            let wanted = params["arguments"]["questions"].as_u64().unwrap_or(1) as usize;
            let answered = params["inputResponses"].as_object().map_or(0, |r| r.len());
            let result = if answered < wanted {
                let q = format!("q{}", answered + 1);
                json!({ "resultType": "input_required", "inputRequests": { q: {
                    "method": "elicitation/create",
                    "params": { "mode": "form", "message": "sure?", "requestedSchema": {
                        "type": "object", "properties": {} } } } } })
            } else {
                let n = {
                    let mut acted = seen.acted.lock().unwrap();
                    *acted += 1;
                    *acted
                };
                json!({ "resultType": "complete",
                    "content": [{ "type": "text", "text": format!("acted {n}") }] })
            };
            axum::Json(json!({ "jsonrpc": "2.0", "id": id, "result": result })).into_response()
        }
    };
    let app = axum::Router::new().route("/mcp", axum::routing::post(handle));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/mcp")
}

/// One round of `confirm` with `key`: `answers` (`q1`..) and `state`.
fn round(id: u64, key: &str, questions: u64, answers: usize, state: Option<&Value>) -> Value {
    let mut params = json!({ "name": "confirm", "arguments": { "questions": questions },
        "_meta": { "dev.idemgate/idempotency-key": key } });
    if answers > 0 {
        let responses: serde_json::Map<String, Value> = (1..=answers)
            .map(|i| {
                (
                    format!("q{i}"),
                    json!({ "action": "accept", "content": {} }),
                )
            })
            .collect();
        params["inputResponses"] = Value::Object(responses);
    }
    if let Some(state) = state {
        params["requestState"] = state.clone();
    }
    json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params })
}

async fn post(door: &ProxyProcess, body: &Value) -> Value {
    let res = common::http()
        .post(format!("{}/mcp", door.base()))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2026-07-28")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    res.json().await.unwrap()
}

/// A server that sends no state gets none back: the door's own is taken
/// off. Its questions, one round after another, keep the key with the call;
/// the completing round is stored and replayed, to a repeat of the last
/// round and to a whole new call alike.
async fn a_stateless_server_asks_twice_and_acts_once(backend: Backend) {
    let seen = Arc::new(Seen::default());
    let upstream = asking_upstream(seen.clone()).await;
    let door = ProxyProcess::start_at(&backend.url(), &upstream, &["--protocol", "mcp"]).await;

    let first = post(&door, &round(1, "K", 2, 0, None)).await;
    assert_eq!(first["result"]["resultType"], "input_required", "{first}");
    let state = first["result"]["requestState"].clone();
    assert!(
        state.as_str().is_some_and(|s| s.starts_with("idemgate.1.")),
        "{first}"
    );
    // Held by the call meanwhile: a whole new call waits, then is refused.
    let held = post(&door, &round(2, "K", 2, 0, None)).await;
    assert_eq!(held["result"]["isError"], true, "{held}");
    assert!(held.to_string().contains("request-in-flight"), "{held}");

    let second = post(&door, &round(3, "K", 2, 1, Some(&state))).await;
    assert_eq!(second["result"]["resultType"], "input_required", "{second}");
    let state = second["result"]["requestState"].clone();
    let done = post(&door, &round(4, "K", 2, 2, Some(&state))).await;
    assert_eq!(done["id"], 4);
    assert_eq!(done["result"]["content"][0]["text"], "acted 1", "{done}");

    let again = post(&door, &round(5, "K", 2, 2, Some(&state))).await;
    assert_eq!(again["id"], 5);
    assert_eq!(again["result"]["content"][0]["text"], "acted 1", "{again}");
    let whole = post(&door, &round(6, "K", 2, 0, None)).await;
    assert_eq!(whole["result"]["content"][0]["text"], "acted 1", "{whole}");
    assert_eq!(*seen.acted.lock().unwrap(), 1);

    let rounds = seen.rounds.lock().unwrap();
    assert_eq!(
        rounds.len(),
        3,
        "the server saw the call's three rounds only"
    );
    for params in rounds.iter() {
        assert!(
            params.get("requestState").is_none(),
            "the door's state never reaches the server: {params}"
        );
    }
}

/// The round is the same call whatever it answers: another call's
/// arguments under the key are `key-reused`, in any round.
async fn a_round_with_other_arguments_is_refused(backend: Backend) {
    let seen = Arc::new(Seen::default());
    let upstream = asking_upstream(seen.clone()).await;
    let door = ProxyProcess::start_at(&backend.url(), &upstream, &["--protocol", "mcp"]).await;
    let first = post(&door, &round(1, "K2", 1, 0, None)).await;
    let state = first["result"]["requestState"].clone();
    let other = post(&door, &round(2, "K2", 3, 1, Some(&state))).await;
    assert_eq!(other["result"]["isError"], true, "{other}");
    assert!(other.to_string().contains("key-reused"), "{other}");
    let done = post(&door, &round(3, "K2", 1, 1, Some(&state))).await;
    assert_eq!(done["result"]["content"][0]["text"], "acted 1", "{done}");
    assert_eq!(*seen.acted.lock().unwrap(), 1);
}

crate::both_stores! {
    serial: [
        a_stateless_server_asks_twice_and_acts_once,
        a_round_with_other_arguments_is_refused,
    ],
    concurrent: [],
}
