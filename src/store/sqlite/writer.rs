//! The writer thread: one OS thread owning the store's one write connection
//! (a `rusqlite::Connection`), fed through a channel of commands. Each
//! command is one whole transaction, `BEGIN IMMEDIATE` … `COMMIT`, run to
//! its end on the thread and answered through a oneshot channel.
//!
//! * **Why a thread of our own.** sqlx runs each SQLite connection on a
//!   thread of its own too, but every statement is a round trip to it (and
//!   back to the runtime); a transaction of four statements was eight hops,
//!   and a write cost three times PostgreSQL's CPU. Here a transaction is one
//!   hop there and one back, and its statements are prepared once
//!   (`prepare_cached`) and run in place.
//! * **Fair and exact.** Commands run one at a time in the order they were
//!   sent: within the process writers queue instead of spinning on SQLite's
//!   busy handler; against another process `BEGIN IMMEDIATE` waits up to the
//!   busy timeout. The clock is read inside the command, after `BEGIN
//!   IMMEDIATE` took the write lock.
//! * **Never a transaction left open.** A command whose transaction fails (or
//!   whose code panics) is rolled back before the next one runs; on a file,
//!   the connection is then closed and reopened for the next command, so that
//!   the store recovers by itself from a full disk or a file made read-only
//!   once the fault is gone (a connection that saw the fault may stay broken:
//!   RELIABILITY.md, SQLite faults). An in-memory database lives in its
//!   connections, so there it is only rolled back.
//! * **Cancellation.** A command is owned by the thread once sent: a request
//!   that goes away drops only the answer; the transaction commits or rolls
//!   back as it would have.
//! * **Ending.** The thread ends when every handle is dropped (the channel
//!   closes), closing the connection (which checkpoints the WAL) and then
//!   releasing its hold on the file lock; [`Writer::close`] closes the
//!   connection at once and refuses the writes sent after it. If it
//!   ever died, callers would get an error, not a hang: their answer
//!   channels close with it.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};
use tokio::sync::oneshot;

use super::errors::classify_rs;
use super::lock::FileLock;
use crate::store::{Result, StoreError};

/// Statements kept prepared: every write statement of the store, with room.
const STATEMENT_CACHE: usize = 32;

/// Where and how the writer opens its connection.
#[derive(Debug, Clone)]
pub(super) struct Target {
    /// The file (or, in memory, the shared in-memory database's name).
    pub(super) path: PathBuf,
    pub(super) in_memory: bool,
    /// Whether a file that is not there is created.
    pub(super) create: bool,
    pub(super) busy_timeout: Duration,
}

impl Target {
    /// Opens the write connection: WAL (stored in the file, so the readers
    /// find it there), `synchronous = FULL`, the busy timeout.
    fn open(&self) -> Result<Connection> {
        let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_URI
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        if self.create {
            flags |= OpenFlags::SQLITE_OPEN_CREATE;
        }
        if self.in_memory {
            // The readers' connection opens the same name with a shared
            // cache: one database between them.
            flags |= OpenFlags::SQLITE_OPEN_MEMORY | OpenFlags::SQLITE_OPEN_SHARED_CACHE;
        }
        let conn = Connection::open_with_flags(&self.path, flags).map_err(classify_rs)?;
        conn.busy_timeout(self.busy_timeout).map_err(classify_rs)?;
        if !self.in_memory {
            // Switching to WAL needs an exclusive lock that the busy timeout
            // does not wait for; the file lock keeps other idemgates away.
            let mode: String = conn
                .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
                .map_err(classify_rs)?;
            if !mode.eq_ignore_ascii_case("wal") {
                return Err(StoreError::unavailable(format!(
                    "the database stays in journal mode {mode}, not WAL"
                )));
            }
        }
        conn.execute_batch("PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;")
            .map_err(classify_rs)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        Ok(conn)
    }
}

/// A transaction's work: runs on the writer thread inside `BEGIN IMMEDIATE`
/// … `COMMIT`, and is answered once the transaction has ended.
trait Command: Send {
    /// The statements; an error rolls the transaction back.
    fn run(&mut self, conn: &Connection) -> Result<()>;
    /// Sends the answer: the value [`run`](Command::run) kept if the
    /// transaction committed, else `outcome`'s error.
    fn answer(self: Box<Self>, outcome: Result<()>);
}

struct Call<T, F> {
    work: Option<F>,
    value: Option<T>,
    answer: oneshot::Sender<Result<T>>,
}

impl<T, F> Command for Call<T, F>
where
    T: Send,
    F: FnOnce(&Connection) -> Result<T> + Send,
{
    fn run(&mut self, conn: &Connection) -> Result<()> {
        let work = self
            .work
            .take()
            .ok_or_else(|| StoreError::other("a write command ran twice"))?;
        self.value = Some(work(conn)?);
        Ok(())
    }

    fn answer(self: Box<Self>, outcome: Result<()>) {
        let answer = match (outcome, self.value) {
            (Ok(()), Some(value)) => Ok(value),
            (Ok(()), None) => Err(StoreError::other("a write command kept no answer")),
            (Err(e), _) => Err(e),
        };
        // The requester may have gone away: the answer is dropped.
        let _ = self.answer.send(answer);
    }
}

enum Message {
    Run(Box<dyn Command>),
    Close(oneshot::Sender<()>),
}

/// A handle on the writer thread; clones share it, and the thread ends when
/// the last is dropped.
#[derive(Debug, Clone)]
pub(super) struct Writer {
    queue: mpsc::Sender<Message>,
}

// === impl Writer ===

impl Writer {
    /// Starts the thread and opens the connection on it, so that a file that
    /// cannot be opened is reported here. The thread holds `lock` until its
    /// connection is closed.
    pub(super) async fn start(target: Target, lock: Option<Arc<FileLock>>) -> Result<Writer> {
        let (queue, commands) = mpsc::channel();
        let (opened, open) = oneshot::channel();
        std::thread::Builder::new()
            .name("idemgate-sqlite-writer".into())
            .spawn(move || {
                let conn = match target.open() {
                    Ok(conn) => {
                        let _ = opened.send(Ok(()));
                        conn
                    }
                    Err(e) => {
                        let _ = opened.send(Err(e));
                        return;
                    }
                };
                serve(&target, Some(conn), &commands);
                drop(lock);
            })
            .map_err(|e| {
                StoreError::unavailable(format!("cannot start the SQLite writer thread: {e}"))
                    .because(e)
            })?;
        open.await.unwrap_or_else(|_| Err(stopped()))?;
        Ok(Writer { queue })
    }

    /// Runs `work` in one write transaction on the writer thread: `BEGIN
    /// IMMEDIATE`, `work`, `COMMIT`. Its value once committed; an error of
    /// `work` or of the transaction rolls everything back.
    pub(super) async fn write<T, F>(&self, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let call = Call {
            work: Some(work),
            value: None,
            answer,
        };
        self.queue
            .send(Message::Run(Box::new(call)))
            .map_err(|_| stopped())?;
        // Dropped unanswered: the command panicked (and was rolled back), or
        // the thread died under it.
        answered.await.unwrap_or_else(|_| {
            Err(StoreError::other(
                "the SQLite writer dropped the write without an answer",
            ))
        })
    }

    /// Closes the connection once the commands sent before are done; later
    /// writes fail as unavailable. The thread ends with the last handle.
    pub(super) async fn close(&self) {
        let (done, closed) = oneshot::channel();
        if self.queue.send(Message::Close(done)).is_ok() {
            let _ = closed.await;
        }
    }
}

fn stopped() -> StoreError {
    StoreError::unavailable("the SQLite writer has stopped (closed, or it failed)")
}

/// The thread's loop: one command at a time, until the channel closes.
fn serve(target: &Target, mut conn: Option<Connection>, commands: &mpsc::Receiver<Message>) {
    let mut closed = false;
    while let Ok(message) = commands.recv() {
        let mut command = match message {
            Message::Run(command) if closed => {
                command.answer(Err(stopped()));
                continue;
            }
            Message::Run(command) => command,
            Message::Close(done) => {
                // Other handles may still send: they are refused until the
                // last is dropped and the channel closes.
                closed = true;
                drop(conn.take());
                let _ = done.send(());
                continue;
            }
        };
        let c = match &mut conn {
            Some(c) => c,
            // Replaced after a failed write: opened afresh, seeing the file
            // as it is now.
            None => match target.open() {
                Ok(c) => conn.insert(c),
                Err(e) => {
                    command.answer(Err(e));
                    continue;
                }
            },
        };
        match catch_unwind(AssertUnwindSafe(|| transaction(c, &mut *command))) {
            Ok(Ok(())) => command.answer(Ok(())),
            Ok(Err(e)) => {
                after_failure(target, &mut conn);
                command.answer(Err(e));
            }
            Err(_) => {
                // Its answer channel closes with it: the caller gets an error.
                drop(command);
                tracing::error!("a write command panicked; its transaction is rolled back");
                after_failure(target, &mut conn);
            }
        }
    }
}

/// `command` between `BEGIN IMMEDIATE` and `COMMIT`.
fn transaction(conn: &Connection, command: &mut dyn Command) -> Result<()> {
    // IMMEDIATE takes the write lock now, waiting up to the busy timeout; a
    // deferred BEGIN that read first could not upgrade after another
    // connection's commit (SQLITE_BUSY_SNAPSHOT, which the busy timeout does
    // not retry). Taking it first also lets the command read the clock under
    // the lock.
    conn.execute_batch("BEGIN IMMEDIATE").map_err(classify_rs)?;
    command.run(conn)?;
    conn.execute_batch("COMMIT").map_err(classify_rs)
}

/// Cleans up after a transaction that did not commit: rolls back whatever is
/// open, and on a file closes the connection, for the next command to open
/// a fresh one.
fn after_failure(target: &Target, conn: &mut Option<Connection>) {
    let Some(c) = conn.as_ref() else {
        return;
    };
    if !c.is_autocommit()
        && let Err(e) = c.execute_batch("ROLLBACK")
    {
        tracing::debug!(error = %e, "rollback of a failed write");
    }
    if !target.in_memory {
        tracing::debug!("a write did not commit: the write connection is replaced");
        // Closing rolls back anything the ROLLBACK above could not.
        drop(conn.take());
    }
}
