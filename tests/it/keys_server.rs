//! `idemgate keys --server URL` (docs/operations.md, “The command line and the
//! endpoints”): the operators' commands through a running idemgate's admin
//! endpoints, the way to reach a SQLite file that a running `serve` or `proxy`
//! holds; and the refusal of that file, which says the exact command that
//! works.

use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::common;
use common::bin::{Served, idemgate_at};

/// What the stuck keys' caller calls them (the reserve's `label`).
const LABEL: &str = "order 1042";

/// A key of tenant `default` held unknown on `served`: reserved under
/// `hold` with a one-second lease that has run out. Its hash.
async fn stuck_key(served: &Served, token: Option<&str>) -> String {
    let key = common::app::fresh_key();
    let mut req = common::http()
        .post(format!("{}/v1/reservations", served.base()))
        .header("idempotency-key", format!("\"{key}\""))
        .json(
            &json!({ "lease_seconds": 1, "on_lease_expiry": "hold", "label": LABEL,
            "request": { "method": "POST", "path": "/charges", "body": { "amount": 5 } } }),
        );
    if let Some(token) = token {
        req = req.bearer_auth(token);
    }
    let res = req.send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

fn run(mut cmd: Command) -> (bool, String, String) {
    let out = cmd.output().expect("idemgate keys runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The words of a shell command as `keys` prints them: split on spaces,
/// with single-quoted words kept whole.
fn words(command: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    for c in command.chars() {
        match c {
            '\'' => quoted = !quoted,
            ' ' if !quoted => words.push(std::mem::take(&mut word)),
            c => word.push(c),
        }
    }
    words.push(word);
    words
}

#[tokio::test]
async fn a_held_sqlite_file_names_the_server_command_that_works_and_it_does() {
    let dir = tempfile::tempdir().unwrap();
    let url = common::backend::Backend::sqlite_url(&dir);
    let served = Served::spawn(idemgate_at(&url), &[]).await;
    let hash = stuck_key(&served, None).await;

    // The file is held: the refusal says the command to run instead, with
    // the URL the running serve announced.
    let mut direct = idemgate_at(&url);
    direct.args(["keys", "list", "--state", "stuck", "--database-url", &url]);
    let (ok, _, stderr) = run(direct);
    assert!(!ok, "the held file must be refused");
    let want = format!(
        "idemgate keys list --state stuck --server {}",
        served.base()
    );
    assert!(stderr.contains(&want), "{want:?} not in: {stderr}");

    // That command, as printed, lists the stuck key.
    let suggested = &stderr[stderr.find(&want).unwrap()..][..want.len()];
    let words = words(suggested);
    let mut cmd = idemgate_at(&url);
    cmd.args(&words[1..]);
    let (ok, stdout, stderr) = run(cmd);
    assert!(ok, "{stderr}");
    assert!(stdout.contains(&hash[..12]), "{stdout}");
    assert!(stdout.contains("unknown"), "{stdout}");
    assert!(
        stdout.contains(&format!("POST /charges · {LABEL}")),
        "the label beside the request: {stdout}"
    );

    // show by prefix, in words and as JSON, and resolve, through the server.
    let mut show = idemgate_at(&url);
    show.args([
        "keys",
        "show",
        "default",
        &hash[..10],
        "--server",
        &served.base(),
    ]);
    let (ok, stdout, stderr) = run(show);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("request         POST /charges"), "{stdout}");
    assert!(
        stdout.contains(&format!("label           {LABEL}")),
        "{stdout}"
    );
    let mut show = idemgate_at(&url);
    show.args([
        "keys",
        "show",
        "default",
        &hash[..10],
        "--server",
        &served.base(),
        "--json",
    ]);
    let (ok, stdout, stderr) = run(show);
    assert!(ok, "{stderr}");
    let view: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(view["key_hash"], hash);
    assert_eq!(view["state"], "unknown");
    assert_eq!(view["label"], LABEL);

    let mut resolve = idemgate_at(&url);
    resolve.args([
        "keys",
        "resolve",
        "default",
        &hash[..10],
        "--release",
        "--reason",
        "never charged",
        "--server",
        &served.base(),
    ]);
    let (ok, stdout, stderr) = run(resolve);
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with("Released"), "{stdout}");
    assert!(
        stdout.contains("(by loopback)"),
        "the server's name for the operator: {stdout}"
    );

    let mut again = idemgate_at(&url);
    again.args([
        "keys",
        "list",
        "--state",
        "stuck",
        "--server",
        &served.base(),
    ]);
    let (ok, stdout, stderr) = run(again);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("No key waits for a person."), "{stdout}");
}

#[tokio::test]
async fn a_server_with_admin_tokens_takes_the_token_and_refuses_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = common::backend::Backend::sqlite_url(&dir);
    let mut cmd = idemgate_at(&url);
    cmd.env("IDEMGATE_ADMIN_TOKENS", "alice:op-secret-1")
        .env("IDEMGATE_TOKENS", "acme:tenant-secret-1");
    let served = Served::spawn(cmd, &[]).await;
    let _hash = stuck_key(&served, Some("tenant-secret-1")).await;

    let list = |token: Option<&str>| {
        let mut cmd = idemgate_at(&url);
        cmd.args([
            "keys",
            "list",
            "--state",
            "stuck",
            "--server",
            &served.base(),
        ]);
        cmd.env_remove("IDEMGATE_ADMIN_TOKEN");
        if let Some(token) = token {
            cmd.env("IDEMGATE_ADMIN_TOKEN", token);
        }
        run(cmd)
    };
    let (ok, _, stderr) = list(None);
    assert!(!ok);
    assert!(stderr.contains("unauthorized"), "{stderr}");
    let (ok, _, stderr) = list(Some("tenant-secret-1"));
    assert!(!ok, "a tenant's token is never an operator's");
    assert!(stderr.contains("forbidden"), "{stderr}");
    assert!(
        !stderr.contains("tenant-secret-1"),
        "no token is printed: {stderr}"
    );
    let (ok, stdout, stderr) = list(Some("op-secret-1"));
    assert!(ok, "{stderr}");
    assert!(stdout.contains("acme"), "{stdout}");
    assert!(!stdout.contains("op-secret-1") && !stderr.contains("op-secret-1"));

    // Nothing listens there: the message says what was asked.
    let mut gone = idemgate_at(&url);
    let port = common::free_port();
    gone.args([
        "keys",
        "list",
        "--server",
        &format!("http://127.0.0.1:{port}"),
    ]);
    let (ok, _, stderr) = run(gone);
    assert!(!ok);
    assert!(
        stderr.contains(&format!("cannot reach http://127.0.0.1:{port}")),
        "{stderr}"
    );
}
