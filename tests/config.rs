//! Settings come from flags, then `IDEMGATE_*` variables, then the `--config`
//! TOML file; the example file documents every setting with its default.

mod common;

use clap::CommandFactory;
use common::bin::{Served, idemgate};
use common::pg::TestDb;
use idemgate::cli::{Cli, CliError, Command};

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/idemgate.example.toml");
const README: &str = include_str!("../README.md");

fn serve_debug(argv: &[&str]) -> String {
    let argv = argv.iter().map(Into::into).collect();
    match Cli::try_parse_merged(argv) {
        Ok(Cli {
            command: Command::Serve(args),
            ..
        }) => format!("{args:?}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_example_file_holds_the_defaults() {
    assert_eq!(
        serve_debug(&["idemgate", "serve", "--config", EXAMPLE]),
        serve_debug(&["idemgate", "serve"]),
    );
}

#[test]
fn the_example_file_and_readme_document_every_setting() {
    let example = std::fs::read_to_string(EXAMPLE).unwrap();
    let table: toml::Table = example.parse().unwrap();
    let cmd = Cli::command();
    for sub in ["serve", "proxy"] {
        let sub_cmd = cmd.find_subcommand(sub).unwrap();
        for arg in sub_cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if ["config", "help", "version"].contains(&id) || arg.get_long().is_none() {
                continue;
            }
            let value = table
                .get(id)
                .or_else(|| table.get(sub).and_then(|t| t.get(id)));
            let defaults: Vec<String> = arg
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            match value {
                Some(v) => {
                    let text = match v {
                        toml::Value::String(s) => s.clone(),
                        toml::Value::Array(items) => items
                            .iter()
                            .map(|i| i.as_str().map_or_else(|| i.to_string(), str::to_owned))
                            .collect::<Vec<_>>()
                            .join(","),
                        other => other.to_string(),
                    };
                    let want = if defaults.is_empty() {
                        if matches!(arg.get_action(), clap::ArgAction::SetTrue) {
                            "false".to_owned()
                        } else {
                            String::new()
                        }
                    } else {
                        defaults.join(",")
                    };
                    assert_eq!(text, want, "{id}: the example's value is not the default");
                }
                None => assert!(
                    example.contains(&format!("# {id} = ")),
                    "{id} is not documented in idemgate.example.toml"
                ),
            }
            let env = arg
                .get_env()
                .map(|e| e.to_string_lossy().into_owned())
                .unwrap_or_default();
            assert!(
                !env.is_empty() && example.contains(&env),
                "{id}: its variable {env:?} is not named in the example"
            );
            assert!(
                README.contains(&format!("`{env}`")),
                "{env} is missing from the README's configuration table"
            );
        }
    }
}

#[test]
fn file_errors_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (text, want) in [
        ("key_max_len = \"lots\"", "key_max_len"),
        ("nope = 1", "nope"),
        ("[serve]\nprune_intervall = 3", "serve.prune_intervall"),
        ("key_max_len = ", "not valid TOML"),
        ("methods = []", "methods"),
    ] {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, text).unwrap();
        let argv = ["idemgate", "serve", "--config", path.to_str().unwrap()]
            .iter()
            .map(Into::into)
            .collect();
        match Cli::try_parse_merged(argv) {
            Err(CliError::Config(e)) => {
                assert!(e.to_string().contains(want), "{text:?}: {e}");
            }
            other => panic!("{text:?} was accepted: {other:?}"),
        }
    }
}

#[tokio::test]
async fn flags_beat_environment_beats_file() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    std::fs::write(
        &path,
        "key_max_len = 10\nmax_wait = 3\ndefault_ttl = 100\nfingerprint_ignore = [\"/a\", \"/b/c\"]\n\
         [serve]\nmax_lease = 99\n",
    )
    .unwrap();
    // The file's database_url would lose to DATABASE_URL anyway; the
    // harness sets that variable.
    let served = {
        let mut cmd = idemgate(&db);
        cmd.env("IDEMGATE_MAX_WAIT", "4")
            .env("IDEMGATE_DEFAULT_TTL", "150");
        Served::spawn(
            cmd,
            &["--config", path.to_str().unwrap(), "--default-ttl", "200"],
        )
        .await
    };
    let policy: serde_json::Value = reqwest::get(format!("{}/v1/policy", served.base()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(policy["key"]["max_length"], 10, "file");
    assert_eq!(policy["max_wait_seconds"], 4, "environment over file");
    assert_eq!(
        policy["ttl_seconds"]["default"], 200,
        "flag over environment and file"
    );
    assert_eq!(policy["lease_seconds"]["max"], 99, "[serve] table");
    assert_eq!(
        policy["fingerprint"]["ignored_pointers"],
        serde_json::json!(["/a", "/b/c"])
    );
}
