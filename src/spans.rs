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

use tracing::Span;

use crate::engine::{CommitOutcome, EngineError, ReserveOutcome};

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

/// The span of the engine's reserve of `key_hash`.
pub(crate) fn claim(key_hash: &[u8; 32], wait_ms: u64) -> Span {
    tracing::info_span!(
        target: TARGET,
        "idemgate.claim",
        idemgate.key.hash = %crate::key::hash_prefix(key_hash),
        idemgate.wait_ms = wait_ms,
        idemgate.outcome = tracing::field::Empty,
        idemgate.attempt = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// Records the reserve's decision on its span.
pub(crate) fn claimed(span: &Span, decision: &Result<ReserveOutcome, EngineError>) {
    match decision {
        Ok(outcome) => {
            span.record("idemgate.outcome", outcome.outcome().as_str());
            if let ReserveOutcome::Reserved(reservation) = outcome {
                span.record("idemgate.attempt", reservation.attempt);
            }
        }
        Err(_) => {
            span.record("otel.status_code", "ERROR");
        }
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

/// Records what became of a commit on its span.
pub(crate) fn committed(span: &Span, outcome: &Result<CommitOutcome, EngineError>) {
    match outcome {
        Ok(CommitOutcome::Committed(_)) => span.record("idemgate.outcome", "committed"),
        Ok(CommitOutcome::AlreadyCommitted(_)) => {
            span.record("idemgate.outcome", "already_committed")
        }
        Ok(CommitOutcome::Refused(_)) => span.record("idemgate.outcome", "refused"),
        Err(_) => span.record("otel.status_code", "ERROR"),
    };
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
