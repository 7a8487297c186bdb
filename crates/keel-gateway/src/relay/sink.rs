//! Where a relayed stream goes: the client's streamed body, or an assembler building the whole
//! response a non-streaming client asked for, or both (a streamed answer the response cache
//! will store: the client's events are assembled on the side, and appended to the live log that
//! identical streaming requests follow, see `cache::flight`).

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use keel_core::assemble::Assembler;
use keel_core::protocol::{event_role, EventRole, Protocol};
use keel_core::sse::SseDecoder;

use crate::body::BodySender;
use crate::cache::flight::LiveWriter;

/// Where relayed events go.
pub enum Sink {
    /// The client's streamed response body.
    Client(BodySender),
    /// Assembled in place into one non-streaming body (no channel, no extra task).
    Assemble(Arc<Mutex<Assembled>>),
    /// The client's streamed body, also assembled for the response cache. An assembly that
    /// fails only marks the copy unusable (`failure`); the client's stream goes on. With `live`
    /// (a coalescing leader), every batch is also appended for the followers, and the stream
    /// goes on after the client has gone while anyone follows.
    Tee {
        client: BodySender,
        copy: Arc<Mutex<Assembled>>,
        live: Option<LiveWriter>,
    },
}

/// A non-streaming response being assembled from the relayed events.
#[derive(Default)]
pub struct Assembled {
    pub decoder: SseDecoder,
    pub body: Assembler,
    /// The error the relay ended with, if any.
    pub failure: Option<String>,
}

/// What became of bytes handed to a sink.
pub enum Sent {
    Ok,
    /// The client went away.
    ClientGone,
    /// The assembler refused them (a bound broken): the segment is `malformed`.
    Refused(String),
}

impl Sink {
    /// Forwards bytes of whole events.
    pub async fn send(&self, protocol: Protocol, bytes: Vec<u8>) -> Sent {
        match self {
            Sink::Client(tx) => {
                if tx.send(Bytes::from(bytes)).await {
                    Sent::Ok
                } else {
                    Sent::ClientGone
                }
            }
            Sink::Assemble(a) => match assemble(a, protocol, &bytes) {
                Ok(()) => Sent::Ok,
                Err(m) => Sent::Refused(m),
            },
            Sink::Tee { client, copy, live } => {
                if let Err(m) = assemble(copy, protocol, &bytes) {
                    let mut a = copy.lock().unwrap_or_else(|e| e.into_inner());
                    a.failure.get_or_insert(m);
                }
                let bytes = Bytes::from(bytes);
                if let Some(l) = live {
                    l.append(&bytes);
                }
                let followed = || live.as_ref().is_some_and(|l| l.live().followed());
                if client.send(bytes).await || followed() {
                    Sent::Ok
                } else {
                    Sent::ClientGone
                }
            }
        }
    }

    /// The assembler of a non-streaming client's response, which the relay may feed with
    /// events it has read already (see `segment`) instead of bytes to decode again.
    pub fn assembler(&self) -> Option<&Arc<Mutex<Assembled>>> {
        match self {
            Sink::Assemble(a) => Some(a),
            Sink::Client(_) | Sink::Tee { .. } => None,
        }
    }

    /// Resolves when the client has gone away (never, for an assembled response: the request
    /// handler itself is dropped then) and, for a coalescing leader, no one follows either.
    pub async fn closed(&self) {
        match self {
            Sink::Client(tx) => tx.closed().await,
            Sink::Tee { client, live, .. } => {
                client.closed().await;
                if let Some(l) = live {
                    l.live().unfollowed().await;
                }
            }
            Sink::Assemble(_) => std::future::pending().await,
        }
    }

    /// Ends the response cleanly: only after its terminal event (the upstream's, or keel's
    /// error event).
    pub async fn end(self) {
        match self {
            Sink::Client(tx) => tx.end().await,
            Sink::Tee { client, live, .. } => {
                if let Some(l) = live {
                    l.end();
                }
                client.end().await;
            }
            Sink::Assemble(_) => {}
        }
    }
}

/// Feeds bytes of whole events to an assembler; `Err` when a bound was broken. keel's own
/// error event (nothing could complete the response) is kept as the failure.
fn assemble(a: &Mutex<Assembled>, protocol: Protocol, bytes: &[u8]) -> Result<(), String> {
    let mut a = a.lock().unwrap_or_else(|e| e.into_inner());
    let mut events = Vec::new();
    if let Err(e) = a.decoder.feed(bytes, &mut events) {
        return Err(format!("cannot assemble the response: {e}"));
    }
    for ev in &events {
        match event_role(protocol, ev) {
            EventRole::Error(m) => a.failure = Some(m),
            _ => a.body.push(protocol, ev)?,
        }
    }
    Ok(())
}
