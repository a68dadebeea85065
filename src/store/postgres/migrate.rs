//! Applying the migrations without holding writes (SPEC §14;
//! docs/operations.md, “Upgrading”).
//!
//! sqlx's migrator runs a step in one transaction, or, for a step whose
//! first line is `-- no-transaction`, sends its whole text at once, which
//! PostgreSQL still runs as one implicit transaction (where `CREATE INDEX
//! CONCURRENTLY` is refused). Here, under the migration lock that the caller
//! holds, each pending step is applied in order:
//!
//! * a transactional step as sqlx applies it. Its DDL takes its locks with a
//!   short `lock_timeout` (`SET LOCAL` in the step): behind a transaction
//!   that holds the table, it gives up within that time rather than queue
//!   every write behind it, and is run again here, a bounded number of
//!   times, each retry logged.
//! * a `-- no-transaction` step statement by statement, each sent on its own
//!   without a statement timeout (an index built `CONCURRENTLY` on a large
//!   table takes longer than a request's); before a `CREATE INDEX
//!   CONCURRENTLY`, an index of that name that an interrupted build left
//!   invalid is dropped `CONCURRENTLY`, so the build runs again rather than
//!   `IF NOT EXISTS` keep it, and one that is built and valid is left alone
//!   (the statement not sent: on Citus, `IF NOT EXISTS` on an index that
//!   exists marks it invalid). The step is recorded once every statement has
//!   run, so each must be one that may run again (`IF NOT EXISTS`, `IF
//!   EXISTS`).

use std::time::{Duration, Instant};

use sqlx::migrate::{MigrateError, Migration, Migrator};
use sqlx::{AssertSqlSafe, Executor as _, PgConnection};

/// How many times a step that gave up on its lock is run again.
pub(super) const LOCK_RETRIES: u32 = 30;

/// The wait before retry `attempt` (1, 2, …): growing, at most two seconds,
/// so that the transaction in the way can end and the writes queued behind
/// the attempt drain.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(u64::from(attempt.min(10)) * 200)
}

/// The id of sqlx's migration lock on the database `name` (as
/// `sqlx-postgres` computes it), so that this release's migrator and an older
/// release's `sqlx::migrate` exclude each other.
fn lock_id(name: &str) -> i64 {
    const CRC_IEEE: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISO_HDLC);
    0x3d32ad9e * i64::from(CRC_IEEE.checksum(name.as_bytes()))
}

async fn database_lock_id(conn: &mut PgConnection) -> Result<i64, MigrateError> {
    let name: String = sqlx::query_scalar("SELECT current_database()::text")
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
    Ok(lock_id(&name))
}

/// Takes the migration lock (the one sqlx's `Migrate::lock` takes), waiting
/// for it by trying again every 100–300 ms rather than in one blocking
/// `pg_advisory_lock`. A session blocked in that call keeps a snapshot
/// open, and a `CREATE INDEX CONCURRENTLY` run by the lock's holder waits
/// for every older snapshot to end: two processes migrating at once (two
/// `serve`s starting) would deadlock, one of them killed by PostgreSQL.
pub(super) async fn lock(conn: &mut PgConnection) -> Result<(), MigrateError> {
    let id = database_lock_id(conn).await?;
    let mut waited = Duration::ZERO;
    loop {
        let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(id)
            .persistent(false)
            .fetch_one(&mut *conn)
            .await?;
        if taken {
            return Ok(());
        }
        if waited.is_zero() {
            tracing::info!("another process is migrating this database; waiting for it to finish");
        }
        // Jittered, so that processes started together do not try in step.
        let jitter = u64::try_from(uuid::Uuid::new_v4().as_u128() % 200).unwrap_or(0);
        let pause = Duration::from_millis(100 + jitter);
        tokio::time::sleep(pause).await;
        waited += pause;
    }
}

/// Gives the migration lock back.
pub(super) async fn unlock(conn: &mut PgConnection) -> Result<(), MigrateError> {
    let id = database_lock_id(conn).await?;
    sqlx::query_scalar::<_, bool>("SELECT pg_advisory_unlock($1)")
        .bind(id)
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
    Ok(())
}

/// Whether `e` is a lock not taken within `lock_timeout` (SQLSTATE 55P03).
fn lock_timed_out(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03")
}

/// Applies `migrator`'s pending migrations up to `target` (all if `None`)
/// on `conn`, whose session holds the migration lock.
pub(super) async fn apply(
    conn: &mut PgConnection,
    migrator: &Migrator,
    target: Option<i64>,
    session_timeouts: bool,
) -> Result<(), MigrateError> {
    use sqlx::migrate::Migrate as _;
    let unlocked = Migrator {
        migrations: migrator.migrations.clone(),
        ignore_missing: migrator.ignore_missing,
        locking: false,
        no_tx: migrator.no_tx,
        table_name: migrator.table_name.clone(),
        create_schemas: migrator.create_schemas.clone(),
    };
    // The table made, the applied steps checked (none dirty, each as this
    // release has it); nothing applied.
    unlocked.run_direct(Some(0), &mut *conn, false).await?;
    let applied: Vec<i64> = conn
        .list_applied_migrations(&migrator.table_name)
        .await?
        .into_iter()
        .map(|m| m.version)
        .collect();
    for step in migrator.iter() {
        if target.is_some_and(|t| t < step.version) {
            break;
        }
        if step.migration_type.is_down_migration() || applied.contains(&step.version) {
            continue;
        }
        let started = Instant::now();
        if step.no_tx {
            apply_statements(conn, migrator, step, session_timeouts).await?;
        } else {
            let mut attempt = 0;
            loop {
                match unlocked
                    .run_direct(Some(step.version), &mut *conn, false)
                    .await
                {
                    Err(MigrateError::ExecuteMigration(e, version))
                        if lock_timed_out(&e) && attempt < LOCK_RETRIES =>
                    {
                        attempt += 1;
                        tracing::warn!(
                            migration = version,
                            attempt,
                            of = LOCK_RETRIES,
                            "migration {version}: a lock was not taken within its lock_timeout \
                             (a transaction holds the table): rolled back, running it again"
                        );
                        tokio::time::sleep(backoff(attempt)).await;
                    }
                    other => break other?,
                }
            }
        }
        tracing::info!(
            migration = step.version,
            description = %step.description,
            ms = started.elapsed().as_millis() as u64,
            "migration applied"
        );
    }
    Ok(())
}

/// A `-- no-transaction` step, statement by statement, then recorded.
async fn apply_statements(
    conn: &mut PgConnection,
    migrator: &Migrator,
    step: &Migration,
    session_timeouts: bool,
) -> Result<(), MigrateError> {
    let failed = |e| MigrateError::ExecuteMigration(e, step.version);
    let started = Instant::now();
    if session_timeouts {
        conn.execute("SET statement_timeout = 0").await?;
    }
    let result = async {
        for statement in statements(step.sql.as_str()) {
            if let Some(index) = concurrent_index(statement)
                && built(conn, &index).await.map_err(failed)?
            {
                // Not sent again: on Citus, a CREATE INDEX CONCURRENTLY IF
                // NOT EXISTS of an index that exists leaves it invalid.
                continue;
            }
            let mut attempt = 0;
            loop {
                match conn.execute(AssertSqlSafe(statement.to_owned())).await {
                    Err(e) if lock_timed_out(&e) && attempt < LOCK_RETRIES => {
                        attempt += 1;
                        tracing::warn!(
                            migration = step.version,
                            attempt,
                            of = LOCK_RETRIES,
                            "migration {}: a lock was not taken within its lock_timeout: \
                             running the statement again",
                            step.version
                        );
                        tokio::time::sleep(backoff(attempt)).await;
                    }
                    other => break other.map(drop).map_err(failed)?,
                }
            }
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (version, description, success, checksum, execution_time) \
             VALUES ($1, $2, TRUE, $3, $4)",
            migrator.table_name
        )))
        .bind(step.version)
        .bind(step.description.as_ref())
        .bind(step.checksum.as_ref())
        .bind(i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX))
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
    .await;
    if session_timeouts {
        // Back to the connection's own (its startup options').
        conn.execute("RESET statement_timeout").await?;
    }
    result
}

/// Whether `index` is built and valid. One that an interrupted `CREATE
/// INDEX CONCURRENTLY` left invalid is dropped (`CONCURRENTLY`), to be built
/// again.
async fn built(conn: &mut PgConnection, index: &str) -> Result<bool, sqlx::Error> {
    let valid: Option<bool> = sqlx::query_scalar(
        "SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass($1)",
    )
    .bind(index)
    .fetch_optional(&mut *conn)
    .await?;
    if valid == Some(false) {
        tracing::warn!(
            index,
            "index {index} is invalid (a build CONCURRENTLY was interrupted): dropping it to \
             build it again"
        );
        conn.execute(AssertSqlSafe(format!(
            "DROP INDEX CONCURRENTLY IF EXISTS {index}"
        )))
        .await?;
    }
    Ok(valid == Some(true))
}

/// The index that `statement` builds, if it is a `CREATE [UNIQUE] INDEX
/// CONCURRENTLY IF NOT EXISTS name …` (the only form a step outside a
/// transaction may build one with: it must be able to run again).
fn concurrent_index(statement: &str) -> Option<String> {
    let words: Vec<String> = code_of(statement)
        .split_whitespace()
        .take(8)
        .map(str::to_ascii_lowercase)
        .collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let rest = match words.as_slice() {
        ["create", "unique", "index", "concurrently", rest @ ..]
        | ["create", "index", "concurrently", rest @ ..] => rest,
        _ => return None,
    };
    match rest {
        ["if", "not", "exists", name, ..] => Some(
            name.split('(')
                .next()
                .unwrap_or_default()
                .trim_matches('"')
                .to_owned(),
        ),
        _ => None,
    }
}

/// `statement` without its `--` comment lines.
fn code_of(statement: &str) -> String {
    statement
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The statements of `sql`, each without its `;`, comments before it
/// kept; a piece that is only comments or blanks is no statement. Quotes
/// (`'…'`, `"…"`), dollar quotes (`$tag$…$tag$`) and comments (`--`, `/* */`)
/// hide their semicolons.
pub(super) fn statements(sql: &str) -> Vec<&str> {
    let bytes = sql.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    fn push<'a>(out: &mut Vec<&'a str>, piece: &'a str) {
        if !code_of(piece).trim().is_empty() && !only_block_comments(piece) {
            out.push(piece.trim());
        }
    }
    while i < bytes.len() {
        match bytes[i] {
            b'-' if bytes.get(i + 1) == Some(&b'-') => {
                i = sql[i..].find('\n').map_or(bytes.len(), |n| i + n + 1);
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i = sql[i + 2..]
                    .find("*/")
                    .map_or(bytes.len(), |n| i + 2 + n + 2);
            }
            quote @ (b'\'' | b'"') => {
                i += 1;
                while i < bytes.len() && bytes[i] != quote {
                    i += 1;
                }
                i += 1;
            }
            b'$' => {
                let tag_end = sql[i + 1..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .map(|n| i + 1 + n);
                match tag_end {
                    Some(end) if bytes[end] == b'$' => {
                        let tag = &sql[i..=end];
                        i = sql[end + 1..]
                            .find(tag)
                            .map_or(bytes.len(), |n| end + 1 + n + tag.len());
                    }
                    _ => i += 1,
                }
            }
            b';' => {
                push(&mut out, &sql[start..i]);
                i += 1;
                start = i;
            }
            _ => i += 1,
        }
    }
    push(&mut out, &sql[start..]);
    out
}

/// Whether `piece` holds nothing but `/* */` comments and blanks.
fn only_block_comments(piece: &str) -> bool {
    let mut rest = code_of(piece);
    loop {
        let trimmed = rest.trim_start();
        if trimmed.is_empty() {
            return true;
        }
        let Some(after) = trimmed.strip_prefix("/*") else {
            return false;
        };
        match after.find("*/") {
            Some(n) => rest = after[n + 2..].to_owned(),
            None => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_split_at_semicolons_outside_quotes_and_comments() {
        let sql = "-- no-transaction\n-- a; comment\n\nCREATE INDEX CONCURRENTLY IF NOT EXISTS a\n    ON t (x) WHERE y = 'a;b';\n\n/* c; */\nDROP INDEX CONCURRENTLY IF EXISTS \"b;\";\nDO $m$ BEGIN EXECUTE 'x;'; END $m$;\nSELECT $1;\n-- trailing; only\n";
        let got = statements(sql);
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(got[0].ends_with("WHERE y = 'a;b'"), "{}", got[0]);
        assert!(got[1].ends_with("IF EXISTS \"b;\""), "{}", got[1]);
        assert_eq!(got[2], "DO $m$ BEGIN EXECUTE 'x;'; END $m$");
        assert_eq!(got[3], "SELECT $1");
    }

    #[test]
    fn the_index_a_statement_builds_concurrently() {
        assert_eq!(
            concurrent_index("-- x\nCREATE INDEX CONCURRENTLY IF NOT EXISTS idx_a\n ON t (x)"),
            Some("idx_a".into())
        );
        assert_eq!(
            concurrent_index("create unique index concurrently if not exists idx_b(x)"),
            Some("idx_b".into())
        );
        assert_eq!(
            concurrent_index("CREATE INDEX CONCURRENTLY idx_c ON t (x)"),
            None
        );
        assert_eq!(
            concurrent_index("CREATE INDEX IF NOT EXISTS idx_d ON t (x)"),
            None
        );
        assert_eq!(
            concurrent_index("DROP INDEX CONCURRENTLY IF EXISTS x"),
            None
        );
    }

    #[test]
    fn every_statement_of_a_step_outside_a_transaction_may_run_again() {
        for step in super::super::MIGRATOR.iter().filter(|m| m.no_tx) {
            for statement in statements(step.sql.as_str()) {
                let code = code_of(statement).to_ascii_uppercase();
                assert!(
                    code.contains("IF NOT EXISTS") || code.contains("IF EXISTS"),
                    "migration {}: {statement} cannot run twice",
                    step.version
                );
                if code.trim_start().starts_with("CREATE INDEX") {
                    assert!(
                        concurrent_index(statement).is_some(),
                        "migration {}: {statement} is not CONCURRENTLY IF NOT EXISTS",
                        step.version
                    );
                }
            }
        }
    }

    #[test]
    fn retries_wait_longer_and_at_most_two_seconds() {
        assert!(backoff(1) < backoff(2));
        assert_eq!(backoff(LOCK_RETRIES), Duration::from_secs(2));
    }
}
