//! The allocator's own counts, for the benchmark harness (feature
//! `count-alloc`, off by default): mimalloc wrapped in `stats_alloc`, which
//! counts every allocation and the bytes asked for, and two series on
//! `/metrics` that expose them, so that the harness can read what a key
//! costs the allocator from the difference of two scrapes. Counting costs
//! atomic increments on every allocation and free, so a release build
//! meant for throughput leaves it out.

use std::sync::Once;

use stats_alloc::StatsAlloc;

/// The binary's global allocator when counting (see `src/main.rs`).
pub static ALLOCATOR: StatsAlloc<mimalloc::MiMalloc> = StatsAlloc::new(mimalloc::MiMalloc);

/// Publishes the counts so far, right before `/metrics` is rendered. A
/// reallocation counts as an allocation, and its growth as bytes: both are
/// calls into the allocator that the request path made.
pub fn record() {
    static DESCRIBED: Once = Once::new();
    DESCRIBED.call_once(|| {
        metrics::describe_counter!(
            "idemgate_alloc_total",
            "Allocations (and reallocations) since the process started; only in a build with \
             the count-alloc feature."
        );
        metrics::describe_counter!(
            "idemgate_alloc_bytes_total",
            metrics::Unit::Bytes,
            "Bytes allocated (and grown by reallocation) since the process started; only in a \
             build with the count-alloc feature."
        );
    });
    let stats = ALLOCATOR.stats();
    let calls = stats.allocations + stats.reallocations;
    metrics::counter!("idemgate_alloc_total").absolute(calls as u64);
    metrics::counter!("idemgate_alloc_bytes_total").absolute(stats.bytes_allocated as u64);
}
