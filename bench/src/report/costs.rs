//! Section 13, what each new key costs, and section 14, many connections.

use std::fmt::Write as _;

use super::{Metric, View, times};
use crate::costs::PerKey;
use crate::load::median;
use crate::suite::{Env, MANY, Results};

/// The c = 256 subjects: their name and label stem (`{stem} c=256`).
pub(super) const FLEET: [(&str, &str); 4] = [
    ("reservation API pairs, PostgreSQL", "api-pair"),
    ("reservation API pairs, SQLite", "sqlite-pair"),
    ("proxy new keys, PostgreSQL", "idemgate-new"),
    ("proxy new keys, SQLite", "idemgate-sqlite-new"),
];

/// The median over `label`'s readings that have the figure `f`.
pub(super) fn field(res: &Results, label: &str, f: Figure) -> Option<f64> {
    let mut v: Vec<f64> = res
        .per_key
        .get(label)?
        .iter()
        .filter_map(f)
        .filter(|x| x.is_finite())
        .collect();
    (!v.is_empty()).then(|| median(&mut v))
}

/// Median over runs of `subject`'s figure ÷ `baseline`'s, the readings
/// that have it taken in order (one per run).
pub(super) fn per_key_ratio(
    res: &Results,
    subject: &str,
    baseline: &str,
    f: Figure,
) -> Option<f64> {
    let runs = |l: &str| -> Vec<f64> {
        res.per_key
            .get(l)
            .map(|v| v.iter().filter_map(f).collect())
            .unwrap_or_default()
    };
    let mut r: Vec<f64> = runs(subject)
        .iter()
        .zip(runs(baseline))
        .map(|(s, b)| s / b)
        .filter(|r| r.is_finite())
        .collect();
    (!r.is_empty()).then(|| median(&mut r))
}

/// The rows of the per-key table: what is measured, and its label stem
/// (`{stem} c={c}`), at each concurrency it is measured at.
const ROWS: [(&str, &str, &[usize]); 9] = [
    ("reservation API pairs, PostgreSQL", "api-pair", &[8, 32]),
    (
        "PostgreSQL floor (pgbench) beside them",
        "pg-floor-api",
        &[8, 32],
    ),
    ("proxy new keys, PostgreSQL", "idemgate-new", &[8, 32]),
    (
        "PostgreSQL floor (pgbench) beside them",
        "pg-floor-proxy",
        &[8],
    ),
    ("reservation API pairs, SQLite", "sqlite-pair", &[8, 32]),
    ("SQLite floor beside them", "sqlite-floor-sqlite", &[8, 32]),
    ("proxy new keys, SQLite", "idemgate-sqlite-new", &[8, 32]),
    ("SQLite floor beside them", "sqlite-floor-proxy", &[8]),
    ("idempotent-proxy, Redis", "ipx-new", &[8, 32]),
];

/// What `label` measures, as the per-key table names it (`… , c = 8`).
fn name_of(label: &str) -> String {
    let (stem, c) = label.rsplit_once(" c=").unwrap_or((label, "?"));
    ROWS.iter().find(|(_, s, _)| *s == stem).map_or_else(
        || label.to_owned(),
        |(what, _, _)| format!("{what}, c = {c}"),
    )
}

/// How a column reads its figure from a reading.
type Figure = fn(&PerKey) -> Option<f64>;

/// The figures of the per-key table, in its column order, with their digits.
const COLUMNS: [(&str, Figure, usize); 12] = [
    ("process CPU, µs", |k| k.proc_cpu_us, 0),
    ("database CPU, µs", |k| k.db_cpu_us, 0),
    ("process context switches", |k| k.proc_switches, 1),
    ("database context switches", |k| k.db_switches, 1),
    ("allocations", |k| k.allocs, 0),
    ("bytes allocated", |k| k.alloc_bytes, 0),
    ("syscalls", |k| k.syscalls, 1),
    ("statements", |k| k.statements, 2),
    ("WAL bytes", |k| k.wal_bytes, 0),
    ("WAL records", |k| k.wal_records, 2),
    ("buffers dirtied", |k| k.dirtied, 2),
    ("transactions", |k| k.xacts, 2),
];

/// Section 13: per new key, every door and store beside its floor and the
/// peer, row by row; then the syscalls by name and the flamegraphs.
pub(super) fn per_key_section(w: &mut String, v: &View, env: &Env, res: &Results) {
    let _ = writeln!(w, "\n### 13. What each new key costs\n");
    let pg = if env.cluster.is_some() {
        "a private PostgreSQL cluster the suite started (`pg_stat_statements` preloaded, fsync on), \
         so that the server-wide WAL and transaction ids are the suite's alone"
    } else {
        "the PostgreSQL server `DATABASE_URL` names, whose WAL and transaction ids are the whole \
         server's (other databases' writes count too)"
    };
    let _ = writeln!(
        w,
        "Per new key (a reserve + commit pair, or a proxied request with a new key), warm-up included, \
         medians over runs; PostgreSQL is {pg}. Process: the door's own process (idemgate, or \
         idempotent-proxy), its CPU time (user + system) and context switches (voluntary + involuntary, \
         summed over its threads: each is a thread handing its core over, so a count of hand-offs). \
         Database: PostgreSQL's processes for the benchmark's database (postmaster, background \
         processes, backends; pgbench's backends sampled every 100 ms while it runs), the SQLite writer \
         thread (idemgate's `{}`, part of the process's figures, or the floor's own), or the \
         `redis-server` process (which serves any other client too). Allocations and bytes: the \
         allocator's counts (`--features count-alloc`, read from `/metrics`) in a probe window of the \
         probe build. Syscalls: `strace -c -f` attached for one probe window (strace slows the process, \
         not what it calls per key). Statements (top-level, `BEGIN` and `COMMIT` included) and shared \
         buffers dirtied: `pg_stat_statements` of the benchmark's database, less the harness's own \
         reads; WAL bytes: the WAL insert position before and after; WAL records: `pg_waldump --stats` \
         over that span; transactions: transaction ids handed out, so the transactions that wrote \
         (all of these are current when a statement ends, unlike the cumulative statistics views, \
         which an idle backend updates up to 10 s later). — where not measured.\n",
        crate::procs::SQLITE_WRITER_THREAD
    );
    let mut head = "| measured | c | keys/s |".to_owned();
    let mut rule = "|---|---|---|".to_owned();
    for (name, _, _) in COLUMNS {
        let _ = write!(head, " {name} |");
        rule.push_str("---|");
    }
    let _ = writeln!(w, "{head}\n{rule}");
    for c in [8, 32] {
        for (what, stem, levels) in ROWS {
            if !levels.contains(&c) {
                continue;
            }
            let label = format!("{stem} c={c}");
            if v.runs(&label).is_empty() && !res.per_key.contains_key(&label) {
                continue;
            }
            let _ = write!(w, "| {what} | {c} | {} |", v.rate(&label));
            for (_, f, digits) in COLUMNS {
                let cell = field(res, &label, f).map_or("—".into(), |x| format!("{x:.digits$}"));
                let _ = write!(w, " {cell} |");
            }
            let _ = writeln!(w);
        }
    }
    if !res.syscalls.is_empty() {
        let _ = writeln!(
            w,
            "\nSyscalls per key by name, c = 8 (`strace -c -f`, one probe window), the most frequent first:\n"
        );
        let _ = writeln!(w, "| door | all | most frequent |\n|---|---|---|");
        for (label, by_name) in &res.syscalls {
            let total: f64 = by_name.iter().map(|(_, n)| n).sum();
            let label = name_of(label);
            let top: Vec<String> = by_name
                .iter()
                .take(8)
                .map(|(name, n)| format!("{name} {n:.1}"))
                .collect();
            let _ = writeln!(w, "| {label} | {total:.1} | {} |", top.join(", "));
        }
    }
    if !res.flamegraphs.is_empty() {
        let _ = writeln!(
            w,
            "\nFlamegraphs of each door at c = 8 (`perf record -e cpu-clock -F 999 -g` on the probe build for one window, weighted in ns of CPU, \
             folded and drawn with inferno):\n"
        );
        for (label, link) in &res.flamegraphs {
            let _ = writeln!(w, "- {}: [{link}]({link})", name_of(label));
        }
    }
}

/// Section 14: c = 256 beside c = 32, with every failed request counted.
pub(super) fn fleet_section(w: &mut String, v: &View, res: &Results) {
    let _ = writeln!(w, "\n### 14. Many connections (c = {MANY})\n");
    let _ = writeln!(
        w,
        "{MANY} workers, one kept-alive connection each (an agents' fleet), beside c = 32 from the same run. \
         Every answer's status is checked (201 for a reserve or a proxied new key, 200 for a commit): \
         anything else, or a failed connection, is an error, never a key done.\n"
    );
    let _ = writeln!(
        w,
        "| measured | c = 32 keys/s | c = {MANY} keys/s | p50 | p99 | errors at c = {MANY} | c = {MANY} ÷ c = 32 | process CPU per key at c = {MANY}, µs |\n|---|---|---|---|---|---|---|---|"
    );
    for (name, stem) in FLEET {
        let many = format!("{stem} c={MANY}");
        let errors: u64 = v.runs(&many).iter().map(|s| s.errors).sum();
        let _ = writeln!(
            w,
            "| {name} | {} | {} | {errors} | {} | {} |",
            v.rate(&format!("{stem} c=32")),
            v.cells(&many),
            times(v.ratio(&many, &format!("{stem} c=32"), Metric::Rate)),
            field(res, &many, |k| k.proc_cpu_us).map_or("—".into(), |x| format!("{x:.0}")),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_named_by_what_they_measure() {
        assert_eq!(name_of("ipx-new c=8"), "idempotent-proxy, Redis, c = 8");
        assert_eq!(name_of("something c=8"), "something c=8");
    }

    #[test]
    fn a_figure_is_the_median_of_the_readings_that_have_it() {
        let mut res = Results::default();
        let k = |cpu: Option<f64>, allocs: Option<f64>| PerKey {
            proc_cpu_us: cpu,
            allocs,
            ..PerKey::default()
        };
        res.per_key.insert(
            "a c=8".into(),
            vec![
                k(Some(300.0), None),
                k(Some(100.0), None),
                k(None, Some(42.0)),
            ],
        );
        res.per_key.insert(
            "b c=8".into(),
            vec![k(Some(150.0), None), k(Some(100.0), None)],
        );
        assert_eq!(field(&res, "a c=8", |k| k.proc_cpu_us), Some(200.0));
        assert_eq!(field(&res, "a c=8", |k| k.allocs), Some(42.0));
        assert_eq!(field(&res, "a c=8", |k| k.syscalls), None);
        // Run by run: 300 ÷ 150 and 100 ÷ 100.
        assert_eq!(
            per_key_ratio(&res, "a c=8", "b c=8", |k| k.proc_cpu_us),
            Some(1.5)
        );
    }
}
