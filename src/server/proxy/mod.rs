//! The reverse proxy (`idemgate proxy --upstream URL`): the
//! [tower layer](crate::layer) over a hyper client, so the proxy and the
//! in-process middleware are one code path.
//!
//! Per request: the layer decides whether the request is guarded and reserves
//! its key; the client's `upstream_request_filter` strips hop-by-hop headers,
//! adds `X-Forwarded-*` and rewrites the target; its `response_filter` strips
//! hop-by-hop headers from the answer; the layer stores or releases, and logs.
//! An unguarded upgrade request (a WebSocket handshake) keeps its `Upgrade`,
//! and a `101` splices the two connections (`upgrade`). The operational
//! endpoints, the operators' endpoints and the console live on a separate
//! admin listener (`admin`). With `--protocol mcp` the upstream is an MCP
//! server, and [`mcp`] guards its tool calls through the same layer.

mod admin;
pub mod client;
pub mod headers;
pub mod mcp;
pub mod routes;
pub mod stdio;
mod upgrade;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tower::Layer;

pub use client::ProxyClient;

use crate::engine::Engine;
use crate::layer::{IdempotencyLayer, LayerPolicy, Route};
use crate::server::config::{ConfigError, ProxyArgs};
use crate::server::{open, serve, tls};
use crate::store::Store;
use crate::telemetry;

/// The proxy's lease exceeds its upstream timeout by this much; it is
/// extended every third of its length while the upstream call runs.
pub const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// A built proxy: the forwarding router and the admin router.
pub struct Proxy {
    /// Every path, forwarded to the upstream through the layer.
    pub app: Router,
    /// `/healthz`, `/readyz`, `/metrics`, `/v1/policy`.
    pub admin: Router,
    /// The engine the layer decides through.
    pub engine: Arc<Engine>,
    /// The layer, which a shutdown asks for its deferred work.
    pub layer: IdempotencyLayer,
}

// === impl Proxy ===

impl Proxy {
    /// Builds the proxy of `args` over `store`, with per-route `routes`.
    ///
    /// # Errors
    /// A bad upstream URL (`--upstream` / `IDEMGATE_UPSTREAM`).
    pub fn build(
        args: &ProxyArgs,
        routes: Vec<Route>,
        store: Arc<dyn Store>,
    ) -> Result<Proxy, ConfigError> {
        let upstream = args.upstream_uri()?;
        let trust = match &args.upstream_ca_file {
            Some(path) => tls::Trust::CaFile(path),
            None => tls::Trust::System,
        };
        let client = ProxyClient::new(
            &upstream,
            trust,
            args.upstream_connect_timeout,
            args.upstream_idle_timeout,
            args.preserve_host,
            args.policy.max_body_bytes,
        )?;
        let client = if args.protocol == "mcp" {
            client.endpoint()
        } else {
            client
        };
        Proxy::build_over(args, routes, store, client)
    }

    /// [`Proxy::build`] with the upstream `client` given: the stdio door's
    /// is its server's bridge.
    ///
    /// # Errors
    /// A setting the engine refuses.
    pub fn build_over(
        args: &ProxyArgs,
        routes: Vec<Route>,
        store: Arc<dyn Store>,
        client: ProxyClient,
    ) -> Result<Proxy, ConfigError> {
        crate::server::exporter::metrics_handle();
        let mcp = args.protocol == "mcp";
        let mut policy = layer_policy(args, routes);
        if mcp {
            // A tool call's fingerprint is its name and arguments; an MCP
            // client waits for a slow tool itself (its own timeout, an event
            // stream that stays open), so no 504 at the upstream timeout.
            policy.fingerprint_policy.ignore.extend(
                mcp::fingerprint_ignore(&args.mcp_key_from()?)
                    .iter()
                    .filter_map(|p| crate::fingerprint::JsonPointer::parse(p).ok()),
            );
            policy.answer_timeout = None;
        }
        let engine = Arc::new(open::engine(&args.run, store.clone(), args.limits())?);
        let admin = admin::router(engine.clone(), args, &policy);
        let key_header = policy.key_header.clone();
        let require_key = policy.require_key;
        let max_body_bytes = policy.max_body_bytes;
        let layer = IdempotencyLayer::new(engine.clone(), policy);
        let door = if mcp { "mcp" } else { "proxy" };
        let app = if mcp {
            mcp::router(
                client,
                &layer,
                args.mcp_tools.clone(),
                args.mcp_advertise_key,
                mcp::Keys {
                    from: args.mcp_key_from()?,
                    header: key_header,
                    require: require_key,
                },
                max_body_bytes,
            )
        } else {
            Router::new().fallback_service(layer.layer(client))
        }
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                crate::server::otel::door_span(door, req, next)
            },
        ))
        .layer(serve::trace_layer());
        Ok(Proxy {
            app,
            admin,
            engine,
            layer,
        })
    }
}

/// The layer's policy from the proxy's settings.
pub fn layer_policy(args: &ProxyArgs, routes: Vec<Route>) -> LayerPolicy {
    let upstream_timeout = args.upstream_timeout();
    LayerPolicy::default()
        .for_proxy()
        .methods(args.policy.methods.clone())
        .require_key(args.require_key)
        .key_header(args.key_header.name.clone())
        .key_policy(args.policy.key_policy())
        .tenant(args.tenant_source())
        .require_tenant(args.require_tenant)
        .fingerprint_policy(args.policy.fingerprint_policy())
        .release_statuses(args.release_statuses.clone())
        .store_headers_deny(
            args.store_headers_deny
                .iter()
                .map(|h| h.name.clone())
                .collect(),
        )
        .max_body_bytes(args.policy.max_body_bytes)
        .lease(upstream_timeout + LEASE_MARGIN)
        .answer_timeout(Some(upstream_timeout))
        .abandon_after(Some(args.abandon_after()))
        .on_lease_expiry(args.on_lease_expiry)
        .default_wait(Some(args.default_wait()).filter(|w| !w.is_zero()))
        .ttl(Duration::from_secs(u64::from(args.policy.default_ttl())))
        .routes(routes)
}

/// `idemgate proxy`: runs until SIGTERM or ctrl-c. `config` is the
/// `--config` file, whose `[[routes]]` it reads.
pub async fn run(args: ProxyArgs, config: Option<PathBuf>) -> anyhow::Result<()> {
    args.validate()?;
    let routes = match &config {
        Some(path) => routes::from_file(path, args.policy.max_ttl())?,
        None => Vec::new(),
    };
    let tls = tls::Listener::from_args(&args.run.tls)?;
    // The listeners before the store: a start that fails for an address
    // leaves no new database behind.
    open::check_database_url(&args.store)?;
    let listener = serve::listen(args.listen, "listen").await?;
    let admin = serve::listen(args.admin_listen, "admin_listen").await?;
    let (store, opened) = open::open_for_serving(&args.store, !args.run.no_migrate).await?;
    let proxy = Proxy::build(&args, routes, store.clone())?;
    // `idemgate keys`, refused the SQLite file this process holds, then says
    // where to ask instead.
    #[cfg(feature = "sqlite")]
    crate::store::SqliteStore::announce_admin(
        &args.store.database_url,
        &format!("{}://{}", args.run.tls.scheme(), admin.local_addr()?),
    );
    let pruner = open::spawn_pruner(&args.run, store);
    let naming = open::watch_naming(&proxy.engine).await?;
    telemetry::record_pruned(0);
    let scheme = args.run.tls.scheme();
    tracing::info!(
        listen = %listener.local_addr()?,
        admin = %admin.local_addr()?,
        scheme,
        upstream = args.upstream.as_deref().unwrap_or_default(),
        console = %format!("{scheme}://{}/console", admin.local_addr()?),
        database = opened.database.as_str(),
        migrations = opened.migrations.to_string().as_str(),
        "idemgate proxy is listening"
    );
    tls::log_tls(&args.run.tls);
    let access = args
        .admin
        .access(args.admin_listen, &crate::server::auth::Tokens::default());
    access.log("proxy");
    admin::host_rule(&access).log("proxy", admin.local_addr()?);

    // One signal stops both listeners.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let signalled = Arc::new(std::sync::OnceLock::new());
    let signalled_at = signalled.clone();
    tokio::spawn(async move {
        serve::shutdown_signal().await;
        let _ = signalled_at.set(tokio::time::Instant::now());
        let _ = stop.send(true);
    });
    let until_stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let serving = serve::Serving::from(&args.run);
    let served = tokio::try_join!(
        serve::serve_tls(
            listener,
            proxy.app,
            serving,
            tls.clone(),
            until_stopped(stopped.clone())
        ),
        serve::serve_tls(admin, proxy.admin, serving, tls, until_stopped(stopped)),
    );
    naming.abort();
    if let Some(p) = pruner {
        p.abort();
    }
    served?;
    // Calls whose client already had its answer (or its 504), and commits
    // waiting for the store: the rest of the grace is theirs.
    let pending = proxy.layer.deferred_work();
    if pending > 0 {
        let spent = signalled.get().map_or(Duration::ZERO, |at| at.elapsed());
        let left = args.run.grace().saturating_sub(spent);
        tracing::info!(
            pending,
            within_seconds = left.as_secs(),
            "waiting for upstream calls still running and commits deferred while the store was away"
        );
        let lost = proxy.layer.finish_deferred(left).await;
        if lost > 0 {
            tracing::warn!(
                lost,
                "the grace ended first: these calls or commits were cut off, and their keys stay \
                 in flight until their leases end"
            );
        }
    }
    tracing::info!("idemgate proxy stopped");
    Ok(())
}
