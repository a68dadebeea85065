//! The service under the layer for guarded tool calls: the proxy's client,
//! with the upstream's answer read and told apart for the layer. A tool
//! call's event stream ends with its response; what comes before it (the
//! server's requests mid-call under 2025-11-25 — elicitation, sampling,
//! roots — and its notifications, progress and logging) is passed to the
//! door as it comes ([`Interim`]), and what the layer gets, and stores, is
//! an event stream of the response alone. A JSON answer is read whole.
//!
//! * A JSON-RPC error that says the call never reached the tool (parse
//!   error, invalid request, method not found, invalid params) or a `4xx`
//!   (no session, a bad header): not executed, the key is released.
//! * Any other JSON-RPC error (`-32800` request cancelled, `-32603`), a body
//!   that breaks off, or a `2xx` without the call's response: the tool may
//!   have run and this is not its result, so it is never stored; the
//!   outcome is unknown.
//! * A release status (`IDEMGATE_RELEASE_STATUSES`) is released by the
//!   layer; any other `5xx` is stored, as the HTTP door stores a `500`.
//! * An `input_required` result (2026-07-28) asks the client for input: not
//!   the call's outcome, never stored (`rounds.rs`).
//! * A call whose user said no to its question (declined or cancelled it, or
//!   whose client answered it with an error, as a client that goes away
//!   does), under either protocol, and that then ends in an error (a tool
//!   result with `isError`, or a JSON-RPC error), did not act: the key is
//!   released, so that the call can be asked again ([`SaidNo`]).
//! * Anything else, a tool result with `isError` included, is stored: the
//!   tool ran.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use http::Request;
use http_body_util::BodyExt;
use serde_json::Value;
use tower::{Service, ServiceExt};

use futures::StreamExt;
use tokio::sync::mpsc;

use super::messages::{self, Form};
use super::rounds::{self, Declined};
use crate::layer::{AwaitingInput, NotExecuted, OutcomeUnknown};
use crate::problem::ApiError;
use crate::server::proxy::ProxyClient;

/// JSON-RPC error codes that mean the request never reached the tool.
const NOT_RUN: [i64; 4] = [-32700, -32600, -32601, -32602];

/// The most of a tool call's answer read into memory.
const MOST: usize = 64 * 1024 * 1024;

/// The JSON-RPC id of the tool call a request carries (an extension).
#[derive(Debug, Clone)]
pub(super) struct CallId(pub Value);

/// Where the messages a guarded call's event stream carries before its
/// response go as they come (an extension the door puts on the request):
/// the response's head, then each message's event. Sent with
/// backpressure, and never an error: a receiver that is gone (its client
/// hung up) stops the passing, not the call.
#[derive(Debug, Clone)]
pub(super) struct Interim(pub mpsc::Sender<Passed>);

/// What [`Interim`] carries.
#[derive(Debug)]
pub(super) enum Passed {
    /// The head of the server's answer, before its first event.
    Head(http::HeaderMap),
    /// A message that is not the call's response, as one `message` event.
    Event(Bytes),
}

/// An [`Interim`], and what receives from it.
pub(super) fn interim() -> (Interim, mpsc::Receiver<Passed>) {
    let (tx, rx) = mpsc::channel(16);
    (Interim(tx), rx)
}

/// [`ProxyClient`] for guarded tool calls.
#[derive(Clone)]
pub(super) struct McpUpstream {
    pub client: ProxyClient,
    pub running: Arc<Running>,
}

/// The guarded calls the MCP server is running, by session and JSON-RPC
/// id, so that a client's `notifications/cancelled` for one is not
/// forwarded: a cancelled tool may already have acted, and its answer
/// would then not be its result.
#[derive(Debug, Default)]
pub(super) struct Running {
    calls: Mutex<HashMap<(String, String), usize>>,
    /// The questions guarded calls asked their clients mid-call, by session
    /// and the question's JSON-RPC id: the call's [`SaidNo`].
    questions: Mutex<HashMap<(String, String), SaidNo>>,
    /// Told each time a call ends.
    ended: tokio::sync::Notify,
}

/// Whether a guarded call's user said no to its question: this round
/// declined or cancelled it (`inputResponses`, 2026-07-28), or the client
/// answered a question the call asked mid-call (2025-11-25) with a decline,
/// a cancel or an error.
#[derive(Debug, Clone, Default)]
pub(super) struct SaidNo(Arc<AtomicBool>);

impl SaidNo {
    fn said(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// The questions one call asked mid-call, known to [`Running`] until dropped.
struct Asked {
    running: Arc<Running>,
    session: String,
    said_no: SaidNo,
    questions: Vec<(String, String)>,
}

impl Asked {
    /// `message` passed to the client: if it is a question (a request),
    /// its answer is watched for a no.
    fn passed(&mut self, message: &Value) {
        let (Some(_), Some(id)) = (message.get("method"), message.get("id")) else {
            return;
        };
        let question = (self.session.clone(), id.to_string());
        let mut questions = self
            .running
            .questions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        questions.insert(question.clone(), self.said_no.clone());
        self.questions.push(question);
    }
}

impl Drop for Asked {
    fn drop(&mut self) {
        let mut questions = self
            .running
            .questions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for question in &self.questions {
            questions.remove(question);
        }
    }
}

/// A call [`Running`] until dropped.
struct RunningCall {
    running: Arc<Running>,
    call: (String, String),
}

impl Running {
    /// The key of call `id` on the session of `headers`.
    fn call(headers: &http::HeaderMap, id: &Value) -> (String, String) {
        let session = headers
            .get(super::MCP_SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        (session.to_owned(), id.to_string())
    }

    fn start(self: &Arc<Running>, headers: &http::HeaderMap, id: &Value) -> RunningCall {
        let call = Running::call(headers, id);
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        *calls.entry(call.clone()).or_default() += 1;
        RunningCall {
            running: self.clone(),
            call,
        }
    }

    /// Whether call `id` on the session of `headers` is running.
    pub(super) fn is_running(&self, headers: &http::HeaderMap, id: &Value) -> bool {
        let calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.contains_key(&Running::call(headers, id))
    }

    /// A client's answer to a question (a JSON-RPC response it sent): if it
    /// answers a guarded call's question with a decline, a cancel or an
    /// error, that call's user said no.
    pub(super) fn answered(&self, headers: &http::HeaderMap, message: &Value) {
        if message.get("method").is_some() {
            return;
        }
        let Some(id) = message.get("id") else {
            return;
        };
        let questions = self.questions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(said_no) = questions.get(&Running::call(headers, id))
            && (message.get("error").is_some()
                || matches!(
                    message.pointer("/result/action").and_then(Value::as_str),
                    Some("decline" | "cancel")
                ))
        {
            said_no.0.store(true, Ordering::SeqCst);
        }
    }

    /// Whether a guarded call of `session` is running.
    pub(super) fn session_busy(&self, session: &str) -> bool {
        let calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.keys().any(|(s, _)| s == session)
    }

    /// Until no guarded call of `session` runs, or `bound` has passed.
    pub(super) async fn session_ended(&self, session: &str, bound: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let ended = self.ended.notified();
            if !self.session_busy(session) {
                return;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                return;
            }
        }
    }
}

impl Drop for RunningCall {
    fn drop(&mut self) {
        let mut calls = self.running.calls.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = calls.get_mut(&self.call) {
            *n -= 1;
            if *n == 0 {
                calls.remove(&self.call);
            }
        }
        drop(calls);
        self.running.ended.notify_waiters();
    }
}

impl Service<Request<Body>> for McpUpstream {
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let client = self.client.clone();
        let running = self.running.clone();
        Box::pin(async move {
            let id = req.extensions().get::<CallId>().map(|c| c.0.clone());
            // Not forwarded to the server: the sender lives as long as the
            // reading of the answer.
            let interim = req.extensions_mut().remove::<Interim>();
            let said_no = SaidNo::default();
            if req.extensions().get::<Declined>().is_some() {
                said_no.0.store(true, Ordering::SeqCst);
            }
            let asked = Asked {
                running: running.clone(),
                session: Running::call(req.headers(), &Value::Null).0,
                said_no,
                questions: Vec::new(),
            };
            // Until the call's response is read: the call runs on if its
            // client hangs up, in the layer's own task.
            let _running = id.as_ref().map(|id| running.start(req.headers(), id));
            let res = client.oneshot(req).await?;
            Ok(told_apart(res, id, interim, asked).await)
        })
    }
}

/// `res` marked for the layer: its outcome unknown, or not executed.
fn marked(mut res: Response, unknown: bool) -> Response {
    if unknown {
        res.extensions_mut().insert(OutcomeUnknown);
    } else {
        res.extensions_mut().insert(NotExecuted);
    }
    res
}

/// The call's response found in the server's answer (`res` holds it),
/// marked as its JSON-RPC error code says; `said_no`: its user said no to
/// its question.
fn responded(res: Response, response: &Value, said_no: bool) -> Response {
    let code = response.pointer("/error/code").and_then(Value::as_i64);
    if said_no && (response.get("error").is_some() || rounds::is_tool_error(response)) {
        tracing::info!(
            "the user said no to a guarded tool's question and the tool answered with an error: \
             it did not act, and the key is released"
        );
        return marked(res, false);
    }
    match code {
        Some(code) if NOT_RUN.contains(&code) => marked(res, false),
        Some(code) => {
            tracing::warn!(
                code,
                "the MCP server answered a tool call with a JSON-RPC error, not its result; \
                 whether the tool ran is unknown"
            );
            marked(res, true)
        }
        None if response.get("error").is_some() => marked(res, true),
        // A question for the client, not the call's outcome.
        None if rounds::asks_for_input(response) => {
            let mut res = res;
            res.extensions_mut().insert(AwaitingInput);
            res
        }
        None => res,
    }
}

/// The server's answer broke off, or ended without the call's response:
/// whether the tool ran is unknown.
fn broke_off(why: &str) -> Response {
    let res = ApiError::UpstreamUnavailable(format!(
        "the MCP server's answer {why}; whether the tool ran is unknown"
    ))
    .into_response();
    marked(res, true)
}

/// A guarded call's event stream, read as it comes: each message before
/// the call's response passed on through `interim` at once (an event
/// without a JSON-RPC message is none: dropped), and the answer, for the
/// layer, an event stream of the response alone. The stream is not read
/// past the response, which ends the call.
async fn event_stream(
    mut parts: http::response::Parts,
    body: Body,
    id: &Value,
    interim: Option<Interim>,
    mut asked: Asked,
) -> Response {
    let mut passing = interim.map(|i| i.0);
    let mut head = Some(parts.headers.clone());
    let mut events = std::pin::pin!(messages::events(body, MOST));
    while let Some(event) = events.next().await {
        let data = match event {
            Ok(data) => data,
            Err(e) => {
                tracing::warn!(error = %e, "the MCP server's answer to a tool call broke off");
                return broke_off("broke off");
            }
        };
        let Ok(message) = serde_json::from_str::<Value>(&data) else {
            continue;
        };
        if messages::is_response_to(&message, id) {
            parts.headers.remove(http::header::CONTENT_LENGTH);
            let res = Response::from_parts(parts, Body::from(messages::event(&data)));
            return responded(res, &message, asked.said_no.said());
        }
        asked.passed(&message);
        if let Some(tx) = &passing {
            let mut sent = match head.take() {
                Some(head) => tx.send(Passed::Head(head)).await.is_ok(),
                None => true,
            };
            sent = sent && tx.send(Passed::Event(messages::event(&data))).await.is_ok();
            if !sent {
                // The client hung up: the call runs to its end all the same.
                passing = None;
            }
        }
    }
    tracing::warn!(
        "the MCP server's answer to a tool call ended without its response; whether the tool \
         ran is unknown"
    );
    broke_off("ended without the call's response")
}

/// The upstream's answer, read and marked for the layer.
async fn told_apart(
    res: Response,
    id: Option<Value>,
    interim: Option<Interim>,
    asked: Asked,
) -> Response {
    if res.extensions().get::<NotExecuted>().is_some()
        || res.extensions().get::<OutcomeUnknown>().is_some()
    {
        return res;
    }
    let status = res.status();
    if status.is_client_error() {
        return marked(res, false);
    }
    let (mut parts, body) = res.into_parts();
    if let Some(id) = &id
        && status.is_success()
        && status != http::StatusCode::ACCEPTED
        && Form::of(&parts.headers) == Some(Form::EventStream)
    {
        return event_stream(parts, body, id, interim, asked).await;
    }
    let bytes = match http_body_util::Limited::new(body, MOST).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            tracing::warn!(error = %e, "the MCP server's answer to a tool call broke off");
            return broke_off("broke off");
        }
    };
    parts.headers.remove(http::header::CONTENT_LENGTH);
    let whole = |parts, bytes| Response::from_parts(parts, Body::from(bytes));
    if status.is_server_error() {
        // The layer releases its release statuses itself; any other 5xx may
        // have come after the tool ran.
        return whole(parts, bytes);
    }
    let (Some(form), Some(id)) = (Form::of(&parts.headers), id) else {
        return whole(parts, bytes);
    };
    let messages = messages::read(form, &bytes).await;
    match messages::response_to(&messages, &id) {
        Some(response) => responded(whole(parts, bytes), response, asked.said_no.said()),
        None if status.is_success() && status != http::StatusCode::ACCEPTED => {
            tracing::warn!(
                "the MCP server's answer to a tool call ended without its response; whether the \
                 tool ran is unknown"
            );
            marked(whole(parts, bytes), true)
        }
        None => whole(parts, bytes),
    }
}
