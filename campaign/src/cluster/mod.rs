//! The system under test: PostgreSQL (or a SQLite file), the proxies, and
//! for PostgreSQL a network namespace per proxy so that one can be cut off
//! from the database alone. Everything is removed when the [`Cluster`] is
//! dropped, and by watchdogs if the campaign is killed outright.

pub mod netns;
pub mod pg;
pub mod proxies;

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Stdio};
use std::time::Duration;

use anyhow::{Context as _, bail};

use netns::Net;
use pg::Postgres;
use proxies::{Proxies, Spec};

/// Where the keys live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Postgres,
    Sqlite,
}

/// How to set the cluster up.
pub struct Settings {
    pub store: Store,
    pub proxies: usize,
    pub idemgate: PathBuf,
    /// Flags for every proxy.
    pub flags: Vec<String>,
    pub pg_bindir: Option<PathBuf>,
    /// The run's output directory (logs, the SQLite file).
    pub out: PathBuf,
    pub origin_port: u16,
    /// Whether the partition fault was asked for (namespaces are needed).
    pub partition: bool,
}

/// The running system. Fields drop in order: the proxies first, then their
/// namespaces, then the database.
pub struct Cluster {
    pub proxies: Proxies,
    pub net: Option<Net>,
    pub pg: Option<Postgres>,
    /// The database as `idemgate keys` reaches it from the host.
    cli_url: String,
    idemgate: PathBuf,
    _rundir: tempfile::TempDir,
    _watchdog: ChildStdin,
    /// Faults asked for that this cluster cannot inject, with why.
    pub skipped: Vec<String>,
}

impl Cluster {
    pub async fn start(s: &Settings) -> anyhow::Result<Cluster> {
        let rundir = tempfile::Builder::new()
            .prefix("idemgate-campaign-")
            .tempdir()?;
        let mut skipped = Vec::new();
        let net = match (s.store, s.partition) {
            (Store::Postgres, true) => match Net::available() {
                Ok(()) => Some(Net::setup(s.proxies)?),
                Err(why) => {
                    eprintln!("campaign: SKIPPING the partition fault: {why}");
                    skipped.push(format!("partition: {why}"));
                    None
                }
            },
            _ => None,
        };
        let names = net.as_ref().map(Net::names).unwrap_or_default();
        let links = net.as_ref().map(Net::link_prefix).unwrap_or_default();
        let watchdog = watchdog(rundir.path(), &links, &names)?;
        let (pg, cli_url) = match s.store {
            Store::Postgres => {
                let listen: Vec<Ipv4Addr> = match &net {
                    Some(net) => (0..s.proxies).map(|i| net.db_host(i)).collect(),
                    None => Vec::new(),
                };
                let subnet = net.as_ref().map(Net::subnet);
                let pg =
                    Postgres::start(s.pg_bindir.as_deref(), &listen, subnet.as_deref()).await?;
                let url = pg.url(Ipv4Addr::LOCALHOST);
                (Some(pg), url)
            }
            Store::Sqlite => {
                let file = std::path::absolute(s.out.join("keys.db"))?;
                (None, format!("sqlite://{}", file.display()))
            }
        };
        let mut specs = Vec::new();
        for i in 0..s.proxies {
            let spec = match (&net, &pg) {
                // In its namespace, a proxy has the ports to itself.
                (Some(net), Some(pg)) => Spec {
                    ns: Some(net.ns(i)),
                    listen: SocketAddr::new(net.app_ns(i).into(), 8081),
                    admin: SocketAddr::new(net.app_ns(i).into(), 9090),
                    database_url: pg.url(net.db_host(i)),
                    upstream: format!("http://{}:{}", net.app_host(i), s.origin_port),
                },
                _ => Spec {
                    ns: None,
                    listen: SocketAddr::new(Ipv4Addr::LOCALHOST.into(), free_port()?),
                    admin: SocketAddr::new(Ipv4Addr::LOCALHOST.into(), free_port()?),
                    database_url: cli_url.clone(),
                    upstream: format!("http://127.0.0.1:{}", s.origin_port),
                },
            };
            specs.push(spec);
        }
        let proxies = Proxies::new(
            s.idemgate.clone(),
            s.flags.clone(),
            specs,
            s.out.clone(),
            rundir.path().to_path_buf(),
        );
        let cluster = Cluster {
            proxies,
            net,
            pg,
            cli_url,
            idemgate: s.idemgate.clone(),
            _rundir: rundir,
            _watchdog: watchdog,
            skipped,
        };
        // One at a time: the first applies the migrations.
        for i in 0..s.proxies {
            cluster.proxies.spawn(i).await?;
            cluster
                .proxies
                .wait_ready(i, Duration::from_secs(60))
                .await?;
        }
        Ok(cluster)
    }

    /// Ends every fault: database links up, proxies resumed and running,
    /// PostgreSQL running.
    pub async fn heal(&self) -> anyhow::Result<()> {
        if let Some(pg) = &self.pg
            && !pg.running().await
        {
            pg.start_again().await?;
        }
        for i in 0..self.proxies.len() {
            if let Some(net) = &self.net {
                net.set_db_link(i, true).await?;
            }
            let _ = self.proxies.signal(i, "CONT").await;
            self.proxies
                .ensure_running(i, Duration::from_secs(60))
                .await?;
        }
        Ok(())
    }

    /// Runs `idemgate keys ARGS` against the database; its standard output.
    pub async fn keys(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = tokio::process::Command::new(&self.idemgate)
            .arg("keys")
            .args(args)
            .args(["--database-url", &self.cli_url])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("USER", "idemgate-campaign")
            .stdin(Stdio::null())
            .output()
            .await
            .context("running idemgate keys")?;
        if !out.status.success() {
            bail!(
                "idemgate keys {}: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// The watchdog: when the campaign is gone (its pipe closes), it kills every
/// process working in the run's directory (the proxies), removes the
/// namespaces and the host's ends of their links (`<links>d<i>`,
/// `<links>a<i>`: a namespace outlives its name while anything holds it),
/// and the directory.
fn watchdog(rundir: &Path, links: &str, namespaces: &[String]) -> anyhow::Result<ChildStdin> {
    const SCRIPT: &str = r#"cat >/dev/null 2>&1
dir="$1"; links="$2"; shift 2
for p in /proc/[0-9]*; do
  [ "$(readlink "$p/cwd" 2>/dev/null)" = "$dir" ] && kill -9 "${p#/proc/}" 2>/dev/null
done
for ns in "$@"; do ip netns del "$ns" 2>/dev/null; done
if [ -n "$links" ]; then
  for l in $(ip -o link show | sed -n "s/^[0-9]*: \($links[ad][0-9]*\)@.*/\1/p"); do
    ip link del "$l" 2>/dev/null
  done
fi
rm -rf "$dir""#;
    let mut child = std::process::Command::new("/bin/sh")
        .args(["-c", SCRIPT, "idemgate-campaign-watchdog"])
        .arg(rundir)
        .arg(links)
        .args(namespaces)
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .context("spawning the watchdog")?;
    child.stdin.take().context("the watchdog's pipe")
}

pub fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// A port free on loopback when asked.
pub fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}
