//! `idemgate serve`: the reservation API's state from the settings, and the
//! server run with its pruning job.

use std::sync::Arc;

use crate::server::api::{self, AppState};
use crate::server::config::{AdminMode, Checked, ServeArgs};
use crate::server::{console, open, serve, tls};
use crate::store::Store;

/// The reservation API's state from its settings, as
/// [`ServeArgs::validate`] found them (`checked`).
pub fn app_state(args: &ServeArgs, checked: Checked, store: Arc<dyn Store>) -> AppState {
    let engine = open::engine_sealed(&args.run, checked.sealer, store, args.policy.limits());
    let tokens = args.tokens.clone().unwrap_or_default();
    let admin = args.admin.access(args.listen, &tokens);
    AppState::new(
        Arc::new(engine),
        tokens,
        admin,
        &args.policy,
        args.require_fingerprint,
    )
}

/// What `serve` answers on its listener: the reservation API (its
/// operators' endpoints included) and the operators' console. Without
/// tenant tokens the listener is open (the reservation API answers anyone,
/// and so do the operators' endpoints without admin tokens), and answers
/// only requests for its own address or a name of `IDEMGATE_ALLOWED_HOSTS`
/// (`serve::hosts`).
pub fn router(state: AppState) -> axum::Router {
    let hosts = host_rule(&state);
    let console = console::Console::new(
        state.engine.clone(),
        state.admin.clone(),
        state.max_body_bytes,
        true,
    );
    let app = api::router(state)
        .merge(console::router(console))
        // A person who opens the server's address finds the console (which
        // links the API's docs).
        .route(
            "/",
            axum::routing::get(|| async { axum::response::Redirect::to("/console") }),
        );
    hosts.guard(app)
}

/// The names `serve`'s listener answers: open without tenant tokens (the
/// reservation API answers anyone, and so do the operators' endpoints
/// without admin tokens), it is checked; with them, where
/// `IDEMGATE_ALLOWED_HOSTS` is set.
fn host_rule(state: &AppState) -> serve::hosts::HostRule {
    serve::hosts::HostRule::new(
        state.tokens.is_empty() || state.admin.mode() == AdminMode::Open,
        state.admin.allowed_hosts(),
    )
}

/// `idemgate serve`: runs until SIGTERM or ctrl-c.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let checked = args.validate()?;
    // The certificate before the store too: an unusable one refuses the
    // start, naming its setting.
    let tls = tls::Listener::from_args(&args.run.tls)?;
    open::check_database_url(&args.store)?;
    // The listener before the store: a start that fails for its address
    // leaves no new database behind.
    let listener = serve::listen(args.listen, "listen").await?;
    let (store, opened) = open::open_for_serving(&args.store, !args.run.no_migrate).await?;
    let state = app_state(&args, checked, store.clone());
    if state.tokens.is_empty() {
        tracing::warn!(
            listen = %args.listen,
            "no IDEMGATE_TOKENS: open single-tenant mode (tenant \"default\"), loopback only"
        );
    } else if state.engine.tenant_limits() == crate::engine::TenantLimits::default() {
        tracing::info!(
            "tenants share the store without limits: IDEMGATE_TENANT_MAX_IN_FLIGHT and \
             IDEMGATE_TENANT_MAX_STORED_BYTES keep one tenant from exhausting it"
        );
    }
    state.admin.log("serve");
    host_rule(&state).log("serve", listener.local_addr()?);
    // `idemgate keys`, refused the SQLite file this process holds, then says
    // where to ask instead.
    #[cfg(feature = "sqlite")]
    crate::store::SqliteStore::announce_admin(
        &args.store.database_url,
        &format!("{}://{}", args.run.tls.scheme(), listener.local_addr()?),
    );
    let pruner = open::spawn_pruner(&args.run, store);
    let naming = open::watch_naming(&state.engine).await?;
    // Make the metric visible before the first pass.
    crate::telemetry::record_pruned(0);
    let scheme = args.run.tls.scheme();
    let base = format!("{scheme}://{}", listener.local_addr()?);
    tracing::info!(
        listen = %listener.local_addr()?,
        console = %format!("{base}/console"),
        docs = %format!("{base}/docs"),
        database = opened.database.as_str(),
        migrations = opened.migrations.to_string().as_str(),
        "idemgate serve is listening"
    );
    tls::log_tls(&args.run.tls);
    serve::serve_tls(
        listener,
        router(state),
        serve::Serving::from(&args.run),
        tls,
        serve::shutdown_signal(),
    )
    .await?;
    naming.abort();
    if let Some(p) = pruner {
        p.abort();
    }
    tracing::info!("idemgate serve stopped");
    Ok(())
}
