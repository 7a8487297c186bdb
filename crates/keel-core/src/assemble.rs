//! Assembling a whole (non-streaming) response from stream events.
//!
//! keel sends non-streaming requests upstream as streams, so that the same stall detection and
//! migration protect them, and assembles what the client would have received as one body in the
//! protocol's non-streaming shape: OpenAI `chat.completion` / `text_completion` (content, tool
//! calls, finish reason, usage), Anthropic `message` (content blocks, tool inputs, stop reason,
//! usage). The events are the stitched, client-visible ones, so the body covers every segment.

use serde_json::{json, Map, Value};

use crate::protocol::{Endpoint, Protocol};
use crate::sse::SseEvent;

/// Builds one body from events.
#[derive(Debug, Clone, Default)]
pub struct Assembler {
    first: Option<Value>,
    text: String,
    /// OpenAI tool calls by index: (id, name, arguments).
    tool_calls: Vec<(Value, String, String)>,
    finish_reason: Value,
    usage: Value,
    /// Anthropic content blocks, and the partial JSON of tool inputs.
    blocks: Vec<Value>,
    partial_json: Vec<String>,
    stop_reason: Value,
    stop_sequence: Value,
    output_tokens: Value,
}

impl Assembler {
    pub fn new() -> Self {
        Assembler {
            finish_reason: Value::Null,
            usage: Value::Null,
            stop_reason: Value::Null,
            stop_sequence: Value::Null,
            output_tokens: Value::Null,
            ..Default::default()
        }
    }

    /// Takes one client-visible event (bytes of one or more events as the stitcher wrote them).
    pub fn push(&mut self, protocol: Protocol, ev: &SseEvent) {
        if ev.comment_only || ev.data == "[DONE]" {
            return;
        }
        // Most chunks carry one piece of text and nothing else: take it without a JSON tree.
        if protocol == Protocol::OpenAi && self.first.is_some() {
            if let Some(view) = crate::protocol::ChunkView::parse(&ev.data) {
                if view.is_plain_text() {
                    self.text.push_str(view.text().unwrap_or(""));
                    return;
                }
            }
        }
        let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
            return;
        };
        match protocol {
            Protocol::OpenAi => self.push_openai(v),
            Protocol::Anthropic => self.push_anthropic(ev.event.as_deref().unwrap_or(""), v),
        }
    }

    fn push_openai(&mut self, v: Value) {
        if self.first.is_none() {
            self.first = Some(v.clone());
        }
        if v.get("usage").is_some_and(|u| !u.is_null()) {
            self.usage = v["usage"].clone();
        }
        let Some(c) = v.get("choices").and_then(|c| c.get(0)) else {
            return;
        };
        if let Some(t) = c
            .pointer("/delta/content")
            .or_else(|| c.get("text"))
            .and_then(Value::as_str)
        {
            self.text.push_str(t);
        }
        if let Some(calls) = c.pointer("/delta/tool_calls").and_then(Value::as_array) {
            for call in calls {
                let i = call["index"].as_u64().unwrap_or(0) as usize;
                while self.tool_calls.len() <= i {
                    self.tool_calls
                        .push((Value::Null, String::new(), String::new()));
                }
                let slot = &mut self.tool_calls[i];
                if !call["id"].is_null() {
                    slot.0 = call["id"].clone();
                }
                if let Some(n) = call.pointer("/function/name").and_then(Value::as_str) {
                    slot.1.push_str(n);
                }
                if let Some(a) = call.pointer("/function/arguments").and_then(Value::as_str) {
                    slot.2.push_str(a);
                }
            }
        }
        if !c["finish_reason"].is_null() {
            self.finish_reason = c["finish_reason"].clone();
        }
    }

    fn push_anthropic(&mut self, name: &str, v: Value) {
        match name {
            "message_start" => self.first = Some(v["message"].clone()),
            "content_block_start" => {
                let i = v["index"].as_u64().unwrap_or(0) as usize;
                while self.blocks.len() <= i {
                    self.blocks.push(Value::Null);
                    self.partial_json.push(String::new());
                }
                self.blocks[i] = v["content_block"].clone();
            }
            "content_block_delta" => {
                let i = v["index"].as_u64().unwrap_or(0) as usize;
                if i >= self.blocks.len() {
                    return;
                }
                if let Some(t) = v.pointer("/delta/text").and_then(Value::as_str) {
                    let cur = self.blocks[i]["text"].as_str().unwrap_or("").to_owned();
                    self.blocks[i]["text"] = Value::String(cur + t);
                }
                if let Some(p) = v.pointer("/delta/partial_json").and_then(Value::as_str) {
                    self.partial_json[i].push_str(p);
                }
            }
            "message_delta" => {
                self.stop_reason = v
                    .pointer("/delta/stop_reason")
                    .cloned()
                    .unwrap_or(Value::Null);
                self.stop_sequence = v
                    .pointer("/delta/stop_sequence")
                    .cloned()
                    .unwrap_or(Value::Null);
                self.output_tokens = v
                    .pointer("/usage/output_tokens")
                    .cloned()
                    .unwrap_or(Value::Null);
            }
            _ => {}
        }
    }

    /// The whole response body.
    pub fn finish(mut self, endpoint: Endpoint) -> Value {
        let first = self.first.take().unwrap_or(Value::Null);
        match endpoint {
            Endpoint::Messages => {
                let content: Vec<Value> = self
                    .blocks
                    .into_iter()
                    .zip(self.partial_json)
                    .filter(|(b, _)| !b.is_null())
                    .map(|(mut b, json)| {
                        if b["type"] == "tool_use" {
                            b["input"] = serde_json::from_str(&json).unwrap_or_else(|_| json!({}));
                        }
                        b
                    })
                    .collect();
                let mut usage = first.get("usage").cloned().unwrap_or_else(|| json!({}));
                if !self.output_tokens.is_null() {
                    usage["output_tokens"] = self.output_tokens;
                }
                json!({"id": first["id"], "type": "message", "role": "assistant", "model": first["model"], "content": content,
                    "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": usage})
            }
            Endpoint::Completions => {
                json!({"id": first["id"], "object": "text_completion", "created": first["created"], "model": first["model"],
                "choices": [{"index": 0, "text": self.text, "logprobs": null, "finish_reason": self.finish_reason}], "usage": self.usage})
            }
            _ => {
                let mut message = Map::new();
                message.insert("role".into(), json!("assistant"));
                message.insert(
                    "content".into(),
                    if self.text.is_empty() && !self.tool_calls.is_empty() {
                        Value::Null
                    } else {
                        Value::String(self.text)
                    },
                );
                message.insert("refusal".into(), Value::Null);
                if !self.tool_calls.is_empty() {
                    let calls: Vec<Value> = self
                        .tool_calls
                        .into_iter()
                        .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
                        .collect();
                    message.insert("tool_calls".into(), Value::Array(calls));
                }
                json!({"id": first["id"], "object": "chat.completion", "created": first["created"], "model": first["model"],
                    "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": self.finish_reason}], "usage": self.usage})
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_chat_with_tool_call() {
        let mut a = Assembler::new();
        let ev = |v: Value| SseEvent::new(None, &v.to_string());
        a.push(Protocol::OpenAi, &ev(json!({"id": "x", "created": 5, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}, "finish_reason": null}]})));
        a.push(Protocol::OpenAi, &ev(json!({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":1}"}}]}, "finish_reason": null}]})));
        a.push(Protocol::OpenAi, &ev(json!({"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})));
        a.push(Protocol::OpenAi, &ev(json!({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})));
        let body = a.finish(Endpoint::ChatCompletions);
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(body["choices"][0]["message"]["content"], Value::Null);
        assert_eq!(
            body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(body["usage"]["total_tokens"], 7);
    }

    #[test]
    fn anthropic_message() {
        let mut a = Assembler::new();
        let ev = |n: &str, v: Value| SseEvent::new(Some(n), &v.to_string());
        a.push(Protocol::Anthropic, &ev("message_start", json!({"message": {"id": "msg", "model": "m", "usage": {"input_tokens": 9, "output_tokens": 1}}})));
        a.push(
            Protocol::Anthropic,
            &ev(
                "content_block_start",
                json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
        );
        a.push(
            Protocol::Anthropic,
            &ev(
                "content_block_delta",
                json!({"index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
            ),
        );
        a.push(
            Protocol::Anthropic,
            &ev(
                "content_block_delta",
                json!({"index": 0, "delta": {"type": "text_delta", "text": " there"}}),
            ),
        );
        a.push(Protocol::Anthropic, &ev("message_delta", json!({"delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 2}})));
        let body = a.finish(Endpoint::Messages);
        assert_eq!(
            body["content"],
            json!([{"type": "text", "text": "Hi there"}])
        );
        assert_eq!(
            body["usage"],
            json!({"input_tokens": 9, "output_tokens": 2})
        );
        assert_eq!(body["stop_reason"], "end_turn");
    }
}
