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
///
/// With `otlp` (`IDEMGATE_OTLP_ENDPOINT`), the spans of
/// [`crate::spans`] are exported there too ([`otel`](super::otel)); the
/// log lines never show them. The returned exporter is to be shut down at
/// the end, so that the last spans are sent.
pub fn init_tracing(json: bool, otlp: Option<&str>) -> Option<super::otel::Exporting> {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;

    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let rust_log = std::env::var("RUST_LOG").unwrap_or_default();
    // The spans are the exporter's, not the log lines' (unless RUST_LOG
    // names them).
    if !rust_log.contains(crate::spans::TARGET)
        && let Ok(off) = format!("{}=off", crate::spans::TARGET).parse()
    {
        filter = filter.add_directive(off);
    }
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let ansi = !json && !no_color && std::io::stderr().is_terminal();
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let fmt = if json {
        fmt.json().flatten_event(true).boxed()
    } else {
        fmt.boxed()
    };
    let mut failed = None;
    let (otel, exporting) = match otlp.map(super::otel::layer) {
        Some(Ok((layer, exporting))) => {
            let only_spans = tracing_subscriber::filter::Targets::new()
                .with_target(crate::spans::TARGET, tracing::Level::TRACE);
            (Some(layer.with_filter(only_spans)), Some(exporting))
        }
        Some(Err(e)) => {
            failed = Some(e);
            (None, None)
        }
        None => (None, None),
    };
    // A second init (tests, embedding) keeps the first subscriber. No
    // `Option` of a layer when there is no exporter: a `None` layer takes an
    // interest in every callsite, so the registry would make every span of
    // `crate::spans` at `info` that no layer reads (BENCHMARKS.md, "Changes
    // measured").
    let logs = tracing_subscriber::registry().with(fmt.with_filter(filter));
    let _ = match otel {
        Some(otel) => logs.with(otel).try_init(),
        None => logs.try_init(),
    };
    if let Some(e) = failed {
        tracing::warn!(error = %e, "traces are not exported");
    }
    exporting
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

/// `/metrics` in Prometheus text format: every series recorded so far, and,
/// in a build that counts its allocations, the allocator's counts as of now.
pub fn render() -> String {
    #[cfg(feature = "count-alloc")]
    super::alloc_count::record();
    metrics_handle().render()
}
