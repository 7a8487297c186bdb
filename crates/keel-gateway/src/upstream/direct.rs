//! keel's own keep-alive pool of HTTP/1.1 connections to plain-`http://` upstreams.
//!
//! A connection is a socket and its read buffer, and nobody spawns a task for it: the request
//! using it writes the request and reads the response ([`exchange`]), and while the body is
//! read, [`DrivenBody`] decodes it straight from the socket. Compared with a pooled client whose
//! connections run as tasks of their own (reqwest over hyper-util), a chunk is read from the
//! socket by the task that relays it, with no wake-up of another task and no hand-over
//! between threads; checking a connection out and in takes only the calling thread's shard
//! of the idle list ([`PerThread`]), not a lock all requests share; and a live stream's
//! upstream connection holds its [`exchange::READ_BUF`] bytes and little else (see [`exchange`] for
//! what hyper's client connection would hold besides).
//!
//! An idle connection is not watched by anyone. Before one is reused, its socket is read once
//! without waiting, so a connection the server has closed meanwhile (a keep-alive timeout:
//! uvicorn's is 5 s) is found closed and dropped. A request on a reused connection that gets
//! no byte of an answer before the connection fails (the server closed it just as it was
//! reused) is sent again on a new one. A small task looks at every idle connection the same way
//! every [`SWEEP_EVERY`], so a connection its server closed does not wait in `CLOSE_WAIT`,
//! holding a descriptor, until the next request or [`IDLE_TIMEOUT`].
//!
//! **Connection caps.** A variant with `max_connections` has a [`Cap`]: every connection to it,
//! busy or idle, holds one of the cap's slots from its opening to its close, so keel never
//! holds more connections to it than the cap, whatever the burst (without one, a burst of
//! requests at a slow server opens a connection per request, which is what makes a slow server
//! slower). Its connections serve only its own requests. A request that finds none idle and no
//! slot free waits for either: a connection checked back in, or one closed. How many wait is
//! bounded above this pool, by the variant's concurrency limit (`max_connections` +
//! `max_pending`, see `pools`), and how long by the attempt's deadline. A reload builds a new
//! pool with new caps: connections still open in the old one (its requests finishing) are not
//! counted by the new cap, and close with the old pool. Sharing the cap instead could leave the
//! new generation waiting for slots held by idle connections only the old pool can reuse.

mod exchange;

pub use exchange::fuzz_response;

use std::collections::VecDeque;
use std::future::poll_fn;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::Stream;
use http::{HeaderMap, HeaderValue, Uri};
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::{BodyStream, Response};
use crate::per_thread::PerThread;
use crate::wire::errors::{ErrorKind, GatewayError};
use exchange::{Decoded, Framing, MAX_HEAD};

/// How long an idle connection is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Idle connections kept per thread's shard (over all upstreams of the pool).
const MAX_IDLE_PER_SHARD: usize = 256;

/// How often idle connections are looked at for a close by their server (uvicorn closes an
/// idle connection after 5 s).
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// A request waiting for a capped connection looks at the idle list again this often even
/// without a check-in: a connection checked in to a shard busy at its last look is found so.
const CAP_RECHECK: Duration = Duration::from_millis(50);

/// A variant's cap on the connections keel holds open to it (`max_connections`).
pub struct Cap {
    /// One permit per connection that may be open.
    slots: Arc<Semaphore>,
    max: u32,
    /// A connection of this cap went back to the idle list: waiters look there.
    returned: Notify,
    /// `keel_upstream_connections{pool,variant}`: connections open under the cap now.
    open: Option<metrics::Gauge>,
}

impl Cap {
    pub fn new(max: u32, open: Option<metrics::Gauge>) -> Arc<Cap> {
        Arc::new(Cap {
            slots: Arc::new(Semaphore::new(max as usize)),
            max,
            returned: Notify::new(),
            open,
        })
    }

    /// Connections open under the cap now (busy or idle).
    pub fn held(&self) -> u32 {
        self.max
            .saturating_sub(self.slots.available_permits() as u32)
    }
}

/// A capped connection's slot, given back when the connection is dropped (closed).
struct Slot {
    cap: Arc<Cap>,
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    fn new(cap: &Arc<Cap>, permit: OwnedSemaphorePermit) -> Slot {
        if let Some(g) = &cap.open {
            g.increment(1.0);
        }
        Slot {
            cap: cap.clone(),
            _permit: permit,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(g) = &self.cap.open {
            g.decrement(1.0);
        }
    }
}

/// Whether a connection of cap `a` may serve a request of cap `b`: the same cap, or none.
fn same_cap(a: Option<&Arc<Cap>>, b: Option<&Arc<Cap>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

/// One connection: its socket, and what was read from it and not yet taken.
struct Conn {
    stream: TcpStream,
    buf: BytesMut,
    /// Its variant's cap's slot, if the variant has a cap.
    slot: Option<Slot>,
}

impl Conn {
    fn cap(&self) -> Option<&Arc<Cap>> {
        self.slot.as_ref().map(|s| &s.cap)
    }

    /// Whether an idle connection can take a request: its socket is read without waiting, so
    /// a close by the server (or anything it sent unasked) is seen here.
    fn usable(&mut self) -> bool {
        self.buf.is_empty()
            && matches!(self.stream.try_read(&mut [0u8; 1]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }
}

struct Idle {
    authority: Arc<str>,
    conn: Conn,
    since: Instant,
}

impl Idle {
    /// Whether it may still be reused at `now`: not idle too long, and not closed by its server.
    fn reusable(&mut self, now: Instant) -> bool {
        now.duration_since(self.since) < IDLE_TIMEOUT && self.conn.usable()
    }
}

/// Where a plain-HTTP request goes: the address to connect to (`host:port`), and the request
/// target and `Host` header.
#[derive(Clone)]
pub struct Target {
    authority: Arc<str>,
    host: HeaderValue,
    /// The path and query, checked by `Uri`'s parser (no space or control byte in it).
    path: Arc<str>,
}

/// URLs whose reading as a [`Target`] each thread keeps: a pool's variants and endpoints.
const TARGETS_KEPT: usize = 32;

impl Target {
    /// `url` as a direct target: plain `http://` without credentials in it, else `None`.
    pub fn of(url: &str) -> Option<Target> {
        let uri: Uri = url.parse().ok()?;
        if uri.scheme_str() != Some("http") {
            return None;
        }
        let auth = uri.authority()?;
        if auth.as_str().contains('@') {
            return None;
        }
        let authority: Arc<str> = match auth.port_u16() {
            Some(_) => Arc::from(auth.as_str()),
            None => Arc::from(format!("{}:80", auth.host())),
        };
        let host = HeaderValue::from_str(auth.as_str()).ok()?;
        let path = match uri.path_and_query().map(|p| p.as_str()) {
            Some(p) if p.starts_with('/') => p.into(),
            _ => "/".into(),
        };
        Some(Target {
            authority,
            host,
            path,
        })
    }
}

/// The pool: idle connections per thread.
pub struct Direct {
    idle: PerThread<VecDeque<Idle>>,
    /// The last URLs read as targets (or found not to be plain HTTP), per thread: every request
    /// to a variant names the same few URLs, and reading one (a `Uri` parse, the `Host` value,
    /// two copies: 1,900 instructions) cost fifteen times the lookup (callgrind).
    targets: PerThread<Vec<(Box<str>, Option<Target>)>>,
    connect_timeout: Duration,
    /// Connections opened (`keel_upstream_connections_opened_total`): a count that grows with
    /// the requests rather than with the concurrency means connections are not reused.
    opened: metrics::Counter,
    /// How often idle connections are swept, and whether the sweeping task is started (by the
    /// first check-in, which runs on the runtime).
    sweep_every: Duration,
    sweeping: AtomicBool,
}

impl Direct {
    pub fn new(connect_timeout: Duration, opened: metrics::Counter) -> Direct {
        Direct::sweeping_every(connect_timeout, opened, SWEEP_EVERY)
    }

    pub fn sweeping_every(
        connect_timeout: Duration,
        opened: metrics::Counter,
        sweep_every: Duration,
    ) -> Direct {
        Direct {
            idle: PerThread::new(VecDeque::new),
            targets: PerThread::new(Vec::new),
            connect_timeout,
            opened,
            sweep_every,
            sweeping: AtomicBool::new(false),
        }
    }

    /// `url` as a direct target (see [`Target::of`]), read once per thread.
    pub fn target(&self, url: &str) -> Option<Target> {
        let mut kept = self.targets.own();
        if let Some((_, t)) = kept.iter().find(|(u, _)| **u == *url) {
            return t.clone();
        }
        let t = Target::of(url);
        if kept.len() >= TARGETS_KEPT {
            kept.remove(0);
        }
        kept.push((url.into(), t.clone()));
        t
    }

    /// Sends a POST of `body` to `target`, on an idle connection when one is usable; `cap`:
    /// the variant's connection cap, if it has one (see the module's notes).
    pub async fn send(
        self: &Arc<Self>,
        target: Target,
        cap: Option<&Arc<Cap>>,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Response, GatewayError> {
        let head = exchange::request_head(&target.path, &target.host, &headers, body.len());
        drop(headers);
        let mut fresh_only = false;
        loop {
            let reused = if fresh_only {
                None
            } else {
                self.checkout(&target.authority, cap)
            };
            let mut was_reused = reused.is_some();
            let mut conn = match (reused, cap) {
                (Some(c), _) => c,
                (None, None) => self.connect(&target.authority, None).await?,
                (None, Some(cap)) => {
                    let (c, reused) = self.open_capped(&target.authority, cap).await?;
                    was_reused = reused;
                    c
                }
            };
            match conn.exchange(&head, &body).await {
                Ok(head) => {
                    // The head's read may have filled the buffer with the body's start.
                    let filled = conn.buf.len() == conn.buf.capacity();
                    return Ok(Response {
                        status: head.status,
                        headers: head.headers,
                        fixes: Vec::new(),
                        body: Box::pin(DrivenBody {
                            reading: Some(Reading {
                                pool: Arc::clone(self),
                                authority: target.authority,
                                conn,
                                framing: head.framing,
                                keep_alive: head.keep_alive,
                                filled,
                            }),
                            at_end: false,
                        }),
                    });
                }
                // No answer at all on a reused connection: its server closed it as it was
                // reused. Once more, on a new connection.
                Err(Failed::Unanswered(e)) if was_reused => {
                    tracing::debug!(error = %e.message, "a reused upstream connection was closed; reconnecting");
                    fresh_only = true;
                }
                Err(Failed::Unanswered(e)) | Err(Failed::Answered(e)) => return Err(e),
            }
        }
    }

    /// A connection under `cap` to `authority`: an idle one, else a new one when the cap has a
    /// slot free, else the first of those to come (a check-in, or a close freeing a slot).
    /// Whether it was reused comes with it.
    async fn open_capped(
        &self,
        authority: &str,
        cap: &Arc<Cap>,
    ) -> Result<(Conn, bool), GatewayError> {
        loop {
            // Registered before looking, so a check-in between the look and the wait wakes it.
            let returned = cap.returned.notified();
            let mut returned = pin!(returned);
            returned.as_mut().enable();
            if let Some(c) = self.checkout(authority, Some(cap)) {
                return Ok((c, true));
            }
            let permit = tokio::select! {
                biased;
                p = cap.slots.clone().acquire_owned() => p.ok(),
                _ = returned => None,
                _ = tokio::time::sleep(CAP_RECHECK) => None,
            };
            if let Some(p) = permit {
                let slot = Slot::new(cap, p);
                return Ok((self.connect(authority, Some(slot)).await?, false));
            }
        }
    }

    /// The newest usable idle connection to `authority` under `cap`: the calling thread's
    /// shard first, then any other shard not busy at the moment.
    fn checkout(&self, authority: &str, cap: Option<&Arc<Cap>>) -> Option<Conn> {
        let n = self.idle.shards();
        let own = self.idle.own_index();
        for k in 0..n {
            let i = (own + k) % n;
            loop {
                let taken = {
                    let shard = if k == 0 {
                        Some(self.idle.shard(i))
                    } else {
                        self.idle.try_shard(i)
                    };
                    let Some(mut q) = shard else { break };
                    let Some(at) = q
                        .iter()
                        .rposition(|c| &*c.authority == authority && same_cap(c.conn.cap(), cap))
                    else {
                        break;
                    };
                    q.remove(at)
                };
                // Checked and dropped outside the shard's lock (both touch the socket).
                let Some(mut idle) = taken else { break };
                if idle.reusable(Instant::now()) {
                    return Some(idle.conn);
                }
            }
        }
        None
    }

    /// Keeps a connection whose response was read to its end for the next request.
    fn checkin(self: &Arc<Self>, authority: Arc<str>, conn: Conn) {
        // A plain load first: every check-in passes here, and only the first needs the swap.
        if !self.sweeping.load(Ordering::Relaxed) && !self.sweeping.swap(true, Ordering::Relaxed) {
            self.start_sweeping();
        }
        let now = Instant::now();
        let mut dropped = Vec::new();
        let cap = conn.cap().cloned();
        {
            let mut q = self.idle.own();
            while q
                .front()
                .is_some_and(|c| now.duration_since(c.since) >= IDLE_TIMEOUT)
                || q.len() >= MAX_IDLE_PER_SHARD
            {
                dropped.extend(q.pop_front());
            }
            q.push_back(Idle {
                authority,
                conn,
                since: now,
            });
        }
        drop(dropped);
        if let Some(cap) = cap {
            cap.returned.notify_waiters();
        }
    }

    /// Starts the task that sweeps idle connections; it ends with the pool.
    fn start_sweeping(self: &Arc<Self>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pool = Arc::downgrade(self);
        let every = self.sweep_every;
        rt.spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(pool) = pool.upgrade() else { return };
                pool.sweep();
            }
        });
    }

    /// Drops the idle connections their servers closed (or that are past [`IDLE_TIMEOUT`]).
    /// Each shard's list is taken out under its lock and checked outside it (a check reads the
    /// socket), and what is still usable goes back in front of anything checked in meanwhile
    /// (it is older).
    fn sweep(&self) {
        let now = Instant::now();
        for i in 0..self.idle.shards() {
            let Some(mut q) = self.idle.try_shard(i) else {
                continue;
            };
            if q.is_empty() {
                continue;
            }
            let mut taken = std::mem::take(&mut *q);
            drop(q);
            taken.retain_mut(|c| c.reusable(now));
            let mut q = self.idle.shard(i);
            for c in taken.into_iter().rev() {
                q.push_front(c);
            }
        }
    }

    /// Opens a connection to `authority`; `slot`: its cap's slot, held for the connection's
    /// life (given back at once if connecting fails).
    async fn connect(&self, authority: &str, slot: Option<Slot>) -> Result<Conn, GatewayError> {
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(authority)).await {
                Err(_) => {
                    return Err(GatewayError::new(
                        ErrorKind::Connect,
                        format!(
                            "connecting timed out after {} ms",
                            self.connect_timeout.as_millis()
                        ),
                    ))
                }
                Ok(Err(e)) => {
                    let kind = if e.kind() == std::io::ErrorKind::ConnectionRefused {
                        ErrorKind::Refused
                    } else {
                        ErrorKind::Connect
                    };
                    return Err(GatewayError::new(kind, format!("error connecting: {e}")));
                }
                Ok(Ok(s)) => s,
            };
        let _ = stream.set_nodelay(true);
        self.opened.increment(1);
        Ok(Conn {
            stream,
            buf: BytesMut::new(),
            slot,
        })
    }
}

/// A failed read or write on an upstream connection.
fn io_error(e: &std::io::Error) -> GatewayError {
    GatewayError::new(ErrorKind::Io, format!("upstream connection: {e}"))
}

/// How an exchange failed.
enum Failed {
    /// Before any byte of an answer came.
    Unanswered(GatewayError),
    /// After some of one.
    Answered(GatewayError),
}

impl Conn {
    /// Sends the request and reads the response's head. An answer that comes before the whole
    /// request was sent (a 413 for a body over the server's limit, from a server that then stops
    /// reading it, or closes) is the response; a failed write is reported only when no answer
    /// came before it.
    async fn exchange(&mut self, head: &[u8], body: &[u8]) -> Result<exchange::Head, Failed> {
        let mut unsent = exchange::Unsent::new(head, body);
        // A failed write ends the sending, not the exchange: the answer may be here already.
        let mut send_error: Option<std::io::Error> = None;
        let mut answered = false;
        poll_fn(|cx| loop {
            match exchange::parse_head(&mut self.buf) {
                Ok(Some(mut head)) => {
                    // Answered before the whole request was sent: the connection's state is
                    // unknown, so it is not kept.
                    head.keep_alive &= unsent.is_empty();
                    return Poll::Ready(Ok(head));
                }
                Ok(None) => {}
                Err(e) => {
                    return Poll::Ready(Err(Failed::Answered(GatewayError::new(ErrorKind::Io, e))))
                }
            }
            if self.buf.len() >= MAX_HEAD {
                return Poll::Ready(Err(Failed::Answered(GatewayError::new(
                    ErrorKind::Io,
                    format!("the upstream's response head is larger than {MAX_HEAD} bytes"),
                ))));
            }
            let failed = |e| {
                if answered {
                    Failed::Answered(e)
                } else {
                    Failed::Unanswered(e)
                }
            };
            if send_error.is_none() && !unsent.is_empty() {
                match unsent.poll_send(&self.stream, cx) {
                    Poll::Ready(Ok(())) => continue,
                    Poll::Ready(Err(e)) => send_error = Some(e),
                    // The socket takes no more for now: meanwhile, has the server answered?
                    Poll::Pending => {}
                }
            }
            let read = exchange::poll_fill(&mut self.stream, &mut self.buf, cx);
            if let Some(e) = &send_error {
                // After a failed write, only what the server sent before it counts.
                match read {
                    Poll::Ready(Ok(n)) if n > 0 => answered = true,
                    _ => return Poll::Ready(Err(failed(io_error(e)))),
                }
                continue;
            }
            match read {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(failed(GatewayError::new(
                        ErrorKind::Io,
                        "the upstream connection closed before the response",
                    ))))
                }
                Poll::Ready(Ok(_)) => answered = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(failed(io_error(&e)))),
            }
        })
        .await
    }
}

/// A response body that drives its connection, and gives the connection back to the pool
/// when it was read to its end.
///
/// Dropped before its end, it first reads what is already received (at most
/// [`DRAIN_MAX_BYTES`]): if that holds the end, the connection is kept. Otherwise it depends on
/// why it was dropped ([`BodyStream::reached_end`]). After the stream's terminal event (the
/// relay stops there, usually before the transfer's own end is read), the rest is waited for in
/// a small task, at most [`DRAIN_WAIT`], to keep the connection; a task of its own per
/// connection would do the same implicitly, here it costs something only in that case. A body
/// given up (a client gone, a stalled stream left for another variant, a hedge's loser) closes
/// its connection at once: the upstream sees it and stops generating.
struct DrivenBody {
    reading: Option<Reading>,
    /// The reader saw the response's last event.
    at_end: bool,
}

/// Bytes read past the point a body was dropped, to reach its end and keep its connection.
const DRAIN_MAX_BYTES: usize = 64 * 1024;

/// How long a dropped body's end is waited for.
const DRAIN_WAIT: Duration = Duration::from_millis(50);

struct Reading {
    pool: Arc<Direct>,
    authority: Arc<str>,
    conn: Conn,
    framing: Framing,
    /// Whether the connection may be reused after the body's end.
    keep_alive: bool,
    /// The last read filled the buffer: more is probably waiting in the socket.
    filled: bool,
}

/// The most body bytes handed over at once: what one piece may gather of a burst.
const MAX_GATHER: usize = 64 * 1024;

/// Pieces of a body decoded from one buffer, joined into one: the first as the slice of the
/// buffer it is, a copy only when a second follows.
#[derive(Default)]
struct Gathered {
    first: Option<Bytes>,
    joined: Option<BytesMut>,
}

impl Gathered {
    /// Adds `data`; `more` is what the buffer still holds (room for it, when a copy starts).
    fn push(&mut self, data: Bytes, more: usize) {
        if let Some(joined) = &mut self.joined {
            joined.extend_from_slice(&data);
        } else if let Some(first) = self.first.take() {
            let mut joined = BytesMut::with_capacity(first.len() + data.len() + more);
            joined.extend_from_slice(&first);
            joined.extend_from_slice(&data);
            self.joined = Some(joined);
        } else {
            self.first = Some(data);
        }
    }

    fn len(&self) -> usize {
        match (&self.joined, &self.first) {
            (Some(j), _) => j.len(),
            (None, Some(f)) => f.len(),
            (None, None) => 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn ready(self) -> Next {
        let data = match (self.joined, self.first) {
            (Some(j), _) => j.freeze(),
            (None, Some(f)) => f,
            (None, None) => Bytes::new(),
        };
        Poll::Ready(Some(Ok(data)))
    }
}

/// A body's next step.
type Next = Poll<Option<Result<Bytes, GatewayError>>>;

impl Reading {
    /// The next piece of the body: everything the buffer holds of it, read from the socket
    /// when it holds none.
    ///
    /// A server that frames every event as a chunk of its own sends many chunks in one
    /// segment; handed over one at a time, each would go through the relay's read, its batch
    /// and a body frame of its own, and the client would get its answer in several writes.
    /// Gathered, what one read brought is relayed at once — and when that read filled the
    /// buffer, the socket is read once more without waiting, since the rest of a burst is
    /// usually there.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Next {
        let error = |m: String| Poll::Ready(Some(Err(GatewayError::new(ErrorKind::Io, m))));
        let mut gathered = Gathered::default();
        loop {
            loop {
                match self.framing.decode(&mut self.conn.buf) {
                    Ok(Decoded::Data(data)) => {
                        gathered.push(data, self.conn.buf.len());
                        if gathered.len() >= MAX_GATHER {
                            return gathered.ready();
                        }
                    }
                    // An end or an error after gathered data is met again on the next call
                    // (decoding stands still at it).
                    Ok(Decoded::End) if gathered.is_empty() => return Poll::Ready(None),
                    Err(e) if gathered.is_empty() => return error(e),
                    Ok(Decoded::End) | Err(_) => return gathered.ready(),
                    Ok(Decoded::More) => break,
                }
            }
            // The buffer is used up. Gathered data waits for no further read unless the last
            // one filled the buffer.
            if !gathered.is_empty() && !self.filled {
                return gathered.ready();
            }
            match exchange::poll_fill(&mut self.conn.stream, &mut self.conn.buf, cx) {
                Poll::Pending if gathered.is_empty() => return Poll::Pending,
                Poll::Pending => return gathered.ready(),
                // The connection's end, like an error, is met on the next call (which reads
                // again: the buffer is empty).
                Poll::Ready(Ok(0) | Err(_)) if !gathered.is_empty() => return gathered.ready(),
                Poll::Ready(Ok(0)) if self.framing.ends_at_close() => {
                    self.keep_alive = false;
                    return Poll::Ready(None);
                }
                Poll::Ready(Ok(0)) => {
                    return error("the upstream connection ended inside the body".into())
                }
                Poll::Ready(Ok(_)) => {
                    self.filled = self.conn.buf.len() == self.conn.buf.capacity();
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(io_error(&e)))),
            }
        }
    }

    /// The body ended: the connection goes back to the pool if it can take another request
    /// (nothing was sent after the response).
    fn release(self) {
        if self.keep_alive && self.conn.buf.is_empty() {
            self.pool.checkin(self.authority, self.conn);
        }
    }

    /// Reads on toward the end, discarding, within `budget` bytes: `true` at the end, `false`
    /// when the rest is too long or broken; pending while the rest is not here yet.
    fn drain(&mut self, cx: &mut Context<'_>, budget: &mut usize) -> Poll<bool> {
        loop {
            match self.poll_next(cx) {
                Poll::Ready(Some(Ok(data))) if data.len() <= *budget => *budget -= data.len(),
                Poll::Ready(Some(_)) => return Poll::Ready(false),
                Poll::Ready(None) => return Poll::Ready(true),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Stream for DrivenBody {
    type Item = Result<Bytes, GatewayError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let Some(reading) = this.reading.as_mut() else {
            return Poll::Ready(None);
        };
        let next = reading.poll_next(cx);
        match &next {
            Poll::Ready(None) => {
                if let Some(reading) = this.reading.take() {
                    reading.release();
                }
            }
            // Fused after an error; the connection is closed.
            Poll::Ready(Some(Err(_))) => this.reading = None,
            _ => {}
        }
        next
    }
}

impl BodyStream for DrivenBody {
    fn reached_end(self: Pin<&mut Self>) {
        self.get_mut().at_end = true;
    }
}

impl Drop for DrivenBody {
    fn drop(&mut self) {
        let Some(mut reading) = self.reading.take() else {
            return;
        };
        let mut budget = DRAIN_MAX_BYTES;
        let mut cx = Context::from_waker(Waker::noop());
        match reading.drain(&mut cx, &mut budget) {
            Poll::Ready(true) => return reading.release(),
            // Too much left, or broken: closed.
            Poll::Ready(false) => return,
            Poll::Pending => {}
        }
        if !self.at_end {
            // Given up mid-response: closed now, so the upstream stops generating.
            return;
        }
        // The end is on its way: a small task waits for it (none outside a runtime).
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            let end = poll_fn(|cx| reading.drain(cx, &mut budget));
            if let Ok(true) = tokio::time::timeout(DRAIN_WAIT, end).await {
                reading.release();
            }
        });
    }
}

#[cfg(test)]
mod tests;
