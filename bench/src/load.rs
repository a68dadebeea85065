//! The closed-loop load runner: `c` workers, each sending its next request as
//! soon as the previous one is answered, for a warm-up and then a measured
//! window. Latencies go into one HDR histogram per worker, merged at the end.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// One simulated client. `seq` counts its calls from 0, so a worker can make a
/// unique key per call without sharing state with the others.
pub trait Worker: Send + 'static {
    /// One operation (which may be several requests, e.g. reserve + commit).
    fn call(&mut self, seq: u64) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// What one measured window came to.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Operations that succeeded, ending inside the window.
    pub ops: u64,
    /// Operations that failed, ending inside the window.
    pub errors: u64,
    /// Length of the window.
    pub secs: f64,
    /// Median latency of one operation, microseconds.
    pub p50_us: u64,
    /// 99th percentile latency, microseconds.
    pub p99_us: u64,
    /// Every operation started, warm-up and failures included.
    pub all_ops: u64,
}

impl Sample {
    /// Successful operations per second.
    pub fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.ops as f64 / self.secs
        } else {
            0.0
        }
    }
}

/// Runs `workers` for `warmup`, then measures until `end` resolves.
pub async fn run<W: Worker>(
    workers: Vec<W>,
    warmup: Duration,
    end: impl Future<Output = ()>,
) -> anyhow::Result<Sample> {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let measure_from = started + warmup;
    let mut tasks = Vec::with_capacity(workers.len());
    for mut worker in workers {
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
                .expect("valid histogram bounds");
            let mut errors = 0u64;
            let mut done = 0u64;
            let mut first_error: Option<String> = None;
            let mut seq = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let result = worker.call(seq).await;
                seq += 1;
                // Throughput counts the calls that ended inside the window,
                // wherever they began: counting only those that also began
                // in it would leave out one latency's worth of the window
                // (6 % of 5 s at a 300 ms p50), which at c = 256 is no longer
                // noise beside c = 32. Latencies are of calls begun in it.
                if Instant::now() < measure_from || stop.load(Ordering::Relaxed) {
                    continue;
                }
                match result {
                    Ok(()) => {
                        done += 1;
                        if t >= measure_from {
                            let us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
                            hist.saturating_record(us.max(1));
                        }
                    }
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| format!("{e:#}"));
                    }
                }
            }
            (hist, done, errors, first_error, seq)
        }));
    }
    tokio::time::sleep_until(measure_from.into()).await;
    let window = Instant::now();
    end.await;
    stop.store(true, Ordering::Relaxed);
    let secs = window.elapsed().as_secs_f64();

    let mut all = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut errors = 0;
    let mut ops = 0;
    let mut first_error = None;
    let mut all_ops = 0;
    for task in tasks {
        let (hist, done, e, first, started) = task.await?;
        all.add(&hist)?;
        ops += done;
        errors += e;
        all_ops += started;
        if first_error.is_none() {
            first_error = first;
        }
    }
    if let Some(first) = first_error {
        eprintln!("    {errors} errors; the first: {first}");
    }
    Ok(Sample {
        ops,
        errors,
        secs,
        p50_us: all.value_at_quantile(0.50),
        p99_us: all.value_at_quantile(0.99),
        all_ops,
    })
}

/// Runs `workers` for `warmup`, then measures for `measure`.
pub async fn run_for<W: Worker>(
    workers: Vec<W>,
    warmup: Duration,
    measure: Duration,
) -> anyhow::Result<Sample> {
    // An async block, so the window's clock starts after the warm-up, not
    // when this is called.
    run(
        workers,
        warmup,
        async move { tokio::time::sleep(measure).await },
    )
    .await
}

/// The median of some values (the mean of the middle two for an even count).
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Sleeper;

    impl Worker for Sleeper {
        async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
            tokio::time::sleep(Duration::from_millis(2)).await;
            if seq % 10 == 9 {
                anyhow::bail!("every tenth call fails");
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn counts_successes_and_errors_inside_the_window() {
        let sample = run_for(
            vec![Sleeper, Sleeper],
            Duration::from_millis(50),
            Duration::from_millis(300),
        )
        .await
        .unwrap();
        assert!(sample.ops > 20, "{sample:?}");
        assert!(sample.errors > 0, "{sample:?}");
        assert!(sample.p50_us >= 2000, "{sample:?}");
        assert!(sample.secs >= 0.3, "{sample:?}");
    }

    struct Slow;

    impl Worker for Slow {
        async fn call(&mut self, _seq: u64) -> anyhow::Result<()> {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok(())
        }
    }

    #[tokio::test]
    async fn throughput_counts_calls_ending_in_the_window_however_long_they_take() {
        // Two workers, 100 ms a call, a 400 ms window: about 8 calls end in
        // it; counting only those begun in it too would give about 6.
        let sample = run_for(
            vec![Slow, Slow],
            Duration::from_millis(50),
            Duration::from_millis(400),
        )
        .await
        .unwrap();
        assert!(sample.ops >= 7, "{sample:?}");
        assert!(sample.rate() > 17.0, "{sample:?}");
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }
}
