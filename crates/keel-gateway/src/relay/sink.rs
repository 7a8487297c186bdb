//! Where a relayed stream goes: the client's streamed body, or an assembler building the whole
//! response a non-streaming client asked for.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use keel_core::assemble::Assembler;
use keel_core::protocol::{event_role, EventRole, Protocol};
use keel_core::sse::SseDecoder;

use crate::body::BodySender;

/// Where relayed events go.
pub enum Sink {
    /// The client's streamed response body.
    Client(BodySender),
    /// Assembled in place into one non-streaming body (no channel, no extra task).
    Assemble(Arc<Mutex<Assembled>>),
}

/// A non-streaming response being assembled from the relayed events.
#[derive(Default)]
pub struct Assembled {
    pub decoder: SseDecoder,
    pub body: Assembler,
    /// The error the relay ended with, if any.
    pub failure: Option<String>,
}

impl Sink {
    /// Forwards bytes of whole events; false when the client is gone.
    pub async fn send(&self, protocol: Protocol, bytes: Vec<u8>) -> bool {
        match self {
            Sink::Client(tx) => tx.send(Bytes::from(bytes)).await,
            Sink::Assemble(a) => {
                let mut a = a.lock().unwrap_or_else(|e| e.into_inner());
                let mut events = Vec::new();
                if let Err(e) = a.decoder.feed(&bytes, &mut events) {
                    a.failure = Some(format!("keel could not assemble the response: {e}"));
                }
                for ev in &events {
                    match event_role(protocol, ev) {
                        EventRole::Error(m) => a.failure = Some(m),
                        _ => {
                            if let Err(m) = a.body.push(protocol, ev) {
                                a.failure = Some(m);
                            }
                        }
                    }
                }
                true
            }
        }
    }

    /// Resolves when the client has gone away (never, for an assembled response: the request
    /// handler itself is dropped then).
    pub async fn closed(&self) {
        match self {
            Sink::Client(tx) => tx.closed().await,
            Sink::Assemble(_) => std::future::pending().await,
        }
    }

    /// Ends the response cleanly: only after its terminal event (the upstream's, or keel's
    /// error event).
    pub async fn end(self) {
        if let Sink::Client(tx) = self {
            tx.end().await;
        }
    }
}
