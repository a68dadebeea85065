//! Typed settings: every one a flag or an `IDEMGATE_*` environment variable
//! (flag first), parsed and validated once at start-up so a bad value fails
//! fast with the setting's name.
//!
//! Each settings struct carries `#[command(mut_args = boolean_style)]`, so
//! that a `bool` field is a setting of the one boolean form without
//! attributes of its own, and names its duration, size and count settings'
//! units by value name (`SECONDS`, `BYTES`, `N`): that is what a refused
//! value's message says is expected (see [`source::FORMS`]).

pub mod command;
pub mod file;
mod proxy;
pub mod source;

pub use proxy::{Header, ProxyArgs};
pub use source::{Origin, Sources};

use std::net::SocketAddr;
use std::time::Duration;

use clap::{ArgAction, Args};
use secrecy::{ExposeSecret, SecretString};

use crate::engine::{DEFAULT_REPLAY_CACHE_BYTES, Limits, TenantLimits};
use crate::fingerprint::{FingerprintPolicy, JsonPointer};
use crate::key::{KeyFormat, KeyPolicy};
use crate::seal::Sealer;
use crate::server::auth::Tokens;

/// Gives a boolean setting its one form: `--strict-key` alone turns it on,
/// `--strict-key true|false` or `--strict-key=true|false` says which, and so
/// do `IDEMGATE_STRICT_KEY=true|false` and `strict_key = true|false` in the
/// file. One form for every boolean, whether it defaults to on or off, lets
/// the variable and the file spell the value as the flag does, and a
/// script can pass a value through without branching on it.
///
/// For `#[command(mut_args = boolean_style)]` on a settings struct: any
/// other argument is returned as it is, and applying it twice changes
/// nothing.
pub fn boolean_style(arg: clap::Arg) -> clap::Arg {
    let flag = matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse);
    let boolean = arg.get_value_parser().type_id() == std::any::TypeId::of::<bool>();
    let settable = flag || matches!(arg.get_action(), ArgAction::Set);
    if !(flag || boolean) || !settable || arg.get_long().is_none() {
        return arg;
    }
    // A `--no-…` flag of clap's SetFalse kind stores false when given.
    let (given, unset) = match arg.get_action() {
        ArgAction::SetFalse => ("false", "true"),
        _ => ("true", "false"),
    };
    let arg = if arg.get_default_values().is_empty() {
        arg.default_value(unset)
    } else {
        arg
    };
    arg.action(ArgAction::Set)
        .value_parser(clap::value_parser!(bool))
        .num_args(0..=1)
        .default_missing_value(given)
        .value_name("true|false")
}

/// Where the records live.
#[derive(Debug, Clone, Args)]
#[command(mut_args = boolean_style)]
pub struct StoreArgs {
    /// Database URL: postgres://… (any number of idemgate processes) or
    /// sqlite://… (one process per file).
    #[arg(
        long,
        env = "DATABASE_URL",
        value_name = "URL",
        default_value = "sqlite://idemgate.db",
        hide_env_values = true
    )]
    pub database_url: String,

    /// Most database connections this process opens.
    #[arg(
        long,
        env = "IDEMGATE_DB_MAX_CONNECTIONS",
        value_name = "N",
        default_value_t = 16
    )]
    pub db_max_connections: u32,

    /// Seconds a request waits for a database connection before it answers
    /// 503 store-unavailable.
    #[arg(
        long,
        env = "IDEMGATE_DB_ACQUIRE_TIMEOUT",
        value_name = "SECONDS",
        default_value_t = 3
    )]
    pub db_acquire_timeout: u64,

    /// Seconds one statement may run before the database cancels it (and the
    /// request answers 503 store-unavailable).
    #[arg(
        long,
        env = "IDEMGATE_DB_STATEMENT_TIMEOUT",
        value_name = "SECONDS",
        default_value_t = 5
    )]
    pub db_statement_timeout: u64,
}

/// What a long-running command (`serve`, `proxy`) does beside its requests,
/// and the memory it keeps for them.
#[derive(Debug, Clone, Args)]
#[command(mut_args = boolean_style)]
pub struct RunArgs {
    /// Do not apply pending migrations at start (`idemgate migrate` does).
    #[arg(long, env = "IDEMGATE_NO_MIGRATE")]
    pub no_migrate: bool,

    /// Seconds between pruning passes (0 turns the job off).
    #[arg(
        long,
        env = "IDEMGATE_PRUNE_INTERVAL",
        value_name = "SECONDS",
        default_value_t = 60
    )]
    pub prune_interval: u64,

    /// Seconds in-flight requests get to finish after SIGTERM or ctrl-c.
    #[arg(
        long,
        env = "IDEMGATE_SHUTDOWN_GRACE",
        value_name = "SECONDS",
        default_value_t = 30
    )]
    pub shutdown_grace: u64,

    /// Seconds a client has to send a request's headers before its
    /// connection is closed, and at most between two pieces of its body
    /// before it gets 408 (slow clients cannot hold connections open).
    #[arg(long, env = "IDEMGATE_HEADER_READ_TIMEOUT", value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub header_read_timeout: u64,

    /// Seconds an idle keep-alive connection, its last response sent, waits
    /// for the next request before it is closed. The default is longer than
    /// any Retry-After sent under the default leases (30 s for serve, 35 s
    /// for the proxy), so a client that waits as told still finds its pooled
    /// connection open.
    #[arg(long, env = "IDEMGATE_KEEP_ALIVE_TIMEOUT", value_name = "SECONDS", default_value_t = 75,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub keep_alive_timeout: u64,

    /// Bytes of memory for completed responses, replayed from there without
    /// a database round trip until they expire (0 turns the cache off).
    #[arg(long, env = "IDEMGATE_REPLAY_CACHE_BYTES", value_name = "BYTES",
          default_value_t = DEFAULT_REPLAY_CACHE_BYTES)]
    pub replay_cache_bytes: u64,

    /// Most keys one tenant may hold in flight at once; a new key beyond it
    /// is answered 429 tenant-limit with Retry-After (0: no limit).
    #[arg(
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
        long,
        env = "IDEMGATE_TENANT_MAX_STORED_BYTES",
        value_name = "BYTES",
        default_value_t = 0
    )]
    pub tenant_max_stored_bytes: u64,

    /// Seals stored responses at rest (AES-256-GCM): 32 random bytes,
    /// base64 (`openssl rand -base64 32`). New responses are sealed under it.
    #[arg(long, env = "IDEMGATE_SEAL_KEY", hide_env_values = true)]
    pub seal_key: Option<SecretString>,

    /// Retired seal keys, comma-separated base64: responses sealed under them
    /// still open, none is sealed under them any more.
    #[arg(long, env = "IDEMGATE_SEAL_KEY_PREVIOUS", hide_env_values = true)]
    pub seal_key_previous: Option<SecretString>,
}

// === impl RunArgs ===

impl RunArgs {
    /// How long in-flight requests get after a shutdown signal.
    pub fn grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace)
    }

    /// How the listeners treat their connections.
    pub fn serving(&self) -> crate::server::serve::Serving {
        crate::server::serve::Serving {
            grace: self.grace(),
            header_read_timeout: Duration::from_secs(self.header_read_timeout),
            keep_alive_timeout: Duration::from_secs(self.keep_alive_timeout),
        }
    }

    /// The per-tenant limits, 0 read as none.
    pub fn tenant_limits(&self) -> TenantLimits {
        TenantLimits {
            max_in_flight: (self.tenant_max_in_flight > 0).then_some(self.tenant_max_in_flight),
            max_stored_bytes: (self.tenant_max_stored_bytes > 0)
                .then_some(self.tenant_max_stored_bytes),
        }
    }

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
            .map(Some)
            .map_err(|e| ConfigError {
                setting: e.setting,
                problem: e.problem,
            })
    }
}

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
          value_parser = TokensParser)]
    pub tokens: Option<Tokens>,

    #[command(flatten)]
    pub run: RunArgs,

    #[command(flatten)]
    pub store: StoreArgs,

    #[command(flatten)]
    pub policy: PolicyArgs,
}

/// `--tokens`' parser. Its errors never repeat the value: it holds secrets
/// (clap's own message for a refused value quotes the value whole).
#[derive(Debug, Clone, Copy)]
struct TokensParser;

impl clap::builder::TypedValueParser for TokensParser {
    type Value = Tokens;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Tokens, clap::Error> {
        use clap::error::{ContextKind, ContextValue, ErrorKind};
        let problem = match value.to_str() {
            Some(text) => match parse_tokens(text) {
                Ok(tokens) => return Ok(tokens),
                Err(problem) => problem,
            },
            None => "it is not valid UTF-8".to_owned(),
        };
        let name = arg.map_or_else(|| "--tokens".to_owned(), ToString::to_string);
        let mut err = clap::Error::raw(
            ErrorKind::ValueValidation,
            format!(
                "invalid value for '{name}' (IDEMGATE_TOKENS; the value is not shown, it holds \
                 secrets): {problem}\n"
            ),
        );
        // The setting and the problem, without the value: what the command
        // line's refusal names (its source: a flag, the variable, the file).
        err.insert(ContextKind::InvalidArg, ContextValue::String(name));
        err.insert(ContextKind::Custom, ContextValue::String(problem));
        Err(err.with_cmd(cmd))
    }
}

/// `tenant:token,…`. A tenant may hold several tokens (rotation), but a token
/// belongs to one tenant only; a pair listed twice counts once. No message
/// holds a token.
fn parse_tokens(s: &str) -> Result<Tokens, String> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((tenant, token)) = item.split_once(':') else {
            return Err("each entry must be tenant:token (e.g. acme:s3cret)".into());
        };
        let tenant = tenant.trim();
        if tenant.is_empty() || token.is_empty() {
            return Err("a tenant and its token must both be non-empty".into());
        }
        if !tenant
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(format!(
                "tenant {tenant:?} may hold only letters, digits, '-', '_' and '.'"
            ));
        }
        match pairs.iter().find(|(_, t)| t == token) {
            Some((owner, _)) if owner == tenant => continue,
            Some((owner, _)) => {
                return Err(format!(
                    "a token is given to two tenants, {owner:?} and {tenant:?}: requests bearing \
                     it could only ever reach one of them; give each tenant its own tokens"
                ));
            }
            None => pairs.push((tenant.to_owned(), token.to_owned())),
        }
    }
    Ok(Tokens::new(pairs))
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

/// A setting that cannot be used.
///
/// The command line's printer names the setting as the operator set it — the
/// flag, the variable with its value, or the `--config` file and its key —
/// from the [`Sources`] of the parse; without those (settings built in
/// code), `Display` names its flag and variable both.
#[derive(Debug)]
pub struct ConfigError {
    /// The setting at fault: its id, the flag's name with `_`
    /// (`default_ttl`). A `--flag` or a variable's name is understood too.
    pub setting: &'static str,
    /// What is wrong and how to fix it, to follow the setting's name. A
    /// `{id}` in it names another setting the same way (`exceeds {max_ttl}`).
    pub problem: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&Sources::default().render(self))
    }
}

impl std::error::Error for ConfigError {}

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
        }
    }

    /// The fingerprint rules.
    pub fn fingerprint_policy(&self) -> FingerprintPolicy {
        FingerprintPolicy {
            ignore: self.fingerprint_ignore.clone(),
        }
    }
}

// === impl ServeArgs ===

impl ServeArgs {
    /// Refuses settings the server must not start with; protected mode first.
    pub fn validate(&self) -> Result<(), ConfigError> {
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
        self.run.sealer()?;
        self.policy.validate()
    }
}

/// How log lines are written (`--log-format`, `IDEMGATE_LOG_FORMAT`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Text for people; coloured only when it goes to a terminal.
    #[default]
    Human,
    /// One JSON object per line.
    Json,
}

/// `human` (also `text`, `pretty`, or empty) or `json`.
pub fn parse_log_format(s: &str) -> Result<LogFormat, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "" | "human" | "text" | "pretty" => Ok(LogFormat::Human),
        "json" => Ok(LogFormat::Json),
        _ => Err("expected `human` or `json`".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_belongs_to_one_tenant() {
        let err = parse_tokens("acme:t0p-s3cret,globex:t0p-s3cret").unwrap_err();
        assert!(err.contains("two tenants"), "{err}");
        assert!(err.contains("acme") && err.contains("globex"), "{err}");
        assert!(!err.contains("t0p-s3cret"), "{err}");
    }

    #[test]
    fn a_tenant_may_hold_several_tokens_and_a_pair_may_repeat() {
        let tokens = parse_tokens("acme:old,acme:new, globex:g ,globex:g").unwrap();
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

    #[test]
    fn log_formats() {
        for (text, want) in [
            ("", LogFormat::Human),
            ("human", LogFormat::Human),
            ("text", LogFormat::Human),
            ("pretty", LogFormat::Human),
            ("JSON", LogFormat::Json),
            ("json", LogFormat::Json),
        ] {
            assert_eq!(parse_log_format(text), Ok(want), "{text:?}");
        }
        assert!(parse_log_format("xml").is_err());
    }
}
