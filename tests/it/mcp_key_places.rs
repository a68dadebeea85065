//! Where the MCP door reads a tool call's key (`IDEMGATE_MCP_KEY_FROM`,
//! issue 52), and task-augmented calls (2025-11-25 Tasks), against the real
//! binary on both stores, over a hand-written JSON-RPC upstream that counts
//! the tool calls it runs.
//!
//! * The agentic commerce protocols put the key in `_meta["idempotency-key"]`
//!   (UCP) and `_meta.idempotency_key` (ACP), several servers take a
//!   camelCase `idempotencyKey` argument: each is guarded by default, the
//!   argument never reaching the server, and a runtime's place beats a
//!   model's in the same call.
//! * A list of the operator's own is read as it says, and one that would
//!   let a model's key beat a runtime's is refused at startup.
//! * A task-augmented call runs once: its repeat gets the task the server
//!   created, never a second one, and `tasks/get` and `tasks/result` pass
//!   through.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::response::IntoResponse;
use serde_json::{Value, json};

use crate::common;
use common::backend::Backend;
use common::proxy::ProxyProcess;

/// What the upstream ran: the `params` of each tool call, in order; and
/// the results of the tasks it created.
#[derive(Default)]
struct Ran {
    calls: Mutex<Vec<Value>>,
    tasks: Mutex<Vec<Value>>,
}

impl Ran {
    fn count(&self) -> usize {
        self.calls.lock().unwrap().len()
    }

    fn params(&self, i: usize) -> Value {
        self.calls.lock().unwrap()[i].clone()
    }
}

/// A JSON-RPC server at `/mcp`: `tools/list` lists `charge`; a `tools/call`
/// runs, its result naming how many calls have run (`call N`), or, asked
/// for a task (`params.task`), creates task `task-N`, working, whose result
/// that is; `tasks/get` says a task completed, `tasks/result` gives its
/// result.
async fn upstream(ran: Arc<Ran>) -> String {
    let answer = move |body: Bytes| {
        let ran = ran.clone();
        async move {
            let Ok(message) = serde_json::from_slice::<Value>(&body) else {
                return (http::StatusCode::BAD_REQUEST, "not JSON").into_response();
            };
            let Some(id) = message.get("id").cloned() else {
                return http::StatusCode::ACCEPTED.into_response();
            };
            let params = &message["params"];
            let result = match message["method"].as_str().unwrap_or_default() {
                "tools/list" => json!({ "tools": [
                    { "name": "charge", "inputSchema": { "type": "object",
                        "properties": { "amount": { "type": "integer" } } } },
                ]}),
                "tools/call" => {
                    let n = {
                        let mut calls = ran.calls.lock().unwrap();
                        calls.push(params.clone());
                        calls.len()
                    };
                    let result =
                        json!({ "content": [{ "type": "text", "text": format!("call {n}") }] });
                    match params.get("task") {
                        Some(task) => {
                            let mut tasks = ran.tasks.lock().unwrap();
                            tasks.push(result);
                            json!({ "task": {
                                "taskId": format!("task-{}", tasks.len()),
                                "status": "working",
                                "createdAt": "2026-12-07T09:00:00Z",
                                "lastUpdatedAt": "2026-12-07T09:00:00Z",
                                "ttl": task.get("ttl").cloned().unwrap_or(Value::Null),
                                "pollInterval": 100,
                            } })
                        }
                        None => result,
                    }
                }
                method @ ("tasks/get" | "tasks/result") => {
                    let task_id = params["taskId"].as_str().unwrap_or_default();
                    let found = task_id
                        .strip_prefix("task-")
                        .and_then(|n| n.parse::<usize>().ok())
                        .and_then(|n| ran.tasks.lock().unwrap().get(n.wrapping_sub(1)).cloned());
                    match (found, method) {
                        (None, _) => {
                            return axum::Json(json!({ "jsonrpc": "2.0", "id": id,
                                "error": { "code": -32602, "message": "no such task" } }))
                            .into_response();
                        }
                        (Some(_), "tasks/get") => json!({
                            "taskId": task_id, "status": "completed",
                            "createdAt": "2026-12-07T09:00:00Z",
                            "lastUpdatedAt": "2026-12-07T09:00:01Z", "ttl": null }),
                        (Some(result), _) => result,
                    }
                }
                _ => json!({}),
            };
            axum::Json(json!({ "jsonrpc": "2.0", "id": id, "result": result })).into_response()
        }
    };
    let app = axum::Router::new().route("/mcp", axum::routing::post(answer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// The door, the real binary, over `backend`'s database, in front of a new
/// upstream.
async fn door(backend: &Backend, extra: &[&str]) -> (ProxyProcess, Arc<Ran>) {
    let ran = Arc::new(Ran::default());
    let up = upstream(ran.clone()).await;
    let mut flags = vec!["--protocol", "mcp"];
    flags.extend_from_slice(extra);
    (
        ProxyProcess::start_at(&backend.url(), &format!("{up}/mcp"), &flags).await,
        ran,
    )
}

/// `message` POSTed to the door's `/mcp` (with the key header `header`, if
/// any): the JSON-RPC answer.
async fn send(door: &ProxyProcess, message: &Value, header: Option<&str>) -> Value {
    let mut req = common::http()
        .post(format!("{}/mcp", door.base()))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-11-25");
    if let Some(key) = header {
        req = req.header("idempotency-key", format!("\"{key}\""));
    }
    let res = req.body(message.to_string()).send().await.unwrap();
    assert_eq!(res.status(), 200);
    res.json().await.unwrap()
}

/// A `charge` of `amount` with JSON-RPC id `id`, its `params` merged with
/// `extra` (`_meta`, `arguments`' key, a `param:`, a task).
fn charge(id: u64, amount: u64, extra: Value) -> Value {
    let mut params = json!({ "name": "charge", "arguments": { "amount": amount } });
    for (name, value) in extra.as_object().unwrap() {
        match (name.as_str(), value) {
            ("arguments", Value::Object(more)) => {
                for (k, v) in more {
                    params["arguments"][k] = v.clone();
                }
            }
            _ => params[name] = value.clone(),
        }
    }
    json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params })
}

/// The text of a tool result (`call N`), after checking the answer is a
/// result for `id` and no refusal.
#[track_caller]
fn ran_as(answer: &Value, id: u64) -> String {
    assert_eq!(answer["id"], id, "{answer}");
    assert_ne!(answer["result"]["isError"], true, "refused: {answer}");
    answer["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no tool result: {answer}"))
        .to_owned()
}

/// The problem's name of a refusal.
#[track_caller]
fn refused_as(answer: &Value) -> String {
    assert_eq!(answer["result"]["isError"], true, "not refused: {answer}");
    let kind = answer["result"]["_meta"]["dev.idemgate/problem"]["type"]
        .as_str()
        .unwrap_or_else(|| panic!("no problem: {answer}"));
    kind.rsplit('/').next().unwrap().to_owned()
}

/// Each place of the default list beyond idemgate's own guards a call: it
/// runs once, its repeat replays, another amount under its key is refused;
/// a key argument never reaches the server.
async fn the_ecosystems_keys_are_guarded_by_default(backend: Backend) {
    let (door, ran) = door(&backend, &[]).await;
    let places = [
        json!({ "_meta": { "idempotency-key": "ucp-1" } }),
        json!({ "_meta": { "idempotency_key": "acp-1" } }),
        json!({ "arguments": { "idempotencyKey": "camel-1" } }),
    ];
    let mut id = 0;
    for (i, place) in places.iter().enumerate() {
        let first = format!("call {}", i + 1);
        for _ in 0..2 {
            id += 1;
            let answer = send(&door, &charge(id, 5, place.clone()), None).await;
            assert_eq!(ran_as(&answer, id), first, "{place}");
        }
        id += 1;
        let other = send(&door, &charge(id, 9, place.clone()), None).await;
        assert_eq!(refused_as(&other), "key-reused", "{place}");
        assert_eq!(ran.count(), i + 1, "{place}");
    }
    // The camelCase argument was taken out; the _meta keys pass, as _meta does.
    assert_eq!(ran.params(2)["arguments"], json!({ "amount": 5 }));
    assert_eq!(ran.params(0)["_meta"]["idempotency-key"], "ucp-1");
    // Without a key, nothing is guarded.
    for i in 0..2 {
        id += 1;
        let answer = send(&door, &charge(id, 5, json!({})), None).await;
        assert_eq!(ran_as(&answer, id), format!("call {}", 4 + i));
    }
    // A key argument that is not a string is key-invalid; a null is no key.
    id += 1;
    let bad = json!({ "arguments": { "idempotencyKey": 7 } });
    let answer = send(&door, &charge(id, 5, bad), None).await;
    assert_eq!(refused_as(&answer), "key-invalid");
    assert_eq!(ran.count(), 5);
    // tools/list offers the first argument place's name, as before.
    let list = send(
        &door,
        &json!({ "jsonrpc": "2.0", "id": 99, "method": "tools/list" }),
        None,
    )
    .await;
    let properties = &list["result"]["tools"][0]["inputSchema"]["properties"];
    assert_eq!(properties["idempotency_key"]["type"], "string", "{list}");
    assert!(properties.get("idempotencyKey").is_none(), "{list}");
}

/// A runtime's place beats a model's in the same call, whose argument the
/// server never sees; and a model's key never meets a runtime's of the
/// same name.
async fn a_runtimes_place_beats_a_models(backend: Backend) {
    let (door, ran) = door(&backend, &[]).await;
    let both = json!({ "_meta": { "idempotency-key": "R" },
        "arguments": { "idempotencyKey": "M" } });
    assert_eq!(
        ran_as(&send(&door, &charge(1, 5, both), None).await, 1),
        "call 1"
    );
    assert_eq!(ran.params(0)["arguments"], json!({ "amount": 5 }));
    // The call was keyed R, in the runtime's scope: the header's R replays it.
    let by_header = send(&door, &charge(2, 5, json!({})), Some("R")).await;
    assert_eq!(ran_as(&by_header, 2), "call 1");
    // M alone is a model's key no call has used.
    let model = json!({ "arguments": { "idempotencyKey": "M" } });
    assert_eq!(
        ran_as(&send(&door, &charge(3, 5, model), None).await, 3),
        "call 2"
    );
    // A model's R is not the runtime's R: it runs, in its own scope.
    let model_r = json!({ "arguments": { "idempotencyKey": "R" } });
    assert_eq!(
        ran_as(&send(&door, &charge(4, 5, model_r.clone()), None).await, 4),
        "call 3"
    );
    assert_eq!(
        ran_as(&send(&door, &charge(5, 5, model_r), None).await, 5),
        "call 3"
    );
    // The header comes before the model's arguments.
    let model_h = json!({ "arguments": { "idempotency_key": "H" } });
    assert_eq!(
        ran_as(
            &send(&door, &charge(6, 5, model_h.clone()), Some("R")).await,
            6
        ),
        "call 1"
    );
    assert_eq!(ran.count(), 3);
}

/// An operator's list: a `param:` place (forwarded, outside the
/// fingerprint), a `_meta` of its own and an argument of its own; the
/// places it leaves out are no keys, the key header among them.
async fn a_list_of_ones_own_is_read_as_it_says(backend: Backend) {
    let (door, ran) = door(
        &backend,
        &["--mcp-key-from", "meta:k,param:idempotencyKey,argument:key"],
    )
    .await;
    // params.idempotencyKey, SEP-3182's: guarded, and forwarded.
    let param = json!({ "idempotencyKey": "p-1" });
    for id in [1, 2] {
        let answer = send(&door, &charge(id, 5, param.clone()), None).await;
        assert_eq!(ran_as(&answer, id), "call 1");
    }
    assert_eq!(ran.params(0)["idempotencyKey"], "p-1");
    // A call keyed in _meta.k, with and without a param: the param is no
    // part of the fingerprint, so the second is the first's repeat.
    let with = json!({ "_meta": { "k": "m-1" }, "idempotencyKey": "ignored" });
    assert_eq!(
        ran_as(&send(&door, &charge(3, 5, with), None).await, 3),
        "call 2"
    );
    let without = json!({ "_meta": { "k": "m-1" } });
    assert_eq!(
        ran_as(&send(&door, &charge(4, 5, without), None).await, 4),
        "call 2"
    );
    // The argument `key`: a model's, taken out.
    let argument = json!({ "arguments": { "key": "a-1" } });
    for id in [5, 6] {
        let answer = send(&door, &charge(id, 5, argument.clone()), None).await;
        assert_eq!(ran_as(&answer, id), "call 3");
    }
    assert_eq!(ran.params(2)["arguments"], json!({ "amount": 5 }));
    // What the list leaves out is no key: idemgate's _meta, the
    // idempotency_key argument (forwarded as the tool's), the header.
    let unlisted = [
        (
            json!({ "_meta": { "dev.idemgate/idempotency-key": "x" } }),
            None,
        ),
        (json!({ "arguments": { "idempotency_key": "x" } }), None),
        (json!({}), Some("x")),
    ];
    let mut id = 6;
    for (extra, header) in unlisted {
        for _ in 0..2 {
            id += 1;
            let before = ran.count();
            let answer = send(&door, &charge(id, 5, extra.clone()), header).await;
            assert_eq!(
                ran_as(&answer, id),
                format!("call {}", before + 1),
                "{extra}"
            );
        }
    }
    assert_eq!(ran.params(5)["arguments"]["idempotency_key"], "x");
    // tools/list offers `key`, the list's first argument.
    let list = send(
        &door,
        &json!({ "jsonrpc": "2.0", "id": 99, "method": "tools/list" }),
        None,
    )
    .await;
    let properties = &list["result"]["tools"][0]["inputSchema"]["properties"];
    assert_eq!(properties["key"]["type"], "string", "{list}");
    assert!(properties.get("idempotency_key").is_none(), "{list}");
}

/// With no argument among the places, `tools/list` offers none; under
/// `--require-key` a call keyed only where the list does not read is
/// refused, never run.
async fn runtime_places_only_advertise_nothing_and_require_a_key_of_theirs(backend: Backend) {
    let (door, ran) = door(&backend, &["--mcp-key-from", "meta:k", "--require-key"]).await;
    let list = send(
        &door,
        &json!({ "jsonrpc": "2.0", "id": 99, "method": "tools/list" }),
        None,
    )
    .await;
    assert_eq!(
        list["result"]["tools"][0]["inputSchema"]["properties"],
        json!({ "amount": { "type": "integer" } }),
        "{list}"
    );
    for (id, extra, header) in [
        (1, json!({}), Some("h")),
        (2, json!({ "arguments": { "idempotency_key": "a" } }), None),
        (3, json!({ "_meta": { "idempotency-key": "u" } }), None),
    ] {
        let answer = send(&door, &charge(id, 5, extra.clone()), header).await;
        assert_eq!(refused_as(&answer), "key-missing", "{extra}");
    }
    assert_eq!(ran.count(), 0);
    let keyed = json!({ "_meta": { "k": "k-1" } });
    assert_eq!(
        ran_as(&send(&door, &charge(4, 5, keyed.clone()), None).await, 4),
        "call 1"
    );
    assert_eq!(
        ran_as(&send(&door, &charge(5, 5, keyed), Some("h")).await, 5),
        "call 1"
    );
    assert_eq!(ran.count(), 1);
}

/// A task-augmented call runs once: the repeat gets the task the server
/// created (`task-1`, with the repeat's id), whatever ttl it asks for;
/// `tasks/get` and `tasks/result` pass through to the server. The same key
/// without a task is another call.
async fn a_task_augmented_call_runs_once(backend: Backend) {
    let (door, ran) = door(&backend, &[]).await;
    let tasked = |ttl: u64| json!({ "_meta": { "dev.idemgate/idempotency-key": "t-1" }, "task": { "ttl": ttl } });
    let mut tasks = Vec::new();
    for (id, ttl) in [(1, 60_000), (2, 60_000), (3, 5_000)] {
        let answer = send(&door, &charge(id, 5, tasked(ttl)), None).await;
        assert_eq!(answer["id"], id, "{answer}");
        assert_eq!(answer["result"]["task"]["status"], "working", "{answer}");
        tasks.push(answer["result"]["task"]["taskId"].clone());
    }
    assert_eq!(tasks, [json!("task-1"), json!("task-1"), json!("task-1")]);
    assert_eq!(ran.count(), 1, "one task, never a second");
    let get = send(
        &door,
        &json!({ "jsonrpc": "2.0", "id": 4, "method": "tasks/get",
            "params": { "taskId": "task-1" } }),
        None,
    )
    .await;
    assert_eq!(get["result"]["status"], "completed", "{get}");
    let result = send(
        &door,
        &json!({ "jsonrpc": "2.0", "id": 5, "method": "tasks/result",
            "params": { "taskId": "task-1" } }),
        None,
    )
    .await;
    assert_eq!(ran_as(&result, 5), "call 1");
    // Asking for the result itself under the task's key is another call.
    let untasked = json!({ "_meta": { "dev.idemgate/idempotency-key": "t-1" } });
    let answer = send(&door, &charge(6, 5, untasked), None).await;
    assert_eq!(refused_as(&answer), "key-reused");
    // A task-augmented call's refusal is a JSON-RPC error (its client reads
    // a task, and a tool result is none), the problem in its data.
    let answer = send(&door, &charge(7, 9, tasked(60_000)), None).await;
    assert_eq!(answer["id"], 7, "{answer}");
    assert_eq!(answer["error"]["code"], -32000, "{answer}");
    assert!(
        answer["error"]["data"]["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("/key-reused")),
        "{answer}"
    );
    assert!(
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("(key-reused)")),
        "{answer}"
    );
    assert_eq!(ran.count(), 1);
}

/// Lists that would let a model's key beat a runtime's, or that name no
/// place, the same place twice or a place of no known kind: refused at
/// startup, naming the setting.
#[test]
fn bad_lists_are_refused_at_startup() {
    for (list, says) in [
        ("argument:idempotency_key,header", "before header"),
        ("header,argument:a,meta:k", "before meta:k"),
        ("", "empty place"),
        ("header,,meta:k", "empty place"),
        ("meta:k,meta:k", "twice"),
        ("cookie:k", "not a place"),
        ("meta:", "names no member"),
        ("param:arguments", "the call's own"),
    ] {
        let out = common::bin::idemgate_at("sqlite::memory:")
            .env("IDEMGATE_MCP_KEY_FROM", list)
            .args([
                "proxy",
                "--protocol",
                "mcp",
                "--upstream",
                "http://127.0.0.1:9",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{list:?} was accepted: {stderr}");
        assert!(
            stderr.contains("IDEMGATE_MCP_KEY_FROM="),
            "{list:?}: {stderr}"
        );
        assert!(stderr.contains(says), "{list:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{list:?}: {stderr}");
    }
    // Set for a door that speaks HTTP, it is a mistake too.
    let out = common::bin::idemgate_at("sqlite::memory:")
        .args([
            "proxy",
            "--upstream",
            "http://127.0.0.1:9",
            "--mcp-key-from",
            "header",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("--mcp-key-from header"), "{stderr}");
}

crate::both_stores! {
    serial: [
        the_ecosystems_keys_are_guarded_by_default,
        a_runtimes_place_beats_a_models,
        a_list_of_ones_own_is_read_as_it_says,
        runtime_places_only_advertise_nothing_and_require_a_key_of_theirs,
        a_task_augmented_call_runs_once,
    ],
    concurrent: [],
}
