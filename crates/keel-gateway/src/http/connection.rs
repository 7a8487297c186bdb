//! One client connection, from accept to close: which HTTP version it speaks (HTTP/1.1, or h2c
//! with prior knowledge), decided from its first bytes, and hyper's server connection for it.
//! A TLS connection's version is decided by ALPN instead (see `tls`), and served here by
//! [`Http::serve_as`] over the decrypted stream.
//!
//! hyper-util's `auto` builder decides the version by *reading* the first 24 bytes and handing
//! hyper a wrapper that replays them. hyper's first read then returns only those 24 bytes, its
//! second finds less than a read's worth of room left and grows the 8 KiB read buffer to
//! 16 KiB, for the connection's life: 8 KiB more for every client connection, a live stream's
//! included (bench/history/2026-12-01-overhead-stops-6-11.md). Here the version is decided by *peeking* (the bytes
//! stay in the socket), and hyper gets the socket itself.
//!
//! Between requests a keep-alive connection may sit idle for `idle_timeout_ms`; once the next
//! request's first byte arrives, its head must be in within `header_read_timeout_ms` (nginx's
//! `keepalive_timeout` and `client_header_timeout`). hyper has one setting for both: it starts
//! the header-read timer as soon as a connection goes idle, so with it alone keel closed every
//! keep-alive connection after 10 s of quiet, and a client whose pool keeps connections longer
//! (reqwest's and Go's 90 s, a load balancer's 60 s) raced the close: a request written as the
//! connection closed failed without a response. [`HeadTimer`] gives hyper's timer both meanings.
//!
//! HTTP/2 has neither setting in hyper. An h2c connection with no open stream for
//! `idle_timeout_ms` is sent GOAWAY (keep-alive pings alone do not keep it: a client that
//! answers them would otherwise hold it for ever), and a request head must arrive whole within
//! `header_read_timeout_ms` of its first frame (`h2_head`). Both versions' sockets, and each
//! HTTP/2 stream, are held to `client_write_timeout_ms` (`client_write`). Graceful shutdown
//! (`graceful`) and the idle close both ask hyper's connection to finish.

use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::io::IoSlice;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::rt::{Sleep, Timer};
use hyper::server::conn::{http1, http2};
use hyper::service::Service;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::http::graceful::Watcher;
use crate::wire::client_write::{
    self, ClientWrites, Limit, Scoped, StreamExec, StreamService, Streams,
};
use crate::Body;

/// What an h2c client with prior knowledge sends first (RFC 9113, 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Streams an HTTP/2 client may have open at once (hyper's default too; nginx allows 128).
const H2_MAX_STREAMS: u32 = 200;

/// Streams an HTTP/2 client may open and reset before keel accepted them (the rapid-reset
/// attack): h2's own default, stated.
const H2_MAX_PENDING_RESETS: usize = 20;

/// Largest request head an HTTP/2 client may send (decoded), as hyper's HTTP/1.1 read buffer
/// bounds a request head there (hyper's HTTP/2 default, stated).
const H2_MAX_HEADER_LIST_BYTES: u32 = 16 * 1024;

/// The HTTP settings every client connection is served with.
pub struct Http {
    h1: http1::Builder,
    /// How long a connection may take to send its first bytes, and a request head to arrive
    /// from its first byte (`header_read_timeout_ms`).
    head: Duration,
    /// How long a connection may wait idle for its next request (`idle_timeout_ms`): an
    /// HTTP/1.1 one between requests, an HTTP/2 one with no open stream.
    idle: Duration,
    /// How long a client may take no response bytes while keel has some for it
    /// (`client_write_timeout_ms`; `None` when 0, off).
    write: Option<Duration>,
    /// `keel_client_write_timeouts_total` for HTTP/1.1 and for HTTP/2.
    write_timeouts: [metrics::Counter; 2],
    /// `keel_tls_handshake_failures_total`: refused (a bad or missing client certificate, a
    /// client that does not speak TLS) and late (no handshake within `head`).
    tls_failures: [metrics::Counter; 2],
}

/// HTTP/1.1, or HTTP/2 (h2c by prior knowledge, or h2 by ALPN over TLS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    H1,
    H2,
}

impl Http {
    pub fn new(
        header_read_timeout: Duration,
        idle_timeout: Duration,
        client_write_timeout: Option<Duration>,
        metrics: &crate::observe::metrics::Metrics,
    ) -> Http {
        let mut h1 = http1::Builder::new();
        // hyper's deadline for a head, which [`HeadTimer`] (set per connection) stretches to
        // the idle timeout until a byte arrives.
        h1.header_read_timeout(header_read_timeout).keep_alive(true);
        let counter = |protocol| {
            metrics.counter(
                "keel_client_write_timeouts_total",
                &[("protocol", protocol)],
            )
        };
        let tls =
            |reason| metrics.counter("keel_tls_handshake_failures_total", &[("reason", reason)]);
        Http {
            h1,
            head: header_read_timeout,
            idle: idle_timeout,
            write: client_write_timeout.filter(|d| !d.is_zero()),
            write_timeouts: [counter("http1"), counter("http2")],
            tls_failures: [tls("refused"), tls("timeout")],
        }
    }

    /// Counts a TLS handshake that failed (`timed_out`: none within the header-read timeout).
    pub fn tls_failed(&self, timed_out: bool) {
        self.tls_failures[usize::from(timed_out)].increment(1);
    }

    /// How long a connection may take to send its first bytes (a TLS handshake included).
    pub fn header_read_timeout(&self) -> Duration {
        self.head
    }

    fn limit(&self, version: &Version) -> Option<Limit> {
        let counter = match version {
            Version::H1 => &self.write_timeouts[0],
            Version::H2 => &self.write_timeouts[1],
        };
        self.write.map(|after| Limit {
            after,
            counter: counter.clone(),
        })
    }

    /// hyper's HTTP/2 settings, for one connection's executor.
    fn h2(&self, exec: StreamExec) -> http2::Builder<StreamExec> {
        let mut h2 = http2::Builder::new(exec);
        // A client that stops answering pings is gone; one that answers them but opens no
        // stream is closed at the idle timeout (see [`serve_connection`]).
        h2.timer(TokioTimer::new())
            .keep_alive_interval(Some(Duration::from_secs(30)))
            .keep_alive_timeout(Duration::from_secs(20))
            .max_concurrent_streams(H2_MAX_STREAMS)
            .max_pending_accept_reset_streams(H2_MAX_PENDING_RESETS)
            .max_header_list_size(H2_MAX_HEADER_LIST_BYTES);
        h2
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
        let version = match tokio::time::timeout(self.head, sniff(&tcp)).await {
            Ok(Ok(Some(v))) => v,
            // Closed before a byte, a socket error, or silent too long.
            _ => return,
        };
        self.serve_as(tcp, version, svc, watcher).await
    }

    /// Serves `io`, which speaks `version` (decided by the caller: sniffed from a plain
    /// socket's first bytes, or negotiated by ALPN), until it closes or `watcher`'s shutdown
    /// has let its requests in flight finish.
    pub async fn serve_as<I, S>(self: Arc<Self>, io: I, version: Version, svc: S, watcher: Watcher)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        S: Service<Request<Incoming>, Response = Response<Body>, Error = Infallible>
            + Send
            + 'static,
        S::Future: Send + 'static,
    {
        let client = Arc::new(ClientWrites::default());
        let limit = self.limit(&version);
        // Errors here are the connection's (a reset, a malformed head hyper answered itself,
        // a client that took no bytes for the write timeout): nothing is left to tell it.
        let _ = match version {
            Version::H1 => {
                let reads = Arc::new(AtomicU64::new(0));
                let mut h1 = self.h1.clone();
                h1.timer(HeadTimer {
                    reads: reads.clone(),
                    head: self.head,
                    idle: self.idle,
                });
                let io = client_write::Watched::new(Counted { io, reads }, limit, client.clone());
                let svc = Scoped { svc, client };
                let conn = h1.serve_connection(TokioIo::new(io), svc);
                serve_connection(conn, watcher, None).await
            }
            // Boxed: an HTTP/2 connection's state is several times an HTTP/1.1 one's, and
            // this future lives as long as the connection (see `server`).
            Version::H2 => {
                Box::pin(async {
                    let heads = crate::http::h2_head::HeadWatch::new(io, self.head);
                    let io = client_write::Watched::new(heads, limit.clone(), client.clone());
                    let streams = Streams::new(limit, client);
                    let h2 = self.h2(StreamExec {
                        streams: streams.clone(),
                    });
                    let svc = StreamService {
                        svc,
                        streams: streams.clone(),
                    };
                    let conn = h2.serve_connection(TokioIo::new(io), svc);
                    let idle = IdleClose {
                        streams,
                        idle: self.idle,
                        grace: self.head,
                    };
                    serve_connection(conn, watcher, Some(idle)).await
                })
                .await
            }
        };
    }
}

/// A hyper server connection that can be asked to finish gracefully.
trait Graceful: Future<Output = Result<(), hyper::Error>> {
    /// HTTP/1.1: close after the response in flight; HTTP/2: GOAWAY, then close once the open
    /// streams are done.
    fn graceful_shutdown(self: Pin<&mut Self>);
}

impl<I, B, S> Graceful for http1::Connection<I, S>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + 'static,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        http1::Connection::graceful_shutdown(self);
    }
}

impl<I, B, S, E> Graceful for http2::Connection<I, S, E>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + 'static,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    E: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        http2::Connection::graceful_shutdown(self);
    }
}

/// When an HTTP/2 connection closes for want of streams: hyper has no idle timeout for
/// HTTP/2, and a client that answers keep-alive pings would otherwise hold its connection
/// (a task, buffers, a descriptor) for ever without sending a request.
struct IdleClose {
    streams: Arc<Streams>,
    /// No open stream for this long: GOAWAY.
    idle: Duration,
    /// After GOAWAY, how long the connection may take to close before it is dropped (a
    /// stream whose last bytes the client never takes would hold it open).
    grace: Duration,
}

/// Drives `conn` to its end: gracefully once `watcher`'s shutdown begins, or (HTTP/2) once it
/// has had no open stream for `idle`'s timeout.
async fn serve_connection<C: Graceful>(
    conn: C,
    mut watcher: Watcher,
    idle: Option<IdleClose>,
) -> Result<(), hyper::Error> {
    let mut conn = pin!(conn);
    let mut shutdown = pin!(watcher.started());
    let mut closing = false;
    // The idle deadline while no stream is open; after GOAWAY, the deadline to close by.
    let mut timer: Option<Pin<Box<tokio::time::Sleep>>> = None;
    let mut armed = false;
    poll_fn(|cx| loop {
        if let Poll::Ready(r) = conn.as_mut().poll(cx) {
            return Poll::Ready(r);
        }
        if closing {
            return match timer.as_mut().map(|t| t.as_mut().poll(cx)) {
                Some(Poll::Ready(())) => Poll::Ready(Ok(())),
                _ => Poll::Pending,
            };
        }
        if shutdown.as_mut().poll(cx).is_ready() {
            closing = true;
            timer = None;
            conn.as_mut().graceful_shutdown();
            continue;
        }
        let Some(idle) = &idle else {
            return Poll::Pending;
        };
        if !idle.streams.poll_none_open(cx) {
            armed = false;
            return Poll::Pending;
        }
        if !armed {
            armed = true;
            let until = tokio::time::Instant::now() + idle.idle;
            match &mut timer {
                Some(t) => t.as_mut().reset(until),
                None => timer = Some(Box::pin(tokio::time::sleep_until(until))),
            }
        }
        match timer.as_mut().map(|t| t.as_mut().poll(cx)) {
            Some(Poll::Ready(())) => {
                closing = true;
                let until = tokio::time::Instant::now() + idle.grace;
                timer = Some(Box::pin(tokio::time::sleep_until(until)));
                conn.as_mut().graceful_shutdown();
            }
            _ => return Poll::Pending,
        }
    })
    .await
}

/// hyper's timer for one HTTP/1.1 connection. hyper asks it for one deadline only, the
/// header-read timeout's, which it starts whenever it waits for a request head: when the
/// connection opens and as soon as each response is done. The sleep it gets back lasts
/// `idle` while no byte arrives, and ends `head` after the first byte that does.
struct HeadTimer {
    /// Reads that returned bytes on the connection, counted by [`Counted`].
    reads: Arc<AtomicU64>,
    head: Duration,
    idle: Duration,
}

impl Timer for HeadTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        self.sleep_until(Instant::now() + duration)
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Sleep>> {
        // hyper's deadline is its start plus `head`: the wait began at `deadline - head`.
        let began = deadline.checked_sub(self.head).unwrap_or(deadline);
        // An idle timeout too long for the clock waits a year (in effect, for ever).
        let idle_until = began
            .checked_add(self.idle)
            .or_else(|| began.checked_add(Duration::from_secs(365 * 86_400)))
            .unwrap_or(deadline);
        Box::pin(HeadSleep {
            reads: self.reads.clone(),
            reads_at_start: self.reads.load(Ordering::Relaxed),
            head: self.head,
            byte_seen: false,
            sleep: tokio::time::sleep_until(idle_until.into()),
        })
    }
}

pin_project_lite::pin_project! {
    /// The wait for one request head (see [`HeadTimer`]). hyper polls it each time the
    /// connection wakes while the head is incomplete, a read included, so the first byte is
    /// noticed on the poll right after the read that brought it.
    struct HeadSleep {
        reads: Arc<AtomicU64>,
        reads_at_start: u64,
        head: Duration,
        byte_seen: bool,
        #[pin]
        sleep: tokio::time::Sleep,
    }
}

impl Future for HeadSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut this = self.project();
        if !*this.byte_seen && this.reads.load(Ordering::Relaxed) != *this.reads_at_start {
            *this.byte_seen = true;
            let until = tokio::time::Instant::now() + *this.head;
            this.sleep.as_mut().reset(until);
        }
        this.sleep.poll(cx)
    }
}

impl Sleep for HeadSleep {}

/// A client's socket that counts the reads that brought bytes (for [`HeadTimer`]); the rest
/// passes straight through.
struct Counted<I> {
    io: I,
    reads: Arc<AtomicU64>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Counted<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.reads.fetch_add(1, Ordering::Relaxed);
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Counted<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
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

    /// The size of the future `Http::serve` returns for a service of type `S`.
    fn serve_size<S>(_: &S) -> usize
    where
        S: Service<Request<Incoming>, Response = Response<Body>, Error = Infallible>
            + Send
            + 'static,
        S::Future: Send + 'static,
    {
        fn returned<A, B, C, D, R>(_: impl FnOnce(A, B, C, D) -> R) -> usize {
            std::mem::size_of::<R>()
        }
        returned(Http::serve::<S>)
    }

    /// A connection's task lives as long as the connection, a live stream's included: its
    /// future's size is memory per stream. HTTP/2's state (and TLS's, in `server`) is boxed,
    /// so a plain HTTP/1.1 connection holds only its own. The bound is the test profile's
    /// (unoptimized: 2.1 KB; 4.1 KB with HTTP/2 inline). In a release build the task's
    /// allocation is 2.4 KB a connection, 9.1 KB with TLS and HTTP/2 inline (heaptrack).
    #[test]
    fn a_plain_connections_future_stays_small() {
        let svc = hyper::service::service_fn(|_: Request<Incoming>| async {
            Ok::<_, Infallible>(crate::wire::body::full_body(
                http::StatusCode::OK,
                "text/plain",
                bytes::Bytes::new(),
            ))
        });
        let size = serve_size(&svc);
        eprintln!("Http::serve's future: {size} bytes");
        assert!(size <= 3_000, "Http::serve's future is {size} bytes");
    }

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
