//! The checker on small made-up histories: clean ones pass, and each kind of
//! violation is caught, so a checker that stopped looking would fail here.
//! Here the executions and the answers; in [`ends`] how keys end.

mod ends;

use super::*;
use crate::history::{Execution, Fault, KeyDone, Recorder, Request, Resolve, RunInfo};

fn run(mode: &str) -> Event {
    Event::Run(RunInfo {
        store: "postgres".into(),
        on_lease_expiry: mode.into(),
        proxies: 3,
        keys: 4,
        tenant: "anonymous".into(),
        ..RunInfo::default()
    })
}

fn exec(seq: u64, key: &str, attempt: Option<u32>, acted: bool, body: &str) -> Event {
    Event::Execution(Execution {
        seq,
        key: key.into(),
        attempt,
        proxy: Some(0),
        mode: if acted { "normal" } else { "release" }.into(),
        acted,
        status: if acted { 201 } else { 503 },
        body: body.into(),
        at: seq * 100,
    })
}

/// An answer from the origin (`problem` None) or a problem of the proxy's.
fn req(
    key: &str,
    at: u64,
    status: u16,
    replayed: bool,
    problem: Option<&str>,
    body: &str,
) -> Event {
    Event::Request(Request {
        key: key.into(),
        client: "c1".into(),
        proxy: 1,
        try_no: 1,
        start: at,
        end: at + 10,
        status: Some(status),
        replayed,
        problem: problem.map(Into::into),
        body: problem.is_none().then(|| body.into()),
        ..Request::default()
    })
}

fn done(key: &str, outcome: &str) -> Event {
    Event::KeyDone(KeyDone {
        key: key.into(),
        client: "c1".into(),
        outcome: outcome.into(),
        tries: 1,
        at: 5000,
    })
}

fn listed(key: &str, state: &str, attempt: i64) -> Listed {
    Listed {
        tenant: "anonymous".into(),
        key_hash: key_hash(key),
        state: state.into(),
        attempt,
        status: (state == "completed").then_some(201),
        resolution: None,
    }
}

fn listings(all: Vec<Listed>) -> Listings {
    let unknown = all
        .iter()
        .filter(|l| l.state == "unknown")
        .cloned()
        .collect();
    Listings {
        all: Listing { keys: all },
        unknown: Listing { keys: unknown },
        after_operator: None,
    }
}

fn rules_broken(events: &[Event], l: &Listings, expect: Option<Expect>) -> Vec<&'static str> {
    let report = check(events, l, expect);
    // Rendering must never panic, whatever was found.
    let _ = report.render();
    let mut rules: Vec<_> = report.violations.iter().map(|v| v.rule).collect();
    rules.dedup();
    rules
}

const A: &str = r#"{"key":"a","execution":1,"charge":"ch_1"}"#;
const B: &str = r#"{"key":"a","execution":2,"charge":"ch_2"}"#;

/// One execution, its answer, a replay, completed: the clean case.
fn clean() -> Vec<Event> {
    vec![
        run("hold"),
        exec(1, "a", None, true, A),
        req("a", 100, 201, false, None, A),
        req("a", 200, 201, true, None, A),
        done("a", "done"),
        done("a", "done"),
    ]
}

#[test]
fn a_clean_history_passes() {
    let report = check(&clean(), &listings(vec![listed("a", "completed", 1)]), None);
    assert!(report.passed(), "{}", report.render());
    assert_eq!(report.acted, 1);
    assert_eq!(report.keys_sent, 1);
    assert!(report.render().contains("PASS"));
}

#[test]
fn a_second_execution_under_hold_is_caught() {
    let mut h = clean();
    h.push(exec(2, "a", None, true, B));
    let l = listings(vec![listed("a", "completed", 1)]);
    assert_eq!(rules_broken(&h, &l, None), ["second-execution"]);
}

#[test]
fn a_release_answer_is_not_an_execution() {
    let mut h = clean();
    h.insert(1, exec(0, "a", None, false, r#"{"busy":0}"#));
    h.insert(2, req("a", 50, 503, false, None, r#"{"busy":0}"#));
    let l = listings(vec![listed("a", "completed", 1)]);
    assert!(rules_broken(&h, &l, None).is_empty());
}

#[test]
fn takeovers_pass_under_takeover_and_fail_under_hold() {
    let h = vec![
        run("takeover"),
        exec(1, "a", None, true, A),
        req("a", 100, 502, false, Some("upstream-unavailable"), ""),
        exec(2, "a", Some(2), true, B),
        req("a", 300, 201, false, None, B),
        req("a", 400, 201, true, None, B),
        done("a", "done"),
    ];
    let l = listings(vec![listed("a", "completed", 2)]);
    assert!(rules_broken(&h, &l, None).is_empty());
    assert_eq!(
        rules_broken(&h, &l, Some(Expect::Hold)),
        ["second-execution", "takeover-under-hold"]
    );
}

#[test]
fn an_unannounced_takeover_is_caught() {
    let h = vec![
        run("takeover"),
        exec(1, "a", None, true, A),
        exec(2, "a", None, true, B),
        req("a", 300, 201, true, None, B),
        done("a", "done"),
    ];
    let l = listings(vec![listed("a", "completed", 1)]);
    assert_eq!(rules_broken(&h, &l, None), ["attempt-missing"]);
}

#[test]
fn a_stale_holders_response_stored_is_caught() {
    let h = vec![
        run("takeover"),
        exec(1, "a", None, true, A),
        exec(2, "a", Some(2), true, B),
        req("a", 300, 201, true, None, A),
        done("a", "done"),
    ];
    let l = listings(vec![listed("a", "completed", 2)]);
    assert_eq!(rules_broken(&h, &l, None), ["stale-holder-stored"]);
}

#[test]
fn a_replay_that_differs_is_caught() {
    let mut h = clean();
    h.push(req(
        "a",
        300,
        201,
        true,
        None,
        r#"{"key":"a","execution":1,"charge":"ch_X"}"#,
    ));
    let l = listings(vec![listed("a", "completed", 1)]);
    assert_eq!(
        rules_broken(&h, &l, None),
        ["replay-differs", "replays-differ", "answer-differs"]
    );
}

#[test]
fn a_replay_without_an_execution_is_caught() {
    let h = vec![
        run("hold"),
        req("a", 100, 201, true, None, A),
        done("a", "done"),
    ];
    let l = listings(vec![listed("a", "completed", 1)]);
    assert_eq!(
        rules_broken(&h, &l, None),
        ["replay-without-execution", "completed-without-execution"]
    );
}

#[test]
fn an_answer_from_nowhere_is_caught() {
    let mut h = clean();
    h.push(req("a", 300, 200, false, None, "{}"));
    let l = listings(vec![listed("a", "completed", 1)]);
    assert_eq!(
        rules_broken(&h, &l, None),
        ["answer-from-nowhere", "answer-differs"]
    );
}
