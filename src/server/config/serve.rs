//! The settings of `idemgate serve`: its listener and its tokens.

use std::net::SocketAddr;

use clap::Args;

use super::tokens::{TokensParser, parse_tenant_tokens};
use super::{AdminArgs, ConfigError, PolicyArgs, RunArgs, StoreArgs, boolean_style, heading};
use crate::seal::Sealer;
use crate::server::auth::Tokens;

/// Settings of `idemgate serve`.
#[derive(Debug, Clone, Args)]
#[command(mut_args = boolean_style)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(
        long,
        env = "IDEMGATE_LISTEN",
        value_name = "HOST:PORT",
        default_value = "127.0.0.1:8080"
    )]
    pub listen: SocketAddr,

    /// Bearer tokens and their tenants: tenant:token,tenant:token. Without
    /// tokens the server is open, single-tenant, and loopback-only.
    #[arg(long, env = "IDEMGATE_TOKENS", value_name = "TENANT:TOKEN,…", hide_env_values = true,
          value_parser = TokensParser::new("--tokens", "IDEMGATE_TOKENS", parse_tenant_tokens))]
    pub tokens: Option<Tokens>,

    #[command(flatten)]
    pub admin: AdminArgs,

    // The order of the groups below is the order of `--help`'s headings.
    #[command(flatten)]
    pub policy: PolicyArgs,

    #[command(flatten)]
    pub store: StoreArgs,

    /// Refuse a reservation that sends neither `fingerprint` nor `request`
    /// (400 invalid-request). Without either, a key alone identifies its
    /// request, and the key reused with another payload cannot be told
    /// apart from a retry.
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_REQUIRE_FINGERPRINT")]
    pub require_fingerprint: bool,

    #[command(flatten)]
    pub run: RunArgs,
}

// === impl ServeArgs ===

impl ServeArgs {
    /// Refuses settings the server must not start with, protected mode
    /// first; what it built while checking them comes back as [`Checked`],
    /// which the server's state is made from.
    pub fn validate(&self) -> Result<Checked, ConfigError> {
        let open = self.tokens.as_ref().is_none_or(Tokens::is_empty);
        if open && !self.listen.ip().is_loopback() {
            return Err(ConfigError {
                setting: "listen",
                problem: format!(
                    "refusing to listen on {} without tokens (protected mode): anyone who can \
                     reach it could read and complete every key. Set tokens \
                     (--tokens or IDEMGATE_TOKENS=tenant:token,…) or listen on a loopback \
                     address (e.g. 127.0.0.1:8080)",
                    self.listen
                ),
            });
        }
        let sealer = self.run.sealer()?;
        self.run.tls.validate()?;
        self.policy.validate()?;
        Ok(Checked { sealer })
    }
}

/// What [`ServeArgs::validate`] built from settings it found usable: the
/// only way to the server's state ([`app_state`](crate::server::wiring::app_state)),
/// so no part of it can be built from settings nobody checked.
#[derive(Debug)]
pub struct Checked {
    /// The sealer of `IDEMGATE_SEAL_KEY`, if set.
    pub(crate) sealer: Option<Sealer>,
}

#[cfg(test)]
mod tests {
    use clap::Args as _;

    use super::*;

    #[test]
    fn a_token_belongs_to_one_tenant() {
        let err = parse_tenant_tokens("acme:t0p-s3cret,globex:t0p-s3cret").unwrap_err();
        assert!(err.contains("two tenants"), "{err}");
        assert!(err.contains("acme") && err.contains("globex"), "{err}");
        assert!(!err.contains("t0p-s3cret"), "{err}");
    }

    #[test]
    fn a_tenant_may_hold_several_tokens_and_a_pair_may_repeat() {
        let tokens = parse_tenant_tokens("acme:old,acme:new, globex:g ,globex:g").unwrap();
        assert_eq!(tokens.tenant_for("old"), Some("acme"));
        assert_eq!(tokens.tenant_for("new"), Some("acme"));
        assert_eq!(tokens.tenant_for("g"), Some("globex"));
        assert_eq!(tokens.tenant_for("other"), None);
        assert_eq!(
            format!("{tokens:?}"),
            r#"["acme:[redacted]", "acme:[redacted]", "globex:[redacted]"]"#
        );
    }

    #[test]
    fn refused_tokens_are_never_echoed() {
        let cmd = ServeArgs::augment_args(clap::Command::new("idemgate"));
        for value in [
            "acme:hush-1,globex",
            "acme:hush-1,globex:hush-1",
            "acme:hush-1,bad tenant:x",
        ] {
            let err = cmd
                .clone()
                .try_get_matches_from(["idemgate", "--tokens", value])
                .unwrap_err();
            assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
            let text = err.render().to_string();
            assert!(!text.contains("hush-1"), "{text}");
            assert!(text.contains("IDEMGATE_TOKENS"), "{text}");
            assert!(text.contains("--tokens"), "{text}");
        }
    }
}
