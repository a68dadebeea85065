//! The real thing: a server on a real socket (port 0), and the `idemgate`
//! binary itself — protected mode, subcommands, SIGTERM.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::app::{TestApp, fresh_key};
use common::bin::{Served, idemgate};
use common::pg::TestDb;
use idemgate::server::{api, serve};
use tokio::net::TcpListener;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_socket_and_graceful_shutdown() {
    let db = TestDb::new().await;
    let app = TestApp::new(&db.url, &[]).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve::serve(
        listener,
        app.router.clone(),
        serve::Serving {
            grace: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(75),
        },
        async move {
            let _ = stop_rx.await;
        },
    ));
    let http = common::http();
    let base = format!("http://{addr}");
    let key = fresh_key();
    let reserved = http
        .post(format!("{base}/v1/reservations"))
        .header("Idempotency-Key", format!("\"{key}\""))
        .send()
        .await
        .unwrap();
    assert_eq!(reserved.status(), 201);
    let id = reserved.json::<serde_json::Value>().await.unwrap()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();

    // A duplicate waits on the socket while the server is told to stop.
    let waiter = {
        let http = http.clone();
        let url = format!("{base}/v1/reservations");
        let key = key.clone();
        tokio::spawn(async move {
            http.post(url)
                .header("Idempotency-Key", key)
                .header("Prefer", "wait=5")
                .send()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop_tx.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The listener is closed at once ...
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "new connections are refused during shutdown"
    );
    // ... while the request in flight still finishes, with the replay.
    let commit = app
        .act(&id, "commit", r#"{"status":200,"body":"ok"}"#)
        .await;
    assert_eq!(commit.status, 200);
    let res = waiter
        .await
        .unwrap()
        .expect("the in-flight request completes");
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["idempotent-replayed"], "true");
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn protected_mode_refuses_a_public_bind_without_tokens() {
    let db = TestDb::new().await;
    let out = idemgate(&db)
        .args(["serve", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("IDEMGATE_TOKENS"), "{stderr}");
    assert!(stderr.contains("protected mode"), "{stderr}");
}

#[tokio::test]
async fn bad_settings_fail_fast_naming_the_setting() {
    let db = TestDb::new().await;
    for (var, value) in [
        ("IDEMGATE_KEY_FORMAT", "ulid"),
        ("IDEMGATE_TOKENS", "no-colon"),
        ("IDEMGATE_FINGERPRINT_IGNORE", "no-slash"),
        ("IDEMGATE_MAX_BODY_BYTES", "lots"),
        ("DATABASE_URL", "mysql://x"),
        ("IDEMGATE_LOG_FORMAT", "xml"),
    ] {
        let out = idemgate(&db).arg("serve").env(var, value).output().unwrap();
        assert!(!out.status.success(), "{var}={value} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let named = stderr.contains(var)
            || stderr.contains(
                &var.trim_start_matches("IDEMGATE_")
                    .to_lowercase()
                    .replace('_', "-"),
            );
        assert!(named, "{var}: {stderr}");
    }
    let out = idemgate(&db)
        .args(["serve", "--default-lease", "7200", "--max-lease", "3600"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    // Two values set at odds: named as they were set, the flags with their values.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--default-lease 7200"), "{stderr}");
    assert!(stderr.contains("--max-lease 3600"), "{stderr}");
}

#[tokio::test]
async fn help_migrate_prune_and_openapi_subcommands() {
    let db = TestDb::new().await;
    let help = idemgate(&db)
        .env("IDEMGATE_TOKENS", "acme:help-must-not-show-this")
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let secret_help = String::from_utf8_lossy(&help.stdout);
    assert!(
        !secret_help.contains("help-must-not-show-this"),
        "a token in --help"
    );
    assert!(
        !secret_help.contains(&db.url),
        "the database URL (and its password) in --help"
    );
    let help = String::from_utf8_lossy(&help.stdout);
    for word in [
        "IDEMGATE_TOKENS",
        "IDEMGATE_LISTEN",
        "DATABASE_URL",
        "IDEMGATE_MAX_WAIT",
    ] {
        assert!(help.contains(word), "serve --help lacks {word}");
    }
    for sub in ["migrate", "prune", "openapi"] {
        let out = idemgate(&db).args([sub, "--help"]).output().unwrap();
        assert!(out.status.success(), "{sub} --help");
    }
    let migrate = idemgate(&db).arg("migrate").output().unwrap();
    assert!(
        migrate.status.success(),
        "{}",
        String::from_utf8_lossy(&migrate.stderr)
    );
    let prune = idemgate(&db).arg("prune").output().unwrap();
    assert!(prune.status.success());
    assert!(String::from_utf8_lossy(&prune.stderr).contains("pruned 0 expired"));
    let spec = idemgate(&db).arg("openapi").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&spec.stdout), api::openapi_json());

    // Failures say what failed: the path that cannot be written, and why the
    // database cannot be reached (not only that a pool timed out).
    let out = idemgate(&db)
        .args(["openapi", "-o", "/nonexistent-dir/openapi.json"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent-dir/openapi.json"));
    let down = idemgate(&db)
        .args(["migrate", "--db-acquire-timeout", "1"])
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nothing")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&down.stderr);
    assert!(!down.status.success());
    assert!(said.contains("cannot connect to the database: "), "{said}");
}

#[tokio::test]
async fn the_binary_serves_and_exits_zero_on_sigterm() {
    let db = TestDb::new().await;
    let mut served = Served::start(&db, &[]).await;
    let http = common::http();
    let base = served.base();
    let key = fresh_key();
    let res = http
        .post(format!("{base}/v1/reservations"))
        .header("Idempotency-Key", &key)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let kill = Command::new("kill")
        .args(["-TERM", &served.child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = served.child.wait().unwrap();
    assert!(status.success(), "exit status {status:?}");
    let mut stderr = String::new();
    std::io::Read::read_to_string(served.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("stopped"), "{stderr}");
    assert!(!stderr.contains(&key), "the raw key was logged");
}
