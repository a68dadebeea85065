//! What a rolling upgrade needs to know (docs/operations.md, “Upgrading”):
//! this release's name, the migrations that an older process cannot work
//! with (contract steps), and the state of a database's schema beside the
//! processes connected to it, for `idemgate migrate --status` and for
//! `migrate`'s refusal.
//!
//! Migrations come in two kinds. An **expand** step adds what this release
//! needs and keeps what the previous one uses, so processes of both serve
//! one database while and after it runs. A **contract** step removes or
//! changes what an older release used; `migrate` applies it only while no
//! connected process predates it. From 0.2.0 on, a contract migration's
//! file name says so (`VERSION_contract_….sql`, so its description in
//! `_sqlx_migrations` starts with `contract`); the ones from before 0.2.0
//! are listed in [`CONTRACT_BEFORE_0_2`].
//!
//! A process of 0.2.0 or later names each of its PostgreSQL connections
//! [`APPLICATION_NAME`]. Earlier ones set no `application_name`: a
//! connection without one whose last statement named idemgate's tables or
//! functions (or whose statement this role may not read) is taken for an
//! idemgate process from before 0.2.0, which knows no migration that the
//! database has pending (it applied every one it knew when it started).

use chrono::{DateTime, Utc};
use serde::Serialize;

/// This release.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The `application_name` of every PostgreSQL connection this process opens.
pub const APPLICATION_NAME: &str = concat!("idemgate/", env!("CARGO_PKG_VERSION"));

/// The prefix of [`APPLICATION_NAME`]s.
pub const APPLICATION_PREFIX: &str = "idemgate/";

/// PostgreSQL migrations from before 0.2.0 that a process started before
/// them cannot work with: `20261204000001_outcome_unknown` dropped the claim
/// functions' old signatures, and `20261207000001_one_table` stopped writing
/// a record's current reservation id where older processes look it up (their
/// commits by id find nothing: the key is stranded).
pub const CONTRACT_BEFORE_0_2: &[i64] = &[20261204000001, 20261207000001];

/// Contract steps from before 0.2.0 that this release applies beside the
/// processes that predate them (on PostgreSQL without Citus), keeping a
/// compatibility write while any of them is connected:
/// `20261207000001_one_table` stopped writing a record's current reservation
/// id into `idempotency_reservations`, where those processes look their
/// records up; the compatibility write (a trigger) writes it, and a later
/// `migrate` (or the start of a `serve` or `proxy`) drops it once none of
/// them is connected.
pub const BRIDGED: &[i64] = &[20261207000001];

/// Each release since processes name themselves, with the newest PostgreSQL
/// migration it works with: a process named `idemgate/0.2.0` cannot work
/// with a contract step newer than that. One line per release, added when
/// the release is made.
pub const RELEASES: &[(&str, i64)] = &[("0.2.0", 20261207000001), ("0.3.0", 20261209000001)];

/// Whether the migration `version` with `description` (as sqlx reads it
/// from the file name: `contract drop x` for `…_contract_drop_x.sql`) is a
/// contract step.
pub fn is_contract(version: i64, description: &str) -> bool {
    CONTRACT_BEFORE_0_2.contains(&version) || description.starts_with("contract")
}

/// A migration, applied or not.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub version: i64,
    pub description: String,
    /// A contract step (see the module's documentation).
    pub contract: bool,
    /// When it was applied; `None` if it is pending.
    pub installed_on: Option<DateTime<Utc>>,
    /// This release has it (an applied step it lacks is a newer release's).
    pub known: bool,
}

impl Step {
    /// `20261207000001 (one table, contract)`.
    pub fn name(&self) -> String {
        let kind = if self.contract { ", contract" } else { "" };
        format!("{} ({}{kind})", self.version, self.description)
    }
}

/// A process connected to the database: one line per process (its
/// connections grouped by backend's client address and name).
#[derive(Debug, Clone, Serialize)]
pub struct Process {
    /// The database's process ids of its connections.
    pub pids: Vec<i32>,
    /// Its `application_name`; empty for a process before 0.2.0.
    pub application_name: String,
    /// Its release, from its name; `None` for one before 0.2.0.
    pub version: Option<String>,
    /// Where it connects from (`local` for a Unix socket).
    pub client: String,
    /// When its oldest connection opened.
    pub since: Option<DateTime<Utc>>,
    /// Its statements could not be read (this role lacks
    /// `pg_read_all_stats`): taken for an idemgate process to be safe.
    pub unreadable: bool,
}

impl Process {
    /// Whether it works with the migration `step` applied.
    pub fn works_with(&self, step: &Step) -> bool {
        if !step.contract {
            return true;
        }
        let Some(version) = &self.version else {
            return false;
        };
        if release(version) >= release(VERSION) {
            return true;
        }
        RELEASES
            .iter()
            .find(|(name, _)| name == version)
            .is_some_and(|&(_, newest)| step.version <= newest)
    }

    /// `idemgate/0.2.0 (pids 12, 13 from 10.0.0.5)`, or for an older one
    /// `idemgate before 0.2.0 (no application_name; pid 12 from local)`.
    pub fn describe(&self) -> String {
        let pids = self
            .pids
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let plural = if self.pids.len() == 1 { "" } else { "s" };
        let since = self
            .since
            .map(|t| format!(", connected since {}", t.format("%Y-%m-%d %H:%M:%S UTC")))
            .unwrap_or_default();
        if self.version.is_some() {
            format!(
                "{} (pid{plural} {pids} from {}{since})",
                self.application_name, self.client
            )
        } else if self.unreadable {
            format!(
                "a process without application_name whose statements this role may not read, \
                 taken for idemgate before 0.2.0 (pid{plural} {pids} from {}{since})",
                self.client
            )
        } else {
            format!(
                "idemgate before 0.2.0 (no application_name; pid{plural} {pids} from {}{since})",
                self.client
            )
        }
    }
}

/// The release numbers of `version` (`0.2.0` → (0, 2, 0)), for ordering.
fn release(version: &str) -> (u64, u64, u64) {
    let mut parts = version
        .split(['-', '+'])
        .next()
        .unwrap_or_default()
        .split('.')
        .map(|p| p.parse::<u64>().unwrap_or(0));
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

/// A pending contract step and the connected processes that cannot work
/// with it.
#[derive(Debug, Clone, Serialize)]
pub struct Blocked {
    pub step: Step,
    pub by: Vec<Process>,
}

/// A database's schema beside this release's migrations and the processes
/// connected to it.
#[derive(Debug, Clone, Serialize)]
pub struct SchemaStatus {
    /// `the PostgreSQL database idemgate on 127.0.0.1:5432`.
    pub database: String,
    /// This release.
    pub release: String,
    /// Every migration the database records, oldest first.
    pub applied: Vec<Step>,
    /// This release's migrations that the database lacks, oldest first.
    pub pending: Vec<Step>,
    /// The idemgate processes connected (PostgreSQL; empty for SQLite).
    pub connected: Vec<Process>,
    /// Whether the store can tell which processes are connected.
    pub sees_processes: bool,
    /// The pending contract steps some connected process cannot work with.
    pub blocked: Vec<Blocked>,
    /// The store can keep a compatibility write for the steps in [`BRIDGED`]
    /// (PostgreSQL without Citus).
    pub can_bridge: bool,
    /// The compatibility write is in place now.
    pub bridge_on: bool,
    /// The role this status was read as, where it may not read other
    /// roles' sessions whole (not a member of `pg_read_all_stats`): their
    /// names are seen, not their addresses nor statements, and a session
    /// without a name is taken for an idemgate process before 0.2.0.
    pub sessions_hidden_from: Option<String>,
}

impl SchemaStatus {
    /// The status, from the migrations `known` (this release's), those the
    /// database records (`applied`: version, description, when) and the
    /// processes `connected`.
    pub fn new(
        database: String,
        known: &sqlx::migrate::Migrator,
        applied: Vec<(i64, String, Option<DateTime<Utc>>)>,
        connected: Vec<Process>,
        sees_processes: bool,
    ) -> SchemaStatus {
        let ours: Vec<&sqlx::migrate::Migration> = known
            .iter()
            .filter(|m| !m.migration_type.is_down_migration())
            .collect();
        let applied: Vec<Step> = applied
            .into_iter()
            .map(|(version, description, installed_on)| Step {
                contract: is_contract(version, &description),
                known: ours.iter().any(|m| m.version == version),
                version,
                description,
                installed_on,
            })
            .collect();
        let pending: Vec<Step> = ours
            .iter()
            .filter(|m| !applied.iter().any(|a| a.version == m.version))
            .map(|m| Step {
                version: m.version,
                description: m.description.to_string(),
                contract: is_contract(m.version, &m.description),
                installed_on: None,
                known: true,
            })
            .collect();
        // A database with nothing applied has no keys to strand (and the
        // processes seen may be other schemas' of the same database).
        let blocked = pending
            .iter()
            .filter(|step| step.contract && !applied.is_empty())
            .filter_map(|step| {
                let by: Vec<Process> = connected
                    .iter()
                    .filter(|p| !p.works_with(step))
                    .cloned()
                    .collect();
                (!by.is_empty()).then(|| Blocked {
                    step: step.clone(),
                    by,
                })
            })
            .collect();
        SchemaStatus {
            database,
            release: VERSION.to_owned(),
            applied,
            pending,
            connected,
            sees_processes,
            blocked,
            can_bridge: false,
            bridge_on: false,
            sessions_hidden_from: None,
        }
    }

    /// Whether every blocked step is one this release applies beside the
    /// processes that hold it back, with the compatibility write: all of
    /// them processes from before 0.2.0, on a store that can keep it.
    pub fn bridged(&self) -> bool {
        self.can_bridge
            && !self.blocked.is_empty()
            && self.blocked.iter().all(|b| {
                BRIDGED.contains(&b.step.version) && b.by.iter().all(|p| p.version.is_none())
            })
    }

    /// Whether a process from before 0.2.0 is connected.
    pub fn older_connected(&self) -> bool {
        self.connected.iter().any(|p| p.version.is_none())
    }

    /// The applied contract steps of a newer release: this one cannot work
    /// on the database.
    pub fn newer_contracts(&self) -> Vec<&Step> {
        self.applied
            .iter()
            .filter(|s| !s.known && s.contract)
            .collect()
    }

    /// Why `migrate` must not run now, if it must not: a pending contract
    /// step that a connected process cannot work with, or a newer release's
    /// contract step already applied.
    pub fn refusal(&self) -> Option<String> {
        if let Some(blocked) = self.blocked.first().filter(|_| !self.bridged()) {
            let by = blocked
                .by
                .iter()
                .map(Process::describe)
                .collect::<Vec<_>>()
                .join("; ");
            return Some(format!(
                "{} has migration {} pending, which removes what processes connected to it \
                 still use: {by}. Applying it now would leave the keys they hold stranded. \
                 Stop those processes (or replace them with idemgate {}), then run `idemgate \
                 migrate` again; `idemgate migrate --status` lists what is connected (docs/operations.md, \
                 Upgrading)",
                self.database,
                blocked.step.name(),
                self.release
            ));
        }
        let newer = self.newer_contracts();
        if !newer.is_empty() {
            let steps = newer
                .iter()
                .map(|s| s.name())
                .collect::<Vec<_>>()
                .join(", ");
            return Some(format!(
                "{} has migration {steps} applied, a contract step of a release newer than \
                 idemgate {}, which cannot work with it: run the newer release",
                self.database, self.release
            ));
        }
        None
    }

    /// The status as lines for a terminal.
    pub fn lines(&self) -> Vec<String> {
        let mut out = vec![format!(
            "{} (idemgate {}, {})",
            self.database,
            self.release,
            env!("IDEMGATE_SCHEMA")
        )];
        let when = |s: &Step| {
            s.installed_on
                .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
                .unwrap_or_default()
        };
        out.push(format!("applied: {}", self.applied.len()));
        for step in &self.applied {
            let newer = if step.known {
                ""
            } else {
                "  (not in this release: a newer one applied it)"
            };
            out.push(format!("  {}  {}{newer}", step.name(), when(step)));
        }
        if self.pending.is_empty() {
            out.push("pending: none".into());
        } else {
            out.push(format!("pending: {}", self.pending.len()));
            for step in &self.pending {
                out.push(format!("  {}", step.name()));
            }
        }
        if !self.sees_processes {
            out.push(
                "connected: not tracked (SQLite: one process per file; `migrate` runs with \
                 none serving it)"
                    .into(),
            );
        } else if self.connected.is_empty() {
            out.push("connected: no idemgate process".into());
        } else {
            out.push(format!("connected: {}", self.connected.len()));
            for process in &self.connected {
                out.push(format!("  {}", process.describe()));
            }
        }
        if let Some(role) = &self.sessions_hidden_from {
            out.push(format!(
                "note: the role {role} may not read other roles' sessions whole (it is not a \
                 member of pg_read_all_stats): their names are listed, not where they connect \
                 from, and a session without a name counts as idemgate before 0.2.0, which \
                 holds back a contract step. To see them: GRANT pg_read_all_stats TO {role};"
            ));
        }
        if self.bridge_on {
            out.push(format!(
                "compatibility write for idemgate before 0.2.0: on ({}; `idemgate migrate` \
                 drops it once none is connected)",
                if self.older_connected() {
                    "such a process is connected"
                } else {
                    "none is connected now"
                }
            ));
        }
        out.push(match self.refusal() {
            Some(why) => format!("idemgate migrate would refuse: {why}"),
            None if self.bridged() => format!(
                "idemgate migrate would apply {} migration(s), keeping a compatibility write for \
                 the processes before 0.2.0 connected while they are",
                self.pending.len()
            ),
            None if self.pending.is_empty() && self.bridge_on && !self.older_connected() => {
                "idemgate migrate would drop the compatibility write".into()
            }
            None if self.pending.is_empty() => "idemgate migrate has nothing to apply".into(),
            None => format!(
                "idemgate migrate would apply {} migration(s)",
                self.pending.len()
            ),
        });
        out
    }
}
