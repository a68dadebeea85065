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

/// A process started for a README section, killed on drop.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until `url` answers 200, or fails naming `what`.
async fn until_up(url: &str, what: &str, child: &mut std::process::Child) {
    let http = common::http();
    let started = std::time::Instant::now();
    loop {
        if let Ok(res) = http.get(url).send().await
            && res.status() == 200
        {
            return;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "{what} exited before it came up"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "{what} did not come up at {url}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_mcp_section_pasted_after_the_others_shows_one_charge_per_run() {
    let blocks = sh_blocks_in("## In front of an MCP server");
    let start = blocks[0];
    // Ports and a store file of its own (the walkthrough's serve holds 8080
    // and idemgate.db, the proxy quick start 8081 and 9090), and the binary
    // where the first command put it.
    assert!(
        start.contains("cargo run --release --bin idemgate-demo-mcp"),
        "{start}"
    );
    let door_line = start
        .lines()
        .skip_while(|l| !l.contains("./target/release/idemgate proxy"))
        .take_while(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    for part in [
        "DATABASE_URL=sqlite://mcp.db ./target/release/idemgate proxy --protocol mcp",
        "--upstream http://127.0.0.1:8000/mcp",
        "--listen 127.0.0.1:8082",
        "--admin-listen 127.0.0.1:9092",
    ] {
        assert!(door_line.contains(part), "{part:?} not in:\n{door_line}");
    }
    for taken in ["8080", "8081", "9090", "idemgate.db"] {
        assert!(!door_line.contains(taken), "{taken} in:\n{door_line}");
    }

    // The server and the door as README starts them, on free ports here.
    let dir = tempfile::tempdir().unwrap();
    let [server, door, admin] = [(); 3].map(|()| format!("127.0.0.1:{}", common::free_port()));
    let mut mcp = Running(
        std::process::Command::new(env!("CARGO_BIN_EXE_idemgate-demo-mcp"))
            .env("LISTEN", &server)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    until_up(
        &format!("http://{server}/charges"),
        "idemgate-demo-mcp",
        &mut mcp.0,
    )
    .await;
    let door_cmd = door_line
        .replace("./target/release/idemgate", common::bin::BIN)
        .replace("127.0.0.1:8000", &server)
        .replace("127.0.0.1:8082", &door)
        .replace("127.0.0.1:9092", &admin);
    let mut proxy = Running(
        std::process::Command::new("bash")
            .args(["-c", &format!("exec env {door_cmd}")])
            .current_dir(dir.path())
            .env_remove("IDEMGATE_CONFIG")
            .env_remove("IDEMGATE_PROTOCOL")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    until_up(
        &format!("http://{admin}/readyz"),
        "the MCP door",
        &mut proxy.0,
    )
    .await;
    assert!(dir.path().join("mcp.db").exists());

    let script = blocks[1]
        .replace("localhost:8082", &door)
        .replace("localhost:8000", &server);
    // Twice: a fresh key per run; the server's charge number goes on.
    for n in 1..=2 {
        let charge = format!("charged 500 eur: ch_{n}");
        common::bin::run_script_expecting(
            &script,
            &[
                r#""serverInfo":{"name":"idemgate-demo-mcp""#,
                r#""id":2,"#,
                charge.as_str(),
                r#""id":3,"#,
                charge.as_str(),
                r#""id":4,"#,
                r#""isError":true"#,
                "/key-reused",
                "\ncharges this run: 1\n",
            ],
        );
    }
    assert!(README.contains("# charges this run: 1\n"));
}

#[tokio::test]
async fn the_consoles_two_commands_leave_a_key_in_the_stuck_queue() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(common::bin::BIN);
    cmd.current_dir(dir.path())
        .env_remove("DATABASE_URL")
        .env_remove("IDEMGATE_TOKENS")
        .env_remove("IDEMGATE_ADMIN_TOKENS")
        .env_remove("IDEMGATE_CONFIG");
    let served = Served::spawn(cmd, &[]).await;
    let stuck = |body: &serde_json::Value| {
        body["keys"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|k| k["state"] == "unknown")
            .count()
    };
    let list = format!("{}/v1/admin/keys?state=stuck", served.base());
    let before: serde_json::Value = common::http()
        .get(&list)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stuck(&before), 0, "a fresh server's queue: {before}");

    let script = sh_blocks_in("## The operators' console")[0]
        .replace("localhost:8080", &format!("127.0.0.1:{}", served.port));
    common::bin::run_script_expecting(&script, &[r#""state":"reserved""#]);
    let after: serde_json::Value = common::http()
        .get(&list)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stuck(&after), 1, "after README's two commands: {after}");
    let page = common::http()
        .get(format!("{}/console", served.base()))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
}

/// The embedding snippet is lines of `examples/axum_app.rs`, which CI
/// builds and runs: each line of code in it (a trailing comment aside) is a
/// line of the example, so the snippet cannot claim what the example does
/// not do — it starts the pruning job, as the example does.
#[test]
fn the_embedding_snippet_is_lines_of_the_example() {
    let example = include_str!("../../examples/axum_app.rs");
    let from = README.find("## Embedding the layer").unwrap();
    let section = &README[from..];
    let start = section.find("```rust\n").expect("a rust block") + "```rust\n".len();
    let snippet = &section[start..start + section[start..].find("```").unwrap()];
    let lines: Vec<&str> = example.lines().map(str::trim).collect();
    let mut checked = 0;
    for line in snippet.lines() {
        let code = line.split("   //").next().unwrap().trim();
        if code.is_empty() || code.starts_with("//") {
            continue;
        }
        assert!(
            lines.contains(&code),
            "README's snippet line {code:?} is not in examples/axum_app.rs"
        );
        checked += 1;
    }
    assert!(checked > 10, "{snippet}");
    assert!(snippet.contains("idemgate::prune::run("), "{snippet}");
}
