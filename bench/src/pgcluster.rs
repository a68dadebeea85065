//! A private PostgreSQL cluster for the suite: initdb into the work
//! directory, `pg_stat_statements` preloaded (which a shared server may not
//! do, and which the harness must not change there), durable as a real one
//! (fsync and synchronous commit on: the floors and idemgate are compared on
//! durable writes), listening on a free loopback port, stopped and its data
//! removed at the end. Nothing but the suite uses it, so the server-wide
//! counters (`pg_stat_wal`) are the suite's alone. PostgreSQL refuses to run
//! as root: as root, its programs run as the `postgres` user.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;

/// A running cluster, stopped when dropped.
pub struct Cluster {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    /// The server's log, kept in the work directory.
    pub log: PathBuf,
    stopped: bool,
}

/// PostgreSQL's newest server binaries: `pg_config --bindir`, else the
/// newest of Debian's versioned directories.
fn server_bin() -> Option<PathBuf> {
    let from_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if let Some(dir) = from_config.filter(|d| d.join("initdb").is_file()) {
        return Some(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

fn running_as_root() -> bool {
    procfs::process::Process::myself()
        .and_then(|p| p.uid())
        .is_ok_and(|uid| uid == 0)
}

/// Runs `program args` (as `postgres` when this process is root) and fails
/// with its output if it fails.
fn run(program: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = if running_as_root() {
        // runuser passes the arguments as they are, with no shell between.
        Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(program)
            .args(args)
            .output()
    } else {
        Command::new(program).args(args).output()
    }
    .with_context(|| format!("run {}", program.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} failed ({}): {}{}",
        program.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// The settings appended to the new cluster's `postgresql.conf`.
fn settings(port: u16, socket_dir: &Path) -> String {
    format!(
        "shared_preload_libraries = 'pg_stat_statements'\n\
         pg_stat_statements.track = top\n\
         fsync = on\n\
         synchronous_commit = on\n\
         full_page_writes = on\n\
         listen_addresses = '127.0.0.1'\n\
         port = {port}\n\
         unix_socket_directories = '{}'\n\
         max_connections = 400\n\
         log_line_prefix = '%m [%p] %q%u@%d '\n",
        socket_dir.display()
    )
}

impl Cluster {
    /// Creates and starts a cluster in `dir/pgdata`, its log in
    /// `dir/postgresql.log`.
    pub fn start(dir: &Path) -> anyhow::Result<Cluster> {
        let bin = server_bin().context(
            "no PostgreSQL server binaries (initdb) found for --private-postgres; \
             install PostgreSQL or pass a DATABASE_URL",
        )?;
        let data = dir.join("pgdata");
        let log = dir.join("postgresql.log");
        let port = crate::procs::free_addr()?.port();
        std::fs::create_dir_all(&data)?;
        std::fs::write(&log, "")?;
        if running_as_root() {
            let status = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&data)
                .arg(&log)
                .status()?;
            anyhow::ensure!(status.success(), "chown postgres {}", data.display());
        }
        let data_s = data.display().to_string();
        // The cluster's own files need not survive a crash of this machine:
        // initdb skips its fsyncs; the server itself keeps fsync on.
        run(
            &bin.join("initdb"),
            &[
                "-D",
                &data_s,
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )?;
        let conf = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).unwrap_or_default();
        text.push_str(&settings(port, &data));
        std::fs::write(&conf, text)?;
        let mut cluster = Cluster {
            bin,
            data,
            port,
            log,
            stopped: true,
        };
        let log_s = cluster.log.display().to_string();
        run(
            &cluster.bin.join("pg_ctl"),
            &["-D", &data_s, "-w", "-t", "60", "-l", &log_s, "start"],
        )?;
        cluster.stopped = false;
        Ok(cluster)
    }

    /// The URL of its `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server and removes its data (the log stays).
    pub fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let data_s = self.data.display().to_string();
        if let Err(e) = run(
            &self.bin.join("pg_ctl"),
            &["-D", &data_s, "-m", "fast", "-w", "stop"],
        ) {
            eprintln!("note: stopping the private PostgreSQL failed: {e:#}");
            return;
        }
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cluster_preloads_statements_and_stays_durable() {
        let s = settings(5999, Path::new("/tmp/x"));
        assert!(s.contains("shared_preload_libraries = 'pg_stat_statements'"));
        assert!(s.contains("fsync = on"));
        assert!(s.contains("synchronous_commit = on"));
        assert!(s.contains("port = 5999"));
        assert!(s.contains("listen_addresses = '127.0.0.1'"));
    }
}
