//! The README tells the truth: its walkthrough, run as written against a
//! real `idemgate serve`, shows what it says it shows.

use crate::common;

use common::bin::Served;
use common::pg::TestDb;

const README: &str = include_str!("../../README.md");

/// The first ```sh block after `heading`.
fn sh_block_after(heading: &str) -> &'static str {
    let from = README.find(heading).expect("heading in README");
    let rest = &README[from..];
    let start = rest.find("```sh\n").expect("an sh block") + "```sh\n".len();
    let len = rest[start..].find("```").expect("the block ends");
    &rest[start..start + len]
}

#[test]
fn readme_opens_with_the_run_and_test_commands() {
    let first = sh_block_after("# idemgate");
    let lines: Vec<&str> = first.lines().collect();
    assert_eq!(lines.len(), 2, "{first}");
    assert!(lines[0].contains("cargo run --release -- serve"));
    assert!(lines[1].starts_with("cargo test "));
    let ci = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/.ci/run")).unwrap();
    assert!(
        ci.lines()
            .any(|l| l.trim() == "cargo test" || l.starts_with("cargo test 2>&1 |")),
        "CI runs the README's test command"
    );
}

async fn run_walkthrough(served: &Served) {
    let script = sh_block_after("## Walkthrough")
        .replace("localhost:8080", &format!("127.0.0.1:{}", served.port));
    let expected = [
        "HTTP/1.1 201 Created",
        "idempotency-expires: ",
        "\"attempt\":1",
        "HTTP/1.1 409 Conflict",
        "retry-after: ",
        "/request-in-flight",
        "\"state\":\"completed\"",
        "idempotent-replayed: true",
        "ch_1001",
        "HTTP/1.1 422 Unprocessable Entity",
        "/key-reused",
    ];
    // Twice: the walkthrough takes a fresh key per run, so it can be rerun.
    common::bin::run_script_expecting(&script, &expected);
    common::bin::run_script_expecting(&script, &expected);
}

#[tokio::test]
async fn the_walkthrough_works_as_written_on_postgres() {
    let db = TestDb::new().await;
    run_walkthrough(&Served::start(&db, &[]).await).await;
}

#[tokio::test]
async fn the_walkthrough_works_as_written_on_the_default_store() {
    // The README's first command as a newcomer runs it: no DATABASE_URL.
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(common::bin::BIN);
    cmd.current_dir(dir.path())
        .env_remove("DATABASE_URL")
        .env_remove("IDEMGATE_TOKENS")
        .env_remove("IDEMGATE_CONFIG");
    run_walkthrough(&Served::spawn(cmd, &[]).await).await;
    assert!(dir.path().join("idemgate.db").exists());
}
