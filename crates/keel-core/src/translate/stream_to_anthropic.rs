//! An OpenAI `chat.completion.chunk` stream, chunk by chunk, as an Anthropic Messages stream.
//!
//! Anthropic content blocks do not interleave: each starts, takes its deltas and stops before
//! the next starts. Text, reasoning and each tool call become one block in the order they
//! appear. Two things wait: a tool call's block starts once its name is known (its id and
//! name normally come together in its first chunk; argument fragments that arrive before the
//! name are held until it does), and the `message_delta` that carries the stop reason and usage
//! goes out at `[DONE]`, because OpenAI sends the usage chunk after the finish reason.

use std::borrow::Cow;

use serde_json::{json, Value};

use super::{passes_untranslated, stop_reason_of, usage_to_anthropic};
use crate::assemble::chunk::{Call, Chunk};
use crate::assemble::{MAX_ASSEMBLED_BYTES, MAX_TOOL_CALLS};
use crate::members::Members;
use crate::protocol::MapOnly;
use crate::protocol::Protocol;
use crate::sse::SseEvent;
use crate::translate::response::error_event_to_protocol;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Text,
    Thinking,
    /// The tool call with this OpenAI index.
    Tool(usize),
}

#[derive(Debug, Clone, Default)]
struct ToolCall {
    id: Option<String>,
    name: String,
    /// Arguments received before the block could start.
    pending: String,
    started: bool,
}

/// Translates one OpenAI chat stream for a Messages client.
#[derive(Debug, Clone)]
pub struct ChatToAnthropicStream {
    model: String,
    id: Value,
    started: bool,
    /// The open block: what it holds and its Anthropic index.
    open: Option<(Open, usize)>,
    next_block: usize,
    tools: Vec<ToolCall>,
    stop_reason: Option<&'static str>,
    refused: bool,
    usage: Option<Value>,
    done: bool,
}

impl ChatToAnthropicStream {
    /// `public_model` names the model in `message_start`.
    pub fn new(public_model: &str) -> Self {
        ChatToAnthropicStream {
            model: public_model.to_owned(),
            id: Value::Null,
            started: false,
            open: None,
            next_block: 0,
            tools: Vec::new(),
            stop_reason: None,
            refused: false,
            usage: None,
            done: false,
        }
    }

    /// Whether the stream has ended (`message_stop` or an error event was written).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Translates one upstream event, appending the client's events to `out`. `Err` is a
    /// malformed upstream event (bad JSON, an out-of-range or resumed tool call).
    pub fn push(&mut self, ev: &SseEvent, out: &mut Vec<SseEvent>) -> Result<(), String> {
        if passes_untranslated(self.done, ev, out) {
            return Ok(());
        }
        if ev.data == "[DONE]" {
            self.finish(out);
            return Ok(());
        }
        // Read without a JSON tree where the chunk has the expected shape (see
        // `assemble::chunk`); an error, or any other shape, is read from its tree.
        let tree: Value;
        let chunk = match Chunk::parse(&ev.data) {
            Ok(chunk) if chunk.error.is_none() => chunk,
            _ => {
                tree = serde_json::from_str(&ev.data)
                    .map_err(|e| format!("invalid JSON in an OpenAI stream chunk: {e}"))?;
                if tree.member("error").is_some_and(|e| !e.is_null()) {
                    out.push(error_event_to_protocol(&tree, Protocol::Anthropic));
                    self.done = true;
                    return Ok(());
                }
                Chunk::from_tree(&tree)
            }
        };
        if self.id.is_null() {
            self.id = chunk.id.clone().unwrap_or(Value::Null);
        }
        self.start(out);
        if let Some(u) = chunk.usage.as_ref().filter(|u| u.is_object()) {
            self.usage = Some(usage_to_anthropic(u));
        }
        let Some(choice) = chunk.choices.as_ref().and_then(|c| c.0.as_ref()) else {
            return Ok(());
        };
        let delta = choice.delta();
        let reasoning =
            delta.and_then(|d| non_empty(&d.reasoning_content).or_else(|| non_empty(&d.reasoning)));
        if let Some(r) = reasoning {
            let block = json!({"type": "thinking", "thinking": "", "signature": ""});
            self.open_block(Open::Thinking, block, out);
            self.block_delta(DeltaOut::Thinking { thinking: r }, out);
        }
        let texts = delta.map(|d| {
            [
                (non_empty(&d.content), false),
                (non_empty(&d.refusal), true),
            ]
        });
        for (t, refusal) in texts.into_iter().flatten() {
            if let Some(t) = t {
                self.refused |= refusal;
                self.open_block(Open::Text, json!({"type": "text", "text": ""}), out);
                self.block_delta(DeltaOut::Text { text: t }, out);
            }
        }
        for MapOnly(call) in choice.calls() {
            self.tool_call(call, out)?;
        }
        if let Some(f) = choice.finish_reason.as_ref().and_then(Value::as_str) {
            self.close_block(out);
            self.stop_reason = Some(if self.refused {
                "refusal"
            } else {
                stop_reason_of(f)
            });
        }
        Ok(())
    }

    fn tool_call(&mut self, call: &Call<'_>, out: &mut Vec<SseEvent>) -> Result<(), String> {
        let i = call
            .index
            .and_then(|i| usize::try_from(i).ok())
            .filter(|&i| i < MAX_TOOL_CALLS)
            .ok_or_else(|| {
                format!("a tool call index that is missing or not below {MAX_TOOL_CALLS}")
            })?;
        if self.tools.len() <= i {
            self.tools.resize(i + 1, ToolCall::default());
        }
        let function = call.function.as_ref().map(|f| &f.0);
        let args = function.and_then(|f| f.arguments.as_deref()).unwrap_or("");
        if self.tools[i].started {
            if !matches!(self.open, Some((Open::Tool(j), _)) if j == i) {
                return Err(format!("tool call {i} resumed after another block began"));
            }
            if !args.is_empty() {
                self.block_delta(DeltaOut::InputJson { partial_json: args }, out);
            }
            return Ok(());
        }
        let slot = &mut self.tools[i];
        if let Some(id) = call.id.as_ref().and_then(Value::as_str) {
            slot.id = Some(id.to_owned());
        }
        if let Some(n) = function.and_then(|f| f.name.as_deref()) {
            slot.name.push_str(n);
        }
        slot.pending.push_str(args);
        if slot.pending.len() + slot.name.len() > MAX_ASSEMBLED_BYTES {
            return Err(format!(
                "tool call {i} sent more than {MAX_ASSEMBLED_BYTES} bytes before its name"
            ));
        }
        if slot.name.is_empty() || (slot.id.is_none() && slot.pending.is_empty()) {
            // Wait for the id (it usually comes with the name) or the first argument.
            return Ok(());
        }
        let id = match &slot.id {
            Some(id) => id.clone(),
            None => format!("toolu_{}_{i}", self.id.as_str().unwrap_or("keel")),
        };
        let name = slot.name.clone();
        let pending = std::mem::take(&mut slot.pending);
        slot.started = true;
        let block = json!({"type": "tool_use", "id": id, "name": name, "input": {}});
        self.open_block(Open::Tool(i), block, out);
        if !pending.is_empty() {
            self.block_delta(
                DeltaOut::InputJson {
                    partial_json: &pending,
                },
                out,
            );
        }
        Ok(())
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        out.push(named(
            "message_start",
            json!({"type": "message_start", "message": {"id": self.id, "type": "message",
                "role": "assistant", "model": self.model, "content": [], "stop_reason": null,
                "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}}}),
        ));
    }

    /// Makes `kind` the open block, closing the previous one if it is another; `block` is the
    /// new block's start shape.
    fn open_block(&mut self, kind: Open, block: Value, out: &mut Vec<SseEvent>) {
        if matches!(self.open, Some((k, _)) if k == kind) {
            return;
        }
        self.close_block(out);
        let index = self.next_block;
        self.next_block += 1;
        self.open = Some((kind, index));
        out.push(named(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
    }

    /// A delta of the open block, serialized straight from its parts (a tree for each, then
    /// serialized, was a third of what translating a stream cost).
    fn block_delta(&self, delta: DeltaOut<'_>, out: &mut Vec<SseEvent>) {
        if let Some((_, index)) = self.open {
            let ev = BlockDeltaOut {
                kind: "content_block_delta",
                index,
                delta,
            };
            // Cannot fail: every map key is a string.
            let data = serde_json::to_string(&ev).unwrap_or_default();
            out.push(SseEvent::new(Some("content_block_delta"), &data));
        }
    }

    fn close_block(&mut self, out: &mut Vec<SseEvent>) {
        if let Some((_, index)) = self.open.take() {
            out.push(named(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn finish(&mut self, out: &mut Vec<SseEvent>) {
        self.start(out);
        self.close_block(out);
        let usage = self
            .usage
            .take()
            .unwrap_or_else(|| json!({"output_tokens": 0}));
        out.push(named(
            "message_delta",
            json!({"type": "message_delta",
                "delta": {"stop_reason": self.stop_reason.unwrap_or("end_turn"), "stop_sequence": null},
                "usage": usage}),
        ));
        out.push(named("message_stop", json!({"type": "message_stop"})));
        self.done = true;
    }
}

/// A delta's text, unless it is empty.
fn non_empty<'s>(t: &'s Option<Cow<'_, str>>) -> Option<&'s str> {
    t.as_deref().filter(|s| !s.is_empty())
}

/// A `content_block_delta` event, in the order of its members on the wire.
#[derive(serde::Serialize)]
struct BlockDeltaOut<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    index: usize,
    delta: DeltaOut<'a>,
}

/// What a delta adds to its block.
#[derive(serde::Serialize)]
#[serde(tag = "type")]
enum DeltaOut<'a> {
    #[serde(rename = "text_delta")]
    Text { text: &'a str },
    #[serde(rename = "thinking_delta")]
    Thinking { thinking: &'a str },
    #[serde(rename = "input_json_delta")]
    InputJson { partial_json: &'a str },
}

fn named(name: &str, v: Value) -> SseEvent {
    SseEvent::new(Some(name), &v.to_string())
}
