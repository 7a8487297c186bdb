//! OpenAI's Responses API (`POST /v1/responses`) as an *upstream*: a variant that speaks only
//! Responses, reached from the Chat Completions hub.
//!
//! This is the mirror image of `crate::translate::responses` (a Responses *client* in front
//! of Chat upstreams); the two keep the same tables, read in opposite directions, and share the
//! usage and finish-reason mappings. keel keeps no state, so every request is sent with
//! `store: false` and the whole conversation in `input`: nothing refers to a stored response.
//!
//! # Requests, Chat Completions → Responses ([`request`])
//!
//! | Chat Completions | Responses | notes |
//! |---|---|---|
//! | `system` / `developer` messages before the first other message | `instructions` (joined by a blank line) | later ones stay in place as `system` / `developer` message items |
//! | `user` text / `image_url` (URL or `data:` URL, `detail`) / `file` parts | a `message` item with `input_text` / `input_image` / `input_file` parts | `input_audio`: **refused** |
//! | `assistant` `content` (text, `refusal` parts) | a `message` item with `output_text` / `refusal` parts | `reasoning_content`: `reasoning_dropped` |
//! | `assistant` `tool_calls` | one `function_call` item each (`call_id` = the call's id) | |
//! | `tool` messages | `function_call_output` items (`output`: the text) | |
//! | a trailing `assistant` message (a continuation's prefill) | a trailing assistant `message` item | |
//! | `tools` (`function`, nested) | `tools` (flat `name`, `description`, `parameters`, `strict`) | `strict` absent: `false` (Responses defaults to strict schemas); other tools: **refused** |
//! | `tool_choice` auto/none/required/named/`allowed_tools` | the same in Responses form | |
//! | `response_format` json_schema / json_object, `verbosity` | `text.format` (flat `name`, `schema`, `strict`, `description`), `text.verbosity` | |
//! | `reasoning_effort` | `reasoning.effort` | |
//! | `max_completion_tokens` / `max_tokens` | `max_output_tokens` | below the API's minimum of 16: raised, `max_output_tokens_raised` |
//! | `temperature`, `top_p`, `parallel_tool_calls`, `user`, `safety_identifier`, `prompt_cache_key`, `prompt_cache_retention`, `service_tier`, `metadata`, `stream` | the same | |
//! | — | `store: false` | `store: true`: `store_dropped` |
//! | `stop` | — (Responses has no stop sequences) | `stop_dropped` |
//! | `frequency_penalty`, `presence_penalty`, `seed`, `logit_bias`, `top_logprobs`, `prediction`, `web_search_options`, message `name`, unknown fields | — | dropped: `<field>_dropped` |
//! | `n` > 1, `logprobs: true`, audio (`modalities`, `audio`, `input_audio`), `functions` / `function_call` / `function` messages | — | **refused**, naming the field |
//!
//! # Answers, Responses → Chat Completions ([`whole`], [`Stream`])
//!
//! | Responses | Chat Completions |
//! |---|---|
//! | `message` items' `output_text` / `refusal` parts | `content` / `refusal` |
//! | `function_call` items | `tool_calls` (`id` = `call_id`) |
//! | `reasoning` items' `summary` (and `reasoning_text` content, from open-weight servers) | `reasoning_content` (parts joined by a blank line) |
//! | `status` completed (with / without function calls), incomplete `max_output_tokens` / `content_filter` | `finish_reason` tool_calls / stop, length / content_filter |
//! | `usage` `input_tokens`, `input_tokens_details.cached_tokens`, `output_tokens`, `output_tokens_details.reasoning_tokens` | `prompt_tokens`, `prompt_tokens_details.cached_tokens`, `completion_tokens`, `completion_tokens_details.reasoning_tokens`, `total_tokens` |
//! | `id`, `created_at` | `id`, `created` (the chunks' too) |
//! | `response.failed`, `error` events | a final `data:` error object, no `[DONE]` |
//!
//! A stream is finished by `response.completed` or `response.incomplete`; one that ends
//! without either gets no finish chunk and no `[DONE]`, so the gateway sees it cut and
//! migrates. Responses has no keep-alive event of its own; SSE comments pass as comments.

use serde_json::{json, Map, Value};

use super::{error_kind_of_status, push_event, DialectRequest, StreamToHub};
use crate::protocol::{error_body, ErrorKind, Protocol};
use crate::request::RequestError;
use crate::sse::{SseDecoder, SseEvent};
use crate::translate::responses::{finish_of_incomplete, usage_to_chat};
use crate::translate::Fixes;

/// The smallest `max_output_tokens` the Responses API accepts.
pub const MIN_MAX_OUTPUT_TOKENS: u64 = 16;

fn unsupported(path: &str, what: &str) -> RequestError {
    RequestError::invalid(format!(
        "{path}: {what} is not supported by Responses variants"
    ))
}

fn invalid(msg: String) -> RequestError {
    RequestError::invalid(msg)
}

/// Chat fields with the same name and meaning in Responses: passed as they are.
const SAME: &[&str] = &[
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "metadata",
    "stream",
];

/// Chat fields Responses has no equivalent for: dropped, with a fix code.
const DROPPED: &[&str] = &[
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "logit_bias",
    "top_logprobs",
    "prediction",
    "web_search_options",
];

/// Chat fields read below (or checked and then needing nothing in Responses).
const READ: &[&str] = &[
    "model",
    "messages",
    "tools",
    "tool_choice",
    "response_format",
    "verbosity",
    "reasoning_effort",
    "max_completion_tokens",
    "max_tokens",
    "store",
    "stream_options",
    "n",
    "logprobs",
    "modalities",
];

/// A Chat Completions body (the hub's) → a Responses body.
pub fn request(hub: &Map<String, Value>) -> Result<DialectRequest, RequestError> {
    let present = |k: &str| hub.get(k).filter(|v| !v.is_null());
    if present("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err(unsupported("n", "more than one choice (`n` > 1)"));
    }
    if present("logprobs").and_then(Value::as_bool) == Some(true) {
        return Err(unsupported("logprobs", "logprobs"));
    }
    if let Some(m) = present("modalities").and_then(Value::as_array) {
        if m.iter().any(|x| x.as_str() == Some("audio")) {
            return Err(unsupported("modalities", "audio output"));
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
            return Err(unsupported(field, what));
        }
    }

    let mut fixes = Fixes::default();
    let mut out = Map::new();
    if let Some(m) = present("model") {
        out.insert("model".into(), m.clone());
    }
    let messages = match hub.get("messages") {
        Some(Value::Array(m)) => m,
        _ => return Err(invalid("`messages` must be an array".into())),
    };
    let (instructions, input) = convert_messages(messages, &mut fixes)?;
    if !instructions.is_empty() {
        out.insert("instructions".into(), instructions.join("\n\n").into());
    }
    out.insert("input".into(), Value::Array(input));

    if let Some(tools) = present("tools") {
        let tools = tools
            .as_array()
            .ok_or_else(|| invalid("`tools` must be an array".into()))?;
        let flat = tools
            .iter()
            .enumerate()
            .map(|(i, t)| tool_to_responses(t, &format!("tools[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        if !flat.is_empty() {
            out.insert("tools".into(), Value::Array(flat));
        }
    }
    if let Some(tc) = present("tool_choice") {
        out.insert("tool_choice".into(), tool_choice_to_responses(tc)?);
    }
    let mut text = Map::new();
    if let Some(rf) = present("response_format") {
        if let Some(format) = format_to_responses(rf)? {
            text.insert("format".into(), format);
        }
    }
    if let Some(v) = present("verbosity") {
        text.insert("verbosity".into(), v.clone());
    }
    if !text.is_empty() {
        out.insert("text".into(), Value::Object(text));
    }
    if let Some(effort) = present("reasoning_effort") {
        out.insert("reasoning".into(), json!({ "effort": effort }));
    }
    if let Some(m) = present("max_completion_tokens").or_else(|| present("max_tokens")) {
        let m = m
            .as_u64()
            .ok_or_else(|| invalid("`max_tokens` must be a non-negative integer".into()))?;
        if m < MIN_MAX_OUTPUT_TOKENS {
            fixes.add("max_output_tokens_raised");
        }
        out.insert(
            "max_output_tokens".into(),
            m.max(MIN_MAX_OUTPUT_TOKENS).into(),
        );
    }
    for key in SAME {
        if let Some(v) = present(key) {
            out.insert((*key).into(), v.clone());
        }
    }
    if present("store") == Some(&Value::Bool(true)) {
        fixes.add("store_dropped");
    }
    out.insert("store".into(), false.into());
    for field in DROPPED {
        if present(field).is_some() {
            fixes.dropped(field);
        }
    }
    let known = |k: &str| {
        SAME.contains(&k)
            || DROPPED.contains(&k)
            || READ.contains(&k)
            || ["audio", "functions", "function_call"].contains(&k)
    };
    for k in hub.keys().filter(|k| !known(k)) {
        if hub[k.as_str()] != Value::Null {
            fixes.dropped(k);
        }
    }
    Ok(DialectRequest {
        body: serde_json::to_vec(&Value::Object(out)).unwrap_or_default(),
        fixes: fixes.into_vec(),
    })
}

/// Chat messages → the leading system text (`instructions`) and the `input` items.
fn convert_messages(
    messages: &[Value],
    fixes: &mut Fixes,
) -> Result<(Vec<String>, Vec<Value>), RequestError> {
    let mut instructions = Vec::new();
    let mut input = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let path = format!("messages[{i}]");
        let obj = m
            .as_object()
            .ok_or_else(|| invalid(format!("`{path}` must be an object")))?;
        let role = obj
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(format!("missing required field `{path}.role`")))?;
        if obj.get("name").is_some_and(|n| !n.is_null()) {
            fixes.dropped("name");
        }
        match role {
            "system" | "developer" => {
                let text = text_of(obj.get("content"), &format!("{path}.content"))?;
                if input.is_empty() {
                    instructions.push(text);
                } else {
                    input.push(message_item(role, vec![input_text(&text)]));
                }
            }
            "user" => {
                let parts = user_parts(obj.get("content"), &format!("{path}.content"))?;
                input.push(message_item("user", parts));
            }
            "assistant" => assistant_items(obj, &path, &mut input, fixes)?,
            "tool" => {
                let call_id = obj
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        invalid(format!("missing string field `{path}.tool_call_id`"))
                    })?;
                let output = text_of(obj.get("content"), &format!("{path}.content"))?;
                input.push(
                    json!({"type": "function_call_output", "call_id": call_id, "output": output}),
                );
            }
            "function" => {
                return Err(unsupported(
                    &format!("{path}.role"),
                    "legacy `function` messages (use `tool`)",
                ))
            }
            other => {
                return Err(invalid(format!(
                "`{path}.role` must be system, developer, user, assistant or tool, got `{other}`"
            )))
            }
        }
    }
    Ok((instructions, input))
}

fn message_item(role: &str, content: Vec<Value>) -> Value {
    json!({"type": "message", "role": role, "content": content})
}

fn input_text(text: &str) -> Value {
    json!({"type": "input_text", "text": text})
}

/// The text of a content that may only be text: a string, or `text` parts (joined).
fn text_of(content: Option<&Value>, path: &str) -> Result<String, RequestError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        text.push_str(p.get("text").and_then(Value::as_str).ok_or_else(|| {
                            invalid(format!("missing string field `{path}[{j}].text`"))
                        })?)
                    }
                    Some(other) => {
                        return Err(unsupported(
                            &format!("{path}[{j}]"),
                            &format!("a `{other}` part in a message that takes only text"),
                        ))
                    }
                    None => {
                        return Err(invalid(format!(
                            "missing required field `{path}[{j}].type`"
                        )))
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(invalid(format!(
            "`{path}` must be a string or an array of content parts"
        ))),
    }
}

/// A user message's content → `input_text` / `input_image` / `input_file` parts.
fn user_parts(content: Option<&Value>, path: &str) -> Result<Vec<Value>, RequestError> {
    let parts = match content {
        Some(Value::String(s)) => return Ok(vec![input_text(s)]),
        Some(Value::Array(parts)) => parts,
        _ => {
            return Err(invalid(format!(
                "`{path}` must be a string or an array of content parts"
            )))
        }
    };
    parts
        .iter()
        .enumerate()
        .map(|(j, p)| {
            let p_path = format!("{path}[{j}]");
            let s = |v: Option<&Value>, what: &str| {
                v.and_then(Value::as_str)
                    .map(str::to_owned)
                    .ok_or_else(|| invalid(format!("missing string field `{p_path}.{what}`")))
            };
            match p.get("type").and_then(Value::as_str) {
                Some("text") => Ok(input_text(&s(p.get("text"), "text")?)),
                Some("image_url") => {
                    // `image_url` is an object in Chat Completions; some clients send the URL.
                    let image = p.get("image_url");
                    let url = match image {
                        Some(Value::String(u)) => u.clone(),
                        _ => s(image.and_then(|i| i.get("url")), "image_url.url")?,
                    };
                    let detail = image
                        .and_then(|i| i.get("detail"))
                        .and_then(Value::as_str)
                        .unwrap_or("auto");
                    Ok(json!({"type": "input_image", "image_url": url, "detail": detail}))
                }
                Some("file") => {
                    let file = p
                        .get("file")
                        .and_then(Value::as_object)
                        .ok_or_else(|| invalid(format!("`{p_path}.file` must be an object")))?;
                    let mut part = Map::new();
                    part.insert("type".into(), "input_file".into());
                    for k in ["file_data", "file_id", "filename"] {
                        if let Some(v) = file.get(k).filter(|v| !v.is_null()) {
                            part.insert(k.into(), v.clone());
                        }
                    }
                    if !part.contains_key("file_data") && !part.contains_key("file_id") {
                        return Err(invalid(format!(
                            "`{p_path}.file` needs `file_data` or `file_id`"
                        )));
                    }
                    Ok(Value::Object(part))
                }
                Some("input_audio") => Err(unsupported(&p_path, "audio input")),
                Some(other) => Err(unsupported(&p_path, &format!("a `{other}` content part"))),
                None => Err(invalid(format!("missing required field `{p_path}.type`"))),
            }
        })
        .collect()
}

/// An assistant message → a `message` item (its text and refusal) and a `function_call` item
/// per tool call, in that order.
fn assistant_items(
    obj: &Map<String, Value>,
    path: &str,
    input: &mut Vec<Value>,
    fixes: &mut Fixes,
) -> Result<(), RequestError> {
    if obj
        .get("reasoning_content")
        .and_then(Value::as_str)
        .is_some_and(|r| !r.is_empty())
    {
        fixes.dropped("reasoning");
    }
    let mut parts = Vec::new();
    match obj.get("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => parts.push(output_text(s)),
        Some(Value::Array(items)) => {
            for (j, p) in items.iter().enumerate() {
                let p_path = format!("{path}.content[{j}]");
                let s = |k: &str| {
                    p.get(k)
                        .and_then(Value::as_str)
                        .ok_or_else(|| invalid(format!("missing string field `{p_path}.{k}`")))
                };
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(output_text(s("text")?)),
                    Some("refusal") => {
                        parts.push(json!({"type": "refusal", "refusal": s("refusal")?}))
                    }
                    Some(other) => {
                        return Err(unsupported(
                            &p_path,
                            &format!("a `{other}` part in an assistant message"),
                        ))
                    }
                    None => return Err(invalid(format!("missing required field `{p_path}.type`"))),
                }
            }
        }
        Some(_) => {
            return Err(invalid(format!(
                "`{path}.content` must be a string or an array of content parts"
            )))
        }
    }
    if let Some(r) = obj
        .get("refusal")
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty())
    {
        parts.push(json!({"type": "refusal", "refusal": r}));
    }
    if !parts.is_empty() {
        input.push(message_item("assistant", parts));
    }
    let calls = match obj.get("tool_calls") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(calls)) => calls,
        Some(_) => return Err(invalid(format!("`{path}.tool_calls` must be an array"))),
    };
    for (k, call) in calls.iter().enumerate() {
        let c_path = format!("{path}.tool_calls[{k}]");
        let s = |p: &str| {
            call.pointer(p).and_then(Value::as_str).ok_or_else(|| {
                invalid(format!(
                    "missing string field `{c_path}{}`",
                    p.replace('/', ".")
                ))
            })
        };
        if call
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("function")
            != "function"
        {
            return Err(unsupported(
                &format!("{c_path}.type"),
                "a tool call that is not a function call",
            ));
        }
        input.push(json!({
            "type": "function_call",
            "call_id": s("/id")?,
            "name": s("/function/name")?,
            "arguments": s("/function/arguments")?,
        }));
    }
    Ok(())
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text})
}

/// A Chat tool (nested under `function`) → a Responses tool (flat).
fn tool_to_responses(tool: &Value, path: &str) -> Result<Value, RequestError> {
    match tool.get("type").and_then(Value::as_str) {
        Some("function") => {
            let f = tool
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| invalid(format!("`{path}.function` must be an object")))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(format!("missing string field `{path}.function.name`")))?;
            let mut out = Map::new();
            out.insert("type".into(), "function".into());
            out.insert("name".into(), name.into());
            if let Some(d) = f.get("description").filter(|d| !d.is_null()) {
                out.insert("description".into(), d.clone());
            }
            // Chat's "no parameters" is a function without arguments; Responses requires them.
            out.insert(
                "parameters".into(),
                f.get("parameters")
                    .filter(|p| !p.is_null())
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            );
            // Responses makes schemas strict unless told otherwise; Chat does not.
            out.insert(
                "strict".into(),
                f.get("strict")
                    .filter(|s| s.is_boolean())
                    .cloned()
                    .unwrap_or(Value::Bool(false)),
            );
            Ok(Value::Object(out))
        }
        Some(other) => Err(unsupported(
            &format!("{path}.type"),
            &format!("`{other}` tools"),
        )),
        None => Err(invalid(format!("missing required field `{path}.type`"))),
    }
}

fn tool_choice_to_responses(choice: &Value) -> Result<Value, RequestError> {
    let name_at = |v: &Value, path: &str| {
        v.pointer("/function/name")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| invalid(format!("missing string field `{path}.function.name`")))
    };
    match choice {
        Value::String(s) if ["auto", "none", "required"].contains(&s.as_str()) => {
            Ok(choice.clone())
        }
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("function") => {
                Ok(json!({"type": "function", "name": name_at(choice, "tool_choice")?}))
            }
            Some("allowed_tools") => {
                let allowed = o.get("allowed_tools").unwrap_or(&Value::Null);
                let mode = allowed
                    .get("mode")
                    .cloned()
                    .unwrap_or_else(|| json!("auto"));
                let tools = allowed
                    .get("tools")
                    .and_then(Value::as_array)
                    .ok_or_else(|| {
                        invalid("`tool_choice.allowed_tools.tools` must be an array".into())
                    })?
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        name_at(t, &format!("tool_choice.allowed_tools.tools[{i}]"))
                            .map(|name| json!({"type": "function", "name": name}))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(json!({"type": "allowed_tools", "mode": mode, "tools": tools}))
            }
            _ => Err(unsupported("tool_choice", "this tool choice")),
        },
        _ => Err(invalid(
            "`tool_choice` must be auto, none, required or a function".into(),
        )),
    }
}

/// `response_format` → `text.format` (`None` for plain text).
fn format_to_responses(rf: &Value) -> Result<Option<Value>, RequestError> {
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let js = rf
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| invalid("`response_format.json_schema` must be an object".into()))?;
            let mut format = Map::new();
            format.insert("type".into(), "json_schema".into());
            let name = js.get("name").and_then(Value::as_str).ok_or_else(|| {
                invalid("missing string field `response_format.json_schema.name`".into())
            })?;
            format.insert("name".into(), name.into());
            format.insert(
                "schema".into(),
                js.get("schema")
                    .filter(|s| s.is_object())
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object"})),
            );
            for k in ["strict", "description"] {
                if let Some(v) = js.get(k).filter(|v| !v.is_null()) {
                    format.insert(k.into(), v.clone());
                }
            }
            Ok(Some(Value::Object(format)))
        }
        _ => Err(invalid(
            "`response_format.type` must be text, json_object or json_schema".into(),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Answers.

/// What a Response's output items say, gathered for a Chat message.
#[derive(Debug, Default)]
struct Output {
    text: String,
    refusal: String,
    reasoning: Vec<String>,
    calls: Vec<Value>,
}

impl Output {
    fn of_items(items: &[Value]) -> Output {
        let mut o = Output::default();
        let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        for item in items {
            match item.get("type").and_then(Value::as_str) {
                Some("message") => {
                    for part in item
                        .get("content")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                    {
                        match part.get("type").and_then(Value::as_str) {
                            Some("output_text") => o.text.push_str(&s(part, "text")),
                            Some("refusal") => o.refusal.push_str(&s(part, "refusal")),
                            _ => {}
                        }
                    }
                }
                Some("function_call") => o.calls.push(json!({
                    "id": s(item, "call_id"),
                    "type": "function",
                    "function": {"name": s(item, "name"), "arguments": s(item, "arguments")},
                })),
                Some("reasoning") => {
                    for key in ["summary", "content"] {
                        for part in item
                            .get(key)
                            .and_then(Value::as_array)
                            .into_iter()
                            .flatten()
                        {
                            let t = s(part, "text");
                            if !t.is_empty() {
                                o.reasoning.push(t);
                            }
                        }
                    }
                }
                // Hosted tools' items are not requested; anything newer carries no Chat output.
                _ => {}
            }
        }
        o
    }
}

/// The Chat `finish_reason` of a finished Response.
fn finish_of(response: &Value, has_calls: bool) -> &'static str {
    match response.get("status").and_then(Value::as_str) {
        Some("incomplete") => finish_of_incomplete(
            response
                .pointer("/incomplete_details/reason")
                .and_then(Value::as_str),
        ),
        _ if has_calls => "tool_calls",
        _ => "stop",
    }
}

/// A Response object → a `chat.completion` body. `model`: the name the answer gives (empty: the
/// Response's own). A failed Response is an `Err` (its error code), as a broken answer is.
pub fn whole(body: &[u8], model: &str) -> Result<Vec<u8>, String> {
    let r: Value =
        serde_json::from_slice(body).map_err(|e| format!("a Response is not JSON: {e}"))?;
    if r.get("status").and_then(Value::as_str) == Some("failed") {
        return Err(format!(
            "the Response failed: {}",
            crate::protocol::error_summary(&json!({"error": r.get("error")}))
        ));
    }
    let items = r
        .get("output")
        .and_then(Value::as_array)
        .ok_or("a Response without an `output` array")?;
    let o = Output::of_items(items);
    let finish = finish_of(&r, !o.calls.is_empty());
    let mut message = Map::new();
    message.insert("role".into(), "assistant".into());
    let content = if o.text.is_empty() && (!o.calls.is_empty() || !o.refusal.is_empty()) {
        Value::Null
    } else {
        Value::String(o.text)
    };
    message.insert("content".into(), content);
    message.insert(
        "refusal".into(),
        if o.refusal.is_empty() {
            Value::Null
        } else {
            o.refusal.into()
        },
    );
    if !o.reasoning.is_empty() {
        message.insert("reasoning_content".into(), o.reasoning.join("\n\n").into());
    }
    if !o.calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(o.calls));
    }
    let model = if model.is_empty() {
        r.get("model").cloned().unwrap_or(Value::Null)
    } else {
        model.into()
    };
    let mut out = Map::new();
    out.insert("id".into(), r.get("id").cloned().unwrap_or(Value::Null));
    out.insert("object".into(), "chat.completion".into());
    out.insert(
        "created".into(),
        r.get("created_at").cloned().unwrap_or_else(|| 0.into()),
    );
    out.insert("model".into(), model);
    out.insert(
        "choices".into(),
        json!([{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}]),
    );
    if let Some(u) = r.get("usage").filter(|u| u.is_object()) {
        out.insert("usage".into(), usage_to_chat(u));
    }
    if let Some(t) = r.get("service_tier").filter(|t| !t.is_null()) {
        out.insert("service_tier".into(), t.clone());
    }
    Ok(serde_json::to_vec(&Value::Object(out)).unwrap_or_default())
}

/// The error kind a Responses error `code` stands for, where it says more than the status.
fn kind_of_code(code: &str) -> Option<ErrorKind> {
    Some(match code {
        "rate_limit_exceeded" | "rate_limit_error" | "insufficient_quota" => ErrorKind::RateLimited,
        "server_is_overloaded" | "slow_down" | "overloaded_error" => ErrorKind::Overloaded,
        "server_error" | "api_error" | "internal_error" => ErrorKind::Internal,
        "timeout" | "timeout_error" => ErrorKind::Timeout,
        "context_length_exceeded" | "invalid_prompt" | "invalid_request_error" => {
            ErrorKind::InvalidRequest
        }
        c if c.starts_with("invalid_") || c.starts_with("image_") || c.starts_with("empty_") => {
            ErrorKind::InvalidRequest
        }
        _ => return None,
    })
}

/// An OpenAI error object whose `type` is the kind's, keeping the upstream's words: its
/// message, `param` and `code`.
fn openai_error(kind: ErrorKind, message: &str, param: Value, code: Value) -> Value {
    let mut body = error_body(Protocol::OpenAi, kind, message);
    if let Some(e) = body.get_mut("error").and_then(Value::as_object_mut) {
        e.insert("param".into(), param);
        e.insert("code".into(), code);
    }
    body
}

/// A Responses error body → the hub's: already OpenAI-shaped, normalised to
/// `{"error": {message, type, param, code}}`; a body of another shape (a proxy's page, a
/// framework's `detail`) becomes one of the status's kind.
pub fn error(status: u16, body: &[u8]) -> Vec<u8> {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let by_status = error_kind_of_status(status);
    let out = match v.get("error").filter(|e| e.is_object()) {
        Some(e) => {
            let message = e
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("the upstream reported an error");
            let field = |k: &str| {
                e.get(k)
                    .filter(|x| !x.is_null())
                    .cloned()
                    .unwrap_or(Value::Null)
            };
            let mut out = openai_error(by_status, message, field("param"), field("code"));
            if let Some(t) = e.get("type").and_then(Value::as_str) {
                out["error"]["type"] = t.into();
            }
            out
        }
        None => {
            let message = match v.get("detail").or_else(|| v.get("message")) {
                Some(Value::String(s)) => s.clone(),
                _ => format!("HTTP {status} from the Responses upstream"),
            };
            openai_error(by_status, &message, Value::Null, Value::Null)
        }
    };
    serde_json::to_vec(&out).unwrap_or_default()
}

/// Where a streamed text goes in the Chat delta, and which part of which item it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Content,
    Refusal,
    Reasoning,
}

impl Field {
    fn key(self) -> &'static str {
        match self {
            Field::Content => "content",
            Field::Refusal => "refusal",
            Field::Reasoning => "reasoning_content",
        }
    }
}

/// A function call item: its Chat tool-call index and the argument bytes sent so far.
#[derive(Debug)]
struct Call {
    output_index: u64,
    sent: usize,
}

/// A Responses stream → Chat Completions chunks (see the module's table).
#[derive(Debug)]
pub struct Stream {
    model: String,
    include_usage: bool,
    decoder: SseDecoder,
    events: Vec<SseEvent>,
    id: String,
    created: u64,
    started: bool,
    calls: Vec<Call>,
    /// The text part deltas go to: (field, output index, part index), and the bytes sent to it.
    part: Option<((Field, u64, u64), usize)>,
    /// Reasoning text has been sent (a later reasoning part starts with a blank line).
    reasoned: bool,
    finished: bool,
}

impl Stream {
    /// `model`: the name the chunks give (empty: the Response's own). `include_usage`: the
    /// client asked for a usage chunk (Chat's `stream_options.include_usage`).
    pub fn new(model: &str, include_usage: bool) -> Stream {
        Stream {
            model: model.to_owned(),
            include_usage,
            decoder: SseDecoder::new(),
            events: Vec::new(),
            id: String::new(),
            created: 0,
            started: false,
            calls: Vec::new(),
            part: None,
            reasoned: false,
            finished: false,
        }
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> Value {
        let mut c = Map::new();
        c.insert("id".into(), self.id.clone().into());
        c.insert("object".into(), "chat.completion.chunk".into());
        c.insert("created".into(), self.created.into());
        c.insert("model".into(), self.model.clone().into());
        c.insert("choices".into(), choices);
        if let Some(u) = usage {
            c.insert("usage".into(), u);
        }
        Value::Object(c)
    }

    fn delta(&self, delta: Value, out: &mut Vec<u8>) {
        let choices =
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]);
        push_event(out, None, &self.chunk(choices, None));
    }

    /// Reads the Response's names (id, creation time, model) once, and sends the role chunk.
    fn start(&mut self, response: Option<&Value>, out: &mut Vec<u8>) {
        if let Some(r) = response {
            if self.id.is_empty() {
                if let Some(id) = r.get("id").and_then(Value::as_str) {
                    self.id = id.to_owned();
                }
            }
            if self.created == 0 {
                self.created = r.get("created_at").and_then(Value::as_u64).unwrap_or(0);
            }
            if self.model.is_empty() {
                if let Some(m) = r.get("model").and_then(Value::as_str) {
                    self.model = m.to_owned();
                }
            }
        }
        if !self.started {
            self.started = true;
            self.delta(json!({"role": "assistant", "content": ""}), out);
        }
    }

    /// Text for `field` of part `key`; `whole`: the part's complete text (a `.done` event),
    /// of which only what was not yet sent goes out.
    fn text(&mut self, field: Field, key: (u64, u64), text: &str, whole: bool, out: &mut Vec<u8>) {
        let key = (field, key.0, key.1);
        let sent = match self.part {
            Some((k, sent)) if k == key => sent,
            _ => 0,
        };
        let new = if whole {
            match text.get(sent..) {
                Some(rest) => rest,
                None => return,
            }
        } else {
            text
        };
        if new.is_empty() {
            return;
        }
        let mut piece = String::new();
        if field == Field::Reasoning && sent == 0 && self.reasoned {
            piece.push_str("\n\n");
        }
        piece.push_str(new);
        if field == Field::Reasoning {
            self.reasoned = true;
        }
        self.part = Some((key, sent + new.len()));
        self.delta(json!({ field.key(): piece }), out);
    }

    /// A function call item: announced once (id and name), then its argument text; `whole`:
    /// the complete arguments, of which only what was not yet sent goes out.
    fn call(
        &mut self,
        output_index: u64,
        item: Option<&Value>,
        args: &str,
        whole: bool,
        out: &mut Vec<u8>,
    ) -> Result<(), String> {
        let k = match self
            .calls
            .iter()
            .position(|c| c.output_index == output_index)
        {
            Some(k) => k,
            None => {
                let item = item.ok_or_else(|| {
                    format!("function call arguments for output {output_index}, which no function call item announced")
                })?;
                let s = |key: &str| item.get(key).and_then(Value::as_str).unwrap_or("");
                let k = self.calls.len();
                self.calls.push(Call {
                    output_index,
                    sent: 0,
                });
                let start = json!({"index": k, "id": s("call_id"), "type": "function",
                    "function": {"name": s("name"), "arguments": ""}});
                self.delta(json!({ "tool_calls": [start] }), out);
                k
            }
        };
        let sent = self.calls[k].sent;
        let new = if whole {
            args.get(sent..).unwrap_or("")
        } else {
            args
        };
        if !new.is_empty() {
            self.calls[k].sent += new.len();
            let d = json!({"index": k, "function": {"arguments": new}});
            self.delta(json!({ "tool_calls": [d] }), out);
        }
        Ok(())
    }

    fn finish(&mut self, response: &Value, out: &mut Vec<u8>) {
        self.start(Some(response), out);
        // The finished Response lists its output; a call whose events were missed still counts.
        let has_calls = !self.calls.is_empty()
            || response
                .get("output")
                .and_then(Value::as_array)
                .is_some_and(|o| o.iter().any(|i| i["type"] == "function_call"));
        let finish = finish_of(response, has_calls);
        let choices = json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish}]);
        push_event(out, None, &self.chunk(choices, None));
        if self.include_usage {
            let usage = response
                .get("usage")
                .filter(|u| u.is_object())
                .map(usage_to_chat)
                .unwrap_or_else(|| usage_to_chat(&json!({})));
            push_event(out, None, &self.chunk(json!([]), Some(usage)));
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        self.finished = true;
    }

    /// A failed Response or an `error` event: the final error object, no `[DONE]`.
    fn fail(&mut self, error: &Value, out: &mut Vec<u8>) {
        let s = |k: &str| {
            error
                .get(k)
                .filter(|v| !v.is_null())
                .cloned()
                .unwrap_or(Value::Null)
        };
        let code = s("code");
        let kind = code
            .as_str()
            .or_else(|| error.get("type").and_then(Value::as_str))
            .and_then(kind_of_code)
            .unwrap_or(ErrorKind::Internal);
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("the Responses upstream failed");
        push_event(out, None, &openai_error(kind, message, s("param"), code));
        self.finished = true;
    }

    fn event(&mut self, ev: &SseEvent, out: &mut Vec<u8>) -> Result<(), String> {
        if ev.comment_only {
            out.extend_from_slice(b": ping\n\n");
            return Ok(());
        }
        if ev.data.trim() == "[DONE]" {
            return Ok(());
        }
        let v: Value = serde_json::from_str(&ev.data)
            .map_err(|e| format!("a Responses stream event is not JSON: {e}"))?;
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .or(ev.event.as_deref())
            .unwrap_or("");
        let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("");
        match kind {
            "response.created" | "response.in_progress" | "response.queued" => {
                self.start(v.get("response"), out)
            }
            "response.output_item.added" | "response.output_item.done" => {
                let item = v.get("item").unwrap_or(&Value::Null);
                if item.get("type").and_then(Value::as_str) == Some("function_call") {
                    self.start(None, out);
                    let args = item.get("arguments").and_then(Value::as_str).unwrap_or("");
                    self.call(n("output_index"), Some(item), args, true, out)?;
                }
            }
            "response.output_text.delta" | "response.output_text.done" => {
                self.start(None, out);
                let whole = kind.ends_with(".done");
                let text = if whole { s("text") } else { s("delta") };
                let key = (n("output_index"), n("content_index"));
                self.text(Field::Content, key, text, whole, out);
            }
            "response.refusal.delta" | "response.refusal.done" => {
                self.start(None, out);
                let whole = kind.ends_with(".done");
                let text = if whole { s("refusal") } else { s("delta") };
                let key = (n("output_index"), n("content_index"));
                self.text(Field::Refusal, key, text, whole, out);
            }
            "response.reasoning_summary_text.delta" | "response.reasoning_summary_text.done" => {
                self.start(None, out);
                let whole = kind.ends_with(".done");
                let text = if whole { s("text") } else { s("delta") };
                let key = (n("output_index"), n("summary_index"));
                self.text(Field::Reasoning, key, text, whole, out);
            }
            "response.reasoning_text.delta" | "response.reasoning_text.done" => {
                self.start(None, out);
                let whole = kind.ends_with(".done");
                let text = if whole { s("text") } else { s("delta") };
                // Apart from the summary parts' numbers: both may come in one item.
                let key = (n("output_index"), n("content_index") | 1 << 32);
                self.text(Field::Reasoning, key, text, whole, out);
            }
            "response.function_call_arguments.delta" | "response.function_call_arguments.done" => {
                self.start(None, out);
                let whole = kind.ends_with(".done");
                let args = if whole { s("arguments") } else { s("delta") };
                self.call(n("output_index"), None, args, whole, out)?;
            }
            "response.completed" | "response.incomplete" => {
                let r = v.get("response").cloned().unwrap_or(Value::Null);
                self.finish(&r, out);
            }
            "response.failed" => {
                let e = v.pointer("/response/error").cloned().unwrap_or(Value::Null);
                self.fail(&e, out);
            }
            "error" => {
                // The documented event carries its fields at the top; some servers nest them.
                let e = v
                    .get("error")
                    .filter(|e| e.is_object())
                    .unwrap_or(&v)
                    .clone();
                self.fail(&e, out);
            }
            // Content part and item bookkeeping, annotations, hosted tools' progress.
            _ => {}
        }
        Ok(())
    }
}

impl StreamToHub for Stream {
    fn feed(&mut self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        self.decoder
            .feed(chunk, &mut self.events)
            .map_err(|e| e.to_string())?;
        let events = std::mem::take(&mut self.events);
        for ev in &events {
            if self.finished {
                break;
            }
            self.event(ev, out)?;
        }
        self.events = events;
        self.events.clear();
        Ok(())
    }

    fn end(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        if self.finished {
            return Ok(());
        }
        // An event completed by the end of the body (no blank line after it) still counts;
        // a partial one is a cut stream, which needs nothing from here.
        let mut events = Vec::new();
        if self.decoder.end(&mut events).is_ok() {
            for ev in &events {
                if self.finished {
                    break;
                }
                self.event(ev, out)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "tests/responses.rs"]
mod tests;
