//! Where idempotency records live: the [`Store`] traits — [`HotPath`] for
//! what a request's path writes and reads, [`Queries`] for what operators
//! read and settle, [`Maintenance`] for what the maintenance tasks run — and
//! their implementations. SQL lives only below this module.
//!
//! A store states facts (this claim applied, this record is there) and
//! decides nothing. The traits are here, its records in `records.rs`, how it
//! fails in `error.rs` ([`StoreError`] keeps the sqlx, rusqlite or io error
//! as its source). `batch/` is the group commit: [`Batcher`] (which the
//! engine holds beside the store) queues claims, commits and releases, the
//! writer tasks (`writer.rs`) write what queued as one transaction,
//! `plan.rs` decides what goes into each, and `same_key.rs` lets a duplicate
//! claim take the answer of its key's claim this process is writing.
//! `sqlite/` and `postgres/` share one shape: `mod.rs` (open, migrate),
//! `store.rs` (the traits' operations), `sql.rs` (every statement a
//! `concat!` constant over the shared `key_columns!`), `rows.rs`, `errors.rs`
//! (what a database failure means), and their own parts; `schema.rs` holds
//! the upgrade rules both share.
//!
//! # One row per key
//!
//! A key is one row of `idempotency_keys` on both stores: a claim finds it by
//! its primary key `(tenant, key_hash)`, and everything its holder does after
//! (commit, release, extend, checkpoint, mark unknown, the look-up by id) by
//! the unique index `(reservation_id, tenant)` — the id first, so that no
//! plan takes it for a look-up by tenant and key. A new key writes that row
//! and nothing else. `idempotency_reservations` holds only the ids a claim
//! superseded (a takeover of a lapsed lease, or a claim of an expired or
//! released key), written by that claim in its transaction, so that a dead
//! id still finds its key and answers `409 lease-lost`, never
//! `404 not-found`; a look-up by id tries the record's current id, then that
//! table, and pruning deletes a key's superseded ids with it.

mod batch;
mod error;
#[cfg(feature = "postgres")]
pub mod postgres;
mod records;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub mod schema;
#[cfg(feature = "sqlite")]
mod sqlite;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

pub use batch::Batcher;
pub use error::{Cause, Result, StoreError, report_unavailable};
#[cfg(feature = "postgres")]
pub use postgres::{PgSettings, PgStore};
pub use records::{
    BatchStats, Claim, ClaimRequest, ClaimedRequest, Found, InFlightUsage, KeptRequest, KeyCursor,
    KeyPage, KeyQuery, KeyState, LeaseExpiry, MarkedUnknown, PoolStats, PruneBatch, Record,
    Recovery, Resolution, Resolve, ResolveAction, StoredResponse, StoredUsage, Write, Written,
};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;

/// What an acknowledged write survives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// The database server it was written to: lost with that server (a
    /// primary lost and an asynchronous standby promoted).
    Local,
    /// The loss of the primary: a synchronous standby had it before it was
    /// acknowledged.
    SynchronousStandby,
}

impl Durability {
    /// As `GET /v1/policy` says it.
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Local => "local",
            Durability::SynchronousStandby => "synchronous-standby",
        }
    }
}

/// Every column of `idempotency_keys`, in the order both stores read a
/// record back: the schema is the same in both, so the list is one.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
macro_rules! key_columns {
    () => {
        "tenant, key_hash, fingerprint, state, reservation_id, lease_expires_at, attempt, \
         recovery_point, recovery_data, response_status, response_headers, response_body, \
         created_at, completed_at, expires_at, on_lease_expiry, resolved_action, resolved_reason, \
         resolved_by, resolved_at, unknown_reason, unknown_at, unknown_reservation_id, request"
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) use key_columns;

/// A struct read from a row by column name, as `#[derive(sqlx::FromRow)]`
/// reads it: each field from the column of its name (found where the
/// previous field's column ends, when it is there: [`column_at`]), and a
/// field marked `@flatten` (last) read whole from the same row, as
/// `#[sqlx(flatten)]`.
/// Written without sqlx's procedural macros (build.rs says why).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
macro_rules! from_row {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident from $row:ty {
            $($(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty,)*
            $(@flatten $flat_vis:vis $flat:ident : $flat_ty:ty,)?
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $($(#[$fmeta])* $fvis $field: $ty,)*
            $($flat_vis $flat: $flat_ty,)?
        }

        impl $name {
            /// Reads the struct from `row`, its columns looked for from
            /// `*next` on ([`column_at`](crate::store::column_at)).
            fn from_row_at(row: &$row, next: &mut usize) -> Result<Self, sqlx::Error> {
                use sqlx::Row as _;
                Ok(Self {
                    $($field: row.try_get($crate::store::column_at(row, next, stringify!($field))?)?,)*
                    $($flat: <$flat_ty>::from_row_at(row, next)?,)?
                })
            }
        }

        impl<'r> sqlx::FromRow<'r, $row> for $name {
            fn from_row(row: &'r $row) -> Result<Self, sqlx::Error> {
                Self::from_row_at(row, &mut 0)
            }
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) use from_row;

/// The index of the column `name` in `row`, for [`from_row!`]: the column at
/// `*next` when it has that name, else the one the row's map of names finds;
/// `*next` moves past it. A struct's fields are its statement's columns in
/// order ([`key_columns!`]), so a field costs one comparison of names where
/// a look-up by name hashes the name (SipHash) into that map: 50 look-ups
/// per proxied key on PostgreSQL, about 4,000 of its 261,000 instructions.
/// A row whose columns come in another order is read by name, as before.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn column_at<R: sqlx::Row>(
    row: &R,
    next: &mut usize,
    name: &str,
) -> std::result::Result<usize, sqlx::Error>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
{
    use sqlx::Column as _;
    let i = match row.columns().get(*next) {
        Some(column) if column.name() == name => *next,
        _ => sqlx::ColumnIndex::index(&name, row)?,
    };
    *next = i + 1;
    Ok(i)
}

/// What a store is: everything the engine, the operators' commands and the
/// maintenance tasks ask of it, each operation atomic across every process
/// that shares the database. It is the sum of three traits, one per job:
/// [`HotPath`] (what a request's path through the engine writes and reads),
/// [`Queries`] (what operators read and settle, and the usage figures tenant
/// limits are checked against) and [`Maintenance`] (pruning, readiness, pool
/// figures). Every type that implements the three is a `Store`; hold an
/// `Arc<dyn Store>` where all of them are needed.
pub trait Store: HotPath + Queries + Maintenance {}

impl<T: HotPath + Queries + Maintenance + ?Sized> Store for T {}

/// What the engine writes and reads on a request's path: claims, commits,
/// releases, lease extensions, checkpoints, unknown marks, and look-ups by
/// reservation id; and the hooks that let claims, commits and releases share
/// transactions ([`Batcher`]). Writes addressed by reservation id apply only
/// while that id is the key's current holder and the record has not
/// expired; they return `None` otherwise, and the engine asks
/// [`HotPath::find_by_reservation`] why.
#[async_trait]
pub trait HotPath: Send + Sync + 'static {
    /// Claims the key or returns its record as it stands (see [`Claim`]).
    /// `None` only under [`ClaimRequest::max_in_flight`]: the limit kept the
    /// claim from applying and the key has no record.
    async fn reserve(&self, req: &ClaimRequest) -> Result<Option<Claim>>;
    /// Stores the response and completes the key.
    async fn complete(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        response: &StoredResponse,
    ) -> Result<Option<Record>>;
    /// Forgets an in-flight key: it is new again at once. Returns its key hash.
    async fn release(&self, tenant: &str, reservation_id: Uuid) -> Result<Option<Vec<u8>>>;
    /// Moves the lease end to now + `lease_seconds`; with `on_lease_expiry`,
    /// the lease's end means that from now on (a call waiting for its
    /// client's input is released at it, [`LeaseExpiry::Takeover`]).
    async fn extend(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        lease_seconds: u32,
        on_lease_expiry: Option<LeaseExpiry>,
    ) -> Result<Option<DateTime<Utc>>>;
    /// Records a recovery point.
    async fn checkpoint(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        recovery: &Recovery,
    ) -> Result<Option<Record>>;
    /// Marks the key the id holds [`KeyState::Unknown`]: its holder cannot
    /// tell whether the effect happened, and says why (`reason`, kept with
    /// the record as a [`MarkedUnknown`]). Applies while the id holds the
    /// key in flight, or already unknown (then the first mark's reason and
    /// time stay); returns its key hash.
    async fn mark_unknown(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        reason: &str,
    ) -> Result<Option<Vec<u8>>>;
    /// The record a reservation id belongs or belonged to, if it still exists.
    async fn find_by_reservation(
        &self,
        tenant: &str,
        reservation_id: Uuid,
    ) -> Result<Option<Found>>;

    /// Applies `writes` in the order given, as if one by one (each sees what
    /// the ones before it did), in one transaction that has committed when
    /// this returns: one durable write for all of them. One answer per write,
    /// in order; an `Err` says that write's transaction failed and nothing is
    /// known of it (the caller then writes it alone). A store without
    /// transactions of its own keeps this default, which writes one by one.
    async fn write_batch(&self, writes: &[&Write]) -> Vec<Result<Written>> {
        let mut answers = Vec::with_capacity(writes.len());
        for write in writes {
            answers.push(write_one(self, write).await);
        }
        answers
    }

    /// How many transactions of batched writes the store runs at once: one
    /// where there is one writer anyway (SQLite); more where a transaction
    /// that waits (on a row lock another process holds) must not hold up
    /// every other write of the process (PostgreSQL).
    fn batch_writers(&self) -> usize {
        1
    }

    /// Whether the store groups its claims, commits and releases itself, on
    /// a writer of its own that takes whatever queued while it wrote the
    /// last group (SQLite, on its writer thread). [`Batcher`] then hands
    /// them to it one by one, straight, and only makes a duplicate claim
    /// wait for its key's claim being written; otherwise it groups them
    /// and hands each group to [`HotPath::write_batch`].
    fn groups_own_writes(&self) -> bool {
        false
    }

    /// How a store that groups its own writes
    /// ([`HotPath::groups_own_writes`]) has grouped them; `None` for the
    /// others, whose writes [`Batcher`] groups and counts.
    fn own_batches(&self) -> Option<BatchStats> {
        None
    }

    /// Writes `writes` as one group, now, as the store's own grouping would
    /// had they queued together (see [`Batcher::write_together`]); answers in
    /// order. A store that does not group its own writes
    /// ([`HotPath::groups_own_writes`]) writes them as one batch.
    async fn write_grouped(&self, writes: Vec<Write>) -> Vec<Result<Written>> {
        let refs: Vec<&Write> = writes.iter().collect();
        self.write_batch(&refs).await
    }
}

/// What operators read and settle (a key's record, a page of keys, a stuck
/// key resolved, the count of stuck keys) and the usage figures a tenant's
/// limits are checked against: reads across a tenant's or every tenant's
/// keys, off a new key's path.
#[async_trait]
pub trait Queries: Send + Sync + 'static {
    /// The record of a key, if it has one (alive or not).
    async fn find_key(&self, tenant: &str, key_hash: &[u8]) -> Result<Option<Found>>;
    /// A page of alive records, oldest first (see [`KeyQuery`]).
    async fn list_keys(&self, query: &KeyQuery) -> Result<KeyPage>;
    /// Up to `limit` key hashes of alive records of `tenant` from `low` to
    /// `high` (both included), in order: what a prefix of a key hash matches, looked up
    /// as a range of the primary key rather than a scan.
    async fn key_hashes_between(
        &self,
        tenant: &str,
        low: &[u8],
        high: &[u8],
        limit: i64,
    ) -> Result<Vec<Vec<u8>>> {
        let _ = (tenant, low, high, limit);
        Err(StoreError::other(
            "this store cannot look a key up by a prefix of its hash",
        ))
    }
    /// Settles a stuck key: applies only while the record is alive, still
    /// has the reservation id `resolve` names, and is unknown or in flight
    /// past its lease. Returns the record as it left it.
    async fn resolve(&self, resolve: &Resolve) -> Result<Option<Found>>;
    /// Alive keys that are unknown or in flight past their lease: those
    /// nobody will settle by themselves (the gauge `idemgate_keys_unknown`).
    async fn count_stuck(&self) -> Result<u64>;
    /// The tenant's live in-flight keys, counted up to `up_to`.
    async fn in_flight_usage(&self, tenant: &str, up_to: u32) -> Result<InFlightUsage>;
    /// What the tenant's completed, unexpired records take; this reads every
    /// one of them, so callers keep the answer a while.
    async fn stored_usage(&self, tenant: &str) -> Result<StoredUsage>;
}

/// What the maintenance tasks and the operations endpoints run: pruning of
/// expired records, the readiness ping, pool figures, and what a write
/// survives.
#[async_trait]
pub trait Maintenance: Send + Sync + 'static {
    /// Deletes up to about `limit` expired records without waiting on locked
    /// rows; says how many it deleted and whether more may be left.
    async fn prune_expired_batch(&self, limit: i64) -> Result<PruneBatch>;
    /// Succeeds when the database answers and holds the tables that every
    /// request needs: what readiness means.
    async fn ping(&self) -> Result<()>;
    /// Pool figures, where the store has a pool.
    fn pool_stats(&self) -> Option<PoolStats>;

    /// Keeps the window `name` open for at least `seconds` more, by the
    /// database's clock (a later end already set stays).
    async fn open_window(&self, name: &str, seconds: u64) -> Result<()>;

    /// The windows open now: those some process said would be open until a
    /// time that has not come yet.
    async fn open_windows(&self) -> Result<Vec<String>>;

    /// What an acknowledged write survives (`GET /v1/policy`'s
    /// `durability`): the loss of this server's disk only (`Local`), or the
    /// loss of the primary, a synchronous standby having had it.
    fn durability(&self) -> Durability {
        Durability::Local
    }
}

/// `write` on its own, through the one-by-one operation of `store`
/// ([`HotPath::reserve`], [`HotPath::complete`] or [`HotPath::release`]).
pub async fn write_one<S: HotPath + ?Sized>(store: &S, write: &Write) -> Result<Written> {
    Ok(match write {
        Write::Claim(req) => Written::Claim(store.reserve(req).await?),
        Write::Complete {
            tenant,
            reservation_id,
            response,
        } => Written::Complete(store.complete(tenant, *reservation_id, response).await?),
        Write::Release {
            tenant,
            reservation_id,
        } => Written::Release(store.release(tenant, *reservation_id).await?),
    })
}

/// The migrations the build embedded for one store (build.rs writes
/// `migrations_<store>.rs`: version, description, text), as the `Migrator`
/// `sqlx::migrate!` would make of the same folder: the same versions,
/// descriptions, checksums (SHA-384 of the text, computed here once, at
/// first use) and `-- no-transaction` marks. Migrations a newer release
/// applied are no reason to refuse (`ignore_missing`): a rollback to this
/// release works on them unless one is a contract step ([`schema`]).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn embedded_migrator(
    files: &'static [(i64, &'static str, &'static str)],
) -> sqlx::migrate::Migrator {
    use sqlx::migrate::{Migration, MigrationType, Migrator};
    use std::borrow::Cow;
    let migrations: Vec<Migration> = files
        .iter()
        .map(|&(version, description, sql)| {
            Migration::new(
                version,
                Cow::Borrowed(description),
                MigrationType::Simple,
                sqlx::SqlStr::from_static(sql),
                sql.starts_with("-- no-transaction"),
            )
        })
        .collect();
    Migrator {
        migrations: Cow::Owned(migrations),
        ignore_missing: true,
        ..Migrator::DEFAULT
    }
}

/// What of `migrator`'s migrations `applied` (the versions a database's
/// `_sqlx_migrations` records) lacks, in words; `None` if nothing.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn missing_migrations(
    migrator: &sqlx::migrate::Migrator,
    applied: &[i64],
) -> Option<String> {
    let missing: Vec<String> = migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .filter(|m| !applied.contains(&m.version))
        .map(|m| m.version.to_string())
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "has not had this version's migrations applied ({} missing: {})",
            missing.len(),
            missing.join(", ")
        )
    })
}

#[cfg(all(test, feature = "sqlite", feature = "postgres"))]
mod tests {
    use sqlx::migrate::Migrator;

    /// The build's embedded list is what sqlx itself reads from the folder
    /// (as `sqlx::migrate!` did, and as older releases recorded each
    /// migration's checksum in `_sqlx_migrations`): the same migrations in
    /// the same order, with the same descriptions, checksums and
    /// `-- no-transaction` marks.
    #[tokio::test]
    async fn embedded_migrations_are_what_sqlx_reads_from_the_folder() {
        for (embedded, dir) in [
            (&*super::postgres::MIGRATOR, "migrations/postgres"),
            (&*super::sqlite::MIGRATOR, "migrations/sqlite"),
        ] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
            let read = Migrator::new(path).await.expect("sqlx reads the folder");
            let ours: Vec<_> = embedded.iter().collect();
            let sqlx: Vec<_> = read.iter().collect();
            assert!(ours.len() >= 9, "{dir}: {} migrations embedded", ours.len());
            assert_eq!(ours.len(), sqlx.len(), "{dir}: how many");
            for (a, b) in ours.iter().zip(&sqlx) {
                assert_eq!(a.version, b.version, "{dir}");
                assert_eq!(a.description, b.description, "{dir} {}", a.version);
                assert_eq!(a.checksum, b.checksum, "{dir} {}", a.version);
                assert_eq!(a.no_tx, b.no_tx, "{dir} {}", a.version);
                assert_eq!(a.migration_type, b.migration_type, "{dir} {}", a.version);
                assert_eq!(a.sql.as_str(), b.sql.as_str(), "{dir} {}", a.version);
            }
            assert!(
                embedded.ignore_missing,
                "{dir}: a newer release's migrations are no refusal"
            );
            // The one migration outside a transaction builds PostgreSQL's indexes.
            assert_eq!(embedded.iter().any(|m| m.no_tx), dir.ends_with("postgres"));
        }
    }

    super::from_row! {
        #[derive(Debug, PartialEq)]
        struct Inner from sqlx::sqlite::SqliteRow {
            c: String,
            d: Option<i64>,
        }
    }

    super::from_row! {
        #[derive(Debug, PartialEq)]
        struct Outer from sqlx::sqlite::SqliteRow {
            a: i64,
            b: String,
            @flatten inner: Inner,
        }
    }

    /// `from_row!` reads each field from the column of its name whether the
    /// statement lists the columns in the struct's order (found in place),
    /// in another order, or with others between (found by name), and a
    /// missing column is sqlx's error, not another column's value.
    #[tokio::test]
    async fn rows_are_read_by_name_in_any_order_of_columns() {
        use sqlx::Connection as _;
        let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
            .await
            .unwrap();
        let want = Outer {
            a: 1,
            b: "two".into(),
            inner: Inner {
                c: "three".into(),
                d: None,
            },
        };
        for sql in [
            "SELECT 1 AS a, 'two' AS b, 'three' AS c, NULL AS d",
            "SELECT NULL AS d, 'three' AS c, 'two' AS b, 1 AS a",
            "SELECT 'x' AS z, 'two' AS b, 1 AS a, 0 AS y, 'three' AS c, NULL AS d",
        ] {
            let got: Outer = sqlx::query_as(sql).fetch_one(&mut conn).await.unwrap();
            assert_eq!(got, want, "{sql}");
        }
        let missing = sqlx::query_as::<_, Outer>("SELECT 1 AS a, 'two' AS b, 'three' AS c")
            .fetch_one(&mut conn)
            .await
            .unwrap_err();
        assert!(
            matches!(missing, sqlx::Error::ColumnNotFound(ref name) if name == "d"),
            "{missing:?}"
        );
    }
}
