//! An Anthropic Messages stream, event by event, as an OpenAI `chat.completion.chunk` stream.
//!
//! Every Anthropic event becomes at most one chunk at once: nothing is held back (a tool call's
//! id and name arrive whole in its `content_block_start`, so its first chunk can go at once,
//! and argument fragments follow as they come).

use serde_json::{json, Map, Value};

use super::{finish_reason_of, passes_untranslated, usage_to_openai, ResponseContext};
use crate::assemble::chunk::BlockDelta;
use crate::assemble::MAX_CONTENT_BLOCKS;
use crate::members::Members;
use crate::protocol::Protocol;
use crate::sse::SseEvent;
use crate::translate::response::error_event_to_protocol;

/// What an Anthropic content block becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    /// A tool call, with its OpenAI `tool_calls` index.
    Tool(usize),
    /// The forced tool standing for `response_format`: its input is the answer text.
    JsonAnswer,
    Thinking,
    /// Redacted thinking, server tools: nothing for a Chat client.
    Ignored,
}

/// Translates one Anthropic stream for a Chat Completions client.
#[derive(Debug, Clone)]
pub struct AnthropicToChatStream {
    ctx: ResponseContext,
    model: String,
    created_s: u64,
    id: Value,
    started: bool,
    blocks: Vec<Option<Block>>,
    tool_calls: usize,
    answered_by_json_tool: bool,
    /// A chunk with a finish reason went out.
    finished: bool,
    usage: Map<String, Value>,
    done: bool,
}

impl AnthropicToChatStream {
    /// `public_model` names the model in every chunk; `created_s` is the chunks' `created`.
    pub fn new(ctx: ResponseContext, public_model: &str, created_s: u64) -> Self {
        AnthropicToChatStream {
            ctx,
            model: public_model.to_owned(),
            created_s,
            id: Value::Null,
            started: false,
            blocks: Vec::new(),
            tool_calls: 0,
            answered_by_json_tool: false,
            finished: false,
            usage: Map::new(),
            done: false,
        }
    }

    /// Whether the stream has ended (`[DONE]` or an error event was written).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Translates one upstream event, appending the client's events to `out`. `Err` is a
    /// malformed upstream event (bad JSON, an out-of-range block index).
    pub fn push(&mut self, ev: &SseEvent, out: &mut Vec<SseEvent>) -> Result<(), String> {
        if passes_untranslated(self.done, ev, out) {
            return Ok(());
        }
        // Text deltas, nearly every event, are read without a JSON tree where they have the
        // expected shape (see `assemble::chunk`).
        if ev.event.as_deref() == Some("content_block_delta") {
            if let Ok(delta) = BlockDelta::parse(&ev.data) {
                return self.block_delta(&delta, out);
            }
        }
        let v: Value = serde_json::from_str(&ev.data)
            .map_err(|e| format!("invalid JSON in an Anthropic stream event: {e}"))?;
        let name = ev
            .event
            .as_deref()
            .or_else(|| v.member("type").and_then(Value::as_str))
            .unwrap_or("");
        match name {
            "ping" => out.push(comment("ping")),
            "message_start" => {
                let msg = v.member("message").unwrap_or(&Value::Null);
                self.id = msg.member("id").cloned().unwrap_or(Value::Null);
                self.merge_usage(msg.member("usage"));
                self.start(out);
            }
            "content_block_start" => {
                self.start(out);
                let i = block_index(v.member("index").and_then(Value::as_u64))?;
                let block = v.member("content_block").unwrap_or(&Value::Null);
                let kind = match block.member("type").and_then(Value::as_str).unwrap_or("") {
                    "text" => {
                        let t = block.member("text").and_then(Value::as_str).unwrap_or("");
                        self.emit_delta(ChatDelta::Content { content: t }, t, out);
                        Block::Text
                    }
                    "thinking" => Block::Thinking,
                    "tool_use" => {
                        let name = block.member("name").and_then(Value::as_str).unwrap_or("");
                        if self.ctx.json_tool.as_deref() == Some(name) {
                            self.answered_by_json_tool = true;
                            Block::JsonAnswer
                        } else {
                            let k = self.tool_calls;
                            self.tool_calls += 1;
                            let call = json!({"index": k, "id": block.member("id").cloned().unwrap_or(Value::Null),
                                "type": "function", "function": {"name": name, "arguments": ""}});
                            out.push(self.chunk(
                                ChatDelta::Tree(json!({"tool_calls": [call]})),
                                Value::Null,
                            ));
                            Block::Tool(k)
                        }
                    }
                    _ => Block::Ignored,
                };
                if self.blocks.len() <= i {
                    self.blocks.resize(i + 1, None);
                }
                self.blocks[i] = Some(kind);
            }
            "content_block_delta" => self.block_delta(&BlockDelta::from_tree(&v), out)?,
            "message_delta" => {
                self.start(out);
                self.merge_usage(v.member("usage"));
                if let Some(stop) = v.pointer("/delta/stop_reason").and_then(Value::as_str) {
                    let finish = if self.answered_by_json_tool && stop == "tool_use" {
                        "stop"
                    } else {
                        finish_reason_of(stop)
                    };
                    out.push(self.chunk(ChatDelta::Tree(json!({})), json!(finish)));
                    self.finished = true;
                }
            }
            "message_stop" => {
                self.start(out);
                if !self.finished {
                    // Chat clients expect a finish reason; the upstream gave none.
                    out.push(self.chunk(ChatDelta::Tree(json!({})), json!("stop")));
                    self.finished = true;
                }
                if self.ctx.include_usage {
                    let usage = usage_to_openai(&Value::Object(self.usage.clone()));
                    out.push(self.write(&[], Some(usage)));
                }
                out.push(SseEvent::new(None, "[DONE]"));
                self.done = true;
            }
            "error" => {
                out.push(error_event_to_protocol(&v, Protocol::OpenAi));
                self.done = true;
            }
            // content_block_stop, and event types newer than this code.
            _ => {}
        }
        Ok(())
    }

    /// The role chunk, once, before anything else.
    fn start(&mut self, out: &mut Vec<SseEvent>) {
        if !self.started {
            self.started = true;
            out.push(self.chunk(
                ChatDelta::Tree(json!({"role": "assistant", "content": ""})),
                Value::Null,
            ));
        }
    }

    /// A content block delta: text, reasoning, the JSON answer's text, or a tool call's
    /// arguments.
    fn block_delta(&self, d: &BlockDelta<'_>, out: &mut Vec<SseEvent>) -> Result<(), String> {
        let i = block_index(d.index)?;
        let Some(kind) = self.blocks.get(i).copied().flatten() else {
            return Err(format!(
                "a delta for content block {i}, which never started"
            ));
        };
        let p = d.delta.as_ref().map(|p| &p.0);
        let delta_type = p.and_then(|p| p.kind.as_deref()).unwrap_or("");
        let text = p.and_then(|p| p.text.as_deref()).unwrap_or("");
        let thinking = p.and_then(|p| p.thinking.as_deref()).unwrap_or("");
        let partial_json = p.and_then(|p| p.partial_json.as_deref()).unwrap_or("");
        match (kind, delta_type) {
            (Block::Text, "text_delta") => {
                self.emit_delta(ChatDelta::Content { content: text }, text, out)
            }
            (Block::Thinking, "thinking_delta") => self.emit_delta(
                ChatDelta::Reasoning {
                    reasoning_content: thinking,
                },
                thinking,
                out,
            ),
            (Block::JsonAnswer, "input_json_delta") => self.emit_delta(
                ChatDelta::Content {
                    content: partial_json,
                },
                partial_json,
                out,
            ),
            (Block::Tool(k), "input_json_delta") => {
                let call = json!({"index": k, "function": {"arguments": partial_json}});
                self.emit_delta(
                    ChatDelta::Tree(json!({"tool_calls": [call]})),
                    partial_json,
                    out,
                );
            }
            // Signatures, citations and whatever comes next: no Chat form.
            _ => {}
        }
        Ok(())
    }

    fn emit_delta(&self, delta: ChatDelta<'_>, payload: &str, out: &mut Vec<SseEvent>) {
        if !payload.is_empty() {
            out.push(self.chunk(delta, Value::Null));
        }
    }

    fn merge_usage(&mut self, usage: Option<&Value>) {
        if let Some(Value::Object(u)) = usage {
            for (k, v) in u {
                if v.is_u64() {
                    self.usage.insert(k.clone(), v.clone());
                }
            }
        }
    }

    /// A chunk of one choice; `"usage": null` on each when the client asked for usage.
    fn chunk(&self, delta: ChatDelta<'_>, finish: Value) -> SseEvent {
        let choice = ChoiceOut {
            index: 0,
            delta,
            logprobs: (),
            finish_reason: finish,
        };
        self.write(&[choice], self.ctx.include_usage.then_some(Value::Null))
    }

    /// A chunk serialized straight from its parts: a tree built for each chunk, then
    /// serialized, was most of what translating a stream cost.
    fn write(&self, choices: &[ChoiceOut<'_>], usage: Option<Value>) -> SseEvent {
        let chunk = ChunkOut {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created_s,
            model: &self.model,
            choices,
            usage,
        };
        // Cannot fail: every map key is a string.
        SseEvent::new(None, &serde_json::to_string(&chunk).unwrap_or_default())
    }
}

/// A `chat.completion.chunk`, in the order of its members on the wire.
#[derive(serde::Serialize)]
struct ChunkOut<'a> {
    id: &'a Value,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: &'a [ChoiceOut<'a>],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Value>,
}

#[derive(serde::Serialize)]
struct ChoiceOut<'a> {
    index: u32,
    delta: ChatDelta<'a>,
    logprobs: (),
    finish_reason: Value,
}

fn block_index(index: Option<u64>) -> Result<usize, String> {
    let i = index.ok_or("a content block event without an index")?;
    usize::try_from(i)
        .ok()
        .filter(|&i| i < MAX_CONTENT_BLOCKS)
        .ok_or_else(|| format!("content block index {i} exceeds the limit of {MAX_CONTENT_BLOCKS}"))
}

fn comment(text: &str) -> SseEvent {
    SseEvent {
        event: None,
        data: String::new(),
        comment_only: true,
        raw: SseEvent::comment(text),
    }
}

/// A chunk's `delta`: text and reasoning written straight from their text (nearly every
/// chunk), anything else from a tree.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum ChatDelta<'a> {
    Content { content: &'a str },
    Reasoning { reasoning_content: &'a str },
    Tree(Value),
}
