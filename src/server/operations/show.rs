//! `show`: one key, as an operator sees it.

use super::{KeyView, key_hash, view};
use crate::engine::Engine;
use crate::problem::ApiError;
use crate::store::StoredResponse;

/// The key `(tenant, key_hash_hex)`; `404 not-found` when it has no record
/// or has expired (it is new again).
pub async fn show(engine: &Engine, tenant: &str, key_hash_hex: &str) -> Result<KeyView, ApiError> {
    Ok(show_with_response(engine, tenant, key_hash_hex).await?.view)
}

/// One key and what it replays: its view, and its stored response (opened,
/// when sealed at rest) once it has one.
#[derive(Debug, Clone)]
pub struct Shown {
    /// What an operator sees of the key.
    pub view: KeyView,
    /// The response every retry replays, once completed.
    pub response: Option<StoredResponse>,
    /// The store's clock when read, which the view's state is as of.
    pub now: chrono::DateTime<chrono::Utc>,
}

/// [`show`], with the stored response: what the operators' page shows.
pub async fn show_with_response(
    engine: &Engine,
    tenant: &str,
    key_hash_hex: &str,
) -> Result<Shown, ApiError> {
    let hash = key_hash(key_hash_hex)?;
    match engine.find_key(tenant, &hash).await? {
        Some(found) => Ok(Shown {
            view: view(&found.record, found.now),
            response: found.record.response,
            now: found.now,
        }),
        None => Err(not_found(tenant)),
    }
}

/// The `404` of a key that is not there.
pub(super) fn not_found(tenant: &str) -> ApiError {
    ApiError::NotFound(format!(
        "tenant {tenant:?} has no such key (it was never reserved, or it expired or was \
         released and is new again)"
    ))
}
