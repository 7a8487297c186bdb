//! The two wire protocols keel speaks (OpenAI and Anthropic): endpoints, error shapes, and how to
//! read a streamed event (content, terminal, error).
//!
//! Everything here is data in, data out. Message shapes are kept as `serde_json::Value` so that
//! unknown fields pass through untouched; only the fields keel acts on are interpreted.

use std::borrow::Cow;

use serde_json::{json, Value};

use crate::members::Members;
use crate::sse::SseEvent;

/// A wire protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    OpenAi,
    Anthropic,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::OpenAi => "openai",
            Protocol::Anthropic => "anthropic",
        }
    }
}

/// A client-facing (and upstream) API endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `POST /v1/completions`.
    Completions,
    /// Anthropic `POST /v1/messages`.
    Messages,
    /// Anthropic `POST /v1/messages/count_tokens`.
    CountTokens,
    /// OpenAI `POST /v1/embeddings`.
    Embeddings,
}

impl Endpoint {
    pub fn protocol(self) -> Protocol {
        match self {
            Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Embeddings => {
                Protocol::OpenAi
            }
            Endpoint::Messages | Endpoint::CountTokens => Protocol::Anthropic,
        }
    }

    /// Path appended to a variant's base URL, as the official SDKs do: OpenAI base URLs end in
    /// `/v1` (`https://api.openai.com/v1`), Anthropic's do not (`https://api.anthropic.com`).
    pub fn upstream_path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/chat/completions",
            Endpoint::Completions => "/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::CountTokens => "/v1/messages/count_tokens",
            Endpoint::Embeddings => "/embeddings",
        }
    }

    /// The endpoint served at a request path (the same paths on keel and on model servers).
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/messages/count_tokens" => Some(Endpoint::CountTokens),
            "/v1/embeddings" => Some(Endpoint::Embeddings),
            _ => None,
        }
    }

    /// The label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Messages => "messages",
            Endpoint::CountTokens => "count_tokens",
            Endpoint::Embeddings => "embeddings",
        }
    }

    /// Whether the endpoint generates output that can be streamed (and so streamed upstream,
    /// hedged on its first token and migrated mid-stream). `count_tokens` and embeddings answer
    /// with one whole body: they are only ever failed over before the response.
    pub fn generates(self) -> bool {
        !matches!(self, Endpoint::CountTokens | Endpoint::Embeddings)
    }
}

/// The class of an error, mapped to each protocol's `type` string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    Authentication,
    Permission,
    NotFound,
    TooLarge,
    UnsupportedMediaType,
    RateLimited,
    /// The client's request body did not arrive in time (408).
    RequestTimeout,
    Timeout,
    Overloaded,
    BadGateway,
    Internal,
}

impl ErrorKind {
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest => 400,
            ErrorKind::Authentication => 401,
            ErrorKind::Permission => 403,
            ErrorKind::NotFound => 404,
            ErrorKind::TooLarge => 413,
            ErrorKind::UnsupportedMediaType => 415,
            ErrorKind::RateLimited => 429,
            ErrorKind::RequestTimeout => 408,
            ErrorKind::Internal => 500,
            ErrorKind::BadGateway => 502,
            ErrorKind::Overloaded => 503,
            ErrorKind::Timeout => 504,
        }
    }

    fn openai_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::TooLarge
            | ErrorKind::UnsupportedMediaType
            | ErrorKind::RequestTimeout => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Timeout => "timeout_error",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::BadGateway | ErrorKind::Internal => "api_error",
        }
    }

    fn anthropic_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::UnsupportedMediaType
            | ErrorKind::RequestTimeout => "invalid_request_error",
            ErrorKind::TooLarge => "request_too_large",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Timeout => "timeout_error",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::BadGateway | ErrorKind::Internal => "api_error",
        }
    }
}

/// The error body in the protocol's own shape.
pub fn error_body(protocol: Protocol, kind: ErrorKind, message: &str) -> Value {
    match protocol {
        Protocol::OpenAi => json!({
            "error": {"message": message, "type": kind.openai_type(), "param": null, "code": null}
        }),
        Protocol::Anthropic => json!({
            "type": "error",
            "error": {"type": kind.anthropic_type(), "message": message}
        }),
    }
}

/// The terminal error event for a stream that cannot be completed. OpenAI has no error event,
/// so keel sends a final `data:` object carrying `error` (the official SDKs raise on it) and no
/// `[DONE]`; Anthropic has `event: error`.
pub fn stream_error_event(protocol: Protocol, kind: ErrorKind, message: &str) -> SseEvent {
    let body = error_body(protocol, kind, message).to_string();
    match protocol {
        Protocol::OpenAi => SseEvent::new(None, &body),
        Protocol::Anthropic => SseEvent::new(Some("error"), &body),
    }
}

/// What a streamed upstream event means for the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventRole {
    /// Metadata before any output (OpenAI's role-only first chunk, Anthropic `message_start`,
    /// `content_block_start`, `content_block_stop`).
    Preamble,
    /// An event carrying generated output (text, tool-call arguments, a finish reason, usage).
    /// The first such event is the "first token".
    Output,
    /// A keep-alive: comments, Anthropic `ping`.
    KeepAlive,
    /// The protocol's clean end: OpenAI `data: [DONE]`, Anthropic `message_stop`.
    Terminal,
    /// The upstream reported an error inside the stream (its summary: see [`error_summary`]).
    Error(String),
    /// The event is not valid for the protocol (bad JSON).
    Malformed(String),
}

/// Classifies one upstream event.
pub fn event_role(protocol: Protocol, ev: &SseEvent) -> EventRole {
    if ev.comment_only {
        return EventRole::KeepAlive;
    }
    match protocol {
        Protocol::OpenAi => {
            if ev.data == "[DONE]" {
                return EventRole::Terminal;
            }
            if let Some(view) = ChunkView::parse(&ev.data).filter(|v| !v.has_error()) {
                return if view.has_output() {
                    EventRole::Output
                } else {
                    EventRole::Preamble
                };
            }
            match serde_json::from_str::<Value>(&ev.data) {
                Ok(v) => match v.member("error") {
                    Some(e) if !e.is_null() => EventRole::Error(error_summary(&v)),
                    _ if openai_chunk_has_output(&v) => EventRole::Output,
                    _ => EventRole::Preamble,
                },
                Err(e) => EventRole::Malformed(format!("invalid JSON in stream chunk: {e}")),
            }
        }
        Protocol::Anthropic => {
            let name = ev.event.as_deref().unwrap_or("");
            match name {
                "ping" => EventRole::KeepAlive,
                "message_stop" => EventRole::Terminal,
                _ => match serde_json::from_str::<Value>(&ev.data) {
                    Ok(v)
                        if name == "error"
                            || v.member("type").and_then(Value::as_str) == Some("error") =>
                    {
                        EventRole::Error(error_summary(&v))
                    }
                    Ok(_) if matches!(name, "content_block_delta" | "message_delta") => {
                        EventRole::Output
                    }
                    Ok(_) => EventRole::Preamble,
                    Err(e) => EventRole::Malformed(format!("invalid JSON in `{name}` event: {e}")),
                },
            }
        }
    }
}

/// The parts of an OpenAI stream chunk keel reads on every event, deserialized without building
/// a JSON tree (unknown fields are skipped, strings borrowed where unescaped). Parsing each
/// chunk into a `Value` was the relay's largest cost per token; this view is several times
/// cheaper, and reading one allocates nothing unless a string holds an escape. `None` fields
/// were absent or `null`.
#[derive(Debug, Default, serde::Deserialize)]
pub struct ChunkView<'a> {
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
    #[serde(default, borrow, deserialize_with = "read_choices")]
    choices: Option<Choices<'a>>,
    #[serde(default)]
    usage: Option<serde::de::IgnoredAny>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct ChoiceView<'a> {
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    finish_reason: Option<serde::de::IgnoredAny>,
    #[serde(default, borrow)]
    delta: Option<MapOnly<DeltaView<'a>>>,
}

/// A chunk's `choices` as keel reads them: the first choice, how many there were, and whether
/// any after the first carries output. Every element is read as a choice (an element of another
/// shape fails the view, as it would fail a vector of choices), but only the first is kept:
/// a chunk almost always has exactly one, and a vector for it was an allocation an event.
#[derive(Debug, Default)]
struct Choices<'a> {
    first: Option<ChoiceView<'a>>,
    count: usize,
    rest_have_output: bool,
}

impl<'de: 'a, 'a> ReadChoices<'de> for Choices<'a> {
    fn read<A: serde::de::SeqAccess<'de>>(mut seq: A) -> Result<Self, A::Error> {
        let mut choices = Choices::default();
        while let Some(MapOnly(c)) = seq.next_element::<MapOnly<ChoiceView<'a>>>()? {
            choices.count += 1;
            if choices.first.is_none() {
                choices.first = Some(c);
            } else {
                choices.rest_have_output |= c.has_output();
            }
        }
        Ok(choices)
    }
}

/// The parts of an Anthropic stream event keel reads on every event, deserialized without a
/// JSON tree: its `type`, its content block's `index` and `type` (a block's start), and its
/// delta's `text`. Each event was
/// parsed into a tree three times (its role, its index, its text), half of what an Anthropic
/// stream cost keel. An event of another shape (a member of an unexpected type, a duplicated
/// member) is not read by this view; callers read its tree as before.
#[derive(Debug, Default, serde::Deserialize)]
pub struct EventView<'a> {
    #[serde(default, borrow, rename = "type", deserialize_with = "borrowed_text")]
    kind: Option<Cow<'a, str>>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(default, borrow)]
    delta: Option<MapOnly<DeltaTextView<'a>>>,
    #[serde(default, borrow)]
    content_block: Option<MapOnly<BlockKindView<'a>>>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct BlockKindView<'a> {
    #[serde(default, borrow, rename = "type", deserialize_with = "borrowed_text")]
    kind: Option<Cow<'a, str>>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct DeltaTextView<'a> {
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    text: Option<Cow<'a, str>>,
}

impl<'a> EventView<'a> {
    /// `None` when the data is not a JSON object of the expected shape.
    pub fn parse(data: &'a str) -> Option<Self> {
        MapOnly::parse(data).ok()
    }

    /// An error event by its `type` (its message is read from the tree).
    pub fn is_error(&self) -> bool {
        self.kind.as_deref() == Some("error")
    }

    /// The content block's index.
    pub fn index(&self) -> Option<u64> {
        self.index
    }

    /// The `type` of the content block a `content_block_start` opens.
    pub fn block_type(&self) -> Option<&str> {
        self.content_block
            .as_ref()
            .and_then(|b| b.0.kind.as_deref())
    }

    /// The delta's text, borrowed from the event unless it holds an escape.
    pub fn into_text(self) -> Option<Cow<'a, str>> {
        self.delta.and_then(|d| d.0.text)
    }
}

/// An optional string borrowed from the chunk where it holds no escape. serde reads a plain
/// `Option<Cow<str>>` field as an owned string whatever `borrow` says: an allocation a token.
pub(crate) fn borrowed_text<'de: 'a, 'a, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Cow<'a, str>>, D::Error> {
    struct Text<'a>(std::marker::PhantomData<&'a ()>);
    impl<'de: 'a, 'a> serde::de::Visitor<'de> for Text<'a> {
        type Value = Option<Cow<'a, str>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a string or null")
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_str(self)
        }
        fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Borrowed(s)))
        }
        fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(s.to_owned())))
        }
        fn visit_string<E>(self, s: String) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(s)))
        }
    }
    d.deserialize_option(Text(std::marker::PhantomData))
}

/// A struct read only from a JSON object. serde's derived structs also accept an array of their
/// fields in order (`{"choices":[["hi"]]}` would read as a choice with text "hi"), which the
/// `Value` path rightly does not see as a chunk: the view must read exactly what the tree reads.
#[derive(Debug, Default, PartialEq)]
pub struct MapOnly<T>(pub T);

impl<'de, T: serde::Deserialize<'de>> MapOnly<T> {
    /// `T` read from JSON text that must be an object.
    pub fn parse(data: &'de str) -> serde_json::Result<T> {
        serde_json::from_str::<Self>(data).map(|m| m.0)
    }
}

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for MapOnly<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for Visit<T> {
            type Value = MapOnly<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<Self::Value, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(MapOnly)
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// A stream chunk's `choices` read element by element, without a vector in between (a chunk
/// almost always holds one choice, and it is read on every event). Each reading says what it
/// keeps of the elements; [`read_choices`] is the serde side around it.
pub(crate) trait ReadChoices<'de>: Sized {
    fn read<A: serde::de::SeqAccess<'de>>(seq: A) -> Result<Self, A::Error>;
}

/// A chunk's `choices` field (`#[serde(deserialize_with)]`) read by `T`: `null` is absent, any
/// other JSON type than an array is an error.
pub(crate) fn read_choices<'de, D: serde::Deserializer<'de>, T: ReadChoices<'de>>(
    d: D,
) -> Result<Option<T>, D::Error> {
    struct Visit<T>(std::marker::PhantomData<T>);
    impl<'de, T: ReadChoices<'de>> serde::de::Visitor<'de> for Visit<T> {
        type Value = Option<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an array of choices")
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_seq(self)
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            T::read(seq).map(Some)
        }
    }
    d.deserialize_option(Visit(std::marker::PhantomData))
}

#[derive(Debug, Default, serde::Deserialize)]
struct DeltaView<'a> {
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    refusal: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    function_call: Option<serde::de::IgnoredAny>,
}

impl<'a> ChunkView<'a> {
    /// `None` when the data is not JSON of the expected shape (callers fall back to `Value`).
    pub fn parse(data: &'a str) -> Option<Self> {
        MapOnly::parse(data).ok()
    }

    pub fn has_error(&self) -> bool {
        self.error.is_some()
    }

    fn first(&self) -> Option<&ChoiceView<'a>> {
        self.choices.as_ref()?.first.as_ref()
    }

    /// Generated text of the first choice (chat `delta.content` or completions `text`).
    pub fn text(&self) -> Option<&str> {
        let c = self.first()?;
        c.delta
            .as_ref()
            .and_then(|d| d.0.content.as_deref())
            .or(c.text.as_deref())
    }

    /// [`ChunkView::text`], taken out of the view: borrowed from the chunk unless it holds an
    /// escape.
    pub fn into_text(self) -> Option<Cow<'a, str>> {
        let c = self.choices?.first?;
        c.delta.and_then(|d| d.0.content).or(c.text)
    }

    pub fn starts_tool_call(&self) -> bool {
        self.first()
            .and_then(|c| c.delta.as_ref())
            .is_some_and(|d| d.0.tool_calls.is_some())
    }

    pub fn finished(&self) -> bool {
        self.first().is_some_and(|c| c.finish_reason.is_some())
    }

    /// Anything beyond plain text of the first choice (tool calls, a finish, usage, several
    /// choices): the chunk needs the full `Value` to be assembled.
    pub fn is_plain_text(&self) -> bool {
        self.usage.is_none()
            && self.error.is_none()
            && self.choices.as_ref().is_some_and(|c| c.count == 1)
            && !self.finished()
            && self.first().is_some_and(|c| {
                c.delta
                    .as_ref()
                    .is_none_or(|d| d.0.tool_calls.is_none() && d.0.function_call.is_none())
            })
    }

    /// Whether the chunk carries output: content, tool calls, a refusal, reasoning, completion
    /// text, a finish reason, or the final usage chunk.
    pub fn has_output(&self) -> bool {
        let Some(choices) = &self.choices else {
            return false;
        };
        match &choices.first {
            None => self.usage.is_some(),
            Some(first) => first.has_output() || choices.rest_have_output,
        }
    }
}

impl ChoiceView<'_> {
    /// Content, tool calls, a refusal, reasoning, completion text or a finish reason.
    fn has_output(&self) -> bool {
        let non_empty = |x: &Option<Cow<str>>| x.as_deref().is_some_and(|s| !s.is_empty());
        non_empty(&self.text)
            || self.finish_reason.is_some()
            || self.delta.as_ref().map(|d| &d.0).is_some_and(|d| {
                non_empty(&d.content)
                    || non_empty(&d.refusal)
                    || non_empty(&d.reasoning_content)
                    || d.tool_calls.is_some()
                    || d.function_call.is_some()
            })
    }
}

/// Generated text of one OpenAI choice in `Value` form (the tree form of [`ChunkView::text`],
/// read the same way: `delta.content` when it is a string, else completions `text`).
pub(crate) fn openai_choice_text(c: &Value) -> Option<&str> {
    c.member("delta")
        .and_then(|d| d.member("content"))
        .and_then(Value::as_str)
        .or_else(|| c.member("text").and_then(Value::as_str))
}

/// Whether an OpenAI chunk carries output (the `Value` form of [`ChunkView::has_output`], for
/// chunks the view cannot read).
pub(crate) fn openai_chunk_has_output(v: &Value) -> bool {
    let Some(choices) = v.member("choices").and_then(Value::as_array) else {
        return false;
    };
    if choices.is_empty() {
        return v.member("usage").is_some_and(|u| !u.is_null());
    }
    let non_empty = |x: Option<&Value>| x.and_then(Value::as_str).is_some_and(|s| !s.is_empty());
    choices.iter().any(|c| {
        let d = c.member("delta");
        non_empty(c.member("text"))
            || c.member("finish_reason").is_some_and(|f| !f.is_null())
            || d.is_some_and(|d| {
                non_empty(d.member("content"))
                    || non_empty(d.member("refusal"))
                    || non_empty(d.member("reasoning_content"))
                    || d.member("tool_calls").is_some_and(|t| !t.is_null())
                    || d.member("function_call").is_some_and(|t| !t.is_null())
            })
    })
}

/// The human message inside either protocol's error object.
pub fn error_message(v: &Value) -> String {
    v.pointer("/error/message")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| v.to_string())
}

/// An upstream's error in a few words keel may repeat: its `type` and `code` (identifiers,
/// not prose), and `loading model` where its message says the server is still loading one
/// (llama.cpp, TGI: warming, not failing). The message itself is never repeated: it may name
/// the upstream account, an organisation or a fragment of a credential ("Incorrect API key
/// provided: sk-…"), and it would reach a client or a log beside other tenants' traffic.
pub fn error_summary(v: &Value) -> String {
    let error = v.member("error").filter(|e| e.is_object()).unwrap_or(v);
    let mut parts = Vec::new();
    for field in ["type", "code"] {
        let value = match error.get(field) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => continue,
        };
        if let Some(word) = identifier(&value) {
            parts.push(format!("{field} {word}"));
        }
    }
    if error_message(v).to_ascii_lowercase().contains("loading") {
        parts.push("loading model".to_owned());
    }
    parts.join(", ")
}

/// `s` when it reads as an identifier (`invalid_api_key`, `rate_limit_error`, `503`), short.
fn identifier(s: &str) -> Option<&str> {
    let ok = !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    ok.then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_summaries_keep_identifiers_never_prose() {
        let openai = serde_json::json!({"error": {"message": "Incorrect API key provided: sk-proj-abc***wxyz. You can find your API key at https://platform.openai.com/account/api-keys.", "type": "invalid_request_error", "code": "invalid_api_key"}});
        assert_eq!(
            error_summary(&openai),
            "type invalid_request_error, code invalid_api_key"
        );
        let org = serde_json::json!({"error": {"message": "No such organization: org-1234.", "type": "invalid_request_error", "code": "invalid organization org-1234"}});
        assert_eq!(error_summary(&org), "type invalid_request_error");
        let anthropic = serde_json::json!({"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}});
        assert_eq!(error_summary(&anthropic), "type authentication_error");
        let llama = serde_json::json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}});
        assert_eq!(
            error_summary(&llama),
            "type unavailable_error, code 503, loading model"
        );
        assert_eq!(error_summary(&serde_json::json!("secret text")), "");
    }

    #[test]
    fn classifies_openai_events() {
        assert_eq!(
            event_role(Protocol::OpenAi, &SseEvent::new(None, "[DONE]")),
            EventRole::Terminal
        );
        let role_only = r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#;
        assert_eq!(
            event_role(Protocol::OpenAi, &SseEvent::new(None, role_only)),
            EventRole::Preamble
        );
        let text = r#"{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#;
        assert_eq!(
            event_role(Protocol::OpenAi, &SseEvent::new(None, text)),
            EventRole::Output
        );
        assert!(matches!(
            event_role(Protocol::OpenAi, &SseEvent::new(None, "{oops")),
            EventRole::Malformed(_)
        ));
        let err = stream_error_event(Protocol::OpenAi, ErrorKind::BadGateway, "boom");
        assert_eq!(
            event_role(Protocol::OpenAi, &err),
            EventRole::Error(format!("type {}", ErrorKind::BadGateway.openai_type()))
        );
    }

    #[test]
    fn classifies_anthropic_events() {
        let stop = SseEvent::new(Some("message_stop"), "{\"type\":\"message_stop\"}");
        assert_eq!(event_role(Protocol::Anthropic, &stop), EventRole::Terminal);
        let start = SseEvent::new(Some("message_start"), "{\"type\":\"message_start\"}");
        assert_eq!(event_role(Protocol::Anthropic, &start), EventRole::Preamble);
        let delta = SseEvent::new(
            Some("content_block_delta"),
            "{\"type\":\"content_block_delta\"}",
        );
        assert_eq!(event_role(Protocol::Anthropic, &delta), EventRole::Output);
        let ping = SseEvent::new(Some("ping"), "{\"type\":\"ping\"}");
        assert_eq!(event_role(Protocol::Anthropic, &ping), EventRole::KeepAlive);
        let err = stream_error_event(Protocol::Anthropic, ErrorKind::Overloaded, "busy");
        assert_eq!(
            event_role(Protocol::Anthropic, &err),
            EventRole::Error("type overloaded_error".into())
        );
    }

    #[test]
    fn error_shapes_follow_each_protocol() {
        let o = error_body(Protocol::OpenAi, ErrorKind::NotFound, "no such model");
        assert_eq!(o["error"]["type"], "not_found_error");
        let a = error_body(Protocol::Anthropic, ErrorKind::TooLarge, "too big");
        assert_eq!(a["type"], "error");
        assert_eq!(a["error"]["type"], "request_too_large");
    }

    #[test]
    fn the_chunk_view_reads_chunks_as_the_json_tree_does() {
        let chunks = [
            r#"{"id":"a","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{"content":"Hel\"lo"},"finish_reason":null}]}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            r#"{"id":"a","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}"#,
            r#"{"id":"a","choices":[],"usage":null}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c"}]}}]}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}"#,
            r#"{"id":"a","choices":[{"index":0,"text":"completion text"}]}"#,
            r#"{"id":"a","error":null,"choices":[{"index":0,"delta":{"refusal":"no"}}]}"#,
            r#"{"id":"a"}"#,
            r#"{"id":"a","choices":null}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{"content":null}}]}"#,
            // Several choices: the first's text, output from any of them.
            r#"{"id":"a","choices":[{"index":0,"delta":{}},{"index":1,"delta":{"content":"b"}}]}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{}}]}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{}},{"index":1,"finish_reason":"stop"}]}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{}},{"index":1,"delta":{}}]}"#,
        ];
        for c in chunks {
            let view = ChunkView::parse(c).expect(c);
            let v: Value = serde_json::from_str(c).unwrap();
            assert_eq!(view.has_output(), openai_chunk_has_output(&v), "{c}");
            let text = v.pointer("/choices/0").and_then(openai_choice_text);
            assert_eq!(view.text(), text, "{c}");
            assert_eq!(
                view.finished(),
                v.pointer("/choices/0/finish_reason")
                    .is_some_and(|f| !f.is_null()),
                "{c}"
            );
        }
        // Arrays are not chunks (serde would read a struct from one), at any depth.
        for c in [
            r#"[null,[{"text":"x"}]]"#,
            r#"{"choices":[["hi"]]}"#,
            r#"{"choices":[{"delta":["hi"]}]}"#,
            r#"{"choices":[{"delta":{}},["hi"]]}"#,
            r#"{"choices":[{"delta":{"content":7}}]}"#,
        ] {
            assert!(ChunkView::parse(c).is_none(), "{c}");
            assert_eq!(
                event_role(Protocol::OpenAi, &SseEvent::new(None, c)),
                EventRole::Preamble,
                "{c}"
            );
        }
        // Only a chunk of exactly one choice is plain text.
        let two = r#"{"choices":[{"delta":{"content":"a"}},{"delta":{"content":"b"}}]}"#;
        assert!(!ChunkView::parse(two).unwrap().is_plain_text());
        let one = r#"{"choices":[{"delta":{"content":"a"}}]}"#;
        assert!(ChunkView::parse(one).unwrap().is_plain_text());
        // Text is borrowed from the chunk unless it holds an escape (then it is unescaped).
        let plain = ChunkView::parse(r#"{"choices":[{"delta":{"content":"Hello"}}]}"#);
        assert!(matches!(
            plain.unwrap().into_text(),
            Some(Cow::Borrowed("Hello"))
        ));
        let escaped = ChunkView::parse(r#"{"choices":[{"text":"a\nb"}]}"#);
        assert!(matches!(escaped.unwrap().into_text(), Some(Cow::Owned(t)) if t == "a\nb"));
        // An error chunk is not read by the view: callers take the tree for its message.
        assert!(ChunkView::parse(r#"{"error":{"message":"boom"}}"#)
            .unwrap()
            .has_error());
    }
}
