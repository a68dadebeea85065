//! Per-connection timers of the HTTP/1 listeners: how long a connection may
//! sit idle between two requests (the keep-alive timeout), and how long a
//! client has to send a request head (the header-read timeout).
//!
//! hyper's own header-read timer starts whenever hyper begins reading the
//! next head, idle or not, so it also closed every idle keep-alive connection
//! after the header-read timeout: sooner than a client told to come back by
//! `Retry-After` returns, which then writes into a dead pooled connection.
//! hyper's timer is off instead, and each accepted stream is a [`TimedIo`]
//! that knows which phase its connection is in:
//!
//! 1. fresh: accepted, nothing read yet; the header-read timeout, counted
//!    from the accept;
//! 2. idle: the last response was written whole; the keep-alive timeout,
//!    counted from its last byte written;
//! 3. head: bytes of a request came in and its service has not been called;
//!    the header-read timeout, from the accept on a fresh connection, else
//!    from the first byte;
//! 4. busy: from the service call until the response body is dropped (sent,
//!    or abandoned); no timer. A request body has its own idle timeout
//!    ([`crate::body::BodyIdleTimeout`]), and a response that is still streaming
//!    is never cut;
//! 5. upgraded: the service answered `101 Switching Protocols`, and the stream
//!    now carries another protocol (a WebSocket) until either side closes it;
//!    no timer, for its silences are that protocol's business (its pings),
//!    not an idle HTTP connection's.
//!
//! The timer is looked at only when a read would block; once it has passed,
//! that read ends the connection: an end of stream where no request had
//! begun (hyper closes quietly), a `TimedOut` error in the middle of a head.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use axum::body::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The two timeouts a connection lives by.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// The most a client may take to send a request head.
    pub header_read: Duration,
    /// The most a connection may wait idle for its next request.
    pub keep_alive: Duration,
}

/// An accepted stream that ends itself when its connection's timer passes.
#[derive(Debug)]
pub struct TimedIo<T> {
    io: T,
    tracker: Tracker,
    timeouts: Timeouts,
    /// Made on the first read that blocks, then reset: one per connection.
    timer: Option<(Instant, Pin<Box<Sleep>>)>,
}

/// The phase of one connection, shared by its stream, its service and its
/// response bodies.
#[derive(Debug, Clone)]
pub struct Tracker(Arc<Mutex<State>>);

/// Held from a request's service call until its response body is dropped:
/// the connection is busy meanwhile.
#[derive(Debug)]
pub struct Busy {
    tracker: Tracker,
    request: u64,
}

/// A response body that marks its connection idle once hyper drops it.
#[derive(Debug)]
pub struct TrackedBody {
    inner: axum::body::Body,
    _busy: Busy,
}

#[derive(Debug)]
struct State {
    phase: Phase,
    /// When the current phase's clock started.
    since: Instant,
    /// Counts service calls, so that a late drop of an old response body
    /// cannot mark a newer request's connection idle.
    request: u64,
    /// The task that last found the stream empty: woken when the
    /// connection turns idle, so that the keep-alive timer starts running
    /// even if hyper would not read again before bytes arrive.
    reader: Option<Waker>,
    /// Requests whose response body is not dropped yet: an HTTP/2
    /// connection runs several at once.
    in_flight: usize,
    /// When `in_flight` last fell to 0 (or the accept).
    quiet_since: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Fresh,
    Idle,
    Head,
    Busy,
    Upgraded,
}

// === impl TimedIo ===

impl<T> TimedIo<T> {
    /// `io`, a just-accepted stream, under `timeouts`; `tracker` is the one
    /// its service marks requests with.
    pub fn new(io: T, tracker: Tracker, timeouts: Timeouts) -> TimedIo<T> {
        TimedIo {
            io,
            tracker,
            timeouts,
            timer: None,
        }
    }

    /// After a read found nothing: pending, or the end of the connection if
    /// its phase's time is up.
    fn poll_timer(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some((deadline, mid_head)) = self.tracker.deadline(cx.waker(), self.timeouts) else {
            return Poll::Pending;
        };
        let (at, sleep) = self
            .timer
            .get_or_insert_with(|| (deadline, Box::pin(tokio::time::sleep_until(deadline))));
        if *at != deadline {
            sleep.as_mut().reset(deadline);
            *at = deadline;
        }
        ready!(sleep.as_mut().poll(cx));
        Poll::Ready(if mid_head {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the request head did not arrive within the header read timeout",
            ))
        } else {
            Ok(())
        })
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for TimedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.tracker.bytes_read();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => this.poll_timer(cx),
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for TimedIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = ready!(Pin::new(&mut this.io).poll_write(cx, buf))?;
        this.tracker.bytes_written(written);
        Poll::Ready(Ok(written))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = ready!(Pin::new(&mut this.io).poll_write_vectored(cx, bufs))?;
        this.tracker.bytes_written(written);
        Poll::Ready(Ok(written))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

// === impl Tracker ===

impl Tracker {
    /// The tracker of a connection accepted now.
    pub fn new() -> Tracker {
        Tracker(Arc::new(Mutex::new(State {
            phase: Phase::Fresh,
            since: Instant::now(),
            request: 0,
            reader: None,
            in_flight: 0,
            quiet_since: Instant::now(),
        })))
    }

    /// The service is called for a request: busy until the returned guard
    /// (carried by the response body) is dropped.
    pub fn request(&self) -> Busy {
        let mut state = self.lock();
        state.phase = Phase::Busy;
        state.request = state.request.wrapping_add(1);
        state.in_flight += 1;
        Busy {
            tracker: self.clone(),
            request: state.request,
        }
    }

    /// The service answered `101 Switching Protocols`: from now on the
    /// stream is another protocol's, and no timer ends it.
    pub fn upgraded(&self) {
        self.lock().phase = Phase::Upgraded;
    }

    /// Since when no request has been running on the connection; `None`
    /// while one is. What an HTTP/2 connection's idle timer goes by.
    pub fn quiet_since(&self) -> Option<Instant> {
        let state = self.lock();
        (state.in_flight == 0).then_some(state.quiet_since)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code under the lock can panic; should one ever, the phase is
        // still a phase.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bytes_read(&self) {
        let mut state = self.lock();
        match state.phase {
            // A fresh connection's head keeps the clock started at accept.
            Phase::Fresh => state.phase = Phase::Head,
            Phase::Idle => {
                state.phase = Phase::Head;
                state.since = Instant::now();
            }
            Phase::Head | Phase::Busy | Phase::Upgraded => {}
        }
    }

    /// The end of a response may still be on its way out after its body
    /// was dropped: the idle clock starts at its last byte.
    fn bytes_written(&self, written: usize) {
        if written == 0 {
            return;
        }
        let mut state = self.lock();
        if state.phase == Phase::Idle {
            state.since = Instant::now();
        }
    }

    /// When the current phase's time is up, and whether a head was being
    /// read then; `None` while busy or upgraded. Remembers `waker` as the
    /// reader.
    fn deadline(&self, waker: &Waker, timeouts: Timeouts) -> Option<(Instant, bool)> {
        let mut state = self.lock();
        if !state.reader.as_ref().is_some_and(|r| r.will_wake(waker)) {
            state.reader = Some(waker.clone());
        }
        let (limit, mid_head) = match state.phase {
            Phase::Fresh => (timeouts.header_read, false),
            Phase::Idle => (timeouts.keep_alive, false),
            Phase::Head => (timeouts.header_read, true),
            Phase::Busy | Phase::Upgraded => return None,
        };
        Some((state.since + limit, mid_head))
    }
}

impl Default for Tracker {
    fn default() -> Tracker {
        Tracker::new()
    }
}

// === impl Busy ===

impl Drop for Busy {
    fn drop(&mut self) {
        let reader = {
            let mut state = self.tracker.lock();
            state.in_flight = state.in_flight.saturating_sub(1);
            if state.in_flight == 0 {
                state.quiet_since = Instant::now();
            }
            if state.request != self.request || state.phase != Phase::Busy {
                return;
            }
            state.phase = Phase::Idle;
            state.since = Instant::now();
            state.reader.take()
        };
        if let Some(reader) = reader {
            reader.wake();
        }
    }
}

// === impl TrackedBody ===

impl TrackedBody {
    /// `inner`, keeping its connection busy until it is dropped.
    pub fn new(inner: axum::body::Body, busy: Busy) -> TrackedBody {
        TrackedBody { inner, _busy: busy }
    }
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    // Forwarded, so that hyper still sees an empty or sized body as such
    // (a Content-Length rather than chunks).
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
