//! Request coalescing: while one request (the leader) is generating the answer for a key,
//! identical cacheable requests in this process wait for it instead of going upstream.
//!
//! The leader holds a [`Flight`]; when its answer is stored it publishes the entry and every
//! waiter replays it (see `replay`). If the leader ends without a storable answer (an error, a
//! truncated stream, a client that went away), dropping the flight wakes the waiters with
//! nothing and each goes upstream itself.
//!
//! **Streams fan out live.** A streaming leader keeps a [`LeaderStream`] log: an append-only list of
//! the batches of events its relay produced (whole events, in the client's protocol, before any
//! Responses front), with a version that wakes readers. Every reader — the leader's own client
//! and each follower — keeps its own offset into the log and is sent from there at its own
//! pace; the relay appends without waiting for anyone (it runs in a task of its own, see
//! `delivery`), so a slow reader holds back neither the generation nor the other readers. A
//! streaming waiter whose stream would be byte-equal (same requested model name, same
//! `stream_options`: [`stream_shape`]) *follows*: it is sent what was produced so far, then each
//! batch as it comes, and ends when the leader's stream ends — cleanly after its terminal event
//! (keel's error event included, so a leader that fails mid-stream ends every follower with the
//! same error), or, if the leader's relay vanished, with keel's error event and an abort. A
//! follower that joined before the leader's first byte and sees the leader fail before it goes
//! upstream itself, as a whole waiter does. While anyone reads, the leader's relay keeps
//! generating after its own client has gone (see `relay::sink`). Waiters of another shape, and
//! whole waiters, get the answer when it is complete. Coalescing is per replica (replicas share
//! answers through Redis once stored, not generations in progress).
//!
//! Memory: the log holds the answer's bytes (shared `Bytes`, never copied per reader) until the
//! flight and its last reader are gone, so a reader far behind costs its offset and nothing
//! more; the log is as large as the answer the leader's client gets, which the assembled copy
//! beside it bounds to `keel_core::assemble::MAX_ASSEMBLED_BYTES` (past that the stream is
//! neither stored nor followed further, see [`LeaderWriter::append`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde_json::{Map, Value};
use tokio::sync::watch;

use super::store::Entry;
use crate::wire::body::BodySender;

/// The most bytes a live log holds: the bound an assembled answer has (the copy the cache
/// stores is assembled beside the log, so a longer stream could not be stored anyway).
pub const MAX_LIVE_BYTES: usize = keel_core::assemble::MAX_ASSEMBLED_BYTES;

type Slot = watch::Sender<Option<Arc<Entry>>>;

/// A flight in the map: its id, the answer's slot, and the leader's live log when it streams.
struct InFlight {
    id: u64,
    slot: Slot,
    live: Option<Arc<LeaderStream>>,
}

/// The generations in progress, by key.
#[derive(Default)]
pub struct Flights {
    by_key: Mutex<HashMap<String, InFlight>>,
    next: AtomicU64,
}

/// How a request joined the key's flight.
pub enum Joined {
    /// No one is generating this answer: this request does, and publishes it.
    Leader(Flight),
    /// Someone is: wait for their answer, or follow their stream live when it has one.
    Waiter(
        watch::Receiver<Option<Arc<Entry>>>,
        Option<Arc<LeaderStream>>,
    ),
}

/// The leader's hold on a key; dropping it ends the flight (waiters without an answer go
/// upstream).
pub struct Flight {
    flights: Arc<Flights>,
    key: String,
    id: u64,
    /// The live log's writing end, taken by the streaming relay.
    live: Option<LeaderWriter>,
}

impl Flights {
    /// Joins the key's flight. `stream` is, when this request streams, its [`stream_shape`] and
    /// request id: as the leader it then keeps a live log for followers.
    pub fn join(self: &Arc<Self>, key: &str, stream: Option<(String, String)>) -> Joined {
        let mut map = self.by_key.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = map.get(key) {
            return Joined::Waiter(f.slot.subscribe(), f.live.clone());
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (slot, _) = watch::channel(None);
        let live = stream.map(|(shape, origin)| Arc::new(LeaderStream::new(shape, origin)));
        map.insert(
            key.to_owned(),
            InFlight {
                id,
                slot,
                live: live.clone(),
            },
        );
        Joined::Leader(Flight {
            flights: self.clone(),
            key: key.to_owned(),
            id,
            live: live.map(LeaderWriter),
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
        if let Some(f) = map.get(&self.key) {
            if f.id == self.id {
                f.slot.send_replace(Some(entry));
            }
        }
    }

    /// The live log's writing end, for the relay that streams the leader's answer.
    pub fn take_live(&mut self) -> Option<LeaderWriter> {
        self.live.take()
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let mut map = self
            .flights
            .by_key
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if map.get(&self.key).is_some_and(|f| f.id == self.id) {
            // Dropping the sender wakes the waiters; those without an answer go upstream.
            map.remove(&self.key);
        }
    }
}

/// What makes two streams of the same answer byte-equal: the model name the client asked for
/// (answers name it) and `stream_options` (whether a usage chunk comes), which the cache key
/// leaves out.
pub fn stream_shape(model: &str, body: &Map<String, Value>) -> String {
    match body.get("stream_options") {
        Some(o) => format!("{model}\n{o}"),
        None => model.to_owned(),
    }
}

/// A streaming leader's events as its client was sent them, for followers.
pub struct LeaderStream {
    shape: String,
    /// The leader's request id (followers' decision records name it).
    origin: String,
    log: Mutex<LeaderLog>,
    /// Bumped on every append and at the end (readers wait on it).
    version: watch::Sender<u64>,
    /// How many read now: the leader's own client and its followers (the leader's relay goes
    /// on while anyone does).
    followers: watch::Sender<usize>,
}

#[derive(Default)]
struct LeaderLog {
    batches: Vec<Bytes>,
    /// The bytes of `batches`.
    bytes: usize,
    variant: String,
    /// `Some(clean)` once the leader's stream ended: cleanly after its terminal event, or not.
    end: Option<bool>,
}

impl LeaderStream {
    fn new(shape: String, origin: String) -> LeaderStream {
        LeaderStream {
            shape,
            origin,
            log: Mutex::new(LeaderLog::default()),
            version: watch::channel(0).0,
            followers: watch::channel(0).0,
        }
    }

    fn log(&self) -> std::sync::MutexGuard<'_, LeaderLog> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Whether a waiter of `shape` would be sent exactly these bytes.
    pub fn fits(&self, shape: &str) -> bool {
        self.shape == shape
    }

    /// Whether anyone reads now (the leader's client, or a follower).
    pub fn followed(&self) -> bool {
        *self.followers.borrow() > 0
    }

    /// Resolves when no one reads (at once if no one does).
    pub async fn unfollowed(&self) {
        let mut rx = self.followers.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    /// A reader from the log's start, at once: the leader's own client.
    pub fn reader(self: &Arc<Self>) -> Follower {
        self.followers.send_modify(|n| *n += 1);
        Follower {
            live: self.clone(),
            next: 0,
            version: self.version.subscribe(),
        }
    }

    /// Follows the leader's stream once it has begun: `None` when it ended before its first
    /// byte or uncleanly (the waiter then goes upstream itself).
    pub async fn follow(self: &Arc<Self>) -> Option<Follower> {
        let follower = self.reader();
        let mut rx = self.version.subscribe();
        loop {
            rx.borrow_and_update();
            {
                // A stream that ended uncleanly is not followed even when it had begun: nothing
                // was sent to this client yet, so it can still go upstream itself.
                let log = self.log();
                match log.end {
                    Some(false) => return None,
                    Some(true) => return Some(follower),
                    None if !log.batches.is_empty() => return Some(follower),
                    None => {}
                }
            }
            if rx.changed().await.is_err() {
                return None;
            }
        }
    }
}

/// The relay's end of a live log. Dropped without [`LeaderWriter::end`], the stream is marked as
/// ended uncleanly (followers end with keel's error event).
pub struct LeaderWriter(Arc<LeaderStream>);

impl LeaderWriter {
    /// Appends a batch of whole events for every reader; false (nothing appended) when the log
    /// would grow past [`MAX_LIVE_BYTES`].
    pub fn append(&self, batch: Bytes) -> bool {
        {
            let mut log = self.0.log();
            if log.bytes + batch.len() > MAX_LIVE_BYTES {
                return false;
            }
            log.bytes += batch.len();
            log.batches.push(batch);
        }
        self.0.bump();
        true
    }

    /// Names the variant generating (followers report it).
    pub fn serving(&self, variant: &str) {
        variant.clone_into(&mut self.0.log().variant);
    }

    pub fn live(&self) -> &Arc<LeaderStream> {
        &self.0
    }

    /// The leader's stream ended after its terminal event.
    pub fn end(self) {
        self.close(true);
    }

    fn close(&self, clean: bool) {
        self.0.log().end.get_or_insert(clean);
        self.0.bump();
    }
}

impl Drop for LeaderWriter {
    fn drop(&mut self) {
        self.close(false);
    }
}

/// One follower of a live log; dropping it stops following.
pub struct Follower {
    live: Arc<LeaderStream>,
    next: usize,
    version: watch::Receiver<u64>,
}

/// What a follower gets next.
pub enum Next {
    /// Batches of whole events, in order.
    Batches(Vec<Bytes>),
    /// The leader's stream ended: cleanly after its terminal event, or not.
    End { clean: bool },
}

impl Follower {
    /// The variant generating the answer.
    pub fn variant(&self) -> String {
        self.live.log().variant.clone()
    }

    /// The id of the request whose stream this is.
    pub fn origin(&self) -> &str {
        &self.live.origin
    }

    /// The batches not yet taken, waiting for more; the end once all were taken.
    pub async fn next(&mut self) -> Next {
        loop {
            self.version.borrow_and_update();
            {
                let log = self.live.log();
                if self.next < log.batches.len() {
                    let batches = log.batches[self.next..].to_vec();
                    self.next = log.batches.len();
                    return Next::Batches(batches);
                }
                if let Some(clean) = log.end {
                    return Next::End { clean };
                }
            }
            if self.version.changed().await.is_err() {
                return Next::End { clean: false };
            }
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.live
            .followers
            .send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// How forwarding a live log to a client ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Forwarded {
    /// After the stream's terminal event: the client's body ended cleanly.
    Ended,
    /// The leader's relay vanished before the end: the client's body was left without its end
    /// (it sends keel's error event and aborts, as any body whose producer is gone).
    Cut,
    /// The client went away.
    ClientGone,
}

/// Sends a client everything in the log from the reader's offset, batch by batch as it comes,
/// at the client's own pace, and ends its body as the leader's stream ended.
pub async fn forward(mut reader: Follower, tx: BodySender) -> Forwarded {
    loop {
        let next = tokio::select! {
            n = reader.next() => n,
            _ = tx.closed() => return Forwarded::ClientGone,
        };
        match next {
            Next::Batches(batches) => {
                for b in batches {
                    if !tx.send(b).await {
                        return Forwarded::ClientGone;
                    }
                }
            }
            Next::End { clean: true } => {
                tx.end().await;
                return Forwarded::Ended;
            }
            Next::End { clean: false } => return Forwarded::Cut,
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
        let Joined::Leader(lead) = f.join("k", None) else {
            panic!("first is the leader")
        };
        let Joined::Waiter(rx, None) = f.join("k", None) else {
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
        let Joined::Leader(lead) = f.join("k", None) else {
            panic!()
        };
        let Joined::Waiter(rx, _) = f.join("k", None) else {
            panic!()
        };
        let waiting = tokio::spawn(wait(rx));
        drop(lead);
        assert!(waiting.await.unwrap().is_none());
        // The next request leads again.
        assert!(matches!(f.join("k", None), Joined::Leader(_)));
    }

    fn leading_stream(f: &Arc<Flights>) -> (Flight, LeaderWriter) {
        let Joined::Leader(mut lead) = f.join("k", Some(("m".into(), "r1".into()))) else {
            panic!("first is the leader")
        };
        let w = lead
            .take_live()
            .expect("a streaming leader keeps a live log");
        (lead, w)
    }

    fn follower_of(f: &Arc<Flights>, shape: &str) -> Arc<LeaderStream> {
        let Joined::Waiter(_, Some(live)) = f.join("k", Some((shape.into(), "r2".into()))) else {
            panic!("a waiter of a streaming leader sees its live log")
        };
        live
    }

    #[tokio::test]
    async fn a_late_follower_gets_everything_in_order_then_the_end() {
        let f = Arc::new(Flights::default());
        let (_lead, w) = leading_stream(&f);
        w.serving("v1");
        w.append(Bytes::from_static(b"a"));
        let live = follower_of(&f, "m");
        assert!(live.fits("m") && !live.fits("m\n{}"));
        let mut follower = live.follow().await.expect("the stream has begun");
        assert_eq!(
            (follower.variant().as_str(), follower.origin()),
            ("v1", "r1")
        );
        assert!(live.followed());
        w.append(Bytes::from_static(b"b"));
        let Next::Batches(got) = follower.next().await else {
            panic!("batches first")
        };
        assert_eq!(
            got,
            vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")]
        );
        let more = tokio::spawn(async move { (follower.next().await, follower) });
        tokio::task::yield_now().await;
        w.append(Bytes::from_static(b"c"));
        let (next, mut follower) = more.await.unwrap();
        assert!(matches!(next, Next::Batches(b) if b == vec![Bytes::from_static(b"c")]));
        w.end();
        assert!(matches!(follower.next().await, Next::End { clean: true }));
        drop(follower);
        assert!(!live.followed());
        live.unfollowed().await;
    }

    #[tokio::test]
    async fn a_vanished_writer_ends_followers_uncleanly_and_turns_new_ones_away() {
        let f = Arc::new(Flights::default());
        let (_lead, w) = leading_stream(&f);
        let live = follower_of(&f, "m");
        let waiting = tokio::spawn({
            let live = live.clone();
            async move { live.follow().await.is_some() }
        });
        w.append(Bytes::from_static(b"a"));
        assert!(
            waiting.await.unwrap(),
            "follows once the first batch is there"
        );
        let mut follower = live.follow().await.unwrap();
        drop(w);
        assert!(matches!(follower.next().await, Next::Batches(_)));
        assert!(matches!(follower.next().await, Next::End { clean: false }));
        assert!(
            live.follow().await.is_none(),
            "an unclean stream is not followed"
        );
    }

    #[tokio::test]
    async fn readers_go_at_their_own_pace_and_the_log_is_bounded() {
        let f = Arc::new(Flights::default());
        let (_lead, w) = leading_stream(&f);
        let live = w.live().clone();
        let mut own = live.reader();
        assert!(live.followed(), "the leader's own client reads");
        assert!(w.append(Bytes::from_static(b"a")));
        let mut late = follower_of(&f, "m").follow().await.unwrap();
        assert!(w.append(Bytes::from_static(b"b")));
        // One reader takes everything; the other, behind, still gets all of it from its offset.
        let Next::Batches(got) = own.next().await else {
            panic!()
        };
        assert_eq!(got.len(), 2);
        assert!(
            !w.append(Bytes::from(vec![0u8; MAX_LIVE_BYTES])),
            "a batch past the bound is refused"
        );
        w.end();
        assert!(matches!(own.next().await, Next::End { clean: true }));
        let Next::Batches(got) = late.next().await else {
            panic!()
        };
        assert_eq!(
            got,
            vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")]
        );
        assert!(matches!(late.next().await, Next::End { clean: true }));
        drop((own, late));
        assert!(!live.followed());
    }

    #[tokio::test]
    async fn a_leader_failing_before_its_first_byte_sends_followers_upstream() {
        let f = Arc::new(Flights::default());
        let (lead, w) = leading_stream(&f);
        let live = follower_of(&f, "m");
        let waiting = tokio::spawn(async move { live.follow().await.is_none() });
        drop(w);
        drop(lead);
        assert!(waiting.await.unwrap());
        assert!(f.is_empty());
    }
}
