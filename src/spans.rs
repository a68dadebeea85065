//! The spans of a request's path through a door, as `tracing` spans of one
//! target, [`TARGET`]: whatever subscriber the application installed sees
//! them, and the `idemgate` binary exports them over OTLP when
//! `IDEMGATE_OTLP_ENDPOINT` is set (its log lines leave them out).
//!
//! | span | where | attributes |
//! | --- | --- | --- |
//! | [`REQUEST`] | one per door request (the binary's doors) | `idemgate.door`, `http.request.method`, `http.route` (API), `http.response.status_code`, `idemgate.outcome`, `idemgate.key.hash`, `idemgate.tenant` |
//! | [`KEY`] | reading the request's key | `idemgate.key.hash`, `idemgate.outcome` (a refused key) |
//! | [`CLAIM`] | the engine's reserve: replay cache, claim, wait | `idemgate.key.hash`, `idemgate.outcome`, `idemgate.attempt`, `idemgate.wait_ms` |
//! | [`UPSTREAM`] | the proxy's call to its upstream | `http.request.method`, `server.address`, `http.response.status_code` |
//! | [`REPLAY`] | a stored response given back (layer and proxy) | `http.response.status_code` |
//! | [`COMMIT`] | storing a response | `idemgate.outcome`, `idemgate.stored.status` |
//! | [`RELEASE`] | forgetting a key whose effect never started | `idemgate.outcome` |
//!
//! `idemgate.key.hash` is the first 12 hex digits of the key's SHA-256, as
//! in the logs; `idemgate.tenant` is what the logs show of the tenant. No
//! span holds a raw key, a request or response body, a token or an
//! `Authorization` header.
//!
//! This module stands below everything that opens a span: it names the
//! spans and their fields and takes plain values, so that the key reader,
//! the engine, the layer and the doors all use it and it uses none of them.

use tracing::Span;

/// The target of every span here: `RUST_LOG` directives and per-layer
/// filters select them by it.
pub const TARGET: &str = "idemgate::spans";

/// A request through a door.
pub const REQUEST: &str = "idemgate.request";
/// Reading the request's key.
pub const KEY: &str = "idemgate.key";
/// The engine's reserve.
pub const CLAIM: &str = "idemgate.claim";
/// The proxy's upstream call.
pub const UPSTREAM: &str = "idemgate.upstream";
/// A stored response replayed.
pub const REPLAY: &str = "idemgate.replay";
/// A response stored.
pub const COMMIT: &str = "idemgate.commit";
/// A key released.
pub const RELEASE: &str = "idemgate.release";

/// The span of reading a key.
pub(crate) fn key() -> Span {
    tracing::info_span!(
        target: TARGET,
        "idemgate.key",
        idemgate.key.hash = tracing::field::Empty,
        idemgate.outcome = tracing::field::Empty,
    )
}

/// The span of the engine's reserve of a key; `key_hash` gives the key's
/// hash prefix, asked for only when the span is enabled.
pub(crate) fn claim(key_hash: impl FnOnce() -> String, wait_ms: u64) -> Span {
    tracing::info_span!(
        target: TARGET,
        "idemgate.claim",
        idemgate.key.hash = %key_hash(),
        idemgate.wait_ms = wait_ms,
        idemgate.outcome = tracing::field::Empty,
        idemgate.attempt = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// Records the reserve's decision on its span: its `outcome`, and the
/// `attempt` of a reservation.
pub(crate) fn claimed(span: &Span, outcome: &str, attempt: Option<i32>) {
    span.record("idemgate.outcome", outcome);
    if let Some(attempt) = attempt {
        span.record("idemgate.attempt", attempt);
    }
}

/// The span of a commit.
pub(crate) fn commit(stored_status: u16) -> Span {
    tracing::info_span!(
        target: TARGET,
        "idemgate.commit",
        idemgate.stored.status = stored_status,
        idemgate.outcome = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// Records what became of a commit on its span: its `outcome`.
pub(crate) fn committed(span: &Span, outcome: &str) {
    span.record("idemgate.outcome", outcome);
}

/// Records on a claim's or a commit's span that the engine failed.
pub(crate) fn failed(span: &Span) {
    span.record("otel.status_code", "ERROR");
}

/// The span of a release.
pub(crate) fn release() -> Span {
    tracing::info_span!(
        target: TARGET,
        "idemgate.release",
        idemgate.outcome = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// The span of a replay.
pub(crate) fn replay(status: u16) -> Span {
    tracing::info_span!(
        target: TARGET,
        "idemgate.replay",
        http.response.status_code = status,
    )
}

/// Records on the request's span (the current one, in a door) what the
/// layer or the API decided: the outcome, the key's hash prefix, the tenant
/// as the logs show it. A field the current span does not have is ignored.
pub(crate) fn record_request(outcome: Option<&str>, key_hash: Option<&str>, tenant: Option<&str>) {
    let span = Span::current();
    if span.is_disabled() {
        return;
    }
    if let Some(outcome) = outcome {
        span.record("idemgate.outcome", outcome);
    }
    if let Some(key_hash) = key_hash {
        span.record("idemgate.key.hash", key_hash);
    }
    if let Some(tenant) = tenant {
        span.record("idemgate.tenant", tenant);
    }
}
