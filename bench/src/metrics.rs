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

/// GETs `/metrics` at `addr` and reads the batch counters from it.
pub async fn batches(addr: SocketAddr) -> anyhow::Result<Batches> {
    let answer = Conn::new(addr)
        .send(Method::GET, "/metrics", &[], Bytes::new())
        .await?;
    anyhow::ensure!(
        answer.status == StatusCode::OK,
        "GET /metrics on {addr}: {}",
        answer.status
    );
    let text = String::from_utf8_lossy(&answer.body);
    parse(&text).with_context(|| format!("GET /metrics on {addr}"))
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
}
