//! Answering a hit: the stored whole answer as the client asked for it — one body, or a stream
//! in the client's protocol (the events the answer would have streamed, rebuilt by
//! `keel_core::synthesize`), wrapped in Responses form for a Responses client. With
//! `pace_replay`, a streamed hit's text comes in small pieces spread over the time the
//! original generation took, so a client sees the recorded token rate; otherwise at once.
//!
//! A hit is accounted for like any request: route `cached`, the generating variant, no
//! attempts, and a decision record naming the request whose answer it is.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::Value;

use keel_core::protocol::{Endpoint, ErrorKind, Protocol};
use keel_core::sse::SseEvent;

use crate::config::ResponseModel;
use crate::observe::access_log::RequestLog;
use crate::observe::decisions::{DecisionLog, Draft};
use crate::observe::record::DecisionRecord;
use crate::pipeline::context::RequestCtx;
use crate::pipeline::delivery;
use crate::state::pools::Pool;
use crate::wire::body::{driven, full_body, Body, BodySender, Driver};
use crate::wire::errors::GatewayError;

use super::flight::{forward, Follower, Forwarded};
use super::store::Entry;
use super::HEADER;

/// Characters of text per replayed piece when pacing (a few tokens).
const PIECE_CHARS: usize = 16;

/// The response for a hit.
pub fn respond(
    pool: &Pool,
    ctx: &RequestCtx,
    model: &str,
    entry: Arc<Entry>,
    mut log: RequestLog,
    decisions: &Arc<DecisionLog>,
) -> Response<Body> {
    let protocol = ctx.endpoint.protocol();
    account(
        pool,
        ctx,
        &mut log,
        decisions,
        (&entry.variant, &entry.request_id),
    );
    let mut body = entry.body.clone();
    if pool.cfg.response_model == ResponseModel::Public {
        // The entry may have been stored under another of the pool's names.
        if let Some(m) = body.get_mut("model") {
            *m = Value::String(model.to_owned());
        }
    }
    let (mut resp, replay) = if ctx.client_stream {
        let events = match keel_core::synthesize::stream_from_whole(protocol, ctx.endpoint, &body) {
            Ok(ev) => ev,
            Err(e) => {
                let e = GatewayError::new(
                    ErrorKind::Internal,
                    format!("keel: a cached answer could not be replayed: {e}"),
                );
                return delivery::error_response(log, protocol, &e);
            }
        };
        let (events, gap) = if pool.cfg.cache.pace_replay {
            let split = split_text(protocol, ctx.endpoint, events);
            let pieces = split.len().max(1) as u32;
            (split, Duration::from_millis(entry.generation_ms) / pieces)
        } else {
            (events, Duration::ZERO)
        };
        let (resp, tx, driver) = stream_head(ctx, protocol);
        (resp, Some((tx, driver, events, gap)))
    } else {
        let bytes = Bytes::from(body.to_string());
        let body = delivery::answer_body(ctx, StatusCode::OK, bytes);
        (full_body(StatusCode::OK, "application/json", body), None)
    };
    stamp(&mut resp, ctx, &mut log, &entry.variant);
    match replay {
        Some((tx, driver, events, gap)) => driver.run(send_events(tx, events, gap, log)),
        None => log.finish("ok", None),
    }
    resp
}

/// The response for a streaming request that follows an identical one's stream live (see
/// `flight`): the leader's events as they are sent to its client.
pub fn follow(
    pool: &Pool,
    ctx: &RequestCtx,
    follower: Follower,
    mut log: RequestLog,
    decisions: &Arc<DecisionLog>,
) -> Response<Body> {
    let variant = follower.variant();
    account(
        pool,
        ctx,
        &mut log,
        decisions,
        (&variant, follower.origin()),
    );
    let (mut resp, tx, driver) = stream_head(ctx, ctx.endpoint.protocol());
    stamp(&mut resp, ctx, &mut log, &variant);
    driver.run(send_followed(tx, follower, log));
    resp
}

/// A hit is accounted for as answered by `variant` with `origin`'s answer: route `cached`, no
/// attempts, and a decision record (kept in `decisions`) that names the original.
fn account(
    pool: &Pool,
    ctx: &RequestCtx,
    log: &mut RequestLog,
    decisions: &Arc<DecisionLog>,
    (variant, origin): (&str, &str),
) {
    log.route = "cached";
    log.cache = "hit";
    log.variant = variant.to_owned();
    log.cached_from = Some(origin.to_owned());
    let mut record = DecisionRecord::bare(&ctx.id, &pool.cfg.name);
    record.reason = "cached";
    record.prompt_edits = ctx.prompt_edits.clone();
    log.decision = Some(Draft::new(decisions, log.started, record));
}

/// A hit's headers, and its log's status and first-byte time.
fn stamp(resp: &mut Response<Body>, ctx: &RequestCtx, log: &mut RequestLog, variant: &str) {
    let h = resp.headers_mut();
    delivery::keel_headers(h, &ctx.id, "cached", variant, 0);
    h.insert(HEADER, HeaderValue::from_static("hit"));
    delivery::front_fixes(h, ctx);
    log.prompt_fixes = delivery::fix_codes(h);
    log.status = 200;
    log.ttft = Some(log.started.elapsed());
    log.stamp_overhead(h);
}

/// A streamed hit's head, the sender of its body, and the driver that runs what feeds it inside
/// the body's polls (see `body::driven`).
fn stream_head(ctx: &RequestCtx, protocol: Protocol) -> (Response<Body>, BodySender, Driver) {
    let (tx, body, driver) = driven(protocol);
    // A hit or a follower gets the masked answer: restored with this request's own map.
    let mut body = crate::pipeline::guard_stream::restore(body, protocol, ctx.guard.as_ref());
    if let Some(front) = &ctx.responses {
        body = front.stream(&ctx.id, body);
    }
    let mut resp = Response::new(body);
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    (resp, tx, driver)
}

/// Sends a streamed hit's events, `gap` apart, and finishes the request's log; the body ends
/// cleanly after the last (terminal) event.
async fn send_events(tx: BodySender, events: Vec<SseEvent>, gap: Duration, mut log: RequestLog) {
    for ev in events {
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
        if !tx.send(Bytes::from(ev.raw)).await {
            log.finish("cancelled", Some("client disconnected"));
            return;
        }
    }
    log.finish("ok", None);
    tx.end().await;
}

/// Forwards the leader's batches as they come, at this client's pace, and ends as its stream
/// ended: cleanly after its terminal event, or (the leader's relay vanished) with keel's error
/// event and an abort, as any stream whose producer is gone. A follower whose client leaves
/// stops following at once (the leader's relay may stop when no one is left).
async fn send_followed(tx: BodySender, follower: Follower, mut log: RequestLog) {
    match forward(follower, tx).await {
        Forwarded::Ended => log.finish("ok", None),
        Forwarded::ClientGone => log.finish("cancelled", Some("client disconnected")),
        Forwarded::Cut => log.finish("incomplete", Some("the stream it followed ended early")),
    }
}

/// Where an event of `endpoint` carries generated text, if anywhere.
fn text_pointer(protocol: Protocol, endpoint: Endpoint, ev: &Value) -> Option<&'static str> {
    let p = match (protocol, endpoint) {
        (Protocol::Anthropic, _) => "/delta/text",
        (_, Endpoint::Completions) => "/choices/0/text",
        _ => "/choices/0/delta/content",
    };
    ev.pointer(p).and_then(Value::as_str).map(|_| p)
}

/// The events with every text delta cut into pieces of [`PIECE_CHARS`] characters (the first
/// piece keeps the event's other fields, later ones drop an OpenAI `role`).
pub fn split_text(protocol: Protocol, endpoint: Endpoint, events: Vec<SseEvent>) -> Vec<SseEvent> {
    let mut out = Vec::with_capacity(events.len());
    for ev in events {
        let parsed: Option<Value> = serde_json::from_str(&ev.data).ok();
        let Some((v, at)) =
            parsed.and_then(|v| Some((v.clone(), text_pointer(protocol, endpoint, &v)?)))
        else {
            out.push(ev);
            continue;
        };
        let text = v.pointer(at).and_then(Value::as_str).unwrap_or("");
        let chars: Vec<char> = text.chars().collect();
        if chars.len() <= PIECE_CHARS {
            out.push(ev);
            continue;
        }
        for (i, piece) in chars.chunks(PIECE_CHARS).enumerate() {
            let mut p = v.clone();
            if let Some(slot) = p.pointer_mut(at) {
                *slot = Value::String(piece.iter().collect());
            }
            if i > 0 {
                if let Some(delta) = p
                    .pointer_mut("/choices/0/delta")
                    .and_then(Value::as_object_mut)
                {
                    delta.remove("role");
                }
            }
            out.push(SseEvent::new(ev.event.as_deref(), &p.to_string()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::assemble::Assembler;
    use serde_json::json;

    #[test]
    fn split_pieces_reassemble_to_the_same_answer() {
        let text = "The quick brown fox jumps over the lazy dog, twice over.";
        for (protocol, endpoint, body) in [
            (
                Protocol::OpenAi,
                Endpoint::ChatCompletions,
                json!({"id": "c", "created": 1, "model": "m", "choices": [{"index": 0,
                    "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}),
            ),
            (
                Protocol::Anthropic,
                Endpoint::Messages,
                json!({"id": "m", "model": "m", "content": [{"type": "text", "text": text}],
                    "stop_reason": "end_turn", "stop_sequence": null,
                    "usage": {"input_tokens": 1, "output_tokens": 12}}),
            ),
        ] {
            let events =
                keel_core::synthesize::stream_from_whole(protocol, endpoint, &body).unwrap();
            let split = split_text(protocol, endpoint, events.clone());
            assert!(split.len() >= events.len() + 3, "{protocol:?}");
            let mut a = Assembler::new();
            for ev in &split {
                a.push(protocol, ev).unwrap();
            }
            let out = a.finish(endpoint).to_value();
            match protocol {
                Protocol::OpenAi => {
                    assert_eq!(out["choices"][0]["message"]["content"], text);
                    assert_eq!(out["choices"][0]["finish_reason"], "stop");
                }
                Protocol::Anthropic => {
                    assert_eq!(out["content"][0]["text"], text);
                    assert_eq!(out["stop_reason"], "end_turn");
                }
            }
        }
    }
}
