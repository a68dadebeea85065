//! How keys, fingerprints and leases are handled: the policy `/v1/policy`
//! publishes, shared by `serve` and `proxy`.

use std::time::Duration;

use clap::Args;

use super::{ConfigError, boolean_style};
use crate::engine::Limits;
use crate::fingerprint::{FingerprintPolicy, JsonPointer};
use crate::key::{KeyFormat, KeyPolicy};

/// How keys, fingerprints and leases are handled: the published policy.
#[derive(Debug, Clone, Args)]
#[command(mut_args = boolean_style)]
pub struct PolicyArgs {
    /// Reject bare (unquoted) keys: only RFC 8941 sf-strings are accepted.
    #[arg(long, env = "IDEMGATE_STRICT_KEY")]
    pub strict_key: bool,

    /// Longest key accepted, in characters after unquoting.
    #[arg(long, env = "IDEMGATE_KEY_MAX_LEN", value_name = "N", default_value_t = 255,
          value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub key_max_len: u16,

    /// Also take keys as OASIS Repeatable Requests 1.0 send them
    /// (`Repeatability-Request-ID` with `Repeatability-First-Sent`, as Azure
    /// SDKs do) and answer those requests with `Repeatability-Result`; a
    /// request first sent longer ago than keys are remembered is refused
    /// with 412, not executed. Off: those headers are ignored.
    #[arg(long, env = "IDEMGATE_REPEATABILITY")]
    pub repeatability: bool,

    /// Key format: `any` or `uuid`.
    #[arg(long, env = "IDEMGATE_KEY_FORMAT", default_value = "any", value_parser = parse_key_format)]
    pub key_format: KeyFormat,

    /// JSON Pointers left out of the fingerprint, comma-separated
    /// (e.g. /sent_at,/metadata/trace_id).
    #[arg(long, env = "IDEMGATE_FINGERPRINT_IGNORE", value_delimiter = ',', value_parser = parse_pointer)]
    pub fingerprint_ignore: Vec<JsonPointer>,

    /// Methods the proxy and the layer guard, comma-separated.
    #[arg(long, env = "IDEMGATE_METHODS", value_delimiter = ',', default_value = "POST,PATCH",
          value_parser = parse_method)]
    pub methods: Vec<http::Method>,

    /// Largest stored response body (and proxied request body), in bytes.
    #[arg(long, env = "IDEMGATE_MAX_BODY_BYTES", value_name = "BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Lease in seconds when a reservation names none.
    #[arg(
        long,
        env = "IDEMGATE_DEFAULT_LEASE",
        value_name = "SECONDS",
        default_value_t = 30
    )]
    pub default_lease: u32,

    /// Longest lease in seconds a reservation may ask for.
    #[arg(
        long,
        env = "IDEMGATE_MAX_LEASE",
        value_name = "SECONDS",
        default_value_t = 3600
    )]
    pub max_lease: u32,

    /// Seconds a key is remembered when a reservation names no TTL.
    #[arg(
        long,
        env = "IDEMGATE_DEFAULT_TTL",
        value_name = "SECONDS",
        default_value_t = 86_400
    )]
    pub default_ttl: u32,

    /// Longest TTL in seconds a reservation may ask for.
    #[arg(long, env = "IDEMGATE_MAX_TTL", value_name = "SECONDS", default_value_t = 7 * 86_400)]
    pub max_ttl: u32,

    /// Longest `Prefer: wait=N` honoured, in seconds.
    #[arg(
        long,
        env = "IDEMGATE_MAX_WAIT",
        value_name = "SECONDS",
        default_value_t = 10
    )]
    pub max_wait: u32,
}

// === impl PolicyArgs ===

impl PolicyArgs {
    /// Checks the values that clap cannot check alone.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("default_lease", self.default_lease),
            ("max_lease", self.max_lease),
            ("default_ttl", self.default_ttl),
            ("max_ttl", self.max_ttl),
        ];
        for (setting, v) in positive {
            if v == 0 {
                return Err(ConfigError {
                    setting,
                    problem: "must be at least 1 second".into(),
                });
            }
        }
        if self.default_lease > self.max_lease {
            return Err(ConfigError {
                setting: "default_lease",
                problem: "exceeds the longest lease a reservation may ask for, {max_lease}: \
                          lower the one or raise the other"
                    .into(),
            });
        }
        if self.default_ttl > self.max_ttl {
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

    /// The engine's bounds.
    pub fn limits(&self) -> Limits {
        let secs = |s: u32| Duration::from_secs(u64::from(s));
        Limits {
            default_lease: secs(self.default_lease),
            max_lease: secs(self.max_lease),
            default_ttl: secs(self.default_ttl),
            max_ttl: secs(self.max_ttl),
            max_wait: secs(self.max_wait),
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
