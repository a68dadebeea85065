//! The PostgreSQL store's own connections, in place of sqlx's pool (why: on
//! [`Conns`]).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::sync::{Semaphore, SemaphorePermit};

use super::errors::{Target, classify, connect_failed};
use crate::store::{Result, StoreError};

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
pub(super) struct Conns {
    pub(super) options: PgConnectOptions,
    /// The second attempt's options, under `sslmode=allow` and `prefer`
    /// (see the `tls` module).
    pub(super) fallback: Option<PgConnectOptions>,
    /// `sslmode` as `DATABASE_URL` gave it, for messages.
    pub(super) sslmode: &'static str,
    /// Where `options` lead, for messages.
    pub(super) target: Target,
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
                let conn = tokio::time::timeout_at(deadline, self.connect())
                    .await
                    .map_err(|_| self.target.no_answer(self.acquire_timeout))?
                    .map_err(|e| connect_failed(e, &self.target))?
                    .0;
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
    /// A new connection, as libpq's `sslmode` says: the first attempt's
    /// options, then the fallback's when the server turned the first away
    /// (`allow`, `prefer`). `true` with it when the fallback's made it.
    pub(super) async fn connect(&self) -> Result<(PgConnection, bool), sqlx::Error> {
        match self.options.connect().await {
            Ok(conn) => Ok((conn, false)),
            Err(e) => match &self.fallback {
                Some(fallback) if super::tls::worth_a_second_attempt(&e) => {
                    fallback.connect().await.map(|conn| (conn, true))
                }
                _ => Err(e),
            },
        }
    }
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
/// failures, and the database's own "this session is over" (an error of
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
