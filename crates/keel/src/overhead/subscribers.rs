//! `keel bench overhead --event-subscribers N`: N open dashboards, simulated by readers of
//! keel's `/keel/events` stream that stay subscribed while keel is measured, so that the added
//! latency can be compared with a run without them (what an open dashboard costs the gateway).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::task::JoinHandle;

/// The readers; dropping it closes them.
pub struct Subscribers {
    tasks: Vec<JoinHandle<()>>,
    /// Snapshots received, all readers together.
    events: Arc<AtomicU64>,
}

impl Subscribers {
    /// Opens `n` readers of `gateway`'s `/keel/events` (`gateway`: `http://host:port`); fails
    /// when keel refuses one.
    pub async fn open(client: &reqwest::Client, gateway: &str, n: usize) -> Result<Self, String> {
        let events = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for _ in 0..n {
            let mut resp = client
                .get(format!("{gateway}/keel/events"))
                .send()
                .await
                .map_err(|e| format!("/keel/events: {e}"))?;
            if !resp.status().is_success() {
                return Err(format!("/keel/events answered {}", resp.status()));
            }
            let count = events.clone();
            tasks.push(tokio::spawn(async move {
                // Reads like a page: every byte, counting the events (one per blank line).
                while let Ok(Some(chunk)) = resp.chunk().await {
                    let n = chunk.windows(2).filter(|w| w == b"\n\n").count();
                    count.fetch_add(n as u64, Ordering::Relaxed);
                }
            }));
        }
        Ok(Subscribers { tasks, events })
    }

    pub fn events(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }
}

impl Drop for Subscribers {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
