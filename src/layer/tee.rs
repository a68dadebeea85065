//! The pipe a streamed response reaches its client through: the holder
//! pushes each chunk as it arrives (and keeps its own copy for the store),
//! the client's body yields them as hyper writes them out.
//!
//! Within the body limit a push never waits: the holder keeps every chunk
//! anyway, so a slow client costs no memory of its own and never slows the
//! recording. Past the limit the copy is dropped, and pushes wait for the
//! client to take what is queued beyond [`WINDOW`] bytes, as any proxy's
//! flow control does. A client that went away takes nothing: pushes then
//! return at once, and the holder reads its upstream to the end all the
//! same.
//!
//! The body ends cleanly only on [`Tee::end`]. A holder that stops any other
//! way (the upstream broke off, the call was abandoned) ends it with an
//! error, so that hyper cuts the connection rather than write the end of a
//! chunked body: a truncated response is never passed off as whole.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Bytes;
use http_body::{Frame, SizeHint};
use tokio::sync::{Semaphore, mpsc};
use tower::BoxError;

/// Bytes past the body limit that may wait for a slow client.
pub(super) const WINDOW: usize = 256 * 1024;

/// What travels down the pipe.
enum Piece {
    /// A chunk, and the window permits it holds (0 within the limit).
    Data(Bytes, u32),
    /// The response ended whole.
    End,
}

/// The holder's end of the pipe.
pub(super) struct Tee {
    tx: mpsc::UnboundedSender<Piece>,
    window: Arc<Semaphore>,
}

/// The client's end: the body of the response it is sent.
pub(super) struct TeeBody {
    rx: mpsc::UnboundedReceiver<Piece>,
    window: Arc<Semaphore>,
    done: bool,
}

// === impl Tee ===

impl Tee {
    /// A pipe and the body that reads it.
    pub(super) fn new() -> (Tee, TeeBody) {
        let (tx, rx) = mpsc::unbounded_channel();
        let window = Arc::new(Semaphore::new(WINDOW));
        let body = TeeBody {
            rx,
            window: window.clone(),
            done: false,
        };
        (Tee { tx, window }, body)
    }

    /// A pipe whose client is already gone (it had its answer earlier).
    pub(super) fn nobody() -> Tee {
        Tee::new().0
    }

    /// Queues `bytes` without waiting (within the body limit).
    pub(super) fn push(&self, bytes: Bytes) {
        let _ = self.tx.send(Piece::Data(bytes, 0));
    }

    /// Queues `bytes` once the client has room for them (past the body
    /// limit); at once if the client is gone.
    pub(super) async fn push_bounded(&self, bytes: Bytes) {
        let permits = u32::try_from(bytes.len().min(WINDOW)).unwrap_or(u32::MAX);
        tokio::select! {
            permit = self.window.acquire_many(permits) => {
                if let Ok(permit) = permit {
                    // Given back by the body when it yields the chunk.
                    permit.forget();
                    let _ = self.tx.send(Piece::Data(bytes, permits));
                }
            }
            () = self.tx.closed() => {}
        }
    }

    /// Ends the body whole.
    pub(super) fn end(self) {
        let _ = self.tx.send(Piece::End);
    }
}

// === impl TeeBody ===

impl http_body::Body for TeeBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match std::task::ready!(self.rx.poll_recv(cx)) {
            Some(Piece::Data(bytes, permits)) => {
                if permits > 0 {
                    self.window.add_permits(permits as usize);
                }
                Poll::Ready(Some(Ok(Frame::data(bytes))))
            }
            Some(Piece::End) => {
                self.done = true;
                Poll::Ready(None)
            }
            None => {
                self.done = true;
                Poll::Ready(Some(Err(
                    "the response broke off before its end; whether it acted in full is unknown"
                        .into(),
                )))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn ends_whole_only_when_told() {
        let (tee, body) = Tee::new();
        tee.push(Bytes::from_static(b"a"));
        tee.push(Bytes::from_static(b"b"));
        tee.end();
        let got = body.collect().await.unwrap().to_bytes();
        assert_eq!(&got[..], b"ab");

        let (tee, body) = Tee::new();
        tee.push(Bytes::from_static(b"a"));
        drop(tee);
        assert!(
            body.collect().await.is_err(),
            "a dropped tee is a broken body"
        );
    }

    #[tokio::test]
    async fn past_the_limit_a_push_waits_for_the_client() {
        let (tee, mut body) = Tee::new();
        tee.push_bounded(Bytes::from(vec![0; WINDOW])).await;
        let second = tee.push_bounded(Bytes::from_static(b"more"));
        tokio::pin!(second);
        assert!(
            futures::poll!(second.as_mut()).is_pending(),
            "the window is full"
        );
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap().len(), WINDOW);
        second.await;
        drop(body);
        // The client is gone: nothing waits.
        tee.push_bounded(Bytes::from(vec![0; WINDOW])).await;
        tee.push_bounded(Bytes::from(vec![0; WINDOW])).await;
        assert!(tee.tx.is_closed());
    }
}
