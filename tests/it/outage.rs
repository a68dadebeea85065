//! When the database goes away every request answers 503 store-unavailable
//! (never a 500, never an unguarded execution), `/readyz` says so, and the
//! server recovers by itself within 5 seconds of its return
//! (docs/operations.md, “Dashboards and alerts”).

use crate::common;

use std::time::{Duration, Instant};

use common::app::{TestApp, fresh_key};
use common::pg::TempCluster;
use idemgate::store::postgres::PgSettings;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_stopped_then_back() {
    let cluster = TempCluster::start().await.expect("a private PostgreSQL");
    let settings = PgSettings {
        acquire_timeout: Duration::from_secs(1),
        ..PgSettings::default()
    };
    let app = TestApp::with_settings(&cluster.url(), &[], settings).await;
    let key = fresh_key();
    let id = app.reserve(&key, "").await.reservation_id();
    assert_eq!(app.send("GET", "/readyz", &[], None).await.status, 200);

    cluster.stop().await.unwrap();
    let res = app.reserve(&fresh_key(), "").await;
    res.assert_problem(503, "store-unavailable");
    let retry: u64 = res.header("retry-after").parse().unwrap();
    assert!(retry >= 1);
    assert_eq!(res.body["retry_after_seconds"], retry);
    app.act(&id, "commit", r#"{"status":200}"#)
        .await
        .assert_problem(503, "store-unavailable");
    app.send("GET", "/readyz", &[], None)
        .await
        .assert_problem(503, "store-unavailable");
    assert_eq!(app.send("GET", "/healthz", &[], None).await.status, 200);
    // Each 503 is one WARN line of the request trace (the cause has its own
    // WARN), not an ERROR: an outage must not bury real errors. The capture
    // is the whole test process's, so other tests' failures are in it too;
    // every one of them must be a WARN as well.
    let logs = common::logs::captured();
    let failures: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("response failed"))
        .collect();
    assert!(
        failures.len() >= 3,
        "expected this test's three 503s in the trace, found {} failure lines",
        failures.len()
    );
    assert!(
        failures.iter().all(|l| l.contains(" WARN ")),
        "{failures:#?}"
    );

    cluster.restart().await.unwrap();
    let back = Instant::now();
    let recovered = loop {
        let res = app
            .act(&id, "commit", r#"{"status":200,"body":"after"}"#)
            .await;
        if res.status == 200 {
            break back.elapsed();
        }
        assert_eq!(res.status, 503, "{res:#?}");
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "not recovered within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("recovered {recovered:?} after the database came back");
    assert_eq!(app.send("GET", "/readyz", &[], None).await.status, 200);
    // The reservation made before the outage survived it.
    let replay = app.reserve(&key, "").await;
    assert_eq!(replay.status, 200, "{replay:#?}");
    assert_eq!(replay.body["response"]["body"], "after");
}
