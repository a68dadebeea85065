//! Sorting SQLite's errors into "try again later" and "broken", with the
//! error (rusqlite's from the writer thread, sqlx's from the readers) kept as
//! the cause.

use crate::store::StoreError;

// SQLite primary result codes (the low byte of an extended code) that mean
// "try again later" rather than "broken".
pub(super) const SQLITE_BUSY: i32 = 5;
pub(super) const SQLITE_LOCKED: i32 = 6;
pub(super) const SQLITE_NOMEM: i32 = 7;
pub(super) const SQLITE_READONLY: i32 = 8;
pub(super) const SQLITE_IOERR: i32 = 10;
pub(super) const SQLITE_FULL: i32 = 13;
pub(super) const SQLITE_CANTOPEN: i32 = 14;
pub(super) const SQLITE_PROTOCOL: i32 = 15;

/// What to do about a file without idemgate's tables. `idemgate migrate` is
/// another process on the file, which one process per file rules out while
/// a server runs.
pub(super) const NO_TABLES: &str = "the file has no idemgate tables: start idemgate without --no-migrate \
     (it applies the migrations at start), or stop it and run `idemgate migrate` on the file";

/// Sorts sqlx errors into "try again later" and "broken", as the PostgreSQL
/// store does: a lock still held after the busy timeout, an I/O error, a full
/// disk, a read-only or unopenable file, all answer 503, and so does a file
/// without the tables (a setup step not taken yet, not a bug: it heals once
/// the migrations are applied); anything else (constraint, schema mismatch,
/// bad SQL) is a bug.
pub(super) fn classify(e: sqlx::Error) -> StoreError {
    sorted(&e).because(e)
}

/// What [`classify`] says of `e`, before `e` is attached as the cause.
pub(super) fn sorted(e: &sqlx::Error) -> StoreError {
    if let sqlx::Error::Database(db) = e
        && db.message().starts_with("no such table")
    {
        return StoreError::unavailable(format!("{}: {NO_TABLES}", db.message()));
    }
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => StoreError::unavailable(e.to_string()),
        sqlx::Error::Database(db) => {
            // sqlx reports SQLite's extended result code, in decimal.
            let code = db.code().and_then(|c| c.parse::<i32>().ok());
            by_code(code, e.to_string())
        }
        _ => StoreError::other(e.to_string()),
    }
}

/// [`classify`] for the writer thread's errors: the same sorting, on the
/// extended result code rusqlite reports.
pub(super) fn classify_rs(e: rusqlite::Error) -> StoreError {
    sorted_rs(&e).because(e)
}

/// What [`classify_rs`] says of `e`, before `e` is attached as the cause.
pub(super) fn sorted_rs(e: &rusqlite::Error) -> StoreError {
    match e {
        rusqlite::Error::SqliteFailure(failure, message) => {
            if let Some(message) = message
                && message.starts_with("no such table")
            {
                return StoreError::unavailable(format!("{message}: {NO_TABLES}"));
            }
            by_code(Some(failure.extended_code), e.to_string())
        }
        _ => StoreError::other(e.to_string()),
    }
}

/// Unavailable when the extended result `code`'s primary code means "try
/// again later".
fn by_code(code: Option<i32>, why: String) -> StoreError {
    match code.map(|c| c & 0xff) {
        Some(
            SQLITE_BUSY | SQLITE_LOCKED | SQLITE_NOMEM | SQLITE_READONLY | SQLITE_IOERR
            | SQLITE_FULL | SQLITE_CANTOPEN | SQLITE_PROTOCOL,
        ) => StoreError::unavailable(why),
        _ => StoreError::other(why),
    }
}
