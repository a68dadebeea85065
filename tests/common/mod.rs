//! Helpers shared by the integration tests (each test file does `mod common;`).
#![allow(dead_code)]

pub mod app;
pub mod backend;
pub mod bin;
pub mod logs;
pub mod pg;
pub mod proxy;
pub mod upstream;
