//! Chat Completions request → Messages request (see the table in the module above).

use serde_json::{json, Map, Value};

use super::tools::{json_tool, tool_choice_to_anthropic, tools_to_anthropic};
use super::{parse_data_url, unsupported, Fixes, RequestTranslation, ResponseContext};
use crate::members::Members;
use crate::protocol::Protocol;
use crate::request::RequestError;

const TARGET: Protocol = Protocol::Anthropic;

/// Thinking budgets for OpenAI reasoning efforts: Anthropic's minimum (1024) for the lowest,
/// then ×4 per step, which keeps "high" well under common `max_tokens` settings (32k).
fn thinking_budget(effort: &str) -> Option<u64> {
    match effort {
        "minimal" | "low" => Some(1024),
        "medium" => Some(4096),
        "high" => Some(16_384),
        "xhigh" => Some(32_768),
        _ => None,
    }
}

/// Translates a Chat Completions body into a Messages body. `default_max_tokens` fills the
/// `max_tokens` Anthropic requires when the client gave none.
pub fn chat_to_messages(
    body: &Map<String, Value>,
    default_max_tokens: u32,
) -> Result<RequestTranslation, RequestError> {
    let mut fixes = Fixes::default();
    let mut ctx = ResponseContext::default();
    let present = |k: &str| body.get(k).filter(|v| !v.is_null());

    refuse_unsupported(&present)?;

    let messages = match body.member("messages") {
        Some(Value::Array(m)) => m,
        _ => return Err(RequestError::invalid("`messages` must be an array")),
    };
    let (system, mut out_messages) = convert_messages(messages, &mut fixes)?;
    let ends_in_tool_turn = messages
        .last()
        .and_then(|m| m.member("role"))
        .and_then(Value::as_str)
        == Some("tool");

    let mut out = Map::new();
    if let Some(m) = body.member("model") {
        out.insert("model".into(), m.clone());
    }
    match system.len() {
        0 => {}
        1 if system[0].member("cache_control").is_none() => {
            out.insert("system".into(), system[0]["text"].clone());
        }
        _ => {
            out.insert("system".into(), Value::Array(system));
        }
    }
    out.insert(
        "messages".into(),
        Value::Array(std::mem::take(&mut out_messages)),
    );

    let max_tokens = match present("max_completion_tokens").or_else(|| present("max_tokens")) {
        Some(v) => v
            .as_u64()
            .ok_or_else(|| RequestError::invalid("`max_tokens` must be a non-negative integer"))?,
        None => {
            fixes.add("max_tokens_defaulted");
            u64::from(default_max_tokens)
        }
    };
    out.insert("max_tokens".into(), max_tokens.into());

    let forced_tool = tools_to(body, &mut out, &mut fixes, &mut ctx)?;

    let thinking = thinking_to(
        &present,
        &mut out,
        &mut fixes,
        forced_tool,
        ends_in_tool_turn,
        max_tokens,
    );
    sampling_to(&present, &mut out, &mut fixes, thinking);
    if let Some(s) = present("stream") {
        out.insert("stream".into(), s.clone());
    }
    ctx.include_usage = body
        .member("stream_options")
        .and_then(|o| o.member("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if let Some(u) = present("user") {
        out.insert("metadata".into(), json!({"user_id": u}));
    }

    drop_unhandled(body, &mut fixes);

    Ok(RequestTranslation {
        body: out,
        fixes: fixes.into_vec(),
        context: ctx,
    })
}

/// Presence of a non-null field of the client's body.
type Present<'b> = dyn Fn(&str) -> Option<&'b Value> + 'b;

/// What Anthropic cannot do at all: refused before anything else is worth doing.
fn refuse_unsupported(present: &Present<'_>) -> Result<(), RequestError> {
    if present("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err(unsupported("n", "more than one choice (`n` > 1)", TARGET));
    }
    if present("logprobs").and_then(Value::as_bool) == Some(true) {
        return Err(unsupported("logprobs", "logprobs", TARGET));
    }
    if let Some(m) = present("modalities").and_then(Value::as_array) {
        if m.iter().any(|x| x.as_str() == Some("audio")) {
            return Err(unsupported("modalities", "audio output", TARGET));
        }
    }
    for (field, what) in [
        ("audio", "audio output"),
        ("functions", "legacy function calling (use `tools`)"),
        (
            "function_call",
            "legacy function calling (use `tool_choice`)",
        ),
    ] {
        if present(field).is_some() {
            return Err(unsupported(field, what, TARGET));
        }
    }
    Ok(())
}

/// Tools, tool choice and the response format (which becomes a tool); whether the choice
/// forces a tool.
fn tools_to(
    body: &Map<String, Value>,
    out: &mut Map<String, Value>,
    fixes: &mut Fixes,
    ctx: &mut ResponseContext,
) -> Result<bool, RequestError> {
    let present = |k: &str| body.get(k).filter(|v| !v.is_null());
    let has_tools = present("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    if has_tools {
        out.insert("tools".into(), tools_to_anthropic(&body["tools"], fixes)?);
    }
    let parallel_off = present("parallel_tool_calls").and_then(Value::as_bool) == Some(false);
    let mut tool_choice = match present("tool_choice") {
        Some(tc) => Some(tool_choice_to_anthropic(tc)?),
        None => None,
    };
    if let Some(rf) = present("response_format") {
        if let Some((tool, name)) = json_tool(rf)? {
            if has_tools || tool_choice.is_some() {
                return Err(unsupported(
                    "response_format",
                    "a JSON response format together with `tools` or `tool_choice`",
                    TARGET,
                ));
            }
            out.insert("tools".into(), json!([tool]));
            tool_choice = Some(json!({"type": "tool", "name": name}));
            fixes.add("response_format_as_tool");
            ctx.json_tool = Some(name);
        }
    }
    if parallel_off {
        match &mut tool_choice {
            Some(Value::Object(tc)) if tc.member("type") != Some(&json!("none")) => {
                tc.insert("disable_parallel_tool_use".into(), true.into());
            }
            Some(_) => {}
            None if has_tools => {
                tool_choice = Some(json!({"type": "auto", "disable_parallel_tool_use": true}));
            }
            None => fixes.dropped("parallel_tool_calls"),
        }
    }
    let forced_tool = tool_choice
        .as_ref()
        .and_then(|tc| tc.member("type"))
        .and_then(Value::as_str)
        .is_some_and(|t| t == "any" || t == "tool");
    if let Some(tc) = tool_choice {
        out.insert("tool_choice".into(), tc);
    }
    Ok(forced_tool)
}

/// Thinking: a budget when Anthropic allows one here (no forced tool, not answering a tool
/// turn, room under `max_tokens`); whether it is on.
fn thinking_to(
    present: &Present<'_>,
    out: &mut Map<String, Value>,
    fixes: &mut Fixes,
    forced_tool: bool,
    ends_in_tool_turn: bool,
    max_tokens: u64,
) -> bool {
    let mut thinking = false;
    if let Some(effort) = present("reasoning_effort") {
        match effort.as_str().map(|e| (e, thinking_budget(e))) {
            Some(("none", _)) => {}
            Some((_, Some(budget))) if !forced_tool && !ends_in_tool_turn && max_tokens > 1024 => {
                let budget = budget.min(max_tokens - 1);
                out.insert(
                    "thinking".into(),
                    json!({"type": "enabled", "budget_tokens": budget}),
                );
                thinking = true;
            }
            _ => fixes.dropped("reasoning_effort"),
        }
    }
    thinking
}

/// Temperature, top_p and top_k as Anthropic takes them (thinking fixes some), and the stop
/// sequences.
fn sampling_to(
    present: &Present<'_>,
    out: &mut Map<String, Value>,
    fixes: &mut Fixes,
    thinking: bool,
) {
    if let Some(t) = present("temperature") {
        if thinking && t.as_f64() != Some(1.0) {
            fixes.dropped("temperature");
        } else if t.as_f64().is_some_and(|t| t > 1.0) {
            fixes.add("temperature_clamped");
            out.insert("temperature".into(), json!(1.0));
        } else {
            out.insert("temperature".into(), t.clone());
        }
    }
    if let Some(p) = present("top_p") {
        if thinking && p.as_f64().is_some_and(|p| p < 0.95) {
            fixes.dropped("top_p");
        } else {
            out.insert("top_p".into(), p.clone());
        }
    }
    if let Some(k) = present("top_k") {
        if thinking {
            fixes.dropped("top_k");
        } else {
            out.insert("top_k".into(), k.clone());
        }
    }
    match present("stop") {
        Some(Value::String(s)) => {
            out.insert("stop_sequences".into(), json!([s]));
        }
        Some(Value::Array(a)) if !a.is_empty() => {
            out.insert("stop_sequences".into(), Value::Array(a.clone()));
        }
        _ => {}
    }
}

/// Everything else has no Anthropic counterpart: dropped, and said so.
fn drop_unhandled(body: &Map<String, Value>, fixes: &mut Fixes) {
    const HANDLED: &[&str] = &[
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "reasoning_effort",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stream",
        "stream_options",
        "user",
        "n",
        "logprobs",
        "modalities",
    ];
    for (k, v) in body {
        if !v.is_null() && !HANDLED.contains(&k.as_str()) {
            fixes.dropped(k);
        }
    }
}

/// The `system` blocks and the Anthropic messages.
fn convert_messages(
    messages: &[Value],
    fixes: &mut Fixes,
) -> Result<(Vec<Value>, Vec<Value>), RequestError> {
    let mut system = Vec::new();
    let mut out: Vec<Value> = Vec::new();
    // Whether the last output message is a user turn made of tool results (the next tool
    // message joins it).
    let mut open_tool_turn = false;
    for (i, m) in messages.iter().enumerate() {
        let path = format!("messages[{i}]");
        let Some(obj) = m.as_object() else {
            return Err(RequestError::invalid(format!("`{path}` must be an object")));
        };
        let role = obj.member("role").and_then(Value::as_str).unwrap_or("");
        if obj.member("name").is_some_and(|n| !n.is_null()) {
            fixes.dropped("name");
        }
        let content = obj.member("content").unwrap_or(&Value::Null);
        match role {
            "system" | "developer" => {
                if !out.is_empty() {
                    fixes.add("system_moved");
                }
                system.extend(text_blocks(content, &path, "a system message")?);
                continue;
            }
            "user" => {
                let content = match content {
                    Value::String(s) => Value::String(s.clone()),
                    Value::Array(parts) => {
                        let mut blocks = Vec::with_capacity(parts.len());
                        for (j, p) in parts.iter().enumerate() {
                            blocks.push(user_part(p, &format!("{path}.content[{j}]"), fixes)?);
                        }
                        Value::Array(blocks)
                    }
                    _ => {
                        return Err(RequestError::invalid(format!(
                            "`{path}.content` must be a string or an array of parts"
                        )))
                    }
                };
                out.push(json!({"role": "user", "content": content}));
                open_tool_turn = false;
            }
            "assistant" => {
                if let Some(msg) = assistant_message(obj, &path, fixes)? {
                    out.push(msg);
                }
                open_tool_turn = false;
            }
            "tool" => {
                let id = obj
                    .member("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        RequestError::invalid(format!(
                            "missing required field `{path}.tool_call_id`"
                        ))
                    })?;
                let result_content = match content {
                    Value::String(s) => Value::String(s.clone()),
                    _ => Value::Array(text_blocks(content, &path, "a tool message")?),
                };
                let block =
                    json!({"type": "tool_result", "tool_use_id": id, "content": result_content});
                match out.last_mut().and_then(|m| m.member_mut("content")) {
                    Some(Value::Array(blocks)) if open_tool_turn => blocks.push(block),
                    _ => out.push(json!({"role": "user", "content": [block]})),
                }
                open_tool_turn = true;
            }
            "function" => {
                return Err(unsupported(
                    &format!("{path}.role"),
                    "a `function` message (legacy function calling)",
                    TARGET,
                ))
            }
            other => {
                return Err(RequestError::invalid(format!(
                    "`{path}.role`: unknown role `{other}`"
                )))
            }
        }
    }
    Ok((system, out))
}

/// Text-only content (system and tool messages) as Anthropic text blocks.
fn text_blocks(content: &Value, path: &str, what: &str) -> Result<Vec<Value>, RequestError> {
    match content {
        Value::String(s) => Ok(vec![json!({"type": "text", "text": s})]),
        Value::Array(parts) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| {
                let kind = p.member("type").and_then(Value::as_str).unwrap_or("");
                let text = p.member("text").and_then(Value::as_str);
                match (kind, text) {
                    ("text", Some(t)) => {
                        let mut b = json!({"type": "text", "text": t});
                        if let Some(cc) = p.member("cache_control") {
                            b["cache_control"] = cc.clone();
                        }
                        Ok(b)
                    }
                    _ => Err(unsupported(
                        &format!("{path}.content[{j}]"),
                        &format!("`{kind}` content in {what}"),
                        TARGET,
                    )),
                }
            })
            .collect(),
        Value::Null => Ok(Vec::new()),
        _ => Err(RequestError::invalid(format!(
            "`{path}.content` must be a string or an array of parts"
        ))),
    }
}

/// One part of a user message as an Anthropic content block.
fn user_part(p: &Value, path: &str, fixes: &mut Fixes) -> Result<Value, RequestError> {
    let kind = p.member("type").and_then(Value::as_str).unwrap_or("");
    let mut block = match kind {
        "text" => {
            let t = p.member("text").and_then(Value::as_str).ok_or_else(|| {
                RequestError::invalid(format!("missing required field `{path}.text`"))
            })?;
            json!({"type": "text", "text": t})
        }
        "image_url" => {
            let image = p.member("image_url");
            let url = image
                .and_then(|i| i.member("url").or(Some(i)))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    RequestError::invalid(format!("missing required field `{path}.image_url.url`"))
                })?;
            if image
                .and_then(|i| i.member("detail"))
                .and_then(Value::as_str)
                .is_some_and(|d| d != "auto")
            {
                fixes.add("image_detail_dropped");
            }
            let source = match parse_data_url(url) {
                Some((media_type, data)) => {
                    json!({"type": "base64", "media_type": media_type, "data": data})
                }
                None if url.starts_with("data:") => {
                    return Err(unsupported(path, "a data URL that is not base64", TARGET))
                }
                None => json!({"type": "url", "url": url}),
            };
            json!({"type": "image", "source": source})
        }
        "file" => {
            let file = p.member("file");
            if file
                .and_then(|f| f.member("file_id"))
                .is_some_and(|v| !v.is_null())
            {
                return Err(unsupported(
                    &format!("{path}.file.file_id"),
                    "an uploaded file id",
                    TARGET,
                ));
            }
            let data_url = file
                .and_then(|f| f.member("file_data"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    RequestError::invalid(format!("missing required field `{path}.file.file_data`"))
                })?;
            let Some((media_type @ "application/pdf", data)) = parse_data_url(data_url) else {
                return Err(unsupported(
                    &format!("{path}.file.file_data"),
                    "a file that is not a base64 PDF",
                    TARGET,
                ));
            };
            let mut b = json!({"type": "document", "source": {"type": "base64", "media_type": media_type, "data": data}});
            if let Some(name) = file
                .and_then(|f| f.member("filename"))
                .filter(|n| n.is_string())
            {
                b["title"] = name.clone();
            }
            b
        }
        "" => {
            return Err(RequestError::invalid(format!(
                "missing required field `{path}.type`"
            )))
        }
        other => return Err(unsupported(path, other, TARGET)),
    };
    if let Some(cc) = p.member("cache_control") {
        block["cache_control"] = cc.clone();
    }
    Ok(block)
}

/// An assistant message; `None` when it carries nothing Anthropic would accept (no text, no
/// tool calls).
fn assistant_message(
    obj: &Map<String, Value>,
    path: &str,
    fixes: &mut Fixes,
) -> Result<Option<Value>, RequestError> {
    for field in ["function_call", "audio"] {
        if obj.get(field).is_some_and(|v| !v.is_null()) {
            return Err(unsupported(&format!("{path}.{field}"), field, TARGET));
        }
    }
    for field in ["reasoning_content", "reasoning"] {
        if obj.get(field).is_some_and(|v| !v.is_null()) {
            fixes.add("thinking_dropped");
        }
    }
    if obj.member("refusal").is_some_and(|v| !v.is_null()) {
        fixes.dropped("refusal");
    }
    let calls = obj.member("tool_calls").and_then(Value::as_array);
    let content = obj.member("content").unwrap_or(&Value::Null);
    let no_calls = calls.is_none_or(|c| c.is_empty());
    // A plain text turn keeps its string form.
    if let (Value::String(s), true) = (content, no_calls) {
        if s.is_empty() {
            fixes.add("empty_message_dropped");
            return Ok(None);
        }
        return Ok(Some(json!({"role": "assistant", "content": s})));
    }
    let mut blocks = Vec::new();
    match content {
        Value::String(s) if !s.is_empty() => blocks.push(json!({"type": "text", "text": s})),
        Value::Array(parts) => {
            for (j, p) in parts.iter().enumerate() {
                let kind = p.member("type").and_then(Value::as_str).unwrap_or("");
                let text = match kind {
                    "text" => p.member("text"),
                    "refusal" => p.member("refusal"),
                    _ => None,
                };
                match text.and_then(Value::as_str) {
                    Some(t) if !t.is_empty() => blocks.push(json!({"type": "text", "text": t})),
                    Some(_) => {}
                    None => {
                        return Err(unsupported(
                            &format!("{path}.content[{j}]"),
                            &format!("`{kind}` content in an assistant message"),
                            TARGET,
                        ))
                    }
                }
            }
        }
        _ => {}
    }
    for (j, call) in calls.into_iter().flatten().enumerate() {
        let cpath = format!("{path}.tool_calls[{j}]");
        let kind = call
            .member("type")
            .and_then(Value::as_str)
            .unwrap_or("function");
        if kind != "function" {
            return Err(unsupported(
                &cpath,
                &format!("a `{kind}` tool call"),
                TARGET,
            ));
        }
        let id = call
            .member("id")
            .and_then(Value::as_str)
            .ok_or_else(|| RequestError::invalid(format!("missing required field `{cpath}.id`")))?;
        let name = call
            .pointer("/function/name")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                RequestError::invalid(format!("missing required field `{cpath}.function.name`"))
            })?;
        let args = call
            .pointer("/function/arguments")
            .and_then(Value::as_str)
            .unwrap_or("");
        let input = if args.trim().is_empty() {
            json!({})
        } else {
            match serde_json::from_str::<Value>(args) {
                Ok(v @ Value::Object(_)) => v,
                _ => {
                    return Err(RequestError::invalid(format!(
                        "`{cpath}.function.arguments` must be a JSON object to be sent to Anthropic-protocol variants"
                    )))
                }
            }
        };
        blocks.push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
    }
    if blocks.is_empty() {
        fixes.add("empty_message_dropped");
        return Ok(None);
    }
    Ok(Some(json!({"role": "assistant", "content": blocks})))
}
