//! The schema's status on PostgreSQL and the processes connected to it
//! (SPEC §14; the rules are in [`crate::store::schema`]).
//!
//! The processes are read from `pg_stat_activity` on the database server
//! (on a Citus cluster, its coordinator, where idemgate connects): every
//! client connection to the same database but this one, named
//! `idemgate/…`, or without a name and whose last statement named
//! idemgate's tables or functions or the migrations' table (an idemgate
//! process from before 0.2.0, which sets none), or whose statement this role
//! may not read. A process is seen once it has run a statement: any request,
//! or its first pruning pass, which runs at its start.

use chrono::{DateTime, Utc};
use sqlx::migrate::Migrator;

use super::PgStore;
use super::errors::{classify, shell_word};
use crate::store::Result;
use crate::store::schema::{APPLICATION_PREFIX, Process, SchemaStatus};

/// The client connections to this database that belong to idemgate
/// processes, oldest first.
const CONNECTED: &str = r#"
SELECT pid, application_name,
       COALESCE(host(client_addr), 'local') AS client,
       backend_start,
       query = '<insufficient privilege>' AS unreadable
  FROM pg_stat_activity
 WHERE datname = current_database()
   AND pid <> pg_backend_pid()
   AND backend_type = 'client backend'
   AND (application_name LIKE 'idemgate/%'
        OR (application_name = ''
            AND (query ~ '(idempotency_keys|idempotency_reservations|idemgate_|_sqlx_migrations)'
                 OR query = '<insufficient privilege>')))
 ORDER BY backend_start, pid"#;

/// A row of [`CONNECTED`]: pid, name, client, since, unreadable.
type ConnectedRow = (i32, String, String, Option<DateTime<Utc>>, bool);

impl PgStore {
    /// The database's migrations beside `migrator`'s, and the idemgate
    /// processes connected to it.
    pub async fn schema_status(&self, migrator: &Migrator) -> Result<SchemaStatus> {
        let target = &self.conns.target;
        let mut conn = self.pool.acquire().await.map_err(|e| classify(e, target))?;
        let table: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?;
        let applied: Vec<(i64, String, Option<DateTime<Utc>>)> = if table {
            sqlx::query_as(
                "SELECT version, description, installed_on FROM _sqlx_migrations \
                 WHERE success ORDER BY version",
            )
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?
        } else {
            Vec::new()
        };
        let rows: Vec<ConnectedRow> = sqlx::query_as(CONNECTED)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?;
        // One process per (name, client): its connections together.
        let mut connected: Vec<Process> = Vec::new();
        for (pid, name, client, since, unreadable) in rows {
            match connected
                .iter_mut()
                .find(|p| p.application_name == name && p.client == client && !name.is_empty())
            {
                Some(process) => process.pids.push(pid),
                None => connected.push(Process {
                    pids: vec![pid],
                    version: name.strip_prefix(APPLICATION_PREFIX).map(str::to_owned),
                    application_name: name,
                    client,
                    since,
                    unreadable,
                }),
            }
        }
        // The unnamed ones, grouped by client too: a process before 0.2.0
        // holds several connections from one address.
        let mut grouped: Vec<Process> = Vec::new();
        for process in connected {
            match grouped.iter_mut().find(|p| {
                p.application_name.is_empty()
                    && process.application_name.is_empty()
                    && p.client == process.client
                    && p.unreadable == process.unreadable
            }) {
                Some(p) => p.pids.extend(process.pids),
                None => grouped.push(process),
            }
        }
        Ok(SchemaStatus::new(
            format!(
                "the PostgreSQL database {} on {}",
                shell_word(&target.database),
                target.server()
            ),
            migrator,
            applied,
            grouped,
            true,
        ))
    }
}
