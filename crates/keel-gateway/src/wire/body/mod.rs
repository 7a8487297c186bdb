//! Response bodies, and the rule for how a streamed one ends: **only on an explicit end**.
//!
//! A streamed body is fed by its producer, the relay (or a cache replay). The producer ends it
//! with [`BodySender::end`], which it calls only after forwarding the upstream's terminal event
//! or keel's own error event. If the producer disappears any other way (it panicked, a bug
//! returned early, its task was aborted), the body does not end cleanly: it sends the
//! protocol's error event (so an SDK raises an error instead of returning a truncated answer)
//! and then fails, which makes hyper abort the response: HTTP/1.1 closes the connection without
//! the final chunk, HTTP/2 resets the stream. Either way no client can take it for complete.
//!
//! Two bodies follow that rule: [`stream_body`], fed through a channel by a producer that runs
//! elsewhere (a spawned task), and [`driven`], which runs its producer inside its own polls
//! (the relay of a streamed answer: no task and no channel hop per upstream read; see
//! `driven`). Both are fed through a [`BodySender`].

mod driven;

use std::io;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use tokio::sync::mpsc;

use keel_core::protocol::{ErrorKind, Protocol};

use crate::wire::errors::GatewayError;

pub use driven::{driven, Driver, QUEUE_BLOCKS};

/// The response body type of every keel response.
pub type Body = BoxBody<Bytes, io::Error>;

/// Room for a response's headers: keel's own (`x-keel-*`: request id, route, variant,
/// attempts, overhead, cache) and the content type make seven, which is one more than an
/// empty map's first allocation holds; growing it rehashes the map on every answer (1% of a
/// whole answer's instructions, bench/history/2026-12-03-overhead-stops-19-20.md). Twelve is
/// the capacity a grown map has.
pub fn response_headers() -> HeaderMap {
    HeaderMap::with_capacity(12)
}

/// A complete response body.
pub fn full_body(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<Body> {
    let mut resp = Response::new(Full::new(body).map_err(|never| match never {}).boxed());
    *resp.status_mut() = status;
    *resp.headers_mut() = response_headers();
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// How long the error event of a vanished producer gets to reach the client before the abort.
const FLUSH_BEFORE_ABORT: std::time::Duration = std::time::Duration::from_millis(100);

enum Msg {
    Data(Bytes),
    End,
}

/// The producer's side of a streamed body.
pub struct BodySender {
    feed: Feed,
}

/// Which body a sender feeds.
enum Feed {
    Channel(mpsc::Sender<Msg>),
    Driven(driven::Feed),
}

impl BodySender {
    fn driven(feed: driven::Feed) -> BodySender {
        BodySender {
            feed: Feed::Driven(feed),
        }
    }

    /// Sends bytes; false when the client is gone.
    pub async fn send(&self, bytes: Bytes) -> bool {
        if bytes.is_empty() {
            return true;
        }
        match &self.feed {
            Feed::Channel(tx) => tx.send(Msg::Data(bytes)).await.is_ok(),
            Feed::Driven(feed) => feed.send(bytes).await,
        }
    }

    /// Ends the body cleanly. Call it only after the stream's terminal event (the upstream's,
    /// or keel's error event).
    pub async fn end(self) {
        match &self.feed {
            Feed::Channel(tx) => {
                let _ = tx.send(Msg::End).await;
            }
            Feed::Driven(feed) => feed.end(),
        }
    }

    /// Resolves when the client has gone away.
    pub async fn closed(&self) {
        match &self.feed {
            Feed::Channel(tx) => tx.closed().await,
            Feed::Driven(feed) => feed.closed().await,
        }
    }
}

/// The error event a client gets when its stream's producer vanished before the end.
fn vanished_event(protocol: Protocol) -> Bytes {
    let why = "keel: internal error, the response is incomplete";
    let ev = GatewayError::new(ErrorKind::Internal, why).to_event(protocol);
    Bytes::from(ev.raw)
}

/// What the body does next.
enum State {
    Open(mpsc::Receiver<Msg>),
    /// The producer vanished: the error event went out, the abort follows.
    Aborting,
    Done,
}

/// A streamed body in `protocol` and its sender.
pub fn stream_body(protocol: Protocol) -> (BodySender, Body) {
    let (tx, rx) = mpsc::channel::<Msg>(32);
    let stream = futures_util::stream::unfold(State::Open(rx), move |state| async move {
        match state {
            State::Open(mut rx) => match rx.recv().await {
                Some(Msg::Data(b)) => Some((Ok(Frame::data(b)), State::Open(rx))),
                Some(Msg::End) => None,
                None => {
                    tracing::error!(
                        "a response stream lost its producer before its end; the client gets an error event and an aborted response"
                    );
                    Some((Ok(Frame::data(vanished_event(protocol))), State::Aborting))
                }
            },
            State::Aborting => {
                // Let the connection flush the error event before it is torn down (an abort
                // discards what is still buffered).
                tokio::time::sleep(FLUSH_BEFORE_ABORT).await;
                Some((
                    Err(io::Error::other(
                        "response producer ended without an explicit end",
                    )),
                    State::Done,
                ))
            }
            State::Done => None,
        }
    });
    (
        BodySender {
            feed: Feed::Channel(tx),
        },
        StreamBody::new(stream).boxed(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn an_explicit_end_is_a_clean_end() {
        let (tx, mut body) = stream_body(Protocol::OpenAi);
        tokio::spawn(async move {
            assert!(tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await);
            tx.end().await;
        });
        let f = body.frame().await.unwrap().unwrap();
        assert_eq!(
            f.into_data().unwrap(),
            Bytes::from_static(b"data: [DONE]\n\n")
        );
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_vanished_producer_is_an_error_event_then_a_failure() {
        for protocol in [Protocol::OpenAi, Protocol::Anthropic] {
            let (tx, mut body) = stream_body(protocol);
            tokio::spawn(async move {
                tx.send(Bytes::from_static(b"data: x\n\n")).await;
                // Dropped without `end`.
            });
            body.frame().await.unwrap().unwrap();
            let ev = body.frame().await.unwrap().unwrap().into_data().unwrap();
            let text = std::str::from_utf8(&ev).unwrap();
            assert!(text.contains("the response is incomplete"), "{text}");
            if protocol == Protocol::Anthropic {
                assert!(text.starts_with("event: error\n"), "{text}");
            }
            assert!(body.frame().await.unwrap().is_err());
        }
    }
}
