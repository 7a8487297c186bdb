//! Translation between OpenAI Chat Completions and Anthropic Messages: requests, whole
//! responses, error bodies and streams, both ways.
//!
//! A client speaks one API and a variant may speak the other. The request is translated after
//! selection ([`chat_to_messages`], [`messages_to_chat`]); the answer comes back through
//! [`message_to_chat_completion`] / [`chat_completion_to_message`] or, streamed, event by event
//! through [`AnthropicToChatStream`] / [`ChatToAnthropicStream`]. Everything is a pure function
//! of its inputs (`created` timestamps are arguments); a request that cannot be translated is an
//! [`InvalidRequest`](crate::protocol::ErrorKind::InvalidRequest) naming the field, and every
//! field dropped or changed on the way is reported as a short *fix code* (for the
//! `x-keel-prompt-fix` header), never dropped silently.
//!
//! # Requests, Chat Completions → Messages ([`chat_to_messages`])
//!
//! | Chat Completions | Messages | notes |
//! |---|---|---|
//! | `system` / `developer` messages | `system` (a string, or text blocks when several) | one later than the first turn is moved up: `system_moved` |
//! | `user` text / `image_url` (https or `data:` URL) / `file` (`file_data`) parts | `text` / `image` (`url` or `base64` source) / `document` (`base64`) | `detail` dropped: `image_detail_dropped`; `cache_control` on a part kept |
//! | assistant `content` + `tool_calls` | `text` + `tool_use` blocks (`id`s kept, `arguments` parsed) | `reasoning_content` dropped: `thinking_dropped` |
//! | consecutive `tool` messages | one user turn of `tool_result` blocks | |
//! | `tools` (`function`), `tool_choice` auto/none/required/named, `parallel_tool_calls: false` | `tools` (`input_schema`), `tool_choice` auto/none/any/tool, `disable_parallel_tool_use` | `strict` dropped: `strict_dropped` |
//! | `response_format` `json_schema` / `json_object` | a forced tool whose `input_schema` is the schema; its input is the answer | `response_format_as_tool`; see [`ResponseContext::json_tool`] |
//! | `max_completion_tokens` / `max_tokens` / absent | `max_tokens` (absent: the caller's default) | `max_tokens_defaulted` |
//! | `temperature` (0–2), `top_p`, `top_k`, `stop`, `stream`, `user` | `temperature` (0–1), `top_p`, `top_k`, `stop_sequences`, `stream`, `metadata.user_id` | above 1: `temperature_clamped` |
//! | `reasoning_effort` | `thinking` `enabled` with a budget (low 1024, medium 4096, high 16384; below `max_tokens`) | impossible (small `max_tokens`, forced tool, open tool turn): `reasoning_effort_dropped` |
//! | `stream_options.include_usage` | (Anthropic always reports usage) | read into [`ResponseContext::include_usage`] |
//! | `frequency_penalty`, `presence_penalty`, `seed`, `logit_bias`, `top_logprobs`, `service_tier`, `store`, `metadata`, `prediction`, message `name`, unknown fields | — | dropped: `<field>_dropped` |
//! | `n` > 1, `logprobs: true`, audio (`modalities`, `audio`, `input_audio` parts), `functions` / `function_call` / `function` messages, `file_id` files, non-function tools, `allowed_tools` | — | **refused**, naming the field |
//!
//! # Requests, Messages → Chat Completions ([`messages_to_chat`])
//!
//! | Messages | Chat Completions | notes |
//! |---|---|---|
//! | `system` (string or text blocks) | one `system` message per block | `cache_control` dropped: `cache_control_dropped` |
//! | user `text` / `image` (`base64`, `url`) / `document` (`base64` PDF) | `text` / `image_url` (data URL or URL) / `file` (`file_data`) parts | |
//! | user `tool_result` blocks | `tool` messages, before the turn's other content | `is_error` dropped: `tool_result_is_error_dropped` |
//! | assistant `text` + `tool_use` | `content` + `tool_calls` (`input` serialized) | `thinking` / `redacted_thinking` blocks dropped: `thinking_dropped` |
//! | `tools`, `tool_choice` auto/none/any/tool, `disable_parallel_tool_use` | `function` tools, `tool_choice` auto/none/required/named, `parallel_tool_calls: false` | |
//! | `thinking` `enabled` (budget) / `adaptive` | `reasoning_effort` (below 2048 low, below 8192 medium, else high) | `thinking_to_reasoning_effort`; with it `max_completion_tokens` replaces `max_tokens` |
//! | `max_tokens`, `temperature`, `top_p`, `stop_sequences`, `stream`, `metadata.user_id` | `max_tokens`, `temperature`, `top_p`, `stop`, `stream` + `stream_options.include_usage`, `user` | |
//! | `top_k`, `service_tier`, `output_config`, `context_management`, unknown fields | — | dropped: `<field>_dropped` |
//! | server tools (`web_search_…`, `bash_…`, …), `mcp_servers`, `container`, `image`/`document` sources other than above, images inside `tool_result`, `server_tool_use` history | — | **refused**, naming the field |
//!
//! # Responses, streams and errors
//!
//! | Messages | Chat Completions |
//! |---|---|
//! | `text` blocks | `content` (concatenated) |
//! | `tool_use` blocks (`toolu_…` ids kept) | `tool_calls` (same ids; `input` ⇄ `arguments` JSON text) |
//! | `tool_use` of the `response_format` tool | `content` (the JSON text), finish `stop` |
//! | `thinking` blocks | `reasoning_content` (the de facto field of vLLM, DeepSeek, SGLang); back as `thinking` blocks without a signature |
//! | `stop_reason` end_turn, stop_sequence, pause_turn / max_tokens, model_context_window_exceeded / tool_use / refusal | `finish_reason` stop / length / tool_calls / content_filter (reverse: stop→end_turn, length→max_tokens, tool_calls→tool_use, content_filter→refusal) |
//! | `usage.input_tokens` + `cache_creation_input_tokens` + `cache_read_input_tokens`, `output_tokens` | `prompt_tokens` (which includes cached tokens), `prompt_tokens_details.cached_tokens`, `completion_tokens`, `total_tokens` (reverse: `input_tokens` = prompt − cached; cache writes are not told apart) |
//! | `id`, `model` | `id` (kept), `model` (the public name given), `created` (given) |
//! | error body / `error` event | error body / final `data:` error object (no `[DONE]`), same kind |
//! | `ping` | an SSE comment (`: ping`) |
//!
//! Known loss, by design: a thinking block translated from OpenAI `reasoning_content` carries no
//! signature, so a client that sends it back to an Anthropic variant has it dropped there; a
//! `stop` string comes back as a one-element array; `developer` comes back as `system`.

mod request_to_anthropic;
mod request_to_openai;
mod response;
pub mod responses;
mod stream_to_anthropic;
mod stream_to_openai;
#[cfg(test)]
mod tests;
mod tools;

use serde_json::{Map, Value};

use crate::members::Members;
use crate::request::RequestError;
use crate::sse::SseEvent;

pub use request_to_anthropic::chat_to_messages;
pub use request_to_openai::messages_to_chat;
pub use response::{
    chat_completion_to_message, error_body_to_protocol, error_kind_of, message_to_chat_completion,
};
pub use stream_to_anthropic::ChatToAnthropicStream;
pub use stream_to_openai::AnthropicToChatStream;
pub use tools::JSON_OBJECT_TOOL;

/// What the response translation needs to know about the translated request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseContext {
    /// The name of the forced tool that stands for the client's `response_format`: its
    /// `tool_use` input is the answer, delivered as text with finish reason `stop`.
    pub json_tool: Option<String>,
    /// The client asked for a final usage chunk (OpenAI `stream_options.include_usage`); always
    /// true for an Anthropic client, whose stream always reports usage.
    pub include_usage: bool,
}

/// A translated request body, the fix codes for what was dropped or changed, and what the
/// response translation needs.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestTranslation {
    pub body: Map<String, Value>,
    /// Short codes (`thinking_dropped`, `max_tokens_defaulted`, …), each once, in the order met.
    pub fixes: Vec<String>,
    pub context: ResponseContext,
}

/// Fix codes, each recorded once.
#[derive(Debug, Default)]
pub(crate) struct Fixes(Vec<String>);

impl Fixes {
    pub(crate) fn add(&mut self, code: impl Into<String>) {
        let code = code.into();
        if !self.0.contains(&code) {
            self.0.push(code);
        }
    }

    pub(crate) fn dropped(&mut self, field: &str) {
        self.add(format!("{field}_dropped"));
    }

    pub(crate) fn into_vec(self) -> Vec<String> {
        self.0
    }
}

/// The error for a part of a request the target protocol cannot express.
pub(crate) fn unsupported(
    path: &str,
    what: &str,
    target: crate::protocol::Protocol,
) -> RequestError {
    let target = match target {
        crate::protocol::Protocol::OpenAi => "OpenAI",
        crate::protocol::Protocol::Anthropic => "Anthropic",
    };
    RequestError::invalid(format!(
        "{path}: {what} is not supported by {target}-protocol variants"
    ))
}

/// The opening every stream translator's `push` shares: once the stream has ended (`done`)
/// an event is dropped, and a comment-only event (a keep-alive) is copied to `out` as it came.
/// `true`: the event is dealt with and has nothing to translate.
pub(crate) fn passes_untranslated(done: bool, ev: &SseEvent, out: &mut Vec<SseEvent>) -> bool {
    if done {
        return true;
    }
    if ev.comment_only {
        out.push(ev.clone());
    }
    ev.comment_only
}

/// Anthropic `stop_reason` → OpenAI `finish_reason`.
pub fn finish_reason_of(stop_reason: &str) -> &'static str {
    match stop_reason {
        "max_tokens" | "model_context_window_exceeded" => "length",
        "tool_use" => "tool_calls",
        "refusal" => "content_filter",
        // end_turn, stop_sequence, pause_turn and anything newer: the turn ended normally.
        _ => "stop",
    }
}

/// OpenAI `finish_reason` → Anthropic `stop_reason`.
pub fn stop_reason_of(finish_reason: &str) -> &'static str {
    match finish_reason {
        "length" => "max_tokens",
        "tool_calls" | "function_call" => "tool_use",
        "content_filter" => "refusal",
        _ => "end_turn",
    }
}

fn u64_at(usage: &Value, key: &str) -> u64 {
    usage.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// Anthropic usage → OpenAI usage. Anthropic's `input_tokens` excludes the tokens read from or
/// written to the cache; OpenAI's `prompt_tokens` counts them all.
pub fn usage_to_openai(usage: &Value) -> Value {
    let cached = u64_at(usage, "cache_read_input_tokens");
    let prompt =
        u64_at(usage, "input_tokens") + u64_at(usage, "cache_creation_input_tokens") + cached;
    let completion = u64_at(usage, "output_tokens");
    let mut out = Map::new();
    out.insert("prompt_tokens".into(), prompt.into());
    out.insert("completion_tokens".into(), completion.into());
    out.insert("total_tokens".into(), (prompt + completion).into());
    if usage
        .member("cache_read_input_tokens")
        .is_some_and(|v| !v.is_null())
    {
        out.insert(
            "prompt_tokens_details".into(),
            serde_json::json!({"cached_tokens": cached}),
        );
    }
    Value::Object(out)
}

/// OpenAI usage → Anthropic usage (see [`usage_to_openai`]).
pub fn usage_to_anthropic(usage: &Value) -> Value {
    let cached = usage
        .pointer("/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64);
    let prompt = u64_at(usage, "prompt_tokens");
    let mut out = Map::new();
    out.insert(
        "input_tokens".into(),
        prompt.saturating_sub(cached.unwrap_or(0)).into(),
    );
    if let Some(c) = cached {
        out.insert("cache_read_input_tokens".into(), c.into());
    }
    out.insert(
        "output_tokens".into(),
        u64_at(usage, "completion_tokens").into(),
    );
    Value::Object(out)
}

/// A `data:` URL's media type and base64 payload.
pub(crate) fn parse_data_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("data:")?;
    let (meta, data) = rest.split_once(',')?;
    let media_type = meta.strip_suffix(";base64")?;
    Some((media_type, data))
}
