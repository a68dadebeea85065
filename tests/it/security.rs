//! Tenants never see each other's records (the cases that tests/tenants.rs does
//! not already cover: completed and sealed records, and the proxy's tenants),
//! and no raw key, token or body ever leaves the process in a log line, a
//! metric or an error body — checked on the real binary.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use common::bin::{BIN, free_port};
use common::proxy::{TestProxy, replayed};
use common::upstream::Upstream;

const TOKENS: &str = "acme:acme-tok-5b1e9d,globex:globex-tok-c47a20";
const SEAL: &str = "q1Rk0m7oV8WmK3mC0cQwX2b9tq1yZ4kPp5JrS6uE3aA=";

/// Every operation of the reservation API with the other tenant's
/// reservation id, while that reservation is in flight, completed (its stored
/// response sealed or not) and released: always 404, never its data.
async fn other_tenants_ids_are_not_found_in_any_state(b: Backend) {
    for flags in [
        vec!["--tokens", TOKENS],
        vec!["--tokens", TOKENS, "--seal-key", SEAL],
    ] {
        let app = TestApp::new(&b.url(), &flags).await;
        let acme = "Bearer acme-tok-5b1e9d";
        let globex = "Bearer globex-tok-c47a20";
        let as_ = |auth: &'static str| [("authorization", auth)];
        // Three reservations of acme's: one left in flight, one completed,
        // one released.
        let mut ids = Vec::new();
        for end in ["in_flight", "completed", "released"] {
            let key = fresh_key();
            let res = app.reserve_as(acme, &key, "").await;
            assert_eq!(res.status, 201, "{res:#?}");
            let id = res.reservation_id();
            let action = match end {
                "completed" => Some(("commit", r#"{"status":201,"body":"acme-private-body"}"#)),
                "released" => Some(("release", "")),
                _ => None,
            };
            if let Some((action, body)) = action {
                let res = app.act_as(acme, &id, action, body).await;
                assert!(res.status.is_success(), "{res:#?}");
            }
            ids.push((end, key, id));
        }
        for (end, key, id) in &ids {
            let ops: [(&str, String, Option<&str>); 5] = [
                ("GET", format!("/v1/reservations/{id}"), None),
                (
                    "POST",
                    format!("/v1/reservations/{id}/commit"),
                    Some(r#"{"status":200,"body":"globex-body"}"#),
                ),
                ("POST", format!("/v1/reservations/{id}/release"), Some("")),
                ("POST", format!("/v1/reservations/{id}/extend"), Some("")),
                (
                    "POST",
                    format!("/v1/reservations/{id}/checkpoint"),
                    Some(r#"{"recovery_point":"stolen"}"#),
                ),
            ];
            for (method, path, body) in ops {
                let res = app.send(method, &path, &as_(globex), body).await;
                res.assert_problem(404, "not-found");
                assert!(!res.text.contains("acme"), "{end} {path}: {}", res.text);
            }
            // The same key under globex: an independent, new record.
            let res = app.reserve_as(globex, key, "").await;
            assert_eq!(res.status, 201, "{end}: {res:#?}");
            assert_eq!(res.body["attempt"], 1);
            assert!(!res.text.contains("acme"), "{}", res.text);
        }
        // Acme's records are untouched by all of that.
        let (_, key, id) = &ids[1];
        let res = app.reserve_as(acme, key, "").await;
        assert_eq!(
            res.body["response"]["body"], "acme-private-body",
            "{res:#?}"
        );
        let got = app
            .send("GET", &format!("/v1/reservations/{id}"), &as_(acme), None)
            .await;
        assert_eq!(got.status, 200);
        assert!(got.body["recovery"].is_null(), "{got:#?}");
        let (_, _, live) = &ids[0];
        let got = app
            .send("GET", &format!("/v1/reservations/{live}"), &as_(acme), None)
            .await;
        assert_eq!(got.body["state"], "in_flight", "{got:#?}");
        assert!(
            got.body["recovery"].is_null(),
            "globex's checkpoint landed: {got:#?}"
        );
    }
}

/// The same key under two proxy tenants (two Authorization values): two
/// records, two executions, each replaying its own response.
async fn proxy_tenants_are_independent(b: Backend) {
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&b.url(), &upstream.url(), &[], Vec::new()).await;
    let key = fresh_key();
    let send = |auth: &'static str, body: &'static str| {
        let key = key.clone();
        let proxy = &proxy;
        async move {
            proxy
                .send(
                    "POST",
                    "/ok",
                    &[
                        ("idempotency-key", key.as_str()),
                        ("authorization", auth),
                        ("content-type", "application/json"),
                    ],
                    Some(body),
                )
                .await
        }
    };
    let a = send("Bearer tenant-one-tok", r#"{"who":"one"}"#).await;
    let b2 = send("Bearer tenant-two-tok", r#"{"who":"two"}"#).await;
    assert_eq!(a.status, 201, "{a:#?}");
    assert_eq!(
        b2.status, 201,
        "another payload is no mismatch elsewhere: {b2:#?}"
    );
    assert!(!replayed(&b2));
    assert_eq!(upstream.started(&key), 2);
    let a_again = send("Bearer tenant-one-tok", r#"{"who":"one"}"#).await;
    let b_again = send("Bearer tenant-two-tok", r#"{"who":"two"}"#).await;
    assert!(replayed(&a_again) && replayed(&b_again));
    assert_eq!(a_again.text, a.text);
    assert_eq!(b_again.text, b2.text);
    assert!(a_again.text.contains("one") && !a_again.text.contains("\"two\""));
    assert_eq!(upstream.started(&key), 2);
}

both_stores!(
    serial: [
        other_tenants_ids_are_not_found_in_any_state,
        proxy_tenants_are_independent,
    ],
    concurrent: [],
);

/// A real `idemgate` process whose stdout and stderr go to files.
struct Proc {
    child: std::process::Child,
    out: tempfile::NamedTempFile,
    err: tempfile::NamedTempFile,
}

impl Proc {
    async fn start(args: &[&str], env: &[(&str, &str)], ready: &str) -> Proc {
        let out = tempfile::NamedTempFile::new().unwrap();
        let err = tempfile::NamedTempFile::new().unwrap();
        let child = Command::new(BIN)
            .args(args)
            .env_remove("IDEMGATE_TOKENS")
            .envs(env.iter().copied())
            .env("RUST_LOG", "idemgate=trace,tower_http=trace,info")
            .stdin(Stdio::null())
            .stdout(out.reopen().unwrap())
            .stderr(err.reopen().unwrap())
            .spawn()
            .unwrap();
        let http = common::http();
        let started = Instant::now();
        while !http
            .get(ready)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            assert!(started.elapsed() < Duration::from_secs(20), "not ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Proc { child, out, err }
    }

    /// Stops it and returns everything it wrote.
    fn finish(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut all = std::fs::read_to_string(self.out.path()).unwrap();
        all.push_str(&std::fs::read_to_string(self.err.path()).unwrap());
        all
    }
}

/// Everything a client saw (bodies of every answer, and `/metrics`).
#[derive(Default)]
struct Seen(String, String);

impl Seen {
    async fn send(
        &mut self,
        method: reqwest::Method,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (u16, String) {
        let mut req = common::http().request(method, url);
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        let res = req.body(body.to_owned()).send().await.unwrap();
        let status = res.status().as_u16();
        let mut text = String::new();
        for (n, v) in res.headers() {
            text.push_str(&format!("{n}: {}\n", v.to_str().unwrap_or_default()));
        }
        let problem = text.contains("application/problem+json");
        text.push_str(&res.text().await.unwrap());
        self.0.push_str(&text);
        if problem {
            self.1.push_str(&text);
        }
        (status, text)
    }
}

#[track_caller]
fn assert_no_secret(what: &str, text: &str, secrets: &[&str]) {
    for (i, s) in secrets.iter().enumerate() {
        assert!(
            !text.contains(s),
            "secret #{i} ({} bytes) appears in {what}",
            s.len()
        );
    }
}

/// `serve` then `proxy`, human and JSON logs: every outcome, then no raw key,
/// token, seal key or body in the output, `/metrics` or an error body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_leaves_the_process() {
    use reqwest::Method;
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    for format in ["human", "json"] {
        let db = format!(
            "sqlite://{}",
            dir.path().join(format!("{format}.db")).display()
        );
        let key = |name: &str| format!("rawkey-{name}-{format}-{}", uuid::Uuid::new_v4().simple());
        let body = |name: &str| {
            format!(
                r#"{{"secret":"rawbody-{name}-{}"}}"#,
                uuid::Uuid::new_v4().simple()
            )
        };
        let (k_new, k_conflict, k_take) = (key("new"), key("conflict"), key("takeover"));
        let (b1, b2) = (body("one"), body("two"));
        let stored = format!("rawstored-{}", uuid::Uuid::new_v4().simple());
        let mut secrets: Vec<String> = vec![
            "acme-tok-5b1e9d".into(),
            "globex-tok-c47a20".into(),
            "wrong-token-3f9e1c".into(),
            SEAL.into(),
            k_new.clone(),
            k_conflict.clone(),
            k_take.clone(),
            b1.clone(),
            b2.clone(),
            stored.clone(),
        ];

        // --- serve ---
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let env = [
            ("DATABASE_URL", db.as_str()),
            ("IDEMGATE_LOG_FORMAT", format),
            ("IDEMGATE_TOKENS", TOKENS),
            ("IDEMGATE_SEAL_KEY", SEAL),
        ];
        let listen = format!("127.0.0.1:{port}");
        let proc = Proc::start(
            &["serve", "--listen", &listen],
            &env,
            &format!("{base}/readyz"),
        )
        .await;
        let mut seen = Seen::default();
        let auth = ("authorization", "Bearer acme-tok-5b1e9d");
        let reserve = format!("{base}/v1/reservations");
        let reserve_with = async |seen: &mut Seen, k: &str, body: &str, a: (&str, &str)| {
            seen.send(Method::POST, &reserve, &[("idempotency-key", k), a], body)
                .await
        };
        let req1 = r#"{"fingerprint":"fp-one"}"#;
        // created
        let (s, text) = reserve_with(&mut seen, &k_new, "", auth).await;
        assert_eq!(s, 201, "{text}");
        let id = serde_json::from_str::<serde_json::Value>(text.rsplit('\n').next().unwrap())
            .unwrap()["reservation_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let commit =
            format!(r#"{{"status":201,"headers":[["x-stored","{stored}"]],"body":"{stored}"}}"#);
        let (s, _) = seen
            .send(
                Method::POST,
                &format!("{reserve}/{id}/commit"),
                &[auth],
                &commit,
            )
            .await;
        assert_eq!(s, 200);
        // replayed
        assert_eq!(reserve_with(&mut seen, &k_new, "", auth).await.0, 200);
        // conflict (in flight), then mismatch
        assert_eq!(
            reserve_with(&mut seen, &k_conflict, req1, auth).await.0,
            201
        );
        assert_eq!(
            reserve_with(&mut seen, &k_conflict, req1, auth).await.0,
            409
        );
        let req2 = r#"{"fingerprint":"fp-two"}"#;
        assert_eq!(
            reserve_with(&mut seen, &k_conflict, req2, auth).await.0,
            422
        );
        // invalid request bodies (with a body secret in them) and a bad key
        let not_json = format!("not json {b1}");
        assert_eq!(
            reserve_with(&mut seen, &k_new, &not_json, auth).await.0,
            400
        );
        let (s, _) = seen.send(Method::POST, &reserve, &[auth], "").await;
        assert_eq!(s, 400);
        // unauthorized
        let wrong = ("authorization", "Bearer wrong-token-3f9e1c");
        let (s, text) = seen
            .send(
                Method::POST,
                &reserve,
                &[("idempotency-key", &k_new), wrong],
                "",
            )
            .await;
        assert_eq!(s, 401, "{text}");
        // takeover
        let short = r#"{"lease_seconds":1}"#;
        assert_eq!(reserve_with(&mut seen, &k_take, short, auth).await.0, 201);
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        let (s, text) = reserve_with(&mut seen, &k_take, short, auth).await;
        assert_eq!(s, 201, "{text}");
        assert!(text.contains("\"attempt\":2"), "{text}");
        let (s, metrics) = seen
            .send(Method::GET, &format!("{base}/metrics"), &[], "")
            .await;
        assert_eq!(s, 200);
        assert!(metrics.contains("outcome=\"takeover\""), "{metrics}");
        let logs = proc.finish();
        assert!(logs.contains("listening"), "logs were captured: {logs}");
        let refs: Vec<&str> = secrets.iter().map(String::as_str).collect();
        // `stored` is echoed in the replays the client asked for: only the
        // other answers must not show it.
        assert_no_secret("serve logs", &logs, &refs);
        assert_no_secret("/metrics", &metrics, &refs);
        let client_side: Vec<&str> = refs.iter().copied().filter(|s| *s != stored).collect();
        assert_no_secret("serve answers", &seen.0, &client_side);

        // --- proxy ---
        let port = free_port();
        let admin_port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let admin = format!("http://127.0.0.1:{admin_port}");
        let listen = format!("127.0.0.1:{port}");
        let admin_listen = format!("127.0.0.1:{admin_port}");
        let up = upstream.url();
        let env = [
            ("DATABASE_URL", db.as_str()),
            ("IDEMGATE_LOG_FORMAT", format),
            ("IDEMGATE_SEAL_KEY", SEAL),
        ];
        let proc = Proc::start(
            &[
                "proxy",
                "--listen",
                &listen,
                "--admin-listen",
                &admin_listen,
                "--upstream",
                &up,
            ],
            &env,
            &format!("{admin}/readyz"),
        )
        .await;
        let mut seen = Seen::default();
        let tenant = ("authorization", "Bearer proxy-tenant-tok-8d2f");
        secrets.push("proxy-tenant-tok-8d2f".into());
        let (pk, pk_slow) = (key("proxy"), key("slow"));
        secrets.push(pk.clone());
        secrets.push(pk_slow.clone());
        let json = ("content-type", "application/json");
        let post = async |seen: &mut Seen, path: &str, k: &str, body: &str| {
            seen.send(
                Method::POST,
                &format!("{base}{path}"),
                &[("idempotency-key", k), tenant, json],
                body,
            )
            .await
            .0
        };
        assert_eq!(post(&mut seen, "/ok", &pk, &b1).await, 201); // created
        assert_eq!(post(&mut seen, "/ok", &pk, &b1).await, 201); // replayed
        assert_eq!(post(&mut seen, "/ok", &pk, &b2).await, 422); // mismatch
        let slow = tokio::spawn({
            let (base, pk_slow, b1) = (base.clone(), pk_slow.clone(), b1.clone());
            async move {
                common::http()
                    .post(format!("{base}/slow/800"))
                    .header("idempotency-key", pk_slow)
                    .header("authorization", "Bearer proxy-tenant-tok-8d2f")
                    .header("content-type", "application/json")
                    .body(b1)
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let conflict = seen
            .send(
                Method::POST,
                &format!("{base}/slow/800"),
                &[
                    ("idempotency-key", &pk_slow),
                    tenant,
                    json,
                    ("prefer", "wait=0"),
                ],
                &b1,
            )
            .await
            .0;
        assert_eq!(conflict, 409); // conflict
        // Held for the first answer, by default: the replay.
        assert_eq!(post(&mut seen, "/slow/800", &pk_slow, &b1).await, 201);
        assert!((200..300).contains(&slow.await.unwrap()));
        let bad = format!("\"{pk}\" , \"{pk}\"");
        let s = seen
            .send(
                Method::POST,
                &format!("{base}/ok"),
                &[("idempotency-key", &bad), json],
                &b1,
            )
            .await
            .0;
        assert_eq!(s, 400); // invalid
        let (s, metrics) = seen
            .send(Method::GET, &format!("{admin}/metrics"), &[], "")
            .await;
        assert_eq!(s, 200);
        let logs = proc.finish();
        let refs: Vec<&str> = secrets.iter().map(String::as_str).collect();
        assert_no_secret("proxy logs", &logs, &refs);
        assert_no_secret("proxy /metrics", &metrics, &refs);
        // Error answers must not echo a key, token or body.
        assert!(seen.1.contains("key-reused"), "{}", seen.1);
        assert_no_secret("proxy problem answers", &seen.1, &refs);
    }
}
