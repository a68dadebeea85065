//! TLS to PostgreSQL, as a managed one asks for it: a cluster of the test's
//! own with `ssl = on`, a server certificate made for this run by a CA of
//! the test's own, and a pg_hba.conf that takes the roles over TLS only
//! (`hostnossl … reject`), one of them only with a client certificate
//! (`hostssl … cert`). The real binary connects as a user would configure
//! it, with libpq's parameters in `DATABASE_URL`.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection as _};

use crate::common;

use common::bin::{Served, idemgate_at, refused, wait_exit};
use common::pg::TempCluster;
use common::proxy::ProxyProcess;
use common::tls::TestCa;
use common::upstream::Upstream;

/// The role that may connect over TLS (trust), and its database.
const TLS_ROLE: &str = "idemgate_tls";
/// The role that must present a client certificate, and its database.
const CERT_ROLE: &str = "idemgate_cert";

/// A cluster that takes TLS only, and the files a client needs.
struct TlsCluster {
    cluster: TempCluster,
    files: tempfile::TempDir,
    /// The CA that signed the server's certificate (and the client's).
    ca: PathBuf,
    /// A CA that signed neither.
    other_ca: PathBuf,
}

impl TlsCluster {
    async fn start() -> TlsCluster {
        let cluster = TempCluster::start().await.expect("a throwaway cluster");
        let ca = TestCa::new("idemgate test CA");
        let data = cluster.data_dir().to_path_buf();
        let (cert, key) = ca.leaf_pem(&["localhost", "127.0.0.1"]);
        for (file, text) in [
            ("server.crt", cert.as_str()),
            ("server.key", key.as_str()),
            ("root.crt", ca.pem.as_str()),
        ] {
            cluster.write_owned(&data.join(file), text).unwrap();
        }
        let conf = "\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n\
                    ssl_ca_file = 'root.crt'\n";
        std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, conf.as_bytes()))
            .unwrap();
        let hba = format!(
            "local all all trust\n\
             hostnossl all all 127.0.0.1/32 reject\n\
             hostssl all {CERT_ROLE} 127.0.0.1/32 cert\n\
             hostssl all all 127.0.0.1/32 trust\n"
        );
        cluster
            .write_owned(&data.join("pg_hba.conf"), &hba)
            .unwrap();
        cluster.stop().await.unwrap();
        cluster.restart().await.unwrap();

        let admin = format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode=require",
            cluster.port()
        );
        let mut conn = sqlx::PgConnection::connect(&admin)
            .await
            .expect("the admin connects over TLS");
        for sql in [
            format!("CREATE ROLE {TLS_ROLE} LOGIN"),
            format!("CREATE DATABASE {TLS_ROLE} OWNER {TLS_ROLE}"),
            format!("CREATE ROLE {CERT_ROLE} LOGIN"),
            format!("CREATE DATABASE {CERT_ROLE} OWNER {CERT_ROLE}"),
        ] {
            sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&mut conn)
                .await
                .unwrap();
        }
        let _ = conn.close().await;

        let files = tempfile::tempdir().unwrap();
        let ca_path = ca.write(&files, "ca.crt");
        let other_ca = TestCa::new("another CA").write(&files, "other-ca.crt");
        let (client_cert, client_key) = ca.client_pem(CERT_ROLE);
        std::fs::write(files.path().join("client.crt"), client_cert).unwrap();
        std::fs::write(files.path().join("client.key"), client_key).unwrap();
        let (stranger_cert, stranger_key) = TestCa::new("a stranger's CA").client_pem(CERT_ROLE);
        std::fs::write(files.path().join("stranger.crt"), stranger_cert).unwrap();
        std::fs::write(files.path().join("stranger.key"), stranger_key).unwrap();
        TlsCluster {
            cluster,
            files,
            ca: ca_path,
            other_ca,
        }
    }

    /// `postgres://ROLE@HOST:PORT/ROLE?QUERY`
    fn url(&self, role: &str, host: &str, query: &str) -> String {
        format!(
            "postgres://{role}@{host}:{}/{role}?{query}",
            self.cluster.port()
        )
    }

    fn file(&self, name: &str) -> String {
        self.files.path().join(name).display().to_string()
    }
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// `idemgate ARGS…` over `url`, run to its end.
fn run(url: &str, args: &[&str]) -> Output {
    idemgate_at(url)
        .env_remove("IDEMGATE_CONFIG")
        .args(args)
        .output()
        .unwrap()
}

#[track_caller]
fn succeeds(url: &str, args: &[&str]) -> String {
    let out = run(url, args);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{args:?} over {url}: {said}");
    said
}

#[track_caller]
fn fails(url: &str, args: &[&str]) -> String {
    let out = run(url, args);
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} over {url} succeeded");
    assert!(!said.contains("panicked"), "{said}");
    said
}

/// A server that takes TLS only: without TLS the role is turned away; with
/// `sslmode=require` (and `prefer`, the default, and `allow`, whose plain
/// attempt is turned away and whose second is TLS) `migrate`, `serve`,
/// `proxy`, `prune` and `keys` all work.
#[tokio::test]
async fn a_postgresql_that_takes_tls_only_serves_every_command_under_sslmode_require() {
    let pg = TlsCluster::start().await;
    let plain = pg.url(TLS_ROLE, "127.0.0.1", "sslmode=disable");
    let said = fails(&plain, &["migrate"]);
    assert!(said.contains("pg_hba.conf"), "{said}");

    let url = pg.url(TLS_ROLE, "127.0.0.1", "sslmode=require");
    succeeds(&url, &["migrate"]);
    succeeds(&pg.url(TLS_ROLE, "127.0.0.1", ""), &["migrate"]);
    succeeds(
        &pg.url(TLS_ROLE, "127.0.0.1", "sslmode=allow"),
        &["migrate"],
    );

    // serve, with and without migrating at start.
    for extra in [&[][..], &["--no-migrate"][..]] {
        let served = Served::spawn(idemgate_at(&url), extra).await;
        let res = common::http()
            .post(format!("{}/v1/reservations", served.base()))
            .header("Idempotency-Key", common::app::fresh_key())
            .send()
            .await
            .unwrap();
        assert_eq!(
            res.status(),
            201,
            "{extra:?}: {}",
            res.text().await.unwrap()
        );
    }

    // proxy: a new key forwarded once, its retry replayed.
    let upstream = Upstream::start().await;
    let origin = format!("http://{}", upstream.addr);
    let proxy = ProxyProcess::start_at(&url, &origin, &["--no-migrate"]).await;
    let key = common::app::fresh_key();
    let mut answers = Vec::new();
    for _ in 0..2 {
        let res = common::http()
            .post(format!("{}/charges", proxy.base()))
            .header("Idempotency-Key", &key)
            .body("{\"amount\":1}")
            .send()
            .await
            .unwrap();
        answers.push((
            res.status().as_u16(),
            res.headers().contains_key("idempotent-replayed"),
        ));
    }
    assert_eq!(answers, [(201, false), (201, true)], "{answers:?}");
    let charges: serde_json::Value = common::http()
        .get(format!("{origin}/charges"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(charges["charges"], 1, "the origin charged once");
    drop(proxy);

    let said = succeeds(&url, &["prune"]);
    assert!(said.contains("pruned"), "{said}");
    let said = succeeds(&url, &["keys", "list"]);
    assert!(!said.contains("error"), "{said}");
}

/// `verify-full` with the CA that signed the server's certificate works, by
/// the name and by the address the certificate bears; with another CA every
/// command refuses to start, naming DATABASE_URL's sslmode and sslrootcert,
/// and exits (no start that answers 503 for ever). A server that is merely
/// not there under the same settings is no refusal: `serve --no-migrate`
/// starts and answers 503.
#[tokio::test]
async fn verify_full_takes_the_right_ca_and_refuses_the_start_with_another() {
    let pg = TlsCluster::start().await;
    for host in ["localhost", "127.0.0.1"] {
        let url = pg.url(
            TLS_ROLE,
            host,
            &format!("sslmode=verify-full&sslrootcert={}", path(&pg.ca)),
        );
        succeeds(&url, &["migrate"]);
        succeeds(&url, &["prune"]);
        // require with the root certificate checks it (as verify-ca).
        let url = pg.url(
            TLS_ROLE,
            host,
            &format!("sslmode=require&sslrootcert={}", path(&pg.ca)),
        );
        succeeds(&url, &["prune"]);
    }

    for mode in ["verify-full", "verify-ca", "require"] {
        let wrong = pg.url(
            TLS_ROLE,
            "localhost",
            &format!("sslmode={mode}&sslrootcert={}", path(&pg.other_ca)),
        );
        let upstream = "http://127.0.0.1:9";
        let admin = format!("127.0.0.1:{}", common::free_port());
        let listen = format!("127.0.0.1:{}", common::free_port());
        for args in [
            vec!["serve", "--listen", listen.as_str()],
            vec!["serve", "--no-migrate", "--listen", listen.as_str()],
            vec![
                "proxy",
                "--no-migrate",
                "--upstream",
                upstream,
                "--listen",
                listen.as_str(),
                "--admin-listen",
                admin.as_str(),
            ],
            vec!["prune"],
            vec!["keys", "list"],
            vec!["migrate"],
        ] {
            let mut cmd = idemgate_at(&wrong);
            cmd.env_remove("IDEMGATE_CONFIG").args(&args);
            let said = refused(cmd).await;
            assert!(said.contains("DATABASE_URL"), "{mode} {args:?}: {said}");
            assert!(
                said.contains(&format!("sslmode={mode}")),
                "{mode} {args:?}: {said}"
            );
            assert!(said.contains("sslrootcert"), "{mode} {args:?}: {said}");
            assert!(said.contains("does not verify"), "{mode} {args:?}: {said}");
        }
    }

    // Nobody there, the same settings: a start that waits for the database.
    let closed = format!(
        "postgres://{TLS_ROLE}@localhost:{}/{TLS_ROLE}?sslmode=verify-full&sslrootcert={}",
        common::free_port(),
        path(&pg.other_ca)
    );
    let port = common::free_port();
    let mut child = idemgate_at(&closed)
        .env_remove("IDEMGATE_CONFIG")
        .args([
            "serve",
            "--no-migrate",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut answered = None;
    for _ in 0..100 {
        if let Ok(res) = common::http()
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .send()
            .await
        {
            answered = Some(res.status().as_u16());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let exited = wait_exit(&mut child, Duration::from_millis(10)).await;
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        exited.is_none(),
        "refused an unreachable server: {exited:?}"
    );
    assert_eq!(answered, Some(503));
}

/// A role that must present a client certificate (`hostssl … cert`):
/// `sslcert` and `sslkey` are presented, and work; without them the server
/// turns the role away saying so; one from a CA the server does not trust
/// is refused in the handshake, and the start refused naming sslcert.
#[tokio::test]
async fn a_client_certificate_is_presented_when_sslcert_and_sslkey_are_given() {
    let pg = TlsCluster::start().await;
    let with_cert = pg.url(
        CERT_ROLE,
        "localhost",
        &format!(
            "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
            path(&pg.ca),
            pg.file("client.crt"),
            pg.file("client.key")
        ),
    );
    succeeds(&with_cert, &["migrate"]);
    let said = succeeds(&with_cert, &["prune"]);
    assert!(said.contains("pruned"), "{said}");

    let without = pg.url(
        CERT_ROLE,
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", path(&pg.ca)),
    );
    let said = fails(&without, &["prune"]);
    assert!(said.contains("certificate"), "{said}");
    assert!(said.contains("sslcert and sslkey"), "{said}");

    let stranger = pg.url(
        CERT_ROLE,
        "localhost",
        &format!(
            "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
            path(&pg.ca),
            pg.file("stranger.crt"),
            pg.file("stranger.key")
        ),
    );
    let said = fails(&stranger, &["prune"]);
    assert!(said.contains("sslcert"), "{said}");

    // A file that is not there is named with its setting, before any
    // connection.
    let missing = pg.url(
        CERT_ROLE,
        "localhost",
        &format!(
            "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
            path(&pg.ca),
            pg.file("client.crt"),
            pg.file("nowhere.key")
        ),
    );
    let said = fails(&missing, &["prune"]);
    assert!(said.contains("sslkey="), "{said}");
    assert!(said.contains("nowhere.key"), "{said}");
}
