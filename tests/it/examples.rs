//! The examples run as README says: the proxy quick start's origin and the
//! layer example can run at once (3000 and 3001), and an address already in
//! use is a message that names it (the MCP server's too), not a bare
//! "Address already in use".

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// An example binary `cargo test` built beside this test (a plain
/// `cargo test` builds the examples; `cargo test --test it examples::` alone does
/// not, so run `cargo build --examples` first then). The origin and the MCP
/// server are the bins `idemgate-demo-origin` and `idemgate-demo-mcp`, which
/// cargo always builds for the tests.
fn example(name: &str) -> PathBuf {
    if name == "origin" {
        return PathBuf::from(env!("CARGO_BIN_EXE_idemgate-demo-origin"));
    }
    if name == "mcp_server" {
        return PathBuf::from(env!("CARGO_BIN_EXE_idemgate-demo-mcp"));
    }
    let exe = std::env::current_exe().unwrap();
    let debug = exe.parent().and_then(|deps| deps.parent()).unwrap();
    debug.join("examples").join(name)
}

fn free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

#[test]
fn an_address_in_use_is_named() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    for name in ["origin", "mcp_server", "axum_app"] {
        let path = example(name);
        assert!(
            path.exists(),
            "{} is not built: cargo build --examples",
            path.display()
        );
        let out = Command::new(path)
            .env("LISTEN", &addr)
            .env("TMPDIR", dir.path())
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} started on a taken address");
        assert!(
            stderr.contains(&format!("cannot listen on {addr}")) && stderr.contains("LISTEN="),
            "{name}: {stderr}"
        );
    }
}

#[test]
fn both_examples_run_at_once_on_their_default_ports() {
    if !free(3000) || !free(3001) {
        eprintln!("ports 3000 and 3001 are not both free here; only the taken-address test ran");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut children = Children(
        ["origin", "axum_app"]
            .iter()
            .map(|name| {
                Command::new(example(name))
                    .env_remove("LISTEN")
                    .env("TMPDIR", dir.path())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect(),
    );
    let started = Instant::now();
    let up = |port: u16| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
    while !(up(3000) && up(3001)) {
        for child in &mut children.0 {
            assert!(child.try_wait().unwrap().is_none(), "an example exited");
        }
        assert!(started.elapsed() < Duration::from_secs(20), "not both up");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Killed on drop, also when an assertion fails.
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
