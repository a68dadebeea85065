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

/// The ```sh blocks of the section under `heading`, up to the next `## `.
fn sh_blocks_in(heading: &str) -> Vec<&'static str> {
    let from = README.find(heading).expect("heading in README") + heading.len();
    let section = &README[from..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    section
        .split("```sh\n")
        .skip(1)
        .map(|b| &b[..b.find("```").expect("the block ends")])
        .collect()
}

/// The demo origin (`idemgate-demo-origin`), killed on drop.
struct Origin(std::process::Child);

impl Drop for Origin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_proxy_quick_start_pasted_twice_shows_one_charge_per_run() {
    // As a newcomer runs it: the demo origin, and the proxy in front of it
    // on a SQLite file of its own (on free ports here, not 3000 and 8081).
    let blocks = sh_blocks_in("## Reverse proxy");
    assert!(
        blocks[0].contains("--bin idemgate-demo-origin"),
        "{}",
        blocks[0]
    );
    assert!(
        blocks[0].contains("DATABASE_URL=sqlite://proxy.db")
            && blocks[0].contains("proxy --upstream http://127.0.0.1:3000"),
        "{}",
        blocks[0]
    );
    let dir = tempfile::tempdir().unwrap();
    let origin_addr = format!("127.0.0.1:{}", common::free_port());
    let _origin = Origin(
        std::process::Command::new(env!("CARGO_BIN_EXE_idemgate-demo-origin"))
            .env("LISTEN", &origin_addr)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let started = std::time::Instant::now();
    while std::net::TcpStream::connect(&origin_addr).is_err() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "the demo origin did not come up on {origin_addr}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let db = format!("sqlite://{}", dir.path().join("proxy.db").display());
    let proxy =
        common::proxy::ProxyProcess::start_at(&db, &format!("http://{origin_addr}"), &[]).await;

    let script = blocks[1]
        .replace("localhost:8081", &format!("127.0.0.1:{}", proxy.port))
        .replace("localhost:3000", &origin_addr);
    for n in 1..=2 {
        let charge = format!(r#""charge":"ch_{n}""#);
        common::bin::run_script_expecting(
            &script,
            &[
                "HTTP/1.1 201 Created",
                charge.as_str(),
                "idempotent-replayed: true",
                charge.as_str(),
                "HTTP/1.1 422 Unprocessable Entity",
                "\ncharges this run: 1\n",
            ],
        );
    }
    assert!(README.contains("# charges this run: 1\n"));
}
