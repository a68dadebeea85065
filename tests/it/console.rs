//! The operators' console over HTTP, as its page calls it — the admin
//! endpoints' rule on every fragment, settling from the page (once: the second
//! is "already settled by …"), the queue as the gauge counts it, paged, and
//! nothing for a request the page did not make. The page in a real browser is
//! `.ci/console`.

use crate::common;

use common::app::{TestApp, TestResponse, fresh_key};
use common::backend::Backend;
use serde_json::json;
use sha2::{Digest, Sha256};

const TENANT_TOKENS: &str = "acme:acme-tok-77c1,globex:globex-tok-0d9e";
const ADMIN_TOKENS: &str = "alice:admin-tok-51aa";
const ADMIN: &str = "Bearer admin-tok-51aa";
const ACME: &str = "Bearer acme-tok-77c1";

fn hash_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// A request as the console page's htmx sends it, as `auth`.
async fn fragment(
    app: &TestApp,
    auth: Option<&str>,
    method: &str,
    path: &str,
    form: Option<&str>,
) -> TestResponse {
    let mut headers = vec![("hx-request", "true"), ("sec-fetch-site", "same-origin")];
    if let Some(auth) = auth {
        headers.push(("authorization", auth));
    }
    if form.is_some() {
        headers.push(("content-type", "application/x-www-form-urlencoded"));
    }
    app.send(method, path, &headers, form).await
}

/// A key of `auth`'s tenant held unknown: reserved under `hold` with a
/// one-second lease, outlived.
async fn stuck_key(app: &TestApp, auth: &str) -> String {
    let key = fresh_key();
    let body = json!({"lease_seconds": 1, "on_lease_expiry": "hold"}).to_string();
    let held = app.reserve_as(auth, &key, &body).await;
    assert_eq!(held.status, 201, "{held:#?}");
    key
}

/// Every fragment keeps the admin endpoints' rule: a tenant's token is
/// refused (`forbidden`), tenant tokens without admin tokens close it
/// (`admin-disabled`, naming `IDEMGATE_ADMIN_TOKENS`), no or a wrong token
/// is `unauthorized`; a refused caller sees none of the key. The page itself
/// holds no data and answers everyone.
async fn every_fragment_keeps_the_admin_rule(b: Backend) {
    type Gate = Option<(u16, &'static str)>;
    let configs: [(&str, Vec<&str>, [Gate; 3]); 3] = [
        (
            "tenant and admin tokens",
            vec!["--tokens", TENANT_TOKENS, "--admin-tokens", ADMIN_TOKENS],
            // nobody, a tenant, an operator
            [Some((401, "unauthorized")), Some((403, "forbidden")), None],
        ),
        (
            "tenant tokens without admin tokens",
            vec!["--tokens", TENANT_TOKENS],
            [
                Some((403, "admin-disabled")),
                Some((403, "admin-disabled")),
                Some((403, "admin-disabled")),
            ],
        ),
        (
            "tenant and admin tokens, not loopback",
            vec![
                "--tokens",
                TENANT_TOKENS,
                "--admin-tokens",
                ADMIN_TOKENS,
                "--listen",
                "0.0.0.0:8080",
            ],
            [Some((401, "unauthorized")), Some((403, "forbidden")), None],
        ),
    ];
    for (name, flags, gates) in configs {
        let app = TestApp::new(&b.url(), &flags).await;
        TestApp::outlive(0).await;
        let key = stuck_key(&app, ACME).await;
        TestApp::outlive(1).await;
        let hash = hash_hex(&key);
        let routes = [
            ("GET", "/console/fragments/counts".to_owned(), None, 200),
            ("GET", "/console/fragments/queue".to_owned(), None, 200),
            (
                "GET",
                format!("/console/fragments/keys/acme/{hash}"),
                None,
                200,
            ),
            (
                "POST",
                format!("/console/fragments/keys/acme/{hash}/resolve"),
                Some("action=nothing-of-the-kind&reason=probe"),
                400,
            ),
        ];
        for (caller, gate) in [None, Some(ACME), Some(ADMIN)].into_iter().zip(gates) {
            for (method, path, form, ok) in &routes {
                let res = fragment(&app, caller, method, path, *form).await;
                let at = format!("{name}: {caller:?} {method} {path}");
                match gate {
                    None => {
                        assert_eq!(res.status, *ok, "{at}: {}", res.text);
                        if path.ends_with("/queue") {
                            assert!(res.text.contains(&hash), "{at}: lists the key");
                        }
                    }
                    // The counts only note a refusal, with its status: the
                    // queue or the key beside them says it, once.
                    Some((status, _)) if path.ends_with("/counts") => {
                        assert_eq!(res.status, status, "{at}: {}", res.text);
                        assert!(res.text.contains("No counts"), "{at}: {}", res.text);
                        assert!(!res.text.contains("problem"), "{at}: {}", res.text);
                    }
                    Some((status, slug)) => {
                        assert_eq!(res.status, status, "{at}: {}", res.text);
                        assert!(res.text.contains(slug), "{at}: {}", res.text);
                        assert!(!res.text.contains(&hash[..12]), "{at}: {}", res.text);
                        if slug == "admin-disabled" {
                            assert!(res.text.contains("IDEMGATE_ADMIN_TOKENS"), "{at}");
                        }
                    }
                }
            }
            // A refused caller settles nothing: the key is still unknown.
            let settle = fragment(
                &app,
                caller,
                "POST",
                &format!("/console/fragments/keys/acme/{hash}/resolve"),
                Some("action=release&reason=nothing+happened"),
            )
            .await;
            if gate.is_some() {
                assert_ne!(settle.status, 200, "{name}: {caller:?}");
                let dup = app.reserve_as(ACME, &key, "").await;
                dup.assert_problem(409, "outcome-unknown");
            }
        }
        let page = app.send("GET", "/console", &[], None).await;
        assert_eq!(page.status, 200, "{name}");
        assert!(page.text.contains("idemgate console"), "{name}");
        assert!(
            !page.text.contains(&hash[..12]),
            "{name}: the page holds no data"
        );
    }
}

/// Settled from the page: `complete` stores what the operator entered and
/// says what a retry gets; the retry replays it; settling again (a double
/// click, a second operator) is `409` "already settled by alice" — for a
/// release too, whose key is otherwise forgotten.
async fn settling_from_the_console_happens_once(b: Backend) {
    let app = TestApp::new(
        &b.url(),
        &["--tokens", TENANT_TOKENS, "--admin-tokens", ADMIN_TOKENS],
    )
    .await;
    let completed = stuck_key(&app, ACME).await;
    let released = stuck_key(&app, ACME).await;
    TestApp::outlive(1).await;

    let queue = fragment(&app, Some(ADMIN), "GET", "/console/fragments/queue", None).await;
    assert_eq!(queue.status, 200, "{}", queue.text);
    for key in [&completed, &released] {
        assert!(queue.text.contains(&hash_hex(key)[..12]), "{}", queue.text);
    }
    let counts = fragment(&app, Some(ADMIN), "GET", "/console/fragments/counts", None).await;
    assert!(counts.text.contains("data-stuck=\"2\""), "{}", counts.text);
    assert!(counts.text.contains("store: "), "{}", counts.text);

    let path = format!("/console/fragments/keys/acme/{}", hash_hex(&completed));
    let page = fragment(&app, Some(ADMIN), "GET", &path, None).await;
    assert_eq!(page.status, 200, "{}", page.text);
    assert!(page.text.contains("Settle this key"), "{}", page.text);
    assert!(page.text.contains("id=\"timeline\""), "{}", page.text);
    // The operator chooses what happened: nothing is chosen for them, and
    // a settle without a choice says so, beside the form, and settles
    // nothing.
    assert!(!page.text.contains("checked"), "{}", page.text);
    let settle = format!("{path}/resolve");
    let unchosen = fragment(
        &app,
        Some(ADMIN),
        "POST",
        &settle,
        Some("status=201&reason=checked+the+books"),
    )
    .await;
    assert_eq!(unchosen.status, 400, "{}", unchosen.text);
    assert!(
        unchosen.text.contains("choose what happened"),
        "{}",
        unchosen.text
    );
    assert_eq!(unchosen.headers["hx-retarget"], "#settle-result");
    assert!(!unchosen.headers.contains_key("hx-trigger"));

    let form = "action=complete&status=201&headers=Content-Type%3A+application%2Fjson\
                &body=%7B%22charge%22%3A1%7D&reason=checked+the+books";
    let first = fragment(&app, Some(ADMIN), "POST", &settle, Some(form)).await;
    assert_eq!(first.status, 200, "{}", first.text);
    // The counts follow at once, and the timeline keeps the lease's end
    // that made the key wait for a person.
    assert_eq!(first.headers["hx-trigger"], "key-settled");
    assert!(
        first.text.contains("lease ended without news"),
        "{}",
        first.text
    );
    let counts = fragment(&app, Some(ADMIN), "GET", "/console/fragments/counts", None).await;
    assert!(counts.text.contains("data-stuck=\"1\""), "{}", counts.text);
    assert!(
        first
            .text
            .contains("A retry now replays <strong>201</strong>"),
        "{}",
        first.text
    );
    assert!(!first.text.contains("Settle this key"), "{}", first.text);
    let again = fragment(&app, Some(ADMIN), "POST", &settle, Some(form)).await;
    assert_eq!(again.status, 409, "{}", again.text);
    assert!(
        again.text.contains("already settled by alice"),
        "{}",
        again.text
    );
    assert_eq!(again.headers["hx-trigger"], "key-settled");

    // The retry replays what the operator entered.
    let retry = app.reserve_as(ACME, &completed, "").await;
    assert_eq!(retry.status, 200, "{retry:#?}");
    assert_eq!(retry.body["response"]["status"], 201, "{retry:#?}");
    assert_eq!(
        retry.body["response"]["body"], "{\"charge\":1}",
        "{retry:#?}"
    );

    let settle = format!(
        "/console/fragments/keys/acme/{}/resolve",
        hash_hex(&released)
    );
    let form = "action=release&reason=nothing+happened";
    let first = fragment(&app, Some(ADMIN), "POST", &settle, Some(form)).await;
    assert_eq!(first.status, 200, "{}", first.text);
    assert!(
        first.text.contains("runs the request again"),
        "{}",
        first.text
    );
    let again = fragment(&app, Some(ADMIN), "POST", &settle, Some(form)).await;
    assert_eq!(again.status, 409, "{}", again.text);
    assert!(
        again.text.contains("already settled by alice"),
        "{}",
        again.text
    );
    // Where the page shows a settle's answer, released or not.
    assert!(
        again.text.contains("id=\"settle-result\""),
        "{}",
        again.text
    );
    // The JSON endpoint says the same.
    let json_again = app
        .send(
            "POST",
            &format!("/v1/admin/keys/acme/{}/resolve", hash_hex(&released)),
            &[("authorization", ADMIN)],
            Some(r#"{"action":"release","reason":"again"}"#),
        )
        .await;
    json_again.assert_problem(409, "key-not-stuck");
    assert!(
        json_again.body["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("already settled by alice"),
        "{json_again:#?}"
    );
    // A reason is required; what was typed stays in the form (the answer
    // goes beside it).
    let third = stuck_key(&app, ACME).await;
    TestApp::outlive(1).await;
    let no_reason = fragment(
        &app,
        Some(ADMIN),
        "POST",
        &format!("/console/fragments/keys/acme/{}/resolve", hash_hex(&third)),
        Some("action=release&reason=+"),
    )
    .await;
    assert_eq!(no_reason.status, 400, "{}", no_reason.text);
    assert_eq!(no_reason.header("hx-retarget"), "#settle-result");
    assert!(no_reason.text.contains("reason"), "{}", no_reason.text);
}

/// The queue is the keys that wait for a person as the gauge counts them —
/// a key in flight past its lease under `takeover` too — oldest first, 50 a
/// page, and the filters narrow it.
async fn the_queue_is_what_waits_paged_and_filtered(b: Backend) {
    let app = TestApp::new(
        &b.url(),
        &["--tokens", TENANT_TOKENS, "--admin-tokens", ADMIN_TOKENS],
    )
    .await;
    let mut keys = Vec::new();
    for i in 0..120 {
        let (auth, lease) = if i % 3 == 0 {
            ("Bearer globex-tok-0d9e", "takeover")
        } else {
            (ACME, "hold")
        };
        let key = fresh_key();
        let body = json!({"lease_seconds": 1, "on_lease_expiry": lease}).to_string();
        assert_eq!(app.reserve_as(auth, &key, &body).await.status, 201);
        keys.push(hash_hex(&key));
    }
    // One in flight under a live lease: not in the queue.
    let live = fresh_key();
    assert_eq!(app.reserve_as(ACME, &live, "").await.status, 201);
    TestApp::outlive(1).await;

    let counts = fragment(&app, Some(ADMIN), "GET", "/console/fragments/counts", None).await;
    assert!(
        counts.text.contains("data-stuck=\"120\""),
        "{}",
        counts.text
    );
    let json = app
        .send(
            "GET",
            "/v1/admin/keys?state=stuck&limit=1000",
            &[("authorization", ADMIN)],
            None,
        )
        .await;
    assert_eq!(
        json.body["keys"].as_array().map(Vec::len),
        Some(120),
        "{json:#?}"
    );

    let rows = |text: &str| -> Vec<String> {
        keys.iter()
            .filter(|h| text.contains(&format!("{}</a>", &h[..12])))
            .cloned()
            .collect()
    };
    let mut seen = Vec::new();
    let mut path = "/console/fragments/queue".to_owned();
    loop {
        let page = fragment(&app, Some(ADMIN), "GET", &path, None).await;
        assert_eq!(page.status, 200, "{}", page.text);
        let on_page = rows(&page.text);
        assert!(!page.text.contains(&hash_hex(&live)[..12]), "a live key");
        seen.extend(on_page.iter().cloned());
        let next = page
            .text
            .split("hx-get=\"")
            .skip(1)
            .filter_map(|s| s.split('"').next())
            .find(|url| url.contains("cursor="))
            .map(|url| url.replace("&amp;", "&"));
        match next {
            Some(next) => {
                assert_eq!(on_page.len(), 50, "a full page before the next");
                path = next;
            }
            None => {
                assert_eq!(on_page.len(), 20, "the last page");
                break;
            }
        }
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 120, "every key once across the pages");

    let globex = fragment(
        &app,
        Some(ADMIN),
        "GET",
        "/console/fragments/queue?tenant=globex&state=stuck",
        None,
    )
    .await;
    assert_eq!(rows(&globex.text).len(), 40, "{}", globex.text);
    assert!(!globex.text.contains(">acme<"), "{}", globex.text);
    let old = fragment(
        &app,
        Some(ADMIN),
        "GET",
        "/console/fragments/queue?older_than=60",
        None,
    )
    .await;
    assert_eq!(
        old.text.matches("No keys").count(),
        1,
        "said once: {}",
        old.text
    );
    let bad = fragment(
        &app,
        Some(ADMIN),
        "GET",
        "/console/fragments/queue?older_than=soon",
        None,
    )
    .await;
    assert_eq!(bad.status, 400, "{}", bad.text);
}

/// The fragments answer the console page alone: not a script without
/// htmx's header, not another site's page (on the JSON endpoints too); the
/// page is its own origin's only (no frames, no outside scripts), and its
/// assets come from the binary.
async fn the_console_answers_its_own_page_only(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
    let plain = app.send("GET", "/console/fragments/queue", &[], None).await;
    assert_eq!(plain.status, 400, "{}", plain.text);
    for (name, value) in [
        ("sec-fetch-site", "cross-site"),
        ("origin", "https://evil.example"),
    ] {
        let res = app
            .send(
                "GET",
                "/console/fragments/queue",
                &[("hx-request", "true"), (name, value)],
                None,
            )
            .await;
        assert_eq!(res.status, 403, "{name}: {}", res.text);
        let json = app
            .send(
                "POST",
                &format!("/v1/admin/keys/default/{}/resolve", "0".repeat(64)),
                &[(name, value), ("content-type", "text/plain")],
                Some(r#"{"action":"release","reason":"x="}"#),
            )
            .await;
        json.assert_problem(403, "forbidden");
    }
    // Same origin, as a browser says it: in.
    let same = app
        .send(
            "GET",
            "/console/fragments/queue",
            &[
                ("hx-request", "true"),
                ("origin", "http://localhost"),
                ("host", "localhost"),
            ],
            None,
        )
        .await;
    assert_eq!(same.status, 200, "{}", same.text);

    let page = app.send("GET", "/console", &[], None).await;
    // Every id once: a label, and the page's script, find the one element.
    for path in [
        "/console".to_owned(),
        format!("/console/keys/default/{}", "0".repeat(64)),
    ] {
        let text = app.send("GET", &path, &[], None).await.text;
        let mut ids: Vec<&str> = text
            .split(" id=\"")
            .skip(1)
            .filter_map(|s| s.split('"').next())
            .collect();
        let all = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), all, "{path}: an id twice in {text}");
    }
    let csp = page.header("content-security-policy");
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(!page.text.contains("http://") && !page.text.contains("https://"));
    for (file, kind) in [
        ("htmx.min.js", "text/javascript"),
        ("console.js", "text/javascript"),
        ("console.css", "text/css"),
        ("icon.svg", "image/svg+xml"),
    ] {
        let res = app
            .send("GET", &format!("/console/assets/{file}"), &[], None)
            .await;
        assert_eq!(res.status, 200, "{file}");
        assert!(res.header("content-type").starts_with(kind), "{file}");
    }
    // htmx as published: htmx.org 2.0.11's dist/htmx.min.js.
    let htmx = app
        .send("GET", "/console/assets/htmx.min.js", &[], None)
        .await;
    assert_eq!(
        hex::encode(Sha256::digest(htmx.text.as_bytes())),
        "d6fdc75f204e6bdefa99b69bf1e6d4ac69b8a364f77929f45c13476b4000f717"
    );
    let missing = app
        .send("GET", "/console/assets/nothing.js", &[], None)
        .await;
    missing.assert_problem(404, "not-found");
}

both_stores! {
    serial: [],
    concurrent: [
        every_fragment_keeps_the_admin_rule,
        settling_from_the_console_happens_once,
        the_queue_is_what_waits_paged_and_filtered,
        the_console_answers_its_own_page_only,
    ],
}

/// The proxy's admin listener serves the console under the same rule as
/// its admin endpoints: behind its admin tokens, or closed off loopback
/// without them; and the page links no `/docs`, which that listener lacks.
async fn the_proxys_admin_listener_serves_the_console_under_the_rule(b: Backend) {
    let upstream = common::upstream::Upstream::start().await;
    let http = reqwest::Client::new();
    let get = |base: String, auth: Option<&'static str>| {
        let mut req = http
            .get(format!("{base}/console/fragments/queue"))
            .header("hx-request", "true");
        if let Some(auth) = auth {
            req = req.header("authorization", auth);
        }
        async move {
            let res = req.send().await.unwrap();
            let status = res.status().as_u16();
            (status, res.text().await.unwrap())
        }
    };
    // Flags, then for each caller (its Authorization) the status and a
    // word of the answer.
    type Expect = (Option<&'static str>, u16, &'static str);
    let cases: [(&[&str], [Expect; 2]); 3] = [
        (
            &["--admin-tokens", ADMIN_TOKENS],
            [(None, 401, "unauthorized"), (Some(ADMIN), 200, "No keys")],
        ),
        (
            &["--admin-listen", "0.0.0.0:9090"],
            [
                (None, 403, "admin-disabled"),
                (Some(ADMIN), 403, "admin-disabled"),
            ],
        ),
        (&[], [(None, 200, "No keys"), (Some(ADMIN), 200, "No keys")]),
    ];
    for (flags, callers) in cases {
        let proxy =
            common::proxy::TestProxy::start(&b.url(), &upstream.url(), flags, Vec::new()).await;
        for (auth, status, text) in callers {
            let (got, body) = get(proxy.admin.clone(), auth).await;
            assert_eq!(got, status, "{flags:?} {auth:?}: {body}");
            assert!(body.contains(text), "{flags:?} {auth:?}: {body}");
        }
        let page = http
            .get(format!("{}/console", proxy.admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(page.contains("idemgate console"), "{flags:?}");
        assert!(!page.contains("href=\"/docs\""), "{flags:?}: {page}");
    }
}

mod proxy_door {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres() {
        the_proxys_admin_listener_serves_the_console_under_the_rule(Backend::postgres().await)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sqlite() {
        the_proxys_admin_listener_serves_the_console_under_the_rule(Backend::sqlite().await).await;
    }
}

/// A person who opens serve's address in a browser is sent to the console,
/// not a 404.
#[tokio::test]
async fn the_servers_root_leads_to_the_console() {
    let b = Backend::sqlite().await;
    let app = TestApp::new(&b.url(), &[]).await;
    let res = app.send("GET", "/", &[], None).await;
    assert_eq!(res.status, 303, "{}", res.text);
    assert_eq!(res.headers["location"], "/console");
    let page = app.send("GET", "/console", &[], None).await;
    assert_eq!(page.status, 200);
}
