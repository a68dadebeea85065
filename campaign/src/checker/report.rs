//! What the checker found: the counts of a run (keys, requests, executions,
//! faults, how keys ended, how long the unknown ones waited) and its
//! violations, printed for a person.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::evidence::secs;
use super::{Expect, KeyHistory, Listing, Violation, describe};
use crate::history::{Event, Request, RunInfo};

/// The violations printed in full; the rest are counted by rule.
const SHOWN: usize = 40;
/// The unknown keys and keys without a record named one by one.
const NAMED: usize = 10;

/// A key left for an operator at the end.
#[derive(Debug, Clone, PartialEq)]
pub struct Unknown {
    pub key: String,
    /// Executions in which the origin acted: how an operator settles it.
    pub acted: usize,
    /// From its first request to the listing.
    pub waited_ms: u64,
}

/// The checker's findings.
#[derive(Debug, Default)]
pub struct Report {
    pub info: RunInfo,
    pub expect: Option<Expect>,
    pub violations: Vec<Violation>,
    /// When the final listing was taken (the end of the run).
    pub listed_at: u64,
    pub keys_sent: usize,
    pub requests: usize,
    /// Answers by kind (`201`, `201 replayed`, `409 outcome-unknown`, `timeout`…).
    pub answers: BTreeMap<String, usize>,
    /// Executions by mode, and how many acted.
    pub executions: BTreeMap<String, usize>,
    pub acted: usize,
    pub faults: BTreeMap<String, usize>,
    /// Clients' ends with a key, by outcome.
    pub ends: BTreeMap<String, usize>,
    /// Keys at least one client dead-lettered (409 outcome-unknown).
    pub keys_dead_lettered: usize,
    /// Keys whose clients got more than one distinct success: a violation
    /// under `hold`; under `takeover` what an origin that does not dedupe on
    /// the key it is forwarded makes of a takeover.
    pub keys_answered_differently: usize,
    /// Keys some client sent but no client finished: a harness fault.
    pub unfinished: Vec<String>,
    /// How the final listing shows the keys, by state.
    pub states: BTreeMap<String, usize>,
    pub unknown: Vec<Unknown>,
    /// Keys without a record, and why they need none.
    pub no_record: Vec<(String, String)>,
    /// Under takeover: keys in flight past their lease, which the next
    /// request takes over.
    pub awaiting_takeover: Vec<String>,
    pub resolves: BTreeMap<String, usize>,
}

impl Report {
    pub fn new(info: RunInfo, expect: Expect) -> Report {
        Report {
            info,
            expect: Some(expect),
            ..Report::default()
        }
    }

    /// Counts what the history holds.
    pub fn count(&mut self, events: &[Event], keys: &BTreeMap<&str, KeyHistory<'_>>) {
        let mut end = 0;
        for event in events {
            match event {
                Event::Request(r) => {
                    self.requests += 1;
                    *self.answers.entry(answer_kind(r)).or_default() += 1;
                    end = end.max(r.end);
                }
                Event::Execution(e) => {
                    *self.executions.entry(e.mode.clone()).or_default() += 1;
                    self.acted += usize::from(e.acted);
                }
                Event::Fault(f) => *self.faults.entry(f.kind.clone()).or_default() += 1,
                Event::KeyDone(d) => *self.ends.entry(d.outcome.clone()).or_default() += 1,
                Event::Resolve(r) => *self.resolves.entry(r.action.clone()).or_default() += 1,
                Event::Phase { name, at } if name == "listed" => self.listed_at = *at,
                Event::Run(_) | Event::Phase { .. } => {}
            }
        }
        if self.listed_at == 0 {
            self.listed_at = end;
        }
        for k in keys.values().filter(|k| !k.requests.is_empty()) {
            self.keys_sent += 1;
            if k.done.iter().any(|d| d.outcome == "dead_lettered") {
                self.keys_dead_lettered += 1;
            }
            if k.done.is_empty() {
                self.unfinished.push(k.key.to_owned());
            }
            let successes: std::collections::BTreeSet<_> = k
                .requests
                .iter()
                .filter(|r| r.problem.is_none() && r.status.is_some_and(|s| s < 300))
                .map(|r| (r.status, r.body.as_deref()))
                .collect();
            if successes.len() > 1 {
                self.keys_answered_differently += 1;
            }
        }
    }

    /// Counts the final listing's states.
    pub fn states(&mut self, all: &Listing) {
        for l in &all.keys {
            *self.states.entry(l.state.clone()).or_default() += 1;
        }
    }

    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The report a person reads.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let expect = match self.expect {
            Some(Expect::Takeover) => "takeover",
            _ => "hold",
        };
        let _ = writeln!(s, "run: {}; checked as {expect}", describe(&self.info));
        let never = self.info.keys.saturating_sub(self.keys_sent);
        let _ = writeln!(
            s,
            "keys: {} sent ({never} of the pool never sent)",
            self.keys_sent
        );
        let _ = writeln!(s, "requests: {} — {}", self.requests, tally(&self.answers));
        let total: usize = self.executions.values().sum();
        let _ = writeln!(
            s,
            "executions: {total} at the origin, {} acted, {} did not (release); by mode: {}",
            self.acted,
            total - self.acted,
            tally(&self.executions)
        );
        let faults: usize = self.faults.values().sum();
        let _ = writeln!(s, "faults: {faults} — {}", tally(&self.faults));
        if !self.info.skipped.is_empty() {
            let _ = writeln!(s, "faults skipped: {}", self.info.skipped.join("; "));
        }
        let _ = writeln!(
            s,
            "clients' ends: {}; keys dead-lettered (outcome-unknown): {}; keys whose clients \
             got different successes: {}",
            tally(&self.ends),
            self.keys_dead_lettered,
            self.keys_answered_differently
        );
        let fives: BTreeMap<String, usize> = self
            .answers
            .iter()
            .filter(|(k, _)| k.starts_with('5') || !k.starts_with(char::is_numeric))
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        let _ = writeln!(s, "5xx and no answer: {}", tally(&fives));
        let _ = writeln!(
            s,
            "end: {}; {} without a record",
            tally(&self.states),
            self.no_record.len()
        );
        self.render_unknown(&mut s);
        if !self.no_record.is_empty() {
            let _ = writeln!(s, "keys without a record (the origin never acted on them):");
            for (key, why) in self.no_record.iter().take(NAMED) {
                let _ = writeln!(s, "  {key}: {why}");
            }
            if self.no_record.len() > NAMED {
                let _ = writeln!(s, "  … and {} more", self.no_record.len() - NAMED);
            }
        }
        if !self.awaiting_takeover.is_empty() {
            let _ = writeln!(
                s,
                "in flight past their lease (the next request takes them over): {}",
                self.awaiting_takeover.len()
            );
        }
        if !self.unfinished.is_empty() {
            let _ = writeln!(
                s,
                "harness: {} key(s) sent but never finished by a client, e.g. {}",
                self.unfinished.len(),
                self.unfinished[0]
            );
        }
        if !self.resolves.is_empty() {
            let _ = writeln!(s, "operator: resolved {}", tally(&self.resolves));
        }
        self.render_violations(&mut s);
        s
    }

    fn render_unknown(&self, s: &mut String) {
        if self.unknown.is_empty() {
            let _ = writeln!(s, "unknown at the end: 0");
            return;
        }
        let mut waits: Vec<u64> = self.unknown.iter().map(|u| u.waited_ms).collect();
        waits.sort_unstable();
        let acted = self.unknown.iter().filter(|u| u.acted > 0).count();
        let _ = writeln!(
            s,
            "unknown at the end: {} ({acted} the origin acted on, {} it did not); waited from \
             their first request to the end: min {}, median {}, max {}",
            self.unknown.len(),
            self.unknown.len() - acted,
            secs(waits[0]),
            secs(waits[waits.len() / 2]),
            secs(waits[waits.len() - 1])
        );
        for u in self.unknown.iter().take(NAMED) {
            let how = if u.acted > 0 {
                "origin acted: complete with its answer"
            } else {
                "origin did not act: release"
            };
            let _ = writeln!(s, "  {} ({how}), waited {}", u.key, secs(u.waited_ms));
        }
        if self.unknown.len() > NAMED {
            let _ = writeln!(s, "  … and {} more", self.unknown.len() - NAMED);
        }
    }

    fn render_violations(&self, s: &mut String) {
        if self.violations.is_empty() {
            let _ = writeln!(s, "violations: 0 — PASS");
            return;
        }
        let mut by_rule: BTreeMap<&str, usize> = BTreeMap::new();
        for v in &self.violations {
            *by_rule.entry(v.rule).or_default() += 1;
        }
        let by_rule: BTreeMap<String, usize> = by_rule
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        let _ = writeln!(
            s,
            "violations: {} — FAIL ({})",
            self.violations.len(),
            tally(&by_rule)
        );
        for v in self.violations.iter().take(SHOWN) {
            let _ = writeln!(s, "VIOLATION {} key={}: {}", v.rule, v.key, v.what);
            for line in &v.evidence {
                let _ = writeln!(s, "    {line}");
            }
        }
        if self.violations.len() > SHOWN {
            let _ = writeln!(s, "… and {} more violations", self.violations.len() - SHOWN);
        }
    }
}

/// What a request got, as one word or two: `201`, `201 replayed`,
/// `409 outcome-unknown`, `503 origin` (a release answer of the origin's),
/// `timeout`, `connect`.
pub fn answer_kind(r: &Request) -> String {
    match (r.status, &r.problem, &r.error) {
        (Some(status), Some(problem), _) => format!("{status} {problem}"),
        (Some(status), None, _) if r.replayed => format!("{status} replayed"),
        (Some(status), None, _) if status >= 500 => format!("{status} origin"),
        (Some(status), None, _) => status.to_string(),
        (None, _, Some(e)) => e.split(':').next().unwrap_or(e).to_owned(),
        (None, _, None) => "no answer".into(),
    }
}

/// `a 3, b 1`, or `none`.
fn tally(counts: &BTreeMap<String, usize>) -> String {
    if counts.is_empty() {
        return "none".into();
    }
    let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{k} {n}")).collect();
    parts.join(", ")
}
