//! The command line: subcommands, the parse that merges flags, the
//! environment and the `--config` file, and that parse's refusals, each
//! naming the setting as the operator set it (the flag, the variable with its
//! value, or the file and its key) and the form its value takes.

use std::ffi::OsString;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Arg, ArgMatches, CommandFactory, FromArgMatches};

use crate::server::config;
use crate::server::config::command::built;
pub use crate::server::config::command::{Cli, Command};
use crate::server::config::file::Merged;
use crate::server::config::source::{self, Origin, Sources};

/// What every error line of the binary starts with, clap's refusals
/// included (not `--help` and `--version`, which are no errors).
pub const ERROR_PREFIX: &str = "idemgate: error: ";

/// Why the command line could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// `--help` or `--version`: clap's own output, printed as clap prints it
    /// (`clap::Error::exit`: standard output, exit 0).
    #[error(transparent)]
    Clap(#[from] clap::Error),
    /// A refused command line or setting: the line to print after
    /// [`ERROR_PREFIX`], naming the setting as it was set.
    #[error("{0}")]
    Config(String),
}

impl Cli {
    /// Parses `argv` with the `--config` file's settings below flags and
    /// environment variables, and records where each setting came from.
    ///
    /// # Errors
    /// [`CliError::Clap`] for `--help` and `--version`; [`CliError::Config`]
    /// for a refusal: a value from a flag is named as the flag, one from the
    /// environment as the variable and its value (a secret's value is never
    /// shown), one from the file as the file and its key.
    pub fn try_parse_merged(argv: Vec<OsString>) -> Result<Cli, CliError> {
        parse(argv).map(|(cli, _)| cli)
    }
}

/// [`Cli::try_parse_merged`], with where each setting of the command came
/// from: a refusal after the parse (a `validate()`) names it as it was set.
///
/// # Errors
/// As [`Cli::try_parse_merged`].
pub fn parse(argv: Vec<OsString>) -> Result<(Cli, Sources), CliError> {
    let plain = Cli::command()
        .try_get_matches_from(&argv)
        .map_err(|e| refusal(e, &argv, None))?;
    let merged = config::file::merge(Cli::command(), argv.clone())
        .map_err(|e| CliError::Config(sources_of(&plain, None).render(&e)))?;
    // Without the file the arguments parse: a refusal now is the file's.
    let matches = Cli::command()
        .try_get_matches_from(&merged.argv)
        .map_err(|e| refusal(e, &argv, Some(&merged)))?;
    let cli = Cli::from_arg_matches(&matches).map_err(|e| refusal(e, &argv, Some(&merged)))?;
    Ok((cli, sources_of(&matches, Some(&merged))))
}

/// Where the settings of the subcommand `matches` ran came from: the
/// innermost one (`keys list`'s, not `keys`'s), which holds the settings.
fn sources_of(matches: &ArgMatches, merged: Option<&Merged>) -> Sources {
    let cmd = built();
    let (mut at_cmd, mut at) = (&cmd, matches);
    while let Some((name, sub)) = at.subcommand() {
        let Some(sub_cmd) = at_cmd.find_subcommand(name) else {
            return Sources::default();
        };
        (at_cmd, at) = (sub_cmd, sub);
    }
    if std::ptr::eq(at_cmd, &cmd) {
        return Sources::default();
    }
    Sources::of(
        at_cmd,
        at,
        merged.and_then(|m| m.path.as_deref()),
        merged.map_or(&[], |m| &m.settings),
    )
}

/// clap's refusal of `argv` (with the `merged` file's settings, if that is
/// what was parsed) as a [`CliError`].
fn refusal(e: clap::Error, argv: &[OsString], merged: Option<&Merged>) -> CliError {
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        return CliError::Clap(e);
    }
    if let Some(message) = value_refusal(&e, argv, merged) {
        return CliError::Config(message);
    }
    // Anything else (an unknown flag, a missing subcommand) is clap's to
    // word, under the one prefix; its text has no colour codes.
    let mut text = e.render().to_string();
    if matches!(
        e.kind(),
        ErrorKind::MissingRequiredArgument | ErrorKind::ArgumentConflict
    ) {
        text = with_plain_usage(&text, argv);
    }
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    CliError::Config(text.trim_end().to_owned())
}

/// clap's refusal `text` of a command line that lacks a required argument
/// (or holds two that exclude each other), its usage line replaced by the
/// command's own (as `--help` shows it).
/// clap's lists every argument present, and a setting given by its
/// variable is present: with `DATABASE_URL` set, `keys resolve` without
/// `--reason` would show `--database-url <URL>` as if it were what is
/// missing.
fn with_plain_usage(text: &str, argv: &[OsString]) -> String {
    let cmd = built();
    let mut run = &cmd;
    for arg in argv.iter().skip(1) {
        if let Some(sub) = arg.to_str().and_then(|a| run.find_subcommand(a)) {
            run = sub;
        }
    }
    let usage = run.clone().render_usage().to_string();
    let Some(usage) = usage.lines().find(|l| l.starts_with("Usage: ")) else {
        return text.to_owned();
    };
    text.lines()
        .map(|line| {
            if line.starts_with("Usage: ") {
                usage
            } else {
                line
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A refused value, as `SOURCE: expected FORM; WHY`, naming where it came
/// from; `None` if `e` is not about a setting's value.
fn value_refusal(e: &clap::Error, argv: &[OsString], merged: Option<&Merged>) -> Option<String> {
    if !matches!(
        e.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation | ErrorKind::InvalidUtf8
    ) {
        return None;
    }
    let cmd = built();
    let arg = refused_arg(e, &cmd, argv)?;
    let id = arg.get_id().as_str();
    let value = match e.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(v)) => v.clone(),
        _ => String::new(),
    };
    let from_file = merged.and_then(|m| {
        let setting = m.settings.iter().find(|f| f.id == id)?;
        Some(Origin::File {
            path: m.path.clone().unwrap_or_default(),
            key: setting.key.clone(),
            value: setting.value.to_string(),
        })
    });
    let origin = match from_file {
        Some(origin) => origin,
        None if on_command_line(e, argv, id) => Origin::Flag(value),
        None => Origin::Env(
            arg.get_env()
                .and_then(std::env::var_os)
                .map_or(value, |v| v.to_string_lossy().into_owned()),
        ),
    };
    Some(format!(
        "{}: {}",
        Sources::describe(arg, &origin),
        expectation(e, arg)
    ))
}

/// The setting `e` refuses a value of, from the command that `argv` runs.
fn refused_arg<'a>(e: &clap::Error, cmd: &'a clap::Command, argv: &[OsString]) -> Option<&'a Arg> {
    let long = refused_long(e)?;
    let run = argv
        .iter()
        .skip(1)
        .find_map(|a| cmd.find_subcommand(a.to_str()?));
    run.into_iter()
        .chain(std::iter::once(cmd))
        .chain(cmd.get_subcommands())
        .flat_map(source::settings_of)
        .find(|a| a.get_long() == Some(long.as_str()))
}

/// The long name of the flag `e` is about: clap names it as
/// `--default-ttl <SECONDS>`.
fn refused_long(e: &clap::Error) -> Option<String> {
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    let flag = arg.split_whitespace().next()?;
    let name = flag.strip_prefix("--")?;
    Some(name.split('=').next().unwrap_or(name).to_owned())
}

/// Whether the value `e` refuses was on the command line rather than in the
/// setting's variable: the same refusal comes back with the variable
/// ignored. (clap tells the two apart only once a parse succeeds.)
fn on_command_line(e: &clap::Error, argv: &[OsString], id: &str) -> bool {
    let strip = |a: Arg| {
        if a.get_id() == id {
            a.env(None::<&str>)
        } else {
            a
        }
    };
    let cmd = Cli::command()
        .mut_args(strip)
        .mut_subcommands(|sub| sub.mut_args(strip));
    match cmd.try_get_matches_from(argv) {
        Ok(_) => false,
        Err(again) => again.kind() == e.kind() && refused_long(&again) == refused_long(e),
    }
}

/// What the refused value of `arg` should have been, and clap's or the
/// parser's reason: `expected whole seconds (e.g. 30); invalid digit found
/// in string`.
fn expectation(e: &clap::Error, arg: &Arg) -> String {
    let reason = std::error::Error::source(e)
        .map(ToString::to_string)
        .or_else(|| match e.get(ContextKind::Custom) {
            Some(ContextValue::String(problem)) => Some(problem.clone()),
            _ => None,
        })
        .or_else(|| match e.get(ContextKind::InvalidValue) {
            Some(ContextValue::String(v)) if !v.is_empty() => None,
            _ => Some("no value given".to_owned()),
        });
    let choices = match e.get(ContextKind::ValidValue) {
        Some(ContextValue::Strings(values)) if !values.is_empty() => {
            Some(format!("one of {}", values.join(", ")))
        }
        _ => None,
    };
    match (
        source::expected_form(arg).map(str::to_owned).or(choices),
        reason,
    ) {
        (Some(form), Some(reason)) => format!("expected {form}; {reason}"),
        (Some(form), None) => format!("expected {form}"),
        (None, Some(reason)) => reason,
        (None, None) => {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or_default();
            first.strip_prefix("error: ").unwrap_or(first).to_owned()
        }
    }
}
