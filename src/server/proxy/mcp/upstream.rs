//! The service under the layer for guarded tool calls: the proxy's client,
//! with the upstream's answer read whole and told apart for the layer. A
//! tool call's event stream ends with its response, so nothing is held
//! back that would come later; what the layer stores is the whole answer.
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
//! * Anything else, a tool result with `isError` included, is stored: the
//!   tool ran.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use http::Request;
use http_body_util::BodyExt;
use serde_json::Value;
use tower::{Service, ServiceExt};

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
    /// Told each time a call ends.
    ended: tokio::sync::Notify,
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

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let client = self.client.clone();
        let running = self.running.clone();
        Box::pin(async move {
            let id = req.extensions().get::<CallId>().map(|c| c.0.clone());
            let declined = req.extensions().get::<Declined>().is_some();
            // Until the whole answer is read: the call runs on if its client
            // hangs up, in the layer's own task.
            let _running = id.as_ref().map(|id| running.start(req.headers(), id));
            let res = client.oneshot(req).await?;
            Ok(told_apart(res, id, declined).await)
        })
    }
}

/// The upstream's answer, read whole and marked for the layer; `declined`:
/// the call's round declined or cancelled the server's question.
async fn told_apart(res: Response, id: Option<Value>, declined: bool) -> Response {
    let marked = |mut res: Response, unknown: bool| {
        if unknown {
            res.extensions_mut().insert(OutcomeUnknown);
        } else {
            res.extensions_mut().insert(NotExecuted);
        }
        res
    };
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
    let bytes = match http_body_util::Limited::new(body, MOST).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            tracing::warn!(error = %e, "the MCP server's answer to a tool call broke off");
            let res = ApiError::UpstreamUnavailable(
                "the MCP server's answer broke off; whether the tool ran is unknown".into(),
            )
            .into_response();
            return marked(res, true);
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
        Some(response) => {
            let code = response.pointer("/error/code").and_then(Value::as_i64);
            let res = whole(parts, bytes);
            match code {
                Some(code) if NOT_RUN.contains(&code) => marked(res, false),
                Some(code) => {
                    tracing::warn!(
                        code,
                        "the MCP server answered a tool call with a JSON-RPC error, not its \
                         result; whether the tool ran is unknown"
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
                // The user said no, and the tool did not act.
                None if declined && rounds::is_tool_error(response) => marked(res, false),
                None => res,
            }
        }
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
