//! What a process, or some of its threads, used over a measurement: CPU
//! time and context switches, read from `/proc` (through `procfs`) before
//! and after. A context switch is a thread giving up its core (voluntary:
//! it waited — a lock, a channel, a socket, a timer; involuntary: it was
//! preempted), so their count per key is a fair count of the hand-offs
//! between threads and processes that a key costs.

use std::collections::HashMap;

use procfs::process::{Process, Status};

/// CPU time and context switches so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// User + system CPU time, in clock ticks ([`ticks_per_second`]).
    pub ticks: u64,
    /// Voluntary + involuntary context switches.
    pub switches: u64,
}

impl Usage {
    /// What was used since `before` (never negative).
    pub fn since(self, before: Usage) -> Usage {
        Usage {
            ticks: self.ticks.saturating_sub(before.ticks),
            switches: self.switches.saturating_sub(before.switches),
        }
    }

    /// CPU microseconds per operation, for `ops` operations.
    pub fn cpu_us_per(self, ops: u64) -> Option<f64> {
        (ops > 0).then(|| self.ticks as f64 * 1e6 / ticks_per_second() as f64 / ops as f64)
    }

    /// Context switches per operation.
    pub fn switches_per(self, ops: u64) -> Option<f64> {
        (ops > 0).then(|| self.switches as f64 / ops as f64)
    }
}

/// Clock ticks per second of the CPU times in `/proc` (100 on Linux).
pub fn ticks_per_second() -> u64 {
    procfs::ticks_per_second().max(1)
}

/// The switches a thread's `status` reports.
pub fn switches(status: &Status) -> u64 {
    status.voluntary_ctxt_switches.unwrap_or(0) + status.nonvoluntary_ctxt_switches.unwrap_or(0)
}

/// Process `pid` so far: its CPU time, exited threads included (the
/// kernel keeps their time in the process's), and the context switches of
/// its live threads, summed over `/proc/PID/task/*/status` (the process's
/// own `status` counts only its main thread's). None if it is gone or not
/// visible.
pub fn of_process(pid: u32) -> Option<Usage> {
    let process = Process::new(i32::try_from(pid).ok()?).ok()?;
    let stat = process.stat().ok()?;
    let switches = process
        .tasks()
        .ok()?
        .flatten()
        .filter_map(|task| task.status().ok())
        .map(|s| switches(&s))
        .sum();
    Some(Usage {
        ticks: stat.utime + stat.stime,
        switches,
    })
}

/// The threads of process `pid` (this process with none) whose name starts
/// with `prefix`, summed; None if the process is not readable or no thread
/// has that name. A thread's name is cut to 15 bytes by the kernel.
pub fn of_threads(pid: Option<u32>, prefix: &str) -> Option<Usage> {
    let process = match pid {
        Some(pid) => Process::new(i32::try_from(pid).ok()?).ok()?,
        None => Process::myself().ok()?,
    };
    let prefix = &prefix[..prefix.len().min(15)];
    let mut found = None::<Usage>;
    for task in process.tasks().ok()?.flatten() {
        let Ok(stat) = task.stat() else { continue };
        if !stat.comm.starts_with(prefix) {
            continue;
        }
        let switches = task.status().map(|s| switches(&s)).unwrap_or(0);
        let total = found.get_or_insert_with(Usage::default);
        total.ticks += stat.utime + stat.stime;
        total.switches += switches;
    }
    found
}

/// Several processes by id, each as [`of_process`] read it.
pub type Processes = HashMap<u32, Usage>;

/// [`of_process`] of each of `pids` that is readable.
pub fn of_processes(pids: impl IntoIterator<Item = u32>) -> Processes {
    pids.into_iter()
        .filter_map(|pid| of_process(pid).map(|u| (pid, u)))
        .collect()
}

/// What a set of processes used between two readings: a process that
/// appeared in between counts whole; one that exited is lost (read the
/// second before the process under test closes its connections).
pub fn processes_since(before: &Processes, after: &Processes) -> Usage {
    after
        .iter()
        .map(|(pid, now)| now.since(before.get(pid).copied().unwrap_or_default()))
        .fold(Usage::default(), |sum, u| Usage {
            ticks: sum.ticks + u.ticks,
            switches: sum.switches + u.switches,
        })
}

#[cfg(test)]
mod tests {
    use procfs::FromRead;

    use super::*;

    #[test]
    fn reads_both_kinds_of_switch_from_a_status_file() {
        // A thread's status as Linux 6 writes it (procfs wants every field).
        let text = "Name:\ttokio-runtime-w\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\n\
Ngid:\t0\nPid:\t4243\nPPid:\t1\nTracerPid:\t0\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n\
FDSize:\t256\nGroups:\t \nNStgid:\t4242\nNSpid:\t4243\nNSpgid:\t4242\nNSsid:\t4242\n\
Kthread:\t0\nVmPeak:\t  3060 kB\nVmSize:\t  3060 kB\nVmLck:\t  0 kB\nVmPin:\t  0 kB\n\
VmHWM:\t  1724 kB\nVmRSS:\t  1724 kB\nRssAnon:\t  108 kB\nRssFile:\t  1616 kB\n\
RssShmem:\t  0 kB\nVmData:\t  360 kB\nVmStk:\t  132 kB\nVmExe:\t  20 kB\nVmLib:\t  1528 kB\n\
VmPTE:\t  48 kB\nVmSwap:\t  0 kB\nHugetlbPages:\t  0 kB\nCoreDumping:\t0\nTHP_enabled:\t1\n\
Threads:\t5\nSigQ:\t0/96367\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\n\
SigBlk:\t0000000000000000\nSigIgn:\t0000000000001000\nSigCgt:\t0000000180000440\n\
CapInh:\t0000000000000000\nCapPrm:\t000001fffeffffff\nCapEff:\t000001fffeffffff\n\
CapBnd:\t000001fffeffffff\nCapAmb:\t0000000000000000\nNoNewPrivs:\t0\nSeccomp:\t0\n\
Seccomp_filters:\t0\nSpeculation_Store_Bypass:\tvulnerable\n\
SpeculationIndirectBranch:\talways enabled\nCpus_allowed:\t3\nCpus_allowed_list:\t0-1\n\
Mems_allowed:\t00000000,00000001\nMems_allowed_list:\t0\n\
voluntary_ctxt_switches:\t1200\nnonvoluntary_ctxt_switches:\t34\n";
        let status = Status::from_read(text.as_bytes()).unwrap();
        assert_eq!(switches(&status), 1234);
    }

    #[test]
    fn this_process_and_its_named_thread_are_readable() {
        let me = of_process(std::process::id()).unwrap();
        assert!(me.switches > 0, "{me:?}");
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("usage-test-thread-long-name".into())
            .spawn(move || {
                let _ = wait.recv();
            })
            .unwrap();
        // The kernel's copy of the name is cut to 15 bytes; the prefix is
        // too. A thread names itself as it starts: wait for it.
        let mut named = None;
        for _ in 0..200 {
            named = of_threads(None, "usage-test-thread-long-name");
            if named.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        go.send(()).unwrap();
        thread.join().unwrap();
        assert!(named.is_some());
        assert!(of_threads(None, "no-such-thread").is_none());
    }

    #[test]
    fn a_process_that_appeared_counts_whole_and_per_key_divides() {
        let before: Processes = [(
            1,
            Usage {
                ticks: 10,
                switches: 5,
            },
        )]
        .into();
        let after: Processes = [
            (
                1,
                Usage {
                    ticks: 30,
                    switches: 9,
                },
            ),
            (
                2,
                Usage {
                    ticks: 7,
                    switches: 1,
                },
            ),
        ]
        .into();
        let used = processes_since(&before, &after);
        assert_eq!(
            used,
            Usage {
                ticks: 27,
                switches: 5
            }
        );
        assert_eq!(used.switches_per(5), Some(1.0));
        assert_eq!(used.switches_per(0), None);
        let us = Usage {
            ticks: ticks_per_second(),
            switches: 0,
        }
        .cpu_us_per(1000);
        assert_eq!(us, Some(1000.0));
    }
}
