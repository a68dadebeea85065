//! How keys, fingerprints and leases are handled: the policy `/v1/policy`
//! publishes, shared by `serve` and `proxy`.

use std::time::Duration;

use clap::Args;

use super::{ConfigError, boolean_style, heading};
use crate::engine::Limits;
use crate::fingerprint::{FingerprintPolicy, JsonPointer};
use crate::key::{KeyFormat, KeyPolicy};

/// How keys, fingerprints and leases are handled: the published policy.
#[derive(Debug, Clone, Args)]
#[command(mut_args = boolean_style)]
pub struct PolicyArgs {
    /// Reject bare (unquoted) keys: only RFC 8941 sf-strings are accepted.
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_STRICT_KEY")]
    pub strict_key: bool,

    /// Longest key accepted, in characters after unquoting.
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_KEY_MAX_LEN", value_name = "N", default_value_t = 255,
          value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub key_max_len: u16,

    /// Also take keys as OASIS Repeatable Requests 1.0 send them
    /// (`Repeatability-Request-ID` with `Repeatability-First-Sent`, as Azure
    /// SDKs do) and answer those requests with `Repeatability-Result`; a
    /// request first sent longer ago than keys are remembered is refused
    /// with 412, not executed. Off: those headers are ignored.
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_REPEATABILITY")]
    pub repeatability: bool,

    /// Key format: `any` or `uuid`.
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_KEY_FORMAT", default_value = "any", value_parser = parse_key_format)]
    pub key_format: KeyFormat,

    /// JSON Pointers left out of the fingerprint, comma-separated
    /// (e.g. /sent_at,/metadata/trace_id).
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_FINGERPRINT_IGNORE", value_delimiter = ',', value_parser = parse_pointer)]
    pub fingerprint_ignore: Vec<JsonPointer>,

    /// Methods the proxy and the layer guard, comma-separated.
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_METHODS", value_delimiter = ',', default_value = "POST,PATCH",
          value_parser = parse_method)]
    pub methods: Vec<http::Method>,

    /// Largest stored response body (and proxied request body), in bytes.
    #[arg(help_heading = heading::LIMITS, long, env = "IDEMGATE_MAX_BODY_BYTES", value_name = "BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Lease in seconds when a reservation names none [default: 30, or
    /// IDEMGATE_MAX_LEASE if that is shorter].
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_DEFAULT_LEASE", value_name = "SECONDS")]
    pub default_lease: Option<u32>,

    /// Longest lease in seconds a reservation may ask for [default: 3600,
    /// or IDEMGATE_DEFAULT_LEASE if that is longer].
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_MAX_LEASE", value_name = "SECONDS")]
    pub max_lease: Option<u32>,

    /// Seconds a key is remembered when a reservation names no TTL
    /// [default: 86400, or IDEMGATE_MAX_TTL if that is shorter].
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_DEFAULT_TTL", value_name = "SECONDS")]
    pub default_ttl: Option<u32>,

    /// Longest TTL in seconds a reservation may ask for [default: 604800,
    /// or IDEMGATE_DEFAULT_TTL if that is longer].
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_MAX_TTL", value_name = "SECONDS")]
    pub max_ttl: Option<u32>,

    /// Longest `Prefer: wait=N` honoured, in seconds [default: 10, or the
    /// proxy's IDEMGATE_DEFAULT_WAIT if that is longer].
    #[arg(help_heading = heading::KEYS, long, env = "IDEMGATE_MAX_WAIT", value_name = "SECONDS")]
    pub max_wait: Option<u32>,
}

/// The lease of a reservation that names none, unless `IDEMGATE_MAX_LEASE`
/// is shorter.
pub const DEFAULT_LEASE: u32 = 30;

/// The longest lease a reservation may ask for, unless
/// `IDEMGATE_DEFAULT_LEASE` is longer.
pub const MAX_LEASE: u32 = 3600;

/// The TTL of a reservation that names none, unless `IDEMGATE_MAX_TTL` is
/// shorter.
pub const DEFAULT_TTL: u32 = 86_400;

/// The longest TTL a reservation may ask for, unless `IDEMGATE_DEFAULT_TTL`
/// is longer.
pub const MAX_TTL: u32 = 7 * 86_400;

/// The longest `Prefer: wait` honoured, unless the proxy's
/// `IDEMGATE_DEFAULT_WAIT` is longer.
pub const MAX_WAIT: u32 = 10;

// === impl PolicyArgs ===

impl PolicyArgs {
    /// The lease of a reservation that names none: `IDEMGATE_DEFAULT_LEASE`
    /// if set, else [`DEFAULT_LEASE`], or the longest lease if that is
    /// shorter. A default never contradicts a bound the operator chose, nor
    /// a bound's default a default the operator chose: of a default and its
    /// bound, the one not set follows the one set.
    pub fn default_lease(&self) -> u32 {
        self.default_lease
            .unwrap_or_else(|| DEFAULT_LEASE.min(self.max_lease()))
    }

    /// The longest lease a reservation may ask for: `IDEMGATE_MAX_LEASE` if
    /// set, else [`MAX_LEASE`], or `IDEMGATE_DEFAULT_LEASE` if that is
    /// longer.
    pub fn max_lease(&self) -> u32 {
        self.max_lease
            .unwrap_or_else(|| MAX_LEASE.max(self.default_lease.unwrap_or(0)))
    }

    /// The TTL of a reservation that names none: `IDEMGATE_DEFAULT_TTL` if
    /// set, else [`DEFAULT_TTL`], or the longest TTL if that is shorter.
    pub fn default_ttl(&self) -> u32 {
        self.default_ttl
            .unwrap_or_else(|| DEFAULT_TTL.min(self.max_ttl()))
    }

    /// The longest TTL a reservation may ask for: `IDEMGATE_MAX_TTL` if set,
    /// else [`MAX_TTL`], or `IDEMGATE_DEFAULT_TTL` if that is longer.
    pub fn max_ttl(&self) -> u32 {
        self.max_ttl
            .unwrap_or_else(|| MAX_TTL.max(self.default_ttl.unwrap_or(0)))
    }

    /// The longest `Prefer: wait` honoured: `IDEMGATE_MAX_WAIT` if set, else
    /// [`MAX_WAIT`], or `default_wait` (the proxy's `IDEMGATE_DEFAULT_WAIT`,
    /// if set) if that is longer.
    pub fn max_wait(&self, default_wait: Option<Duration>) -> u32 {
        self.max_wait.unwrap_or_else(|| {
            let wait = default_wait.map_or(0, |w| u32::try_from(w.as_secs()).unwrap_or(u32::MAX));
            MAX_WAIT.max(wait)
        })
    }

    /// Checks the values that clap cannot check alone. A setting not set
    /// follows the one it is bounded by (see [`PolicyArgs::default_lease`]);
    /// only two values the operator set can be at odds.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // The bounds first: a default that follows a bound of 0 would be
        // refused in the bound's stead.
        let positive = [
            ("max_lease", self.max_lease()),
            ("max_ttl", self.max_ttl()),
            ("default_lease", self.default_lease()),
            ("default_ttl", self.default_ttl()),
        ];
        for (setting, v) in positive {
            if v == 0 {
                return Err(ConfigError {
                    setting,
                    problem: "must be at least 1 second".into(),
                });
            }
        }
        if self.default_lease() > self.max_lease() {
            return Err(ConfigError {
                setting: "default_lease",
                problem: "exceeds the longest lease a reservation may ask for, {max_lease}: \
                          lower the one or raise the other"
                    .into(),
            });
        }
        if self.default_ttl() > self.max_ttl() {
            return Err(ConfigError {
                setting: "default_ttl",
                problem: "exceeds the longest TTL a reservation may ask for, {max_ttl}: \
                          lower the one or raise the other"
                    .into(),
            });
        }
        if self.max_body_bytes == 0 {
            return Err(ConfigError {
                setting: "max_body_bytes",
                problem: "must be at least 1 byte".into(),
            });
        }
        Ok(())
    }

    /// The engine's bounds, for a door without a default wait (`serve`).
    pub fn limits(&self) -> Limits {
        self.limits_waiting(None)
    }

    /// The engine's bounds, with the door's `IDEMGATE_DEFAULT_WAIT` if the
    /// operator set one (the longest wait follows it when not set itself).
    pub fn limits_waiting(&self, default_wait: Option<Duration>) -> Limits {
        let secs = |s: u32| Duration::from_secs(u64::from(s));
        Limits {
            default_lease: secs(self.default_lease()),
            max_lease: secs(self.max_lease()),
            default_ttl: secs(self.default_ttl()),
            max_ttl: secs(self.max_ttl()),
            max_wait: secs(self.max_wait(default_wait)),
        }
    }

    /// The key rules.
    pub fn key_policy(&self) -> KeyPolicy {
        KeyPolicy {
            strict: self.strict_key,
            max_len: usize::from(self.key_max_len),
            format: self.key_format,
            repeatability: self.repeatability,
        }
    }

    /// The fingerprint rules.
    pub fn fingerprint_policy(&self) -> FingerprintPolicy {
        FingerprintPolicy {
            ignore: self.fingerprint_ignore.clone(),
        }
    }
}

fn parse_key_format(s: &str) -> Result<KeyFormat, String> {
    match s.to_ascii_lowercase().as_str() {
        "any" => Ok(KeyFormat::Any),
        "uuid" => Ok(KeyFormat::Uuid),
        _ => Err("expected `any` or `uuid`".into()),
    }
}

fn parse_pointer(s: &str) -> Result<JsonPointer, String> {
    JsonPointer::parse(s.trim())
}

fn parse_method(s: &str) -> Result<http::Method, String> {
    let m = s.trim().to_ascii_uppercase();
    http::Method::from_bytes(m.as_bytes()).map_err(|_| format!("{s:?} is not an HTTP method"))
}
