//! Amazon Bedrock's Converse API (`POST /model/{modelId}/converse`, streamed:
//! `/converse-stream`), with Anthropic Messages as the hub.
//!
//! Converse is one request shape for every model Bedrock hosts, and close to Messages: turns of
//! content blocks, tools with JSON Schema inputs, a forced tool. The mapping is mostly renaming;
//! what Converse has no field for goes in `additionalModelRequestFields`, in the words of the
//! model behind it (Claude: `top_k`, `thinking`; Nova: `inferenceConfig.topK`). The model's
//! family is read from the model id (`anthropic.` / `claude`, `amazon.nova`); for any other
//! model those two are dropped with a fix code rather than sent where Bedrock would refuse them.
//!
//! # Requests ([`request`])
//!
//! | Messages | Converse | notes |
//! |---|---|---|
//! | `system` (string or text blocks) | `system` `[{text}]` | `cache_control` (on any block or tool) → a `cachePoint` after it, `ttl` kept |
//! | `messages` text / image (`base64`) / document (`base64` PDF, plain text) | `{text}` / `{image:{format,source:{bytes}}}` / `{document:{format,name,source:{bytes}}}` | consecutive turns of one role are merged (Converse refuses them): `turns_merged` |
//! | `tool_use` / `tool_result` (`is_error`) | `{toolUse:{toolUseId,name,input}}` / `{toolResult:{toolUseId,content,status}}` | |
//! | `thinking` (signed) / `redacted_thinking` | `{reasoningContent:{reasoningText:{text,signature}}}` / `{reasoningContent:{redactedContent}}` | unsigned thinking (from an OpenAI client): `thinking_dropped` |
//! | a trailing assistant turn (prefill, continuation) | kept as the trailing `assistant` turn | |
//! | `max_tokens`, `temperature`, `top_p`, `stop_sequences` | `inferenceConfig` `maxTokens`, `temperature`, `topP`, `stopSequences` | |
//! | `top_k`, `thinking` | `additionalModelRequestFields` (by model family, above) | other models: `top_k_dropped`, `thinking_dropped` |
//! | `tools` (`input_schema`), `tool_choice` auto / any / tool | `toolConfig.tools[].toolSpec` (`inputSchema.json`), `toolChoice` `{auto:{}}` / `{any:{}}` / `{tool:{name}}` | `disable_parallel_tool_use`, a tool's `strict` and other fields: `<field>_dropped` |
//! | `tool_choice` none | no `toolConfig` (`tool_choice_none_without_tools`), or, when the history holds tool blocks (Converse then requires `toolConfig`), the tools without a `toolChoice` (`tool_choice_none_as_auto`) | |
//! | tool blocks in the history, no `tools` | `toolConfig` with a bare spec per name used (`tool_config_from_history`) | |
//! | `metadata`, `service_tier`, unknown fields | — | `<field>_dropped` |
//! | image URLs, server tools, other block types | — | **refused**, naming the field |
//!
//! The model and the stream choice are in the URL, not the body.
//!
//! # Answers ([`whole`], [`Stream`], [`error`])
//!
//! A whole answer becomes an Anthropic `message`: `text`, `tool_use`, `thinking`,
//! `redacted_thinking` blocks; `stopReason` end_turn / tool_use / max_tokens / stop_sequence /
//! model_context_window_exceeded kept, guardrail_intervened / content_filtered → `refusal` (a
//! finished answer, not an error), anything else → end_turn; `usage` with the cache counts.
//! Converse answers carry no id: one is derived from the model and the answer's bytes, so the
//! same answer always has the same id.
//!
//! A stream is `application/vnd.amazon.eventstream`: binary frames (prelude with lengths and a
//! CRC, headers, a JSON payload, a message CRC), decoded with `aws-smithy-eventstream`, which
//! checks both CRCs. Events become Anthropic events: `messageStart` → `message_start`; a
//! `contentBlockStart` (tool use only: text and reasoning blocks have none in Converse, and are
//! opened on their first delta) → `content_block_start`; deltas → `text_delta`,
//! `input_json_delta`, `thinking_delta`, `signature_delta`; `contentBlockStop` →
//! `content_block_stop`. `messageStop` carries the stop reason and `metadata`, after it, the
//! usage: `message_delta` + `message_stop` go out when `metadata` arrives, or when the body ends
//! after a `messageStop` without one. Converse tells no token count before its end, so
//! `message_start` counts zero and `message_delta` carries the whole usage, input and cache
//! counts included (as Anthropic's own `message_delta` does). A body that ends before
//! `messageStop` adds nothing, so the gateway sees a cut stream. Exception frames become an
//! `error` event; one of the model's own (`modelStreamErrorException`) is classed by the status
//! it carries (`originalStatusCode` 429: rate limited, 503/529: overloaded).
//!
//! An error answer names its exception in the `x-amzn-ErrorType` header (or the body's
//! `__type`); the hub's error kind follows it, else the HTTP status, and the message leads with
//! the exception's name (`ThrottlingException: Too many requests…`):
//!
//! | exception | hub error |
//! |---|---|
//! | Throttling, ServiceQuotaExceeded | `rate_limit_error` |
//! | ServiceUnavailable, ModelNotReady | `overloaded_error` |
//! | ModelTimeout | `timeout_error` |
//! | Validation | `invalid_request_error` |
//! | AccessDenied | `permission_error` |
//! | UnrecognizedClient, ExpiredToken, InvalidSignature, IncompleteSignature | `authentication_error` |
//! | ResourceNotFound | `not_found_error` |
//! | InternalServer, ModelError, ModelStreamError | `api_error` |

use aws_smithy_eventstream::frame::{write_message_to, DecodedFrame, MessageFrameDecoder};
use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
use base64::Engine as _;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::{error_kind_of_status, push_event, DialectRequest, StreamToHub};
use crate::protocol::{error_body, ErrorKind, Protocol};
use crate::request::RequestError;
use crate::translate::Fixes;

#[cfg(test)]
#[path = "tests/bedrock.rs"]
mod tests;

/// The refusal for a part of the hub request Converse cannot express.
fn unsupported(path: &str, what: &str) -> RequestError {
    RequestError::invalid(format!(
        "{path}: {what} is not supported by Bedrock variants"
    ))
}

/// The model families whose own request fields keel knows how to put in
/// `additionalModelRequestFields`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Claude,
    Nova,
    Other,
}

impl Family {
    /// From a model id (`anthropic.claude-…`, `us.anthropic.claude-…`, `amazon.nova-pro-v1:0`).
    fn of(model: &str) -> Family {
        let m = model.to_ascii_lowercase();
        if m.contains("anthropic") || m.contains("claude") {
            Family::Claude
        } else if m.contains("amazon.nova") {
            Family::Nova
        } else {
            Family::Other
        }
    }
}

/// The hub (Anthropic Messages) request as a Converse body.
pub fn request(hub: &Map<String, Value>) -> Result<DialectRequest, RequestError> {
    let mut fixes = Fixes::default();
    let family = Family::of(hub.get("model").and_then(Value::as_str).unwrap_or(""));
    let mut out = Map::new();
    let mut inference = Map::new();
    let mut additional = Map::new();
    for (key, value) in hub {
        match key.as_str() {
            // In the URL; handled below.
            "model" | "stream" | "messages" | "tools" | "tool_choice" => {}
            "system" => {
                let system = system(value, &mut fixes)?;
                if !system.is_empty() {
                    out.insert("system".into(), Value::Array(system));
                }
            }
            "max_tokens" => {
                inference.insert("maxTokens".into(), number(value, key)?);
            }
            "temperature" => {
                inference.insert("temperature".into(), number(value, key)?);
            }
            "top_p" => {
                inference.insert("topP".into(), number(value, key)?);
            }
            "stop_sequences" => {
                let stops = value
                    .as_array()
                    .filter(|a| a.iter().all(Value::is_string))
                    .ok_or_else(|| RequestError::invalid("stop_sequences: must be strings"))?;
                if !stops.is_empty() {
                    inference.insert("stopSequences".into(), value.clone());
                }
            }
            "top_k" => {
                let k = number(value, key)?;
                match family {
                    Family::Claude => {
                        additional.insert("top_k".into(), k);
                    }
                    Family::Nova => {
                        additional.insert("inferenceConfig".into(), json!({"topK": k}));
                    }
                    Family::Other => fixes.dropped("top_k"),
                }
            }
            "thinking" => {
                let disabled = value.get("type").and_then(Value::as_str) == Some("disabled");
                if family == Family::Claude {
                    additional.insert("thinking".into(), value.clone());
                } else if !disabled {
                    fixes.dropped("thinking");
                }
            }
            _ => fixes.dropped(key),
        }
    }

    let mut history_tools = ToolHistory::default();
    let messages = messages(
        hub.get("messages").unwrap_or(&Value::Null),
        &mut fixes,
        &mut history_tools,
    )?;
    out.insert("messages".into(), Value::Array(messages));
    if !inference.is_empty() {
        out.insert("inferenceConfig".into(), Value::Object(inference));
    }
    if let Some(config) = tool_config(hub, &history_tools, &mut fixes)? {
        out.insert("toolConfig".into(), config);
    }
    if !additional.is_empty() {
        out.insert(
            "additionalModelRequestFields".into(),
            Value::Object(additional),
        );
    }
    Ok(DialectRequest {
        body: serde_json::to_vec(&Value::Object(out)).unwrap_or_default(),
        fixes: fixes.into_vec(),
    })
}

fn number(v: &Value, path: &str) -> Result<Value, RequestError> {
    if v.is_number() {
        Ok(v.clone())
    } else {
        Err(RequestError::invalid(format!("{path}: must be a number")))
    }
}

fn system(v: &Value, fixes: &mut Fixes) -> Result<Vec<Value>, RequestError> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::String(s) if s.is_empty() => Ok(Vec::new()),
        Value::String(s) => Ok(vec![json!({"text": s})]),
        Value::Array(blocks) => {
            let mut out = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let path = format!("system[{i}]");
                if b.get("type").and_then(Value::as_str) != Some("text") {
                    return Err(unsupported(&path, "a system block other than text"));
                }
                let text = b.get("text").and_then(Value::as_str).unwrap_or("");
                out.push(json!({"text": text}));
                cache_control(b, &mut out, fixes);
            }
            Ok(out)
        }
        _ => Err(RequestError::invalid(
            "system: must be a string or text blocks",
        )),
    }
}

/// A cache point after a block marked `cache_control`: Converse marks the end of the content
/// to cache with a block of its own, Anthropic marks the last cached block. Both know the
/// `5m` and `1h` lifetimes.
fn cache_control(block: &Value, out: &mut Vec<Value>, fixes: &mut Fixes) {
    if let Some(cc) = block.get("cache_control").filter(|c| !c.is_null()) {
        let mut point = Map::new();
        point.insert("type".into(), "default".into());
        match cc.get("ttl") {
            None | Some(Value::Null) => {}
            Some(ttl @ Value::String(t)) if t == "5m" || t == "1h" => {
                point.insert("ttl".into(), ttl.clone());
            }
            Some(_) => fixes.dropped("cache_ttl"),
        }
        out.push(json!({"cachePoint": point}));
    }
}

/// The tool blocks in the history: Converse refuses them without a `toolConfig`.
#[derive(Debug, Default)]
struct ToolHistory {
    /// A `toolUse` or `toolResult` block is in the history.
    used: bool,
    /// The tools the history called, in order met.
    names: Vec<String>,
}

fn messages(
    v: &Value,
    fixes: &mut Fixes,
    history_tools: &mut ToolHistory,
) -> Result<Vec<Value>, RequestError> {
    let turns = v
        .as_array()
        .ok_or_else(|| RequestError::invalid("messages: must be an array"))?;
    let mut out: Vec<Value> = Vec::with_capacity(turns.len());
    for (i, turn) in turns.iter().enumerate() {
        let role = match turn.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(RequestError::invalid(format!(
                    "messages[{i}].role: must be user or assistant"
                )))
            }
        };
        let content = content(
            turn.get("content").unwrap_or(&Value::Null),
            &format!("messages[{i}].content"),
            fixes,
            history_tools,
        )?;
        // Converse requires turns to alternate; Anthropic joins consecutive turns of one role.
        if let Some(last) = out.last_mut() {
            if last.get("role").and_then(Value::as_str) == Some(role) {
                if let Some(blocks) = last.get_mut("content").and_then(Value::as_array_mut) {
                    blocks.extend(content);
                    fixes.add("turns_merged");
                    continue;
                }
            }
        }
        out.push(json!({"role": role, "content": content}));
    }
    Ok(out)
}

fn content(
    v: &Value,
    path: &str,
    fixes: &mut Fixes,
    history_tools: &mut ToolHistory,
) -> Result<Vec<Value>, RequestError> {
    let blocks = match v {
        Value::String(s) => return Ok(vec![json!({"text": s})]),
        Value::Array(blocks) => blocks,
        _ => {
            return Err(RequestError::invalid(format!(
                "{path}: must be a string or an array of blocks"
            )))
        }
    };
    let mut out = Vec::with_capacity(blocks.len());
    for (j, b) in blocks.iter().enumerate() {
        let path = format!("{path}[{j}]");
        let kind = b.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "text" => {
                let text = b.get("text").and_then(Value::as_str).unwrap_or("");
                out.push(json!({"text": text}));
            }
            "image" => out.push(image(b, &path)?),
            "document" => out.push(document(b, &path)?),
            "tool_use" => {
                let name = str_field(b, "name", &path)?;
                history_tools.used = true;
                if !history_tools.names.iter().any(|n| n == name) {
                    history_tools.names.push(name.to_owned());
                }
                out.push(json!({"toolUse": {
                    "toolUseId": str_field(b, "id", &path)?,
                    "name": name,
                    "input": b.get("input").cloned().unwrap_or_else(|| json!({})),
                }}));
            }
            "tool_result" => {
                let id = str_field(b, "tool_use_id", &path)?;
                let status = if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    "error"
                } else {
                    "success"
                };
                let result = tool_result_content(b.get("content"), &format!("{path}.content"))?;
                history_tools.used = true;
                out.push(
                    json!({"toolResult": {"toolUseId": id, "content": result, "status": status}}),
                );
            }
            "thinking" => {
                let signature = b.get("signature").and_then(Value::as_str).unwrap_or("");
                if signature.is_empty() {
                    // Unsigned reasoning (from an OpenAI client) is refused by Claude.
                    fixes.dropped("thinking");
                    continue;
                }
                let text = b.get("thinking").and_then(Value::as_str).unwrap_or("");
                out.push(json!({"reasoningContent": {"reasoningText": {"text": text, "signature": signature}}}));
            }
            "redacted_thinking" => {
                let data = str_field(b, "data", &path)?;
                out.push(json!({"reasoningContent": {"redactedContent": data}}));
            }
            _ => {
                return Err(unsupported(
                    &format!("{path}.type"),
                    &format!("a `{kind}` block"),
                ))
            }
        }
        cache_control(b, &mut out, fixes);
    }
    Ok(out)
}

fn str_field<'a>(b: &'a Value, key: &str, path: &str) -> Result<&'a str, RequestError> {
    b.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| RequestError::invalid(format!("{path}.{key}: must be a string")))
}

/// A base64 source's media type and data.
fn base64_source<'a>(
    b: &'a Value,
    path: &str,
    what: &str,
) -> Result<(&'a str, &'a str), RequestError> {
    let source = b.get("source").unwrap_or(&Value::Null);
    let kind = source.get("type").and_then(Value::as_str).unwrap_or("");
    if kind != "base64" {
        return Err(unsupported(
            &format!("{path}.source"),
            &format!("a `{kind}` {what} source (only base64)"),
        ));
    }
    Ok((
        source
            .get("media_type")
            .and_then(Value::as_str)
            .unwrap_or(""),
        str_field(source, "data", &format!("{path}.source"))?,
    ))
}

fn image(b: &Value, path: &str) -> Result<Value, RequestError> {
    let (media_type, data) = base64_source(b, path, "image")?;
    let format = match media_type {
        "image/png" => "png",
        "image/jpeg" => "jpeg",
        "image/gif" => "gif",
        "image/webp" => "webp",
        other => {
            return Err(unsupported(
                &format!("{path}.source.media_type"),
                &format!("image type `{other}`"),
            ))
        }
    };
    Ok(json!({"image": {"format": format, "source": {"bytes": data}}}))
}

/// A document block. Converse requires a name (letters, digits, single spaces, hyphens,
/// parentheses, brackets): the title, cleaned, else one from the block's place in the request
/// (`document messages[0] content[2]`), which no other document has.
fn document(b: &Value, path: &str) -> Result<Value, RequestError> {
    let source = b.get("source").unwrap_or(&Value::Null);
    let (format, bytes) = match source.get("type").and_then(Value::as_str) {
        Some("text") => {
            let text = str_field(source, "data", &format!("{path}.source"))?;
            (
                "txt",
                base64::engine::general_purpose::STANDARD.encode(text.as_bytes()),
            )
        }
        _ => match base64_source(b, path, "document")? {
            ("application/pdf", data) => ("pdf", data.to_owned()),
            (other, _) => {
                return Err(unsupported(
                    &format!("{path}.source.media_type"),
                    &format!("document type `{other}`"),
                ))
            }
        },
    };
    let mut name = String::new();
    for c in b.get("title").and_then(Value::as_str).unwrap_or("").chars() {
        if c.is_ascii_alphanumeric() || matches!(c, '-' | '(' | ')' | '[' | ']') {
            name.push(c);
        } else if c.is_whitespace() && !name.is_empty() && !name.ends_with(' ') {
            name.push(' ');
        }
    }
    let name = name.trim_end();
    let name = if name.is_empty() {
        format!("document {}", path.replace('.', " "))
    } else {
        name.to_owned()
    };
    Ok(json!({"document": {"format": format, "name": name, "source": {"bytes": bytes}}}))
}

fn tool_result_content(v: Option<&Value>, path: &str) -> Result<Vec<Value>, RequestError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) if s.is_empty() => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![json!({"text": s})]),
        Some(Value::Array(blocks)) => {
            let mut out = Vec::with_capacity(blocks.len());
            for (k, b) in blocks.iter().enumerate() {
                let path = format!("{path}[{k}]");
                match b.get("type").and_then(Value::as_str).unwrap_or("") {
                    "text" => out
                        .push(json!({"text": b.get("text").and_then(Value::as_str).unwrap_or("")})),
                    "image" => out.push(image(b, &path)?),
                    "document" => out.push(document(b, &path)?),
                    other => {
                        return Err(unsupported(
                            &format!("{path}.type"),
                            &format!("a `{other}` block in a tool result"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(RequestError::invalid(format!(
            "{path}: must be a string or an array of blocks"
        ))),
    }
}

/// `toolConfig` from `tools` and `tool_choice`, or from the tools the history used: Converse
/// refuses `toolUse` / `toolResult` blocks without a `toolConfig`.
fn tool_config(
    hub: &Map<String, Value>,
    history: &ToolHistory,
    fixes: &mut Fixes,
) -> Result<Option<Value>, RequestError> {
    let mut tools = Vec::new();
    if let Some(list) = hub.get("tools").filter(|t| !t.is_null()) {
        let list = list
            .as_array()
            .ok_or_else(|| RequestError::invalid("tools: must be an array"))?;
        for (i, t) in list.iter().enumerate() {
            let path = format!("tools[{i}]");
            if let Some(kind) = t.get("type").and_then(Value::as_str) {
                if kind != "custom" {
                    return Err(unsupported(
                        &format!("{path}.type"),
                        &format!("the server tool `{kind}`"),
                    ));
                }
            }
            let mut spec = Map::new();
            spec.insert("name".into(), str_field(t, "name", &path)?.into());
            if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                spec.insert("description".into(), d.clone());
            }
            let schema = t
                .get("input_schema")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            spec.insert("inputSchema".into(), json!({"json": schema}));
            for key in t.as_object().into_iter().flat_map(|o| o.keys()) {
                if !matches!(
                    key.as_str(),
                    "name" | "description" | "input_schema" | "type" | "cache_control"
                ) {
                    fixes.dropped(key);
                }
            }
            tools.push(json!({"toolSpec": spec}));
            cache_control(t, &mut tools, fixes);
        }
    }
    let used_in_history = history.used;
    let choice = hub.get("tool_choice").filter(|c| !c.is_null());
    if choice
        .and_then(|c| c.get("disable_parallel_tool_use"))
        .and_then(Value::as_bool)
        == Some(true)
    {
        fixes.dropped("disable_parallel_tool_use");
    }
    let kind = choice.and_then(|c| c.get("type")).and_then(Value::as_str);
    let tool_choice = match kind {
        None | Some("auto") => None,
        Some("any") => Some(json!({"any": {}})),
        Some("tool") => {
            let name = choice
                .and_then(|c| c.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| RequestError::invalid("tool_choice.name: must be a string"))?;
            Some(json!({"tool": {"name": name}}))
        }
        Some("none") => {
            if tools.is_empty() && !used_in_history {
                return Ok(None);
            }
            if !used_in_history {
                fixes.add("tool_choice_none_without_tools");
                return Ok(None);
            }
            fixes.add("tool_choice_none_as_auto");
            None
        }
        Some(other) => {
            return Err(unsupported(
                "tool_choice.type",
                &format!("tool choice `{other}`"),
            ))
        }
    };
    if tools.is_empty() {
        if !used_in_history {
            return Ok(None);
        }
        // Bare specs for the tools the history called, so its blocks are accepted.
        for name in &history.names {
            tools.push(
                json!({"toolSpec": {"name": name, "inputSchema": {"json": {"type": "object"}}}}),
            );
        }
        if tools.is_empty() {
            // Only results, their calls not in the history: a placeholder spec.
            tools.push(
                json!({"toolSpec": {"name": "tool", "inputSchema": {"json": {"type": "object"}}}}),
            );
        }
        fixes.add("tool_config_from_history");
    }
    let mut config = Map::new();
    config.insert("tools".into(), Value::Array(tools));
    if let Some(c) = tool_choice {
        config.insert("toolChoice".into(), c);
    }
    Ok(Some(Value::Object(config)))
}

// ---------------------------------------------------------------------------------------------
// Answers.

/// Converse `stopReason` → Anthropic `stop_reason`.
fn stop_reason_of(reason: &str) -> &'static str {
    match reason {
        "tool_use" => "tool_use",
        "max_tokens" => "max_tokens",
        "stop_sequence" => "stop_sequence",
        "model_context_window_exceeded" => "model_context_window_exceeded",
        // A safety stop is a finished answer the model would not give.
        "guardrail_intervened" | "content_filtered" => "refusal",
        // end_turn, malformed_model_output, malformed_tool_use, and newer reasons.
        _ => "end_turn",
    }
}

/// Converse `usage` → Anthropic `usage`. Both count input tokens without the cached ones.
fn usage_of(usage: Option<&Value>) -> Value {
    let n = |key: &str| {
        usage
            .and_then(|u| u.get(key))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    json!({
        "input_tokens": n("inputTokens"),
        "cache_creation_input_tokens": n("cacheWriteInputTokens"),
        "cache_read_input_tokens": n("cacheReadInputTokens"),
        "output_tokens": n("outputTokens"),
    })
}

/// The stop sequence that ended the answer, where the model reports it (Claude does, in
/// `additionalModelResponseFields`).
fn stop_sequence_of(fields: Option<&Value>) -> Value {
    fields
        .and_then(|f| f.get("stop_sequence"))
        .filter(|s| s.is_string())
        .cloned()
        .unwrap_or(Value::Null)
}

/// A message id derived from the model and some bytes of the answer: Converse sends none.
fn message_id(model: &str, bytes: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(model.as_bytes());
    h.update([0]);
    h.update(bytes);
    let digest = h.finalize();
    let mut id = String::from("msg_bdrk_");
    for b in &digest[..12] {
        id.push_str(&format!("{b:02x}"));
    }
    id
}

/// A Converse answer (`output.message`, `stopReason`, `usage`) as an Anthropic `message`.
pub fn whole(body: &[u8], model: &str) -> Result<Vec<u8>, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("the Bedrock answer is not JSON: {e}"))?;
    let blocks = v
        .pointer("/output/message/content")
        .and_then(Value::as_array)
        .ok_or("the Bedrock answer has no output.message.content")?;
    let mut content = Vec::with_capacity(blocks.len());
    for b in blocks {
        if let Some(text) = b.get("text").and_then(Value::as_str) {
            content.push(json!({"type": "text", "text": text}));
        } else if let Some(t) = b.get("toolUse") {
            content.push(json!({"type": "tool_use",
                "id": t.get("toolUseId").cloned().unwrap_or(Value::Null),
                "name": t.get("name").cloned().unwrap_or(Value::Null),
                "input": t.get("input").cloned().unwrap_or_else(|| json!({}))}));
        } else if let Some(r) = b.get("reasoningContent") {
            if let Some(t) = r.get("reasoningText") {
                content.push(json!({"type": "thinking",
                    "thinking": t.get("text").and_then(Value::as_str).unwrap_or(""),
                    "signature": t.get("signature").and_then(Value::as_str).unwrap_or("")}));
            } else if let Some(data) = r.get("redactedContent").and_then(Value::as_str) {
                content.push(json!({"type": "redacted_thinking", "data": data}));
            }
        } else if let Some(parts) = b
            .pointer("/citationsContent/content")
            .and_then(Value::as_array)
        {
            let text: String = parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            content.push(json!({"type": "text", "text": text}));
        }
        // Other blocks (images, guard content) have no place in an assistant message.
    }
    let stop = v
        .get("stopReason")
        .and_then(Value::as_str)
        .unwrap_or("end_turn");
    let msg = json!({
        "id": message_id(model, body),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason_of(stop),
        "stop_sequence": stop_sequence_of(v.get("additionalModelResponseFields")),
        "usage": usage_of(v.get("usage")),
    });
    serde_json::to_vec(&msg).map_err(|e| e.to_string())
}

/// The hub's error kind for a Bedrock exception name, in either spelling (`ThrottlingException`
/// in the `x-amzn-ErrorType` header, `throttlingException` in a stream).
fn kind_of_exception(name: &str) -> Option<ErrorKind> {
    let lower = name.to_ascii_lowercase();
    Some(match lower.strip_suffix("exception").unwrap_or(&lower) {
        "throttling" | "servicequotaexceeded" => ErrorKind::RateLimited,
        "serviceunavailable" | "modelnotready" => ErrorKind::Overloaded,
        "modeltimeout" => ErrorKind::Timeout,
        "validation" => ErrorKind::InvalidRequest,
        "accessdenied" => ErrorKind::Permission,
        "unrecognizedclient" | "expiredtoken" | "invalidsignature" | "incompletesignature" => {
            ErrorKind::Authentication
        }
        "resourcenotfound" => ErrorKind::NotFound,
        "internalserver" | "modelerror" | "modelstreamerror" => ErrorKind::Internal,
        _ => return None,
    })
}

/// The exception name in `x-amzn-ErrorType` (`ThrottlingException:http://internal…`) or a
/// body's `__type` (`com.amazon.coral.service#ThrottlingException`).
fn exception_name(raw: &str) -> &str {
    let name = raw.rsplit('#').next().unwrap_or(raw);
    name.split(':').next().unwrap_or(name).trim()
}

/// A Bedrock error answer (`{"message": …}`, the exception named in the `x-amzn-ErrorType`
/// header, or in the body's `__type`) as an Anthropic error body. The message leads with the
/// exception's name.
pub fn error(status: u16, error_type: Option<&str>, body: &[u8]) -> Vec<u8> {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let name = error_type
        .map(exception_name)
        .filter(|n| !n.is_empty())
        .or_else(|| {
            v.get("__type")
                .and_then(Value::as_str)
                .map(exception_name)
                .filter(|n| !n.is_empty())
        });
    let message = v
        .get("message")
        .or_else(|| v.get("Message"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| {
            if v.is_null() {
                String::from_utf8_lossy(body).trim().to_owned()
            } else {
                String::new()
            }
        });
    let kind = name
        .and_then(kind_of_exception)
        .unwrap_or_else(|| error_kind_of_status(status));
    let text = match (name, message.is_empty()) {
        (Some(n), false) => format!("{n}: {message}"),
        (Some(n), true) => n.to_owned(),
        (None, false) => message,
        (None, true) => format!("Bedrock answered HTTP {status}"),
    };
    serde_json::to_vec(&error_body(Protocol::Anthropic, kind, &text)).unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// Event stream frames, as a Bedrock server writes them.

fn string_header(name: &'static str, value: &str) -> Header {
    Header::new(name, HeaderValue::String(value.to_owned().into()))
}

fn frame_bytes(message: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    // Writing fails only for headers or payloads past the format's limits.
    let _ = write_message_to(message, &mut out);
    out
}

/// One Converse stream event as Bedrock sends it: an event-stream frame with the headers
/// `:event-type` (`messageStart`, `contentBlockDelta`, …), `:content-type`
/// `application/json` and `:message-type` `event`, and the JSON payload. For tests and
/// keel-sim.
pub fn encode_frame(event_type: &str, payload: &Value) -> Vec<u8> {
    let message = Message::new(serde_json::to_vec(payload).unwrap_or_default())
        .add_header(string_header(":event-type", event_type))
        .add_header(string_header(":content-type", "application/json"))
        .add_header(string_header(":message-type", "event"));
    frame_bytes(&message)
}

/// An exception inside a Converse stream as Bedrock sends it: `:exception-type`
/// (`throttlingException`, `modelStreamErrorException`, …), `:message-type` `exception`,
/// payload `{"message": …}`. For tests and keel-sim.
pub fn encode_exception(exception_type: &str, message: &str) -> Vec<u8> {
    let payload = serde_json::to_vec(&json!({"message": message})).unwrap_or_default();
    let message = Message::new(payload)
        .add_header(string_header(":exception-type", exception_type))
        .add_header(string_header(":content-type", "application/json"))
        .add_header(string_header(":message-type", "exception"));
    frame_bytes(&message)
}

fn header<'a>(message: &'a Message, name: &str) -> Option<&'a str> {
    message
        .headers()
        .iter()
        .find(|h| h.name().as_str() == name)
        .and_then(|h| h.value().as_string().ok())
        .map(|s| s.as_str())
}

/// The largest frame accepted: the event-stream format's own limit (16 MiB of payload) and
/// room for headers.
const MAX_FRAME_BYTES: usize = 16 * 1024 * 1024 + 128 * 1024;

/// What a Converse content block is in the hub's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Tool,
    Thinking,
    Redacted,
}

#[derive(Debug)]
struct Block {
    /// `contentBlockIndex` in the Converse stream.
    converse: u64,
    /// The Anthropic block index.
    index: usize,
    kind: Kind,
    open: bool,
}

/// A Converse event stream, frame by frame, as Anthropic Messages events.
#[derive(Debug)]
pub struct Stream {
    model: String,
    decoder: MessageFrameDecoder,
    /// Bytes not yet consumed by the decoder.
    pending: Vec<u8>,
    /// The decoder holds the prelude of a frame whose rest has not all arrived.
    in_frame: bool,
    started: bool,
    blocks: Vec<Block>,
    /// `messageStop` seen: the Anthropic stop reason and stop sequence.
    stop: Option<(&'static str, Value)>,
    usage: Option<Value>,
    /// `message_stop` or an error event went out: later frames are ignored.
    done: bool,
}

impl Stream {
    /// `model` names the model in `message_start`.
    pub fn new(model: &str) -> Stream {
        Stream {
            model: model.to_owned(),
            decoder: MessageFrameDecoder::new(),
            pending: Vec::new(),
            in_frame: false,
            started: false,
            blocks: Vec::new(),
            stop: None,
            usage: None,
            done: false,
        }
    }

    fn start(&mut self, seed: &[u8], out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        // The id comes from the first frame's payload, whose random padding (`p`) tells
        // streams apart.
        push_event(
            out,
            Some("message_start"),
            &json!({"type": "message_start", "message": {
                "id": message_id(&self.model, seed), "type": "message", "role": "assistant",
                "model": self.model, "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 0, "output_tokens": 0}}}),
        );
    }

    /// The open hub block for a Converse index, opening one of `kind` (with `start` as its
    /// `content_block`) when none is.
    fn block(
        &mut self,
        converse: u64,
        kind: Kind,
        start: impl FnOnce() -> Value,
        out: &mut Vec<u8>,
    ) -> Result<usize, String> {
        if let Some(b) = self
            .blocks
            .iter()
            .find(|b| b.converse == converse && b.open)
        {
            return if b.kind == kind {
                Ok(b.index)
            } else {
                Err(format!(
                    "Bedrock stream: a {kind:?} delta for content block {converse}, a {:?} block",
                    b.kind
                ))
            };
        }
        let index = self.blocks.len();
        push_event(
            out,
            Some("content_block_start"),
            &json!({"type": "content_block_start", "index": index, "content_block": start()}),
        );
        self.blocks.push(Block {
            converse,
            index,
            kind,
            open: true,
        });
        Ok(index)
    }

    fn delta(out: &mut Vec<u8>, index: usize, delta: Value) {
        push_event(
            out,
            Some("content_block_delta"),
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        );
    }

    fn close(&mut self, converse: Option<u64>, out: &mut Vec<u8>) {
        for b in self
            .blocks
            .iter_mut()
            .filter(|b| b.open && converse.is_none_or(|c| c == b.converse))
        {
            b.open = false;
            push_event(
                out,
                Some("content_block_stop"),
                &json!({"type": "content_block_stop", "index": b.index}),
            );
        }
    }

    fn finish(&mut self, out: &mut Vec<u8>) {
        let Some((stop_reason, stop_sequence)) = self.stop.clone() else {
            return;
        };
        push_event(
            out,
            Some("message_delta"),
            &json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage_of(self.usage.as_ref())}),
        );
        push_event(out, Some("message_stop"), &json!({"type": "message_stop"}));
        self.done = true;
    }

    fn error_event(&mut self, kind: ErrorKind, message: &str, out: &mut Vec<u8>) {
        push_event(
            out,
            Some("error"),
            &error_body(Protocol::Anthropic, kind, message),
        );
        self.done = true;
    }

    fn frame(&mut self, message: &Message, out: &mut Vec<u8>) -> Result<(), String> {
        let payload = message.payload();
        match header(message, ":message-type").unwrap_or("event") {
            "event" => {}
            "exception" => {
                let name = header(message, ":exception-type").unwrap_or("exception");
                let v: Value = serde_json::from_slice(payload).unwrap_or(Value::Null);
                let text = v.get("message").and_then(Value::as_str).unwrap_or("");
                // A model's own error carries the status it answered with.
                let kind = match v.get("originalStatusCode").and_then(Value::as_u64) {
                    Some(429) => ErrorKind::RateLimited,
                    Some(503 | 529) => ErrorKind::Overloaded,
                    _ => kind_of_exception(name).unwrap_or(ErrorKind::Internal),
                };
                self.error_event(kind, &format!("{name}: {text}"), out);
                return Ok(());
            }
            "error" => {
                let code = header(message, ":error-code").unwrap_or("error");
                let text = header(message, ":error-message").unwrap_or("");
                let kind = kind_of_exception(code).unwrap_or(ErrorKind::Internal);
                self.error_event(kind, &format!("{code}: {text}"), out);
                return Ok(());
            }
            other => return Err(format!("Bedrock stream: unknown message type `{other}`")),
        }
        let event = header(message, ":event-type").unwrap_or("");
        let v: Value = serde_json::from_slice(payload)
            .map_err(|e| format!("Bedrock stream: invalid JSON in `{event}`: {e}"))?;
        let index = v
            .get("contentBlockIndex")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        match event {
            "messageStart" => self.start(payload, out),
            "contentBlockStart" => {
                self.start(payload, out);
                if let Some(tool) = v.pointer("/start/toolUse") {
                    let block = json!({"type": "tool_use",
                        "id": tool.get("toolUseId").cloned().unwrap_or(Value::Null),
                        "name": tool.get("name").cloned().unwrap_or(Value::Null),
                        "input": {}});
                    self.block(index, Kind::Tool, || block, out)?;
                }
            }
            "contentBlockDelta" => {
                self.start(payload, out);
                let delta = v.get("delta").unwrap_or(&Value::Null);
                if let Some(text) = delta.get("text").and_then(Value::as_str) {
                    let i = self.block(
                        index,
                        Kind::Text,
                        || json!({"type": "text", "text": ""}),
                        out,
                    )?;
                    Self::delta(out, i, json!({"type": "text_delta", "text": text}));
                } else if let Some(tool) = delta.get("toolUse") {
                    let Some(i) = self
                        .blocks
                        .iter()
                        .find(|b| b.converse == index && b.open && b.kind == Kind::Tool)
                        .map(|b| b.index)
                    else {
                        return Err(format!(
                            "Bedrock stream: tool input for content block {index}, which started no tool use"
                        ));
                    };
                    let input = tool.get("input").and_then(Value::as_str).unwrap_or("");
                    Self::delta(
                        out,
                        i,
                        json!({"type": "input_json_delta", "partial_json": input}),
                    );
                } else if let Some(r) = delta.get("reasoningContent") {
                    let thinking = || json!({"type": "thinking", "thinking": "", "signature": ""});
                    if let Some(text) = r.get("text").and_then(Value::as_str) {
                        let i = self.block(index, Kind::Thinking, thinking, out)?;
                        Self::delta(out, i, json!({"type": "thinking_delta", "thinking": text}));
                    } else if let Some(sig) = r.get("signature").and_then(Value::as_str) {
                        let i = self.block(index, Kind::Thinking, thinking, out)?;
                        Self::delta(out, i, json!({"type": "signature_delta", "signature": sig}));
                    } else if let Some(data) = r.get("redactedContent").and_then(Value::as_str) {
                        // Anthropic sends redacted thinking whole, in its block's start.
                        let data = data.to_owned();
                        self.block(
                            index,
                            Kind::Redacted,
                            || json!({"type": "redacted_thinking", "data": data}),
                            out,
                        )?;
                    }
                }
                // Citations and newer delta kinds: nothing for the hub.
            }
            "contentBlockStop" => self.close(Some(index), out),
            "messageStop" => {
                self.start(payload, out);
                self.close(None, out);
                let reason = v
                    .get("stopReason")
                    .and_then(Value::as_str)
                    .unwrap_or("end_turn");
                self.stop = Some((
                    stop_reason_of(reason),
                    stop_sequence_of(v.get("additionalModelResponseFields")),
                ));
                if self.usage.is_some() {
                    self.finish(out);
                }
            }
            "metadata" => {
                self.usage = Some(v.get("usage").cloned().unwrap_or(Value::Null));
                self.finish(out);
            }
            // Event types newer than this code.
            _ => {}
        }
        Ok(())
    }
}

impl StreamToHub for Stream {
    fn feed(&mut self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        self.pending.extend_from_slice(chunk);
        let mut consumed = 0;
        let result = loop {
            if self.done {
                consumed = self.pending.len();
                break Ok(());
            }
            let mut rest = &self.pending[consumed..];
            // A frame starts with its total length: refuse a huge one before waiting for it
            // (its checksums are checked only once it is whole).
            if !self.in_frame {
                if let Some(len) = rest.get(..4) {
                    let total = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
                    if total as usize > MAX_FRAME_BYTES {
                        break Err(format!(
                            "Bedrock stream: a frame of {total} bytes exceeds {MAX_FRAME_BYTES}"
                        ));
                    }
                }
            }
            let before = rest.len();
            let decoded = self.decoder.decode_frame(&mut rest);
            let read = before - rest.len();
            consumed += read;
            match decoded {
                Ok(DecodedFrame::Complete(message)) => {
                    self.in_frame = false;
                    if let Err(e) = self.frame(&message, out) {
                        break Err(e);
                    }
                }
                Ok(DecodedFrame::Incomplete) => {
                    // The decoder keeps a prelude it has read; the rest of the frame follows.
                    self.in_frame |= read > 0;
                    break Ok(());
                }
                Err(e) => break Err(format!("Bedrock stream: a bad event-stream frame: {e}")),
            }
        };
        self.pending.drain(..consumed);
        result
    }

    fn end(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        // `messageStop` seen but no `metadata`: the answer is complete, without usage.
        if !self.done && self.stop.is_some() {
            self.finish(out);
        }
        Ok(())
    }
}
