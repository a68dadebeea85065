//! Who may use the operators' endpoints (`/v1/admin/keys…`):
//! `IDEMGATE_ADMIN_TOKENS`.

use std::net::SocketAddr;

use clap::Args;

use super::tokens::{TokensParser, parse_admin_tokens};
use crate::server::auth::Tokens;

/// Settings of the operators' endpoints, on `serve`'s listener and the
/// proxy's admin listener.
#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// Bearer tokens of the operators' endpoints (/v1/admin/keys: list,
    /// show and resolve stuck keys), comma-separated; an entry NAME:TOKEN
    /// names who uses it in each resolution's record (a bare token is named
    /// admin-1, admin-2, … by its place). A tenant's token is not one.
    /// Without any, the endpoints answer only on a loopback listener.
    #[arg(long, env = "IDEMGATE_ADMIN_TOKENS", value_name = "[NAME:]TOKEN,…",
          hide_env_values = true,
          value_parser = TokensParser::new("--admin-tokens", "IDEMGATE_ADMIN_TOKENS", parse_admin_tokens))]
    pub admin_tokens: Option<Tokens>,
}

// === impl AdminArgs ===

impl AdminArgs {
    /// The access rule for a listener bound to `listen`.
    pub fn access(&self, listen: SocketAddr) -> AdminAccess {
        AdminAccess {
            tokens: self.admin_tokens.clone().unwrap_or_default(),
            loopback: listen.ip().is_loopback(),
        }
    }
}

/// Who may use the operators' endpoints of one listener.
#[derive(Debug, Clone, Default)]
pub struct AdminAccess {
    /// The operators' tokens, each with the name it is recorded under.
    pub tokens: Tokens,
    /// The listener is on a loopback address: with no tokens, it is open.
    pub loopback: bool,
}

#[cfg(test)]
mod tests {
    use super::parse_admin_tokens;

    #[test]
    fn entries_are_named_or_numbered() {
        let tokens = parse_admin_tokens("alice:s3cret, plain-token ,ops.bob:x:y").unwrap();
        assert_eq!(tokens.tenant_for("s3cret"), Some("alice"));
        assert_eq!(tokens.tenant_for("plain-token"), Some("admin-2"));
        assert_eq!(tokens.tenant_for("x:y"), Some("ops.bob"));
        assert_eq!(tokens.tenant_for("alice:s3cret"), None);
        let err = parse_admin_tokens("a:t,b:t").unwrap_err();
        assert!(!err.contains(":t"), "{err}");
    }
}
