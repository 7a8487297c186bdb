//! The OpenAI Responses API (`POST /v1/responses`), served in front of the Chat Completions
//! path.
//!
//! Admission turns the request into a Chat Completions request (`keel_core::translate::responses`),
//! which then runs through selection, execution (settlement, failover, hedging, translation to
//! Anthropic-protocol variants) and the relay (migration) exactly as a Chat request does.
//! Delivery turns the answer back: a whole Chat completion into a Response object, and a stream
//! into Responses events by wrapping the client's body, so that the relay's explicit-end rule
//! still holds (a stream that ends without keel's end is still an aborted response, now
//! preceded by a Responses `error` event).

use std::io;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;

use keel_core::protocol::Endpoint;
use keel_core::request::{self, CanonicalRequest};
use keel_core::sse::{SseDecoder, SseEvent};
use keel_core::translate::responses::{
    chat_completion_to_response, responses_to_chat, ChatToResponsesStream, ResponseIds,
    ResponsesContext,
};

use crate::wire::body::Body;
use crate::wire::errors::GatewayError;

/// The label of Responses requests in metrics and logs.
pub const LABEL: &str = "responses";

/// What delivery needs to answer a Responses client.
#[derive(Debug)]
pub struct Front {
    context: ResponsesContext,
    /// What the translation to Chat Completions dropped or changed (`x-keel-prompt-fix`).
    pub fixes: Vec<String>,
}

/// Reads a Responses body as the Chat Completions request it runs as.
pub fn admit(bytes: &[u8]) -> Result<(CanonicalRequest, Arc<Front>), GatewayError> {
    let body = request::parse_object(bytes)?;
    let t = responses_to_chat(&body)?;
    let req = request::from_object(Endpoint::ChatCompletions, t.body)?;
    let front = Front {
        context: t.context,
        fixes: t.fixes,
    };
    Ok((req, Arc::new(front)))
}

impl Front {
    fn ids(&self, request_id: &str) -> ResponseIds {
        let created_at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        ResponseIds {
            id: format!("resp_{request_id}"),
            // Named by the Chat answer, which already carries the name the pool gives clients.
            model: String::new(),
            created_at,
        }
    }

    /// A whole Chat completion body as a Response object body. A body that is not JSON (it
    /// cannot be: delivery checked it) is passed on as it is.
    pub fn whole(&self, request_id: &str, chat: &[u8]) -> Bytes {
        match serde_json::from_slice(chat) {
            Ok(v) => Bytes::from(
                chat_completion_to_response(&v, &self.context, &self.ids(request_id)).to_string(),
            ),
            Err(_) => Bytes::copy_from_slice(chat),
        }
    }

    /// The client's streamed body: the relay's Chat events as Responses events.
    pub fn stream(&self, request_id: &str, chat: Body) -> Body {
        let state = Translating {
            chat,
            decoder: SseDecoder::new(),
            stream: ChatToResponsesStream::new(self.context.clone(), self.ids(request_id)),
            finished: false,
        };
        let frames = futures_util::stream::unfold(state, |mut s| async move {
            let next = s.next().await?;
            Some((next, s))
        });
        http_body_util::StreamBody::new(frames).boxed()
    }
}

struct Translating {
    chat: Body,
    decoder: SseDecoder,
    stream: ChatToResponsesStream,
    finished: bool,
}

impl Translating {
    /// The next frame for the client; `None` at the end.
    async fn next(&mut self) -> Option<Result<Frame<Bytes>, io::Error>> {
        if self.finished {
            return None;
        }
        loop {
            let mut events = Vec::new();
            let read = match self.chat.frame().await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => self
                        .decoder
                        .feed(&data, &mut events)
                        .map_err(|e| e.to_string()),
                    Err(_) => continue,
                },
                Some(Err(e)) => {
                    // The relay's body was aborted (after its error event, translated above):
                    // abort this one too.
                    self.finished = true;
                    return Some(Err(e));
                }
                None => {
                    // A clean end is keel's decision that the answer is complete: a stream
                    // that never said `[DONE]` is completed here.
                    self.finished = true;
                    let ended = self.decoder.end(&mut events).map_err(|e| e.to_string());
                    let mut out = self.translate(&events, ended);
                    self.stream.end(&mut out);
                    return Some(Ok(Frame::data(encode(&out))));
                }
            };
            let out = self.translate(&events, read);
            if !out.is_empty() {
                return Some(Ok(Frame::data(encode(&out))));
            }
        }
    }

    fn translate(&mut self, events: &[SseEvent], read: Result<(), String>) -> Vec<SseEvent> {
        let mut out = Vec::new();
        let mut failure = read.err();
        for ev in events {
            if failure.is_some() {
                break;
            }
            failure = self.stream.push(ev, &mut out).err();
        }
        if let Some(why) = failure {
            // keel's own relay wrote something unreadable: a bug, never a truncated answer.
            tracing::error!(%why, "a Responses stream could not be translated");
            let err = serde_json::json!({"error": {"message": format!("keel: internal error, the response is incomplete ({why})"), "type": "server_error", "param": null, "code": null}});
            let _ = self
                .stream
                .push(&SseEvent::new(None, &err.to_string()), &mut out);
        }
        out
    }
}

fn encode(events: &[SseEvent]) -> Bytes {
    let mut buf = Vec::with_capacity(events.iter().map(|e| e.raw.len()).sum());
    for e in events {
        buf.extend_from_slice(&e.raw);
    }
    Bytes::from(buf)
}
