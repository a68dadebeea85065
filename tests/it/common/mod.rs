//! The harness every area shares (`use crate::common;`): the test app in
//! process, the built binary as a child process, PostgreSQL databases and
//! clusters, the counting upstream, and the log capture.

pub mod app;
#[macro_use]
pub mod backend;
pub mod bin;
pub mod citus;
pub mod faulty;
pub mod logs;
pub mod pg;
pub mod proxy;
pub mod tls;
pub mod upstream;

use std::time::{Duration, Instant};

/// Whether `cond` came to hold within `limit` (checked every 10 ms). Callers
/// assert on it with a message saying what did not happen.
#[must_use = "assert on it: false means the condition never held"]
pub async fn until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let started = Instant::now();
    while !cond() {
        if started.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

/// A free port on the loopback interface (free when asked; a test binds it
/// soon after).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding 127.0.0.1:0");
    listener.local_addr().expect("a bound address").port()
}

/// An HTTP client for tests: a request that hangs fails after 30 s instead
/// of hanging the test.
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("an HTTP client")
}
