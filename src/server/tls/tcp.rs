//! The TCP connections to an upstream, as a client's pool keeps them: a
//! [`TcpIo`] asks the socket itself whenever tokio would call it not
//! readable, so that a connection the upstream closed while it sat idle is
//! known closed before a request is written on it.
//!
//! tokio calls a socket readable only once its reactor has seen the event,
//! and a busy runtime sees it late: until then an idle connection whose
//! `FIN` has already arrived still reads as pending, the pool counts it
//! open, and hyper writes the next request into it. The upstream, which
//! closed it, never gets that request — but the proxy cannot tell it from
//! one the upstream read before hanging up, so the key would be held
//! outcome-unknown. hyper reads an idle connection before it writes the next
//! request on it; when that read finds the end of the stream, hyper hands the
//! request back unwritten and the pool sends it on another connection. The
//! gap left is the few microseconds between that read and the write, and an
//! upstream that closes just as the request is on its way: the pool's idle
//! timeout, below the upstream's keep-alive, is what keeps a request off
//! such a connection at all.

use std::future::Future;
use std::io::{self, Read as _};
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tower::Service;

/// The most read straight off the socket at once, when tokio has not seen
/// it readable yet.
const DIRECT_READ: usize = 16 * 1024;

/// [`HttpConnector`], its streams made [`TcpIo`].
#[derive(Debug, Clone)]
pub struct TcpConnector {
    inner: HttpConnector,
}

impl TcpConnector {
    pub fn new(inner: HttpConnector) -> TcpConnector {
        TcpConnector { inner }
    }
}

impl Service<Uri> for TcpConnector {
    type Response = TokioIo<TcpIo>;
    type Error = <HttpConnector as Service<Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<TokioIo<TcpIo>, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let stream = connecting.await?.into_inner();
            Ok(TokioIo::new(TcpIo { stream }))
        })
    }
}

/// A connection to the upstream whose reads do not wait for tokio's
/// reactor to learn of an end of stream, a reset, or bytes that arrived.
#[derive(Debug)]
pub struct TcpIo {
    stream: TcpStream,
}

impl TcpIo {
    /// What the socket holds now, asked directly: a read tokio has just left
    /// pending (its waker registered) is finished here if the kernel has an
    /// end of stream, an error or bytes for it already.
    fn poll_direct(&self, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let socket = socket2::SockRef::from(&self.stream);
        let mut probe = [MaybeUninit::<u8>::uninit(); 1];
        match socket.peek(&mut probe) {
            // The end of the stream: a read would find nothing more.
            Ok(0) => Poll::Ready(Ok(())),
            Ok(_) => {
                let want = buf.remaining().min(DIRECT_READ);
                if want == 0 {
                    return Poll::Pending;
                }
                match (&*socket).read(buf.initialize_unfilled_to(want)) {
                    Ok(n) => {
                        buf.advance(n);
                        Poll::Ready(Ok(()))
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Poll::Pending,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => Poll::Pending,
                    Err(e) => Poll::Ready(Err(e)),
                }
            }
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncRead for TcpIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Pending => this.poll_direct(buf),
            ready => ready,
        }
    }
}

impl AsyncWrite for TcpIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl Connection for TcpIo {
    fn connected(&self) -> Connected {
        self.stream.connected()
    }
}
