//! One client connection, from accept to close: which HTTP version it speaks (HTTP/1.1, or h2c
//! with prior knowledge), decided from its first bytes, and hyper's server connection for it.
//!
//! hyper-util's `auto` builder decides the version by *reading* the first 24 bytes and handing
//! hyper a wrapper that replays them. hyper's first read then returns only those 24 bytes, its
//! second finds less than a read's worth of room left and grows the 8 KiB read buffer to
//! 16 KiB, for the connection's life: 8 KiB more for every client connection, a live stream's
//! included (bench/RESULTS.md, issue 16). Here the version is decided by *peeking* (the bytes
//! stay in the socket), and hyper gets the socket itself.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::Service;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::Watcher;
use tokio::net::TcpStream;

use crate::Body;

/// What an h2c client with prior knowledge sends first (RFC 9113, 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The HTTP settings every client connection is served with.
pub struct Http {
    h1: http1::Builder,
    h2: http2::Builder<TokioExecutor>,
    /// How long a connection may take to send its first bytes (`header_read_timeout_ms`, which
    /// hyper applies to every HTTP/1.1 request head after that).
    first_bytes: Duration,
}

/// HTTP/1.1 or h2c.
#[derive(Debug, PartialEq, Eq)]
enum Version {
    H1,
    H2,
}

impl Http {
    pub fn new(header_read_timeout: Duration) -> Http {
        let mut h1 = http1::Builder::new();
        h1.timer(TokioTimer::new())
            .header_read_timeout(header_read_timeout)
            .keep_alive(true);
        let mut h2 = http2::Builder::new(TokioExecutor::new());
        h2.timer(TokioTimer::new())
            .keep_alive_interval(Some(Duration::from_secs(30)));
        Http {
            h1,
            h2,
            first_bytes: header_read_timeout,
        }
    }

    /// Serves `tcp` until it closes (or, once `watcher`'s shutdown starts, until its requests
    /// in flight are done). A connection that sends nothing within the header-read timeout is
    /// closed without a word, as hyper closes one whose request head is late.
    pub async fn serve<S>(self: Arc<Self>, tcp: TcpStream, svc: S, watcher: Watcher)
    where
        S: Service<Request<Incoming>, Response = Response<Body>, Error = Infallible>
            + Send
            + 'static,
        S::Future: Send + 'static,
    {
        let version = match tokio::time::timeout(self.first_bytes, sniff(&tcp)).await {
            Ok(Ok(Some(v))) => v,
            // Closed before a byte, a socket error, or silent too long.
            _ => return,
        };
        let io = TokioIo::new(tcp);
        // Errors here are the connection's (a reset, a malformed head hyper answered itself):
        // nothing is left to tell its client.
        let _ = match version {
            Version::H1 => watcher.watch(self.h1.serve_connection(io, svc)).await,
            Version::H2 => watcher.watch(self.h2.serve_connection(io, svc)).await,
        };
    }
}

/// The version `tcp` speaks, from its first bytes, which stay unread; `None` when it closes
/// before sending any.
async fn sniff(tcp: &TcpStream) -> std::io::Result<Option<Version>> {
    let mut first = [0u8; H2_PREFACE.len()];
    let mut wait = Duration::from_millis(1);
    loop {
        let n = tcp.peek(&mut first).await?;
        match version_of(&first[..n]) {
            Some(v) => return Ok(Some(v)),
            None if n == 0 => return Ok(None),
            // A strict beginning of the preface (a client that splits it across packets):
            // the socket stays readable with those bytes in it, so waiting for readiness
            // would spin. Look again shortly, less often the longer it takes (a client that
            // stops there costs a few wake-ups, not one a millisecond); the caller's timeout
            // bounds the wait.
            None => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_millis(50));
            }
        }
    }
}

/// The version that `seen`, a connection's first bytes, show; `None` while they could still
/// be either (nothing yet, or a strict beginning of the h2 preface).
fn version_of(seen: &[u8]) -> Option<Version> {
    if seen == H2_PREFACE {
        Some(Version::H2)
    } else if seen.is_empty() || H2_PREFACE.starts_with(seen) {
        None
    } else {
        // No HTTP/1 request starts with the preface's first three bytes (`PRI` is reserved for
        // it), so most requests are told apart by their second byte.
        Some(Version::H1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preface_is_h2_anything_else_h1_and_a_beginning_of_it_undecided() {
        assert_eq!(version_of(H2_PREFACE), Some(Version::H2));
        assert_eq!(
            version_of(b"POST /v1/chat/completions HTTP/1.1\r\n"),
            Some(Version::H1)
        );
        assert_eq!(version_of(b"PO"), Some(Version::H1));
        assert_eq!(version_of(b"GET / HTTP/1.1\r\n\r\n"), Some(Version::H1));
        assert_eq!(version_of(b""), None);
        assert_eq!(version_of(b"P"), None);
        assert_eq!(version_of(b"PRI * HTTP/2.0\r\n"), None);
        // The preface's length but other bytes.
        assert_eq!(
            version_of(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n"),
            Some(Version::H1)
        );
    }
}
