//! Both stores behind one handle, so a scenario is written once and run
//! against PostgreSQL and the embedded SQLite store.

use std::sync::Arc;

use chrono::Utc;
use idemgate::engine::{Engine, Limits};
use idemgate::store::{PgStore, SqliteStore, Store};

use super::pg::TestDb;

/// One fresh database for one test: every [`Backend::open`] is another store
/// instance (another pool, as another process would have) over it.
pub enum Backend {
    /// A fresh PostgreSQL database.
    Postgres(TestDb),
    /// A fresh directory for the SQLite file.
    Sqlite(tempfile::TempDir),
}

impl Backend {
    pub async fn postgres() -> Backend {
        Backend::Postgres(TestDb::new().await)
    }

    pub async fn sqlite() -> Backend {
        Backend::Sqlite(tempfile::tempdir().expect("temp dir"))
    }

    pub fn sqlite_url(dir: &tempfile::TempDir) -> String {
        format!("sqlite://{}", dir.path().join("idemgate.db").display())
    }

    pub async fn open_pg(db: &TestDb) -> PgStore {
        let store = PgStore::connect_lazy(&db.url, &Default::default()).expect("PgStore");
        store.migrate().await.expect("migrate PostgreSQL");
        store
    }

    pub async fn open_sqlite(dir: &tempfile::TempDir) -> SqliteStore {
        let store = SqliteStore::open(&Self::sqlite_url(dir))
            .await
            .expect("SqliteStore::open");
        store.migrate().await.expect("migrate SQLite");
        store
    }

    /// A new store instance over this backend's database, migrated; through
    /// the pooler `IDEMGATE_TEST_PG_POOLER` names, if set (migrated directly).
    pub async fn open(&self) -> Arc<dyn Store> {
        match self {
            Backend::Postgres(db) => {
                let direct = Self::open_pg(db).await;
                match super::pg::through_pooler(&db.url) {
                    Some(url) => {
                        let settings = idemgate::store::PgSettings {
                            transaction_pooler: true,
                            ..Default::default()
                        };
                        Arc::new(PgStore::connect_lazy(&url, &settings).expect("PgStore"))
                    }
                    None => Arc::new(direct),
                }
            }
            Backend::Sqlite(dir) => Arc::new(Self::open_sqlite(dir).await),
        }
    }

    /// An engine over a new store instance, without a replay cache: every
    /// reserve reaches the store, which is what the store contract tests.
    pub async fn engine(&self) -> Engine {
        self.engine_with_cache(0).await
    }

    /// An engine over a new store instance with a replay cache of
    /// `max_bytes` (0: none).
    pub async fn engine_with_cache(&self, max_bytes: u64) -> Engine {
        Engine::new(self.open().await, Limits::default()).with_replay_cache(max_bytes)
    }

    /// Deletes every record and reservation, straight from the tables: the
    /// database no longer knows any key (whatever a process remembers).
    pub async fn delete_all(&self) {
        const KEYS: &str = "DELETE FROM idempotency_keys";
        const RESERVATIONS: &str = "DELETE FROM idempotency_reservations";
        match self {
            Backend::Postgres(db) => {
                let store = Self::open_pg(db).await;
                for sql in [KEYS, RESERVATIONS] {
                    sqlx::query(sql)
                        .execute(store.pool())
                        .await
                        .expect("delete rows");
                }
                store.pool().close().await;
            }
            Backend::Sqlite(dir) => {
                let store = Self::open_sqlite(dir).await;
                for sql in [KEYS, RESERVATIONS] {
                    sqlx::query(sql)
                        .execute(store.pool())
                        .await
                        .expect("delete rows");
                }
                store.close().await;
            }
        }
        assert_eq!(self.counts().await, (0, 0), "rows left after delete_all");
    }

    /// Rows in `idempotency_keys` and `idempotency_reservations`, read
    /// directly.
    pub async fn counts(&self) -> (i64, i64) {
        const SQL: &str = "SELECT (SELECT count(*) FROM idempotency_keys), \
                                  (SELECT count(*) FROM idempotency_reservations)";
        match self {
            Backend::Postgres(db) => {
                let store = Self::open_pg(db).await;
                let counts = sqlx::query_as(SQL).fetch_one(store.pool()).await;
                store.pool().close().await;
                counts.expect("count rows")
            }
            Backend::Sqlite(dir) => {
                let store = Self::open_sqlite(dir).await;
                let counts = sqlx::query_as(SQL).fetch_one(store.pool()).await;
                store.close().await;
                counts.expect("count rows")
            }
        }
    }

    /// Inserts `n` completed records of tenant `seed` that expired an hour
    /// ago, each with one superseded reservation id (as a takeover leaves),
    /// straight into the tables.
    pub async fn seed_expired(&self, n: i64) {
        match self {
            Backend::Postgres(db) => {
                let store = Self::open_pg(db).await;
                sqlx::query(
                    "INSERT INTO idempotency_keys
                         (tenant, key_hash, state, reservation_id, attempt, created_at, expires_at)
                     SELECT 'seed', sha256(i::text::bytea), 'completed', gen_random_uuid(), 1,
                            now() - interval '2 hours', now() - interval '1 hour'
                       FROM generate_series(1, $1) AS i",
                )
                .bind(n)
                .execute(store.pool())
                .await
                .expect("seed keys");
                sqlx::query(
                    "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
                     SELECT tenant, gen_random_uuid(), key_hash FROM idempotency_keys
                      WHERE tenant = 'seed'",
                )
                .execute(store.pool())
                .await
                .expect("seed superseded ids");
                store.pool().close().await;
            }
            Backend::Sqlite(dir) => {
                let store = Self::open_sqlite(dir).await;
                let hour_ago = Utc::now().timestamp_millis() - 3_600_000;
                sqlx::query(
                    "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < ?1)
                     INSERT INTO idempotency_keys
                         (tenant, key_hash, state, reservation_id, attempt, created_at, expires_at)
                     SELECT 'seed', CAST(i AS BLOB), 'completed',
                            printf('%08x-0000-4000-8000-%012x', i, i), 1, ?2 - 3600000, ?2
                       FROM s",
                )
                .bind(n)
                .bind(hour_ago)
                .execute(store.pool())
                .await
                .expect("seed keys");
                sqlx::query(
                    "INSERT INTO idempotency_reservations (tenant, reservation_id, key_hash)
                     SELECT tenant, printf('%08x-0000-4000-9000-%012x', rowid, rowid), key_hash
                       FROM idempotency_keys WHERE tenant = 'seed'",
                )
                .execute(store.pool())
                .await
                .expect("seed superseded ids");
                store.close().await;
            }
        }
    }
}

impl Backend {
    /// Two pruning passes, each on a store instance of its own (as two
    /// processes would run them), released together; the rows they deleted
    /// between them.
    pub async fn prune_twice_at_once(&self) -> u64 {
        let stores: [Arc<dyn Store>; 2] = [self.open().await, self.open().await];
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let passes = stores.map(|store| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                idemgate::prune::prune_once(store.as_ref()).await
            })
        });
        let mut total = 0;
        for pass in passes {
            total += pass.await.unwrap().expect("prune pass");
        }
        total
    }

    /// The `DATABASE_URL` of this backend's database.
    pub fn url(&self) -> String {
        match self {
            Backend::Postgres(db) => db.url.clone(),
            Backend::Sqlite(dir) => Self::sqlite_url(dir),
        }
    }
}

/// Makes a `postgres::NAME` and a `sqlite::NAME` test of each scenario
/// `async fn NAME(Backend)`; `concurrent` ones run on a 4-thread runtime.
#[macro_export]
macro_rules! both_stores {
    (serial: [$($serial:ident),* $(,)?], concurrent: [$($concurrent:ident),* $(,)?] $(,)?) => {
        $crate::both_stores!(@backend postgres, [$($serial),*], [$($concurrent),*]);
        $crate::both_stores!(@backend sqlite, [$($serial),*], [$($concurrent),*]);
    };
    (@backend $backend:ident, [$($serial:ident),*], [$($concurrent:ident),*]) => {
        mod $backend {
            use $crate::common::backend::Backend;
            $(
                #[tokio::test]
                async fn $serial() {
                    super::$serial(Backend::$backend().await).await;
                }
            )*
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $concurrent() {
                    super::$concurrent(Backend::$backend().await).await;
                }
            )*
        }
    };
}
