//! How the records of a shared store are named, as far as this process
//! knows: the windows each process keeps open in the store for the naming it
//! writes ([`crate::seal::Naming`]), read back at start and every minute.
//!
//! - `names:plain`: some process names records by plain SHA-256 (one
//!   without sealing, or in the window after sealing is turned on). A
//!   process that keys names then also looks for a new key under its plain
//!   names.
//! - `names:<key id>`: some process keys names under the seal key with that
//!   id. A process that cannot name records that way (it lacks the key)
//!   would not find them and would run their requests again: it refuses to
//!   start, and once started refuses new keys with `503` until it can.
//!
//! A window stays open for the longest TTL and an hour more after the last
//! process that writes that naming said so.

use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{Engine, EngineError};
use crate::store::StoreError;

/// The prefix of a naming window's name.
const PREFIX: &str = "names:";
/// The window of plain names.
const PLAIN: &str = "names:plain";

/// What [`Engine::keep_naming_windows`] last read.
#[derive(Debug)]
pub(super) struct Windows {
    /// `names:plain` is open.
    plain: AtomicBool,
    /// An open window of a naming this process cannot look under.
    blind: RwLock<Option<String>>,
}

impl Windows {
    /// Before the store has said anything: a process that keys names
    /// assumes plain names may be alive (a new key costs a look more, never
    /// a second run).
    pub(super) fn assume(plain: bool) -> Windows {
        Windows {
            plain: AtomicBool::new(plain),
            blind: RwLock::new(None),
        }
    }
}

/// A naming this process cannot look under is in use: which seal key it
/// lacks (by id), in words for an operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "records in this database are named under seal key id {key_id} (a process with that key \
     keeps them so until the key window since it last ran has passed): without that key this \
     process would not find them and would run their requests again; give it the key, as \
     IDEMGATE_SEAL_KEY or in IDEMGATE_SEAL_KEY_PREVIOUS"
)]
pub struct MissingSealKey {
    /// The id of the seal key, in hex, as `@idemgate-sealed` markers name it.
    pub key_id: String,
}

impl Engine {
    /// Keeps the store's windows of namings: opens (for the longest TTL and
    /// an hour more) the window of the naming this process writes, reads
    /// the windows open, and keeps what they mean for a new key (the plain
    /// names to look under too; a naming this process cannot look under).
    /// `Err(Ok(missing))` when such a naming is in use: the process must not
    /// take new keys. Run at start and every minute.
    pub async fn keep_naming_windows(&self) -> Result<Result<(), MissingSealKey>, EngineError> {
        let writes = match &self.sealer {
            Some(sealer) if !sealer.accepts_plaintext() => format!("{PREFIX}{}", sealer.key_id()),
            _ => PLAIN.to_owned(),
        };
        let seconds = self.limits.max_ttl.as_secs().saturating_add(3600);
        self.store.open_window(&writes, seconds).await?;
        let open = self.store.open_windows().await?;
        let known = self
            .sealer
            .as_ref()
            .map(|s| s.key_ids())
            .unwrap_or_default();
        let missing = open
            .iter()
            .filter_map(|w| w.strip_prefix(PREFIX))
            .find(|id| *id != "plain" && !known.iter().any(|k| k == id))
            .map(|id| MissingSealKey {
                key_id: id.to_owned(),
            });
        self.windows
            .plain
            .store(open.iter().any(|w| w == PLAIN), Ordering::Relaxed);
        *self
            .windows
            .blind
            .write()
            .unwrap_or_else(|e| e.into_inner()) = missing.as_ref().map(|m| m.key_id.clone());
        Ok(missing.map_or(Ok(()), Err))
    }

    /// Whether a new key is also looked for under its plain names: a
    /// process that names records plainly may have written some that are
    /// still alive.
    pub fn plain_window(&self) -> bool {
        self.windows.plain.load(Ordering::Relaxed)
    }

    /// `Err` (unavailable) when a naming this process cannot look under is
    /// in use: a new key must not be taken, as its record may be there
    /// under that name.
    pub(super) fn check_not_blind(&self) -> Result<(), EngineError> {
        let blind = self.windows.blind.read().unwrap_or_else(|e| e.into_inner());
        match blind.as_ref() {
            None => Ok(()),
            Some(key_id) => {
                let why = MissingSealKey {
                    key_id: key_id.clone(),
                };
                tracing::error!(error = %why, "a new key refused");
                Err(StoreError::unavailable(why.to_string()))
            }
        }
    }
}
