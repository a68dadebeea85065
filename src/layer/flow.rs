//! One request through the layer, in three steps. First the request: is its
//! route guarded (if not, or if it carries no key where none is required, it
//! goes to the inner service untouched), its key and a first attempt's age,
//! its tenant, its body within the limit, and its fingerprint. Then the
//! engine's decision, in a task of its own with the call it may lead to
//! ([`super::call`]): a reserved key's holder ([`super::holder`]) calls the
//! inner service and answers; a completed record is replayed (decoded for a
//! retry that cannot take its encoding, [`super::encoding`]); anything else is
//! the problem. Last, the request's metric, span fields and log line.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::response::Response;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::Instrument;

use super::call::{Call, Decided, Decision};
use super::encoding;
use super::headers::replay_headers;
use super::holder::{SettledAs, timed_out};
use super::policy::{Door, LayerPolicy, TenantPart, TenantSource};
use super::shared::{Inner, Shared};
use crate::admission::{self, NotAdmitted};
use crate::engine::{ReserveOutcome, ReserveRequest};
use crate::fingerprint;
use crate::headers::{
    IDEMPOTENCY_ATTEMPT, mark_replayed, prefer_wait, set_expires, set_repeatability_result,
};
use crate::key::{Dialect, KeyError, ModelKey};
use crate::problem::ApiError;
use crate::spans;
use crate::store::{ClaimedRequest, Record};
use crate::telemetry::{self, Outcome};

/// The tenant of requests that carry no tenant header.
const ANONYMOUS: &str = "anonymous";

/// Handles one request.
pub(crate) async fn handle(shared: Arc<Shared>, inner: Inner, mut req: Request<Body>) -> Response {
    let started = Instant::now();
    let policy = &shared.policy;
    let mode = policy.door.as_str();

    let guard = policy.guard(req.method(), req.uri().path());
    if !guard.guarded {
        // Extensions and all: a WebSocket handshake keeps the connection's
        // `OnUpgrade`, and its `101` comes back as it is.
        return passthrough(policy, inner, req, started).await;
    }
    // A guarded request is never upgraded, keyed or not: what a switched
    // connection does next can be neither stored nor replayed.
    req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>();
    let dialect = Dialect::of(req.headers(), &policy.key_policy);
    let seen = Seen {
        mode,
        method: req.method().clone(),
        url_path: req.uri().path().to_owned(),
        started,
        dialect,
    };
    let keyed = match admission::read_key(
        req.headers(),
        &policy.key_header,
        &policy.key_policy,
        dialect,
    ) {
        Ok(keyed) => keyed,
        Err(NotAdmitted::Key(KeyError::Missing)) if !guard.require_key => {
            return passthrough(policy, inner, req, started).await;
        }
        Err(refusal) => return seen.refused(policy, refusal, None),
    };
    if let Err(refusal) = admission::check_first_sent(&keyed, guard.ttl) {
        return seen.refused(policy, refusal, Some(&keyed.key.hash_prefix()));
    }
    // A key a model chose lives in a scope of its own (`ModelKey`).
    let key = if req.extensions().get::<ModelKey>().is_some() {
        keyed.key.in_model_scope()
    } else {
        keyed.key
    };
    // Only a takeover says which attempt a request is; a client's own say
    // is not passed on.
    req.headers_mut().remove(IDEMPOTENCY_ATTEMPT);
    let (parts, body) = req.into_parts();
    let tenant = match tenant_of(&parts, policy) {
        Some(tenant) => tenant,
        None => {
            if let Some(refused) = seen.no_tenant(&shared, &parts.headers) {
                return refused;
            }
            ANONYMOUS.to_owned()
        }
    };
    let body = crate::body::BodyIdleTimeout::apply(&parts.extensions, body);
    let body = match read_body(&parts.headers, body, policy).await {
        Ok(body) => body,
        Err(e) => return policy.problem(e),
    };
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let fingerprint = fingerprint::fingerprint_request(
        parts.method.as_str(),
        path_and_query,
        content_type,
        &body,
        &policy.fingerprint_policy,
    );

    // In a task of its own with the call it may lead to: a client that
    // hangs up (or gets its 504 at the answer timeout) drops this future,
    // never a claim half made, nor the call or the commit after it. A claim
    // whose caller had gone would otherwise be left held for a request
    // that never ran.
    let key_hash = key.hash_prefix();
    let request = ReserveRequest {
        tenant_from_credential: tenant != ANONYMOUS,
        tenant: tenant.clone(),
        key_hash: key.hash(),
        fingerprint: Some(fingerprint),
        lease_seconds: whole_seconds(policy.lease),
        ttl_seconds: whole_seconds(guard.ttl),
        wait: prefer_wait(&parts.headers).or(policy.default_wait),
        on_lease_expiry: guard.on_lease_expiry,
        request: Some(ClaimedRequest::new(
            parts.method.as_str(),
            path_and_query,
            parts
                .headers
                .get("traceparent")
                .and_then(|v| v.to_str().ok()),
        )),
    };
    // A replay is decoded for a retry that cannot take its encoding: its
    // Accept-Encoding is all that is kept of the head for that (the rest
    // goes with the request to the inner service).
    let mut accepted = HeaderMap::new();
    for value in parts.headers.get_all(header::ACCEPT_ENCODING) {
        accepted.append(header::ACCEPT_ENCODING, value.clone());
    }
    // A replay the cache holds claims nothing: it is answered here, with no
    // task of its own. (A later round of a call that asked for input
    // continues its reservation, which only `Call::decide` does.)
    let cached = match parts.extensions.get::<super::Resumes>() {
        None => shared.engine.reserve_from_cache(&request),
        Some(_) => None,
    };
    let Decided { elapsed, decision } = match cached {
        Some(outcome) => Decided {
            elapsed: started.elapsed(),
            decision: Ok(Decision::Other(outcome)),
        },
        None => {
            let call = Call {
                shared: shared.clone(),
                tenant: tenant.clone(),
                key_hash: key_hash.clone(),
                on_lease_expiry: guard.on_lease_expiry,
                inner,
                req: Request::from_parts(parts, Body::from(body)),
            };
            let (decided_tx, decided) = oneshot::channel();
            tokio::spawn(
                call.decide(request, started, decided_tx)
                    .instrument(tracing::Span::current()),
            );
            let Ok(decided) = decided.await else {
                let e = ApiError::Internal("the request task ended without a decision".into());
                return policy.problem(e);
            };
            decided
        }
    };
    let decided = elapsed;
    let decision = match decision {
        // Logged by the conversion (503) or the response (500).
        Err(e) => return policy.problem(ApiError::from(e)),
        Ok(decision) => decision,
    };
    let outcome = decision.outcome();
    let (outcome, settled, res) = match decision {
        Decision::Holding { answer, .. } => match answer.await {
            Ok((SettledAs::Released, res)) => (Outcome::Released, Some(SettledAs::Released), res),
            Ok((settled, res)) => (outcome, Some(settled), res),
            Err(_) => {
                let e = ApiError::Internal("the request task ended without an answer".into());
                (outcome, None, policy.problem(e))
            }
        },
        Decision::Other(ReserveOutcome::Completed(record)) => {
            let replayed = replay(policy, &record);
            let span = spans::replay(replayed.status().as_u16());
            let res = encoding::for_retry(&accepted, replayed)
                .instrument(span)
                .await;
            (outcome, None, res)
        }
        Decision::Other(refused) => {
            let e = ApiError::refusing(&refused)
                .unwrap_or_else(|| ApiError::Internal("a decision without an answer".into()));
            (outcome, None, policy.problem(e))
        }
    };

    seen.answered(outcome, settled, &tenant, &key_hash, decided, res)
}

/// What the request's log lines say of it, and its dialect: the method,
/// and the path without its query, whose values may hold secrets (the record
/// keeps the query for the operator, sealed when responses are), with their
/// OpenTelemetry names. Guarded requests only: a passthrough logs no line of
/// its own.
struct Seen {
    mode: &'static str,
    method: http::Method,
    url_path: String,
    started: Instant,
    dialect: Dialect,
}

impl Seen {
    /// A request refused before the engine (`key_hash`, where its key was
    /// read): counted, logged, answered.
    fn refused(
        &self,
        policy: &LayerPolicy,
        refusal: NotAdmitted,
        key_hash: Option<&str>,
    ) -> Response {
        let outcome = refusal.outcome();
        telemetry::record(self.mode, outcome, self.started.elapsed());
        spans::record_request(Some(outcome.as_str()), key_hash, None);
        match &refusal {
            NotAdmitted::Key(_) => tracing::info!(
                mode = self.mode,
                http.request.method = %self.method,
                url.path = %self.url_path,
                outcome = outcome.as_str(),
                "idempotency key refused"
            ),
            NotAdmitted::FirstSentTooOld { too_old, .. } => tracing::info!(
                mode = self.mode,
                http.request.method = %self.method,
                url.path = %self.url_path,
                key.hash = key_hash.unwrap_or_default(),
                outcome = outcome.as_str(),
                age_seconds = too_old.age.as_secs(),
                "first attempt older than the keys' window: refused, not executed"
            ),
        }
        answered(
            self.dialect,
            outcome,
            policy.problem(refusal.into_problem()),
        )
    }

    /// A keyed request with none of the policy's tenant sources: `401`
    /// where [`LayerPolicy::require_tenant`] says so, before anything is
    /// read, reserved or called; else `None`, the anonymous tenant, which
    /// the first such request that carries a `Cookie` (a credential the
    /// policy does not read) warns about, once per layer.
    fn no_tenant(&self, shared: &Shared, headers: &HeaderMap) -> Option<Response> {
        let policy = &shared.policy;
        let setting = match policy.door {
            Door::Proxy => "IDEMGATE_TENANT_FROM",
            Door::Layer => "LayerPolicy::tenant",
        };
        if policy.require_tenant {
            let outcome = Outcome::Missing;
            telemetry::record(self.mode, outcome, self.started.elapsed());
            spans::record_request(Some(outcome.as_str()), None, None);
            tracing::info!(
                mode = self.mode,
                http.request.method = %self.method,
                url.path = %self.url_path,
                outcome = outcome.as_str(),
                "no credential to scope the key by: refused, not executed"
            );
            let e = ApiError::Unauthorized(match policy.door {
                Door::Proxy => {
                    "this request carries none of the credentials its key is scoped by \
                     (IDEMGATE_TENANT_FROM), and keys without one are refused \
                     (IDEMGATE_REQUIRE_TENANT): send the credential, or no Idempotency-Key"
                }
                Door::Layer => {
                    "this request carries none of the credentials its key is scoped by, and \
                     keys without one are refused: send the credential, or no idempotency key"
                }
            });
            return Some(answered(self.dialect, outcome, policy.problem(e)));
        }
        if headers.contains_key(header::COOKIE)
            && !shared
                .anonymous_cookie_warned
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                mode = self.mode,
                tenant_from = %describe_sources(&policy.tenant),
                "a keyed request carries a Cookie but none of the credentials keys are scoped \
                 by, so it is in the one anonymous tenant, whose replays every request without \
                 them shares: if the Cookie holds the caller's session, name it in {setting} \
                 (e.g. cookie:session), or refuse such requests (IDEMGATE_REQUIRE_TENANT=true). \
                 Said once",
            );
        }
        None
    }

    /// The engine's decision answered: counted, logged, and the answer.
    fn answered(
        &self,
        outcome: Outcome,
        settled: Option<SettledAs>,
        tenant: &str,
        key_hash: &str,
        decided: Duration,
        res: Response,
    ) -> Response {
        telemetry::record(self.mode, outcome, decided);
        let tenant_shown = &tenant[..tenant.len().min(12)];
        spans::record_request(Some(outcome.as_str()), Some(key_hash), Some(tenant_shown));
        tracing::info!(
            mode = self.mode,
            http.request.method = %self.method,
            url.path = %self.url_path,
            tenant.id = %tenant_shown,
            key.hash = %key_hash,
            outcome = outcome.as_str(),
            settled = settled.map(SettledAs::as_str),
            status = res.status().as_u16(),
            "idempotency"
        );
        answered(self.dialect, outcome, res)
    }
}

/// `res` with the `Repeatability-Result` of `outcome`, for a request of
/// OASIS's dialect.
fn answered(dialect: Dialect, outcome: Outcome, mut res: Response) -> Response {
    set_repeatability_result(res.headers_mut(), dialect, outcome.repeatability_result());
    res
}

/// Not guarded: straight through, within the answer timeout (there is no
/// key to keep, so nothing runs on past it). The timeout bounds the wait for
/// the response head only: a body that streams, or a connection that
/// switched protocols after a `101`, is never cut by it.
async fn passthrough(
    policy: &LayerPolicy,
    inner: Inner,
    req: Request<Body>,
    started: Instant,
) -> Response {
    telemetry::record(
        policy.door.as_str(),
        Outcome::Passthrough,
        started.elapsed(),
    );
    let call = inner(req);
    let answer = match policy.answer_timeout {
        Some(within) => match tokio::time::timeout(within, call).await {
            Ok(answer) => answer,
            Err(_) => return timed_out(policy, within, false),
        },
        None => call.await,
    };
    match answer {
        Ok(res) => res,
        Err(e) => policy.problem(ApiError::Internal(format!("the inner service failed: {e}"))),
    }
}

/// The request's tenant under `policy`: the hash of its credentials
/// ([`tenant_hash`]), the anonymous tenant under [`TenantSource::Single`],
/// or `None` when it carries none of the sources the policy names.
fn tenant_of(parts: &http::request::Parts, policy: &LayerPolicy) -> Option<String> {
    let credentials = match &policy.tenant {
        TenantSource::Single => return Some(ANONYMOUS.to_owned()),
        TenantSource::Header(name) => Credentials::Header(header_values(&parts.headers, name)),
        TenantSource::From(of) => return of(parts).map(|id| tenant_hash(&Credentials::Id(&id))),
        TenantSource::Parts(sources) => match sources.as_slice() {
            [TenantPart::Header(name)] => Credentials::Header(header_values(&parts.headers, name)),
            _ => Credentials::Named(
                sources
                    .iter()
                    .map(|source| {
                        let values = match source {
                            TenantPart::Header(name) => header_values(&parts.headers, name),
                            TenantPart::Cookie(name) => cookie_values(&parts.headers, name),
                        };
                        (source, values)
                    })
                    .collect(),
            ),
        },
    };
    let found = match &credentials {
        Credentials::Header(values) => !values.is_empty(),
        Credentials::Named(sources) => sources.iter().any(|(_, values)| !values.is_empty()),
        Credentials::Id(_) => true,
    };
    found.then(|| tenant_hash(&credentials))
}

/// What a request's tenant is hashed from.
enum Credentials<'a> {
    /// One header's values: [`TenantSource::Header`], or a list of one.
    Header(Vec<&'a [u8]>),
    /// The id a [`TenantSource::From`] function returned.
    Id(&'a str),
    /// Each source of a [`TenantSource::Parts`] list of several, in the
    /// list's order, with its values (none where the request lacks it).
    Named(Vec<(&'a TenantPart, Vec<&'a [u8]>)>),
}

/// The tenant of `credentials`: the lowercase hex SHA-256 of an input that
/// no other credentials give. One header's values are joined by `\n`, which
/// no header value holds (the encoding every earlier release used, so a
/// key's tenant survives an upgrade); an id is hashed as it is. A list of
/// sources starts with a NUL byte, which no header value holds either, then
/// names each source and counts and length-prefixes each of its values, so
/// that a value moved from one source to another, split in two, or missing
/// changes the input. The one place a tenant is hashed.
fn tenant_hash(credentials: &Credentials<'_>) -> String {
    fn framed(hasher: &mut Sha256, bytes: &[u8]) {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    }
    let mut hasher = Sha256::new();
    match credentials {
        Credentials::Header(values) => {
            for (i, value) in values.iter().enumerate() {
                if i > 0 {
                    hasher.update(b"\n");
                }
                hasher.update(value);
            }
        }
        Credentials::Id(id) => hasher.update(id.as_bytes()),
        Credentials::Named(sources) => {
            hasher.update(b"\0idemgate-tenant-sources-v1\0");
            for (source, values) in sources {
                framed(&mut hasher, source.to_string().as_bytes());
                hasher.update((values.len() as u64).to_be_bytes());
                for value in values {
                    framed(&mut hasher, value);
                }
            }
        }
    }
    hex::encode(hasher.finalize())
}

/// Every value of the header `name`.
fn header_values<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Vec<&'a [u8]> {
    headers
        .get_all(name)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect()
}

/// Every value of the cookie `name` in the request's `Cookie` header(s)
/// (HTTP/2 may split them), in order.
fn cookie_values<'a>(headers: &'a HeaderMap, name: &str) -> Vec<&'a [u8]> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b';'))
        .filter_map(|pair| {
            let at = pair.iter().position(|&b| b == b'=')?;
            let (key, value) = (pair[..at].trim_ascii(), &pair[at + 1..]);
            (key == name.as_bytes()).then(|| value.trim_ascii())
        })
        .collect()
}

/// The sources a tenant is taken from, by name (never a value), for a log
/// line.
fn describe_sources(source: &TenantSource) -> String {
    match source {
        TenantSource::Single => "none (one tenant)".to_owned(),
        TenantSource::Header(name) => name.to_string(),
        TenantSource::From(_) => "the policy's function".to_owned(),
        TenantSource::Parts(parts) => parts
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
    }
}

/// The whole request body, or `413` once it passes `limit`.
async fn read_body(
    headers: &HeaderMap,
    body: Body,
    policy: &LayerPolicy,
) -> Result<Bytes, ApiError> {
    let limit = policy.max_body_bytes;
    let too_large = || {
        ApiError::PayloadTooLarge(format!(
            "the request body is over the limit of {limit} bytes{}",
            policy.door.setting("IDEMGATE_MAX_BODY_BYTES")
        ))
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(e) if crate::body::timed_out(e.as_ref()) => Err(crate::problem::body_timeout()),
        Err(e) => {
            tracing::debug!(error = %e, "the request body could not be read");
            Err(ApiError::InvalidRequest(
                "the request body could not be read to its end".into(),
            ))
        }
    }
}

/// The stored response, replayed.
fn replay(policy: &LayerPolicy, record: &Record) -> Response {
    let Some(stored) = &record.response else {
        return policy.problem(ApiError::Internal(
            "a completed key has no stored response".into(),
        ));
    };
    let Ok(status) = StatusCode::from_u16(stored.status) else {
        return policy.problem(ApiError::Internal(format!(
            "stored status {} is not valid",
            stored.status
        )));
    };
    let mut res = Response::new(Body::from(stored.body.clone()));
    *res.status_mut() = status;
    // Every replay of every door passes here: whoever wrote the record, its
    // framing is never replayed, hyper frames the body it has.
    *res.headers_mut() = replay_headers(&stored.headers);
    let headers = res.headers_mut();
    mark_replayed(headers);
    set_expires(headers, record.expires_at);
    res
}

/// Whole seconds, at least 1, as the engine takes them.
fn whole_seconds(d: Duration) -> u32 {
    u32::try_from(d.as_secs()).unwrap_or(u32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> http::request::Parts {
        let mut req = Request::builder();
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        req.body(()).unwrap().into_parts().0
    }

    fn tenant(sources: &str, headers: &[(&str, &str)]) -> Option<String> {
        let list = sources
            .split(',')
            .map(|s| TenantPart::parse(s).unwrap())
            .collect();
        let policy = LayerPolicy::default().tenant(TenantSource::Parts(list));
        tenant_of(&parts(headers), &policy)
    }

    #[test]
    fn one_header_hashes_as_every_release_did() {
        let want = hex::encode(Sha256::digest(b"Bearer t1"));
        let by_default = tenant_of(
            &parts(&[("authorization", "Bearer t1")]),
            &LayerPolicy::default(),
        );
        assert_eq!(by_default.as_deref(), Some(want.as_str()));
        assert_eq!(
            tenant("Authorization", &[("authorization", "Bearer t1")]).as_deref(),
            Some(want.as_str())
        );
        assert_eq!(tenant_of(&parts(&[]), &LayerPolicy::default()), None);
    }

    #[test]
    fn cookies_are_read_by_name_across_cookie_headers() {
        let a = tenant("cookie:session", &[("cookie", "theme=dark; session=A")]);
        let a_again = tenant("cookie:session", &[("cookie", "session=A;theme=light")]);
        let b = tenant("cookie:session", &[("cookie", "session=B")]);
        assert!(a.is_some());
        assert_eq!(a, a_again, "other cookies do not change the tenant");
        assert_ne!(a, b);
        let split = tenant(
            "cookie:session",
            &[("cookie", "theme=dark"), ("cookie", "session=A")],
        );
        assert_eq!(split, a, "HTTP/2 splits the Cookie header");
        assert_eq!(tenant("cookie:session", &[("cookie", "Session=A")]), None);
        assert_eq!(tenant("cookie:session", &[("cookie", "sessionx=A")]), None);
        assert_eq!(tenant("cookie:session", &[]), None);
    }

    #[test]
    fn no_two_combinations_of_sources_hash_alike() {
        let sources = "authorization,x-org,cookie:session";
        let cases: [&[(&str, &str)]; 8] = [
            &[("authorization", "a")],
            &[("x-org", "a")],
            &[("cookie", "session=a")],
            &[("authorization", "a"), ("x-org", "b")],
            &[("authorization", "ab")],
            &[("authorization", "a"), ("authorization", "b")],
            &[("authorization", "a"), ("cookie", "session=b")],
            &[("x-org", "a"), ("cookie", "session=b")],
        ];
        let mut seen: Vec<String> = cases
            .iter()
            .map(|headers| tenant(sources, headers).unwrap())
            .collect();
        // And none is the one-header hash of the same bytes.
        seen.push(hex::encode(Sha256::digest(b"a")));
        let all = seen.len();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), all);
    }

    #[test]
    fn a_source_is_a_header_or_a_named_cookie() {
        assert_eq!(
            TenantPart::parse(" Cookie:sid ").unwrap(),
            TenantPart::Cookie("sid".into())
        );
        assert_eq!(
            TenantPart::parse("X-Org").unwrap(),
            TenantPart::Header(HeaderName::from_static("x-org"))
        );
        for bad in ["cookie:", "cookie:a b", "cookie:a;b", "bad header"] {
            assert!(TenantPart::parse(bad).is_err(), "{bad}");
        }
    }
}
