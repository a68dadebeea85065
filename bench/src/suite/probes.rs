//! The probe windows: each door at c = 8 once more, on the probe build
//! (`--probe-idemgate`: counting allocator, symbols), for what the
//! throughput measurements cannot read without disturbing them: its
//! allocations per key (from its `/metrics`), its syscalls per key
//! (`strace -c -f` attached for one window) and, with `--flamegraphs`, a
//! flamegraph of one window (`perf record`). Run once, after the first
//! run's scenarios: these counts move little from run to run.

use std::net::SocketAddr;

use super::{Env, Results, api_pairs, measure, posts};
use crate::costs::{Db, Meter, PerKey};
use crate::load::Sample;
use crate::metrics;
use crate::probe;
use crate::procs::{self, Door, Proc};
use crate::workers::Keys;

/// The concurrency the probes load each door at.
const C: usize = 8;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    ServePostgres,
    ServeSqlite,
    ProxyPostgres,
    ProxySqlite,
    Peer,
}

/// A door the probes look into.
struct ProbeDoor {
    kind: Kind,
    /// The label of its throughput measurement, whose per-key row this
    /// completes.
    label: &'static str,
    /// Its files' name.
    file: &'static str,
    title: &'static str,
    /// The scenario it belongs to (`--only`).
    scenario: &'static str,
}

const DOORS: [ProbeDoor; 5] = [
    ProbeDoor {
        kind: Kind::ServePostgres,
        label: "api-pair c=8",
        file: "serve-postgresql",
        title: "idemgate serve on PostgreSQL: reserve + commit, c = 8",
        scenario: "sql",
    },
    ProbeDoor {
        kind: Kind::ServeSqlite,
        label: "sqlite-pair c=8",
        file: "serve-sqlite",
        title: "idemgate serve on SQLite: reserve + commit, c = 8",
        scenario: "sqlite",
    },
    ProbeDoor {
        kind: Kind::ProxyPostgres,
        label: "idemgate-new c=8",
        file: "proxy-postgresql",
        title: "idemgate proxy on PostgreSQL: new keys, c = 8",
        scenario: "proxy",
    },
    ProbeDoor {
        kind: Kind::ProxySqlite,
        label: "idemgate-sqlite-new c=8",
        file: "proxy-sqlite",
        title: "idemgate proxy on SQLite: new keys, c = 8",
        scenario: "proxy",
    },
    ProbeDoor {
        kind: Kind::Peer,
        label: "ipx-new c=8",
        file: "idempotent-proxy",
        title: "idempotent-proxy on Redis: new keys, c = 8",
        scenario: "proxy",
    },
];

/// Starts the door on a fresh store: the probe build of idemgate, or the
/// peer. Returns it, its address and the path its requests go to.
async fn start(
    env: &Env,
    kind: Kind,
    origin: SocketAddr,
) -> anyhow::Result<Option<(Proc, SocketAddr, &'static str)>> {
    let log = env.log("idemgate-probe");
    let (door, url) = match kind {
        Kind::Peer => {
            let Some(bin) = &env.ipx else {
                return Ok(None);
            };
            let (proc, addr) = env.ipx(bin, origin).await?;
            return Ok(Some((proc, addr, "/URL_ORIGIN")));
        }
        Kind::ServePostgres => (Door::Serve, env.bench_url.clone()),
        Kind::ServeSqlite => (Door::Serve, env.sqlite_url("probe")),
        Kind::ProxyPostgres => (Door::Proxy(origin), env.bench_url.clone()),
        Kind::ProxySqlite => (Door::Proxy(origin), env.sqlite_url("probe")),
    };
    if matches!(kind, Kind::ServePostgres | Kind::ProxyPostgres) {
        env.truncate().await?;
    }
    let (proc, addr) = procs::idemgate(
        "idemgate (probe build)",
        &env.probe_idemgate,
        &door,
        &url,
        &[],
        &log,
    )
    .await?;
    Ok(Some((proc, addr, "/v1/charges")))
}

/// One window of the door's load at [`C`], new keys each time.
async fn window(env: &Env, kind: Kind, addr: SocketAddr, path: &str) -> anyhow::Result<Sample> {
    match kind {
        Kind::ServePostgres | Kind::ServeSqlite => measure(env, api_pairs(env, addr, C)).await,
        _ => {
            let keys = Keys::Fresh(env.fresh_prefix());
            measure(env, posts(addr, path, &keys, C)).await
        }
    }
}

/// Every wanted door's probe windows.
pub(super) async fn probes(env: &Env, origin: SocketAddr, res: &mut Results) -> anyhow::Result<()> {
    for door in &DOORS {
        if !env.wants(door.scenario) {
            continue;
        }
        let Some((proc, addr, path)) = start(env, door.kind, origin).await? else {
            continue;
        };
        println!("  probing {}", door.title);
        let result = probe_door(env, door, &proc, addr, path, res).await;
        proc.stop().await;
        result?;
    }
    Ok(())
}

async fn probe_door(
    env: &Env,
    door: &ProbeDoor,
    proc: &Proc,
    addr: SocketAddr,
    path: &str,
    res: &mut Results,
) -> anyhow::Result<()> {
    let pid = proc.pid().unwrap_or(0);
    // Allocations: only a build with the count-alloc feature has them.
    if let Some(m) = proc.metrics_addr()
        && metrics::allocations(m).await.is_some()
    {
        let meter = Meter {
            proc: None,
            metrics: Some(m),
            db: Db::None,
        };
        let before = meter.before().await;
        let sample = window(env, door.kind, addr, path).await?;
        let after = meter.after(&before).await;
        res.record_costs(door.label, &before, &after, sample.all_ops);
    }
    if env.strace {
        let traced = probe::strace(
            pid,
            &env.work,
            door.file,
            window(env, door.kind, addr, path),
        );
        match traced.await {
            Ok((sample, calls)) if sample.all_ops > 0 => {
                let keys = sample.all_ops as f64;
                res.add_costs(
                    door.label,
                    PerKey {
                        syscalls: Some(calls.total as f64 / keys),
                        ..PerKey::default()
                    },
                );
                let by_name = calls
                    .by_name
                    .into_iter()
                    .map(|(name, n)| (name, n as f64 / keys))
                    .collect();
                res.syscalls.insert(door.label.to_owned(), by_name);
            }
            Ok(_) => {}
            Err(e) => res
                .notes
                .push(format!("syscalls per key of {}: n/a ({e:#})", door.title)),
        }
    }
    if let Some(dir) = env.flame_dir.as_ref().filter(|_| door.kind != Kind::Peer) {
        let svg = dir.join(format!("{}.svg", door.file));
        let drawn = probe::flamegraph(
            pid,
            &env.work,
            door.file,
            door.title,
            &svg,
            window(env, door.kind, addr, path),
        )
        .await;
        match drawn {
            Ok(_) => {
                let dir_name = dir
                    .file_name()
                    .map_or(String::new(), |d| d.to_string_lossy().into_owned());
                let link = format!("{dir_name}/{}.svg", door.file);
                println!("    flamegraph: {}", svg.display());
                res.flamegraphs.insert(door.label.to_owned(), link);
            }
            Err(e) => res
                .notes
                .push(format!("no flamegraph of {}: {e:#}", door.title)),
        }
    }
    Ok(())
}
