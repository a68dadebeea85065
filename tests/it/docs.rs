//! The `docs/` pages: the table of every setting in `docs/configuration.md`
//! is generated from the command line's own definitions (clap), so it cannot
//! drift from the code; and every page is served, offline, under `/docs`.
//!
//! Regenerate the table after changing a setting with
//! `IDEMGATE_UPDATE_DOCS=1 cargo test --test it docs::`.

use std::collections::BTreeMap;
use std::path::Path;

use clap::{Arg, ArgAction, CommandFactory};
use idemgate::server::cli::Cli;

/// Where the generated table sits in `docs/configuration.md`.
const BEGIN: &str = "<!-- BEGIN SETTINGS TABLE: generated from the clap definitions by tests/it/docs.rs; \
                     edit the settings' doc comments, then IDEMGATE_UPDATE_DOCS=1 cargo test --test it docs:: -->\n";
const END: &str = "<!-- END SETTINGS TABLE -->\n";

/// One row: a setting as the commands in `commands` take it.
struct Row {
    flag: String,
    env: String,
    file_key: String,
    default: String,
    help: String,
    commands: Vec<String>,
}

/// `text` as one table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    let one_line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    one_line.replace('|', "\\|")
}

/// `--flag VALUE`, `--flag[=true|false]` for a boolean.
fn flag(arg: &Arg, long: &str) -> String {
    let takes = arg.get_action().takes_values();
    let names = arg.get_value_names().map(|names| {
        names
            .iter()
            .map(|n| n.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    });
    let optional = arg.get_num_args().is_some_and(|n| n.min_values() == 0);
    match (takes, names) {
        (false, _) => format!("--{long}"),
        (true, _)
            if optional && arg.get_value_parser().type_id() == std::any::TypeId::of::<bool>() =>
        {
            format!("--{long}[=true|false]")
        }
        (true, Some(names)) if optional => format!("--{long}[={names}]"),
        (true, Some(names)) => format!("--{long} {names}"),
        (true, None) => format!("--{long} {}", arg.get_id().as_str().to_uppercase()),
    }
}

/// Whether the `--config` file can give the setting `id`: as the file's
/// reader takes them, a global flag or a setting of a top-level command,
/// here only those that have an environment variable too (`--status`,
/// `--output` are a command's options, not settings).
fn in_file(root: &clap::Command, arg: &Arg) -> bool {
    let id = arg.get_id();
    arg.get_env().is_some()
        && id != "config"
        && (arg.is_global_set()
            || root
                .get_subcommands()
                .any(|c| c.get_arguments().any(|a| a.get_id() == id)))
}

/// The rows of `cmd`'s settings (and its subcommands'), as `path` runs it.
fn collect(
    root: &clap::Command,
    cmd: &clap::Command,
    path: &str,
    rows: &mut Vec<Row>,
    headings: &mut BTreeMap<String, String>,
) {
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let id = arg.get_id().as_str();
        if arg.is_hide_set() || ["help", "version"].contains(&id) {
            continue;
        }
        let global = arg.is_global_set();
        if global && !path.is_empty() {
            // Listed once, with the top-level command's.
            continue;
        }
        let commands = if global {
            "every command".to_owned()
        } else {
            path.to_owned()
        };
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let mut help = arg
            .get_long_help()
            .or_else(|| arg.get_help())
            .map(ToString::to_string)
            .unwrap_or_default();
        // A default that depends on another setting is written into the
        // help text as `[default: …]`: the default column shows it.
        let mut written_default = None;
        if let Some(at) = help.rfind("[default: ")
            && help.trim_end().ends_with(']')
        {
            let inner = help[at + "[default: ".len()..].trim_end();
            written_default = Some(inner[..inner.len() - 1].to_owned());
            help.truncate(at);
        }
        let default = if let Some(text) = written_default {
            cell(&text)
        } else if !defaults.is_empty() {
            format!("`{}`", defaults.join(","))
        } else if matches!(arg.get_action(), ArgAction::SetTrue) {
            "`false`".to_owned()
        } else {
            "none".to_owned()
        };
        let mut row = Row {
            flag: format!("`{}`", flag(arg, long)).replace('|', "\\|"),
            env: arg.get_env().map_or_else(
                || "none".to_owned(),
                |e| format!("`{}`", e.to_string_lossy()),
            ),
            file_key: if in_file(root, arg) {
                format!("`{id}`")
            } else {
                "none".to_owned()
            },
            default,
            help: cell(&help),
            commands: vec![commands],
        };
        if let Some(heading) = arg.get_help_heading() {
            headings
                .entry(row.flag.clone())
                .or_insert_with(|| heading.to_owned());
        }
        // One row per setting, unless commands describe it differently.
        match rows.iter_mut().find(|r| {
            r.flag == row.flag
                && r.env == row.env
                && r.default == row.default
                && r.help == row.help
                && r.file_key == row.file_key
        }) {
            Some(same) => {
                if !same.commands.contains(&row.commands[0]) && !global {
                    same.commands.push(row.commands.remove(0));
                }
            }
            None => rows.push(row),
        }
    }
    for sub in cmd.get_subcommands() {
        if sub.get_name() == "help" {
            continue;
        }
        let sub_path = if path.is_empty() {
            sub.get_name().to_owned()
        } else {
            format!("{path} {}", sub.get_name())
        };
        collect(root, sub, &sub_path, rows, headings);
    }
}

/// The generated block: one table per help heading, the unheaded first.
pub fn settings_table() -> String {
    let mut cmd = Cli::command();
    cmd.build();
    let mut rows = Vec::new();
    let mut headings = BTreeMap::new();
    collect(&cmd, &cmd, "", &mut rows, &mut headings);
    let mut order: Vec<Option<String>> = Vec::new();
    for row in &rows {
        let heading = headings.get(&row.flag).cloned();
        if !order.contains(&heading) {
            order.push(heading);
        }
    }
    order.sort_by_key(Option::is_some);
    let mut out = String::from(BEGIN);
    for heading in order {
        out.push('\n');
        if let Some(h) = &heading {
            out.push_str(&format!("#### {h}\n\n"));
        }
        out.push_str(
            "| flag | environment variable | file key | default | commands | what it does |\n",
        );
        out.push_str("|---|---|---|---|---|---|\n");
        for row in rows
            .iter()
            .filter(|r| headings.get(&r.flag) == heading.as_ref())
        {
            let commands = row
                .commands
                .iter()
                .map(|c| {
                    if c == "every command" {
                        c.clone()
                    } else {
                        format!("`{c}`")
                    }
                })
                .collect::<Vec<_>>()
                .join(", ");
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                row.flag, row.env, row.file_key, row.default, commands, row.help
            ));
        }
    }
    out.push('\n');
    out.push_str(END);
    out
}

fn configuration_page() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md")
}

#[test]
fn the_settings_table_is_the_code_s() {
    let path = configuration_page();
    let page = std::fs::read_to_string(&path).unwrap();
    let start = page
        .find(BEGIN)
        .expect("docs/configuration.md holds the table's BEGIN line");
    let end = page[start..].find(END).expect("and its END line") + start + END.len();
    let generated = settings_table();
    if std::env::var_os("IDEMGATE_UPDATE_DOCS").is_some() {
        let updated = format!("{}{generated}{}", &page[..start], &page[end..]);
        std::fs::write(&path, updated).unwrap();
        return;
    }
    assert!(
        page[start..end] == generated,
        "docs/configuration.md's table of settings differs from what the clap definitions \
         generate.\nRegenerate it with: IDEMGATE_UPDATE_DOCS=1 cargo test --test it docs::\n\
         and commit the result."
    );
}

#[test]
fn the_table_names_every_setting_with_its_variable() {
    let table = settings_table();
    for needle in [
        "`--database-url URL`",
        "`DATABASE_URL`",
        "`IDEMGATE_LISTEN`",
        "`IDEMGATE_LOG_FORMAT`",
        r"`--no-migrate[=true\|false]`",
        "`keys list`",
    ] {
        assert!(table.contains(needle), "{needle} missing from:\n{table}");
    }
}

/// Every page of `docs/` (but the images), by its file name.
fn page_files() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    let mut pages: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| {
            let slug = p.file_stem().unwrap().to_string_lossy().into_owned();
            (slug, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    pages.sort();
    pages
}

#[tokio::test]
async fn a_running_serve_serves_every_page_offline_beside_the_apis() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(crate::common::bin::BIN);
    cmd.current_dir(dir.path())
        .env_remove("DATABASE_URL")
        .env_remove("IDEMGATE_TOKENS")
        .env_remove("IDEMGATE_CONFIG");
    let served = crate::common::bin::Served::spawn(cmd, &[]).await;
    let http = crate::common::http();
    let index = http
        .get(format!("{}/docs", served.base()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let files = page_files();
    assert!(
        files.len() >= 8,
        "{:?}",
        files.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    for (slug, markdown) in &files {
        let title = markdown
            .lines()
            .find_map(|l| l.strip_prefix("# "))
            .unwrap_or_else(|| panic!("docs/{slug}.md has no # title"));
        assert!(
            index.contains(&format!("<a href=\"/docs/{slug}\">")),
            "/docs does not link {slug}:\n{index}"
        );
        let res = http
            .get(format!("{}/docs/{slug}", served.base()))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "/docs/{slug}");
        let content_type = res.headers()["content-type"].to_str().unwrap().to_owned();
        assert!(
            content_type.starts_with("text/html"),
            "{slug}: {content_type}"
        );
        let html = res.text().await.unwrap();
        assert!(
            html.contains(&format!("<title>{title} · idemgate</title>")),
            "{slug}: {}",
            &html[..html.len().min(400)]
        );
        assert!(html.contains("<h1 id="), "{slug}");
        // Nothing it shows comes from elsewhere: no script, style sheet,
        // font or image of another host.
        for asset in ["<script", "<link", "<img", "@import", "url("] {
            assert!(!html.contains(asset), "{slug} holds {asset}");
        }
        // Links between pages stay on the server, and lead to a page.
        for link in html.split("href=\"/docs/").skip(1) {
            let target = &link[..link.find(['"', '#']).unwrap()];
            assert!(
                files.iter().any(|(s, _)| s == target),
                "{slug} links /docs/{target}, which is no page"
            );
        }
        // A relative link to a Markdown file would lead nowhere here.
        for href in html.split("href=\"").skip(1) {
            let href = &href[..href.find('"').unwrap()];
            assert!(
                href.starts_with("http") || !href.split('#').next().unwrap().ends_with(".md"),
                "{slug} links {href}"
            );
        }
    }
    let missing = http
        .get(format!("{}/docs/no-such-page", served.base()))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    assert_eq!(
        missing.headers()["content-type"],
        "application/problem+json"
    );
    let problem: serde_json::Value = missing.json().await.unwrap();
    assert!(
        problem["type"].as_str().unwrap().ends_with("/not-found"),
        "{problem}"
    );
}
