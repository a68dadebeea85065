//! `idemgate-campaign upgrade`: a rolling upgrade under load
//! (docs/operations.md, “Upgrading”).
//!
//! The previous release (N−1) and this one (N) serve one PostgreSQL
//! database through both doors — proxies in front of the recording origin,
//! and `serve`'s reservation API, whose clients run the effect at the origin
//! themselves and commit through any `serve` — while clients send new keys
//! and repeat earlier ones to any process of the door:
//!
//! 1. N−1 alone (it migrates the database);
//! 2. N's `migrate --status`, then N's `migrate`, while N−1 serves;
//! 3. N's processes join (both releases serve);
//! 4. N−1's processes stop (SIGTERM);
//! 5. the rollback: N−1 starts again on the migrated database, serves beside
//!    N, and N stops;
//! 6. the load stops, the leases run out, and every key is sent once more.
//!
//! On SQLite (one process per file) the same file is served by one process
//! at a time: N−1's proxy, then its serve, then N's (which migrate the file
//! at start), then N−1's again.
//!
//! The checker reads every answer and every execution in the history: no
//! key ran twice, none was stranded (an `outcome-unknown` answer, a commit
//! that found no reservation, or a key that does not replay at the end), no
//! answer was a 500, and every successful answer of a key carries the body
//! of its one execution.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tokio::process::{Child, Command};

use crate::clients::{self, Attempt};
use crate::history::{self, Event, KeyDone, Recorder, Request, RunInfo};
use crate::origin::{Origin, VIA};

/// The lease every process and reservation is given: long enough that a
/// key in flight while its process is swapped out (SQLite) is committed
/// before it ends.
const LEASE_SECS: u64 = 10;

/// How the run is set up.
#[derive(Debug, Clone)]
pub struct Plan {
    /// N−1's binary.
    pub previous: PathBuf,
    /// N's binary.
    pub current: PathBuf,
    /// `postgres://…` of an empty database, or `None` for SQLite (a file
    /// in `out`).
    pub database_url: Option<String>,
    pub clients: usize,
    /// Seconds each step of the timeline lasts.
    pub step_secs: u64,
    pub seed: u64,
    pub out: PathBuf,
    /// N's `migrate` is expected to refuse while N−1 is connected (an
    /// upgrade across a contract step): the N−1 processes are stopped
    /// first, as the upgrade notes (docs/operations.md) say, and there is no rollback.
    pub expect_refusal: bool,
    /// Skip the rollback (an N−1 that cannot start on N's schema).
    pub no_rollback: bool,
}

/// The two doors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Door {
    Proxy,
    Api,
}

/// A process that serves one door.
struct Proc {
    /// `N-1 proxy #3`.
    name: String,
    door: Door,
    /// The endpoint's id: its index in [`Endpoints::bases`].
    id: usize,
    child: Child,
    /// Where readiness is asked.
    ready: String,
}

/// Every endpoint ever started (by id), and the ids live now.
#[derive(Default)]
struct Endpoints {
    bases: RwLock<Vec<String>>,
    live: RwLock<Vec<(usize, Door)>>,
}

impl Endpoints {
    fn pick(&self, door: Door, rng: &mut StdRng) -> Option<usize> {
        let live = self.live.read().unwrap_or_else(|e| e.into_inner());
        let ids: Vec<usize> = live
            .iter()
            .filter(|(_, d)| *d == door)
            .map(|(id, _)| *id)
            .collect();
        (!ids.is_empty()).then(|| ids[rng.random_range(0..ids.len())])
    }

    fn base(&self, id: usize) -> String {
        self.bases.read().unwrap_or_else(|e| e.into_inner())[id].clone()
    }

    fn all_bases(&self) -> Vec<String> {
        self.bases.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// What the run shares with its clients.
struct Shared {
    endpoints: Endpoints,
    rec: Arc<Recorder>,
    origin: String,
    http: reqwest::Client,
    /// Keys issued so far, per door.
    proxy_keys: AtomicUsize,
    api_keys: AtomicUsize,
    stop: AtomicBool,
    /// Per door (proxy, API): no new key is taken while set.
    paused: [AtomicBool; 2],
    /// Per door: clients driving a key now.
    busy: [AtomicUsize; 2],
    seed: u64,
}

impl Door {
    fn index(self) -> usize {
        match self {
            Door::Proxy => 0,
            Door::Api => 1,
        }
    }
}

/// The raw key `i` of `door`.
fn key_of(seed: u64, door: Door, i: usize) -> String {
    match door {
        // The proxy door's keys are the campaign's (the clients' `send`
        // derives the path and body from the number).
        Door::Proxy => clients::key_name(seed, i),
        Door::Api => format!("upgrade-{seed}-api-{i:06}"),
    }
}

/// Runs the whole timeline and checks it; `Ok(true)` if the checker passed.
pub async fn run(plan: &Plan) -> anyhow::Result<bool> {
    std::fs::create_dir_all(&plan.out)?;
    let rec = Arc::new(Recorder::create(&plan.out.join("history.jsonl"))?);
    let store = if plan.database_url.is_some() {
        "postgres"
    } else {
        "sqlite"
    };
    rec.record(&Event::Run(RunInfo {
        store: store.into(),
        on_lease_expiry: "hold".into(),
        seed: plan.seed,
        clients: plan.clients,
        lease_secs: LEASE_SECS,
        ..RunInfo::default()
    }));
    let origin = Origin::start(
        "127.0.0.1:0".parse().expect("an address"),
        rec.clone(),
        None,
        plan.seed,
    )
    .await?;
    let shared = Arc::new(Shared {
        endpoints: Endpoints::default(),
        rec: rec.clone(),
        origin: format!("http://{}", origin.addr),
        http: reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .build()?,
        proxy_keys: AtomicUsize::new(0),
        api_keys: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        paused: [AtomicBool::new(false), AtomicBool::new(false)],
        busy: [AtomicUsize::new(0), AtomicUsize::new(0)],
        seed: plan.seed,
    });
    let mut run = Run {
        plan: plan.clone(),
        shared: shared.clone(),
        procs: Vec::new(),
        notes: Vec::new(),
        url: match &plan.database_url {
            Some(url) => url.clone(),
            None => format!("sqlite://{}", plan.out.join("idemgate.db").display()),
        },
    };
    let mut tasks = Vec::new();
    for c in 0..plan.clients.max(2) {
        let door = if c % 2 == 0 { Door::Proxy } else { Door::Api };
        let shared = shared.clone();
        tasks.push(tokio::spawn(client(shared, c, door)));
    }
    let timeline = if plan.database_url.is_some() {
        run.postgres().await
    } else {
        run.sqlite().await
    };
    shared.stop.store(true, Ordering::SeqCst);
    for task in tasks {
        let _ = task.await;
    }
    let finale = match timeline {
        Ok(()) => run.finale().await,
        Err(e) => Err(e),
    };
    run.stop_all().await;
    finale?;
    let events = history::read(&plan.out.join("history.jsonl"))?;
    let report = check(&events, &run.notes);
    std::fs::write(plan.out.join("report.txt"), &report.text)?;
    print!("{}", report.text);
    Ok(report.passed)
}

struct Run {
    plan: Plan,
    shared: Arc<Shared>,
    procs: Vec<Proc>,
    /// What the run saw beside the history (migrate's refusal, the
    /// statuses), for the report.
    notes: Vec<String>,
    url: String,
}

impl Run {
    fn step(&self) -> Duration {
        Duration::from_secs(self.plan.step_secs)
    }

    fn phase(&mut self, name: &str) {
        println!("upgrade: {name} (at {} ms)", self.shared.rec.now());
        self.shared.rec.phase(name);
    }

    async fn postgres(&mut self) -> anyhow::Result<()> {
        let prev = self.plan.previous.clone();
        let cur = self.plan.current.clone();
        self.phase("n-1 migrates and serves");
        self.migrate(&prev, "n-1").await?;
        for door in [Door::Proxy, Door::Proxy, Door::Api, Door::Api] {
            self.start(&prev, "N-1", door).await?;
        }
        tokio::time::sleep(self.step()).await;

        self.status(&cur, "before").await;
        if self.plan.expect_refusal {
            self.phase("n migrate, expected to refuse while n-1 is connected");
            let refused = !self.migrate_ok(&cur, "n-refused").await?;
            self.notes.push(format!(
                "N's migrate while N-1 was connected: {}",
                if refused { "refused" } else { "APPLIED" }
            ));
            if !refused {
                bail!("N's migrate applied while N-1 processes were connected");
            }
            // The upgrade notes' order for such an upgrade: stop N-1, migrate,
            // start N.
            self.phase("n-1 stops (as the upgrade notes say)");
            self.stop_where("N-1").await;
            self.migrate(&cur, "n").await?;
            for door in [Door::Proxy, Door::Proxy, Door::Api, Door::Api] {
                self.start(&cur, "N", door).await?;
            }
            self.status(&cur, "after").await;
            tokio::time::sleep(self.step()).await;
            return Ok(());
        }
        self.phase("n migrates while n-1 serves");
        let started = Instant::now();
        self.migrate(&cur, "n").await?;
        self.notes.push(format!(
            "N's migrate while N-1 served: applied in {} ms",
            started.elapsed().as_millis()
        ));
        tokio::time::sleep(self.step()).await;

        self.phase("n joins: both releases serve");
        for door in [Door::Proxy, Door::Proxy, Door::Api, Door::Api] {
            self.start(&cur, "N", door).await?;
        }
        self.status(&cur, "both").await;
        tokio::time::sleep(self.step()).await;

        self.phase("n-1 stops");
        self.stop_where("N-1").await;
        tokio::time::sleep(self.step()).await;

        if !self.plan.no_rollback {
            self.phase("rollback: n-1 starts again beside n");
            self.start(&prev, "N-1", Door::Proxy).await?;
            self.start(&prev, "N-1", Door::Api).await?;
            tokio::time::sleep(self.step()).await;
            self.phase("rollback: n stops, n-1 alone");
            self.stop_where("N ").await;
            tokio::time::sleep(self.step()).await;
        }
        Ok(())
    }

    async fn sqlite(&mut self) -> anyhow::Result<()> {
        let prev = self.plan.previous.clone();
        let cur = self.plan.current.clone();
        let mut order = vec![
            (prev.clone(), "N-1", Door::Proxy),
            (prev.clone(), "N-1", Door::Api),
            (cur.clone(), "N", Door::Proxy),
            (cur.clone(), "N", Door::Api),
        ];
        if !self.plan.no_rollback {
            order.push((prev.clone(), "N-1", Door::Proxy));
            order.push((prev.clone(), "N-1", Door::Api));
        }
        for (bin, release, door) in order {
            self.phase(&format!("{release} {door:?} on the file").to_lowercase());
            self.start(&bin, release, door).await?;
            if release == "N" && door == Door::Proxy {
                self.notes
                    .push("the file N-1 wrote opened under N (migrated at start)".into());
            }
            tokio::time::sleep(self.step()).await;
            self.stop_where("").await;
        }
        Ok(())
    }

    /// `bin migrate`, which must succeed.
    async fn migrate(&mut self, bin: &Path, label: &str) -> anyhow::Result<()> {
        if !self.migrate_ok(bin, label).await? {
            bail!(
                "{} migrate failed: see {}",
                bin.display(),
                self.plan.out.join(format!("migrate-{label}.log")).display()
            );
        }
        Ok(())
    }

    /// `bin migrate`; whether it succeeded. Its output goes to the report.
    async fn migrate_ok(&mut self, bin: &Path, label: &str) -> anyhow::Result<bool> {
        let out = Command::new(bin)
            .arg("migrate")
            .env("DATABASE_URL", &self.url)
            .stdin(Stdio::null())
            .output()
            .await
            .with_context(|| format!("running {} migrate", bin.display()))?;
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        std::fs::write(self.plan.out.join(format!("migrate-{label}.log")), &text)?;
        println!("upgrade: migrate ({label}): {}", text.trim());
        if !out.status.success() {
            self.notes
                .push(format!("migrate ({label}) said: {}", text.trim()));
        }
        Ok(out.status.success())
    }

    /// N's `migrate --status`, kept for the report.
    async fn status(&mut self, bin: &Path, label: &str) {
        let out = Command::new(bin)
            .args(["migrate", "--status"])
            .env("DATABASE_URL", &self.url)
            .stdin(Stdio::null())
            .output()
            .await;
        let text = match out {
            Ok(out) => format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => format!("could not run migrate --status: {e}"),
        };
        let _ = std::fs::write(self.plan.out.join(format!("status-{label}.txt")), &text);
        println!("upgrade: migrate --status ({label}):\n{text}");
        self.notes
            .push(format!("migrate --status ({label}):\n{text}"));
    }

    /// Starts `bin`'s process for `door`, waits until it is ready, and
    /// hands it to the clients.
    async fn start(&mut self, bin: &Path, release: &str, door: Door) -> anyhow::Result<()> {
        let id = self.shared.endpoints.bases.read().map_or(0, |b| b.len());
        let name = format!(
            "{release} {} #{id}",
            if door == Door::Proxy {
                "proxy"
            } else {
                "serve"
            }
        );
        let port = crate::cluster::free_port()?;
        let log = std::fs::File::create(self.plan.out.join(format!(
            "{}.log",
            name.replace([' ', '#'], "-").to_lowercase()
        )))?;
        let mut cmd = Command::new(bin);
        cmd.env("DATABASE_URL", &self.url)
            .env("RUST_LOG", "info")
            .env_remove("IDEMGATE_TOKENS")
            .env_remove("IDEMGATE_LISTEN")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        let base = format!("http://127.0.0.1:{port}");
        let ready = match door {
            Door::Proxy => {
                let admin = crate::cluster::free_port()?;
                cmd.args(["proxy", "--upstream", &self.shared.origin])
                    .args(["--listen", &format!("127.0.0.1:{port}")])
                    .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
                    .args(["--on-lease-expiry", "hold"])
                    .args(["--default-lease", &LEASE_SECS.to_string()]);
                format!("http://127.0.0.1:{admin}/readyz")
            }
            Door::Api => {
                cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")]);
                format!("{base}/readyz")
            }
        };
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut proc = Proc {
            name: name.clone(),
            door,
            id,
            child,
            ready,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(res) = self.shared.http.get(&proc.ready).send().await
                && res.status() == 200
            {
                break;
            }
            if let Ok(Some(status)) = proc.child.try_wait() {
                bail!(
                    "{name} ({}) exited at start ({status}): see its log in {}",
                    bin.display(),
                    self.plan.out.display()
                );
            }
            if Instant::now() > deadline {
                bail!("{name} was not ready within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.shared
            .endpoints
            .bases
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(base);
        self.shared
            .endpoints
            .live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, door));
        println!("upgrade: {name} ready");
        self.procs.push(proc);
        Ok(())
    }

    /// Takes the processes whose name starts with `prefix` from the clients,
    /// then stops them with SIGTERM (their calls finish and commit). A door
    /// left with no process is drained first: its clients take no new key
    /// and finish the ones they drive (a reservation's commit needs a
    /// `serve`), as a deployment drains a process before it stops it.
    async fn stop_where(&mut self, prefix: &str) {
        let (stopping, keep): (Vec<Proc>, Vec<Proc>) = std::mem::take(&mut self.procs)
            .into_iter()
            .partition(|p| p.name.starts_with(prefix));
        self.procs = keep;
        let mut drained = Vec::new();
        for door in [Door::Proxy, Door::Api] {
            let stops = stopping.iter().any(|p| p.door == door);
            let stays = self.procs.iter().any(|p| p.door == door);
            if stops && !stays {
                let d = door.index();
                self.shared.paused[d].store(true, Ordering::SeqCst);
                let deadline = Instant::now() + BUDGET + Duration::from_secs(5);
                while self.shared.busy[d].load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                drained.push(d);
            }
        }
        {
            let mut live = self
                .shared
                .endpoints
                .live
                .write()
                .unwrap_or_else(|e| e.into_inner());
            live.retain(|(id, _)| !stopping.iter().any(|p| p.id == *id));
        }
        for mut p in stopping {
            terminate(&mut p).await;
        }
        for d in drained {
            self.shared.paused[d].store(false, Ordering::SeqCst);
        }
    }

    async fn stop_all(&mut self) {
        self.stop_where("").await;
    }

    /// Waits out the leases, then sends every key once more through the
    /// processes left (on SQLite, N−1's proxy and then its serve).
    async fn finale(&mut self) -> anyhow::Result<()> {
        self.phase("the leases run out");
        tokio::time::sleep(Duration::from_secs(LEASE_SECS + 1)).await;
        let doors: Vec<(Door, Option<PathBuf>)> = if self.plan.database_url.is_some() {
            vec![(Door::Proxy, None), (Door::Api, None)]
        } else {
            let last = if self.plan.no_rollback {
                self.plan.current.clone()
            } else {
                self.plan.previous.clone()
            };
            vec![(Door::Proxy, Some(last.clone())), (Door::Api, Some(last))]
        };
        for (door, start) in doors {
            if let Some(bin) = start {
                let release = if bin == self.plan.previous {
                    "N-1"
                } else {
                    "N"
                };
                self.start(&bin, release, door).await?;
            }
            self.phase(&format!("every {door:?} key once more").to_lowercase());
            let n = match door {
                Door::Proxy => self.shared.proxy_keys.load(Ordering::SeqCst),
                Door::Api => self.shared.api_keys.load(Ordering::SeqCst),
            };
            let mut rng = StdRng::seed_from_u64(self.plan.seed ^ 0xf1a1);
            for i in 0..n {
                once_more(&self.shared, door, i, &mut rng).await;
            }
            if self.plan.database_url.is_none() {
                self.stop_where("").await;
            }
        }
        Ok(())
    }
}

/// SIGTERM, then up to 20 s for a clean exit, then SIGKILL.
async fn terminate(p: &mut Proc) {
    if let Some(pid) = p.child.id() {
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await;
    }
    match tokio::time::timeout(Duration::from_secs(20), p.child.wait()).await {
        Ok(Ok(status)) => println!("upgrade: {} stopped ({status})", p.name),
        _ => {
            let _ = p.child.kill().await;
            println!("upgrade: {} killed after 20 s", p.name);
        }
    }
}

/// A client: new keys and earlier ones of its door, each driven to its
/// end, until the run stops.
async fn client(shared: Arc<Shared>, c: usize, door: Door) {
    let mut rng = StdRng::seed_from_u64(shared.seed.wrapping_add(500 + c as u64));
    let name = format!("c{c}");
    let d = door.index();
    while !shared.stop.load(Ordering::SeqCst) {
        // Busy first, then the pause: a drain that sees no one busy is
        // sure that no one takes a key until it ends.
        shared.busy[d].fetch_add(1, Ordering::SeqCst);
        if shared.paused[d].load(Ordering::SeqCst)
            || shared.endpoints.pick(door, &mut rng).is_none()
        {
            shared.busy[d].fetch_sub(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let counter = match door {
            Door::Proxy => &shared.proxy_keys,
            Door::Api => &shared.api_keys,
        };
        let issued = counter.load(Ordering::SeqCst);
        let i = if issued > 0 && rng.random_bool(0.3) {
            rng.random_range(0..issued)
        } else {
            counter.fetch_add(1, Ordering::SeqCst)
        };
        match door {
            Door::Proxy => drive_proxy(&shared, &name, i, &mut rng).await,
            Door::Api => drive_api(&shared, &name, i, &mut rng).await,
        }
        shared.busy[d].fetch_sub(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(rng.random_range(10..40))).await;
    }
}

/// The most time a client spends on one key.
const BUDGET: Duration = Duration::from_secs(30);

/// Drives proxy key `i` by the campaign's retry table.
async fn drive_proxy(shared: &Shared, client: &str, i: usize, rng: &mut StdRng) {
    let key = key_of(shared.seed, Door::Proxy, i);
    let deadline = Instant::now() + BUDGET;
    let mut try_no = 0;
    loop {
        let Some(id) = shared.endpoints.pick(Door::Proxy, rng) else {
            if Instant::now() > deadline {
                return done(shared, &key, client, "gave_up", try_no);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        try_no += 1;
        let attempt = Attempt {
            key: &key,
            number: i,
            client,
            proxy: id,
            try_no,
            no_wait: false,
        };
        let bases = shared.endpoints.all_bases();
        let r = clients::send(
            &shared.http,
            &bases,
            &attempt,
            Duration::from_secs(20),
            &shared.rec,
        )
        .await;
        let status = r.status;
        let problem = r.problem.clone();
        let retry_after = r.retry_after;
        shared.rec.record(&Event::Request(r));
        let wait = match (status, problem.as_deref()) {
            (None, _) | (Some(502..=504), _) => Duration::from_millis(100),
            (Some(409), Some("outcome-unknown")) => {
                return done(shared, &key, client, "dead_lettered", try_no);
            }
            (Some(409 | 429 | 425 | 408), _) => {
                Duration::from_secs(retry_after.unwrap_or(1).min(1))
            }
            _ => return done(shared, &key, client, "done", try_no),
        };
        if Instant::now() + wait > deadline {
            return done(shared, &key, client, "gave_up", try_no);
        }
        tokio::time::sleep(wait).await;
    }
}

fn done(shared: &Shared, key: &str, client: &str, outcome: &str, tries: u32) {
    shared.rec.record(&Event::KeyDone(KeyDone {
        key: key.to_owned(),
        client: client.to_owned(),
        outcome: outcome.to_owned(),
        tries,
        at: shared.rec.now(),
    }));
}

/// The request body of API key `i` (its fingerprint's input).
fn api_request(i: usize) -> serde_json::Value {
    serde_json::json!({
        "request": {"method": "POST", "path": format!("/charge/{i}"),
                    "body": format!(r#"{{"order":{i}}}"#)},
        "lease_seconds": LEASE_SECS,
        "on_lease_expiry": "hold",
    })
}

/// One HTTP call of the API door, recorded as a request of `who`
/// (`c3/reserve`, `c3/commit`, `final/reserve`).
async fn call(
    shared: &Shared,
    who: &str,
    key: &str,
    id: usize,
    url: String,
    body: serde_json::Value,
    with_key: bool,
) -> (Option<u16>, Option<String>, Option<u64>, serde_json::Value) {
    let mut req = shared
        .http
        .post(url)
        .header("content-type", "application/json")
        .timeout(Duration::from_secs(20))
        .body(body.to_string());
    if with_key {
        req = req.header("idempotency-key", key);
    }
    let mut r = Request {
        key: key.to_owned(),
        client: who.to_owned(),
        proxy: id,
        start: shared.rec.now(),
        ..Request::default()
    };
    let mut json = serde_json::Value::Null;
    match req.send().await {
        Ok(res) => {
            let status = res.status().as_u16();
            r.status = Some(status);
            r.replayed = res
                .headers()
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true");
            r.retry_after = res
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse().ok());
            let text = res.text().await.unwrap_or_default();
            json = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
            if let Some(t) = json.get("type").and_then(|t| t.as_str()) {
                r.problem = Some(t.rsplit('/').next().unwrap_or(t).to_owned());
            } else {
                r.body = Some(text);
            }
        }
        Err(e) => r.error = Some(if e.is_connect() { "connect" } else { "broken" }.into()),
    }
    r.end = shared.rec.now();
    let out = (r.status, r.problem.clone(), r.retry_after, json);
    shared.rec.record(&Event::Request(r));
    out
}

/// Drives API key `i`: reserve through any serve; on 201 run the effect at
/// the origin and commit through any serve (of either release); a replay
/// ends it.
async fn drive_api(shared: &Shared, client: &str, i: usize, rng: &mut StdRng) {
    let key = key_of(shared.seed, Door::Api, i);
    let deadline = Instant::now() + BUDGET;
    let mut tries = 0;
    while Instant::now() < deadline {
        let Some(id) = shared.endpoints.pick(Door::Api, rng) else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        tries += 1;
        let url = format!("{}/v1/reservations", shared.endpoints.base(id));
        let (status, problem, retry_after, json) = call(
            shared,
            &format!("{client}/reserve"),
            &key,
            id,
            url,
            api_request(i),
            true,
        )
        .await;
        match (status, problem.as_deref()) {
            (Some(201), _) => {
                let reservation = json["reservation_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                let outcome = effect_and_commit(shared, client, &key, i, &reservation, rng).await;
                return done(shared, &key, client, outcome, tries);
            }
            (Some(200), _) => return done(shared, &key, client, "done", tries),
            (Some(409), Some("outcome-unknown")) => {
                return done(shared, &key, client, "dead_lettered", tries);
            }
            (Some(409 | 429), _) => {
                tokio::time::sleep(Duration::from_secs(retry_after.unwrap_or(1).min(1))).await;
            }
            (None, _) | (Some(502..=504), _) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            _ => return done(shared, &key, client, "unexpected", tries),
        }
    }
    done(shared, &key, client, "gave_up", tries)
}

/// The effect at the origin, then its commit, through any serve, until one
/// answers.
async fn effect_and_commit(
    shared: &Shared,
    client: &str,
    key: &str,
    i: usize,
    reservation: &str,
    rng: &mut StdRng,
) -> &'static str {
    let effect = shared
        .http
        .post(format!("{}/charge/{i}", shared.origin))
        .header("idempotency-key", key)
        .header(VIA, "1000")
        .timeout(Duration::from_secs(20))
        .body(format!(r#"{{"order":{i}}}"#))
        .send()
        .await;
    let (status, body) = match effect {
        Ok(res) => (res.status().as_u16(), res.text().await.unwrap_or_default()),
        // The origin is local and never fails here.
        Err(_) => return "origin_failed",
    };
    let commit = serde_json::json!({
        "status": status,
        "headers": [["content-type", "application/json"]],
        "body": body,
    });
    let deadline = Instant::now() + BUDGET;
    while Instant::now() < deadline {
        let Some(id) = shared.endpoints.pick(Door::Api, rng) else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let url = format!(
            "{}/v1/reservations/{reservation}/commit",
            shared.endpoints.base(id)
        );
        let (status, _, _, _) = call(
            shared,
            &format!("{client}/commit"),
            key,
            id,
            url,
            commit.clone(),
            false,
        )
        .await;
        match status {
            Some(200) => return "done",
            None | Some(502..=504) => tokio::time::sleep(Duration::from_millis(100)).await,
            // 404 not-found, 409 lease-lost: the key is stranded.
            _ => return "commit_lost",
        }
    }
    "gave_up"
}

/// Key `i` of `door` sent once more (retried only while no answer comes or
/// the store is unavailable); a reservation this grants is released.
async fn once_more(shared: &Shared, door: Door, i: usize, rng: &mut StdRng) {
    let key = key_of(shared.seed, door, i);
    for _ in 0..50 {
        let Some(id) = shared.endpoints.pick(door, rng) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let status = match door {
            Door::Proxy => {
                let attempt = Attempt {
                    key: &key,
                    number: i,
                    client: "final",
                    proxy: id,
                    try_no: 1,
                    no_wait: true,
                };
                let bases = shared.endpoints.all_bases();
                let r = clients::send(
                    &shared.http,
                    &bases,
                    &attempt,
                    Duration::from_secs(20),
                    &shared.rec,
                )
                .await;
                let status = r.status;
                shared.rec.record(&Event::Request(r));
                status
            }
            Door::Api => {
                let url = format!("{}/v1/reservations", shared.endpoints.base(id));
                let (status, _, _, json) =
                    call(shared, "final/reserve", &key, id, url, api_request(i), true).await;
                if status == Some(201)
                    && let Some(r) = json["reservation_id"].as_str()
                {
                    let url = format!("{}/v1/reservations/{r}/release", shared.endpoints.base(id));
                    let _ = shared.http.post(url).send().await;
                }
                status
            }
        };
        match status {
            None | Some(503) => tokio::time::sleep(Duration::from_millis(100)).await,
            _ => return,
        }
    }
}

/// The checker's verdict.
struct Report {
    text: String,
    passed: bool,
}

/// Reads every answer and every execution.
fn check(events: &[Event], notes: &[String]) -> Report {
    #[derive(Default)]
    struct Key<'a> {
        executions: Vec<&'a history::Execution>,
        /// Successful answers' bodies (the effect's response as replayed).
        bodies: Vec<String>,
        before_final_ok: bool,
        final_answer: Option<&'a Request>,
        stranded: Vec<String>,
    }
    let mut keys: BTreeMap<&str, Key<'_>> = BTreeMap::new();
    let mut answers = 0usize;
    let mut errors_500 = Vec::new();
    let mut other_5xx = 0usize;
    let mut no_answer = 0usize;
    let mut gave_up = Vec::new();
    for event in events {
        match event {
            Event::Execution(e) => keys.entry(&e.key).or_default().executions.push(e),
            Event::KeyDone(d) => {
                if matches!(
                    d.outcome.as_str(),
                    "gave_up" | "unexpected" | "origin_failed"
                ) {
                    gave_up.push(format!("{} ({})", d.key, d.outcome));
                }
            }
            Event::Request(r) => {
                let k = keys.entry(&r.key).or_default();
                let is_final = r.client.starts_with("final");
                let Some(status) = r.status else {
                    no_answer += 1;
                    continue;
                };
                answers += 1;
                if status == 500 {
                    errors_500.push(format!("{} {} → 500", r.client, r.key));
                } else if status >= 500 {
                    other_5xx += 1;
                }
                if r.problem.as_deref() == Some("outcome-unknown") {
                    k.stranded
                        .push(format!("{}: 409 outcome-unknown", r.client));
                }
                if r.client.ends_with("/commit") && matches!(status, 404 | 409) {
                    k.stranded.push(format!(
                        "{}: commit answered {status} {}",
                        r.client,
                        r.problem.as_deref().unwrap_or("")
                    ));
                }
                if let Some(body) = success_body(r) {
                    k.bodies.push(body);
                    if !is_final {
                        k.before_final_ok = true;
                    }
                }
                if is_final {
                    k.final_answer = Some(r);
                }
            }
            _ => {}
        }
    }
    let mut twice = Vec::new();
    let mut stranded = Vec::new();
    let mut not_replayed = Vec::new();
    let mut mismatched = Vec::new();
    for (key, k) in &keys {
        let acted: Vec<_> = k.executions.iter().filter(|e| e.acted).collect();
        if acted.len() > 1 {
            twice.push(format!(
                "{key}: executions {}",
                acted
                    .iter()
                    .map(|e| e.seq.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if !k.stranded.is_empty() {
            stranded.push(format!("{key}: {}", k.stranded.join("; ")));
        }
        if k.before_final_ok {
            let replayed = k.final_answer.is_some_and(|r| {
                success_body(r).is_some() && (r.replayed || r.client.ends_with("/reserve"))
            });
            if !replayed {
                not_replayed.push(format!(
                    "{key}: {}",
                    k.final_answer
                        .map_or("not sent at the end".to_owned(), |r| format!(
                            "{:?} {}",
                            r.status,
                            r.problem.as_deref().unwrap_or("")
                        ))
                ));
            }
        }
        if let Some(first) = acted.first() {
            let body = &first.body;
            if k.bodies.iter().any(|b| b != body) {
                mismatched.push(format!("{key}: an answer's body is not its execution's"));
            }
        }
    }
    let proxy_keys = keys.keys().filter(|k| !k.contains("-api-")).count();
    let api_keys = keys.len() - proxy_keys;
    let executions: usize = keys.values().map(|k| k.executions.len()).sum();
    let passed = twice.is_empty()
        && stranded.is_empty()
        && errors_500.is_empty()
        && not_replayed.is_empty()
        && mismatched.is_empty()
        && gave_up.is_empty()
        && !keys.is_empty();
    let mut text = String::new();
    let mut line = |s: String| {
        text.push_str(&s);
        text.push('\n');
    };
    for note in notes {
        line(format!("note: {}", note.trim_end()));
    }
    line(format!(
        "keys: {} ({proxy_keys} through the proxies, {api_keys} through the reservation API); executions: {executions}; answers: {answers} (no answer: {no_answer}, 502/503/504: {other_5xx})",
        keys.len()
    ));
    let mut verdict = |name: &str, list: &[String]| {
        line(format!("{name}: {}", list.len()));
        for item in list.iter().take(10) {
            line(format!("  {item}"));
        }
    };
    verdict("run twice", &twice);
    verdict(
        "stranded (held unknown, or a commit that found no reservation)",
        &stranded,
    );
    verdict("500 answers", &errors_500);
    verdict(
        "keys from before that did not replay at the end",
        &not_replayed,
    );
    verdict("answers whose body is not the execution's", &mismatched);
    verdict("keys a client could not finish", &gave_up);
    line(format!(
        "upgrade check: {}",
        if passed { "PASSED" } else { "FAILED" }
    ));
    Report { text, passed }
}

/// The effect's response an answer carries, if it carries one: a proxy's
/// 201 (executed or replayed), or the reservation API's replay (200) or
/// commit... (a commit's answer is the view, not the response).
fn success_body(r: &Request) -> Option<String> {
    let status = r.status?;
    if r.client.ends_with("/commit") {
        return None;
    }
    if r.client.ends_with("/reserve") {
        if status != 200 {
            return None;
        }
        let json: serde_json::Value = serde_json::from_str(r.body.as_deref()?).ok()?;
        return json["response"]["body"].as_str().map(str::to_owned);
    }
    (status == 201).then(|| r.body.clone()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Execution;

    fn execution(key: &str, seq: u64) -> Event {
        Event::Execution(Execution {
            seq,
            key: key.into(),
            mode: "normal".into(),
            acted: true,
            status: 201,
            body: format!("body {seq}"),
            ..Execution::default()
        })
    }

    fn answer(key: &str, client: &str, status: u16, body: Option<&str>, replayed: bool) -> Event {
        Event::Request(Request {
            key: key.into(),
            client: client.into(),
            status: Some(status),
            replayed,
            body: body.map(str::to_owned),
            problem: (status == 409).then(|| "outcome-unknown".to_owned()),
            ..Request::default()
        })
    }

    #[test]
    fn a_key_executed_once_and_replayed_at_the_end_passes() {
        let events = [
            execution("k", 1),
            answer("k", "c0", 201, Some("body 1"), false),
            answer("k", "final", 201, Some("body 1"), true),
        ];
        assert!(check(&events, &[]).passed);
    }

    #[test]
    fn a_key_run_twice_a_stranded_key_and_a_500_each_fail_the_check() {
        let twice = [
            execution("k", 1),
            execution("k", 2),
            answer("k", "c0", 201, Some("body 1"), false),
            answer("k", "final", 201, Some("body 1"), true),
        ];
        let report = check(&twice, &[]);
        assert!(
            !report.passed && report.text.contains("run twice: 1"),
            "{}",
            report.text
        );

        let stranded = [
            execution("k", 1),
            answer("k", "c0", 201, Some("body 1"), false),
            answer("k", "final", 409, None, false),
        ];
        let report = check(&stranded, &[]);
        assert!(!report.passed, "{}", report.text);
        assert!(
            report.text.contains("did not replay at the end: 1"),
            "{}",
            report.text
        );

        let error = [
            execution("k", 1),
            answer("k", "c0", 500, None, false),
            answer("k", "c1", 201, Some("body 1"), false),
            answer("k", "final", 201, Some("body 1"), true),
        ];
        let report = check(&error, &[]);
        assert!(
            !report.passed && report.text.contains("500 answers: 1"),
            "{}",
            report.text
        );
    }
}
