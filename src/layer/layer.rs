//! [`IdempotencyLayer`]: the configuration half of the middleware.

use std::sync::Arc;

use tower::Layer;

use super::policy::LayerPolicy;
use super::service::Idempotency;
use crate::engine::Engine;

/// Applies [`Idempotency`] to a service: SPEC §6 for any
/// `tower::Service<http::Request<axum::body::Body>>`.
///
/// See the [module documentation](crate::layer) for an example.
#[derive(Clone)]
pub struct IdempotencyLayer {
    pub(crate) shared: Arc<Shared>,
}

/// What every clone of the service shares.
pub(crate) struct Shared {
    pub engine: Arc<Engine>,
    pub policy: LayerPolicy,
}

// === impl IdempotencyLayer ===

impl IdempotencyLayer {
    /// A layer deciding through `engine` under `policy`. The engine's replay
    /// cache serves the layer's replays: build it with
    /// [`Engine::with_replay_cache`] to change its bound or turn it off.
    pub fn new(engine: Arc<Engine>, policy: LayerPolicy) -> IdempotencyLayer {
        // Every series of this door, at 0 from the start (with whatever
        // metrics recorder the application installed).
        crate::telemetry::register_door(policy.mode.as_str(), &crate::telemetry::Outcome::ALL);
        IdempotencyLayer {
            shared: Arc::new(Shared { engine, policy }),
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
