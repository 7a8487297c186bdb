//! Mid-stream migration, the pure part: what has been delivered, how to ask another variant to
//! continue from it, and how to stitch its stream onto the one the client already has.
//!
//! **Continuation requests** ([`continuation`]), by the target variant's `resume` mode:
//! * `prefill`: the delivered text becomes a final assistant message. Anthropic continues such a
//!   message natively; OpenAI-compatible servers (vLLM, SGLang) need
//!   `continue_final_message: true, add_generation_prompt: false`; llama.cpp continues a final
//!   assistant message by default (the flags are harmless there).
//! * `completion`: `/v1/completions` with the delivered text appended to the prompt (only for
//!   requests that were completions to begin with: keel cannot render a chat template).
//! * `instruction`: for APIs without prefill: the partial answer as an assistant message, then a
//!   user message asking to continue without repeating; the overlap between what was delivered
//!   and what comes back is removed ([`overlap`]).
//! * `none`: no migration.
//!
//! The output limit is lowered by what was already generated, so the whole answer still
//! respects the client's `max_tokens`.
//!
//! **Stitching** ([`Stitcher`]): the client keeps one response: the first segment's id, created
//! time and model name; one role header (the continuation's preamble — role chunk,
//! `message_start`, `content_block_start`, `ping` — is dropped); Anthropic block indexes continue
//! where the first segment left them; exactly one terminal event; usage that adds up (prompt
//! tokens as the client sent them, completion tokens as delivered).

use serde_json::{json, Map, Value};

use crate::members::Members;
use crate::protocol::{event_role, Endpoint, EventRole, Protocol};
use crate::request::CanonicalRequest;
use crate::sse::SseEvent;
use crate::tokens;

/// How a variant continues a generation started elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    Prefill,
    Completion,
    Instruction,
    None,
}

/// The instruction used by `instruction` mode.
pub const CONTINUE_INSTRUCTION: &str =
    "Your previous answer was cut off. Continue it exactly where it stopped, without repeating any of it and without any preamble.";

/// The message Anthropic's newer models (Claude Sonnet 4.6, Opus 4.6 and later) answer a
/// prefill with, in a 400 `invalid_request_error`.
pub const PREFILL_REFUSAL: &str = "This model does not support assistant message prefill. The conversation must end with a user message.";

/// Whether an upstream's error message says that the model refuses assistant prefill (a
/// conversation ending in an assistant message): such a variant can still continue a
/// generation in `instruction` mode. Recognised loosely (case, wording around it), by either
/// half of Anthropic's message.
pub fn is_prefill_refusal(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    let m = m.split_whitespace().collect::<Vec<_>>().join(" ");
    (m.contains("not support") && m.contains("prefill"))
        || m.contains("does not support assistant message prefill")
        || m.contains("must end with a user message")
}

/// Why a continuation cannot be built for a variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotPossible {
    /// The variant's resume mode is `none`.
    Disabled,
    /// The mode does not fit the request (e.g. `completion` for a chat request).
    ModeMismatch(&'static str),
    /// The output limit is already used up.
    LimitReached,
}

/// The extra fields of an OpenAI-compatible `prefill` continuation, as vLLM and SGLang expect
/// them (a variant's `continuation_fields` replaces them for servers with other conventions).
pub fn default_prefill_fields() -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("continue_final_message".into(), Value::Bool(true));
    m.insert("add_generation_prompt".into(), Value::Bool(false));
    m
}

/// The continuation request for one variant: the endpoint to call and the body (the client's
/// body with the delivered text folded in). `prefill_fields` are merged into OpenAI-compatible
/// `prefill` continuations (see [`default_prefill_fields`]).
pub fn continuation(
    req: &CanonicalRequest,
    mode: ResumeMode,
    prefill_fields: &Map<String, Value>,
    delivered: &str,
    delivered_tokens: u64,
) -> Result<(Endpoint, Map<String, Value>), NotPossible> {
    let mut body = req.body.clone();
    // Lower every output limit the client set by what was already generated.
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = body.get(key).and_then(Value::as_u64) {
            if n <= delivered_tokens {
                return Err(NotPossible::LimitReached);
            }
            body.insert(key.into(), Value::from(n - delivered_tokens));
        }
    }
    match (mode, req.endpoint) {
        (ResumeMode::None, _) => Err(NotPossible::Disabled),
        (_, Endpoint::CountTokens) => {
            Err(NotPossible::ModeMismatch("count_tokens has no generation"))
        }
        (_, Endpoint::Embeddings) => {
            Err(NotPossible::ModeMismatch("embeddings have no generation"))
        }
        (ResumeMode::Completion, Endpoint::Completions)
        | (ResumeMode::Prefill, Endpoint::Completions)
        | (ResumeMode::Instruction, Endpoint::Completions) => {
            let prompt = match body.member("prompt") {
                Some(Value::String(p)) => p.clone(),
                Some(Value::Array(a)) if a.len() == 1 => {
                    a[0].as_str().unwrap_or_default().to_owned()
                }
                _ => {
                    return Err(NotPossible::ModeMismatch(
                        "only a single-string prompt can be continued",
                    ))
                }
            };
            body.insert(
                "prompt".into(),
                Value::String(format!("{prompt}{delivered}")),
            );
            Ok((Endpoint::Completions, body))
        }
        (ResumeMode::Completion, _) => Err(NotPossible::ModeMismatch(
            "`completion` resume needs a /v1/completions request",
        )),
        (ResumeMode::Prefill, ep) | (ResumeMode::Instruction, ep) => {
            let Some(Value::Array(messages)) = body.member_mut("messages") else {
                return Err(NotPossible::ModeMismatch("no messages"));
            };
            // A client prefill (final assistant message) is extended, not duplicated.
            let last_is_assistant = messages
                .last()
                .and_then(|m| m.member("role"))
                .and_then(Value::as_str)
                == Some("assistant");
            if last_is_assistant && mode == ResumeMode::Prefill {
                let last = messages
                    .last_mut()
                    .and_then(Value::as_object_mut)
                    .ok_or(NotPossible::ModeMismatch("bad message"))?;
                let before = match last.member("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.member("text").and_then(Value::as_str))
                        .collect(),
                    _ => String::new(),
                };
                last.insert(
                    "content".into(),
                    Value::String(format!("{before}{delivered}")),
                );
            } else {
                messages.push(json!({"role": "assistant", "content": delivered}));
                if mode == ResumeMode::Instruction {
                    messages.push(json!({"role": "user", "content": CONTINUE_INSTRUCTION}));
                }
            }
            if mode == ResumeMode::Prefill && ep == Endpoint::ChatCompletions {
                for (k, v) in prefill_fields {
                    body.insert(k.clone(), v.clone());
                }
            }
            Ok((ep, body))
        }
    }
}

/// Length in bytes of the longest suffix of `delivered` that is a prefix of `continuation`
/// (at most 400 bytes are compared): what `instruction` mode strips from a continuation that
/// repeats the end of the delivered text.
pub fn overlap(delivered: &str, continuation: &str) -> usize {
    let max = delivered.len().min(continuation.len()).min(400);
    (1..=max)
        .rev()
        .find(|&n| {
            delivered.is_char_boundary(delivered.len() - n)
                && continuation.is_char_boundary(n)
                && delivered[delivered.len() - n..] == continuation[..n]
        })
        .unwrap_or(0)
}

/// Generated text carried by one output event (text only; tool-call arguments are not text).
pub fn event_text(protocol: Protocol, ev: &SseEvent) -> Option<String> {
    if protocol == Protocol::OpenAi {
        if let Some(view) = crate::protocol::ChunkView::parse(&ev.data) {
            return view.text().map(str::to_owned);
        }
    }
    let v: Value = serde_json::from_str(&ev.data).ok()?;
    match protocol {
        Protocol::OpenAi => {
            let c = v.member("choices")?.get(0)?;
            crate::protocol::openai_choice_text(c).map(str::to_owned)
        }
        Protocol::Anthropic => {
            if ev.event.as_deref() != Some("content_block_delta") {
                return None;
            }
            v.pointer("/delta/text")
                .and_then(Value::as_str)
                .map(str::to_owned)
        }
    }
}

/// The members of an OpenAI chunk that make a stream's identity (`id`, `created`, `model`),
/// read from the chunk's text without building its JSON tree. Reads exactly what `Value::get`
/// on the parsed chunk would: only from an object, a member present as `null` is `Some(Null)`,
/// the last of duplicate keys wins.
#[derive(Default)]
struct Identity {
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
}

impl<'de> serde::Deserialize<'de> for Identity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Identity;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Identity, A::Error> {
                let mut out = Identity::default();
                while let Some(Member(member)) = map.next_key()? {
                    let slot = match member {
                        Some(0) => &mut out.id,
                        Some(1) => &mut out.created,
                        Some(_) => &mut out.model,
                        None => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                            continue;
                        }
                    };
                    *slot = Some(map.next_value()?);
                }
                Ok(out)
            }
        }
        d.deserialize_map(Visit)
    }
}

/// A member name of an [`Identity`]: its index in (`id`, `created`, `model`), `None` for any
/// other. Compared where it lies (escaped names unescaped by serde_json), never allocated.
struct Member(Option<u8>);

impl<'de> serde::Deserialize<'de> for Member {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = Member;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a member name")
            }
            fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Member, E> {
                Ok(Member(match name {
                    "id" => Some(0),
                    "created" => Some(1),
                    "model" => Some(2),
                    _ => None,
                }))
            }
        }
        d.deserialize_identifier(Visit)
    }
}

/// The room the delivered text starts with: a short answer's text.
const DELIVERED_ROOM: usize = 256;

/// Keeps one client-visible stream across segments.
#[derive(Debug, Clone)]
pub struct Stitcher {
    protocol: Protocol,
    /// Identity of the first segment (OpenAI `id`, `created`, `model`), read from its first
    /// chunk when a continuation begins (see [`Stitcher::begin_segment`]).
    /// Boxed: only a continuation needs it, and every live stream's relay holds a stitcher.
    identity: Option<Box<(Value, Value, Value)>>,
    /// The data of the first segment's first chunk, until a continuation reads its identity:
    /// most streams never continue, and reading every stream's first chunk for it cost 2% of
    /// keel's CPU per streamed request.
    first_chunk: Option<String>,
    /// Text delivered to the client so far.
    pub delivered: String,
    /// Tokens of text delivered before the current segment began.
    tokens_before_segment: u64,
    /// Segment number (0 = the original).
    pub segment: u32,
    /// Anthropic: index of the content block open in the client's stream, and the next free one.
    open_block: Option<u64>,
    next_block: u64,
    /// Index shift for the current continuation's blocks, and whether its block 0 continues a
    /// block left open by the previous segment.
    block_offset: u64,
    continues_open: bool,
}

impl Stitcher {
    pub fn new(protocol: Protocol) -> Self {
        Stitcher {
            protocol,
            identity: None,
            first_chunk: None,
            delivered: String::new(),
            tokens_before_segment: 0,
            segment: 0,
            open_block: None,
            next_block: 0,
            block_offset: 0,
            continues_open: false,
        }
    }

    /// Tokens delivered so far by keel's tokenizer rule (lowers the continuation's limit).
    pub fn delivered_tokens(&self) -> u64 {
        tokens::count(&self.delivered) as u64
    }

    /// Starts a continuation segment.
    pub fn begin_segment(&mut self) {
        if let Some(data) = self.first_chunk.take() {
            if let Ok(Identity {
                id: Some(id),
                created,
                model,
            }) = serde_json::from_str::<Identity>(&data)
            {
                let field = |v: Option<Value>| v.unwrap_or(Value::Null);
                self.identity = Some(Box::new((id, field(created), field(model))));
            }
        }
        self.segment = self.segment.saturating_add(1);
        self.tokens_before_segment = self.delivered_tokens();
        self.block_offset = self.open_block.unwrap_or(self.next_block);
        self.continues_open = self.open_block.is_some();
    }

    /// Processes one upstream event; returns the bytes for the client, or `None` to drop it.
    /// `trim_overlap` is set for `instruction` continuations: text repeating the end of what was
    /// delivered is cut from the segment's first text.
    pub fn process(&mut self, ev: &SseEvent, trim_overlap: &mut bool) -> Option<Vec<u8>> {
        if ev.comment_only {
            return Some(ev.raw.clone());
        }
        if self.segment == 0 {
            let mut out = Vec::with_capacity(ev.raw.len());
            self.process_into(ev, trim_overlap, &mut out);
            return Some(out);
        }
        let role = event_role(self.protocol, ev);
        match self.protocol {
            Protocol::OpenAi => self.openai_continuation(ev, role, trim_overlap),
            Protocol::Anthropic => self.anthropic_continuation(ev, role, trim_overlap),
        }
    }

    /// [`Stitcher::process`] appending the bytes for the client to `out`, the relay's batch of
    /// one upstream read: an event of the original segment is copied once, into the batch,
    /// instead of into a buffer of its own.
    pub fn process_into(&mut self, ev: &SseEvent, trim_overlap: &mut bool, out: &mut Vec<u8>) {
        let text = match event_role(self.protocol, ev) {
            EventRole::Output => event_text(self.protocol, ev),
            _ => None,
        };
        self.process_known(ev, text.as_deref(), trim_overlap, out)
    }

    /// [`Stitcher::process_into`] for an event the caller has read already
    /// (`stream_watch::read_event`): `text` is its text when it is output, so that the event
    /// is not parsed again for it.
    pub fn process_known(
        &mut self,
        ev: &SseEvent,
        text: Option<&str>,
        trim_overlap: &mut bool,
        out: &mut Vec<u8>,
    ) {
        if self.segment == 0 && !ev.comment_only {
            self.observe_original(ev);
            if let Some(t) = text {
                if self.delivered.capacity() == 0 {
                    // Room for a short answer at once, rather than the growth from 8 bytes
                    // by doubling that token-sized pieces would take (an allocation and a copy
                    // at each step).
                    self.delivered.reserve(t.len().max(DELIVERED_ROOM));
                }
                self.delivered.push_str(t);
            }
            out.extend_from_slice(&ev.raw);
        } else if let Some(bytes) = self.process(ev, trim_overlap) {
            out.extend_from_slice(&bytes);
        }
    }

    fn observe_original(&mut self, ev: &SseEvent) {
        match self.protocol {
            Protocol::OpenAi => {
                // Only the first segment is observed; its identity is read when a continuation begins.
                if self.first_chunk.is_none() {
                    self.first_chunk = Some(ev.data.clone());
                }
            }
            Protocol::Anthropic => match ev.event.as_deref() {
                Some("content_block_start") => {
                    // Read without a tree where the event view can read it, as the relay's
                    // reading of the same event does.
                    let i = match crate::protocol::EventView::parse(&ev.data) {
                        Some(view) => view.index(),
                        None => serde_json::from_str::<Value>(&ev.data)
                            .ok()
                            .and_then(|v| v.member("index").and_then(Value::as_u64)),
                    }
                    .unwrap_or(self.next_block);
                    self.open_block = Some(i);
                    // Saturating: an index is the upstream's number, `u64::MAX` included.
                    self.next_block = i.saturating_add(1);
                }
                Some("content_block_stop") => self.open_block = None,
                _ => {}
            },
        }
    }

    fn trim(&mut self, text: &str, trim_overlap: &mut bool) -> String {
        if !*trim_overlap {
            return text.to_owned();
        }
        *trim_overlap = false;
        let n = overlap(&self.delivered, text);
        text[n..].to_owned()
    }

    fn openai_continuation(
        &mut self,
        ev: &SseEvent,
        role: EventRole,
        trim_overlap: &mut bool,
    ) -> Option<Vec<u8>> {
        if matches!(role, EventRole::Preamble) {
            return None; // the continuation's role chunk: the client already has one
        }
        if ev.data == "[DONE]" {
            return Some(ev.raw.clone());
        }
        // A chunk is an object; anything else is not one to rewrite (and would panic on
        // `v["id"] = …`): dropped, as unparsable JSON is.
        let Ok(Value::Object(mut v)) = serde_json::from_str::<Value>(&ev.data) else {
            return None;
        };
        if let Some((id, created, model)) = self.identity.as_deref() {
            v.insert("id".into(), id.clone());
            v.insert("created".into(), created.clone());
            v.insert("model".into(), model.clone());
        }
        if let Some(text) = event_text(Protocol::OpenAi, ev) {
            let text = self.trim(&text, trim_overlap);
            self.delivered.push_str(&text);
            let choice = v
                .member_mut("choices")
                .and_then(|c| c.get_mut(0))
                .and_then(Value::as_object_mut);
            if let Some(c) = choice {
                // The field `event_text` read the text from (see `openai_choice_text`).
                let in_delta = c
                    .member("delta")
                    .and_then(|d| d.member("content"))
                    .is_some_and(Value::is_string);
                if in_delta {
                    if let Some(d) = c.member_mut("delta").and_then(Value::as_object_mut) {
                        d.insert("content".into(), Value::String(text));
                    }
                } else if c.member("text").is_some_and(Value::is_string) {
                    c.insert("text".into(), Value::String(text));
                }
            }
        }
        if let Some(u) = v.member_mut("usage").and_then(Value::as_object_mut) {
            let before = self.tokens_before_segment;
            let read = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
            let prompt = read("prompt_tokens").saturating_sub(before);
            let completion = read("completion_tokens").saturating_add(before);
            u.insert("prompt_tokens".into(), Value::from(prompt));
            u.insert("completion_tokens".into(), Value::from(completion));
            u.insert(
                "total_tokens".into(),
                Value::from(prompt.saturating_add(completion)),
            );
        }
        Some(SseEvent::new(None, &Value::Object(v).to_string()).raw)
    }

    fn anthropic_continuation(
        &mut self,
        ev: &SseEvent,
        role: EventRole,
        trim_overlap: &mut bool,
    ) -> Option<Vec<u8>> {
        let name = ev.event.as_deref().unwrap_or("");
        if matches!(role, EventRole::KeepAlive) || name == "message_start" {
            return None;
        }
        // Every Anthropic event is an object; anything else is not one to rewrite (and would
        // panic on `v["index"] = …`): dropped, as unparsable JSON is.
        let Ok(Value::Object(mut v)) = serde_json::from_str::<Value>(&ev.data) else {
            return None;
        };
        let offset = self.block_offset;
        // Indexes are the upstream's numbers: shifted with saturation, never overflowing.
        let index = |v: &Map<String, Value>| v.member("index").and_then(Value::as_u64).unwrap_or(0);
        match name {
            "content_block_start" => {
                let i = index(&v);
                if i == 0 && self.continues_open {
                    return None; // block 0 continues the block the client has open
                }
                let shifted = i.saturating_add(offset);
                v.insert("index".into(), Value::from(shifted));
                self.open_block = Some(shifted);
                self.next_block = self.next_block.max(shifted.saturating_add(1));
            }
            "content_block_delta" | "content_block_stop" => {
                let shifted = index(&v).saturating_add(offset);
                v.insert("index".into(), Value::from(shifted));
                if name == "content_block_delta" {
                    if let Some(text) = event_text(Protocol::Anthropic, ev) {
                        let text = self.trim(&text, trim_overlap);
                        self.delivered.push_str(&text);
                        // `event_text` found `/delta/text`, so `delta` is an object.
                        if let Some(d) = v.member_mut("delta").and_then(Value::as_object_mut) {
                            d.insert("text".into(), Value::String(text));
                        }
                    }
                } else {
                    self.open_block = None;
                }
            }
            "message_delta" => {
                let before = self.tokens_before_segment;
                if let Some(u) = v.member_mut("usage").and_then(Value::as_object_mut) {
                    if let Some(out) = u.member("output_tokens").and_then(Value::as_u64) {
                        u.insert(
                            "output_tokens".into(),
                            Value::from(out.saturating_add(before)),
                        );
                    }
                }
            }
            _ => {}
        }
        Some(SseEvent::new(Some(name), &Value::Object(v).to_string()).raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse;

    #[test]
    fn prefill_for_each_protocol_lowers_the_limit() {
        let r = parse(
            Endpoint::ChatCompletions,
            br#"{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        let (ep, b) = continuation(
            &r,
            ResumeMode::Prefill,
            &default_prefill_fields(),
            "Hello there",
            2,
        )
        .unwrap();
        assert_eq!(ep, Endpoint::ChatCompletions);
        assert_eq!(b["max_tokens"], 98);
        assert_eq!(
            b["messages"][1],
            json!({"role": "assistant", "content": "Hello there"})
        );
        assert_eq!(b["continue_final_message"], true);
        assert_eq!(b["add_generation_prompt"], false);

        let a = parse(Endpoint::Messages, br#"{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Sure:"}]}"#).unwrap();
        let (_, b) = continuation(
            &a,
            ResumeMode::Prefill,
            &default_prefill_fields(),
            " one two",
            2,
        )
        .unwrap();
        assert_eq!(
            b["messages"].as_array().unwrap().len(),
            2,
            "the client's prefill is extended"
        );
        assert_eq!(b["messages"][1]["content"], "Sure: one two");
        assert!(b.member("continue_final_message").is_none());
        assert_eq!(
            continuation(&a, ResumeMode::Prefill, &default_prefill_fields(), "x", 10).unwrap_err(),
            NotPossible::LimitReached
        );
    }

    #[test]
    fn completion_and_instruction_and_none() {
        let c = parse(
            Endpoint::Completions,
            br#"{"model":"m","prompt":"Once upon"}"#,
        )
        .unwrap();
        let (ep, b) = continuation(&c, ResumeMode::Completion, &Map::new(), " a time", 2).unwrap();
        assert_eq!(
            (ep, b["prompt"].as_str().unwrap()),
            (Endpoint::Completions, "Once upon a time")
        );
        let r = parse(
            Endpoint::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert!(matches!(
            continuation(&r, ResumeMode::Completion, &Map::new(), "x", 1),
            Err(NotPossible::ModeMismatch(_))
        ));
        assert_eq!(
            continuation(&r, ResumeMode::None, &Map::new(), "x", 1).unwrap_err(),
            NotPossible::Disabled
        );
        let (_, b) = continuation(&r, ResumeMode::Instruction, &Map::new(), "partial", 1).unwrap();
        assert_eq!(b["messages"][2]["content"], CONTINUE_INSTRUCTION);
    }

    #[test]
    fn a_prefill_refusal_is_recognised_by_its_message() {
        assert!(is_prefill_refusal(PREFILL_REFUSAL));
        assert!(is_prefill_refusal(
            "this model DOES NOT SUPPORT assistant message prefill."
        ));
        assert!(is_prefill_refusal(
            "Bad request: the conversation must end with a User message"
        ));
        assert!(is_prefill_refusal(
            "The conversation  must\nend with a user message."
        ));
        assert!(is_prefill_refusal("This model does not support prefill"));
        for other in [
            "",
            "max_tokens: must be at most 8192",
            "messages: roles must alternate between user and assistant",
            "prefill too long",
            "The model `x` does not exist.",
        ] {
            assert!(!is_prefill_refusal(other), "{other}");
        }
    }

    #[test]
    fn overlap_is_the_longest_suffix_prefix() {
        assert_eq!(overlap("the cat sat on", " sat on the mat"), 7);
        assert_eq!(overlap("abc", "xyz"), 0);
        assert_eq!(overlap("héllo wörld", "wörld!"), "wörld".len());
    }

    fn openai_chunk(id: &str, delta: Value, finish: Value) -> SseEvent {
        SseEvent::new(None, &json!({"id": id, "object": "chat.completion.chunk", "created": 1, "model": id, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).to_string())
    }

    #[test]
    fn a_chunks_identity_is_read_as_the_parsed_tree_reads_it() {
        // What `Value::get` on the whole chunk gives, member by member (all absent for text
        // that is not JSON, or JSON that is not an object).
        let by_tree = |data: &str| -> [Option<Value>; 3] {
            let v = serde_json::from_str::<Value>(data).unwrap_or_default();
            ["id", "created", "model"].map(|k| v.get(k).cloned())
        };
        for data in [
            r#"{"id":"c1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"content":"hi"}}]}"#,
            r#"{"choices":[{"id":"inner"}],"model":"m"}"#,
            r#"{"id":null,"created":1}"#,
            r#"{"id":"a","id":"b","model":{"nested":[1,2]}}"#,
            r#"{"\u0069d":"escaped key","mod\u0065l":"m2"}"#,
            r#"["id","created","model"]"#,
            r#""id""#,
            "[DONE]",
            r#"{"id":"trailing"} x"#,
            "{}",
        ] {
            let i = serde_json::from_str::<Identity>(data).unwrap_or_default();
            let view = [i.id, i.created, i.model];
            assert_eq!(view, by_tree(data), "{data}");
        }
    }

    #[test]
    fn openai_segments_share_one_identity_and_role() {
        let mut s = Stitcher::new(Protocol::OpenAi);
        let mut trim = false;
        s.process(
            &openai_chunk(
                "a",
                json!({"role": "assistant", "content": ""}),
                Value::Null,
            ),
            &mut trim,
        )
        .unwrap();
        s.process(
            &openai_chunk("a", json!({"content": "Hello"}), Value::Null),
            &mut trim,
        )
        .unwrap();
        s.begin_segment();
        assert!(s
            .process(
                &openai_chunk(
                    "b",
                    json!({"role": "assistant", "content": ""}),
                    Value::Null
                ),
                &mut trim
            )
            .is_none());
        let out = s
            .process(
                &openai_chunk("b", json!({"content": " world"}), Value::Null),
                &mut trim,
            )
            .unwrap();
        let v: Value =
            serde_json::from_str(&crate::sse::decode_all(&out).unwrap()[0].data).unwrap();
        assert_eq!(
            (v["id"].as_str(), v["model"].as_str()),
            (Some("a"), Some("a"))
        );
        let usage = SseEvent::new(None, &json!({"id": "b", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}}).to_string());
        let out = s.process(&usage, &mut trim).unwrap();
        let v: Value =
            serde_json::from_str(&crate::sse::decode_all(&out).unwrap()[0].data).unwrap();
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16})
        );
        assert_eq!(s.delivered, "Hello world");
    }

    #[test]
    fn anthropic_segments_continue_the_open_block() {
        let ev = |name: &str, data: Value| SseEvent::new(Some(name), &data.to_string());
        let mut s = Stitcher::new(Protocol::Anthropic);
        let mut trim = false;
        s.process(
            &ev("message_start", json!({"type": "message_start"})),
            &mut trim,
        )
        .unwrap();
        s.process(
            &ev(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0}),
            ),
            &mut trim,
        )
        .unwrap();
        s.process(&ev("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}})), &mut trim).unwrap();
        s.begin_segment();
        assert!(s
            .process(
                &ev("message_start", json!({"type": "message_start"})),
                &mut trim
            )
            .is_none());
        assert!(s
            .process(
                &ev(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": 0})
                ),
                &mut trim
            )
            .is_none());
        assert!(s
            .process(&ev("ping", json!({"type": "ping"})), &mut trim)
            .is_none());
        s.process(&ev("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " there"}})), &mut trim).unwrap();
        s.process(
            &ev(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            ),
            &mut trim,
        )
        .unwrap();
        // A second block in the continuation gets the next index.
        let out = s
            .process(
                &ev(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": 1}),
                ),
                &mut trim,
            )
            .unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&crate::sse::decode_all(&out).unwrap()[0].data).unwrap()
                ["index"],
            1
        );
        let out = s
            .process(
                &ev(
                    "message_delta",
                    json!({"type": "message_delta", "usage": {"output_tokens": 3}}),
                ),
                &mut trim,
            )
            .unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&crate::sse::decode_all(&out).unwrap()[0].data).unwrap()
                ["usage"]["output_tokens"],
            4
        );
        assert_eq!(s.delivered, "Hi there");
    }
}
