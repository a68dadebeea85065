//! idemgate: the HTTP `Idempotency-Key` header (IETF draft
//! `draft-ietf-httpapi-idempotency-key-header-07`) done on the server side, as
//! one engine behind several doors.
//!
//! A request that carries a key runs once: the first result is stored and
//! replayed to every retry, a duplicate that arrives while the first is still
//! running is answered `409`, the key reused with another payload `422`.
//!
//! - [`engine::Engine`] decides: reserve a key, commit its result, release it.
//! - [`store`] remembers: `store::SqliteStore` (feature `sqlite`, one
//!   process per file) and `store::PgStore` (feature `postgres`, any
//!   number of processes) behind the [`store::Store`] trait.
//! - [`layer::IdempotencyLayer`] is the door for a Rust service: a
//!   `tower::Layer` in front of any `Service<http::Request<axum::body::Body>>`.
//! - [`prune`] deletes expired keys; run it beside the layer.
//!
//! The `server` feature (on by default) adds the `idemgate` binary: the
//! reservation API, the reverse proxy and the command line. An application
//! that only embeds the layer turns it off:
//!
//! ```toml
//! idemgate = { version = "0.1", default-features = false, features = ["sqlite"] }
//! ```
#![forbid(unsafe_code)]
#![deny(rustdoc::broken_intra_doc_links, rustdoc::private_intra_doc_links)]

mod admission;
mod body;
mod durations;
pub mod engine;
pub mod fingerprint;
mod headers;
pub mod key;
pub mod layer;
mod problem;
pub mod prune;
mod replay_cache;
pub mod seal;
#[cfg(feature = "server")]
pub mod server;
pub mod spans;
pub mod store;
mod telemetry;

pub use engine::{Engine, Limits};
pub use layer::{Idempotency, IdempotencyLayer, LayerPolicy};
pub use problem::DEFAULT_PROBLEM_BASE;
pub use store::{LeaseExpiry, Store, StoreError};

/// The parsers that read what the network sends, for the fuzz targets
/// (`fuzz/`). Not an interface.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::headers::prefer_wait;
    pub use crate::layer::headers::storable;
    #[cfg(feature = "server")]
    pub use crate::server::proxy::headers::to_upstream;
    #[cfg(feature = "server")]
    pub use crate::server::proxy::mcp::envelope::{
        Envelope, assert_invariants as assert_mcp_envelope_invariants,
        classify as classify_mcp_envelope,
    };
}
