//! Real PostgreSQL for integration tests (never mocks, never a silent skip).
//!
//! * [`admin_url`] resolves, once per test process, a server on which the tests may
//!   `CREATE DATABASE`:
//!   1. `DATABASE_URL` if set and non-empty (must be `postgres://` or `postgresql://`). It is
//!      used **as is** (a `CREATE DATABASE` may be issued from any database, and the database it
//!      names is one the user is known to be allowed to connect to); only if that database does
//!      not exist yet is the URL retried with the database `postgres`. If it is set but unusable
//!      the tests panic: an explicit setting is never silently bypassed.
//!   2. else `postgres://postgres@127.0.0.1:5432/postgres` if it answers within ~2 s and the
//!      role may create databases. `IDEMGATE_TEST_PG_PROBE=host:port` replaces the probed
//!      address (only meant to exercise the fallback: `IDEMGATE_TEST_PG_PROBE=127.0.0.1:1`).
//!   3. else a throwaway [`TempCluster`] started from the machine's PostgreSQL binaries, kept
//!      for the life of the test process and removed by its watchdog when the process exits.
//!   4. else panic, saying what to install or set.
//! * [`TestDb`] is a fresh, empty database per test, dropped (`WITH (FORCE)`) on `Drop`.
//!   With `IDEMGATE_TEST_CITUS_URL` set (the coordinator of a Citus cluster, e.g.
//!   `postgres://postgres@127.0.0.1:5501/postgres`), it is instead a fresh schema in that
//!   database, its `url` setting `search_path` to it: the migrations then distribute the tables
//!   in it, and every PostgreSQL scenario of the test binary runs on the cluster. (A database
//!   per test would need Citus set up in each, on every node.)
//! * [`TempCluster`] is a private cluster in a temp dir on a free port, for the fallback and for
//!   tests that must stop and restart the database.
//!
//! * `IDEMGATE_TEST_PG_POOLER=HOST:PORT` (a pooler in transaction mode, e.g. PgBouncer, in
//!   front of the same server): the stores under test ([`Backend::open`], [`TestApp`]) connect
//!   through it, with `IDEMGATE_PG_POOLER=transaction`'s settings, after the migrations ran on a
//!   direct connection; the tests' own reads and writes of the tables stay direct. See
//!   [`through_pooler`].
//!
//! [`Backend::open`]: super::backend::Backend::open
//! [`TestApp`]: super::app::TestApp
//!
//! Other environment knobs: `IDEMGATE_TEST_PG_BINDIR` (directory holding `initdb`, `pg_ctl`,
//! `postgres`; otherwise `pg_config --bindir`, then the highest `/usr/lib/postgresql/*/bin`,
//! then `PATH`) and `IDEMGATE_TEST_PG_OS_USER` (the unprivileged OS user a cluster runs as when
//! the tests run as root; default `postgres`).

use std::io::Write as _;
use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::str::FromStr as _;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{AssertSqlSafe, ConnectOptions as _, Connection as _};

const DEFAULT_PROBE: &str = "127.0.0.1:5432";
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
const EXPLICIT_TIMEOUT: Duration = Duration::from_secs(10);
const DB_PREFIX: &str = "idemgate_test_";
const INSTALL_HINT: &str = "install the PostgreSQL server (Debian/Ubuntu: `apt-get install postgresql`; \
     Fedora: `dnf install postgresql-server`; macOS: `brew install postgresql`), or start one on \
     127.0.0.1:5432 with a `postgres` role that needs no password, or set \
     DATABASE_URL=postgres://USER:PASSWORD@HOST:PORT/DB pointing at a server where USER may CREATE DATABASE";

// ---------------------------------------------------------------------------------------------
// admin_url
// ---------------------------------------------------------------------------------------------

static ADMIN: tokio::sync::OnceCell<Result<String, String>> = tokio::sync::OnceCell::const_new();
/// The fallback cluster, when one was needed. Statics are never dropped: its watchdog removes it
/// once the test process has exited.
static FALLBACK: OnceLock<TempCluster> = OnceLock::new();

/// The admin URL of a PostgreSQL server for tests, resolved once per test process (see the
/// module docs for the order). Panics, with what to install or set, if there is none.
pub async fn admin_url() -> String {
    match ADMIN.get_or_init(resolve_admin_url).await {
        Ok(url) => url.clone(),
        Err(msg) => panic!("{msg}"),
    }
}

async fn resolve_admin_url() -> Result<String, String> {
    if let Some(url) = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
    {
        return explicit_admin_url(url.trim()).await;
    }

    let probe =
        std::env::var("IDEMGATE_TEST_PG_PROBE").unwrap_or_else(|_| DEFAULT_PROBE.to_owned());
    let url = format!("postgres://postgres@{probe}/postgres");
    let why_not_local = match check_admin(&url, PROBE_TIMEOUT).await {
        Ok(()) => {
            eprintln!("[idemgate tests] using PostgreSQL at {url}");
            return Ok(url);
        }
        Err(e) => e.msg,
    };

    let Some(bindir) = find_bindir() else {
        return Err(format!(
            "no PostgreSQL available for the integration tests: DATABASE_URL is unset, {url} is \
             not usable ({why_not_local}), and no PostgreSQL server binaries (initdb, pg_ctl, \
             postgres) were found (looked at $IDEMGATE_TEST_PG_BINDIR, `pg_config --bindir`, \
             /usr/lib/postgresql/*/bin and PATH). To fix: {INSTALL_HINT}."
        ));
    };
    match TempCluster::start_in(bindir.clone()).await {
        Ok(cluster) => {
            let url = cluster.url();
            eprintln!(
                "[idemgate tests] {probe} not usable ({why_not_local}); started a throwaway \
                 cluster from {} at {url}",
                bindir.display()
            );
            let _ = FALLBACK.set(cluster);
            Ok(url)
        }
        Err(e) => Err(format!(
            "no PostgreSQL available for the integration tests: DATABASE_URL is unset, {url} is \
             not usable ({why_not_local}), and starting a throwaway cluster from {} failed: \
             {e:#}. To fix: {INSTALL_HINT}.",
            bindir.display()
        )),
    }
}

async fn explicit_admin_url(url: &str) -> Result<String, String> {
    let shown = redact_url(url);
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(format!(
            "DATABASE_URL must be a postgres:// or postgresql:// URL, got `{shown}`"
        ));
    }
    let err = match check_admin(url, EXPLICIT_TIMEOUT).await {
        Ok(()) => return Ok(url.to_owned()),
        Err(e) if e.missing_database => {
            let fallback = with_database(url, "postgres");
            match check_admin(&fallback, EXPLICIT_TIMEOUT).await {
                Ok(()) => {
                    eprintln!(
                        "[idemgate tests] the database of DATABASE_URL does not exist; using {}",
                        redact_url(&fallback)
                    );
                    return Ok(fallback);
                }
                Err(e2) => format!("{}; with database `postgres`: {}", e.msg, e2.msg),
            }
        }
        Err(e) => e.msg,
    };
    Err(format!(
        "DATABASE_URL is set to `{shown}` but is not usable for the integration tests: {err}. \
         It must point at a reachable server where the user may CREATE DATABASE (or unset it to \
         use 127.0.0.1:5432 or a throwaway cluster)."
    ))
}

struct ConnectError {
    msg: String,
    missing_database: bool,
}

async fn connect(url: &str, timeout: Duration) -> Result<PgConnection, ConnectError> {
    let opts = PgConnectOptions::from_str(url)
        .map_err(|e| ConnectError {
            msg: format!("invalid URL: {e}"),
            missing_database: false,
        })?
        .application_name("idemgate-test-harness")
        .disable_statement_logging();
    match tokio::time::timeout(timeout, PgConnection::connect_with(&opts)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(ConnectError {
            missing_database: e
                .as_database_error()
                .and_then(|d| d.code())
                .is_some_and(|c| c == "3D000"),
            msg: format!("cannot connect: {e}"),
        }),
        Err(_) => Err(ConnectError {
            msg: format!("no answer within {timeout:?}"),
            missing_database: false,
        }),
    }
}

/// Connects and checks that the role may create databases.
async fn check_admin(url: &str, timeout: Duration) -> Result<(), ConnectError> {
    let mut conn = connect(url, timeout).await?;
    let may_create: Result<bool, sqlx::Error> = sqlx::query_scalar(
        "SELECT rolsuper OR rolcreatedb FROM pg_roles WHERE rolname = current_user",
    )
    .fetch_one(&mut conn)
    .await;
    let _ = conn.close().await;
    match may_create {
        Ok(true) => Ok(()),
        Ok(false) => Err(ConnectError {
            msg: "connected, but the role may not CREATE DATABASE".into(),
            missing_database: false,
        }),
        Err(e) => Err(ConnectError {
            msg: format!("connected, but checking CREATEDB failed: {e}"),
            missing_database: false,
        }),
    }
}

/// `url` with its database (path) replaced by `db`; user info, host and query are kept.
fn with_database(url: &str, db: &str) -> String {
    let scheme_end = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let after = &rest[authority_end..];
    let query = &after[after.find(['?', '#']).unwrap_or(after.len())..];
    format!(
        "{}{}/{db}{query}",
        &url[..scheme_end],
        &rest[..authority_end]
    )
}

/// `url` leading through the pooler `IDEMGATE_TEST_PG_POOLER` names (`HOST:PORT`), its
/// user, database and query kept; `None` when that is unset. The stores under test then use
/// `IDEMGATE_PG_POOLER=transaction`'s settings (`PgSettings::transaction_pooler`).
pub fn through_pooler(url: &str) -> Option<String> {
    let pooler = std::env::var("IDEMGATE_TEST_PG_POOLER")
        .ok()
        .filter(|p| !p.trim().is_empty())?;
    let scheme_end = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let user = authority.rfind('@').map_or("", |at| &authority[..=at]);
    Some(format!(
        "{}{user}{}{}",
        &url[..scheme_end],
        pooler.trim(),
        &rest[authority_end..]
    ))
}

/// The URL with any password replaced by `***`, for messages.
fn redact_url(url: &str) -> String {
    let scheme_end = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            let user = userinfo.split(':').next().unwrap_or("");
            let pass = if userinfo.contains(':') { ":***" } else { "" };
            format!("{}{user}{pass}{}", &url[..scheme_end], &rest[at..])
        }
        None => url.to_owned(),
    }
}

// ---------------------------------------------------------------------------------------------
// TestDb
// ---------------------------------------------------------------------------------------------

static COUNTER: AtomicU64 = AtomicU64::new(0);
static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

/// A fresh, empty database for one test, named `idemgate_test_<pid>_<n>` and created through
/// [`admin_url`]. `url` connects to it as the admin user. On `Drop` it is dropped `WITH (FORCE)`
/// (open connections are cut) from a helper thread with its own small runtime; `Drop` waits for
/// that at most ~12 s and never panics. Leftovers of crashed test processes are dropped on the
/// first `TestDb::new` of a later process (see [`sweep_leftovers`]).
pub struct TestDb {
    pub url: String,
    pub name: String,
    admin: String,
    /// A schema on a Citus cluster rather than a database.
    schema: bool,
}

/// Ends every other session of `conn`'s database and waits until they are
/// gone (`pg_terminate_backend` only signals); returns how many it ended.
/// For a test's own database: its stores' connections, and whatever they
/// had not yet reported to the statistics (a backend reports when it ends).
pub async fn end_other_sessions(conn: &mut PgConnection) -> i64 {
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid()) t",
    )
    .fetch_one(&mut *conn)
    .await
    .expect("end the other sessions");
    for _ in 0..250 {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_one(&mut *conn)
        .await
        .expect("count sessions");
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ended
}

/// The Citus coordinator the PostgreSQL tests run on, if one is set.
pub fn citus_url() -> Option<String> {
    std::env::var("IDEMGATE_TEST_CITUS_URL")
        .ok()
        .map(|u| u.trim().to_owned())
        .filter(|u| !u.is_empty())
}

/// `url` with `search_path` set to `schema` for every connection.
fn with_search_path(url: &str, schema: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options[search_path]={schema}")
}

impl TestDb {
    pub async fn new() -> TestDb {
        if let Some(citus) = citus_url() {
            return TestDb::schema_on(citus).await;
        }
        let admin = admin_url().await;
        SWEPT.get_or_init(|| sweep_leftovers(&admin)).await;

        let mut conn = connect(&admin, EXPLICIT_TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("TestDb: admin connection failed: {}", e.msg));
        let mut attempt = 0u32;
        let name = loop {
            let name = format!(
                "{DB_PREFIX}{}_{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            );
            // template0 never has sessions attached, so concurrent creations cannot trip over
            // "source database is being accessed by other users".
            let sql = format!("CREATE DATABASE \"{name}\" TEMPLATE template0");
            match sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut conn).await {
                Ok(_) => break name,
                Err(e) => {
                    let code = e
                        .as_database_error()
                        .and_then(|d| d.code())
                        .map(|c| c.into_owned());
                    attempt += 1;
                    // 42P04 duplicate_database: a name taken by a process with the same pid
                    // (another machine on a shared server); 55006: transient lock conflicts.
                    let retryable = matches!(code.as_deref(), Some("42P04" | "55006" | "40001"));
                    if !retryable || attempt >= 20 {
                        panic!("TestDb: CREATE DATABASE {name} failed: {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
                }
            }
        };
        let _ = conn.close().await;
        TestDb {
            url: with_database(&admin, &name),
            name,
            admin,
            schema: false,
        }
    }

    /// A fresh schema on the Citus coordinator at `admin`.
    pub async fn schema_on(admin: String) -> TestDb {
        static SWEPT_SCHEMAS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        SWEPT_SCHEMAS
            .get_or_init(|| sweep_leftover_schemas(&admin))
            .await;
        let mut conn = connect(&admin, EXPLICIT_TIMEOUT).await.unwrap_or_else(|e| {
            panic!(
                "TestDb: IDEMGATE_TEST_CITUS_URL={} is not usable: {}",
                redact_url(&admin),
                e.msg
            )
        });
        let has_citus: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')",
        )
        .fetch_one(&mut conn)
        .await
        .expect("TestDb: look for the citus extension");
        assert!(
            has_citus,
            "TestDb: IDEMGATE_TEST_CITUS_URL={} has no citus extension",
            redact_url(&admin)
        );
        let name = format!(
            "{DB_PREFIX}{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{name}\"")))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("TestDb: CREATE SCHEMA {name} failed: {e}"));
        let _ = conn.close().await;
        TestDb {
            url: with_search_path(&admin, &name),
            name,
            admin,
            schema: true,
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        let name = self.name.clone();
        let schema = self.schema;
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name(format!("drop-{name}"))
            .spawn(move || {
                let result = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt.block_on(async {
                        let dropped = async {
                            if schema {
                                drop_schema(&admin, &name).await
                            } else {
                                drop_database(&admin, &name).await
                            }
                        };
                        tokio::time::timeout(Duration::from_secs(10), dropped)
                            .await
                            .unwrap_or_else(|_| Err("timed out after 10s".into()))
                    }),
                    Err(e) => Err(format!("no runtime: {e}")),
                };
                let _ = tx.send(result);
            });
        if spawned.is_err() {
            eprintln!(
                "[idemgate tests] could not spawn a thread to drop {}",
                self.name
            );
            return;
        }
        match rx.recv_timeout(Duration::from_secs(12)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("[idemgate tests] dropping {} failed: {e}", self.name),
            Err(_) => eprintln!(
                "[idemgate tests] dropping {} did not finish in time",
                self.name
            ),
        }
    }
}

async fn drop_schema(admin: &str, name: &str) -> Result<(), String> {
    let mut conn = connect(admin, Duration::from_secs(5))
        .await
        .map_err(|e| e.msg)?;
    let result = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{name}\" CASCADE"
    )))
    .execute(&mut conn)
    .await
    .map(|_| ())
    .map_err(|e| e.to_string());
    let _ = conn.close().await;
    result
}

/// Drops `idemgate_test_<pid>_*` schemas of test processes that are gone (see
/// [`sweep_leftovers`]).
async fn sweep_leftover_schemas(admin: &str) {
    sweep(
        admin,
        r"SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'idemgate\_test\_%'",
        "schema",
        |name| format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"),
    )
    .await;
}

async fn drop_database(admin: &str, name: &str) -> Result<(), String> {
    let mut conn = connect(admin, Duration::from_secs(5))
        .await
        .map_err(|e| e.msg)?;
    let forced = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
    let result = match sqlx::raw_sql(AssertSqlSafe(forced))
        .execute(&mut conn)
        .await
    {
        Ok(_) => Ok(()),
        // Servers before 13 have no WITH (FORCE): cut the sessions by hand, then drop.
        Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("42601") => {
            let _ = sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = $1 AND pid <> pg_backend_pid()",
            )
            .bind(name)
            .execute(&mut conn)
            .await;
            let plain = format!("DROP DATABASE IF EXISTS \"{name}\"");
            sqlx::raw_sql(AssertSqlSafe(plain))
                .execute(&mut conn)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
        Err(e) => Err(e.to_string()),
    };
    let _ = conn.close().await;
    result
}

/// Drops `idemgate_test_<pid>_*` databases left behind by test processes that are gone (or by an
/// earlier process that had our pid). Only for servers on this machine (loopback or a Unix
/// socket), where pids are comparable; a database that still has sessions is left alone (plain
/// `DROP DATABASE` refuses it). Best effort: failures are reported on stderr and ignored.
async fn sweep_leftovers(admin: &str) {
    sweep(
        admin,
        r"SELECT datname::text FROM pg_database WHERE datname LIKE 'idemgate\_test\_%'",
        "database",
        |name| format!("DROP DATABASE IF EXISTS \"{name}\""),
    )
    .await;
}

/// Runs `drop` for each name `list` returns whose test process is gone.
async fn sweep(admin: &str, list: &'static str, what: &str, drop: impl Fn(&str) -> String) {
    let Ok(opts) = PgConnectOptions::from_str(admin) else {
        return;
    };
    let host = opts.get_host();
    let local =
        host.starts_with('/') || matches!(host, "localhost" | "127.0.0.1" | "::1" | "[::1]");
    if !local || !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(mut conn) = connect(admin, EXPLICIT_TIMEOUT).await else {
        return;
    };
    let names: Vec<String> = sqlx::query_scalar(list)
        .fetch_all(&mut conn)
        .await
        .unwrap_or_default();
    let me = std::process::id();
    for name in names {
        let Some(pid) = name
            .strip_prefix(DB_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != me && Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let sql = drop(&name);
        if let Err(e) = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut conn).await {
            eprintln!("[idemgate tests] leaving leftover {what} {name}: {e}");
        }
    }
    let _ = conn.close().await;
}

// ---------------------------------------------------------------------------------------------
// TempCluster
// ---------------------------------------------------------------------------------------------

/// A private PostgreSQL cluster in a temp dir, listening on 127.0.0.1 on a free port (and on a
/// Unix socket in the temp dir), with trust auth for the `postgres` role and fsync off.
///
/// When the tests run as root the cluster runs as an unprivileged OS user (`postgres`, or
/// `$IDEMGATE_TEST_PG_OS_USER`) through `runuser`/`su`, its temp dir chowned to that user.
///
/// Cleanup: `Drop` stops it (`-m immediate`) and removes the dir synchronously. In addition a
/// detached watchdog (`sh`, in its own process group, as the cluster's user) blocks reading a
/// pipe whose only write end this struct holds; when the test process exits for any reason
/// (including SIGKILL or a static never being dropped) the pipe closes and the watchdog stops
/// the server and removes the dir. No pid polling, so no pid-reuse or cross-user `kill -0` issue.
pub struct TempCluster {
    root: PathBuf,
    data: PathBuf,
    port: u16,
    bindir: PathBuf,
    run_as: Option<String>,
    watchdog: Option<ChildStdin>,
}

impl TempCluster {
    /// initdb (`-A trust -U postgres -E UTF8 --no-locale --no-sync`) + `pg_ctl start -w` on a
    /// free port, retrying on another port if the chosen one was taken meanwhile.
    pub async fn start() -> anyhow::Result<TempCluster> {
        let bindir = find_bindir().with_context(|| {
            format!(
                "no PostgreSQL server binaries (initdb, pg_ctl, postgres) found; {INSTALL_HINT}"
            )
        })?;
        Self::start_in(bindir).await
    }

    /// [`TempCluster::start`] with `conf` appended to its `postgresql.conf`.
    pub async fn start_with(conf: &str) -> anyhow::Result<TempCluster> {
        let bindir = find_bindir().with_context(|| {
            format!(
                "no PostgreSQL server binaries (initdb, pg_ctl, postgres) found; {INSTALL_HINT}"
            )
        })?;
        Self::start_configured(bindir, conf).await
    }

    /// The directory of the server binaries the clusters are started from.
    pub fn bindir() -> Option<PathBuf> {
        find_bindir()
    }

    async fn start_in(bindir: PathBuf) -> anyhow::Result<TempCluster> {
        Self::start_configured(bindir, "").await
    }

    async fn start_configured(bindir: PathBuf, extra_conf: &str) -> anyhow::Result<TempCluster> {
        let cluster = Self::prepare(bindir)?;
        let mut cmd = cluster.command(&cluster.bindir.join("initdb"));
        cmd.arg("-D").arg(&cluster.data).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        ]);
        let initdb = run(cmd).await.context("running initdb")?;
        if !initdb.status.success() {
            bail!(
                "initdb failed ({}): {}{}",
                initdb.status,
                String::from_utf8_lossy(&initdb.stdout),
                String::from_utf8_lossy(&initdb.stderr)
            );
        }
        cluster.configure_and_start(extra_conf).await
    }

    /// A hot standby of `primary`, streaming from it: `pg_basebackup -R -X
    /// stream` of it into a temp dir of its own, started on a free port with
    /// `extra_conf` appended. (initdb's pg_hba.conf lets replication in from
    /// 127.0.0.1 under trust.)
    pub async fn standby_of(
        primary: &TempCluster,
        extra_conf: &str,
    ) -> anyhow::Result<TempCluster> {
        let cluster = Self::prepare(primary.bindir.clone())?;
        let mut cmd = cluster.command(&cluster.bindir.join("pg_basebackup"));
        cmd.arg("-D")
            .arg(&cluster.data)
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .args([
                "-U",
                "postgres",
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ]);
        let backup = run(cmd).await.context("running pg_basebackup")?;
        if !backup.status.success() {
            bail!(
                "pg_basebackup failed ({}): {}{}",
                backup.status,
                String::from_utf8_lossy(&backup.stdout),
                String::from_utf8_lossy(&backup.stderr)
            );
        }
        // The copied postgresql.conf names the primary's socket dir; the
        // standby's own, appended, wins.
        cluster.configure_and_start(extra_conf).await
    }

    /// `kill -9` of the postmaster (its backends then end by themselves):
    /// the server lost, as a crashed host loses it.
    pub fn kill9(&self) -> anyhow::Result<()> {
        let pid = std::fs::read_to_string(self.data.join("postmaster.pid"))
            .context("reading postmaster.pid")?;
        let pid = pid.lines().next().unwrap_or_default().trim().to_owned();
        let status = Command::new("kill").args(["-9", &pid]).status()?;
        if !status.success() {
            bail!("kill -9 {pid} failed ({status})");
        }
        Ok(())
    }

    /// `pg_ctl promote -w`: the standby becomes a primary.
    pub async fn promote(&self) -> anyhow::Result<()> {
        let mut cmd = self.command(&self.bindir.join("pg_ctl"));
        cmd.arg("-D")
            .arg(&self.data)
            .args(["promote", "-w", "-t", "60"]);
        let out = run(cmd).await.context("running pg_ctl promote")?;
        if !out.status.success() {
            bail!(
                "pg_ctl promote failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// A cluster's temp dir, owned by the OS user it runs as, with its
    /// watchdog; nothing in it yet.
    fn prepare(bindir: PathBuf) -> anyhow::Result<TempCluster> {
        let run_as = if running_as_root() {
            let user = std::env::var("IDEMGATE_TEST_PG_OS_USER")
                .ok()
                .filter(|u| !u.is_empty())
                .unwrap_or_else(|| "postgres".to_owned());
            Some(user)
        } else {
            None
        };
        let ids = match &run_as {
            Some(user) => Some(user_ids(user).with_context(|| {
                format!(
                    "running as root, and PostgreSQL refuses to run as root, but there is no \
                     OS user `{user}` to run the cluster as (create it, or set \
                     IDEMGATE_TEST_PG_OS_USER)"
                )
            })?),
            None => None,
        };

        // As root, use /tmp: the unprivileged user must be able to reach the directory.
        let base = if run_as.is_some() {
            PathBuf::from("/tmp")
        } else {
            std::env::temp_dir()
        };
        let root = tempfile::Builder::new()
            .prefix("idemgate-pg-")
            .tempdir_in(&base)
            .with_context(|| format!("creating a temp dir in {}", base.display()))?
            .keep();
        // From here on, Drop cleans up whatever happens.
        let mut cluster = TempCluster {
            data: root.join("data"),
            root,
            port: 0,
            bindir,
            run_as,
            watchdog: None,
        };
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::chown(&cluster.root, Some(uid), Some(gid))
                .with_context(|| format!("chown {}", cluster.root.display()))?;
        }
        cluster.spawn_watchdog()?;
        Ok(cluster)
    }

    /// Appends the test settings and `extra_conf` to the data dir's
    /// postgresql.conf and starts the server on a free port.
    async fn configure_and_start(mut self, extra_conf: &str) -> anyhow::Result<TempCluster> {
        let cluster = &mut self;
        let socket_dir = cluster.root.to_string_lossy().replace('\'', "''");
        let conf = format!(
            "\n# idemgate test cluster\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{socket_dir}'\n\
             fsync = off\n\
             synchronous_commit = off\n\
             full_page_writes = off\n\
             max_connections = 300\n\
             {extra_conf}\n"
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(cluster.data.join("postgresql.conf"))
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .context("writing postgresql.conf")?;

        let mut last_err = None;
        for _ in 0..10 {
            let port = super::free_port();
            match cluster.pg_start(port).await {
                Ok(()) => {
                    cluster.port = port;
                    return Ok(self);
                }
                Err(StartError::PortTaken(msg)) => last_err = Some(msg),
                Err(StartError::Other(e)) => return Err(e),
            }
        }
        bail!(
            "could not find a free port for the cluster: {}",
            last_err.unwrap_or_default()
        )
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster's data directory (`postgresql.conf`, `pg_hba.conf`).
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// Writes `contents` to `path` as a file the cluster's server owns and
    /// alone may read (mode 0600): a TLS key PostgreSQL accepts.
    pub fn write_owned(&self, path: &Path, contents: &str) -> anyhow::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        let owner = std::fs::metadata(&self.data)?;
        if running_as_root() {
            std::os::unix::fs::chown(path, Some(owner.uid()), Some(owner.gid()))
                .with_context(|| format!("chown {}", path.display()))?;
        }
        Ok(())
    }

    /// The cluster's temp dir (data dir, Unix socket and `server.log` live inside).
    pub fn dir(&self) -> &Path {
        &self.root
    }

    /// `pg_ctl stop -m fast -w`: sessions are cut, the server is gone when this returns.
    pub async fn stop(&self) -> anyhow::Result<()> {
        let mut cmd = self.command(&self.bindir.join("pg_ctl"));
        cmd.arg("-D")
            .arg(&self.data)
            .args(["stop", "-m", "fast", "-w", "-t", "60"]);
        let out = run(cmd).await.context("running pg_ctl stop")?;
        if !out.status.success() {
            bail!(
                "pg_ctl stop failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Starts the (stopped) cluster again on the same port and data dir.
    pub async fn restart(&self) -> anyhow::Result<()> {
        match self.pg_start(self.port).await {
            Ok(()) => Ok(()),
            Err(StartError::PortTaken(msg)) => {
                bail!(
                    "port {} was taken while the cluster was stopped: {msg}",
                    self.port
                )
            }
            Err(StartError::Other(e)) => Err(e),
        }
    }

    async fn pg_start(&self, port: u16) -> Result<(), StartError> {
        let log = self.root.join("server.log");
        let log_len = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
        let mut cmd = self.command(&self.bindir.join("pg_ctl"));
        cmd.arg("-D")
            .arg(&self.data)
            // -l is essential: without it the server would inherit our stdout pipe.
            .arg("-l")
            .arg(&log)
            .args(["-w", "-t", "60", "-o"])
            .arg(format!("-p {port}"))
            .arg("start");
        let out = run(cmd).await.map_err(|e| {
            StartError::Other(anyhow::Error::new(e).context("running pg_ctl start"))
        })?;
        if out.status.success() {
            return Ok(());
        }
        let log_text = std::fs::read(&log)
            .map(|b| String::from_utf8_lossy(b.get(log_len as usize..).unwrap_or(&b)).into_owned())
            .unwrap_or_default();
        let msg = format!(
            "pg_ctl start on port {port} failed ({}): {}{}\nserver log:\n{log_text}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if log_text.contains("already in use") || log_text.contains("could not bind") {
            Err(StartError::PortTaken(msg))
        } else {
            Err(StartError::Other(anyhow::anyhow!(msg)))
        }
    }

    /// A command for `program`, run as the cluster's OS user, in the cluster's dir, stdin null.
    fn command(&self, program: &Path) -> Command {
        let mut cmd = as_user(self.run_as.as_deref(), program);
        cmd.current_dir(&self.root).stdin(Stdio::null());
        cmd
    }

    fn spawn_watchdog(&mut self) -> anyhow::Result<()> {
        const SCRIPT: &str = r#"cat >/dev/null 2>&1
"$1" -D "$2" stop -m immediate -w -t 30 >/dev/null 2>&1
rm -rf "$3""#;
        let mut cmd = self.command(Path::new("/bin/sh"));
        cmd.arg("-c")
            .arg(SCRIPT)
            .arg("idemgate-pg-watchdog")
            .arg(self.bindir.join("pg_ctl"))
            .arg(&self.data)
            .arg(&self.root)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Own process group: a Ctrl-C aimed at `cargo test` must not kill the cleanup.
            .process_group(0);
        let mut child = cmd.spawn().context("spawning the cluster watchdog")?;
        self.watchdog = child.stdin.take();
        // The child is not waited for; it exits when the pipe closes.
        Ok(())
    }
}

impl Drop for TempCluster {
    fn drop(&mut self) {
        let _ = self
            .command(&self.bindir.join("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .args(["stop", "-m", "immediate", "-w", "-t", "30"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.root);
        // Closing the pipe releases the watchdog, which finds nothing left to do.
        drop(self.watchdog.take());
    }
}

enum StartError {
    PortTaken(String),
    Other(anyhow::Error),
}

/// Runs `cmd` to completion without blocking the runtime.
async fn run(cmd: Command) -> std::io::Result<std::process::Output> {
    tokio::process::Command::from(cmd).output().await
}

/// `program` run as `user` (None: as ourselves). Uses `runuser -u`, else `su -s /bin/sh`.
fn as_user(user: Option<&str>, program: &Path) -> Command {
    let Some(user) = user else {
        return Command::new(program);
    };
    if let Some(runuser) = find_program("runuser", &["/usr/sbin/runuser", "/sbin/runuser"]) {
        let mut cmd = Command::new(runuser);
        cmd.args(["-u", user, "--"]).arg(program);
        cmd
    } else {
        let su = find_program("su", &["/bin/su", "/usr/bin/su"]).unwrap_or_else(|| "su".into());
        let mut cmd = Command::new(su);
        cmd.args(["-s", "/bin/sh", "-c", r#"exec "$0" "$@""#, user, "--"])
            .arg(program);
        cmd
    }
}

fn find_program(name: &str, candidates: &[&str]) -> Option<PathBuf> {
    candidates
        .iter()
        .map(PathBuf::from)
        .chain(
            std::env::var_os("PATH")
                .map(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join(name))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
        )
        .find(|p| p.is_file())
}

fn running_as_root() -> bool {
    match std::fs::metadata("/proc/self") {
        Ok(m) => m.uid() == 0,
        Err(_) => Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false),
    }
}

fn user_ids(user: &str) -> anyhow::Result<(u32, u32)> {
    let id = |flag: &str| -> anyhow::Result<u32> {
        let out = Command::new("id").args([flag, user]).output()?;
        if !out.status.success() {
            bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    };
    Ok((id("-u")?, id("-g")?))
}

/// A directory holding `initdb`, `pg_ctl` and `postgres`: `$IDEMGATE_TEST_PG_BINDIR`, then
/// `pg_config --bindir`, then the highest `/usr/lib/postgresql/*/bin`, then `PATH` (symlinks,
/// such as /usr/local/bin/initdb here, are resolved to the real binaries' directory).
fn find_bindir() -> Option<PathBuf> {
    let complete = |d: &Path| {
        ["initdb", "pg_ctl", "postgres"]
            .iter()
            .all(|b| d.join(b).is_file())
    };

    if let Some(dir) = std::env::var_os("IDEMGATE_TEST_PG_BINDIR").map(PathBuf::from) {
        if complete(&dir) {
            return Some(dir);
        }
        eprintln!(
            "[idemgate tests] IDEMGATE_TEST_PG_BINDIR={} lacks initdb/pg_ctl/postgres; ignored",
            dir.display()
        );
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && complete(&dir) {
            return Some(dir);
        }
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<(Vec<u32>, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let version = name
                    .split('.')
                    .map(|p| p.parse::<u32>().ok())
                    .collect::<Option<Vec<_>>>()?;
                Some((version, e.path().join("bin")))
            })
            .filter(|(_, dir)| complete(dir))
            .collect();
        versions.sort();
        if let Some((_, dir)) = versions.pop() {
            return Some(dir);
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find_map(|dir| {
        let initdb = dir.join("initdb");
        if !initdb.is_file() {
            return None;
        }
        let real = std::fs::canonicalize(&initdb).ok()?;
        let real_dir = real.parent()?.to_path_buf();
        [real_dir, dir].into_iter().find(|d| complete(d))
    })
}
