//! A small axum app behind `IdempotencyLayer`, over the embedded SQLite store.
//!
//! ```sh
//! cargo run --example axum_app
//! # in another shell:
//! J='content-type: application/json'
//! K="Idempotency-Key: \"order-$(date +%s)\""   # a new key (a quoted sf-string) each time through
//! curl -si localhost:3001/charges -H "$J" -H "$K" -d '{"amount":500}'  # 201, a new charge (ch_1 on a fresh start)
//! curl -si localhost:3001/charges -H "$J" -H "$K" -d '{"amount":500}'  # replayed: the same charge
//! curl -si localhost:3001/charges -H "$J" -H "$K" -d '{"amount":900}'  # 422 key-reused
//! curl -si localhost:3001/charges -H "$J" -d '{"amount":500}'          # 400 key-missing
//! curl -s localhost:3001/charges                                       # one charge per key, not per request
//! ```
//!
//! The keys live in `idemgate-example.db` in the temp directory and outlive
//! the app (the charge counter does not): a key used before replays its
//! first response, so each time through takes a new one. `LISTEN` overrides
//! the address (default 127.0.0.1:3001, beside the proxy quick start's
//! origin on 3000).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idemgate::store::SqliteStore;
use idemgate::{Engine, IdempotencyLayer, LayerPolicy, Limits};
use serde_json::{Value, json};

/// The side effect: every executed charge increments the counter.
async fn create_charge(
    State(charges): State<Arc<AtomicU64>>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        Json(json!({ "charge": format!("ch_{n}"), "amount": body["amount"] })),
    )
}

async fn count_charges(State(charges): State<Arc<AtomicU64>>) -> Json<Value> {
    Json(json!({ "charges": charges.load(Ordering::SeqCst) }))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let file = std::env::temp_dir().join("idemgate-example.db");
    let url = format!("sqlite://{}", file.display());
    let store = Arc::new(SqliteStore::open(&url).await?);
    store.migrate().await?;
    let engine = Arc::new(Engine::new(store.clone(), Limits::default()));
    // Expired keys are deleted by the application's own pruning job.
    tokio::spawn(idemgate::prune::run(store, Duration::from_secs(60)));

    // POST and PATCH are guarded; a key is optional unless `require_key`.
    // The tenant is the SHA-256 of `Authorization` by default; behind an
    // authentication layer, `tenant_from` reads the principal it put in the
    // request's extensions instead.
    let policy = LayerPolicy::default().require_key(true);
    let layer = IdempotencyLayer::new(engine, policy);
    let app = Router::new()
        .route("/charges", post(create_charge).get(count_charges))
        .layer(layer.clone())
        .with_state(Arc::new(AtomicU64::new(0)));

    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:3001".into());
    let listener = tokio::net::TcpListener::bind(&listen).await.with_context(|| {
        format!("cannot listen on {listen} (is something else on it? LISTEN=HOST:PORT picks another)")
    })?;
    tracing::info!(%listen, store = %url, "example app listening: POST /charges with an Idempotency-Key");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Calls that outlived their client's answer, and commits waiting for the
    // store, get a few seconds to land before the process exits.
    let left = layer.finish_deferred(Duration::from_secs(10)).await;
    if left > 0 {
        tracing::warn!(left, "exiting with deferred work still running");
    }
    Ok(())
}
