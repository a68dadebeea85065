//! Who may use the operators' endpoints (docs/operations.md, “The command line
//! and the endpoints”). Every admin route, with every kind of caller (none, a
//! bad token, a tenant's token, an admin token, a token that is not Bearer), in
//! every configuration of `serve` and of the proxy's admin listener; a refused
//! caller learns nothing of the keys and settles nothing. Then the real
//! binaries: the refusal names `IDEMGATE_ADMIN_TOKENS`, and the start-up log
//! says how the endpoints answer.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::app::{TestApp, TestResponse, fresh_key};
use common::backend::Backend;
use common::bin::{drain_stderr, free_port, idemgate_at};
use common::proxy::TestProxy;
use common::upstream::Upstream;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const TENANT_TOKENS: &str = "acme:acme-tok-91f3,globex:globex-tok-4c2d";
const ADMIN_TOKENS: &str = "alice:admin-tok-7e0b";

/// Who asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Caller {
    Nobody,
    Bad,
    NotBearer,
    Tenant,
    Admin,
}

const CALLERS: [Caller; 5] = [
    Caller::Nobody,
    Caller::Bad,
    Caller::NotBearer,
    Caller::Tenant,
    Caller::Admin,
];

impl Caller {
    fn authorization(self) -> Option<&'static str> {
        match self {
            Caller::Nobody => None,
            Caller::Bad => Some("Bearer not-a-token-of-anyone"),
            Caller::NotBearer => Some("Basic YWxpY2U6YWRtaW4tdG9rLTdlMGI="),
            Caller::Tenant => Some("Bearer globex-tok-4c2d"),
            Caller::Admin => Some("Bearer admin-tok-7e0b"),
        }
    }
}

/// What a configuration must answer a caller: through the gate, or this
/// status and slug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    In,
    Refused(u16, &'static str),
}

/// One configuration: its flags and the rule it must keep.
struct Config {
    name: &'static str,
    flags: Vec<&'static str>,
    gate: fn(Caller) -> Gate,
}

fn serve_configs() -> Vec<Config> {
    vec![
        Config {
            name: "no tokens at all, loopback: open (development)",
            flags: vec![],
            gate: |_| Gate::In,
        },
        Config {
            name: "tenant tokens, no admin tokens, loopback: disabled",
            flags: vec!["--tokens", TENANT_TOKENS],
            gate: |_| Gate::Refused(403, "admin-disabled"),
        },
        Config {
            name: "tenant tokens, no admin tokens, not loopback: disabled",
            flags: vec!["--tokens", TENANT_TOKENS, "--listen", "0.0.0.0:8080"],
            gate: |_| Gate::Refused(403, "admin-disabled"),
        },
        Config {
            name: "tenant and admin tokens, loopback",
            flags: vec!["--tokens", TENANT_TOKENS, "--admin-tokens", ADMIN_TOKENS],
            gate: with_admin_tokens,
        },
        Config {
            name: "tenant and admin tokens, not loopback",
            flags: vec![
                "--tokens",
                TENANT_TOKENS,
                "--admin-tokens",
                ADMIN_TOKENS,
                "--listen",
                "0.0.0.0:8080",
            ],
            gate: with_admin_tokens,
        },
        Config {
            name: "admin tokens only, loopback",
            flags: vec!["--admin-tokens", ADMIN_TOKENS],
            // No tenant has a token here: the "tenant's" is just not an
            // admin token.
            gate: |caller| match caller {
                Caller::Admin => Gate::In,
                _ => Gate::Refused(401, "unauthorized"),
            },
        },
    ]
}

fn with_admin_tokens(caller: Caller) -> Gate {
    match caller {
        Caller::Admin => Gate::In,
        Caller::Tenant => Gate::Refused(403, "forbidden"),
        _ => Gate::Refused(401, "unauthorized"),
    }
}

fn hash_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Every admin route, for a stuck key `hash` of `tenant`: what each answers
/// a caller that is let in (the resolve sent is one that cannot settle
/// anything: a bad action).
fn routes(tenant: &str, hash: &str) -> Vec<(&'static str, String, Option<Value>, u16)> {
    vec![
        ("GET", "/v1/admin/keys".to_owned(), None, 200),
        ("GET", "/v1/admin/keys?state=unknown".to_owned(), None, 200),
        ("GET", format!("/v1/admin/keys/{tenant}/{hash}"), None, 200),
        // A prefix of 8 digits or more names the key; a shorter one is refused.
        (
            "GET",
            format!("/v1/admin/keys/{tenant}/{}", &hash[..12]),
            None,
            200,
        ),
        (
            "GET",
            format!("/v1/admin/keys/{tenant}/{}", &hash[..6]),
            None,
            400,
        ),
        (
            "POST",
            format!("/v1/admin/keys/{tenant}/{hash}/resolve"),
            Some(json!({"action": "nothing-of-the-kind", "reason": "probe"})),
            400,
        ),
        (
            "POST",
            format!("/v1/admin/keys/{tenant}/{hash}/resolve"),
            Some(json!({"action": "release"})),
            400,
        ),
    ]
}

/// The resolve that settles the key, for the callers refused: it must not.
fn settle(tenant: &str, hash: &str) -> (&'static str, String, Option<Value>) {
    (
        "POST",
        format!("/v1/admin/keys/{tenant}/{hash}/resolve"),
        Some(json!({"action": "release", "reason": "nothing happened"})),
    )
}

#[track_caller]
fn check(
    config: &str,
    caller: Caller,
    route: &str,
    res: &TestResponse,
    want: Gate,
    ok: u16,
    hash: &str,
) {
    let at = format!("{config}: {caller:?} {route}");
    match want {
        Gate::In => assert_eq!(res.status.as_u16(), ok, "{at}: {res:#?}"),
        Gate::Refused(status, slug) => {
            assert_eq!(res.status.as_u16(), status, "{at}: {res:#?}");
            let ty = res.body["type"].as_str().unwrap_or_default();
            assert!(ty.ends_with(&format!("/{slug}")), "{at}: {ty}");
            assert!(
                !res.text.contains(&hash[..12]),
                "{at} shows the key: {}",
                res.text
            );
            if slug == "admin-disabled" {
                assert!(
                    res.body["detail"]
                        .as_str()
                        .unwrap_or_default()
                        .contains("IDEMGATE_ADMIN_TOKENS"),
                    "{at}: {res:#?}"
                );
            }
            if status == 401 {
                assert!(res.headers.contains_key("www-authenticate"), "{at}");
            }
        }
    }
}

async fn send(
    app: &TestApp,
    caller: Caller,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> TestResponse {
    let headers: Vec<(&str, &str)> = caller
        .authorization()
        .map(|a| ("authorization", a))
        .into_iter()
        .collect();
    let body = body.map(Value::to_string);
    app.send(method, path, &headers, body.as_deref()).await
}

/// `serve`: every configuration × caller × route. In each, a key of globex's
/// is held unknown; the callers refused cannot settle it, the ones let in
/// see it, and an operator settles it at the end.
async fn every_admin_route_keeps_the_rule_on_serve(b: Backend) {
    for config in serve_configs() {
        let app = TestApp::new(&b.url(), &config.flags).await;
        let tenanted = config.flags.contains(&"--tokens");
        let (tenant, auth) = if tenanted {
            ("globex", Some("Bearer globex-tok-4c2d"))
        } else {
            ("default", None)
        };
        let key = fresh_key();
        let body =
            json!({"fingerprint": "fp", "lease_seconds": 1, "on_lease_expiry": "hold"}).to_string();
        let held = match auth {
            Some(auth) => app.reserve_as(auth, &key, &body).await,
            None => app.reserve(&key, &body).await,
        };
        assert_eq!(held.status, 201, "{}: {held:#?}", config.name);
        TestApp::outlive(1).await;
        let hash = hash_hex(&key);

        for caller in CALLERS {
            let want = (config.gate)(caller);
            for (method, path, body, ok) in routes(tenant, &hash) {
                let res = send(&app, caller, method, &path, body.as_ref()).await;
                check(
                    config.name,
                    caller,
                    &format!("{method} {path}"),
                    &res,
                    want,
                    ok,
                    &hash,
                );
                if want == Gate::In && path == "/v1/admin/keys?state=unknown" {
                    assert!(
                        res.text.contains(&hash),
                        "{}: {caller:?} lists it",
                        config.name
                    );
                }
            }
            if want != Gate::In {
                let (method, path, body) = settle(tenant, &hash);
                let res = send(&app, caller, method, &path, body.as_ref()).await;
                check(config.name, caller, &path, &res, want, 0, &hash);
            }
        }
        // Nobody refused settled it: still unknown, to its own tenant too.
        let dup = match auth {
            Some(auth) => app.reserve_as(auth, &key, &body).await,
            None => app.reserve(&key, &body).await,
        };
        dup.assert_problem(409, "outcome-unknown");
        // The one let in settles it, under the name of its token.
        let operator = CALLERS.into_iter().find(|c| (config.gate)(*c) == Gate::In);
        if let Some(operator) = operator {
            let (method, path, body) = settle(tenant, &hash);
            let res = send(&app, operator, method, &path, body.as_ref()).await;
            assert_eq!(res.status, 200, "{}: {res:#?}", config.name);
            let by = if operator == Caller::Admin {
                "alice"
            } else {
                "loopback"
            };
            assert_eq!(res.body["resolution"]["by"], by, "{}", config.name);
        }
    }
}

/// The proxy's admin listener: open on loopback without admin tokens (the
/// proxy has no tenant tokens: its callers' credentials are the origin's),
/// disabled on another address without them, behind them where they are set.
async fn every_admin_route_keeps_the_rule_on_the_proxys_admin_listener(b: Backend) {
    let upstream = Upstream::start().await;
    let only_admin: fn(Caller) -> Gate = |c| match c {
        Caller::Admin => Gate::In,
        _ => Gate::Refused(401, "unauthorized"),
    };
    let configs = [
        Config {
            name: "proxy, loopback admin listener, no admin tokens: open",
            flags: vec![],
            gate: |_| Gate::In,
        },
        Config {
            name: "proxy, admin listener on 0.0.0.0, no admin tokens: disabled",
            flags: vec!["--admin-listen", "0.0.0.0:9090"],
            gate: |_| Gate::Refused(403, "admin-disabled"),
        },
        Config {
            name: "proxy, admin tokens",
            flags: vec!["--admin-tokens", ADMIN_TOKENS],
            gate: only_admin,
        },
        Config {
            name: "proxy, admin tokens, admin listener on 0.0.0.0",
            flags: vec![
                "--admin-tokens",
                ADMIN_TOKENS,
                "--admin-listen",
                "0.0.0.0:9090",
            ],
            gate: only_admin,
        },
    ];
    let http = reqwest::Client::new();
    for Config { name, flags, gate } in configs {
        let proxy = TestProxy::start(&b.url(), &upstream.url(), &flags, Vec::new()).await;
        // No key is stuck here: a route let in answers its own 200 / 404 /
        // 400, a refused one the refusal.
        let hash = hash_hex(&fresh_key());
        let tenant = "anonymous";
        let mut all: Vec<(&str, String, Option<Value>, u16)> = vec![
            ("GET", "/v1/admin/keys".to_owned(), None, 200),
            ("GET", format!("/v1/admin/keys/{tenant}/{hash}"), None, 404),
            (
                "POST",
                format!("/v1/admin/keys/{tenant}/{hash}/resolve"),
                Some(json!({"action": "release", "reason": "nothing happened"})),
                404,
            ),
        ];
        all.push((
            "POST",
            format!("/v1/admin/keys/{tenant}/{hash}/resolve"),
            Some(json!({"action": "bogus"})),
            400,
        ));
        for caller in CALLERS {
            for (method, path, body, ok) in &all {
                let mut req =
                    http.request(method.parse().unwrap(), format!("{}{path}", proxy.admin));
                if let Some(auth) = caller.authorization() {
                    req = req.header("authorization", auth);
                }
                if let Some(body) = body {
                    req = req
                        .header("content-type", "application/json")
                        .body(body.to_string());
                }
                let res = req.send().await.unwrap();
                let status = res.status();
                let headers = res.headers().clone();
                let text = res.text().await.unwrap();
                let res = TestResponse {
                    status,
                    headers,
                    body: serde_json::from_str(&text).unwrap_or(Value::Null),
                    text,
                };
                check(
                    name,
                    caller,
                    &format!("{method} {path}"),
                    &res,
                    gate(caller),
                    *ok,
                    &hash,
                );
            }
        }
        // Health, readiness and metrics answer whatever the rule.
        for path in ["/healthz", "/readyz", "/metrics", "/v1/policy"] {
            let res = http
                .get(format!("{}{path}", proxy.admin))
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), 200, "{name}: {path}");
        }
    }
}

both_stores! {
    serial: [],
    concurrent: [
        every_admin_route_keeps_the_rule_on_serve,
        every_admin_route_keeps_the_rule_on_the_proxys_admin_listener,
    ],
}

/// Reads `child`'s stderr until `needle` shows up.
async fn wait_for_line(log: &std::sync::Arc<std::sync::Mutex<String>>, needle: &str) -> String {
    let started = Instant::now();
    loop {
        let text = log.lock().unwrap().clone();
        if let Some(line) = text.lines().find(|l| l.contains(needle)) {
            return line.to_owned();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no line with {needle:?} in:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The real binaries: `serve` with tenant tokens and no admin tokens on
/// loopback refuses a tenant and nobody alike with `403 admin-disabled`, and
/// says so at start; `serve` with no tokens says at WARN that they are open;
/// the proxy with its admin listener on 0.0.0.0 says they are disabled and
/// refuses them there, its health endpoints open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binaries_refuse_and_say_so_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();

    for (flags, level, expect) in [
        (
            vec!["--tokens", TENANT_TOKENS],
            "WARN",
            Some((403, "admin-disabled")),
        ),
        (vec![], "WARN", None),
        (
            vec!["--tokens", TENANT_TOKENS, "--admin-tokens", ADMIN_TOKENS],
            "INFO",
            Some((403, "forbidden")),
        ),
    ] {
        let port = free_port();
        let url = format!("sqlite://{}/serve-{port}.db", dir.path().display());
        let mut child = idemgate_at(&url)
            .env_remove("IDEMGATE_TOKENS")
            .env_remove("IDEMGATE_ADMIN_TOKENS")
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env("IDEMGATE_LOG_FORMAT", "human")
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(&flags)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = drain_stderr(&mut child);
        let line = wait_for_line(&log, "/v1/admin/keys").await;
        assert!(line.contains(level), "{flags:?}: {line}");
        if flags.is_empty() {
            assert!(line.contains("open"), "{line}");
        }
        wait_for_line(&log, "listening").await;
        let res = http
            .get(format!("http://127.0.0.1:{port}/v1/admin/keys"))
            .header("authorization", "Bearer globex-tok-4c2d")
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let body: Value = res.json().await.unwrap_or(Value::Null);
        match expect {
            Some((want, slug)) => {
                assert_eq!(status, want, "{flags:?}: {body}");
                assert!(body["type"].as_str().unwrap().ends_with(slug), "{body}");
            }
            None => assert_eq!(status, 200, "{body}"),
        }
        // The binary serves the operators' console beside the endpoints.
        let console = http
            .get(format!("http://127.0.0.1:{port}/console"))
            .send()
            .await
            .unwrap();
        assert_eq!(console.status(), 200, "{flags:?}: /console");
        let _ = child.kill();
        let _ = child.wait();
    }

    let upstream = Upstream::start().await;
    let (port, admin) = (free_port(), free_port());
    let url = format!("sqlite://{}/proxy.db", dir.path().display());
    let mut child = idemgate_at(&url)
        .env_remove("IDEMGATE_UPSTREAM")
        .env_remove("IDEMGATE_ADMIN_LISTEN")
        .env_remove("IDEMGATE_ADMIN_TOKENS")
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .env("IDEMGATE_LOG_FORMAT", "human")
        .args(["proxy", "--upstream", &upstream.url()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("0.0.0.0:{admin}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = drain_stderr(&mut child);
    let line = wait_for_line(&log, "/v1/admin/keys").await;
    assert!(line.contains("WARN") && line.contains("disabled"), "{line}");
    wait_for_line(&log, "listening").await;
    let res = http
        .get(format!("http://127.0.0.1:{admin}/v1/admin/keys"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 403);
    let body: Value = res.json().await.unwrap();
    assert!(
        body["type"].as_str().unwrap().ends_with("/admin-disabled"),
        "{body}"
    );
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("IDEMGATE_ADMIN_TOKENS")
    );
    let res = http
        .get(format!("http://127.0.0.1:{admin}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let _ = child.kill();
    let _ = child.wait();
}
