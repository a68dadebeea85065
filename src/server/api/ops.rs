//! Operational endpoints and the published policy: no token needed.

use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use super::problems::StoreUnavailable;
use crate::fingerprint;
use crate::key;
use crate::problem::{ApiError, DEFAULT_PROBLEM_BASE};
use crate::server::views::{KeyFormat, LeaseExpiry};
use crate::telemetry;

/// How long readiness waits for the database.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// Liveness: the process is up.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ok`.
    pub status: &'static str,
}

/// The published idempotency policy: what a client may rely on.
#[derive(Debug, Serialize, ToSchema)]
pub struct Policy {
    /// The request header that carries the key.
    pub header: &'static str,
    /// The IETF draft implemented.
    pub specification: &'static str,
    /// Key rules.
    pub key: KeyRules,
    /// Lease bounds, in seconds: how long a holder owns a key before another
    /// caller may take it over.
    pub lease_seconds: Bounds,
    /// Key lifetime bounds, in seconds, counted from the first reservation.
    pub ttl_seconds: Bounds,
    /// The response header that carries each key's expiry (an HTTP-date).
    pub expiry_header: &'static str,
    /// Longest `Prefer: wait=N` honoured, in seconds.
    pub max_wait_seconds: u64,
    /// How long a duplicate of a key in flight is held when it does not send
    /// `Prefer: wait` (0: answered at once). The reservation API answers at
    /// once; the proxy and the layer hold it.
    pub default_wait_seconds: u64,
    /// What a lease that ends without a commit or release means.
    pub on_lease_expiry: LeaseExpiryRules,
    /// How requests are fingerprinted.
    pub fingerprint: FingerprintRules,
    /// Methods the proxy and the layer guard.
    pub guarded_methods: Vec<String>,
    /// How keys are scoped.
    pub tenant_scoping: &'static str,
    /// Limits on stored responses.
    pub stored_response: StoredResponseRules,
    /// How much of the store one tenant may hold.
    pub tenant_limits: TenantLimitRules,
    /// The guard against a retry that comes after its key expired.
    pub first_sent: FirstSentRules,
    /// The second dialect: OASIS Repeatable Requests 1.0.
    pub repeatability: RepeatabilityRules,
    /// The base of every problem `type` URI; the slug follows.
    pub problem_base: &'static str,
    /// What an acknowledged key survives: `local`, the database server it
    /// was written to (lost with it: a primary lost and an asynchronous
    /// standby promoted), or `synchronous-standby`, the loss of the primary
    /// (a synchronous standby had it before it was acknowledged). As the
    /// server that takes writes last said.
    #[schema(example = "local")]
    pub durability: &'static str,
}

/// A key is new again once it expires, so a retry that comes later would
/// execute again; a request that says when it was first sent is refused
/// instead, with `412 first-sent-too-old`, once that is longer ago than its
/// key would be remembered.
#[derive(Debug, Serialize, ToSchema)]
pub struct FirstSentRules {
    /// The request header of the `Idempotency-Key` dialect (optional): the
    /// HTTP-date at which the request's first attempt was sent.
    pub header: &'static str,
    /// The rule.
    pub rule: &'static str,
    /// How far a client's clock may run ahead without weakening the guard:
    /// the window is the key's TTL less this (less half the TTL, for one
    /// under two minutes).
    pub clock_skew_allowance_seconds: u64,
    /// The window for the default TTL, in seconds.
    pub default_window_seconds: u64,
}

/// OASIS Repeatable Requests 1.0, as Azure services use it: the key in
/// `Repeatability-Request-ID` (scoped by `Repeatability-Client-ID` if sent),
/// the first attempt's time in `Repeatability-First-Sent` (required), and
/// `Repeatability-Result: accepted | rejected` on the answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct RepeatabilityRules {
    /// Whether this server takes the dialect (`IDEMGATE_REPEATABILITY`);
    /// when not, those headers are ignored.
    pub enabled: bool,
    /// The standard.
    pub specification: &'static str,
    /// The request id header (the key).
    pub request_id_header: &'static str,
    /// The first-sent header (required with the request id).
    pub first_sent_header: &'static str,
    /// The client id header (optional; scopes the request id).
    pub client_id_header: &'static str,
    /// The response header.
    pub result_header: &'static str,
}

/// Key rules.
#[derive(Debug, Serialize, ToSchema)]
pub struct KeyRules {
    /// `any` or `uuid`.
    pub format: KeyFormat,
    /// Shortest key.
    pub min_length: usize,
    /// Longest key.
    pub max_length: usize,
    /// Whether bare (unquoted) keys are refused.
    pub strict: bool,
    /// The accepted syntax.
    pub syntax: &'static str,
}

/// What a lease that ends without news means for its key.
#[derive(Debug, Serialize, ToSchema)]
pub struct LeaseExpiryRules {
    /// The choice when the holder names none: `takeover` (the reserve body's
    /// `on_lease_expiry` chooses per reservation).
    pub default: LeaseExpiry,
    /// The rule.
    pub rule: &'static str,
}

/// A default and a maximum.
#[derive(Debug, Serialize, ToSchema)]
pub struct Bounds {
    /// Used when the caller names none.
    pub default: u64,
    /// The most a caller may ask for.
    pub max: u64,
}

/// Fingerprint rules.
#[derive(Debug, Serialize, ToSchema)]
pub struct FingerprintRules {
    /// The method.
    pub method: &'static str,
    /// JSON Pointers left out of JSON bodies.
    pub ignored_pointers: Vec<String>,
    /// Whether every key is checked against its request: `true`, a
    /// reservation that sends neither `fingerprint` nor `request` is refused
    /// with 400 invalid-request (`IDEMGATE_REQUIRE_FINGERPRINT`; the proxy
    /// always fingerprints); `false`, such a reservation is identified by
    /// its key alone, and the key reused with another payload replays.
    pub required: bool,
}

/// Limits on stored responses.
#[derive(Debug, Serialize, ToSchema)]
pub struct StoredResponseRules {
    /// Largest stored body, in bytes.
    pub max_body_bytes: usize,
    /// Which statuses are stored (the reservation API stores what it is given).
    pub statuses: &'static str,
    /// Whether stored responses are sealed at rest (AES-256-GCM,
    /// `IDEMGATE_SEAL_KEY`), with the recovery data of checkpoints.
    pub sealed_at_rest: bool,
}

/// How much of the store one tenant may hold; over a limit, new keys are
/// answered `429 tenant-limit` with `Retry-After`, and replays go on.
#[derive(Debug, Serialize, ToSchema)]
pub struct TenantLimitRules {
    /// Most keys in flight at once (`null`: no limit).
    pub max_in_flight_keys: Option<u32>,
    /// Most bytes of stored responses kept until they expire (`null`: no
    /// limit).
    pub max_stored_bytes: Option<u64>,
}

/// Process up.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "The process is up.", body = Health)))]
pub async fn get_healthz() -> axum::Json<Health> {
    axum::Json(Health { status: "ok" })
}

/// Database reachable.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "The database answers.", body = Health),
        StoreUnavailable,
    ))]
pub async fn get_readyz(State(state): State<AppState>) -> Result<axum::Json<Health>, ApiError> {
    let ready = match tokio::time::timeout(READY_TIMEOUT, state.engine.store().ping()).await {
        Ok(Ok(())) => Ok(axum::Json(Health { status: "ok" })),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(ApiError::StoreUnavailable),
    };
    telemetry::record_store_up(ready.is_ok());
    ready
}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text format.", body = String, content_type = "text/plain")))]
pub async fn get_metrics(State(state): State<AppState>) -> impl IntoResponse {
    // The store's own answer, so that an alert sees an outage with no traffic
    // too (a ping is one round trip per scrape; not counted as an error).
    let up = matches!(
        tokio::time::timeout(READY_TIMEOUT, state.engine.store().ping()).await,
        Ok(Ok(()))
    );
    telemetry::record_store_up(up);
    if let Some(stats) = state.engine.store().pool_stats() {
        telemetry::record_pool(stats);
    }
    telemetry::record_batches(state.engine.batch_stats());
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::server::exporter::render(),
    )
}

/// The published idempotency policy.
#[utoipa::path(get, path = "/v1/policy", tag = "operations",
    responses((status = 200, description = "The policy.", body = Policy)))]
pub async fn get_policy(State(state): State<AppState>) -> axum::Json<Policy> {
    axum::Json(policy(&state))
}

/// The policy this server enforces.
pub fn policy(state: &AppState) -> Policy {
    let limits = state.engine.limits();
    Policy {
        header: "Idempotency-Key",
        specification: "draft-ietf-httpapi-idempotency-key-header-07",
        key: KeyRules {
            format: state.key_policy.format.into(),
            min_length: 1,
            max_length: state.key_policy.max_len,
            strict: state.key_policy.strict,
            syntax: if state.key_policy.strict {
                "an RFC 8941 sf-string of printable ASCII"
            } else {
                "an RFC 8941 sf-string of printable ASCII, or a bare token of visible ASCII"
            },
        },
        lease_seconds: Bounds {
            default: limits.default_lease.as_secs(),
            max: limits.max_lease.as_secs(),
        },
        ttl_seconds: Bounds {
            default: limits.default_ttl.as_secs(),
            max: limits.max_ttl.as_secs(),
        },
        expiry_header: "Idempotency-Expires",
        max_wait_seconds: limits.max_wait.as_secs(),
        default_wait_seconds: 0,
        on_lease_expiry: LeaseExpiryRules {
            default: LeaseExpiry::Takeover,
            rule: "takeover: the next reserve after the lease takes the key over (attempt + 1) \
                   with the last recovery point; hold: the outcome is unknown, and every request \
                   with the key is 409 outcome-unknown until the holder's late commit or \
                   release, or an operator (/v1/admin/keys), settles it",
        },
        fingerprint: FingerprintRules {
            method: fingerprint::METHOD,
            ignored_pointers: state
                .fingerprint_policy
                .ignore
                .iter()
                .map(|p| p.as_str().to_owned())
                .collect(),
            required: state.require_fingerprint,
        },
        guarded_methods: state.methods.clone(),
        tenant_scoping: "keys are scoped by tenant: (tenant, SHA-256(key)); the bearer token names the tenant",
        stored_response: StoredResponseRules {
            max_body_bytes: state.max_body_bytes,
            statuses: "every status the caller commits is stored and replayed",
            sealed_at_rest: state.engine.seals(),
        },
        tenant_limits: TenantLimitRules {
            max_in_flight_keys: state.engine.tenant_limits().max_in_flight,
            max_stored_bytes: state.engine.tenant_limits().max_stored_bytes,
        },
        first_sent: FirstSentRules {
            header: "Idempotency-First-Sent",
            rule: "a request first sent longer ago than its key's TTL, less the clock-skew \
                   allowance, is refused with 412 first-sent-too-old and not executed",
            clock_skew_allowance_seconds: key::dialect::CLOCK_SKEW_ALLOWANCE.as_secs(),
            default_window_seconds: key::dialect::window(limits.default_ttl).as_secs(),
        },
        repeatability: RepeatabilityRules {
            enabled: state.key_policy.repeatability,
            specification: "OASIS Repeatable Requests Version 1.0",
            request_id_header: "Repeatability-Request-ID",
            first_sent_header: "Repeatability-First-Sent",
            client_id_header: "Repeatability-Client-ID",
            result_header: "Repeatability-Result",
        },
        problem_base: DEFAULT_PROBLEM_BASE,
        durability: state.engine.store().durability().as_str(),
    }
}
