//! The PostgreSQL store's own connections, in place of sqlx's pool (why: on
//! [`Conns`]).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection as _, Row as _};
use tokio::sync::{Semaphore, SemaphorePermit};

use super::errors::{Target, classify, connect_failed};
use crate::store::{Durability, Result, StoreError};

/// One server `DATABASE_URL` names.
#[derive(Debug)]
pub(super) struct Host {
    pub(super) options: PgConnectOptions,
    /// The second attempt's options, under `sslmode=allow` and `prefer`
    /// (see the `tls` module).
    pub(super) fallback: Option<PgConnectOptions>,
    /// Whether the last connection made to it was the second attempt's.
    pub(super) fell_back: AtomicBool,
    /// Where `options` lead, for messages.
    pub(super) target: Target,
}

impl Host {
    /// The options that last made a connection: the migrations' pool takes
    /// them.
    pub(super) fn working_options(&self) -> PgConnectOptions {
        match &self.fallback {
            Some(fallback) if self.fell_back.load(Ordering::Relaxed) => fallback.clone(),
            _ => self.options.clone(),
        }
    }
}

/// The store's connections: a stack of idle ones under a semaphore of
/// `max_connections`.
///
/// sqlx's pool sends a ping (Sync, wait for ReadyForQuery) each time a
/// connection goes back to it, unconditionally: one extra round trip per
/// statement, which was 15 % of `serve`'s CPU time under reserve+commit load
/// and as many wake-ups of a PostgreSQL backend. Here a connection goes back
/// to the stack only when its statement ran to the end (sqlx has then read up
/// to ReadyForQuery, so it is clean); one dropped mid-statement (a cancelled
/// request) or broken (an I/O or protocol error) is closed instead, and a
/// broken one empties the stack, since its siblings most likely died with it
/// (the database restarted).
///
/// `DATABASE_URL` may name several servers (see the `hosts` module): a new
/// connection goes to the one that last took writes, else to the others in
/// their order, and is handed out only once the server has said it takes
/// writes (not in recovery, not read-only); so after a failover the first
/// connection made finds the promoted server.
pub(super) struct Conns {
    /// The servers, in `DATABASE_URL`'s order.
    pub(super) hosts: Vec<Host>,
    /// The one a connection was last made to.
    pub(super) current: AtomicUsize,
    /// `sslmode` as `DATABASE_URL` gave it, for messages.
    pub(super) sslmode: &'static str,
    /// Where `hosts` lead, for messages: all of them.
    pub(super) target: Target,
    /// What the server last connected to said of its standbys.
    pub(super) synchronous: AtomicBool,
    pub(super) idle: Mutex<Vec<PgConnection>>,
    pub(super) permits: Semaphore,
    pub(super) acquire_timeout: Duration,
    /// How long one statement may take from this side: the statement timeout
    /// plus a margin, so that the database's own timeout (which leaves the
    /// connection usable) fires first, and this one only when the database
    /// is silent (a network that drops packets, a host that froze).
    pub(super) answer_timeout: Duration,
    /// Connections open: idle and in use.
    pub(super) open: AtomicU32,
    /// Behind a pooler in transaction mode: what opens each statement's own
    /// transaction and sets what a session would otherwise carry (`BEGIN;
    /// SET LOCAL …`). `None` on a direct connection: the settings are
    /// startup options, and a statement is its own transaction.
    pub(super) scope: Option<String>,
}

impl std::fmt::Debug for Conns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conns")
            .field("open", &self.open.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A connection taken from [`Conns`]: back to the stack on [`Conn::done`]
/// with a result that leaves it clean, closed otherwise.
pub(super) struct Conn<'a> {
    pub(super) conns: &'a Conns,
    pub(super) conn: Option<PgConnection>,
    pub(super) reuse: bool,
    pub(super) _permit: SemaphorePermit<'a>,
}

// === impl Conns ===

impl Conns {
    pub(super) async fn acquire(&self) -> Result<Conn<'_>> {
        let deadline = tokio::time::Instant::now() + self.acquire_timeout;
        let permit = tokio::time::timeout_at(deadline, self.permits.acquire())
            .await
            .map_err(|_| classify(sqlx::Error::PoolTimedOut, &self.target))?
            .map_err(|_| classify(sqlx::Error::PoolClosed, &self.target))?;
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let conn = match idle {
            Some(conn) => conn,
            None => {
                let conn = self.connect(deadline).await?;
                self.open.fetch_add(1, Ordering::Relaxed);
                conn
            }
        };
        Ok(Conn {
            conns: self,
            conn: Some(conn),
            reuse: false,
            _permit: permit,
        })
    }
}

impl Conns {
    /// A new connection to `host`, as libpq's `sslmode` says: the first
    /// attempt's options, then the fallback's when the server turned the
    /// first away (`allow`, `prefer`); the host remembers which made it.
    pub(super) async fn open(host: &Host) -> Result<PgConnection, sqlx::Error> {
        match host.options.connect().await {
            Ok(conn) => {
                host.fell_back.store(false, Ordering::Relaxed);
                Ok(conn)
            }
            Err(e) => match &host.fallback {
                Some(fallback) if super::tls::worth_a_second_attempt(&e) => {
                    let conn = fallback.connect().await?;
                    host.fell_back.store(true, Ordering::Relaxed);
                    Ok(conn)
                }
                _ => Err(e),
            },
        }
    }

    /// A new connection to a server that takes writes: the one that last
    /// did first, then the others in order, each given an even share of
    /// what is left until `deadline`.
    pub(super) async fn connect(&self, deadline: tokio::time::Instant) -> Result<PgConnection> {
        let n = self.hosts.len();
        let first = self.current.load(Ordering::Relaxed) % n;
        let mut why = Vec::with_capacity(n);
        for (tried, i) in (first..n).chain(0..first).enumerate() {
            let host = &self.hosts[i];
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let share = left / u32::try_from(n - tried).unwrap_or(1);
            let attempt = async {
                let mut conn = Conns::open(host)
                    .await
                    .map_err(|e| connect_failed(e, &host.target))?;
                match self.check(&mut conn, &host.target).await {
                    Ok(()) => Ok(conn),
                    Err(e) => {
                        let _ = conn.close().await;
                        Err(e)
                    }
                }
            };
            match tokio::time::timeout(share, attempt).await {
                Ok(Ok(conn)) => {
                    if self.current.swap(i, Ordering::Relaxed) != i && n > 1 {
                        tracing::warn!(
                            server = host.target.server(),
                            "the store now writes to this database server (the first of \
                             DATABASE_URL's hosts, from the last one used, that takes writes)"
                        );
                    }
                    return Ok(conn);
                }
                Ok(Err(e)) => why.push(e),
                Err(_) => why.push(host.target.no_answer(share)),
            }
        }
        if n == 1 {
            return Err(why.pop().expect("one host tried"));
        }
        let said: Vec<String> = why.iter().map(|e| e.reason().to_owned()).collect();
        Err(StoreError::unavailable(format!(
            "none of the {n} database servers DATABASE_URL names takes writes now: {}",
            said.join("; ")
        )))
    }

    /// Whether the server `conn` leads to takes writes (a hot standby, or a
    /// server set read-only, does not: the connection is then not handed
    /// out), and what it says of its standbys.
    async fn check(&self, conn: &mut PgConnection, at: &Target) -> Result<()> {
        // The simple protocol: no statement is prepared, or cached.
        let row = sqlx::raw_sql(WRITABLE)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| classify(e, at))?;
        let text = |i: usize| -> Result<String> {
            row.try_get::<String, _>(i)
                .map_err(|e| StoreError::other(format!("the writability check: {e}")))
        };
        let in_recovery = text(0)? == "true";
        let read_only = text(1)? == "on";
        let replication = Replication {
            synchronous_standby_names: text(2)?,
            synchronous_commit: text(3)?,
            standbys: text(4)?.parse().unwrap_or(0),
        };
        self.synchronous.store(
            replication.durability() == Durability::SynchronousStandby,
            Ordering::Relaxed,
        );
        if in_recovery {
            return Err(not_writable(
                at,
                "it is a hot standby (pg_is_in_recovery() is true)",
            ));
        }
        if read_only {
            return Err(not_writable(
                at,
                "its sessions are read-only (transaction_read_only is on)",
            ));
        }
        Ok(())
    }

    /// What the server last connected to promises of an acknowledged write.
    pub(super) fn durability(&self) -> Durability {
        if self.synchronous.load(Ordering::Relaxed) {
            Durability::SynchronousStandby
        } else {
            Durability::Local
        }
    }
}

/// The check made on each new connection, in one round trip.
pub(super) const WRITABLE: &str = "SELECT pg_is_in_recovery()::text, \
     current_setting('transaction_read_only'), \
     current_setting('synchronous_standby_names'), \
     current_setting('synchronous_commit'), \
     (SELECT count(*) FROM pg_stat_replication)::text";

/// What a primary says of its standbys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Replication {
    pub(super) synchronous_standby_names: String,
    pub(super) synchronous_commit: String,
    /// Standbys streaming from it now (`pg_stat_replication`'s rows, which
    /// every role may count).
    pub(super) standbys: i64,
}

impl Replication {
    /// A commit is acknowledged only once a synchronous standby has it when
    /// some standby is named synchronous and the session's commits wait for
    /// one (`synchronous_commit` on, `remote_write` or `remote_apply`).
    pub(super) fn durability(&self) -> Durability {
        let named = !self.synchronous_standby_names.trim().is_empty();
        let waits = matches!(
            self.synchronous_commit.as_str(),
            "on" | "remote_write" | "remote_apply"
        );
        if named && waits {
            Durability::SynchronousStandby
        } else {
            Durability::Local
        }
    }
}

/// A server that will not take writes: no store for idemgate, for now.
fn not_writable(at: &Target, why: &str) -> StoreError {
    StoreError::unavailable(format!(
        "the database server at {} does not take writes: {why}; idemgate needs the primary \
         (name every server in DATABASE_URL, postgres://user@db1:5432,db2:5432/idemgate?\
         target_session_attrs=read-write, and the one that takes writes is used)",
        at.server()
    ))
}

/// What the database gets beyond the statement timeout to answer before the
/// store gives up on it.
pub(super) const ANSWER_MARGIN: Duration = Duration::from_secs(2);

impl Conns {
    /// Whether statements are kept prepared, under a name, on the
    /// connection: not behind a pooler in transaction mode, whose next
    /// transaction may be on another server connection.
    pub(super) fn persistent(&self) -> bool {
        self.scope.is_none()
    }

    /// Closes every idle connection.
    pub(super) fn drop_idle(&self) {
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|e| e.into_inner()));
        let closed = u32::try_from(idle.len()).unwrap_or(u32::MAX);
        self.open.fetch_sub(closed, Ordering::Relaxed);
    }

    /// `statement`'s result, or `Unavailable` when the database has not
    /// answered within [`Conns::answer_timeout`]: its connection is then
    /// dropped mid-statement and closed, and the idle ones are let go too,
    /// since they most likely lead to the same silent database.
    pub(super) async fn answered<T>(&self, statement: impl Future<Output = T>) -> Result<T> {
        match tokio::time::timeout(self.answer_timeout, statement).await {
            Ok(result) => Ok(result),
            Err(_) => {
                self.drop_idle();
                Err(StoreError::unavailable(format!(
                    "the database did not answer within {} s",
                    self.answer_timeout.as_secs()
                )))
            }
        }
    }
}

// === impl Conn ===

impl Conn<'_> {
    /// Runs `statement` on the connection; behind a pooler in transaction
    /// mode, inside a transaction of its own that carries the settings
    /// (`Conns::scope`): three round trips more (the transaction's two, and
    /// the unnamed statement's parse), and the same single statement as
    /// without the pooler. A failed statement is rolled back here, so the
    /// connection goes back clean; one that cannot be rolled back is
    /// reported by that error, which says it is broken.
    pub(super) async fn scoped<T>(
        &mut self,
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        let conns = self.conns;
        let conn: &mut PgConnection = self;
        let Some(scope) = &conns.scope else {
            return statement(conn).await;
        };
        sqlx::raw_sql(sqlx::AssertSqlSafe(scope.as_str()))
            .execute(&mut *conn)
            .await?;
        match statement(&mut *conn).await {
            Ok(value) => {
                sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
                Ok(value)
            }
            Err(e) if broken(&e) => Err(e),
            Err(e) => match sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await {
                Ok(_) => Err(e),
                Err(rollback) => Err(rollback),
            },
        }
    }

    /// Marks the statement finished: the connection is reusable unless the
    /// error says it is broken.
    pub(super) fn done<T>(&mut self, result: &Result<T, sqlx::Error>) {
        self.reuse = match result {
            Ok(_) => true,
            Err(e) => !broken(e),
        };
        if !self.reuse {
            // Its siblings most likely died with it.
            self.conns.drop_idle();
        }
    }
}

impl std::ops::Deref for Conn<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn.as_ref().expect("present until dropped")
    }
}

impl std::ops::DerefMut for Conn<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("present until dropped")
    }
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if self.reuse {
            self.conns
                .idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(conn);
        } else {
            drop(conn);
            self.conns.open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Errors after which a connection must not be used again: I/O and protocol
/// failures, a server that no longer takes writes (25006
/// read_only_sql_transaction: a demoted primary, a server set read-only; a
/// new connection is checked before it is handed out, and so finds the
/// primary), and the database's own "this session is over" (an error of
/// severity FATAL or PANIC, which PostgreSQL sends before it closes the
/// session: 57P01–57P03, terminated by an administrator, a crash or a
/// shutdown, and the connection exceptions of class 08 it raises itself). An
/// ERROR leaves the session usable: a statement timeout (57014), and a Citus
/// coordinator's 08006 when one of its workers is down, which says nothing of
/// the coordinator's connection (closing the pool's idle connections for it
/// would make every healthy tenant reconnect).
pub(super) fn broken(e: &sqlx::Error) -> bool {
    use sqlx::postgres::{PgDatabaseError, PgSeverity};
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) if db.code().is_some_and(|c| c == "25006") => true,
        sqlx::Error::Database(db) => match db.try_downcast_ref::<PgDatabaseError>() {
            Some(pg) => matches!(pg.severity(), PgSeverity::Fatal | PgSeverity::Panic),
            None => {
                let code = db.code().unwrap_or_default();
                code.starts_with("08") || code.starts_with("57P")
            }
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replication(names: &str, commit: &str, standbys: i64) -> Replication {
        Replication {
            synchronous_standby_names: names.to_owned(),
            synchronous_commit: commit.to_owned(),
            standbys,
        }
    }

    #[test]
    fn durability_is_a_synchronous_standby_only_when_commits_wait_for_one() {
        use Durability::{Local, SynchronousStandby};
        for (names, commit, expected) in [
            ("*", "on", SynchronousStandby),
            ("FIRST 1 (s1, s2)", "remote_apply", SynchronousStandby),
            ("ANY 1 (s1, s2)", "remote_write", SynchronousStandby),
            ("*", "local", Local),
            ("*", "off", Local),
            ("", "on", Local),
            ("  ", "remote_apply", Local),
        ] {
            assert_eq!(
                replication(names, commit, 1).durability(),
                expected,
                "{names:?} {commit:?}"
            );
        }
    }
}
