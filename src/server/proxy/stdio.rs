//! `idemgate proxy --protocol mcp --stdio -- COMMAND [ARGS…]` (docs/mcp.md,
//! "stdio servers"): the MCP door for a server that speaks stdio, as an MCP
//! host (a desktop agent, an IDE) starts it, with idemgate as the host's
//! command in place of the server's.
//!
//! The door is the HTTP door itself ([`super::mcp::router`]), in this
//! process, with no listener:
//!
//! * **idemgate's side.** Each line on idemgate's stdin (one JSON-RPC
//!   message: the MCP stdio transport) is POSTed into the door as its own
//!   request, all of them at once (a slow call blocks no other), with the
//!   protocol version the client negotiated (`initialize`'s result, or the
//!   message's own `_meta`). Each answer's JSON-RPC messages, whether JSON
//!   or an event stream, are written to stdout as lines; a request the door
//!   answers with no JSON-RPC response (an HTTP error of its own) gets a
//!   JSON-RPC error, so that no request is left unanswered.
//! * **The server's side** (`Bridge`): the door's upstream is the child,
//!   as a streamable-HTTP server that answers every POST as
//!   `application/json`. A POSTed request is written to the child's stdin
//!   and answered with the child's response of the same id; a POSTed
//!   notification or response (the client's answer to the server's
//!   question) is written and answered `202`. What the child writes that
//!   answers no pending request (its questions mid-call: elicitation,
//!   sampling, roots; its notifications: progress, logging) goes straight
//!   to idemgate's stdout, so that a question reaches the client while the
//!   call waits for its answer.
//! * **The child ends.** Every request it had been sent and not answered
//!   is answered with a JSON-RPC error: its outcome is unknown, so a
//!   guarded call's key is held `unknown`, never run again. idemgate then
//!   exits, non-zero, naming the child's exit.
//! * **idemgate's stdin ends** (or SIGTERM, ctrl-c): the calls in flight
//!   run to their end (within `--shutdown-grace`), so that their results
//!   are kept for the retry; then the child's stdin is closed, the child is
//!   given a few seconds to exit (then killed), and idemgate exits 0.
//!
//! Nothing but MCP is written to stdout: the logs go to stderr, as the
//! child's own stderr does.

use std::collections::HashMap;
use std::convert::Infallible;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use futures::future::BoxFuture;
use http::{HeaderValue, Method, Request, StatusCode, header};
use http_body_util::BodyExt as _;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{ChildStdin, ChildStdout};
use tokio::sync::{mpsc, oneshot};
use tower::{Service, ServiceExt as _};

use super::mcp::messages::Form;
use super::{Proxy, ProxyClient, routes};
use crate::layer::{NotExecuted, OutcomeUnknown};
use crate::problem::ApiError;
use crate::server::config::ProxyArgs;
use crate::server::open;
use crate::telemetry;

/// How long the child has to exit once its stdin is closed, before it is
/// killed.
const CHILD_EXIT_BOUND: Duration = Duration::from_secs(5);

/// The JSON-RPC error code of a request idemgate could not take to the
/// server, or whose answer it could not give.
const UNAVAILABLE: i64 = -32000;

/// Where a 2026-07-28 request's `_meta` names its protocol version.
const VERSION_META: &str = "/params/_meta/io.modelcontextprotocol~1protocolVersion";

/// The SQLite URL of the stdio door's default store: a file of this
/// command's own in the user's data directory (`$XDG_DATA_HOME/idemgate/`,
/// else `~/.local/share/idemgate/`; the platform's own on macOS and
/// Windows), created if missing, named after the command and a hash of it
/// with its arguments, so that two servers never share a file (one process
/// per SQLite file) and a server's keys are never another's.
///
/// # Errors
/// No home directory to find the data directory from, or the directory
/// cannot be created.
pub fn default_database_url(command: &[OsString]) -> anyhow::Result<String> {
    use etcetera::BaseStrategy as _;
    let base = etcetera::base_strategy::choose_native_strategy().context(
        "cannot find the user's data directory for the stdio door's keys; set DATABASE_URL",
    )?;
    let dir = base.data_dir().join("idemgate");
    std::fs::create_dir_all(&dir).with_context(|| {
        format!(
            "cannot create {} for the stdio door's keys; set DATABASE_URL",
            dir.display()
        )
    })?;
    let path = dir.join(database_file_name(command));
    let Some(path) = path.to_str() else {
        anyhow::bail!(
            "the data directory {} is not UTF-8; set DATABASE_URL",
            dir.display()
        );
    };
    // sqlx percent-decodes the file name.
    let path = path
        .replace('%', "%25")
        .replace('?', "%3F")
        .replace('#', "%23");
    Ok(format!("sqlite://{path}"))
}

/// `stdio-SLUG-HASH.db`: the program's name and its first argument that is
/// not an option (the script or the package: never the rest of the command
/// line, which may hold a token), shortened, and the start of the whole
/// command line's SHA-256.
fn database_file_name(command: &[OsString]) -> String {
    use sha2::Digest as _;
    let mut hash = sha2::Sha256::new();
    for arg in command {
        hash.update(arg.as_encoded_bytes());
        hash.update([0]);
    }
    let hash = hex::encode(&hash.finalize()[..6]);
    let named = command.iter().take(1).chain(
        command
            .iter()
            .skip(1)
            .find(|arg| !arg.to_string_lossy().starts_with('-')),
    );
    let mut slug = String::new();
    for arg in named {
        let arg = arg.to_string_lossy();
        // A path (the program's, a script's, a package's scope) by its
        // last part.
        let arg = arg.rsplit(['/', '\\']).next().unwrap_or_default();
        for c in arg.chars() {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                slug.push(c.to_ascii_lowercase());
            } else if !slug.ends_with('-') {
                slug.push('-');
            }
        }
        if !slug.ends_with('-') {
            slug.push('-');
        }
    }
    let slug: String = slug.trim_matches(['-', '.']).chars().take(48).collect();
    let slug = slug.trim_end_matches(['-', '.']);
    if slug.is_empty() {
        format!("stdio-{hash}.db")
    } else {
        format!("stdio-{slug}-{hash}.db")
    }
}

/// Runs the stdio door until idemgate's stdin ends, a signal, or the
/// child's exit (an error naming it). `config` is the `--config` file.
pub async fn run(args: ProxyArgs, config: Option<PathBuf>) -> anyhow::Result<()> {
    args.validate()?;
    let routes = match &config {
        Some(path) => routes::from_file(path, args.policy.max_ttl())?,
        None => Vec::new(),
    };
    open::check_database_url(&args.store)?;
    let (store, opened) = open::open_for_serving(&args.store, !args.run.no_migrate).await?;
    let program = args.command[0].to_string_lossy().into_owned();
    let mut child = tokio::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start the MCP server's command {program:?}"))?;
    let (Some(child_in), Some(child_out)) = (child.stdin.take(), child.stdout.take()) else {
        anyhow::bail!("the MCP server's command {program:?} was started without its pipes");
    };
    let (out, writing) = Output::start();
    let bridge = Arc::new(Bridge::new(child_in));
    let reading = tokio::spawn(bridge.clone().read(child_out, out.clone()));
    let client = ProxyClient::local(
        tower::util::BoxCloneSyncService::new(BridgeService(bridge.clone())),
        "stdio-server",
    );
    let proxy = Proxy::build_over(&args, routes, store.clone(), client)?;
    let pruner = open::spawn_pruner(&args.run, store);
    let naming = open::watch_naming(&proxy.engine).await?;
    telemetry::record_pruned(0);
    tracing::info!(
        command = program.as_str(),
        pid = child.id().unwrap_or_default(),
        database = opened.database.as_str(),
        migrations = opened.migrations.to_string().as_str(),
        "idemgate's MCP stdio door is running: MCP on stdin and stdout, the server as a child"
    );

    let door = Door {
        app: proxy.app.clone(),
        out: out.clone(),
        version: Arc::new(Mutex::new(None)),
    };
    let mut calls = tokio::task::JoinSet::new();
    let mut lines = stdin_lines();
    let signal = crate::server::serve::shutdown_signal();
    tokio::pin!(signal);
    let ended = loop {
        tokio::select! {
            line = lines.recv() => match line {
                Some(line) => {
                    if !line.trim().is_empty() {
                        calls.spawn(door.clone().send(line));
                    }
                }
                None => break Ended::Input,
            },
            status = child.wait() => break Ended::Child(status),
            () = &mut signal => break Ended::Signal,
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
        }
    };
    let grace = args.run.grace();
    let outcome = match ended {
        Ended::Child(status) => {
            bridge.gone();
            let status = describe_exit(status);
            tracing::warn!(
                status = status.as_str(),
                "the MCP server exited; the calls it had not answered are answered with an error, \
                 and their keys held unknown"
            );
            finish(&mut calls, grace).await;
            Err(anyhow::anyhow!(
                "the MCP server's command {program:?} {status}; idemgate's stdio door stops with it"
            ))
        }
        Ended::Input | Ended::Signal => {
            let pending = calls.len();
            if pending > 0 {
                tracing::info!(
                    pending,
                    within_seconds = grace.as_secs(),
                    why = if matches!(ended, Ended::Input) {
                        "stdin ended"
                    } else {
                        "signal"
                    },
                    "idemgate's stdio door is stopping: waiting for the calls in flight, whose \
                     results are kept for their retries"
                );
            }
            finish(&mut calls, grace).await;
            bridge.close().await;
            match tokio::time::timeout(CHILD_EXIT_BOUND, child.wait()).await {
                Ok(status) => {
                    tracing::info!(
                        status = describe_exit(status).as_str(),
                        "the MCP server exited"
                    );
                }
                Err(_) => {
                    tracing::warn!(
                        within_seconds = CHILD_EXIT_BOUND.as_secs(),
                        "the MCP server did not exit once its stdin was closed; killing it"
                    );
                    let _ = child.kill().await;
                }
            }
            bridge.gone();
            Ok(())
        }
    };
    naming.abort();
    if let Some(p) = pruner {
        p.abort();
    }
    let lost = proxy.layer.finish_deferred(grace).await;
    if lost > 0 {
        tracing::warn!(
            lost,
            "the grace ended first: these calls or commits were cut off, and their keys stay in \
             flight until their leases end"
        );
    }
    reading.abort();
    drop((door, out, proxy));
    let _ = writing.await;
    tracing::info!("idemgate's MCP stdio door stopped");
    outcome
}

/// idemgate's stdin, line by line, read on a thread of its own: a read
/// that waits for its client never holds up the process's exit (tokio's
/// own stdin reads on its blocking pool, which the runtime waits for).
fn stdin_lines() -> mpsc::UnboundedReceiver<String> {
    let (tx, rx) = mpsc::unbounded_channel();
    let spawned = std::thread::Builder::new()
        .name("idemgate-stdin".into())
        .spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::stdin().lock().lines() {
                match line {
                    Ok(line) => {
                        if tx.send(line).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "idemgate's stdin could not be read; stopping");
                        return;
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the thread that reads idemgate's stdin");
    }
    rx
}

/// Why the door's loop ended.
enum Ended {
    /// idemgate's stdin reached its end.
    Input,
    /// SIGTERM or ctrl-c.
    Signal,
    /// The child exited.
    Child(std::io::Result<ExitStatus>),
}

/// The child's exit, in words.
fn describe_exit(status: std::io::Result<ExitStatus>) -> String {
    match status {
        Ok(status) => {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt as _;
                if let Some(signal) = status.signal() {
                    return format!("was ended by signal {signal}");
                }
            }
            match status.code() {
                Some(code) => format!("exited with status {code}"),
                None => "exited".to_owned(),
            }
        }
        Err(e) => format!("could not be waited for ({e})"),
    }
}

/// Waits for the door's calls, at most `within`; those still running then
/// are cut off.
async fn finish(calls: &mut tokio::task::JoinSet<()>, within: Duration) {
    let all = async { while calls.join_next().await.is_some() {} };
    if tokio::time::timeout(within, all).await.is_err() {
        tracing::warn!(
            cut = calls.len(),
            "calls still running at the end of the grace were cut off"
        );
        calls.abort_all();
    }
}

/// idemgate's stdout: one writer, one JSON-RPC message a line.
#[derive(Clone)]
struct Output(mpsc::UnboundedSender<String>);

impl Output {
    /// The writer's handle and its task, which ends when every handle has
    /// been dropped and the last line is written.
    fn start() -> (Output, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        let task = tokio::spawn(async move {
            let mut stdout = tokio::io::stdout();
            let mut broken = false;
            while let Some(mut line) = rx.recv().await {
                if broken {
                    continue;
                }
                line.push('\n');
                let written = async {
                    stdout.write_all(line.as_bytes()).await?;
                    stdout.flush().await
                };
                if let Err(e) = written.await {
                    tracing::warn!(error = %e, "idemgate's stdout cannot be written: its client is gone");
                    broken = true;
                }
            }
        });
        (Output(tx), task)
    }

    /// Writes `message` as one line.
    fn send(&self, message: &Value) {
        let _ = self.0.send(message.to_string());
    }
}

/// The door in this process, and what it sends each message with.
#[derive(Clone)]
struct Door {
    app: Router,
    out: Output,
    /// The protocol version `initialize` negotiated.
    version: Arc<Mutex<Option<String>>>,
}

impl Door {
    /// Sends one line from idemgate's stdin through the door, and writes
    /// what the door answers.
    async fn send(self, line: String) {
        let message: Value = match serde_json::from_str(&line) {
            Ok(message) => message,
            Err(e) => {
                tracing::warn!(error = %e, "a line on idemgate's stdin is not JSON; answered with a parse error");
                self.out.send(&json!({ "jsonrpc": "2.0", "id": null,
                    "error": { "code": -32700, "message": format!("idemgate: parse error: {e}") } }));
                return;
            }
        };
        let requests = request_ids(&message);
        let initialize = match &message {
            Value::Object(m) if m.get("method").and_then(Value::as_str) == Some("initialize") => {
                m.get("id").cloned()
            }
            _ => None,
        };
        let version = message
            .pointer(VERSION_META)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| {
                self.version
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone()
            });
        let mut req = Request::builder()
            .method(Method::POST)
            .uri("/mcp")
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json, text/event-stream");
        if let Some(version) = version.and_then(|v| HeaderValue::from_str(&v).ok()) {
            req = req.header("mcp-protocol-version", version);
        }
        let Ok(req) = req.body(Body::from(line)) else {
            return;
        };
        let res = match self.app.clone().oneshot(req).await {
            Ok(res) => res,
            Err(never) => match never {},
        };
        let mut answered: Vec<Value> = Vec::new();
        let status = res.status();
        let form = Form::of(res.headers());
        let mut text = String::new();
        match form {
            Some(Form::EventStream) => {
                use eventsource_stream::Eventsource as _;
                let mut events = res.into_body().into_data_stream().eventsource();
                while let Some(event) = events.next().await {
                    let Ok(event) = event else { break };
                    if let Ok(message) = serde_json::from_str::<Value>(&event.data) {
                        self.written(&message, &mut answered, initialize.as_ref());
                    }
                }
            }
            _ => {
                let bytes = res
                    .into_body()
                    .collect()
                    .await
                    .map(http_body_util::Collected::to_bytes)
                    .unwrap_or_default();
                match serde_json::from_slice::<Value>(&bytes) {
                    Ok(Value::Array(batch)) if batch.iter().all(is_jsonrpc) => {
                        for message in &batch {
                            remember(&mut answered, message);
                        }
                        self.out.send(&Value::Array(batch));
                    }
                    Ok(message) if is_jsonrpc(&message) => {
                        self.written(&message, &mut answered, initialize.as_ref());
                    }
                    Ok(problem) => {
                        text = problem
                            .get("detail")
                            .or_else(|| problem.get("title"))
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                            .unwrap_or_default();
                    }
                    Err(_) => text = String::from_utf8_lossy(&bytes).chars().take(500).collect(),
                }
            }
        }
        // No request is left without an answer.
        for id in requests {
            if !answered.contains(&id) {
                let message = if text.is_empty() {
                    format!("idemgate: the door answered HTTP {status} without a JSON-RPC response")
                } else {
                    format!("idemgate: {text}")
                };
                self.out.send(&json!({ "jsonrpc": "2.0", "id": id,
                    "error": { "code": UNAVAILABLE, "message": message } }));
            }
        }
    }

    /// Writes `message` to stdout; notes the response it is, and the
    /// protocol version an answer to `initialize` negotiated.
    fn written(&self, message: &Value, answered: &mut Vec<Value>, initialize: Option<&Value>) {
        if let Some(id) = initialize
            && message.get("id") == Some(id)
            && let Some(version) = message
                .pointer("/result/protocolVersion")
                .and_then(Value::as_str)
        {
            *self.version.lock().unwrap_or_else(|e| e.into_inner()) = Some(version.to_owned());
        }
        remember(answered, message);
        self.out.send(message);
    }
}

/// Notes the id `message` answers, if it is a response.
fn remember(answered: &mut Vec<Value>, message: &Value) {
    if is_response(message)
        && let Some(id) = message.get("id")
    {
        answered.push(id.clone());
    }
}

/// Whether `message` is a JSON-RPC message (not a problem document).
fn is_jsonrpc(message: &Value) -> bool {
    message.get("jsonrpc").is_some()
}

/// Whether `message` is a response (a result or an error to a request).
fn is_response(message: &Value) -> bool {
    message.get("method").is_none()
        && (message.get("result").is_some() || message.get("error").is_some())
}

/// The ids of the requests (not notifications, not responses) in
/// `message`, one or a batch.
fn request_ids(message: &Value) -> Vec<Value> {
    let one = |m: &Value| match (m.get("method"), m.get("id")) {
        (Some(_), Some(id)) if !id.is_null() => Some(id.clone()),
        _ => None,
    };
    match message {
        Value::Array(batch) => batch.iter().filter_map(one).collect(),
        message => one(message).into_iter().collect(),
    }
}

/// The child, as a streamable-HTTP MCP server that answers every POST
/// with `application/json`.
struct Bridge {
    /// The child's stdin, `None` once closed.
    stdin: tokio::sync::Mutex<Option<ChildStdin>>,
    pending: Mutex<Pending>,
}

/// The requests written to the child and not yet answered.
#[derive(Default)]
struct Pending {
    /// By JSON-RPC id (its JSON text): where the response goes.
    waiting: HashMap<String, oneshot::Sender<Value>>,
    /// The child's stdout has ended (or the child has exited): nothing
    /// more will be answered.
    gone: bool,
}

/// What became of a request written to the child.
enum Answer {
    /// Its response.
    Response(Value),
    /// The child went away first.
    Gone,
}

impl Bridge {
    fn new(stdin: ChildStdin) -> Bridge {
        Bridge {
            stdin: tokio::sync::Mutex::new(Some(stdin)),
            pending: Mutex::new(Pending::default()),
        }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the child's stdout to its end: each response to its waiting
    /// request, everything else to idemgate's stdout.
    async fn read(self: Arc<Bridge>, stdout: ChildStdout, out: Output) {
        let mut lines = BufReader::new(stdout).lines();
        loop {
            let line = match lines.next_line().await {
                Ok(Some(line)) => line,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "the MCP server's stdout could not be read");
                    break;
                }
            };
            if line.trim().is_empty() {
                continue;
            }
            let message = match serde_json::from_str::<Value>(&line) {
                Ok(message) => message,
                Err(_) => {
                    // Never passed on: idemgate's stdout carries MCP only.
                    tracing::warn!(
                        bytes = line.len(),
                        "the MCP server wrote a line that is not JSON to its stdout; dropped"
                    );
                    continue;
                }
            };
            match message {
                Value::Array(batch) => {
                    for message in batch {
                        self.deliver(message, &out);
                    }
                }
                message => self.deliver(message, &out),
            }
        }
        self.gone();
    }

    /// A message from the child: to the request it answers, or to stdout.
    fn deliver(&self, message: Value, out: &Output) {
        if is_response(&message)
            && let Some(id) = message.get("id")
        {
            let waiting = self.pending().waiting.remove(&id.to_string());
            if let Some(waiting) = waiting {
                if let Err(message) = waiting.send(message) {
                    out.send(&message);
                }
                return;
            }
        }
        out.send(&message);
    }

    /// The child is gone: every waiting request learns so.
    fn gone(&self) {
        let mut pending = self.pending();
        pending.gone = true;
        pending.waiting.clear();
    }

    /// Closes the child's stdin: the MCP stdio transport's end.
    async fn close(&self) {
        if let Some(mut stdin) = self.stdin.lock().await.take() {
            let _ = stdin.shutdown().await;
        }
    }

    /// Writes `line` to the child; false if it could not be.
    async fn write(&self, line: &[u8]) -> bool {
        let mut stdin = self.stdin.lock().await;
        let Some(pipe) = stdin.as_mut() else {
            return false;
        };
        let written = async {
            pipe.write_all(line).await?;
            pipe.write_all(b"\n").await?;
            pipe.flush().await
        };
        match written.await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "the MCP server's stdin cannot be written: it has exited");
                false
            }
        }
    }

    /// One POST of the door: its message written to the child, and the
    /// answer.
    async fn post(self: Arc<Bridge>, req: Request<Body>) -> Response {
        let bytes = match req.into_body().collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) => {
                return not_executed(ApiError::InvalidRequest(format!(
                    "the request body could not be read: {e}"
                )));
            }
        };
        let Ok(message) = serde_json::from_slice::<Value>(&bytes) else {
            return not_executed(ApiError::InvalidRequest(
                "a message for the stdio server is not JSON".into(),
            ));
        };
        // One line on the child's stdin.
        let line = message.to_string();
        let ids = request_ids(&message);
        let mut answers = Vec::with_capacity(ids.len());
        {
            let mut pending = self.pending();
            if pending.gone {
                return not_executed(ApiError::UpstreamUnavailable(
                    "the MCP server has exited; the request was not sent".into(),
                ));
            }
            if let Some(id) = ids
                .iter()
                .find(|id| pending.waiting.contains_key(&id.to_string()))
            {
                let error = json!({ "jsonrpc": "2.0", "id": id, "error": { "code": -32600,
                    "message": "idemgate: a request with this id is still running" } });
                let mut res = json_answer(&error);
                res.extensions_mut().insert(NotExecuted);
                return res;
            }
            for id in &ids {
                let (tx, rx) = oneshot::channel();
                pending.waiting.insert(id.to_string(), tx);
                answers.push(rx);
            }
        }
        if !self.write(line.as_bytes()).await {
            let mut pending = self.pending();
            for id in &ids {
                pending.waiting.remove(&id.to_string());
            }
            return not_executed(ApiError::UpstreamUnavailable(
                "the MCP server has exited; the request was not sent".into(),
            ));
        }
        if ids.is_empty() {
            return StatusCode::ACCEPTED.into_response();
        }
        let mut responses = Vec::with_capacity(answers.len());
        for rx in answers {
            match rx.await.map_or(Answer::Gone, Answer::Response) {
                Answer::Response(response) => responses.push(response),
                Answer::Gone => {
                    let mut res = ApiError::UpstreamUnavailable(
                        "the MCP server exited before it answered; whether it acted is unknown"
                            .into(),
                    )
                    .into_response();
                    res.extensions_mut().insert(OutcomeUnknown);
                    return res;
                }
            }
        }
        let answer = match (&message, responses.len()) {
            (Value::Array(_), _) => Value::Array(responses),
            (_, _) => responses.pop().unwrap_or_default(),
        };
        json_answer(&answer)
    }
}

/// `message` as a `200` `application/json`.
fn json_answer(message: &Value) -> Response {
    let mut res = Response::new(Body::from(message.to_string()));
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

/// `e`'s answer, marked: the request never reached the server.
fn not_executed(e: ApiError) -> Response {
    let mut res = e.into_response();
    res.extensions_mut().insert(NotExecuted);
    res
}

/// [`Bridge`] as the door's upstream service.
#[derive(Clone)]
struct BridgeService(Arc<Bridge>);

impl Service<Request<Body>> for BridgeService {
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let bridge = self.0.clone();
        Box::pin(async move {
            if req.method() != Method::POST {
                // No event stream, no session to end: a stdio server has
                // one client and speaks only when written to.
                return Ok(StatusCode::METHOD_NOT_ALLOWED.into_response());
            }
            Ok(bridge.post(req).await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_names_its_own_file() {
        let cmd = |args: &[&str]| -> Vec<OsString> { args.iter().map(OsString::from).collect() };
        let a = database_file_name(&cmd(&["npx", "-y", "@example/payments-mcp"]));
        assert!(a.starts_with("stdio-npx-payments-mcp-"), "{a}");
        assert!(a.ends_with(".db"));
        let b = database_file_name(&cmd(&["/usr/bin/python3", "server.py", "--stdio"]));
        assert!(b.starts_with("stdio-python3-server.py-"), "{b}");
        // Nothing past the script or package: an option's value may be a token.
        let c = database_file_name(&cmd(&["npx", "-y", "pay-mcp", "--api-key", "sk_live_1"]));
        assert!(c.starts_with("stdio-npx-pay-mcp-"), "{c}");
        assert!(!c.contains("sk_live"), "{c}");
        assert_ne!(
            database_file_name(&cmd(&["npx", "a"])),
            database_file_name(&cmd(&["npx", "b"]))
        );
        assert_ne!(
            database_file_name(&cmd(&["a b"])),
            database_file_name(&cmd(&["a", "b"]))
        );
    }

    #[test]
    fn requests_are_told_from_notifications_and_responses() {
        assert_eq!(
            request_ids(&json!({ "jsonrpc": "2.0", "id": 3, "method": "tools/call" })),
            vec![json!(3)]
        );
        assert!(
            request_ids(&json!({ "jsonrpc": "2.0", "method": "notifications/initialized" }))
                .is_empty()
        );
        assert!(request_ids(&json!({ "jsonrpc": "2.0", "id": 4, "result": {} })).is_empty());
        assert_eq!(
            request_ids(&json!([{ "id": "a", "method": "ping" }, { "method": "x" }])),
            vec![json!("a")]
        );
    }
}
