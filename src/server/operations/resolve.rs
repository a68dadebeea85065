//! `resolve`: an operator settles a stuck key — releases it (nothing
//! happened: the next request executes) or completes it with the response
//! that really happened (every retry replays it) — saying why.

use serde::Deserialize;
use utoipa::ToSchema;

use super::show::not_found;
use super::{Action, KeyView, key_hash, view};
use crate::engine::{Engine, Resolved, Settlement};
use crate::problem::ApiError;
use crate::server::views::{CommitBody, refuse_framing, stored_response};

/// The longest reason kept.
const MAX_REASON: usize = 1000;

/// How to settle a stuck key.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolveBody {
    /// `release` (nothing happened: the next request executes) or `complete`
    /// (this is what happened: every retry replays `response`).
    pub action: Action,
    /// Why: kept with the record and logged (1 to 1000 characters).
    #[schema(min_length = 1, max_length = 1000)]
    pub reason: String,
    /// With `complete`: the response that really happened.
    pub response: Option<CommitBody>,
}

/// Settles the key `(tenant, key_hash_hex)` as `body` says, on behalf of
/// `by`: `409 key-not-stuck` unless it is unknown or in flight past its
/// lease; `400 invalid-request` for a completion that names a hop-by-hop or
/// framing header.
pub async fn resolve(
    engine: &Engine,
    tenant: &str,
    key_hash_hex: &str,
    body: ResolveBody,
    by: &str,
    max_body_bytes: usize,
) -> Result<KeyView, ApiError> {
    let hash = key_hash(key_hash_hex)?;
    let reason = body.reason.trim();
    if reason.is_empty() || reason.chars().count() > MAX_REASON {
        return Err(ApiError::InvalidRequest(format!(
            "reason must hold 1 to {MAX_REASON} characters: why the key is settled this way"
        )));
    }
    let response = match (body.action, body.response) {
        (Action::Complete, Some(response)) => {
            refuse_framing(&response.headers)?;
            Some(stored_response(response, max_body_bytes)?)
        }
        (Action::Complete, None) => {
            return Err(ApiError::InvalidRequest(
                "action complete needs response: {\"status\", \"headers\", \"body\" | \
                 \"body_base64\"}, the response that really happened"
                    .into(),
            ));
        }
        (Action::Release, Some(_)) => {
            return Err(ApiError::InvalidRequest(
                "action release takes no response: nothing happened".into(),
            ));
        }
        (Action::Release, None) => None,
    };
    let settlement = Settlement {
        action: body.action.into(),
        response,
        reason: reason.to_owned(),
        by: by.to_owned(),
    };
    match engine.resolve(tenant, &hash, &settlement).await? {
        Resolved::Settled(found) => Ok(view(&found.record, found.now)),
        Resolved::NotFound => Err(not_found(tenant)),
        Resolved::NotStuck(found) => {
            let shown = view(&found.record, found.now);
            if let Some(done) = &shown.resolution {
                return Err(ApiError::NotStuck(format!(
                    "already settled by {} at {} ({}: {}); the key is {}",
                    done.by,
                    done.at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    done.action.as_str(),
                    done.reason,
                    shown.state.as_str(),
                )));
            }
            Err(ApiError::NotStuck(format!(
                "the key is {} and will be settled without an operator; only a key that is \
                 unknown or in flight past its lease can be resolved",
                match shown.state {
                    super::ShownState::InFlight => "in flight under a live lease",
                    state => state.as_str(),
                }
            )))
        }
    }
}
