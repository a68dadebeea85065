//! A throwaway PostgreSQL cluster of the campaign's own (initdb + pg_ctl on
//! a free port, its data in a temp dir), so that restarting it mid-run
//! disturbs no other database on the machine.
//!
//! Run as root, the server runs as the `postgres` OS user (PostgreSQL
//! refuses root). A watchdog shell, holding the read end of a pipe only we
//! write to, stops the server and removes its directory when the campaign
//! exits for any reason, `kill -9` included.

use std::io::Write as _;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};

use anyhow::{Context as _, bail};

/// The running cluster; stopped and removed on drop.
pub struct Postgres {
    root: PathBuf,
    data: PathBuf,
    pub port: u16,
    bindir: PathBuf,
    run_as: Option<String>,
    _watchdog: ChildStdin,
}

impl Postgres {
    /// initdb, then start on a free port, listening on 127.0.0.1 and
    /// `listen`, trusting `subnet` as well as loopback.
    pub async fn start(
        bindir: Option<&Path>,
        listen: &[Ipv4Addr],
        subnet: Option<&str>,
    ) -> anyhow::Result<Postgres> {
        let bindir = match bindir {
            Some(dir) => dir.to_path_buf(),
            None => find_bindir().context(
                "no PostgreSQL server binaries (initdb, pg_ctl, postgres) on PATH; name their \
                 directory with --pg-bindir",
            )?,
        };
        let run_as = super::running_as_root().then(|| "postgres".to_owned());
        // As root, a directory the `postgres` user can reach: /tmp, not a
        // private $TMPDIR.
        let base = if run_as.is_some() {
            PathBuf::from("/tmp")
        } else {
            std::env::temp_dir()
        };
        let root = tempfile::Builder::new()
            .prefix("idemgate-campaign-pg-")
            .tempdir_in(base)?
            .keep();
        if let Some(user) = &run_as {
            let status = Command::new("chown").arg(user).arg(&root).status()?;
            if !status.success() {
                bail!(
                    "chown {user} {}: is there a `{user}` OS user?",
                    root.display()
                );
            }
        }
        let watchdog = watchdog(&bindir, &root, run_as.as_deref())?;
        let port = super::free_port()?;
        let pg = Postgres {
            data: root.join("data"),
            root,
            port,
            bindir,
            run_as,
            _watchdog: watchdog,
        };
        let mut initdb = pg.command("initdb");
        initdb.arg("-D").arg(&pg.data).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        ]);
        run(initdb).await.context("initdb")?;

        let mut addrs = vec!["127.0.0.1".to_owned()];
        addrs.extend(listen.iter().map(ToString::to_string));
        // fsync off survives the crashes we inject (processes, not the
        // kernel); synchronous_commit stays on, or an immediate stop could
        // lose a commit idemgate was told had landed.
        let conf = format!(
            "\nlisten_addresses = '{}'\nport = {port}\nunix_socket_directories = '{}'\n\
             fsync = off\nsynchronous_commit = on\nfull_page_writes = off\n\
             max_connections = 200\n",
            addrs.join(","),
            pg.root.display()
        );
        append(&pg.data.join("postgresql.conf"), &conf)?;
        if let Some(subnet) = subnet {
            append(
                &pg.data.join("pg_hba.conf"),
                &format!("host all all {subnet} trust\n"),
            )?;
        }
        pg.start_again().await?;
        Ok(pg)
    }

    /// `postgres://postgres@HOST:PORT/postgres`.
    pub fn url(&self, host: Ipv4Addr) -> String {
        format!("postgres://postgres@{host}:{}/postgres", self.port)
    }

    /// `pg_ctl stop -m MODE` (`fast` or `immediate`).
    pub async fn stop(&self, mode: &str) -> anyhow::Result<()> {
        let mut cmd = self.command("pg_ctl");
        cmd.arg("-D")
            .arg(&self.data)
            .args(["stop", "-m", mode, "-w", "-t", "60"]);
        run(cmd).await.context("pg_ctl stop")
    }

    /// `pg_ctl start`, waiting until it accepts connections.
    pub async fn start_again(&self) -> anyhow::Result<()> {
        let mut cmd = self.command("pg_ctl");
        cmd.arg("-D")
            .arg(&self.data)
            // Without -l the server would inherit our stdout.
            .arg("-l")
            .arg(self.root.join("server.log"))
            .args(["-w", "-t", "60", "start"]);
        run(cmd).await.context("pg_ctl start")
    }

    /// Whether the server runs (`pg_ctl status`).
    pub async fn running(&self) -> bool {
        let mut cmd = self.command("pg_ctl");
        cmd.arg("-D").arg(&self.data).arg("status");
        run(cmd).await.is_ok()
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = as_user(self.run_as.as_deref(), &self.bindir.join(program));
        cmd.current_dir(&self.root).stdin(Stdio::null());
        cmd
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["stop", "-m", "immediate", "-w", "-t", "30"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// The watchdog: blocks reading a pipe; when the campaign is gone, the
/// pipe closes and it stops the server and removes its directory.
fn watchdog(bindir: &Path, root: &Path, run_as: Option<&str>) -> anyhow::Result<ChildStdin> {
    const SCRIPT: &str = r#"cat >/dev/null 2>&1
"$1" -D "$2/data" stop -m immediate -w -t 30 >/dev/null 2>&1
rm -rf "$2""#;
    let mut cmd = as_user(run_as, Path::new("/bin/sh"));
    cmd.args(["-c", SCRIPT, "idemgate-campaign-pg-watchdog"])
        .arg(bindir.join("pg_ctl"))
        .arg(root)
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C at the campaign must not kill
        // the cleanup with it.
        .process_group(0);
    let mut child = cmd.spawn().context("spawning the PostgreSQL watchdog")?;
    child.stdin.take().context("the watchdog's pipe")
}

fn as_user(user: Option<&str>, program: &Path) -> Command {
    match user {
        Some(user) => {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", user, "--"]).arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

async fn run(cmd: Command) -> anyhow::Result<()> {
    let out = tokio::process::Command::from(cmd).output().await?;
    if !out.status.success() {
        bail!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn append(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .with_context(|| format!("writing {}", path.display()))
}

/// The directory of `initdb` on PATH, symlinks resolved, if `pg_ctl` and
/// `postgres` are beside it.
fn find_bindir() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find_map(|dir| {
        let initdb = dir.join("initdb");
        let real = std::fs::canonicalize(&initdb).ok()?;
        let real_dir = real.parent()?.to_path_buf();
        [real_dir, dir].into_iter().find(|d| {
            ["initdb", "pg_ctl", "postgres"]
                .iter()
                .all(|b| d.join(b).is_file())
        })
    })
}
