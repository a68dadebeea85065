//! `list`: the alive keys an operator asks for, oldest first, a page at a
//! time.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{KeyView, decode_cursor, encode_cursor, view};
use crate::engine::Engine;
use crate::problem::ApiError;
use crate::server::config::keys::{DEFAULT_LIMIT, ListState};
use crate::store::{KeyCursor, KeyQuery, KeyState};

/// The most keys one page holds.
pub const MAX_LIMIT: u32 = 1000;
/// The longest `older_than`: ten years, longer than any key lives.
pub const MAX_OLDER_THAN: u64 = 315_360_000;

/// Which keys to list.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only keys in this state: `stuck` (the work queue: unknown, or in
    /// flight past their lease under either choice — what the gauge
    /// `idemgate_keys_unknown` counts), `unknown` (marked so, or held past
    /// their lease), `in_flight`, or `completed`.
    pub state: Option<StateFilter>,
    /// Only this tenant's keys (as stored).
    pub tenant: Option<String>,
    /// Only keys first reserved at least this many seconds ago (at most ten
    /// years: no key lives longer).
    #[param(minimum = 0, maximum = 315_360_000)]
    pub older_than: Option<u64>,
    /// The most keys on this page (1 to 1000, default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
    /// Where the page starts: the `next` of the page before.
    pub cursor: Option<String>,
}

/// A state to list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StateFilter {
    /// Waiting for a person: unknown, or in flight past its lease (under
    /// `takeover` too, until the next request takes it over).
    Stuck,
    /// In flight under a live lease (or past it under `takeover`).
    InFlight,
    /// Unknown: marked so, or held past its lease.
    Unknown,
    /// Completed.
    Completed,
}

impl StateFilter {
    /// The state as the query spells it (`stuck`, `in_flight`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            StateFilter::Stuck => "stuck",
            StateFilter::InFlight => "in_flight",
            StateFilter::Unknown => "unknown",
            StateFilter::Completed => "completed",
        }
    }
}

impl From<ListState> for StateFilter {
    /// The filter of `keys list --state`.
    fn from(state: ListState) -> StateFilter {
        match state {
            ListState::Stuck => StateFilter::Stuck,
            ListState::InFlight => StateFilter::InFlight,
            ListState::Unknown => StateFilter::Unknown,
            ListState::Completed => StateFilter::Completed,
        }
    }
}

/// One page of keys.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct KeyList {
    /// The keys, oldest first.
    pub keys: Vec<KeyView>,
    /// The cursor of the next page, `null` after the last.
    pub next: Option<String>,
    /// The store's clock when listed, which the views' states are as of
    /// (not sent: a page's reader counts ages from it).
    #[serde(skip)]
    pub now: chrono::DateTime<chrono::Utc>,
}

/// The page of keys `query` asks for.
pub async fn list(engine: &Engine, query: &ListQuery) -> Result<KeyList, ApiError> {
    let limit = query.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ApiError::InvalidRequest(format!(
            "limit is {limit}; it must be between 1 and {MAX_LIMIT}"
        )));
    }
    if let Some(secs) = query.older_than.filter(|&s| s > MAX_OLDER_THAN) {
        return Err(ApiError::InvalidRequest(format!(
            "older_than is {secs}; it must be at most {MAX_OLDER_THAN} seconds (ten years)"
        )));
    }
    let after = query.cursor.as_deref().map(decode_cursor).transpose()?;
    let page = engine
        .list_keys(&KeyQuery {
            state: query.state.and_then(|s| match s {
                StateFilter::Stuck => None,
                StateFilter::InFlight => Some(KeyState::InFlight),
                StateFilter::Unknown => Some(KeyState::Unknown),
                StateFilter::Completed => Some(KeyState::Completed),
            }),
            stuck: query.state == Some(StateFilter::Stuck),
            tenant: query.tenant.clone().filter(|t| !t.is_empty()),
            older_than: query.older_than.map(Duration::from_secs),
            limit,
            after,
        })
        .await?;
    let full = page.records.len() >= limit as usize;
    let next = page
        .records
        .last()
        .filter(|_| full)
        .map(|last| encode_cursor(&KeyCursor::after(last)));
    Ok(KeyList {
        keys: page.records.iter().map(|r| view(r, page.now)).collect(),
        next,
        now: page.now,
    })
}
