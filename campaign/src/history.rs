//! The history of a run: every request a client sent and what it got, every
//! execution at the origin, every fault, as JSON lines in `history.jsonl`.
//!
//! The checker reads nothing else of the run (besides the final key
//! listings), so each event carries all it needs: raw keys, bodies as the
//! client or origin saw them, and times in milliseconds since the run began.

use std::fs::File;
use std::io::{BufRead as _, BufReader, BufWriter, Write as _};
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

/// One line of the history.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// The first line: how the run was set up.
    Run(RunInfo),
    /// A request a client sent and its answer (or the error instead).
    Request(Request),
    /// A request that reached the origin.
    Execution(Execution),
    /// A fault the nemesis injected, once it has ended.
    Fault(Fault),
    /// What a client made of a key in the end.
    KeyDone(KeyDone),
    /// An operator settled an unknown key.
    Resolve(Resolve),
    /// A step of the run's end (`faults_stopped`, `healed`, `clients_done`,
    /// `listed`, `operator_done`).
    Phase { name: String, at: u64 },
}

/// How the run was set up.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RunInfo {
    pub store: String,
    /// What the proxies were started with: `hold` or `takeover`.
    pub on_lease_expiry: String,
    pub seed: u64,
    pub proxies: usize,
    /// Keys in the pool (some may never be sent if the run is short).
    pub keys: usize,
    pub clients: usize,
    pub duration_secs: u64,
    pub upstream_timeout_secs: u64,
    pub lease_secs: u64,
    /// The fault kinds the nemesis was asked for.
    pub faults: Vec<String>,
    /// Fault kinds asked for but not injected, with the reason.
    pub skipped: Vec<String>,
    /// The proxies' tenant as `keys list` shows it.
    pub tenant: String,
}

/// A request a client sent: what, through which proxy, and what came back.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Request {
    pub key: String,
    /// `c<N>` for the campaign's clients, `operator` after a resolve.
    pub client: String,
    /// The proxy it was sent to.
    pub proxy: usize,
    /// 1 for the client's first try with this key.
    pub try_no: u32,
    pub start: u64,
    pub end: u64,
    /// The answer's status; `None` when there was no answer (`error`).
    pub status: Option<u16>,
    /// Why there was no answer: `timeout`, `connect`, or the error.
    pub error: Option<String>,
    /// `Idempotent-Replayed: true` on the answer.
    pub replayed: bool,
    /// The last segment of a problem+json `type` (`outcome-unknown`, …).
    pub problem: Option<String>,
    pub retry_after: Option<u64>,
    /// The body of an answer that is not a problem.
    pub body: Option<String>,
}

/// A request that reached the origin, and what the origin made of it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Execution {
    /// The origin's own count, over the whole run.
    pub seq: u64,
    pub key: String,
    /// The `Idempotency-Attempt` header, if any.
    pub attempt: Option<u32>,
    /// The proxy it came through, as the client named it.
    pub proxy: Option<usize>,
    /// `normal`, `slow`, `hangup`, `stall` or `release`.
    pub mode: String,
    /// Whether the origin acted: false only for a `release` answer (503),
    /// which says it did not.
    pub acted: bool,
    pub status: u16,
    /// The body it answered (or would have: a `hangup` drops it).
    pub body: String,
    pub at: u64,
}

/// A fault, from its start to its end.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Fault {
    /// `kill`, `stop`, `pg-restart`, `partition`, or `origin-<mode>`.
    pub kind: String,
    /// `proxy-<i>`, `postgres`, or the key of an origin fault.
    pub target: String,
    pub start: u64,
    pub end: u64,
    pub note: Option<String>,
}

/// How a client finished with a key.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct KeyDone {
    pub key: String,
    pub client: String,
    /// `done`, `dead_lettered` (409 outcome-unknown), `gave_up` (out of
    /// time), or `key_reused` (422).
    pub outcome: String,
    pub tries: u32,
    pub at: u64,
}

/// An operator's resolve of an unknown key.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Resolve {
    pub key: String,
    /// `complete` or `release`.
    pub action: String,
    /// With `complete`: the response given.
    pub status: Option<u16>,
    pub body: Option<String>,
    pub ok: bool,
    pub output: String,
    pub at: u64,
}

/// Writes events as they happen, one line each, flushed at once so that a
/// run that dies still leaves what it saw.
pub struct Recorder {
    out: Mutex<BufWriter<File>>,
    started: Instant,
}

impl Recorder {
    pub fn create(path: &Path) -> anyhow::Result<Recorder> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Recorder {
            out: Mutex::new(BufWriter::new(file)),
            started: Instant::now(),
        })
    }

    /// Milliseconds since the run began: every event's clock.
    pub fn now(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub fn record(&self, event: &Event) {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        // A history that cannot be written is worthless: say so loudly.
        if let Err(e) = serde_json::to_writer(&mut *out, event)
            .map_err(std::io::Error::from)
            .and_then(|()| out.write_all(b"\n"))
            .and_then(|()| out.flush())
        {
            eprintln!("campaign: cannot write the history: {e}");
        }
    }

    pub fn phase(&self, name: &str) {
        self.record(&Event::Phase {
            name: name.to_owned(),
            at: self.now(),
        });
    }
}

/// Every event of a history file, in the order written.
pub fn read(path: &Path) -> anyhow::Result<Vec<Event>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut events = Vec::new();
    for (n, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let event = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not an event", path.display(), n + 1))?;
        events.push(event);
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_survive_their_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.jsonl");
        let events = vec![
            Event::Run(RunInfo {
                seed: 7,
                ..RunInfo::default()
            }),
            Event::Request(Request {
                key: "k".into(),
                status: Some(201),
                body: Some("{}".into()),
                ..Request::default()
            }),
            Event::Phase {
                name: "listed".into(),
                at: 3,
            },
        ];
        let recorder = Recorder::create(&path).unwrap();
        for event in &events {
            recorder.record(event);
        }
        assert_eq!(read(&path).unwrap(), events);
    }
}
