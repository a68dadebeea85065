//! A private Citus cluster for tests: a coordinator and workers, each a
//! [`TempCluster`] with the extension preloaded, on loopback ports. It needs
//! the Citus extension installed into the machine's PostgreSQL.

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use sqlx::{Connection as _, PgConnection};

use super::pg::TempCluster;

/// Whether the Citus extension is installed beside the PostgreSQL binaries
/// the test clusters use.
pub fn installed() -> bool {
    library().is_some_and(|lib| lib.exists())
}

/// Where `citus.so` would be: the server's library directory, beside its
/// `bin` (the layout of Debian's packages and of a source install).
fn library() -> Option<PathBuf> {
    let bindir = TempCluster::bindir()?;
    Some(bindir.parent()?.join("lib").join("citus.so"))
}

/// Whether a test that needs Citus runs here: yes when it is installed; when
/// it is not, the test says so and passes, unless `IDEMGATE_TEST_REQUIRE_CITUS`
/// is set (as CI sets it), where that is a failure.
pub fn available(test: &str) -> bool {
    if installed() {
        return true;
    }
    let why = format!(
        "{test}: the Citus extension is not installed for the PostgreSQL at {} (build and \
         install Citus 13 from citusdata/citus: see docs/operations.md, \"Scaling out\")",
        TempCluster::bindir().map_or_else(|| "(none found)".into(), |d| d.display().to_string())
    );
    assert!(
        std::env::var_os("IDEMGATE_TEST_REQUIRE_CITUS").is_none(),
        "IDEMGATE_TEST_REQUIRE_CITUS is set, and {why}"
    );
    eprintln!("[idemgate tests] skipped {why}");
    false
}

/// A coordinator and `n` workers.
pub struct TempCitus {
    pub coordinator: TempCluster,
    pub workers: Vec<TempCluster>,
}

impl TempCitus {
    pub async fn start(n: usize) -> anyhow::Result<TempCitus> {
        // `sslmode=prefer` between the nodes: with Citus's default
        // (`require`) CREATE EXTENSION turns TLS on with a certificate of its
        // own making, X.509 version 1, which rustls (the tests' sqlx and
        // idemgate's) cannot read.
        let conf = "shared_preload_libraries = 'citus'\nmax_prepared_transactions = 100\n\
                    citus.node_conninfo = 'sslmode=prefer'\n";
        let coordinator = TempCluster::start_with(conf).await?;
        let mut workers = Vec::new();
        for _ in 0..n {
            workers.push(TempCluster::start_with(conf).await?);
        }
        for node in std::iter::once(&coordinator).chain(&workers) {
            exec(&node.url(), "CREATE EXTENSION IF NOT EXISTS citus").await?;
        }
        exec(
            &coordinator.url(),
            &format!(
                "SELECT citus_set_coordinator_host('127.0.0.1', {})",
                coordinator.port()
            ),
        )
        .await?;
        for worker in &workers {
            exec(
                &coordinator.url(),
                &format!("SELECT citus_add_node('127.0.0.1', {})", worker.port()),
            )
            .await?;
        }
        Ok(TempCitus {
            coordinator,
            workers,
        })
    }

    /// The coordinator's URL: what idemgate connects to.
    pub fn url(&self) -> String {
        self.coordinator.url()
    }

    /// The port of the worker that holds `tenant`'s shard of the keys table.
    pub async fn worker_port_of(&self, tenant: &str) -> anyhow::Result<u16> {
        let mut conn = PgConnection::connect(&self.url()).await?;
        let port: i32 = sqlx::query_scalar(
            "SELECT nodeport FROM pg_dist_shard_placement
              WHERE shardid = get_shard_id_for_distribution_column('idempotency_keys', $1)",
        )
        .bind(tenant)
        .fetch_one(&mut conn)
        .await
        .with_context(|| format!("placement of tenant {tenant}"))?;
        let _ = conn.close().await;
        Ok(u16::try_from(port)?)
    }

    /// One tenant name per worker, in the workers' order: `prefix-N` names
    /// tried until each worker holds one.
    pub async fn tenant_per_worker(&self, prefix: &str) -> anyhow::Result<Vec<String>> {
        let mut found: Vec<Option<String>> = vec![None; self.workers.len()];
        for i in 0..1000 {
            let name = format!("{prefix}-{i}");
            let port = self.worker_port_of(&name).await?;
            if let Some(w) = self.workers.iter().position(|w| w.port() == port)
                && found[w].is_none()
            {
                found[w] = Some(name);
            }
            if found.iter().all(Option::is_some) {
                return Ok(found.into_iter().flatten().collect());
            }
        }
        bail!("no tenant name found for every worker")
    }
}

async fn exec(url: &str, sql: &str) -> anyhow::Result<()> {
    let mut conn = PgConnection::connect(url)
        .await
        .with_context(|| format!("connecting to {url}"))?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut conn)
        .await
        .with_context(|| format!("{sql} on {url}"))?;
    let _ = conn.close().await;
    Ok(())
}
