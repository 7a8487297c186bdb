//! Write progress: a client that takes no response bytes for `client_write_timeout_ms` while
//! keel has some to send loses its request.
//!
//! Why: a request's deadlines live in its producer (the relay, polled from inside the response
//! body, see `body::driven`), and hyper stops polling a body while it cannot hand the client
//! more. A client that stopped reading therefore held the upstream connection, the variant's
//! slot and its key's concurrency slot for as long as it liked, `total_ms` notwithstanding.
//! Here the client's request is dropped instead: the body goes, and the relay runs to its end
//! as `cancelled` (its `Drop` path), which settles the attempt and frees both slots.
//!
//! Cost: nothing per write. A write that makes progress clears a flag; only a write that finds
//! the client not taking bytes (after one that did) arms the connection's one timer, and when
//! it fires, a write still blocked fails. Two places can block:
//!
//! * The socket ([`Watched`], an IO wrapper generic over the inner IO): the client stopped
//!   reading and the kernel's buffers are full. The failing write makes hyper close the
//!   connection (HTTP/1.1, or every stream of an HTTP/2 one).
//! * One HTTP/2 stream's flow-control window ([`StreamExec`], [`Tracked`]): the socket still
//!   flows but the client stopped granting the stream window, and hyper waits for window
//!   without polling the body. hyper runs each stream in a task of its own, spawned through the
//!   connection's executor; the executor here wraps that task, and the stream's body notes when
//!   it handed hyper bytes and was not asked for more since. A stream that stays so for the
//!   timeout has its task dropped: h2 resets the stream (`RST_STREAM CANCEL`), the body is
//!   dropped with it.
//!
//! A request lost so is counted (`keel_client_write_timeouts_total`, by protocol) and its
//! access line's outcome is `client_write_timeout` (see [`ClientWrites`]).
//!
//! The executor also counts a connection's streams, which is how an HTTP/2 connection learns
//! that it has had no open stream for its idle timeout (see `connection`).

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::service::Service;
use metrics::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::Body;

tokio::task_local! {
    /// The client of the request being handled (set around each request's service future).
    static CLIENT: Arc<ClientWrites>;
}

/// Whether a request's client lost it to the write timeout; its access log reads this when
/// the request ends (see `access_log`).
#[derive(Debug, Default)]
pub struct ClientWrites {
    timed_out: AtomicBool,
    /// The HTTP/2 connection the stream belongs to: its socket may time out too.
    connection: Option<Arc<ClientWrites>>,
}

impl ClientWrites {
    fn on(connection: &Arc<ClientWrites>) -> ClientWrites {
        ClientWrites {
            timed_out: AtomicBool::new(false),
            connection: Some(connection.clone()),
        }
    }

    /// True once the request (its connection or its stream) was dropped because its client
    /// took no bytes for the write timeout.
    pub fn timed_out(&self) -> bool {
        self.timed_out.load(Ordering::Relaxed)
            || self.connection.as_ref().is_some_and(|c| c.timed_out())
    }

    fn mark(&self) {
        self.timed_out.store(true, Ordering::Relaxed);
    }
}

/// The client of the request whose service future is running now, if any.
pub fn current() -> Option<Arc<ClientWrites>> {
    CLIENT.try_with(Arc::clone).ok()
}

/// One stall: the time the client may take no bytes, and what a timeout does.
#[derive(Clone)]
pub struct Limit {
    pub after: Duration,
    /// `keel_client_write_timeouts_total` for the connection's protocol.
    pub counter: Counter,
}

/// The timer of one place that can block (a socket, a stream): armed when a wait for the
/// client begins, not touched while writes progress.
struct Stall {
    limit: Limit,
    blocked: bool,
    /// Allocated on the first stall only: most connections never make one.
    timer: Option<Pin<Box<Sleep>>>,
}

impl Stall {
    fn new(limit: Limit) -> Stall {
        Stall {
            limit,
            blocked: false,
            timer: None,
        }
    }

    /// Notes one poll's result: `waiting` when the client is not taking bytes now. True when
    /// it has not taken any for the whole limit (the timer registered `cx` otherwise).
    fn expired(&mut self, waiting: bool, cx: &mut Context<'_>) -> bool {
        if !waiting {
            self.blocked = false;
            return false;
        }
        if !self.blocked {
            self.blocked = true;
            let until = Instant::now() + self.limit.after;
            match &mut self.timer {
                Some(t) => t.as_mut().reset(until),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(until))),
            }
        }
        let expired = self
            .timer
            .as_mut()
            .is_some_and(|t| t.as_mut().poll(cx).is_ready());
        if expired {
            self.limit.counter.increment(1);
        }
        expired
    }
}

/// A client's socket whose writes must make progress: one that stays blocked for the limit
/// fails with `TimedOut` (and every write after it), which ends the connection.
pub struct Watched<I> {
    io: I,
    /// `None` when the timeout is off.
    stall: Option<Stall>,
    client: Arc<ClientWrites>,
    failed: bool,
}

impl<I> Watched<I> {
    pub fn new(io: I, limit: Option<Limit>, client: Arc<ClientWrites>) -> Watched<I> {
        Watched {
            io,
            stall: limit.map(Stall::new),
            client,
            failed: false,
        }
    }

    /// Passes `polled` on, unless the client has taken no bytes for the limit.
    fn check<T>(
        &mut self,
        polled: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        let Some(stall) = &mut self.stall else {
            return polled;
        };
        if stall.expired(polled.is_pending(), cx) {
            self.failed = true;
            self.client.mark();
        }
        if self.failed {
            return Poll::Ready(Err(timed_out()));
        }
        polled
    }
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the client took no response bytes for client_write_timeout_ms",
    )
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(Err(timed_out()));
        }
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.check(polled, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(Err(timed_out()));
        }
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.check(polled, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.check(polled, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A service whose requests know their client (see [`current`]): the connection's, for
/// HTTP/1.1.
#[derive(Clone)]
pub struct Scoped<S> {
    pub svc: S,
    pub client: Arc<ClientWrites>,
}

impl<S> Service<Request<Incoming>> for Scoped<S>
where
    S: Service<Request<Incoming>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tokio::task::futures::TaskLocalFuture<Arc<ClientWrites>, S::Future>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        CLIENT.scope(self.client.clone(), self.svc.call(req))
    }
}

/// One HTTP/2 connection's streams, as its executor and its service see them.
pub struct Streams {
    limit: Option<Limit>,
    /// The connection's socket (see [`Watched`]).
    client: Arc<ClientWrites>,
    /// The stream whose request the service was just called for, until hyper spawns its task
    /// (hyper calls the service and spawns the stream's task one after the other, in the
    /// connection's task).
    next: Mutex<Option<Arc<Stream>>>,
    open: AtomicUsize,
    /// The connection's task, woken when its last open stream ends.
    idle: AtomicWaker,
}

impl Streams {
    pub fn new(limit: Option<Limit>, client: Arc<ClientWrites>) -> Arc<Streams> {
        Arc::new(Streams {
            limit,
            client,
            next: Mutex::new(None),
            open: AtomicUsize::new(0),
            idle: AtomicWaker::new(),
        })
    }

    /// Whether the connection has no stream running; `cx` is woken when its last one ends.
    pub fn poll_none_open(&self, cx: &mut Context<'_>) -> bool {
        self.idle.register(cx.waker());
        self.open.load(Ordering::Acquire) == 0
    }
}

/// What a stream's task and its body share.
struct Stream {
    /// The body handed hyper bytes and has not been asked for more since.
    owed: AtomicBool,
    client: Arc<ClientWrites>,
}

/// The service of an HTTP/2 connection: each request knows its stream's client, and its
/// response body tells the stream's task when it waits for the client.
#[derive(Clone)]
pub struct StreamService<S> {
    pub svc: S,
    pub streams: Arc<Streams>,
}

type StreamFuture<E> =
    Pin<Box<dyn Future<Output = Result<Response<Tracked<Body>>, E>> + Send + 'static>>;

impl<S> Service<Request<Incoming>> for StreamService<S>
where
    S: Service<Request<Incoming>, Response = Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = Response<Tracked<Body>>;
    type Error = S::Error;
    type Future = StreamFuture<S::Error>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let stream = Arc::new(Stream {
            owed: AtomicBool::new(false),
            client: Arc::new(ClientWrites::on(&self.streams.client)),
        });
        *self
            .streams
            .next
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(stream.clone());
        let called = CLIENT.scope(stream.client.clone(), self.svc.call(req));
        Box::pin(async move {
            let resp = called.await?;
            Ok(resp.map(|inner| Tracked { inner, stream }))
        })
    }
}

pin_project_lite::pin_project! {
    /// A response body that tells its stream's task whether it waits for the client.
    pub struct Tracked<B> {
        #[pin]
        inner: B,
        stream: Arc<Stream>,
    }
}

impl<B: HttpBody> HttpBody for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        this.stream.owed.store(false, Ordering::Relaxed);
        let polled = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if frame.is_data() {
                this.stream.owed.store(true, Ordering::Relaxed);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The executor of one HTTP/2 connection: runs each stream's task under the write timeout and
/// counts the streams running.
#[derive(Clone)]
pub struct StreamExec {
    pub streams: Arc<Streams>,
}

impl<F> hyper::rt::Executor<F> for StreamExec
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        let stream = self
            .streams
            .next
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        self.streams.open.fetch_add(1, Ordering::AcqRel);
        tokio::spawn(StreamTask {
            fut,
            stall: self.streams.limit.clone().map(Stall::new),
            stream,
            streams: self.streams.clone(),
        });
    }
}

pin_project_lite::pin_project! {
    /// One stream's task; ends early (dropping the stream) when the client takes none of its
    /// bytes for the limit.
    struct StreamTask<F> {
        #[pin]
        fut: F,
        stall: Option<Stall>,
        stream: Option<Arc<Stream>>,
        streams: Arc<Streams>,
    }

    impl<F> PinnedDrop for StreamTask<F> {
        fn drop(this: Pin<&mut Self>) {
            if this.streams.open.fetch_sub(1, Ordering::AcqRel) == 1 {
                this.streams.idle.wake();
            }
        }
    }
}

impl<F: Future<Output = ()>> Future for StreamTask<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.fut.poll(cx).is_ready() {
            return Poll::Ready(());
        }
        let (Some(stall), Some(stream)) = (this.stall.as_mut(), this.stream.as_ref()) else {
            return Poll::Pending;
        };
        if stall.expired(stream.owed.load(Ordering::Relaxed), cx) {
            stream.client.mark();
            // Dropping the stream's task resets the stream and drops its body.
            return Poll::Ready(());
        }
        Poll::Pending
    }
}
