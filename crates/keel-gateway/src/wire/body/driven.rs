//! A streamed body that runs its producer inside its own polls: no task, no channel hop.
//!
//! Why: with a spawned producer (`stream_body` + `tokio::spawn`), every upstream read crossed
//! three tasks (the upstream client connection, the relay task, the client's connection) with
//! a channel and a cross-task wake-up between each pair; a CPU profile showed about a
//! fifth of keel's CPU in parking and waking threads. Here the body owns the producer future
//! (the relay) and polls it from `poll_frame`, on the client connection's own task: the relay's
//! IO and timers wake that task directly, and what the relay sends is handed over through a
//! small queue that both ends reach from the same poll, so a send never wakes anybody.
//!
//! How the two ends meet, and why no waker is needed for the queue:
//!
//! * `poll_frame` returns what is queued first; only when the queue is empty does it poll the
//!   producer, which runs until it queues something, waits on its own IO or timers, or ends.
//!   A producer's send waits when [`QUEUE_BLOCKS`] blocks are queued (backpressure: the relay
//!   never runs ahead of a slow client by more than that, and hyper stops polling the body
//!   while its own write buffer is full). Only the body drains the queue and the body polls the
//!   producer as soon as it has drained it, so a waiting send is always polled again.
//! * The body ending is the other event the producer watches (`BodySender::closed`): it only
//!   happens in the body's `Drop`, which marks the queue closed and, if the producer has not
//!   finished, moves it into a task of its own (`tokio::spawn`), whose first poll sees the
//!   close. The relay must run to its end after its client left: it settles the attempt,
//!   finishes the access log (`cancelled`) and lets the cache capture decide.
//! * The rule of `body` holds unchanged: the body ends cleanly only on [`BodySender::end`];
//!   a producer that finishes without it, or panics (caught here, as the task boundary caught
//!   it before), makes the body send the protocol's error event and then fail.
//!
//! The producer is handed over after the body was made ([`Driver::run`]), so that a call site
//! can wrap the body (drain cut, Responses front) before it builds the relay that feeds it.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::io;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;

use keel_core::protocol::Protocol;

use super::{vanished_event, Body, BodySender, FLUSH_BEFORE_ABORT};

/// Blocks the producer may queue before its send waits for the client. One relay poll queues
/// one block per upstream read, plus a migration note or keel's error event at most, so a few
/// are enough; more would only let the relay run further ahead of a slow client.
pub const QUEUE_BLOCKS: usize = 4;

type Producer = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What the body and its producer share.
#[derive(Default)]
struct Shared {
    queue: VecDeque<Bytes>,
    /// The producer ended the body cleanly ([`BodySender::end`]).
    ended: bool,
    /// The body is gone (the client left, or the response was cut).
    closed: bool,
    /// The producer, from [`Driver::run`] until the body's first poll takes it.
    handed: Option<Producer>,
    /// [`Driver::run`] was called.
    started: bool,
    /// The driver went away without running a producer.
    abandoned: bool,
    /// The body, polled before its producer was handed over.
    waiting: Option<Waker>,
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // Nothing panics while holding it; should something, the queue is still consistent.
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The producer's end of a driven body (inside [`BodySender`]).
pub(super) struct Feed(Arc<Mutex<Shared>>);

impl Feed {
    /// Queues bytes once there is room; false when the body is gone. Waits without a waker:
    /// see the module comment for why the body always polls it again.
    pub(super) async fn send(&self, bytes: Bytes) -> bool {
        let mut bytes = Some(bytes);
        poll_fn(|_| {
            let mut s = lock(&self.0);
            if s.closed {
                return Poll::Ready(false);
            }
            if s.queue.len() >= QUEUE_BLOCKS {
                return Poll::Pending;
            }
            s.queue.extend(bytes.take());
            Poll::Ready(true)
        })
        .await
    }

    /// Ends the body cleanly once what is queued has gone out.
    pub(super) fn end(&self) {
        lock(&self.0).ended = true;
    }

    /// Resolves when the body is gone (only its `Drop` closes it, and the producer is polled
    /// afresh in its own task after that).
    pub(super) async fn closed(&self) {
        poll_fn(|_| match lock(&self.0).closed {
            true => Poll::Ready(()),
            false => Poll::Pending,
        })
        .await
    }
}

/// Hands a driven body its producer.
#[must_use = "a body whose producer never runs ends with an error event"]
pub struct Driver {
    shared: Arc<Mutex<Shared>>,
}

impl Driver {
    /// Runs `producer` inside the body's polls (where a call site would have spawned it). If
    /// the body is already gone, the producer runs in a task of its own and sees its client
    /// gone.
    pub fn run<F>(self, producer: F)
    where
        F: Future + Send + 'static,
    {
        // `map`, not `async move { producer.await }`: an async block keeps the captured
        // future and the awaited one in separate slots, which doubled the allocation a live
        // stream holds (the relay's state, ≈ 6.8 KB, twice).
        let producer: Producer = Box::pin(futures_util::FutureExt::map(producer, drop));
        let mut s = lock(&self.shared);
        s.started = true;
        if s.closed {
            drop(s);
            spawn_remainder(producer);
            return;
        }
        s.handed = Some(producer);
        if let Some(w) = s.waiting.take() {
            w.wake();
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        if !s.started {
            s.abandoned = true;
            if let Some(w) = s.waiting.take() {
                w.wake();
            }
        }
    }
}

/// A streamed body in `protocol` whose producer runs inside its polls, the producer's sender,
/// and the driver that hands the producer over.
pub fn driven(protocol: Protocol) -> (BodySender, Body, Driver) {
    let shared = Arc::new(Mutex::new(Shared::default()));
    let body = Driven {
        shared: shared.clone(),
        protocol,
        producer: Mutex::new(None),
        state: State::Starting,
    };
    (
        BodySender::driven(Feed(shared.clone())),
        body.boxed(),
        Driver { shared },
    )
}

enum State {
    /// The producer has not been handed over yet.
    Starting,
    Running,
    /// The producer vanished: the error event went out, the abort follows.
    Aborting(Pin<Box<tokio::time::Sleep>>),
    Done,
}

type Polled = Poll<Option<Result<Frame<Bytes>, io::Error>>>;

struct Driven {
    shared: Arc<Mutex<Shared>>,
    protocol: Protocol,
    /// In a mutex only so that the body is `Sync` (a `Body` must be); only ever reached
    /// through `get_mut`, never locked.
    producer: Mutex<Option<Producer>>,
    state: State,
}

impl Driven {
    /// What is queued, or the clean end once the queue is empty; `None` when neither.
    fn queued(&mut self) -> Option<Polled> {
        let mut s = lock(&self.shared);
        if let Some(b) = s.queue.pop_front() {
            return Some(Poll::Ready(Some(Ok(Frame::data(b)))));
        }
        if s.ended {
            drop(s);
            self.state = State::Done;
            return Some(Poll::Ready(None));
        }
        None
    }

    /// Polls the producer once; true when it is gone (finished or panicked).
    fn poll_producer(&mut self, cx: &mut Context<'_>) -> bool {
        let slot = self
            .producer
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(producer) = slot.as_mut() else {
            return true;
        };
        match std::panic::catch_unwind(AssertUnwindSafe(|| producer.as_mut().poll(cx))) {
            Ok(Poll::Pending) => return false,
            Ok(Poll::Ready(())) => {}
            // The panic was reported by the panic hook; the stream is incomplete.
            Err(_) => tracing::error!("a response stream's producer panicked"),
        }
        *slot = None;
        true
    }

    /// The producer ended without an end: the protocol's error event now, the abort next.
    fn vanished(&mut self) -> Polled {
        tracing::error!(
            "a response stream lost its producer before its end; the client gets an error event and an aborted response"
        );
        self.state = State::Aborting(Box::pin(tokio::time::sleep(FLUSH_BEFORE_ABORT)));
        Poll::Ready(Some(Ok(Frame::data(vanished_event(self.protocol)))))
    }
}

impl http_body::Body for Driven {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                State::Starting => {
                    let mut s = lock(&this.shared);
                    if let Some(p) = s.handed.take() {
                        *this
                            .producer
                            .get_mut()
                            .unwrap_or_else(PoisonError::into_inner) = Some(p);
                    } else if !s.abandoned {
                        s.waiting = Some(cx.waker().clone());
                        return Poll::Pending;
                    }
                    drop(s);
                    this.state = State::Running;
                }
                State::Running => {
                    if let Some(polled) = this.queued() {
                        return polled;
                    }
                    let gone = this.poll_producer(cx);
                    if let Some(polled) = this.queued() {
                        return polled;
                    }
                    return match gone {
                        true => this.vanished(),
                        false => Poll::Pending,
                    };
                }
                State::Aborting(sleep) => {
                    // Let the connection flush the error event before it is torn down (an
                    // abort discards what is still buffered).
                    std::task::ready!(sleep.as_mut().poll(cx));
                    this.state = State::Done;
                    return Poll::Ready(Some(Err(io::Error::other(
                        "response producer ended without an explicit end",
                    ))));
                }
                State::Done => return Poll::Ready(None),
            }
        }
    }
}

impl Drop for Driven {
    fn drop(&mut self) {
        let producer = self
            .producer
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let handed = {
            let mut s = lock(&self.shared);
            s.closed = true;
            s.queue.clear();
            s.handed.take()
        };
        if let Some(p) = producer.or(handed) {
            spawn_remainder(p);
        }
    }
}

/// Runs an unfinished producer to its end in a task of its own (its client is gone).
fn spawn_remainder(producer: Producer) {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn(producer);
        }
        Err(_) => tracing::warn!(
            "a response body was dropped outside the runtime; its producer stops unfinished"
        ),
    }
}

#[cfg(test)]
mod tests;
