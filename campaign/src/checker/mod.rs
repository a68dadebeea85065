//! The checker: reads a run's history and its final key listings and says
//! whether idemgate kept its promise — no key executed twice (under `hold`),
//! every takeover announced (under `takeover`), every answer a client got the
//! one response of its key, and no key left stuck out of an operator's sight.
//!
//! It trusts nothing but the files: `history.jsonl` (what the clients and the
//! origin saw, [`crate::history`]), `keys.json` (`idemgate keys list --all
//! --json` at the end), `unknown.json` (the same with `--state unknown`), and,
//! after an operator phase, `keys-after-operator.json`. The rules are in
//! [`rules`], one function each; the counts in [`report`].

mod evidence;
mod report;
mod rules;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use anyhow::{Context as _, bail};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::history::{self, Event, Execution, KeyDone, Request, Resolve, RunInfo};
pub use report::Report;

/// What the proxies promised: the rules differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Never a second execution of a key.
    Hold,
    /// A second execution only as an announced takeover.
    Takeover,
}

impl Expect {
    pub fn parse(s: &str) -> anyhow::Result<Expect> {
        match s {
            "hold" => Ok(Expect::Hold),
            "takeover" => Ok(Expect::Takeover),
            other => bail!("expected hold or takeover, not {other:?}"),
        }
    }
}

/// `idemgate keys list --json`, as much of it as the checker reads.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Listing {
    pub keys: Vec<Listed>,
}

/// One key of a listing.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Listed {
    pub tenant: String,
    pub key_hash: String,
    pub state: String,
    pub attempt: i64,
    pub status: Option<u16>,
    #[serde(default)]
    pub resolution: Option<serde_json::Value>,
}

/// The listings taken at the end of a run.
#[derive(Debug, Clone, Default)]
pub struct Listings {
    /// Every key (`keys list --all`).
    pub all: Listing,
    /// The keys `keys list --state unknown` shows: the operator's queue.
    pub unknown: Listing,
    /// Every key again after the operator settled the unknown ones.
    pub after_operator: Option<Listing>,
}

/// One broken promise, with the events that show it.
#[derive(Debug, Clone, PartialEq)]
pub struct Violation {
    /// The rule's name (`second-execution`, `replays-differ`, …).
    pub rule: &'static str,
    pub key: String,
    pub what: String,
    pub evidence: Vec<String>,
}

/// Everything the history says about one key, in time order.
#[derive(Debug, Default)]
pub struct KeyHistory<'a> {
    pub key: &'a str,
    pub requests: Vec<&'a Request>,
    pub executions: Vec<&'a Execution>,
    pub done: Vec<&'a KeyDone>,
    pub resolves: Vec<&'a Resolve>,
}

impl KeyHistory<'_> {
    /// The executions in which the origin acted.
    pub fn acted(&self) -> Vec<&Execution> {
        self.executions
            .iter()
            .copied()
            .filter(|e| e.acted)
            .collect()
    }
}

/// The lowercase hex SHA-256 of a raw key: how listings name it.
pub fn key_hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Checks the run in `dir`; `expect` overrides what the history says the
/// proxies were started with.
pub fn check_dir(dir: &Path, expect: Option<Expect>) -> anyhow::Result<Report> {
    let events = history::read(&dir.join("history.jsonl"))?;
    let read = |name: &str| -> anyhow::Result<Option<Listing>> {
        let path = dir.join(name);
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let listing = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a `keys list --json` output", path.display()))?;
        Ok(Some(listing))
    };
    let listings = Listings {
        all: read("keys.json")?.context("keys.json is missing: the run did not end")?,
        unknown: read("unknown.json")?.context("unknown.json is missing: the run did not end")?,
        after_operator: read("keys-after-operator.json")?,
    };
    Ok(check(&events, &listings, expect))
}

/// Checks `events` against `listings`.
pub fn check(events: &[Event], listings: &Listings, expect: Option<Expect>) -> Report {
    let info = events
        .iter()
        .find_map(|e| match e {
            Event::Run(info) => Some(info.clone()),
            _ => None,
        })
        .unwrap_or_default();
    let expect = expect
        .or_else(|| Expect::parse(&info.on_lease_expiry).ok())
        .unwrap_or(Expect::Hold);
    let keys = index(events);
    let mut report = Report::new(info.clone(), expect);
    report.count(events, &keys);
    report.states(&listings.all);

    let by_hash: HashMap<&str, &Listed> = listings
        .all
        .keys
        .iter()
        .map(|l| (l.key_hash.as_str(), l))
        .collect();
    let queue: HashSet<&str> = listings
        .unknown
        .keys
        .iter()
        .map(|l| l.key_hash.as_str())
        .collect();
    let listed_at = report.listed_at;
    let mut known_hashes = HashSet::new();
    for k in keys.values() {
        let hash = key_hash(k.key);
        let listed = by_hash.get(hash.as_str()).copied();
        rules::executions(k, expect, &mut report.violations);
        rules::answers(k, expect, &mut report.violations);
        rules::outcomes(k, &mut report.violations);
        rules::listing(
            k,
            listed,
            queue.contains(hash.as_str()),
            expect,
            listed_at,
            &mut report,
        );
        rules::operator(k, &mut report.violations);
        known_hashes.insert(hash);
    }
    for l in &listings.all.keys {
        if !known_hashes.contains(&l.key_hash) {
            report.violations.push(Violation {
                rule: "key-from-nowhere",
                key: format!("hash {}", l.key_hash),
                what: format!("listed {} but never sent by a client", l.state),
                evidence: vec![format!("{l:?}")],
            });
        }
    }
    if let Some(after) = &listings.after_operator {
        rules::after_operator(after, &keys, &mut report.violations);
    }
    report
}

/// The events of each key, by key.
fn index(events: &[Event]) -> BTreeMap<&str, KeyHistory<'_>> {
    fn of<'a, 'm>(
        keys: &'m mut BTreeMap<&'a str, KeyHistory<'a>>,
        key: &'a str,
    ) -> &'m mut KeyHistory<'a> {
        keys.entry(key).or_insert_with(|| KeyHistory {
            key,
            ..KeyHistory::default()
        })
    }
    let mut keys = BTreeMap::new();
    for event in events {
        match event {
            Event::Request(r) => of(&mut keys, &r.key).requests.push(r),
            Event::Execution(e) => of(&mut keys, &e.key).executions.push(e),
            Event::KeyDone(d) => of(&mut keys, &d.key).done.push(d),
            Event::Resolve(r) => of(&mut keys, &r.key).resolves.push(r),
            Event::Run(_) | Event::Fault(_) | Event::Phase { .. } => {}
        }
    }
    for k in keys.values_mut() {
        k.requests.sort_by_key(|r| (r.start, r.end));
        k.executions.sort_by_key(|e| e.seq);
    }
    keys
}

/// A run's settings, for a report's first line.
pub fn describe(info: &RunInfo) -> String {
    format!(
        "store {}, {} prox{} on_lease_expiry {}, seed {}, {} keys, {} clients, {} s",
        info.store,
        info.proxies,
        if info.proxies == 1 { "y," } else { "ies," },
        info.on_lease_expiry,
        info.seed,
        info.keys,
        info.clients,
        info.duration_secs
    )
}
