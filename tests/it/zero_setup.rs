//! The first five minutes: `idemgate serve` on a fresh machine needs nothing
//! but the binary (the embedded SQLite default), keeps its keys across a
//! restart, and the container files run what exists.

use crate::common;

use std::process::{Command, Stdio};

use clap::CommandFactory;
use common::bin::{BIN, Served, refused};
use idemgate::server::cli::Cli;

/// `idemgate` in `dir` with no DATABASE_URL: the embedded default store.
fn bare(dir: &std::path::Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.current_dir(dir)
        .env_remove("DATABASE_URL")
        .env_remove("IDEMGATE_TOKENS")
        .env_remove("IDEMGATE_LISTEN")
        .env_remove("IDEMGATE_CONFIG")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null());
    cmd
}

async fn reserve(base: &str, key: &str) -> reqwest::Response {
    common::http()
        .post(format!("{base}/v1/reservations"))
        .header("Idempotency-Key", key)
        .body(r#"{"fingerprint":"f"}"#)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn default_store_is_a_sqlite_file_that_survives_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let key = format!("zero-setup-{}", uuid::Uuid::new_v4());
    let mut first = Served::spawn(bare(dir.path()), &[]).await;
    assert!(
        dir.path().join("idemgate.db").exists(),
        "created on first start"
    );
    let res = reserve(&first.base(), &key).await;
    assert_eq!(res.status(), 201);
    let body: serde_json::Value = res.json().await.unwrap();
    let id = body["reservation_id"].as_str().unwrap();
    let commit = common::http()
        .post(format!("{}/v1/reservations/{id}/commit", first.base()))
        .body(r#"{"status":201,"body":"charged once"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(commit.status(), 200);
    // No goodbye: SIGKILL right after the acknowledged commit.
    first.child.kill().unwrap();
    first.child.wait().unwrap();

    let second = Served::spawn(bare(dir.path()), &[]).await;
    let replay = reserve(&second.base(), &key).await;
    assert_eq!(replay.status(), 200);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let body: serde_json::Value = replay.json().await.unwrap();
    assert_eq!(body["response"]["body"], "charged once");
}

#[tokio::test]
async fn json_logs_and_the_protected_mode_notice() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = bare(dir.path());
    cmd.env("IDEMGATE_LOG_FORMAT", "json");
    let mut served = Served::spawn(cmd, &[]).await;
    let kill = Command::new("kill")
        .args(["-TERM", &served.child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    assert!(served.child.wait().unwrap().success());
    let mut stderr = String::new();
    std::io::Read::read_to_string(served.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines
            .iter()
            .all(|l| l["level"].is_string() && l["timestamp"].is_string())
    );
    assert!(
        lines.iter().any(|l| l["message"]
            .as_str()
            .unwrap_or_default()
            .contains("loopback only")),
        "protected mode is announced: {stderr}"
    );
}

#[test]
fn the_container_files_run_what_exists() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dockerfile = std::fs::read_to_string(format!("{root}/Dockerfile")).unwrap();
    let compose = std::fs::read_to_string(format!("{root}/docker-compose.yml")).unwrap();
    assert!(dockerfile.matches("\nFROM ").count() >= 2, "multi-stage");
    assert!(
        dockerfile
            .contains("cargo build --release --locked --bin idemgate --bin idemgate-demo-origin")
    );
    assert!(
        std::path::Path::new(&format!("{root}/examples/origin.rs")).exists(),
        "the demo origin the image carries"
    );
    // Cargo loads every workspace member's manifest to build any package:
    // the build stage must COPY each member, or it fails before compiling.
    let build_stage = dockerfile
        .split("\nFROM ")
        .find(|stage| stage.contains(" AS build"))
        .expect("a stage named build");
    let copied: Vec<&str> = build_stage
        .lines()
        .filter_map(|l| l.strip_prefix("COPY "))
        .flat_map(|args| {
            let words: Vec<&str> = args.split_whitespace().collect();
            words[..words.len() - 1].to_vec()
        })
        .collect();
    let manifest: toml::Table = std::fs::read_to_string(format!("{root}/Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let members = manifest["workspace"]["members"].as_array().unwrap();
    for member in members.iter().map(|m| m.as_str().unwrap()) {
        assert!(
            copied.contains(&member),
            "the build stage does not COPY the workspace member {member}"
        );
    }
    for needed in [
        "Cargo.toml",
        "Cargo.lock",
        "build.rs",
        "src",
        "migrations",
        "examples",
    ] {
        assert!(
            copied.contains(&needed),
            "the build stage does not COPY {needed}"
        );
    }
    assert!(dockerfile.contains("ENTRYPOINT [\"idemgate\"]"));
    let user = dockerfile
        .lines()
        .rev()
        .find(|l| l.starts_with("USER "))
        .expect("the runtime stage names a user");
    assert_ne!(user.trim(), "USER root");

    let cli = Cli::command();
    let subcommands: Vec<&str> = cli.get_subcommands().map(|c| c.get_name()).collect();
    let known_env: Vec<String> = cli
        .get_subcommands()
        .flat_map(|c| c.get_arguments())
        .chain(cli.get_arguments())
        .filter_map(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
        .collect();
    let mut commands = 0;
    for line in compose.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("command:") {
            let sub = rest
                .trim()
                .trim_start_matches("[\"")
                .split('"')
                .next()
                .unwrap();
            assert!(
                subcommands.contains(&sub),
                "compose runs `idemgate {sub}`, which does not exist"
            );
            commands += 1;
        }
        if let Some((name, _)) = line.split_once(':')
            && name.starts_with("IDEMGATE_")
        {
            assert!(
                known_env.iter().any(|e| e == name),
                "compose sets unknown {name}"
            );
        }
    }
    assert!(
        commands >= 2,
        "compose starts idemgate serve and idemgate proxy"
    );
    assert!(compose.contains("command: [\"proxy\", \"--upstream\", \"http://origin:3000\"]"));
    assert!(compose.contains("entrypoint: [\"idemgate-demo-origin\"]"));
    assert!(compose.contains("DATABASE_URL: postgres://"));
}

/// The SQLite URL forms sqlx reads are all taken (`sqlite:rel.db`,
/// `sqlite::memory:`, not only `sqlite://…`); another scheme is refused with
/// the forms that work.
#[test]
fn every_sqlite_url_form_opens_and_other_schemes_say_what_works() {
    let dir = tempfile::tempdir().unwrap();
    for url in ["sqlite:rel.db", "sqlite::memory:", "sqlite://abs.db"] {
        let out = bare(dir.path())
            .env("DATABASE_URL", url)
            .arg("migrate")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(dir.path().join("rel.db").exists());
    assert!(dir.path().join("abs.db").exists());
    let out = bare(dir.path())
        .env("DATABASE_URL", "mysql://db/x")
        .arg("migrate")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        said.contains("DATABASE_URL") && said.contains("sqlite:") && said.contains("\"mysql\""),
        "{said}"
    );
}

/// With JSON logs, every line on stderr parses, a refusal to start included:
/// it is an ERROR line whose `error` names the setting.
#[test]
fn with_json_logs_a_refusal_to_start_is_json_too() {
    let dir = tempfile::tempdir().unwrap();
    let out = bare(dir.path())
        .env("IDEMGATE_LOG_FORMAT", "json")
        .env("IDEMGATE_LISTEN", "0.0.0.0:0")
        .arg("serve")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let refusal = lines.last().expect("a line");
    assert_eq!(refusal["level"], "ERROR", "{stderr}");
    assert!(
        refusal["error"]
            .as_str()
            .is_some_and(|e| e.contains("IDEMGATE_TOKENS")),
        "{stderr}"
    );
    // And a one-shot command's report (`migrate`: `prune` never creates
    // the file, and the refused start left none).
    let out = bare(dir.path())
        .env("IDEMGATE_LOG_FORMAT", "json")
        .arg("migrate")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in String::from_utf8_lossy(&out.stderr).lines() {
        let line: serde_json::Value = serde_json::from_str(line).expect("JSON");
        assert!(line["level"].is_string(), "{line}");
    }
}

/// One idemgate process per SQLite file: a second `serve` on the file refuses
/// to start, naming the file and the process that holds it, and so do
/// `migrate` and `prune` (other processes on the file too); the first serves
/// on, undisturbed. The lock is the kernel's: once the first dies, even by
/// SIGKILL, the next one starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_on_one_sqlite_file_is_refused_naming_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let key = format!("one-process-{}", uuid::Uuid::new_v4());
    // A secret on the holder's command line, which the refusal must not quote.
    let seal = "bG9jay10ZXN0LXNlYWwta2V5LW9mLTMyLWJ5dGVzISE=";
    let mut first = Served::spawn(bare(dir.path()), &["--seal-key", seal]).await;
    let pid = first.child.id().to_string();
    let file = std::fs::canonicalize(dir.path().join("idemgate.db")).unwrap();
    let file = file.display().to_string();

    let port = common::bin::free_port().to_string();
    let mut second = bare(dir.path());
    second.args(["serve", "--listen", &format!("127.0.0.1:{port}")]);
    let mut migrate = bare(dir.path());
    migrate.arg("migrate");
    let mut prune = bare(dir.path());
    prune.arg("prune");
    // The same file by another spelling of its path.
    let mut elsewhere = bare(std::path::Path::new("/"));
    elsewhere
        .env("DATABASE_URL", format!("sqlite://{file}"))
        .arg("prune");
    for (what, cmd) in [
        ("serve", second),
        ("migrate", migrate),
        ("prune", prune),
        ("prune by its full path", elsewhere),
    ] {
        let said = refused(cmd).await;
        assert!(
            said.contains(&file) && said.contains(&pid) && said.contains("serve"),
            "{what}: the refusal names the file, the holder's pid and its command: {said}"
        );
        assert!(
            said.contains("DATABASE_URL") && said.contains("One idemgate process per SQLite file"),
            "{what}: the refusal names the setting and the rule: {said}"
        );
        assert!(
            !said.contains(seal),
            "{what}: a secret of the holder's command line was quoted: {said}"
        );
    }
    let res = reserve(&first.base(), &key).await;
    assert_eq!(res.status(), 201, "the first one serves on");
    let stderr_first = {
        first.child.kill().unwrap();
        first.child.wait().unwrap();
        let mut s = String::new();
        std::io::Read::read_to_string(first.child.stderr.as_mut().unwrap(), &mut s).unwrap();
        s
    };
    assert!(!stderr_first.contains("panicked"), "{stderr_first}");

    // SIGKILL left the lock file behind; the kernel's lock went with the process.
    assert!(dir.path().join("idemgate.db.lock").exists());
    // (With the same seal key: without it the next would not find the
    // record, which is keyed, and refuses to start.)
    let next = Served::spawn(bare(dir.path()), &["--seal-key", seal]).await;
    let again = reserve(&next.base(), &key).await;
    assert_eq!(again.status(), 409, "the record outlived its first server");
}
