//! Graceful shutdown of one listener's connections: at the signal each
//! connection finishes the request it is serving and closes, and the
//! listener waits until every one has.
//!
//! hyper-util's `GracefulShutdown` does the same, but watches only
//! connections that cannot switch protocols. A connection that has switched
//! (a WebSocket, after its `101`) has left hyper and is not waited for: it
//! is its protocol's to close, and it lives no longer than the process.

use tokio::sync::watch;

/// The signalling half, kept by the accept loop.
#[derive(Debug)]
pub struct Drain {
    tx: watch::Sender<bool>,
}

/// One connection's half: held by its task until the connection ends, so
/// that [`Drain::drain`] knows when every connection has.
#[derive(Debug)]
pub struct Watch {
    rx: watch::Receiver<bool>,
}

// === impl Drain ===

impl Drain {
    /// A drain with no connection yet.
    pub fn new() -> Drain {
        let (tx, _) = watch::channel(false);
        Drain { tx }
    }

    /// A watch for a connection just accepted.
    pub fn watch(&self) -> Watch {
        Watch {
            rx: self.tx.subscribe(),
        }
    }

    /// Tells every connection to finish, and resolves once all their
    /// watches are dropped.
    pub async fn drain(self) {
        let _ = self.tx.send(true);
        self.tx.closed().await;
    }
}

// === impl Watch ===

impl Watch {
    /// Resolves when the listener shuts down (or was dropped).
    pub async fn signalled(&mut self) {
        let _ = self.rx.wait_for(|stop| *stop).await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn drain_signals_every_watch_and_waits_until_they_are_dropped() {
        let drain = Drain::new();
        let mut watch = drain.watch();
        let mut draining = tokio::spawn(drain.drain());
        tokio::time::timeout(Duration::from_secs(1), watch.signalled())
            .await
            .expect("a connection is told to finish");
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut draining)
                .await
                .is_err(),
            "the drain ended with a connection still open"
        );
        drop(watch);
        tokio::time::timeout(Duration::from_secs(1), draining)
            .await
            .expect("the drain ends once every connection has")
            .unwrap();
    }
}
