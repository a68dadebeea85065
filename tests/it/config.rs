//! Settings come from flags, then `IDEMGATE_*` variables, then the `--config`
//! TOML file; the example file documents every setting with its default.

use crate::common;

use clap::CommandFactory;
use common::bin::{Served, idemgate};
use common::pg::TestDb;
use idemgate::server::cli::{Cli, CliError, Command};
use idemgate::server::config::LogFormat;

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/idemgate.example.toml");
const CONFIGURATION: &str = include_str!("../../docs/configuration.md");

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
fn the_example_file_and_the_configuration_page_document_every_setting() {
    let example = std::fs::read_to_string(EXAMPLE).unwrap();
    let table: toml::Table = example.parse().unwrap();
    let cmd = Cli::command();
    // The global flags (every command's), then each command's own.
    let globals = cmd.get_arguments().filter(|a| a.is_global_set());
    let globals = globals.map(|arg| ("", arg));
    let own = ["serve", "proxy"].into_iter().flat_map(|sub| {
        let sub_cmd = cmd.find_subcommand(sub).unwrap();
        sub_cmd.get_arguments().map(move |arg| (sub, arg))
    });
    let mut checked = Vec::new();
    for (sub, arg) in globals.chain(own) {
        let id = arg.get_id().as_str();
        if ["config", "help", "version"].contains(&id) || arg.get_long().is_none() {
            continue;
        }
        checked.push(id.to_owned());
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
            CONFIGURATION.contains(&format!("`{env}`")),
            "{env} is missing from docs/configuration.md"
        );
    }
    assert!(checked.iter().any(|id| id == "log_format"), "{checked:?}");
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
        ("log_format = \"xml\"", "log_format"),
        ("[serve]\nlog_format = 1", "log_format"),
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

/// `argv`'s log format, as parsed with its config file merged.
fn log_format(argv: &[&str]) -> LogFormat {
    let argv = argv.iter().map(Into::into).collect();
    match Cli::try_parse_merged(argv) {
        Ok(cli) => cli.log_format,
        Err(e) => panic!("{e:?}"),
    }
}

#[test]
fn log_format_is_a_flag_of_every_command_and_a_file_key() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("json.toml");
    std::fs::write(&json, "log_format = \"json\"\n").unwrap();
    let json = json.to_str().unwrap();
    let serve_only = dir.path().join("serve.toml");
    std::fs::write(&serve_only, "[serve]\nlog_format = \"json\"\n").unwrap();
    let serve_only = serve_only.to_str().unwrap();
    for (argv, want) in [
        (&["idemgate", "serve"][..], LogFormat::Human),
        (
            &["idemgate", "serve", "--log-format", "json"],
            LogFormat::Json,
        ),
        (
            &["idemgate", "--log-format", "json", "serve"],
            LogFormat::Json,
        ),
        (&["idemgate", "proxy", "--log-format=json"], LogFormat::Json),
        (
            &["idemgate", "migrate", "--log-format", "json"],
            LogFormat::Json,
        ),
        (
            &["idemgate", "prune", "--log-format", "json"],
            LogFormat::Json,
        ),
        (
            &["idemgate", "openapi", "--log-format", "json"],
            LogFormat::Json,
        ),
        // The values IDEMGATE_LOG_FORMAT has always taken.
        (
            &["idemgate", "serve", "--log-format", "text"],
            LogFormat::Human,
        ),
        (
            &["idemgate", "serve", "--log-format", "pretty"],
            LogFormat::Human,
        ),
        (&["idemgate", "serve", "--log-format", ""], LogFormat::Human),
        // The file, at the top level or in the command's table.
        (&["idemgate", "serve", "--config", json], LogFormat::Json),
        (&["idemgate", "migrate", "--config", json], LogFormat::Json),
        (
            &["idemgate", "serve", "--config", serve_only],
            LogFormat::Json,
        ),
        (
            &["idemgate", "proxy", "--config", serve_only],
            LogFormat::Human,
        ),
        // A flag beats the file, before the command or after it.
        (
            &[
                "idemgate",
                "serve",
                "--config",
                json,
                "--log-format",
                "human",
            ],
            LogFormat::Human,
        ),
        (
            &[
                "idemgate",
                "--log-format",
                "human",
                "serve",
                "--config",
                json,
            ],
            LogFormat::Human,
        ),
    ] {
        assert_eq!(log_format(argv), want, "{argv:?}");
    }
}

/// What `idemgate serve` logs until it is ready, run with `env` and `flags`
/// and its standard error a pipe.
async fn start_logs(db: &TestDb, env: &[(&str, &str)], flags: &[&str]) -> String {
    let mut cmd = idemgate(db);
    cmd.env_remove("IDEMGATE_LOG_FORMAT")
        .env_remove("IDEMGATE_CONFIG")
        .env_remove("NO_COLOR");
    for (var, value) in env {
        cmd.env(var, value);
    }
    let mut served = Served::spawn(cmd, flags).await;
    served.child.kill().unwrap();
    served.child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(served.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("idemgate serve is listening"), "{stderr}");
    stderr
}

/// Whether every log line is a JSON object (`true`) or none is (`false`).
#[track_caller]
fn all_json(logs: &str) -> bool {
    let json: Vec<bool> = logs
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .is_ok_and(|v| v["level"].is_string() && v["timestamp"].is_string())
        })
        .collect();
    assert!(!json.is_empty(), "no logs");
    assert!(
        json.iter().all(|j| *j) || json.iter().all(|j| !*j),
        "JSON and human lines mixed:\n{logs}"
    );
    json[0]
}

#[tokio::test]
async fn log_format_flag_beats_environment_beats_file() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let file = |format: &str| {
        let path = dir.path().join(format!("{format}.toml"));
        std::fs::write(&path, format!("log_format = \"{format}\"\n")).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let (human_file, json_file) = (file("human"), file("json"));
    let env = |v| [("IDEMGATE_LOG_FORMAT", v)];
    for (env, flags, json, why) in [
        (&[][..], &["--log-format", "json"][..], true, "the flag"),
        (&[], &["--config", &json_file], true, "the file"),
        (&[], &["--config", &human_file], false, "the file"),
        (&env("json")[..], &[], true, "the environment"),
        (
            &env("human"),
            &["--config", &json_file],
            false,
            "environment over file",
        ),
        (
            &env("json"),
            &["--config", &human_file],
            true,
            "environment over file",
        ),
        (
            &env("human"),
            &["--config", &json_file, "--log-format", "json"],
            true,
            "flag over environment",
        ),
        (
            &env("json"),
            &["--config", &json_file, "--log-format", "human"],
            false,
            "flag over environment and file",
        ),
    ] {
        let logs = start_logs(&db, env, flags).await;
        assert_eq!(all_json(&logs), json, "{why}: {env:?} {flags:?}:\n{logs}");
    }
}

#[tokio::test]
async fn human_logs_to_a_pipe_have_no_colour_codes() {
    let db = TestDb::new().await;
    for env in [&[][..], &[("IDEMGATE_LOG_FORMAT", "human")]] {
        let logs = start_logs(&db, env, &[]).await;
        assert!(!all_json(&logs), "{logs}");
        assert!(logs.contains(" INFO "), "{logs}");
        assert!(
            !logs.contains("\x1b["),
            "ANSI escapes in piped logs:\n{logs:?}"
        );
    }
}

#[tokio::test]
async fn a_bad_log_format_is_refused_naming_the_setting() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "log_format = \"xml\"\n").unwrap();
    let path = path.to_str().unwrap();
    for (env, args, named) in [
        (None, &["serve", "--log-format", "xml"][..], "--log-format"),
        (None, &["--log-format", "xml", "migrate"], "--log-format"),
        // The variable is named as such, with its value.
        (Some("xml"), &["serve"], "IDEMGATE_LOG_FORMAT=xml"),
        (
            None,
            &["serve", "--config", path],
            "key `log_format` = \"xml\"",
        ),
    ] {
        let mut cmd = idemgate(&db);
        cmd.env_remove("IDEMGATE_LOG_FORMAT");
        if let Some(value) = env {
            cmd.env("IDEMGATE_LOG_FORMAT", value);
        }
        let out = cmd.args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{env:?} {args:?} was accepted");
        assert!(stderr.contains(named), "{env:?} {args:?}: {stderr}");
        assert!(stderr.contains("`human` or `json`"), "{stderr}");
    }
}

#[tokio::test]
async fn a_token_given_to_two_tenants_is_refused_without_showing_it() {
    let db = TestDb::new().await;
    let secret = "shared-secret-7c1f0e";
    let tokens = format!("acme:{secret},globex:{secret}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens.toml");
    std::fs::write(&path, format!("tokens = \"{tokens}\"\n")).unwrap();
    let path = path.to_str().unwrap();
    for (env, args, named) in [
        (Some(tokens.as_str()), &["serve"][..], "IDEMGATE_TOKENS"),
        (None, &["serve", "--tokens", &tokens], "--tokens"),
        (None, &["serve", "--config", path], "key `tokens`"),
    ] {
        let mut cmd = idemgate(&db);
        if let Some(value) = env {
            cmd.env("IDEMGATE_TOKENS", value);
        }
        let out = cmd.args(args).output().unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(all.contains(named), "{args:?}: {all}");
        assert!(all.contains("given to two tenants"), "{args:?}: {all}");
        assert!(!all.contains(secret), "{args:?} showed the token: {all}");
    }
    // Nor does any other refusal of the value show a token in it.
    let out = idemgate(&db)
        .env("IDEMGATE_TOKENS", format!("acme:{secret},globex"))
        .arg("serve")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("IDEMGATE_TOKENS"), "{stderr}");
    assert!(!stderr.contains(secret), "{stderr}");
}

#[tokio::test]
async fn two_tokens_of_one_tenant_and_a_repeated_pair_are_accepted() {
    let db = TestDb::new().await;
    let tokens = "acme:acme-old-tok,acme:acme-new-tok,globex:globex-tok,globex:globex-tok";
    let mut cmd = idemgate(&db);
    cmd.env("IDEMGATE_TOKENS", tokens);
    let served = Served::spawn(cmd, &[]).await;
    let http = common::http();
    let key = format!("\"{}\"", uuid::Uuid::new_v4());
    // Both of acme's tokens reach acme (the second finds the first's key in
    // flight); globex's key is its own.
    for (token, want) in [
        ("acme-old-tok", 201),
        ("acme-new-tok", 409),
        ("globex-tok", 201),
        ("unknown-tok", 401),
    ] {
        let res = http
            .post(format!("{}/v1/reservations", served.base()))
            .header("idempotency-key", &key)
            .bearer_auth(token)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), want, "{token}");
    }
}

// === Refusals name the setting as it was set ===

/// `idemgate` with nothing from the caller's environment but `env`.
fn bare(env: &[(&str, &str)]) -> std::process::Command {
    let mut cmd = std::process::Command::new(common::bin::BIN);
    cmd.env_clear()
        .env("DATABASE_URL", "sqlite::memory:")
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null());
    cmd
}

/// Runs `cmd`, which must be refused, and returns its standard error.
#[track_caller]
fn refused(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "{cmd:?} was accepted:\n{stderr}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!stderr.contains("panicked"), "{cmd:?}: {stderr}");
    stderr
}

/// The arguments that make `sub` start but for the setting under test.
fn start_args(sub: &str) -> Vec<&'static str> {
    match sub {
        "proxy" => vec!["proxy", "--upstream", "http://127.0.0.1:9"],
        _ => vec!["serve"],
    }
}

/// Every setting of `serve` and `proxy` whose value has a form a message
/// states (a duration, a size, a count, an address, a boolean): the
/// command, the id, the flag, the variable and that form.
fn formed_settings() -> Vec<(&'static str, String, String, String, &'static str)> {
    let cmd = idemgate::server::config::command::built();
    let mut found = Vec::new();
    for sub in ["serve", "proxy"] {
        for arg in cmd.find_subcommand(sub).unwrap().get_arguments() {
            let (Some(long), Some(env), Some(form)) = (
                arg.get_long(),
                arg.get_env(),
                idemgate::server::config::source::expected_form(arg),
            ) else {
                continue;
            };
            found.push((
                sub,
                arg.get_id().to_string(),
                format!("--{long}"),
                env.to_string_lossy().into_owned(),
                form,
            ));
        }
    }
    found
}

#[test]
fn a_refused_value_names_the_flag_the_variable_or_the_file_key_it_came_from() {
    let settings = formed_settings();
    for want in [
        "--default-ttl",
        "--upstream-timeout",
        "--prune-interval",
        "--listen",
    ] {
        assert!(
            settings.iter().any(|(_, _, flag, _, _)| flag == want),
            "{want} has no form: {settings:?}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    let path = file.to_str().unwrap();
    for (sub, id, flag, env, form) in &settings {
        let form = form.split(" (").next().unwrap();
        // From the environment: the variable and its value, not the flag.
        let said = refused(bare(&[(env, "soon")]).args(start_args(sub)));
        assert!(said.contains(&format!("{env}=soon")), "{env}: {said}");
        assert!(said.contains(form), "{env}: {said}");
        assert!(
            !said.contains(flag.as_str()),
            "{env} named as {flag}: {said}"
        );
        // From the command line: the flag, not the variable.
        let said = refused(bare(&[]).args(start_args(sub)).args([flag, "soon"]));
        assert!(said.contains(&format!("{flag} soon")), "{flag}: {said}");
        assert!(said.contains(form), "{flag}: {said}");
        assert!(
            !said.contains(env.as_str()),
            "{flag} named as {env}: {said}"
        );
        // From the file: the file and the key as written there.
        std::fs::write(&file, format!("[{sub}]\n{id} = \"soon\"\n")).unwrap();
        let said = refused(bare(&[]).args(start_args(sub)).args(["--config", path]));
        assert!(
            said.contains(&format!("{path}: key `{sub}.{id}` = \"soon\"")),
            "{id} in the file: {said}"
        );
        assert!(said.contains(form), "{id} in the file: {said}");
        assert!(
            !said.contains(flag.as_str()) && !said.contains(env.as_str()),
            "{id} in the file named as its flag or variable: {said}"
        );
    }
}

#[test]
fn a_duration_value_error_says_whole_seconds_and_names_the_variable() {
    let said = refused(bare(&[("IDEMGATE_DEFAULT_TTL", "abc")]).arg("serve"));
    assert!(said.contains("IDEMGATE_DEFAULT_TTL=abc"), "{said}");
    assert!(said.contains("whole seconds"), "{said}");
    assert!(!said.contains("--default-ttl"), "{said}");
    let said = refused(bare(&[("IDEMGATE_LISTEN", "localhost:8080")]).arg("serve"));
    assert!(
        said.contains(
            "IDEMGATE_LISTEN=localhost:8080: expected HOST:PORT (an IP address and a port"
        ),
        "{said}"
    );
}

#[test]
fn a_refusal_after_the_parse_names_the_setting_as_it_was_set() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("zero.toml");
    let path = file.to_str().unwrap();
    std::fs::write(&file, "[serve]\ndefault_ttl = 0\n").unwrap();
    for (env, args, named, not) in [
        (
            &[][..],
            &["serve", "--default-ttl", "0"][..],
            "--default-ttl 0: must be at least 1 second",
            "IDEMGATE_DEFAULT_TTL",
        ),
        (
            &[("IDEMGATE_DEFAULT_TTL", "0")],
            &["serve"],
            "IDEMGATE_DEFAULT_TTL=0: must be at least 1 second",
            "--default-ttl",
        ),
        (
            &[],
            &["serve", "--config", path],
            &format!("{path}: key `serve.default_ttl` = 0: must be at least 1 second"),
            "IDEMGATE_DEFAULT_TTL",
        ),
        (
            &[],
            &[
                "proxy",
                "--upstream",
                "http://127.0.0.1:9",
                "--upstream-timeout",
                "0",
            ],
            "--upstream-timeout 0: must be at least 1 second",
            "IDEMGATE_UPSTREAM_TIMEOUT",
        ),
        // Two settings at odds: each named as it was set.
        (
            &[("IDEMGATE_DEFAULT_TTL", "86400")],
            &["serve", "--max-ttl", "3600"],
            "IDEMGATE_DEFAULT_TTL=86400: exceeds the longest TTL a reservation may ask for, \
             --max-ttl 3600",
            "IDEMGATE_MAX_TTL",
        ),
        (
            &[("IDEMGATE_LISTEN", "0.0.0.0:0")],
            &["serve"],
            "IDEMGATE_LISTEN=0.0.0.0:0: refusing to listen on 0.0.0.0:0 without tokens \
             (protected mode)",
            "--listen",
        ),
    ] {
        let said = refused(bare(env).args(args));
        assert!(said.contains(named), "{env:?} {args:?}: {said}");
        assert!(!said.contains(not), "{env:?} {args:?} named {not}: {said}");
    }
}

#[test]
fn every_error_line_has_one_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "nope = 1\n").unwrap();
    let path = file.to_str().unwrap();
    for (env, args) in [
        // clap's own refusals: an unknown flag, a missing value, a bad value.
        (&[][..], &["serve", "--nope"][..]),
        (&[], &["serve", "--default-ttl"]),
        (&[], &["serve", "--default-ttl", "abc"]),
        (&[], &["frobnicate"]),
        (&[], &["migrate", "--no-migrate"]),
        // The file's.
        (&[], &["serve", "--config", path]),
        // validate()'s, and a start-up failure.
        (&[], &["serve", "--default-ttl", "0"]),
        (&[("DATABASE_URL", "mysql://x")], &["serve"]),
    ] {
        let said = refused(bare(env).args(args));
        let first = said.lines().next().unwrap_or_default();
        assert!(first.starts_with("idemgate: error: "), "{args:?}: {said}");
        assert!(
            !said.lines().any(|l| l.starts_with("error:")),
            "{args:?}: a second prefix: {said}"
        );
    }
    // --help and --version are no errors: standard output, exit 0.
    for args in [&["--help"][..], &["--version"], &["serve", "--help"]] {
        let out = bare(&[]).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        assert!(!out.stdout.is_empty() && out.stderr.is_empty(), "{args:?}");
    }
}

#[test]
fn migrate_and_prune_help_describes_what_they_do() {
    for sub in ["migrate", "prune"] {
        let out = bare(&[]).args([sub, "--help"]).output().unwrap();
        assert!(out.status.success(), "{sub} --help");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            !help.contains("--no-migrate"),
            "{sub} offers --no-migrate:\n{help}"
        );
        assert!(!help.contains("503"), "{sub} help speaks of a 503:\n{help}");
        assert!(!help.contains("store-unavailable"), "{sub}:\n{help}");
        assert!(
            help.contains("the command fails"),
            "{sub} help does not say what a timeout does:\n{help}"
        );
        let said = refused(bare(&[]).args([sub, "--no-migrate"]));
        assert!(said.contains("--no-migrate"), "{said}");
    }
    for sub in ["serve", "proxy"] {
        let out = bare(&[]).args([sub, "--help"]).output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains("--no-migrate"),
            "{sub} lost --no-migrate:\n{help}"
        );
    }
}

/// `--help` puts what most starts need first, under clap's "Options" (the
/// listeners, `--database-url`, the tokens), then the rest in groups: a
/// reader finds the database URL on the first screen.
#[test]
fn help_puts_the_common_settings_first_then_groups() {
    for (args, first, common, headings) in [
        (
            &["serve", "--help"][..],
            15,
            &[
                "--listen",
                "--database-url",
                "--tokens",
                "--admin-tokens",
                "--config",
            ][..],
            &[
                "Keys and leases",
                "Tenants and limits",
                "Database",
                "Connections",
                "Observability",
                "Sealing at rest",
                "TLS",
            ][..],
        ),
        (
            &["proxy", "--help"],
            15,
            &[
                "--upstream",
                "--listen",
                "--admin-listen",
                "--database-url",
                "--admin-tokens",
            ],
            &[
                "Upstream",
                "MCP",
                "Keys and leases",
                "Tenants and limits",
                "Stored responses",
                "Database",
                "TLS",
            ],
        ),
        (
            &["keys", "list", "--help"],
            15,
            &["--state", "--database-url", "--server", "--token", "--json"],
            &["Database", "Sealing at rest"],
        ),
    ] {
        let out = bare(&[]).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        let help = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = help.lines().collect();
        let at = |heading: &str| lines.iter().position(|l| *l == format!("{heading}:"));
        let options = at("Options").unwrap_or_else(|| panic!("{args:?}: no Options:\n{help}"));
        let groups = lines
            .iter()
            .skip(options + 1)
            .position(|l| l.ends_with(':') && !l.starts_with(' '))
            .map_or(lines.len(), |i| options + 1 + i);
        for flag in common {
            let line = lines
                .iter()
                .position(|l| l.split_whitespace().next() == Some(*flag))
                .unwrap_or_else(|| panic!("{args:?}: no {flag}:\n{help}"));
            assert!(
                line > options && line < groups,
                "{args:?}: {flag} is not among the common options (line {line}):\n{help}"
            );
        }
        let url = lines
            .iter()
            .position(|l| l.split_whitespace().next() == Some("--database-url"))
            .unwrap();
        assert!(
            url < first,
            "{args:?}: --database-url is on line {} (over {first}):\n{help}",
            url + 1
        );
        for heading in headings {
            let line = at(heading).unwrap_or_else(|| panic!("{args:?}: no {heading}:\n{help}"));
            assert!(
                line >= groups,
                "{args:?}: {heading} before the common options"
            );
        }
    }
}

/// A command line that lacks a required argument is told what it lacks,
/// and its usage line is the command's own: a setting given by its
/// variable (`DATABASE_URL`) is not shown as if it were required.
#[test]
fn a_missing_argument_is_named_and_the_usage_shows_what_is_required() {
    let hash = "ab".repeat(32);
    for (args, missing) in [
        (
            vec!["keys", "resolve", "default", hash.as_str(), "--release"],
            &["--reason"][..],
        ),
        (
            vec!["keys", "resolve", "default", hash.as_str(), "--reason", "x"],
            &["--release", "--complete"],
        ),
        (
            vec!["keys", "resolve", "default", hash.as_str()],
            &["--reason", "--release", "--complete"],
        ),
    ] {
        let said = refused(bare(&[("DATABASE_URL", "sqlite://held.db")]).args(&args));
        let (list, usage) = said.split_once("Usage: ").unwrap_or((&said, ""));
        for flag in missing {
            assert!(list.contains(flag), "{args:?} does not name {flag}: {said}");
        }
        assert!(
            usage.starts_with("idemgate keys resolve [OPTIONS] --reason <REASON>"),
            "{args:?}: {said}"
        );
        assert!(!said.contains("--database-url"), "{args:?}: {said}");
    }
}

/// `prune` and `keys` name the store setting alike, as the operator set
/// it (the default, the variable or the flag, a password masked), when the
/// SQLite file is not there and when PostgreSQL cannot be reached.
#[test]
fn prune_and_keys_name_the_database_setting_alike() {
    let dir = tempfile::tempdir().unwrap();
    let hash = "ab".repeat(32);
    let pg = "postgres://idem:hunter2@127.0.0.1:1/idem";
    let masked = "postgres://idem:***@127.0.0.1:1/idem";
    for (env, flag, names) in [
        (
            None,
            None,
            "the default --database-url sqlite://idemgate.db: ".to_owned(),
        ),
        (Some(pg), None, format!("DATABASE_URL={masked}: ")),
        (None, Some(pg), format!("--database-url {masked}: ")),
    ] {
        let mut said = Vec::new();
        for args in [
            vec!["prune"],
            vec!["keys", "list"],
            vec!["keys", "show", "default", hash.as_str()],
        ] {
            let mut cmd = std::process::Command::new(common::bin::BIN);
            cmd.env_clear().current_dir(dir.path()).args(&args);
            if let Some(url) = env {
                cmd.env("DATABASE_URL", url);
            }
            if let Some(url) = flag {
                cmd.args(["--database-url", url]);
            }
            let text = refused(&mut cmd);
            assert!(
                text.starts_with(&format!("idemgate: error: {names}")),
                "{args:?}: {text}"
            );
            assert!(!text.contains("hunter2"), "{args:?}: {text}");
            said.push(text);
        }
        assert!(said.iter().all(|t| *t == said[0]), "{said:#?}");
    }
    assert!(!dir.path().join("idemgate.db").exists());
}

/// The boolean settings of `sub`, by id.
/// Whether boolean setting `id` of `sub` is on when nothing sets it.
fn on_by_default(sub: &str, id: &str) -> bool {
    let cmd = Cli::command();
    let arg = cmd
        .find_subcommand(sub)
        .unwrap()
        .get_arguments()
        .find(|a| a.get_id() == id)
        .unwrap();
    arg.get_default_values().iter().any(|v| v == "true")
}

fn booleans(sub: &str) -> Vec<(String, String, String)> {
    // Built, so that the global flags are there too.
    let mut cmd = Cli::command();
    cmd.build();
    cmd.find_subcommand(sub)
        .unwrap()
        .get_arguments()
        .filter(|a| a.get_value_parser().type_id() == std::any::TypeId::of::<bool>())
        .filter_map(|a| {
            Some((
                a.get_id().to_string(),
                format!("--{}", a.get_long()?),
                a.get_env()?.to_string_lossy().into_owned(),
            ))
        })
        .collect()
}

/// The parsed settings of `idemgate ARGV…`, as `Debug` shows them.
fn parsed(argv: &[String]) -> String {
    let full = std::iter::once("idemgate").chain(argv.iter().map(String::as_str));
    match Cli::try_parse_merged(full.map(Into::into).collect()) {
        Ok(Cli {
            command: Command::Serve(args),
            ..
        }) => format!("{args:?}"),
        Ok(Cli {
            command: Command::Proxy(args),
            ..
        }) => format!("{args:?}"),
        other => panic!("{argv:?}: {other:?}"),
    }
}

#[test]
fn every_boolean_takes_one_form_from_flag_environment_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bool.toml");
    let path = file.to_str().unwrap();
    let mut seen = Vec::new();
    for sub in ["serve", "proxy"] {
        let all = booleans(sub);
        for want in ["no_migrate", "strict_key"] {
            assert!(all.iter().any(|(id, _, _)| id == want), "{sub}: {all:?}");
        }
        let start = start_args(sub);
        for (id, flag, env) in all {
            seen.push(id.clone());
            let with = |extra: &[&str]| {
                let argv: Vec<String> =
                    start.iter().chain(extra).map(|a| (*a).to_owned()).collect();
                parsed(&argv)
            };
            let is = |debug: &str, value: bool| debug.contains(&format!("{id}: {value}"));
            let default = on_by_default(sub, &id);
            assert!(is(&with(&[]), default), "{id} is {default} unless set");
            // The flag: bare (also before another flag), or with a value
            // after `=` or a space.
            let (on, off) = (format!("{flag}=true"), format!("{flag}=false"));
            for (extra, want) in [
                (vec![flag.as_str()], true),
                (vec![flag.as_str(), "--max-wait", "3"], true),
                (vec![on.as_str()], true),
                (vec![off.as_str()], false),
                (vec![flag.as_str(), "true"], true),
                (vec![flag.as_str(), "false"], false),
            ] {
                assert!(is(&with(&extra), want), "{sub} {extra:?}");
            }
            // The file: a TOML boolean, at the top or in the command's table.
            for (text, want) in [
                (format!("{id} = true\n"), true),
                (format!("{id} = false\n"), false),
                (format!("[{sub}]\n{id} = true\n"), true),
            ] {
                std::fs::write(&file, &text).unwrap();
                assert!(is(&with(&["--config", path]), want), "{sub} {text:?}");
            }
            // The binary takes the same forms: the refusal that follows is
            // another setting's, not the boolean's.
            let accepted = |said: &str| {
                !said.contains(flag.as_str())
                    && !said.contains(env.as_str())
                    && said.to_lowercase().replace('-', "_").contains("max_ttl")
            };
            for extra in [
                vec![flag.as_str()],
                vec![on.as_str()],
                vec![off.as_str()],
                vec![flag.as_str(), "true"],
                vec![flag.as_str(), "false"],
            ] {
                let said = refused(bare(&[]).args(&start).args(&extra).args(["--max-ttl", "0"]));
                assert!(accepted(&said), "{extra:?}: {said}");
            }
            // The variable, through the binary so as not to set it in this
            // process: `true` and `false` are accepted, anything else is
            // refused as the variable.
            for value in ["true", "false"] {
                let said = refused(
                    bare(&[(env.as_str(), value)])
                        .args(&start)
                        .args(["--max-ttl", "0"]),
                );
                assert!(accepted(&said), "{env}={value}: {said}");
            }
            let said = refused(bare(&[(env.as_str(), "maybe")]).args(&start));
            assert!(
                said.contains(&format!("{env}=maybe: expected true or false")),
                "{said}"
            );
            let said = refused(bare(&[]).args(&start).arg(format!("{flag}=maybe")));
            assert!(
                said.contains(&format!("{flag} maybe: expected true or false")),
                "{said}"
            );
        }
    }
    assert!(seen.iter().any(|id| id == "require_key"), "{seen:?}");
}

#[test]
fn refusals_never_show_a_secret() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("secret.toml");
    std::fs::write(&file, "seal_key = \"c2hvcnQta2V5LW9mLTE2Yg==\"\n").unwrap();
    for (env, args, named, secret) in [
        (
            &[("DATABASE_URL", "mysql://app:hunter2@db/idem")][..],
            &["serve"][..],
            "DATABASE_URL=mysql://app:***@db/idem",
            "hunter2",
        ),
        (
            &[],
            &["serve", "--database-url", "mysql://app:hunter2@db/idem"],
            "--database-url mysql://app:***@db/idem",
            "hunter2",
        ),
        (
            &[],
            &["serve", "--seal-key", "c2hvcnQta2V5LW9mLTE2Yg=="],
            "--seal-key (value not shown",
            "c2hvcnQta2V5LW9mLTE2Yg",
        ),
        (
            &[("IDEMGATE_SEAL_KEY", "c2hvcnQta2V5LW9mLTE2Yg==")],
            &["serve"],
            "IDEMGATE_SEAL_KEY (value not shown",
            "c2hvcnQta2V5LW9mLTE2Yg",
        ),
        (
            &[],
            &["serve", "--config", file.to_str().unwrap()],
            "key `seal_key` (value not shown",
            "c2hvcnQta2V5LW9mLTE2Yg",
        ),
        (
            &[],
            &["serve", "--tokens", "acme:t0p-s3cret,globex"],
            "--tokens (value not shown",
            "t0p-s3cret",
        ),
        (
            &[],
            &["proxy", "--upstream", "http://app:hunter2@127.0.0.1:9"],
            "--upstream http://app:***@127.0.0.1:9",
            "hunter2",
        ),
    ] {
        let said = refused(bare(env).args(args));
        assert!(said.contains(named), "{args:?}: {said}");
        assert!(!said.contains(secret), "{args:?} showed a secret: {said}");
    }
}

/// A number's refusal says what it counts only if the setting's value name
/// does (`SECONDS`, `BYTES`, `N`, …): a new duration without one would be
/// refused as "a whole number", not "whole seconds".
#[test]
fn every_number_setting_names_its_unit() {
    use std::any::TypeId;
    let numbers = [
        TypeId::of::<u8>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
    ];
    let units: Vec<&str> = idemgate::server::config::source::FORMS
        .iter()
        .map(|(name, _)| *name)
        .collect();
    let cmd = idemgate::server::config::command::built();
    for sub in cmd.get_subcommands() {
        for arg in sub.get_arguments() {
            let ty = arg.get_value_parser().type_id();
            if !numbers.iter().any(|n| ty == *n) {
                continue;
            }
            let names: Vec<String> = arg
                .get_value_names()
                .unwrap_or_default()
                .iter()
                .map(ToString::to_string)
                .collect();
            assert!(
                names.iter().any(|n| units.contains(&n.as_str())),
                "{} {}: give it a value_name of config::source::FORMS, e.g. \"SECONDS\" \
                 (got {names:?})",
                sub.get_name(),
                arg.get_id()
            );
        }
    }
}

/// The proxy's lease-expiry choice and default wait are refused, named as
/// set, when they cannot be used: a choice that is neither `hold` nor
/// `takeover`, a default wait longer than the longest wait.
#[test]
fn the_proxys_hold_settings_are_refused_by_name() {
    let err = refused(bare(&[("IDEMGATE_ON_LEASE_EXPIRY", "retry")]).args(start_args("proxy")));
    assert!(err.contains("IDEMGATE_ON_LEASE_EXPIRY"), "{err}");
    assert!(err.contains("hold") && err.contains("takeover"), "{err}");
    let err = refused(bare(&[]).args(start_args("proxy")).args([
        "--default-wait",
        "20",
        "--max-wait",
        "5",
    ]));
    assert!(err.contains("--default-wait"), "{err}");
    assert!(
        err.contains("--max-wait") || err.contains("max_wait"),
        "{err}"
    );
    let err = refused(
        bare(&[("IDEMGATE_ADMIN_TOKENS", "a:s3cret-admin,b:s3cret-admin")]).args(["serve"]),
    );
    assert!(err.contains("IDEMGATE_ADMIN_TOKENS"), "{err}");
    assert!(!err.contains("s3cret-admin"), "{err}");
}
