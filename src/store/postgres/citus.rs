//! Scale-out on Citus: when the database has the `citus` extension,
//! the migrations distribute both tables by `tenant`, colocated, and the claim
//! function by its tenant argument, so every per-request statement is a router
//! query on the tenant's shard. Nothing here runs on a plain PostgreSQL except
//! the check that finds no extension.
//!
//! Pruning cannot lock rows across shards (`FOR UPDATE` is refused on a
//! multi-shard query), so on Citus it runs shard by shard: the one pruning
//! statement, with the shard tables' names, on each pair of colocated shards,
//! each in its own transaction on the worker that holds them.

use sqlx::postgres::PgPool;
use sqlx::{Connection as _, PgConnection};

use crate::store::{PruneBatch, StoreError};

/// How the tables are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One PostgreSQL (or Citus without the tables distributed).
    Single,
    /// Distributed by tenant over `shards` shards.
    Citus { shards: u32 },
}

/// The tables and the function the migrations distribute.
const KEYS: &str = "idempotency_keys";
const RESERVATIONS: &str = "idempotency_reservations";
/// The claim function's signature, as the latest migration made it.
pub(super) const RESERVE_SIGNATURE: &str =
    "idemgate_reserve(text, bytea, text, uuid, float8, float8, int8, text, bytea)";
/// The batch function's signature, as the latest migration made it.
pub(super) const WRITE_BATCH_SIGNATURE: &str = "idemgate_write_batch(text, text[], text[], \
     bytea[], text[], uuid[], float8[], float8[], int8[], int4[], jsonb[], bytea[], text[], \
     bytea[])";
/// The signatures the previous release calls (migration
/// `20261209000001_claimed_request.sql` kept them), distributed too, so that
/// its calls run on the tenant's node while it is connected.
const RESERVE_BEFORE: &str =
    "idemgate_reserve(text, bytea, text, uuid, float8, float8, int8, text)";
const WRITE_BATCH_BEFORE: &str = "idemgate_write_batch(text, text[], text[], \
     bytea[], text[], uuid[], float8[], float8[], int8[], int4[], jsonb[], bytea[], text[])";
/// The functions distributed by their tenant argument: name, signature.
const FUNCTIONS: [(&str, &str); 4] = [
    ("idemgate_reserve", RESERVE_SIGNATURE),
    ("idemgate_write_batch", WRITE_BATCH_SIGNATURE),
    ("idemgate_reserve", RESERVE_BEFORE),
    ("idemgate_write_batch", WRITE_BATCH_BEFORE),
];

/// Serializes the distribution across idemgate processes starting together.
const LOCK: i64 = 0x6964_656d_6369_7475; // "idemcitu"

/// Reads the layout: Citus when the extension is there and the keys table
/// is distributed. Read once per process: its statements are not kept
/// prepared (a pooler in transaction mode could not keep them).
pub async fn layout(conn: &mut PgConnection) -> Result<Layout, sqlx::Error> {
    if !has_citus(conn).await? {
        return Ok(Layout::Single);
    }
    let shards: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_catalog.pg_dist_shard
          WHERE logicalrelid = to_regclass('idempotency_keys')",
    )
    .persistent(false)
    .fetch_one(&mut *conn)
    .await?;
    Ok(match u32::try_from(shards) {
        Ok(0) | Err(_) => Layout::Single,
        Ok(shards) => Layout::Citus { shards },
    })
}

/// Whether the database has the `citus` extension.
async fn has_citus(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')")
        .persistent(false)
        .fetch_one(&mut *conn)
        .await
}

crate::store::from_row! {
    /// A table's place in Citus's metadata: `None` when it is a plain table.
    #[derive(Debug)]
    struct Placement from sqlx::postgres::PgRow {
        /// `h` for hash-distributed; `n` for reference and local tables.
        method: String,
        column: Option<String>,
        colocation: i32,
    }
}

async fn placement(conn: &mut PgConnection, table: &str) -> Result<Option<Placement>, sqlx::Error> {
    sqlx::query_as(
        "SELECT p.partmethod::text AS method,
                CASE WHEN p.partkey IS NOT NULL
                     THEN column_to_column_name(p.logicalrelid, p.partkey) END AS column,
                p.colocationid AS colocation
           FROM pg_catalog.pg_dist_partition p
          WHERE p.logicalrelid = to_regclass($1)",
    )
    .bind(table)
    .fetch_optional(&mut *conn)
    .await
}

/// What a table that is already a Citus table of the wrong kind needs.
fn misplaced(table: &str, found: &Placement) -> StoreError {
    let what = match (found.method.as_str(), found.column.as_deref()) {
        ("h", Some(column)) => format!("distributed by {column}"),
        ("n", _) => "a reference or local table".to_owned(),
        (method, _) => format!("a Citus table of method {method}"),
    };
    StoreError::other(format!(
        "{table} is {what}; idemgate needs it distributed by tenant, colocated with \
         {KEYS}: run SELECT undistribute_table('{table}'), then idemgate migrate"
    ))
}

/// Distributes the tables and the claim function when the database has the
/// `citus` extension and they are not distributed yet; returns the layout.
/// Several processes may run it at once: a lock takes them in turn, and the
/// later ones find the work done.
pub async fn distribute(pool: &PgPool) -> Result<Layout, StoreError> {
    let mut conn = pool.acquire().await.map_err(other)?;
    if !has_citus(&mut conn).await.map_err(other)? {
        return Ok(Layout::Single);
    }
    let mut tx = conn.begin().await.map_err(other)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(LOCK)
        .execute(&mut *tx)
        .await
        .map_err(other)?;
    // Sequential: Citus refuses to distribute a function in a transaction
    // that used parallel connections to the workers (as distributing a table
    // does by default).
    sqlx::query("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
        .execute(&mut *tx)
        .await
        .map_err(other)?;
    let mut done = Vec::new();
    let keys = match placement(&mut tx, KEYS).await.map_err(other)? {
        Some(p) if p.method == "h" && p.column.as_deref() == Some("tenant") => p,
        Some(p) => return Err(misplaced(KEYS, &p)),
        None => {
            sqlx::query("SELECT create_distributed_table($1::regclass, 'tenant')")
                .bind(KEYS)
                .execute(&mut *tx)
                .await
                .map_err(|e| failed("distributing", KEYS, e))?;
            done.push(KEYS);
            placement(&mut tx, KEYS)
                .await
                .map_err(other)?
                .ok_or_else(|| StoreError::other(format!("{KEYS} is not distributed")))?
        }
    };
    match placement(&mut tx, RESERVATIONS).await.map_err(other)? {
        Some(p) if p.method == "h" && p.colocation == keys.colocation => {}
        Some(p) => return Err(misplaced(RESERVATIONS, &p)),
        None => {
            sqlx::query(
                "SELECT create_distributed_table($1::regclass, 'tenant', colocate_with => $2)",
            )
            .bind(RESERVATIONS)
            .bind(KEYS)
            .execute(&mut *tx)
            .await
            .map_err(|e| failed("distributing", RESERVATIONS, e))?;
            done.push(RESERVATIONS);
        }
    }
    for (name, signature) in FUNCTIONS {
        let delegated: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_object
                             WHERE classid = 'pg_proc'::regclass
                               AND objid = to_regprocedure($1)
                               AND distribution_argument_index IS NOT NULL
                               AND colocationid = $2)",
        )
        .bind(signature)
        .bind(keys.colocation)
        .fetch_one(&mut *tx)
        .await
        .map_err(other)?;
        if !delegated {
            sqlx::query(
                "SELECT create_distributed_function($1::regprocedure, 'p_tenant', \
                 colocate_with => $2)",
            )
            .bind(signature)
            .bind(KEYS)
            .execute(&mut *tx)
            .await
            .map_err(|e| failed("distributing", name, e))?;
            done.push(name);
        }
    }
    tx.commit().await.map_err(other)?;
    let layout = layout(&mut conn).await.map_err(other)?;
    let workers: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT pl.groupid) FROM pg_catalog.pg_dist_placement pl
           JOIN pg_catalog.pg_dist_shard s USING (shardid)
          WHERE s.logicalrelid = to_regclass($1)",
    )
    .bind(KEYS)
    .fetch_one(&mut *conn)
    .await
    .map_err(other)?;
    let shards = match layout {
        Layout::Citus { shards } => shards,
        Layout::Single => 0,
    };
    if done.is_empty() {
        tracing::info!(
            shards,
            nodes = workers,
            "citus: {KEYS} and {RESERVATIONS} are distributed by tenant, colocated, and \
             idemgate_reserve and idemgate_write_batch run on the tenant's node"
        );
    } else {
        tracing::info!(
            shards,
            nodes = workers,
            distributed = done.join(", "),
            "citus: distributed {KEYS} and {RESERVATIONS} by tenant, colocated, and \
             idemgate_reserve and idemgate_write_batch by their tenant argument"
        );
    }
    Ok(layout)
}

fn other(e: sqlx::Error) -> StoreError {
    StoreError::other(format!("citus: {}", said(&e))).because(e)
}

fn failed(doing: &str, what: &str, e: sqlx::Error) -> StoreError {
    StoreError::other(format!("citus: {doing} {what} failed: {}", said(&e))).because(e)
}

/// The server's words for a database error (without sqlx's "at line N"),
/// else the error as sqlx says it.
fn said(e: &sqlx::Error) -> String {
    match e.as_database_error() {
        Some(db) => format!(
            "{} (SQLSTATE {})",
            db.message(),
            db.code().unwrap_or_default()
        ),
        None => e.to_string(),
    }
}

/// The pruning statement over the tables named `keys` and `reservations`:
/// deletes up to `limit` records expired at `cutoff`, skipping the rows that
/// a reservation or another pruner holds, with the reservation ids they
/// superseded, and returns how many. `limit` and `cutoff` are SQL
/// expressions.
pub fn prune_sql(keys: &str, reservations: &str, cutoff: &str, limit: &str) -> String {
    format!(
        "WITH doomed AS (
            SELECT tenant, key_hash FROM {keys}
             WHERE expires_at <= {cutoff}
             ORDER BY expires_at
             LIMIT {limit}
             FOR UPDATE SKIP LOCKED
        ), gone AS (
            DELETE FROM {keys} k USING doomed d
             WHERE k.tenant = d.tenant AND k.key_hash = d.key_hash
               AND k.expires_at <= {cutoff}
         RETURNING k.tenant, k.key_hash
        ), fences AS (
            DELETE FROM {reservations} r USING gone g
             WHERE r.tenant = g.tenant AND r.key_hash = g.key_hash
        )
        SELECT count(*) FROM gone"
    )
}

/// The statement that prunes every pair of colocated shards, up to
/// `per_shard` records each, one after the other (each pair on its own
/// connection to its worker, so running them side by side would open a
/// connection per shard at once). The cutoff is the coordinator's `now()`,
/// the clock every claim used. Returns one row: deleted, the most any one
/// shard deleted, the shards that failed, and the first failure.
pub fn prune_shards_sql(per_shard: u32) -> String {
    // format() runs twice: here, with now() (so `%%` stands for the `%` of
    // the shard names' placeholders), and in Citus, with the shard names.
    let command = prune_sql(
        "%%1$s",
        "%%2$s",
        "%1$L::timestamptz",
        &per_shard.to_string(),
    );
    format!(
        "SELECT coalesce(sum(result::int8) FILTER (WHERE success), 0)::int8 AS deleted,
                coalesce(max(result::int8) FILTER (WHERE success), 0)::int8 AS fullest,
                count(*) FILTER (WHERE NOT success) AS failed,
                min(nodename || ':' || nodeport || ': ' || result)
                    FILTER (WHERE NOT success) AS failure
           FROM run_command_on_colocated_placements(
                    '{KEYS}', '{RESERVATIONS}', format('{}', now()), false)",
        command.replace('\'', "''")
    )
}

crate::store::from_row! {
    /// One row of [`prune_shards_sql`].
    #[derive(Debug)]
    pub struct ShardsPruned from sqlx::postgres::PgRow {
        pub deleted: i64,
        pub fullest: i64,
        pub failed: i64,
        pub failure: Option<String>,
    }
}

impl ShardsPruned {
    pub fn batch(&self, per_shard: u32) -> PruneBatch {
        PruneBatch {
            deleted: u64::try_from(self.deleted).unwrap_or(0),
            more: self.fullest >= i64::from(per_shard),
            unreachable: (self.failed > 0).then(|| {
                format!(
                    "{} shard(s) could not be pruned ({})",
                    self.failed,
                    self.failure.as_deref().unwrap_or("no reason given")
                )
            }),
        }
    }
}

/// Records per shard for a batch of `limit`: the limit is what one
/// transaction may lock, and on Citus each shard's part is a transaction of
/// its own; so every shard gets the whole of it (a tenant that expires many
/// keys at once fills one shard, and a share of the limit would prune it in
/// slivers).
pub fn per_shard(limit: i64) -> u32 {
    u32::try_from(limit.max(1)).unwrap_or(u32::MAX)
}
