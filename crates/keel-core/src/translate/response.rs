//! Whole (non-streamed) responses and error bodies, both ways.

use serde_json::{json, Map, Value};

use super::{
    finish_reason_of, stop_reason_of, usage_to_anthropic, usage_to_openai, ResponseContext,
};
use crate::members::Members;
use crate::protocol::{error_body, error_message, ErrorKind, Protocol};

fn is_error_body(v: &Value) -> bool {
    v.member("type").and_then(Value::as_str) == Some("error")
        || v.member("error").is_some_and(|e| !e.is_null())
}

/// An Anthropic `message` as an OpenAI `chat.completion`, under the public model name and
/// the given `created` time (seconds since the epoch). `Err` when the body is not a message.
pub fn message_to_chat_completion(
    msg: &Value,
    ctx: &ResponseContext,
    public_model: &str,
    created_s: u64,
) -> Result<Value, String> {
    if is_error_body(msg) {
        return Err("the upstream answer is an error body".into());
    }
    let blocks = msg
        .member("content")
        .and_then(Value::as_array)
        .ok_or("the upstream message has no content array")?;
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    let mut answered_by_json_tool = false;
    for b in blocks {
        match b.member("type").and_then(Value::as_str).unwrap_or("") {
            "text" => text.push_str(b.member("text").and_then(Value::as_str).unwrap_or("")),
            "thinking" => {
                reasoning.push_str(b.member("thinking").and_then(Value::as_str).unwrap_or(""))
            }
            "tool_use" => {
                let name = b.member("name").and_then(Value::as_str).unwrap_or("");
                let input = b.member("input").cloned().unwrap_or_else(|| json!({}));
                if ctx.json_tool.as_deref() == Some(name) {
                    text.push_str(&input.to_string());
                    answered_by_json_tool = true;
                } else {
                    calls.push(json!({"id": b.member("id").cloned().unwrap_or(Value::Null),
                        "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
                }
            }
            // Redacted thinking and server-tool blocks have no Chat form.
            _ => {}
        }
    }
    let stop = msg
        .member("stop_reason")
        .and_then(Value::as_str)
        .unwrap_or("end_turn");
    let finish = if answered_by_json_tool && stop == "tool_use" {
        "stop"
    } else {
        finish_reason_of(stop)
    };
    let mut message = Map::new();
    message.insert("role".into(), "assistant".into());
    let content = if text.is_empty() && !calls.is_empty() {
        Value::Null
    } else {
        Value::String(text)
    };
    message.insert("content".into(), content);
    message.insert("refusal".into(), Value::Null);
    if !reasoning.is_empty() {
        message.insert("reasoning_content".into(), reasoning.into());
    }
    if !calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(calls));
    }
    let mut out = json!({
        "id": msg.member("id").cloned().unwrap_or(Value::Null),
        "object": "chat.completion",
        "created": created_s,
        "model": public_model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
    });
    if let Some(u) = msg.member("usage").filter(|u| u.is_object()) {
        out["usage"] = usage_to_openai(u);
    }
    Ok(out)
}

/// An OpenAI `chat.completion` (its first choice) as an Anthropic `message`, under the public
/// model name. `Err` when the body is not a completion, or a tool call's arguments are not a
/// JSON object (Anthropic's `input` must be one).
pub fn chat_completion_to_message(body: &Value, public_model: &str) -> Result<Value, String> {
    if is_error_body(body) {
        return Err("the upstream answer is an error body".into());
    }
    let choice = body
        .member("choices")
        .and_then(|c| c.get(0))
        .ok_or("the upstream completion has no choices")?;
    let message = choice.member("message").unwrap_or(&Value::Null);
    let mut content = Vec::new();
    if let Some(r) = message
        .member("reasoning_content")
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty())
    {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    match message.member("content") {
        Some(Value::String(s)) if !s.is_empty() => content.push(json!({"type": "text", "text": s})),
        Some(Value::Array(parts)) => {
            for p in parts {
                if let Some(t) = p
                    .member("text")
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
                {
                    content.push(json!({"type": "text", "text": t}));
                }
            }
        }
        _ => {}
    }
    let refusal = message
        .member("refusal")
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty());
    if let Some(r) = refusal {
        content.push(json!({"type": "text", "text": r}));
    }
    let calls = message.member("tool_calls").and_then(Value::as_array);
    for (j, call) in calls.into_iter().flatten().enumerate() {
        let args = call
            .pointer("/function/arguments")
            .and_then(Value::as_str)
            .unwrap_or("");
        let input = if args.trim().is_empty() {
            json!({})
        } else {
            match serde_json::from_str::<Value>(args) {
                Ok(v @ Value::Object(_)) => v,
                _ => return Err(format!("tool call {j}'s arguments are not a JSON object")),
            }
        };
        content.push(json!({"type": "tool_use",
            "id": call.member("id").cloned().unwrap_or(Value::Null),
            "name": call.pointer("/function/name").cloned().unwrap_or(Value::Null),
            "input": input}));
    }
    let stop_reason = if refusal.is_some() {
        "refusal"
    } else {
        stop_reason_of(
            choice
                .member("finish_reason")
                .and_then(Value::as_str)
                .unwrap_or("stop"),
        )
    };
    let usage = body
        .member("usage")
        .filter(|u| u.is_object())
        .map(usage_to_anthropic)
        .unwrap_or_else(|| json!({"input_tokens": 0, "output_tokens": 0}));
    Ok(json!({
        "id": body.member("id").cloned().unwrap_or(Value::Null),
        "type": "message",
        "role": "assistant",
        "model": public_model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": null,
        "usage": usage,
    }))
}

/// The kind of an upstream error: from the HTTP status when there is one, else from the
/// error's `type` (in-stream errors have no status of their own).
pub fn error_kind_of(body: &Value, status: Option<u16>) -> ErrorKind {
    match status {
        Some(400) => return ErrorKind::InvalidRequest,
        Some(401) => return ErrorKind::Authentication,
        Some(403) => return ErrorKind::Permission,
        Some(404) => return ErrorKind::NotFound,
        Some(408) => return ErrorKind::RequestTimeout,
        Some(413) => return ErrorKind::TooLarge,
        Some(415) => return ErrorKind::UnsupportedMediaType,
        Some(429) => return ErrorKind::RateLimited,
        Some(502) => return ErrorKind::BadGateway,
        Some(503) | Some(529) => return ErrorKind::Overloaded,
        Some(504) => return ErrorKind::Timeout,
        Some(500..=599) => return ErrorKind::Internal,
        _ => {}
    }
    let kind = body
        .pointer("/error/type")
        .and_then(Value::as_str)
        .unwrap_or("");
    match kind {
        "invalid_request_error" => ErrorKind::InvalidRequest,
        "authentication_error" => ErrorKind::Authentication,
        "permission_error" => ErrorKind::Permission,
        "not_found_error" => ErrorKind::NotFound,
        "request_too_large" => ErrorKind::TooLarge,
        "rate_limit_error" => ErrorKind::RateLimited,
        "timeout_error" => ErrorKind::Timeout,
        "overloaded_error" => ErrorKind::Overloaded,
        "api_error" | "server_error" => ErrorKind::Internal,
        _ => ErrorKind::BadGateway,
    }
}

/// An upstream's in-stream error (either protocol's shape) as the `to` protocol's stream error
/// event, keeping the message and the kind.
pub(crate) fn error_event_to_protocol(body: &Value, to: Protocol) -> crate::sse::SseEvent {
    crate::protocol::stream_error_event(to, error_kind_of(body, None), &error_message(body))
}

/// An upstream error body (either protocol's shape) in the `to` protocol's shape, keeping the
/// message and the kind.
pub fn error_body_to_protocol(body: &Value, status: Option<u16>, to: Protocol) -> Value {
    error_body(to, error_kind_of(body, status), &error_message(body))
}
