//! `https://` upstreams: the proxy speaks TLS to an origin whose certificate
//! a CA made in the test signed, checks that certificate (against the CA
//! file it is given, or the system's roots), and treats a certificate it
//! cannot trust as an upstream it cannot reach: `502`, nothing sent, the key
//! released.

use crate::common;

use std::time::{Duration, Instant};

use common::app::fresh_key;
use common::backend::Backend;
use common::bin::{idemgate_at, refused};
use common::proxy::{TestProxy, replayed};
use common::tls::{TestCa, TlsOrigin};

/// A proxy over the SQLite file in `dir` in front of `upstream`.
async fn proxy(dir: &tempfile::TempDir, upstream: &str, flags: &[&str]) -> TestProxy {
    TestProxy::start(&Backend::sqlite_url(dir), upstream, flags, Vec::new()).await
}

#[tokio::test]
async fn an_https_upstream_is_guarded_as_a_plain_one() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("idemgate test CA");
    let ca_file = ca.write(&dir, "ca.pem");
    let origin = TlsOrigin::start(&ca, &["localhost", "127.0.0.1"]).await;
    for host in ["127.0.0.1", "localhost"] {
        let upstream = format!("https://{host}:{}", origin.port);
        let p = proxy(
            &dir,
            &upstream,
            &["--upstream-ca-file", ca_file.to_str().unwrap()],
        )
        .await;
        let key = fresh_key();
        let first = p.post("/ok", &key, r#"{"amount":1}"#).await;
        assert_eq!(first.status, 201, "{host}: {first:#?}");
        assert_eq!(first.body["path"], "/ok");
        let again = p.post("/ok", &key, r#"{"amount":1}"#).await;
        assert_eq!(again.status, 201);
        assert!(replayed(&again), "{again:#?}");
        assert_eq!(origin.counts.started(&key), 1, "executed once over TLS");
        // Unguarded requests go the same way.
        let read = p.send("GET", "/echo/x", &[], None).await;
        assert_eq!(read.status, 200, "{read:#?}");
    }
    assert!(origin.handshakes() >= 2);
}

/// Every way of not trusting the origin: the system's roots (which never
/// signed the test's CA), another CA's file, and a certificate for another
/// name. Each is a `502 upstream-unavailable` with nothing sent, and the
/// key is free for the retry that a proxy with the right CA then executes.
#[tokio::test]
async fn an_untrusted_certificate_is_refused_and_the_key_released() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("idemgate test CA");
    let ca_file = ca.write(&dir, "ca.pem");
    let other_file = TestCa::new("someone else's CA").write(&dir, "other.pem");
    let origin = TlsOrigin::start(&ca, &["127.0.0.1"]).await;
    let upstream = format!("https://127.0.0.1:{}", origin.port);
    let misnamed = TlsOrigin::start(&ca, &["origin.example"]).await;
    let misnamed_upstream = format!("https://127.0.0.1:{}", misnamed.port);

    let system = proxy(&dir, &upstream, &[]).await;
    let wrong_ca = proxy(
        &dir,
        &upstream,
        &["--upstream-ca-file", other_file.to_str().unwrap()],
    )
    .await;
    let wrong_name = proxy(
        &dir,
        &misnamed_upstream,
        &["--upstream-ca-file", ca_file.to_str().unwrap()],
    )
    .await;
    let trusting = proxy(
        &dir,
        &upstream,
        &["--upstream-ca-file", ca_file.to_str().unwrap()],
    )
    .await;
    for (why, p) in [
        ("system roots", &system),
        ("another CA", &wrong_ca),
        ("another name", &wrong_name),
    ] {
        let key = fresh_key();
        let refused = p.post("/ok", &key, "{}").await;
        refused.assert_problem(502, "upstream-unavailable");
        assert!(
            refused.body["detail"]
                .as_str()
                .is_some_and(|d| d.contains("not sent")),
            "{why}: {refused:#?}"
        );
        // The key was released: the same request through a proxy that
        // trusts the origin runs, once.
        let retried = trusting.post("/ok", &key, "{}").await;
        assert_eq!(retried.status, 201, "{why}: {retried:#?}");
        assert!(!replayed(&retried));
        assert_eq!(origin.counts.started(&key), 1, "{why}");
    }
    assert_eq!(
        misnamed.counts.total(),
        0,
        "nothing reached the misnamed origin"
    );
    assert_eq!(misnamed.handshakes(), 0);
}

/// An origin that accepts the connection but never answers the TLS
/// handshake is an upstream that cannot be reached within the connect
/// timeout, not a request that hangs until the upstream timeout.
#[tokio::test]
async fn a_handshake_that_never_ends_is_bounded_by_the_connect_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let p = proxy(
        &dir,
        &format!("https://127.0.0.1:{port}"),
        &[
            "--upstream-connect-timeout",
            "1",
            "--upstream-timeout",
            "20",
        ],
    )
    .await;
    let key = fresh_key();
    let started = Instant::now();
    let res = p.post("/ok", &key, "{}").await;
    res.assert_problem(502, "upstream-unavailable");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "answered after {:?}",
        started.elapsed()
    );
    silent.abort();
}

/// A plain-HTTP origin named with `https://`: its answer to a TLS hello is
/// no handshake, so nothing is sent.
#[tokio::test]
async fn tls_to_a_plain_http_origin_sends_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let origin = common::upstream::Upstream::start().await;
    let p = proxy(&dir, &format!("https://{}", origin.addr), &[]).await;
    let key = fresh_key();
    let res = p.post("/ok", &key, "{}").await;
    res.assert_problem(502, "upstream-unavailable");
    assert_eq!(origin.total(), 0, "no request reached the origin");
}

/// The binary refuses a CA file it cannot use, or one set for a plain-HTTP
/// upstream, before it listens, naming the setting and the file.
#[tokio::test]
async fn a_ca_file_that_cannot_be_used_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let url = Backend::sqlite_url(&dir);
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "hello\n").unwrap();
    let missing = dir.path().join("missing.pem");
    let ca_file = TestCa::new("idemgate test CA").write(&dir, "ca.pem");
    let cases = [
        ("https://127.0.0.1:9", &garbage, "holds no certificate"),
        ("https://127.0.0.1:9", &missing, "cannot read"),
        ("http://127.0.0.1:9", &ca_file, "not https://"),
    ];
    let proxy_to = |upstream: &str| {
        let mut cmd = idemgate_at(&url);
        cmd.args([
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--upstream",
            upstream,
        ]);
        cmd
    };
    for (upstream, file, says) in cases {
        let mut cmd = proxy_to(upstream);
        cmd.args(["--upstream-ca-file", file.to_str().unwrap()]);
        let said = refused(cmd).await;
        assert!(said.contains("--upstream-ca-file"), "{said}");
        assert!(said.contains(says), "{said}");
        assert!(
            said.contains(file.file_name().unwrap().to_str().unwrap()),
            "{said}"
        );
    }
    // And from the environment, named as the variable.
    let mut cmd = proxy_to("https://127.0.0.1:9");
    cmd.env("IDEMGATE_UPSTREAM_CA_FILE", &garbage);
    let said = refused(cmd).await;
    assert!(said.contains("IDEMGATE_UPSTREAM_CA_FILE"), "{said}");
}

/// A WebSocket to an `https://` origin: the upgrade is made over the TLS
/// connection, and the switched connection carries frames both ways.
#[tokio::test]
async fn a_websocket_to_an_https_origin_passes_through() {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;

    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("idemgate test CA");
    let ca_file = ca.write(&dir, "ca.pem");
    let acceptor = ca.acceptor(&["127.0.0.1"]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let origin = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut ws) = tokio_tungstenite::accept_async(tls).await else {
                    return;
                };
                while let Some(Ok(msg)) = ws.next().await {
                    if msg.is_text() || msg.is_binary() {
                        let _ = ws.send(msg).await;
                    }
                }
            });
        }
    });
    let p = proxy(
        &dir,
        &format!("https://127.0.0.1:{port}"),
        &["--upstream-ca-file", ca_file.to_str().unwrap()],
    )
    .await;
    let url = format!("ws://{}/ws", p.addr);
    let (mut ws, res) = tokio_tungstenite::connect_async(url)
        .await
        .expect("the handshake succeeds through the proxy");
    assert_eq!(res.status(), 101);
    for text in ["over TLS", "and back"] {
        ws.send(Message::text(text)).await.unwrap();
        let echoed = tokio::time::timeout(Duration::from_secs(5), ws.next())
            .await
            .expect("an echo")
            .unwrap()
            .unwrap();
        assert_eq!(echoed, Message::text(text));
    }
    ws.close(None).await.unwrap();
    origin.abort();
}
