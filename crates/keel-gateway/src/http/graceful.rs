//! Graceful shutdown of client connections: the accept loop hands each connection a
//! [`Watcher`]; [`GracefulShutdown::shutdown`] tells them all to finish (HTTP/1.1 closes after
//! the response in flight, HTTP/2 sends GOAWAY) and waits until every one has ended.
//!
//! Why not hyper-util's: its watcher takes the connection whole, so nothing else may ask the
//! connection to close gracefully; an HTTP/2 connection with no open stream for its idle
//! timeout must (see `connection`). This is the same mechanism (a watch channel whose
//! receivers the connections hold until they end) with the signal in the connection's hands.

use tokio::sync::watch;

/// The accept loop's side.
pub struct GracefulShutdown {
    tx: watch::Sender<()>,
}

/// One connection's side: held until the connection ends.
pub struct Watcher {
    rx: watch::Receiver<()>,
}

impl GracefulShutdown {
    pub fn new() -> GracefulShutdown {
        GracefulShutdown {
            tx: watch::channel(()).0,
        }
    }

    /// A watcher for one more connection.
    pub fn watcher(&self) -> Watcher {
        Watcher {
            rx: self.tx.subscribe(),
        }
    }

    /// Tells every connection to finish, and waits until all have ended.
    pub async fn shutdown(self) {
        let GracefulShutdown { tx } = self;
        let _ = tx.send(());
        tx.closed().await;
    }
}

impl Default for GracefulShutdown {
    fn default() -> Self {
        GracefulShutdown::new()
    }
}

impl Watcher {
    /// Resolves once shutdown has begun (at once if it began before this was called).
    pub async fn started(&mut self) {
        // An error means the accept loop's side is gone: shutting down too.
        let _ = self.rx.changed().await;
    }
}
