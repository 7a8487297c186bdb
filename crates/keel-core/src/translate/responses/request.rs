//! Responses request → Chat Completions request (see the table in the module above).

use serde_json::{json, Map, Value};

use super::ResponsesContext;
use crate::members::Members;
use crate::request::RequestError;
use crate::translate::Fixes;

/// A Responses request as a Chat Completions body, with its fix codes and what the answer needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesTranslation {
    pub body: Map<String, Value>,
    pub fixes: Vec<String>,
    pub context: ResponsesContext,
}

/// Fields that need state keel does not keep, or a service it does not run: refused.
const REFUSED: &[(&str, &str)] = &[
    (
        "previous_response_id",
        "keel does not store responses; send the whole conversation in `input`",
    ),
    (
        "conversation",
        "keel does not store conversations; send the whole conversation in `input`",
    ),
    (
        "background",
        "background responses are not supported; stream the response instead",
    ),
    ("prompt", "stored prompt templates are not supported"),
];

/// Fields with no Chat Completions equivalent that change nothing the client can rely on:
/// dropped, with a fix code when the client set them.
const DROPPED: &[&str] = &[
    "include",
    "truncation",
    "max_tool_calls",
    "top_logprobs",
    "stream_options",
];

/// Chat Completions fields with the same name and meaning in Responses: passed as they are.
const SAME: &[&str] = &[
    "model",
    "stream",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
];

fn invalid(msg: String) -> RequestError {
    RequestError::invalid(msg)
}

/// Translates a Responses body (`POST /v1/responses`) into a Chat Completions body.
pub fn responses_to_chat(body: &Map<String, Value>) -> Result<ResponsesTranslation, RequestError> {
    let present = |k: &str| body.get(k).filter(|v| !v.is_null());
    for (field, why) in REFUSED {
        if present(field).is_some_and(|v| v != &Value::Bool(false)) {
            return Err(invalid(format!("`{field}`: {why}")));
        }
    }
    let mut fixes = Fixes::default();
    let mut out = Map::new();
    for key in SAME {
        if let Some(v) = present(key) {
            out.insert((*key).into(), v.clone());
        }
    }

    let mut messages = Vec::new();
    match present("instructions") {
        None => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(invalid("`instructions` must be a string".into())),
    }
    match body.member("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                convert_item(item, &format!("input[{i}]"), &mut messages, &mut fixes)?;
            }
        }
        Some(Value::Array(_)) => return Err(invalid("`input` must not be empty".into())),
        Some(_) => {
            return Err(invalid(
                "`input` must be a string or an array of input items".into(),
            ))
        }
        None => return Err(invalid("missing required field `input`".into())),
    }
    if !messages.iter().any(|m| m["role"] != "system") {
        return Err(invalid(
            "`input` has no message to answer (only instructions)".into(),
        ));
    }
    out.insert("messages".into(), Value::Array(messages));

    if let Some(tools) = present("tools") {
        let tools = tools
            .as_array()
            .ok_or_else(|| invalid("`tools` must be an array".into()))?;
        let converted = tools
            .iter()
            .enumerate()
            .map(|(i, t)| tool_to_chat(t, &format!("tools[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        if !converted.is_empty() {
            out.insert("tools".into(), Value::Array(converted));
        }
    }
    if let Some(choice) = present("tool_choice") {
        out.insert("tool_choice".into(), tool_choice_to_chat(choice)?);
    }
    if let Some(format) = body.member("text").and_then(|t| t.member("format")) {
        if let Some(rf) = format_to_chat(format)? {
            out.insert("response_format".into(), rf);
        }
    }
    if let Some(v) = body.member("text").and_then(|t| t.member("verbosity")) {
        out.insert("verbosity".into(), v.clone());
    }
    let mut reasoning = false;
    if let Some(r) = present("reasoning") {
        if let Some(effort) = r.member("effort").filter(|e| !e.is_null()) {
            out.insert("reasoning_effort".into(), effort.clone());
            reasoning = true;
        }
        if r.member("summary").is_some_and(|s| !s.is_null()) {
            fixes.add("reasoning_summary_dropped");
        }
    }
    if let Some(m) = present("max_output_tokens") {
        if !m.is_u64() {
            return Err(invalid(
                "`max_output_tokens` must be a non-negative integer".into(),
            ));
        }
        // The field reasoning models require; plain `max_tokens` reaches every other server.
        let key = if reasoning {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        out.insert(key.into(), m.clone());
    }
    if out.member("stream") == Some(&Value::Bool(true)) {
        // Responses streams always end with usage.
        out.insert("stream_options".into(), json!({"include_usage": true}));
    }
    for field in DROPPED {
        if present(field).is_some() {
            fixes.dropped(field);
        }
    }
    if present("store") == Some(&Value::Bool(true)) {
        fixes.add("store_dropped");
    }
    let known = |k: &str| {
        SAME.contains(&k)
            || DROPPED.contains(&k)
            || [
                "instructions",
                "input",
                "tools",
                "tool_choice",
                "text",
                "reasoning",
                "max_output_tokens",
                "store",
                "metadata",
            ]
            .contains(&k)
            || REFUSED.iter().any(|(f, _)| *f == k)
    };
    for k in body.keys().filter(|k| !known(k)) {
        fixes.dropped(k);
    }
    Ok(ResponsesTranslation {
        body: out,
        fixes: fixes.into_vec(),
        context: ResponsesContext::of_request(body),
    })
}

/// One input item → Chat messages (appended; function calls join the assistant turn before).
fn convert_item(
    item: &Value,
    path: &str,
    messages: &mut Vec<Value>,
    fixes: &mut Fixes,
) -> Result<(), RequestError> {
    let obj = item
        .as_object()
        .ok_or_else(|| invalid(format!("`{path}` must be an object")))?;
    let kind = obj.member("type").and_then(Value::as_str);
    match kind {
        None | Some("message") => convert_message(obj, path, messages, fixes),
        Some("function_call") => {
            let field = |k: &str| {
                obj.get(k)
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("missing string field `{path}.{k}`")))
            };
            let call = json!({
                "id": field("call_id")?,
                "type": "function",
                "function": {"name": field("name")?, "arguments": field("arguments")?},
            });
            // Consecutive calls (and the text before them) are one assistant turn.
            match messages.last_mut() {
                Some(last) if last["role"] == "assistant" => {
                    let calls = last
                        .as_object_mut()
                        .and_then(|m| {
                            m.entry("tool_calls")
                                .or_insert_with(|| Value::Array(Vec::new()))
                                .as_array_mut()
                        })
                        .ok_or_else(|| invalid(format!("`{path}`: malformed history")))?;
                    calls.push(call);
                }
                _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
            Ok(())
        }
        Some("function_call_output") => {
            let call_id = obj
                .member("call_id")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(format!("missing string field `{path}.call_id`")))?;
            let content = match obj.member("output") {
                Some(Value::String(s)) => Value::String(s.clone()),
                Some(Value::Array(parts)) => {
                    let parts = parts
                        .iter()
                        .enumerate()
                        .map(|(j, p)| part_to_chat(p, &format!("{path}.output[{j}]"), true))
                        .collect::<Result<Vec<_>, _>>()?;
                    Value::Array(parts)
                }
                _ => {
                    return Err(invalid(format!(
                        "`{path}.output` must be a string or an array of content parts"
                    )))
                }
            };
            messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": content}));
            Ok(())
        }
        Some("reasoning") => {
            fixes.add("reasoning_item_dropped");
            Ok(())
        }
        Some("item_reference") => Err(invalid(format!(
            "`{path}`: item references need stored responses, which keel does not keep; send the item itself"
        ))),
        Some(other) => Err(invalid(format!(
            "`{path}`: input items of type `{other}` are not supported (only messages, function calls and their outputs)"
        ))),
    }
}

fn convert_message(
    obj: &Map<String, Value>,
    path: &str,
    messages: &mut Vec<Value>,
    fixes: &mut Fixes,
) -> Result<(), RequestError> {
    let role = obj
        .member("role")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("missing required field `{path}.role`")))?;
    let role = match role {
        "user" | "assistant" | "system" => role,
        "developer" => "developer",
        other => {
            return Err(invalid(format!(
                "`{path}.role` must be user, assistant, system or developer, got `{other}`"
            )))
        }
    };
    let content = match obj.member("content") {
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) => {
            let assistant = role == "assistant";
            let mut converted = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let p_path = format!("{path}.content[{j}]");
                if p.member("type").and_then(Value::as_str) == Some("refusal") {
                    fixes.add("refusal_as_text");
                }
                converted.push(part_to_chat(p, &p_path, !assistant)?);
            }
            // An assistant turn is text only in Chat Completions: join its parts.
            if assistant {
                let text: String = converted
                    .iter()
                    .filter_map(|p| p.member("text").and_then(Value::as_str))
                    .collect();
                Value::String(text)
            } else {
                Value::Array(converted)
            }
        }
        _ => {
            return Err(invalid(format!(
                "`{path}.content` must be a string or an array of content parts"
            )))
        }
    };
    messages.push(json!({"role": role, "content": content}));
    Ok(())
}

/// A Responses content part → a Chat content part. `inputs`: images and files are allowed.
fn part_to_chat(part: &Value, path: &str, inputs: bool) -> Result<Value, RequestError> {
    let kind = part
        .member("type")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("missing required field `{path}.type`")))?;
    let text = |k: &str| {
        part.get(k)
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(format!("missing string field `{path}.{k}`")))
    };
    match kind {
        "input_text" | "output_text" | "text" => Ok(json!({"type": "text", "text": text("text")?})),
        "refusal" => Ok(json!({"type": "text", "text": text("refusal")?})),
        "input_image" if inputs => {
            if part.member("file_id").is_some_and(|v| !v.is_null()) {
                return Err(invalid(format!(
                    "`{path}.file_id`: uploaded files are not supported; send the image as a URL or a data: URL"
                )));
            }
            let mut image = Map::new();
            image.insert("url".into(), text("image_url")?.into());
            if let Some(d) = part.member("detail").filter(|d| !d.is_null()) {
                image.insert("detail".into(), d.clone());
            }
            Ok(json!({"type": "image_url", "image_url": image}))
        }
        "input_file" if inputs => {
            if part.member("file_id").is_some_and(|v| !v.is_null())
                || part.member("file_url").is_some()
            {
                return Err(invalid(format!(
                    "`{path}`: files by id or URL are not supported; send `file_data`"
                )));
            }
            let mut file = Map::new();
            file.insert("file_data".into(), text("file_data")?.into());
            if let Some(name) = part.member("filename").filter(|n| !n.is_null()) {
                file.insert("filename".into(), name.clone());
            }
            Ok(json!({"type": "file", "file": file}))
        }
        other => Err(invalid(format!(
            "`{path}`: content parts of type `{other}` are not supported here"
        ))),
    }
}

/// A Responses tool (flat) → a Chat tool (nested under `function`).
fn tool_to_chat(tool: &Value, path: &str) -> Result<Value, RequestError> {
    match tool.member("type").and_then(Value::as_str) {
        Some("function") => {
            let name = tool
                .member("name")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(format!("missing string field `{path}.name`")))?;
            let mut function = Map::new();
            function.insert("name".into(), name.into());
            for k in ["description", "parameters", "strict"] {
                if let Some(v) = tool.get(k).filter(|v| !v.is_null()) {
                    function.insert(k.into(), v.clone());
                }
            }
            Ok(json!({"type": "function", "function": function}))
        }
        Some(other) => Err(invalid(format!(
            "`{path}.type`: hosted tools (`{other}`) are not supported; only `function` tools"
        ))),
        None => Err(invalid(format!("missing required field `{path}.type`"))),
    }
}

fn tool_choice_to_chat(choice: &Value) -> Result<Value, RequestError> {
    match choice {
        Value::String(s) if ["auto", "none", "required"].contains(&s.as_str()) => {
            Ok(choice.clone())
        }
        Value::Object(o) if o.member("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .member("name")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid("missing string field `tool_choice.name`".into()))?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(invalid(
            "`tool_choice` must be auto, none, required or {\"type\": \"function\", \"name\": …}"
                .into(),
        )),
    }
}

/// `text.format` → `response_format` (`None` for plain text).
fn format_to_chat(format: &Value) -> Result<Option<Value>, RequestError> {
    match format.member("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let name = format
                .member("name")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid("missing string field `text.format.name`".into()))?;
            let schema = format
                .member("schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| {
                    invalid("`text.format.schema` must be a JSON schema object".into())
                })?;
            let mut js = Map::new();
            js.insert("name".into(), name.into());
            js.insert("schema".into(), schema.clone());
            for k in ["strict", "description"] {
                if let Some(v) = format.get(k).filter(|v| !v.is_null()) {
                    js.insert(k.into(), v.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": js})))
        }
        _ => Err(invalid(
            "`text.format.type` must be text, json_object or json_schema".into(),
        )),
    }
}
