//! Who is calling the reservation API: bearer tokens, each mapped to the
//! tenant whose keys it may touch.

use secrecy::{ExposeSecret as _, SecretString};
use subtle::ConstantTimeEq as _;

/// Bearer tokens mapped to tenants. `Debug` never shows a token.
#[derive(Clone, Default)]
pub struct Tokens(Vec<(String, SecretString)>);

// === impl Tokens ===

impl Tokens {
    /// Tokens from `(tenant, token)` pairs.
    pub fn new(pairs: impl IntoIterator<Item = (String, String)>) -> Tokens {
        Tokens(
            pairs
                .into_iter()
                .map(|(t, s)| (t, SecretString::from(s)))
                .collect(),
        )
    }

    /// No token configured: open, single-tenant mode.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The tenant `token` belongs to. Every configured token is compared, in
    /// constant time over equal-length digests, so neither a match's position
    /// nor a token's length shows in the timing.
    pub fn tenant_for(&self, token: &str) -> Option<&str> {
        use sha2::{Digest, Sha256};
        let given = Sha256::digest(token.as_bytes());
        let mut found = None;
        for (tenant, secret) in &self.0 {
            let want = Sha256::digest(secret.expose_secret().as_bytes());
            if bool::from(given.ct_eq(&want)) && found.is_none() {
                found = Some(tenant.as_str());
            }
        }
        found
    }
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(t, _)| format!("{t}:[redacted]")))
            .finish()
    }
}
