//! A tiny MCP server for README's "In front of an MCP server": one write tool,
//! `charge`, that charges again every time it is called, and one read-only
//! tool, `charges`, that counts the charges made. It knows nothing of keys:
//! `idemgate proxy --protocol mcp` in front of it makes `charge` run once
//! per key.
//!
//! ```sh
//! cargo run --release --bin idemgate-demo-mcp   # its endpoint is http://127.0.0.1:8000/mcp
//! curl -s localhost:8000/charges                # {"charges":N}: the server's own count
//! ```
//!
//! It speaks MCP's streamable HTTP transport as its smallest server may:
//! JSON-RPC over `POST /mcp`, each answer `application/json`, no session and
//! no server-sent event stream (`GET /mcp` is `405`). `LISTEN` overrides the
//! address (default 127.0.0.1:8000).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

/// The protocol versions this server speaks; it answers an `initialize`
/// asking for another with the newest.
const VERSIONS: [&str; 3] = ["2025-11-25", "2025-06-18", "2025-03-26"];

/// Charges made since start: the side effect a repeated call would repeat.
type Charges = Arc<AtomicU64>;

#[tokio::main]
async fn main() {
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:8000".into());
    let listener = match tokio::net::TcpListener::bind(&listen).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!(
                "idemgate-demo-mcp: cannot listen on {listen} ({e}; is something else on it? \
                 LISTEN=HOST:PORT picks another)"
            );
            std::process::exit(1);
        }
    };
    let app = Router::new()
        .route("/mcp", post(message).get(no_stream).delete(no_stream))
        .route("/charges", get(count))
        .with_state(Charges::default());
    eprintln!("idemgate-demo-mcp: MCP endpoint http://{listen}/mcp (tools: charge, charges)");
    let stop = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await
    {
        eprintln!("idemgate-demo-mcp: {e}");
        std::process::exit(1);
    }
}

/// One JSON-RPC message: a request gets its answer, a notification `202`.
async fn message(State(charges): State<Charges>, Json(message): Json<Value>) -> Response {
    let Some(id) = message.get("id").cloned() else {
        return StatusCode::ACCEPTED.into_response();
    };
    let params = &message["params"];
    let answer = match message["method"].as_str().unwrap_or_default() {
        "initialize" => Ok(initialize(params)),
        "ping" => Ok(json!({})),
        "tools/list" => Ok(json!({ "tools": tools() })),
        "tools/call" => call(&charges, params),
        other => Err((-32601, format!("no method {other}"))),
    };
    let body = match answer {
        Ok(result) => json!({ "jsonrpc": "2.0", "id": id, "result": result }),
        Err((code, text)) => {
            json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": text } })
        }
    };
    Json(body).into_response()
}

fn initialize(params: &Value) -> Value {
    let asked = params["protocolVersion"].as_str().unwrap_or_default();
    let version = VERSIONS
        .into_iter()
        .find(|v| *v == asked)
        .unwrap_or(VERSIONS[0]);
    json!({
        "protocolVersion": version,
        "capabilities": { "tools": {} },
        "serverInfo": { "name": "idemgate-demo-mcp", "version": env!("CARGO_PKG_VERSION") },
    })
}

/// `charge` writes (no `readOnlyHint`), so the door guards it; `charges`
/// only reads.
fn tools() -> Value {
    json!([
        {
            "name": "charge",
            "description": "Charge a card. Every call charges again.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "amount": { "type": "integer", "description": "in cents" },
                    "currency": { "type": "string" },
                },
                "required": ["amount"],
            },
        },
        {
            "name": "charges",
            "description": "How many charges were made.",
            "inputSchema": { "type": "object", "properties": {} },
            "annotations": { "readOnlyHint": true },
        },
    ])
}

fn call(charges: &Charges, params: &Value) -> Result<Value, (i64, String)> {
    let text = match params["name"].as_str().unwrap_or_default() {
        "charge" => {
            let Some(amount) = params["arguments"]["amount"].as_i64() else {
                return Err((-32602, "charge needs an integer amount".into()));
            };
            let currency = params["arguments"]["currency"].as_str().unwrap_or("eur");
            let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
            eprintln!("idemgate-demo-mcp: charge ch_{n}: {amount} {currency}");
            format!("charged {amount} {currency}: ch_{n}")
        }
        "charges" => json!({ "charges": charges.load(Ordering::SeqCst) }).to_string(),
        other => return Err((-32602, format!("no tool {other}"))),
    };
    Ok(json!({ "content": [{ "type": "text", "text": text }], "isError": false }))
}

/// No server-sent event stream of its own to offer.
async fn no_stream() -> StatusCode {
    StatusCode::METHOD_NOT_ALLOWED
}

async fn count(State(charges): State<Charges>) -> Json<Value> {
    Json(json!({ "charges": charges.load(Ordering::SeqCst) }))
}
