//! The binary's logs (tracing, human or JSON) and its Prometheus exporter,
//! which renders the series every door records.

use std::io::IsTerminal as _;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

/// Installs the global tracing subscriber, writing to standard error: human
/// by default, JSON when asked, level from `RUST_LOG` (default `info`). Human
/// lines are coloured only when standard error is a terminal (and `NO_COLOR`
/// is unset), so a file or a pipe gets no escape sequences.
pub fn init_tracing(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let ansi = !json && !no_color && std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    // A second init (tests, embedding) keeps the first subscriber.
    let _ = if json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
}

/// The process-wide Prometheus recorder, installed on first use.
pub fn metrics_handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full("idemgate_request_duration_seconds".into()),
                &[
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0,
                ],
            )
            .unwrap_or_else(|_| PrometheusBuilder::new());
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be global (an embedding application's);
        // ours then still renders what it was given directly.
        let _ = metrics::set_global_recorder(recorder);
        crate::telemetry::describe();
        handle
    })
}
