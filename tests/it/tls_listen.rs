//! TLS on idemgate's own listeners (docs/configuration.md, “TLS on idemgate's
//! listeners”): the real binary with `--tls-cert`/`--tls-key` made per test by
//! rcgen, driven by curl and by rustls clients: HTTP/1.1 and HTTP/2 by ALPN, a
//! rotation under load that fails no request, mutual TLS, the proxy's two
//! listeners, and the refusals (one file of the pair, unusable files, protected
//! mode with TLS on).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SerialNumber,
};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

use crate::common::bin::{BIN, drain_stderr, free_port};

const CHARGE: &str =
    r#"{"request":{"method":"POST","path":"/charges","body":{"amount":500,"currency":"eur"}}}"#;

/// A CA of the test's own, and the leaves it signs.
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

/// A leaf certificate and its key, PEM.
#[derive(Clone)]
struct Leaf {
    cert: String,
    key: String,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A server certificate for localhost and 127.0.0.1 with `serial`.
    fn server(&self, serial: u64) -> Leaf {
        self.leaf(
            &["localhost", "127.0.0.1"],
            serial,
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate.
    fn client(&self, name: &str) -> Leaf {
        self.leaf(&[name], 7, ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn leaf(&self, names: &[&str], serial: u64, usage: ExtendedKeyUsagePurpose) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.serial_number = Some(SerialNumber::from(serial));
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

impl Leaf {
    fn der(&self) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(self.cert.as_bytes()).unwrap()
    }
}

/// Writes `text` to `path` by a rename, as a careful rotation does.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The files of one server's TLS in a temp dir.
struct Files {
    dir: tempfile::TempDir,
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

impl Files {
    fn new(ca: &Ca, leaf: &Leaf) -> Files {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, ca_path) = (
            dir.path().join("cert.pem"),
            dir.path().join("key.pem"),
            dir.path().join("ca.pem"),
        );
        std::fs::write(&cert, &leaf.cert).unwrap();
        std::fs::write(&key, &leaf.key).unwrap();
        std::fs::write(&ca_path, &ca.pem).unwrap();
        Files {
            dir,
            cert,
            key,
            ca: ca_path,
        }
    }

    fn db(&self) -> String {
        format!("sqlite://{}", self.dir.path().join("db.sqlite").display())
    }
}

/// A running binary, killed on drop, its stderr gathered.
struct Running {
    child: Child,
    logs: Arc<Mutex<String>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Running {
    fn logs(&self) -> String {
        self.logs.lock().unwrap().clone()
    }
}

fn command(files: &Files) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("DATABASE_URL", files.db())
        .env("RUST_LOG", "info")
        .env("IDEMGATE_TLS_CERT", &files.cert)
        .env("IDEMGATE_TLS_KEY", &files.key)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

/// Starts `cmd` and waits until `port` completes a TLS handshake.
async fn start(mut cmd: Command, port: u16, ca: &Ca) -> Running {
    let mut child = cmd.spawn().unwrap();
    let logs = drain_stderr(&mut child);
    let mut running = Running { child, logs };
    let config = client_config(ca, None);
    let started = Instant::now();
    loop {
        if connect(&config, port).await.is_ok() {
            return running;
        }
        if let Ok(Some(status)) = running.child.try_wait() {
            panic!("idemgate exited ({status}):\n{}", running.logs());
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "idemgate did not come up:\n{}",
            running.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn start_serve(files: &Files, ca: &Ca, extra: &[&str]) -> (Running, u16) {
    let port = free_port();
    let mut cmd = command(files);
    cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(extra);
    (start(cmd, port, ca).await, port)
}

/// A client trusting `ca`, with `identity` as its certificate if given, and
/// no session resumption: every connection is a full handshake, which sees
/// the certificate served now.
fn client_config(ca: &Ca, identity: Option<&Leaf>) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem.as_bytes()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match identity {
        None => builder.with_no_client_auth(),
        Some(leaf) => builder
            .with_client_auth_cert(
                vec![leaf.der()],
                PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap(),
            )
            .unwrap(),
    };
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// A new TLS connection to `port`, HTTP/1.1 over it, and the certificate
/// the server showed.
async fn connect(
    config: &Arc<ClientConfig>,
    port: u16,
) -> anyhow::Result<(Sender, CertificateDer<'static>)> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    let tls = TlsConnector::from(config.clone())
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await?;
    let shown = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no server certificate"))?;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    Ok((send, shown))
}

/// One reservation with a fresh key over `send`: its status.
async fn reserve(send: &mut Sender, port: u16) -> anyhow::Result<u16> {
    send.ready().await?;
    let req = http::Request::post(format!("https://127.0.0.1:{port}/v1/reservations"))
        .header("host", format!("127.0.0.1:{port}"))
        .header("idempotency-key", uuid::Uuid::new_v4().to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(CHARGE.as_bytes())))?;
    let res = send.send_request(req).await?;
    let status = res.status().as_u16();
    res.into_body().collect().await?;
    Ok(status)
}

/// `curl ARGS…`: its exit status, standard output and error.
fn curl(args: &[&str]) -> (bool, String, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .args(args)
        .output()
        .expect("curl is installed");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn curl_speaks_http1_and_http2_over_tls_and_the_log_says_https() {
    let ca = Ca::new("curl test CA");
    let files = Files::new(&ca, &ca.server(1));
    let (served, port) = start_serve(&files, &ca, &[]).await;
    let ca_path = files.ca.to_str().unwrap();
    let base = format!("https://127.0.0.1:{port}");
    for (flag, version) in [("--http1.1", "1.1"), ("--http2", "2")] {
        let (ok, out, err) = curl(&[
            flag,
            "--cacert",
            ca_path,
            "-w",
            "\n%{http_code} %{http_version}",
            &format!("{base}/healthz"),
        ]);
        assert!(ok, "{flag}: {err}");
        assert!(out.ends_with(&format!("200 {version}")), "{flag}: {out}");
        // The reservation API itself, a key reserved and replayed.
        let key = uuid::Uuid::new_v4().to_string();
        for want in ["201", "409"] {
            let (ok, out, err) = curl(&[
                flag,
                "--cacert",
                ca_path,
                "-X",
                "POST",
                "-H",
                &format!("Idempotency-Key: {key}"),
                "-H",
                "Content-Type: application/json",
                "--data",
                CHARGE,
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                &format!("{base}/v1/reservations"),
            ]);
            assert!(ok, "{flag}: {err}");
            // A second reserve of a key in flight is 409 request-in-flight.
            assert_eq!(out, want, "{flag}");
        }
    }
    // Without the CA, curl refuses the certificate; plain HTTP gets no answer.
    let (ok, _, err) = curl(&[&format!("{base}/healthz")]);
    assert!(
        !ok,
        "curl trusted a certificate of the test's own CA: {err}"
    );
    let (ok, out, _) = curl(&[&format!("http://127.0.0.1:{port}/healthz")]);
    assert!(!ok && !out.contains("ok"), "{out}");

    let logs = served.logs();
    assert!(
        logs.contains(&format!("docs=https://127.0.0.1:{port}/docs")),
        "{logs}"
    );
    assert!(
        logs.contains("https:") && logs.contains(files.cert.to_str().unwrap()),
        "the start-up log names the files: {logs}"
    );
}

/// Over HTTP/2 a browser names the host in `:authority`, not `Host`: on
/// `serve` open without tokens, a page whose name was rebound to 127.0.0.1
/// is refused there too (`421 misdirected-request`), and the listener's own
/// names are answered.
#[tokio::test]
async fn an_http2_authority_of_another_name_is_misdirected() {
    let ca = Ca::new("authority test CA");
    let files = Files::new(&ca, &ca.server(1));
    let (_served, port) = start_serve(&files, &ca, &[]).await;
    let ca_path = files.ca.to_str().unwrap();
    for (host, want) in [
        ("rebind.attacker.example", "421 2"),
        ("localhost", "200 2"),
        ("127.0.0.1", "200 2"),
    ] {
        let resolve = format!("{host}:{port}:127.0.0.1");
        let (ok, out, err) = curl(&[
            "--http2",
            "--cacert",
            ca_path,
            // The rebound name is not on the certificate: a browser that
            // was told to go on anyway, or a plain HTTP listener.
            "--insecure",
            "--resolve",
            &resolve,
            "-w",
            "\n%{http_code} %{http_version}",
            &format!("https://{host}:{port}/v1/admin/keys?state=stuck"),
        ]);
        assert!(ok, "{host}: {err}");
        assert!(out.ends_with(want), "{host}: {out}");
        if want.starts_with("421") {
            assert!(out.contains("misdirected-request"), "{host}: {out}");
        }
    }
}

/// Requests on kept-alive connections and on new ones while the files are
/// replaced: a half-written certificate and a key of another certificate
/// are refused with a WARN naming the setting and the old certificate
/// stays; the new pair is served from the next handshake on; not one
/// request fails, and the kept-alive connections are never dropped.
#[tokio::test]
async fn a_rotation_under_load_fails_no_request() {
    let ca = Ca::new("rotation test CA");
    let (first, second, third) = (ca.server(0xA1), ca.server(0xB2), ca.server(0xC3));
    let files = Files::new(&ca, &first);
    let (served, port) = start_serve(&files, &ca, &[]).await;
    let config = client_config(&ca, None);

    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut workers = Vec::new();
    // Kept alive: one connection each for the whole test.
    for _ in 0..3 {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        let (mut send, _) = connect(&config, port).await.unwrap();
        workers.push(tokio::spawn(async move {
            let mut served_here = 0usize;
            while !stop.load(Ordering::Relaxed) {
                match reserve(&mut send, port).await {
                    Ok(201) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                        served_here += 1;
                    }
                    other => failed
                        .lock()
                        .unwrap()
                        .push(format!("kept-alive: {other:?}")),
                }
            }
            served_here
        }));
    }
    // A new connection, a full handshake, for every request: the serials
    // each saw, in order.
    let seen = Arc::new(Mutex::new(Vec::<CertificateDer<'static>>::new()));
    for _ in 0..3 {
        let (stop, ok, failed, seen, config) = (
            stop.clone(),
            ok.clone(),
            failed.clone(),
            seen.clone(),
            config.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut served_here = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let outcome = match connect(&config, port).await {
                    Ok((mut send, shown)) => {
                        seen.lock().unwrap().push(shown);
                        reserve(&mut send, port).await
                    }
                    Err(e) => Err(e),
                };
                match outcome {
                    Ok(201) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                        served_here += 1;
                    }
                    other => failed.lock().unwrap().push(format!("new: {other:?}")),
                }
            }
            served_here
        }));
    }

    let last_seen = || seen.lock().unwrap().last().cloned();
    let shows = |leaf: &Leaf, seen: &Arc<Mutex<Vec<CertificateDer<'static>>>>| {
        let want = leaf.der();
        let seen = seen.clone();
        async move {
            let at = seen.lock().unwrap().len();
            crate::common::until(Duration::from_secs(5), || {
                let seen = seen.lock().unwrap();
                seen.len() > at + 5 && seen[at + 5..].iter().all(|c| *c == want)
            })
            .await
        }
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        shows(&first, &seen).await,
        "the first certificate is served"
    );

    // Half a certificate, written in place as a careless copy does.
    std::fs::write(&files.cert, &second.cert[..second.cert.len() / 2]).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        shows(&first, &seen).await,
        "a half-written certificate replaced the one served"
    );
    assert!(
        crate::common::until(Duration::from_secs(5), || served
            .logs()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("setting=\"tls_cert\"")))
        .await,
        "no WARN naming tls_cert: {}",
        served.logs()
    );
    // The whole new certificate, but the old key: they do not match.
    std::fs::write(&files.cert, &second.cert).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        shows(&first, &seen).await,
        "a certificate without its key was served"
    );
    assert!(
        crate::common::until(Duration::from_secs(5), || served
            .logs()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("setting=\"tls_key\"")))
        .await,
        "no WARN naming tls_key: {}",
        served.logs()
    );
    // Its key: the second pair is served.
    std::fs::write(&files.key, &second.key).unwrap();
    assert!(
        shows(&second, &seen).await,
        "the second certificate (serial B2) is not served: last {:?}",
        last_seen().map(|c| c.len())
    );
    // A rotation by renames, key first: the third pair.
    replace(&files.key, &third.key);
    replace(&files.cert, &third.cert);
    assert!(
        shows(&third, &seen).await,
        "the third certificate (serial C3) is not served"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;

    stop.store(true, Ordering::Relaxed);
    let mut per_worker = Vec::new();
    for w in workers {
        per_worker.push(w.await.unwrap());
    }
    let failed = failed.lock().unwrap().clone();
    let ok = ok.load(Ordering::Relaxed);
    let handshakes = seen.lock().unwrap().len();
    eprintln!(
        "rotation under load: {ok} requests answered 201, {} failed; {handshakes} new \
         connections; per worker {per_worker:?}",
        failed.len()
    );
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(
        per_worker.iter().all(|n| *n > 10),
        "a worker barely ran: {per_worker:?}"
    );
    let logs = served.logs();
    assert_eq!(
        logs.matches("TLS certificate reloaded").count(),
        2,
        "two reloads (the second pair, the third): {logs}"
    );
}

#[tokio::test]
async fn mutual_tls_refuses_a_client_without_a_certificate_of_its_ca() {
    let ca = Ca::new("mtls server CA");
    let clients = Ca::new("mtls clients CA");
    let stranger = Ca::new("another CA");
    let files = Files::new(&ca, &ca.server(3));
    let clients_ca = files.dir.path().join("clients.pem");
    std::fs::write(&clients_ca, &clients.pem).unwrap();
    let port = free_port();
    let mut cmd = command(&files);
    cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--tls-client-ca")
        .arg(&clients_ca);
    let mut child = cmd.spawn().unwrap();
    let logs = drain_stderr(&mut child);
    let served = Running { child, logs };
    let good = ca_client(&ca, Some(&clients.client("alice")));
    // The listener is up once a client with its certificate is answered.
    let started = Instant::now();
    let status = loop {
        if let Ok((mut send, _)) = connect(&good, port).await
            && let Ok(status) = reserve(&mut send, port).await
        {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{}",
            served.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status, 201, "a client with a certificate of the CA");

    for (who, config) in [
        ("no client certificate", ca_client(&ca, None)),
        (
            "a certificate of another CA",
            ca_client(&ca, Some(&stranger.client("mallory"))),
        ),
    ] {
        // Under TLS 1.3 the client's handshake ends before the server has
        // checked its certificate: the refusal comes on the first request.
        let outcome = match connect(&config, port).await {
            Ok((mut send, _)) => reserve(&mut send, port).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        assert!(outcome.is_err(), "{who}: answered {outcome:?}");
    }

    // curl likewise.
    let dir = files.dir.path();
    let alice = clients.client("alice");
    std::fs::write(dir.join("alice.pem"), &alice.cert).unwrap();
    std::fs::write(dir.join("alice.key"), &alice.key).unwrap();
    let ca_path = files.ca.to_str().unwrap();
    let url = format!("https://127.0.0.1:{port}/healthz");
    let (ok, _, err) = curl(&["--cacert", ca_path, &url]);
    assert!(!ok, "curl without a client certificate was answered: {err}");
    let (ok, out, err) = curl(&[
        "--cacert",
        ca_path,
        "--cert",
        dir.join("alice.pem").to_str().unwrap(),
        "--key",
        dir.join("alice.key").to_str().unwrap(),
        &url,
    ]);
    assert!(ok && out.contains("ok"), "{out} {err}");
    let logs = served.logs();
    assert!(
        logs.contains("mutual TLS") && logs.contains("clients.pem"),
        "{logs}"
    );
}

fn ca_client(ca: &Ca, identity: Option<&Leaf>) -> Arc<ClientConfig> {
    client_config(ca, identity)
}

// The upstream answers on this test's runtime while curl blocks a thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_serves_both_listeners_over_tls() {
    let upstream = crate::common::upstream::Upstream::start().await;
    let ca = Ca::new("proxy test CA");
    let files = Files::new(&ca, &ca.server(5));
    let (port, admin) = (free_port(), free_port());
    let mut cmd = command(&files);
    cmd.args(["proxy", "--upstream", &upstream.url()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")]);
    let proxy = start(cmd, admin, &ca).await;
    let ca_path = files.ca.to_str().unwrap();
    let (ok, out, err) = curl(&[
        "--cacert",
        ca_path,
        &format!("https://127.0.0.1:{admin}/healthz"),
    ]);
    assert!(ok && out.contains("ok"), "admin: {out} {err}");
    // The door: a keyed POST runs once upstream and is replayed.
    let key = uuid::Uuid::new_v4().to_string();
    for _ in 0..2 {
        let (ok, out, err) = curl(&[
            "--cacert",
            ca_path,
            "-X",
            "POST",
            "-H",
            &format!("Idempotency-Key: {key}"),
            "--data",
            "{}",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{http_version}",
            &format!("https://127.0.0.1:{port}/charges"),
        ]);
        assert!(ok, "{err}");
        assert!(out.starts_with('2') && out.ends_with(" 2"), "{out}");
    }
    assert_eq!(upstream.total(), 1, "the keyed call ran once upstream");
    // The upstream is told the client spoke https, over HTTP/1.1 as well.
    let (ok, out, err) = curl(&[
        "--http1.1",
        "--cacert",
        ca_path,
        &format!("https://127.0.0.1:{port}/echo"),
    ]);
    assert!(ok, "{err}");
    let echoed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        echoed["headers"]["x-forwarded-proto"],
        serde_json::json!(["https"]),
        "{out}"
    );
    let logs = proxy.logs();
    assert!(
        logs.contains("scheme=\"https\"") || logs.contains("scheme=https"),
        "{logs}"
    );
}

async fn refusal(files: &Files, env: &[(&str, &str)], args: &[&str]) -> String {
    let mut cmd = command(files);
    cmd.env_remove("IDEMGATE_TLS_CERT")
        .env_remove("IDEMGATE_TLS_KEY")
        .envs(env.iter().copied())
        .args(args);
    crate::common::bin::refused(cmd).await
}

#[tokio::test]
async fn unusable_tls_settings_refuse_the_start_naming_the_setting() {
    let ca = Ca::new("refusal test CA");
    let leaf = ca.server(9);
    let files = Files::new(&ca, &leaf);
    let (cert, key) = (files.cert.to_str().unwrap(), files.key.to_str().unwrap());
    let serve = ["serve", "--listen", "127.0.0.1:0"];

    let err = refusal(&files, &[("IDEMGATE_TLS_CERT", cert)], &serve).await;
    assert!(
        err.contains("IDEMGATE_TLS_KEY") || err.contains("--tls-key"),
        "{err}"
    );
    assert!(
        err.contains("needed, since") && !err.contains("is not set"),
        "{err}"
    );
    let err = refusal(&files, &[("IDEMGATE_TLS_KEY", key)], &serve).await;
    assert!(
        err.contains("IDEMGATE_TLS_CERT") || err.contains("--tls-cert"),
        "{err}"
    );
    let err = refusal(
        &files,
        &[],
        &[&serve[..], &["--tls-client-ca", files.ca.to_str().unwrap()]].concat(),
    )
    .await;
    assert!(err.contains("--tls-client-ca"), "{err}");

    // A certificate that is not one, a key of another certificate.
    let garbled = files.dir.path().join("garbled.pem");
    std::fs::write(&garbled, "-----BEGIN CERTIFICATE-----\nAAAA\n").unwrap();
    let err = refusal(
        &files,
        &[],
        &[
            &serve[..],
            &["--tls-cert", garbled.to_str().unwrap(), "--tls-key", key],
        ]
        .concat(),
    )
    .await;
    assert!(
        err.contains("--tls-cert") && err.contains("garbled.pem"),
        "{err}"
    );
    let other = files.dir.path().join("other.key");
    std::fs::write(&other, ca.server(10).key).unwrap();
    let err = refusal(
        &files,
        &[
            ("IDEMGATE_TLS_CERT", cert),
            ("IDEMGATE_TLS_KEY", other.to_str().unwrap()),
        ],
        &serve,
    )
    .await;
    assert!(
        err.contains("IDEMGATE_TLS_KEY") && err.contains("other.key"),
        "{err}"
    );
    assert!(!err.contains("PRIVATE KEY-----\n"), "{err}");

    // TLS is not a token: protected mode stands.
    let err = refusal(
        &files,
        &[("IDEMGATE_TLS_CERT", cert), ("IDEMGATE_TLS_KEY", key)],
        &["serve", "--listen", "0.0.0.0:0"],
    )
    .await;
    assert!(
        err.contains("--listen") && err.contains("protected mode"),
        "{err}"
    );
    // Nor is a client CA.
    let err = refusal(
        &files,
        &[
            ("IDEMGATE_TLS_CERT", cert),
            ("IDEMGATE_TLS_KEY", key),
            ("IDEMGATE_TLS_CLIENT_CA", files.ca.to_str().unwrap()),
        ],
        &["serve", "--listen", "0.0.0.0:0"],
    )
    .await;
    assert!(err.contains("protected mode"), "{err}");
    // The proxy refuses one of the pair alike.
    let err = refusal(
        &files,
        &[("IDEMGATE_TLS_CERT", cert)],
        &[
            "proxy",
            "--upstream",
            "http://127.0.0.1:9",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
    )
    .await;
    assert!(err.contains("IDEMGATE_TLS_KEY"), "{err}");
}

/// An HTTP/2 connection has no idle phase of its own (its requests run side
/// by side): it is closed once none has run for the keep-alive timeout, and
/// not while one runs.
#[tokio::test]
async fn an_idle_http2_connection_is_closed_after_the_keep_alive_timeout() {
    let ca = Ca::new("h2 idle test CA");
    let files = Files::new(&ca, &ca.server(11));
    let (_served, port) = start_serve(&files, &ca, &["--keep-alive-timeout", "2"]).await;
    let mut config = (*client_config(&ca, None)).clone();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let tls = TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tls),
    )
    .await
    .unwrap();
    let ended = Arc::new(AtomicBool::new(false));
    let ended_at = ended.clone();
    tokio::spawn(async move {
        let _ = conn.await;
        ended_at.store(true, Ordering::SeqCst);
    });
    // Requests 1 s apart keep it open past the timeout.
    let started = Instant::now();
    for _ in 0..4 {
        let req = http::Request::get(format!("https://127.0.0.1:{port}/healthz"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = send.send_request(req).await.unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(res.version(), http::Version::HTTP_2);
        res.into_body().collect().await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(!ended.load(Ordering::SeqCst), "closed while in use");
    // Then idle: closed within the timeout and a bit.
    let idle = Instant::now();
    assert!(
        crate::common::until(Duration::from_secs(5), || ended.load(Ordering::SeqCst)).await,
        "an idle HTTP/2 connection stayed open {} s past a 2 s keep-alive timeout",
        idle.elapsed().as_secs()
    );
    eprintln!(
        "h2 idle close: used {:.1} s, closed {:.1} s after its last request",
        (idle - started).as_secs_f64(),
        idle.elapsed().as_secs_f64() + 1.0
    );
}
