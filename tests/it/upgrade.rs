//! Upgrades (docs/operations.md, “Upgrading”): every process names its release
//! to the database, `idemgate migrate --status` says what is applied, pending
//! and connected, and `migrate` refuses a contract step while a process that
//! cannot work with it is connected, naming both. This release adds no
//! migration of its own, so the rules are tested with one more migration after
//! this release's, in a directory of the test's.
//!
//! The whole path — the previous release and this one serving one database
//! under load while this one's `migrate` runs, then a rollback — is
//! `.ci/upgrade`.
//!
//! Not on a Citus cluster: there the tests' schemas share one database, so
//! every other test's processes are connected to it too.

use crate::common;

use std::path::Path;

use common::bin::{BIN, idemgate_at};
use common::pg::TestDb;
use idemgate::store::PgStore;
use idemgate::store::schema::APPLICATION_NAME;
use sqlx::Connection as _;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgConnection};

/// This release's PostgreSQL migrations and one more, `name` holding `sql`,
/// in a directory of the test's (kept while the migrator is used).
async fn with_one_more(name: &str, sql: &str) -> (tempfile::TempDir, Migrator) {
    let dir = tempfile::tempdir().expect("temp dir");
    let ours = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/postgres");
    for entry in std::fs::read_dir(ours).expect("the migrations") {
        let entry = entry.expect("a migration");
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy");
    }
    std::fs::write(dir.path().join(name), sql).expect("write the extra migration");
    let mut migrator = Migrator::new(dir.path())
        .await
        .expect("the test's migrations");
    migrator.set_ignore_missing(true);
    (dir, migrator)
}

/// A connection as a process of a release before 0.2.0 holds one: no
/// `application_name`, its last statement on idemgate's table. Its pid.
async fn older_process(url: &str) -> (PgConnection, i32) {
    older_named(url, None).await
}

/// A connection named `name` (none: as before 0.2.0) that has used
/// idemgate's table. Its pid.
async fn older_named(url: &str, name: Option<&str>) -> (PgConnection, i32) {
    let mut options: PgConnectOptions = url.parse().expect("the test URL");
    if let Some(name) = name {
        options = options.application_name(name);
    }
    let mut conn = PgConnection::connect_with(&options).await.expect("connect");
    let pid: i32 = sqlx::query_scalar(
        "SELECT pg_backend_pid() FROM (SELECT count(*) FROM idempotency_keys) AS k",
    )
    .fetch_one(&mut conn)
    .await
    .expect("a statement on idemgate's table");
    (conn, pid)
}

/// A store of this release over `db`, migrated.
async fn store(db: &TestDb) -> PgStore {
    let store = PgStore::connect_lazy(&db.url, &Default::default()).expect("PgStore");
    store.migrate().await.expect("migrate");
    store
}

fn on_citus() -> bool {
    common::pg::citus_url().is_some()
}

#[tokio::test]
async fn every_connection_names_its_release_to_the_database() {
    if on_citus() {
        return;
    }
    let db = TestDb::new().await;
    let store = store(&db).await;
    idemgate::store::Maintenance::prune_expired_batch(&store, 10)
        .await
        .expect("a statement of the store's own connections");
    let mut conn = PgConnection::connect(&db.url).await.expect("connect");
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT application_name FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(&mut conn)
    .await
    .expect("pg_stat_activity");
    assert_eq!(names, vec![APPLICATION_NAME.to_owned()]);
    assert_eq!(
        APPLICATION_NAME,
        format!("idemgate/{}", env!("CARGO_PKG_VERSION"))
    );
}

#[tokio::test]
async fn version_names_the_release_and_the_schema_each_store_ends_at() {
    let newest = |dir: &str| {
        std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(dir))
            .expect("migrations")
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.split('_').next()?.parse::<u64>().ok()
            })
            .max()
            .expect("a migration")
    };
    let out = std::process::Command::new(BIN)
        .arg("--version")
        .output()
        .expect("idemgate --version");
    assert!(out.status.success());
    let (pg, sqlite) = (newest("migrations/postgres"), newest("migrations/sqlite"));
    let schema = if pg == sqlite {
        format!("schema {pg}")
    } else {
        format!("schema {pg} on PostgreSQL, {sqlite} on SQLite")
    };
    let version = env!("CARGO_PKG_VERSION");
    let printed = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if version.contains('-') {
        // A pre-release names the commit it was built from.
        let commit = printed
            .strip_prefix(&format!("idemgate {version} (commit "))
            .and_then(|rest| rest.split_once(", "))
            .map(|(commit, _)| commit.to_owned())
            .unwrap_or_else(|| panic!("no commit in {printed:?}"));
        assert!(
            commit == "unknown"
                || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
            "{printed}"
        );
        assert_eq!(
            printed,
            format!("idemgate {version} (commit {commit}, {schema})")
        );
    } else {
        assert_eq!(printed, format!("idemgate {version} ({schema})"));
    }

    // docs/configuration.md shows the line as it is (its commit aside).
    let page = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"),
    )
    .expect("docs/configuration.md");
    let shown = page
        .split('`')
        .find(|s| s.starts_with("idemgate ") && s.contains("schema "))
        .expect("docs/configuration.md shows an `idemgate --version` line");
    let shown_commit = |line: &str| {
        line.split_once("(commit ")
            .and_then(|(_, rest)| rest.split_once(','))
            .map(|(c, _)| c.to_owned())
    };
    let mut expected = printed.clone();
    if let (Some(ours), Some(theirs)) = (shown_commit(&printed), shown_commit(shown)) {
        expected = expected.replace(&format!("commit {ours},"), &format!("commit {theirs},"));
    }
    assert_eq!(
        shown, expected,
        "docs/configuration.md's `idemgate --version` line is not this build's"
    );
}

/// A build with a migration that no release has is a pre-release of the
/// next version (SPEC §14): never the last release's number. A release is
/// listed in `RELEASES` with the newest migration it has.
#[test]
fn a_build_whose_schema_no_release_has_is_a_pre_release() {
    use idemgate::store::schema::{RELEASES, VERSION};
    let newest =
        std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/postgres"))
            .expect("migrations")
            .filter_map(|e| {
                e.ok()?
                    .file_name()
                    .into_string()
                    .ok()?
                    .split('_')
                    .next()?
                    .parse::<i64>()
                    .ok()
            })
            .max()
            .expect("a migration");
    let numbers = |v: &str| -> Vec<u64> {
        v.split(['-', '+'])
            .next()
            .unwrap_or_default()
            .split('.')
            .map(|p| p.parse().unwrap())
            .collect()
    };
    let (last, last_schema) = *RELEASES.last().expect("a release");
    if newest > last_schema {
        assert!(
            VERSION.contains('-') && numbers(VERSION) > numbers(last),
            "migration {newest} is in no release (the last, {last}, ends at {last_schema}): \
             this build is a pre-release of the next version (e.g. 0.4.0-dev), not {VERSION}"
        );
    } else {
        assert!(
            RELEASES.iter().any(|(name, _)| *name == VERSION),
            "{VERSION} has the schema of a release, and is not listed in RELEASES"
        );
    }
}

#[tokio::test]
async fn migrate_status_lists_the_migrations_and_the_versions_connected_and_changes_nothing() {
    if on_citus() {
        return;
    }
    let db = TestDb::new().await;
    // This release's migrations: every file of the directory.
    let migrations = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/postgres"))
        .expect("migrations/postgres")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "sql"))
        })
        .count();
    let status = |url: &str| {
        let out = idemgate_at(url)
            .args(["migrate", "--status"])
            .output()
            .expect("idemgate migrate --status");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let fresh = status(&db.url);
    assert!(fresh.contains("applied: 0\n"), "{fresh}");
    assert!(
        fresh.contains("  20261207000001 (one table, contract)\n"),
        "{fresh}"
    );
    assert!(fresh.contains("connected: no idemgate process"), "{fresh}");
    assert!(
        fresh.contains(&format!(
            "idemgate migrate would apply {migrations} migration(s)"
        )),
        "{fresh}"
    );
    // --status changed nothing.
    assert!(status(&db.url).contains("applied: 0\n"));

    let store = store(&db).await;
    idemgate::store::Maintenance::prune_expired_batch(&store, 10)
        .await
        .expect("a statement");
    let (_old, pid) = older_process(&db.url).await;
    let out = status(&db.url);
    assert!(out.contains(&format!("applied: {migrations}\n")), "{out}");
    assert!(out.contains("pending: none"), "{out}");
    assert!(
        out.contains(&format!("  {APPLICATION_NAME} (pid")),
        "this release's store is listed by name: {out}"
    );
    assert!(
        out.contains(&format!(
            "idemgate before 0.2.0 (no application_name; pid {pid} from "
        )),
        "the unnamed one is taken for an older idemgate: {out}"
    );
    assert!(
        out.contains("idemgate migrate has nothing to apply"),
        "{out}"
    );
}

#[tokio::test]
async fn migrate_refuses_a_contract_step_while_a_process_that_predates_it_is_connected_naming_both()
{
    if on_citus() {
        return;
    }
    let db = TestDb::new().await;
    let store = store(&db).await;
    let (dir, migrator) = with_one_more(
        "20991231000001_contract_drop_the_test_comment.sql",
        "COMMENT ON TABLE idempotency_keys IS NULL;",
    )
    .await;

    // A process of a release before 0.2.0.
    let (old, pid) = older_process(&db.url).await;
    let why = store
        .migrate_with(&migrator)
        .await
        .expect_err("refused while the older process is connected")
        .reason()
        .to_owned();
    assert!(
        why.contains(
            "has migration 20991231000001 (contract drop the test comment, contract) pending"
        ),
        "{why}"
    );
    assert!(
        why.contains(&format!(
            "idemgate before 0.2.0 (no application_name; pid {pid} "
        )),
        "{why}"
    );
    let status = store.schema_status(&migrator).await.expect("status");
    assert_eq!(status.blocked.len(), 1);
    assert_eq!(status.pending.len(), 1);
    old.close().await.expect("close");

    // A named process of a release that does not know the step.
    let (named, pid) = older_named(&db.url, Some("idemgate/0.1.9")).await;
    let why = store
        .migrate_with(&migrator)
        .await
        .expect_err("refused while idemgate/0.1.9 is connected")
        .reason()
        .to_owned();
    assert!(
        why.contains(&format!("idemgate/0.1.9 (pid {pid} ")),
        "{why}"
    );
    named.close().await.expect("close");

    // This release's own processes do not hold it back: none of them
    // predates a step it ships (here the test's).
    store
        .migrate_with(&migrator)
        .await
        .expect("applied once no older process is connected");
    let status = store.schema_status(&migrator).await.expect("status");
    assert!(status.pending.is_empty());

    // Rolled back to this release's migrations, which lack that contract
    // step: this release cannot work there, and says so.
    let why = store
        .migrate()
        .await
        .expect_err("a newer release's contract step refuses an older release")
        .reason()
        .to_owned();
    assert!(
        why.contains(
            "has migration 20991231000001 (contract drop the test comment, contract) applied"
        ),
        "{why}"
    );
    drop(dir);
}

#[tokio::test]
async fn an_expand_step_applies_while_older_processes_serve_and_the_release_before_it_still_starts()
{
    if on_citus() {
        return;
    }
    let db = TestDb::new().await;
    let store = store(&db).await;
    let (dir, migrator) = with_one_more(
        "20991231000002_expand_a_test_table.sql",
        "CREATE TABLE idemgate_test_expand (x int);",
    )
    .await;
    let (_old, _) = older_process(&db.url).await;
    store
        .migrate_with(&migrator)
        .await
        .expect("an expand step applies beside older processes");

    // This release on a database a newer one expanded: it migrates (nothing
    // to do) and starts with --no-migrate too.
    store.migrate().await.expect("a rollback migrates");
    assert_eq!(store.not_set_up().await.expect("read"), None);
    let out = idemgate_at(&db.url)
        .args(["migrate", "--status"])
        .output()
        .expect("status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("  20991231000002 (expand a test table)  ")
            && text.contains("(not in this release: a newer one applied it)"),
        "{text}"
    );
    drop(dir);
}

#[tokio::test]
async fn migrate_status_on_a_sqlite_file_lists_its_migrations() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("idemgate.db").display());
    let out = idemgate_at(&url).arg("migrate").output().expect("migrate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = idemgate_at(&url)
        .args(["migrate", "--status"])
        .output()
        .expect("status");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with(&format!("the SQLite database {url} (idemgate ")),
        "{text}"
    );
    assert!(text.contains("pending: none"), "{text}");
    assert!(text.contains("connected: not tracked"), "{text}");

    // A running serve holds the file: --status, which only reads, reads it
    // all the same, and leaves the serve answering.
    let served = common::bin::Served::spawn(idemgate_at(&url), &["--no-migrate"]).await;
    let out = idemgate_at(&url)
        .args(["migrate", "--status"])
        .output()
        .expect("status");
    assert!(
        out.status.success(),
        "refused beside a serve: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("pending: none"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let ready = common::http()
        .get(format!("{}/readyz", served.base()))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    // A file that is not there: named, and not created.
    let missing = dir.path().join("typo.db");
    let out = idemgate_at(&format!("sqlite://{}", missing.display()))
        .args(["migrate", "--status"])
        .output()
        .expect("status");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no SQLite database at"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!missing.exists());
    drop(served);
}

#[tokio::test]
async fn across_one_table_beside_an_older_process_migrate_keeps_a_compatibility_write_until_none_is_connected()
 {
    if on_citus() {
        return;
    }
    let db = TestDb::new().await;
    let store = PgStore::connect_lazy(&db.url, &Default::default()).expect("PgStore");
    // The schema of a release from before 20261207000001_one_table.
    let mut before =
        Migrator::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/postgres"))
            .await
            .expect("the migrations");
    before.migrations = before
        .migrations
        .iter()
        .filter(|m| m.version < 20261207000001)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    store.migrate_with(&before).await.expect("the older schema");
    let (old, _) = older_process(&db.url).await;

    let status = store
        .schema_status(&idemgate::store::postgres::MIGRATOR)
        .await
        .expect("status");
    assert!(status.bridged(), "{:?}", status.lines());
    store
        .migrate()
        .await
        .expect("applied, with the compatibility write");
    // Named, so that it is not taken for an older idemgate.
    let options: PgConnectOptions = db.url.parse().expect("the test URL");
    let mut conn = PgConnection::connect_with(&options.application_name("the test"))
        .await
        .expect("connect");
    let trigger =
        "SELECT count(*) FROM pg_trigger WHERE tgname = 'idemgate_compat_reservation_ids'";
    let on: i64 = sqlx::query_scalar(trigger)
        .fetch_one(&mut conn)
        .await
        .expect("read");
    assert_eq!(on, 1);
    // A claim writes its id where the older process looks a record up.
    let id: uuid::Uuid = sqlx::query_scalar(
        "SELECT reservation_id FROM idemgate_reserve('t', '\\x01'::bytea, NULL, \
         gen_random_uuid(), 30, 60, NULL, 'hold')",
    )
    .fetch_one(&mut conn)
    .await
    .expect("a claim");
    let found: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_reservations WHERE reservation_id = $1",
    )
    .bind(id)
    .fetch_one(&mut conn)
    .await
    .expect("read");
    assert_eq!(found, 1, "the compatibility write wrote the current id");
    // The batch's commit answers with the response, as the older process expects.
    let batch: String = sqlx::query_scalar(
        "SELECT prosrc FROM pg_proc WHERE proname = 'idemgate_write_batch' AND pronargs = 13",
    )
    .fetch_one(&mut conn)
    .await
    .expect("read");
    assert!(!batch.contains("NULL::bytea"));

    // Still connected: a migrate keeps it.
    store.migrate().await.expect("migrate");
    let on: i64 = sqlx::query_scalar(trigger)
        .fetch_one(&mut conn)
        .await
        .expect("read");
    assert_eq!(on, 1);
    // Gone: the next migrate drops it, and the batch function is the one
    // 20261207000001 made.
    old.close().await.expect("close");
    store.migrate().await.expect("migrate");
    let on: i64 = sqlx::query_scalar(trigger)
        .fetch_one(&mut conn)
        .await
        .expect("read");
    assert_eq!(on, 0);
    let batch: String = sqlx::query_scalar(
        "SELECT prosrc FROM pg_proc WHERE proname = 'idemgate_write_batch' AND pronargs = 13",
    )
    .fetch_one(&mut conn)
    .await
    .expect("read");
    assert!(batch.contains("NULL::bytea"));
}

/// This release's PostgreSQL migrations before `version`.
async fn migrations_before(version: i64) -> Migrator {
    let mut before =
        Migrator::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/postgres"))
            .await
            .expect("the migrations");
    before.migrations = before
        .migrations
        .iter()
        .filter(|m| m.version < version)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    before.set_ignore_missing(true);
    before
}

/// A connection named for the test (not taken for an idemgate process).
async fn test_conn(url: &str) -> PgConnection {
    let options: PgConnectOptions = url.parse().expect("the test URL");
    PgConnection::connect_with(&options.application_name("the test"))
        .await
        .expect("connect")
}

/// SPEC §14: a step's DDL takes its lock with a short lock_timeout. Behind a
/// transaction that holds the table for two seconds, `migrate` gives up
/// within it and runs the step again, rather than wait in the lock's queue
/// with every write behind it: no write waits a second, and the step
/// applies once the transaction ends.
#[tokio::test]
async fn a_step_behind_a_transaction_on_the_table_gives_up_its_lock_and_runs_again_while_writes_go_on()
 {
    if on_citus() {
        return;
    }
    let db = TestDb::new().await;
    let store = PgStore::connect_lazy(&db.url, &Default::default()).expect("PgStore");
    // 0.3.0's schema.
    store
        .migrate_with(&migrations_before(20261210000001).await)
        .await
        .expect("0.3.0's schema");
    let mut holder = test_conn(&db.url).await;
    sqlx::raw_sql("BEGIN; SELECT count(*) FROM idempotency_keys")
        .execute(&mut holder)
        .await
        .expect("a transaction that has read the table");
    let migrating = tokio::spawn({
        let store = store.clone();
        async move { store.migrate().await }
    });
    let mut writer = test_conn(&db.url).await;
    let held = std::time::Instant::now();
    let mut worst = std::time::Duration::ZERO;
    let mut writes = 0;
    while held.elapsed() < std::time::Duration::from_secs(2) {
        let started = std::time::Instant::now();
        sqlx::query(
            "INSERT INTO idempotency_keys (tenant, key_hash, state, reservation_id, attempt, \
             created_at, expires_at) \
             VALUES ('t', sha256(convert_to($1, 'UTF8')), 'in_flight', gen_random_uuid(), 1, \
                     now(), now() + interval '1 hour')",
        )
        .bind(format!("k{writes}"))
        .execute(&mut writer)
        .await
        .expect("a write");
        worst = worst.max(started.elapsed());
        writes += 1;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let finished_early = migrating.is_finished();
    sqlx::raw_sql("COMMIT")
        .execute(&mut holder)
        .await
        .expect("the transaction ends");
    assert!(
        worst < std::time::Duration::from_millis(900),
        "a write waited {worst:?} behind the migration ({writes} writes)"
    );
    assert!(
        !finished_early,
        "migrate did not wait for the transaction on the table: {:?}",
        migrating.await
    );
    migrating
        .await
        .expect("the task")
        .expect("migrate applies the step once the transaction ended");
    let mut conn = test_conn(&db.url).await;
    let limited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE limited AND state = 'in_flight'",
    )
    .fetch_one(&mut conn)
    .await
    .expect("the column");
    assert_eq!(limited, writes, "the rows in flight are marked");
}

/// An index that an interrupted `CREATE INDEX CONCURRENTLY` left invalid is
/// dropped and built again, not kept by IF NOT EXISTS.
#[tokio::test]
async fn an_index_an_interrupted_concurrent_build_left_invalid_is_built_again() {
    if on_citus() {
        return;
    }
    let db = TestDb::new().await;
    let store = PgStore::connect_lazy(&db.url, &Default::default()).expect("PgStore");
    store
        .migrate_with(&migrations_before(20261210000003).await)
        .await
        .expect("the steps before the indexes");
    let mut conn = test_conn(&db.url).await;
    // What a build that failed half-way leaves: the name taken, the index
    // invalid (and here, on the wrong column, to tell it from the new one).
    sqlx::raw_sql(
        "CREATE INDEX idempotency_keys_lease_end ON idempotency_keys (attempt); \
         UPDATE pg_index SET indisvalid = false \
          WHERE indexrelid = 'idempotency_keys_lease_end'::regclass",
    )
    .execute(&mut conn)
    .await
    .expect("an invalid index");
    store.migrate().await.expect("migrate");
    let (valid, definition): (bool, String) = sqlx::query_as(
        "SELECT i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i \
          WHERE i.indexrelid = 'idempotency_keys_lease_end'::regclass",
    )
    .fetch_one(&mut conn)
    .await
    .expect("the index");
    assert!(valid, "{definition}");
    assert!(definition.contains("(lease_expires_at)"), "{definition}");
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT indexrelid::regclass::text FROM pg_index \
          WHERE indrelid = 'idempotency_keys'::regclass \
            AND (NOT indisvalid OR indexrelid::regclass::text IN \
                 ('idempotency_keys_in_flight', 'idempotency_keys_unknown'))",
    )
    .fetch_all(&mut conn)
    .await
    .expect("the indexes");
    assert!(left.is_empty(), "{left:?}");
}

/// Processes that migrate one database at once (several `serve`s starting
/// together) take turns and none fails: a process waiting for the migration
/// lock holds no snapshot that the holder's `CREATE INDEX CONCURRENTLY`
/// would wait for (a blocking `pg_advisory_lock` did, and PostgreSQL
/// killed one side of the deadlock). The lock is sqlx's: while an older
/// release's migrator holds it, nobody migrates.
#[tokio::test]
async fn processes_migrating_at_once_take_turns_and_never_deadlock() {
    use sqlx::migrate::Migrate as _;
    let db = TestDb::new().await;
    let mut older = test_conn(&db.url).await;
    older.lock().await.expect("sqlx's migration lock");
    let stores: Vec<PgStore> = (0..4)
        .map(|_| PgStore::connect_lazy(&db.url, &Default::default()).expect("PgStore"))
        .collect();
    let mut all = Box::pin(futures::future::join_all(
        stores.iter().map(|store| store.migrate()),
    ));
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(1500), &mut all)
            .await
            .is_err(),
        "a migration ran while an older release's migrator held the lock"
    );
    older.unlock().await.expect("unlock");
    let results = tokio::time::timeout(std::time::Duration::from_secs(180), all)
        .await
        .expect("the four migrations end");
    for result in results {
        result.expect("each process migrates (or finds nothing to do), none deadlocks");
    }
    let _ = older.close().await;
}
