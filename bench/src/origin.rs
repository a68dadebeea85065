//! The origin every proxy scenario forwards to: reads the request body and
//! answers `201` with a small JSON body, as a payment API creating a charge
//! would. `POST /v1/stream` answers as a model API streams: a
//! `text/event-stream` whose first event is sent at once and whose second
//! and last follows [`STREAM_GAP`] later. The same process serves the
//! direct, idemgate and idempotent-proxy runs, so only the proxies differ.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

static EXECUTIONS: AtomicU64 = AtomicU64::new(0);

/// The pause between a stream's first event and its last.
pub const STREAM_GAP: Duration = Duration::from_millis(10);
/// A stream's first event.
pub const FIRST_EVENT: &[u8] = b"event: token\ndata: {\"text\":\"Hello\"}\n\n";
/// A stream's last event.
pub const LAST_EVENT: &[u8] = b"event: done\ndata: [DONE]\n\n";

type Body = BoxBody<Bytes, Infallible>;

async fn handle(req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let unsafe_method = !req.method().is_safe();
    let stream = req.uri().path() == "/v1/stream";
    let _ = req.into_body().collect().await;
    let n = if unsafe_method {
        EXECUTIONS.fetch_add(1, Ordering::Relaxed) + 1
    } else {
        EXECUTIONS.load(Ordering::Relaxed)
    };
    if stream {
        return Ok(event_stream());
    }
    let body = format!(
        r#"{{"id":"ch_{n:012}","object":"charge","amount":1000,"currency":"eur","status":"succeeded"}}"#
    );
    let resp = Response::builder()
        .status(if unsafe_method {
            StatusCode::CREATED
        } else {
            StatusCode::OK
        })
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)).boxed())
        .unwrap_or_default();
    Ok(resp)
}

/// Two events, [`STREAM_GAP`] apart, chunked.
fn event_stream() -> Response<Body> {
    let events = futures::stream::unfold(0u8, |step| async move {
        let event = match step {
            0 => FIRST_EVENT,
            1 => {
                tokio::time::sleep(STREAM_GAP).await;
                LAST_EVENT
            }
            _ => return None,
        };
        let frame = Frame::data(Bytes::from_static(event));
        Some((Ok::<_, Infallible>(frame), step + 1))
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(StreamBody::new(events).boxed())
        .unwrap_or_default()
}

/// Serves until the process ends.
pub async fn serve(listen: SocketAddr) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    println!("origin listening on {}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service_fn(handle))
                .await;
        });
    }
}
