//! Gemini's `generateContent` / `streamGenerateContent?alt=sse` (AI Studio and Vertex AI's
//! `publishers/google`), read as Anthropic Messages.
//!
//! Requests: `contents` (roles `user` and `model`, parts `text`, `inlineData`,
//! `functionCall`, `functionResponse`), `systemInstruction`, `tools[].functionDeclarations`,
//! `toolConfig.functionCallingConfig`, `generationConfig` (the REST API takes camelCase and
//! snake_case field names alike; both are read). A trailing `model` turn is continued as an
//! Anthropic prefill is. Answers: `candidates[0].content.parts`, `finishReason`,
//! `usageMetadata`; streamed as SSE events separated by CRLF, with no terminator: the last
//! chunk carries `finishReason` and `usageMetadata`.

use serde_json::{json, Map, Value};

use super::{HubRequest, Route};
use crate::text::Finish;
use crate::wire::{Piece, Reply};

/// A field under its camelCase or snake_case name.
fn field<'a>(obj: &'a Map<String, Value>, camel: &str, snake: &str) -> Option<&'a Value> {
    obj.get(camel).or_else(|| obj.get(snake))
}

pub fn to_hub(route: &Route, obj: &Map<String, Value>) -> Result<HubRequest, String> {
    let contents = obj
        .get("contents")
        .and_then(Value::as_array)
        .ok_or("contents: required")?;
    if contents.is_empty() {
        return Err("contents: must not be empty".into());
    }
    let messages = contents
        .iter()
        .enumerate()
        .map(|(i, c)| message(i, c))
        .collect::<Result<Vec<Value>, String>>()?;
    let mut hub = Map::new();
    hub.insert(
        "model".into(),
        json!(route.model.as_deref().unwrap_or_default()),
    );
    if let Some(system) = field(obj, "systemInstruction", "system_instruction") {
        let parts = system.get("parts").and_then(Value::as_array);
        let blocks: Vec<Value> = parts
            .into_iter()
            .flatten()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|t| json!({"type": "text", "text": t}))
            .collect();
        hub.insert("system".into(), Value::Array(blocks));
    }
    hub.insert("messages".into(), Value::Array(messages));
    let config = field(obj, "generationConfig", "generation_config")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let schema = generation(&config, &mut hub)?;
    let tools = tools(obj);
    if !tools.is_empty() {
        hub.insert("tools".into(), Value::Array(tools));
    }
    if let Some(choice) = tool_choice(obj) {
        hub.insert("tool_choice".into(), choice);
    }
    hub.insert("stream".into(), json!(route.stream));
    Ok(HubRequest {
        body: Value::Object(hub),
        schema,
    })
}

/// `contents[i]` as a Messages message: its role, its parts as content blocks (thoughts left
/// out, a part of an unknown kind kept as a block of that type for the hub to refuse).
fn message(i: usize, c: &Value) -> Result<Value, String> {
    let role = match c.get("role").and_then(Value::as_str).unwrap_or("user") {
        "user" => "user",
        "model" => "assistant",
        other => {
            return Err(format!(
                "contents[{i}].role: Please use a valid role: user, model (got `{other}`)"
            ))
        }
    };
    let parts = c
        .get("parts")
        .and_then(Value::as_array)
        .ok_or(format!("contents[{i}].parts: required"))?;
    let mut blocks = Vec::new();
    for (j, p) in parts.iter().enumerate() {
        let Some(p) = p.as_object() else {
            return Err(format!("contents[{i}].parts[{j}]: must be an object"));
        };
        if p.get("thought").and_then(Value::as_bool) == Some(true) {
            continue;
        }
        blocks.extend(block(p));
    }
    Ok(json!({"role": role, "content": blocks}))
}

/// One part as a Messages content block; `None` for an empty part.
fn block(p: &Map<String, Value>) -> Option<Value> {
    if let Some(t) = p.get("text").and_then(Value::as_str) {
        Some(json!({"type": "text", "text": t}))
    } else if let Some(d) = field(p, "inlineData", "inline_data") {
        Some(json!({"type": "image", "source": {"type": "base64",
            "media_type": field(d.as_object().unwrap_or(&Map::new()), "mimeType", "mime_type").cloned().unwrap_or(json!("application/octet-stream")),
            "data": d.get("data").cloned().unwrap_or(json!(""))}}))
    } else if let Some(f) = field(p, "functionCall", "function_call") {
        Some(
            json!({"type": "tool_use", "id": call_id(f), "name": call_name(f),
            "input": f.get("args").cloned().unwrap_or(json!({}))}),
        )
    } else if let Some(f) = field(p, "functionResponse", "function_response") {
        Some(json!({"type": "tool_result", "tool_use_id": call_id(f),
            "content": f.get("response").map(Value::to_string).unwrap_or_default()}))
    } else {
        p.keys().next().map(|kind| json!({ "type": kind }))
    }
}

fn call_name(f: &Value) -> &str {
    f.get("name").and_then(Value::as_str).unwrap_or_default()
}

/// A function call's or response's id; without one, an id made of the function's name, so
/// that a call and its response still pair up.
fn call_id(f: &Value) -> String {
    f.get("id")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| format!("toolu_{}", call_name(f)))
}

/// `generationConfig` into the hub request (`max_tokens`, `stop_sequences`, sampling); the
/// JSON schema the answer must follow, if it sets one (a JSON MIME type alone: any object).
fn generation(
    config: &Map<String, Value>,
    hub: &mut Map<String, Value>,
) -> Result<Option<Value>, String> {
    let max = field(config, "maxOutputTokens", "max_output_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(8192);
    hub.insert("max_tokens".into(), json!(max));
    if let Some(n) = field(config, "candidateCount", "candidate_count").and_then(Value::as_u64) {
        if n != 1 {
            return Err("generationConfig.candidateCount: only 1 is supported".into());
        }
    }
    if let Some(stop) = field(config, "stopSequences", "stop_sequences") {
        hub.insert("stop_sequences".into(), stop.clone());
    }
    for (camel, snake, hub_name) in [
        ("temperature", "temperature", "temperature"),
        ("topP", "top_p", "top_p"),
        ("topK", "top_k", "top_k"),
    ] {
        if let Some(v) = field(config, camel, snake) {
            hub.insert(hub_name.into(), v.clone());
        }
    }
    let schema = field(config, "responseJsonSchema", "response_json_schema")
        .or_else(|| field(config, "responseSchema", "response_schema"))
        .map(lowercase_types);
    let json_mime = field(config, "responseMimeType", "response_mime_type").and_then(Value::as_str)
        == Some("application/json");
    Ok(match (schema, json_mime) {
        (Some(s), _) => Some(s),
        (None, true) => Some(json!({"type": "object"})),
        (None, false) => None,
    })
}

/// Every `tools[].functionDeclarations` entry as a Messages tool.
fn tools(obj: &Map<String, Value>) -> Vec<Value> {
    let mut tools = Vec::new();
    for t in obj
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let decls = field(
            t.as_object().unwrap_or(&Map::new()),
            "functionDeclarations",
            "function_declarations",
        )
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
        for d in decls {
            let params = d
                .get("parametersJsonSchema")
                .or_else(|| d.get("parameters_json_schema"))
                .or_else(|| d.get("parameters"))
                .map(lowercase_types)
                .unwrap_or(json!({"type": "object", "properties": {}}));
            let mut tool = json!({"name": d.get("name").cloned().unwrap_or(json!("")), "input_schema": params});
            if let Some(desc) = d.get("description") {
                tool["description"] = desc.clone();
            }
            tools.push(tool);
        }
    }
    tools
}

/// `toolConfig.functionCallingConfig` as a Messages `tool_choice` (`ANY` with one allowed
/// function: that tool).
fn tool_choice(obj: &Map<String, Value>) -> Option<Value> {
    let calling = field(obj, "toolConfig", "tool_config").and_then(|c| {
        c.get("functionCallingConfig")
            .or_else(|| c.get("function_calling_config"))
    })?;
    let allowed = calling
        .get("allowedFunctionNames")
        .or_else(|| calling.get("allowed_function_names"))
        .and_then(Value::as_array);
    Some(
        match calling
            .get("mode")
            .and_then(Value::as_str)
            .unwrap_or("AUTO")
        {
            "ANY" | "VALIDATED" => match allowed {
                Some(a) if a.len() == 1 => json!({"type": "tool", "name": a[0]}),
                _ => json!({"type": "any"}),
            },
            "NONE" => json!({"type": "none"}),
            _ => json!({"type": "auto"}),
        },
    )
}

/// A Gemini schema (OpenAPI subset, `"type": "OBJECT"`) as JSON Schema (`"object"`).
fn lowercase_types(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| match (k.as_str(), v) {
                    ("type", Value::String(t)) => (k.clone(), json!(t.to_lowercase())),
                    _ => (k.clone(), lowercase_types(v)),
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(lowercase_types).collect()),
        other => other.clone(),
    }
}

fn finish_reason(reply: &Reply) -> &'static str {
    match (&reply.tool_call, &reply.finish) {
        (None, Finish::Length) => "MAX_TOKENS",
        (None, Finish::Refusal) => "SAFETY",
        _ => "STOP",
    }
}

fn usage(reply: &Reply) -> Value {
    let mut u = json!({
        "promptTokenCount": reply.prompt_tokens,
        "candidatesTokenCount": reply.completion_tokens,
        "totalTokenCount": reply.prompt_tokens + reply.completion_tokens,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": reply.prompt_tokens}],
    });
    if reply.cached_tokens > 0 {
        u["cachedContentTokenCount"] = json!(reply.cached_tokens);
    }
    u
}

fn function_call(reply: &Reply) -> Option<Value> {
    reply.tool_call.as_ref().map(|tc| {
        json!({"functionCall": {"name": tc.name,
            "args": serde_json::from_str::<Value>(&tc.arguments).unwrap_or(json!({}))}})
    })
}

fn response(
    reply: &Reply,
    parts: Vec<Value>,
    finish: Option<&str>,
    usage_metadata: Value,
) -> Value {
    let mut candidate = json!({"content": {"role": "model", "parts": parts}, "index": 0});
    if let Some(f) = finish {
        candidate["finishReason"] = json!(f);
    }
    json!({"candidates": [candidate], "usageMetadata": usage_metadata,
        "modelVersion": reply.model, "responseId": super::id_hex(reply)})
}

pub fn whole(reply: &Reply) -> Value {
    let parts = match function_call(reply) {
        Some(fc) => vec![fc],
        None => vec![json!({"text": reply.text()})],
    };
    response(reply, parts, Some(finish_reason(reply)), usage(reply))
}

fn event(v: &Value) -> Vec<u8> {
    format!("data: {v}\r\n\r\n").into_bytes()
}

/// Prompt counts only, as Gemini's chunks before the last carry them.
fn partial_usage(reply: &Reply) -> Value {
    json!({"promptTokenCount": reply.prompt_tokens, "totalTokenCount": reply.prompt_tokens})
}

pub fn piece(reply: &Reply, index: usize, piece: &Piece) -> Vec<u8> {
    match piece {
        Piece::Text(t) => event(&response(
            reply,
            vec![json!({ "text": t })],
            None,
            partial_usage(reply),
        )),
        // A function call arrives whole, in one chunk.
        Piece::ToolArgs(_) if index == 0 => event(&response(
            reply,
            function_call(reply).into_iter().collect(),
            None,
            partial_usage(reply),
        )),
        Piece::ToolArgs(_) => Vec::new(),
    }
}

pub fn tail(reply: &Reply) -> Vec<u8> {
    let mut out = Vec::new();
    if reply.tool_call.is_some() && reply.pieces.is_empty() {
        out = event(&response(
            reply,
            function_call(reply).into_iter().collect(),
            None,
            partial_usage(reply),
        ));
    }
    out.extend(event(&response(
        reply,
        vec![json!({"text": ""})],
        Some(finish_reason(reply)),
        usage(reply),
    )));
    out
}
