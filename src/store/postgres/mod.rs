//! The PostgreSQL store: every transition is one statement, made atomic across
//! processes by the primary key's row lock, with the database's `now()` as the
//! one clock all processes share.

use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, FromRow};
use tokio::sync::{Semaphore, SemaphorePermit};
use uuid::Uuid;

mod citus;

use super::{
    Claim, ClaimRequest, Found, InFlightUsage, KeyState, PoolStats, PruneBatch, Record, Recovery,
    Result, Store, StoreError, StoredResponse, StoredUsage, Write, Written,
};
use citus::Layout;

/// The PostgreSQL schema migrations (`migrations/postgres`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// How the pool behaves; the defaults suit one idemgate process.
#[derive(Debug, Clone)]
pub struct PgSettings {
    /// Most connections the pool opens.
    pub max_connections: u32,
    /// How long a request waits for a connection before answering 503.
    pub acquire_timeout: Duration,
    /// Server-side limit on one statement, so a hung database gives a 503.
    pub statement_timeout: Duration,
}

impl Default for PgSettings {
    fn default() -> Self {
        PgSettings {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(3),
            statement_timeout: Duration::from_secs(5),
        }
    }
}

/// A [`Store`] over PostgreSQL connections.
#[derive(Debug, Clone)]
pub struct PgStore {
    /// For migrations and for tools; opens connections only when used.
    pool: PgPool,
    /// For every statement of the store.
    conns: Arc<Conns>,
    /// One PostgreSQL or a Citus cluster: read once, by the migrations or by
    /// the first pruning batch.
    layout: Arc<tokio::sync::OnceCell<Layout>>,
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
struct Conns {
    options: PgConnectOptions,
    /// Where `options` lead, for messages.
    target: Target,
    idle: Mutex<Vec<PgConnection>>,
    permits: Semaphore,
    acquire_timeout: Duration,
    /// How long one statement may take from this side: the statement timeout
    /// plus a margin, so that the database's own timeout (which leaves the
    /// connection usable) fires first, and this one only when the database
    /// is silent (a network that drops packets, a host that froze).
    answer_timeout: Duration,
    /// Connections open: idle and in use.
    open: AtomicU32,
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
struct Conn<'a> {
    conns: &'a Conns,
    conn: Option<PgConnection>,
    reuse: bool,
    _permit: SemaphorePermit<'a>,
}

// === impl Conns ===

impl Conns {
    async fn acquire(&self) -> Result<Conn<'_>> {
        let deadline = tokio::time::Instant::now() + self.acquire_timeout;
        let permit = tokio::time::timeout_at(deadline, self.permits.acquire())
            .await
            .map_err(|_| classify(sqlx::Error::PoolTimedOut, &self.target))?
            .map_err(|_| classify(sqlx::Error::PoolClosed, &self.target))?;
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let conn = match idle {
            Some(conn) => conn,
            None => {
                let conn = tokio::time::timeout_at(deadline, self.options.connect())
                    .await
                    .map_err(|_| self.target.no_answer(self.acquire_timeout))?
                    .map_err(|e| connect_failed(e, &self.target))?;
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

/// What the database gets beyond the statement timeout to answer before the
/// store gives up on it.
const ANSWER_MARGIN: Duration = Duration::from_secs(2);

impl Conns {
    /// Closes every idle connection.
    fn drop_idle(&self) {
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|e| e.into_inner()));
        let closed = u32::try_from(idle.len()).unwrap_or(u32::MAX);
        self.open.fetch_sub(closed, Ordering::Relaxed);
    }

    /// `statement`'s result, or `Unavailable` when the database has not
    /// answered within [`Conns::answer_timeout`]: its connection is then
    /// dropped mid-statement and closed, and the idle ones are let go too,
    /// since they most likely lead to the same silent database.
    async fn answered<T>(&self, statement: impl Future<Output = T>) -> Result<T> {
        match tokio::time::timeout(self.answer_timeout, statement).await {
            Ok(result) => Ok(result),
            Err(_) => {
                self.drop_idle();
                Err(StoreError::Unavailable(format!(
                    "the database did not answer within {} s",
                    self.answer_timeout.as_secs()
                )))
            }
        }
    }
}

// === impl Conn ===

impl Conn<'_> {
    /// Marks the statement finished: the connection is reusable unless the
    /// error says it is broken.
    fn done<T>(&mut self, result: &Result<T, sqlx::Error>) {
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
fn broken(e: &sqlx::Error) -> bool {
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

// === impl PgStore ===

impl PgStore {
    /// Builds a pool for `url` without connecting yet: the server can start,
    /// and recover, while the database is away.
    pub fn connect_lazy(url: &str, settings: &PgSettings) -> Result<PgStore> {
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::Other(format!("invalid PostgreSQL URL: {e}")))?
            .options([(
                "statement_timeout",
                format!("{}", settings.statement_timeout.as_millis()),
            )])
            .log_statements(tracing::log::LevelFilter::Trace);
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .min_connections(0)
            .idle_timeout(Duration::from_secs(30))
            .acquire_timeout(settings.acquire_timeout)
            .connect_lazy_with(options.clone());
        let max = settings.max_connections.max(1);
        let conns = Arc::new(Conns {
            target: Target::of(&options),
            options,
            idle: Mutex::new(Vec::with_capacity(max as usize)),
            permits: Semaphore::new(max as usize),
            acquire_timeout: settings.acquire_timeout,
            answer_timeout: settings.statement_timeout + ANSWER_MARGIN,
            open: AtomicU32::new(0),
        });
        Ok(PgStore {
            pool,
            conns,
            layout: Arc::default(),
        })
    }

    /// The pool, for tests and tools.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs a query returning rows on one of the store's connections; the
    /// first row, if any.
    async fn fetch_row<'q, O>(
        &self,
        query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> Result<Option<O>>
    where
        O: Send + Unpin + for<'r> FromRow<'r, sqlx::postgres::PgRow>,
    {
        let mut conn = self.conns.acquire().await?;
        let result = self
            .conns
            .answered(query.fetch_optional(&mut *conn))
            .await?;
        conn.done(&result);
        result.map_err(|e| classify(e, &self.conns.target))
    }

    /// Runs a query returning one column on one of the store's connections;
    /// the first row's value, if any.
    async fn fetch_scalar<'q, O>(
        &self,
        query: sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> Result<Option<O>>
    where
        O: Send + Unpin,
        (O,): for<'r> FromRow<'r, sqlx::postgres::PgRow>,
    {
        let mut conn = self.conns.acquire().await?;
        let result = self
            .conns
            .answered(query.fetch_optional(&mut *conn))
            .await?;
        conn.done(&result);
        result.map_err(|e| classify(e, &self.conns.target))
    }

    /// Applies the pending migrations; on a Citus cluster, then distributes
    /// the tables and the claim function (see the `citus` module).
    pub async fn migrate(&self) -> Result<()> {
        self.run_migrations().await?;
        let layout = citus::distribute(&self.pool).await?;
        let _ = self.layout.set(layout);
        Ok(())
    }

    /// How the tables are laid out, read once.
    async fn layout(&self) -> Result<Layout> {
        self.layout
            .get_or_try_init(|| async {
                let mut conn = self.conns.acquire().await?;
                let result = self.conns.answered(citus::layout(&mut conn)).await?;
                conn.done(&result);
                result.map_err(|e| classify(e, &self.conns.target))
            })
            .await
            .copied()
    }

    async fn run_migrations(&self) -> Result<()> {
        let target = &self.conns.target;
        match MIGRATOR.run(&self.pool).await {
            Ok(()) => Ok(()),
            // The pool says only that it timed out; one direct attempt says
            // why it could not connect (refused, unknown host, bad password).
            Err(sqlx::migrate::MigrateError::Execute(sqlx::Error::PoolTimedOut)) => {
                match tokio::time::timeout(self.conns.acquire_timeout, self.conns.options.connect())
                    .await
                {
                    Ok(Err(e)) => Err(connect_failed(e, target)),
                    Ok(Ok(_)) => Err(StoreError::Unavailable(format!(
                        "PostgreSQL at {} did not answer in time",
                        target.server()
                    ))),
                    Err(_) => Err(target.no_answer(self.conns.acquire_timeout)),
                }
            }
            Err(sqlx::migrate::MigrateError::Execute(e)) => Err(classify(e, target)),
            Err(sqlx::migrate::MigrateError::ExecuteMigration(e, version)) => {
                Err(match classify(e, target) {
                    StoreError::Unavailable(why) => {
                        StoreError::Unavailable(format!("migration {version}: {why}"))
                    }
                    StoreError::Other(why) => {
                        StoreError::Other(format!("migration {version}: {why}"))
                    }
                })
            }
            Err(other) => Err(StoreError::Other(other.to_string())),
        }
    }
}

/// Transactions of batched writes at once, per process: two, so that one
/// waiting on a row lock (a claim of a key another process's transaction
/// holds) or on a slow statement does not hold up every other write; the
/// other gathers what queued meanwhile.
const BATCH_WRITERS: usize = 2;

impl PgStore {
    /// `writes` in one call of `idemgate_write_batch`: one transaction.
    async fn write_batch_call(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        let n = writes.len();
        let mut ops = Vec::with_capacity(n);
        let mut tenants = Vec::with_capacity(n);
        let mut key_hashes: Vec<Option<&[u8]>> = Vec::with_capacity(n);
        let mut fingerprints: Vec<Option<&str>> = Vec::with_capacity(n);
        let mut ids = Vec::with_capacity(n);
        let mut leases: Vec<Option<f64>> = Vec::with_capacity(n);
        let mut ttls: Vec<Option<f64>> = Vec::with_capacity(n);
        let mut limits: Vec<Option<i64>> = Vec::with_capacity(n);
        let mut statuses: Vec<Option<i32>> = Vec::with_capacity(n);
        let mut headers: Vec<Option<serde_json::Value>> = Vec::with_capacity(n);
        let mut bodies: Vec<Option<&[u8]>> = Vec::with_capacity(n);
        for write in writes {
            let (op, id) = match write {
                Write::Claim(req) => ("claim", req.reservation_id),
                Write::Complete { reservation_id, .. } => ("complete", *reservation_id),
                Write::Release { reservation_id, .. } => ("release", *reservation_id),
            };
            ops.push(op);
            tenants.push(write.tenant());
            ids.push(id);
            let claim = match write {
                Write::Claim(req) => Some(req),
                _ => None,
            };
            key_hashes.push(claim.map(|r| &r.key_hash[..]));
            fingerprints.push(claim.and_then(|r| r.fingerprint.as_deref()));
            leases.push(claim.map(|r| f64::from(r.lease_seconds)));
            ttls.push(claim.map(|r| f64::from(r.ttl_seconds)));
            limits.push(claim.and_then(|r| r.max_in_flight.map(i64::from)));
            let response = match write {
                Write::Complete { response, .. } => Some(response),
                _ => None,
            };
            statuses.push(response.map(|r| i32::from(r.status)));
            headers.push(response.map(|r| headers_json(&r.headers)));
            bodies.push(response.map(|r| &r.body[..]));
        }
        let query = sqlx::query_as(WRITE_BATCH.as_str())
            .bind(tenants.first().copied().unwrap_or_default())
            .bind(&ops)
            .bind(&tenants)
            .bind(&key_hashes)
            .bind(&fingerprints)
            .bind(&ids)
            .bind(&leases)
            .bind(&ttls)
            .bind(&limits)
            .bind(&statuses)
            .bind(&headers)
            .bind(&bodies);
        let rows: Vec<BatchRow> = match self.fetch_all(query).await {
            Ok(rows) => rows,
            Err(e) => return writes.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut answers: Vec<Result<Written>> = writes
            .iter()
            .map(|w| {
                Ok(match w {
                    Write::Claim(_) => Written::Claim(None),
                    Write::Complete { .. } => Written::Complete(None),
                    Write::Release { .. } => Written::Release(None),
                })
            })
            .collect();
        for row in rows {
            let Some(i) = usize::try_from(row.ord)
                .ok()
                .and_then(|ord| ord.checked_sub(1))
                .filter(|&i| i < n)
            else {
                continue;
            };
            let now = row.db_now;
            let claimed = row.claimed;
            answers[i] = Record::try_from(row.row).map(|record| match &writes[i] {
                Write::Claim(_) => Written::Claim(Some(Claim {
                    claimed,
                    record,
                    now,
                })),
                Write::Complete { .. } => Written::Complete(Some(record)),
                Write::Release { .. } => Written::Release(Some(record.key_hash)),
            });
        }
        answers
    }

    /// Runs a query on one of the store's connections; every row.
    async fn fetch_all<'q, O>(
        &self,
        query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<O>>
    where
        O: Send + Unpin + for<'r> FromRow<'r, sqlx::postgres::PgRow>,
    {
        let mut conn = self.conns.acquire().await?;
        let result = self.conns.answered(query.fetch_all(&mut *conn)).await?;
        conn.done(&result);
        result.map_err(|e| classify(e, &self.conns.target))
    }
}

/// Every column of `idempotency_keys`, in the order [`KeyRow`] reads them.
const KEY_COLUMNS: &str = "tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, \
     attempt, recovery_point, recovery_data, response_status, response_headers, response_body, \
     created_at, completed_at, expires_at";

#[derive(FromRow)]
struct KeyRow {
    tenant: String,
    key_hash: Vec<u8>,
    fingerprint: Option<String>,
    state: String,
    reservation_id: Uuid,
    lease_expires_at: Option<DateTime<Utc>>,
    attempt: i32,
    recovery_point: Option<String>,
    recovery_data: Option<serde_json::Value>,
    response_status: Option<i32>,
    response_headers: Option<serde_json::Value>,
    response_body: Option<Vec<u8>>,
    created_at: DateTime<Utc>,
    completed_at: Option<DateTime<Utc>>,
    expires_at: DateTime<Utc>,
}

#[derive(FromRow)]
struct ClaimRow {
    claimed: bool,
    db_now: DateTime<Utc>,
    #[sqlx(flatten)]
    row: KeyRow,
}

#[derive(FromRow)]
struct BatchRow {
    ord: i32,
    claimed: bool,
    db_now: DateTime<Utc>,
    #[sqlx(flatten)]
    row: KeyRow,
}

#[derive(FromRow)]
struct FoundRow {
    db_now: DateTime<Utc>,
    #[sqlx(flatten)]
    row: KeyRow,
}

impl TryFrom<KeyRow> for Record {
    type Error = StoreError;

    fn try_from(r: KeyRow) -> Result<Record> {
        let state = KeyState::parse(&r.state)?;
        let response = StoredResponse::from_columns(
            r.response_status.map(i64::from),
            r.response_headers,
            r.response_body,
        )?;
        Ok(Record {
            tenant: r.tenant,
            key_hash: r.key_hash,
            fingerprint: r.fingerprint,
            state,
            reservation_id: r.reservation_id,
            lease_expires_at: r.lease_expires_at,
            attempt: r.attempt,
            recovery: r.recovery_point.map(|recovery_point| Recovery {
                recovery_point,
                data: r.recovery_data,
            }),
            response,
            created_at: r.created_at,
            completed_at: r.completed_at,
            expires_at: r.expires_at,
        })
    }
}

/// Where the store connects, as messages name it: the server, the database
/// and the role, never the password.
#[derive(Debug, Clone)]
struct Target {
    /// `HOST:PORT`, or the Unix socket's path.
    server: String,
    /// The database, as the server will look it up.
    database: String,
    /// The role.
    user: String,
    /// The server's flags for the PostgreSQL tools (`-h … -p …`).
    host_flags: String,
}

impl Target {
    fn of(options: &PgConnectOptions) -> Target {
        let user = options.get_username().to_owned();
        let (server, host) = match options.get_socket() {
            Some(socket) => (socket.display().to_string(), socket.display().to_string()),
            None => (
                format!("{}:{}", options.get_host(), options.get_port()),
                options.get_host().to_owned(),
            ),
        };
        Target {
            host_flags: format!("-h {} -p {}", shell_word(&host), options.get_port()),
            server,
            // PostgreSQL's default database is the role's name.
            database: options.get_database().unwrap_or(&user).to_owned(),
            user,
        }
    }

    fn server(&self) -> &str {
        &self.server
    }

    /// The server did not let a connection through within `waited`.
    fn no_answer(&self, waited: Duration) -> StoreError {
        StoreError::Unavailable(format!(
            "no connection to the database within {} s: is PostgreSQL running at {}, and \
             reachable from here?",
            waited.as_secs(),
            self.server
        ))
    }
}

/// `word` as one shell word, quoted only when it needs to be.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:@".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// What to do about a database without idemgate's tables.
const NO_TABLES: &str = "run `idemgate migrate` (or start idemgate without --no-migrate: it \
     applies the migrations at start)";

/// Sorts sqlx errors into "try again later" and "broken"; each message names
/// the cause in the server's words (without sqlx's "at line N", the line of
/// PostgreSQL's own source that raised it) and, where the cause is a setup
/// step not taken, what to do. A database that does not exist, a role the
/// server refuses, tables not created yet: the database cannot serve, but
/// nothing is broken, and it heals once the step is taken, so those are
/// `Unavailable` like an outage, never a bug's `Other`.
fn classify(e: sqlx::Error, at: &Target) -> StoreError {
    match &e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => StoreError::Unavailable(e.to_string()),
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            let said = format!("{} (SQLSTATE {code})", db.message());
            // For a refusal at connect: which server refused.
            let refused = format!("{} on {} (SQLSTATE {code})", db.message(), at.server);
            match code.as_ref() {
                // invalid_catalog_name: the database does not exist.
                "3D000" => StoreError::Unavailable(format!(
                    "{refused}: create it: createdb {} {} -U {}, then apply the migrations: \
                     idemgate migrate",
                    shell_word(&at.database),
                    at.host_flags,
                    shell_word(&at.user)
                )),
                // invalid_authorization_specification: no such role, or
                // pg_hba.conf turned the connection away.
                "28000" if db.message().contains("does not exist") => {
                    StoreError::Unavailable(format!(
                        "{refused}: check the user in DATABASE_URL, or create the role (as a \
                         role that may create roles): createuser {} {}",
                        shell_word(&at.user),
                        at.host_flags
                    ))
                }
                "28000" => StoreError::Unavailable(format!(
                    "{refused}: check the user and password in DATABASE_URL, and the rules \
                     of the server's pg_hba.conf"
                )),
                // invalid_password.
                "28P01" => StoreError::Unavailable(format!(
                    "{refused}: check the password in DATABASE_URL"
                )),
                // undefined_table, or undefined_function for the claim
                // function: the migrations were not (all) applied.
                "42P01" => no_tables(&said, at),
                "42883" if db.message().contains("idemgate_") => no_tables(&said, at),
                // 08: connection exception; 57: operator intervention
                // (shutdown, statement timeout 57014); 53: insufficient
                // resources.
                c if c.starts_with("08") || c.starts_with("57") || c.starts_with("53") => {
                    StoreError::Unavailable(said)
                }
                _ => StoreError::Other(said),
            }
        }
        _ => StoreError::Other(e.to_string()),
    }
}

/// A database without the tables; `said` is the server's word for it.
fn no_tables(said: &str, at: &Target) -> StoreError {
    StoreError::Unavailable(format!(
        "{said}: the database {} on {} has no idemgate tables: {NO_TABLES}",
        shell_word(&at.database),
        at.server
    ))
}

/// A connection that could not be made: whatever stopped it, the database
/// cannot serve this process, which is no bug of the request's.
fn connect_failed(e: sqlx::Error, at: &Target) -> StoreError {
    let io = matches!(e, sqlx::Error::Io(_) | sqlx::Error::Tls(_));
    match classify(e, at) {
        StoreError::Unavailable(why) if io => StoreError::Unavailable(format!(
            "cannot connect to the database: {why}: is PostgreSQL running at {}, and \
             reachable from here?",
            at.server
        )),
        StoreError::Unavailable(why) => StoreError::Unavailable(why),
        StoreError::Other(why) => StoreError::Unavailable(format!(
            "cannot connect to the database at {}: {why}",
            at.server
        )),
    }
}

fn headers_json(headers: &[(String, String)]) -> serde_json::Value {
    serde_json::Value::Array(
        headers
            .iter()
            .map(|(n, v)| serde_json::json!([n, v]))
            .collect(),
    )
}

// The claim (migration `20261202000001_reserve_function.sql`): insert a new
// record, or, under the row lock that ON CONFLICT takes, reset an expired one
// or take over an in-flight one whose lease ended; else read the record as it
// stands. `$7` is the tenant's limit of live in-flight keys, NULL for none. A
// function, so that it is one router call on Citus too: see the migration.
static RESERVE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT claimed, db_now, {KEY_COLUMNS}
           FROM idemgate_reserve($1, $2, $3, $4, $5, $6, $7)"
    )
});

// Claims, commits and releases in one call (migration
// `20261203000001_write_batch_function.sql`); the arrays hold one item per
// write, NULL where a kind of write has no such argument.
static WRITE_BATCH: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT ord, claimed, db_now, {KEY_COLUMNS}
           FROM idemgate_write_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
    )
});

static PRUNE: LazyLock<String> = LazyLock::new(|| {
    citus::prune_sql(
        "idempotency_keys",
        "idempotency_reservations",
        "now()",
        "$1",
    )
});

/// Restricts a statement on `idempotency_keys k` to the row whose current
/// holder is reservation `$2` of tenant `$1`, while the record is alive.
const CURRENT_HOLDER: &str = "k.tenant = $1 AND k.reservation_id = $2
       AND k.key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                          WHERE r.tenant = $1 AND r.reservation_id = $2)
       AND k.state = 'in_flight' AND k.expires_at > now()";

static COMPLETE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idempotency_keys k SET state = 'completed', response_status = $3,
                response_headers = $4, response_body = $5, completed_at = now(),
                lease_expires_at = NULL
          WHERE {CURRENT_HOLDER}
      RETURNING {KEY_COLUMNS}"
    )
});

static RELEASE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idempotency_keys k SET expires_at = now(), lease_expires_at = now()
          WHERE {CURRENT_HOLDER}
      RETURNING k.key_hash"
    )
});

static EXTEND: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idempotency_keys k SET lease_expires_at = now() + make_interval(secs => $3)
          WHERE {CURRENT_HOLDER}
      RETURNING k.lease_expires_at"
    )
});

static CHECKPOINT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idempotency_keys k SET recovery_point = $3, recovery_data = $4
          WHERE {CURRENT_HOLDER}
      RETURNING {KEY_COLUMNS}"
    )
});

static FIND: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT now() AS db_now, {KEY_COLUMNS} FROM idempotency_keys k
          WHERE k.tenant = $1
            AND k.key_hash = (SELECT r.key_hash FROM idempotency_reservations r
                               WHERE r.tenant = $1 AND r.reservation_id = $2)"
    )
});

/// A tenant's live in-flight keys, up to `$2`; the partial index
/// `idempotency_keys_in_flight` holds exactly these rows.
const IN_FLIGHT_USAGE: &str = "SELECT count(*), min(lease_expires_at), now() FROM (
        SELECT lease_expires_at FROM idempotency_keys
         WHERE tenant = $1 AND state = 'in_flight' AND lease_expires_at > now()
           AND expires_at > now()
         ORDER BY lease_expires_at
         LIMIT $2) live";

/// What a tenant's completed records take. `octet_length` of a bytea and
/// `pg_column_size` of a jsonb read the stored size without decompressing.
const STORED_USAGE: &str = "SELECT coalesce(sum(coalesce(octet_length(response_body), 0)
                         + coalesce(pg_column_size(response_headers), 0)), 0)::int8,
                min(expires_at), now()
           FROM idempotency_keys
          WHERE tenant = $1 AND state = 'completed' AND expires_at > now()";

/// The statements behind [`Store::reserve`] and [`Store::complete`], for tools
/// that measure the database's own share of a request (the benchmark's
/// raw-SQL bound sends exactly these).
///
/// `reserve` binds: tenant (text), key hash (bytea), fingerprint (text, null
/// allowed), new reservation id (uuid), lease and TTL seconds (float8), the
/// tenant's limit of in-flight keys (int8, null for none).
/// `complete` binds: tenant, reservation id, status (int4), headers (jsonb
/// array of `[name, value]`), body (bytea).
pub mod sql {
    /// One round trip that claims a key or reads it as it stands.
    pub fn reserve() -> &'static str {
        super::RESERVE.as_str()
    }

    /// One round trip that stores the response and completes the key.
    pub fn complete() -> &'static str {
        super::COMPLETE.as_str()
    }

    /// Every per-request statement, by name, for tests that check how a
    /// distributed database plans each. Binds, after tenant (text):
    /// `reserve` as above; `complete` as above; `release`: reservation id;
    /// `extend`: reservation id, lease seconds (float8); `checkpoint`:
    /// reservation id, recovery point (text), data (jsonb); `find`:
    /// reservation id; `in_flight_usage`: limit (int8); `stored_usage`:
    /// nothing.
    pub fn per_request() -> [(&'static str, &'static str); 8] {
        [
            ("reserve", super::RESERVE.as_str()),
            ("complete", super::COMPLETE.as_str()),
            ("release", super::RELEASE.as_str()),
            ("extend", super::EXTEND.as_str()),
            ("checkpoint", super::CHECKPOINT.as_str()),
            ("find", super::FIND.as_str()),
            ("in_flight_usage", super::IN_FLIGHT_USAGE),
            ("stored_usage", super::STORED_USAGE),
        ]
    }
}

#[async_trait]
impl Store for PgStore {
    async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        // The function's read has a snapshot of its own, taken after the
        // claim, so it sees what a concurrent claim committed; a record gone
        // between the two (pruned at that instant) is tried again. Under a
        // limit, nothing twice running means the limit held the claim back
        // from a key with no record.
        for round in 0..5 {
            let query = sqlx::query_as(RESERVE.as_str())
                .bind(&req.tenant)
                .bind(&req.key_hash[..])
                .bind(&req.fingerprint)
                .bind(req.reservation_id)
                .bind(f64::from(req.lease_seconds))
                .bind(f64::from(req.ttl_seconds))
                .bind(req.max_in_flight.map(i64::from));
            let row: Option<ClaimRow> = self.fetch_row(query).await?;
            match row {
                Some(row) => {
                    return Ok(Some(Claim {
                        claimed: row.claimed,
                        now: row.db_now,
                        record: row.row.try_into()?,
                    }));
                }
                None if req.max_in_flight.is_some() && round > 0 => return Ok(None),
                None => {}
            }
        }
        Err(StoreError::Unavailable(
            "the record kept changing under the claim; try again".into(),
        ))
    }

    async fn complete(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        response: &StoredResponse,
    ) -> Result<Option<Record>> {
        let row: Option<KeyRow> = self
            .fetch_row(
                sqlx::query_as(COMPLETE.as_str())
                    .bind(tenant)
                    .bind(reservation_id)
                    .bind(i32::from(response.status))
                    .bind(headers_json(&response.headers))
                    .bind(&response.body),
            )
            .await?;
        row.map(Record::try_from).transpose()
    }

    async fn release(&self, tenant: &str, reservation_id: Uuid) -> Result<Option<Vec<u8>>> {
        // Expiring the record at once makes the key new again and
        // kills the id; the pruning job deletes the row later.
        self.fetch_scalar(
            sqlx::query_scalar(RELEASE.as_str())
                .bind(tenant)
                .bind(reservation_id),
        )
        .await
    }

    async fn extend(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        lease_seconds: u32,
    ) -> Result<Option<DateTime<Utc>>> {
        self.fetch_scalar(
            sqlx::query_scalar(EXTEND.as_str())
                .bind(tenant)
                .bind(reservation_id)
                .bind(f64::from(lease_seconds)),
        )
        .await
    }

    async fn checkpoint(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        recovery: &Recovery,
    ) -> Result<Option<Record>> {
        let row: Option<KeyRow> = self
            .fetch_row(
                sqlx::query_as(CHECKPOINT.as_str())
                    .bind(tenant)
                    .bind(reservation_id)
                    .bind(&recovery.recovery_point)
                    .bind(&recovery.data),
            )
            .await?;
        row.map(Record::try_from).transpose()
    }

    async fn find_by_reservation(
        &self,
        tenant: &str,
        reservation_id: Uuid,
    ) -> Result<Option<Found>> {
        let row: Option<FoundRow> = self
            .fetch_row(
                sqlx::query_as(FIND.as_str())
                    .bind(tenant)
                    .bind(reservation_id),
            )
            .await?;
        row.map(|r| {
            Ok(Found {
                now: r.db_now,
                record: r.row.try_into()?,
            })
        })
        .transpose()
    }

    async fn prune_expired_batch(&self, limit: i64) -> Result<PruneBatch> {
        if limit <= 0 {
            return Ok(PruneBatch::default());
        }
        // SKIP LOCKED: rows a reservation (or another pruner) holds are left
        // for the next pass, so pruning never waits on live traffic and two
        // pruners never delete the same row. On Citus, the same statement
        // runs shard by shard.
        match self.layout().await? {
            Layout::Single => {
                let deleted: Option<i64> = self
                    .fetch_scalar(sqlx::query_scalar(PRUNE.as_str()).bind(limit))
                    .await?;
                let deleted = deleted.and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
                Ok(PruneBatch::of(deleted, limit))
            }
            Layout::Citus { .. } => {
                let per_shard = citus::per_shard(limit);
                let sql = citus::prune_shards_sql(per_shard);
                let row: Option<citus::ShardsPruned> = self
                    .fetch_row(sqlx::query_as(sqlx::AssertSqlSafe(sql)))
                    .await?;
                let row = row.ok_or_else(|| StoreError::Other("pruning returned no row".into()))?;
                Ok(row.batch(per_shard))
            }
        }
    }

    async fn in_flight_usage(&self, tenant: &str, up_to: u32) -> Result<InFlightUsage> {
        // The count stops at `up_to`.
        let row: Option<(i64, Option<DateTime<Utc>>, DateTime<Utc>)> = self
            .fetch_row(
                sqlx::query_as(IN_FLIGHT_USAGE)
                    .bind(tenant)
                    .bind(i64::from(up_to)),
            )
            .await?;
        let (keys, next_lease_end, now) =
            row.ok_or_else(|| StoreError::Other("count returned no row".into()))?;
        Ok(InFlightUsage {
            keys: u64::try_from(keys).unwrap_or(0),
            next_lease_end,
            now,
        })
    }

    async fn stored_usage(&self, tenant: &str) -> Result<StoredUsage> {
        let row: Option<(i64, Option<DateTime<Utc>>, DateTime<Utc>)> = self
            .fetch_row(sqlx::query_as(STORED_USAGE).bind(tenant))
            .await?;
        let (bytes, next_expiry, now) =
            row.ok_or_else(|| StoreError::Other("sum returned no row".into()))?;
        Ok(StoredUsage {
            bytes: u64::try_from(bytes).unwrap_or(0),
            next_expiry,
            now,
        })
    }

    async fn ping(&self) -> Result<()> {
        // What every request needs beyond a connection: the two tables and
        // the claim function. Catalog lookups, evaluated at each execution (a
        // cached plan would keep the answer of its first run), reading
        // neither table.
        let found: Option<(bool, bool, bool, bool)> = self
            .fetch_row(sqlx::query_as(
                "SELECT to_regclass('idempotency_keys') IS NOT NULL,
                        to_regclass('idempotency_reservations') IS NOT NULL,
                        to_regprocedure(
                            'idemgate_reserve(text, bytea, text, uuid, float8, float8, int8)')
                            IS NOT NULL,
                        to_regprocedure(
                            'idemgate_write_batch(text, text[], text[], bytea[], text[], uuid[],
                                                  float8[], float8[], int8[], int4[], jsonb[],
                                                  bytea[])')
                            IS NOT NULL",
            ))
            .await?;
        match found {
            Some((true, true, true, true)) => Ok(()),
            // In the words a request would get, so that both are one cause.
            Some((keys, reservations, reserve, _)) => {
                let missing = if !keys {
                    "relation \"idempotency_keys\" does not exist (SQLSTATE 42P01)"
                } else if !reservations {
                    "relation \"idempotency_reservations\" does not exist (SQLSTATE 42P01)"
                } else if !reserve {
                    "function idemgate_reserve does not exist (SQLSTATE 42883)"
                } else {
                    "function idemgate_write_batch does not exist (SQLSTATE 42883)"
                };
                Err(no_tables(missing, &self.conns.target))
            }
            None => Err(StoreError::Other(
                "the readiness query returned no row".into(),
            )),
        }
    }

    async fn write_batch(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        let layout = match self.layout().await {
            Ok(layout) => layout,
            Err(e) => return writes.iter().map(|_| Err(e.clone())).collect(),
        };
        match layout {
            Layout::Single => self.write_batch_call(writes).await,
            // The function runs on the node that holds its tenant's shard: a
            // call per tenant, each its own transaction there.
            Layout::Citus { .. } => {
                let mut by_tenant: Vec<(&str, Vec<usize>)> = Vec::new();
                for (i, write) in writes.iter().enumerate() {
                    match by_tenant.iter_mut().find(|(t, _)| *t == write.tenant()) {
                        Some((_, items)) => items.push(i),
                        None => by_tenant.push((write.tenant(), vec![i])),
                    }
                }
                let mut answers: Vec<Option<Result<Written>>> =
                    (0..writes.len()).map(|_| None).collect();
                for (_, items) in by_tenant {
                    let group: Vec<&Write> = items.iter().map(|&i| writes[i]).collect();
                    for (&i, answer) in items.iter().zip(self.write_batch_call(&group).await) {
                        answers[i] = Some(answer);
                    }
                }
                answers
                    .into_iter()
                    .map(|a| a.unwrap_or_else(|| Err(StoreError::Other("no answer".into()))))
                    .collect()
            }
        }
    }

    fn batch_writers(&self) -> usize {
        BATCH_WRITERS
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        let size = self.conns.open.load(Ordering::Relaxed);
        let idle = self.conns.idle.lock().map_or(0, |idle| idle.len());
        let idle = u32::try_from(idle).unwrap_or(u32::MAX);
        Some(PoolStats { size, idle })
    }
}
