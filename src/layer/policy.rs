//! What the layer guards and how: [`LayerPolicy`], with per-route
//! [`Route`] rules over its global defaults.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use globset::GlobMatcher;
use http::{HeaderName, Method};

use super::path;
use crate::engine::Limits;
use crate::fingerprint::FingerprintPolicy;
use crate::key::KeyPolicy;
use crate::store::LeaseExpiry;

/// Which door a request came through. The proxy is the layer over a hyper
/// client; what differs is its metric label and how it words two answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Door {
    /// The in-process tower layer.
    #[default]
    Layer,
    /// `idemgate proxy`.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    Proxy,
}

impl Door {
    /// The door's name as the metrics carry it: their `mode` label (a
    /// public label, named before the code said "door").
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Door::Layer => "layer",
            Door::Proxy => "proxy",
        }
    }

    /// ` (SETTING)` after a sentence that a setting of the binary governs;
    /// nothing for an embedding application, which never set it.
    pub(crate) fn setting(self, name: &'static str) -> &'static str {
        match (self, name) {
            (Door::Proxy, "IDEMGATE_MAX_BODY_BYTES") => " (IDEMGATE_MAX_BODY_BYTES)",
            (Door::Proxy, "IDEMGATE_UPSTREAM_TIMEOUT") => " (IDEMGATE_UPSTREAM_TIMEOUT)",
            _ => "",
        }
    }
}

/// Whose keys a request's key is among: keys are scoped by tenant, so two
/// callers never see each other's records.
#[derive(Clone)]
pub enum TenantSource {
    /// Every request in one tenant.
    Single,
    /// The SHA-256 of this header's value(s); requests without it share one
    /// anonymous tenant. A credential that changes between a timeout and the
    /// retry (an OAuth token refreshed) lands the retry in another tenant,
    /// where it executes again: name a header that a gateway sets from the
    /// authenticated caller, or use [`TenantSource::From`].
    Header(HeaderName),
    /// What the function makes of the request's head: its extensions hold
    /// what an authentication layer in front put there (the principal).
    /// `None` puts the request in the anonymous tenant. The tenant is stored
    /// as the SHA-256 of the returned id.
    From(TenantFn),
    /// The request's credentials from several places, taken together:
    /// headers and cookies (a session cookie is a credential too). The
    /// tenant is a SHA-256 over every source's values, each named and
    /// length-prefixed, so no two combinations hash alike; a request with
    /// none of them is in the anonymous tenant. One header alone hashes as
    /// [`TenantSource::Header`] does, so `Parts(vec![Header(h)])` is that
    /// tenant.
    Parts(Vec<TenantPart>),
}

/// One place [`TenantSource::Parts`] takes a credential from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantPart {
    /// A request header, every value of it.
    Header(HeaderName),
    /// A cookie of the `Cookie` header(s), by its name (case-sensitive, as
    /// cookie names are), every value of it.
    Cookie(String),
}

impl TenantPart {
    /// `NAME` (a header) or `cookie:NAME`, the form `IDEMGATE_TENANT_FROM`
    /// takes.
    pub fn parse(s: &str) -> Result<TenantPart, String> {
        let given = s.trim();
        if let Some((prefix, name)) = given.split_once(':')
            && prefix.trim().eq_ignore_ascii_case("cookie")
        {
            let name = name.trim();
            let token = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b));
            return if token {
                Ok(TenantPart::Cookie(name.to_owned()))
            } else {
                Err(format!("{s:?} does not name a cookie: give cookie:NAME"))
            };
        }
        HeaderName::from_bytes(given.as_bytes())
            .map(TenantPart::Header)
            .map_err(|_| format!("{s:?} is not a header name or cookie:NAME"))
    }
}

impl std::fmt::Display for TenantPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TenantPart::Header(name) => f.write_str(name.as_str()),
            TenantPart::Cookie(name) => write!(f, "cookie:{name}"),
        }
    }
}

/// A function from a request's head to its tenant's id (see [`TenantSource::From`]).
pub type TenantFn = Arc<dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync>;

impl std::fmt::Debug for TenantSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TenantSource::Single => f.write_str("Single"),
            TenantSource::Header(name) => f.debug_tuple("Header").field(name).finish(),
            TenantSource::From(_) => f.write_str("From(..)"),
            TenantSource::Parts(parts) => f.debug_tuple("Parts").field(parts).finish(),
        }
    }
}

/// What the layer guards and how; the proxy runs under one too.
///
/// Start from [`LayerPolicy::default`], which holds the documented defaults,
/// and change what differs with the chainable setters (the fields can be
/// read, and assigned, but the struct cannot be built literally: a new
/// setting is then no breaking change):
///
/// ```
/// use std::time::Duration;
///
/// use idemgate::layer::LayerPolicy;
///
/// let policy = LayerPolicy::default()
///     .require_key(true)
///     .ttl(Duration::from_secs(3600));
/// assert_eq!(policy.key_header.as_str(), "idempotency-key");
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LayerPolicy {
    /// Which door enforces it.
    pub(crate) door: Door,
    /// Guarded methods (default `POST`, `PATCH`); the others pass straight
    /// through.
    pub methods: Vec<Method>,
    /// Answer `400 key-missing` to a guarded request without a key, instead
    /// of passing it through unguarded.
    pub require_key: bool,
    /// The header that carries the key (default `Idempotency-Key`).
    pub key_header: HeaderName,
    /// How keys are validated.
    pub key_policy: KeyPolicy,
    /// Whose keys a request's key is among (default: the SHA-256 of
    /// `Authorization`; see [`TenantSource::Header`] for what that costs).
    pub tenant: TenantSource,
    /// Answer `401 unauthorized` to a guarded request with a key that
    /// carries none of the [`tenant`](Self::tenant) sources, instead of
    /// putting it in the anonymous tenant that every such request shares
    /// (default `false`). A request without a key passes through as ever:
    /// nothing of it is stored or replayed. Nothing under
    /// [`TenantSource::Single`] is refused.
    pub require_tenant: bool,
    /// What goes into the fingerprint.
    pub fingerprint_policy: FingerprintPolicy,
    /// Statuses that mean the origin did not act: the response is returned
    /// but not stored, and the key is released (default 408, 425, 429, 503).
    pub release_statuses: Vec<u16>,
    /// Response headers never stored for replay, besides the hop-by-hop and
    /// framing ones, which are never stored nor replayed whatever this says
    /// (default `Set-Cookie`, `Set-Cookie2`, `WWW-Authenticate`: a replay
    /// must not hand one caller's cookie or challenge to another).
    pub store_headers_deny: Vec<HeaderName>,
    /// Largest request body accepted and response body stored (default
    /// 1 MiB).
    pub max_body_bytes: usize,
    /// How long a request holds its key without news from its holder. The
    /// holder extends it every third of its length while the inner service
    /// works and its response body is read, so a slow handler or origin
    /// keeps its key (a retry meanwhile waits, or is a `409`); a lease that
    /// was not extended (the process died or stalled) ends as
    /// [`on_lease_expiry`](Self::on_lease_expiry) says.
    pub lease: Duration,
    /// How long the client waits for the head of the inner service's answer
    /// (`None`, the default: as long as it takes); a body that is still
    /// coming then streams to the client for as long as it takes (within
    /// [`abandon_after`](Self::abandon_after)). Past it the client gets
    /// `504 upstream-timeout`, but the call is not abandoned: it runs on, its
    /// key in flight and its lease kept alive, and an answer that comes late
    /// is stored, so the retry gets the replay. Not-guarded requests get the
    /// `504` and nothing runs on for them. The proxy sets it to its upstream
    /// timeout.
    pub answer_timeout: Option<Duration>,
    /// The longest a call may run while its lease is kept alive (`None`, the
    /// default: no bound, a handler is never abandoned). Past it the call is
    /// dropped, its outcome unknown ([`on_lease_expiry`](Self::on_lease_expiry)
    /// says what follows). The proxy sets it to its upstream abandon bound.
    pub abandon_after: Option<Duration>,
    /// What a lease that ends without news means (default
    /// [`LeaseExpiry::Hold`]): the holder was killed, stalled, or cut off
    /// from the store for longer than the lease, so whether its call acted
    /// is unknown. Under `Hold` the key is never run again by itself: every
    /// request with it gets `409 outcome-unknown` until the holder's late
    /// commit or release, or an operator, settles it; and a call the holder
    /// itself cannot tell the outcome of (it failed after it was sent, or
    /// ran past [`abandon_after`](Self::abandon_after)) marks the key so at
    /// once. Under `Takeover` the next request after the lease takes the key
    /// over and runs again, with `Idempotency-Attempt: N`: for an inner
    /// service or origin that dedupes on the key itself.
    pub on_lease_expiry: LeaseExpiry,
    /// How long a duplicate of a key in flight is held for the first
    /// request's answer, which it then gets replayed, when it does not say
    /// itself (`Prefer: wait=N`; `wait=0` asks for the immediate `409`).
    /// Default 10 s, capped by the engine's
    /// [`Limits::max_wait`](crate::engine::Limits::max_wait); `None` answers
    /// `409 request-in-flight` at once. Clients in the wild do not send
    /// `Prefer: wait`, and many give up after two quick retries of a `409`.
    pub default_wait: Option<Duration>,
    /// How long a key is remembered, from its first request.
    pub ttl: Duration,
    /// Per-route rules, first match wins.
    pub routes: Vec<Route>,
    /// What every problem `type` starts with, the slug after it (default
    /// [`DEFAULT_PROBLEM_BASE`](crate::DEFAULT_PROBLEM_BASE)).
    pub problem_base: Cow<'static, str>,
}

impl Default for LayerPolicy {
    fn default() -> Self {
        let limits = Limits::default();
        LayerPolicy {
            door: Door::Layer,
            methods: vec![Method::POST, Method::PATCH],
            require_key: false,
            key_header: HeaderName::from_static("idempotency-key"),
            key_policy: KeyPolicy::default(),
            tenant: TenantSource::Header(http::header::AUTHORIZATION),
            require_tenant: false,
            fingerprint_policy: FingerprintPolicy::default(),
            release_statuses: vec![408, 425, 429, 503],
            store_headers_deny: vec![
                http::header::SET_COOKIE,
                HeaderName::from_static("set-cookie2"),
                http::header::WWW_AUTHENTICATE,
            ],
            max_body_bytes: 1024 * 1024,
            lease: limits.default_lease,
            answer_timeout: None,
            abandon_after: None,
            on_lease_expiry: LeaseExpiry::Hold,
            default_wait: Some(DEFAULT_WAIT),
            ttl: limits.default_ttl,
            routes: Vec::new(),
            problem_base: Cow::Borrowed(crate::problem::DEFAULT_PROBLEM_BASE),
        }
    }
}

/// How long a duplicate is held by default ([`LayerPolicy::default_wait`]).
pub const DEFAULT_WAIT: Duration = Duration::from_secs(10);

/// A chainable setter for each field.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty;)*) => {
        impl LayerPolicy {
            $(
                $(#[$doc])*
                #[must_use]
                pub fn $name(mut self, $name: $ty) -> LayerPolicy {
                    self.$name = $name;
                    self
                }
            )*
        }
    };
}

setters! {
    /// Sets [`methods`](#structfield.methods).
    methods: Vec<Method>;
    /// Sets [`require_key`](#structfield.require_key).
    require_key: bool;
    /// Sets [`key_header`](#structfield.key_header).
    key_header: HeaderName;
    /// Sets [`key_policy`](#structfield.key_policy).
    key_policy: KeyPolicy;
    /// Sets [`tenant`](#structfield.tenant).
    tenant: TenantSource;
    /// Sets [`require_tenant`](#structfield.require_tenant).
    require_tenant: bool;
    /// Sets [`fingerprint_policy`](#structfield.fingerprint_policy).
    fingerprint_policy: FingerprintPolicy;
    /// Sets [`release_statuses`](#structfield.release_statuses).
    release_statuses: Vec<u16>;
    /// Sets [`store_headers_deny`](#structfield.store_headers_deny).
    store_headers_deny: Vec<HeaderName>;
    /// Sets [`max_body_bytes`](#structfield.max_body_bytes).
    max_body_bytes: usize;
    /// Sets [`lease`](#structfield.lease).
    lease: Duration;
    /// Sets [`answer_timeout`](#structfield.answer_timeout).
    answer_timeout: Option<Duration>;
    /// Sets [`abandon_after`](#structfield.abandon_after).
    abandon_after: Option<Duration>;
    /// Sets [`on_lease_expiry`](#structfield.on_lease_expiry).
    on_lease_expiry: LeaseExpiry;
    /// Sets [`default_wait`](#structfield.default_wait).
    default_wait: Option<Duration>;
    /// Sets [`ttl`](#structfield.ttl).
    ttl: Duration;
    /// Sets [`routes`](#structfield.routes).
    routes: Vec<Route>;
    /// Sets [`problem_base`](#structfield.problem_base).
    problem_base: Cow<'static, str>;
}

impl LayerPolicy {
    /// The tenant from the header `name` (`None`: one tenant for all).
    #[must_use]
    pub fn tenant_header(self, name: Option<HeaderName>) -> LayerPolicy {
        self.tenant(name.map_or(TenantSource::Single, TenantSource::Header))
    }

    /// The tenant from the caller's identity: `of` reads the request's head,
    /// typically the principal an authentication layer put in its
    /// extensions (see [`TenantSource::From`]).
    #[must_use]
    pub fn tenant_from(
        self,
        of: impl Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    ) -> LayerPolicy {
        self.tenant(TenantSource::From(Arc::new(of)))
    }

    /// The same policy, enforced by the proxy.
    #[cfg(feature = "server")]
    pub(crate) fn for_proxy(mut self) -> LayerPolicy {
        self.door = Door::Proxy;
        self
    }

    /// `e` as this policy's response.
    pub(crate) fn problem(&self, e: crate::problem::ApiError) -> axum::response::Response {
        e.into_response_at(&self.problem_base)
    }
}

/// What the policy says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Guard {
    /// The method is guarded on this path.
    pub guarded: bool,
    /// A guarded request must carry a key.
    pub require_key: bool,
    /// The key's TTL.
    pub ttl: Duration,
    /// What the key's lease ending without news means.
    pub on_lease_expiry: LeaseExpiry,
}

// === impl LayerPolicy ===

impl LayerPolicy {
    /// The rule for `method` on `path`: the first matching route's settings
    /// over the global ones. Routes are matched against `path` normalized
    /// once here ([`path::normalize`]), not against the path as sent.
    pub(crate) fn guard(&self, method: &Method, path: &str) -> Guard {
        let route = if self.routes.is_empty() {
            None
        } else {
            let path = path::normalize(path);
            self.routes.iter().find(|r| r.matches(&path))
        };
        let methods = route
            .and_then(|r| r.methods.as_deref())
            .unwrap_or(&self.methods);
        Guard {
            guarded: methods.contains(method),
            require_key: route
                .and_then(|r| r.require_key)
                .unwrap_or(self.require_key),
            ttl: route.and_then(|r| r.ttl).unwrap_or(self.ttl),
            on_lease_expiry: route
                .and_then(|r| r.on_lease_expiry)
                .unwrap_or(self.on_lease_expiry),
        }
    }
}

/// A per-route rule: where it applies and what it changes.
///
/// A path without glob characters is a prefix (`/payments/` covers
/// `/payments/123`); one with `*`, `?`, `[` or `{` is a glob over the whole
/// path, where `*` stays within one segment and `**` crosses segments
/// (`/v1/*/charges`).
///
/// The layer matches it against the request's path after normalization:
/// percent-encoded unreserved characters decoded, repeated slashes merged,
/// and `.` and `..` segments resolved (so `//pay`, `/x/../pay` and `/%70ay`
/// are all `/pay`); the request goes on with its path as sent.
#[derive(Debug, Clone)]
pub struct Route {
    path: String,
    glob: Option<GlobMatcher>,
    /// Guarded methods on this route, instead of the global ones.
    pub methods: Option<Vec<Method>>,
    /// Whether a key is required on this route.
    pub require_key: Option<bool>,
    /// The TTL of keys on this route.
    pub ttl: Option<Duration>,
    /// What a lease's end without news means on this route.
    pub on_lease_expiry: Option<LeaseExpiry>,
}

// === impl Route ===

impl Route {
    /// A rule for `path` (a prefix or a glob) that changes nothing yet.
    ///
    /// # Errors
    /// The reason, when `path` does not start with `/` or is a bad glob.
    pub fn new(path: &str) -> Result<Route, String> {
        if !path.starts_with('/') {
            return Err(format!("path {path:?} must start with '/'"));
        }
        let glob = if path.contains(['*', '?', '[', '{']) {
            let glob = globset::GlobBuilder::new(path)
                .literal_separator(true)
                .build()
                .map_err(|e| format!("path {path:?} is not a valid glob: {e}"))?;
            Some(glob.compile_matcher())
        } else {
            None
        };
        Ok(Route {
            path: path.to_owned(),
            glob,
            methods: None,
            require_key: None,
            ttl: None,
            on_lease_expiry: None,
        })
    }

    /// The path as configured.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Whether the rule applies to a request for `path`, taken as it is (the
    /// layer passes the normalized path).
    pub fn matches(&self, path: &str) -> bool {
        match &self.glob {
            Some(glob) => glob.is_match(path),
            None => path.starts_with(&self.path),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_and_glob_routes() {
        let prefix = Route::new("/payments/").unwrap();
        assert!(prefix.matches("/payments/1"));
        assert!(!prefix.matches("/payment"));
        let glob = Route::new("/v1/*/charges").unwrap();
        assert!(glob.matches("/v1/acme/charges"));
        assert!(!glob.matches("/v1/a/b/charges"));
        assert!(!glob.matches("/v1/acme/charges/2"));
        let deep = Route::new("/v2/**/refunds").unwrap();
        assert!(deep.matches("/v2/a/b/refunds"));
        assert!(Route::new("payments").is_err());
        assert!(Route::new("/a/[").is_err());
    }

    #[test]
    fn first_matching_route_wins_over_defaults() {
        let mut strict = Route::new("/payments/").unwrap();
        strict.require_key = Some(true);
        strict.ttl = Some(Duration::from_secs(5));
        let mut put = Route::new("/payments/").unwrap();
        put.methods = Some(vec![Method::PUT]);
        strict.on_lease_expiry = Some(LeaseExpiry::Takeover);
        let policy = LayerPolicy::default().routes(vec![strict, put]);
        let g = policy.guard(&Method::POST, "/payments/1");
        assert!(g.guarded && g.require_key);
        assert_eq!(g.ttl, Duration::from_secs(5));
        assert_eq!(g.on_lease_expiry, LeaseExpiry::Takeover);
        assert_eq!(
            policy.guard(&Method::POST, "/other").on_lease_expiry,
            LeaseExpiry::Hold,
            "the default holds"
        );
        assert!(!policy.guard(&Method::PUT, "/payments/1").guarded);
        let other = policy.guard(&Method::POST, "/other");
        assert!(other.guarded && !other.require_key);
        assert_eq!(other.ttl, Duration::from_secs(86_400));
        assert!(!policy.guard(&Method::GET, "/other").guarded);
    }

    #[test]
    fn routes_match_the_normalized_path() {
        let mut pay = Route::new("/pay").unwrap();
        pay.require_key = Some(true);
        pay.methods = Some(vec![Method::POST]);
        let policy = LayerPolicy::default().routes(vec![pay]);
        for path in [
            "/pay",
            "//pay",
            "/x/../pay",
            "/./pay",
            "/%70ay",
            "/%2e%2e/pay",
        ] {
            let g = policy.guard(&Method::POST, path);
            assert!(g.guarded && g.require_key, "{path:?}");
            assert!(!policy.guard(&Method::PATCH, path).guarded, "{path:?}");
        }
        for path in ["/", "/other", "/%2Fpay", "/pa%2Fy"] {
            assert!(!policy.guard(&Method::POST, path).require_key, "{path:?}");
        }
    }
}
