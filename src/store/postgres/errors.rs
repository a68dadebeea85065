//! What the PostgreSQL store says when the database fails it: each sqlx
//! error sorted into "try again later" or "broken", in words that name the
//! server, the database and the role (never the password) and, where a setup
//! step was not taken, the command that takes it; the sqlx error is kept as
//! the cause.

use std::time::Duration;

use sqlx::postgres::PgConnectOptions;

use crate::store::StoreError;

/// Where the store connects, as messages name it: the server, the database
/// and the role, never the password.
#[derive(Debug, Clone)]
pub(super) struct Target {
    /// `HOST:PORT`, or the Unix socket's path.
    pub(super) server: String,
    /// The database, as the server will look it up.
    pub(super) database: String,
    /// The role.
    pub(super) user: String,
    /// The server's flags for the PostgreSQL tools (`-h … -p …`).
    pub(super) host_flags: String,
}

impl Target {
    pub(super) fn of(options: &PgConnectOptions) -> Target {
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

    /// Where any of `hosts` lead: their servers, in order, in one.
    pub(super) fn of_all(hosts: &[PgConnectOptions]) -> Target {
        let mut all = Target::of(&hosts[0]);
        if hosts.len() > 1 {
            all.server = hosts
                .iter()
                .map(|h| Target::of(h).server)
                .collect::<Vec<_>>()
                .join(",");
        }
        all
    }

    pub(super) fn server(&self) -> &str {
        &self.server
    }

    /// The server did not let a connection through within `waited`.
    pub(super) fn no_answer(&self, waited: Duration) -> StoreError {
        StoreError::unavailable(format!(
            "no connection to the database within {} s: is PostgreSQL running at {}, and \
             reachable from here?",
            waited.as_secs(),
            self.server
        ))
    }
}

/// `word` as one shell word, quoted only when it needs to be.
pub(super) fn shell_word(word: &str) -> String {
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
pub(super) const NO_TABLES: &str = "run `idemgate migrate` (or start idemgate without --no-migrate: it \
     applies the migrations at start)";

/// Sorts sqlx errors into "try again later" and "broken"; each message names
/// the cause in the server's words (without sqlx's "at line N", the line of
/// PostgreSQL's own source that raised it) and, where the cause is a setup
/// step not taken, what to do. A database that does not exist, a role the
/// server refuses, tables not created yet: the database cannot serve, but
/// nothing is broken, and it heals once the step is taken, so those are
/// `Unavailable` like an outage, never a bug's `Other`.
pub(super) fn classify(e: sqlx::Error, at: &Target) -> StoreError {
    sorted(&e, at).because(e)
}

/// What [`classify`] says of `e`, before `e` is attached as the cause.
pub(super) fn sorted(e: &sqlx::Error, at: &Target) -> StoreError {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => StoreError::unavailable(e.to_string()),
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            let said = format!("{} (SQLSTATE {code})", db.message());
            // For a refusal at connect: which server refused.
            let refused = format!("{} on {} (SQLSTATE {code})", db.message(), at.server);
            match code.as_ref() {
                // invalid_catalog_name: the database does not exist.
                "3D000" => StoreError::unavailable(format!(
                    "{refused}: create it: createdb {} {} -U {}, then apply the migrations: \
                     idemgate migrate",
                    shell_word(&at.database),
                    at.host_flags,
                    shell_word(&at.user)
                )),
                // invalid_authorization_specification: no such role, or
                // pg_hba.conf turned the connection away.
                "28000" if db.message().contains("does not exist") => {
                    StoreError::unavailable(format!(
                        "{refused}: check the user in DATABASE_URL, or create the role (as a \
                         role that may create roles): createuser {} {}",
                        shell_word(&at.user),
                        at.host_flags
                    ))
                }
                // pg_hba.conf's `cert` method: no client certificate, or
                // one whose common name is not the role.
                "28000" if db.message().contains("certificate") => {
                    StoreError::unavailable(format!(
                        "{refused}: give the role's client certificate and key as sslcert \
                         and sslkey in DATABASE_URL (its common name must be the role's, {})",
                        shell_word(&at.user)
                    ))
                }
                "28000" => StoreError::unavailable(format!(
                    "{refused}: check the user and password in DATABASE_URL, and the rules \
                     of the server's pg_hba.conf"
                )),
                // invalid_password.
                "28P01" => StoreError::unavailable(format!(
                    "{refused}: check the password in DATABASE_URL"
                )),
                // undefined_table, or undefined_function for the claim
                // function: the migrations were not (all) applied.
                "42P01" => no_tables(&said, at),
                "42883" if db.message().contains("idemgate_") => no_tables(&said, at),
                // read_only_sql_transaction: the server will not take
                // writes (a hot standby, a demoted primary): no store for
                // now, until the primary is found.
                "25006" => StoreError::unavailable(format!(
                    "{said}: the database server at {} does not take writes (a standby, or a \
                     primary demoted by a failover); name every server in DATABASE_URL with \
                     target_session_attrs=read-write and the one that takes writes is used",
                    at.server
                )),
                // 08: connection exception; 57: operator intervention
                // (shutdown, statement timeout 57014); 53: insufficient
                // resources.
                c if c.starts_with("08") || c.starts_with("57") || c.starts_with("53") => {
                    StoreError::unavailable(said)
                }
                _ => StoreError::other(said),
            }
        }
        _ => StoreError::other(e.to_string()),
    }
}

/// A database without the tables; `said` is the server's word for it.
pub(super) fn no_tables(said: &str, at: &Target) -> StoreError {
    StoreError::unavailable(format!(
        "{said}: the database {} on {} has no idemgate tables: {NO_TABLES}",
        shell_word(&at.database),
        at.server
    ))
}

/// A connection that could not be made: whatever stopped it, the database
/// cannot serve this process, which is no bug of the request's.
pub(super) fn connect_failed(e: sqlx::Error, at: &Target) -> StoreError {
    let io = matches!(e, sqlx::Error::Io(_) | sqlx::Error::Tls(_));
    let e = classify(e, at);
    if !e.is_unavailable() {
        e.reworded(|why| format!("cannot connect to the database at {}: {why}", at.server))
            .into_unavailable()
    } else if io {
        e.reworded(|why| {
            format!(
                "cannot connect to the database: {why}: is PostgreSQL running at {}, and \
                 reachable from here?",
                at.server
            )
        })
    } else {
        e
    }
}
