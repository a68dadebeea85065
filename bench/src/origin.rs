//! The origin every proxy scenario forwards to: reads the request body and
//! answers `201` with a small JSON body, as a payment API creating a charge
//! would. The same process serves the direct, idemgate and idempotent-proxy
//! runs, so only the proxies differ.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

static EXECUTIONS: AtomicU64 = AtomicU64::new(0);

async fn handle(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let unsafe_method = !req.method().is_safe();
    let _ = req.into_body().collect().await;
    let n = if unsafe_method {
        EXECUTIONS.fetch_add(1, Ordering::Relaxed) + 1
    } else {
        EXECUTIONS.load(Ordering::Relaxed)
    };
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
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_default();
    Ok(resp)
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
