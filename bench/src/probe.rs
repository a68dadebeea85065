//! Short windows that look inside a running door rather than time it:
//! `strace -c -f` attached to the process for the syscalls a key costs, and
//! `perf record` for a flamegraph. Each slows the process it watches, so
//! each gets a window of its own, after the measurements whose throughput is
//! reported. Neither tool is required: without it (or without the right to
//! attach) the window is skipped with a note.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::process::{Child, Command};

/// What `strace -c` counted over a window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Syscalls {
    /// Every call, all syscalls together.
    pub total: u64,
    /// Calls by syscall, most first.
    pub by_name: Vec<(String, u64)>,
}

/// Reads the summary table `strace -c` writes: one row per syscall, the
/// calls in the fourth column and the name in the last, and a `total` row.
/// None if there is no total row (strace did not attach, or wrote nothing).
pub fn parse_strace_summary(text: &str) -> Option<Syscalls> {
    let mut total = None;
    let mut by_name = Vec::new();
    for line in text.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        // % time, seconds, usecs/call, calls, [errors], syscall.
        if cols.len() < 5 || cols[0].parse::<f64>().is_err() {
            continue;
        }
        let (Some(name), Ok(calls)) = (cols.last(), cols[3].parse::<u64>()) else {
            continue;
        };
        if *name == "total" {
            total = Some(calls);
        } else {
            by_name.push(((*name).to_owned(), calls));
        }
    }
    by_name.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Some(Syscalls {
        total: total?,
        by_name,
    })
}

/// A tool attached to a process, stopped with SIGINT (which makes strace
/// print its summary and perf close its file).
struct Attached {
    child: Child,
}

impl Attached {
    async fn spawn(program: &str, args: &[String], log: &Path) -> anyhow::Result<Attached> {
        let out = std::fs::File::create(log)?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {program}"))?;
        Ok(Attached { child })
    }

    /// SIGINT, then up to 60 s to finish writing; its exit status.
    async fn finish(mut self) -> anyhow::Result<std::process::ExitStatus> {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .args(["-INT", &pid.to_string()])
                .status()
                .await;
        }
        match tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await {
            Ok(status) => Ok(status?),
            Err(_) => {
                let _ = self.child.kill().await;
                anyhow::bail!("did not finish within 60 s of SIGINT")
            }
        }
    }
}

/// Whether `program` runs here (`program ARG` succeeds: `--version`, or
/// `--help` for a program without it).
pub async fn available(program: &str, arg: &str) -> bool {
    Command::new(program)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .is_ok_and(|s| s.success())
}

/// Waits until process `pid` has a tracer (strace attached), up to 5 s.
async fn traced(pid: u32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let status = procfs::process::Process::new(pid as i32).and_then(|p| p.status());
        if status.is_ok_and(|s| s.tracerpid > 0) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Runs `window` with `strace -c -f` attached to every thread of process
/// `pid`, and returns what it counted, or why not.
pub async fn strace<T>(
    pid: u32,
    dir: &Path,
    name: &str,
    window: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<(T, Syscalls)> {
    let summary = dir.join(format!("{name}.strace"));
    let args = [
        "-c".to_owned(),
        "-f".to_owned(),
        "-qq".to_owned(),
        "-o".to_owned(),
        summary.display().to_string(),
        "-p".to_owned(),
        pid.to_string(),
    ];
    let log = dir.join(format!("{name}.strace.log"));
    let attached = Attached::spawn("strace", &args, &log).await?;
    if !traced(pid).await {
        let _ = attached.finish().await;
        let why = std::fs::read_to_string(&log).unwrap_or_default();
        anyhow::bail!("strace did not attach: {}", why.trim());
    }
    let result = window.await;
    let status = attached.finish().await?;
    let out = result?;
    let text = std::fs::read_to_string(&summary).unwrap_or_default();
    let counted = parse_strace_summary(&text)
        .with_context(|| format!("no summary from strace ({status})"))?;
    Ok((out, counted))
}

/// Runs `window` under `perf record -e cpu-clock -F 999 -g` attached to
/// process `pid`,
/// then folds the stacks and draws them with inferno into `svg`.
pub async fn flamegraph<T>(
    pid: u32,
    dir: &Path,
    name: &str,
    title: &str,
    svg: &Path,
    window: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let data = dir.join(format!("{name}.perf.data"));
    // cpu-clock everywhere (hardware counters are missing on many virtual
    // machines), so that a sample's weight is nanoseconds of CPU.
    let args = [
        "record".to_owned(),
        "-e".to_owned(),
        "cpu-clock".to_owned(),
        "-F".to_owned(),
        "999".to_owned(),
        "-g".to_owned(),
        "-o".to_owned(),
        data.display().to_string(),
        "-p".to_owned(),
        pid.to_string(),
    ];
    let log = dir.join(format!("{name}.perf.log"));
    let attached = Attached::spawn("perf", &args, &log).await?;
    // perf has no sign of having attached that is cheap to read; it takes
    // a moment to open its events.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let result = window.await;
    let status = attached.finish().await?;
    let out = result?;
    anyhow::ensure!(
        data.is_file(),
        "perf record wrote nothing ({status}): {}",
        std::fs::read_to_string(&log).unwrap_or_default().trim()
    );
    draw(&data, title, svg).await?;
    let _ = std::fs::remove_file(&data);
    Ok(out)
}

/// `perf script | inferno-collapse-perf | inferno-flamegraph`, in files.
async fn draw(data: &Path, title: &str, svg: &Path) -> anyhow::Result<()> {
    let script = data.with_extension("script");
    let folded = data.with_extension("folded");
    run_to_file(
        Command::new("perf").args(["script", "-i"]).arg(data),
        None,
        &script,
    )
    .await?;
    run_to_file(
        &mut Command::new("inferno-collapse-perf"),
        Some(&script),
        &folded,
    )
    .await?;
    if let Some(parent) = svg.parent() {
        std::fs::create_dir_all(parent)?;
    }
    run_to_file(
        Command::new("inferno-flamegraph").args(["--title", title, "--countname", "ns of CPU"]),
        Some(&folded),
        svg,
    )
    .await?;
    let _ = std::fs::remove_file(&script);
    let _ = std::fs::remove_file(&folded);
    Ok(())
}

async fn run_to_file(cmd: &mut Command, input: Option<&Path>, out: &Path) -> anyhow::Result<()> {
    let stdin = match input {
        Some(path) => Stdio::from(std::fs::File::open(path)?),
        None => Stdio::null(),
    };
    // Not `output()`, which would capture standard output in memory
    // whatever it was set to.
    let output = cmd
        .stdin(stdin)
        .stdout(Stdio::from(std::fs::File::create(out)?))
        .stderr(Stdio::piped())
        .spawn()
        .context("start")?
        .wait_with_output()
        .await?;
    anyhow::ensure!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(())
}

/// Where the flamegraphs of a report written to `out` go: a directory
/// beside it, named after it (`BENCHMARKS.md` → `BENCHMARKS.flamegraphs/`).
pub fn flamegraph_dir(out: &Path) -> PathBuf {
    let stem = out
        .file_stem()
        .map_or("report".into(), |s| s.to_string_lossy().into_owned());
    out.with_file_name(format!("{stem}.flamegraphs"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_strace_c_summary_with_and_without_errors() {
        let text = "\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 41.20    0.041200          10      4012           sendto
 30.11    0.030110           7      4001      2003 recvfrom
 20.02    0.020020           5      3998           epoll_wait
  8.67    0.008670           2      4101           futex
------ ----------- ----------- --------- --------- ----------------
100.00    0.100000           6     16112      2003 total
";
        let s = parse_strace_summary(text).unwrap();
        assert_eq!(s.total, 16112);
        assert_eq!(s.by_name[0], ("futex".to_owned(), 4101));
        assert_eq!(s.by_name.len(), 4);
        assert_eq!(
            s.by_name.iter().find(|(n, _)| n == "recvfrom").unwrap().1,
            4001
        );
    }

    #[test]
    fn no_total_row_is_no_summary() {
        assert_eq!(parse_strace_summary(""), None);
        assert_eq!(
            parse_strace_summary(
                "strace: attach: ptrace(PTRACE_SEIZE, 1): Operation not permitted\n"
            ),
            None
        );
    }

    #[test]
    fn flamegraphs_go_beside_the_report() {
        assert_eq!(
            flamegraph_dir(Path::new("BENCHMARKS.md")),
            Path::new("BENCHMARKS.flamegraphs")
        );
        assert_eq!(
            flamegraph_dir(Path::new("/tmp/smoke.md")),
            Path::new("/tmp/smoke.flamegraphs")
        );
    }
}
