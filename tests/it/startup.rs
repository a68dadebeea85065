//! What a command leaves behind when it fails, and what a reading command
//! never creates: a start refused for its address opens no store (so no new
//! SQLite file), and `keys` and `prune` on a SQLite file that is not there
//! say so, naming the path, and create neither it nor its lock file.

use std::process::Stdio;

use crate::common;

use common::bin::{Served, idemgate_at, refused};
use common::proxy::ProxyProcess;

/// `serve` and `proxy` on a port already taken: refused naming the
/// address, and the SQLite file they would have created is not there.
#[tokio::test]
async fn a_start_refused_for_its_address_creates_no_database() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let free = format!("127.0.0.1:{}", common::free_port());
    let dir = tempfile::tempdir().unwrap();
    for (name, args) in [
        ("serve.db", vec!["serve", "--listen", addr.as_str()]),
        (
            "proxy.db",
            vec![
                "proxy",
                "--upstream",
                "http://127.0.0.1:9",
                "--listen",
                addr.as_str(),
                "--admin-listen",
                free.as_str(),
            ],
        ),
        (
            "proxy-admin.db",
            vec![
                "proxy",
                "--upstream",
                "http://127.0.0.1:9",
                "--listen",
                free.as_str(),
                "--admin-listen",
                addr.as_str(),
            ],
        ),
    ] {
        let path = dir.path().join(name);
        let mut cmd = idemgate_at(&format!("sqlite://{}", path.display()));
        cmd.env_remove("IDEMGATE_CONFIG").args(&args);
        let said = refused(cmd).await;
        assert!(said.contains(&addr), "{args:?}: {said}");
        assert!(said.contains("cannot listen there"), "{args:?}: {said}");
        // What to do next: the setting to change, and that another process
        // holds the address.
        let flag =
            if args.last() == Some(&addr.as_str()) && args[args.len() - 2] == "--admin-listen" {
                "--admin-listen"
            } else {
                "--listen"
            };
        assert!(said.contains(flag), "{args:?}: {flag} not named: {said}");
        assert!(said.contains("another process listens"), "{args:?}: {said}");
        assert!(!said.contains("os error"), "{args:?}: {said}");
        assert!(!path.exists(), "{args:?} left {} behind", path.display());
    }
}

/// `keys list|show|resolve` and `prune` on a SQLite file that is not there
/// (a typo): an error naming the path; no file and no lock file created.
#[test]
fn reading_commands_never_create_a_sqlite_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgat.db");
    let url = format!("sqlite://{}", path.display());
    let hash = "ab".repeat(32);
    for args in [
        vec!["keys", "list"],
        vec!["keys", "show", "default", hash.as_str()],
        vec![
            "keys",
            "resolve",
            "default",
            hash.as_str(),
            "--release",
            "--reason",
            "typo",
        ],
        vec!["prune"],
    ] {
        let out = idemgate_at(&url)
            .env_remove("IDEMGATE_CONFIG")
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{args:?}: {stdout}{stderr}");
        assert!(!stdout.contains("No keys"), "{args:?}: {stdout}");
        assert!(
            stderr.contains(&format!("no SQLite database at {}", path.display())),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!path.exists(), "{args:?} created {}", path.display());
        let lock = dir.path().join("idemgat.db.lock");
        assert!(!lock.exists(), "{args:?} created {}", lock.display());
    }
}

/// `migrate`, `prune` and `keys list` on a PostgreSQL database already
/// migrated: no server NOTICE (`relation "_sqlx_migrations" already exists,
/// skipping`) on either stream.
#[tokio::test]
async fn postgres_commands_print_no_server_notice() {
    let db = common::pg::TestDb::new().await;
    for args in [
        vec!["migrate"],
        vec!["migrate"],
        vec!["prune"],
        vec!["keys", "list"],
    ] {
        let out = idemgate_at(&db.url)
            .env_remove("IDEMGATE_CONFIG")
            .args(&args)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{args:?}: {text}");
        assert!(!text.contains("already exists"), "{args:?}: {text}");
        assert!(!text.contains("skipping"), "{args:?}: {text}");
    }
}

/// Every command that prints ends quietly when its reader is gone (`| head`
/// closing early): no panic, no message, and the status a shell shows for a
/// Unix tool ended by SIGPIPE (141); `--help` and `--version` as clap ends
/// them (0).
#[tokio::test]
async fn a_reader_that_goes_away_ends_a_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("pipe.db").display());
    let migrated = idemgate_at(&url).arg("migrate").output().unwrap();
    assert!(migrated.status.success());
    for (args, code) in [
        (vec!["openapi"], 141),
        (vec!["keys", "list"], 141),
        (vec!["keys", "list", "--json"], 141),
        (vec!["keys", "list", "--state", "unknown"], 141),
        (vec!["--help"], 0),
        (vec!["keys", "--help"], 0),
        (vec!["--version"], 0),
    ] {
        let mut child = idemgate_at(&url)
            .env_remove("IDEMGATE_CONFIG")
            .env("RUST_BACKTRACE", "1")
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader is gone before the command writes a byte.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(!stderr.contains("error"), "{args:?}: {stderr}");
    }
}

/// Claims keys of `tenant` with these hashes in the store at `url` (the
/// store closed again, so that the command can open a SQLite file).
async fn claim_hashes(url: &str, tenant: &str, hashes: &[[u8; 32]]) {
    let args: idemgate::server::config::StoreArgs =
        common::bin::parse_args(&["--database-url", url]);
    let store = idemgate::server::open::open_store(&args, true)
        .await
        .unwrap();
    for hash in hashes {
        let claimed = store
            .reserve(&idemgate::store::ClaimRequest {
                on_lease_expiry: idemgate::store::LeaseExpiry::Hold,
                tenant: tenant.into(),
                key_hash: *hash,
                fingerprint: None,
                reservation_id: uuid::Uuid::new_v4(),
                lease_seconds: 1,
                ttl_seconds: 3600,
                max_in_flight: None,
                request: None,
            })
            .await
            .unwrap();
        assert!(claimed.is_some_and(|c| c.claimed));
    }
    drop(store);
    // The SQLite file lock goes with the last handle.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
}

/// `keys show` and `keys resolve` take a unique prefix of a key hash (at
/// least 8 hex digits, as `keys list` shows 12), on both stores; an
/// ambiguous one lists its matches, a short one and one that matches
/// nothing are clear errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_show_and_resolve_take_a_unique_prefix_of_the_key_hash() {
    let pg = common::pg::TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite://{}", dir.path().join("prefix.db").display());
    let mut a = [0x11u8; 32];
    a[..4].copy_from_slice(&[0xab, 0xcd, 0xef, 0x01]);
    let mut b = a;
    b[4] = 0x22;
    let mut c = [0x33u8; 32];
    c[..4].copy_from_slice(&[0xab, 0xcd, 0xef, 0x02]);
    let (a_hex, b_hex, c_hex) = (hex::encode(a), hex::encode(b), hex::encode(c));
    for url in [pg.url.clone(), sqlite] {
        claim_hashes(&url, "acme", &[a, b, c]).await;
        // Leases of 1 s under hold: unknown, and so resolvable, after it.
        tokio::time::sleep(std::time::Duration::from_millis(1_300)).await;
        let run = |args: &[&str]| {
            let out = common::bin::keys(&url, args);
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        };
        let (ok, out, err) = run(&["show", "acme", &c_hex[..12]]);
        assert!(ok && out.contains(&c_hex), "{url}: {out}{err}");
        let (ok, out, err) = run(&["show", "acme", &a_hex[..10].to_uppercase()]);
        assert!(ok && out.contains(&a_hex), "{url}: {out}{err}");
        let (ok, _, err) = run(&["show", "acme", &a_hex[..8]]);
        assert!(!ok && err.contains("ambiguous"), "{url}: {err}");
        assert!(err.contains(&a_hex) && err.contains(&b_hex), "{url}: {err}");
        assert!(!err.contains(&c_hex), "{url}: {err}");
        let (ok, _, err) = run(&["show", "acme", &a_hex[..7]]);
        assert!(!ok && err.contains("at least 8"), "{url}: {err}");
        let (ok, _, err) = run(&["show", "acme", "0123456789ab"]);
        assert!(
            !ok && err.contains("no key whose hash starts with"),
            "{url}: {err}"
        );
        // Another tenant's keys are not matched.
        let (ok, _, err) = run(&["show", "globex", &c_hex[..12]]);
        assert!(!ok && err.contains("not-found"), "{url}: {err}");
        let (ok, out, err) = run(&[
            "resolve",
            "acme",
            &b_hex[..12],
            "--release",
            "--reason",
            "nothing happened",
        ]);
        assert!(ok && out.contains("Released"), "{url}: {out}{err}");
        assert!(out.contains(&b_hex), "{url}: {out}");
        // Now a's prefix of 8 is unique.
        let (ok, out, err) = run(&["show", "acme", &a_hex[..8]]);
        assert!(ok && out.contains(&a_hex), "{url}: {out}{err}");
    }
}

/// A command whose standard error is read by a reader gone away (`2>&1 |
/// head` closing early) ends as it would have, without a panic (101):
/// `migrate` and `prune` report on stderr, a refusal says why there, and
/// `keys show` prints a key into a stdout already closed.
#[tokio::test]
async fn a_reader_of_standard_error_that_goes_away_ends_a_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("stderr.db").display());
    let mut hash = [0x44u8; 32];
    hash[0] = 0xfe;
    claim_hashes(&url, "acme", &[hash]).await;
    let hex_hash = hex::encode(hash);
    let missing = "ab".repeat(32);
    for (args, stdout_closed, code) in [
        (vec!["migrate"], false, 0),
        (vec!["--log-format", "json", "migrate"], false, 0),
        (vec!["prune"], false, 0),
        (vec!["keys", "show", "acme", missing.as_str()], false, 1),
        (vec!["keys", "show", "acme", &hex_hash[..12]], true, 141),
        (vec!["keys", "show", "acme", hex_hash.as_str()], true, 141),
        (vec!["no-such-command"], false, 2),
        (vec!["serve", "--listen", "nowhere"], false, 2),
    ] {
        let mut child = idemgate_at(&url)
            .env_remove("IDEMGATE_CONFIG")
            .env("RUST_BACKTRACE", "1")
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stderr.take());
        if stdout_closed {
            drop(child.stdout.take());
        }
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stdout}");
        assert!(!stdout.contains("panicked"), "{args:?}: {stdout}");
    }
}

/// The start-up log line of `child` (stderr piped) that says `what` is
/// listening, once it is written.
async fn listening_line(child: &mut std::process::Child, what: &str) -> String {
    let log = common::bin::drain_stderr(child);
    let said = |log: &std::sync::Mutex<String>| {
        log.lock()
            .unwrap()
            .lines()
            .find(|l| l.contains(what))
            .map(str::to_owned)
    };
    assert!(
        common::until(std::time::Duration::from_secs(10), || said(&log).is_some()).await,
        "no {what:?} line in:\n{}",
        log.lock().unwrap()
    );
    said(&log).unwrap()
}

/// `serve` and `proxy` say at start where the console is (serve's listener,
/// the proxy's admin listener) and the docs (serve), which database they
/// opened (a SQLite file's path; a PostgreSQL URL with its password
/// masked), and what became of its migrations: applied, already current, or
/// skipped by --no-migrate.
#[tokio::test]
async fn the_start_says_where_the_console_is_and_which_database_it_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("start.db");
    let url = format!("sqlite://{}", path.display());
    let database = format!("database=\"{}\"", path.display());
    for (extra, migrations) in [
        (&[][..], "applied "),
        (&[][..], "already current"),
        (
            &["--no-migrate"][..],
            "not migrated at start (--no-migrate)",
        ),
    ] {
        let mut served = Served::spawn(idemgate_at(&url), extra).await;
        let line = listening_line(&mut served.child, "idemgate serve is listening").await;
        let base = served.base();
        for want in [
            format!("console={base}/console"),
            format!("docs={base}/docs"),
            database.clone(),
            format!("migrations=\"{migrations}"),
        ] {
            assert!(
                line.contains(&want),
                "{extra:?}: {want} missing from: {line}"
            );
        }
    }

    let pg = common::pg::TestDb::new().await;
    // The test server trusts its clients: a password in the URL is sent
    // and ignored (one it needs already is there, and is the secret).
    let mut parsed = reqwest::Url::parse(&pg.url).unwrap();
    if parsed.password().is_none() {
        parsed.set_password(Some("s3cret-pw")).unwrap();
    }
    let secret = parsed.password().unwrap().to_owned();
    let with_password = parsed.to_string();
    let mut proxy = ProxyProcess::start_at(&with_password, "http://127.0.0.1:9", &[]).await;
    let line = listening_line(&mut proxy.child, "idemgate proxy is listening").await;
    let masked = with_password.replace(&format!(":{secret}@"), ":***@");
    for want in [
        format!("console=http://127.0.0.1:{}/console", proxy.admin),
        format!("database=\"{masked}\""),
        "migrations=\"applied ".to_owned(),
    ] {
        assert!(line.contains(&want), "{want} missing from: {line}");
    }
    assert!(!line.contains(&secret), "{line}");
}
