//! The writer thread: one OS thread owning the store's one write connection
//! (a `rusqlite::Connection`), fed through a channel of commands. Each
//! command is one whole transaction, `BEGIN IMMEDIATE` … `COMMIT`, run to
//! its end on the thread and answered through a oneshot channel.
//!
//! * **Group commit on the thread.** Claims, commits and releases come as
//!   writes ([`Writer::submit`]), not commands: the thread takes every write
//!   that queued while it wrote the last group and writes them together
//!   (see [`plan`](crate::store::batch) for what goes into each
//!   transaction), answering each caller itself. A write is one hop to the
//!   thread and one back, as a command is, with no task of the runtime
//!   between. Past [`QUEUE_BOUND`](crate::store::batch) writes waiting, a
//!   write is refused at once as unavailable.
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

use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};
use tokio::sync::oneshot;

use super::errors::classify_rs;
use super::lock::FileLock;
use super::rows::now_ms;
use super::tx::write_in;
use crate::store::batch::{BlockingSink, Counters, Job, MAX_BATCH, QUEUE_BOUND, flush_blocking};
use crate::store::{BatchStats, Result, StoreError, Write, Written};

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
    /// A claim, commit or release, grouped with the others queued.
    Write(Job),
    /// Writes grouped as one, whatever else queued.
    Group(Vec<Job>),
    Close(oneshot::Sender<()>),
}

/// A handle on the writer thread; clones share it, and the thread ends when
/// the last is dropped.
#[derive(Debug, Clone)]
pub(super) struct Writer {
    queue: mpsc::Sender<Message>,
    /// Writes sent and not yet taken into a group, and the bound on them.
    waiting: Arc<Waiting>,
    stats: Arc<Counters>,
}

#[derive(Debug)]
struct Waiting {
    writes: AtomicUsize,
    bound: AtomicUsize,
}

// === impl Writer ===

impl Writer {
    /// Starts the thread and opens the connection on it, so that a file that
    /// cannot be opened is reported here. The thread holds `lock` until its
    /// connection is closed.
    pub(super) async fn start(target: Target, lock: Option<Arc<FileLock>>) -> Result<Writer> {
        let (queue, commands) = mpsc::channel();
        let (opened, open) = oneshot::channel();
        let waiting = Arc::new(Waiting {
            writes: AtomicUsize::new(0),
            bound: AtomicUsize::new(QUEUE_BOUND),
        });
        let stats = Arc::new(Counters::default());
        let thread = Thread {
            target,
            waiting: waiting.clone(),
            stats: stats.clone(),
        };
        std::thread::Builder::new()
            .name("idemgate-sqlite-writer".into())
            .spawn(move || {
                let conn = match thread.target.open() {
                    Ok(conn) => {
                        let _ = opened.send(Ok(()));
                        conn
                    }
                    Err(e) => {
                        let _ = opened.send(Err(e));
                        return;
                    }
                };
                thread.serve(Some(conn), &commands);
                drop(lock);
            })
            .map_err(|e| {
                StoreError::unavailable(format!("cannot start the SQLite writer thread: {e}"))
                    .because(e)
            })?;
        open.await.unwrap_or_else(|_| Err(stopped()))?;
        Ok(Writer {
            queue,
            waiting,
            stats,
        })
    }

    /// Refuses writes past `bound` waiting (instead of the default bound).
    pub(super) fn bound_queue(&self, bound: usize) {
        self.waiting.bound.store(bound.max(1), Ordering::Relaxed);
    }

    /// How the writes were grouped.
    pub(super) fn stats(&self) -> BatchStats {
        self.stats.stats()
    }

    /// Writes `write` with whatever else queued meanwhile (see the module's
    /// docs): its answer once its group's transaction committed.
    pub(super) async fn submit(&self, write: Write) -> Result<Written> {
        let bound = self.waiting.bound.load(Ordering::Relaxed);
        if self.waiting.writes.fetch_add(1, Ordering::Relaxed) >= bound {
            self.waiting.writes.fetch_sub(1, Ordering::Relaxed);
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::unavailable(format!(
                "{bound} writes are already waiting for the database"
            )));
        }
        let (answer, answered) = oneshot::channel();
        if self
            .queue
            .send(Message::Write(Job { write, answer }))
            .is_err()
        {
            self.waiting.writes.fetch_sub(1, Ordering::Relaxed);
            return Err(stopped());
        }
        answered.await.unwrap_or_else(|_| {
            Err(StoreError::other(
                "the SQLite writer dropped the write without an answer",
            ))
        })
    }

    /// Writes `writes` as one group, as the thread would had they queued
    /// together; answers in order.
    pub(super) async fn submit_group(&self, writes: Vec<Write>) -> Vec<Result<Written>> {
        let mut jobs = Vec::with_capacity(writes.len());
        let mut answered = Vec::with_capacity(writes.len());
        for write in writes {
            let (answer, rx) = oneshot::channel();
            jobs.push(Job { write, answer });
            answered.push(rx);
        }
        let sent = self.queue.send(Message::Group(jobs)).is_ok();
        let mut answers = Vec::with_capacity(answered.len());
        for rx in answered {
            answers.push(match sent {
                true => rx
                    .await
                    .unwrap_or_else(|_| Err(StoreError::other("a grouped write got no answer"))),
                false => Err(stopped()),
            });
        }
        answers
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

/// What the thread owns besides its connection.
struct Thread {
    target: Target,
    waiting: Arc<Waiting>,
    stats: Arc<Counters>,
}

impl Thread {
    /// The thread's loop, until the channel closes: a command at a time, and
    /// the writes that queued together as one group.
    fn serve(&self, conn: Option<Connection>, commands: &mpsc::Receiver<Message>) {
        let conn = RefCell::new(conn);
        let mut closed = false;
        let mut next = None;
        loop {
            let message = match next.take() {
                Some(message) => message,
                None => match commands.recv() {
                    Ok(message) => message,
                    Err(_) => return,
                },
            };
            match message {
                Message::Write(job) => {
                    let mut jobs = Vec::with_capacity(8);
                    jobs.push(job);
                    // Whatever queued behind it comes along, in order, up to
                    // the first command that is not a write.
                    while jobs.len() < MAX_BATCH {
                        match commands.try_recv() {
                            Ok(Message::Write(job)) => jobs.push(job),
                            Ok(other) => {
                                next = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    self.waiting.writes.fetch_sub(jobs.len(), Ordering::Relaxed);
                    self.group(&conn, closed, jobs);
                }
                Message::Group(jobs) => self.group(&conn, closed, jobs),
                Message::Run(command) if closed => command.answer(Err(stopped())),
                Message::Run(mut command) => {
                    let mut conn = conn.borrow_mut();
                    let c = match self.connection(&mut conn) {
                        Ok(c) => c,
                        Err(e) => {
                            command.answer(Err(e));
                            continue;
                        }
                    };
                    match catch_unwind(AssertUnwindSafe(|| transaction(c, &mut *command))) {
                        Ok(Ok(())) => command.answer(Ok(())),
                        Ok(Err(e)) => {
                            after_failure(&self.target, &mut conn);
                            command.answer(Err(e));
                        }
                        Err(_) => {
                            // Its answer channel closes with it: the caller gets an error.
                            drop(command);
                            tracing::error!(
                                "a write command panicked; its transaction is rolled back"
                            );
                            after_failure(&self.target, &mut conn);
                        }
                    }
                }
                Message::Close(done) => {
                    // Other handles may still send: they are refused until the
                    // last is dropped and the channel closes.
                    closed = true;
                    drop(conn.borrow_mut().take());
                    let _ = done.send(());
                }
            }
        }
    }

    /// The connection, opened afresh after a failed write (seeing the file
    /// as it is now).
    fn connection<'c>(&self, conn: &'c mut Option<Connection>) -> Result<&'c mut Connection> {
        match conn {
            Some(c) => Ok(c),
            None => Ok(conn.insert(self.target.open()?)),
        }
    }

    /// Writes `jobs` as one group and answers each.
    fn group(&self, conn: &RefCell<Option<Connection>>, closed: bool, mut jobs: Vec<Job>) {
        if closed {
            for job in jobs {
                let _ = job.answer.send(Err(stopped()));
            }
            return;
        }
        self.stats.count(jobs.len());
        flush_blocking(&OnThread { thread: self, conn }, &mut jobs);
    }

    /// `work` in one transaction on the connection; a failure rolls it back
    /// (and replaces a file's connection), a panic too.
    fn in_transaction<T>(
        &self,
        conn: &RefCell<Option<Connection>>,
        work: impl FnOnce(&Connection) -> Result<T>,
    ) -> Result<T> {
        let mut conn = conn.borrow_mut();
        let c = self.connection(&mut conn)?;
        let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<T> {
            run_cached(c, "BEGIN IMMEDIATE")?;
            let value = work(c)?;
            run_cached(c, "COMMIT")?;
            Ok(value)
        }));
        match outcome {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                after_failure(&self.target, &mut conn);
                Err(e)
            }
            Err(_) => {
                tracing::error!("a grouped write panicked; its transaction is rolled back");
                after_failure(&self.target, &mut conn);
                Err(StoreError::other("a grouped write failed"))
            }
        }
    }
}

/// The thread's connection as the group commit's [`BlockingSink`]: a run in one
/// transaction, one clock reading for all; a write alone in its own.
struct OnThread<'a> {
    thread: &'a Thread,
    conn: &'a RefCell<Option<Connection>>,
}

impl BlockingSink for OnThread<'_> {
    fn together(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        let written: Result<Vec<Written>> = self.thread.in_transaction(self.conn, |conn| {
            let now = now_ms();
            writes.iter().map(|w| write_in(conn, w, now)).collect()
        });
        match written {
            Ok(written) => written.into_iter().map(Ok).collect(),
            Err(e) => writes.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    fn alone(&self, write: &Write) -> Result<Written> {
        self.thread
            .in_transaction(self.conn, |conn| write_in(conn, write, now_ms()))
    }
}

/// `command` between `BEGIN IMMEDIATE` and `COMMIT`.
fn transaction(conn: &Connection, command: &mut dyn Command) -> Result<()> {
    // IMMEDIATE takes the write lock now, waiting up to the busy timeout; a
    // deferred BEGIN that read first could not upgrade after another
    // connection's commit (SQLITE_BUSY_SNAPSHOT, which the busy timeout does
    // not retry). Taking it first also lets the command read the clock under
    // the lock.
    run_cached(conn, "BEGIN IMMEDIATE")?;
    command.run(conn)?;
    run_cached(conn, "COMMIT")
}

/// `sql` (a statement without parameters or rows), prepared once per
/// connection: `execute_batch` would parse it again every time.
fn run_cached(conn: &Connection, sql: &str) -> Result<()> {
    conn.prepare_cached(sql)
        .and_then(|mut stmt| stmt.raw_execute())
        .map(drop)
        .map_err(classify_rs)
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
