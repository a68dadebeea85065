//! Which names a listener answers to: the defence against DNS rebinding.
//!
//! A page on `rebind.attacker.example` whose name the attacker then points
//! at 127.0.0.1 is, to the browser, still that site: its requests to
//! idemgate's loopback listener are same-origin, carry `Host:
//! rebind.attacker.example:PORT`, and pass any check of `Origin` against
//! `Host`. What they cannot carry is idemgate's own address. So a listener
//! open without tokens ([`HostRule::new`]) answers only requests whose
//! `Host` (and HTTP/2 `:authority`, or an absolute request target) is the
//! address the connection came in on — the IP and port, or `localhost`
//! with that port — or a name of `IDEMGATE_ALLOWED_HOSTS`; anything else is
//! `421 misdirected-request` before any route runs. On a listener bound to
//! every address (`0.0.0.0`, `[::]`), "its own address" is the one the
//! client connected to. A listener with tokens is checked only where
//! `IDEMGATE_ALLOWED_HOSTS` is set. Vite's `server.allowedHosts` is the
//! model.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use http::header::HOST;

use super::OverTls;
use crate::problem::ApiError;
use crate::server::config::AllowedHost;

/// Request extension: the address the request's connection was accepted
/// on (its local address), put there by [`serve_tls`](super::serve_tls).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalAddr(pub SocketAddr);

/// The names one listener answers to.
#[derive(Debug, Clone)]
pub struct HostRule {
    /// Whether `Host` is checked at all.
    checked: bool,
    /// The names of `IDEMGATE_ALLOWED_HOSTS`.
    allowed: Vec<AllowedHost>,
}

// === impl HostRule ===

impl HostRule {
    /// The rule of a listener that is `open` (nobody needs a token for what
    /// it serves) with the names of `IDEMGATE_ALLOWED_HOSTS`: checked when
    /// open, or when names are set.
    pub fn new(open: bool, allowed: &[AllowedHost]) -> HostRule {
        HostRule {
            checked: open || !allowed.is_empty(),
            allowed: allowed.to_vec(),
        }
    }

    /// Says at start-up, for the listener bound to `listen`, which names
    /// it answers (nothing where it answers any).
    pub fn log(&self, door: &'static str, listen: SocketAddr) {
        if !self.checked {
            return;
        }
        let allowed: Vec<String> = self
            .allowed
            .iter()
            .map(|a| match a.port {
                Some(port) => format!("{}:{port}", a.host),
                None => a.host.clone(),
            })
            .collect();
        tracing::info!(
            door,
            %listen,
            allowed_hosts = allowed.join(",").as_str(),
            "this listener answers only requests addressed to its own address (or localhost \
             with its port) or a name of IDEMGATE_ALLOWED_HOSTS; any other Host is 421 \
             misdirected-request (DNS rebinding). Name in IDEMGATE_ALLOWED_HOSTS what a health \
             check or a reverse proxy sends"
        );
    }

    /// `router`, answering `421` to a request for another name before any
    /// of its routes runs.
    pub fn guard(self, router: Router) -> Router {
        if !self.checked {
            return router;
        }
        router.layer(axum::middleware::from_fn_with_state(Arc::new(self), check))
    }

    /// Whether every name the request gives (its target's authority, each
    /// `Host`) is the listener's own or an allowed one; a request that
    /// names none is not admitted. `local` is the address the connection
    /// came in on, `tls` whether it is over TLS (the port a name without
    /// one means).
    fn admits(&self, req: &Request, local: SocketAddr, tls: bool) -> bool {
        let default_port = if tls { 443 } else { 80 };
        let mut names = 0;
        let authority = req.uri().authority().map(|a| a.as_str());
        let hosts = req.headers().get_all(HOST).iter().map(|v| v.to_str().ok());
        for name in authority.map(Some).into_iter().chain(hosts) {
            names += 1;
            let Some((host, port)) = name.and_then(split) else {
                return false;
            };
            let port = port.unwrap_or(default_port);
            if !(own(&host, port, local) || self.listed(&host, port)) {
                return false;
            }
        }
        names > 0
    }

    /// A name of `IDEMGATE_ALLOWED_HOSTS`, with its port if it gave one.
    fn listed(&self, host: &str, port: u16) -> bool {
        self.allowed
            .iter()
            .any(|a| a.host == host && a.port.is_none_or(|p| p == port))
    }
}

/// `HOST[:PORT]` as a lowercase host (an IPv6 address in its brackets) and
/// the port it names; `None` for what is no such thing (a user part, an
/// empty host).
fn split(name: &str) -> Option<(String, Option<u16>)> {
    if name.contains('@') {
        return None;
    }
    let authority: http::uri::Authority = name.trim().parse().ok()?;
    let host = authority.host();
    if host.is_empty() {
        return None;
    }
    Some((host.to_ascii_lowercase(), authority.port_u16()))
}

/// Whether `host:port` names `local`: its IP, or `localhost`, with its port.
fn own(host: &str, port: u16, local: SocketAddr) -> bool {
    if port != local.port() {
        return false;
    }
    if host == "localhost" {
        return true;
    }
    let ip = host.trim_start_matches('[').trim_end_matches(']');
    ip.parse::<IpAddr>()
        .is_ok_and(|ip| ip.to_canonical() == local.ip().to_canonical())
}

/// The middleware of [`HostRule::guard`]. A request that came in through
/// no listener (a router driven in-process) has no [`LocalAddr`] and
/// nothing to compare with; it passes.
async fn check(State(rule): State<Arc<HostRule>>, req: Request, next: Next) -> Response {
    if let Some(&LocalAddr(local)) = req.extensions().get::<LocalAddr>() {
        let tls = req.extensions().get::<OverTls>().is_some();
        if !rule.admits(&req, local, tls) {
            // Not the path: an operator's path holds a key's whole hash.
            tracing::debug!(%local, "refused a request for another host name (421)");
            return ApiError::MisdirectedRequest(
                "this listener answers only requests for its own address (the IP and port it \
                 listens on, or localhost with that port) or a name in IDEMGATE_ALLOWED_HOSTS; \
                 address it so, or add the name you use to IDEMGATE_ALLOWED_HOSTS",
            )
            .into_response();
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(rule: &HostRule, local: &str, hosts: &[&str], target: &str) -> bool {
        let mut req = http::Request::builder().uri(target);
        for h in hosts {
            req = req.header(HOST, *h);
        }
        let req = req.body(axum::body::Body::empty()).unwrap();
        rule.admits(&req, local.parse().unwrap(), false)
    }

    #[test]
    fn only_the_own_address_localhost_and_listed_names() {
        let allowed = [AllowedHost {
            host: "idemgate.internal".into(),
            port: None,
        }];
        let rule = HostRule::new(true, &allowed);
        let v4 = "127.0.0.1:9090";
        assert!(admitted(&rule, v4, &["127.0.0.1:9090"], "/"));
        assert!(admitted(&rule, v4, &["LOCALHOST:9090"], "/"));
        assert!(admitted(&rule, v4, &["idemgate.internal:1234"], "/"));
        assert!(!admitted(&rule, v4, &["rebind.attacker.example:9090"], "/"));
        assert!(!admitted(&rule, v4, &["127.0.0.1:9091"], "/"));
        assert!(!admitted(&rule, v4, &["localhost"], "/"));
        assert!(!admitted(&rule, v4, &["127.0.0.2:9090"], "/"));
        assert!(!admitted(&rule, v4, &["x@127.0.0.1:9090"], "/"));
        assert!(!admitted(&rule, v4, &[], "/"));
        // Every name a request gives must pass.
        assert!(!admitted(
            &rule,
            v4,
            &["127.0.0.1:9090", "evil.example:9090"],
            "/"
        ));
        assert!(!admitted(
            &rule,
            v4,
            &["127.0.0.1:9090"],
            "http://evil.example:9090/"
        ));
        assert!(admitted(&rule, v4, &[], "http://localhost:9090/healthz"));
        let v6 = "[::1]:9090";
        assert!(admitted(&rule, v6, &["[::1]:9090"], "/"));
        assert!(!admitted(&rule, v6, &["[::2]:9090"], "/"));
        assert!(admitted(
            &rule,
            "[::ffff:127.0.0.1]:80",
            &["127.0.0.1"],
            "/"
        ));
        let port_bound = [AllowedHost {
            host: "ops.example".into(),
            port: Some(8443),
        }];
        let rule = HostRule::new(false, &port_bound);
        assert!(admitted(&rule, v4, &["ops.example:8443"], "/"));
        assert!(!admitted(&rule, v4, &["ops.example:9090"], "/"));
        assert!(!HostRule::new(false, &[]).checked);
    }
}
