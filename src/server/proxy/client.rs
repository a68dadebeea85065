//! [`ProxyClient`]: the service under the layer — a pooled keep-alive hyper
//! client to the upstream. It never fails: a connect failure is its own
//! `502` (marked [`NotExecuted`]), a connection that breaks after the
//! request was sent its own `502` (marked [`OutcomeUnknown`]). It waits for
//! the upstream as long as its caller polls it: the layer answers the
//! client at the upstream timeout and decides how long a call runs on.
//!
//! An idle connection is kept `--upstream-idle-timeout` seconds, less than
//! the upstream's own keep-alive should be, so that no request is written
//! into a connection the upstream is closing at that moment. A request that
//! meets a pooled connection already closed (hyper found its end of stream
//! before writing a byte of the request, and handed the request back whole,
//! its body unread) is sent on another connection by the pool itself
//! (`retry_canceled_requests`); one that met a connection closed without
//! having been reused was never sent either, and is a `502` marked
//! [`NotExecuted`]. Anything else that ends a request without an answer may
//! have reached the upstream, and is never sent again.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use http::uri::{Authority, Scheme};
use http::{Request, StatusCode, Uri, Version, header};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tower::{Service, ServiceExt as _};
use tracing::Instrument as _;

use super::headers::to_upstream;
use super::upgrade;
use crate::layer::{NotExecuted, OutcomeUnknown, strip_connection_headers};
use crate::problem::ApiError;
use crate::server::config::ConfigError;
use crate::server::tls::{self, Connector, Trust};

/// Forwards requests to one upstream.
#[derive(Clone)]
pub struct ProxyClient {
    client: Via,
    upstream: Arc<Upstream>,
    /// Send the client's `Host` upstream instead of the upstream's own.
    preserve_host: bool,
}

/// How requests reach the upstream.
#[derive(Clone)]
#[expect(
    clippy::large_enum_variant,
    reason = "one per client, cloned per request: a box would allocate on every clone"
)]
enum Via {
    /// Over HTTP, through the pool.
    Pool(Client<Connector, Body>),
    /// A service in this process (the stdio door's bridge to its server),
    /// which marks its own answers [`NotExecuted`] or [`OutcomeUnknown`].
    Local(LocalService),
}

/// A service in this process that answers as an upstream would.
pub type LocalService = tower::util::BoxCloneSyncService<Request<Body>, Response, Infallible>;

/// Where requests go.
#[derive(Debug)]
struct Upstream {
    scheme: Scheme,
    authority: Authority,
    /// The upstream URL's path without its trailing `/`, prefixed to every
    /// request's path.
    base_path: String,
    /// The upstream URL is one endpoint (an MCP server's `/mcp`), not a
    /// base: a request already under `base_path` goes there as it is.
    endpoint: bool,
}

// === impl ProxyClient ===

impl ProxyClient {
    /// A client for `upstream` (an `http://` or `https://` URL, checked by
    /// [`ProxyArgs::upstream_uri`](crate::server::config::ProxyArgs::upstream_uri)),
    /// whose certificate, for `https`, is checked against `trust`.
    /// `connect_timeout` bounds the TCP connect and TLS handshake together;
    /// an idle connection is kept for `idle_timeout` (zero: none is kept).
    /// With `preserve_host`, the upstream gets the `Host` the client sent;
    /// without, the upstream's own authority. An answer's head is read
    /// whole up to `max_head_bytes` (at least hyper's own limit; see
    /// [`head_limits`]).
    ///
    /// # Errors
    /// When `upstream` has no scheme or authority (`upstream`), or the CA
    /// file cannot be used (`upstream_ca_file`).
    pub fn new(
        upstream: &Uri,
        trust: Trust<'_>,
        connect_timeout: Duration,
        idle_timeout: Duration,
        preserve_host: bool,
        max_head_bytes: usize,
    ) -> Result<ProxyClient, ConfigError> {
        let bad_upstream = |problem: &str| ConfigError {
            setting: "upstream",
            problem: problem.into(),
        };
        let scheme = upstream
            .scheme()
            .cloned()
            .ok_or_else(|| bad_upstream("has no scheme"))?;
        let authority = upstream
            .authority()
            .cloned()
            .ok_or_else(|| bad_upstream("names no host"))?;
        let connector =
            tls::connector(scheme == Scheme::HTTPS, trust, connect_timeout).map_err(|problem| {
                ConfigError {
                    setting: "upstream_ca_file",
                    problem,
                }
            })?;
        let (head_bytes, head_lines) = head_limits(max_head_bytes);
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            // An origin's answer of more than hyper's 100 header lines (or
            // 408 KiB of head) would otherwise fail after the origin acted:
            // a 502, and the key held unknown.
            .http1_max_buf_size(head_bytes)
            .http1_max_headers(head_lines)
            // Closes idle connections as they expire, not only when a
            // request finds them expired.
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(idle_timeout)
            // A request hyper hands back unwritten, from a pooled
            // connection found closed, goes on another connection: the
            // only request ever sent again, since no byte of it left.
            .retry_canceled_requests(true);
        if idle_timeout.is_zero() {
            builder.pool_max_idle_per_host(0);
        }
        let client = Via::Pool(builder.build(connector));
        Ok(ProxyClient {
            client,
            upstream: Arc::new(Upstream {
                scheme,
                authority,
                base_path: upstream.path().trim_end_matches('/').to_owned(),
                endpoint: false,
            }),
            preserve_host,
        })
    }

    /// A client whose upstream is `service`, in this process, named
    /// `name` (an authority: the span's `server.address`): the stdio door's
    /// MCP server. Requests go to it as they come (no forwarding headers,
    /// no rewritten target).
    pub fn local(service: LocalService, name: &'static str) -> ProxyClient {
        ProxyClient {
            client: Via::Local(service),
            upstream: Arc::new(Upstream {
                scheme: Scheme::HTTP,
                authority: Authority::from_static(name),
                base_path: String::new(),
                endpoint: true,
            }),
            preserve_host: false,
        }
    }

    /// This client with its upstream URL taken as one endpoint rather than a
    /// base: `--upstream http://host:8000/mcp` (the URL an MCP server gives)
    /// maps the door's `/mcp` onto the server's `/mcp`, and `/` onto it too,
    /// never onto `/mcp/mcp`; another path is still put under it.
    #[must_use]
    pub fn endpoint(mut self) -> ProxyClient {
        let up = &self.upstream;
        self.upstream = Arc::new(Upstream {
            scheme: up.scheme.clone(),
            authority: up.authority.clone(),
            base_path: up.base_path.clone(),
            endpoint: true,
        });
        self
    }

    /// Sends `req` upstream and returns the upstream's answer, or the proxy's
    /// own 4xx/5xx. An upgrade request keeps its `Upgrade`, and a `101`
    /// switches both connections (`upgrade`).
    async fn forward(self, mut req: Request<Body>) -> Response {
        let client = match &self.client {
            Via::Pool(client) => client.clone(),
            Via::Local(service) => {
                return match service.clone().oneshot(req).await {
                    Ok(res) => res,
                    Err(never) => match never {},
                };
            }
        };
        let asked = upgrade::Asked::take(&mut req);
        let mut req = match self.upstream_request_filter(req) {
            Ok(req) => req,
            Err(res) => return res,
        };
        if let Some(asked) = &asked {
            asked.ask(req.headers_mut());
        }
        // The upstream call's span is the upstream's parent, when traces are
        // exported; otherwise the client's traceparent goes on as it came.
        crate::server::otel::inject(req.headers_mut());
        match client.request(req).await {
            Ok(res) if res.status() == StatusCode::SWITCHING_PROTOCOLS => {
                upgrade::switched(asked, res, &self.upstream.authority)
            }
            Ok(res) => response_filter(res.map(Body::new)),
            Err(e) if e.is_connect() => {
                tracing::warn!(upstream = %self.upstream.authority, error = %chain(&e), "upstream unreachable");
                let mut res = ApiError::UpstreamUnavailable(
                    "the upstream could not be reached; the request was not sent".into(),
                )
                .into_response();
                res.extensions_mut().insert(NotExecuted);
                res
            }
            Err(e) if never_sent(&e) => {
                tracing::warn!(upstream = %self.upstream.authority, error = %chain(&e), "the upstream closed the connection before the request was written");
                let mut res = ApiError::UpstreamUnavailable(
                    "the upstream closed the connection before the request was sent; the request \
                     was not sent"
                        .into(),
                )
                .into_response();
                res.extensions_mut().insert(NotExecuted);
                res
            }
            Err(e) => {
                tracing::warn!(upstream = %self.upstream.authority, error = %chain(&e), "upstream request failed after it was sent");
                let mut res = ApiError::UpstreamUnavailable(
                    "the upstream connection failed after the request was sent; whether it acted is unknown"
                        .into(),
                )
                .into_response();
                res.extensions_mut().insert(OutcomeUnknown);
                res
            }
        }
    }

    /// The request as the upstream gets it: hop-by-hop headers stripped,
    /// `X-Forwarded-*` added, the target rewritten to the upstream, and
    /// `Host` the client's or the upstream's.
    #[expect(clippy::result_large_err, reason = "the error is the response itself")]
    fn upstream_request_filter(&self, req: Request<Body>) -> Result<Request<Body>, Response> {
        let (mut parts, body) = req.into_parts();
        let client = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(addr)| addr.ip());
        let host = parts.headers.get(header::HOST).cloned().or_else(|| {
            let authority = parts.uri.authority()?;
            http::HeaderValue::from_str(authority.as_str()).ok()
        });
        to_upstream(&mut parts.headers, client, host.clone());
        if parts
            .extensions
            .get::<crate::server::serve::OverTls>()
            .is_some()
        {
            // The client spoke TLS to the proxy's listener.
            parts
                .headers
                .insert("x-forwarded-proto", http::HeaderValue::from_static("https"));
        }
        if self.preserve_host
            && let Some(host) = host
        {
            // hyper adds the upstream's authority only when Host is absent.
            parts.headers.insert(header::HOST, host);
        }
        parts.uri = match self.target(&parts.uri) {
            Ok(uri) => uri,
            Err(why) => {
                let mut res =
                    ApiError::InvalidRequest(format!("cannot forward this request target: {why}"))
                        .into_response();
                res.extensions_mut().insert(NotExecuted);
                return Err(res);
            }
        };
        // The pool speaks HTTP/1.1 to the upstream, whatever the client spoke.
        parts.version = Version::HTTP_11;
        Ok(Request::from_parts(parts, body))
    }

    /// The upstream URI for a request's target.
    fn target(&self, uri: &Uri) -> Result<Uri, String> {
        let path_and_query = uri.path_and_query().map_or("/", |pq| pq.as_str());
        if !path_and_query.starts_with('/') {
            return Err("only origin-form targets (/path?query) are proxied".into());
        }
        let up = &self.upstream;
        Uri::builder()
            .scheme(up.scheme.clone())
            .authority(up.authority.clone())
            .path_and_query(up.path_for(path_and_query))
            .build()
            .map_err(|e| e.to_string())
    }
}

// === impl Upstream ===

impl Upstream {
    /// The upstream's path and query for a request's (`/` and a path).
    fn path_for(&self, path_and_query: &str) -> String {
        let base = self.base_path.as_str();
        if self.endpoint && !base.is_empty() {
            let path = path_and_query.split('?').next().unwrap_or_default();
            if path == base || path.starts_with(&format!("{base}/")) {
                return path_and_query.to_owned();
            }
            if path == "/" {
                return format!("{base}{}", &path_and_query[1..]);
            }
        }
        format!("{base}{path_and_query}")
    }
}

/// hyper's own bound on a response's head in bytes (its read buffer's
/// default), below which the proxy never goes.
const HYPER_HEAD_BYTES: usize = 8192 + 4096 * 100;

/// The most header lines a head may have: `http`'s `HeaderMap` holds at most
/// 32,768 slots at a load of three quarters, and hyper reserves one for each
/// line it parsed, so a head of more would make hyper's connection task
/// panic rather than fail. Where this is below what a head of
/// `max_head_bytes` can hold, it is the bound.
const MAX_HEAD_LINES: usize = 24_576;

/// The read buffer's size and the header lines hyper makes room for, for a
/// head of up to `max_head_bytes`: as many lines as fit in it (the shortest
/// line, `a:` and its LF, is 3 bytes), within [`MAX_HEAD_LINES`].
///
/// hyper makes that room on every response it parses, however few lines
/// it has: two vectors of `lines` slots of 32 bytes. As released, hyper
/// writes every slot (`smallvec![MaybeUninit::uninit(); lines]`), about
/// 1.5 MB per upstream answer and half the proxy's instructions per key;
/// the hyper this binary builds (`vendor/README.md`) allocates them
/// unwritten, so the room costs two allocations, not their filling. The
/// bound stays where it is either way: a lower one would turn an origin's
/// valid answer with more lines into a `502`, its key held `unknown` after
/// the origin acted.
fn head_limits(max_head_bytes: usize) -> (usize, usize) {
    let bytes = max_head_bytes.max(HYPER_HEAD_BYTES);
    (bytes, (bytes / 3 + 1).min(MAX_HEAD_LINES))
}

/// The upstream's response as the client gets it: hop-by-hop headers
/// stripped.
fn response_filter(mut res: Response) -> Response {
    strip_connection_headers(res.headers_mut());
    res
}

/// Whether hyper handed the request back unwritten: it canceled the request
/// because the connection was closed (or not ready) before it took a byte of
/// it. hyper says so with a canceled error, and only then.
fn never_sent(e: &hyper_util::client::legacy::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(hyper) = s.downcast_ref::<hyper::Error>() {
            return hyper.is_canceled();
        }
        source = s.source();
    }
    false
}

/// An error with its sources, for the log.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

impl Service<Request<Body>> for ProxyClient {
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The pool has no readiness of its own: connections are made per call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let this = self.clone();
        let span = tracing::info_span!(
            target: crate::spans::TARGET,
            "idemgate.upstream",
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            http.request.method = %req.method(),
            server.address = %this.upstream.authority,
            http.response.status_code = tracing::field::Empty,
        );
        Box::pin(async move {
            let res = this.forward(req).instrument(span.clone()).await;
            span.record("http.response.status_code", res.status().as_u16());
            if res.status().is_server_error() {
                span.record("otel.status_code", "ERROR");
            }
            Ok(res)
        })
    }
}

impl std::fmt::Debug for ProxyClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyClient")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(upstream: &str) -> ProxyClient {
        let uri: Uri = upstream.parse().unwrap();
        ProxyClient::new(
            &uri,
            Trust::System,
            Duration::from_secs(1),
            Duration::from_secs(4),
            false,
            1024 * 1024,
        )
        .unwrap()
    }

    #[test]
    fn a_head_is_read_up_to_the_body_limit_and_the_lines_a_map_holds() {
        assert_eq!(head_limits(1024 * 1024), (1024 * 1024, MAX_HEAD_LINES));
        assert_eq!(head_limits(1024), (HYPER_HEAD_BYTES, MAX_HEAD_LINES));
        let mut map = http::HeaderMap::new();
        map.reserve(MAX_HEAD_LINES);
        assert!(map.try_reserve(MAX_HEAD_LINES + 1).is_err());
    }

    #[test]
    fn an_endpoint_upstream_takes_its_own_path_and_the_root_as_it_is() {
        let mcp = client("http://127.0.0.1:8000/mcp").endpoint();
        let target = |t: &str| mcp.target(&t.parse().unwrap()).unwrap().to_string();
        assert_eq!(target("/mcp"), "http://127.0.0.1:8000/mcp");
        assert_eq!(target("/mcp/"), "http://127.0.0.1:8000/mcp/");
        assert_eq!(target("/"), "http://127.0.0.1:8000/mcp");
        assert_eq!(target("/?a=1"), "http://127.0.0.1:8000/mcp?a=1");
        assert_eq!(target("/mcpx"), "http://127.0.0.1:8000/mcp/mcpx");
        let bare = client("http://127.0.0.1:8000").endpoint();
        assert_eq!(
            bare.target(&"/mcp".parse().unwrap()).unwrap().to_string(),
            "http://127.0.0.1:8000/mcp"
        );
    }

    #[test]
    fn targets_keep_the_path_and_query_under_the_base_path() {
        let plain = client("http://127.0.0.1:3000");
        let uri: Uri = "/v1/charges?b=2&a=1".parse().unwrap();
        assert_eq!(
            plain.target(&uri).unwrap().to_string(),
            "http://127.0.0.1:3000/v1/charges?b=2&a=1"
        );
        let based = client("http://origin.internal:8080/api/");
        assert_eq!(
            based.target(&uri).unwrap().to_string(),
            "http://origin.internal:8080/api/v1/charges?b=2&a=1"
        );
        let absolute: Uri = "http://elsewhere/x".parse().unwrap();
        assert_eq!(
            plain.target(&absolute).unwrap().to_string(),
            "http://127.0.0.1:3000/x",
            "an absolute-form target goes to the upstream all the same"
        );
        let star: Uri = "*".parse().unwrap();
        assert!(plain.target(&star).is_err());
    }
}
