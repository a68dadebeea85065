//! How an idemgate process batched its writes, read from its Prometheus
//! `/metrics`: group commit pays off only if writes really share
//! transactions under the load measured, so the suite reads the counters
//! right after each measurement of new keys.

use std::net::SocketAddr;

use anyhow::Context;
use bytes::Bytes;
use http::{Method, StatusCode};

use crate::http::Conn;

/// The store's batch counters, since the process started.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Batches {
    /// Transactions that wrote claims, commits or releases.
    pub batches: f64,
    /// Writes in those transactions.
    pub writes: f64,
    /// The most writes one transaction carried.
    pub largest: f64,
    /// Writes refused with 503 because the write queue was full.
    pub refused: f64,
}

impl Batches {
    /// Mean writes per transaction (none before the first batch).
    pub fn mean(&self) -> Option<f64> {
        (self.batches > 0.0).then(|| self.writes / self.batches)
    }
}

/// The allocator's counts since the process started, in a build with the
/// `count-alloc` feature.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Allocations {
    /// Allocations and reallocations.
    pub calls: f64,
    /// Bytes allocated (and grown by reallocation).
    pub bytes: f64,
}

impl Allocations {
    /// What was allocated since `before`.
    pub fn since(self, before: Allocations) -> Allocations {
        Allocations {
            calls: self.calls - before.calls,
            bytes: self.bytes - before.bytes,
        }
    }
}

async fn scrape(addr: SocketAddr) -> anyhow::Result<String> {
    let answer = Conn::new(addr)
        .send(Method::GET, "/metrics", &[], Bytes::new())
        .await?;
    anyhow::ensure!(
        answer.status == StatusCode::OK,
        "GET /metrics on {addr}: {}",
        answer.status
    );
    Ok(String::from_utf8_lossy(&answer.body).into_owned())
}

/// GETs `/metrics` at `addr` and reads the batch counters from it.
pub async fn batches(addr: SocketAddr) -> anyhow::Result<Batches> {
    let text = scrape(addr).await?;
    parse(&text).with_context(|| format!("GET /metrics on {addr}"))
}

/// GETs `/metrics` at `addr` and reads the allocator's counts: none from a
/// build without the `count-alloc` feature, or if `/metrics` did not answer.
pub async fn allocations(addr: SocketAddr) -> Option<Allocations> {
    let text = scrape(addr).await.ok()?;
    parse_allocations(&text)
}

fn parse_allocations(text: &str) -> Option<Allocations> {
    Some(Allocations {
        calls: value(text, "idemgate_alloc_total")?,
        bytes: value(text, "idemgate_alloc_bytes_total")?,
    })
}

fn parse(text: &str) -> anyhow::Result<Batches> {
    let get = |name: &str| value(text, name).with_context(|| format!("no {name} series"));
    Ok(Batches {
        batches: get("idemgate_store_batches_total")?,
        writes: get("idemgate_store_batched_writes_total")?,
        largest: get("idemgate_store_batch_largest")?,
        refused: get("idemgate_store_writes_refused_total")?,
    })
}

/// The value of the unlabelled series `name` in Prometheus text format.
fn value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.split_once(char::is_whitespace)?;
            if series != name {
                return None;
            }
            value.split_whitespace().next()?.parse().ok()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_batch_series_and_skips_comments_and_lookalikes() {
        let text = "\
# HELP idemgate_store_batches_total Transactions.
# TYPE idemgate_store_batches_total counter
idemgate_store_batches_total 40
idemgate_store_batched_writes_total 250
idemgate_store_batch_largest_seen 99
idemgate_store_batch_largest 17
idemgate_store_writes_refused_total 0
idemgate_db_pool_connections{state=\"idle\"} 3
";
        let b = parse(text).unwrap();
        assert_eq!(b.batches, 40.0);
        assert_eq!(b.largest, 17.0);
        assert_eq!(b.mean(), Some(6.25));
        assert!(parse("idemgate_store_batches_total 1\n").is_err());
    }

    #[test]
    fn reads_the_allocator_counts_only_where_the_build_has_them() {
        let text = "\
# TYPE idemgate_alloc_total counter
idemgate_alloc_total 1500
# TYPE idemgate_alloc_bytes_total counter
idemgate_alloc_bytes_total 96000
";
        let before = parse_allocations(text).unwrap();
        let after = Allocations {
            calls: 2500.0,
            bytes: 160_000.0,
        };
        assert_eq!(
            after.since(before),
            Allocations {
                calls: 1000.0,
                bytes: 64_000.0
            }
        );
        assert_eq!(parse_allocations("idemgate_store_batches_total 1\n"), None);
    }
}
