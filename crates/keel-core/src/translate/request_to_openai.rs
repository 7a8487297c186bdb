//! Messages request → Chat Completions request (see the table in the module above).

use serde_json::{json, Map, Value};

use super::tools::{tool_choice_to_openai, tools_to_openai};
use super::{unsupported, Fixes, RequestTranslation, ResponseContext};
use crate::members::Members;
use crate::protocol::Protocol;
use crate::request::RequestError;

const TARGET: Protocol = Protocol::OpenAi;

/// An OpenAI reasoning effort for an Anthropic thinking budget (the inverse of the budgets
/// [`super::chat_to_messages`] uses: each effort's budget maps back to it).
fn effort_for_budget(budget: u64) -> &'static str {
    match budget {
        0..2048 => "low",
        2048..8192 => "medium",
        _ => "high",
    }
}

/// Translates a Messages body into a Chat Completions body.
pub fn messages_to_chat(body: &Map<String, Value>) -> Result<RequestTranslation, RequestError> {
    let mut fixes = Fixes::default();
    let present = |k: &str| body.get(k).filter(|v| !v.is_null());
    for field in ["mcp_servers", "container"] {
        if present(field).is_some() {
            return Err(unsupported(field, &format!("`{field}`"), TARGET));
        }
    }

    let mut messages = Vec::new();
    match present("system") {
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            for (j, b) in blocks.iter().enumerate() {
                let text = text_of(b, &format!("system[{j}]"), "a system prompt")?;
                if b.member("cache_control").is_some() {
                    fixes.add("cache_control_dropped");
                }
                messages.push(json!({"role": "system", "content": text}));
            }
        }
        Some(_) => {
            return Err(RequestError::invalid(
                "`system` must be a string or an array of text blocks",
            ))
        }
        None => {}
    }
    let input = match body.member("messages") {
        Some(Value::Array(m)) => m,
        _ => return Err(RequestError::invalid("`messages` must be an array")),
    };
    for (i, m) in input.iter().enumerate() {
        convert_message(m, &format!("messages[{i}]"), &mut messages, &mut fixes)?;
    }

    let mut out = Map::new();
    if let Some(m) = body.member("model") {
        out.insert("model".into(), m.clone());
    }
    out.insert("messages".into(), Value::Array(messages));

    let mut reasoning_effort = None;
    if let Some(t) = present("thinking") {
        match t.member("type").and_then(Value::as_str) {
            Some("enabled") => {
                let budget = t
                    .member("budget_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                reasoning_effort = Some(effort_for_budget(budget).to_owned());
            }
            Some("adaptive") => {
                let effort = body
                    .member("output_config")
                    .and_then(|o| o.member("effort"))
                    .and_then(Value::as_str)
                    .map(|e| if e == "max" { "high" } else { e })
                    .unwrap_or("medium");
                reasoning_effort = Some(effort.to_owned());
            }
            _ => {}
        }
        if reasoning_effort.is_some() {
            fixes.add("thinking_to_reasoning_effort");
        }
    }
    if let Some(mt) = present("max_tokens") {
        // Reasoning models take only `max_completion_tokens`; other servers know `max_tokens`
        // best (every OpenAI-compatible server reads it).
        let key = if reasoning_effort.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        out.insert(key.into(), mt.clone());
    }
    if let Some(e) = reasoning_effort {
        out.insert("reasoning_effort".into(), e.into());
    }
    for k in ["temperature", "top_p"] {
        if let Some(v) = present(k) {
            out.insert(k.into(), v.clone());
        }
    }
    if let Some(s) = present("stop_sequences").and_then(Value::as_array) {
        if !s.is_empty() {
            out.insert("stop".into(), Value::Array(s.clone()));
        }
    }
    if let Some(s) = present("stream") {
        out.insert("stream".into(), s.clone());
        if s.as_bool() == Some(true) {
            // The Anthropic stream reports usage at its end; ask the upstream for it.
            out.insert("stream_options".into(), json!({"include_usage": true}));
        }
    }
    if let Some(u) = present("metadata")
        .and_then(|m| m.member("user_id"))
        .filter(|u| !u.is_null())
    {
        out.insert("user".into(), u.clone());
    }

    let has_tools = present("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    if has_tools {
        out.insert("tools".into(), tools_to_openai(&body["tools"], &mut fixes)?);
    }
    if let Some(tc) = present("tool_choice") {
        let (choice, parallel_off) = tool_choice_to_openai(tc)?;
        out.insert("tool_choice".into(), choice);
        if parallel_off {
            out.insert("parallel_tool_calls".into(), false.into());
        }
    }

    const HANDLED: &[&str] = &[
        "model",
        "system",
        "messages",
        "max_tokens",
        "thinking",
        "temperature",
        "top_p",
        "stop_sequences",
        "stream",
        "metadata",
        "tools",
        "tool_choice",
    ];
    for (k, v) in body {
        if v.is_null() || HANDLED.contains(&k.as_str()) {
            continue;
        }
        // `output_config` was read for an adaptive thinking effort.
        if k == "output_config" && out.contains_key("reasoning_effort") {
            continue;
        }
        fixes.dropped(k);
    }

    Ok(RequestTranslation {
        body: out,
        fixes: fixes.into_vec(),
        context: ResponseContext {
            json_tool: None,
            include_usage: true,
        },
    })
}

/// The text of a text block; any other block is refused (`what` names where it was).
fn text_of<'a>(b: &'a Value, path: &str, what: &str) -> Result<&'a str, RequestError> {
    let kind = b.member("type").and_then(Value::as_str).unwrap_or("");
    match (kind, b.member("text").and_then(Value::as_str)) {
        ("text", Some(t)) => Ok(t),
        _ => Err(unsupported(
            path,
            &format!("`{kind}` content in {what}"),
            TARGET,
        )),
    }
}

/// Appends the Chat messages for one Anthropic message.
fn convert_message(
    m: &Value,
    path: &str,
    out: &mut Vec<Value>,
    fixes: &mut Fixes,
) -> Result<(), RequestError> {
    let role = match m.member("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        Some(other) => {
            return Err(RequestError::invalid(format!(
                "`{path}.role`: unknown role `{other}`"
            )))
        }
        None => {
            return Err(RequestError::invalid(format!(
                "missing required field `{path}.role`"
            )))
        }
    };
    let content = m.member("content").unwrap_or(&Value::Null);
    let blocks = match content {
        Value::String(s) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Value::Array(b) => b,
        _ => {
            return Err(RequestError::invalid(format!(
                "`{path}.content` must be a string or an array of content blocks"
            )))
        }
    };
    for b in blocks {
        if b.member("cache_control").is_some() {
            fixes.add("cache_control_dropped");
        }
    }
    match role {
        "user" => {
            let mut parts = Vec::new();
            for (j, b) in blocks.iter().enumerate() {
                let bpath = format!("{path}.content[{j}]");
                match b.member("type").and_then(Value::as_str).unwrap_or("") {
                    "tool_result" => out.push(tool_message(b, &bpath, fixes)?),
                    "text" => parts
                        .push(json!({"type": "text", "text": text_of(b, &bpath, "a message")?})),
                    "image" => parts.push(image_part(b, &bpath)?),
                    "document" => parts.push(document_part(b, &bpath)?),
                    other => {
                        return Err(unsupported(&bpath, &format!("`{other}` content"), TARGET))
                    }
                }
            }
            if !parts.is_empty() {
                out.push(json!({"role": "user", "content": parts}));
            }
        }
        // "assistant", checked above.
        _ => {
            let mut texts = Vec::new();
            let mut calls = Vec::new();
            for (j, b) in blocks.iter().enumerate() {
                let bpath = format!("{path}.content[{j}]");
                match b.member("type").and_then(Value::as_str).unwrap_or("") {
                    "text" => texts.push(text_of(b, &bpath, "a message")?),
                    "tool_use" => {
                        let id = b.member("id").and_then(Value::as_str).ok_or_else(|| {
                            RequestError::invalid(format!("missing required field `{bpath}.id`"))
                        })?;
                        let name = b.member("name").and_then(Value::as_str).ok_or_else(|| {
                            RequestError::invalid(format!("missing required field `{bpath}.name`"))
                        })?;
                        let input = b.member("input").cloned().unwrap_or_else(|| json!({}));
                        calls.push(json!({"id": id, "type": "function",
                            "function": {"name": name, "arguments": input.to_string()}}));
                    }
                    "thinking" | "redacted_thinking" => fixes.add("thinking_dropped"),
                    other => {
                        return Err(unsupported(&bpath, &format!("`{other}` content"), TARGET))
                    }
                }
            }
            // One text block reads back as a string (the common form, and the form a Chat
            // client's string content took on the way in); several as text parts.
            let content = match texts.as_slice() {
                [] => Value::Null,
                [t] => Value::String((*t).to_owned()),
                many => Value::Array(
                    many.iter()
                        .map(|t| json!({"type": "text", "text": t}))
                        .collect(),
                ),
            };
            if content.is_null() && calls.is_empty() {
                fixes.add("empty_message_dropped");
                return Ok(());
            }
            let mut msg = Map::new();
            msg.insert("role".into(), "assistant".into());
            msg.insert("content".into(), content);
            if !calls.is_empty() {
                msg.insert("tool_calls".into(), Value::Array(calls));
            }
            out.push(Value::Object(msg));
        }
    }
    Ok(())
}

fn tool_message(b: &Value, path: &str, fixes: &mut Fixes) -> Result<Value, RequestError> {
    let id = b
        .member("tool_use_id")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            RequestError::invalid(format!("missing required field `{path}.tool_use_id`"))
        })?;
    if b.member("is_error").and_then(Value::as_bool) == Some(true) {
        fixes.add("tool_result_is_error_dropped");
    }
    let content = match b.member("content").unwrap_or(&Value::Null) {
        Value::String(s) => Value::String(s.clone()),
        Value::Null => Value::String(String::new()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (k, p) in parts.iter().enumerate() {
                let t = text_of(p, &format!("{path}.content[{k}]"), "a tool result")?;
                texts.push(json!({"type": "text", "text": t}));
            }
            Value::Array(texts)
        }
        _ => {
            return Err(RequestError::invalid(format!(
                "`{path}.content` must be a string or an array of blocks"
            )))
        }
    };
    Ok(json!({"role": "tool", "tool_call_id": id, "content": content}))
}

fn image_part(b: &Value, path: &str) -> Result<Value, RequestError> {
    let source = b.member("source").unwrap_or(&Value::Null);
    let url = match source.member("type").and_then(Value::as_str) {
        Some("base64") => {
            let media_type = source
                .member("media_type")
                .and_then(Value::as_str)
                .unwrap_or("");
            let data = source.member("data").and_then(Value::as_str).unwrap_or("");
            format!("data:{media_type};base64,{data}")
        }
        Some("url") => source
            .member("url")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                RequestError::invalid(format!("missing required field `{path}.source.url`"))
            })?
            .to_owned(),
        other => {
            return Err(unsupported(
                &format!("{path}.source"),
                &format!("an image `{}` source", other.unwrap_or("")),
                TARGET,
            ))
        }
    };
    Ok(json!({"type": "image_url", "image_url": {"url": url}}))
}

fn document_part(b: &Value, path: &str) -> Result<Value, RequestError> {
    let source = b.member("source").unwrap_or(&Value::Null);
    let media_type = source.member("media_type").and_then(Value::as_str);
    match (source.member("type").and_then(Value::as_str), media_type) {
        (Some("base64"), Some(mt @ "application/pdf")) => {
            let data = source.member("data").and_then(Value::as_str).unwrap_or("");
            let mut file = json!({"file_data": format!("data:{mt};base64,{data}")});
            if let Some(t) = b.member("title").filter(|t| t.is_string()) {
                file["filename"] = t.clone();
            }
            Ok(json!({"type": "file", "file": file}))
        }
        (kind, _) => Err(unsupported(
            &format!("{path}.source"),
            &format!(
                "a document `{}` source other than a base64 PDF",
                kind.unwrap_or("")
            ),
            TARGET,
        )),
    }
}
