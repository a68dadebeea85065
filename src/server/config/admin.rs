//! Who may use the operators' endpoints (`/v1/admin/keys…`):
//! `IDEMGATE_ADMIN_TOKENS`; and which names the listener they are on
//! answers to: `IDEMGATE_ALLOWED_HOSTS`.

use std::net::SocketAddr;

use clap::Args;

use super::tokens::{TokensParser, parse_admin_tokens};
use crate::problem::ApiError;
use crate::server::auth::Tokens;

/// Settings of the operators' endpoints, on `serve`'s listener and the
/// proxy's admin listener.
#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// Bearer tokens of the operators' endpoints (/v1/admin/keys: list,
    /// show and resolve stuck keys), comma-separated; an entry NAME:TOKEN
    /// names who uses it in each resolution's record (a bare token is named
    /// admin-1, admin-2, … by its place). A tenant's token is not one.
    /// Without any, the endpoints are open only on a loopback listener of a
    /// server with no tenant tokens (IDEMGATE_TOKENS), and answer
    /// 403 admin-disabled everywhere else.
    #[arg(long, env = "IDEMGATE_ADMIN_TOKENS", value_name = "[NAME:]TOKEN,…",
          hide_env_values = true,
          value_parser = TokensParser::new("--admin-tokens", "IDEMGATE_ADMIN_TOKENS", parse_admin_tokens))]
    pub admin_tokens: Option<Tokens>,

    /// Host names (HOST or HOST:PORT, comma-separated) that `serve`'s
    /// listener and the proxy's admin listener answer besides their own
    /// address (the IP and port they listen on, and localhost with that
    /// port). A listener open without tokens answers no other `Host`
    /// (421 misdirected-request), so that a page whose name was rebound to
    /// 127.0.0.1 reaches nothing; one with tokens checks `Host` only where
    /// this is set. Name here what a health check or a local reverse proxy
    /// sends as `Host`. The proxy's own listener is never checked.
    #[arg(long, env = "IDEMGATE_ALLOWED_HOSTS", value_name = "HOST[:PORT],…",
          value_delimiter = ',', value_parser = parse_allowed_host)]
    pub allowed_hosts: Vec<AllowedHost>,
}

/// A name of `IDEMGATE_ALLOWED_HOSTS`: a host (lowercase; an IPv6 address
/// in brackets) and, if given, the one port it is allowed with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedHost {
    /// The host, lowercase.
    pub host: String,
    /// The port, or any.
    pub port: Option<u16>,
}

/// `HOST` or `HOST:PORT` (`[::1]:8080` for an IPv6 address).
fn parse_allowed_host(s: &str) -> Result<AllowedHost, String> {
    let given = s.trim();
    if given.contains("://") || given.contains(['/', '@', '?', '#']) || given.is_empty() {
        return Err(format!(
            "{s:?} is not a host name: give HOST or HOST:PORT (no scheme, path or user), e.g. \
             idemgate.internal:9090"
        ));
    }
    let authority: http::uri::Authority = given
        .parse()
        .map_err(|_| format!("{s:?} is not a host name: give HOST or HOST:PORT"))?;
    if authority.host().is_empty() || (given.ends_with(':') && authority.port().is_none()) {
        return Err(format!("{s:?} is not a host name: give HOST or HOST:PORT"));
    }
    Ok(AllowedHost {
        host: authority.host().to_ascii_lowercase(),
        port: authority.port_u16(),
    })
}

// === impl AdminArgs ===

impl AdminArgs {
    /// The access rule for a listener bound to `listen` of a server whose
    /// tenants hold `tenants` (none on the proxy, whose tenants are its
    /// callers' credentials, never idemgate's).
    pub fn access(&self, listen: SocketAddr, tenants: &Tokens) -> AdminAccess {
        AdminAccess {
            tokens: self.admin_tokens.clone().unwrap_or_default(),
            tenants: tenants.clone(),
            loopback: listen.ip().is_loopback(),
            listen,
            allowed_hosts: self.allowed_hosts.clone(),
        }
    }
}

/// Who may use the operators' endpoints of one listener (docs/operations.md,
/// “The command line and the endpoints”): the one rule both doors (and anything
/// else that settles keys over HTTP) ask.
///
/// | admin tokens | tenant tokens | listener | a caller gets |
/// |---|---|---|---|
/// | set | any | any | an admin token: in; none or another: `401`; a tenant's: `403 forbidden` |
/// | none | set | any | `403 admin-disabled`, whoever asks |
/// | none | none | loopback | in, as `loopback` (development; WARN at start) |
/// | none | none | another | `403 admin-disabled` |
#[derive(Debug, Clone)]
pub struct AdminAccess {
    tokens: Tokens,
    tenants: Tokens,
    loopback: bool,
    listen: SocketAddr,
    allowed_hosts: Vec<AllowedHost>,
}

/// How a listener's operators' endpoints answer, as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminMode {
    /// Behind `IDEMGATE_ADMIN_TOKENS`.
    Tokens,
    /// Open to anyone who reaches the listener: loopback, nobody has an
    /// identity.
    Open,
    /// Closed: `403 admin-disabled` to every caller.
    Disabled,
}

/// Who resolves on a loopback listener without any tokens.
pub const LOOPBACK_OPERATOR: &str = "loopback";

// === impl AdminAccess ===

impl AdminAccess {
    /// How the endpoints answer.
    pub fn mode(&self) -> AdminMode {
        if !self.tokens.is_empty() {
            AdminMode::Tokens
        } else if self.tenants.is_empty() && self.loopback {
            AdminMode::Open
        } else {
            AdminMode::Disabled
        }
    }

    /// The names of `IDEMGATE_ALLOWED_HOSTS` the listener answers besides
    /// its own address.
    pub fn allowed_hosts(&self) -> &[AllowedHost] {
        &self.allowed_hosts
    }

    /// The operator a request is from — the name its token is recorded
    /// under — or the refusal. `bearer` reads the request's bearer token; it
    /// is asked only where a token decides.
    pub fn authorize<'a>(
        &self,
        bearer: impl FnOnce() -> Result<&'a str, ApiError>,
    ) -> Result<String, ApiError> {
        match self.mode() {
            AdminMode::Open => Ok(LOOPBACK_OPERATOR.to_owned()),
            AdminMode::Disabled if self.tenants.is_empty() => Err(ApiError::AdminDisabled(
                "the admin endpoints are disabled: this listener is not on a loopback address \
                 and no IDEMGATE_ADMIN_TOKENS is set; set IDEMGATE_ADMIN_TOKENS \
                 (--admin-tokens NAME:TOKEN,…) to use them",
            )),
            AdminMode::Disabled => Err(ApiError::AdminDisabled(
                "the admin endpoints are disabled: this server has tenant tokens \
                 (IDEMGATE_TOKENS) and no IDEMGATE_ADMIN_TOKENS, and a tenant's token is never \
                 an operator's; set IDEMGATE_ADMIN_TOKENS (--admin-tokens NAME:TOKEN,…) to use \
                 them",
            )),
            AdminMode::Tokens => {
                let token = bearer()?;
                if let Some(name) = self.tokens.tenant_for(token) {
                    Ok(name.to_owned())
                } else if self.tenants.tenant_for(token).is_some() {
                    Err(ApiError::Forbidden(
                        "a tenant's token cannot use the admin endpoints: they need a token of \
                         IDEMGATE_ADMIN_TOKENS",
                    ))
                } else {
                    Err(ApiError::Unauthorized(
                        "the bearer token is not an admin token",
                    ))
                }
            }
        }
    }

    /// Says at start-up how the endpoints answer: WARN where they are open
    /// or closed by default, INFO behind tokens.
    pub fn log(&self, door: &'static str) {
        let listen = self.listen;
        match self.mode() {
            AdminMode::Tokens => tracing::info!(
                door,
                %listen,
                "the admin endpoints (/v1/admin/keys) need a token of IDEMGATE_ADMIN_TOKENS"
            ),
            AdminMode::Open => tracing::warn!(
                door,
                %listen,
                "the admin endpoints (/v1/admin/keys) are open without a token to anyone on this \
                 host (a loopback listener and no tokens set): set IDEMGATE_ADMIN_TOKENS before \
                 anyone else can reach it"
            ),
            AdminMode::Disabled => tracing::warn!(
                door,
                %listen,
                "the admin endpoints (/v1/admin/keys) are disabled (403 admin-disabled): set \
                 IDEMGATE_ADMIN_TOKENS to list and settle stuck keys over HTTP; `idemgate keys` \
                 works meanwhile"
            ),
        }
    }
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
