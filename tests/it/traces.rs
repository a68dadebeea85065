//! Traces: the real binary, with `IDEMGATE_OTLP_ENDPOINT` pointing at an
//! OTLP/HTTP receiver in the test that decodes what it is sent
//! (`ExportTraceServiceRequest`, protobuf), and an origin that records the
//! headers it gets. Spans carry the caller's trace, the upstream gets the
//! upstream call's span as its parent, a replay sends nothing upstream, and
//! no attribute holds the key or the body.

use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message as _;

use crate::common;
use common::bin::{Served, free_port, idemgate_at, signal, wait_exit};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";
const KEY: &str = "trace-key-7f3a9c21";
const BODY: &str = r#"{"amount":4217,"memo":"body-secret-memo"}"#;

/// One exported span, as the receiver decoded it.
#[derive(Debug, Clone)]
struct Exported {
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    attributes: Vec<(String, String)>,
    service: String,
}

impl Exported {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// An OTLP/HTTP receiver on 127.0.0.1:0: `POST /v1/traces` with a protobuf
/// `ExportTraceServiceRequest`.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Exported>>>,
    refused: Arc<Mutex<Vec<String>>>,
}

impl Receiver {
    async fn start() -> (Receiver, String) {
        let receiver = Receiver::default();
        let app = Router::new()
            .route("/v1/traces", post(receive))
            .with_state(receiver.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (receiver, format!("http://{addr}"))
    }

    fn spans(&self) -> Vec<Exported> {
        self.spans.lock().unwrap().clone()
    }
}

async fn receive(State(receiver): State<Receiver>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if content_type != "application/x-protobuf" {
        receiver
            .refused
            .lock()
            .unwrap()
            .push(format!("content-type {content_type:?}"));
        return StatusCode::UNSUPPORTED_MEDIA_TYPE;
    }
    let request = match ExportTraceServiceRequest::decode(body) {
        Ok(request) => request,
        Err(e) => {
            receiver.refused.lock().unwrap().push(e.to_string());
            return StatusCode::BAD_REQUEST;
        }
    };
    let mut spans = receiver.spans.lock().unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref())
            .map(any_text)
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                spans.push(Exported {
                    trace_id: hex::encode(&span.trace_id),
                    span_id: hex::encode(&span.span_id),
                    parent: hex::encode(&span.parent_span_id),
                    name: span.name.clone(),
                    attributes: span
                        .attributes
                        .iter()
                        .map(|kv| {
                            let value = kv.value.as_ref().map(any_text).unwrap_or_default();
                            (kv.key.clone(), value)
                        })
                        .collect(),
                    service: service.clone(),
                });
            }
        }
    }
    StatusCode::OK
}

fn any_text(value: &opentelemetry_proto::tonic::common::v1::AnyValue) -> String {
    match &value.value {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// An origin that records every request's headers and answers 201.
#[derive(Clone, Default)]
struct Origin {
    seen: Arc<Mutex<Vec<HeaderMap>>>,
}

impl Origin {
    async fn start() -> (Origin, String) {
        let origin = Origin::default();
        let app = Router::new()
            .fallback(
                |State(origin): State<Origin>, headers: HeaderMap, body: Bytes| async move {
                    origin.seen.lock().unwrap().push(headers);
                    // An MCP tool call gets its JSON-RPC result.
                    let call = serde_json::from_slice::<serde_json::Value>(&body).ok();
                    match call.filter(|c| c["jsonrpc"] == "2.0") {
                        Some(call) => {
                            let result = serde_json::json!({ "jsonrpc": "2.0", "id": call["id"],
                                "result": { "content": [{ "type": "text", "text": "charged" }] } });
                            (
                                StatusCode::OK,
                                [("content-type", "application/json")],
                                result.to_string(),
                            )
                        }
                        None => (
                            StatusCode::CREATED,
                            [("content-type", "application/json")],
                            r#"{"charged":true}"#.to_owned(),
                        ),
                    }
                },
            )
            .with_state(origin.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (origin, format!("http://{addr}"))
    }

    fn traceparents(&self) -> Vec<Option<String>> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|h| {
                h.get("traceparent")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            })
            .collect()
    }
}

/// `idemgate proxy` in front of `upstream`, with `env`, on free ports; waits
/// for `/readyz`.
async fn proxy(upstream: &str, env: &[(&str, &str)], flags: &[&str]) -> (Child, String) {
    let (port, admin) = (free_port(), free_port());
    let mut cmd = idemgate_at("sqlite::memory:");
    cmd.env_remove("IDEMGATE_UPSTREAM")
        .env_remove("IDEMGATE_OTLP_ENDPOINT")
        .env_remove("OTEL_SERVICE_NAME")
        .env_remove("OTEL_RESOURCE_ATTRIBUTES");
    for (name, value) in env {
        cmd.env(name, value);
    }
    let mut child = cmd
        .args(["proxy", "--upstream", upstream])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(flags)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let ready = format!("http://127.0.0.1:{admin}/readyz");
    let started = Instant::now();
    loop {
        if let Ok(res) = reqwest::get(&ready).await
            && res.status() == 200
        {
            return (child, format!("http://127.0.0.1:{port}"));
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("idemgate proxy exited ({status})");
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "idemgate proxy did not come up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Stops `child` with SIGTERM (its exporter flushes on the way out).
async fn stop(child: &mut Child) {
    signal(child.id(), "TERM");
    let status = wait_exit(child, Duration::from_secs(20)).await;
    assert!(status.is_some(), "the process did not stop on SIGTERM");
}

fn traceparent() -> String {
    format!("00-{TRACE_ID}-{CALLER_SPAN}-01")
}

async fn post_charge(http: &reqwest::Client, base: &str) -> reqwest::Response {
    http.post(format!("{base}/v1/charges"))
        .header("idempotency-key", KEY)
        .header("content-type", "application/json")
        .header("authorization", "Bearer tenant-token-5d1e")
        .header("traceparent", traceparent())
        .body(BODY)
        .send()
        .await
        .unwrap()
}

/// No attribute anywhere holds the key, the body, or the token.
fn assert_nothing_secret(spans: &[Exported]) {
    for span in spans {
        for (key, value) in &span.attributes {
            for secret in [KEY, "body-secret-memo", "tenant-token-5d1e"] {
                assert!(
                    !value.contains(secret),
                    "{}: attribute {key} = {value:?} holds {secret:?}",
                    span.name
                );
            }
        }
    }
}

#[tokio::test]
async fn the_proxy_exports_its_spans_in_the_callers_trace_and_passes_its_context_upstream() {
    let (receiver, endpoint) = Receiver::start().await;
    let (origin, upstream) = Origin::start().await;
    let (mut child, base) = proxy(
        &upstream,
        &[
            ("IDEMGATE_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
        &[],
    )
    .await;
    let http = common::http();

    let first = post_charge(&http, &base).await;
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    // The first request's spans are all out before the retry is sent, so
    // the two requests' spans can be told apart by time.
    let first_done = common::until(Duration::from_secs(10), || {
        receiver
            .spans()
            .iter()
            .any(|s| s.name == "idemgate.request")
    })
    .await;
    assert!(
        first_done,
        "no request span was exported: {:?}",
        receiver.refused
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first_spans = receiver.spans();

    let retry = post_charge(&http, &base).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(
        retry.headers().get("idempotent-replayed").unwrap(),
        "true",
        "the retry is a replay"
    );
    stop(&mut child).await;
    let all = receiver.spans();
    assert!(
        receiver.refused.lock().unwrap().is_empty(),
        "{:?}",
        receiver.refused
    );
    let retry_spans: Vec<Exported> = all[first_spans.len()..].to_vec();

    // Every span is in the caller's trace, and the door's span is the
    // caller's span's child.
    for span in &all {
        assert_eq!(span.trace_id, TRACE_ID, "{span:?}");
        assert_eq!(span.service, "idemgate", "{span:?}");
    }
    let request = |spans: &[Exported]| -> Exported {
        let found: Vec<&Exported> = spans
            .iter()
            .filter(|s| s.name == "idemgate.request")
            .collect();
        assert_eq!(found.len(), 1, "one request span: {spans:#?}");
        found[0].clone()
    };
    let children_of = |spans: &[Exported], parent: &Exported| -> Vec<String> {
        let mut names: Vec<String> = spans
            .iter()
            .filter(|s| s.parent == parent.span_id)
            .map(|s| s.name.clone())
            .collect();
        names.sort();
        names
    };

    let first_request = request(&first_spans);
    assert_eq!(first_request.parent, CALLER_SPAN);
    assert_eq!(first_request.attr("idemgate.door"), Some("proxy"));
    assert_eq!(first_request.attr("http.request.method"), Some("POST"));
    assert_eq!(first_request.attr("http.response.status_code"), Some("201"));
    assert_eq!(first_request.attr("idemgate.outcome"), Some("created"));
    let key_hash = first_request.attr("idemgate.key.hash").unwrap().to_owned();
    assert_eq!(key_hash.len(), 12, "the hash prefix, as in the logs");
    assert_eq!(
        children_of(&first_spans, &first_request),
        [
            "idemgate.claim",
            "idemgate.commit",
            "idemgate.key",
            "idemgate.upstream"
        ]
    );
    let claim = first_spans
        .iter()
        .find(|s| s.name == "idemgate.claim")
        .unwrap();
    assert_eq!(claim.attr("idemgate.outcome"), Some("created"));
    assert_eq!(claim.attr("idemgate.attempt"), Some("1"));
    assert_eq!(claim.attr("idemgate.key.hash"), Some(key_hash.as_str()));
    let commit = first_spans
        .iter()
        .find(|s| s.name == "idemgate.commit")
        .unwrap();
    assert_eq!(commit.attr("idemgate.outcome"), Some("committed"));
    let upstream_span = first_spans
        .iter()
        .find(|s| s.name == "idemgate.upstream")
        .unwrap();
    assert_eq!(upstream_span.attr("http.response.status_code"), Some("201"));

    // The origin got the trace, with the upstream call's span as parent.
    let sent = origin.traceparents();
    assert_eq!(sent.len(), 1, "the replay sent nothing upstream: {sent:?}");
    let sent = sent[0].clone().expect("the origin got a traceparent");
    let parts: Vec<&str> = sent.split('-').collect();
    assert_eq!(parts.len(), 4, "{sent}");
    assert_eq!(parts[1], TRACE_ID, "{sent}");
    assert_eq!(parts[2], upstream_span.span_id, "{sent}");
    assert_ne!(
        parts[2], CALLER_SPAN,
        "{sent}: the caller's own traceparent"
    );

    // The replay: a request span in the same trace, with the key and the
    // claim (answered from the store) and the replay, and no upstream call.
    let retry_request = request(&retry_spans);
    assert_eq!(retry_request.parent, CALLER_SPAN);
    assert_eq!(retry_request.attr("idemgate.outcome"), Some("replayed"));
    assert_eq!(
        children_of(&retry_spans, &retry_request),
        ["idemgate.claim", "idemgate.key", "idemgate.replay"]
    );
    assert!(
        !retry_spans.iter().any(|s| s.name == "idemgate.upstream"),
        "{retry_spans:#?}"
    );

    assert_nothing_secret(&all);
}

#[tokio::test]
async fn without_an_endpoint_nothing_is_exported_and_the_callers_traceparent_passes_through() {
    let (origin, upstream) = Origin::start().await;
    let (mut child, base) = proxy(&upstream, &[], &[]).await;
    let http = common::http();
    let res = post_charge(&http, &base).await;
    assert_eq!(res.status(), 201);
    stop(&mut child).await;
    assert_eq!(origin.traceparents(), [Some(traceparent())]);
}

#[tokio::test]
async fn serve_exports_a_reservations_spans_in_the_callers_trace() {
    let (receiver, endpoint) = Receiver::start().await;
    let mut cmd = idemgate_at("sqlite::memory:");
    // A batch's delay far longer than the test: the spans arrive because
    // the process flushes them when it stops.
    cmd.env("IDEMGATE_OTLP_ENDPOINT", &endpoint)
        .env("OTEL_SERVICE_NAME", "reservations-under-test")
        .env("OTEL_BSP_SCHEDULE_DELAY", "120000");
    let mut served = Served::spawn(cmd, &[]).await;
    let http = common::http();
    let reserved = http
        .post(format!("{}/v1/reservations", served.base()))
        .header("idempotency-key", KEY)
        .header("traceparent", traceparent())
        .json(
            &serde_json::json!({ "request": { "method": "POST", "path": "/charges",
            "body": { "memo": "body-secret-memo" } } }),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(reserved.status(), 201);
    let id = reserved.json::<serde_json::Value>().await.unwrap()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let committed = http
        .post(format!("{}/v1/reservations/{id}/commit", served.base()))
        .header("traceparent", traceparent())
        .json(&serde_json::json!({ "status": 201, "body": "body-secret-memo" }))
        .send()
        .await
        .unwrap();
    assert!(committed.status().is_success(), "{}", committed.status());
    // Health checks are not traced.
    let _ = http.get(format!("{}/healthz", served.base())).send().await;
    assert!(
        receiver.spans().is_empty(),
        "exported before the batch's delay: the flush at the stop is not what is tested"
    );
    stop(&mut served.child).await;

    let spans = receiver.spans();
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    for span in &spans {
        assert_eq!(span.trace_id, TRACE_ID, "{span:?}");
        assert_eq!(span.service, "reservations-under-test", "{span:?}");
    }
    let requests: Vec<&Exported> = spans
        .iter()
        .filter(|s| s.name == "idemgate.request")
        .collect();
    assert_eq!(requests.len(), 2, "reserve and commit only: {names:?}");
    for request in &requests {
        assert_eq!(request.parent, CALLER_SPAN);
        assert_eq!(request.attr("idemgate.door"), Some("api"));
        assert_eq!(request.attr("idemgate.tenant"), None, "open mode");
    }
    let routes: Vec<Option<&str>> = requests.iter().map(|r| r.attr("http.route")).collect();
    assert!(routes.contains(&Some("/v1/reservations")), "{routes:?}");
    assert!(
        routes.contains(&Some("/v1/reservations/{id}/commit")),
        "{routes:?}"
    );
    for name in ["idemgate.key", "idemgate.claim", "idemgate.commit"] {
        let span = spans.iter().find(|s| s.name == name).unwrap_or_else(|| {
            panic!("no {name} span: {names:?}");
        });
        assert!(
            requests.iter().any(|r| r.span_id == span.parent),
            "{name} is not a request's child"
        );
    }
    let claim = spans.iter().find(|s| s.name == "idemgate.claim").unwrap();
    assert_eq!(claim.attr("idemgate.outcome"), Some("created"));
    assert_nothing_secret(&spans);
}

#[tokio::test]
async fn the_mcp_door_traces_a_tool_call_and_its_repeat() {
    let (receiver, endpoint) = Receiver::start().await;
    let (origin, upstream) = Origin::start().await;
    let (mut child, base) = proxy(
        &format!("{upstream}/mcp"),
        &[("IDEMGATE_OTLP_ENDPOINT", endpoint.as_str())],
        &["--protocol", "mcp"],
    )
    .await;
    let http = common::http();
    for id in [1, 2] {
        let call = serde_json::json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": { "name": "charge",
                "arguments": { "memo": "body-secret-memo", "idempotency_key": KEY } } });
        let res = http
            .post(format!("{base}/mcp"))
            .header("accept", "application/json, text/event-stream")
            .header("traceparent", traceparent())
            .json(&call)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        let answer: serde_json::Value = res.json().await.unwrap();
        assert_eq!(answer["id"], id, "{answer}");
        assert_eq!(
            answer["result"]["content"][0]["text"], "charged",
            "{answer}"
        );
    }
    // The default batch delay is longer than this: the flush at the stop
    // delivers them.
    stop(&mut child).await;

    let spans = receiver.spans();
    for span in &spans {
        assert_eq!(span.trace_id, TRACE_ID, "{span:?}");
    }
    let requests: Vec<&Exported> = spans
        .iter()
        .filter(|s| s.name == "idemgate.request")
        .collect();
    assert_eq!(requests.len(), 2, "{spans:#?}");
    let outcomes: Vec<Option<&str>> = requests
        .iter()
        .map(|r| r.attr("idemgate.outcome"))
        .collect();
    assert!(outcomes.contains(&Some("created")), "{outcomes:?}");
    assert!(outcomes.contains(&Some("replayed")), "{outcomes:?}");
    for request in &requests {
        assert_eq!(request.parent, CALLER_SPAN);
        assert_eq!(request.attr("idemgate.door"), Some("mcp"));
    }
    let upstream_spans: Vec<&Exported> = spans
        .iter()
        .filter(|s| s.name == "idemgate.upstream")
        .collect();
    assert_eq!(
        upstream_spans.len(),
        1,
        "the repeat is not sent: {spans:#?}"
    );
    let sent = origin.traceparents();
    assert_eq!(sent.len(), 1, "{sent:?}");
    let sent = sent[0].clone().expect("the MCP server got a traceparent");
    assert_eq!(
        sent,
        format!("00-{TRACE_ID}-{}-01", upstream_spans[0].span_id)
    );
    assert_nothing_secret(&spans);
}
