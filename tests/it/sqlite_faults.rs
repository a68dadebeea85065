//! The embedded SQLite store when its file cannot be written:
//! made read-only under a running server, met read-only at a restart, and a
//! full disk. Every write answers `503 store-unavailable` (problem+json,
//! `Retry-After`, `retry_after_seconds`), never a 500 and never a panic; the
//! process keeps serving; no commit answered 200 is lost; the file passes
//! `PRAGMA integrity_check`; and the server recovers, by itself within 5 s
//! of the fault's end where SQLite lets it (a file made read-only or a disk
//! filled under a running server), and after a restart in any case.
//!
//! The tests run the real binary, as root in CI, where permission bits do not
//! stop anything and a `chmod` does not reach the descriptors a running
//! server already holds. So the faults are made for real another way:
//!
//! * **read-only under a running server**: `chattr +i` on the database file,
//!   its `-wal` and their directory. The kernel then refuses writes even
//!   through descriptors opened for writing (`EPERM`), as a filesystem gone
//!   read-only does. Not on the `-shm` file: SQLite writes it through a
//!   shared mapping, and a write fault on an immutable mapping is `SIGBUS`,
//!   which says something about the test rig, not about idemgate. Needs
//!   `CAP_LINUX_IMMUTABLE` and a filesystem with the flag (ext4, xfs,
//!   btrfs); the test says so and stops where that is missing.
//! * **read-only at a restart**: the server runs as `nobody` (65534) when the
//!   test is root, and the file, its side files and the directory are made
//!   `0444`/`0555`. That runs anywhere. A running server does not notice (its
//!   descriptors were opened for writing); the next one to start does.
//! * **a full disk**: `RLIMIT_FSIZE` set on the running server with
//!   prlimit(1), `SIGXFSZ` ignored (an ignored signal stays ignored across
//!   `exec`), so that a write past the limit fails with `EFBIG` (or comes up
//!   short) instead of killing the process. SQLite reads that exactly as a
//!   full disk: the write fails, `SQLITE_FULL` or `SQLITE_IOERR_WRITE`. The
//!   WAL, which every commit appends to, hits the limit first.
//!
//! Rerun: `cargo test --test it sqlite_faults:: -- --nocapture` (figures on
//! stdout).

use crate::common::{self, until};

use std::collections::HashMap;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::str::FromStr as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::app::fresh_key;
use common::bin::{BIN, Served, drain_stderr, signal, wait_exit};
use sha2::{Digest as _, Sha256};
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions as _, Connection as _};

/// Self-recovery must come within this of the fault's end (docs/operations.md,
/// “Dashboards and alerts”).
const RECOVERY: Duration = Duration::from_secs(5);
/// `nobody`: an unprivileged user for the server when the test is root.
const NOBODY: u32 = 65534;

// === the server ===

/// `idemgate` on the SQLite file `url`, in `dir`, with no stray settings
/// from the caller's environment.
fn idemgate(dir: &Path, url: &str) -> Command {
    let mut cmd = Command::new(BIN);
    plain_env(&mut cmd, dir, url);
    cmd
}

fn plain_env(cmd: &mut Command, dir: &Path, url: &str) {
    cmd.current_dir(dir)
        .env("DATABASE_URL", url)
        .env_remove("IDEMGATE_TOKENS")
        .env_remove("IDEMGATE_LISTEN")
        .env_remove("IDEMGATE_CONFIG")
        .env_remove("IDEMGATE_SEAL_KEY")
        .env_remove("IDEMGATE_REPLAY_CACHE_BYTES")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null());
}

/// A running `idemgate serve` and its stderr, read as it comes.
struct Server {
    served: Served,
    log: Arc<Mutex<String>>,
    http: Http,
}

impl Server {
    /// Starts `cmd serve`, replay cache off so that every replay reads the
    /// database, and waits for `/readyz`.
    async fn start(cmd: Command) -> Server {
        let mut served = Served::spawn(cmd, &["--replay-cache-bytes", "0"]).await;
        let log = drain_stderr(&mut served.child);
        let http = Http::new(served.base());
        Server { served, log, http }
    }

    fn pid(&self) -> u32 {
        self.served.child.id()
    }

    #[track_caller]
    fn assert_running(&mut self) {
        let exited = self.served.child.try_wait().expect("try_wait");
        assert!(
            exited.is_none(),
            "the server exited: {exited:?}\n{}",
            self.log()
        );
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// SIGTERM, and the graceful shutdown must end in exit 0; then no panic
    /// and no internal error may have been logged.
    async fn stop(mut self) {
        signal(self.pid(), "TERM");
        let status = wait_exit(&mut self.served.child, Duration::from_secs(20))
            .await
            .expect("no exit within 20 s of SIGTERM");
        // The drain thread reads until EOF, which comes with the exit.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let log = self.log();
        assert!(status.success(), "exit {status} after SIGTERM:\n{log}");
        assert!(!log.contains("panicked"), "the server panicked:\n{log}");
        assert!(
            !log.contains("internal error"),
            "the server logged an internal error:\n{log}"
        );
    }
}

// === HTTP ===

#[derive(Clone)]
struct Http {
    client: reqwest::Client,
    base: String,
}

/// The most writes one transaction of the server carried so far
/// (`idemgate_store_batch_largest`): the faults land in the middle of
/// batches, not between lone writes.
async fn largest_batch(http: &Http) -> u64 {
    let text = http
        .client
        .get(format!("{}/metrics", http.base))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find_map(|l| l.strip_prefix("idemgate_store_batch_largest "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// One answer: status, the headers that matter here, the JSON body.
#[derive(Debug)]
struct Answer {
    status: u16,
    content_type: String,
    retry_after: Option<String>,
    body: serde_json::Value,
}

impl Http {
    fn new(base: String) -> Http {
        let client = reqwest::Client::builder()
            // A request that hangs is an error (recorded), not a hung test.
            .timeout(Duration::from_secs(15))
            .build()
            .unwrap();
        Http { client, base }
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<Answer, String> {
        let res = req.send().await.map_err(|e| format!("transport: {e}"))?;
        let header = |name: &str| {
            res.headers()
                .get(name)
                .map(|v| v.to_str().unwrap_or_default().to_owned())
        };
        let status = res.status().as_u16();
        let content_type = header("content-type").unwrap_or_default();
        let retry_after = header("retry-after");
        let text = res.text().await.map_err(|e| format!("body: {e}"))?;
        let body = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
        Ok(Answer {
            status,
            content_type,
            retry_after,
            body,
        })
    }

    async fn reserve(&self, key: &str) -> Result<Answer, String> {
        self.send(
            self.client
                .post(format!("{}/v1/reservations", self.base))
                .header("Idempotency-Key", format!("\"{key}\""))
                .header("content-type", "application/json")
                .body("{}"),
        )
        .await
    }

    async fn commit(&self, id: &str, body: &str) -> Result<Answer, String> {
        let json = serde_json::json!({"status": 201, "headers": [], "body": body});
        self.send(
            self.client
                .post(format!("{}/v1/reservations/{id}/commit", self.base))
                .header("content-type", "application/json")
                .body(json.to_string()),
        )
        .await
    }

    async fn get(&self, path: &str) -> Result<Answer, String> {
        self.send(self.client.get(format!("{}{path}", self.base)))
            .await
    }
}

// === what the clients saw ===

/// Every answer of a run, by kind.
#[derive(Default)]
struct Tally {
    requests: usize,
    /// Commits answered 200: they must survive anything.
    acknowledged: Vec<Ack>,
    /// Well-formed `503 store-unavailable` answers.
    unavailable: usize,
    /// 503s without problem+json, `Retry-After` or `retry_after_seconds`.
    malformed: Vec<String>,
    /// Anything else: a 500, another status, no answer at all.
    unexpected: Vec<String>,
}

impl Tally {
    /// Counts `answer` to `what`; true when its status is `want`. A 503
    /// must be a well-formed `store-unavailable`; any other status than
    /// `want` is unexpected.
    fn note(&mut self, what: &str, answer: &Result<Answer, String>, want: u16) -> bool {
        self.requests += 1;
        match answer {
            Ok(a) if a.status == want => true,
            Ok(a) if a.status == 503 => {
                match store_unavailable(a) {
                    Ok(()) => self.unavailable += 1,
                    Err(why) => self.malformed.push(format!("{what}: {why}: {a:?}")),
                }
                false
            }
            Ok(a) => {
                self.unexpected
                    .push(format!("{what}: {} {}", a.status, a.body));
                false
            }
            Err(e) => {
                self.unexpected.push(format!("{what}: {e}"));
                false
            }
        }
    }

    fn absorb(&mut self, other: Tally) {
        self.requests += other.requests;
        self.acknowledged.extend(other.acknowledged);
        self.unavailable += other.unavailable;
        self.malformed.extend(other.malformed);
        self.unexpected.extend(other.unexpected);
    }

    /// No 500, no other surprise, every 503 well-formed.
    #[track_caller]
    fn assert_clean(&self) {
        assert!(
            self.unexpected.is_empty(),
            "{} answers other than the expected ones and 503 (first 10): {:#?}",
            self.unexpected.len(),
            &self.unexpected[..self.unexpected.len().min(10)]
        );
        assert!(
            self.malformed.is_empty(),
            "malformed 503s (first 10): {:#?}",
            &self.malformed[..self.malformed.len().min(10)]
        );
    }
}

/// Why `a` is not a proper `503 store-unavailable`, if it is not.
fn store_unavailable(a: &Answer) -> Result<(), String> {
    if a.content_type != "application/problem+json" {
        return Err(format!("content-type {:?}", a.content_type));
    }
    let ty = a.body["type"].as_str().unwrap_or_default();
    if !ty.ends_with("/store-unavailable") {
        return Err(format!("type {ty:?}"));
    }
    let header = a.retry_after.as_deref().and_then(|v| v.parse::<u64>().ok());
    let field = a.body["retry_after_seconds"].as_u64();
    match (header, field) {
        (Some(h), Some(f)) if h == f && h > 0 => Ok(()),
        _ => Err(format!(
            "Retry-After {:?}, retry_after_seconds {}",
            a.retry_after, a.body["retry_after_seconds"]
        )),
    }
}

/// A commit answered 200.
#[derive(Clone, Debug)]
struct Ack {
    key: String,
    reservation_id: String,
    body: String,
}

/// How one reserve + commit of a fresh key ended.
#[derive(Debug, PartialEq)]
enum Put {
    Acknowledged,
    Refused,
}

/// Reserves `key` and commits a body of about `size` bytes that names it.
async fn put(http: &Http, key: &str, size: usize, tally: &mut Tally) -> Put {
    let reserved = http.reserve(key).await;
    if !tally.note("reserve", &reserved, 201) {
        return Put::Refused;
    }
    let id = reserved.unwrap().body["reservation_id"]
        .as_str()
        .expect("reservation_id")
        .to_owned();
    let body = format!("{key}:{}", "x".repeat(size));
    let committed = http.commit(&id, &body).await;
    if tally.note("commit", &committed, 200) {
        tally.acknowledged.push(Ack {
            key: key.to_owned(),
            reservation_id: id,
            body,
        });
        Put::Acknowledged
    } else {
        Put::Refused
    }
}

/// Clients putting fresh keys until stopped, into one shared tally that
/// the test can read meanwhile.
struct Load {
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(http: &Http, clients: usize, size: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new(Tally::default()));
        let workers = (0..clients)
            .map(|_| {
                let (http, stop, tally) = (http.clone(), stop.clone(), tally.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let mut mine = Tally::default();
                        let outcome = put(&http, &fresh_key(), size, &mut mine).await;
                        tally.lock().unwrap().absorb(mine);
                        if outcome == Put::Refused {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            tally,
            workers,
        }
    }

    fn unavailable(&self) -> usize {
        self.tally.lock().unwrap().unavailable
    }

    fn acknowledged(&self) -> usize {
        self.tally.lock().unwrap().acknowledged.len()
    }

    async fn finish(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        for w in self.workers {
            tokio::time::timeout(Duration::from_secs(20), w)
                .await
                .expect("a client hung")
                .expect("a client panicked");
        }
        Arc::try_unwrap(self.tally)
            .ok()
            .expect("workers done")
            .into_inner()
            .unwrap()
    }
}

/// Puts fresh keys until one is acknowledged: the time that took, or `None`
/// after [`RECOVERY`].
async fn recovery(http: &Http, tally: &mut Tally) -> Option<Duration> {
    let started = Instant::now();
    loop {
        if put(http, &fresh_key(), 256, tally).await == Put::Acknowledged {
            return Some(started.elapsed());
        }
        if started.elapsed() > RECOVERY {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `/readyz` under the fault: it must answer, promptly, 200 or a proper 503.
async fn readyz(http: &Http, tally: &mut Tally) -> (u16, Duration) {
    let started = Instant::now();
    let answer = http.get("/readyz").await;
    let took = started.elapsed();
    tally.note("readyz", &answer, 200);
    assert!(took < Duration::from_secs(5), "/readyz took {took:?}");
    (answer.map(|a| a.status).unwrap_or(0), took)
}

/// Replays every key of `acknowledged`: how many answered 200 with their
/// committed body (each answer counted into `tally`).
async fn replays(http: &Http, acknowledged: &[Ack], tally: &mut Tally) -> usize {
    let mut ok = 0;
    for ack in acknowledged {
        let answer = http.reserve(&ack.key).await;
        if tally.note("replay", &answer, 200) {
            let a = answer.unwrap();
            assert_eq!(a.body["response"]["body"], ack.body.as_str(), "{}", ack.key);
            ok += 1;
        }
    }
    ok
}

/// Reads the records of `acknowledged` by reservation id (no write
/// involved): how many answered 200, completed.
async fn lookups(http: &Http, acknowledged: &[Ack], tally: &mut Tally) -> usize {
    let mut ok = 0;
    for ack in acknowledged {
        let answer = http
            .get(&format!("/v1/reservations/{}", ack.reservation_id))
            .await;
        if tally.note("lookup", &answer, 200) {
            assert_eq!(answer.unwrap().body["state"], "completed", "{}", ack.key);
            ok += 1;
        }
    }
    ok
}

// === the file ===

fn sqlite_url(path: &Path) -> String {
    format!("sqlite://{}", path.display())
}

/// With no server running: `PRAGMA integrity_check` must say `ok`, and every
/// acknowledged key must be completed with its body. Returns how many were.
async fn check_file(url: &str, acknowledged: &[Ack]) -> usize {
    let mut conn = SqliteConnectOptions::from_str(url)
        .unwrap()
        .connect()
        .await
        .expect("open the database file");
    let integrity: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check")
        .fetch_all(&mut conn)
        .await
        .expect("integrity_check");
    assert_eq!(integrity, ["ok"], "the database file is damaged");
    let rows: Vec<(Vec<u8>, Vec<u8>)> = sqlx::query_as(
        "SELECT key_hash, response_body FROM idempotency_keys
          WHERE tenant = 'default' AND state = 'completed'",
    )
    .fetch_all(&mut conn)
    .await
    .expect("completed keys");
    conn.close().await.expect("close");
    let stored: HashMap<Vec<u8>, Vec<u8>> = rows.into_iter().collect();
    let found = acknowledged
        .iter()
        .filter(|ack| {
            stored
                .get(&Sha256::digest(ack.key.as_bytes()).to_vec())
                .is_some_and(|body| body[..] == *ack.body.as_bytes())
        })
        .count();
    assert_eq!(
        found,
        acknowledged.len(),
        "acknowledged commits are missing from the file"
    );
    found
}

/// After a restart: every key in `acknowledged` replays its body, and a new
/// key reserves and commits. Returns how many were replayed.
async fn check_after_restart(cmd: Command, acknowledged: &[Ack], tally: &mut Tally) -> usize {
    let server = Server::start(cmd).await;
    let replayed = replays(&server.http, acknowledged, tally).await;
    assert_eq!(
        replayed,
        acknowledged.len(),
        "acknowledged commits do not replay"
    );
    assert_eq!(
        put(&server.http, &fresh_key(), 1024, tally).await,
        Put::Acknowledged,
        "a new key after the restart"
    );
    server.stop().await;
    replayed
}

/// Once a fault is gone: the server answers again within 5 s by itself, the
/// load ends with 200s and 503s only (some 503s), the server stops, every
/// acknowledged commit is in the file, and a sample replays after a restart.
/// Returns the recovery time, the commits found and the sample replayed.
async fn recovers_and_kept_everything(
    mut server: Server,
    http: &Http,
    load: Load,
    tally: &mut Tally,
    (dir, url): (&Path, &str),
    fault_gone: &str,
) -> (Duration, usize, usize) {
    let recovered = recovery(http, tally).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let load = load.finish().await;
    server.assert_running();
    tally.absorb(load);
    tally.assert_clean();
    assert!(tally.unavailable > 0);
    let Some(recovered) = recovered else {
        panic!(
            "not recovered within 5 s of {fault_gone}; the server's log ends:\n{}",
            tail(&server.log(), 40)
        );
    };
    server.stop().await;

    let found = check_file(url, &tally.acknowledged).await;
    let mut after = Tally::default();
    let replayed = check_after_restart(
        idemgate(dir, url),
        &sample(&tally.acknowledged, 100),
        &mut after,
    )
    .await;
    after.assert_clean();
    (recovered, found, replayed)
}

/// The last `n` lines of `log`.
fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// At most `n` elements of `all`, spread over it.
fn sample<T: Clone>(all: &[T], n: usize) -> Vec<T> {
    all.iter().step_by(all.len() / n + 1).cloned().collect()
}

/// Runs a command that must succeed.
#[track_caller]
fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn is_root() -> bool {
    let out = Command::new("id").arg("-u").output().expect("id(1)");
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

// === 1. read-only under a running server ===

/// Paths made immutable (`chattr +i`) until dropped, even when the test
/// fails, so that the temporary directory can be removed.
struct Immutable(Vec<PathBuf>);

impl Immutable {
    /// Whether `chattr +i` works here (root with `CAP_LINUX_IMMUTABLE`, a
    /// filesystem with the flag).
    fn available(dir: &Path) -> Result<(), String> {
        let probe = dir.join("probe");
        std::fs::write(&probe, b"probe").unwrap();
        let out = Command::new("chattr")
            .arg("+i")
            .arg(&probe)
            .output()
            .map_err(|e| format!("chattr: {e}"))?;
        let _ = Command::new("chattr").arg("-i").arg(&probe).status();
        let _ = std::fs::remove_file(&probe);
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
        }
    }

    fn set(paths: Vec<PathBuf>) -> Immutable {
        for p in &paths {
            run("chattr", &["+i", p.to_str().unwrap()]);
        }
        Immutable(paths)
    }

    fn clear(mut self) {
        for p in self.0.drain(..) {
            run("chattr", &["-i", p.to_str().unwrap()]);
        }
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = Command::new("chattr").arg("-i").arg(p).status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_made_read_only_under_load_answers_503_and_recovers_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    if let Err(why) = Immutable::available(dir.path()) {
        eprintln!(
            "SKIPPED: cannot make a file immutable here ({why}); \
             a_database_read_only_at_a_restart_* covers a read-only file without it"
        );
        return;
    }
    let db = dir.path().join("x.db");
    let url = sqlite_url(&db);
    let mut server = Server::start(idemgate(dir.path(), &url)).await;
    let http = server.http.clone();

    let mut tally = Tally::default();
    let mut before = Tally::default();
    for _ in 0..20 {
        put(&http, &fresh_key(), 1024, &mut before).await;
    }
    before.assert_clean();
    assert_eq!(before.acknowledged.len(), 20, "before the fault");

    let load = Load::start(&http, 4, 1024);
    assert!(
        until(Duration::from_secs(5), || load.acknowledged() >= 10).await,
        "the load made no progress before the fault"
    );
    assert_eq!(load.unavailable(), 0, "503s before the fault");
    let fault_at = Instant::now();
    let fault = Immutable::set(vec![
        db.clone(),
        dir.path().join("x.db-wal"),
        dir.path().to_owned(),
    ]);
    assert!(
        until(Duration::from_secs(5), || load.unavailable() > 0).await,
        "no 503 within 5 s of the file turning read-only"
    );
    let felt_after = fault_at.elapsed();
    // Hold the fault a while under load, then look around.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (ready, ready_took) = readyz(&http, &mut tally).await;
    let healthz = http.get("/healthz").await;
    assert!(tally.note("healthz", &healthz, 200), "{healthz:?}");
    // Reads go on, replays included: the store reads a completed record
    // before it asks for the write lock.
    let looked_up = lookups(&http, &before.acknowledged, &mut tally).await;
    assert_eq!(
        looked_up, 20,
        "records read by reservation id during the fault"
    );
    let replayed_during = replays(&http, &before.acknowledged, &mut tally).await;
    assert_eq!(
        replayed_during,
        before.acknowledged.len(),
        "replays read the file: they go on while it cannot be written"
    );
    server.assert_running();
    let unavailable_during = load.unavailable();
    let largest = largest_batch(&http).await;
    assert!(largest >= 2, "4 clients and no batch of two writes");

    fault.clear();
    tally.absorb(before);
    let (recovered, found, replayed) = recovers_and_kept_everything(
        server,
        &http,
        load,
        &mut tally,
        (dir.path(), &url),
        "the file turning writable",
    )
    .await;
    println!(
        "read-only (chattr +i) under 4 clients: {} requests, {} commits acknowledged, {} \
         answers 503 ({} while read-only, the first {felt_after:?} after the fault), 0 other; \
         /readyz {ready} in {ready_took:?} meanwhile; during the fault {looked_up}/20 earlier \
         records read by id, {replayed_during}/20 earlier keys replayed; \
         recovered by itself {recovered:?} after the file turned writable; integrity_check ok, \
         {found}/{} acknowledged commits in the file, {replayed} replayed after a restart",
        tally.requests,
        tally.acknowledged.len(),
        tally.unavailable,
        unavailable_during,
        tally.acknowledged.len(),
    );
}

// === 2. read-only at a restart ===

/// `path`'s permission bits.
fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// The database file and the side files that exist, then the directory.
fn database_files(dir: &Path) -> Vec<PathBuf> {
    ["x.db", "x.db-wal", "x.db-shm"]
        .iter()
        .map(|f| dir.join(f))
        .filter(|p| p.exists())
        .collect()
}

/// Makes the database and its directory read-only (`0444`, `0555`), or
/// writable again (`0644`, `0755`).
fn read_only(dir: &Path, yes: bool) {
    for f in database_files(dir) {
        chmod(&f, if yes { 0o444 } else { 0o644 });
    }
    chmod(dir, if yes { 0o555 } else { 0o755 });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_read_only_at_a_restart_answers_503_and_recovers_after_another() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("x.db");
    let url = sqlite_url(&db);
    // Root ignores permission bits: the server runs as nobody then.
    let root = is_root();
    if root {
        std::os::unix::fs::chown(dir.path(), Some(NOBODY), Some(NOBODY)).unwrap();
    }
    let program = program_for_nobody(dir.path(), root);
    let cmd = || {
        let mut cmd = Command::new(&program);
        plain_env(&mut cmd, dir.path(), &url);
        if root {
            cmd.uid(NOBODY).gid(NOBODY);
        }
        cmd
    };
    let mut tally = Tally::default();

    // A server writes, and its files are made read-only under it: the
    // descriptors it holds keep their write access, so it goes on writing.
    let mut first = Server::start(cmd()).await;
    for _ in 0..20 {
        put(&first.http, &fresh_key(), 1024, &mut tally).await;
    }
    assert_eq!(tally.acknowledged.len(), 20, "before the fault");
    let earlier = tally.acknowledged.clone();
    read_only(dir.path(), true);
    let mut under_chmod = Tally::default();
    for _ in 0..5 {
        put(&first.http, &fresh_key(), 1024, &mut under_chmod).await;
    }
    let written_under_chmod = under_chmod.acknowledged.len();
    first.assert_running();
    tally.absorb(under_chmod);
    // It cannot remove its WAL on the way out, so the next one finds it.
    first.stop().await;
    assert!(
        database_files(dir.path()).len() == 3,
        "the WAL and its index stay behind a read-only directory"
    );

    // The restart meets the read-only file: it comes up, reads, refuses
    // every write with 503, and stays up.
    let mut second = Server::start(cmd()).await;
    let http = second.http.clone();
    let mut refused = 0;
    for _ in 0..10 {
        if put(&http, &fresh_key(), 1024, &mut tally).await == Put::Refused {
            refused += 1;
        }
    }
    assert_eq!(refused, 10, "writes to a read-only database");
    let looked_up = lookups(&http, &earlier, &mut tally).await;
    assert_eq!(looked_up, 20, "records read by reservation id");
    let replayed_during = replays(&http, &earlier, &mut tally).await;
    assert_eq!(
        replayed_during,
        earlier.len(),
        "replays from a read-only file"
    );
    let (ready, ready_took) = readyz(&http, &mut tally).await;
    second.assert_running();

    // Writable again. This process cannot recover by itself: SQLite keeps
    // one WAL index (the `-shm` mapping) per file per process, shared by
    // all its connections, and opened it read-only; it is opened afresh only
    // once every connection to the file has closed, and the idle readers
    // keep theirs (up to sqlx's 10 minutes idle timeout). So: measured, not
    // required, and a restart must recover.
    read_only(dir.path(), false);
    let by_itself = recovery(&http, &mut tally).await;
    second.assert_running();
    second.stop().await;
    let third = Server::start(cmd()).await;
    let recovery_after_restart = recovery(&third.http, &mut tally)
        .await
        .expect("not recovered after a restart on the writable file");
    let replayed_after = replays(&third.http, &tally.acknowledged.clone(), &mut tally).await;
    assert_eq!(replayed_after, tally.acknowledged.len());
    third.stop().await;
    let found = check_file(&url, &tally.acknowledged).await;

    // Read-only again, and no WAL left this time (the last server removed
    // it): a start cannot even open the file, and says so.
    assert_eq!(
        database_files(dir.path()),
        [db.as_path()],
        "WAL left behind"
    );
    read_only(dir.path(), true);
    let refusal = refused_start(cmd()).await;
    read_only(dir.path(), false);
    assert!(
        refusal.contains("DATABASE_URL") && refusal.contains("readonly"),
        "the refusal names the setting and the cause: {refusal}"
    );
    let mut after = Tally::default();
    let replayed = check_after_restart(cmd(), &tally.acknowledged, &mut after).await;
    after.assert_clean();
    tally.assert_clean();
    assert!(tally.unavailable > 0);
    println!(
        "read-only at a restart (0444/0555{}): {written_under_chmod}/5 commits still \
         acknowledged by the running server after the chmod (its open descriptors keep write \
         access); after the restart {refused}/10 new keys refused with 503, {looked_up}/20 \
         records read by id, {replayed_during}/20 replays answered 200, /readyz \
         {ready} in {ready_took:?}; after the chmod back, recovered by itself: {}; after a \
         restart: a new key acknowledged in {recovery_after_restart:?}; {} requests, {} answers \
         503, 0 other; integrity_check ok, {found}/{} acknowledged commits in the file and \
         {replayed} replayed after a restart; a start on the read-only file with no WAL left is \
         refused: {}",
        if root { ", server as nobody" } else { "" },
        by_itself.map_or_else(
            || "no (not within 5 s)".to_owned(),
            |d| format!("yes, in {d:?}")
        ),
        tally.requests,
        tally.unavailable,
        tally.acknowledged.len(),
        refusal.lines().last().unwrap_or_default().trim(),
    );
}

/// The binary, where nobody can run it: as it is, or copied into `dir`
/// when its own path is closed to other users.
fn program_for_nobody(dir: &Path, root: bool) -> PathBuf {
    let runs = |program: &Path| {
        Command::new(program)
            .uid(NOBODY)
            .gid(NOBODY)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !root || runs(Path::new(BIN)) {
        return PathBuf::from(BIN);
    }
    let copy = dir.join("idemgate");
    std::fs::copy(BIN, &copy).unwrap();
    chmod(&copy, 0o755);
    assert!(runs(&copy), "nobody cannot run {}", copy.display());
    copy
}

/// Runs `cmd serve`, which must exit non-zero within 10 s: its stderr.
async fn refused_start(mut cmd: Command) -> String {
    let port = common::bin::free_port().to_string();
    let mut child = cmd
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(10)).await;
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    let status = status.unwrap_or_else(|| panic!("started on a read-only file:\n{stderr}"));
    assert!(!status.success(), "exit {status}:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

// === 3. a full disk ===

/// Whether `SIGXFSZ` is ignored by process `pid` (`SigIgn` in its status).
fn ignores_sigxfsz(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .map(|m| u64::from_str_radix(m.trim(), 16).unwrap())
        .unwrap();
    // Signal n is bit n - 1; SIGXFSZ is 25 on Linux.
    mask & (1 << 24) != 0
}

/// Sets the soft `RLIMIT_FSIZE` of process `pid`: the largest size, in
/// bytes, any file it writes may reach.
fn file_size_limit(pid: u32, limit: &str) {
    run(
        "prlimit",
        &["--pid", &pid.to_string(), &format!("--fsize={limit}:")],
    );
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_under_load_answers_503_and_loses_no_acknowledged_commit() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("x.db");
    let wal = dir.path().join("x.db-wal");
    let url = sqlite_url(&db);
    // `sh` ignores SIGXFSZ, then becomes the server (same pid): the ignored
    // disposition survives `exec`.
    let mut cmd = Command::new("sh");
    cmd.args(["-c", r#"trap '' XFSZ; exec "$0" "$@""#, BIN]);
    plain_env(&mut cmd, dir.path(), &url);
    let mut server = Server::start(cmd).await;
    let http = server.http.clone();
    assert!(ignores_sigxfsz(server.pid()), "SIGXFSZ is not ignored");

    let mut tally = Tally::default();
    for _ in 0..20 {
        put(&http, &fresh_key(), 4096, &mut tally).await;
    }
    assert_eq!(tally.acknowledged.len(), 20, "before the fault");
    let earlier = tally.acknowledged.clone();
    let load = Load::start(&http, 4, 4096);
    assert!(
        until(Duration::from_secs(5), || load.acknowledged() >= 10).await,
        "the load made no progress before the fault"
    );
    // Room for 1 MiB more in any file. The WAL, which every commit appends
    // to, fills it first: it is short of its first checkpoint (1,000 pages,
    // about 4 MiB), after which it would be rewritten from its start.
    let wal_at_fault = size(&wal);
    assert!(
        wal_at_fault < 3 << 20,
        "the WAL is {wal_at_fault} bytes already"
    );
    let limit = size(&db).max(wal_at_fault) + (1 << 20);
    assert_eq!(load.unavailable(), 0, "503s before the fault");
    let fault_at = Instant::now();
    let acknowledged_at_fault = load.acknowledged();
    file_size_limit(server.pid(), &limit.to_string());
    assert!(
        until(Duration::from_secs(10), || load.unavailable() > 0).await,
        "no 503 within 10 s of the disk filling up"
    );
    let felt_after = fault_at.elapsed();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let largest = largest_batch(&http).await;
    assert!(largest >= 2, "4 clients and no batch of two writes");
    let wal_at_limit = size(&wal);
    assert!(wal_at_limit <= limit, "the limit did not hold");
    let (ready, ready_took) = readyz(&http, &mut tally).await;
    let healthz = http.get("/healthz").await;
    assert!(tally.note("healthz", &healthz, 200), "{healthz:?}");
    let looked_up = lookups(&http, &earlier, &mut tally).await;
    assert_eq!(
        looked_up, 20,
        "records read by reservation id on a full disk"
    );
    let replayed_during = replays(&http, &earlier, &mut tally).await;
    server.assert_running();
    let unavailable_during = load.unavailable();
    let acknowledged_during = load.acknowledged() - acknowledged_at_fault;

    file_size_limit(server.pid(), "unlimited");
    let (recovered, found, replayed) = recovers_and_kept_everything(
        server,
        &http,
        load,
        &mut tally,
        (dir.path(), &url),
        "the disk having room again",
    )
    .await;
    println!(
        "full disk (RLIMIT_FSIZE = largest file + 1 MiB, 4 KiB bodies) under 4 clients: {} \
         requests, {} commits acknowledged ({acknowledged_during} of them after the limit was \
         set), {} answers 503 ({unavailable_during} while full, the first {felt_after:?} after \
         the limit was set), 0 other; WAL {wal_at_limit} bytes at the limit of {limit}; /readyz \
         {ready} in {ready_took:?}; during the fault {looked_up}/20 earlier records read by id, \
         {replayed_during}/20 earlier keys replayed; recovered by itself {recovered:?} after the \
         limit was lifted; integrity_check ok, {found}/{} acknowledged commits in the file, \
         {replayed} replayed after a restart",
        tally.requests,
        tally.acknowledged.len(),
        tally.unavailable,
        tally.acknowledged.len(),
    );
}
