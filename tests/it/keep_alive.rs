//! Connection timers on real sockets, on `serve`'s listener and the proxy's
//! (both are `serve::serve`): an idle keep-alive connection waits for the
//! keep-alive timeout, not the header-read timeout; a head that trickles in,
//! or never comes, is cut at the header-read timeout; a response that is
//! slow to come or to stream is never cut.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::app::{TestApp, fresh_key};
use common::backend::Backend;
use common::proxy::TestProxy;
use common::upstream::{Counts, Upstream};
use idemgate::server::serve;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The header-read timeout of every listener here.
const HEADER_READ: Duration = Duration::from_secs(1);

/// One keep-alive client connection, spoken to byte by byte.
struct Client {
    stream: TcpStream,
    /// Bytes read past the last response.
    buf: Vec<u8>,
}

/// A response read off a [`Client`].
#[derive(Debug)]
struct Answer {
    status: u16,
    body: String,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Client {
            stream,
            buf: Vec::new(),
        }
    }

    /// `GET path`, keeping the connection open; `None` if the server had
    /// closed it.
    async fn get(&mut self, path: &str) -> Option<Answer> {
        self.request(&format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n"))
            .await
    }

    /// Sends `raw`, its `Host: x` as the listener's own address (the one
    /// name an open listener answers).
    async fn request(&mut self, raw: &str) -> Option<Answer> {
        let own = format!("Host: {}\r\n", self.stream.peer_addr().ok()?);
        let raw = raw.replacen("Host: x\r\n", &own, 1);
        self.stream.write_all(raw.as_bytes()).await.ok()?;
        self.answer().await
    }

    /// More bytes into `buf`; `None` once the server has closed.
    async fn fill(&mut self) -> Option<()> {
        let mut chunk = [0u8; 8192];
        match self.stream.read(&mut chunk).await {
            Ok(0) | Err(_) => None,
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Some(())
            }
        }
    }

    /// Takes `n` bytes off the front of `buf`, reading as needed.
    async fn take(&mut self, n: usize) -> Option<Vec<u8>> {
        while self.buf.len() < n {
            self.fill().await?;
        }
        Some(self.buf.drain(..n).collect())
    }

    /// Takes one CRLF-terminated line.
    async fn line(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = self.take(end + 2).await?;
                return Some(String::from_utf8_lossy(&line[..end]).into_owned());
            }
            self.fill().await?;
        }
    }

    /// One response, sized or chunked.
    async fn answer(&mut self) -> Option<Answer> {
        let status_line = self.line().await?;
        let status = status_line.split(' ').nth(1)?.parse().ok()?;
        let (mut length, mut chunked) = (0, false);
        loop {
            let line = self.line().await?;
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':')?;
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = value.parse().ok()?;
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value.eq_ignore_ascii_case("chunked");
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                let size = usize::from_str_radix(self.line().await?.trim(), 16).ok()?;
                if size == 0 {
                    self.line().await?;
                    break;
                }
                body.extend(self.take(size).await?);
                self.take(2).await?;
            }
        } else {
            body = self.take(length).await?;
        }
        Some(Answer {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    /// How long after now the server closed the connection, if it did
    /// within `limit` (without sending anything more).
    async fn closed_within(&mut self, limit: Duration) -> Option<Duration> {
        let began = Instant::now();
        let mut rest = Vec::new();
        match tokio::time::timeout(limit, self.stream.read_to_end(&mut rest)).await {
            Ok(_) => {
                assert!(
                    rest.is_empty(),
                    "bytes before the close: {:?}",
                    String::from_utf8_lossy(&rest)
                );
                Some(began.elapsed())
            }
            Err(_) => None,
        }
    }
}

/// `idemgate serve`'s router (over a fresh SQLite file) on port 0, with
/// these timeouts.
struct Api {
    addr: SocketAddr,
    app: TestApp,
    task: JoinHandle<std::io::Result<()>>,
    _dir: tempfile::TempDir,
}

impl Api {
    async fn start(keep_alive: Duration) -> Api {
        let dir = tempfile::tempdir().unwrap();
        let app = TestApp::new(&Backend::sqlite_url(&dir), &[]).await;
        let (addr, task) = serve(app.router.clone(), keep_alive).await;
        Api {
            addr,
            app,
            task,
            _dir: dir,
        }
    }
}

impl Drop for Api {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `router` served by `serve::serve` on port 0 with [`HEADER_READ`] and
/// `keep_alive`.
async fn serve(
    router: axum::Router,
    keep_alive: Duration,
) -> (SocketAddr, JoinHandle<std::io::Result<()>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = serve::Serving {
        grace: Duration::from_secs(1),
        header_read_timeout: HEADER_READ,
        keep_alive_timeout: keep_alive,
    };
    let task = tokio::spawn(serve::serve(
        listener,
        router,
        serving,
        std::future::pending(),
    ));
    (addr, task)
}

/// A proxy (over a fresh SQLite file) in front of a fresh origin, with
/// [`HEADER_READ`] and `keep_alive`.
async fn proxy(keep_alive: Duration) -> (TestProxy, Upstream, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start().await;
    let keep_alive = keep_alive.as_secs().to_string();
    let proxy = TestProxy::start(
        &Backend::sqlite_url(&dir),
        &upstream.url(),
        &[
            "--header-read-timeout",
            &HEADER_READ.as_secs().to_string(),
            "--keep-alive-timeout",
            &keep_alive,
        ],
        Vec::new(),
    )
    .await;
    (proxy, upstream, dir)
}

#[tokio::test]
async fn an_idle_connection_outlives_the_header_read_timeout() {
    let api = Api::start(Duration::from_secs(30)).await;
    let (proxy, _upstream, _dir) = proxy(Duration::from_secs(30)).await;
    for (addr, path) in [(api.addr, "/healthz"), (proxy.addr, "/ok")] {
        let mut client = Client::connect(addr).await;
        let first = client.get(path).await.expect("the first answer");
        assert!(first.status < 300, "{path}: {first:?}");
        // Idle for well over the header-read timeout, as a pooled client
        // told to come back in a few seconds would be.
        tokio::time::sleep(HEADER_READ * 3).await;
        let second = client
            .get(path)
            .await
            .unwrap_or_else(|| panic!("{path}: the idle connection was closed"));
        assert!(second.status < 300, "{path}: {second:?}");
    }
}

#[tokio::test]
async fn an_idle_connection_is_closed_after_the_keep_alive_timeout() {
    let keep_alive = Duration::from_secs(3);
    let api = Api::start(keep_alive).await;
    let (proxy, _upstream, _dir) = proxy(keep_alive).await;
    let post = |key: &str| {
        format!(
            "POST /v1/reservations HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n\
             Content-Length: 0\r\n\r\n"
        )
    };
    for (addr, request) in [
        (
            api.addr,
            "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n".to_owned(),
        ),
        (api.addr, post(&fresh_key())),
        (proxy.addr, "GET /ok HTTP/1.1\r\nHost: x\r\n\r\n".to_owned()),
    ] {
        let mut client = Client::connect(addr).await;
        let answer = client.request(&request).await.expect("an answer");
        assert!(answer.status < 300, "{request}: {answer:?}");
        let closed = client
            .closed_within(keep_alive * 3)
            .await
            .unwrap_or_else(|| panic!("{request}: the idle connection was never closed"));
        assert!(
            closed >= keep_alive - Duration::from_millis(300) && closed < keep_alive * 2,
            "{request}: closed after {closed:?}, not the keep-alive timeout"
        );
    }
}

#[tokio::test]
async fn a_trickled_head_is_cut_at_the_header_read_timeout() {
    let api = Api::start(Duration::from_secs(30)).await;
    let (proxy, _upstream, _dir) = proxy(Duration::from_secs(30)).await;
    for (addr, path) in [(api.addr, "/healthz"), (proxy.addr, "/ok")] {
        // On a fresh connection, and on one kept alive past the header-read
        // timeout: the clock starts at the head's first byte there.
        for kept_alive in [false, true] {
            let mut client = Client::connect(addr).await;
            if kept_alive {
                client.get(path).await.expect("the first answer");
                tokio::time::sleep(HEADER_READ * 2).await;
            }
            let (mut rd, mut wr) = client.stream.split();
            let began = Instant::now();
            wr.write_all(format!("GET {path} HTTP/1.1\r\n").as_bytes())
                .await
                .unwrap();
            // A header line every 250 ms, for longer than the test waits.
            let trickle = async {
                for i in 0..40 {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    let line = format!("X-Slow-{i}: a\r\n");
                    if wr.write_all(line.as_bytes()).await.is_err() {
                        break;
                    }
                }
            };
            let closed = async {
                let mut chunk = [0u8; 1024];
                let read = rd.read(&mut chunk).await;
                (began.elapsed(), read.map(|n| chunk[..n].to_vec()))
            };
            let outcome = tokio::time::timeout(Duration::from_secs(5), async {
                tokio::select! {
                    closed = closed => Some(closed),
                    () = trickle => None,
                }
            })
            .await;
            let Ok(Some((waited, read))) = outcome else {
                panic!("{path} (kept alive: {kept_alive}): the trickled head was never cut");
            };
            assert!(
                read.as_ref().is_err() || read.as_ref().is_ok_and(Vec::is_empty),
                "{path} (kept alive: {kept_alive}): the trickled head was answered: {read:?}"
            );
            assert!(
                waited >= HEADER_READ - Duration::from_millis(100) && waited < HEADER_READ * 3,
                "{path} (kept alive: {kept_alive}): cut after {waited:?}"
            );
        }
    }
}

#[tokio::test]
async fn a_silent_connection_is_cut_at_the_header_read_timeout() {
    let api = Api::start(Duration::from_secs(30)).await;
    let (proxy, _upstream, _dir) = proxy(Duration::from_secs(30)).await;
    for addr in [api.addr, proxy.addr] {
        let mut client = Client::connect(addr).await;
        let closed = client
            .closed_within(HEADER_READ * 5)
            .await
            .expect("a connection that sends nothing is closed");
        assert!(
            closed >= HEADER_READ - Duration::from_millis(300) && closed < HEADER_READ * 3,
            "closed after {closed:?}"
        );
    }
}

#[tokio::test]
async fn a_slow_response_is_never_cut() {
    let keep_alive = Duration::from_secs(2);
    // A body streamed over 4.8 s, 1.2 s between pieces: longer than both
    // timeouts, and each gap longer than the header-read one.
    let (pieces, gap_ms) = (5, 1200);
    let drip = format!("/drip/{pieces}/{gap_ms}");
    let origin = common::upstream::router(std::sync::Arc::new(Counts::default()));
    let (served, _task) = serve(origin, keep_alive).await;
    let (proxy, _upstream, _dir) = proxy(keep_alive).await;
    for addr in [served, proxy.addr] {
        let mut client = Client::connect(addr).await;
        let began = Instant::now();
        let answer = client.get(&drip).await.expect("the whole streamed body");
        assert_eq!(answer.status, 200, "{answer:?}");
        assert_eq!(answer.body.lines().count(), pieces, "{answer:?}");
        assert!(began.elapsed() >= Duration::from_millis(4 * gap_ms));
        // And the connection goes on serving afterwards.
        let again = client.get("/ok").await.expect("the connection is open");
        assert!(again.status < 300, "{again:?}");
    }

    // An answer that is slow to start: a duplicate that waits (`Prefer:
    // wait`) for the key's first request longer than both timeouts.
    let api = Api::start(keep_alive).await;
    let key = fresh_key();
    let first = api.app.reserve(&key, "").await;
    assert_eq!(first.status, 201);
    let mut client = Client::connect(api.addr).await;
    let began = Instant::now();
    let waited = client
        .request(&format!(
            "POST /v1/reservations HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n\
             Prefer: wait=4\r\nContent-Length: 0\r\n\r\n"
        ))
        .await
        .expect("the waiting request is answered");
    assert_eq!(waited.status, 409, "{waited:?}");
    assert!(began.elapsed() >= Duration::from_millis(3500));
}
