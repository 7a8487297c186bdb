//! A stream made from a whole response. Some OpenAI-compatible servers ignore `stream: true` and
//! answer with one JSON body; keel serves that answer instead of failing it: a streaming client
//! gets the events the server would have streamed (the same text, tool calls, finish reason and
//! usage, in the protocol's own event shapes), so the relay, stitching and assembly treat it as
//! any other stream.
//!
//! Nothing here indexes JSON in a way that can panic: a body of the wrong shape is an `Err`
//! (a `malformed` upstream failure), never a crash.

use serde_json::{json, Map, Value};

use crate::members::Members;
use crate::protocol::{Endpoint, Protocol};
use crate::sse::SseEvent;

/// The events of a stream equivalent to `body`, a whole response of `endpoint`.
pub fn stream_from_whole(
    protocol: Protocol,
    endpoint: Endpoint,
    body: &Value,
) -> Result<Vec<SseEvent>, String> {
    let obj = body
        .as_object()
        .ok_or("the whole response is not a JSON object")?;
    if obj.member("error").is_some_and(|e| !e.is_null())
        || obj.member("type") == Some(&json!("error"))
    {
        return Err("the whole response is an error body".into());
    }
    match (protocol, endpoint) {
        (Protocol::OpenAi, Endpoint::ChatCompletions) => Ok(openai(obj, false)),
        (Protocol::OpenAi, Endpoint::Completions) => Ok(openai(obj, true)),
        (Protocol::Anthropic, Endpoint::Messages) => anthropic(obj),
        _ => Err(format!(
            "a whole {} response cannot stand for a stream",
            endpoint.as_str()
        )),
    }
}

fn data(v: Value) -> SseEvent {
    SseEvent::new(None, &v.to_string())
}

fn named(name: &str, v: Value) -> SseEvent {
    SseEvent::new(Some(name), &v.to_string())
}

fn openai(obj: &Map<String, Value>, completions: bool) -> Vec<SseEvent> {
    let field = |k: &str| obj.get(k).cloned().unwrap_or(Value::Null);
    let object = if completions {
        "text_completion"
    } else {
        "chat.completion.chunk"
    };
    let chunk = |choice: Value| {
        data(
            json!({"id": field("id"), "object": object, "created": field("created"),
            "model": field("model"), "choices": [choice]}),
        )
    };
    let mut out = Vec::new();
    let choices = obj.member("choices").and_then(Value::as_array);
    for (n, c) in choices.into_iter().flatten().enumerate() {
        let Some(c) = c.as_object() else { continue };
        let index = c.member("index").cloned().unwrap_or(json!(n));
        if completions {
            let text = c.member("text").and_then(Value::as_str).unwrap_or("");
            out.push(chunk(
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": null}),
            ));
        } else {
            let msg = c.member("message").and_then(Value::as_object);
            let get = |k: &str| msg.and_then(|m| m.get(k)).cloned().unwrap_or(Value::Null);
            let mut delta = Map::new();
            delta.insert("role".into(), json!("assistant"));
            delta.insert("content".into(), get("content"));
            for k in ["refusal", "reasoning_content"] {
                if !get(k).is_null() {
                    delta.insert(k.into(), get(k));
                }
            }
            out.push(chunk(
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null}),
            ));
            let calls = get("tool_calls");
            for (i, call) in calls.as_array().into_iter().flatten().enumerate() {
                let Some(call) = call.as_object() else {
                    continue;
                };
                let mut call = call.clone();
                call.insert("index".into(), json!(i));
                out.push(chunk(
                    json!({"index": index, "delta": {"tool_calls": [call]}, "logprobs": null, "finish_reason": null}),
                ));
            }
        }
        let finish = c
            .member("finish_reason")
            .cloned()
            .filter(|f| !f.is_null())
            .unwrap_or(json!("stop"));
        let end = if completions {
            json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish})
        };
        out.push(chunk(end));
    }
    if let Some(usage) = obj.member("usage").filter(|u| !u.is_null()) {
        out.push(data(
            json!({"id": field("id"), "object": object, "created": field("created"),
                "model": field("model"), "choices": [], "usage": usage}),
        ));
    }
    out.push(SseEvent::new(None, "[DONE]"));
    out
}

fn anthropic(obj: &Map<String, Value>) -> Result<Vec<SseEvent>, String> {
    let field = |k: &str| obj.get(k).cloned().unwrap_or(Value::Null);
    let usage = obj.member("usage").and_then(Value::as_object);
    let mut start_usage = usage.cloned().unwrap_or_default();
    start_usage.insert("output_tokens".into(), json!(0));
    let mut out = vec![named(
        "message_start",
        json!({"type": "message_start", "message": {"id": field("id"), "type": "message",
            "role": "assistant", "model": field("model"), "content": [], "stop_reason": null,
            "stop_sequence": null, "usage": start_usage}}),
    )];
    let blocks = obj
        .member("content")
        .and_then(Value::as_array)
        .ok_or("the whole message has no content array")?;
    for (i, block) in blocks.iter().enumerate() {
        let Some(b) = block.as_object() else {
            return Err(format!("content block {i} is not an object"));
        };
        let kind = b.member("type").and_then(Value::as_str).unwrap_or("");
        let (start, delta) = match kind {
            "text" => (
                json!({"type": "text", "text": ""}),
                Some(
                    json!({"type": "text_delta", "text": b.member("text").and_then(Value::as_str).unwrap_or("")}),
                ),
            ),
            "tool_use" => {
                let mut s = b.clone();
                s.insert("input".into(), json!({}));
                let input = b.member("input").cloned().unwrap_or(json!({}));
                (
                    Value::Object(s),
                    Some(json!({"type": "input_json_delta", "partial_json": input.to_string()})),
                )
            }
            "thinking" => (
                json!({"type": "thinking", "thinking": ""}),
                Some(
                    json!({"type": "thinking_delta", "thinking": b.member("thinking").and_then(Value::as_str).unwrap_or("")}),
                ),
            ),
            // Anything else (redacted thinking, server tool results) arrives whole in its start.
            _ => (block.clone(), None),
        };
        out.push(named(
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": start}),
        ));
        if let Some(d) = delta {
            out.push(named(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i, "delta": d}),
            ));
        }
        out.push(named(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        ));
    }
    let output_tokens = usage
        .and_then(|u| u.member("output_tokens"))
        .cloned()
        .unwrap_or(json!(0));
    out.push(named(
        "message_delta",
        json!({"type": "message_delta", "delta": {"stop_reason": field("stop_reason"),
            "stop_sequence": field("stop_sequence")}, "usage": {"output_tokens": output_tokens}}),
    ));
    out.push(named("message_stop", json!({"type": "message_stop"})));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assemble::Assembler;
    use crate::protocol::{event_role, EventRole};

    /// A whole body turned into a stream and assembled again gives the same answer.
    fn round_trip(protocol: Protocol, endpoint: Endpoint, body: Value) -> Value {
        let events = stream_from_whole(protocol, endpoint, &body).unwrap();
        assert_eq!(
            events
                .iter()
                .filter(|e| event_role(protocol, e) == EventRole::Terminal)
                .count(),
            1
        );
        let mut a = Assembler::new();
        for ev in &events {
            a.push(protocol, ev).unwrap();
        }
        a.finish(endpoint).to_value()
    }

    #[test]
    fn openai_chat_with_text_tool_calls_and_usage() {
        let body = json!({"id": "c1", "object": "chat.completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
                "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}});
        let out = round_trip(Protocol::OpenAi, Endpoint::ChatCompletions, body);
        assert_eq!(out["id"], "c1");
        assert_eq!(
            out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert_eq!(out["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(out["usage"]["total_tokens"], 7);

        let text = json!({"id": "c2", "created": 1, "model": "m", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": "Hello there"}, "finish_reason": "stop"}]});
        let out = round_trip(Protocol::OpenAi, Endpoint::ChatCompletions, text);
        assert_eq!(out["choices"][0]["message"]["content"], "Hello there");
        assert_eq!(out["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn openai_completions() {
        let body = json!({"id": "t", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "once upon", "finish_reason": "length"}]});
        let out = round_trip(Protocol::OpenAi, Endpoint::Completions, body);
        assert_eq!(out["choices"][0]["text"], "once upon");
        assert_eq!(out["choices"][0]["finish_reason"], "length");
    }

    #[test]
    fn anthropic_message_with_text_and_tool_use() {
        let body = json!({"id": "msg", "type": "message", "role": "assistant", "model": "m",
            "content": [{"type": "text", "text": "Let me check."},
                        {"type": "tool_use", "id": "tu", "name": "weather", "input": {"city": "Oslo"}}],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 12, "output_tokens": 9}});
        let out = round_trip(Protocol::Anthropic, Endpoint::Messages, body.clone());
        assert_eq!(out["content"], body["content"]);
        assert_eq!(out["stop_reason"], "tool_use");
        assert_eq!(out["usage"]["output_tokens"], 9);
        assert_eq!(out["usage"]["input_tokens"], 12);
    }

    #[test]
    fn wrong_shapes_are_errors_not_panics() {
        for body in [
            json!(null),
            json!([1, 2]),
            json!("x"),
            json!({"error": {"message": "nope"}}),
            json!({"type": "error", "error": {}}),
        ] {
            assert!(stream_from_whole(Protocol::OpenAi, Endpoint::ChatCompletions, &body).is_err());
        }
        assert!(stream_from_whole(
            Protocol::Anthropic,
            Endpoint::Messages,
            &json!({"content": 5})
        )
        .is_err());
        assert!(stream_from_whole(
            Protocol::Anthropic,
            Endpoint::Messages,
            &json!({"content": [7]})
        )
        .is_err());
        // Odd but harmless shapes still give a well-formed stream.
        let odd =
            json!({"choices": [5, {"message": 3}, {"message": {"tool_calls": [1, {"id": 2}]}}]});
        let ev = stream_from_whole(Protocol::OpenAi, Endpoint::ChatCompletions, &odd).unwrap();
        assert_eq!(ev.last().unwrap().data, "[DONE]");
    }
}
