//! `idemgate proxy` for tests: in-process over port 0 (`TestProxy`), or the
//! real binary (`ProxyProcess`).

use std::sync::Mutex;
use std::time::Duration;

use idemgate::layer::Route;
use idemgate::server::config::ProxyArgs;
use idemgate::server::open::open_store;
use idemgate::server::proxy::Proxy;
use idemgate::server::serve::{self, Serving};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::app::TestResponse;
use super::logs;
use super::pg::TestDb;
use super::upstream::Upstream;

/// `idemgate proxy` settings from flags.
pub fn proxy_args(flags: &[&str]) -> ProxyArgs {
    super::bin::parse_args(flags)
}

/// One proxy "process" on port 0, with its admin listener.
pub struct TestProxy {
    pub base: String,
    pub admin: String,
    pub addr: std::net::SocketAddr,
    pub http: reqwest::Client,
    pub tasks: Vec<JoinHandle<std::io::Result<()>>>,
    /// Keys and tokens sent: none may show up in the logs.
    pub secrets: Mutex<Vec<String>>,
}

impl TestProxy {
    /// A proxy over the database at `db_url` in front of `upstream`.
    pub async fn start(
        db_url: &str,
        upstream: &str,
        flags: &[&str],
        routes: Vec<Route>,
    ) -> TestProxy {
        logs::init();
        let mut all = vec!["--upstream", upstream, "--database-url", db_url];
        all.extend_from_slice(flags);
        let args = proxy_args(&all);
        args.validate().expect("valid settings");
        let store = open_store(&args.store, true).await.expect("store");
        let proxy = Proxy::build(&args, routes, store).expect("proxy");
        // As `proxy` does at start (a seal key missing makes the binary
        // refuse to start; here the engine then turns new keys away).
        let _ = proxy.engine.keep_naming_windows().await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let base = format!("http://{addr}");
        let admin_base = format!("http://{}", admin.local_addr().unwrap());
        // The timeouts of `flags`; a short grace, since nothing here waits
        // for a shutdown.
        let serving = Serving {
            grace: Duration::from_secs(5),
            ..Serving::from(&args.run)
        };
        let tasks = vec![
            tokio::spawn(serve::serve(
                listener,
                proxy.app,
                serving,
                std::future::pending(),
            )),
            tokio::spawn(serve::serve(
                admin,
                proxy.admin,
                serving,
                std::future::pending(),
            )),
        ];
        TestProxy {
            base,
            admin: admin_base,
            addr,
            http: super::http(),
            tasks,
            secrets: Mutex::new(Vec::new()),
        }
    }

    /// Sends one request through the proxy. `headers` may repeat a name.
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> TestResponse {
        self.send_with(&self.http, method, path, headers, body)
            .await
            .expect("the proxy answers")
    }

    pub async fn send_with(
        &self,
        http: &reqwest::Client,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> reqwest::Result<TestResponse> {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut req = http.request(method, format!("{}{path}", self.base));
        for (name, value) in headers {
            let secret = value.trim_matches('"');
            if ["idempotency-key", "authorization"].contains(&name.to_ascii_lowercase().as_str())
                && secret.len() >= 4
            {
                self.secrets.lock().unwrap().push(secret.to_owned());
            }
            req = req.header(*name, *value);
        }
        if let Some(body) = body {
            req = req.body(body.to_owned());
        }
        let res = req.send().await?;
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = res.bytes().await?;
        Ok(TestResponse {
            status,
            headers,
            body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            text: String::from_utf8_lossy(&bytes).into_owned(),
        })
    }

    /// Sends one HTTP/1.1 request over a plain socket with `target` exactly as
    /// given (an HTTP client would resolve `/x/../pay` itself), a `{}` body,
    /// and `headers`; reads the answer to the end (`Connection: close`).
    pub async fn send_raw(
        &self,
        method: &str,
        target: &str,
        headers: &[(&str, &str)],
    ) -> TestResponse {
        let mut request = format!(
            "{method} {target} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\n",
            self.addr
        );
        for (name, value) in headers {
            if name.eq_ignore_ascii_case("idempotency-key") {
                let secret = value.trim_matches('"');
                if secret.len() >= 4 {
                    self.secrets.lock().unwrap().push(secret.to_owned());
                }
            }
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n{}");
        self.send_raw_request(&request).await
    }

    /// Writes `request` (a whole HTTP/1.1 request, which should ask for
    /// `Connection: close`) to the proxy as is, and reads the answer to the end.
    pub async fn send_raw_request(&self, request: &str) -> TestResponse {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let mut socket = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        socket.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        socket.read_to_end(&mut raw).await.unwrap();
        let raw = String::from_utf8_lossy(&raw);
        let (head, body) = raw.split_once("\r\n\r\n").expect("a response");
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or_else(|| panic!("a status line in {head:?}"));
        let mut header_map = http::HeaderMap::new();
        for line in lines {
            let (name, value) = line.split_once(':').expect("a header line");
            header_map.append(
                http::HeaderName::from_bytes(name.trim().as_bytes()).unwrap(),
                http::HeaderValue::from_str(value.trim()).unwrap(),
            );
        }
        TestResponse {
            status: http::StatusCode::from_u16(status).unwrap(),
            headers: header_map,
            body: serde_json::from_str(body).unwrap_or(Value::Null),
            text: body.to_owned(),
        }
    }

    /// `POST path` with `key` and a JSON body.
    /// `POST path` with `key`, asking for the immediate answer
    /// (`Prefer: wait=0`): a duplicate in flight is its 409.
    pub async fn post_now(&self, path: &str, key: &str, body: &str) -> TestResponse {
        self.send(
            "POST",
            path,
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
                ("prefer", "wait=0"),
            ],
            Some(body),
        )
        .await
    }

    pub async fn post(&self, path: &str, key: &str, body: &str) -> TestResponse {
        self.send(
            "POST",
            path,
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ],
            Some(body),
        )
        .await
    }

    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        let res = self
            .http
            .get(format!("{}{path}", self.admin))
            .send()
            .await
            .unwrap();
        (res.status().as_u16(), res.text().await.unwrap())
    }
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        if std::thread::panicking() {
            return;
        }
        let secrets = self.secrets.lock().unwrap().clone();
        let refs: Vec<&str> = secrets.iter().map(String::as_str).collect();
        logs::assert_absent(&refs);
    }
}

pub fn replayed(res: &TestResponse) -> bool {
    res.headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// A fresh database and origin, and a proxy over them with `flags`.
pub async fn setup(flags: &[&str]) -> (TestDb, Upstream, TestProxy) {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let proxy = TestProxy::start(&db.url, &upstream.url(), flags, Vec::new()).await;
    (db, upstream, proxy)
}

/// A running `idemgate proxy`, killed on drop.
pub struct ProxyProcess {
    pub child: std::process::Child,
    pub port: u16,
    /// The admin listener's port.
    pub admin: u16,
}

impl ProxyProcess {
    pub async fn start(db: &TestDb, upstream: &str) -> ProxyProcess {
        ProxyProcess::start_with(db, upstream, &[]).await
    }

    /// As [`ProxyProcess::start`], with extra `proxy` flags (e.g.
    /// `--upstream-timeout 2`).
    pub async fn start_with(db: &TestDb, upstream: &str, extra: &[&str]) -> ProxyProcess {
        ProxyProcess::start_at(&db.url, upstream, extra).await
    }

    /// As [`ProxyProcess::start_with`], over the database at `url` (a
    /// SQLite one too).
    pub async fn start_at(url: &str, upstream: &str, extra: &[&str]) -> ProxyProcess {
        let (port, admin) = (super::bin::free_port(), super::bin::free_port());
        let child = super::bin::idemgate_at(url)
            .env_remove("IDEMGATE_UPSTREAM")
            .env_remove("IDEMGATE_ADMIN_LISTEN")
            .args(["proxy", "--upstream", upstream])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut process = ProxyProcess { child, port, admin };
        let ready = format!("http://127.0.0.1:{admin}/readyz");
        let started = std::time::Instant::now();
        loop {
            if let Ok(res) = reqwest::get(&ready).await
                && res.status() == 200
            {
                return process;
            }
            if let Ok(Some(status)) = process.child.try_wait() {
                panic!("idemgate proxy exited ({status}):\n{}", process.stderr());
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "idemgate proxy did not come up"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `http://127.0.0.1:PORT` of the proxy listener.
    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn stderr(&mut self) -> String {
        let mut text = String::new();
        if let Some(mut pipe) = self.child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
        }
        text
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
