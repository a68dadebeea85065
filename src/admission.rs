//! Key admission: what every door checks of a request's key before the
//! engine sees it. The key is there and well formed (in the dialect the
//! request speaks: `Idempotency-Key`, or OASIS's `Repeatability-*`), and the
//! request's first attempt, where the client says when that was, is recent
//! enough for its key to be remembered still. A request refused here was
//! neither reserved nor run; its refusal says what the door counts and what
//! it answers.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName};

use crate::key::dialect::{self, Keyed, TooOld};
use crate::key::{Dialect, KeyError, KeyPolicy};
use crate::problem::{self, ApiError};
use crate::telemetry::Outcome;

/// Why a request's key was not admitted.
#[derive(Debug)]
pub(crate) enum NotAdmitted {
    /// No key, or a malformed one.
    Key(KeyError),
    /// The first attempt was sent longer ago than a key of `ttl` is
    /// remembered: its key may have been forgotten, so it is not reserved
    /// afresh.
    FirstSentTooOld {
        /// The header that said when, as the request named it.
        header: &'static str,
        too_old: TooOld,
        ttl: Duration,
    },
}

impl NotAdmitted {
    /// The outcome the door counts.
    pub(crate) fn outcome(&self) -> Outcome {
        match self {
            NotAdmitted::Key(KeyError::Missing) => Outcome::Missing,
            NotAdmitted::Key(KeyError::Invalid(_)) => Outcome::Invalid,
            NotAdmitted::FirstSentTooOld { .. } => Outcome::TooOld,
        }
    }

    /// What the door answers.
    pub(crate) fn into_problem(self) -> ApiError {
        match self {
            NotAdmitted::Key(e) => ApiError::from(e),
            NotAdmitted::FirstSentTooOld {
                header,
                too_old,
                ttl,
            } => problem::first_sent_too_old(header, too_old, ttl),
        }
    }
}

/// The request's key, from `key_header` or OASIS's headers as `dialect`
/// says.
pub(crate) fn read_key(
    headers: &HeaderMap,
    key_header: &HeaderName,
    policy: &KeyPolicy,
    dialect: Dialect,
) -> Result<Keyed, NotAdmitted> {
    dialect::read(headers, key_header, policy, dialect).map_err(NotAdmitted::Key)
}

/// Refuses a request whose first attempt is older than a key kept for `ttl`
/// is remembered (less the allowance for clock skew).
pub(crate) fn check_first_sent(keyed: &Keyed, ttl: Duration) -> Result<(), NotAdmitted> {
    let Some(first_sent) = keyed.first_sent else {
        return Ok(());
    };
    match dialect::too_old(first_sent, ttl, SystemTime::now()) {
        None => Ok(()),
        Some(too_old) => Err(NotAdmitted::FirstSentTooOld {
            header: match keyed.dialect {
                Dialect::IdempotencyKey => "Idempotency-First-Sent",
                Dialect::Repeatability => "Repeatability-First-Sent",
            },
            too_old,
            ttl,
        }),
    }
}
