//! OpenAI's Responses API (`POST /v1/responses`) as a client API.
//!
//! Model servers speak Chat Completions or Messages; the Responses API is what newer OpenAI
//! clients send. keel serves it *in front of* everything else: the request becomes a Chat
//! Completions request ([`responses_to_chat`]) that then goes through selection, failover,
//! hedging and migration like any other (and to Anthropic-protocol variants through the Chat ⇄
//! Messages translation); the answer comes back as a Response object
//! ([`chat_completion_to_response`]) or, streamed, as Responses events, event by event
//! ([`ChatToResponsesStream`]). Because the conversion sits outside the relay, a migration
//! mid-stream is invisible here: the relay stitches Chat events, this module names them.
//!
//! keel keeps no state, so what needs stored responses is refused with a 400 naming the field.
//!
//! The reverse direction, a variant that speaks only Responses behind the Chat hub, is the
//! upstream dialect `crate::dialect::responses`: the same tables read the other way, sharing
//! the usage and finish-reason mappings below.
//!
//! # Requests, Responses → Chat Completions ([`responses_to_chat`])
//!
//! | Responses | Chat Completions | notes |
//! |---|---|---|
//! | `instructions` | a first `system` message | |
//! | `input` string | one `user` message | |
//! | `input` message items (`user`/`assistant`/`system`/`developer`; `input_text`, `output_text`, `refusal` parts) | messages with text parts (assistant parts joined) | `refusal` as text: `refusal_as_text` |
//! | `input_image` (`image_url`: URL or `data:` URL, `detail`) / `input_file` (`file_data`, `filename`) | `image_url` / `file` parts | `file_id`, `file_url`: **refused** |
//! | `function_call` items (`call_id`, `name`, `arguments`) | `tool_calls` of the assistant turn (consecutive calls: one turn) | |
//! | `function_call_output` items | `tool` messages (`tool_call_id` = `call_id`) | |
//! | `reasoning` items | — | dropped: `reasoning_item_dropped` |
//! | `tools` (`function`: flat `name`, `description`, `parameters`, `strict`) | `tools` (nested under `function`) | hosted tools (`web_search`, `file_search`, …): **refused** |
//! | `tool_choice` auto/none/required/`{type: function, name}` | the same in Chat form | other forms: **refused** |
//! | `text.format` text / json_object / json_schema (`name`, `schema`, `strict`) | — / `response_format` json_object / json_schema | |
//! | `text.verbosity`, `temperature`, `top_p`, `parallel_tool_calls`, `user`, `safety_identifier`, `prompt_cache_key`, `service_tier` | the same | |
//! | `reasoning.effort` | `reasoning_effort` (and `max_completion_tokens` for the limit) | `reasoning.summary`: `reasoning_summary_dropped` |
//! | `max_output_tokens` | `max_tokens` | |
//! | `stream` | `stream` + `stream_options.include_usage` | |
//! | `store: true`, `include`, `truncation`, `max_tool_calls`, `top_logprobs`, `stream_options`, unknown fields | — | dropped: `<field>_dropped` |
//! | `previous_response_id`, `conversation`, `background`, `prompt`, `item_reference` items, other item types | — | **refused**, naming the field |
//!
//! # Answers, Chat Completions → Responses
//!
//! | Chat Completions | Responses |
//! |---|---|
//! | `reasoning_content` | a `reasoning` item with a `reasoning_text` part |
//! | `content` / `refusal` | a `message` item with an `output_text` / `refusal` part |
//! | `tool_calls` | one `function_call` item each (`call_id` = the call's id) |
//! | `finish_reason` stop, tool_calls / length / content_filter | `status` completed / incomplete (`max_output_tokens`) / incomplete (`content_filter`) |
//! | `usage` (`prompt_tokens`, `cached_tokens`, `completion_tokens`, `reasoning_tokens`) | `usage` (`input_tokens`, `input_tokens_details.cached_tokens`, `output_tokens`, `output_tokens_details.reasoning_tokens`, `total_tokens`) |
//! | stream chunks | `response.created`, `response.in_progress`, `response.output_item.added`, `response.content_part.added`, `response.output_text.delta` / `response.function_call_arguments.delta` / `response.reasoning_text.delta`, the matching `.done` events, `response.completed` (or `response.incomplete`), numbered by `sequence_number` |
//! | an error body / error event | the error body as is (same shape) / an `error` event that also carries an `error` object, so SDKs raise |
//!
//! The response echoes the request's `instructions`, `tools`, `tool_choice`, `text`,
//! `temperature`, `top_p`, `max_output_tokens`, `parallel_tool_calls`, `reasoning` and
//! `metadata`; `store` is always false.

mod request;
mod response;
mod stream;

use serde_json::{json, Map, Value};

pub use request::{responses_to_chat, ResponsesTranslation};
pub use response::chat_completion_to_response;
pub use stream::ChatToResponsesStream;

/// What a Response object echoes from its request, and how to name it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResponsesContext {
    echo: Map<String, Value>,
}

impl ResponsesContext {
    fn of_request(body: &Map<String, Value>) -> Self {
        let get = |k: &str, default: Value| body.get(k).cloned().unwrap_or(default);
        let mut echo = Map::new();
        echo.insert("instructions".into(), get("instructions", Value::Null));
        echo.insert(
            "max_output_tokens".into(),
            get("max_output_tokens", Value::Null),
        );
        echo.insert("metadata".into(), get("metadata", json!({})));
        echo.insert(
            "parallel_tool_calls".into(),
            get("parallel_tool_calls", json!(true)),
        );
        echo.insert("previous_response_id".into(), Value::Null);
        echo.insert(
            "reasoning".into(),
            get("reasoning", json!({"effort": null, "summary": null})),
        );
        echo.insert("store".into(), json!(false));
        echo.insert("temperature".into(), get("temperature", json!(1.0)));
        echo.insert(
            "text".into(),
            get("text", json!({"format": {"type": "text"}})),
        );
        echo.insert("tool_choice".into(), get("tool_choice", json!("auto")));
        echo.insert("tools".into(), get("tools", json!([])));
        echo.insert("top_p".into(), get("top_p", json!(1.0)));
        echo.insert("truncation".into(), get("truncation", json!("disabled")));
        echo.insert("user".into(), get("user", Value::Null));
        ResponsesContext { echo }
    }
}

/// Names for one response: its id, model and creation time, and its items' ids.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseIds {
    /// `resp_…`.
    pub id: String,
    /// The model name the client sees; empty: the name the Chat answer gives (which keel has
    /// already set to the pool's public name or the upstream's, as the pool says).
    pub model: String,
    /// Unix seconds.
    pub created_at: u64,
}

impl ResponseIds {
    /// An item id: the response's suffix with the item's kind and position, unique within keel's
    /// responses and stable across a migration.
    fn item(&self, prefix: &str, output_index: usize) -> String {
        let suffix = self.id.strip_prefix("resp_").unwrap_or(&self.id);
        format!("{prefix}_{suffix}_{output_index}")
    }
}

/// How a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Completed,
    Incomplete(&'static str),
}

impl Ending {
    fn of_finish(finish_reason: Option<&str>) -> Self {
        match finish_reason {
            Some("length") => Ending::Incomplete("max_output_tokens"),
            Some("content_filter") => Ending::Incomplete("content_filter"),
            _ => Ending::Completed,
        }
    }
}

/// An incomplete Response's `incomplete_details.reason` → Chat `finish_reason`: the inverse of
/// [`Ending::of_finish`], for Responses-API upstreams (`crate::dialect::responses`).
pub(crate) fn finish_of_incomplete(reason: Option<&str>) -> &'static str {
    match reason {
        Some("content_filter") => "content_filter",
        // max_output_tokens, and any newer reason: the answer was cut short.
        _ => "length",
    }
}

/// Responses usage → Chat usage: the inverse of [`usage_of`]. The detail objects are kept
/// only where the Response carried them.
pub(crate) fn usage_to_chat(usage: &Value) -> Value {
    let n = |p: &str| usage.pointer(p).and_then(Value::as_u64);
    let (input, output) = (
        n("/input_tokens").unwrap_or(0),
        n("/output_tokens").unwrap_or(0),
    );
    let mut out = Map::new();
    out.insert("prompt_tokens".into(), input.into());
    out.insert("completion_tokens".into(), output.into());
    out.insert(
        "total_tokens".into(),
        n("/total_tokens").unwrap_or(input + output).into(),
    );
    if let Some(c) = n("/input_tokens_details/cached_tokens") {
        out.insert(
            "prompt_tokens_details".into(),
            json!({ "cached_tokens": c }),
        );
    }
    if let Some(r) = n("/output_tokens_details/reasoning_tokens") {
        out.insert(
            "completion_tokens_details".into(),
            json!({ "reasoning_tokens": r }),
        );
    }
    Value::Object(out)
}

/// Chat usage → Responses usage.
fn usage_of(usage: &Value) -> Value {
    let n = |p: &str| usage.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let (input, output) = (n("/prompt_tokens"), n("/completion_tokens"));
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": n("/prompt_tokens_details/cached_tokens")},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": n("/completion_tokens_details/reasoning_tokens")},
        "total_tokens": input + output,
    })
}

/// A Response object. `status`: `in_progress` while streaming, else from `ending`.
fn response_object(
    ctx: &ResponsesContext,
    ids: &ResponseIds,
    ending: Option<Ending>,
    output: Vec<Value>,
    usage: Option<&Value>,
) -> Value {
    let mut r = Map::new();
    r.insert("id".into(), ids.id.clone().into());
    r.insert("object".into(), "response".into());
    r.insert("created_at".into(), ids.created_at.into());
    let (status, incomplete) = match ending {
        None => ("in_progress", Value::Null),
        Some(Ending::Completed) => ("completed", Value::Null),
        Some(Ending::Incomplete(reason)) => ("incomplete", json!({ "reason": reason })),
    };
    r.insert("status".into(), status.into());
    r.insert("error".into(), Value::Null);
    r.insert("incomplete_details".into(), incomplete);
    r.insert("model".into(), ids.model.clone().into());
    r.insert("output".into(), Value::Array(output));
    r.insert("usage".into(), usage.map_or(Value::Null, usage_of));
    for (k, v) in &ctx.echo {
        r.insert(k.clone(), v.clone());
    }
    Value::Object(r)
}

fn message_item(id: String, status: &str, content: Vec<Value>) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

fn function_call_item(id: String, status: &str, call_id: &str, name: &str, args: &str) -> Value {
    json!({"type": "function_call", "id": id, "status": status, "call_id": call_id, "name": name, "arguments": args})
}

fn reasoning_item(id: String, status: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": status, "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
}

#[cfg(test)]
mod tests;
