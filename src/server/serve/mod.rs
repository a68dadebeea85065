//! Serving a router: the accept loop with its TLS handshake (when
//! `IDEMGATE_TLS_CERT` is set) and HTTP/1.1 or HTTP/2 by ALPN, its
//! per-connection timers (`conn`), graceful shutdown (`drain`), the names a
//! listener open without tokens answers (`hosts`), and the request tracing
//! every listener shares. Both HTTP doors (the reservation API and the
//! proxy) are served through it.

mod conn;
mod drain;
pub mod hosts;

use std::future::Future;
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tower_http::classify::{ServerErrorsAsFailures, SharedClassifier};
use tower_http::trace::{DefaultOnFailure, TraceLayer};

use crate::body::BodyIdleTimeout;
use crate::server::config::{ConfigError, RunArgs};
use crate::server::tls;

/// A listener on `addr`, the address of the setting `setting` (`listen`,
/// `admin_listen`); refused naming that setting, with what to do for the
/// two causes a person meets: the address in use (another process, often
/// an idemgate already running) and a port that needs privileges.
pub async fn listen(
    addr: std::net::SocketAddr,
    setting: &'static str,
) -> Result<TcpListener, ConfigError> {
    TcpListener::bind(addr).await.map_err(|e| ConfigError {
        setting,
        problem: match e.kind() {
            std::io::ErrorKind::AddrInUse => format!(
                "cannot listen there: another process listens on {addr} already (an idemgate \
                 started before? `ss -ltnp 'sport = :{}'` names it): stop it, or choose another \
                 address with this setting",
                addr.port()
            ),
            std::io::ErrorKind::PermissionDenied => format!(
                "cannot listen there: port {} needs privileges this process lacks; choose a \
                 port above 1023 with this setting",
                addr.port()
            ),
            std::io::ErrorKind::AddrNotAvailable => {
                "cannot listen there: no network interface of this machine has that address; \
                 choose one it has (127.0.0.1 for this machine alone, 0.0.0.0 for every \
                 interface)"
                    .to_owned()
            }
            _ => format!("cannot listen there: {e}"),
        },
    })
}

/// How a listener treats its connections.
#[derive(Debug, Clone, Copy)]
pub struct Serving {
    /// How long in-flight requests get to finish after the shutdown signal.
    pub grace: Duration,
    /// How long a client has to send a request's headers (a slower one's
    /// connection is closed), and at most between two pieces of its body (a
    /// slower one gets `408 request-timeout`): slow clients cannot hold
    /// connections open. A fresh connection's clock starts at the accept, a
    /// kept-alive one's at the first byte of its next request.
    pub header_read_timeout: Duration,
    /// How long a connection may wait idle, its last response sent, for its
    /// next request before it is closed.
    pub keep_alive_timeout: Duration,
}

impl From<&RunArgs> for Serving {
    /// How the listeners of `run`'s settings treat their connections.
    fn from(run: &RunArgs) -> Serving {
        Serving {
            grace: run.grace(),
            header_read_timeout: run.header_read_timeout,
            keep_alive_timeout: run.keep_alive_timeout,
        }
    }
}

/// Request tracing for every listener. A 5xx is logged at WARN, not
/// tower-http's ERROR: the error itself is logged where it happens (a 500 at
/// ERROR with its cause, a lost upstream or store at WARN), and during an
/// outage every request, and every `/readyz` probe, is a 503.
///
/// The span names the request's route as routed (`/v1/admin/keys/{tenant}/{key_hash}`)
/// where there is one, rather than its path: an operator's path holds a
/// whole key hash, which logs may only show a prefix of. The proxy's
/// requests, which no route matches, are named by their path.
pub fn trace_layer() -> TraceLayer<SharedClassifier<ServerErrorsAsFailures>, MakeSpan> {
    TraceLayer::new_for_http()
        .make_span_with(MakeSpan)
        .on_failure(DefaultOnFailure::new().level(tracing::Level::WARN))
}

/// The span of one request: its method, and its route or its path — never
/// its query, whose values may be secrets (a token in a callback URL).
#[derive(Debug, Clone, Copy)]
pub struct MakeSpan;

impl<B> tower_http::trace::MakeSpan<B> for MakeSpan {
    fn make_span(&mut self, req: &http::Request<B>) -> tracing::Span {
        let route = req
            .extensions()
            .get::<axum::extract::MatchedPath>()
            .map(axum::extract::MatchedPath::as_str);
        match route {
            Some(route) => tracing::debug_span!(
                "request",
                method = %req.method(),
                route,
                version = ?req.version(),
            ),
            None => tracing::debug_span!(
                "request",
                method = %req.method(),
                path = req.uri().path(),
                version = ?req.version(),
            ),
        }
    }
}

/// In the extensions of every request that came over a TLS listener: the
/// proxy tells its upstream `X-Forwarded-Proto: https`.
#[derive(Debug, Clone, Copy)]
pub struct OverTls;

/// Largest request head (request line and headers) a client may send; a
/// bigger one is answered `431 Request Header Fields Too Large`.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Serves `app` on `listener` until `shutdown` resolves; then closes the
/// listener at once, lets in-flight requests finish for up to `grace`, and
/// returns. A connection may switch protocols (a `101` answer to a
/// WebSocket handshake); once it has, it is not an HTTP connection any more,
/// and neither its timers nor the shutdown wait for it.
///
/// hyper's connection builder is used directly rather than `axum::serve`,
/// which has no timeouts, so that a client that trickles its headers cannot
/// hold its connection for ever. Those timers are ours (`conn`), not
/// hyper's: hyper's header read timeout also runs while a kept-alive
/// connection waits for its next request, and so closed every idle
/// connection after it.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    serving: Serving,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_tls(listener, app, serving, None, shutdown).await
}

/// [`serve`], with TLS on every connection when `tls` is given
/// (`IDEMGATE_TLS_CERT`): the handshake must end within the header read
/// timeout, counted from the accept like a plain connection's first head;
/// ALPN offers HTTP/2 and HTTP/1.1. An HTTP/1.1 connection over TLS lives
/// by the same timers as a plain one. An HTTP/2 connection multiplexes its
/// requests: it is closed (gracefully, a GOAWAY) once none has run for the
/// keep-alive timeout, and hyper's HTTP/2 pings end one whose client has
/// gone.
pub async fn serve_tls(
    listener: TcpListener,
    app: Router,
    serving: Serving,
    tls: Option<tls::Listener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    // Off: `conn` times heads and idle connections apart.
    http.header_read_timeout(None)
        .max_header_size(MAX_HEAD_BYTES);
    let mut h2 = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    h2.timer(hyper_util::rt::TokioTimer::new())
        .max_header_list_size(u32::try_from(MAX_HEAD_BYTES).unwrap_or(u32::MAX))
        .keep_alive_interval(Some(serving.keep_alive_timeout))
        .keep_alive_timeout(serving.header_read_timeout);
    let timeouts = conn::Timeouts {
        header_read: serving.header_read_timeout,
        keep_alive: serving.keep_alive_timeout,
    };
    let drain = drain::Drain::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: say so, breathe,
                    // go on serving the connections already open.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        // The address the client connected to: what the listener's own
        // name is, for a `Host` check (`hosts`).
        let local = stream.local_addr().ok().map(hosts::LocalAddr);
        // The peer address goes into every request (ConnectInfo): the proxy
        // forwards it as X-Forwarded-For. Whoever reads a body whole reads it
        // under the idle timeout (`BodyIdleTimeout`). The connection is busy
        // from the service call until hyper drops the response body, and
        // only then does its keep-alive clock start.
        let idle = BodyIdleTimeout(serving.header_read_timeout);
        let tracker = conn::Tracker::new();
        let io_tracker = tracker.clone();
        let over_tls = tls.is_some();
        let app = app.clone();
        let service = tower::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            let busy = tracker.request();
            let tracker = tracker.clone();
            req.extensions_mut()
                .insert(axum::extract::ConnectInfo(peer));
            req.extensions_mut().insert(idle);
            if let Some(local) = local {
                req.extensions_mut().insert(local);
            }
            if over_tls {
                req.extensions_mut().insert(OverTls);
            }
            let call = tower::ServiceExt::oneshot(app.clone(), req.map(axum::body::Body::new));
            async move {
                let res = call.await?;
                if res.status() == http::StatusCode::SWITCHING_PROTOCOLS {
                    tracker.upgraded();
                }
                Ok::<_, std::convert::Infallible>(
                    res.map(|body| conn::TrackedBody::new(body, busy)),
                )
            }
        });
        let service = hyper_util::service::TowerToHyperService::new(service);
        let mut watch = drain.watch();
        let (http, h2, tls) = (http.clone(), h2.clone(), tls.clone());
        tokio::spawn(async move {
            let ended = match tls {
                None => {
                    let io = conn::TimedIo::new(stream, io_tracker, timeouts);
                    drive_http1(&http, io, service, &mut watch).await
                }
                Some(tls) => {
                    let handshake = tokio::time::timeout(timeouts.header_read, tls.accept(stream));
                    let stream = tokio::select! {
                        done = handshake => match done {
                            Ok(Ok(stream)) => stream,
                            Ok(Err(e)) => {
                                tracing::debug!(error = %e, %peer, "TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "no TLS handshake within the header read timeout");
                                return;
                            }
                        },
                        () = watch.signalled() => return,
                    };
                    if stream.get_ref().1.alpn_protocol() == Some(b"h2") {
                        let idle = (io_tracker, timeouts.keep_alive);
                        drive_http2(&h2, stream, service, &mut watch, idle).await
                    } else {
                        let io = conn::TimedIo::new(stream, io_tracker, timeouts);
                        drive_http1(&http, io, service, &mut watch).await
                    }
                }
            };
            drop(watch);
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    // Said once per process by `shutdown_signal`; a proxy has two listeners.
    tracing::debug!(
        listen = ?listener.local_addr().ok(),
        grace_seconds = serving.grace.as_secs(),
        "listener closed: finishing its in-flight requests"
    );
    drop(listener);
    if tokio::time::timeout(serving.grace, drain.drain())
        .await
        .is_err()
    {
        tracing::warn!("shutdown grace elapsed with requests still running");
    }
    Ok(())
}

/// Serves HTTP/1.1 on `io` until the client or the shutdown ends it. With
/// upgrades: the request's `OnUpgrade` extension hands the stream to
/// whoever answers `101` (the proxy's splice, axum's WebSocket), and the
/// connection future ends once it has.
async fn drive_http1<I, S>(
    http: &hyper::server::conn::http1::Builder,
    io: I,
    service: S,
    watch: &mut drain::Watch,
) -> Result<(), hyper::Error>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::HttpService<hyper::body::Incoming> + Send + 'static,
    S::Future: Send + 'static,
    S::ResBody: Send + 'static,
    <S::ResBody as http_body::Body>::Data: Send,
    <S::ResBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let conn = http
        .serve_connection(hyper_util::rt::TokioIo::new(io), service)
        .with_upgrades();
    let mut conn = std::pin::pin!(conn);
    let mut signalled = false;
    loop {
        tokio::select! {
            ended = conn.as_mut() => return ended,
            () = watch.signalled(), if !signalled => {
                signalled = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Serves HTTP/2 (negotiated by ALPN) on `io` until the client or the
/// shutdown ends it, or it has run no request for `idle.1`.
async fn drive_http2<I, S>(
    h2: &hyper::server::conn::http2::Builder<hyper_util::rt::TokioExecutor>,
    io: I,
    service: S,
    watch: &mut drain::Watch,
    idle: (conn::Tracker, Duration),
) -> Result<(), hyper::Error>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::HttpService<hyper::body::Incoming> + Send + 'static,
    S::Future: Send + 'static,
    S::ResBody: Send + 'static,
    <S::ResBody as http_body::Body>::Data: Send,
    <S::ResBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (tracker, keep_alive) = idle;
    let conn = h2.serve_connection(hyper_util::rt::TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    let mut closing = false;
    loop {
        // While requests run, look again after a keep-alive timeout.
        let wake = tracker
            .quiet_since()
            .unwrap_or_else(tokio::time::Instant::now)
            + keep_alive;
        tokio::select! {
            ended = conn.as_mut() => return ended,
            () = watch.signalled(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            () = tokio::time::sleep_until(wake), if !closing => {
                if tracker.quiet_since().is_some_and(|t| t.elapsed() >= keep_alive) {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// Resolves on SIGTERM or ctrl-c.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!(
        "shutting down: the listeners close, and in-flight requests finish \
         (within IDEMGATE_SHUTDOWN_GRACE)"
    );
}
