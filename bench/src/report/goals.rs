//! The goals table: each target beside what this run measured, each ratio
//! the median of per-run ratios whose two sides were measured in one run
//! (the subject right after its baseline where the scenario allows).

use std::fmt::Write as _;

use super::costs::{FLEET, field, per_key_ratio};
use super::{
    Metric, STREAM_DOORS, View, cpu, cpu_ratio, own_work_ms, storm_goal, stream_own_ms, times,
    verdict,
};
use crate::load::median;
use crate::suite::{MANY, Results};

/// The proxy doors beside their store's floor at c = 8: the store, the
/// door's label, the floor's.
const FLOORED_PROXY: [(&str, &str, &str); 2] = [
    ("PostgreSQL", "idemgate-new c=8", "pg-floor-proxy c=8"),
    (
        "SQLite",
        "idemgate-sqlite-new c=8",
        "sqlite-floor-proxy c=8",
    ),
];

/// New keys on PostgreSQL beside the pgbench floor measured right before
/// them: what, the label, the floor's.
const PG_BESIDE_FLOOR: [(&str, &str, &str); 3] = [
    (
        "reservation API pairs, c = 8",
        "api-pair c=8",
        "pg-floor-api c=8",
    ),
    (
        "reservation API pairs, c = 32",
        "api-pair c=32",
        "pg-floor-api c=32",
    ),
    (
        "proxy new keys, c = 8",
        "idemgate-new c=8",
        "pg-floor-proxy c=8",
    ),
];

/// p50 at c = 1 beyond the origin's and the store's two writes, per run:
/// the SQLite door less the origin and less the SQLite floor's key at
/// c = 1 (two group-committed writes), measured in turn.
fn sqlite_added_ms(v: &View) -> Option<f64> {
    let mut per_run: Vec<f64> = v
        .runs("idemgate-sqlite-new c=1")
        .iter()
        .zip(v.runs("origin c=1"))
        .zip(v.runs("sqlite-floor-proxy c=1"))
        .map(|((p, o), f)| (p.p50_us as f64 - o.p50_us as f64 - f.p50_us as f64) / 1000.0)
        .collect();
    (!per_run.is_empty()).then(|| median(&mut per_run))
}

/// One row at c = 256: no failed request, throughput at least c = 32's,
/// and a p99.
fn fleet_row(w: &mut String, v: &View, name: &str, stem: &str) {
    let many = format!("{stem} c={MANY}");
    let runs = v.runs(&many);
    if runs.is_empty() {
        let _ = writeln!(
            w,
            "| c = {MANY}: no error, throughput ≥ c = 32's, p99 reported, {name} | — | not measured |"
        );
        return;
    }
    let errors: u64 = runs.iter().map(|s| s.errors).sum();
    let r = v.ratio(&many, &format!("{stem} c=32"), Metric::Rate);
    let p99 = v.med(&many, Metric::P99).map(|us| us / 1000.0);
    let ok = errors == 0 && r.is_some_and(|r| r >= 1.0) && p99.is_some_and(|p| p > 0.0);
    let _ = writeln!(
        w,
        "| c = {MANY}: no error, throughput ≥ c = 32's, p99 reported, {name} | {} errors, {} c = 32's, p99 {} | {} |",
        errors,
        times(r),
        p99.map_or("—".into(), |ms| format!("{ms:.2} ms")),
        if ok { "met" } else { "**not met**" }
    );
}

fn row(w: &mut String, goal: &str, r: Option<f64>, ok: impl Fn(f64) -> bool) {
    let _ = writeln!(w, "| {goal} | {} | {} |", times(r), verdict(r, ok));
}

/// One reservation-pairs row beside pgbench's two statements: the ratio,
/// and the database's CPU and WAL per key beside the floor's.
fn pg_pairs_row(w: &mut String, v: &View, res: &Results, c: u32, goal: f64) {
    let (label, floor) = (format!("api-pair c={c}"), format!("pg-floor-api c={c}"));
    let r = v.ratio(&label, &floor, Metric::Rate);
    let fig = |l: &str, f: fn(&crate::costs::PerKey) -> Option<f64>, digits: usize| {
        field(res, l, f).map_or("—".into(), |x| format!("{x:.digits$}"))
    };
    let _ = writeln!(
        w,
        "| reservation pairs on PostgreSQL ÷ pgbench's two statements, c = {c}, ≥ {goal} × | {} (database per key: {} µs CPU, {} B of WAL in {} records; the floor's: {} µs, {} B, {}) | {} |",
        times(r),
        fig(&label, |k| k.db_cpu_us, 0),
        fig(&label, |k| k.wal_bytes, 0),
        fig(&label, |k| k.wal_records, 1),
        fig(&floor, |k| k.db_cpu_us, 0),
        fig(&floor, |k| k.wal_bytes, 0),
        fig(&floor, |k| k.wal_records, 1),
        verdict(r, |r| r >= goal)
    );
}

/// The goals table.
pub(super) fn goals(w: &mut String, v: &View, res: &Results, prune_rows: u64) {
    let _ = writeln!(w, "### Goals\n");
    let _ = writeln!(w, "| goal | measured | |\n|---|---|---|");
    for (c, goal) in [(32, 0.9), (8, 0.8)] {
        pg_pairs_row(w, v, res, c, goal);
    }
    row(
        w,
        "proxy new keys on PostgreSQL ÷ idempotent-proxy, c = 32, ≥ 0.7 ×",
        v.ratio("idemgate-new c=32", "ipx-new c=32", Metric::Rate),
        |r| r >= 0.7,
    );
    for (c, goal) in [(32, 1.0), (8, 0.8)] {
        row(
            w,
            &format!(
                "proxy new keys on SQLite ÷ idempotent-proxy on Redis, c = {c}, ≥ {goal:.1} ×"
            ),
            v.ratio(
                &format!("idemgate-sqlite-new c={c}"),
                &format!("ipx-new c={c}"),
                Metric::Rate,
            ),
            |r| r >= goal,
        );
    }
    for (store, door) in [
        ("PostgreSQL", "idemgate-new c=8"),
        ("SQLite", "idemgate-sqlite-new c=8"),
    ] {
        let r = cpu_ratio(res, door, "ipx-new c=8");
        let _ = writeln!(
            w,
            "| CPU of idemgate's process per proxied new key ≤ the peer's (idempotent-proxy), c = 8, {store} | {} µs against {} µs ({}) | {} |",
            cpu(res, door),
            cpu(res, "ipx-new c=8"),
            times(r),
            verdict(r, |r| r <= 1.0)
        );
    }
    for (store, door, floor) in FLOORED_PROXY {
        row(
            w,
            &format!(
                "earlier: proxy new keys ÷ its store's measured floor, c = 8, {store}, ≥ 0.8 ×"
            ),
            v.ratio(door, floor, Metric::Rate),
            |r| r >= 0.8,
        );
    }
    for c in [8, 32] {
        row(
            w,
            &format!("earlier: SQLite reservation pairs ÷ SQLite's floor, c = {c}, ≥ 0.7 ×"),
            v.ratio(
                &format!("sqlite-pair c={c}"),
                &format!("sqlite-floor-sqlite c={c}"),
                Metric::Rate,
            ),
            |r| r >= 0.7,
        );
    }
    for (what, label, floor) in PG_BESIDE_FLOOR {
        let r = per_key_ratio(res, label, floor, |k| k.db_cpu_us);
        let us =
            |l: &str| field(res, l, |k| k.db_cpu_us).map_or("—".into(), |u| format!("{u:.0}"));
        let _ = writeln!(
            w,
            "| earlier: PostgreSQL's CPU per new key ≤ 1.5 × the floor's, {what} | {} µs against {} µs ({}) | {} |",
            us(label),
            us(floor),
            times(r),
            verdict(r, |r| r <= 1.5)
        );
    }
    for (store, added) in [
        ("PostgreSQL", own_work_ms(v)),
        ("SQLite", sqlite_added_ms(v)),
    ] {
        let _ = writeln!(
            w,
            "| earlier: added p50 at c = 1 beyond the origin and the store's two writes ≤ 0.15 ms, {store} | {} | {} |",
            added.map_or("—".into(), |ms| format!("{ms:.2} ms")),
            verdict(added, |ms| ms <= 0.15)
        );
    }
    for (name, stem) in FLEET {
        fleet_row(w, v, name, stem);
    }
    for c in [8, 32] {
        for (store, door) in [("PostgreSQL", "idemgate"), ("SQLite", "idemgate-sqlite")] {
            row(
                w,
                &format!("kept: proxy replays ≥ 2.5 × the peer's, c = {c}, {store}"),
                v.ratio(
                    &format!("{door}-replay c={c}"),
                    &format!("ipx-replay c={c}"),
                    Metric::Rate,
                ),
                |r| r >= 2.5,
            );
        }
    }
    storm_goal(w, v, res);
    row(
        w,
        &format!("kept: live p99 while pruning {prune_rows} expired rows ≤ 2 × without, c = 8"),
        v.ratio("prune-on c=8", "prune-off c=8", Metric::P99),
        |r| r <= 2.0,
    );
    for c in [8, 32] {
        row(
            w,
            &format!("kept: replays ≥ 1.0 × raw primary-key SELECT, c = {c}"),
            v.ratio(
                &format!("api-replay c={c}"),
                &format!("raw-select c={c}"),
                Metric::Rate,
            ),
            |r| r >= 1.0,
        );
    }
    for c in [8, 32] {
        row(
            w,
            &format!("kept: SQLite reservation pairs ≥ 1.5 × PostgreSQL's, c = {c}"),
            v.ratio(
                &format!("sqlite-pair c={c}"),
                &format!("api-pair c={c}"),
                Metric::Rate,
            ),
            |r| r >= 1.5,
        );
    }
    let p50 = v.med("sqlite-pair c=32", Metric::P50).map(|us| us / 1000.0);
    let _ = writeln!(
        w,
        "| kept: SQLite p50 at c = 32 < 10 ms | {} | {} |",
        p50.map_or("—".into(), |ms| format!("{ms:.2} ms")),
        verdict(p50, |ms| ms < 10.0)
    );
    for (store, door, origin, claim) in STREAM_DOORS {
        let d = v.diff_ms(door, origin, Metric::P50);
        let _ = writeln!(
            w,
            "| kept: streamed response: first byte through the proxy within 1 ms of the origin's, p50, c = 1, {store} | {} | {} |",
            d.map_or("—".into(), |ms| format!("{ms:+.2} ms")),
            verdict(d, |ms| ms <= 1.0)
        );
        let own = stream_own_ms(v, door, origin, claim);
        let _ = writeln!(
            w,
            "| kept: streamed response: the proxy's own work on the first byte ≤ 1 ms p50 at c = 1, beside the claim's durable write, {store} | {} | {} |",
            own.map_or("—".into(), |ms| format!("{ms:+.2} ms")),
            verdict(own, |ms| ms <= 1.0)
        );
    }
    let _ = writeln!(w);
}
