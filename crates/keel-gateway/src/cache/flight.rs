//! Request coalescing: while one request (the leader) is generating the answer for a key,
//! identical cacheable requests in this process wait for it instead of going upstream.
//!
//! The leader holds a [`Flight`]; when its answer is stored it publishes the entry and every
//! waiter replays it (see `replay`). If the leader ends without a storable answer (an error, a
//! truncated stream, a client that went away), dropping the flight wakes the waiters with
//! nothing and each goes upstream itself. Waiters do not see the leader's stream live: they get
//! the answer when it is complete. Coalescing is per replica (replicas share answers through
//! Redis once stored, not generations in progress).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::store::Entry;

type Slot = watch::Sender<Option<Arc<Entry>>>;

/// The generations in progress, by key.
#[derive(Default)]
pub struct Flights {
    by_key: Mutex<HashMap<String, (u64, Slot)>>,
    next: AtomicU64,
}

/// How a request joined the key's flight.
pub enum Joined {
    /// No one is generating this answer: this request does, and publishes it.
    Leader(Flight),
    /// Someone is: wait for their answer.
    Waiter(watch::Receiver<Option<Arc<Entry>>>),
}

/// The leader's hold on a key; dropping it ends the flight (waiters without an answer go
/// upstream).
pub struct Flight {
    flights: Arc<Flights>,
    key: String,
    id: u64,
}

impl Flights {
    pub fn join(self: &Arc<Self>, key: &str) -> Joined {
        let mut map = self.by_key.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, tx)) = map.get(key) {
            return Joined::Waiter(tx.subscribe());
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, _) = watch::channel(None);
        map.insert(key.to_owned(), (id, tx));
        Joined::Leader(Flight {
            flights: self.clone(),
            key: key.to_owned(),
            id,
        })
    }

    /// Generations in progress (tests).
    pub fn len(&self) -> usize {
        self.by_key.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Flight {
    /// Hands the stored answer to every waiter.
    pub fn publish(&self, entry: Arc<Entry>) {
        let map = self
            .flights
            .by_key
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((id, tx)) = map.get(&self.key) {
            if *id == self.id {
                tx.send_replace(Some(entry));
            }
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let mut map = self
            .flights
            .by_key
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if map.get(&self.key).is_some_and(|(id, _)| *id == self.id) {
            // Dropping the sender wakes the waiters; those without an answer go upstream.
            map.remove(&self.key);
        }
    }
}

/// Waits for the leader's answer; `None` when the leader ended without one.
pub async fn wait(mut rx: watch::Receiver<Option<Arc<Entry>>>) -> Option<Arc<Entry>> {
    match rx.wait_for(Option::is_some).await {
        Ok(v) => v.clone(),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Arc<Entry> {
        Arc::new(Entry {
            request_id: "r1".into(),
            variant: "v".into(),
            body: serde_json::json!({}),
            output_tokens: 1,
            generation_ms: 1,
            embedding: Vec::new(),
            parameters: String::new(),
        })
    }

    #[tokio::test]
    async fn waiters_get_the_published_answer() {
        let f = Arc::new(Flights::default());
        let Joined::Leader(lead) = f.join("k") else {
            panic!("first is the leader")
        };
        let Joined::Waiter(rx) = f.join("k") else {
            panic!("second waits")
        };
        let waiting = tokio::spawn(wait(rx));
        lead.publish(entry());
        drop(lead);
        assert_eq!(waiting.await.unwrap().unwrap().request_id, "r1");
        assert!(f.is_empty());
    }

    #[tokio::test]
    async fn a_leader_without_an_answer_releases_its_waiters() {
        let f = Arc::new(Flights::default());
        let Joined::Leader(lead) = f.join("k") else {
            panic!()
        };
        let Joined::Waiter(rx) = f.join("k") else {
            panic!()
        };
        let waiting = tokio::spawn(wait(rx));
        drop(lead);
        assert!(waiting.await.unwrap().is_none());
        // The next request leads again.
        assert!(matches!(f.join("k"), Joined::Leader(_)));
    }
}
