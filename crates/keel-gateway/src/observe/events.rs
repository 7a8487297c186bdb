//! The dashboard's snapshot stream: the latest snapshot, published once per tick, and who
//! listens. It outlives config generations (a reload keeps the open dashboards); the ticker that
//! builds snapshots and the endpoint that serves them are the operations plane's
//! (`admin::events`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::watch;

/// The published snapshots and who listens.
pub struct Hub {
    /// The latest snapshot as one server-sent event; empty while nobody listens.
    latest: watch::Sender<Bytes>,
    subscribers: Arc<AtomicUsize>,
}

impl Default for Hub {
    fn default() -> Self {
        Hub {
            latest: watch::Sender::new(Bytes::new()),
            subscribers: Arc::new(AtomicUsize::new(0)),
        }
    }
}

/// A subscriber's place: released when its stream is dropped (the client went away).
pub struct Place(Arc<AtomicUsize>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Hub {
    /// Subscribers now.
    pub fn subscribers(&self) -> usize {
        self.subscribers.load(Ordering::Relaxed)
    }

    /// A place among at most `max` subscribers and the snapshots from now on, or `None` when
    /// `max` already listen.
    pub fn join(&self, max: usize) -> Option<(Place, watch::Receiver<Bytes>)> {
        self.subscribers
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some((Place(self.subscribers.clone()), self.latest.subscribe()))
    }

    /// Publishes a snapshot to every subscriber.
    pub fn publish(&self, event: Bytes) {
        self.latest.send_replace(event);
    }

    /// Nobody listens: drops the last snapshot, so that the next subscriber gets a fresh one
    /// rather than one from before a quiet spell.
    pub fn forget(&self) {
        if !self.latest.borrow().is_empty() {
            self.latest.send_replace(Bytes::new());
        }
    }
}
