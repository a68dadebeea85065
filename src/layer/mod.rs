//! The in-process door: a tower [`Layer`](tower::Layer) that gives any
//! `tower::Service<http::Request<axum::body::Body>>` the `Idempotency-Key`
//! behaviour of `idemgate proxy`, over the one
//! [`Engine`](crate::engine::Engine).
//!
//! A guarded request (`POST` and `PATCH` by default) that carries a key runs
//! once: its response is stored and every retry gets it back with
//! `Idempotent-Replayed: true` and `Idempotency-Expires`. A duplicate that
//! arrives while the first is still running is held until the first
//! answers, and gets its replay ([`LayerPolicy::default_wait`], 10 s by
//! default; `Prefer: wait=N` says how long itself, and `Prefer: wait=0`
//! asks for the immediate `409 request-in-flight`), the same key with
//! another payload `422 key-reused`, a malformed key `400 key-invalid`, and a
//! request body over the limit `413 payload-too-large` before the service is
//! called. Responses with a release status (408, 425, 429, 503 by default) are
//! returned but not stored; every other status is stored, 500 included.
//! Hop-by-hop and framing headers are never stored nor replayed from any
//! record, and the deny list (`Set-Cookie`, `Set-Cookie2`,
//! `WWW-Authenticate`) is not stored. A response body over the limit is passed through and
//! stored as its status and headers only, replayed with
//! `Idempotency-Body-Omitted: true`. A response stored with a
//! `Content-Encoding` the retry does not accept (gzip, deflate, br) is
//! decoded for that retry. Once the key is reserved, the call runs
//! in a task of its own, so a client that hangs up does not cancel it.
//!
//! A response whose body is not all there when its head is (server-sent
//! events, a slow chunked answer) is streamed: the client gets each chunk as
//! the service produces it, a copy is recorded, and the key is committed when
//! the body ends — before the client's body ends, so a client that has the
//! whole answer and retries at once is replayed. A body that fails midway
//! fails the client's body too, and its key's outcome is unknown (below).
//!
//! # Unknown outcomes
//!
//! When the layer cannot know whether the inner service acted — it failed
//! (or its response broke off) after the request reached it, it ran past
//! [`LayerPolicy::abandon_after`], or it answered with [`OutcomeUnknown`] —
//! or when the process holding a key dies, stalls or loses its store for
//! longer than the lease, [`LayerPolicy::on_lease_expiry`] decides. Under
//! [`LeaseExpiry::Hold`](crate::store::LeaseExpiry::Hold), the default, the
//! key is never run again by itself: every request with it gets
//! `409 outcome-unknown` until the holder's own late commit (a commit
//! deferred while the store was away lands, and the key replays) or an
//! operator (`idemgate keys`, `/v1/admin/keys`) settles it. Under
//! [`LeaseExpiry::Takeover`](crate::store::LeaseExpiry::Takeover) the next
//! request after the lease runs again, and the inner service sees
//! `Idempotency-Attempt: N`.
//!
//! A request of a method that is not guarded passes through untouched, its
//! extensions included, so a WebSocket handshake reaches the service with
//! hyper's `OnUpgrade` and its `101 Switching Protocols` comes back as it
//! is; [`LayerPolicy::answer_timeout`] bounds the wait for that `101`, not
//! the WebSocket. A guarded request is never upgraded: the layer takes its
//! `OnUpgrade` away, and a `101` to one is answered `500` with its key left
//! in flight, for a switched connection can be neither stored nor replayed.
//!
//! A request may say when its first attempt was sent
//! (`Idempotency-First-Sent`, an HTTP-date); one first sent longer ago than
//! its key is remembered is refused with `412 first-sent-too-old` before the
//! service is called. With [`KeyPolicy::repeatability`](crate::key::KeyPolicy::repeatability)
//! on, OASIS Repeatable Requests' `Repeatability-Request-ID` and
//! `Repeatability-First-Sent` name the key too, answered with
//! `Repeatability-Result`.
//!
//! Retries of a completed key are answered from the engine's in-process
//! replay cache of completed records, without a database round trip, until
//! the key expires: [`Engine::new`](crate::engine::Engine::new) gives it
//! 64 MiB, and [`Engine::with_replay_cache`](crate::engine::Engine::with_replay_cache)
//! sets another bound, or turns it off with 0, before the engine goes into
//! the layer.
//!
//! The tenant a key belongs to comes from the request: by default the SHA-256
//! of its `Authorization` header; [`TenantSource::Parts`] takes several
//! headers and cookies together (a session cookie is a credential too), and
//! [`LayerPolicy::tenant_from`] whatever it makes of the principal an
//! authentication layer put in its extensions. A request with none of them
//! is in one anonymous tenant that every such request shares (the first with
//! a `Cookie` is a WARN), unless [`LayerPolicy::require_tenant`] refuses it.
//!
//! # Shutting down
//!
//! Some work outlives its client's answer: a call that runs on after its
//! client got `504` at [`LayerPolicy::answer_timeout`], a commit retried in
//! the background while the store is away. Once the server has stopped
//! taking requests, wait for it with
//! [`IdempotencyLayer::finish_deferred`]; a process that exits first leaves
//! those keys to their lease's end (never executed twice under `hold`, but
//! their outcome is then unknown and a late answer is lost).
//!
//! The inner service can steer the key through response extensions:
//! [`NotExecuted`] releases it (the effect never started), [`OutcomeUnknown`]
//! says the effect may have happened, as above.
//!
//! ```
//! use std::sync::Arc;
//!
//! use axum::{Router, body::Body, routing::post};
//! use http::Request;
//! use idemgate::store::SqliteStore;
//! use idemgate::{Engine, IdempotencyLayer, LayerPolicy, Limits};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let url = format!("sqlite://{}", dir.path().join("keys.db").display());
//! // The embedded store (`url` is `sqlite://` and a file path).
//! let store = SqliteStore::open(&url).await?;
//! store.migrate().await?;
//! // The replay cache's bound: 8 MiB here instead of the default 64 MiB.
//! let engine = Engine::new(Arc::new(store), Limits::default()).with_replay_cache(8 << 20);
//! let engine = Arc::new(engine);
//!
//! let app = Router::new()
//!     .route("/charges", post(|| async { "charged" }))
//!     .layer(IdempotencyLayer::new(engine, LayerPolicy::default()));
//!
//! let charge = || {
//!     Request::post("/charges")
//!         .header("Idempotency-Key", "\"order-1001\"")
//!         .body(Body::from(r#"{"amount":500}"#))
//!         .unwrap()
//! };
//! let first = app.clone().oneshot(charge()).await?;
//! assert_eq!(first.status(), 200);
//! assert!(first.headers().get("idempotent-replayed").is_none());
//!
//! // The retry is answered from the replay cache (or the store): the handler
//! // does not run again.
//! let retry = app.oneshot(charge()).await?;
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # Ok(())
//! # }
//! ```

mod call;
mod deferred;
mod encoding;
mod flow;
mod future;
pub(crate) mod headers;
mod holder;
#[expect(
    clippy::module_inception,
    reason = "tower-http's layout: layer.rs, service.rs, future.rs"
)]
mod layer;
mod path;
mod policy;
mod produce;
mod service;
mod shared;
mod tee;

pub use future::ResponseFuture;
pub use headers::{
    IDEMPOTENCY_ATTEMPT, IDEMPOTENCY_BODY_OMITTED, IDEMPOTENCY_EXPIRES, IDEMPOTENT_REPLAYED,
    strip_connection_headers,
};
pub use layer::IdempotencyLayer;
pub use policy::{LayerPolicy, Route, TenantFn, TenantPart, TenantSource};
pub use service::Idempotency;

/// Response extension: the request never reached the origin (the proxy sets
/// it with its `502` on a connect failure). The key is released, so a retry
/// executes afresh.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotExecuted;

/// Response extension: the request may have been executed, but its outcome is
/// unknown (the proxy sets it with its `502` for a connection that broke
/// after the request was sent). Nothing is stored; under
/// [`LeaseExpiry::Hold`](crate::store::LeaseExpiry::Hold) the key is marked
/// unknown (every retry `409 outcome-unknown` until settled), under
/// `Takeover` it stays in flight until its lease ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutcomeUnknown;

/// Response extension: the answer asks its client for input before the call
/// can complete (an MCP `input_required` result, SPEC §12), so it is not the
/// call's outcome. It goes to the client and is never stored; the key stays
/// held by this call, its lease extended, and is released at the lease's end
/// unless a later round continues the call ([`Resumes`]). The layer marks
/// the answer [`HeldFor`] with the reservation a round must name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AwaitingInput;

/// Response extension the layer sets on an [`AwaitingInput`] answer whose key
/// it kept: the reservation that holds the key, which the round that
/// continues the call names in [`Resumes`]. It is a capability (whoever names
/// it continues the call, within the key's tenant, key and fingerprint):
/// hand it only to the client that made the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldFor(pub uuid::Uuid);

/// Request extension: this request continues the call that reservation `0`
/// holds (a later round of an [`AwaitingInput`] call). If that reservation
/// still holds the request's key under the request's fingerprint, the
/// request holds the key as that call did, with no new claim; otherwise it
/// is reserved as any request is (the key was released at its lease's end,
/// or completed, or another call holds it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resumes(pub uuid::Uuid);
