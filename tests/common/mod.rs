//! Helpers shared by the integration tests (each test file does `mod common;`).
// Each test binary compiles all of these and uses a part: `allow`, not
// `expect`, since which helpers go unused differs from binary to binary.
#![allow(dead_code)]

pub mod app;
pub mod backend;
pub mod bin;
pub mod citus;
pub mod logs;
pub mod pg;
pub mod proxy;
pub mod upstream;
