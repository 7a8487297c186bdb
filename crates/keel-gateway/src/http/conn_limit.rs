//! The cap on open client connections (`max_connections`).
//!
//! Why: each connection holds a descriptor, a task and hyper's buffers; without a cap, a
//! client opening connections faster than they close (or holding them open) ran keel out of
//! descriptors, and then every client, a healthy one included, found `accept` failing. Past
//! the cap a new connection is told so, in HTTP/1.1 and OpenAI's error shape (a `503` with
//! `retry-after: 1` and `connection: close`), and closed: never left hanging in the accept
//! queue. The connections already open are untouched.
//!
//! Each served connection's task holds a [`Slot`]; dropping it (the connection ended) frees
//! its place. Counted: `keel_connections_open` (a gauge) and `keel_connections_refused_total`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel_core::protocol::{ErrorKind, Protocol};
use metrics::{Counter, Gauge};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::observe::metrics::Metrics;
use crate::wire::errors::GatewayError;

/// How long a refused connection gets to take its answer (and close) before it is dropped.
const REFUSAL_TIME: Duration = Duration::from_secs(1);

/// Refusals being written at once; past this a refused connection is closed at once (a flood
/// of connections must not turn into a flood of refusal tasks).
const MAX_REFUSING: usize = 1024;

/// What a client sends after its request that is read (and dropped) before a refused
/// connection closes: closing with unread bytes would reset the connection, and a reset may
/// destroy the answer before the client reads it.
const DRAIN_BYTES: usize = 64 * 1024;

/// The open connections and their cap.
pub struct ConnLimit {
    max: usize,
    open: AtomicUsize,
    refusing: AtomicUsize,
    open_gauge: Gauge,
    refused: Counter,
    /// The refusal's head but for its request id, and its body.
    refusal_head: String,
    refusal_body: String,
}

/// One open connection's place under the cap, freed when dropped.
pub struct Slot {
    limit: Arc<ConnLimit>,
}

impl ConnLimit {
    pub fn new(max: usize, metrics: &Metrics) -> Arc<ConnLimit> {
        let why = format!(
            "keel has as many connections open as it serves at once (max_connections = {max}): retry shortly, or reuse an open connection"
        );
        let body = GatewayError::new(ErrorKind::Overloaded, why)
            .body(Protocol::OpenAi)
            .to_string();
        // keel's own answers carry its headers (as `delivery::keel_headers` sets them).
        let refusal_head = format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\nx-keel-route: unavailable\r\nx-keel-variant: none\r\nx-keel-attempts: 0\r\n",
            body.len()
        );
        Arc::new(ConnLimit {
            max: max.max(1),
            open: AtomicUsize::new(0),
            refusing: AtomicUsize::new(0),
            open_gauge: metrics.gauge("keel_connections_open", &[]),
            refused: metrics.counter("keel_connections_refused_total", &[]),
            refusal_head,
            refusal_body: body,
        })
    }

    /// A place for one more connection, or `None` at the cap.
    pub fn take(self: &Arc<Self>) -> Option<Slot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()?;
        self.open_gauge.increment(1.0);
        Some(Slot {
            limit: self.clone(),
        })
    }

    /// Answers `tcp` with the refusal and closes it, in a task of its own.
    pub fn refuse(self: &Arc<Self>, mut tcp: TcpStream) {
        self.refused.increment(1);
        if self.refusing.fetch_add(1, Ordering::AcqRel) >= MAX_REFUSING {
            self.refusing.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        let limit = self.clone();
        let mut answer = format!(
            "{}x-keel-request-id: {}\r\n\r\n",
            self.refusal_head,
            crate::wire::request_id::new()
        )
        .into_bytes();
        answer.extend_from_slice(self.refusal_body.as_bytes());
        tokio::spawn(async move {
            let _ = tokio::time::timeout(REFUSAL_TIME, async {
                tcp.write_all(&answer).await?;
                tcp.shutdown().await?;
                let mut drained = 0;
                let mut buf = [0u8; 4096];
                while drained < DRAIN_BYTES {
                    match tcp.read(&mut buf).await? {
                        0 => break,
                        n => drained += n,
                    }
                }
                Ok::<_, std::io::Error>(())
            })
            .await;
            limit.refusing.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.limit.open.fetch_sub(1, Ordering::AcqRel);
        self.limit.open_gauge.decrement(1.0);
    }
}
