//! Traces over OTLP: with `IDEMGATE_OTLP_ENDPOINT` set, the spans of
//! [`crate::spans`] are exported to `ENDPOINT/v1/traces` as OTLP/HTTP
//! protobuf, in batches from a background thread, through the binary's own
//! hyper client and rustls; W3C trace context (`traceparent`,
//! `tracestate`) is read from each door request and written into the
//! request the proxy sends upstream. Unset, no exporter exists and the
//! spans are disabled: a proxied request's `traceparent` reaches the
//! upstream as the client sent it, like any other end-to-end header.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use http::HeaderMap;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider};
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::server::tls::{self, Connector, Trust};
use crate::spans;

/// The service name when `OTEL_SERVICE_NAME` is unset.
pub const SERVICE_NAME: &str = "idemgate";

/// The longest one export may take, connection included.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The most of a collector's answer read.
const MAX_ANSWER: usize = 4 * 1024 * 1024;

/// `ENDPOINT/v1/traces`, where OTLP/HTTP takes spans: the endpoint is a
/// base URL, as OpenTelemetry's `OTEL_EXPORTER_OTLP_ENDPOINT` is.
pub fn traces_url(endpoint: &str) -> String {
    format!("{}/v1/traces", endpoint.trim().trim_end_matches('/'))
}

/// The exporter's provider, to flush and shut down once the command ends.
#[derive(Debug)]
pub struct Exporting {
    provider: SdkTracerProvider,
}

impl Exporting {
    /// Exports the spans still queued and stops the exporter; waits at
    /// most the export timeout for the collector.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown());
        match tokio::time::timeout(EXPORT_TIMEOUT + Duration::from_secs(1), done).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the last spans could not be exported"),
            Ok(Err(_)) | Err(_) => {
                tracing::warn!("the last spans could not be exported in time");
            }
        }
    }
}

/// The tracing layer that exports [`crate::spans`] to `endpoint` (a base
/// URL), with the W3C trace-context propagator installed globally.
///
/// # Errors
/// When the exporter cannot be built (there is no runtime, or TLS set-up
/// failed).
pub fn layer<S>(
    endpoint: &str,
) -> Result<
    (
        tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>,
        Exporting,
    ),
    String,
>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let url = traces_url(endpoint);
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| "traces need the tokio runtime".to_owned())?;
    let connector = tls::connector(url.starts_with("https:"), Trust::System, EXPORT_TIMEOUT)?;
    let client = OtlpClient {
        client: Client::builder(TokioExecutor::new()).build(connector),
        runtime,
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| format!("the OTLP exporter could not be built: {e}"))?;
    // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are read by the
    // builder; the service is `idemgate` unless they name it.
    let named = std::env::var_os("OTEL_SERVICE_NAME").is_some_and(|v| !v.is_empty());
    let resource = if named {
        Resource::builder().build()
    } else {
        Resource::builder().with_service_name(SERVICE_NAME).build()
    };
    // The batch processor's own thread; OTEL_BSP_* tune it.
    let provider = SdkTracerProvider::builder()
        .with_span_processor(BatchSpanProcessor::builder(exporter).build())
        .with_resource(resource)
        .build();
    let tracer = provider.tracer(SERVICE_NAME);
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_threads(false)
        .with_location(false);
    Ok((layer, Exporting { provider }))
}

/// Posts OTLP requests through the proxy's hyper client and rustls, on the
/// runtime that built it: the batch processor's thread only waits.
struct OtlpClient {
    client: Client<Connector, Body>,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for OtlpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpClient").finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl HttpClient for OtlpClient {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let sent = self.runtime.spawn(async move {
            let call = async {
                let res = client.request(request.map(Body::from)).await?;
                let (parts, body) = res.into_parts();
                let body = http_body_util::Limited::new(body, MAX_ANSWER)
                    .collect()
                    .await?
                    .to_bytes();
                Ok::<_, HttpError>(http::Response::from_parts(parts, body))
            };
            match tokio::time::timeout(EXPORT_TIMEOUT, call).await {
                Ok(answer) => answer,
                Err(_) => Err("the collector did not answer in time".into()),
            }
        });
        sent.await?
    }
}

/// The span of a door's request ([`spans::REQUEST`]), a child of the
/// caller's span when the request carries W3C trace context: `door` is
/// `api`, `proxy` or `mcp`. The reservation API traces its
/// `/v1/reservations` requests only, not health checks, metrics or pages.
pub async fn door_span(door: &'static str, req: Request, next: Next) -> Response {
    if door == "api" && !req.uri().path().starts_with("/v1/reservations") {
        return next.run(req).await;
    }
    let span = tracing::info_span!(
        target: spans::TARGET,
        "idemgate.request",
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        idemgate.door = door,
        http.request.method = %req.method(),
        http.route = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        idemgate.outcome = tracing::field::Empty,
        idemgate.key.hash = tracing::field::Empty,
        idemgate.tenant = tracing::field::Empty,
    );
    if span.is_disabled() {
        return next.run(req).await;
    }
    if let Some(route) = req.extensions().get::<MatchedPath>() {
        span.record("http.route", route.as_str());
    }
    let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.extract(&HeaderExtractor(req.headers()))
    });
    // No trace context (or no OTel layer) leaves the span a root.
    let _ = span.set_parent(parent);
    let res = next.run(req).instrument(span.clone()).await;
    let status = res.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    res
}

/// Writes the current span's trace context (`traceparent`, `tracestate`)
/// into `headers`, replacing what the client sent; without an exporter,
/// leaves them as they are.
pub fn inject(headers: &mut HeaderMap) {
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&cx, &mut HeaderInjector(headers));
    });
}
