//! [`IdempotencyLayer`]: the configuration half of the middleware.

use std::sync::Arc;

use tower::Layer;

use super::policy::LayerPolicy;
use super::service::Idempotency;
use super::shared::Shared;
use crate::engine::Engine;

/// Applies [`Idempotency`] to a service: the `Idempotency-Key` behaviour for
/// any `tower::Service<http::Request<axum::body::Body>>`.
///
/// See the [module documentation](crate::layer) for an example.
#[derive(Clone)]
pub struct IdempotencyLayer {
    pub(crate) shared: Arc<Shared>,
}

// === impl IdempotencyLayer ===

impl IdempotencyLayer {
    /// A layer deciding through `engine` under `policy`. The engine's replay
    /// cache serves the layer's replays: build it with
    /// [`Engine::with_replay_cache`] to change its bound or turn it off.
    pub fn new(engine: Arc<Engine>, policy: LayerPolicy) -> IdempotencyLayer {
        IdempotencyLayer {
            shared: Shared::new(engine, policy),
        }
    }

    /// The policy it enforces.
    pub fn policy(&self) -> &LayerPolicy {
        &self.shared.policy
    }

    /// The engine it decides through.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.shared.engine
    }

    /// Work of this layer's services that outlives its client's answer, right
    /// now: calls still running (their client may have hung up or had its
    /// `504` at the answer timeout), and commits of responses given while the
    /// store was away, retrying in the background.
    pub fn deferred_work(&self) -> usize {
        self.shared.deferred.pending()
    }

    /// Waits until all deferred work has ended (every call answered and
    /// settled, every background commit landed or given up), or until
    /// `within` has passed; returns how much is still running. Call it at
    /// shutdown once the listener has drained, so that a call whose client
    /// already had its answer is not cut off, nor its response left
    /// unstored.
    pub async fn finish_deferred(&self, within: std::time::Duration) -> usize {
        self.shared.deferred.finish(within).await
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::from_shared(inner, self.shared.clone())
    }
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("policy", &self.shared.policy)
            .finish_non_exhaustive()
    }
}
