//! Typed settings: every one a flag or an `IDEMGATE_*` environment variable
//! (flag first), parsed and validated once at start-up so a bad value fails
//! fast with the setting's name.
//!
//! Each settings struct carries `#[command(mut_args = boolean_style)]`, so
//! that a `bool` field is a setting of the one boolean form without
//! attributes of its own, and names its duration, size and count settings'
//! units by value name (`SECONDS`, `BYTES`, `N`): that is what a refused
//! value's message says is expected (see [`source::FORMS`]).

mod admin;
pub mod command;
pub mod file;
pub mod keys;
mod policy;
mod proxy;
mod run;
mod serve;
pub mod source;
mod store;
mod tokens;

pub use admin::{AdminAccess, AdminArgs, AdminMode, AllowedHost, LOOPBACK_OPERATOR};
pub use policy::PolicyArgs;
pub use proxy::{Header, ProxyArgs};
pub use run::{RunArgs, SealArgs, TlsArgs};
pub use serve::{Checked, ServeArgs};
pub use source::{Origin, Sources};
pub use store::{PgPooler, StoreArgs};

use std::time::Duration;

use clap::ArgAction;

/// The headings of `--help` (clap's `help_heading`): the settings most
/// starts need (listeners, the database URL, tokens) come first, under
/// clap's own "Options", then one group after another.
pub mod heading {
    /// Keys, fingerprints, leases, TTLs and waits: the published policy.
    pub const KEYS: &str = "Keys and leases";
    /// What one tenant, one body or the replay cache may take.
    pub const LIMITS: &str = "Tenants and limits";
    /// The responses the proxy stores for replay.
    pub const STORED: &str = "Stored responses";
    /// The database pool, migrations and pruning.
    pub const DATABASE: &str = "Database";
    /// How long connections and shutdown may take.
    pub const CONNECTIONS: &str = "Connections";
    /// Traces.
    pub const OBSERVABILITY: &str = "Observability";
    /// Stored responses sealed at rest.
    pub const SEALING: &str = "Sealing at rest";
    /// TLS on idemgate's own listeners.
    pub const TLS: &str = "TLS";
    /// The proxy's origin.
    pub const UPSTREAM: &str = "Upstream";
    /// The MCP door.
    pub const MCP: &str = "MCP";
}

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

/// Whole seconds as a [`Duration`]: the parser of every duration setting
/// (value name `SECONDS`), so that the settings hold the type they are used
/// as, parsed once.
pub fn seconds(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|e| e.to_string())
}

/// As [`seconds`], at least one.
pub fn positive_seconds(s: &str) -> Result<Duration, String> {
    let d = seconds(s)?;
    if d.is_zero() {
        return Err("must be at least 1 second".into());
    }
    Ok(d)
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
