//! Every `(mode, outcome)` series of `idemgate_requests_total` is exported
//! from start-up, at 0, on the API and on the proxy's admin listener, so that
//! a dashboard or an alert on `rate()` works before the first request of
//! each kind. Run against the real binary: the in-process tests share one
//! metrics registry.

use crate::common;

use common::bin::Served;
use common::pg::{TempCluster, TestDb};
use common::proxy::ProxyProcess;
use common::upstream::Upstream;

const OUTCOMES: [&str; 11] = [
    "created",
    "replayed",
    "conflict",
    "mismatch",
    "missing",
    "invalid",
    "takeover",
    "released",
    "passthrough",
    "limited",
    "too_old",
];

async fn metrics(url: String) -> String {
    let res = reqwest::get(url).await.unwrap();
    assert_eq!(res.status(), 200);
    res.text().await.unwrap()
}

#[track_caller]
fn assert_series_at_zero(text: &str, mode: &str, outcomes: &[&str]) {
    for outcome in outcomes {
        let line = format!("idemgate_requests_total{{mode=\"{mode}\",outcome=\"{outcome}\"}} 0");
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
}

#[tokio::test]
async fn the_api_exports_its_series_from_start_up() {
    let db = TestDb::new().await;
    let served = Served::start(&db, &[]).await;
    let text = metrics(format!("{}/metrics", served.base())).await;
    let api: Vec<&str> = OUTCOMES
        .iter()
        .copied()
        .filter(|o| *o != "passthrough")
        .collect();
    assert_series_at_zero(&text, "api", &api);
    assert!(
        !text.contains("mode=\"api\",outcome=\"passthrough\""),
        "the API passes nothing through"
    );
}

#[tokio::test]
async fn the_proxy_admin_listener_exports_its_series_from_start_up() {
    let db = TestDb::new().await;
    let origin = Upstream::start().await;
    let proxy = ProxyProcess::start(&db, &origin.url()).await;
    let text = metrics(format!("http://127.0.0.1:{}/metrics", proxy.admin)).await;
    assert_series_at_zero(&text, "proxy", &OUTCOMES);
}

/// The value of the series `name` (with its labels, as rendered), if exported.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[track_caller]
fn assert_value(text: &str, series: &str, expected: f64) {
    assert_eq!(value(text, series), Some(expected), "{series} in:\n{text}");
}

async fn reserve(base: &str, key: &str, body: Option<&str>) -> reqwest::Response {
    let mut req = common::http()
        .post(format!("{base}/v1/reservations"))
        .header("Idempotency-Key", format!("\"{key}\""));
    if let Some(body) = body {
        req = req
            .header("content-type", "application/json")
            .body(body.to_owned());
    }
    req.send().await.unwrap()
}

/// A reservation whose body or field the API cannot take (400
/// invalid-request) is counted as `invalid`, with the malformed keys, not
/// under no outcome at all.
#[tokio::test]
async fn a_bad_reservation_body_counts_as_invalid() {
    let db = TestDb::new().await;
    let served = Served::start(&db, &[]).await;
    let base = served.base();
    let series = "idemgate_requests_total{mode=\"api\",outcome=\"invalid\"}";
    assert_value(&metrics(format!("{base}/metrics")).await, series, 0.0);
    for body in [
        "{not json",
        r#"{"lease_seconds":0}"#,
        r#"{"fingerprint":"a","request":{"method":"POST","path":"/"}}"#,
    ] {
        let res = reserve(&base, &common::app::fresh_key(), Some(body)).await;
        assert_eq!(res.status(), 400, "{body}");
        let problem: serde_json::Value = res.json().await.unwrap();
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("/invalid-request"),
            "{problem}"
        );
    }
    let text = metrics(format!("{base}/metrics")).await;
    assert_value(&text, series, 3.0);
    assert_value(
        &text,
        "idemgate_requests_total{mode=\"api\",outcome=\"created\"}",
        0.0,
    );
}

/// The replay cache's hits and misses are counted (at 0 from start-up): a
/// new key misses, its replay after the commit hits.
#[tokio::test]
async fn replay_cache_hits_and_misses_are_counted() {
    let db = TestDb::new().await;
    let served = Served::start(&db, &[]).await;
    let base = served.base();
    let text = metrics(format!("{base}/metrics")).await;
    assert_value(&text, "idemgate_replay_cache_hits_total", 0.0);
    assert_value(&text, "idemgate_replay_cache_misses_total", 0.0);

    let key = common::app::fresh_key();
    let reserved = reserve(&base, &key, None).await;
    assert_eq!(reserved.status(), 201);
    let id = reserved.json::<serde_json::Value>().await.unwrap()["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let committed = common::http()
        .post(format!("{base}/v1/reservations/{id}/commit"))
        .header("content-type", "application/json")
        .body(r#"{"status":200,"body":"ok"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(committed.status(), 200);
    let replayed = reserve(&base, &key, None).await;
    assert_eq!(replayed.status(), 200);

    let text = metrics(format!("{base}/metrics")).await;
    assert_value(&text, "idemgate_replay_cache_misses_total", 1.0);
    assert_value(&text, "idemgate_replay_cache_hits_total", 1.0);
}

/// Through the proxy, whose replays from the cache are answered in the
/// request's own task: every guarded request is counted once, a hit or a
/// miss, never both; a new key misses and charges once; its replays are
/// the first answer, and another payload under the key is refused from the
/// cache as from the store.
#[tokio::test]
async fn the_proxy_counts_each_replay_once_as_a_hit_or_a_miss() {
    let db = TestDb::new().await;
    let origin = Upstream::start().await;
    let proxy = ProxyProcess::start(&db, &origin.url()).await;
    let admin = format!("http://127.0.0.1:{}/metrics", proxy.admin);
    let key = common::app::fresh_key();
    let post = |body: &'static str| {
        common::http()
            .post(format!("{}/charges", proxy.base()))
            .header("Idempotency-Key", format!("\"{key}\""))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let first = post(r#"{"amount":7}"#).await.unwrap();
    assert_eq!(first.status(), 201);
    let charged = first.text().await.unwrap();
    let text = metrics(admin.clone()).await;
    assert_value(&text, "idemgate_replay_cache_misses_total", 1.0);
    assert_value(&text, "idemgate_replay_cache_hits_total", 0.0);

    for _ in 0..3 {
        let again = post(r#"{"amount":7}"#).await.unwrap();
        assert_eq!(again.status(), 201);
        assert_eq!(again.headers().get("idempotent-replayed").unwrap(), "true");
        assert_eq!(again.text().await.unwrap(), charged);
    }
    let other = post(r#"{"amount":8}"#).await.unwrap();
    assert_eq!(other.status(), 422);
    assert_eq!(
        origin.started(&format!("\"{key}\"")),
        1,
        "the origin ran once"
    );

    let text = metrics(admin).await;
    let hits = value(&text, "idemgate_replay_cache_hits_total").unwrap();
    let misses = value(&text, "idemgate_replay_cache_misses_total").unwrap();
    assert_eq!(hits + misses, 5.0, "one count per request:\n{text}");
    assert!(
        hits >= 3.0,
        "the replays after the first come from the cache:\n{text}"
    );
    assert_value(
        &text,
        "idemgate_requests_total{mode=\"proxy\",outcome=\"replayed\"}",
        3.0,
    );
    assert_value(
        &text,
        "idemgate_requests_total{mode=\"proxy\",outcome=\"mismatch\"}",
        1.0,
    );
}

/// An outage shows on /metrics with no traffic (`idemgate_store_up` 0, from
/// the scrape's own ping) and in the answers it caused
/// (`idemgate_store_errors_total{kind="unavailable"}`), so an alert can fire
/// on either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_shows_as_store_down_and_store_errors() {
    let cluster = TempCluster::start().await.expect("a private PostgreSQL");
    let served = Served::spawn(common::bin::idemgate_at(&cluster.url()), &[]).await;
    let base = served.base();
    let unavailable = "idemgate_store_errors_total{kind=\"unavailable\"}";
    let text = metrics(format!("{base}/metrics")).await;
    assert_value(&text, "idemgate_store_up", 1.0);
    assert_value(&text, unavailable, 0.0);
    assert_value(&text, "idemgate_store_errors_total{kind=\"other\"}", 0.0);

    cluster.stop().await.unwrap();
    let text = metrics(format!("{base}/metrics")).await;
    assert_value(&text, "idemgate_store_up", 0.0);
    assert_value(&text, unavailable, 0.0);
    let res = reserve(&base, &common::app::fresh_key(), None).await;
    assert_eq!(res.status(), 503);
    let text = metrics(format!("{base}/metrics")).await;
    assert_value(&text, unavailable, 1.0);
    assert_value(&text, "idemgate_store_up", 0.0);
}
