//! `idemgate proxy --protocol mcp` (docs/mcp.md): in front of an MCP server's
//! streamable-HTTP endpoint, its write tools run once per key, with no change
//! to the server.
//!
//! * Everything passes through as it is (the event stream, `DELETE`,
//!   `initialize`, notifications, resources, prompts, the session and
//!   protocol headers) but two messages: `tools/list` answers, whose guarded
//!   tools gain an optional `idempotency_key` argument in their input schema
//!   (`tools.rs`), and `tools/call` requests of guarded tools.
//! * A guarded call's key is the first found of the places
//!   `IDEMGATE_MCP_KEY_FROM` names (`places.rs`): by default its
//!   `params._meta["dev.idemgate/idempotency-key"]`, `_meta`'s
//!   `idempotency-key` and `idempotency_key`, or the key header (set by a
//!   runtime, which mints keys from the attempt's identity), then its
//!   `idempotency_key` or `idempotencyKey` argument (set by a model). The
//!   key arguments are removed before the call is forwarded, unless the
//!   tool declares them. The call
//!   then goes through the same layer as the HTTP door, with the key in the
//!   header and a fingerprint over the tool's name and arguments (the
//!   JSON-RPC `id` and `_meta` are ignored). A call without a key passes
//!   through unguarded, as the HTTP door passes a request without one. A
//!   model's key lives in a scope of its own (`ModelKey`: the layer stores
//!   it under another hash), so it never meets a runtime's.
//! * Every envelope is guarded (`envelope.rs`): a guarded call sent as a
//!   notification is answered `202` and dropped, a batch that holds one is
//!   refused whole, and a body the door and a server could read
//!   differently is refused; none of them is forwarded.
//! * The layer's answer goes back as MCP clients take it: a first call's
//!   answer as the server gave it; a replay as the stored response with the
//!   repeat's own `id`, in the form the first answer had where the repeat
//!   accepts it (`application/json` or one server-sent event); a refusal as
//!   a tool result with `isError` and the problem in `structuredContent`
//!   (`key-reused`, `request-in-flight`, `outcome-unknown`, `key-invalid`);
//!   a store or upstream that is away as a JSON-RPC error. Every result the
//!   door writes is valid under the protocol version the request names
//!   (`protocol.rs`).
//! * What a server sends on a guarded call's event stream before the call's
//!   response (under 2025-11-25 its questions mid-call, elicitation,
//!   sampling, roots, and its progress and logging notifications) reaches
//!   the client as it comes (`asking`), and the client's answers, requests
//!   of their own, are forwarded; only the response is the key's outcome
//!   (`upstream.rs`).
//! * A `notifications/cancelled` for a guarded call the server is running
//!   is answered `202` and not forwarded: the call runs to its end and its
//!   result is stored, as when an HTTP client hangs up. A session's `DELETE`
//!   while a guarded call of it runs is answered `200` here and sent to the
//!   server once those calls have ended (a server ends a session's calls
//!   with it). An answer that is not the call's result (a JSON-RPC error, a
//!   broken stream) is never stored (`upstream.rs`).

pub mod envelope;
pub(in crate::server::proxy) mod messages;
pub mod places;
mod protocol;
mod rounds;
mod tools;
mod upstream;

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Map, Value, json};
use tower::{Layer, ServiceExt};

use self::envelope::Envelope;
use self::messages::Form;
use self::places::{KeyFrom, KeyPlace};
use self::protocol::Protocol;
use self::tools::Catalogue;
use self::upstream::{CallId, McpUpstream, Passed, Running};
use crate::key::ModelKey;
use crate::layer::{HeldFor, Idempotency, IdempotencyLayer};
use crate::problem::{ApiError, OwnProblem};
use crate::server::proxy::ProxyClient;

/// Where a refusal's `_meta` carries its problem.
pub const PROBLEM_META: &str = "dev.idemgate/problem";

/// The JSON-RPC error code of a call idemgate could not take to the tool.
const UNAVAILABLE: i64 = -32000;

/// The door's state.
struct McpDoorState {
    client: ProxyClient,
    guarded: Idempotency<McpUpstream>,
    running: Arc<Running>,
    catalogue: Catalogue,
    key_from: KeyFrom,
    key_header: HeaderName,
    require_key: bool,
    max_body_bytes: usize,
}

/// Where the door finds a call's key, and what it does without one.
#[derive(Debug, Clone)]
pub struct Keys {
    /// The places, in order (`IDEMGATE_MCP_KEY_FROM`).
    pub from: KeyFrom,
    /// The key header (`IDEMGATE_KEY_HEADER`).
    pub header: HeaderName,
    /// Refuse a guarded call without a key (`IDEMGATE_REQUIRE_KEY`).
    pub require: bool,
}

/// The router of the MCP door: `client` to the upstream, guarded calls
/// through `layer`; `advertise_key` adds the key argument (the first of
/// `keys`' argument places) to guarded tools' schemas in `tools/list`
/// answers.
pub fn router(
    client: ProxyClient,
    layer: &IdempotencyLayer,
    guarded_tools: Option<Vec<String>>,
    advertise_key: bool,
    keys: Keys,
    max_body_bytes: usize,
) -> Router {
    let running = Arc::new(Running::default());
    let door = McpDoorState {
        guarded: layer.layer(McpUpstream {
            client: client.clone(),
            running: running.clone(),
        }),
        client,
        running,
        catalogue: Catalogue::new(
            guarded_tools,
            advertise_key,
            keys.from.arguments().map(str::to_owned).collect(),
        ),
        key_from: keys.from,
        key_header: keys.header,
        require_key: keys.require,
        max_body_bytes,
    };
    Router::new().fallback(handle).with_state(Arc::new(door))
}

/// The JSON-Pointers a guarded call's fingerprint leaves out: the JSON-RPC
/// id (new on every call), `_meta` (progress tokens, the key), and what a
/// later round of a call that asked for input adds to it (`rounds.rs`): every
/// round of one call is the same call.
pub const FINGERPRINT_IGNORE: [&str; 4] = [
    "/id",
    "/params/_meta",
    "/params/inputResponses",
    "/params/requestState",
];

/// What a task-augmented call (2025-11-25 Tasks) leaves out of its
/// fingerprint: how long the server is asked to keep the task. Whether the
/// call asks for a task at all stays in (`"task": {}`): a task and a tool
/// result are two different answers.
pub const TASK_TTL: &str = "/params/task/ttl";

/// Every JSON-Pointer a guarded call's fingerprint leaves out, with keys
/// read `from` those places: [`FINGERPRINT_IGNORE`], [`TASK_TTL`], and the
/// `param:` places (forwarded, as servers that take them read them there).
pub fn fingerprint_ignore(from: &KeyFrom) -> Vec<String> {
    FINGERPRINT_IGNORE
        .iter()
        .map(|p| (*p).to_owned())
        .chain([TASK_TTL.to_owned()])
        .chain(from.unfingerprinted())
        .collect()
}

/// How long a session's `DELETE` waits for its guarded calls before it is
/// sent to the server all the same.
const SESSION_END_BOUND: std::time::Duration = std::time::Duration::from_secs(300);

async fn handle(State(door): State<Arc<McpDoorState>>, req: Request<Body>) -> Response {
    let req = if req.method() != Method::POST && !http_body::Body::is_end_stream(req.body()) {
        // A server may read a body whatever the method: a guarded call
        // comes with POST, or not at all.
        let (parts, body) = req.into_parts();
        let bytes = match door.read(body).await {
            Ok(bytes) => bytes,
            Err(res) => return res,
        };
        let content_type = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok());
        // A body that is not JSON (an upload) is the server's to read.
        let holds_a_call =
            match envelope::classify(&bytes, content_type, &|name| door.catalogue.guarded(name)) {
                Envelope::Forward(_) => false,
                Envelope::Refuse(refusal) => refusal.code != envelope::PARSE_ERROR,
                Envelope::Guard { .. } | Envelope::Drop { .. } => true,
            };
        if holds_a_call {
            let mut res = refused_envelope(&envelope::Refusal {
                why: "a tool call is sent with POST",
                code: envelope::INVALID_REQUEST,
                ids: Vec::new(),
                batch: false,
                dropped: 0,
            });
            *res.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
            res.headers_mut().insert(
                http::header::ALLOW,
                HeaderValue::from_static("GET, POST, DELETE"),
            );
            return res;
        }
        Request::from_parts(parts, Body::from(bytes))
    } else {
        req
    };
    if req.method() == Method::DELETE
        && let Some(session) = req
            .headers()
            .get(MCP_SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
        && door.running.session_busy(&session)
    {
        // A server ends a session's running calls with it (the Python SDK
        // cancels their handlers), and a client closes its session as soon
        // as it gives up on a call: the DELETE is answered here, and sent
        // once the session's guarded calls have ended, so that each runs
        // to its end and its result is kept for the retry.
        tracing::info!(
            "a client ended its MCP session while a guarded call of it runs; the session ends \
             at the server when its guarded calls have"
        );
        let door = door.clone();
        tokio::spawn(async move {
            door.running
                .session_ended(&session, SESSION_END_BOUND)
                .await;
            let _ = door.forward(req).await;
        });
        return StatusCode::OK.into_response();
    }
    if req.method() != Method::POST {
        return door.forward(req).await;
    }
    let (parts, body) = req.into_parts();
    let bytes = match door.read(body).await {
        Ok(bytes) => bytes,
        Err(res) => return res,
    };
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let message = match envelope::classify(&bytes, content_type, &|name| {
        door.catalogue.guarded(name)
    }) {
        Envelope::Forward(message) => message,
        Envelope::Guard { message, id } => return door.call(parts, bytes, message, id).await,
        Envelope::Drop { dropped } => {
            dropped_notifications(dropped);
            return StatusCode::ACCEPTED.into_response();
        }
        Envelope::Refuse(refusal) => {
            dropped_notifications(refusal.dropped);
            tracing::info!(
                why = refusal.why,
                "an MCP request body that may hold a guarded tool call was refused, not forwarded"
            );
            return refused_envelope(&refusal);
        }
    };
    let method = message
        .as_ref()
        .and_then(|m| m.get("method"))
        .and_then(Value::as_str);
    match (method, message.as_ref().and_then(|m| m.get("id"))) {
        (Some("notifications/cancelled"), None)
            if message
                .as_ref()
                .and_then(|m| m.pointer("/params/requestId"))
                .is_some_and(|id| door.running.is_running(&parts.headers, id)) =>
        {
            // The call runs to its end and its result is stored: a
            // cancelled tool may already have acted.
            tracing::info!(
                "a client cancelled a guarded tool call the server is running; the call runs to \
                 its end, and its result is kept for the retry"
            );
            StatusCode::ACCEPTED.into_response()
        }
        (None, Some(_)) => {
            // A client's answer to a question a guarded call asked it.
            if let Some(message) = &message {
                door.running.answered(&parts.headers, message);
            }
            door.forward(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        (Some("tools/list"), Some(id)) => {
            let id = id.clone();
            door.list(Request::from_parts(parts, Body::from(bytes)), id)
                .await
        }
        _ => {
            door.forward(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
    }
}

/// Counts guarded tool calls sent as notifications, never forwarded.
fn dropped_notifications(n: usize) {
    if n > 0 {
        tracing::info!(
            dropped = n,
            "a guarded tool call sent as a JSON-RPC notification (no id) was dropped, not \
             forwarded: a call without an id can be neither answered nor told from its repeat"
        );
        crate::telemetry::record_mcp_notifications_dropped(n as u64);
    }
}

/// A body the door does not forward, answered as JSON-RPC: an error for
/// each of its requests (an array for a batch), or one error without an id
/// (`400`, as MCP servers answer a message they cannot read).
fn refused_envelope(refusal: &envelope::Refusal) -> Response {
    let error = |id: &Value| {
        messages::error(
            id,
            refusal.code,
            &format!("idemgate: {}", refusal.why),
            None,
        )
    };
    if refusal.ids.is_empty() {
        let mut res = messages::answer(Form::Json, &error(&Value::Null), HeaderMap::new());
        *res.status_mut() = StatusCode::BAD_REQUEST;
        return res;
    }
    let message = if refusal.batch {
        Value::Array(refusal.ids.iter().map(error).collect())
    } else {
        error(&refusal.ids[0])
    };
    messages::answer(Form::Json, &message, HeaderMap::new())
}

impl McpDoorState {
    /// A request's whole body, within the body limit; else the answer.
    async fn read(&self, body: Body) -> Result<Bytes, Response> {
        match http_body_util::Limited::new(body, self.max_body_bytes)
            .collect()
            .await
        {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(e) => {
                let e = if e.is::<http_body_util::LengthLimitError>() {
                    ApiError::PayloadTooLarge(format!(
                        "the request body is over {} bytes",
                        self.max_body_bytes
                    ))
                } else {
                    ApiError::InvalidRequest(format!("the request body could not be read: {e}"))
                };
                Err(e.into_response())
            }
        }
    }

    async fn forward(&self, req: Request<Body>) -> Response {
        match self.client.clone().oneshot(req).await {
            Ok(res) => res,
            Err(never) => match never {},
        }
    }

    /// A `tools/list`: forwarded, and its answer told which tools take a key.
    async fn list(&self, req: Request<Body>, id: Value) -> Response {
        let res = self.forward(req).await;
        let Some(form) = Form::of(res.headers()).filter(|_| res.status().is_success()) else {
            return res;
        };
        let (parts, body) = res.into_parts();
        let bytes = match body.collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) => {
                return ApiError::UpstreamUnavailable(format!(
                    "the MCP server's tools/list answer broke off: {e}"
                ))
                .into_response();
            }
        };
        let messages = messages::read(form, &bytes).await;
        let Some(mut response) = messages::response_to(&messages, &id).cloned() else {
            return Response::from_parts(parts, Body::from(bytes));
        };
        if let Some(result) = response.get_mut("result") {
            self.catalogue.list(result);
        }
        messages::answer(form, &response, parts.headers)
    }

    /// A `tools/call`: a guarded tool's with a key through the layer,
    /// anything else forwarded as it came.
    async fn call(
        &self,
        mut parts: http::request::Parts,
        bytes: Bytes,
        mut message: Value,
        id: Value,
    ) -> Response {
        let asker = Asker::of(&parts.headers, &message, id.clone());
        let Some(name) = message.pointer("/params/name").and_then(Value::as_str) else {
            return self
                .forward(Request::from_parts(parts, Body::from(bytes)))
                .await;
        };
        let name = name.to_owned();
        if !self.catalogue.guarded(&name) {
            return self
                .forward(Request::from_parts(parts, Body::from(bytes)))
                .await;
        }
        let tool = self.catalogue.tool(&name);
        let asker = asker.with_typed_output(tool.typed_output);
        let reads_header = self.key_from.reads_header();
        let in_header = reads_header && parts.headers.contains_key(&self.key_header);
        let declares = |argument: &str| tool.declares(argument);
        let key = match take_key(&mut message, &self.key_from, &declares, in_header) {
            Ok(key) => key,
            Err(why) => return asker.refused(&ApiError::KeyInvalid(why)),
        };
        match key {
            Some((key, set_by)) => match sf_string(&key) {
                Some(value) => {
                    parts.headers.insert(self.key_header.clone(), value);
                    if set_by == SetBy::Model {
                        // The model's keys never meet the runtime's: a
                        // model cannot pre-empt, replay or refuse them.
                        parts.extensions.insert(ModelKey);
                    }
                }
                None => {
                    let e = ApiError::KeyInvalid(
                        "the idempotency key must be printable ASCII (1 to 255 characters)".into(),
                    );
                    return asker.refused(&e);
                }
            },
            None if in_header => {}
            None if self.require_key => {
                if !reads_header {
                    // Not a place this door reads: the layer must not
                    // read it either.
                    parts.headers.remove(&self.key_header);
                }
            }
            None if rounds::names_a_call(&message) => {
                // Unguarded, it would act outside the call its key holds.
                let e = ApiError::InvalidRequest(
                    "this round continues a call that was made with an idempotency key: send it \
                     with the same key as the call's first round"
                        .into(),
                );
                return asker.refused(&e);
            }
            None => {
                return self
                    .forward(Request::from_parts(parts, Body::from(bytes)))
                    .await;
            }
        }
        // A later round of a call that asked for input continues it.
        if let Err(why) = rounds::continuing(&mut message, &mut parts.extensions) {
            return asker.refused(&ApiError::InvalidRequest(why));
        }
        let body = serde_json::to_vec(&message).unwrap_or_else(|_| bytes.to_vec());
        parts.headers.remove(http::header::CONTENT_LENGTH);
        parts.extensions.insert(CallId(id.clone()));
        // What the server asks mid-call reaches the client as it comes (`asking`).
        let (interim, asked) = upstream::interim();
        parts.extensions.insert(interim);
        let call = self
            .guarded
            .clone()
            .oneshot(Request::from_parts(parts, Body::from(body)));
        asking(call, asked, asker).await
    }
}

/// A guarded call's answer to its client: the layer's answer as
/// [`answered`] makes it (a replay, a refusal, a JSON answer: the server
/// asked nothing); or, once the server has sent a message on the call's
/// event stream before its response (a question mid-call under 2025-11-25:
/// elicitation, sampling, roots; a progress or logging notification), an
/// event stream that passes each such message as it comes and ends with
/// that answer. The client's answers to the questions come as requests of
/// their own, forwarded. The layer runs the call in its own task: a client
/// that hangs up stops only this stream.
async fn asking(
    call: impl Future<Output = Result<Response, std::convert::Infallible>> + Send + 'static,
    mut asked: tokio::sync::mpsc::Receiver<Passed>,
    asker: Asker,
) -> Response {
    let mut call = Box::pin(call);
    let mut first = None;
    while first.is_none() {
        tokio::select! {
            // What the server sent before its response comes first.
            biased;
            passed = asked.recv() => match passed {
                Some(Passed::Head(head)) => first = Some(head),
                Some(Passed::Event(_)) => {}
                None => return answered(into_ok(call.await), &asker).await,
            },
            res = &mut call => return answered(into_ok(res), &asker).await,
        }
    }
    let mut headers = first.unwrap_or_default();
    headers.remove(http::header::CONTENT_LENGTH);
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    let (events, body) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let mut open = true;
        let res = loop {
            tokio::select! {
                biased;
                passed = asked.recv(), if open => match passed {
                    Some(Passed::Event(event)) => {
                        if events.send(event).await.is_err() {
                            // The client hung up; the call runs on.
                            return;
                        }
                    }
                    Some(Passed::Head(_)) => {}
                    None => open = false,
                },
                res = &mut call => break into_ok(res),
            }
        };
        while let Ok(passed) = asked.try_recv() {
            if let Passed::Event(event) = passed
                && events.send(event).await.is_err()
            {
                return;
            }
        }
        let last = as_event(answered(res, &asker).await, &asker).await;
        let _ = events.send(last).await;
    });
    let body = futures::stream::unfold(body, |mut body| async move {
        body.recv()
            .await
            .map(|event| (Ok::<_, std::convert::Infallible>(event), body))
    });
    let mut res = Response::new(Body::from_stream(body));
    *res.headers_mut() = headers;
    res
}

fn into_ok(res: Result<Response, std::convert::Infallible>) -> Response {
    match res {
        Ok(res) => res,
        Err(never) => match never {},
    }
}

/// An answer as the last event of a stream: its own events if it is an
/// event stream, else its JSON-RPC message as one event (a JSON-RPC error
/// where it holds none).
async fn as_event(res: Response, asker: &Asker) -> Bytes {
    let (parts, body) = res.into_parts();
    let bytes = body
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .unwrap_or_default();
    match Form::of(&parts.headers) {
        Some(Form::EventStream) => return bytes,
        Some(Form::Json) => {
            if let Ok(message) = serde_json::from_slice::<Value>(&bytes) {
                return messages::event(&message.to_string());
            }
        }
        None => {}
    }
    let message = messages::error(
        &asker.id,
        UNAVAILABLE,
        &format!(
            "idemgate: the answer to this call (HTTP {}) could not be passed on",
            parts.status
        ),
        None,
    );
    messages::event(&message.to_string())
}

/// Who set a call's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SetBy {
    /// A runtime place (`_meta`, the key header, a `param:`).
    Runtime,
    /// An `argument:` place: a model, whose keys live in a scope of their
    /// own (`ModelKey`).
    Model,
}

/// The call's key, first found of the places `from` names (`in_header`:
/// the key header is there; if it is found first, `None`: the layer reads
/// it). A `null` is no key. Every argument that is a key place is taken out
/// of the call either way, unless the tool declares it (`declares`), so the
/// server never sees a key the runtime's overrode.
fn take_key(
    message: &mut Value,
    from: &KeyFrom,
    declares: &dyn Fn(&str) -> bool,
    in_header: bool,
) -> Result<Option<(String, SetBy)>, String> {
    let mut arguments: Vec<(&str, Value)> = Vec::new();
    if let Some(given) = message
        .pointer_mut("/params/arguments")
        .and_then(Value::as_object_mut)
    {
        for name in from.arguments() {
            let value = if declares(name) {
                given.get(name).cloned()
            } else {
                given.remove(name)
            };
            if let Some(value) = value {
                arguments.push((name, value));
            }
        }
    }
    let params = message.get("params");
    for place in from.places() {
        let found = match place {
            KeyPlace::Meta(name) => params
                .and_then(|p| p.get("_meta"))
                .and_then(|m| m.get(name))
                .cloned(),
            KeyPlace::Header if in_header => return Ok(None),
            KeyPlace::Header => None,
            KeyPlace::Param(name) => params.and_then(|p| p.get(name)).cloned(),
            KeyPlace::Argument(name) => arguments
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone()),
        };
        let set_by = if place.is_models() {
            SetBy::Model
        } else {
            SetBy::Runtime
        };
        match found {
            None | Some(Value::Null) => {}
            Some(Value::String(key)) => return Ok(Some((key, set_by))),
            Some(_) => return Err(format!("{} must be a string", place.described())),
        }
    }
    Ok(None)
}

/// `key` as the header's sf-string, if it can be one.
fn sf_string(key: &str) -> Option<HeaderValue> {
    if key.is_empty() || !key.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return None;
    }
    let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
    HeaderValue::from_str(&quoted).ok()
}

/// Who asked for a guarded call, as far as its answer depends on it: the
/// call's JSON-RPC `id`, the forms its `Accept` takes, its protocol version,
/// and whether its tool's output schema would refuse a problem.
struct Asker {
    id: Value,
    headers: HeaderMap,
    protocol: Protocol,
    typed_output: bool,
    /// A task-augmented call (`params.task`), whose client reads a task,
    /// never a tool result.
    tasked: bool,
}

impl Asker {
    fn of(headers: &HeaderMap, message: &Value, id: Value) -> Asker {
        let mut accept = HeaderMap::new();
        for value in headers.get_all(http::header::ACCEPT) {
            accept.append(http::header::ACCEPT, value.clone());
        }
        Asker {
            id,
            headers: accept,
            protocol: Protocol::of(headers, message),
            typed_output: false,
            tasked: message
                .pointer("/params/task")
                .is_some_and(Value::is_object),
        }
    }

    fn with_typed_output(mut self, typed_output: bool) -> Asker {
        self.typed_output = typed_output;
        self
    }

    /// The form to answer in, `preferred` where the asker takes it.
    fn form(&self, preferred: Form) -> Form {
        Form::for_request(&self.headers, preferred)
    }

    /// A JSON-RPC result of this call: `result` made complete under its
    /// protocol.
    fn result(&self, mut result: Value) -> Value {
        self.protocol.complete(&mut result);
        messages::result(&self.id, result)
    }

    /// A refusal of the door's own.
    fn refused(&self, e: &ApiError) -> Response {
        let problem = serde_json::to_value(e.problem(crate::problem::DEFAULT_PROBLEM_BASE))
            .unwrap_or_default();
        self.problem_answer(e.status(), problem)
    }

    /// An idemgate problem as an MCP answer: a refusal the model can read (a
    /// tool result with `isError`), or, for what is no refusal of the call
    /// (a store or upstream away, a fault), a JSON-RPC error.
    ///
    /// The refusal's problem goes in `structuredContent`, and in
    /// `_meta["dev.idemgate/problem"]`; for a tool whose `outputSchema` a
    /// problem would not satisfy (`typed_output`), only in `_meta` under a
    /// protocol before 2026-07-28: the TypeScript SDK of those versions
    /// checks an error result's `structuredContent` against that schema
    /// too, and would turn the refusal into a protocol error the model never
    /// sees. A task-augmented call's refusal is a JSON-RPC error with the
    /// same text and the problem as its `data`: its client reads the answer
    /// as a `CreateTaskResult`, and a tool result would be a protocol error
    /// there too (the TypeScript SDK's `-32603` listing what the schema
    /// missed).
    fn problem_answer(&self, status: StatusCode, problem: Value) -> Response {
        let title = problem["title"].as_str().unwrap_or("Refused").to_owned();
        let detail = problem["detail"].as_str().unwrap_or_default().to_owned();
        let slug = problem["type"]
            .as_str()
            .and_then(|t| t.rsplit('/').next())
            .unwrap_or_default()
            .to_owned();
        let message = if status.is_client_error() && status != StatusCode::PAYLOAD_TOO_LARGE {
            let mut text = format!("idemgate refused this call ({slug}): {detail}");
            if !text.ends_with('.') {
                text.push('.');
            }
            if let Some(secs) = problem["retry_after_seconds"].as_u64() {
                text.push_str(&format!(
                    " Repeat the call with the same idempotency key in {secs} s."
                ));
            }
            if self.tasked {
                let message = messages::error(&self.id, UNAVAILABLE, &text, Some(problem));
                return messages::answer(self.form(Form::Json), &message, HeaderMap::new());
            }
            let structured: Map<String, Value> = problem.as_object().cloned().unwrap_or_default();
            let mut result = json!({
                "content": [{ "type": "text", "text": text }],
                "isError": true,
                "_meta": { PROBLEM_META: structured },
            });
            if !self.typed_output || self.protocol.structures_every_error() {
                result["structuredContent"] = Value::Object(structured);
            }
            self.result(result)
        } else {
            messages::error(
                &self.id,
                UNAVAILABLE,
                &format!("idemgate: {title}: {detail}"),
                Some(problem),
            )
        };
        messages::answer(self.form(Form::Json), &message, HeaderMap::new())
    }
}

/// The layer's answer to a guarded call, as its MCP client takes it.
async fn answered(res: Response, asker: &Asker) -> Response {
    let id = &asker.id;
    if let Some(OwnProblem(_)) = res.extensions().get::<OwnProblem>().copied() {
        let (parts, body) = res.into_parts();
        let problem = body
            .collect()
            .await
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b.to_bytes()).ok())
            .unwrap_or_else(|| json!({ "status": parts.status.as_u16() }));
        return asker.problem_answer(parts.status, problem);
    }
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let status = res.status();
    // The official clients read no HTTP error status as an answer (the
    // Python SDK turns one into -32603 "Server returned an error response",
    // the problem lost): whatever the MCP server answered with one, first
    // time or replayed, goes back as a JSON-RPC message. A first 404 stays
    // as it is: it is how a server says the session is gone (the call was
    // not run, and its key released).
    if (status.is_client_error() || status.is_server_error())
        && (replayed || status != StatusCode::NOT_FOUND)
    {
        return error_status(res, asker, replayed).await;
    }
    if let Some(&HeldFor(held)) = res.extensions().get::<HeldFor>() {
        // A question for the client: the round that answers it names the
        // call it continues.
        return rounds::naming_the_call(res, id, held).await;
    }
    if !replayed {
        return res;
    }
    if res
        .headers()
        .contains_key(crate::headers::IDEMPOTENCY_BODY_OMITTED)
    {
        // The tool ran; its result was over the body limit, so only its
        // status was kept.
        let message = messages::error(
            id,
            UNAVAILABLE,
            "idemgate: the tool already ran under this key, but its result was too large to \
             keep (IDEMGATE_MAX_BODY_BYTES), so it cannot be given again",
            None,
        );
        return messages::answer(asker.form(Form::Json), &message, HeaderMap::new());
    }
    let (parts, body) = res.into_parts();
    let Some(stored_form) = Form::of(&parts.headers) else {
        return Response::from_parts(parts, body);
    };
    let Ok(bytes) = body
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
    else {
        return ApiError::Internal("a stored answer could not be read".into()).into_response();
    };
    let messages = messages::read(stored_form, &bytes).await;
    let stored = messages
        .iter()
        .rev()
        .find(|m| m.get("result").is_some() || m.get("error").is_some());
    let message = match stored {
        Some(stored) => {
            let mut message = stored.clone();
            message["id"] = id.clone();
            // Stored under one protocol version, replayed under another.
            if let Some(result) = message.get_mut("result") {
                asker.protocol.complete(result);
            }
            message
        }
        // What an operator settled the key with (`idemgate keys resolve
        // --complete`) may be the tool's result alone.
        None => match messages.last() {
            Some(result @ Value::Object(_)) => asker.result(result.clone()),
            _ => return Response::from_parts(parts, Body::from(bytes)),
        },
    };
    let mut headers = parts.headers;
    headers.remove(http::header::ETAG);
    // The first caller's session is not the repeat's.
    headers.remove(MCP_SESSION_ID);
    messages::answer(asker.form(stored_form), &message, headers)
}

/// The session header, never handed from one session's answer to another.
const MCP_SESSION_ID: &str = "mcp-session-id";

/// An answer with an HTTP error status, as a JSON-RPC message at 200: the
/// server's own JSON-RPC message where the body holds one (with the call's
/// `id`), else a JSON-RPC error that names the status.
async fn error_status(res: Response, asker: &Asker, replayed: bool) -> Response {
    let id = &asker.id;
    let (parts, body) = res.into_parts();
    let status = parts.status;
    let bytes = body
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .unwrap_or_default();
    let form = Form::of(&parts.headers);
    let found = match form {
        Some(form) => messages::read(form, &bytes)
            .await
            .into_iter()
            .rev()
            .find(|m| m.get("result").is_some() || m.get("error").is_some()),
        None => None,
    };
    let message = match found {
        Some(mut message) => {
            message["id"] = id.clone();
            if let Some(result) = message.get_mut("result") {
                asker.protocol.complete(result);
            }
            message
        }
        None => {
            let text = String::from_utf8_lossy(&bytes);
            let mut excerpt: String = text.chars().take(1_000).collect();
            if excerpt.len() < text.len() {
                excerpt.push('…');
            }
            let when = if replayed {
                "the tool's first call under this key was answered with it, and that answer is \
                 what every repeat gets"
            } else {
                "the tool may have run"
            };
            messages::error(
                id,
                UNAVAILABLE,
                &format!("idemgate: the MCP server answered HTTP {status} to this call ({when})"),
                Some(json!({
                    "upstream_status": status.as_u16(),
                    "replayed": replayed,
                    "body": excerpt,
                })),
            )
        }
    };
    let mut headers = HeaderMap::new();
    if replayed {
        headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    messages::answer(asker.form(form.unwrap_or(Form::Json)), &message, headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `take_key` with the default places, the tool declaring nothing
    /// (`strip`) or `idempotency_key`.
    fn take(
        message: &mut Value,
        strip: bool,
        in_header: bool,
    ) -> Result<Option<(String, SetBy)>, String> {
        let declares = |name: &str| !strip && name == "idempotency_key";
        take_key(message, &KeyFrom::default(), &declares, in_header)
    }

    fn key_from(list: &str) -> KeyFrom {
        KeyFrom::new(
            list.split(',')
                .map(|p| KeyPlace::parse(p).unwrap())
                .collect(),
        )
        .unwrap()
    }

    #[test]
    fn the_runtimes_key_comes_first_and_the_argument_is_removed_all_the_same() {
        let mut call = json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": { "name": "charge", "arguments": { "amount": 5, "idempotency_key": "k1" } } });
        assert_eq!(
            take(&mut call, true, false),
            Ok(Some(("k1".into(), SetBy::Model)))
        );
        assert_eq!(call["params"]["arguments"], json!({ "amount": 5 }));
        let mut own = json!({ "params": { "arguments": { "idempotency_key": "k2" } } });
        assert_eq!(
            take(&mut own, false, false),
            Ok(Some(("k2".into(), SetBy::Model)))
        );
        assert_eq!(own["params"]["arguments"]["idempotency_key"], "k2");
        let mut meta = json!({ "params": { "arguments": {},
            "_meta": { "dev.idemgate/idempotency-key": "k3" } } });
        assert_eq!(
            take(&mut meta, true, false),
            Ok(Some(("k3".into(), SetBy::Runtime)))
        );
        let mut bad = json!({ "params": { "arguments": { "idempotency_key": 7 } } });
        assert_eq!(
            take(&mut bad, true, false),
            Err("the idempotency_key argument must be a string".into())
        );
        assert_eq!(take(&mut json!({ "params": {} }), true, false), Ok(None));

        // The runtime's key beats the model's, which the server never sees.
        let mut both = json!({ "params": {
            "arguments": { "amount": 5, "idempotency_key": "invented" },
            "_meta": { "dev.idemgate/idempotency-key": "runtime" } } });
        assert_eq!(
            take(&mut both, true, false),
            Ok(Some(("runtime".into(), SetBy::Runtime)))
        );
        assert_eq!(both["params"]["arguments"], json!({ "amount": 5 }));
        let mut header = json!({ "params": {
            "arguments": { "amount": 5, "idempotency_key": 7 } } });
        assert_eq!(take(&mut header, true, true), Ok(None));
        assert_eq!(header["params"]["arguments"], json!({ "amount": 5 }));
    }

    #[test]
    fn the_default_places_are_read_in_their_order() {
        // The commerce protocols' _meta keys, UCP's and ACP's.
        for name in ["idempotency-key", "idempotency_key"] {
            let mut call = json!({ "params": { "arguments": { "amount": 5 },
                "_meta": { name: "k" } } });
            assert_eq!(
                take(&mut call, true, false),
                Ok(Some(("k".into(), SetBy::Runtime))),
                "{name}"
            );
        }
        // A camelCase argument: a model's, removed.
        let mut camel =
            json!({ "params": { "arguments": { "amount": 5, "idempotencyKey": "c" } } });
        assert_eq!(
            take(&mut camel, true, false),
            Ok(Some(("c".into(), SetBy::Model)))
        );
        assert_eq!(camel["params"]["arguments"], json!({ "amount": 5 }));
        // Both arguments: the first place's wins, and neither is forwarded.
        let mut two = json!({ "params": { "arguments": {
            "idempotencyKey": "second", "idempotency_key": "first" } } });
        assert_eq!(
            take(&mut two, true, false),
            Ok(Some(("first".into(), SetBy::Model)))
        );
        assert_eq!(two["params"]["arguments"], json!({}));
        // idemgate's own _meta key before the commerce protocols'.
        let mut metas = json!({ "params": { "_meta": {
            "idempotency_key": "acp", "dev.idemgate/idempotency-key": "own" } } });
        assert_eq!(
            take(&mut metas, true, false),
            Ok(Some(("own".into(), SetBy::Runtime)))
        );
        // The header comes after the _meta places, before the arguments.
        let mut header = json!({ "params": { "_meta": { "idempotency-key": "m" },
            "arguments": { "idempotencyKey": "a" } } });
        assert_eq!(
            take(&mut header, true, true),
            Ok(Some(("m".into(), SetBy::Runtime)))
        );
        assert_eq!(header["params"]["arguments"], json!({}));
        // First found wins: a bad value later on is never looked at; a bad
        // value found first is key-invalid.
        let mut later = json!({ "params": { "_meta": { "idempotency-key": "m" },
            "arguments": { "idempotencyKey": 7 } } });
        assert_eq!(
            take(&mut later, true, false),
            Ok(Some(("m".into(), SetBy::Runtime)))
        );
        let mut first = json!({ "params": { "_meta": { "idempotency-key": ["m"] },
            "arguments": { "idempotencyKey": "a" } } });
        assert_eq!(
            take(&mut first, true, false),
            Err("_meta[\"idempotency-key\"] must be a string".into())
        );
        // null is no key: the next place is read.
        let mut null = json!({ "params": { "_meta": { "idempotency-key": null },
            "arguments": { "idempotency_key": null, "idempotencyKey": "a" } } });
        assert_eq!(
            take(&mut null, true, false),
            Ok(Some(("a".into(), SetBy::Model)))
        );
        // Not a default place: ignored, and left where it is.
        let mut other = json!({ "params": { "idempotencyKey": "p",
            "_meta": { "Idempotency-Key": "m" }, "arguments": { "key": "a" } } });
        assert_eq!(take(&mut other, true, false), Ok(None));
        assert_eq!(other["params"]["arguments"], json!({ "key": "a" }));
    }

    #[test]
    fn a_list_of_its_own_is_read_as_it_says() {
        let from = key_from("param:idempotencyKey,meta:k,argument:key");
        let none = |_: &str| false;
        let mut param = json!({ "params": { "idempotencyKey": "p", "_meta": { "k": "m" },
            "arguments": { "key": "a", "idempotency_key": "x" } } });
        assert_eq!(
            take_key(&mut param, &from, &none, false),
            Ok(Some(("p".into(), SetBy::Runtime)))
        );
        // The param stays (forwarded); the key argument goes; an argument
        // that is no place of this list stays.
        assert_eq!(param["params"]["idempotencyKey"], "p");
        assert_eq!(
            param["params"]["arguments"],
            json!({ "idempotency_key": "x" })
        );
        // Without the header among the places, a key in it is not read.
        let mut header = json!({ "params": { "arguments": { "key": "a" } } });
        assert_eq!(
            take_key(&mut header, &from, &none, false),
            Ok(Some(("a".into(), SetBy::Model)))
        );
        // Without an argument among the places, every argument stays.
        let runtime_only = key_from("header,meta:k");
        let mut call = json!({ "params": { "arguments": { "idempotency_key": "a" } } });
        assert_eq!(take_key(&mut call, &runtime_only, &none, false), Ok(None));
        assert_eq!(call["params"]["arguments"]["idempotency_key"], "a");
        assert_eq!(take_key(&mut call, &runtime_only, &none, true), Ok(None));
    }

    #[test]
    fn the_fingerprint_leaves_out_the_task_ttl_and_param_places() {
        assert_eq!(
            fingerprint_ignore(&KeyFrom::default()),
            [
                "/id",
                "/params/_meta",
                "/params/inputResponses",
                "/params/requestState",
                "/params/task/ttl"
            ]
        );
        assert_eq!(
            fingerprint_ignore(&key_from("param:idempotencyKey"))[5..],
            ["/params/idempotencyKey"]
        );
    }

    #[test]
    fn a_key_becomes_an_sf_string() {
        assert_eq!(sf_string("a\"b\\c").unwrap(), "\"a\\\"b\\\\c\"");
        assert!(sf_string("").is_none());
        assert!(sf_string("é").is_none());
    }
}
