//! A bare HTTP/1.1 client over one kept-alive connection per worker, so the
//! load generator itself costs as little as possible.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// One connection to one server.
pub struct Conn {
    addr: SocketAddr,
    host: String,
    sender: Option<SendRequest<Full<Bytes>>>,
}

/// A response, read whole.
pub struct Answer {
    /// Its status.
    pub status: StatusCode,
    /// Its body.
    pub body: Bytes,
}

impl Conn {
    /// A connection to `addr`, opened on first use (and again after an error).
    pub fn new(addr: SocketAddr) -> Conn {
        Conn {
            addr,
            host: addr.to_string(),
            sender: None,
        }
    }

    async fn sender(&mut self) -> anyhow::Result<&mut SendRequest<Full<Bytes>>> {
        if self.sender.as_ref().is_none_or(|s| s.is_closed()) {
            let stream = TcpStream::connect(self.addr)
                .await
                .with_context(|| format!("connect to {}", self.addr))?;
            stream.set_nodelay(true)?;
            let (sender, conn) = http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            self.sender = Some(sender);
        }
        self.sender.as_mut().context("the connection is not open")
    }

    /// Sends a request and reads the whole answer.
    pub async fn send(
        &mut self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> anyhow::Result<Answer> {
        let req = self.request(method, path, headers, body)?;
        let result = async {
            let sender = self.sender().await?;
            sender.ready().await?;
            let resp = sender.send_request(req).await?;
            let status = resp.status();
            let body = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok(Answer { status, body })
        }
        .await;
        if result.is_err() {
            // Start over on a fresh connection next time.
            self.sender = None;
        }
        result
    }

    /// A request to this connection's host.
    fn request(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> anyhow::Result<Request<Full<Bytes>>> {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, &self.host);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        Ok(req.body(Full::new(body))?)
    }

    /// A POST whose answer is a stream: the time from sending it to the
    /// first byte of the body, and the whole body, read to its end.
    pub async fn first_byte(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> anyhow::Result<(Duration, Bytes)> {
        let mut req = self.request(Method::POST, path, headers, body)?;
        req.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        let result = async {
            let sender = self.sender().await?;
            sender.ready().await?;
            let sent = Instant::now();
            let resp = sender.send_request(req).await?;
            anyhow::ensure!(
                resp.status() == StatusCode::OK,
                "POST {path}: expected 200, got {}",
                resp.status()
            );
            let mut body = resp.into_body();
            let mut first = None;
            let mut all = Vec::new();
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame?.into_data()
                    && !data.is_empty()
                {
                    first.get_or_insert_with(|| sent.elapsed());
                    all.extend_from_slice(&data);
                }
            }
            let first = first.context("the stream had no body")?;
            anyhow::Ok((first, Bytes::from(all)))
        }
        .await;
        if result.is_err() {
            self.sender = None;
        }
        result
    }

    /// A POST with a JSON body, expecting `expected`.
    pub async fn post_json(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
        expected: StatusCode,
    ) -> anyhow::Result<Bytes> {
        let mut all = Vec::with_capacity(headers.len() + 1);
        all.push(("content-type", "application/json"));
        all.extend_from_slice(headers);
        let answer = self.send(Method::POST, path, &all, body).await?;
        if answer.status != expected {
            anyhow::bail!(
                "POST {path}: expected {expected}, got {}: {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            );
        }
        Ok(answer.body)
    }

    /// True once a GET of `path` answers 200.
    pub async fn get_ok(&mut self, path: &str) -> bool {
        matches!(
            self.send(Method::GET, path, &[], Bytes::new()).await,
            Ok(a) if a.status == StatusCode::OK
        )
    }
}
