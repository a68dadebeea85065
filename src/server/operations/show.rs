//! `show`: one key, as an operator sees it.

use super::{KeyView, key_hash, view};
use crate::engine::Engine;
use crate::problem::ApiError;

/// The key `(tenant, key_hash_hex)`; `404 not-found` when it has no record
/// or has expired (it is new again).
pub async fn show(engine: &Engine, tenant: &str, key_hash_hex: &str) -> Result<KeyView, ApiError> {
    let hash = key_hash(key_hash_hex)?;
    match engine.find_key(tenant, &hash).await? {
        Some(found) => Ok(view(&found.record, found.now)),
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
