//! Where a relayed stream goes: the client's streamed body, or an assembler building the whole
//! response a non-streaming client asked for, or both (a streamed answer the response cache
//! will store: the client's events are assembled on the side), or — a streaming request that
//! leads a coalesced flight — the flight's live log, which the leader's own client and every
//! identical streaming request read at their own pace (see `state::cache::flight`).

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use keel_core::assemble::Assembler;
use keel_core::protocol::{self, event_role, EventRole, Protocol};
use keel_core::sse::SseDecoder;

use crate::state::cache::flight::LeaderWriter;
use crate::wire::body::BodySender;
use crate::wire::errors::{ErrorKind, GatewayError};

/// Where relayed events go.
pub enum Sink {
    /// The client's streamed response body.
    Client(BodySender),
    /// Assembled in place into one non-streaming body (no channel, no extra task).
    Assemble(Arc<Mutex<Assembled>>),
    /// The client's streamed body, also assembled for the response cache. An assembly that
    /// fails only marks the copy unusable (`failure`); the client's stream goes on.
    Tee {
        client: BodySender,
        copy: Arc<Mutex<Assembled>>,
    },
    /// A coalescing leader's live log, assembled on the side as `Tee`'s copy is. Sending never
    /// waits for a reader (the relay runs in a task of its own); the client is "gone" only when
    /// no one reads any more — neither the leader's client nor a follower.
    Shared {
        copy: Arc<Mutex<Assembled>>,
        live: LeaderWriter,
    },
}

/// A non-streaming response being assembled from the relayed events.
#[derive(Default)]
pub struct Assembled {
    pub decoder: SseDecoder,
    pub body: Assembler,
    /// The error the relay ended with, if any (keel's own error event, or an answer that
    /// could not be assembled).
    pub failure: Option<GatewayError>,
}

/// What became of bytes handed to a sink.
pub enum Sent {
    Ok,
    /// The client went away.
    ClientGone,
    /// The assembler refused them (a bound broken): the segment is `malformed`.
    Refused(GatewayError),
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
            Sink::Tee { client, copy } => {
                copy_aside(copy, protocol, &bytes);
                if client.send(Bytes::from(bytes)).await {
                    Sent::Ok
                } else {
                    Sent::ClientGone
                }
            }
            Sink::Shared { copy, live } => {
                if !live.live().followed() {
                    return Sent::ClientGone;
                }
                let n = bytes.len();
                copy_aside(copy, protocol, &bytes);
                if live.append(Bytes::from(bytes)) {
                    Sent::Ok
                } else {
                    Sent::Refused(GatewayError::new(
                        ErrorKind::Malformed,
                        format!(
                            "the streamed answer exceeds {} bytes (adding {n})",
                            crate::state::cache::flight::MAX_LIVE_BYTES
                        ),
                    ))
                }
            }
        }
    }

    /// The assembler of a non-streaming client's response, which the relay may feed with
    /// events it has read already (see `segment`) instead of bytes to decode again.
    pub fn assembler(&self) -> Option<&Arc<Mutex<Assembled>>> {
        match self {
            Sink::Assemble(a) => Some(a),
            Sink::Client(_) | Sink::Tee { .. } | Sink::Shared { .. } => None,
        }
    }

    /// Resolves when the client has gone away (never, for an assembled response: the request
    /// handler itself is dropped then) or, for a coalescing leader, when no one reads any more.
    pub async fn closed(&self) {
        match self {
            Sink::Client(tx) | Sink::Tee { client: tx, .. } => tx.closed().await,
            Sink::Shared { live, .. } => live.live().unfollowed().await,
            Sink::Assemble(_) => std::future::pending().await,
        }
    }

    /// Ends the response cleanly: only after its terminal event (the upstream's, or keel's
    /// error event).
    pub async fn end(self) {
        match self {
            Sink::Client(tx) => tx.end().await,
            Sink::Tee { client, .. } => client.end().await,
            Sink::Shared { live, .. } => live.end(),
            Sink::Assemble(_) => {}
        }
    }
}

/// Assembles the cache's copy; a failure only marks it unusable.
fn copy_aside(copy: &Mutex<Assembled>, protocol: Protocol, bytes: &[u8]) {
    if let Err(m) = assemble(copy, protocol, bytes) {
        let mut a = copy.lock().unwrap_or_else(|e| e.into_inner());
        a.failure.get_or_insert(m);
    }
}

/// Feeds bytes of whole events to an assembler; `Err` when a bound was broken. keel's own
/// error event (nothing could complete the response) is kept as the failure.
fn assemble(a: &Mutex<Assembled>, protocol: Protocol, bytes: &[u8]) -> Result<(), GatewayError> {
    let mut a = a.lock().unwrap_or_else(|e| e.into_inner());
    let mut events = Vec::new();
    if let Err(e) = a.decoder.feed(bytes, &mut events) {
        let why = format!("cannot assemble the response: {e}");
        return Err(GatewayError::new(ErrorKind::Malformed, why));
    }
    for ev in &events {
        match event_role(protocol, ev) {
            EventRole::Error(m) => {
                a.failure = Some(GatewayError::new(protocol::ErrorKind::BadGateway, m))
            }
            _ => a
                .body
                .push(protocol, ev)
                .map_err(|why| GatewayError::new(ErrorKind::Malformed, why))?,
        }
    }
    Ok(())
}
