//! One run, from the first proxy to the checker's verdict: start the
//! origin and the cluster, let the clients and the nemesis loose for the
//! run's duration, then stop the faults, heal everything, let the clients
//! finish, wait past the leases, stop the proxies, list every key, settle
//! the unknown ones as an operator, and check.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;

use crate::checker::{self, Listing};
use crate::cluster::{self, Cluster, Store};
use crate::faults::{self, Kind, Nemesis};
use crate::history::{Event, Recorder, RunInfo};
use crate::origin::{Origin, OriginFaults};
use crate::{clients, operator};

/// Everything a run needs, presets applied.
#[derive(Debug, Clone)]
pub struct Plan {
    pub store: Store,
    pub proxies: usize,
    pub keys: usize,
    pub clients: usize,
    pub duration: Duration,
    pub budget: Duration,
    pub seed: u64,
    pub on_lease_expiry: String,
    pub faults: Vec<String>,
    pub fault_every_ms: (u64, u64),
    /// The origin's release, hang-up, stall and slow shares.
    pub origin_rates: [f64; 4],
    pub upstream_timeout: u64,
    pub out: PathBuf,
    pub idemgate: PathBuf,
    pub pg_bindir: Option<PathBuf>,
    pub operator: bool,
}

impl Plan {
    /// The proxies' lease: the upstream timeout plus 5 s.
    fn lease(&self) -> Duration {
        Duration::from_secs(self.upstream_timeout + 5)
    }

    /// A call still running after this is abandoned (outcome unknown).
    fn abandon_after(&self) -> u64 {
        self.upstream_timeout + 4
    }
}

/// Runs the campaign `plan` describes; whether the checker passed it.
pub async fn run(plan: &Plan) -> anyhow::Result<bool> {
    std::fs::create_dir_all(&plan.out)
        .with_context(|| format!("creating {}", plan.out.display()))?;
    println!(
        "campaign: seed {} (rerun with --seed {}), output in {}",
        plan.seed,
        plan.seed,
        plan.out.display()
    );
    if cluster::running_as_root() {
        let removed = cluster::netns::sweep_leftovers();
        if !removed.is_empty() {
            println!(
                "campaign: removed leftovers of an earlier run: {}",
                removed.join(", ")
            );
        }
    }
    let rec = Arc::new(Recorder::create(&plan.out.join("history.jsonl"))?);
    let wanted = |name: &str| plan.faults.iter().any(|f| f == name);
    let t = plan.upstream_timeout * 1000;
    let [release, hangup, stall, slow] = plan.origin_rates;
    let origin_faults = wanted("origin").then_some(OriginFaults {
        release,
        hangup,
        stall,
        slow,
        slow_ms: (t + 500, t + 3000),
        stall_ms: plan.abandon_after() * 1000 + 2000,
    });
    let any: SocketAddr = "0.0.0.0:0".parse()?;
    let origin = Origin::start(any, rec.clone(), origin_faults, plan.seed).await?;

    let flags: Vec<String> = [
        "--upstream-timeout",
        &plan.upstream_timeout.to_string(),
        "--upstream-abandon-after",
        &plan.abandon_after().to_string(),
        "--on-lease-expiry",
        &plan.on_lease_expiry,
        "--default-wait",
        "3",
        "--shutdown-grace",
        "10",
        "--db-acquire-timeout",
        "2",
    ]
    .map(str::to_owned)
    .to_vec();
    let cluster = Arc::new(
        Cluster::start(&cluster::Settings {
            store: plan.store,
            proxies: plan.proxies,
            idemgate: plan.idemgate.clone(),
            flags,
            pg_bindir: plan.pg_bindir.clone(),
            out: plan.out.clone(),
            origin_port: origin.addr.port(),
            partition: wanted("partition"),
        })
        .await?,
    );
    let mut skipped = cluster.skipped.clone();
    let mut kinds = Vec::new();
    for kind in [Kind::Kill, Kind::Stop, Kind::PgRestart, Kind::Partition] {
        if !wanted(kind.name()) {
            continue;
        }
        let possible = match kind {
            Kind::PgRestart => cluster.pg.is_some(),
            Kind::Partition => cluster.net.is_some(),
            Kind::Kill | Kind::Stop => true,
        };
        if possible {
            kinds.push(kind);
        } else if plan.store == Store::Sqlite {
            skipped.push(format!("{}: not applicable to SQLite", kind.name()));
        }
    }
    rec.record(&Event::Run(RunInfo {
        store: format!("{:?}", plan.store).to_lowercase(),
        on_lease_expiry: plan.on_lease_expiry.clone(),
        seed: plan.seed,
        proxies: plan.proxies,
        keys: plan.keys,
        clients: plan.clients,
        duration_secs: plan.duration.as_secs(),
        upstream_timeout_secs: plan.upstream_timeout,
        lease_secs: plan.lease().as_secs(),
        faults: plan.faults.clone(),
        skipped,
        tenant: "anonymous".into(),
    }));

    let nemesis = Nemesis::start(
        cluster.clone(),
        rec.clone(),
        faults::Settings {
            kinds,
            every_ms: plan.fault_every_ms,
            lease: plan.lease(),
            seed: plan.seed,
        },
    );
    let proxies = (0..plan.proxies).map(|i| cluster.proxies.base(i)).collect();
    let clients = tokio::spawn(clients::run(
        clients::Settings {
            clients: plan.clients,
            keys: plan.keys,
            duration: plan.duration,
            budget: plan.budget,
            // Past the longest a proxy keeps a client (the default wait,
            // 3 s, or the upstream timeout), so only a paused or cut-off
            // proxy runs into it.
            request_timeout: Duration::from_secs(plan.upstream_timeout.max(3) + 3),
            seed: plan.seed,
        },
        proxies,
        rec.clone(),
    ));
    tokio::time::sleep(plan.duration).await;

    println!("campaign: faults stop; healing");
    nemesis.stop().await;
    origin.calm();
    rec.phase("faults_stopped");
    cluster.heal().await?;
    rec.phase("healed");
    clients.await?;
    rec.phase("clients_done");
    println!("campaign: clients done; waiting past the leases");
    tokio::time::sleep(plan.lease() + Duration::from_secs(2)).await;
    cluster.proxies.stop_all(Duration::from_secs(15)).await;
    rec.phase("proxies_stopped");

    let all = cluster
        .keys(&["list", "--all", "--limit", "1000", "--json"])
        .await?;
    std::fs::write(plan.out.join("keys.json"), &all)?;
    let unknown = cluster
        .keys(&[
            "list", "--state", "unknown", "--all", "--limit", "1000", "--json",
        ])
        .await?;
    std::fs::write(plan.out.join("unknown.json"), &unknown)?;
    rec.phase("listed");

    if plan.operator {
        let queue: Listing = serde_json::from_str(&unknown).context("reading unknown.json")?;
        let n = operator::settle(&cluster, &origin, &rec, &queue, plan.seed, plan.keys).await?;
        let after = cluster
            .keys(&["list", "--all", "--limit", "1000", "--json"])
            .await?;
        std::fs::write(plan.out.join("keys-after-operator.json"), after)?;
        rec.phase("operator_done");
        println!("campaign: the operator settled {n} unknown key(s)");
    }
    drop(cluster);

    let report = checker::check_dir(&plan.out, None)?;
    let text = report.render();
    std::fs::write(plan.out.join("report.txt"), &text)?;
    print!("{text}");
    Ok(report.passed())
}
