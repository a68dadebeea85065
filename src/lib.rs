//! idemgate: the HTTP `Idempotency-Key` header (IETF draft -07) done on the
//! server side, as one engine behind several doors.
#![forbid(unsafe_code)]

pub mod api;
pub mod cli;
pub mod config;
mod durations;
pub mod engine;
pub mod fingerprint;
pub mod headers;
pub mod key;
pub mod layer;
pub mod proxy;
pub mod prune;
pub mod replay_cache;
pub mod seal;
pub mod server;
pub mod store;
pub mod telemetry;

pub use layer::{Idempotency, IdempotencyLayer};
