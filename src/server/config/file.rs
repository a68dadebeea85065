//! The optional TOML file named by `--config`: the lowest of the three sources
//! (flag > `IDEMGATE_*` environment > file).
//!
//! Each scalar key is a setting named as its flag with `_` for `-`
//! (`key_max_len = 64` is `--key-max-len 64`); a `[serve]` or `[proxy]` table
//! holds settings for that command only. Global flags (`log_format`) are keys
//! too, read by every command. The file's values are handed to clap
//! as the flags they stand for, but only for settings that neither a flag nor
//! the environment gave — clap reports where each value came from — so one
//! parser validates all three sources, and a bad value in the file fails with
//! the same checks as the flag would; [`Merged`] says which settings the
//! file gave, so that a refusal names the file and its key.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;

use super::ConfigError;

/// Top-level keys that are not command-line settings: tables read by the
/// command that owns them (the proxy's per-route rules).
const STRUCTURED_KEYS: &[&str] = &["routes"];

/// The command line with the `--config` file's settings appended.
#[derive(Debug, Clone, Default)]
pub struct Merged {
    /// The arguments to parse: the command line's, then the file's as flags.
    pub argv: Vec<OsString>,
    /// The file, if one was named.
    pub path: Option<PathBuf>,
    /// The settings taken from the file, in the order appended.
    pub settings: Vec<FileSetting>,
}

/// One setting the file gave.
#[derive(Debug, Clone)]
pub struct FileSetting {
    /// The setting's id (`max_lease`).
    pub id: String,
    /// The key as written in the file: `max_lease`, or `serve.max_lease` in
    /// the `[serve]` table.
    pub key: String,
    /// Its value there.
    pub value: toml::Value,
}

/// Returns `argv` with the settings of the `--config` file appended, or
/// `argv` unchanged when no file is named or the arguments do not parse (clap
/// then reports that itself). A refusal of the file itself (unreadable, not
/// TOML, an unknown key) is a [`ConfigError`] of the `config` setting.
pub fn merge(cmd: clap::Command, argv: Vec<OsString>) -> Result<Merged, ConfigError> {
    let unchanged = |argv| Merged {
        argv,
        ..Merged::default()
    };
    let Ok(matches) = cmd.clone().try_get_matches_from(&argv) else {
        return Ok(unchanged(argv));
    };
    let Some((name, sub)) = matches.subcommand() else {
        return Ok(unchanged(argv));
    };
    let Some(path) = sub.try_get_one::<PathBuf>("config").ok().flatten() else {
        return Ok(unchanged(argv));
    };
    let table = read(path)?;
    let Some(sub_cmd) = cmd.find_subcommand(name) else {
        return Ok(unchanged(argv));
    };
    let subcommands: Vec<String> = cmd
        .get_subcommands()
        .map(|c| c.get_name().to_owned())
        .collect();
    let known = |key: &str| {
        global_arg(&cmd, key).is_some()
            || cmd
                .get_subcommands()
                .any(|c| c.get_arguments().any(|a| a.get_id() == key))
    };

    // Top-level settings, then the command's own table over them: each as
    // (id, key as written, value).
    let mut settings: Vec<(String, String, toml::Value)> = Vec::new();
    for (key, value) in &table {
        if subcommands.contains(key) {
            continue;
        }
        if STRUCTURED_KEYS.contains(&key.as_str()) {
            continue;
        }
        if !known(key) {
            return Err(unknown(key));
        }
        settings.push((key.clone(), key.clone(), value.clone()));
    }
    for section in &subcommands {
        if let Some(value) = table.get(section) {
            let Some(inner) = value.as_table() else {
                return Err(file_error(format!("[{section}] must be a table")));
            };
            if section != name {
                continue;
            }
            for (key, value) in inner {
                if STRUCTURED_KEYS.contains(&key.as_str()) {
                    continue;
                }
                if !sub_cmd.get_arguments().any(|a| a.get_id() == key.as_str())
                    && global_arg(&cmd, key).is_none()
                {
                    return Err(unknown(&format!("{section}.{key}")));
                }
                settings.retain(|(id, _, _)| id != key);
                settings.push((key.clone(), format!("{section}.{key}"), value.clone()));
            }
        }
    }

    let mut argv = argv;
    // Before a `--`, whose arguments are a command's (`proxy --stdio -- COMMAND`).
    let mut at = argv.iter().position(|a| a == "--").unwrap_or(argv.len());
    let mut from_file = Vec::new();
    for (key, written, value) in settings {
        let Some(arg) = sub_cmd
            .get_arguments()
            .find(|a| a.get_id() == key.as_str())
            .or_else(|| global_arg(&cmd, &key))
        else {
            continue; // a setting of another command
        };
        let given = matches!(
            sub.value_source(&key),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
        if given || key == "config" {
            continue;
        }
        let Some(long) = arg.get_long() else {
            continue;
        };
        // An empty list stands for "none": the flag cannot say that, and
        // every list setting's default is what an empty list means here
        // except `methods`, where an empty list would guard nothing.
        if value.as_array().is_some_and(Vec::is_empty) {
            if key == "methods" {
                return Err(file_error(format!(
                    "key `{written}` = []: list at least one method"
                )));
            }
            continue;
        }
        let text = scalar(&value).ok_or_else(|| {
            file_error(format!(
                "key `{written}`: expected a string, number, boolean or list"
            ))
        })?;
        // Booleans too: they all take `--flag=true|false` (see
        // `config::boolean_style`).
        argv.insert(at, format!("--{long}={text}").into());
        at += 1;
        from_file.push(FileSetting {
            id: key,
            key: written,
            value,
        });
    }
    Ok(Merged {
        argv,
        path: Some(path.clone()),
        settings: from_file,
    })
}

/// The setting `key` of every command (a global flag such as `--log-format`);
/// `config` names the file itself and is no key of it.
fn global_arg<'a>(cmd: &'a clap::Command, key: &str) -> Option<&'a clap::Arg> {
    if key == "config" {
        return None;
    }
    cmd.get_arguments()
        .find(|a| a.is_global_set() && a.get_id() == key)
}

/// The file as a TOML table.
pub fn read(path: &Path) -> Result<toml::Table, ConfigError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| file_error(format!("cannot read it: {e}")))?;
    text.parse::<toml::Table>()
        .map_err(|e| file_error(format!("not valid TOML: {e}")))
}

fn scalar(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        toml::Value::Array(items) => items
            .iter()
            .map(scalar)
            .collect::<Option<Vec<_>>>()
            .map(|v| v.join(",")),
        _ => None,
    }
}

fn unknown(key: &str) -> ConfigError {
    file_error(format!(
        "unknown key `{key}` (keys are the flags' names with `_`, e.g. key_max_len)"
    ))
}

/// A refusal of the file: named as the `config` setting, which shows its
/// path (`--config FILE` or `IDEMGATE_CONFIG=FILE`).
fn file_error(problem: String) -> ConfigError {
    ConfigError {
        setting: "config",
        problem,
    }
}
