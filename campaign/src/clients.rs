//! The clients: many tasks, each taking keys from a shared queue and
//! driving each to an end by the retry table of idemgate's README — the
//! same key and body on every retry, through a proxy picked at random each
//! time. A key is often handed to two to four clients at once, as duplicates
//! arrive in real traffic (a user double-clicks, a gateway retries).
//!
//! | answer | what a client does |
//! |---|---|
//! | timeout, connection error, 502, 504 | retry after a short backoff |
//! | 408, 425, 429, 503 | retry after `Retry-After` |
//! | 409 `request-in-flight` | wait `Retry-After`, retry |
//! | 409 `outcome-unknown` | stop: dead-lettered |
//! | 422 | stop (never expected: one body per key) |
//! | anything else | done |
//!
//! Past its budget a client gives the key up. Every request is recorded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tokio::sync::{Mutex, mpsc};

use crate::history::{Event, KeyDone, Recorder, Request};

/// How the clients behave.
#[derive(Debug, Clone)]
pub struct Settings {
    pub clients: usize,
    pub keys: usize,
    /// The keys are handed out evenly over this long.
    pub duration: Duration,
    /// The most time a client spends on one key.
    pub budget: Duration,
    pub request_timeout: Duration,
    pub seed: u64,
}

/// The raw key of key number `i`.
pub fn key_name(seed: u64, i: usize) -> String {
    format!("campaign-{seed}-{i:06}")
}

/// The key number in a raw key.
pub fn key_number(key: &str) -> Option<usize> {
    key.rsplit('-').next()?.parse().ok()
}

/// The one request body of key `i`: every retry sends it unchanged.
fn body_of(i: usize) -> String {
    format!(
        r#"{{"order":{i},"amount":{},"currency":"eur"}}"#,
        100 + (i * 37) % 900
    )
}

/// Hands out the keys over `duration` and runs the clients until every key
/// is done; returns when the last client has finished.
pub async fn run(settings: Settings, proxies: Vec<String>, recorder: Arc<Recorder>) {
    let (tx, rx) = mpsc::unbounded_channel::<usize>();
    let rx = Arc::new(Mutex::new(rx));
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .build()
        .expect("an HTTP client");
    let proxies = Arc::new(proxies);
    let mut tasks = Vec::new();
    for c in 0..settings.clients {
        let (rx, http, proxies, rec, s) = (
            rx.clone(),
            http.clone(),
            proxies.clone(),
            recorder.clone(),
            settings.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(s.seed.wrapping_add(1000 + c as u64));
            let client = format!("c{c}");
            loop {
                let next = rx.lock().await.recv().await;
                let Some(i) = next else { break };
                drive(&client, i, &s, &http, &proxies, &rec, &mut rng).await;
            }
        }));
    }
    schedule(&settings, tx).await;
    for task in tasks {
        let _ = task.await;
    }
}

/// Sends each key to 1–4 clients: the first at its turn, the others within
/// a second and a half of it.
async fn schedule(s: &Settings, tx: mpsc::UnboundedSender<usize>) {
    let mut rng = StdRng::seed_from_u64(s.seed.wrapping_add(7));
    let started = tokio::time::Instant::now();
    let step = s.duration / u32::try_from(s.keys.max(1)).unwrap_or(u32::MAX);
    let mut later = Vec::new();
    for i in 0..s.keys {
        tokio::time::sleep_until(started + step * u32::try_from(i).unwrap_or(u32::MAX)).await;
        let _ = tx.send(i);
        let copies = match rng.random_range(0..100) {
            0..50 => 0,
            50..75 => 1,
            75..90 => 2,
            _ => 3,
        };
        for _ in 0..copies {
            let (tx, delay) = (tx.clone(), rng.random_range(0..1500));
            later.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                let _ = tx.send(i);
            }));
        }
    }
    for task in later {
        let _ = task.await;
    }
}

/// What to do after an answer.
enum Next {
    Retry(Duration),
    End(&'static str),
}

/// Drives key `i` to its end.
async fn drive(
    client: &str,
    i: usize,
    s: &Settings,
    http: &reqwest::Client,
    proxies: &[String],
    rec: &Recorder,
    rng: &mut StdRng,
) {
    let key = key_name(s.seed, i);
    let deadline = Instant::now() + s.budget;
    let mut backoff = Duration::from_millis(100);
    let mut try_no = 0;
    loop {
        try_no += 1;
        let proxy = rng.random_range(0..proxies.len());
        // Some clients ask for the immediate 409 rather than being held.
        let no_wait = rng.random_bool(0.2);
        let attempt = Attempt {
            key: &key,
            number: i,
            client,
            proxy,
            try_no,
            no_wait,
        };
        let r = send(http, proxies, &attempt, s.request_timeout, rec).await;
        let next = classify(&r, backoff);
        rec.record(&Event::Request(r));
        let wait = match next {
            Next::End(outcome) => return done(rec, &key, client, outcome, try_no),
            Next::Retry(wait) => wait,
        };
        let jitter = Duration::from_millis(rng.random_range(0..100));
        if Instant::now() + wait + jitter > deadline {
            return done(rec, &key, client, "gave_up", try_no);
        }
        tokio::time::sleep(wait + jitter).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

fn done(rec: &Recorder, key: &str, client: &str, outcome: &str, tries: u32) {
    rec.record(&Event::KeyDone(KeyDone {
        key: key.to_owned(),
        client: client.to_owned(),
        outcome: outcome.to_owned(),
        tries,
        at: rec.now(),
    }));
}

/// The retry table.
fn classify(r: &Request, backoff: Duration) -> Next {
    let told = r.retry_after.map_or(backoff, |s| {
        Duration::from_secs(s).min(Duration::from_secs(5))
    });
    let Some(status) = r.status else {
        return Next::Retry(backoff);
    };
    match (status, r.problem.as_deref()) {
        (409, Some("outcome-unknown")) => Next::End("dead_lettered"),
        (409, _) => Next::Retry(told),
        (422, _) => Next::End("key_reused"),
        (502 | 504, _) => Next::Retry(backoff),
        (408 | 425 | 429 | 503, _) => Next::Retry(told),
        _ => Next::End("done"),
    }
}

/// One try of a client's.
pub struct Attempt<'a> {
    pub key: &'a str,
    /// The key's number: its path and body.
    pub number: usize,
    pub client: &'a str,
    /// The proxy it goes through.
    pub proxy: usize,
    pub try_no: u32,
    /// Ask for the immediate `409` (`Prefer: wait=0`) rather than be held.
    pub no_wait: bool,
}

/// Sends `a` once; what came back.
pub async fn send(
    http: &reqwest::Client,
    proxies: &[String],
    a: &Attempt<'_>,
    timeout: Duration,
    rec: &Recorder,
) -> Request {
    let mut req = http
        .post(format!("{}/charge/{}", proxies[a.proxy], a.number))
        .header("idempotency-key", a.key)
        .header("content-type", "application/json")
        .header(crate::origin::VIA, a.proxy.to_string())
        .timeout(timeout)
        .body(body_of(a.number));
    if a.no_wait {
        req = req.header("prefer", "wait=0");
    }
    let mut r = Request {
        key: a.key.to_owned(),
        client: a.client.to_owned(),
        proxy: a.proxy,
        try_no: a.try_no,
        start: rec.now(),
        ..Request::default()
    };
    match answer(req).await {
        Ok((status, replayed, problem, retry_after, body)) => {
            r.status = Some(status);
            r.replayed = replayed;
            r.retry_after = retry_after;
            if problem.is_some() {
                r.problem = problem;
            } else {
                r.body = Some(body);
            }
        }
        Err(e) => r.error = Some(e),
    }
    r.end = rec.now();
    r
}

type Answer = (u16, bool, Option<String>, Option<u64>, String);

async fn answer(req: reqwest::RequestBuilder) -> Result<Answer, String> {
    let res = req.send().await.map_err(describe)?;
    let header = |name: &str| {
        res.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let status = res.status().as_u16();
    let replayed = header("idempotent-replayed").is_some_and(|v| v == "true");
    let retry_after = header("retry-after").and_then(|v| v.trim().parse().ok());
    let is_problem = header("content-type").is_some_and(|t| t.contains("problem+json"));
    let body = res.text().await.map_err(describe)?;
    let problem = is_problem.then(|| {
        serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .map_or_else(
                || "unparsed-problem".to_owned(),
                |t| t.rsplit('/').next().unwrap_or(&t).to_owned(),
            )
    });
    Ok((status, replayed, problem, retry_after, body))
}

/// `timeout`, `connect: …`, or `broken: …` (the answer broke off).
fn describe(e: reqwest::Error) -> String {
    use std::error::Error as _;
    let mut why = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        why = format!("{why}: {s}");
        source = s.source();
    }
    if e.is_timeout() {
        "timeout".into()
    } else if e.is_connect() {
        format!("connect: {why}")
    } else {
        format!("broken: {why}")
    }
}
