//! Round trips, refusals, fix codes, responses and streams, across both directions.

mod requests;
mod responses;
mod streams;

use serde_json::{json, Map, Value};

use super::*;
use crate::assemble::Assembler;
use crate::protocol::{Endpoint, Protocol};
use crate::sse::SseEvent;

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().expect("an object").clone()
}

fn anthropic_message() -> Value {
    json!({"id": "msg_01", "type": "message", "role": "assistant", "model": "claude-x",
        "content": [
            {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_A", "name": "weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_B", "name": "weather", "input": {"city": "Bergen", "units": ["c"]}}],
        "stop_reason": "tool_use", "stop_sequence": null,
        "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 90, "output_tokens": 25}})
}

fn ev(name: &str, v: Value) -> SseEvent {
    SseEvent::new(Some(name), &v.to_string())
}

fn chunk(delta: Value, finish: Value) -> SseEvent {
    SseEvent::new(
        None,
        &json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "up",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        .to_string(),
    )
}

fn translate_to_openai(s: &mut AnthropicToChatStream, events: &[SseEvent]) -> Vec<SseEvent> {
    let mut out = Vec::new();
    for e in events {
        s.push(e, &mut out).unwrap();
    }
    out
}

fn translate_to_anthropic(s: &mut ChatToAnthropicStream, events: &[SseEvent]) -> Vec<SseEvent> {
    let mut out = Vec::new();
    for e in events {
        s.push(e, &mut out).unwrap();
    }
    out
}

fn assemble(protocol: Protocol, endpoint: Endpoint, events: &[SseEvent]) -> Value {
    let mut a = Assembler::new();
    for e in events {
        a.push(protocol, e).unwrap();
    }
    a.finish(endpoint).to_value()
}

fn assemble_openai(s: &mut AnthropicToChatStream, events: &[SseEvent]) -> Value {
    let out = translate_to_openai(s, events);
    assert_eq!(out.last().unwrap().data, "[DONE]");
    assert!(s.is_done());
    assemble(Protocol::OpenAi, Endpoint::ChatCompletions, &out)
}

/// `text` cut at the character positions `cuts` (taken modulo its length), in order.
pub(crate) fn split_at(text: &str, cuts: &[usize]) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
    points.push(0);
    points.push(chars.len());
    points.sort_unstable();
    points.dedup();
    points
        .windows(2)
        .map(|w| chars[w[0]..w[1]].iter().collect())
        .collect()
}
