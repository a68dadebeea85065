//! A plain origin that knows nothing of idempotency keys: every
//! `POST /charges` charges again. Put `idemgate proxy` in front of it (see
//! the README's "Reverse proxy" section):
//!
//! ```sh
//! cargo run --release --bin idemgate-demo-origin                 # 127.0.0.1:3000
//! DATABASE_URL=sqlite://proxy.db cargo run --release -- proxy --upstream http://127.0.0.1:3000
//! ```
//!
//! It is the bin `idemgate-demo-origin` (Cargo.toml says why it is not an
//! example), which `cargo build --release` builds beside the server and the
//! container image carries. `LISTEN` overrides the address.

use std::sync::Arc;

use anyhow::Context as _;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};

/// The side effect: every call is a new charge.
async fn create_charge(
    State(charges): State<Arc<AtomicU64>>,
    body: Bytes,
) -> (StatusCode, Json<Value>) {
    let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
    let amount = serde_json::from_slice::<Value>(&body)
        .map(|b| b["amount"].clone())
        .unwrap_or(Value::Null);
    (
        StatusCode::CREATED,
        Json(json!({ "charge": format!("ch_{n}"), "amount": amount })),
    )
}

async fn count_charges(State(charges): State<Arc<AtomicU64>>) -> Json<Value> {
    Json(json!({ "charges": charges.load(Ordering::SeqCst) }))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let app = Router::new()
        .route("/charges", post(create_charge).get(count_charges))
        .with_state(Arc::new(AtomicU64::new(0)));
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&listen).await.with_context(|| {
        format!("cannot listen on {listen} (is something else on it? LISTEN=HOST:PORT picks another)")
    })?;
    eprintln!("origin listening on {listen}: POST /charges charges, GET /charges counts");
    axum::serve(listener, app)
        .with_graceful_shutdown(idemgate::server::serve::shutdown_signal())
        .await?;
    Ok(())
}
