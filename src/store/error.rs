//! How a store fails: [`StoreError`], and the log line an outage gets (one
//! per cause, not one per request).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Why a store operation failed.
///
/// `why` says it in words a person can act on (it already names the cause:
/// the server's message, what to create or start); [`source`] gives the
/// underlying error itself — an `sqlx::Error`, an `std::io::Error` — for code
/// that inspects it (`downcast_ref`), so a printer of this error's chain
/// should stop here rather than print the cause's words twice.
///
/// [`source`]: std::error::Error::source
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum StoreError {
    /// The database cannot be reached or timed out, or cannot serve yet (no
    /// such database, no tables): the caller should retry later.
    Unavailable {
        /// What went wrong, and what to do about it where there is something.
        why: String,
        /// The error underneath, if there was one.
        source: Option<Cause>,
    },
    /// Anything else: a bug or a schema mismatch.
    Other {
        /// What went wrong.
        why: String,
        /// The error underneath, if there was one.
        source: Option<Cause>,
    },
}

/// The error underneath a [`StoreError`], shared by every caller that waited
/// on the same write.
pub type Cause = Arc<dyn std::error::Error + Send + Sync>;

impl StoreError {
    /// The store cannot serve now.
    pub fn unavailable(why: impl Into<String>) -> StoreError {
        StoreError::Unavailable {
            why: why.into(),
            source: None,
        }
    }

    /// Anything but unavailability.
    pub fn other(why: impl Into<String>) -> StoreError {
        StoreError::Other {
            why: why.into(),
            source: None,
        }
    }

    /// The same error, caused by `cause`.
    #[must_use]
    pub fn because(self, cause: impl std::error::Error + Send + Sync + 'static) -> StoreError {
        let cause: Cause = Arc::new(cause);
        match self {
            StoreError::Unavailable { why, .. } => StoreError::Unavailable {
                why,
                source: Some(cause),
            },
            StoreError::Other { why, .. } => StoreError::Other {
                why,
                source: Some(cause),
            },
        }
    }

    /// The same error (kind and cause) in other words.
    #[cfg(feature = "postgres")]
    pub(crate) fn reworded(self, say: impl FnOnce(&str) -> String) -> StoreError {
        match self {
            StoreError::Unavailable { why, source } => StoreError::Unavailable {
                why: say(&why),
                source,
            },
            StoreError::Other { why, source } => StoreError::Other {
                why: say(&why),
                source,
            },
        }
    }

    /// The same error, as unavailability.
    #[cfg(feature = "postgres")]
    pub(crate) fn into_unavailable(self) -> StoreError {
        match self {
            StoreError::Other { why, source } => StoreError::Unavailable { why, source },
            unavailable => unavailable,
        }
    }

    /// What went wrong, without the "unavailable" / "store error" prefix:
    /// for a message that names the cause in its own words.
    pub fn reason(&self) -> &str {
        match self {
            StoreError::Unavailable { why, .. } | StoreError::Other { why, .. } => why,
        }
    }

    /// True for [`StoreError::Unavailable`].
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Unavailable { why, .. } => write!(f, "the store is unavailable: {why}"),
            StoreError::Other { why, .. } => write!(f, "store error: {why}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Unavailable { source, .. } | StoreError::Other { source, .. } => source
                .as_deref()
                .map(|cause| cause as &(dyn std::error::Error + 'static)),
        }
    }
}

/// Result of a store operation.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// How long the same cause of unavailability stays quiet after it was logged.
const REPEAT_AFTER: Duration = Duration::from_secs(60);

/// How many causes are remembered at once: enough for the few that can
/// alternate (a request's and `/readyz`'s view of one fault).
const CAUSES_KEPT: usize = 8;

/// A cause of unavailability logged at WARN: when, and how many times it
/// came back since without a line of its own.
struct Reported {
    why: String,
    at: Instant,
    quiet: u64,
}

static REPORTED: Mutex<Vec<Reported>> = Mutex::new(Vec::new());

/// Logs why the store is unavailable: at WARN the first time a cause comes
/// up, then at most once a minute while it lasts, with how many times it
/// came back meanwhile; DEBUG otherwise. During an outage every request
/// fails the same way, and one line per request would bury the line that
/// says what to do.
pub fn report_unavailable(why: &str) {
    let warn = {
        let mut reported = REPORTED.lock().unwrap_or_else(|e| e.into_inner());
        decide(&mut reported, why, Instant::now())
    };
    match warn {
        Some(0) => tracing::warn!(error = %why, "store unavailable"),
        Some(repeated) => tracing::warn!(error = %why, repeated, "store unavailable, still"),
        None => tracing::debug!(error = %why, "store unavailable (logged already)"),
    }
}

/// Whether `why`, seen at `now`, gets a WARN line: `Some(times it came back
/// unlogged since its last line)`, or `None` to stay quiet.
fn decide(reported: &mut Vec<Reported>, why: &str, now: Instant) -> Option<u64> {
    if let Some(r) = reported.iter_mut().find(|r| r.why == why) {
        if now.duration_since(r.at) < REPEAT_AFTER {
            r.quiet += 1;
            return None;
        }
        let repeated = r.quiet;
        r.at = now;
        r.quiet = 0;
        return Some(repeated);
    }
    if reported.len() >= CAUSES_KEPT
        && let Some(oldest) = (0..reported.len()).min_by_key(|&i| reported[i].at)
    {
        reported.swap_remove(oldest);
    }
    reported.push(Reported {
        why: why.to_owned(),
        at: now,
        quiet: 0,
    });
    Some(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_is_logged_when_new_then_once_a_minute_while_it_lasts() {
        let mut reported = Vec::new();
        let t0 = Instant::now();
        let at = |secs| t0 + Duration::from_secs(secs);
        assert_eq!(decide(&mut reported, "a", t0), Some(0));
        for i in 1..=5 {
            assert_eq!(decide(&mut reported, "a", at(i)), None);
        }
        assert_eq!(
            decide(&mut reported, "b", at(6)),
            Some(0),
            "another cause is news"
        );
        assert_eq!(
            decide(&mut reported, "a", at(7)),
            None,
            "two causes that alternate are each logged once, not at every turn"
        );
        assert_eq!(
            decide(&mut reported, "a", at(61)),
            Some(6),
            "a minute on: one line, with the count of the quiet ones"
        );
        assert_eq!(decide(&mut reported, "a", at(62)), None);
        for (i, cause) in ["c", "d", "e", "f", "g", "h", "i", "j"].iter().enumerate() {
            assert_eq!(decide(&mut reported, cause, at(70 + i as u64)), Some(0));
        }
        assert!(reported.len() <= CAUSES_KEPT, "the memory is bounded");
    }
}
