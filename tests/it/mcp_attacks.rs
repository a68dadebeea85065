//! The MCP door's envelopes and key scopes under attack (issue 51, findings
//! 1 and 6), against the real binary on both stores, over a hand-written
//! JSON-RPC upstream that counts the tool calls it runs.
//!
//! * A guarded `tools/call` sent as a notification (no `id`) was forwarded,
//!   unguarded, every time; a JSON-RPC batch of two calls under one key ran
//!   both; under `--require-key` a keyless batch and a keyless notification
//!   ran. Now a notification is answered `202`, dropped and counted, and a
//!   batch that holds a guarded call is refused whole.
//! * A `method` that is `tools/call` but for its case, or a body that
//!   repeats a member, could make the door and a lenient server read two
//!   different messages; now refused.
//! * A model's `idempotency_key` argument and a runtime's `_meta` key lived
//!   in one namespace: the model's `rt-2` pre-empted the runtime's. Now they
//!   never meet.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::response::IntoResponse;
use serde_json::{Value, json};

use crate::common;
use common::backend::Backend;
use common::proxy::ProxyProcess;

/// What the upstream ran: the arguments of each tool call, in order.
#[derive(Default)]
struct Ran {
    calls: Mutex<Vec<Value>>,
}

impl Ran {
    fn count(&self) -> usize {
        self.calls.lock().unwrap().len()
    }
}

/// Whether `method` is a tool call to a lenient server, which trims and
/// lowercases the method it reads.
fn lenient_tools_call(method: &Value) -> bool {
    method
        .as_str()
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("tools/call"))
}

/// A JSON-RPC server at `/mcp` as lenient as some are: it runs every
/// message whose `method` reads as `tools/call` after trimming and
/// lowercasing, requests and notifications alike, alone or in a batch,
/// sent with `POST` or `PUT`, and, for a member repeated in a message,
/// takes the first (as some parsers do; it finds the first with a raw
/// scan, enough for these bodies). Each call's result names how many calls
/// it has run.
async fn lenient_upstream(ran: Arc<Ran>) -> String {
    let run_body = move |body: Bytes| {
        let ran = ran.clone();
        async move {
            let text = String::from_utf8_lossy(&body).into_owned();
            let Ok(parsed) = serde_json::from_slice::<Value>(&body) else {
                return (http::StatusCode::BAD_REQUEST, "not JSON").into_response();
            };
            // First-wins: a method named first in the raw text counts.
            let first_method_is_call = text
                .find("\"method\"")
                .map(|at| &text[at + 8..])
                .and_then(|rest| rest.trim_start().strip_prefix(':'))
                .is_some_and(|rest| {
                    rest.trim_start()
                        .to_ascii_lowercase()
                        .starts_with("\"tools/call\"")
                });
            let run = |message: &Value| -> Option<Value> {
                let is_call = lenient_tools_call(&message["method"])
                    || (first_method_is_call && !parsed.is_array());
                if !is_call {
                    return message
                        .get("id")
                        .map(|id| json!({ "jsonrpc": "2.0", "id": id, "result": {} }));
                }
                let n = {
                    let mut calls = ran.calls.lock().unwrap();
                    calls.push(message["params"]["arguments"].clone());
                    calls.len()
                };
                let id = message.get("id")?;
                Some(json!({ "jsonrpc": "2.0", "id": id, "result": {
                        "content": [{ "type": "text", "text": format!("call {n}") }] } }))
            };
            let answer = match &parsed {
                Value::Array(batch) => {
                    let answers: Vec<Value> = batch.iter().filter_map(run).collect();
                    (!answers.is_empty()).then_some(Value::Array(answers))
                }
                message => run(message),
            };
            match answer {
                Some(answer) => axum::Json(answer).into_response(),
                None => http::StatusCode::ACCEPTED.into_response(),
            }
        }
    };
    let app =
        axum::Router::new().route("/mcp", axum::routing::post(run_body.clone()).put(run_body));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// The door, the real binary, over `backend`'s database, in front of a new
/// lenient upstream.
async fn door(backend: &Backend, extra: &[&str]) -> (ProxyProcess, Arc<Ran>) {
    let ran = Arc::new(Ran::default());
    let up = lenient_upstream(ran.clone()).await;
    let mut flags = vec!["--protocol", "mcp"];
    flags.extend_from_slice(extra);
    (
        ProxyProcess::start_at(&backend.url(), &format!("{up}/mcp"), &flags).await,
        ran,
    )
}

/// `body` POSTed to the door's `/mcp`, as is: the status and the JSON.
async fn post(door: &ProxyProcess, body: &str) -> (u16, Value) {
    let res = common::http()
        .post(format!("{}/mcp", door.base()))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let bytes = res.bytes().await.unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// A `charge` call: with `id` (none: a notification), the model's key
/// `argument_key` and the runtime's `meta_key`, if any.
fn charge(
    id: Option<u64>,
    amount: u64,
    argument_key: Option<&str>,
    meta_key: Option<&str>,
) -> Value {
    let mut call = json!({ "jsonrpc": "2.0", "method": "tools/call",
        "params": { "name": "charge", "arguments": { "amount": amount } } });
    if let Some(id) = id {
        call["id"] = json!(id);
    }
    if let Some(key) = argument_key {
        call["params"]["arguments"]["idempotency_key"] = json!(key);
    }
    if let Some(key) = meta_key {
        call["params"]["_meta"] = json!({ "dev.idemgate/idempotency-key": key });
    }
    call
}

/// The value of the series `series` at the door's `/metrics`.
async fn metric(door: &ProxyProcess, series: &str) -> Option<f64> {
    let text = reqwest::get(format!("http://127.0.0.1:{}/metrics", door.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

const DROPPED: &str = "idemgate_mcp_notifications_dropped_total";

/// A guarded call sent twice as a notification is never forwarded: `202`,
/// and counted. A batch of two calls under one key runs neither: each gets
/// a JSON-RPC error. The same call sent alone is guarded as always.
async fn notifications_and_batches_are_guarded(backend: Backend) {
    let (door, ran) = door(&backend, &[]).await;
    let notification = charge(None, 5, Some("K"), None).to_string();
    for _ in 0..2 {
        let (status, _) = post(&door, &notification).await;
        assert_eq!(status, 202);
    }
    assert_eq!(ran.count(), 0, "a notification is never forwarded");

    let batch = json!([
        charge(Some(3), 5, Some("K"), None),
        charge(Some(4), 5, Some("K"), None)
    ]);
    let (status, answer) = post(&door, &batch.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let answers = answer.as_array().expect("an answer for each request");
    assert_eq!(answers.len(), 2, "{answer}");
    for (answer, id) in answers.iter().zip([3, 4]) {
        assert_eq!(answer["id"], id, "{answer}");
        assert_eq!(answer["error"]["code"], -32600, "{answer}");
    }
    assert_eq!(ran.count(), 0, "nothing of the batch is forwarded");

    // A batch of notifications: dropped and counted, each.
    let mut n = charge(None, 5, Some("K"), None);
    n["params"]["arguments"]["amount"] = json!(6);
    let (status, _) = post(&door, &json!([n.clone(), n]).to_string()).await;
    assert_eq!(status, 202);
    assert_eq!(ran.count(), 0);
    assert_eq!(metric(&door, DROPPED).await, Some(4.0), "each counted");

    // Alone, the call is guarded: it runs once under K.
    for id in [5, 6] {
        let (_, answer) = post(&door, &charge(Some(id), 5, Some("K"), None).to_string()).await;
        assert_eq!(answer["id"], id, "{answer}");
        assert_eq!(answer["result"]["content"][0]["text"], "call 1", "{answer}");
    }
    assert_eq!(ran.count(), 1);
}

/// Under `--require-key`, no envelope carries a keyless call to the tool.
async fn require_key_holds_in_every_envelope(backend: Backend) {
    let (door, ran) = door(&backend, &["--require-key"]).await;
    let (status, _) = post(&door, &charge(None, 5, None, None).to_string()).await;
    assert_eq!(status, 202);
    let batch = json!([
        charge(Some(1), 5, None, None),
        charge(Some(2), 5, None, None)
    ]);
    let (status, answer) = post(&door, &batch.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer[0]["error"]["code"], -32600, "{answer}");
    let (_, alone) = post(&door, &charge(Some(3), 5, None, None).to_string()).await;
    assert_eq!(alone["result"]["isError"], true, "refused: {alone}");
    assert_eq!(ran.count(), 0, "no keyless call ran");
}

/// Messages the door and a lenient server would read differently are
/// refused, never forwarded: each was sent twice, and would have run twice.
async fn ambiguous_messages_are_refused(backend: Backend) {
    let (door, ran) = door(&backend, &[]).await;
    let bodies = [
        // Odd case and whitespace in the method.
        r#"{"jsonrpc":"2.0","id":1,"method":"Tools/Call","params":{"name":"charge","arguments":{"amount":5,"idempotency_key":"K"}}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":" tools/call ","params":{"name":"charge","arguments":{"amount":5}}}"#,
        // A repeated method: this door's parser takes the last, the
        // server's the first.
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","method":"ping","params":{"name":"charge","arguments":{"amount":5}}}"#,
        // A nested batch.
        r#"[[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":5}}}]]"#,
    ];
    for body in bodies {
        for _ in 0..2 {
            let (status, answer) = post(&door, body).await;
            assert!(
                status == 200 || status == 400,
                "{status} {answer} for {body}"
            );
            assert!(
                answer["error"]["code"] == -32600 || answer[0]["error"]["code"] == -32600,
                "{answer} for {body}"
            );
        }
    }
    // A guarded call sent with another method than POST.
    for _ in 0..2 {
        let res = common::http()
            .put(format!("{}/mcp", door.base()))
            .header("content-type", "application/json")
            .body(charge(Some(1), 5, Some("K"), None).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 405);
    }
    assert_eq!(ran.count(), 0);
    // Not JSON to this door: not forwarded either.
    let (status, answer) = post(&door, r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":NaN}}}"#).await;
    assert_eq!(status, 400);
    assert_eq!(answer["error"]["code"], -32700, "{answer}");
    assert_eq!(ran.count(), 0);
    // Nothing here was a notification: the series is there, at 0.
    assert_eq!(metric(&door, DROPPED).await, Some(0.0));
}

/// A model's key `rt-2` does not pre-empt a runtime's `rt-2`: both calls
/// run, once each, and each repeat gets its own call's result. The key
/// header is the runtime's scope, as `_meta` is.
async fn a_models_key_never_meets_a_runtimes(backend: Backend) {
    let (door, ran) = door(&backend, &[]).await;
    let (_, model) = post(&door, &charge(Some(1), 5, Some("rt-2"), None).to_string()).await;
    assert_eq!(model["result"]["content"][0]["text"], "call 1", "{model}");
    let (_, runtime) = post(&door, &charge(Some(2), 7, None, Some("rt-2")).to_string()).await;
    assert_eq!(
        runtime["result"]["content"][0]["text"], "call 2",
        "the runtime's call runs: {runtime}"
    );
    assert_eq!(ran.count(), 2);

    let (_, model_again) = post(&door, &charge(Some(3), 5, Some("rt-2"), None).to_string()).await;
    assert_eq!(model_again["result"], model["result"], "{model_again}");
    let (_, runtime_again) = post(&door, &charge(Some(4), 7, None, Some("rt-2")).to_string()).await;
    assert_eq!(
        runtime_again["result"], runtime["result"],
        "{runtime_again}"
    );
    let by_header = common::http()
        .post(format!("{}/mcp", door.base()))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("idempotency-key", "\"rt-2\"")
        .body(charge(Some(5), 7, None, None).to_string())
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(by_header["result"], runtime["result"], "{by_header}");

    // Nor can a model's repeat with other arguments refuse the runtime's
    // key, or the runtime's the model's: other arguments under one's own
    // key are refused in its own scope only.
    let (_, model_other) = post(&door, &charge(Some(6), 9, Some("rt-2"), None).to_string()).await;
    assert_eq!(model_other["result"]["isError"], true, "{model_other}");
    let (_, runtime_again) = post(&door, &charge(Some(7), 7, None, Some("rt-2")).to_string()).await;
    assert_eq!(
        runtime_again["result"], runtime["result"],
        "{runtime_again}"
    );
    assert_eq!(ran.count(), 2);
    assert_eq!(
        *ran.calls.lock().unwrap(),
        vec![json!({ "amount": 5 }), json!({ "amount": 7 })]
    );
    // An operator finds each: the runtime's with --key, the model's with
    // --model-key.
    use sha2::{Digest, Sha256};
    let admin = format!("http://127.0.0.1:{}", door.admin);
    for (flag, hashed) in [
        ("--key", &b"rt-2"[..]),
        ("--model-key", &b"idemgate/model-key\0rt-2"[..]),
    ] {
        let mut show = common::bin::idemgate_at(&backend.url());
        show.args([
            "keys",
            "show",
            "anonymous",
            flag,
            "rt-2",
            "--server",
            &admin,
            "--json",
        ]);
        let out = show.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{flag}: {stderr}");
        let view: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            view["key_hash"],
            hex::encode(Sha256::digest(hashed)),
            "{flag}"
        );
    }
}

/// The invariants the `mcp_envelope` fuzz target checks, on bodies built
/// from the pieces that make envelopes odd, and on arbitrary bytes: a
/// stable smoke run of what `cargo fuzz run mcp_envelope` runs long.
#[test]
fn the_envelope_classification_keeps_its_invariants() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    let piece = |list: &'static [&'static str]| proptest::sample::select(list);
    let member = prop_oneof![
        piece(&[
            "\"tools/call\"",
            "\"Tools/Call\"",
            "\" tools/call\"",
            "\"tools\\/call\"",
            "\"ping\""
        ])
        .prop_map(|m| format!("\"method\":{m}")),
        piece(&["\"tools/call\"", "\"ping\""]).prop_map(|m| format!("\"Method\":{m}")),
        piece(&["1", "\"a\"", "null", "1.0", "1.5", "true", "[1]", "{}"])
            .prop_map(|id| format!("\"id\":{id}")),
        piece(&["\"charge\"", "\"balance\"", "7"])
            .prop_map(|n| format!("\"params\":{{\"name\":{n},\"arguments\":{{\"amount\":5}}}}")),
        "[a-z]{1,3}".prop_map(|k| format!("\"jsonrpc\":\"{k}\"")),
    ];
    let object = prop::collection::vec(member, 0..6).prop_map(|m| format!("{{{}}}", m.join(",")));
    let body = prop_oneof![
        object.clone(),
        prop::collection::vec(object.clone(), 0..4).prop_map(|o| format!("[{}]", o.join(","))),
        prop::collection::vec(object, 0..3).prop_map(|o| format!("[[{}]]", o.join(","))),
        ".{0,40}",
    ];
    let content_type = piece(&["application/json", "application/x-www-form-urlencoded", ""]);
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    let mut runner = TestRunner::new(Config::with_cases(cases));
    runner
        .run(&(body, content_type, 0u8..3), |(body, ct, guarded)| {
            let ct = (!ct.is_empty()).then_some(ct);
            match guarded {
                0 => {
                    idemgate::fuzzing::assert_mcp_envelope_invariants(body.as_bytes(), ct, &|_| {
                        true
                    })
                }
                1 => {
                    idemgate::fuzzing::assert_mcp_envelope_invariants(body.as_bytes(), ct, &|_| {
                        false
                    })
                }
                _ => idemgate::fuzzing::assert_mcp_envelope_invariants(
                    body.as_bytes(),
                    ct,
                    &|name| name != "balance",
                ),
            }
            Ok(())
        })
        .unwrap();
    let mut bytes = TestRunner::new(Config::with_cases(cases));
    bytes
        .run(&(prop::collection::vec(any::<u8>(), 0..64)), |body| {
            idemgate::fuzzing::assert_mcp_envelope_invariants(
                &body,
                Some("application/json"),
                &|_| true,
            );
            Ok(())
        })
        .unwrap();
}

crate::both_stores! {
    serial: [
        notifications_and_batches_are_guarded,
        require_key_holds_in_every_envelope,
        ambiguous_messages_are_refused,
        a_models_key_never_meets_a_runtimes,
    ],
    concurrent: [],
}
