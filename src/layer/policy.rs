//! What the layer guards and how: [`LayerPolicy`], with per-route
//! [`Route`] rules over its global defaults.

use std::time::Duration;

use globset::GlobMatcher;
use http::{HeaderName, Method};

use super::path;
use crate::engine::Limits;
use crate::fingerprint::FingerprintPolicy;
use crate::key::KeyPolicy;

/// Which door a request came through: the `mode` label of the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// The in-process tower layer.
    #[default]
    Layer,
    /// `idemgate proxy`: the layer over a hyper client.
    Proxy,
}

impl Mode {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Layer => "layer",
            Mode::Proxy => "proxy",
        }
    }
}

/// The policy of SPEC §6, shared by the layer and the proxy.
///
/// Build it with struct-update syntax over [`LayerPolicy::default`], which
/// holds the documented defaults:
///
/// ```
/// use idemgate::layer::LayerPolicy;
///
/// let policy = LayerPolicy {
///     require_key: true,
///     ..LayerPolicy::default()
/// };
/// assert_eq!(policy.key_header.as_str(), "idempotency-key");
/// ```
#[derive(Debug, Clone)]
pub struct LayerPolicy {
    /// The metric label.
    pub mode: Mode,
    /// Guarded methods (`IDEMGATE_METHODS`, default `POST`, `PATCH`); the
    /// others pass straight through.
    pub methods: Vec<Method>,
    /// Answer `400 key-missing` to a guarded request without a key, instead
    /// of passing it through unguarded (`IDEMGATE_REQUIRE_KEY`).
    pub require_key: bool,
    /// The header that carries the key (`IDEMGATE_KEY_HEADER`, default
    /// `Idempotency-Key`).
    pub key_header: HeaderName,
    /// How keys are validated.
    pub key_policy: KeyPolicy,
    /// The header whose value names the tenant (`IDEMGATE_TENANT_HEADER`,
    /// default `Authorization`): keys are scoped by the SHA-256 of its value,
    /// and requests without it share one anonymous tenant. `None`: one tenant.
    pub tenant_header: Option<HeaderName>,
    /// What goes into the fingerprint.
    pub fingerprint_policy: FingerprintPolicy,
    /// Statuses that mean the origin did not act: the response is returned
    /// but not stored, and the key is released (`IDEMGATE_RELEASE_STATUSES`).
    pub release_statuses: Vec<u16>,
    /// Response headers never stored for replay, besides the hop-by-hop ones
    /// (`IDEMGATE_STORE_HEADERS_DENY`, default `Set-Cookie`,
    /// `WWW-Authenticate`).
    pub store_headers_deny: Vec<HeaderName>,
    /// Largest request body accepted and response body stored
    /// (`IDEMGATE_MAX_BODY_BYTES`).
    pub max_body_bytes: usize,
    /// How long a request holds its key without news from its holder. The
    /// holder extends it every third of its length while the inner service
    /// works and its response body is read, so a slow handler or origin
    /// keeps its key (a retry meanwhile is a `409`); a retry after a lease
    /// that was not extended (the process died or stalled) takes the key
    /// over.
    pub lease: Duration,
    /// How long the client waits for the inner service's whole answer
    /// (`None`, the default: as long as it takes). Past it the client gets
    /// `504 upstream-timeout`, but the call is not abandoned: it runs on, its
    /// key in flight and its lease kept alive, and an answer that comes late
    /// is stored, so the retry gets the replay. Not-guarded requests get the
    /// `504` and nothing runs on for them. The proxy sets it to its upstream
    /// timeout.
    pub answer_timeout: Option<Duration>,
    /// The longest a call may run while its lease is kept alive (`None`, the
    /// default: no bound, a handler is never abandoned). Past it the call is
    /// dropped, its outcome unknown: the key stays in flight until its lease
    /// ends, and a retry after that takes it over. The proxy sets it to its
    /// upstream abandon bound.
    pub abandon_after: Option<Duration>,
    /// How long a key is remembered, from its first request.
    pub ttl: Duration,
    /// Per-route rules, first match wins.
    pub routes: Vec<Route>,
}

impl Default for LayerPolicy {
    fn default() -> Self {
        let limits = Limits::default();
        LayerPolicy {
            mode: Mode::Layer,
            methods: vec![Method::POST, Method::PATCH],
            require_key: false,
            key_header: HeaderName::from_static("idempotency-key"),
            key_policy: KeyPolicy::default(),
            tenant_header: Some(http::header::AUTHORIZATION),
            fingerprint_policy: FingerprintPolicy::default(),
            release_statuses: vec![408, 425, 429, 503],
            store_headers_deny: vec![http::header::SET_COOKIE, http::header::WWW_AUTHENTICATE],
            max_body_bytes: 1024 * 1024,
            lease: limits.default_lease,
            answer_timeout: None,
            abandon_after: None,
            ttl: limits.default_ttl,
            routes: Vec::new(),
        }
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
        let policy = LayerPolicy {
            routes: vec![strict, put],
            ..LayerPolicy::default()
        };
        let g = policy.guard(&Method::POST, "/payments/1");
        assert!(g.guarded && g.require_key);
        assert_eq!(g.ttl, Duration::from_secs(5));
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
        let policy = LayerPolicy {
            routes: vec![pay],
            ..LayerPolicy::default()
        };
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
