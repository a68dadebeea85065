//! Section 15, latency against concurrency (scenario `curve`).

use std::fmt::Write as _;

use super::costs::field;
use super::{Metric, View, cpu};
use crate::load::median;
use crate::suite::Results;
use crate::suite::curve::{SUBJECTS, label, levels};

pub(super) fn curve_section(w: &mut String, v: &View, res: &Results, smoke: bool) {
    let measured = SUBJECTS
        .iter()
        .any(|(stem, _)| !v.runs(&label(stem, 1)).is_empty());
    if !measured {
        return;
    }
    let _ = writeln!(w, "\n### 15. Latency against concurrency\n");
    let _ = writeln!(
        w,
        "Each door and floor at each c in turn, new keys only, every answer's status checked. \
         CPU is per key, warm-up included: the process under test's (idemgate, idempotent-proxy) and the store's \
         (PostgreSQL's processes for the benchmark database, the SQLite writer thread, Redis). \
         Active: the benchmark database's statements running at once, sampled every 50 ms through the measurement \
         (mean / most). Batch: idemgate's writes per transaction (group commit). \
         ×c=1: the throughput over the same subject's at c = 1.\n"
    );
    let _ = writeln!(
        w,
        "| subject | c | keys/s | ×c=1 | p50 ms | p99 ms | CPU µs/key | store CPU µs/key | active | batch | busy |\n\
         |---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (stem, name) in SUBJECTS {
        let alone = v.med(&label(stem, 1), Metric::Rate);
        for &c in levels(smoke) {
            let l = label(stem, c);
            if v.runs(&l).is_empty() {
                continue;
            }
            let rate = v.med(&l, Metric::Rate);
            let scale = match (rate, alone) {
                (Some(r), Some(a)) if a > 0.0 => format!("{:.1}", r / a),
                _ => "—".into(),
            };
            // pgbench reports no latencies of its own here.
            let (p50, p99) = if stem == "curve-pg-floor" {
                ("—".into(), "—".into())
            } else {
                (v.ms(&l, Metric::P50), v.ms(&l, Metric::P99))
            };
            let _ = writeln!(
                w,
                "| {name} | {c} | {} | {scale} | {} | {} | {} | {} | {} | {} | {} |",
                v.rate(&l),
                p50,
                p99,
                cpu(res, &l),
                field(res, &l, |p| p.db_cpu_us).map_or("—".into(), |us| format!("{us:.0}")),
                active(res, &l),
                batch(res, &l),
                busy(res, &l),
            );
        }
    }
}

/// The median mean and the most of `label`'s samples of running statements.
fn active(res: &Results, label: &str) -> String {
    let Some(runs) = res.active.get(label).filter(|r| !r.is_empty()) else {
        return "—".into();
    };
    let mut means: Vec<f64> = runs.iter().map(|a| a.mean).collect();
    let most = runs.iter().map(|a| a.max).max().unwrap_or(0);
    format!("{:.1} / {most}", median(&mut means))
}

/// The median share of the machine's cores busy during `label`, in percent.
fn busy(res: &Results, label: &str) -> String {
    let mut v = res.busy.get(label).cloned().unwrap_or_default();
    if v.is_empty() {
        return "—".into();
    }
    format!("{:.0} %", median(&mut v) * 100.0)
}

/// The median of `label`'s writes per transaction.
fn batch(res: &Results, label: &str) -> String {
    let mut means: Vec<f64> = res
        .batches
        .get(label)
        .map(|runs| runs.iter().filter_map(|b| b.mean()).collect())
        .unwrap_or_default();
    if means.is_empty() {
        return "—".into();
    }
    format!("{:.2}", median(&mut means))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::Sample;
    use crate::suite::curve::Active;

    fn sample(ops: u64, p50_us: u64) -> Sample {
        Sample {
            ops,
            errors: 0,
            secs: 1.0,
            p50_us,
            p99_us: 2 * p50_us,
            all_ops: ops,
        }
    }

    #[test]
    fn nothing_is_written_without_the_scenario() {
        let res = Results::default();
        let mut w = String::new();
        curve_section(&mut w, &View(&res), &res, false);
        assert!(w.is_empty(), "{w}");
    }

    #[test]
    fn each_level_is_a_row_with_its_scale_and_what_ran_at_once() {
        let mut res = Results::default();
        res.samples
            .insert("curve-api-pair c=1".into(), vec![sample(1000, 900)]);
        res.samples
            .insert("curve-api-pair c=8".into(), vec![sample(2500, 2800)]);
        res.samples
            .insert("curve-pg-floor c=8".into(), vec![sample(6000, 0)]);
        res.active.insert(
            "curve-api-pair c=8".into(),
            vec![Active { mean: 1.25, max: 2 }],
        );
        res.busy.insert("curve-api-pair c=8".into(), vec![0.74]);
        let mut w = String::new();
        curve_section(&mut w, &View(&res), &res, false);
        let row = w
            .lines()
            .find(|l| l.starts_with("| reservation API pairs, PostgreSQL | 8 |"))
            .expect("a row for c = 8");
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        // subject, c, keys/s, ×c=1, p50, p99, CPU, store CPU, active, batch, busy
        assert_eq!(cells[3], "2500");
        assert_eq!(cells[4], "2.5");
        assert_eq!(cells[5], "2.80");
        assert_eq!(cells[9], "1.2 / 2");
        assert_eq!(cells[11], "74 %");
        // pgbench gives no latency: none is made up.
        let floor = w
            .lines()
            .find(|l| l.starts_with("| floor: pgbench's two statements, PostgreSQL | 8 |"))
            .expect("the floor's row");
        assert!(floor.contains("| 6000 | — | — | — |"), "{floor}");
        // Levels not measured have no row.
        assert!(!w.contains("PostgreSQL | 16 |"), "{w}");
    }
}
