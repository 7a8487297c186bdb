//! Bedrock's Converse API (`POST /model/{modelId}/converse` and `/converse-stream`), read as
//! Anthropic Messages.
//!
//! Requests: `messages[].content[]` blocks `text`, `image`, `toolUse`, `toolResult`; `system`
//! blocks; `inferenceConfig`; `toolConfig` (`toolSpec`s and `toolChoice`);
//! `additionalModelRequestFields.top_k`. A trailing assistant turn is continued as an
//! Anthropic prefill is. Whole answers: `output.message`, `stopReason`, `usage`, `metrics`.
//! Streams are `application/vnd.amazon.eventstream` binary frames (`:event-type`
//! messageStart, contentBlockStart (tool use only), contentBlockDelta, contentBlockStop,
//! messageStop, metadata), errors in a stream are `:message-type: exception` frames, and HTTP
//! errors carry their name in `x-amzn-ErrorType` beside `{"message": …}`.

use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
use serde_json::{json, Map, Value};

use super::{HubRequest, Route};
use crate::text::Finish;
use crate::wire::{Piece, Reply};

pub fn to_hub(route: &Route, obj: &Map<String, Value>) -> Result<HubRequest, String> {
    let msgs = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("messages: required")?;
    if msgs.is_empty() {
        return Err("A conversation must start with a user message. Try again with a conversation that starts with a user message.".into());
    }
    let mut messages = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => return Err(format!("messages.{i}.role: must be user or assistant")),
        };
        let content = m
            .get("content")
            .and_then(Value::as_array)
            .ok_or(format!("messages.{i}.content: required"))?;
        let mut blocks = Vec::new();
        for b in content {
            let Some(b) = b.as_object() else { continue };
            if let Some(t) = b.get("text").and_then(Value::as_str) {
                blocks.push(json!({"type": "text", "text": t}));
            } else if let Some(img) = b.get("image") {
                let format = img.get("format").and_then(Value::as_str).unwrap_or("png");
                blocks.push(json!({"type": "image", "source": {"type": "base64",
                    "media_type": format!("image/{format}"),
                    "data": img.pointer("/source/bytes").cloned().unwrap_or(json!(""))}}));
            } else if let Some(t) = b.get("toolUse") {
                blocks.push(
                    json!({"type": "tool_use", "id": t.get("toolUseId"), "name": t.get("name"),
                    "input": t.get("input").cloned().unwrap_or(json!({}))}),
                );
            } else if let Some(t) = b.get("toolResult") {
                let text: Vec<String> = t
                    .get("content")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .map(|c| match (c.get("text"), c.get("json")) {
                        (Some(Value::String(s)), _) => s.clone(),
                        (_, Some(j)) => j.to_string(),
                        _ => String::new(),
                    })
                    .collect();
                let mut r = json!({"type": "tool_result", "tool_use_id": t.get("toolUseId"), "content": text.join("\n")});
                if t.get("status").and_then(Value::as_str) == Some("error") {
                    r["is_error"] = json!(true);
                }
                blocks.push(r);
            } else if b.contains_key("cachePoint") || b.contains_key("reasoningContent") {
                continue;
            } else if let Some(kind) = b.keys().next() {
                blocks.push(json!({ "type": kind }));
            }
        }
        messages.push(json!({"role": role, "content": blocks}));
    }
    let mut hub = Map::new();
    hub.insert(
        "model".into(),
        json!(route.model.as_deref().unwrap_or_default()),
    );
    if let Some(system) = obj.get("system").and_then(Value::as_array) {
        let blocks: Vec<Value> = system
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .map(|t| json!({"type": "text", "text": t}))
            .collect();
        hub.insert("system".into(), Value::Array(blocks));
    }
    hub.insert("messages".into(), Value::Array(messages));
    let config = obj
        .get("inferenceConfig")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    hub.insert(
        "max_tokens".into(),
        json!(config
            .get("maxTokens")
            .and_then(Value::as_u64)
            .unwrap_or(4096)),
    );
    for (from, to) in [
        ("temperature", "temperature"),
        ("topP", "top_p"),
        ("stopSequences", "stop_sequences"),
    ] {
        if let Some(v) = config.get(from) {
            hub.insert(to.into(), v.clone());
        }
    }
    if let Some(k) = obj
        .get("additionalModelRequestFields")
        .and_then(|f| f.get("top_k"))
    {
        hub.insert("top_k".into(), k.clone());
    }
    if let Some(tc) = obj.get("toolConfig") {
        let tools: Vec<Value> = tc
            .get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|t| t.get("toolSpec"))
            .map(|s| {
                let mut t = json!({"name": s.get("name"),
                    "input_schema": s.pointer("/inputSchema/json").cloned().unwrap_or(json!({"type": "object"}))});
                if let Some(d) = s.get("description") {
                    t["description"] = d.clone();
                }
                t
            })
            .collect();
        if !tools.is_empty() {
            hub.insert("tools".into(), Value::Array(tools));
        }
        if let Some(choice) = tc.get("toolChoice") {
            let c = if choice.get("any").is_some() {
                json!({"type": "any"})
            } else if let Some(name) = choice.pointer("/tool/name") {
                json!({"type": "tool", "name": name})
            } else {
                json!({"type": "auto"})
            };
            hub.insert("tool_choice".into(), c);
        }
    }
    hub.insert("stream".into(), json!(route.stream));
    Ok(HubRequest {
        body: Value::Object(hub),
        schema: None,
    })
}

/// Checks an `Authorization: AWS4-HMAC-SHA256 Credential=…, SignedHeaders=…, Signature=…`
/// header's shape, and that its scope names the `bedrock` service (the signature itself is not
/// verified: the simulator holds no secret).
pub fn check_sigv4(auth: &str, amz_date: Option<&str>) -> Result<(), String> {
    let bad = |m: &str| Err(format!("Authorization header requires {m}."));
    let Some(rest) = auth.strip_prefix("AWS4-HMAC-SHA256 ") else {
        return bad("the AWS4-HMAC-SHA256 algorithm");
    };
    let mut credential = None;
    let mut signed = None;
    let mut signature = None;
    for part in rest.split(',') {
        match part.trim().split_once('=') {
            Some(("Credential", v)) => credential = Some(v),
            Some(("SignedHeaders", v)) => signed = Some(v),
            Some(("Signature", v)) => signature = Some(v),
            _ => {}
        }
    }
    let Some(credential) = credential else {
        return bad("'Credential' parameter");
    };
    let scope: Vec<&str> = credential.split('/').collect();
    let [key, date, region, service, terminator] = scope[..] else {
        return bad("a Credential of the form key/date/region/service/aws4_request");
    };
    if key.is_empty()
        || date.len() != 8
        || !date.bytes().all(|b| b.is_ascii_digit())
        || region.is_empty()
        || terminator != "aws4_request"
    {
        return bad("a Credential of the form key/date/region/service/aws4_request");
    }
    if service != "bedrock" {
        return Err(format!(
            "Credential should be scoped to correct service: 'bedrock' (got '{service}')."
        ));
    }
    if !signed.is_some_and(|s| s.split(';').any(|h| h == "host")) {
        return bad("'SignedHeaders' parameter including host");
    }
    if !signature.is_some_and(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())) {
        return bad("'Signature' parameter (64 hex digits)");
    }
    if amz_date.is_none() {
        return Err(
            "Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header."
                .into(),
        );
    }
    Ok(())
}

/// The exception name Bedrock gives an HTTP status.
pub fn error_name(status: u16) -> &'static str {
    match status {
        400 => "ValidationException",
        401 | 403 => "AccessDeniedException",
        404 => "ResourceNotFoundException",
        408 => "ModelTimeoutException",
        424 => "ModelErrorException",
        429 => "ThrottlingException",
        503 | 529 => "ServiceUnavailableException",
        _ => "InternalServerException",
    }
}

fn stop_reason(reply: &Reply) -> &'static str {
    match (&reply.tool_call, &reply.finish) {
        (Some(_), _) => "tool_use",
        (_, Finish::Length) => "max_tokens",
        (_, Finish::StopSequence(_)) => "stop_sequence",
        (_, Finish::Refusal) => "content_filtered",
        _ => "end_turn",
    }
}

fn usage(reply: &Reply) -> Value {
    let mut u = json!({"inputTokens": reply.prompt_tokens, "outputTokens": reply.completion_tokens,
        "totalTokens": reply.prompt_tokens + reply.completion_tokens});
    if reply.cached_tokens > 0 {
        u["cacheReadInputTokens"] = json!(reply.cached_tokens);
        u["cacheWriteInputTokens"] = json!(0);
    }
    u
}

pub fn whole(reply: &Reply) -> Value {
    let content = match &reply.tool_call {
        Some(tc) => json!([{"toolUse": {"toolUseId": tc.id, "name": tc.name,
            "input": serde_json::from_str::<Value>(&tc.arguments).unwrap_or(json!({}))}}]),
        None => json!([{"text": reply.text()}]),
    };
    json!({"output": {"message": {"role": "assistant", "content": content}},
        "stopReason": stop_reason(reply), "usage": usage(reply), "metrics": {"latencyMs": 0}})
}

/// One event-stream frame.
fn frame(
    message_type: &'static str,
    type_header: &'static str,
    name: &str,
    payload: &Value,
) -> Vec<u8> {
    let message = Message::new(payload.to_string().into_bytes())
        .add_header(Header::new(
            type_header,
            HeaderValue::String(name.to_owned().into()),
        ))
        .add_header(Header::new(
            ":content-type",
            HeaderValue::String("application/json".into()),
        ))
        .add_header(Header::new(
            ":message-type",
            HeaderValue::String(message_type.into()),
        ));
    let mut out = Vec::new();
    // Writing a frame of this size into a Vec cannot fail.
    let _ = aws_smithy_eventstream::frame::write_message_to(&message, &mut out);
    out
}

fn event(name: &str, payload: Value) -> Vec<u8> {
    frame("event", ":event-type", name, &payload)
}

pub fn head(reply: &Reply) -> Vec<u8> {
    let mut out = event("messageStart", json!({"role": "assistant"}));
    if let Some(tc) = &reply.tool_call {
        out.extend(event(
            "contentBlockStart",
            json!({"contentBlockIndex": 0, "start": {"toolUse": {"toolUseId": tc.id, "name": tc.name}}}),
        ));
    }
    out
}

pub fn piece(piece: &Piece) -> Vec<u8> {
    let delta = match piece {
        Piece::Text(t) => json!({ "text": t }),
        Piece::ToolArgs(a) => json!({"toolUse": {"input": a}}),
    };
    event(
        "contentBlockDelta",
        json!({"contentBlockIndex": 0, "delta": delta}),
    )
}

pub fn tail(reply: &Reply) -> Vec<u8> {
    let mut out = event("contentBlockStop", json!({"contentBlockIndex": 0}));
    out.extend(event(
        "messageStop",
        json!({"stopReason": stop_reason(reply)}),
    ));
    out.extend(event(
        "metadata",
        json!({"usage": usage(reply), "metrics": {"latencyMs": 0}}),
    ));
    out
}

/// A frame whose message checksum does not match.
pub fn malformed() -> Vec<u8> {
    let mut f = event(
        "contentBlockDelta",
        json!({"contentBlockIndex": 0, "delta": {"text": "?"}}),
    );
    if let Some(last) = f.last_mut() {
        *last ^= 0xff;
    }
    f
}

/// The exception frame a stream ends with on an error.
pub fn exception(status: u16, message: &str) -> Vec<u8> {
    let name = match status {
        429 => "throttlingException",
        503 | 529 => "serviceUnavailableException",
        400 => "validationException",
        500 => "internalServerException",
        _ => "modelStreamErrorException",
    };
    frame(
        "exception",
        ":exception-type",
        name,
        &json!({ "message": message }),
    )
}
