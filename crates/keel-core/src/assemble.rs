//! Assembling a whole (non-streaming) response from stream events.
//!
//! keel sends non-streaming requests upstream as streams, so that the same stall detection and
//! migration protect them, and assembles what the client would have received as one body in the
//! protocol's non-streaming shape: OpenAI `chat.completion` / `text_completion` (content, tool
//! calls, finish reason, usage), Anthropic `message` (content blocks, tool inputs, stop reason,
//! usage). The events are the stitched, client-visible ones, so the body covers every segment.
//!
//! **Hostile input.** Every event comes from an upstream keel does not control. Nothing here
//! indexes JSON mutably without checking its shape, and everything that grows is bounded:
//! tool-call and content-block indexes by [`MAX_TOOL_CALLS`] and [`MAX_CONTENT_BLOCKS`] (slots
//! are allocated up to the index an upstream names, so an unbounded index is an allocation of
//! the upstream's choosing), and the accumulated text, arguments and tool inputs together by
//! [`MAX_ASSEMBLED_BYTES`]. Exceeding a bound makes [`Assembler::push`] return `Err` with the
//! message of a `malformed` upstream failure, which fails over or migrates like any other.

mod answer;
pub(crate) mod chunk;

use serde_json::{json, Map, Value};

pub use answer::Answer;
use chunk::{BlockDelta, Chunk};

use crate::members::Members;
use crate::protocol::{Endpoint, MapOnly, Protocol};
use crate::sse::SseEvent;
use crate::stream_watch::ChunkTemplate;

/// Highest number of tool calls in one OpenAI response (`index` 0..=255). Real responses carry a
/// handful (parallel tool calls are bounded by the tools a request declares, and APIs cap those
/// at 128); 256 leaves room while keeping the slots keel allocates for one index small (a few
/// kilobytes), whatever index an upstream writes.
pub const MAX_TOOL_CALLS: usize = 256;

/// Highest number of content blocks in one Anthropic message (`index` 0..=255), for the same
/// reason as [`MAX_TOOL_CALLS`]: a message holds a few text, thinking and tool-use blocks.
pub const MAX_CONTENT_BLOCKS: usize = 256;

/// Most bytes of text, tool-call names and arguments, and tool-input JSON one response may
/// accumulate: the default largest whole upstream body (64 MiB) — a non-streaming client would
/// not get more from an upstream that answered in one piece.
pub const MAX_ASSEMBLED_BYTES: usize = 64 * 1024 * 1024;

/// Builds one body from events.
#[derive(Debug, Clone, Default)]
pub struct Assembler {
    /// The OpenAI answer's identity (`id`, `created`, `model`), from its first chunk.
    identity: Option<Identity>,
    /// The Anthropic `message` of `message_start`.
    message: Option<Value>,
    text: String,
    /// OpenAI tool calls by index: (id, name, arguments).
    tool_calls: Vec<(Value, String, String)>,
    finish_reason: Value,
    usage: Value,
    /// Anthropic content blocks, the text their deltas added, and the partial JSON of tool
    /// inputs (kept apart from the blocks so that appending is not a copy of the whole text).
    blocks: Vec<Value>,
    block_text: Vec<String>,
    partial_json: Vec<String>,
    stop_reason: Value,
    stop_sequence: Value,
    output_tokens: Value,
    /// The token counts of `message_delta`'s `usage` (cumulative: they replace those of
    /// `message_start`). Anthropic sends the input counts there too; a dialect that learns
    /// them only at the end (Bedrock, Gemini) sends them only there.
    delta_usage: Map<String, Value>,
    /// Bytes accumulated so far (see [`MAX_ASSEMBLED_BYTES`]).
    accumulated: usize,
    /// The `model` the answer is given, whatever its events said ([`Assembler::answering_as`]).
    model: Option<Value>,
    /// The bytes around the text of the last Anthropic text delta parsed, and its block: a
    /// delta written alike is that JSON with only its text changed, appended without parsing
    /// it (a parse costs ≈ 1,700 instructions a delta, 8% of an assembled Anthropic answer).
    delta_template: ChunkTemplate,
    delta_block: usize,
}

#[derive(Debug, Clone, Default)]
struct Identity {
    id: Value,
    created: Value,
    model: Value,
}

impl Identity {
    /// The identity of the first chunk, if any, with `model` in place of its name.
    fn named(first: Option<Identity>, model: Option<Value>) -> Identity {
        let mut identity = first.unwrap_or_default();
        if let Some(m) = model {
            identity.model = m;
        }
        identity
    }

    /// An OpenAI answer of this identity.
    fn answer<C>(self, object: &'static str, choice: C, usage: Value) -> answer::OpenAiAnswer<C> {
        answer::OpenAiAnswer {
            id: self.id,
            object,
            created: self.created,
            model: self.model,
            choices: [choice],
            usage,
        }
    }
}

/// An upstream-supplied index, if it is within `max` slots.
fn bounded_index(v: &Value, max: usize, what: &str) -> Result<usize, String> {
    bounded(v.member("index").and_then(Value::as_u64), max, what)
}

/// An index (0 when absent), if it is within `max` slots.
fn bounded(i: Option<u64>, max: usize, what: &str) -> Result<usize, String> {
    let i = i.unwrap_or(0);
    match usize::try_from(i) {
        Ok(i) if i < max => Ok(i),
        _ => Err(format!(
            "upstream sent {what} index {i}; at most {max} are accepted"
        )),
    }
}

impl Assembler {
    pub fn new() -> Self {
        Self::default()
    }

    /// An assembler whose answer names `model`, whatever its events say: a gateway that
    /// answers with the name its client asked for gives it to the whole answer once, instead
    /// of renaming every event only it reads.
    pub fn answering_as(model: &str) -> Self {
        Assembler {
            model: Some(Value::String(model.to_owned())),
            ..Self::default()
        }
    }

    /// Counts `n` more accumulated bytes against [`MAX_ASSEMBLED_BYTES`].
    fn grow(&mut self, n: usize) -> Result<(), String> {
        self.accumulated = self.accumulated.saturating_add(n);
        if self.accumulated > MAX_ASSEMBLED_BYTES {
            return Err(format!(
                "upstream response exceeds {MAX_ASSEMBLED_BYTES} bytes of assembled output"
            ));
        }
        Ok(())
    }

    /// Takes one client-visible event (bytes of one or more events as the stitcher wrote them).
    /// `Err` is the message of a `malformed` upstream failure: the response broke a bound (see
    /// the module doc) and must not be served.
    pub fn push(&mut self, protocol: Protocol, ev: &SseEvent) -> Result<(), String> {
        if ev.comment_only || ev.data == "[DONE]" {
            return Ok(());
        }
        match protocol {
            Protocol::OpenAi => self.push_openai(&ev.data),
            Protocol::Anthropic => {
                let name = ev.event.as_deref().unwrap_or("");
                match name {
                    // Most events are text deltas: read without a JSON tree, and those written
                    // like the last one parsed without parsing them.
                    "content_block_delta" => {
                        if let Some(t) = self.delta_template.text(&ev.data) {
                            self.grow(t.len())?;
                            self.block_text[self.delta_block].push_str(t);
                            return Ok(());
                        }
                        if let Ok(delta) = BlockDelta::parse(&ev.data) {
                            return self.read_block_delta(&delta, Some(&ev.data));
                        }
                    }
                    "message_start" | "content_block_start" | "message_delta" => {}
                    // Nothing else adds to the answer (a block's stop, the message's stop,
                    // pings): not parsed for nothing.
                    _ => return Ok(()),
                }
                let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
                    return Ok(());
                };
                self.push_anthropic(name, v)
            }
        }
    }

    /// [`Assembler::push`] for an event already read (`stream_watch::read_event`): a plain
    /// text chunk (`plain`, its `text`) after the first is appended without parsing it again,
    /// and any other chunk is read whole without first looking for plain text.
    pub fn push_read(
        &mut self,
        protocol: Protocol,
        ev: &SseEvent,
        plain: bool,
        text: Option<&str>,
    ) -> Result<(), String> {
        if protocol != Protocol::OpenAi || ev.comment_only || ev.data == "[DONE]" {
            return self.push(protocol, ev);
        }
        match (plain, &self.identity) {
            (true, Some(_)) => self.append(text.unwrap_or("")),
            _ => self.read_chunk(&ev.data),
        }
    }

    /// Appends a plain chunk's text.
    fn append(&mut self, t: &str) -> Result<(), String> {
        self.grow(t.len())?;
        self.text.push_str(t);
        Ok(())
    }

    fn push_openai(&mut self, data: &str) -> Result<(), String> {
        // Most chunks carry one piece of text and nothing else: take it without reading the rest.
        if self.identity.is_some() {
            if let Some(view) = crate::protocol::ChunkView::parse(data) {
                if view.is_plain_text() {
                    return self.append(view.text().unwrap_or(""));
                }
            }
        }
        self.read_chunk(data)
    }

    /// Reads an OpenAI chunk: without a JSON tree where it has the expected shape (see
    /// [`chunk`]); data that is not JSON is skipped.
    fn read_chunk(&mut self, data: &str) -> Result<(), String> {
        match Chunk::parse(data) {
            Ok(chunk) => self.read_openai(chunk),
            Err(_) => match serde_json::from_str::<Value>(data) {
                Ok(tree) => self.read_openai(Chunk::from_tree(&tree)),
                Err(_) => Ok(()),
            },
        }
    }

    fn read_openai(&mut self, chunk: Chunk<'_>) -> Result<(), String> {
        let Chunk {
            id,
            created,
            model,
            usage,
            choices,
            ..
        } = chunk;
        // The first chunk gives the answer its identity.
        if self.identity.is_none() {
            self.identity = Some(Identity {
                id: id.unwrap_or_default(),
                created: created.unwrap_or_default(),
                model: model.unwrap_or_default(),
            });
        }
        if let Some(u) = usage {
            self.usage = u;
        }
        let Some(c) = choices.and_then(|c| c.0) else {
            return Ok(());
        };
        if let Some(t) = c.text() {
            self.grow(t.len())?;
            self.text.push_str(t);
        }
        for MapOnly(call) in c.calls() {
            let i = bounded(call.index, MAX_TOOL_CALLS, "tool call")?;
            let f = call.function.as_ref().map(|f| &f.0);
            let name = f.and_then(|f| f.name.as_deref());
            let args = f.and_then(|f| f.arguments.as_deref());
            self.grow(name.map_or(0, str::len) + args.map_or(0, str::len))?;
            if self.tool_calls.len() <= i {
                self.tool_calls
                    .resize(i + 1, (Value::Null, String::new(), String::new()));
            }
            let slot = &mut self.tool_calls[i];
            if let Some(id) = &call.id {
                slot.0 = id.clone();
            }
            slot.1.push_str(name.unwrap_or(""));
            slot.2.push_str(args.unwrap_or(""));
        }
        if let Some(f) = c.finish_reason {
            self.finish_reason = f;
        }
        Ok(())
    }

    fn push_anthropic(&mut self, name: &str, v: Value) -> Result<(), String> {
        match name {
            "message_start" => {
                self.message = Some(v.member("message").cloned().unwrap_or(Value::Null))
            }
            "content_block_start" => {
                let i = bounded_index(&v, MAX_CONTENT_BLOCKS, "content block")?;
                if self.blocks.len() <= i {
                    self.blocks.resize(i + 1, Value::Null);
                    self.block_text.resize(i + 1, String::new());
                    self.partial_json.resize(i + 1, String::new());
                }
                self.blocks[i] = v.member("content_block").cloned().unwrap_or(Value::Null);
                self.block_text[i].clear();
                self.partial_json[i].clear();
            }
            "content_block_delta" => self.read_block_delta(&BlockDelta::from_tree(&v), None)?,
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
                if let Some(Value::Object(u)) = v.member("usage") {
                    for (key, n) in u.iter().filter(|(_, n)| n.is_u64()) {
                        self.delta_usage.insert(key.clone(), n.clone());
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Adds a content block delta's text or tool-input JSON to its block. `data`: the delta's
    /// JSON text when `delta` was read from it (not from a tree), so that a delta of text
    /// alone becomes the template of those written alike.
    fn read_block_delta(
        &mut self,
        delta: &BlockDelta<'_>,
        data: Option<&str>,
    ) -> Result<(), String> {
        // A delta for a block that never started has nowhere to go (dropped, as before).
        let Some(i) = bounded(delta.index, MAX_CONTENT_BLOCKS, "content block")
            .ok()
            .filter(|&i| i < self.blocks.len())
        else {
            return Ok(());
        };
        let (text, json) = delta.pieces();
        if let (Some(t), None, Some(data)) = (text, json, data) {
            // Only a text borrowed from `data` (nothing unescaped) can be learned from.
            if self.delta_template.learn(data, t) {
                self.delta_block = i;
            }
        }
        if let Some(t) = text {
            self.grow(t.len())?;
            self.block_text[i].push_str(t);
        }
        if let Some(p) = json {
            self.grow(p.len())?;
            self.partial_json[i].push_str(p);
        }
        Ok(())
    }

    /// The whole response body.
    pub fn finish(mut self, endpoint: Endpoint) -> Answer {
        match endpoint {
            Endpoint::Messages => {
                let first = self.message.take().unwrap_or(Value::Null);
                let content: Vec<Value> = self
                    .blocks
                    .into_iter()
                    .zip(self.block_text)
                    .zip(self.partial_json)
                    .filter_map(|((b, text), json)| {
                        // A block that is not an object (never started, or an upstream's
                        // nonsense) has no content to give.
                        let Value::Object(mut b) = b else {
                            return None;
                        };
                        if !text.is_empty() {
                            let before = b.member("text").and_then(Value::as_str).unwrap_or("");
                            let whole = before.to_owned() + &text;
                            b.insert("text".into(), Value::String(whole));
                        }
                        if b.member("type").and_then(Value::as_str) == Some("tool_use") {
                            let input = serde_json::from_str(&json).unwrap_or_else(|_| json!({}));
                            b.insert("input".into(), input);
                        }
                        Some(Value::Object(b))
                    })
                    .collect();
                let mut usage = match first.member("usage") {
                    Some(Value::Object(u)) => u.clone(),
                    _ => Map::new(),
                };
                if !self.output_tokens.is_null() {
                    usage.insert("output_tokens".into(), self.output_tokens);
                }
                usage.extend(self.delta_usage);
                let member = |key: &str| first.get(key).cloned().unwrap_or_default();
                Answer::Message(answer::Message {
                    id: member("id"),
                    kind: "message",
                    role: "assistant",
                    model: self.model.unwrap_or_else(|| member("model")),
                    content,
                    stop_reason: self.stop_reason,
                    stop_sequence: self.stop_sequence,
                    usage,
                })
            }
            Endpoint::Completions => {
                let choice = answer::CompletionChoice {
                    index: 0,
                    text: self.text,
                    logprobs: (),
                    finish_reason: self.finish_reason,
                };
                let first = Identity::named(self.identity, self.model);
                Answer::Completion(first.answer("text_completion", choice, self.usage))
            }
            _ => {
                let first = Identity::named(self.identity, self.model);
                let only_calls = self.text.is_empty() && !self.tool_calls.is_empty();
                let tool_calls = self
                    .tool_calls
                    .into_iter()
                    .map(|(id, name, arguments)| answer::ToolCall {
                        id,
                        kind: "function",
                        function: answer::Function { name, arguments },
                    })
                    .collect();
                let choice = answer::ChatChoice {
                    index: 0,
                    message: answer::ChatMessage {
                        role: "assistant",
                        content: (!only_calls).then_some(self.text),
                        refusal: (),
                        tool_calls,
                    },
                    logprobs: (),
                    finish_reason: self.finish_reason,
                };
                Answer::Chat(first.answer("chat.completion", choice, self.usage))
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
        a.push(Protocol::OpenAi, &ev(json!({"id": "x", "created": 5, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}, "finish_reason": null}]}))).unwrap();
        a.push(Protocol::OpenAi, &ev(json!({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":1}"}}]}, "finish_reason": null}]}))).unwrap();
        a.push(Protocol::OpenAi, &ev(json!({"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}))).unwrap();
        a.push(Protocol::OpenAi, &ev(json!({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}))).unwrap();
        let body = a.finish(Endpoint::ChatCompletions).to_value();
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
    fn an_answer_named_by_its_gateway_keeps_the_name_whatever_its_events_say() {
        let chat = [
            json!({"id": "x", "created": 5, "model": "upstream-7b", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": null}]}),
            json!({"id": "x", "created": 5, "model": "upstream-7b", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        ];
        for (endpoint, named) in [
            (Endpoint::ChatCompletions, Some("public")),
            (Endpoint::ChatCompletions, None),
            (Endpoint::Completions, Some("public")),
        ] {
            let mut a = named.map_or_else(Assembler::new, Assembler::answering_as);
            for c in &chat {
                a.push(Protocol::OpenAi, &SseEvent::new(None, &c.to_string()))
                    .unwrap();
            }
            let body = a.finish(endpoint).to_value();
            assert_eq!(
                body["model"],
                named.unwrap_or("upstream-7b"),
                "{endpoint:?}"
            );
            assert_eq!(
                (body["id"].as_str(), body["created"].as_u64()),
                (Some("x"), Some(5))
            );
        }
        // No chunk at all still answers with the name.
        let body = Assembler::answering_as("public")
            .finish(Endpoint::ChatCompletions)
            .to_value();
        assert_eq!(body["model"], "public");
        let mut a = Assembler::answering_as("public");
        let start =
            json!({"message": {"id": "msg", "model": "upstream-7b", "usage": {"input_tokens": 9}}});
        a.push(
            Protocol::Anthropic,
            &SseEvent::new(Some("message_start"), &start.to_string()),
        )
        .unwrap();
        let body = a.finish(Endpoint::Messages).to_value();
        assert_eq!(
            (body["model"].as_str(), body["id"].as_str()),
            (Some("public"), Some("msg"))
        );
    }

    #[test]
    fn anthropic_usage_counts_of_message_delta_replace_those_of_message_start() {
        let mut a = Assembler::new();
        let ev = |n: &str, v: Value| SseEvent::new(Some(n), &v.to_string());
        a.push(Protocol::Anthropic, &ev("message_start", json!({"message": {"id": "msg", "model": "m", "usage": {"input_tokens": 0, "output_tokens": 0}}}))).unwrap();
        a.push(Protocol::Anthropic, &ev("message_delta", json!({"delta": {"stop_reason": "end_turn", "stop_sequence": null},
            "usage": {"input_tokens": 30, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100, "output_tokens": 12, "server_tool_use": null}}))).unwrap();
        let body = a.finish(Endpoint::Messages).to_value();
        assert_eq!(
            body["usage"],
            json!({"input_tokens": 30, "output_tokens": 12, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100})
        );
    }

    proptest::proptest! {
        /// Text deltas written like the last one parsed are appended without parsing them: the
        /// answer is the one an assembler that parses every delta builds, whatever the texts
        /// (escapes, quotes, empty), the blocks they add to (text, thinking, a tool's input)
        /// and their order.
        #[test]
        fn a_delta_read_by_its_template_adds_what_its_parse_adds(
            steps in proptest::collection::vec(
                (0usize..3, 0usize..4, "\\PC{0,6}|[\"\\\\\n\t]{1,3}|"),
                1..30,
            ),
        ) {
            let ev = |n: &str, v: Value| SseEvent::new(Some(n), &v.to_string());
            let mut events = vec![
                ev("message_start", json!({"type": "message_start", "message": {"id": "msg", "model": "m"}})),
                ev("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
                ev("content_block_start", json!({"type": "content_block_start", "index": 1, "content_block": {"type": "thinking", "thinking": ""}})),
                ev("content_block_start", json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}})),
            ];
            for (block, kind, text) in steps {
                let delta = match kind {
                    0 | 1 => json!({"type": "text_delta", "text": text}),
                    2 => json!({"type": "thinking_delta", "thinking": text}),
                    _ => json!({"type": "input_json_delta", "partial_json": text}),
                };
                events.push(ev("content_block_delta", json!({"type": "content_block_delta", "index": block, "delta": delta})));
            }
            events.push(ev("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}})));
            let (mut read, mut parsed) = (Assembler::new(), Assembler::new());
            for e in &events {
                read.push(Protocol::Anthropic, e).unwrap();
                parsed.delta_template = ChunkTemplate::default();
                parsed.push(Protocol::Anthropic, e).unwrap();
            }
            proptest::prop_assert_eq!(
                read.finish(Endpoint::Messages).to_value(),
                parsed.finish(Endpoint::Messages).to_value()
            );
        }
    }

    /// The second of two text deltas written alike takes the template's path; a delta of
    /// another block, or with an escape in its text, is parsed.
    #[test]
    fn a_text_delta_written_like_the_last_is_read_by_its_template() {
        let mut a = Assembler::new();
        let ev = |n: &str, v: Value| SseEvent::new(Some(n), &v.to_string());
        let delta = |i: u64, t: &str| {
            ev(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": t}}),
            )
        };
        for i in 0..2 {
            let start = json!({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}});
            a.push(Protocol::Anthropic, &ev("content_block_start", start))
                .unwrap();
        }
        a.push(Protocol::Anthropic, &delta(0, "Hi")).unwrap();
        assert_eq!(
            a.delta_template.text(&delta(0, " there").data),
            Some(" there")
        );
        assert_eq!(a.delta_template.text(&delta(1, " there").data), None);
        assert_eq!(a.delta_template.text(&delta(0, "a\"b").data), None);
        a.push(Protocol::Anthropic, &delta(0, " there")).unwrap();
        a.push(Protocol::Anthropic, &delta(1, "x")).unwrap();
        a.push(Protocol::Anthropic, &delta(0, "!")).unwrap();
        assert_eq!(a.block_text, ["Hi there!", "x"]);
    }

    #[test]
    fn anthropic_message() {
        let mut a = Assembler::new();
        let ev = |n: &str, v: Value| SseEvent::new(Some(n), &v.to_string());
        a.push(Protocol::Anthropic, &ev("message_start", json!({"message": {"id": "msg", "model": "m", "usage": {"input_tokens": 9, "output_tokens": 1}}}))).unwrap();
        a.push(
            Protocol::Anthropic,
            &ev(
                "content_block_start",
                json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
        )
        .unwrap();
        a.push(
            Protocol::Anthropic,
            &ev(
                "content_block_delta",
                json!({"index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
            ),
        )
        .unwrap();
        a.push(
            Protocol::Anthropic,
            &ev(
                "content_block_delta",
                json!({"index": 0, "delta": {"type": "text_delta", "text": " there"}}),
            ),
        )
        .unwrap();
        a.push(Protocol::Anthropic, &ev("message_delta", json!({"delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 2}}))).unwrap();
        let body = a.finish(Endpoint::Messages).to_value();
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

    #[test]
    fn an_index_past_the_bound_is_malformed_not_an_allocation() {
        // Found from outside: `"index": 4000000000` made keel allocate ~24 GB and be OOM-killed.
        let mut a = Assembler::new();
        let huge = json!({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 4_000_000_000u64, "function": {"name": "f"}}]}}]});
        let err = a
            .push(Protocol::OpenAi, &SseEvent::new(None, &huge.to_string()))
            .unwrap_err();
        assert!(err.contains("4000000000"), "{err}");
        assert!(a.tool_calls.is_empty());
        let last = json!({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": MAX_TOOL_CALLS - 1}]}}]});
        a.push(Protocol::OpenAi, &SseEvent::new(None, &last.to_string()))
            .unwrap();
        assert_eq!(a.tool_calls.len(), MAX_TOOL_CALLS);

        let mut a = Assembler::new();
        let start = |i: u64| {
            SseEvent::new(
                Some("content_block_start"),
                &json!({"index": i, "content_block": {"type": "text", "text": ""}}).to_string(),
            )
        };
        assert!(a.push(Protocol::Anthropic, &start(u64::MAX)).is_err());
        assert!(a
            .push(Protocol::Anthropic, &start(MAX_CONTENT_BLOCKS as u64))
            .is_err());
        a.push(Protocol::Anthropic, &start(MAX_CONTENT_BLOCKS as u64 - 1))
            .unwrap();
        assert_eq!(a.blocks.len(), MAX_CONTENT_BLOCKS);
    }

    #[test]
    fn accumulated_output_is_bounded() {
        let mut a = Assembler::new();
        let piece = "x".repeat(1024 * 1024);
        let ev = SseEvent::new(
            None,
            &json!({"id": "x", "choices": [{"index": 0, "delta": {"content": piece}}]}).to_string(),
        );
        let mut pushed = 0;
        let err = loop {
            match a.push(Protocol::OpenAi, &ev) {
                Ok(()) => pushed += 1,
                Err(e) => break e,
            }
        };
        assert_eq!(pushed, MAX_ASSEMBLED_BYTES / piece.len());
        assert!(err.contains("exceeds"), "{err}");
    }

    #[test]
    fn wrong_shapes_are_ignored_not_a_panic() {
        // Each event name with data of every JSON shape, and nested fields of the wrong type,
        // then every endpoint's finish: none of them may panic.
        let shapes = [
            "null",
            "[]",
            "[1,{}]",
            "7",
            "\"s\"",
            "true",
            "{}",
            r#"{"index":"0","delta":[],"content_block":5,"message":[],"usage":"u"}"#,
            r#"{"index":0,"content_block":"text","delta":{"text":5,"partial_json":[]}}"#,
            r#"{"index":0,"content_block":[1],"delta":{"text":"t","partial_json":"{"}}"#,
            r#"{"index":0,"content_block":{"type":"tool_use","text":7},"delta":{"text":"t"}}"#,
            r#"{"message":{"usage":7,"id":[]},"delta":{"stop_reason":{}},"usage":{"output_tokens":"x"}}"#,
            r#"{"choices":7}"#,
            r#"{"choices":[7]}"#,
            r#"{"choices":[{"delta":7,"text":[]}]}"#,
            r#"{"choices":[{"delta":{"content":7,"tool_calls":{}}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[7,null,{"index":-1},{"index":1.5,"id":7,"function":"f"}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"function":{"name":7,"arguments":{}}}]}}]}"#,
        ];
        let names = [
            None,
            Some("message_start"),
            Some("content_block_start"),
            Some("content_block_delta"),
            Some("content_block_stop"),
            Some("message_delta"),
            Some("message_stop"),
            Some("ping"),
            Some("error"),
        ];
        for protocol in [Protocol::OpenAi, Protocol::Anthropic] {
            let mut a = Assembler::new();
            // Twice: once to start blocks and take a first chunk, once more with state behind.
            for _ in 0..2 {
                for name in names {
                    for data in shapes {
                        let _ = a.push(protocol, &SseEvent::new(name, data));
                    }
                }
            }
            for endpoint in [
                Endpoint::ChatCompletions,
                Endpoint::Completions,
                Endpoint::Messages,
                Endpoint::CountTokens,
            ] {
                let _ = a.clone().finish(endpoint).to_bytes();
            }
        }
    }
}
