//! What a long-running command does beside its requests: migrations,
//! pruning, shutdown, connection timers, memory, tenant limits, sealing.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use secrecy::{ExposeSecret, SecretString};

use super::{ConfigError, boolean_style, heading, positive_seconds, seconds};
use crate::engine::{DEFAULT_REPLAY_CACHE_BYTES, TenantLimits};
use crate::seal::Sealer;

/// What a long-running command (`serve`, `proxy`) does beside its requests,
/// and the memory it keeps for them.
#[derive(Debug, Clone, Args)]
#[command(mut_args = boolean_style)]
pub struct RunArgs {
    /// Do not apply pending migrations at start (`idemgate migrate` does).
    #[arg(help_heading = heading::DATABASE, long, env = "IDEMGATE_NO_MIGRATE")]
    pub no_migrate: bool,

    /// Seconds between pruning passes (0 turns the job off).
    #[arg(
        help_heading = heading::DATABASE,
        long,
        env = "IDEMGATE_PRUNE_INTERVAL",
        value_name = "SECONDS",
        default_value = "60",
        value_parser = seconds
    )]
    pub prune_interval: Duration,

    /// Seconds in-flight requests get to finish after SIGTERM or ctrl-c.
    #[arg(
        help_heading = heading::CONNECTIONS,
        long,
        env = "IDEMGATE_SHUTDOWN_GRACE",
        value_name = "SECONDS",
        default_value = "30",
        value_parser = seconds
    )]
    pub shutdown_grace: Duration,

    /// Seconds a client has to send a request's headers before its
    /// connection is closed, and at most between two pieces of its body
    /// before it gets 408 (slow clients cannot hold connections open).
    #[arg(help_heading = heading::CONNECTIONS, long, env = "IDEMGATE_HEADER_READ_TIMEOUT", value_name = "SECONDS", default_value = "10",
          value_parser = positive_seconds)]
    pub header_read_timeout: Duration,

    /// Seconds an idle keep-alive connection, its last response sent, waits
    /// for the next request before it is closed. The default is longer than
    /// any Retry-After sent under the default leases (30 s for serve, 35 s
    /// for the proxy), so a client that waits as told still finds its pooled
    /// connection open.
    #[arg(help_heading = heading::CONNECTIONS, long, env = "IDEMGATE_KEEP_ALIVE_TIMEOUT", value_name = "SECONDS", default_value = "75",
          value_parser = positive_seconds)]
    pub keep_alive_timeout: Duration,

    /// Bytes of memory for completed responses, replayed from there without
    /// a database round trip until they expire (0 turns the cache off).
    #[arg(help_heading = heading::LIMITS, long, env = "IDEMGATE_REPLAY_CACHE_BYTES", value_name = "BYTES",
          default_value_t = DEFAULT_REPLAY_CACHE_BYTES)]
    pub replay_cache_bytes: u64,

    /// Most keys one tenant may hold in flight at once; a new key beyond it
    /// is answered 429 tenant-limit with Retry-After (0: no limit).
    #[arg(
        help_heading = heading::LIMITS,
        long,
        env = "IDEMGATE_TENANT_MAX_IN_FLIGHT",
        value_name = "N",
        default_value_t = 0
    )]
    pub tenant_max_in_flight: u32,

    /// Most bytes of stored responses one tenant may keep until they
    /// expire; at or over it, its new keys are answered 429 tenant-limit
    /// with Retry-After while its replays go on (0: no limit).
    #[arg(
        help_heading = heading::LIMITS,
        long,
        env = "IDEMGATE_TENANT_MAX_STORED_BYTES",
        value_name = "BYTES",
        default_value_t = 0
    )]
    pub tenant_max_stored_bytes: u64,

    /// Exports traces (a span per request, with its key parse, claim,
    /// upstream call and commit) over OTLP/HTTP to this collector's base
    /// URL, e.g. http://127.0.0.1:4318 (`/v1/traces` is added). Unset: no
    /// export. OTEL_SERVICE_NAME names the service (default idemgate).
    #[arg(help_heading = heading::OBSERVABILITY, long, env = "IDEMGATE_OTLP_ENDPOINT", value_name = "URL",
          value_parser = parse_endpoint)]
    pub otlp_endpoint: Option<String>,

    #[command(flatten)]
    pub seal: SealArgs,

    #[command(flatten)]
    pub tls: TlsArgs,
}

/// TLS on the command's own listeners (`serve`'s, the proxy's two).
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// Serves the listeners over TLS with this certificate (PEM: the leaf
    /// first, then its intermediates); needs --tls-key. Read again when it
    /// changes: a rotated certificate is served from the next handshake on.
    #[arg(help_heading = heading::TLS, long, env = "IDEMGATE_TLS_CERT", value_name = "PEM FILE")]
    pub tls_cert: Option<PathBuf>,

    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1); read
    /// again when it changes.
    #[arg(help_heading = heading::TLS, long, env = "IDEMGATE_TLS_KEY", value_name = "PEM FILE")]
    pub tls_key: Option<PathBuf>,

    /// Requires clients to present a certificate signed by one of these CAs
    /// (PEM) on the TLS listeners: mutual TLS. It is not a token: tokens and
    /// the admin rule apply as they are.
    #[arg(help_heading = heading::TLS, long, env = "IDEMGATE_TLS_CLIENT_CA", value_name = "PEM FILE")]
    pub tls_client_ca: Option<PathBuf>,
}

/// The seal keys of stored responses: what `serve` and `proxy` seal with,
/// and what `keys` opens records with.
#[derive(Debug, Clone, Args)]
#[command(mut_args = boolean_style)]
pub struct SealArgs {
    /// Seals stored responses, requests and checkpoints at rest (AES-256-GCM)
    /// and keys the stored key hashes, credential tenants and fingerprints
    /// (HMAC-SHA-256): 32 random bytes, base64 (`openssl rand -base64 32`).
    /// New records are sealed under it. A process without the key that
    /// other processes name records with refuses to start.
    #[arg(help_heading = heading::SEALING, long, env = "IDEMGATE_SEAL_KEY", hide_env_values = true)]
    pub seal_key: Option<SecretString>,

    /// Retired seal keys, comma-separated base64: records sealed and named
    /// under them are still opened and found; none is sealed under them any
    /// more. Keep a key here until the key window since it was last used has
    /// passed.
    #[arg(help_heading = heading::SEALING, long, env = "IDEMGATE_SEAL_KEY_PREVIOUS", hide_env_values = true)]
    pub seal_key_previous: Option<SecretString>,

    /// With a seal key, the window after sealing is turned on: still replay
    /// records stored in the clear, and keep naming new records by plain
    /// hashes so that processes not yet given the key (or of 0.3.0) find
    /// them. Without it a record in the clear is refused (never replayed,
    /// never run again), so that a row written into the database by hand
    /// cannot reach a caller. Remove it once every process has the key.
    #[arg(help_heading = heading::SEALING, long, env = "IDEMGATE_SEAL_ACCEPT_PLAINTEXT")]
    pub seal_accept_plaintext: bool,
}

// === impl RunArgs ===

impl RunArgs {
    /// How long in-flight requests get after a shutdown signal.
    pub fn grace(&self) -> Duration {
        self.shutdown_grace
    }

    /// The per-tenant limits, 0 read as none.
    pub fn tenant_limits(&self) -> TenantLimits {
        TenantLimits {
            max_in_flight: (self.tenant_max_in_flight > 0).then_some(self.tenant_max_in_flight),
            max_stored_bytes: (self.tenant_max_stored_bytes > 0)
                .then_some(self.tenant_max_stored_bytes),
        }
    }

    /// The sealer of the seal settings ([`SealArgs::sealer`]).
    pub fn sealer(&self) -> Result<Option<Sealer>, ConfigError> {
        self.seal.sealer()
    }
}

/// The parser of `--otlp-endpoint`: an `http://` or `https://` URL without
/// credentials (they would show in logs), to which `/v1/traces` is added.
pub fn parse_endpoint(s: &str) -> Result<String, String> {
    let raw = s.trim();
    let uri: http::Uri = raw.parse().map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(
            "expected an http:// or https:// URL, e.g. http://127.0.0.1:4318 (/v1/traces is \
             added)"
                .into(),
        );
    }
    let Some(authority) = uri.authority() else {
        return Err("names no host".into());
    };
    if authority.as_str().contains('@') {
        return Err("credentials in the URL are not supported".into());
    }
    if uri.query().is_some() {
        return Err("a query is not supported: give the collector's base URL".into());
    }
    Ok(raw.trim_end_matches('/').to_owned())
}

// === impl TlsArgs ===

impl TlsArgs {
    /// Refuses a certificate without its key, a key without its
    /// certificate, and client CAs without either.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let missing = |setting, problem: &str| {
            Err(ConfigError {
                setting,
                problem: problem.into(),
            })
        };
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => missing(
                "tls_key",
                "needed, since {tls_cert} is set: TLS needs the certificate and its key \
                 (set both, or neither for plain HTTP)",
            ),
            (None, Some(_)) => missing(
                "tls_cert",
                "needed, since {tls_key} is set: TLS needs the certificate and its key \
                 (set both, or neither for plain HTTP)",
            ),
            (None, None) if self.tls_client_ca.is_some() => missing(
                "tls_client_ca",
                "is set without {tls_cert} and {tls_key}: client certificates are asked for \
                 on TLS listeners only",
            ),
            _ => Ok(()),
        }
    }

    /// The URL scheme of the listeners.
    pub fn scheme(&self) -> &'static str {
        if self.tls_cert.is_some() {
            "https"
        } else {
            "http"
        }
    }
}

// === impl SealArgs ===

impl SealArgs {
    /// The sealer the seal settings describe, if `IDEMGATE_SEAL_KEY` is set;
    /// an error naming the setting (never its value) if a key is unusable.
    pub fn sealer(&self) -> Result<Option<Sealer>, ConfigError> {
        let previous = self
            .seal_key_previous
            .as_ref()
            .map(|p| p.expose_secret())
            .filter(|p| !p.trim().is_empty());
        let Some(current) = self
            .seal_key
            .as_ref()
            .map(|k| k.expose_secret())
            .filter(|k| !k.trim().is_empty())
        else {
            if previous.is_some() {
                return Err(ConfigError {
                    setting: "seal_key_previous",
                    problem: "holds retired keys but no current one: set {seal_key} too".into(),
                });
            }
            return Ok(None);
        };
        Sealer::from_settings(current, previous)
            .map(|sealer| Some(sealer.accepting_plaintext(self.seal_accept_plaintext)))
            .map_err(|e| ConfigError {
                setting: e.setting,
                problem: e.problem,
            })
    }
}
