//! A database that is there but not set up for idemgate — a PostgreSQL
//! database not created yet, a role the server does not know, tables not
//! migrated, on SQLite a file without the tables — cannot serve, and is no
//! bug either: every door answers `503 store-unavailable` (never a 500),
//! `/readyz` answers 503, one WARN line says what is wrong and what to do,
//! a start that migrates refuses with the same words (without sqlx's "at line
//! N" noise and without the password), and the server recovers by itself
//! once the step is taken.
//!
//! Real PostgreSQL (a database of the test server, created and dropped by
//! the test), real SQLite files, the real binary.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::bin::{drain_stderr, free_port, idemgate_at, refused};
use common::pg::{TestDb, admin_url};
use sqlx::{AssertSqlSafe, Connection as _};

/// A password in `DATABASE_URL` that must never be printed (the test
/// server trusts every local connection, so it is never checked).
const PASSWORD: &str = "pw-never-printed-5e7c";

/// A role the test server does not have.
const NO_SUCH_ROLE: &str = "idemgate_no_such_role";

/// `url` with its user info replaced by `user:PASSWORD`.
fn with_user(url: &str, user: &str) -> String {
    let start = url.find("://").expect("a URL") + 3;
    let rest = &url[start..];
    let host = rest.find('@').map_or(rest, |at| &rest[at + 1..]);
    format!("{}{user}:{PASSWORD}@{host}", &url[..start])
}

/// `url` with a password added to its user.
fn with_password(url: &str) -> String {
    let start = url.find("://").expect("a URL") + 3;
    let rest = &url[start..];
    let at = rest.find('@').expect("a user in the test URL");
    let user = rest[..at].split(':').next().unwrap_or_default();
    with_user(url, user)
}

/// Runs one statement on the admin connection of the test server.
async fn admin(sql: String) {
    let mut conn = sqlx::PgConnection::connect(&admin_url().await)
        .await
        .expect("admin connection");
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
        .expect("admin statement");
    let _ = conn.close().await;
}

/// A database name of the test server that does not exist (yet): a
/// [`TestDb`] dropped at once, so that its guard drops whatever the test
/// creates under that name.
async fn missing_database() -> TestDb {
    let db = TestDb::new().await;
    admin(format!("DROP DATABASE \"{}\" WITH (FORCE)", db.name)).await;
    db
}

/// `idemgate` over `url`, pruning off (its pass would log the same cause
/// once more, on its own schedule).
fn idemgate(url: &str) -> Command {
    let mut cmd = idemgate_at(url);
    cmd.env_remove("IDEMGATE_CONFIG")
        .env("IDEMGATE_PRUNE_INTERVAL", "0");
    cmd
}

/// A refusal or a log that says `cause`, without noise or secrets.
#[track_caller]
fn says_plainly(text: &str, cause: &[&str]) {
    for want in cause {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    assert!(
        !text.contains(" at line "),
        "sqlx's location noise:\n{text}"
    );
    assert!(
        !text.contains(PASSWORD),
        "the password was printed:\n{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
}

/// `idemgate serve --no-migrate` on a free port, up (`/healthz`) though
/// its database cannot serve; killed on drop.
struct Server {
    child: Child,
    base: String,
    log: Arc<Mutex<String>>,
    http: reqwest::Client,
}

impl Server {
    async fn start(mut cmd: Command) -> Server {
        let port = free_port();
        let mut child = cmd
            .args([
                "serve",
                "--no-migrate",
                "--listen",
                &format!("127.0.0.1:{port}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = drain_stderr(&mut child);
        let server = Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            log,
            http: common::http(),
        };
        let started = Instant::now();
        loop {
            if let Ok(res) = server.http.get(server.url("/healthz")).send().await
                && res.status() == 200
            {
                return server;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "idemgate serve did not come up:\n{}",
                server.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// `POST /v1/reservations` with a fresh key: status and body.
    async fn reserve(&self) -> (u16, reqwest::header::HeaderMap, serde_json::Value) {
        let res = self
            .http
            .post(self.url("/v1/reservations"))
            .header("Idempotency-Key", uuid::Uuid::new_v4().to_string())
            .body(r#"{"fingerprint":"f"}"#)
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        let body = res.json().await.unwrap_or_default();
        (status, headers, body)
    }

    async fn get(&self, path: &str) -> (u16, serde_json::Value) {
        let res = self.http.get(self.url(path)).send().await.unwrap();
        let status = res.status().as_u16();
        (status, res.json().await.unwrap_or_default())
    }

    /// Every door answers `503 store-unavailable`: a reservation (with
    /// `Retry-After`), a commit and a look-up by id, and `/readyz`.
    async fn assert_unavailable(&self) {
        let (status, headers, body) = self.reserve().await;
        assert_eq!(status, 503, "reservation: {body}\n{}", self.log());
        assert_problem(&body, "store-unavailable");
        assert!(headers.contains_key("retry-after"), "{headers:?}");
        assert!(body["retry_after_seconds"].as_u64().is_some_and(|s| s >= 1));
        let id = uuid::Uuid::new_v4();
        let res = self
            .http
            .post(self.url(&format!("/v1/reservations/{id}/commit")))
            .body(r#"{"status":200}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 503, "commit");
        assert_problem(&res.json().await.unwrap(), "store-unavailable");
        let (status, body) = self.get(&format!("/v1/reservations/{id}")).await;
        assert_eq!(status, 503, "look-up: {body}");
        assert_problem(&body, "store-unavailable");
        let (status, body) = self.get("/readyz").await;
        assert_eq!(status, 503, "/readyz: {body}\n{}", self.log());
        assert_problem(&body, "store-unavailable");
    }

    /// Waits up to 5 s for the log to hold `text`.
    async fn logged(&self, text: &str) -> String {
        let started = Instant::now();
        loop {
            let log = self.log();
            if log.contains(text) {
                return log;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{text:?} never logged:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Nothing was a 500, nothing panicked.
    fn assert_no_internal_error(&self) {
        let log = self.log();
        assert!(!log.contains("internal error"), "{log}");
        assert!(!log.contains("500 Internal"), "{log}");
        assert!(!log.contains("panicked"), "{log}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[track_caller]
fn assert_problem(body: &serde_json::Value, slug: &str) {
    let ty = body["type"].as_str().unwrap_or_default();
    assert!(ty.ends_with(&format!("/{slug}")), "not {slug}: {body}");
    assert!(
        body["title"].is_string() && body["detail"].is_string(),
        "{body}"
    );
}

/// A PostgreSQL database that does not exist: `serve` (which migrates at
/// start) and `migrate` refuse, saying so and how to create it.
#[tokio::test]
async fn a_missing_database_refuses_to_start_saying_createdb() {
    let db = missing_database().await;
    let url = with_password(&db.url);
    let create = format!("createdb {}", db.name);
    let missing = format!("database \"{}\" does not exist", db.name);
    let port = free_port().to_string();
    let mut serve = idemgate(&url);
    serve.args(["serve", "--listen", &format!("127.0.0.1:{port}")]);
    let mut migrate = idemgate(&url);
    migrate.arg("migrate");
    for (what, cmd) in [("serve", serve), ("migrate", migrate)] {
        let said = refused(cmd).await;
        says_plainly(
            &said,
            &["DATABASE_URL", &missing, &create, "idemgate migrate"],
        );
        assert!(
            !said.contains("is it running"),
            "{what}: a missing database is not an unreachable server: {said}"
        );
    }
}

/// The library's error for a missing database: unavailable (it heals once
/// the database is created), a message that says so, and the database's own
/// error kept underneath, for an embedder that inspects it.
#[tokio::test]
async fn a_store_error_keeps_the_databases_error_as_its_source() {
    let db = missing_database().await;
    let store =
        idemgate::store::PgStore::connect_lazy(&db.url, &Default::default()).expect("a lazy store");
    let err = idemgate::store::Maintenance::ping(&store)
        .await
        .expect_err("the database does not exist");
    assert!(err.is_unavailable(), "{err}");
    assert!(err.to_string().contains("does not exist"), "{err}");
    let source = std::error::Error::source(&err).expect("the cause is kept");
    let sqlx = source
        .downcast_ref::<sqlx::Error>()
        .unwrap_or_else(|| panic!("not an sqlx::Error: {source:?}"));
    let code = sqlx.as_database_error().and_then(|d| d.code());
    assert_eq!(code.as_deref(), Some("3D000"), "{sqlx}");
}

/// `serve --no-migrate` over a database that does not exist refuses to
/// start, naming the database and what to run, instead of answering every
/// request 503.
#[tokio::test]
async fn no_migrate_over_a_missing_database_refuses_to_start() {
    let db = missing_database().await;
    let url = with_password(&db.url);
    let port = free_port().to_string();
    let mut serve = idemgate(&url);
    serve.args([
        "serve",
        "--no-migrate",
        "--listen",
        &format!("127.0.0.1:{port}"),
    ]);
    let said = refused(serve).await;
    says_plainly(
        &said,
        &[
            &format!("database \"{}\" does not exist", db.name),
            "--no-migrate",
            "idemgate migrate",
        ],
    );
}

/// `serve --no-migrate` and `proxy --no-migrate` over a database without
/// the tables refuse to start, naming it and saying what to run.
#[tokio::test]
async fn no_migrate_over_missing_tables_refuses_to_start() {
    let db = TestDb::new().await;
    let (port, admin) = (free_port().to_string(), free_port().to_string());
    let mut serve = idemgate(&db.url);
    serve.args([
        "serve",
        "--no-migrate",
        "--listen",
        &format!("127.0.0.1:{port}"),
    ]);
    let mut proxy = idemgate(&db.url);
    proxy.args([
        "proxy",
        "--no-migrate",
        "--upstream",
        "http://127.0.0.1:9",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--admin-listen",
        &format!("127.0.0.1:{admin}"),
    ]);
    for cmd in [serve, proxy] {
        let said = refused(cmd).await;
        says_plainly(
            &said,
            &[
                &format!("the database {} ", db.name),
                "has no idemgate tables",
                "run `idemgate migrate`",
                "--no-migrate",
            ],
        );
    }
}

/// SQLite: `--no-migrate` over a file without the tables refuses to start,
/// and over a file that is not there refuses without creating it.
#[tokio::test]
async fn no_migrate_over_a_sqlite_file_without_tables_or_none_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.db");
    std::fs::File::create(&empty).unwrap();
    let missing = dir.path().join("missing.db");
    for (path, want) in [
        (&empty, "has no idemgate tables"),
        (&missing, "no SQLite database at"),
    ] {
        let url = format!("sqlite://{}", path.display());
        let mut serve = idemgate(&url);
        serve.args([
            "serve",
            "--no-migrate",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
        ]);
        let said = refused(serve).await;
        says_plainly(
            &said,
            &[
                want,
                &path.display().to_string(),
                "idemgate migrate",
                "--no-migrate",
            ],
        );
    }
    assert!(!missing.exists(), "--no-migrate created the file");
    let lock = dir.path().join("missing.db.lock");
    assert!(!lock.exists(), "--no-migrate created the lock file");
}

/// A role the server does not know: the start refuses, saying so; under
/// `--no-migrate`, 503 and the same words in the log; never the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_role_is_named_and_never_a_500() {
    let db = TestDb::new().await;
    let url = with_user(&db.url, NO_SUCH_ROLE);
    let missing = format!("role \"{NO_SUCH_ROLE}\" does not exist");
    let create = format!("createuser {NO_SUCH_ROLE}");
    let said = refused({
        let mut cmd = idemgate(&url);
        cmd.arg("migrate");
        cmd
    })
    .await;
    says_plainly(&said, &["DATABASE_URL", &missing, &create]);

    let server = Server::start(idemgate(&url)).await;
    server.assert_unavailable().await;
    let log = server.logged(&missing).await;
    says_plainly(&log, &["check the user in DATABASE_URL", &create]);
    server.assert_no_internal_error();
}
