//! The schema's status on PostgreSQL and the processes connected to it
//! (docs/operations.md, “Upgrading”; the rules are in
//! [`crate::store::schema`]).
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

use sqlx::AssertSqlSafe;

use super::PgStore;
use super::errors::{classify, shell_word};
use crate::store::schema::BRIDGED;
use crate::store::schema::{APPLICATION_PREFIX, Process, SchemaStatus};
use crate::store::{Result, StoreError};

/// The client connections to this database that belong to idemgate
/// processes, oldest first.
///
/// A role without `pg_read_all_stats` sees another role's session with its
/// name (`application_name`) but not its type, address, start or
/// statement (NULL, and `<insufficient privilege>`): such a session is
/// counted too — idemgate's processes run as the application's role, not
/// as the owner that migrates — with its address shown as unknown.
const CONNECTED: &str = r#"
SELECT pid, application_name,
       CASE WHEN query = '<insufficient privilege>' THEN 'an address this role may not read'
            ELSE COALESCE(host(client_addr), 'local') END AS client,
       backend_start,
       query = '<insufficient privilege>' AS unreadable
  FROM pg_stat_activity
 WHERE datname = current_database()
   AND pid <> pg_backend_pid()
   AND (backend_type = 'client backend'
        OR (backend_type IS NULL AND query = '<insufficient privilege>'))
   AND (application_name LIKE 'idemgate/%'
        OR (application_name = ''
            AND (query ~ '(idempotency_keys|idempotency_reservations|idemgate_|_sqlx_migrations)'
                 OR query = '<insufficient privilege>')))
 ORDER BY backend_start NULLS LAST, pid"#;

/// Whether the role reads every session's type, address and statement in
/// `pg_stat_activity` (a superuser, or a member of `pg_read_all_stats`,
/// which `pg_monitor` includes).
const READS_EVERY_SESSION: &str = "SELECT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')";

/// The compatibility write for processes before 0.2.0 across
/// `20261207000001_one_table` ([`crate::store::schema::BRIDGED`]): every
/// reservation id a record takes is written into `idempotency_reservations`
/// too, where those processes look a record up by its id. Deferred to the
/// commit, so that the claim function from before that migration, which
/// inserts the id itself, runs unchanged (ON CONFLICT DO NOTHING then).
const BRIDGE_ON: &str = r#"
CREATE OR REPLACE FUNCTION idemgate_compat_reservation_ids() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
BEGIN
    INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
    VALUES (NEW.tenant, NEW.reservation_id, NEW.key_hash)
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$fn$;
DO $do$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                    WHERE tgname = 'idemgate_compat_reservation_ids'
                      AND tgrelid = 'idempotency_keys'::regclass) THEN
        CREATE CONSTRAINT TRIGGER idemgate_compat_reservation_ids
            AFTER INSERT OR UPDATE OF reservation_id ON idempotency_keys
            DEFERRABLE INITIALLY DEFERRED
            FOR EACH ROW EXECUTE FUNCTION idemgate_compat_reservation_ids();
    END IF;
END
$do$;"#;

/// `20261207000001_one_table` as it is bridged: its batch function's
/// commits answer with the stored response, as before it (a process before
/// 0.2.0 keeps what a commit answers in its replay cache; without the
/// response, it would replay an empty body). `None` if the text is not the
/// one this was written for.
fn bridged_step(sql: &str) -> Option<String> {
    const WITHOUT: &str = "k.recovery_data, k.response_status, NULL::jsonb, NULL::bytea,";
    const WITH: &str = "k.recovery_data, k.response_status, k.response_headers, k.response_body,";
    (sql.matches(WITHOUT).count() == 1).then(|| sql.replace(WITHOUT, WITH))
}

/// The compatibility write dropped.
const BRIDGE_OFF: &str = "DROP TRIGGER IF EXISTS idemgate_compat_reservation_ids ON idempotency_keys; \
                          DROP FUNCTION IF EXISTS idemgate_compat_reservation_ids();";

/// Whether the compatibility write is in place.
const BRIDGE_IS_ON: &str = "SELECT EXISTS (SELECT 1 FROM pg_trigger \
                            WHERE tgname = 'idemgate_compat_reservation_ids' \
                              AND tgrelid = to_regclass('idempotency_keys'))";

/// A row of [`CONNECTED`]: pid, name, client, since, unreadable.
type ConnectedRow = (i32, String, String, Option<DateTime<Utc>>, bool);

impl PgStore {
    /// The database's migrations beside `migrator`'s, and the idemgate
    /// processes connected to it.
    pub async fn schema_status(&self, migrator: &Migrator) -> Result<SchemaStatus> {
        let target = &self.conns.target;
        let mut conn = self.pool.acquire().await.map_err(|e| classify(e, target))?;
        // Read in one transaction: behind a pooler in transaction mode, an
        // unnamed statement's parse and execution then reach one server
        // connection, and nothing is left prepared on it.
        let mut conn = sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?;
        let table: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?;
        let applied: Vec<(i64, String, Option<DateTime<Utc>>)> = if table {
            sqlx::query_as(
                "SELECT version, description, installed_on FROM _sqlx_migrations \
                 WHERE success ORDER BY version",
            )
            .persistent(false)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?
        } else {
            Vec::new()
        };
        let rows: Vec<ConnectedRow> = sqlx::query_as(CONNECTED)
            .persistent(false)
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
        let citus: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')",
        )
        .persistent(false)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| classify(e, target))?;
        let reads_every_session: bool = sqlx::query_scalar(READS_EVERY_SESSION)
            .persistent(false)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?;
        let bridge_on: bool = sqlx::query_scalar(BRIDGE_IS_ON)
            .persistent(false)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?;
        conn.rollback().await.map_err(|e| classify(e, target))?;
        let mut status = SchemaStatus::new(
            format!(
                "the PostgreSQL database {} on {}",
                shell_word(&target.database),
                target.server()
            ),
            migrator,
            applied,
            grouped,
            true,
        );
        status.can_bridge = !citus;
        status.bridge_on = bridge_on;
        if !reads_every_session {
            status.sessions_hidden_from = Some(target.user.clone());
        }
        Ok(status)
    }

    /// Applies `migrator`'s pending migrations with the compatibility write
    /// for processes before 0.2.0: the migrations before each step of
    /// [`BRIDGED`](crate::store::schema::BRIDGED) as sqlx applies them, then
    /// that step in one transaction with the compatibility write (so that no
    /// claim of theirs ever runs without it), then the rest; all under
    /// sqlx's migration lock.
    pub(super) async fn migrate_bridged(&self, migrator: &Migrator) -> Result<()> {
        let target = &self.conns.target;
        let failed = |e: sqlx::migrate::MigrateError| {
            StoreError::other(format!("migration with the compatibility write: {e}")).because(e)
        };
        let session_timeouts = !self.settings.transaction_pooler;
        let mut conn = self.pool.acquire().await.map_err(|e| classify(e, target))?;
        super::migrate::lock(&mut conn).await.map_err(failed)?;
        let result = async {
            for &version in BRIDGED {
                let Some(step) = migrator.iter().find(|m| m.version == version) else {
                    continue;
                };
                super::migrate::apply(&mut conn, migrator, Some(version - 1), session_timeouts)
                    .await
                    .map_err(failed)?;
                let applied: bool = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT EXISTS (SELECT 1 FROM {} WHERE version = $1)",
                    migrator.table_name
                )))
                .bind(version)
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| classify(e, target))?;
                if applied {
                    continue;
                }
                let bridged = bridged_step(step.sql.as_str()).ok_or_else(|| {
                    StoreError::other(format!(
                        "migration {version} is not the one the compatibility write was made for"
                    ))
                })?;
                let started = std::time::Instant::now();
                let mut tx = sqlx::Connection::begin(&mut *conn)
                    .await
                    .map_err(|e| classify(e, target))?;
                for sql in [BRIDGE_ON, step.sql.as_str(), bridged.as_str()] {
                    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| {
                            classify(e, target)
                                .reworded(|why| format!("migration {version}: {why}"))
                        })?;
                }
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {} (version, description, success, checksum, execution_time) \
                     VALUES ($1, $2, TRUE, $3, $4)",
                    migrator.table_name
                )))
                .bind(version)
                .bind(step.description.as_ref())
                .bind(step.checksum.as_ref())
                .bind(i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX))
                .execute(&mut *tx)
                .await
                .map_err(|e| classify(e, target))?;
                tx.commit().await.map_err(|e| classify(e, target))?;
            }
            super::migrate::apply(&mut conn, migrator, None, session_timeouts)
                .await
                .map_err(failed)
        }
        .await;
        let unlocked = super::migrate::unlock(&mut conn).await;
        result?;
        unlocked.map_err(failed)
    }

    /// Drops the compatibility write, and gives the batch function back the
    /// form `20261207000001_one_table` made (its commits answer without the
    /// response). Only that function, the last statement of the step: a
    /// later migration adds overloads of it (`20261209000001_claimed_request`)
    /// and leaves this signature alone.
    pub(super) async fn drop_bridge(&self, migrator: &Migrator) -> Result<()> {
        let target = &self.conns.target;
        let mut conn = self.pool.acquire().await.map_err(|e| classify(e, target))?;
        let applied: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT version FROM {} WHERE success",
            migrator.table_name
        )))
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| classify(e, target))?;
        let mut tx = sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(|e| classify(e, target))?;
        sqlx::raw_sql(BRIDGE_OFF)
            .execute(&mut *tx)
            .await
            .map_err(|e| classify(e, target))?;
        for step in migrator
            .iter()
            .filter(|m| applied.contains(&m.version) && BRIDGED.contains(&m.version))
        {
            let sql = step.sql.as_str();
            let Some(from) = sql.find(BATCH_FUNCTION) else {
                continue;
            };
            sqlx::raw_sql(AssertSqlSafe(sql[from..].to_owned()))
                .execute(&mut *tx)
                .await
                .map_err(|e| classify(e, target))?;
        }
        tx.commit().await.map_err(|e| classify(e, target))?;
        Ok(())
    }
}

/// Where a bridged step's batch function begins: the step's last statement.
const BATCH_FUNCTION: &str = "CREATE OR REPLACE FUNCTION idemgate_write_batch(";
