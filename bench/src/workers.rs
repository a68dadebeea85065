//! The operations each scenario repeats: through idemgate's HTTP doors, and
//! the same statements sent straight to PostgreSQL as the bound to beat.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use http::StatusCode;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::http::Conn;
use crate::load::Worker;

/// The request the reservation API is told about: a charge, fingerprinted by
/// idemgate (JCS over method, path and body).
pub const RESERVE_BODY: &str = r#"{"request":{"method":"POST","path":"/v1/charges","body":{"amount":1000,"currency":"eur","customer":"cus_8e03978e"}}}"#;

/// The response the backend commits.
pub const COMMIT_BODY: &str = r#"{"status":201,"headers":[["content-type","application/json"]],"body":"{\"id\":\"ch_000000000001\",\"object\":\"charge\",\"amount\":1000,\"currency\":\"eur\",\"status\":\"succeeded\"}"}"#;

/// The stored body of [`COMMIT_BODY`], for the raw-SQL bound.
const STORED_BODY: &[u8] = br#"{"id":"ch_000000000001","object":"charge","amount":1000,"currency":"eur","status":"succeeded"}"#;

/// The request a client sends through a proxy.
pub const CHARGE_BODY: &str = r#"{"amount":1000,"currency":"eur","customer":"cus_8e03978e"}"#;

/// The key of call `seq` of worker `worker` in a run named `prefix`.
pub fn key(prefix: &str, worker: usize, seq: u64) -> String {
    format!("{prefix}-{worker}-{seq}")
}

/// The key a replay worker uses on call `seq`: spread over the populated set.
fn replay_key(keys: &[String], worker: usize, seq: u64) -> &str {
    let i = (worker as u64 * 7919 + seq) % keys.len() as u64;
    &keys[usize::try_from(i).unwrap_or(0)]
}

#[derive(Deserialize)]
struct Reserved {
    reservation_id: Uuid,
}

/// Reserve + commit of a new key through the reservation API.
pub struct ApiPair {
    conn: Conn,
    prefix: String,
    worker: usize,
}

impl ApiPair {
    pub fn new(addr: SocketAddr, prefix: &str, worker: usize) -> ApiPair {
        ApiPair {
            conn: Conn::new(addr),
            prefix: prefix.to_owned(),
            worker,
        }
    }
}

/// One reserve + commit of `key` through the reservation API.
pub async fn api_pair(conn: &mut Conn, key: &str) -> anyhow::Result<()> {
    let body = conn
        .post_json(
            "/v1/reservations",
            &[("idempotency-key", key)],
            Bytes::from_static(RESERVE_BODY.as_bytes()),
            StatusCode::CREATED,
        )
        .await?;
    let reserved: Reserved = serde_json::from_slice(&body).context("reserve answer")?;
    let path = format!("/v1/reservations/{}/commit", reserved.reservation_id);
    conn.post_json(
        &path,
        &[],
        Bytes::from_static(COMMIT_BODY.as_bytes()),
        StatusCode::OK,
    )
    .await?;
    Ok(())
}

impl Worker for ApiPair {
    async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
        let key = key(&self.prefix, self.worker, seq);
        api_pair(&mut self.conn, &key).await
    }
}

/// A reserve of a completed key through the reservation API: a replay.
pub struct ApiReplay {
    conn: Conn,
    keys: Arc<Vec<String>>,
    worker: usize,
}

impl ApiReplay {
    pub fn new(addr: SocketAddr, keys: Arc<Vec<String>>, worker: usize) -> ApiReplay {
        ApiReplay {
            conn: Conn::new(addr),
            keys,
            worker,
        }
    }
}

impl Worker for ApiReplay {
    async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
        let key = replay_key(&self.keys, self.worker, seq);
        self.conn
            .post_json(
                "/v1/reservations",
                &[("idempotency-key", key)],
                Bytes::from_static(RESERVE_BODY.as_bytes()),
                StatusCode::OK,
            )
            .await?;
        Ok(())
    }
}

/// Which keys a proxy worker sends.
#[derive(Clone)]
pub enum Keys {
    /// A new key on every call.
    Fresh(String),
    /// Keys completed before, round robin.
    Replay(Arc<Vec<String>>),
}

/// A charge POSTed through a proxy (or straight to the origin).
pub struct ProxyPost {
    conn: Conn,
    path: String,
    keys: Keys,
    worker: usize,
}

impl ProxyPost {
    pub fn new(addr: SocketAddr, path: &str, keys: Keys, worker: usize) -> ProxyPost {
        ProxyPost {
            conn: Conn::new(addr),
            path: path.to_owned(),
            keys,
            worker,
        }
    }
}

impl Worker for ProxyPost {
    async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
        let fresh;
        let key = match &self.keys {
            Keys::Fresh(prefix) => {
                fresh = key(prefix, self.worker, seq);
                fresh.as_str()
            }
            Keys::Replay(keys) => replay_key(keys, self.worker, seq),
        };
        self.conn
            .post_json(
                &self.path,
                &[("idempotency-key", key)],
                Bytes::from_static(CHARGE_BODY.as_bytes()),
                StatusCode::CREATED,
            )
            .await?;
        Ok(())
    }
}

/// The statements behind one reserve and one commit, sent straight through a
/// sqlx pool: what the reservation API would cost with no HTTP at all.
pub struct RawPair {
    pool: PgPool,
    prefix: String,
    worker: usize,
    headers: serde_json::Value,
    fingerprint: String,
}

impl RawPair {
    pub fn new(pool: PgPool, prefix: &str, worker: usize) -> RawPair {
        RawPair {
            pool,
            prefix: prefix.to_owned(),
            worker,
            headers: serde_json::json!([["content-type", "application/json"]]),
            fingerprint: hex(&Sha256::digest(RESERVE_BODY.as_bytes())),
        }
    }
}

impl Worker for RawPair {
    async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
        let key = key(&self.prefix, self.worker, seq);
        let hash = Sha256::digest(key.as_bytes());
        let id = Uuid::new_v4();
        raw_reserve(&self.pool, &hash, &self.fingerprint, id).await?;
        sqlx::query(idemgate::store::postgres::sql::complete())
            .bind("raw")
            .bind(id)
            .bind(201_i32)
            .bind(&self.headers)
            .bind(STORED_BODY)
            .fetch_optional(&self.pool)
            .await?
            .context("the commit statement matched no row")?;
        Ok(())
    }
}

/// The request [`RESERVE_BODY`] describes, as the store keeps it.
const REQUEST_KEPT: &[u8] = br#"{"method":"POST","path":"/v1/charges"}"#;

/// idemgate's reserve statement for a new key, which must claim it.
async fn raw_reserve(
    pool: &PgPool,
    hash: &[u8],
    fingerprint: &str,
    id: Uuid,
) -> anyhow::Result<()> {
    let row = sqlx::query(idemgate::store::postgres::sql::reserve())
        .bind("raw")
        .bind(hash)
        .bind(Some(fingerprint))
        .bind(id)
        .bind(30.0_f64)
        .bind(86_400.0_f64)
        .bind(None::<i64>)
        // The proxy's default: its keys are held past their lease.
        .bind("hold")
        // What the key is for, as the reservation API keeps it.
        .bind(REQUEST_KEPT)
        .fetch_optional(pool)
        .await?
        .context("the reserve statement returned no row")?;
    anyhow::ensure!(row.try_get::<bool, _>("claimed")?, "the key was not new");
    Ok(())
}

/// The reserve of [`RawPair`] alone: what idemgate's own claim costs the
/// database, without the proxy around it.
pub struct RawClaim {
    pool: PgPool,
    prefix: String,
    fingerprint: String,
}

impl RawClaim {
    pub fn new(pool: PgPool, prefix: &str) -> RawClaim {
        RawClaim {
            pool,
            prefix: prefix.to_owned(),
            fingerprint: hex(&Sha256::digest(RESERVE_BODY.as_bytes())),
        }
    }
}

impl Worker for RawClaim {
    async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
        let hash = Sha256::digest(key(&self.prefix, 1, seq).as_bytes());
        raw_reserve(&self.pool, &hash, &self.fingerprint, Uuid::new_v4()).await
    }
}

/// The least SQL a reservation can be: one autocommit INSERT of the claim and
/// one autocommit UPDATE storing the response, with no fingerprint, no
/// reservation-id table, no takeover and no per-tenant limit. A floor that no
/// real idempotency layer reaches, so that the API's rate can be read against
/// the cheapest thing the database can do per key, not only against
/// idemgate's own statements.
pub struct FloorPair {
    pool: PgPool,
    prefix: String,
    worker: usize,
}

impl FloorPair {
    pub fn new(pool: PgPool, prefix: &str, worker: usize) -> FloorPair {
        FloorPair {
            pool,
            prefix: prefix.to_owned(),
            worker,
        }
    }
}

/// The claim of [`FloorPair`]: a new in-flight row, or nothing if the key exists.
const FLOOR_CLAIM: &str = "INSERT INTO idempotency_keys
        (tenant, key_hash, state, reservation_id, lease_expires_at, attempt, created_at, expires_at)
     VALUES ($1, $2, 'in_flight', $3, now() + interval '30 seconds', 1, now(), now() + interval '1 day')
     ON CONFLICT DO NOTHING";

/// The commit of [`FloorPair`]: the response stored on the row by its key.
const FLOOR_COMPLETE: &str = "UPDATE idempotency_keys
        SET state = 'completed', response_status = 201, response_headers = '[]'::jsonb,
            response_body = $3, completed_at = now(), lease_expires_at = NULL
      WHERE tenant = $1 AND key_hash = $2";

impl Worker for FloorPair {
    async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
        let key = key(&self.prefix, self.worker, seq);
        let hash = Sha256::digest(key.as_bytes());
        floor_claim(&self.pool, &hash).await?;
        let completed = sqlx::query(FLOOR_COMPLETE)
            .bind("floor")
            .bind(&hash[..])
            .bind(STORED_BODY)
            .execute(&self.pool)
            .await?;
        anyhow::ensure!(completed.rows_affected() == 1, "the commit matched no row");
        Ok(())
    }
}

/// A single-row SELECT by primary key through a sqlx pool: what a replay
/// would cost if it read the database and did nothing else.
pub struct RawSelect {
    pool: PgPool,
    hashes: Arc<Vec<Vec<u8>>>,
    worker: usize,
}

impl RawSelect {
    pub fn new(pool: PgPool, keys: &[String], worker: usize) -> RawSelect {
        RawSelect {
            pool,
            hashes: Arc::new(keys.iter().map(|k| Sha256::digest(k).to_vec()).collect()),
            worker,
        }
    }
}

impl Worker for RawSelect {
    async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
        let i = (self.worker as u64 * 7919 + seq) % self.hashes.len() as u64;
        let hash = &self.hashes[usize::try_from(i).unwrap_or(0)];
        sqlx::query("SELECT * FROM idempotency_keys WHERE tenant = $1 AND key_hash = $2")
            .bind("default")
            .bind(hash)
            .fetch_optional(&self.pool)
            .await?
            .context("the key is not in the table")?;
        Ok(())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The claim alone of [`FloorPair`], autocommitted: the one durable write
/// that must come before a guarded request is forwarded.
pub struct FloorClaim {
    pool: PgPool,
    prefix: String,
}

impl FloorClaim {
    pub fn new(pool: PgPool, prefix: &str) -> FloorClaim {
        FloorClaim {
            pool,
            prefix: prefix.to_owned(),
        }
    }
}

impl Worker for FloorClaim {
    async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
        let hash = Sha256::digest(key(&self.prefix, 0, seq).as_bytes());
        floor_claim(&self.pool, &hash).await
    }
}

/// [`FLOOR_CLAIM`] of a new key's hash.
async fn floor_claim(pool: &PgPool, hash: &[u8]) -> anyhow::Result<()> {
    let claimed = sqlx::query(FLOOR_CLAIM)
        .bind("floor")
        .bind(hash)
        .bind(Uuid::new_v4())
        .execute(pool)
        .await?;
    anyhow::ensure!(claimed.rows_affected() == 1, "the key was not new");
    Ok(())
}

/// The same claim on a SQLite file as idemgate's embedded store keeps it
/// (WAL, `synchronous = FULL`: on disk before it is acknowledged), one
/// autocommitted `INSERT` into a table of the claim's columns.
pub struct SqliteClaim {
    pool: sqlx::SqlitePool,
    prefix: String,
}

impl SqliteClaim {
    /// Creates the file at `path` (a new one) and its table.
    pub async fn create(path: &std::path::Path, prefix: &str) -> anyhow::Result<SqliteClaim> {
        use sqlx::sqlite::{
            SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
        };
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .with_context(|| format!("open {}", path.display()))?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS claims (tenant TEXT NOT NULL, key_hash BLOB NOT NULL,
                 state TEXT NOT NULL, reservation_id TEXT NOT NULL, lease_expires_at INTEGER,
                 attempt INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
                 PRIMARY KEY (tenant, key_hash))",
        )
        .execute(&pool)
        .await?;
        Ok(SqliteClaim {
            pool,
            prefix: prefix.to_owned(),
        })
    }
}

impl Worker for SqliteClaim {
    async fn call(&mut self, seq: u64) -> anyhow::Result<()> {
        let hash = Sha256::digest(key(&self.prefix, 0, seq).as_bytes());
        let claimed = sqlx::query(
            "INSERT INTO claims (tenant, key_hash, state, reservation_id, lease_expires_at,
                 attempt, created_at, expires_at)
             VALUES ('floor', ?1, 'in_flight', ?2, unixepoch() + 30, 1, unixepoch(), unixepoch() + 86400)
             ON CONFLICT DO NOTHING",
        )
        .bind(&hash[..])
        .bind(Uuid::new_v4().to_string())
        .execute(&self.pool)
        .await?;
        anyhow::ensure!(claimed.rows_affected() == 1, "the key was not new");
        Ok(())
    }
}
