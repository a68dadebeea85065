//! The processes a scenario needs (idemgate, the origin, idempotent-proxy),
//! started fresh for each measurement so that each one's peak memory belongs
//! to that measurement alone.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::process::{Child, Command};

use crate::http::Conn;

/// A child process, stopped (SIGTERM, then SIGKILL) when dropped.
pub struct Proc {
    name: String,
    child: Child,
    /// Where its Prometheus `/metrics` answers, for an idemgate process.
    metrics: Option<SocketAddr>,
}

/// A port nobody listens on right now.
pub fn free_addr() -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

impl Proc {
    /// Starts `program` with `args` and `env`, its output appended to `log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[&str],
        env: &[(&str, String)],
        cwd: Option<&Path>,
        log: &Path,
    ) -> anyhow::Result<Proc> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("open {}", log.display()))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        if let Some(dir) = cwd {
            cmd.current_dir(dir);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("start {name} ({})", program.display()))?;
        Ok(Proc {
            name: name.to_owned(),
            child,
            metrics: None,
        })
    }

    /// Where its `/metrics` answers, if it has one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics
    }

    /// Its process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Waits until `GET path` at `addr` answers 200 (or, with no path, until
    /// the port accepts connections).
    pub async fn wait_ready(&mut self, addr: SocketAddr, path: Option<&str>) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!("{} exited before it was ready ({status})", self.name);
            }
            let ready = match path {
                Some(path) => Conn::new(addr).get_ok(path).await,
                None => tokio::net::TcpStream::connect(addr).await.is_ok(),
            };
            if ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                anyhow::bail!("{} did not become ready on {addr}", self.name);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// CPU time it has used so far (user + system), in clock ticks of 10 ms.
    pub fn cpu_ticks(&self) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()?)).ok()?;
        // Fields after the command name, which may hold spaces: state is
        // field 3, utime 14 and stime 15.
        let rest = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        Some(utime + stime)
    }

    /// Peak resident memory so far (VmHWM), in KiB.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// SIGTERM, up to 10 s to exit, then SIGKILL.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
            if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
                .await
                .is_ok()
            {
                return;
            }
        }
        let _ = self.child.kill().await;
    }
}

/// Which door an idemgate process opens.
pub enum Door {
    /// `idemgate serve`: the reservation API.
    Serve,
    /// `idemgate proxy` in front of this origin.
    Proxy(SocketAddr),
}

/// Starts `bin serve` or `bin proxy` on free ports over `database_url`, with
/// the pruning job off and warnings only (`extra` may override), waits for
/// its `/readyz`, and returns it with the address its door listens on. Its
/// `/metrics` is on that address for `serve`, on the admin listener for
/// `proxy` (where the door forwards every path to the origin).
pub async fn idemgate(
    name: &str,
    bin: &Path,
    door: &Door,
    database_url: &str,
    extra: &[(&str, String)],
    log: &Path,
) -> anyhow::Result<(Proc, SocketAddr)> {
    let addr = free_addr()?;
    let admin = free_addr()?;
    let mut env = vec![
        ("DATABASE_URL", database_url.to_owned()),
        ("IDEMGATE_LISTEN", addr.to_string()),
        ("IDEMGATE_ADMIN_LISTEN", admin.to_string()),
        // The defaults a user runs with: the log at `info` (13 % of the
        // proxy's CPU per key beside `warn`) and a pruning pass a minute,
        // each counting the stuck keys for the gauge.
    ];
    env.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
    let upstream;
    let (args, ops): (Vec<&str>, SocketAddr) = match door {
        Door::Serve => (vec!["serve"], addr),
        Door::Proxy(origin) => {
            upstream = format!("http://{origin}");
            (vec!["proxy", "--upstream", &upstream], admin)
        }
    };
    let mut proc = Proc::spawn(name, bin, &args, &env, None, log)?;
    proc.metrics = Some(ops);
    proc.wait_ready(ops, Some("/readyz")).await?;
    Ok((proc, addr))
}

/// The directory of the running executable: `idemgate` is built beside it.
pub fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("the executable has no directory")?;
    Ok(dir.join(name))
}

/// Runs a command to completion and returns its trimmed standard output.
pub async fn output(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().await.ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The name of idemgate's SQLite writer thread (`src/store/sqlite`): on
/// SQLite, the store's work inside idemgate's process.
pub const SQLITE_WRITER_THREAD: &str = "idemgate-sqlite-writer";

/// The PostgreSQL processes that work for `pool`'s database, by process id,
/// with what each has used so far: the postmaster (the parent of this
/// connection's backend), the background processes (checkpointer, WAL
/// writer, …: no database in `pg_stat_activity`) and every backend
/// connected to this database. Backends of other databases on a shared
/// server are left out. None when the server's processes are not visible
/// here (another host or container).
pub async fn db_processes(pool: &sqlx::PgPool) -> Option<crate::usage::Processes> {
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
        .ok()?;
    let pids: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname IS NULL OR datname = current_database()",
    )
    .fetch_all(pool)
    .await
    .ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{backend}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let postmaster: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
    let pids = pids
        .into_iter()
        .filter_map(|p| u32::try_from(p).ok())
        .chain([postmaster]);
    let usage = crate::usage::of_processes(pids);
    (!usage.is_empty()).then_some(usage)
}
