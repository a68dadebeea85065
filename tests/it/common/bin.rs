//! The `idemgate` binary, run as a user would run it.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::pg::TestDb;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_idemgate");

/// `idemgate` with the test database and no stray settings from the caller's
/// environment.
pub fn idemgate(db: &TestDb) -> Command {
    idemgate_at(&db.url)
}

/// `idemgate` over the database at `url`, without stray settings.
pub fn idemgate_at(url: &str) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env("DATABASE_URL", url)
        .env_remove("IDEMGATE_TOKENS")
        .env_remove("IDEMGATE_LISTEN")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null());
    cmd
}

pub use super::free_port;

/// `idemgate keys ARGS…` over the database at `url`, run to its end.
pub fn keys(url: &str, args: &[&str]) -> std::process::Output {
    idemgate_at(url)
        .arg("keys")
        .args(args)
        .output()
        .expect("idemgate keys runs")
}

/// `idemgate keys ARGS… --json`, which must succeed: its JSON.
#[track_caller]
pub fn keys_json(url: &str, args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = keys(url, &all);
    assert!(
        out.status.success(),
        "idemgate keys {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "idemgate keys {args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// A running `idemgate serve`, killed on drop.
pub struct Served {
    pub child: Child,
    pub port: u16,
}

impl Served {
    /// Starts `idemgate serve` on a free port and waits until `/readyz` says 200.
    pub async fn start(db: &TestDb, extra: &[&str]) -> Served {
        Served::spawn(idemgate(db), extra).await
    }

    /// Starts `cmd serve --listen <free port> extra…` and waits for `/readyz`.
    pub async fn spawn(mut cmd: Command, extra: &[&str]) -> Served {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let child = cmd
            .args(["serve", "--listen", &listen])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut served = Served { child, port };
        let http = super::http();
        let started = Instant::now();
        loop {
            if let Ok(res) = http.get(format!("{}/readyz", served.base())).send().await
                && res.status() == 200
            {
                return served;
            }
            if let Ok(Some(status)) = served.child.try_wait() {
                let mut stderr = String::new();
                if let Some(mut pipe) = served.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
                }
                panic!("idemgate serve exited ({status}):\n{stderr}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "idemgate serve did not come up"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Settings of one subcommand (`ServeArgs`, `ProxyArgs`, …) from flags, as
/// clap parses them (the environment included).
pub fn parse_args<A: clap::Args + clap::FromArgMatches>(flags: &[&str]) -> A {
    let cmd = A::augment_args(clap::Command::new("idemgate"));
    let argv = std::iter::once("idemgate").chain(flags.iter().copied());
    cmd.try_get_matches_from(argv)
        .and_then(|m| A::from_arg_matches(&m))
        .unwrap_or_else(|e| panic!("bad test flags {flags:?}: {e}"))
}

/// Runs a README shell block with bash (`-euo pipefail`) in a fresh
/// directory and checks that its output holds `expected`, in that order.
#[track_caller]
pub fn run_script_expecting(script: &str, expected: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", script])
        .current_dir(dir.path())
        .output()
        .expect("bash and curl are installed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut at = 0;
    for want in expected {
        let found = stdout[at..]
            .find(want)
            .unwrap_or_else(|| panic!("{want:?} missing (in order) from:\n{stdout}"));
        at += found + want.len();
    }
}

/// Sends `signal` (`"KILL"`, `"TERM"`, `"STOP"`, `"CONT"`, …) to the process
/// `pid` with kill(1) (the crate forbids `unsafe`, so no libc call).
#[track_caller]
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("kill(1) is installed");
    assert!(status.success(), "kill -{signal} {pid} failed");
}

/// Waits up to `limit` for `child` to exit; `None` if it is still running.
pub async fn wait_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if started.elapsed() >= limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `cmd` (a subcommand that must refuse to start) and gives its
/// stderr: it must exit non-zero within 20 s, without a panic.
pub async fn refused(mut cmd: Command) -> String {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(20)).await;
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    let status =
        status.unwrap_or_else(|| panic!("it started (still running after 20 s):\n{stderr}"));
    assert!(!status.success(), "exit {status}:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// Takes `child`'s piped stderr and reads it on a thread into the returned
/// buffer, so a busy process never blocks on a full pipe (64 KiB of logs).
pub fn drain_stderr(child: &mut Child) -> std::sync::Arc<std::sync::Mutex<String>> {
    let buf = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    if let Some(pipe) = child.stderr.take() {
        let sink = buf.clone();
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
    }
    buf
}

/// Counts `idempotency_keys` rows in `state` (`in_flight`, `completed`).
pub async fn count_state(db: &TestDb, state: &str) -> i64 {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE state = $1")
        .bind(state)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
    n
}
