//! `counts`: how much waits for a person — the head of the operators'
//! queue.

use chrono::{DateTime, Utc};

use super::list::{ListQuery, StateFilter, list};
use crate::engine::Engine;
use crate::problem::ApiError;

/// The work queue at a glance.
#[derive(Debug, Clone)]
pub struct Counts {
    /// Keys that wait for a person: unknown, or in flight past their lease.
    pub stuck: u64,
    /// When the oldest of them was first reserved.
    pub oldest: Option<DateTime<Utc>>,
    /// The store's clock when counted (ages count from here).
    pub now: DateTime<Utc>,
}

/// The queue's counts: how many keys wait, and since when the oldest does.
/// The count and the oldest are two reads, so a key settled in between may
/// make them disagree for one refresh.
pub async fn counts(engine: &Engine) -> Result<Counts, ApiError> {
    let stuck = engine.count_stuck().await?;
    let head = list(
        engine,
        &ListQuery {
            state: Some(StateFilter::Stuck),
            limit: Some(1),
            ..ListQuery::default()
        },
    )
    .await?;
    let oldest = head.keys.first().map(|k| k.created_at);
    Ok(Counts {
        stuck,
        oldest,
        now: head.now,
    })
}
