//! The integration tests: one crate, so the harness in `common` and idemgate's
//! dependencies are compiled and linked once, not once per file.
//!
//! Each module is one area, run alone with `cargo test --test it AREA::`
//! (for example `cargo test --test it openapi::`). Every test runs against
//! real parts: a SQLite file, a PostgreSQL database of its own (see
//! `common::pg`), a real upstream that counts executions, and the built
//! `idemgate` binary where a process is the thing under test.

#[macro_use]
mod common;

mod admin_access;
mod api;
mod batching;
mod citus;
mod claimed_request;
mod config;
mod console;
mod crash;
mod db_faults;
mod db_setup;
mod defaults;
mod docs;
mod examples;
mod failover;
mod framing_attacks;
mod harness_selftest;
mod held_attacks;
mod host_attacks;
mod hostile;
mod keep_alive;
mod keys_server;
mod layer;
mod least_privilege;
mod lifecycle;
mod limits;
mod mcp;
mod mcp_attacks;
mod mcp_key_places;
mod mcp_rounds;
mod metrics;
mod openapi;
mod outage;
mod pg_connections;
mod pg_tls;
mod pooler;
mod properties;
mod proxy;
mod readme;
mod repeatability;
mod replay_cache;
mod retry_after;
mod seal;
mod seal_names;
mod security;
mod server;
mod shutdown;
mod slow_origin;
mod sqlite_faults;
mod startup;
mod store_contract;
mod storms;
mod streaming;
mod tenants;
mod tls_listen;
mod tls_upstream;
mod traces;
mod unknown;
mod upgrade;
mod upstream_pool;
mod waiting;
mod websocket;
mod zero_setup;
