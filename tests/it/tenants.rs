//! Bearer tokens name tenants (docs/reservation-api.md); a tenant never sees
//! another's keys or reservations; no token in a log line.

use crate::common;

use common::app::{TestApp, fresh_key};
use common::backend::Backend;

const TOKENS: &str = "acme:acme-secret-token-1,globex:globex-secret-token-2";

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

async fn tenant_app(b: &Backend) -> TestApp {
    TestApp::new(&b.url(), &["--tokens", TOKENS]).await
}

async fn missing_or_wrong_tokens_are_401(b: Backend) {
    let app = tenant_app(&b).await;
    let key = fresh_key();
    let acme = bearer("acme-secret-token-1");
    let cases: Vec<Vec<(&str, &str)>> = vec![
        vec![("idempotency-key", key.as_str())],
        vec![
            ("idempotency-key", key.as_str()),
            ("authorization", "Bearer nope"),
        ],
        vec![
            ("idempotency-key", key.as_str()),
            ("authorization", "Basic YTpi"),
        ],
        vec![
            ("idempotency-key", key.as_str()),
            ("authorization", "acme-secret-token-1"),
        ],
        vec![
            ("idempotency-key", key.as_str()),
            ("authorization", acme.as_str()),
            ("authorization", acme.as_str()),
        ],
    ];
    for headers in cases {
        let res = app
            .send("POST", "/v1/reservations", &headers, Some(""))
            .await;
        res.assert_problem(401, "unauthorized");
        assert!(res.headers.contains_key("www-authenticate"));
        assert!(!res.text.contains("secret"), "{}", res.text);
    }
    // The operational endpoints and the policy need no token.
    for path in [
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/policy",
        "/openapi.json",
    ] {
        assert_eq!(app.send("GET", path, &[], None).await.status, 200, "{path}");
    }
}

async fn same_key_under_two_tenants_is_two_records(b: Backend) {
    let app = tenant_app(&b).await;
    let key = fresh_key();
    let acme = bearer("acme-secret-token-1");
    let globex = bearer("globex-secret-token-2");
    let reserve = |auth: String, body: &'static str| {
        let key = key.clone();
        let app = &app;
        async move {
            app.send(
                "POST",
                "/v1/reservations",
                &[
                    ("idempotency-key", key.as_str()),
                    ("authorization", auth.as_str()),
                ],
                Some(body),
            )
            .await
        }
    };
    let a = reserve(acme.clone(), r#"{"fingerprint":"a"}"#).await;
    assert_eq!(a.status, 201);
    // Another payload under another tenant: no mismatch, no conflict.
    let g = reserve(globex.clone(), r#"{"fingerprint":"g"}"#).await;
    assert_eq!(g.status, 201, "{g:#?}");
    let a_id = a.reservation_id();
    let g_id = g.reservation_id();

    // Every operation with acme's id, as globex: not found.
    for (action, body) in [
        ("commit", r#"{"status":200}"#),
        ("release", ""),
        ("extend", ""),
        ("checkpoint", r#"{"recovery_point":"p"}"#),
    ] {
        let res = app
            .send(
                "POST",
                &format!("/v1/reservations/{a_id}/{action}"),
                &[("authorization", globex.as_str())],
                Some(body),
            )
            .await;
        res.assert_problem(404, "not-found");
    }
    let res = app
        .send(
            "GET",
            &format!("/v1/reservations/{a_id}"),
            &[("authorization", globex.as_str())],
            None,
        )
        .await;
    res.assert_problem(404, "not-found");

    // Each tenant completes its own record; each replays its own response.
    for (id, auth, body) in [(&a_id, &acme, "acme"), (&g_id, &globex, "globex")] {
        let res = app
            .send(
                "POST",
                &format!("/v1/reservations/{id}/commit"),
                &[("authorization", auth.as_str())],
                Some(&format!(r#"{{"status":200,"body":"{body}"}}"#)),
            )
            .await;
        assert_eq!(res.status, 200, "{res:#?}");
    }
    assert_eq!(
        reserve(acme, r#"{"fingerprint":"a"}"#).await.body["response"]["body"],
        "acme"
    );
    assert_eq!(
        reserve(globex, r#"{"fingerprint":"g"}"#).await.body["response"]["body"],
        "globex"
    );
}

both_stores! {
    serial: [
        missing_or_wrong_tokens_are_401,
        same_key_under_two_tenants_is_two_records,
    ],
    concurrent: [
    ],
}
