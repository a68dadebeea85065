//! Where each setting's value came from — a flag, an environment variable,
//! the `--config` file, or its default — so that a refusal names what the
//! operator actually wrote, the way they wrote it.
//!
//! Everything here is read from clap's own description of the settings (long
//! name, variable, value name, value type, whether the value is hidden): a new
//! setting is named right without being listed anywhere. The one table is
//! [`FORMS`], the form each value name stands for.

use std::any::TypeId;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{Arg, ArgMatches, Command};

use super::ConfigError;
use super::file::FileSetting;

/// What a refused value should have been, by the setting's value name (the
/// `SECONDS` of `--default-ttl <SECONDS>`, shown by `--help` too). A setting
/// without one of these names is described by its type (see
/// [`expected_form`]); one with its own parser says what it expects itself.
pub const FORMS: &[(&str, &str)] = &[
    ("SECONDS", "whole seconds (e.g. 30)"),
    ("BYTES", "a whole number of bytes"),
    ("N", "a whole number"),
    ("STATUS", "HTTP status codes (100 to 599), comma-separated"),
    (
        "HOST:PORT",
        "HOST:PORT (an IP address and a port, e.g. 127.0.0.1:8080)",
    ),
    ("true|false", "true or false"),
];

/// The form `arg`'s value takes, for a message about a refused value: by its
/// value name if [`FORMS`] knows it, else by the type it parses to (`bool`,
/// a socket address, an integer); `None` when its parser's own error says it.
pub fn expected_form(arg: &Arg) -> Option<&'static str> {
    let form = |name: &str| FORMS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f);
    if let Some(found) = arg
        .get_value_names()
        .unwrap_or_default()
        .iter()
        .find_map(|n| form(n.as_str()))
    {
        return Some(found);
    }
    let ty = arg.get_value_parser().type_id();
    let is = |id: TypeId| ty == id;
    if is(TypeId::of::<bool>()) {
        form("true|false")
    } else if is(TypeId::of::<SocketAddr>()) {
        form("HOST:PORT")
    } else if [
        TypeId::of::<u8>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
        TypeId::of::<i32>(),
        TypeId::of::<i64>(),
    ]
    .into_iter()
    .any(is)
    {
        form("N")
    } else {
        None
    }
}

/// Where one setting's value came from. As [`Sources`] keeps it, a secret's
/// value is empty and a URL's password masked, so that not even `Debug`
/// shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The command line, with the value given there.
    Flag(String),
    /// The setting's environment variable, with its value.
    Env(String),
    /// The `--config` file: its path, the key as written there
    /// (`serve.max_lease` for a key of the `[serve]` table) and the value as
    /// TOML.
    File {
        /// The file.
        path: PathBuf,
        /// The key, dotted after its table if it is in one.
        key: String,
        /// The value, written as TOML (`"abc"`, `0`, `["a", "b"]`).
        value: String,
    },
    /// Not given: the default, with its value.
    Default(String),
    /// Not given, and without a default.
    Unset,
}

/// One setting as clap describes it: what a message needs to name it.
#[derive(Debug, Clone)]
struct Setting {
    id: String,
    long: Option<String>,
    env: Option<String>,
    /// Its value is never shown (`hide_env_values`: tokens, seal keys, the
    /// database URL).
    secret: bool,
    /// A URL (value name `URL`): shown even if secret, password masked.
    url: bool,
}

impl Setting {
    fn of(arg: &Arg) -> Setting {
        Setting {
            id: arg.get_id().to_string(),
            long: arg.get_long().map(|l| format!("--{l}")),
            env: arg.get_env().map(|e| e.to_string_lossy().into_owned()),
            secret: arg.is_hide_env_values_set(),
            url: arg
                .get_value_names()
                .unwrap_or_default()
                .iter()
                .any(|n| n.as_str() == "URL"),
        }
    }

    /// Whether `name` (an id, `--flag` or variable) is this setting.
    fn is(&self, name: &str) -> bool {
        self.id == name || self.long.as_deref() == Some(name) || self.env.as_deref() == Some(name)
    }

    fn flag(&self) -> &str {
        self.long.as_deref().unwrap_or(&self.id)
    }

    /// Both its names, for a message that knows no origin.
    fn generic(&self) -> String {
        match &self.env {
            Some(env) => format!("{} / {env}", self.flag()),
            None => self.flag().to_owned(),
        }
    }

    /// `origin` with its value as it may be kept: none for a secret, a URL's
    /// password masked.
    fn kept(&self, origin: Origin) -> Origin {
        let keep = |value: String| {
            if self.secret && !self.url {
                String::new()
            } else {
                mask_password(&value)
            }
        };
        match origin {
            Origin::Flag(v) => Origin::Flag(keep(v)),
            Origin::Env(v) => Origin::Env(keep(v)),
            Origin::Default(v) => Origin::Default(keep(v)),
            Origin::File { path, key, value } => Origin::File {
                path,
                key,
                value: keep(value),
            },
            Origin::Unset => Origin::Unset,
        }
    }

    /// `value` as a message may show it: a URL's password masked, anything
    /// with spaces (or nothing) quoted.
    fn shown(&self, value: &str) -> Option<String> {
        if self.secret && !self.url {
            return None;
        }
        let value = mask_password(value);
        Some(if value.is_empty() || value.contains(char::is_whitespace) {
            format!("{value:?}")
        } else {
            value
        })
    }

    /// The setting as the operator set it: `--default-ttl 0`,
    /// `IDEMGATE_DEFAULT_TTL=0`, `FILE: key `default_ttl` = 0`, or its default.
    fn describe(&self, origin: &Origin) -> String {
        const HIDDEN: &str = "(value not shown: a secret)";
        match origin {
            Origin::Flag(value) => match self.shown(value) {
                None => format!("{} {HIDDEN}", self.flag()),
                Some(_) if value.is_empty() => self.flag().to_owned(),
                Some(v) => format!("{} {v}", self.flag()),
            },
            Origin::Env(value) => {
                let env = self.env.as_deref().unwrap_or(&self.id);
                match self.shown(value) {
                    Some(v) => format!("{env}={v}"),
                    None => format!("{env} {HIDDEN}"),
                }
            }
            Origin::File { path, key, value } => {
                let shown = if self.secret && !self.url {
                    HIDDEN.to_owned()
                } else {
                    format!("= {}", mask_password(value))
                };
                format!("{}: key `{key}` {shown}", path.display())
            }
            Origin::Default(value) => match self.shown(value) {
                Some(v) => format!("the default {} {v}", self.flag()),
                None => format!("the default {}", self.flag()),
            },
            Origin::Unset => format!("{} (not set)", self.generic()),
        }
    }
}

/// `text` with the password of a `scheme://user:password@host` URL in it
/// replaced by `***`, and so the value of a `password` or `sslpassword`
/// query parameter (libpq takes both); a lone `scheme://secret@host` is
/// masked whole, since a token is often passed that way.
pub fn mask_password(text: &str) -> String {
    let Some((scheme, rest)) = text.split_once("://") else {
        return text.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let masked = match rest[..authority_end].rfind('@') {
        None => text.to_owned(),
        Some(at) => match rest[..at].split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***{}", &rest[at..]),
            None => format!("{scheme}://***{}", &rest[at..]),
        },
    };
    let Some((base, query)) = masked.split_once('?') else {
        return masked;
    };
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _))
                if name.eq_ignore_ascii_case("password")
                    || name.eq_ignore_ascii_case("sslpassword") =>
            {
                format!("{name}=***")
            }
            _ => pair.to_owned(),
        })
        .collect();
    format!("{base}?{}", query.join("&"))
}

/// Where every setting of the command being run came from, to name each in
/// a refusal as it was set. Empty (the default) for settings built without
/// a command line: then a refusal names both a setting's flag and variable.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    settings: Vec<(Setting, Origin)>,
}

impl Sources {
    /// The origins of `cmd`'s settings (a subcommand, built so that it holds
    /// the global flags too) as `matches` saw them; `file` lists those that
    /// the `--config` file at `path` gave (clap saw them as flags).
    pub fn of(
        cmd: &Command,
        matches: &ArgMatches,
        path: Option<&Path>,
        file: &[FileSetting],
    ) -> Sources {
        let settings = settings_of(cmd)
            .map(|arg| {
                let id = arg.get_id().as_str();
                let raw = || {
                    matches
                        .try_get_raw(id)
                        .ok()
                        .flatten()
                        .map(|values| {
                            values
                                .map(|v| v.to_string_lossy().into_owned())
                                .collect::<Vec<_>>()
                                .join(",")
                        })
                        .unwrap_or_default()
                };
                let origin = match matches.value_source(id) {
                    Some(ValueSource::CommandLine) => match file.iter().find(|f| f.id == id) {
                        Some(f) => Origin::File {
                            path: path.map(Path::to_path_buf).unwrap_or_default(),
                            key: f.key.clone(),
                            value: f.value.to_string(),
                        },
                        None => Origin::Flag(raw()),
                    },
                    Some(ValueSource::EnvVariable) => Origin::Env(
                        arg.get_env()
                            .and_then(std::env::var_os)
                            .map(|v| v.to_string_lossy().into_owned())
                            .unwrap_or_else(raw),
                    ),
                    Some(ValueSource::DefaultValue) => Origin::Default(raw()),
                    _ => Origin::Unset,
                };
                let setting = Setting::of(arg);
                let origin = setting.kept(origin);
                (setting, origin)
            })
            .collect();
        Sources { settings }
    }

    /// Where `setting` (an id, a `--flag` or a variable) came from, if it
    /// is a setting of the command that was run.
    pub fn origin(&self, setting: &str) -> Option<&Origin> {
        self.find(setting).map(|(_, origin)| origin)
    }

    /// `setting` named as the operator set it (`--default-ttl 0`,
    /// `IDEMGATE_DEFAULT_TTL=0`, the file and its key), or by its flag and
    /// variable if this command line did not parse it. `setting` is an id,
    /// a `--flag` or a variable; `--flag / VARIABLE` is understood too.
    pub fn name(&self, setting: &str) -> String {
        if let Some((s, origin)) = self.find(setting) {
            return s.describe(origin);
        }
        match known(setting) {
            Some(s) => s.generic(),
            None => setting.to_owned(),
        }
    }

    /// `origin` of the setting `arg` named as [`Sources::name`] would.
    pub fn describe(arg: &Arg, origin: &Origin) -> String {
        let setting = Setting::of(arg);
        setting.describe(&setting.kept(origin.clone()))
    }

    /// The line for a refused setting: the setting as it was set, then the
    /// problem, in which `{id}` names another setting the same way.
    pub fn render(&self, e: &ConfigError) -> String {
        format!("{}: {}", self.name(e.setting), self.mentions(&e.problem))
    }

    /// `e` and its causes as `{e:#}` writes them, with every refused
    /// setting in the chain named by [`Sources::render`].
    pub fn explain(&self, e: &anyhow::Error) -> String {
        let mut links: Vec<String> = Vec::new();
        for cause in e.chain() {
            links.push(match cause.downcast_ref::<ConfigError>() {
                Some(refused) => self.render(refused),
                None => cause.to_string(),
            });
            // A store error's message already names its cause in words; the
            // sqlx or io error under it would say the same again.
            if cause.is::<crate::store::StoreError>() {
                break;
            }
        }
        // Given as `.context(ConfigError { .. })`, the refusal is inside
        // anyhow's wrapper, which only anyhow's own downcast sees through.
        if let (Some(refused), Some(first)) = (e.downcast_ref::<ConfigError>(), links.first_mut())
            && *first == refused.to_string()
        {
            *first = self.render(refused);
        }
        links.join(": ")
    }

    /// `text` with each `{id}` of a known setting replaced by its name.
    fn mentions(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let after = &rest[open + 1..];
            let id = after.find('}').map(|close| &after[..close]).filter(|id| {
                !id.is_empty() && id.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            });
            match id {
                Some(id) if self.find(id).is_some() || known(id).is_some() => {
                    // One that is not set is named by both names: the text
                    // around it says what is missing.
                    let name = match self.find(id) {
                        Some((s, Origin::Unset)) => s.generic(),
                        _ => self.name(id),
                    };
                    out.push_str(&name);
                    rest = &after[id.len() + 1..];
                }
                _ => {
                    out.push('{');
                    rest = after;
                }
            }
        }
        out.push_str(rest);
        out
    }

    fn find(&self, setting: &str) -> Option<&(Setting, Origin)> {
        names(setting).find_map(|name| self.settings.iter().find(|(s, _)| s.is(name)))
    }
}

/// The words of `setting` that may name one (`--upstream / IDEMGATE_UPSTREAM`
/// holds two).
fn names(setting: &str) -> impl Iterator<Item = &str> {
    setting.split([' ', '/']).filter(|w| !w.is_empty())
}

/// The settings of `cmd`, without `--help` and `--version`.
pub fn settings_of(cmd: &Command) -> impl Iterator<Item = &Arg> {
    cmd.get_arguments().filter(|a| {
        !matches!(
            a.get_action(),
            clap::ArgAction::Help
                | clap::ArgAction::HelpShort
                | clap::ArgAction::HelpLong
                | clap::ArgAction::Version
        )
    })
}

/// `setting` as some command of idemgate's defines it.
fn known(setting: &str) -> Option<Setting> {
    let cmd = super::command::built();
    names(setting).find_map(|name| {
        std::iter::once(&cmd)
            .chain(cmd.get_subcommands())
            .flat_map(settings_of)
            .map(Setting::of)
            .find(|s| s.is(name))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked() {
        for (text, want) in [
            (
                "postgres://app:hunter2@db:5432/idem",
                "postgres://app:***@db:5432/idem",
            ),
            ("http://t0ken@origin/", "http://***@origin/"),
            ("http://u:p@h/a@b", "http://u:***@h/a@b"),
            ("sqlite://idemgate.db", "sqlite://idemgate.db"),
            (
                "postgres://app@db/idem?sslmode=require&password=hunter2&PassWord=x",
                "postgres://***@db/idem?sslmode=require&password=***&PassWord=***",
            ),
            (
                "postgres://app:p@db/idem?sslpassword=k",
                "postgres://app:***@db/idem?sslpassword=***",
            ),
            ("30", "30"),
        ] {
            assert_eq!(mask_password(text), want, "{text}");
        }
    }

    #[test]
    fn mentions_name_known_settings_only() {
        let sources = Sources::default();
        assert_eq!(
            sources.mentions("over {max_ttl}, not {nothing} or {\"a\":1}"),
            "over --max-ttl / IDEMGATE_MAX_TTL, not {nothing} or {\"a\":1}"
        );
    }

    #[test]
    fn a_setting_is_found_by_id_flag_or_variable() {
        let sources = Sources::default();
        for name in ["default_ttl", "--default-ttl", "IDEMGATE_DEFAULT_TTL"] {
            assert_eq!(sources.name(name), "--default-ttl / IDEMGATE_DEFAULT_TTL");
        }
        assert_eq!(
            sources.name("--upstream / IDEMGATE_UPSTREAM"),
            "--upstream / IDEMGATE_UPSTREAM"
        );
        assert_eq!(sources.name("nothing"), "nothing");
    }
}
