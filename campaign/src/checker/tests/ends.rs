//! How keys end: in the final listing, in the operator's queue, settled by
//! the operator; and a run read from its files.

use super::*;

#[test]
fn a_lost_record_is_caught_and_a_key_never_executed_needs_none() {
    let h = clean();
    assert_eq!(rules_broken(&h, &listings(vec![]), None), ["lost-record"]);

    let h = vec![
        run("hold"),
        req("b", 100, 503, false, Some("store-unavailable"), ""),
        done("b", "gave_up"),
    ];
    let report = check(&h, &listings(vec![]), None);
    assert!(report.passed(), "{}", report.render());
    assert_eq!(report.no_record.len(), 1);
    assert!(report.no_record[0].1.contains("503 store-unavailable"));
}

#[test]
fn an_unknown_key_must_be_in_the_operators_queue() {
    let h = vec![
        run("hold"),
        exec(1, "a", None, true, A),
        req("a", 100, 409, false, Some("outcome-unknown"), ""),
        done("a", "dead_lettered"),
        Event::Phase {
            name: "listed".into(),
            at: 9100,
        },
    ];
    let mut l = listings(vec![listed("a", "unknown", 1)]);
    let report = check(&h, &l, None);
    assert!(report.passed(), "{}", report.render());
    assert_eq!(
        report.unknown,
        [report::Unknown {
            key: "a".into(),
            acted: 1,
            waited_ms: 9000
        }]
    );
    assert_eq!(report.keys_dead_lettered, 1);
    l.unknown.keys.clear();
    assert_eq!(rules_broken(&h, &l, None), ["unknown-out-of-sight"]);
}

#[test]
fn a_key_left_in_flight_is_stuck_under_hold_only() {
    let h = vec![
        run("hold"),
        exec(1, "a", None, true, A),
        done("a", "gave_up"),
    ];
    let l = listings(vec![listed("a", "in_flight", 1)]);
    assert_eq!(rules_broken(&h, &l, None), ["stuck"]);
    let report = check(&h, &l, Some(Expect::Takeover));
    assert!(report.passed());
    assert_eq!(report.awaiting_takeover, ["a"]);
}

#[test]
fn a_422_is_caught() {
    let mut h = clean();
    h.push(req("a", 300, 422, false, Some("key-reused"), ""));
    h.push(done("a", "key_reused"));
    let l = listings(vec![listed("a", "completed", 1)]);
    assert_eq!(rules_broken(&h, &l, None), ["key-reused"]);
}

/// `e`, a request, as the operator's.
fn by_operator(mut e: Event) -> Event {
    if let Event::Request(r) = &mut e {
        r.client = "operator".into();
    }
    e
}

fn operator(action: &str, answer: Event) -> Vec<Event> {
    vec![
        run("hold"),
        exec(1, "a", None, true, A),
        req("a", 100, 409, false, Some("outcome-unknown"), ""),
        done("a", "dead_lettered"),
        Event::Resolve(Resolve {
            key: "a".into(),
            action: action.into(),
            status: Some(201),
            body: Some(A.into()),
            ok: true,
            output: String::new(),
            at: 1000,
        }),
        by_operator(answer),
    ]
}

#[test]
fn the_operators_settlement_is_checked() {
    let l = listings(vec![listed("a", "unknown", 1)]);
    let good = operator("complete", req("a", 1100, 201, true, None, A));
    assert!(rules_broken(&good, &l, None).is_empty());
    let bad = operator(
        "complete",
        req("a", 1100, 409, false, Some("outcome-unknown"), ""),
    );
    assert_eq!(rules_broken(&bad, &l, None), ["operator-answer"]);

    let mut after = l.clone();
    after.after_operator = Some(l.all.clone());
    assert_eq!(
        rules_broken(&good, &after, None),
        ["unknown-after-operator"]
    );
}

#[test]
fn faults_are_counted_by_kind() {
    let mut h = clean();
    for kind in ["kill", "kill", "partition"] {
        h.push(Event::Fault(Fault {
            kind: kind.into(),
            target: "proxy-0".into(),
            ..Fault::default()
        }));
    }
    let report = check(&h, &listings(vec![listed("a", "completed", 1)]), None);
    assert_eq!(report.faults.get("kill"), Some(&2));
    assert!(report.render().contains("faults: 3 — kill 2, partition 1"));
}

#[test]
fn a_run_directory_is_checked_from_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let recorder = Recorder::create(&dir.path().join("history.jsonl")).unwrap();
    for event in clean() {
        recorder.record(&event);
    }
    // `keys list --json` as idemgate prints it, naming a key no client sent.
    let keys = r#"{"keys":[{"tenant":"anonymous","key_hash":"x","state":"completed",
        "attempt":1,"reservation_id":"r","on_lease_expiry":"hold","created_at":"t",
        "lease_expires_at":null,"expires_at":"t","completed_at":"t","recovery":null,
        "status":201,"resolution":null}],"next":null}"#;
    std::fs::write(dir.path().join("keys.json"), keys).unwrap();
    std::fs::write(
        dir.path().join("unknown.json"),
        r#"{"keys":[],"next":null}"#,
    )
    .unwrap();
    let report = check_dir(dir.path(), None).unwrap();
    let rules: Vec<_> = report.violations.iter().map(|v| v.rule).collect();
    assert_eq!(rules, ["lost-record", "key-from-nowhere"]);
}

#[test]
fn an_unknown_key_the_origin_never_acted_on_is_released_and_runs_once() {
    let h = vec![
        run("hold"),
        req("a", 100, 409, false, Some("outcome-unknown"), ""),
        done("a", "dead_lettered"),
        Event::Phase {
            name: "listed".into(),
            at: 900,
        },
        Event::Resolve(Resolve {
            key: "a".into(),
            action: "release".into(),
            ok: true,
            at: 1000,
            ..Resolve::default()
        }),
        exec(11, "a", None, true, A),
        by_operator(req("a", 1050, 201, false, None, A)),
    ];
    let mut l = listings(vec![listed("a", "unknown", 1)]);
    l.after_operator = Some(Listing { keys: vec![] });
    let report = check(&h, &l, None);
    assert!(report.passed(), "{}", report.render());
    assert_eq!(
        report.unknown[0].acted, 0,
        "the execution came after the listing"
    );
}
