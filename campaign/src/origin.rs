//! The origin behind the proxies: `POST /charge/{n}` "charges" and records
//! every execution in the history, answering a body unique to that execution
//! (so two executions can never pass for one). While the nemesis is on, a
//! request may instead be slow (past the proxies' upstream timeout), stall
//! (past their abandon bound), hang up after acting (no answer at all), or be
//! refused with `503` (which says the origin did not act, so idemgate
//! releases the key).
//!
//! A plain hyper server rather than a framework: a hang-up is the service
//! returning an error, on which hyper closes the connection without writing
//! a response — exactly a crash after the effect.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::history::{Event, Execution, Fault, Recorder};

/// The header a client names its proxy in; the proxy forwards it, and it
/// is not part of a request's fingerprint (method, path, body).
pub const VIA: &str = "x-campaign-via";

/// How often each origin fault happens while faults are on.
#[derive(Debug, Clone)]
pub struct OriginFaults {
    pub slow: f64,
    pub stall: f64,
    pub hangup: f64,
    pub release: f64,
    /// How long a slow answer takes (more than the upstream timeout).
    pub slow_ms: (u64, u64),
    /// How long a stalled answer takes (more than the abandon bound).
    pub stall_ms: u64,
}

struct State {
    recorder: Arc<Recorder>,
    faults: OriginFaults,
    faults_on: AtomicBool,
    seq: AtomicU64,
    rng: Mutex<StdRng>,
    /// Executions by key, for the operator, who settles an unknown key with
    /// what the origin really did.
    executions: Mutex<HashMap<String, Vec<Execution>>>,
}

/// The running origin.
pub struct Origin {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

/// The service's error: hang up without an answer.
#[derive(Debug)]
struct HangUp;

impl std::fmt::Display for HangUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the origin hangs up after acting")
    }
}

impl std::error::Error for HangUp {}

impl Origin {
    /// Listens on `bind` (every address, so that proxies in their own
    /// network namespaces reach it over their links).
    pub async fn start(
        bind: SocketAddr,
        recorder: Arc<Recorder>,
        faults: Option<OriginFaults>,
        seed: u64,
    ) -> anyhow::Result<Origin> {
        let listener = TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            recorder,
            faults_on: AtomicBool::new(faults.is_some()),
            faults: faults.unwrap_or(OriginFaults {
                slow: 0.0,
                stall: 0.0,
                hangup: 0.0,
                release: 0.0,
                slow_ms: (0, 0),
                stall_ms: 0,
            }),
            seq: AtomicU64::new(0),
            rng: Mutex::new(StdRng::seed_from_u64(seed ^ 0x0219_1e00)),
            executions: Mutex::new(HashMap::new()),
        });
        let shared = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = shared.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| handle(state.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Origin { addr, state, task })
    }

    /// No more faults: every request from now on is answered promptly.
    pub fn calm(&self) {
        self.state.faults_on.store(false, Ordering::SeqCst);
    }

    /// What the origin did for `key` so far.
    pub fn executions(&self, key: &str) -> Vec<Execution> {
        let all = self
            .state
            .executions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        all.get(key).cloned().unwrap_or_default()
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One request: pick a mode, record the execution, answer as the mode says.
async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, HangUp> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim_matches('"').to_owned())
    };
    let Some(key) = header("idempotency-key") else {
        return Ok(answer(
            StatusCode::BAD_REQUEST,
            "{\"error\":\"no key\"}".into(),
        ));
    };
    let attempt = header("idempotency-attempt").and_then(|v| v.parse().ok());
    let proxy = header(VIA).and_then(|v| v.parse().ok());
    // Read the whole request, as an origin that acts on it would.
    let _ = req.into_body().collect().await;

    let (mode, delay, charge) = {
        let mut rng = state.rng.lock().unwrap_or_else(|e| e.into_inner());
        let f = &state.faults;
        let roll: f64 = if state.faults_on.load(Ordering::SeqCst) {
            rng.random()
        } else {
            1.0
        };
        let mode = pick(f, roll);
        let delay = match mode {
            "stall" => f.stall_ms,
            "slow" => rng.random_range(f.slow_ms.0..=f.slow_ms.1),
            _ => rng.random_range(5..40),
        };
        (mode, delay, rng.random::<u64>())
    };
    let seq = state.seq.fetch_add(1, Ordering::SeqCst) + 1;
    let acted = mode != "release";
    let (status, body) = if acted {
        let body = serde_json::json!({"key": key, "execution": seq, "charge": format!("ch_{charge:016x}")});
        (StatusCode::CREATED, body.to_string())
    } else {
        let body = serde_json::json!({"error": "busy, nothing charged", "execution": seq});
        (StatusCode::SERVICE_UNAVAILABLE, body.to_string())
    };
    let at = state.recorder.now();
    let execution = Execution {
        seq,
        key: key.clone(),
        attempt,
        proxy,
        mode: mode.into(),
        acted,
        status: status.as_u16(),
        body: body.clone(),
        at,
    };
    // Recorded when it acts, before any answer: an effect that happened is
    // in the history even if nobody ever hears of it.
    state.recorder.record(&Event::Execution(execution.clone()));
    state
        .executions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key.clone())
        .or_default()
        .push(execution);
    if mode != "normal" {
        state.recorder.record(&Event::Fault(Fault {
            kind: format!("origin-{mode}"),
            target: key,
            start: at,
            end: at + delay,
            note: Some(format!("execution #{seq}")),
        }));
    }
    tokio::time::sleep(Duration::from_millis(delay)).await;
    match mode {
        "hangup" => Err(HangUp),
        "release" => {
            let mut res = answer(status, body);
            res.headers_mut()
                .insert("retry-after", hyper::header::HeaderValue::from_static("1"));
            Ok(res)
        }
        _ => Ok(answer(status, body)),
    }
}

fn answer(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from(body)));
    *res.status_mut() = status;
    res.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    res
}

/// The mode a roll in [0, 1) falls on; 1.0 (faults off) is always `normal`.
fn pick(f: &OriginFaults, roll: f64) -> &'static str {
    let table = [
        ("release", f.release),
        ("hangup", f.hangup),
        ("stall", f.stall),
        ("slow", f.slow),
    ];
    let mut edge = 0.0;
    for (mode, p) in table {
        edge += p;
        if roll < edge {
            return mode;
        }
    }
    "normal"
}
