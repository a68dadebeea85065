//! The rules, one function each, over one key's history. Each pushes a
//! [`Violation`] per broken promise, with the events that show it; none has
//! side effects beyond that (and `listing` filling the report's tables).

use std::collections::{BTreeMap, BTreeSet};

use super::evidence::{execution, request};
use super::{Expect, KeyHistory, Listed, Listing, Report, Violation, key_hash};
use crate::history::{Execution, Request};

/// Under `hold` the origin acts at most once per key, and never for a
/// takeover (a request carrying `Idempotency-Attempt`). Under `takeover`
/// every execution after the first is announced with `Idempotency-Attempt`
/// ≥ 2, each attempt number once.
pub fn executions(k: &KeyHistory<'_>, expect: Expect, out: &mut Vec<Violation>) {
    let acted = k.acted();
    let evidence = || acted.iter().map(|e| execution(e)).collect::<Vec<_>>();
    match expect {
        Expect::Hold => {
            if acted.len() > 1 {
                out.push(violation(
                    "second-execution",
                    k,
                    format!(
                        "the origin acted {} times under hold (at most once)",
                        acted.len()
                    ),
                    evidence(),
                ));
            }
            for e in k.executions.iter().filter(|e| e.attempt.is_some()) {
                out.push(violation(
                    "takeover-under-hold",
                    k,
                    format!(
                        "execution #{} was sent upstream as attempt {}: a held key was taken over",
                        e.seq,
                        e.attempt.unwrap_or_default()
                    ),
                    vec![execution(e)],
                ));
            }
        }
        Expect::Takeover => {
            for (i, e) in acted.iter().enumerate().skip(1) {
                if e.attempt.is_none_or(|n| n < 2) {
                    out.push(violation(
                        "attempt-missing",
                        k,
                        format!(
                            "execution #{} is execution {} of its key but carries no \
                             Idempotency-Attempt >= 2",
                            e.seq,
                            i + 1
                        ),
                        evidence(),
                    ));
                }
            }
            let mut seen = BTreeSet::new();
            for e in &acted {
                if let Some(n) = e.attempt
                    && !seen.insert(n)
                {
                    out.push(violation(
                        "attempt-repeated",
                        k,
                        format!("two executions carried Idempotency-Attempt {n}"),
                        evidence(),
                    ));
                }
            }
        }
    }
}

/// Every answer from the origin a client got (not a problem of the proxy's)
/// is one the origin gave for that key; every replay is the same response,
/// that of an execution in which the origin acted; under `hold`, every
/// success a client got is the one execution's.
pub fn answers(k: &KeyHistory<'_>, expect: Expect, out: &mut Vec<Violation>) {
    let acted = k.acted();
    let from_origin = k
        .requests
        .iter()
        .copied()
        .filter(|r| r.status.is_some() && r.problem.is_none());
    let matches = |r: &Request, e: &Execution| {
        r.status == Some(e.status) && r.body.as_deref() == Some(e.body.as_str())
    };
    let mut replays: BTreeMap<(Option<u16>, Option<&str>), Vec<&Request>> = BTreeMap::new();
    for r in from_origin {
        if r.replayed {
            replays
                .entry((r.status, r.body.as_deref()))
                .or_default()
                .push(r);
            if acted.is_empty() {
                out.push(violation(
                    "replay-without-execution",
                    k,
                    "a replay was served for a key the origin never acted on".into(),
                    vec![request(r)],
                ));
            } else if !acted.iter().any(|e| matches(r, e)) {
                let mut ev = vec![request(r)];
                ev.extend(acted.iter().map(|e| execution(e)));
                out.push(violation(
                    "replay-differs",
                    k,
                    "a replay matches no execution of its key".into(),
                    ev,
                ));
            }
        } else if !k.executions.iter().any(|e| matches(r, e)) {
            let mut ev = vec![request(r)];
            ev.extend(k.executions.iter().map(|e| execution(e)));
            out.push(violation(
                "answer-from-nowhere",
                k,
                "an answer that is not a problem matches no execution of its key".into(),
                ev,
            ));
        }
    }
    if replays.len() > 1 {
        let ev = replays.values().map(|rs| request(rs[0])).collect();
        out.push(violation(
            "replays-differ",
            k,
            format!(
                "{} different responses were replayed for one key",
                replays.len()
            ),
            ev,
        ));
    }
    if expect == Expect::Hold && acted.len() == 1 {
        let one = acted[0];
        for r in k.requests.iter().filter(|r| success(r) && !matches(r, one)) {
            out.push(violation(
                "answer-differs",
                k,
                "a client got a success that is not the key's one execution".into(),
                vec![request(r), execution(one)],
            ));
        }
    }
}

/// A client never sees `422 key-reused`: it always sends one body per key.
pub fn outcomes(k: &KeyHistory<'_>, out: &mut Vec<Violation>) {
    for d in k.done.iter().filter(|d| d.outcome == "key_reused") {
        let ev = k
            .requests
            .iter()
            .filter(|r| r.status == Some(422))
            .map(|r| request(r));
        out.push(violation(
            "key-reused",
            k,
            format!(
                "client {} got 422 key-reused for the body it always sends",
                d.client
            ),
            ev.collect(),
        ));
    }
}

/// Every key ends completed, or in the operator's queue (`unknown`), or
/// without a record only if the origin never acted on it.
pub fn listing(
    k: &KeyHistory<'_>,
    listed: Option<&Listed>,
    in_queue: bool,
    expect: Expect,
    listed_at: u64,
    report: &mut Report,
) {
    // What the origin had done when the listing was taken: the operator's
    // phase comes after.
    let acted: Vec<_> = k
        .acted()
        .into_iter()
        .filter(|e| e.at <= listed_at)
        .collect();
    let out = &mut report.violations;
    let Some(l) = listed else {
        if acted.is_empty() {
            report.no_record.push((k.key.to_owned(), explain(k)));
        } else {
            out.push(violation(
                "lost-record",
                k,
                format!(
                    "the origin acted {} time(s) but the key has no record: its next request \
                     would execute again",
                    acted.len()
                ),
                acted.iter().map(|e| execution(e)).collect(),
            ));
        }
        return;
    };
    match l.state.as_str() {
        "completed" => {
            if acted.is_empty() && l.resolution.is_none() {
                out.push(violation(
                    "completed-without-execution",
                    k,
                    format!(
                        "completed with status {:?}, but the origin never acted",
                        l.status
                    ),
                    vec![format!("{l:?}")],
                ));
            }
            // The replayed response must be the current holder's: a stale
            // holder's commit is fenced off.
            let replayed = k
                .requests
                .iter()
                .find(|r| r.replayed && r.problem.is_none());
            if let Some(r) = replayed
                && let Some(e) = acted.iter().find(|e| r.body.as_deref() == Some(&e.body))
                && i64::from(e.attempt.unwrap_or(1)) != l.attempt
                && l.resolution.is_none()
            {
                out.push(violation(
                    "stale-holder-stored",
                    k,
                    format!(
                        "the replayed response is attempt {}'s, but the record's holder is \
                         attempt {}",
                        e.attempt.unwrap_or(1),
                        l.attempt
                    ),
                    vec![request(r), execution(e), format!("{l:?}")],
                ));
            }
        }
        "unknown" => {
            if !in_queue {
                out.push(violation(
                    "unknown-out-of-sight",
                    k,
                    "the key is unknown but `keys list --state unknown` does not show it".into(),
                    vec![format!("{l:?}")],
                ));
            }
            let first = k.requests.first().map_or(listed_at, |r| r.start);
            report.unknown.push(super::report::Unknown {
                key: k.key.to_owned(),
                acted: acted.len(),
                waited_ms: listed_at.saturating_sub(first),
            });
        }
        "in_flight" if expect == Expect::Takeover => {
            report.awaiting_takeover.push(k.key.to_owned());
        }
        state => out.push(violation(
            "stuck",
            k,
            format!(
                "the key ended {state} after the faults were healed and the leases had passed: \
                 neither settled nor in the operator's queue"
            ),
            vec![format!("{l:?}")],
        )),
    }
}

/// After an operator settled a key, its next request is answered: the
/// response the operator stored, replayed, or a fresh execution after a
/// release.
pub fn operator(k: &KeyHistory<'_>, out: &mut Vec<Violation>) {
    for r in &k.resolves {
        if !r.ok {
            out.push(violation(
                "resolve-failed",
                k,
                format!("the operator's {} failed: {}", r.action, r.output.trim()),
                vec![],
            ));
            continue;
        }
        // The operator's last try after the resolve is its answer (earlier
        // ones may have met a proxy still starting).
        let Some(next) = k
            .requests
            .iter()
            .rev()
            .find(|q| q.client == "operator" && q.start >= r.at)
        else {
            out.push(violation(
                "operator-unchecked",
                k,
                "no request was sent after the resolve".into(),
                vec![],
            ));
            continue;
        };
        let fine = match r.action.as_str() {
            "complete" => next.replayed && success(next) && next.body == r.body,
            _ => {
                success(next)
                    && !next.replayed
                    && k.executions
                        .iter()
                        .any(|e| e.acted && e.at >= r.at && next.body.as_deref() == Some(&e.body))
            }
        };
        if !fine {
            out.push(violation(
                "operator-answer",
                k,
                format!(
                    "after the operator's {}, the next request got something else",
                    r.action
                ),
                vec![
                    request(next),
                    format!("resolve: {:?} {:?}", r.status, r.body),
                ],
            ));
        }
    }
}

/// Once the operator has settled every unknown key, none is unknown.
pub fn after_operator(
    after: &Listing,
    keys: &BTreeMap<&str, KeyHistory<'_>>,
    out: &mut Vec<Violation>,
) {
    let names: BTreeMap<String, &str> = keys.keys().map(|k| (key_hash(k), *k)).collect();
    for l in after.keys.iter().filter(|l| l.state == "unknown") {
        out.push(Violation {
            rule: "unknown-after-operator",
            key: names
                .get(&l.key_hash)
                .map_or_else(|| l.key_hash.clone(), |k| (*k).to_owned()),
            what: "still unknown after the operator settled every unknown key".into(),
            evidence: vec![format!("{l:?}")],
        });
    }
}

/// Why a key that has no record needs none: what each of its requests got.
fn explain(k: &KeyHistory<'_>) -> String {
    let mut got: BTreeMap<String, usize> = BTreeMap::new();
    for r in &k.requests {
        *got.entry(super::report::answer_kind(r)).or_default() += 1;
    }
    for e in &k.executions {
        *got.entry(format!("origin {} (did not act)", e.mode))
            .or_default() += 1;
    }
    for d in &k.done {
        *got.entry(format!("client {}", d.outcome)).or_default() += 1;
    }
    let parts: Vec<String> = got
        .iter()
        .map(|(what, n)| format!("{n} x {what}"))
        .collect();
    parts.join(", ")
}

/// A 2xx answer from the origin, first-hand or replayed.
fn success(r: &Request) -> bool {
    r.problem.is_none() && r.status.is_some_and(|s| (200..300).contains(&s))
}

fn violation(rule: &'static str, k: &KeyHistory<'_>, what: String, ev: Vec<String>) -> Violation {
    Violation {
        rule,
        key: k.key.to_owned(),
        what,
        evidence: ev,
    }
}
