//! The nemesis: at random moments (a seeded RNG), a fault on a proxy or the
//! database — `kill -9` then a restart, `SIGSTOP` past the lease then
//! `SIGCONT`, a PostgreSQL restart, or a partition of one proxy from the
//! database past the lease. Each fault heals itself when it ends and is
//! recorded with its start and end. Faults overlap, but never two on one
//! target, and one proxy is always left alone so keys keep completing.
//! (The origin's faults are the origin's: see [`crate::origin`].)

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};
use tokio::sync::{Mutex, watch};
use tokio::task::JoinSet;

use crate::cluster::Cluster;
use crate::history::{Event, Fault, Recorder};

/// A fault the nemesis injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Kill,
    Stop,
    PgRestart,
    Partition,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Kill => "kill",
            Kind::Stop => "stop",
            Kind::PgRestart => "pg-restart",
            Kind::Partition => "partition",
        }
    }
}

/// How the nemesis behaves.
#[derive(Debug, Clone)]
pub struct Settings {
    pub kinds: Vec<Kind>,
    /// Between the starts of two faults, in milliseconds.
    pub every_ms: (u64, u64),
    /// The proxies' lease: pauses and partitions outlast it.
    pub lease: Duration,
    pub seed: u64,
}

/// The running nemesis.
pub struct Nemesis {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Nemesis {
    pub fn start(cluster: Arc<Cluster>, rec: Arc<Recorder>, s: Settings) -> Nemesis {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(inject(cluster, rec, s, stopped));
        Nemesis { stop, task }
    }

    /// Injects no more faults, and returns once every running one has ended
    /// (healed itself).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// What a fault is done to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Target {
    Proxy(usize),
    Postgres,
}

async fn inject(
    cluster: Arc<Cluster>,
    rec: Arc<Recorder>,
    s: Settings,
    mut stopped: watch::Receiver<bool>,
) {
    if s.kinds.is_empty() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(s.seed.wrapping_add(31));
    let busy = Arc::new(Mutex::new(HashSet::new()));
    let mut running = JoinSet::new();
    // A shuffled deck, so that even a short run gets each kind.
    let mut deck: Vec<Kind> = Vec::new();
    let proxies = cluster.proxies.len();
    loop {
        let pause = Duration::from_millis(rng.random_range(s.every_ms.0..=s.every_ms.1));
        tokio::select! {
            _ = stopped.changed() => break,
            () = tokio::time::sleep(pause) => {}
        }
        if deck.is_empty() {
            deck = s.kinds.clone();
            deck.shuffle(&mut rng);
        }
        let kind = deck[deck.len() - 1];
        let target = {
            let busy = busy.lock().await;
            if kind == Kind::PgRestart {
                (!busy.contains(&Target::Postgres)).then_some(Target::Postgres)
            } else {
                let free: Vec<usize> = (0..proxies)
                    .filter(|i| !busy.contains(&Target::Proxy(*i)))
                    .collect();
                // Leave one proxy alone, unless there is only one.
                let enough = if proxies > 1 {
                    free.len() >= 2
                } else {
                    !free.is_empty()
                };
                enough.then(|| Target::Proxy(free[rng.random_range(0..free.len())]))
            }
        };
        // Its target is busy: the kind waits for a later turn.
        let Some(target) = target else { continue };
        deck.pop();
        busy.lock().await.insert(target);
        // Drawn here, so the seed decides them whatever the timing.
        let length = s.lease + Duration::from_millis(rng.random_range(500..3000));
        let pause = Duration::from_millis(rng.random_range(300..3000));
        let immediate = rng.random_bool(0.5);
        let (cluster, rec, busy) = (cluster.clone(), rec.clone(), busy.clone());
        running.spawn(async move {
            let start = rec.now();
            let note = match apply(&cluster, kind, target, length, pause, immediate).await {
                Ok(note) => note,
                Err(e) => {
                    eprintln!(
                        "campaign: fault {} on {target:?} failed: {e:#}",
                        kind.name()
                    );
                    format!("error: {e:#}")
                }
            };
            rec.record(&Event::Fault(Fault {
                kind: kind.name().into(),
                target: match target {
                    Target::Proxy(i) => format!("proxy-{i}"),
                    Target::Postgres => "postgres".into(),
                },
                start,
                end: rec.now(),
                note: Some(note),
            }));
            busy.lock().await.remove(&target);
        });
    }
    while running.join_next().await.is_some() {}
}

/// Does one fault and undoes it; says how it went.
async fn apply(
    cluster: &Cluster,
    kind: Kind,
    target: Target,
    length: Duration,
    pause: Duration,
    immediate: bool,
) -> anyhow::Result<String> {
    let proxies = &cluster.proxies;
    match (kind, target) {
        (Kind::Kill, Target::Proxy(i)) => {
            proxies.kill(i).await;
            tokio::time::sleep(pause).await;
            proxies.ensure_running(i, Duration::from_secs(60)).await?;
            Ok(format!("kill -9, restarted after {} ms", pause.as_millis()))
        }
        (Kind::Stop, Target::Proxy(i)) => {
            proxies.signal(i, "STOP").await?;
            tokio::time::sleep(length).await;
            proxies.signal(i, "CONT").await?;
            Ok(format!("SIGSTOP for {} ms", length.as_millis()))
        }
        (Kind::Partition, Target::Proxy(i)) => {
            let net = cluster
                .net
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("no network namespaces"))?;
            net.set_db_link(i, false).await?;
            tokio::time::sleep(length).await;
            net.set_db_link(i, true).await?;
            Ok(format!(
                "cut from the database for {} ms",
                length.as_millis()
            ))
        }
        (Kind::PgRestart, Target::Postgres) => {
            let pg = cluster
                .pg
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("no PostgreSQL"))?;
            let mode = if immediate { "immediate" } else { "fast" };
            pg.stop(mode).await?;
            tokio::time::sleep(pause).await;
            pg.start_again().await?;
            Ok(format!(
                "pg_ctl stop -m {mode}, down {} ms",
                pause.as_millis()
            ))
        }
        _ => anyhow::bail!("{kind:?} does not apply to {target:?}"),
    }
}
