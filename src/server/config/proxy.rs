//! Settings of `idemgate proxy`.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{
    AdminArgs, ConfigError, PolicyArgs, RunArgs, StoreArgs, boolean_style, heading, seconds,
};
use crate::layer::{TenantPart, TenantSource};
use crate::server::proxy::mcp::places::{KeyFrom, KeyPlace};
use crate::store::LeaseExpiry;

/// Settings of `idemgate proxy`.
#[derive(Debug, Clone, Args)]
#[command(mut_args = boolean_style)]
pub struct ProxyArgs {
    /// The origin every request is forwarded to: http://HOST:PORT or
    /// https://HOST:PORT, optionally with a base path. Required. An https
    /// upstream's certificate is always checked: against the system's
    /// roots, or --upstream-ca-file.
    #[arg(long, env = "IDEMGATE_UPSTREAM", value_name = "URL")]
    pub upstream: Option<String>,

    /// A PEM file of the certificates an https upstream's certificate is
    /// checked against, instead of the system's roots: the CA of a private
    /// network, or the upstream's own self-signed certificate.
    #[arg(help_heading = heading::UPSTREAM, long, env = "IDEMGATE_UPSTREAM_CA_FILE", value_name = "PATH")]
    pub upstream_ca_file: Option<PathBuf>,

    /// Address the proxy listens on.
    #[arg(
        long,
        env = "IDEMGATE_LISTEN",
        value_name = "HOST:PORT",
        default_value = "127.0.0.1:8081"
    )]
    pub listen: SocketAddr,

    /// Address of the admin listener: /healthz, /readyz, /metrics,
    /// /v1/policy (never mixed into the upstream's paths).
    #[arg(
        long,
        env = "IDEMGATE_ADMIN_LISTEN",
        value_name = "HOST:PORT",
        default_value = "127.0.0.1:9090"
    )]
    pub admin_listen: SocketAddr,

    /// Seconds a client waits for the upstream's answer once its request is
    /// sent (then 504 upstream-timeout). A guarded call is not abandoned at
    /// the timeout: it runs on, its key's lease kept alive, and its late
    /// answer is stored for the retry. The key's lease is this plus 5,
    /// extended every third of that while the call runs [default: 30, or
    /// IDEMGATE_UPSTREAM_ABANDON_AFTER if that is shorter].
    #[arg(
        help_heading = heading::UPSTREAM,
        long,
        env = "IDEMGATE_UPSTREAM_TIMEOUT",
        value_name = "SECONDS",
        value_parser = seconds
    )]
    pub upstream_timeout: Option<Duration>,

    /// Seconds after which a guarded upstream call that has still not
    /// answered is abandoned: its outcome is unknown (see
    /// --on-lease-expiry). Until then the lease is kept alive, so a slow
    /// origin never runs a key twice. The default outlasts the request timeouts origins commonly have
    /// themselves (30 to 120 s), at the cost of a connection and a task per
    /// call still running [default: 300, or IDEMGATE_UPSTREAM_TIMEOUT if
    /// that is longer].
    #[arg(
        help_heading = heading::UPSTREAM,
        long,
        env = "IDEMGATE_UPSTREAM_ABANDON_AFTER",
        value_name = "SECONDS",
        value_parser = seconds
    )]
    pub upstream_abandon_after: Option<Duration>,

    /// Seconds to wait for a connection to the upstream, its TLS handshake
    /// included (502 upstream-unavailable after that; the key is released).
    #[arg(
        help_heading = heading::UPSTREAM,
        long,
        env = "IDEMGATE_UPSTREAM_CONNECT_TIMEOUT",
        value_name = "SECONDS",
        default_value = "5",
        value_parser = seconds
    )]
    pub upstream_connect_timeout: Duration,

    /// Seconds an idle connection to the upstream is kept for the next
    /// request. Keep it below the upstream's own keep-alive timeout
    /// (uvicorn's and Node's are 5 s): a request sent on a connection the
    /// upstream is closing at that moment may have reached it or not, and
    /// its key is then held outcome-unknown. 0 opens a new connection for
    /// every request.
    #[arg(
        help_heading = heading::UPSTREAM,
        long,
        env = "IDEMGATE_UPSTREAM_IDLE_TIMEOUT",
        value_name = "SECONDS",
        default_value = "4",
        value_parser = seconds
    )]
    pub upstream_idle_timeout: Duration,

    /// Send the client's Host header to the upstream (true), so that the
    /// origin builds its absolute URLs (Location, links) with the name its
    /// clients use; false sends the upstream URL's host:port instead, for an
    /// origin that routes by its own name. X-Forwarded-Host carries the
    /// client's either way.
    #[arg(help_heading = heading::UPSTREAM, long, env = "IDEMGATE_PRESERVE_HOST", default_value_t = true)]
    pub preserve_host: bool,

    /// What the upstream speaks: `http` guards requests by their HTTP
    /// method and `Idempotency-Key` header; `mcp` is the upstream's MCP
    /// streamable-HTTP endpoint, whose write tools' `tools/call` requests are
    /// guarded by their `idempotency_key` argument (everything else passes
    /// through, and `tools/list` tells clients about the argument).
    #[arg(help_heading = heading::MCP, long, env = "IDEMGATE_PROTOCOL", value_name = "http|mcp", default_value = "http",
          value_parser = ["http", "mcp"])]
    pub protocol: String,

    /// With --protocol mcp: run `COMMAND [ARGS…]` (given after `--`) as the
    /// MCP server over its stdin and stdout, and speak MCP to this process's
    /// own client over idemgate's stdin and stdout, for an MCP host that
    /// starts servers as commands: configure `idemgate proxy --protocol mcp
    /// --stdio -- COMMAND ARGS…` as the server's command. The server's
    /// stderr is idemgate's; idemgate logs to stderr only, and writes
    /// nothing but MCP to stdout. No listener is opened (no --listen,
    /// --admin-listen or --upstream). Unless DATABASE_URL is set, the
    /// keys are kept in a SQLite file of the server's own in the user's
    /// data directory ($XDG_DATA_HOME/idemgate/, else
    /// ~/.local/share/idemgate/; on macOS ~/Library/Application
    /// Support/idemgate/), named after the command.
    #[arg(help_heading = heading::MCP, long, env = "IDEMGATE_STDIO")]
    pub stdio: bool,

    /// With --stdio: the MCP server's command and its arguments, after `--`.
    #[arg(value_name = "COMMAND", last = true)]
    pub command: Vec<OsString>,

    /// With --protocol mcp: the tools that are guarded, comma-separated
    /// (`*` for all). Unset, every tool the server's tools/list does not
    /// annotate `readOnlyHint: true`.
    #[arg(
        help_heading = heading::MCP,
        long,
        env = "IDEMGATE_MCP_TOOLS",
        value_name = "NAME,...",
        value_delimiter = ','
    )]
    pub mcp_tools: Option<Vec<String>>,

    /// With --protocol mcp: add an optional `idempotency_key` argument (the
    /// first argument: place of IDEMGATE_MCP_KEY_FROM) to each guarded
    /// tool's input schema in tools/list answers, for a model to send. false leaves tools/list as the server wrote it, for a
    /// runtime that sets the key itself (`_meta["dev.idemgate/idempotency-key"]`
    /// or the key header) and keeps it out of the model's view.
    #[arg(help_heading = heading::MCP, long, env = "IDEMGATE_MCP_ADVERTISE_KEY", value_name = "true|false",
          default_value_t = true, action = clap::ArgAction::Set)]
    pub mcp_advertise_key: bool,

    /// With --protocol mcp: where a guarded tool call's key is read from,
    /// comma-separated, first found wins: meta:NAME (params._meta.NAME),
    /// header (the key header), param:NAME (params.NAME, forwarded and
    /// never fingerprinted), all set by a runtime; then argument:NAME
    /// (params.arguments.NAME, set by a model: removed before the call is
    /// forwarded unless the tool declares it, its keys in a scope of their
    /// own; the first is the one tools/list offers). Runtime places come
    /// first
    /// [default: meta:dev.idemgate/idempotency-key,meta:idempotency-key,meta:idempotency_key,header,argument:idempotency_key,argument:idempotencyKey].
    #[arg(help_heading = heading::MCP, long, env = "IDEMGATE_MCP_KEY_FROM",
          value_name = "PLACE,…", value_delimiter = ',', value_parser = KeyPlace::parse)]
    pub mcp_key_from: Option<Vec<KeyPlace>>,

    /// What a key's lease ending without news means (the proxy was killed,
    /// stalled or cut off from the database for longer than the lease):
    /// `hold` (the default) never sends it upstream again by itself, for the
    /// proxy cannot know whether the origin acted: every request with the
    /// key gets 409 outcome-unknown until the proxy's late commit lands or
    /// an operator settles it (`idemgate keys`); so does a key whose
    /// upstream connection broke after the request was sent, or whose call
    /// passed the abandon bound. `takeover`: the next request after the
    /// lease sends it upstream again, with `Idempotency-Attempt: N`, for an
    /// origin that dedupes on the key it is forwarded. Per route in the
    /// config file too.
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_ON_LEASE_EXPIRY", value_name = "hold|takeover",
          default_value = "hold", value_parser = parse_lease_expiry)]
    pub on_lease_expiry: LeaseExpiry,

    /// Seconds a duplicate of a key still in flight is held for the first
    /// request's answer, which it then gets replayed (at most
    /// IDEMGATE_MAX_WAIT), when it does not say itself with `Prefer: wait=N`;
    /// `Prefer: wait=0` asks for the immediate 409 request-in-flight, and 0
    /// here answers every duplicate at once [default: 10, 4 with --protocol
    /// mcp (the OpenAI Agents SDK's MCP session reads for 5 s), or
    /// IDEMGATE_MAX_WAIT if that is shorter].
    #[arg(
        help_heading = heading::KEYS,
        long,
        env = "IDEMGATE_DEFAULT_WAIT",
        value_name = "SECONDS",
        value_parser = seconds
    )]
    pub default_wait: Option<Duration>,

    /// Answer 400 key-missing to a guarded request without a key, instead of
    /// passing it through unguarded.
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_REQUIRE_KEY")]
    pub require_key: bool,

    /// The request header that carries the key.
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_KEY_HEADER", default_value = "Idempotency-Key",
          value_parser = parse_header_name)]
    pub key_header: Header,

    /// The request header whose value names the tenant (hashed): the
    /// one-header form of IDEMGATE_TENANT_FROM [default: Authorization].
    #[arg(help_heading = heading::LIMITS, long, env = "IDEMGATE_TENANT_HEADER",
          value_parser = parse_header_name)]
    pub tenant_header: Option<Header>,

    /// Where a request's credentials are, which scope its keys (hashed
    /// together, so each credential is its own tenant), comma-separated:
    /// header names and cookie:NAME, e.g. Authorization,cookie:session.
    /// A request with none of them is in one anonymous tenant, whose
    /// replays everyone without a credential shares: name the session
    /// cookie of an origin whose callers sign in with one [default:
    /// Authorization].
    #[arg(help_heading = heading::LIMITS, long, env = "IDEMGATE_TENANT_FROM",
          value_name = "HEADER|cookie:NAME,…", value_delimiter = ',',
          value_parser = TenantPart::parse)]
    pub tenant_from: Option<Vec<TenantPart>>,

    /// Answer 401 unauthorized to a guarded request with a key that carries
    /// none of the IDEMGATE_TENANT_FROM credentials, without calling the
    /// upstream, instead of putting it in the anonymous tenant. A request
    /// without a key still passes through (nothing of it is stored or
    /// replayed).
    #[arg(help_heading = heading::LIMITS, long, env = "IDEMGATE_REQUIRE_TENANT")]
    pub require_tenant: bool,

    /// Response statuses returned but not stored: the key is released, since
    /// the origin did not act.
    #[arg(help_heading = heading::STORED, long, env = "IDEMGATE_RELEASE_STATUSES", value_name = "STATUS", value_delimiter = ',',
          default_value = "408,425,429,503", value_parser = clap::value_parser!(u16).range(100..=599))]
    pub release_statuses: Vec<u16>,

    /// Response headers never stored for replay (hop-by-hop and framing
    /// headers never are, nor replayed), comma-separated.
    #[arg(help_heading = heading::STORED, long, env = "IDEMGATE_STORE_HEADERS_DENY", value_delimiter = ',',
          default_value = "set-cookie,set-cookie2,www-authenticate", value_parser = parse_header_name)]
    pub store_headers_deny: Vec<Header>,

    #[command(flatten)]
    pub admin: AdminArgs,

    // The order of the groups below is the order of `--help`'s headings.
    #[command(flatten)]
    pub policy: PolicyArgs,

    #[command(flatten)]
    pub store: StoreArgs,

    #[command(flatten)]
    pub run: RunArgs,
}

/// A header name as set: the name, and its spelling for what the proxy
/// publishes (`X-Idempotency-Key` rather than the name's lowercase).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The name.
    pub name: http::HeaderName,
    /// As the operator spelled it.
    pub spelled: String,
}

/// `hold` or `takeover`.
pub fn parse_lease_expiry(s: &str) -> Result<LeaseExpiry, String> {
    LeaseExpiry::parse(s)
}

fn parse_header_name(s: &str) -> Result<Header, String> {
    let spelled = s.trim();
    http::HeaderName::from_bytes(spelled.as_bytes())
        .map(|name| Header {
            name,
            spelled: spelled.to_owned(),
        })
        .map_err(|_| format!("{s:?} is not a valid header name"))
}

/// How long a client waits for the upstream's answer, unless
/// `IDEMGATE_UPSTREAM_ABANDON_AFTER` is shorter.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a guarded call may run unanswered before it is abandoned, unless
/// `IDEMGATE_UPSTREAM_TIMEOUT` is longer.
pub const ABANDON_AFTER: Duration = Duration::from_secs(300);

/// How long a duplicate is held for the first request's answer, unless
/// `IDEMGATE_MAX_WAIT` is shorter.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(10);

/// [`DEFAULT_WAIT`] of the MCP door: a held tool call is answered before the
/// official clients' request timeouts run out (the OpenAI Agents SDK's MCP
/// session reads for 5 s).
pub const MCP_DEFAULT_WAIT: Duration = Duration::from_secs(4);

// === impl ProxyArgs ===

impl ProxyArgs {
    /// How long a client waits for the upstream's answer:
    /// `IDEMGATE_UPSTREAM_TIMEOUT` if set, else [`UPSTREAM_TIMEOUT`], or
    /// `IDEMGATE_UPSTREAM_ABANDON_AFTER` if that is shorter. Of two settings
    /// bound to each other, the one not set follows the one set: a default
    /// never contradicts a value the operator chose.
    pub fn upstream_timeout(&self) -> Duration {
        self.upstream_timeout.unwrap_or_else(|| {
            self.upstream_abandon_after
                .map_or(UPSTREAM_TIMEOUT, |a| UPSTREAM_TIMEOUT.min(a))
        })
    }

    /// When a guarded call still unanswered is abandoned:
    /// `IDEMGATE_UPSTREAM_ABANDON_AFTER` if set, else [`ABANDON_AFTER`], or
    /// `IDEMGATE_UPSTREAM_TIMEOUT` if that is longer.
    pub fn abandon_after(&self) -> Duration {
        self.upstream_abandon_after.unwrap_or_else(|| {
            self.upstream_timeout
                .map_or(ABANDON_AFTER, |t| ABANDON_AFTER.max(t))
        })
    }

    /// How long a duplicate is held by default: `IDEMGATE_DEFAULT_WAIT` if
    /// set, else [`DEFAULT_WAIT`] ([`MCP_DEFAULT_WAIT`] for the MCP door),
    /// or `IDEMGATE_MAX_WAIT` if that is shorter.
    pub fn default_wait(&self) -> Duration {
        let default = if self.protocol == "mcp" {
            MCP_DEFAULT_WAIT
        } else {
            DEFAULT_WAIT
        };
        self.default_wait
            .unwrap_or_else(|| default.min(Duration::from_secs(u64::from(self.max_wait()))))
    }

    /// The longest `Prefer: wait` honoured: `IDEMGATE_MAX_WAIT` if set, else
    /// 10, or `IDEMGATE_DEFAULT_WAIT` if that is longer.
    pub fn max_wait(&self) -> u32 {
        self.policy.max_wait(self.default_wait)
    }

    /// The engine's bounds.
    pub fn limits(&self) -> crate::engine::Limits {
        self.policy.limits_waiting(self.default_wait)
    }

    /// Where the tenant of a request is taken from: IDEMGATE_TENANT_FROM,
    /// or IDEMGATE_TENANT_HEADER, or `Authorization`.
    pub fn tenant_source(&self) -> TenantSource {
        match (&self.tenant_from, &self.tenant_header) {
            (Some(parts), _) => match parts.as_slice() {
                [TenantPart::Header(name)] => TenantSource::Header(name.clone()),
                _ => TenantSource::Parts(parts.clone()),
            },
            (None, Some(header)) => TenantSource::Header(header.name.clone()),
            (None, None) => TenantSource::Header(http::header::AUTHORIZATION),
        }
    }

    /// Where the MCP door reads a tool call's key: IDEMGATE_MCP_KEY_FROM,
    /// or SPEC §12's default list.
    ///
    /// # Errors
    /// A list the door must not start with ([`KeyFrom::new`]).
    pub fn mcp_key_from(&self) -> Result<KeyFrom, ConfigError> {
        match &self.mcp_key_from {
            None => Ok(KeyFrom::default()),
            Some(places) => KeyFrom::new(places.clone()).map_err(|problem| ConfigError {
                setting: "mcp_key_from",
                problem,
            }),
        }
    }

    /// Refuses settings the proxy must not start with.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tenant_from.is_some() && self.tenant_header.is_some() {
            return Err(ConfigError {
                setting: "tenant_header",
                problem: "is set, and so is {tenant_from}, of which it is the one-header form; \
                          set one (e.g. IDEMGATE_TENANT_FROM=Authorization,cookie:session)"
                    .into(),
            });
        }
        let https = if self.stdio {
            false
        } else {
            self.upstream_uri()?.scheme() == Some(&http::uri::Scheme::HTTPS)
        };
        if let Some(path) = &self.upstream_ca_file
            && !https
        {
            return Err(ConfigError {
                setting: "upstream_ca_file",
                problem: format!(
                    "is set ({}) but the upstream is not https://; a CA file checks an https \
                     upstream's certificate",
                    path.display()
                ),
            });
        }
        if self.mcp_tools.is_some() && self.protocol != "mcp" {
            return Err(ConfigError {
                setting: "mcp_tools",
                problem: format!(
                    "names the guarded MCP tools, but the protocol is {:?}; set \
                     IDEMGATE_PROTOCOL=mcp (--protocol mcp) for an MCP server's endpoint",
                    self.protocol
                ),
            });
        }
        if self.mcp_key_from.is_some() && self.protocol != "mcp" {
            return Err(ConfigError {
                setting: "mcp_key_from",
                problem: format!(
                    "names where MCP tool calls carry their key, but the protocol is {:?}; set \
                     IDEMGATE_PROTOCOL=mcp (--protocol mcp) for an MCP server's endpoint",
                    self.protocol
                ),
            });
        }
        self.mcp_key_from()?;
        // The bound first: a timeout that follows a bound of 0 would be
        // refused in the bound's stead.
        if self.abandon_after().is_zero() {
            return Err(ConfigError {
                setting: "upstream_abandon_after",
                problem: "must be at least 1 second".into(),
            });
        }
        if self.upstream_timeout().is_zero() {
            return Err(ConfigError {
                setting: "upstream_timeout",
                problem: "must be at least 1 second".into(),
            });
        }
        if self.abandon_after() < self.upstream_timeout() {
            return Err(ConfigError {
                setting: "upstream_abandon_after",
                problem: format!(
                    "{} s is shorter than {{upstream_timeout}} ({} s): a call must be \
                     allowed to run at least as long as its client waits for it",
                    self.abandon_after().as_secs(),
                    self.upstream_timeout().as_secs()
                ),
            });
        }
        if self.default_wait().as_secs() > u64::from(self.max_wait()) {
            return Err(ConfigError {
                setting: "default_wait",
                problem: format!(
                    "{} s is longer than the longest wait, {{max_wait}} ({} s): lower the one or \
                     raise the other",
                    self.default_wait().as_secs(),
                    self.max_wait()
                ),
            });
        }
        if self.upstream_connect_timeout.is_zero() {
            return Err(ConfigError {
                setting: "upstream_connect_timeout",
                problem: "must be at least 1 second".into(),
            });
        }
        if self.listen == self.admin_listen && self.listen.port() != 0 {
            return Err(ConfigError {
                setting: "admin_listen",
                problem: "is also the proxy's address ({listen}); the admin endpoints need a \
                          listener of their own"
                    .into(),
            });
        }
        self.run.tls.validate()?;
        self.policy.validate()?;
        self.validate_stdio()
    }

    /// `--stdio` goes with `--protocol mcp` and a command, and a command
    /// with `--stdio`.
    fn validate_stdio(&self) -> Result<(), ConfigError> {
        let stdio = |problem: &str| ConfigError {
            setting: "stdio",
            problem: problem.into(),
        };
        match (self.stdio, self.command.is_empty()) {
            (true, _) if self.protocol != "mcp" => Err(stdio(
                "runs an MCP server over stdio, but the protocol is not mcp; add --protocol mcp \
                 (idemgate proxy --protocol mcp --stdio -- COMMAND ARGS…)",
            )),
            (true, _) if self.upstream.is_some() => Err(ConfigError {
                setting: "upstream",
                problem: "is set, and so is {stdio}, which runs the MCP server as a command \
                          instead of forwarding to a URL; set one"
                    .into(),
            }),
            (true, true) => Err(stdio(
                "needs the MCP server's command after `--` (idemgate proxy --protocol mcp \
                 --stdio -- COMMAND ARGS…)",
            )),
            (false, false) => Err(ConfigError {
                setting: "upstream",
                problem: format!(
                    "a command was given after `--` ({}), which only --stdio runs; add \
                     --protocol mcp --stdio to run it as a stdio MCP server, or leave it out \
                     and name the upstream URL",
                    self.command[0].to_string_lossy()
                ),
            }),
            _ => Ok(()),
        }
    }

    /// The upstream as a URI: `http` or `https`, a host, and a path without
    /// query.
    pub fn upstream_uri(&self) -> Result<http::Uri, ConfigError> {
        let bad = |problem: String| ConfigError {
            setting: "upstream",
            problem,
        };
        let Some(raw) = self.upstream.as_deref().map(str::trim) else {
            return Err(bad(
                "required: the origin to forward to, e.g. --upstream http://127.0.0.1:3000".into(),
            ));
        };
        // Checked first: no message shows the value, but the command line's
        // names it (masking a password), and an embedded user is no better.
        let authority = raw.split_once("://").map_or(raw, |(_, rest)| rest);
        let authority = authority.split(['/', '?', '#']).next().unwrap_or_default();
        if authority.contains('@') {
            return Err(bad(
                "credentials in the upstream URL are not supported (they would end up in logs); \
                 the clients' own Authorization headers pass through to the origin"
                    .into(),
            ));
        }
        let uri: http::Uri = raw.parse().map_err(|e| bad(format!("not a URL: {e}")))?;
        match uri.scheme_str() {
            Some("http" | "https") => {}
            Some(other) => {
                return Err(bad(format!(
                    "scheme {other:?} is not supported; use http://HOST:PORT or https://HOST:PORT"
                )));
            }
            None => {
                return Err(bad(
                    "no scheme; use http://HOST:PORT or https://HOST:PORT".into()
                ));
            }
        }
        if uri.host().is_none_or(str::is_empty) {
            return Err(bad("names no host".into()));
        }
        if uri.query().is_some() {
            return Err(bad("has a query; give a base URL only".into()));
        }
        Ok(uri)
    }
}
