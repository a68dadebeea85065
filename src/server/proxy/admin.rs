//! The admin listener: the reservation API's operational endpoints, with
//! `/v1/policy` describing the proxy (its key header, what it stores, its
//! routes) rather than the reservation API.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use serde_json::{Value, json};

use crate::engine::Engine;
use crate::layer::{LayerPolicy, TenantSource};
use crate::server::api::{self, AppState};
use crate::server::auth::Tokens;
use crate::server::config::{AdminAccess, AdminMode, ProxyArgs};
use crate::server::console;
use crate::server::serve::hosts::HostRule;

/// The admin router over the proxy's `engine`, whose operators' endpoints
/// settle keys in the proxy's own replay cache and wake its waiters.
pub fn router(engine: Arc<Engine>, args: &ProxyArgs, policy: &LayerPolicy) -> Router {
    let sealed = engine.seals();
    let state = AppState::new(
        engine,
        Tokens::default(),
        args.admin.access(args.admin_listen, &Tokens::default()),
        &args.policy,
        // The admin listener takes no reservation; the proxy publishes its
        // own fingerprint rule (`policy_patch`).
        false,
    );
    let patch = Arc::new(policy_patch(args, policy, sealed));
    let console = console::router(console::Console::new(
        state.engine.clone(),
        state.admin.clone(),
        state.max_body_bytes,
        false,
    ));
    host_rule(&state.admin).guard(
        api::admin_router(state)
            .merge(console)
            .layer(axum::middleware::from_fn_with_state(patch, publish)),
    )
}

/// The names the admin listener answers: open without admin tokens (a
/// loopback listener), it answers only requests for its own address or a
/// name of `IDEMGATE_ALLOWED_HOSTS`; with them, it is checked where that is
/// set.
pub fn host_rule(access: &AdminAccess) -> HostRule {
    HostRule::new(access.mode() == AdminMode::Open, access.allowed_hosts())
}

/// What the proxy publishes over the reservation API's policy.
fn policy_patch(args: &ProxyArgs, policy: &LayerPolicy, sealed: bool) -> Value {
    let statuses: Vec<String> = policy.release_statuses.iter().map(u16::to_string).collect();
    let tenant = match &policy.tenant {
        TenantSource::Header(h) => format!(
            "keys are scoped by tenant: (SHA-256 of the {h} header, SHA-256(key)); requests \
             without it share one anonymous tenant"
        ),
        TenantSource::Parts(parts) => format!(
            "keys are scoped by tenant: (SHA-256 of the request's {} together, SHA-256(key)); \
             requests with none of them share one anonymous tenant",
            parts
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        TenantSource::Single | TenantSource::From(_) => "one tenant: (SHA-256(key))".to_owned(),
    };
    let sources: Vec<String> = match &policy.tenant {
        TenantSource::Header(h) => vec![h.to_string()],
        TenantSource::Parts(parts) => parts.iter().map(ToString::to_string).collect(),
        TenantSource::Single | TenantSource::From(_) => Vec::new(),
    };
    json!({
        "header": args.key_header.spelled,
        "tenant_scoping": tenant,
        "tenant_sources": sources,
        "require_tenant": policy.require_tenant,
        "lease_seconds": { "default": policy.lease.as_secs() },
        "on_lease_expiry": {
            "default": policy.on_lease_expiry.as_str(),
            "rule": "a key whose proxy was killed, stalled or cut off from the database past its \
                     lease, or whose upstream call broke off after it was sent: `hold` answers \
                     409 outcome-unknown until its late commit or an operator settles it; \
                     `takeover` sends it upstream again with Idempotency-Attempt: N",
        },
        "default_wait_seconds": policy.default_wait.map_or(0, |w| w.as_secs()),
        // Every guarded request is fingerprinted from its method, path and
        // body: no key goes unchecked.
        "fingerprint": { "required": true },
        "stored_response": {
            "statuses": format!(
                "every status is stored and replayed except {}, which release the key",
                statuses.join(", ")
            ),
            "headers_not_stored": policy
                .store_headers_deny
                .iter()
                .map(|h| h.as_str())
                .chain(["hop-by-hop headers"])
                .collect::<Vec<_>>(),
            "sealed_at_rest": sealed,
            "over_the_limit": "passed through; replayed with its status and headers, an empty body and Idempotency-Body-Omitted: true",
            "streamed": "a response body is passed to the client as it arrives and recorded as it passes; the client's response ends once the key is settled",
        },
        "proxy": {
            "require_key": policy.require_key,
            "release_statuses": policy.release_statuses,
            "upstream_timeout_seconds": args.upstream_timeout().as_secs(),
            "upstream_abandon_after_seconds": args.abandon_after().as_secs(),
            "routes": policy.routes.iter().map(|r| json!({
                "path": r.path(),
                "methods": r.methods.as_ref().map(|m| m.iter().map(|m| m.as_str()).collect::<Vec<_>>()),
                "require_key": r.require_key,
                "ttl_seconds": r.ttl.map(|t| t.as_secs()),
                "on_lease_expiry": r.on_lease_expiry.map(|c| c.as_str()),
            })).collect::<Vec<_>>(),
        },
    })
}

/// Merges the proxy's values into the `/v1/policy` document.
async fn publish(State(patch): State<Arc<Value>>, req: Request, next: Next) -> Response {
    let is_policy = req.uri().path() == "/v1/policy";
    let res = next.run(req).await;
    if !is_policy || !res.status().is_success() {
        return res;
    }
    let (parts, body) = res.into_parts();
    let Ok(bytes) = body.collect().await.map(|b| b.to_bytes()) else {
        return Response::from_parts(parts, Body::empty());
    };
    let Ok(mut doc) = serde_json::from_slice::<Value>(&bytes) else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    merge(&mut doc, &patch);
    axum::Json(doc).into_response()
}

/// JSON merge patch (RFC 7396) without deletions.
fn merge(doc: &mut Value, patch: &Value) {
    match (doc, patch) {
        (Value::Object(doc), Value::Object(patch)) => {
            for (k, v) in patch {
                merge(doc.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (doc, patch) => *doc = patch.clone(),
    }
}
