//! Every `(mode, outcome)` series of `idemgate_requests_total` is exported
//! from start-up, at 0, on the API and on the proxy's admin listener, so that
//! a dashboard or an alert on `rate()` works before the first request of
//! each kind. Run against the real binary: the in-process tests share one
//! metrics registry.

use crate::common;

use common::bin::Served;
use common::pg::TestDb;
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
