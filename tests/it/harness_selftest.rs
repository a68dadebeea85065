//! Self-test of the test harness in `tests/it/common`: real PostgreSQL, log capture.
//!
//! Nothing here is `#[ignore]`d or gated: it all runs under plain `cargo test`, in CI as root
//! (clusters then run as the `postgres` OS user).

use crate::common;

use std::time::Duration;

use common::{logs, pg};
use sqlx::{Connection as _, PgConnection};

async fn connect(url: &str) -> sqlx::Result<PgConnection> {
    tokio::time::timeout(Duration::from_secs(5), PgConnection::connect(url))
        .await
        .unwrap_or_else(|_| Err(sqlx::Error::PoolTimedOut))
}

async fn database_exists(admin: &mut PgConnection, name: &str) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(admin)
        .await
        .expect("querying pg_database")
}

#[tokio::test]
async fn admin_url_connects_and_may_create_databases() {
    let url = pg::admin_url().await;
    assert_eq!(url, pg::admin_url().await, "resolved once per process");
    let mut conn = connect(&url).await.expect("connecting to admin_url()");
    let may_create: bool = sqlx::query_scalar(
        "SELECT rolsuper OR rolcreatedb FROM pg_roles WHERE rolname = current_user",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert!(may_create);
}

#[tokio::test]
async fn test_dbs_are_distinct_usable_and_dropped() {
    let a = pg::TestDb::new().await;
    let b = pg::TestDb::new().await;
    assert_ne!(a.name, b.name);
    assert_ne!(a.url, b.url);
    let pid = std::process::id().to_string();
    for db in [&a, &b] {
        assert!(
            db.name.starts_with(&format!("idemgate_test_{pid}_")),
            "{}",
            db.name
        );
    }

    let mut admin = connect(&pg::admin_url().await).await.unwrap();
    assert!(database_exists(&mut admin, &a.name).await);
    assert!(database_exists(&mut admin, &b.name).await);

    let mut ca = connect(&a.url).await.expect("connecting to TestDb a");
    let mut cb = connect(&b.url).await.expect("connecting to TestDb b");
    let current: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&mut ca)
        .await
        .unwrap();
    assert_eq!(current, a.name);
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')",
    )
    .fetch_one(&mut ca)
    .await
    .unwrap();
    assert_eq!(tables, 0, "a fresh database is empty");

    for conn in [&mut ca, &mut cb] {
        sqlx::raw_sql("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)")
            .execute(&mut *conn)
            .await
            .expect("creating a table");
    }
    sqlx::query("INSERT INTO t VALUES (2)")
        .execute(&mut ca)
        .await
        .unwrap();
    let count_b: i64 = sqlx::query_scalar("SELECT count(*) FROM t")
        .fetch_one(&mut cb)
        .await
        .unwrap();
    assert_eq!(count_b, 1, "the databases are independent");

    // Drop cuts open sessions (WITH (FORCE)) and removes the database before returning.
    let (name_a, name_b) = (a.name.clone(), b.name.clone());
    drop(a);
    drop(b);
    assert!(!database_exists(&mut admin, &name_a).await);
    assert!(!database_exists(&mut admin, &name_b).await);
    assert!(
        sqlx::query("SELECT 1").execute(&mut ca).await.is_err(),
        "sessions of a dropped TestDb are cut"
    );
}

#[tokio::test]
async fn temp_cluster_starts_stops_restarts_and_cleans_up() {
    let cluster = pg::TempCluster::start()
        .await
        .expect("starting a TempCluster");
    let url = cluster.url();
    assert_eq!(
        url,
        format!("postgres://postgres@127.0.0.1:{}/postgres", cluster.port())
    );
    let dir = cluster.dir().to_path_buf();
    assert!(dir.join("data").join("PG_VERSION").is_file());

    let mut held = connect(&url).await.expect("connecting to the cluster");
    sqlx::query("SELECT 1").execute(&mut held).await.unwrap();

    cluster.stop().await.expect("stop");
    assert!(
        sqlx::query("SELECT 1").execute(&mut held).await.is_err(),
        "stop() cuts existing sessions"
    );
    assert!(
        connect(&url).await.is_err(),
        "stop() refuses new connections"
    );

    cluster.restart().await.expect("restart");
    let mut again = connect(&url).await.expect("connecting after restart()");
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut again)
        .await
        .unwrap();
    assert_eq!(one, 1);
    again.close().await.unwrap();

    let port = cluster.port();
    drop(cluster);
    assert!(!dir.exists(), "Drop removes {}", dir.display());
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "Drop stops the server"
    );
}

#[test]
fn logs_are_captured() {
    logs::init();
    logs::init(); // idempotent
    let marker = format!("hello-{}", uuid::Uuid::new_v4());
    tracing::info!("{marker}");
    assert!(logs::captured().contains(&marker));
    logs::assert_absent(&["this string is never logged by anyone"]);
}

#[test]
#[should_panic(expected = "a secret appears in the captured logs")]
fn assert_absent_panics_when_a_secret_is_logged() {
    logs::init();
    let secret = format!("s3cr3t-{}", uuid::Uuid::new_v4());
    tracing::warn!(token = %secret, "oops");
    logs::assert_absent(&["not-logged-anywhere", &secret]);
}

#[test]
fn assert_absent_message_does_not_reveal_the_secret() {
    logs::init();
    let secret = format!("s3cr3t-{}", uuid::Uuid::new_v4());
    tracing::error!("leaking {secret} here");
    let payload = std::panic::catch_unwind(|| logs::assert_absent(&["unused", &secret]))
        .expect_err("assert_absent must panic");
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .expect("a formatted panic message");
    assert!(!msg.contains(&secret), "the panic message leaks the secret");
    assert!(msg.contains("secret #1"), "{msg}");
    assert!(msg.contains(&format!("({} bytes)", secret.len())), "{msg}");
    assert!(msg.contains("leaking [REDACTED #1] here"), "{msg}");
}
