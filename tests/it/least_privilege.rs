//! A role that owns nothing: only SELECT, INSERT, UPDATE and DELETE on
//! idemgate's tables and EXECUTE on its functions, granted as docs/operations.md's
//! "Least privilege" says, after the owner migrated the database. Every
//! command but `migrate` works with it: `serve --no-migrate`, `proxy
//! --no-migrate`, `prune` and `keys`; `migrate` is refused by the server.

use std::process::Output;

use sqlx::{AssertSqlSafe, Connection as _};

use crate::common;

use common::bin::{Served, idemgate_at};
use common::pg::TestDb;
use common::proxy::ProxyProcess;
use common::upstream::Upstream;

/// `url` with its user (and password) replaced by `role`.
fn as_role(url: &str, role: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{role}@{host}")
}

fn run(url: &str, args: &[&str]) -> Output {
    idemgate_at(url)
        .env_remove("IDEMGATE_CONFIG")
        .args(args)
        .output()
        .unwrap()
}

#[tokio::test]
async fn every_command_but_migrate_works_with_a_role_that_owns_nothing() {
    let db = TestDb::new().await;
    let migrated = run(&db.url, &["migrate"]);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let role = format!(
        "idemgate_app_{}",
        db.name.trim_start_matches("idemgate_test_")
    );
    let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(&mut admin)
        .await
        .unwrap();
    let owner: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&mut admin)
        .await
        .unwrap();
    // docs/operations.md's grants, word for word but the names.
    let grants = format!(
        "CREATE ROLE {role} LOGIN;
         GRANT USAGE ON SCHEMA {schema} TO {role};
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role};
         GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {role};
         ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {schema}
             GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {role};
         ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {schema}
             GRANT EXECUTE ON FUNCTIONS TO {role};"
    );
    sqlx::raw_sql(AssertSqlSafe(grants))
        .execute(&mut admin)
        .await
        .unwrap();
    let url = as_role(&db.url, &role);

    let result = async {
        // migrate needs the owner.
        let out = run(&url, &["migrate"]);
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "migrate as {role} succeeded");
        assert!(said.contains("permission denied"), "{said}");
        assert!(said.contains("owns the schema"), "{said}");

        // serve: a reservation made and committed.
        let served = Served::spawn(idemgate_at(&url), &["--no-migrate"]).await;
        let http = common::http();
        let key = common::app::fresh_key();
        let res = http
            .post(format!("{}/v1/reservations", served.base()))
            .header("Idempotency-Key", &key)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        let view: serde_json::Value = res.json().await.unwrap();
        let id = view["reservation_id"].as_str().unwrap().to_owned();
        let res = http
            .post(format!("{}/v1/reservations/{id}/commit", served.base()))
            .json(&serde_json::json!({"status": 200, "headers": [], "body": "done"}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
        let res = http
            .post(format!("{}/v1/reservations", served.base()))
            .header("Idempotency-Key", &key)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "the replay");
        drop(served);

        // proxy: a new key forwarded once, its retry replayed.
        let upstream = Upstream::start().await;
        let origin = format!("http://{}", upstream.addr);
        let proxy = ProxyProcess::start_at(&url, &origin, &["--no-migrate"]).await;
        let key = common::app::fresh_key();
        let mut replays = Vec::new();
        for _ in 0..2 {
            let res = http
                .post(format!("{}/charges", proxy.base()))
                .header("Idempotency-Key", &key)
                .body("{\"amount\":1}")
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), 201);
            replays.push(res.headers().contains_key("idempotent-replayed"));
        }
        assert_eq!(replays, [false, true]);
        drop(proxy);

        // One key left in flight past its lease, for keys and prune.
        let served = Served::spawn(idemgate_at(&url), &["--no-migrate"]).await;
        let res = http
            .post(format!("{}/v1/reservations", served.base()))
            .header("Idempotency-Key", common::app::fresh_key())
            .json(&serde_json::json!({"lease_seconds": 1, "ttl_seconds": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        drop(served);
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;

        for args in [
            &["prune"][..],
            &["keys", "list"][..],
            &["keys", "list", "--json"][..],
        ] {
            let out = run(&url, args);
            assert!(
                out.status.success(),
                "{args:?} as {role}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let listed = common::bin::keys_json(&url, &["list", "--all"]);
        assert!(listed["keys"].is_array(), "{listed}");
    };
    let outcome = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(result)).await;
    // The role is the cluster's, not the database's: dropped whatever
    // happened.
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP OWNED BY {role}; DROP ROLE {role};"
    )))
    .execute(&mut admin)
    .await;
    let _ = admin.close().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// `migrate --status` run as the schema's owner, a role that is no
/// superuser, beside `serve` running as the application's role with the
/// grants above: PostgreSQL shows the owner another role's sessions with
/// their names only, and the status lists the process by its name and says
/// what it cannot see and the GRANT that shows it; granted
/// `pg_read_all_stats`, it lists where the process connects from, and the
/// note is gone.
#[tokio::test]
async fn the_owner_sees_the_application_roles_processes() {
    let db = TestDb::new().await;
    let suffix = db.name.trim_start_matches("idemgate_test_").to_owned();
    let (owner, app) = (
        format!("idemgate_own_{suffix}"),
        format!("idemgate_app_{suffix}"),
    );
    let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(&mut admin)
        .await
        .unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE ROLE {owner} LOGIN; CREATE ROLE {app} LOGIN;
         ALTER SCHEMA {schema} OWNER TO {owner};"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    let owner_url = as_role(&db.url, &owner);
    let app_url = as_role(&db.url, &app);

    let result = async {
        let migrated = run(&owner_url, &["migrate"]);
        assert!(
            migrated.status.success(),
            "migrate as {owner}: {}",
            String::from_utf8_lossy(&migrated.stderr)
        );
        let mut as_owner = sqlx::PgConnection::connect(&owner_url).await.unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "GRANT USAGE ON SCHEMA {schema} TO {app};
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {app};
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {app};"
        )))
        .execute(&mut as_owner)
        .await
        .unwrap();
        let _ = as_owner.close().await;

        let served = Served::spawn(idemgate_at(&app_url), &["--no-migrate"]).await;
        let name = format!("idemgate/{}", env!("CARGO_PKG_VERSION"));
        let status = |url: &str| {
            let out = run(url, &["migrate", "--status"]);
            let said = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                out.status.success(),
                "{said}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            said
        };
        // The process is seen once it ran a statement (its first pruning
        // pass, at start).
        let mut said = String::new();
        for _ in 0..50 {
            said = status(&owner_url);
            if said.contains(&name) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        assert!(
            said.contains(&format!("  {name} (pid")),
            "the application role's process is listed: {said}"
        );
        assert!(!said.contains("no idemgate process"), "{said}");
        assert!(
            said.contains(&format!("GRANT pg_read_all_stats TO {owner};")),
            "{said}"
        );

        sqlx::raw_sql(AssertSqlSafe(format!(
            "GRANT pg_read_all_stats TO {owner};"
        )))
        .execute(&mut admin)
        .await
        .unwrap();
        let said = status(&owner_url);
        assert!(
            said.contains(&format!("  {name} (pid")) && said.contains("from 127.0.0.1"),
            "granted, where it connects from: {said}"
        );
        assert!(!said.contains("pg_read_all_stats"), "{said}");
        drop(served);
    };
    let outcome = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(result)).await;
    // Roles are the cluster's, not the database's: dropped whatever happened.
    let _ = common::pg::end_other_sessions(&mut admin).await;
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER SCHEMA {schema} OWNER TO CURRENT_USER; REASSIGN OWNED BY {owner} TO CURRENT_USER;
         DROP OWNED BY {owner}; DROP OWNED BY {app}; DROP ROLE {owner}; DROP ROLE {app};"
    )))
    .execute(&mut admin)
    .await;
    let _ = admin.close().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}
