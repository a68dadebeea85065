//! The `idemgate proxy` processes: started (in their namespace when there
//! is one), killed, paused, resumed, restarted, and stopped gracefully at the
//! end. Each one's output goes to `proxy-<i>.log` in the run's directory.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

/// Where one proxy runs.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Its network namespace, if any.
    pub ns: Option<String>,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub database_url: String,
    pub upstream: String,
}

/// The proxies of a run.
pub struct Proxies {
    bin: PathBuf,
    /// Flags every proxy gets (timeouts, `--on-lease-expiry`, …).
    flags: Vec<String>,
    specs: Vec<Spec>,
    children: Vec<Mutex<Option<Child>>>,
    logs: PathBuf,
    /// Every proxy's working directory: what the watchdog recognises them by.
    cwd: PathBuf,
    http: reqwest::Client,
}

impl Proxies {
    pub fn new(
        bin: PathBuf,
        flags: Vec<String>,
        specs: Vec<Spec>,
        logs: PathBuf,
        cwd: PathBuf,
    ) -> Proxies {
        let children = specs.iter().map(|_| Mutex::new(None)).collect();
        Proxies {
            bin,
            flags,
            specs,
            children,
            logs,
            cwd,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .expect("an HTTP client"),
        }
    }

    pub fn len(&self) -> usize {
        self.specs.len()
    }

    /// `http://HOST:PORT` of proxy `i`, where clients send requests.
    pub fn base(&self, i: usize) -> String {
        format!("http://{}", self.specs[i].listen)
    }

    /// Starts proxy `i` (again).
    pub async fn spawn(&self, i: usize) -> anyhow::Result<()> {
        let spec = &self.specs[i];
        let mut cmd = match &spec.ns {
            Some(ns) => {
                // `ip netns exec` execs the binary: the child's pid is the
                // proxy's own, so signals reach it.
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", ns]).arg(&self.bin);
                cmd
            }
            None => Command::new(&self.bin),
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("proxy-{i}.log")))?;
        cmd.arg("proxy")
            .args(["--upstream", &spec.upstream])
            .args(["--database-url", &spec.database_url])
            .args(["--listen", &spec.listen.to_string()])
            .args(["--admin-listen", &spec.admin.to_string()])
            .args(&self.flags)
            // No stray IDEMGATE_* settings from the caller's environment.
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .current_dir(&self.cwd)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        let child = cmd.spawn().with_context(|| format!("starting proxy {i}"))?;
        *self.children[i].lock().await = Some(child);
        Ok(())
    }

    /// Waits until proxy `i` says it is ready (its database reachable).
    pub async fn wait_ready(&self, i: usize, limit: Duration) -> anyhow::Result<()> {
        let url = format!("http://{}/readyz", self.specs[i].admin);
        let started = Instant::now();
        loop {
            if let Ok(res) = self.http.get(&url).send().await
                && res.status() == 200
            {
                return Ok(());
            }
            if !self.running(i).await {
                bail!("proxy {i} exited; see proxy-{i}.log");
            }
            if started.elapsed() > limit {
                bail!("proxy {i} not ready after {limit:?}; see proxy-{i}.log");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether proxy `i`'s process is alive.
    pub async fn running(&self, i: usize) -> bool {
        let mut child = self.children[i].lock().await;
        child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// `kill -9`, and reaps it.
    pub async fn kill(&self, i: usize) {
        if let Some(mut child) = self.children[i].lock().await.take() {
            let _ = child.kill().await;
        }
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`) to proxy `i`.
    pub async fn signal(&self, i: usize, signal: &str) -> anyhow::Result<()> {
        let pid = {
            let child = self.children[i].lock().await;
            child.as_ref().and_then(Child::id)
        };
        let Some(pid) = pid else {
            bail!("proxy {i} is not running");
        };
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .await?;
        if !status.success() {
            bail!("kill -{signal} {pid} failed");
        }
        Ok(())
    }

    /// Starts proxy `i` again if it is not running, until it stays up (a
    /// proxy whose database is away at start exits, and is tried again).
    pub async fn ensure_running(&self, i: usize, limit: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            if !self.running(i).await {
                self.spawn(i).await?;
            }
            if self.wait_ready(i, Duration::from_secs(5)).await.is_ok() {
                return Ok(());
            }
            if started.elapsed() > limit {
                bail!("proxy {i} did not come back within {limit:?}; see proxy-{i}.log");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// SIGTERM every proxy (resumed first), waiting up to `grace` for each
    /// to finish its calls and commits; `kill -9` after that.
    pub async fn stop_all(&self, grace: Duration) {
        for i in 0..self.len() {
            let _ = self.signal(i, "CONT").await;
            let _ = self.signal(i, "TERM").await;
        }
        for (i, slot) in self.children.iter().enumerate() {
            if let Some(mut child) = slot.lock().await.take() {
                match tokio::time::timeout(grace, child.wait()).await {
                    Ok(Ok(status)) if status.success() => {}
                    Ok(status) => eprintln!("campaign: proxy {i} exited {status:?} at SIGTERM"),
                    Err(_) => {
                        eprintln!(
                            "campaign: proxy {i} still running {grace:?} after SIGTERM; killed"
                        );
                        let _ = child.kill().await;
                    }
                }
            }
        }
    }
}
