//! Gemini's `generateContent` (Google AI Studio, and Vertex AI's `publishers/google` models,
//! which take the same bodies) as a dialect of Anthropic Messages.
//!
//! # Requests ([`request`])
//!
//! | Messages | Gemini | notes |
//! |---|---|---|
//! | `system` (string or text blocks) | `systemInstruction.parts[].text` | `cache_control` dropped: `cache_control_dropped` |
//! | `user` / `assistant` turns | `contents[]` with role `user` / `model` | a trailing assistant turn (a prefill, or keel's continuation of a cut stream) stays the trailing `model` turn |
//! | `text`, `image` / `document` with a `base64` source, `document` with a `text` source | `text`, `inlineData {mimeType, data}`, `text` | URL and file sources are **refused** |
//! | `tool_use` | `functionCall {name, args}` | |
//! | `tool_result` | `functionResponse {name, response: {output}}` (`{error}` when `is_error`) | Gemini names the function, not the call: the name is the one of the earlier `tool_use` with that id; images in a result are **refused** |
//! | `thinking` with a Gemini signature | a thought part `{text, thought: true, thoughtSignature}`; without text, the next part's `thoughtSignature` | other thinking (another model's, or unsigned) is not sent: Gemini reads its reasoning from its signatures; `redacted_thinking` dropped: `redacted_thinking_dropped` |
//! | `tools` (custom) | `tools[0].functionDeclarations[]` with `parametersJsonSchema` = `input_schema` | server tools are **refused**; `$schema` left out (metadata Gemini does not take) |
//! | `tool_choice` auto / any / tool / none | `toolConfig.functionCallingConfig.mode` AUTO / ANY / ANY + `allowedFunctionNames` / NONE | `disable_parallel_tool_use` dropped: `disable_parallel_tool_use_dropped` |
//! | `max_tokens`, `temperature`, `top_p`, `top_k`, `stop_sequences` | `generationConfig.maxOutputTokens`, `temperature`, `topP`, `topK`, `stopSequences` | more than 5 stop sequences are **refused** (Gemini's limit) |
//! | `thinking` enabled (budget) / adaptive / disabled | `thinkingConfig {thinkingBudget: budget / -1, includeThoughts: true}` / none | |
//! | `output_format` / `output_config.format` `json_schema` | `responseMimeType: application/json` + `responseJsonSchema` | `output_config.effort` dropped: `effort_dropped` |
//! | `metadata`, `service_tier`, unknown fields | — | dropped: `<field>_dropped` |
//! | `mcp_servers` | — | **refused** |
//!
//! Structured output needs nothing of its own: the hub expresses a client's `response_format`
//! as a forced tool, which becomes a forced function (`ANY` with one allowed name).
//!
//! # Thought signatures
//!
//! Gemini's thinking models put an opaque `thoughtSignature` on parts of the answer, and
//! Gemini 3 refuses a conversation whose function calls come back without theirs. The hub's
//! place for an opaque reasoning token is a `thinking` block's `signature`, which Anthropic
//! clients send back untouched: a signature on a thought part signs that thinking block, one on
//! a function call becomes a thinking block of its own (no text) just before the `tool_use`.
//! Signatures are written with the prefix `gemini:`, so a request can tell them from Claude's
//! (which Gemini would refuse) and sends only its own back: a signed thinking block with text
//! as the thought part it was, one without text as the signature of the part that follows.
//! A model turn with function calls and no Gemini signature (a history from another model, or
//! from a client that does not keep thinking blocks) gets the placeholder Gemini documents for
//! such histories on its first call: fix code `thought_signature_placeholder`. Signatures on
//! plain text parts are not kept: Gemini does not require them.
//!
//! # Answers ([`whole`], [`Stream`])
//!
//! | Gemini | Messages |
//! |---|---|
//! | `candidates[0].content.parts`: `text` / `text` with `thought: true` / `functionCall` | `text` / `thinking` / `tool_use` blocks (consecutive parts of one kind make one block) |
//! | a `functionCall`'s identity | `toolu_<responseId>_<n>`: stable for the answer, unique across turns |
//! | `finishReason` STOP (a call made: tool_use), MAX_TOKENS, SAFETY / RECITATION / BLOCKLIST / PROHIBITED_CONTENT / SPII / IMAGE_* | `stop_reason` end_turn (tool_use), max_tokens, refusal |
//! | `promptFeedback.blockReason` without candidates | an empty answer with `stop_reason` refusal |
//! | `usageMetadata` `promptTokenCount`, `cachedContentTokenCount`, `candidatesTokenCount` + `thoughtsTokenCount` | `input_tokens` (prompt − cached), `cache_read_input_tokens`, `output_tokens` |
//! | error body `{"error": {code, message, status}}` | error body, kind from `status` (then the HTTP status), message `STATUS: message` |
//!
//! A stream (`:streamGenerateContent?alt=sse`) is a series of `data:` events, each a whole
//! `GenerateContentResponse` holding the next parts, with no terminator: the chunk carrying a
//! `finishReason` is the last. The hub's `message_delta` and `message_stop` are written as soon
//! as that chunk is read, rather than when the body ends: the client has its end of answer
//! without waiting on the upstream's close, and a connection that lingers after the last chunk
//! costs nothing. A body that ends before a `finishReason` ends the hub stream without
//! `message_stop`, as a cut Anthropic stream would; an `{"error": …}` event becomes the hub's
//! `error` event.

use std::borrow::Cow;
use std::collections::HashMap;

use serde_json::{json, Map, Value};

use super::{error_kind_of_status, push_event, DialectRequest, StreamToHub};
use crate::protocol::{borrowed_text, error_body, ErrorKind, MapOnly, Protocol};
use crate::request::RequestError;
use crate::sse::{SseDecoder, SseEvent};
use crate::translate::Fixes;

/// The prefix of a thinking block's signature that carries a Gemini `thoughtSignature`.
const SIGNATURE_PREFIX: &str = "gemini:";

/// The `thoughtSignature` Gemini documents for function calls of a history it did not write
/// (it turns the signature check off for that call).
pub const PLACEHOLDER_SIGNATURE: &str = "skip_thought_signature_validator";

/// The most `stopSequences` Gemini takes (AI Studio and Vertex AI alike); more is a 400.
const MAX_STOP_SEQUENCES: usize = 5;

fn unsupported(path: &str, what: &str) -> RequestError {
    RequestError::invalid(format!(
        "{path}: {what} is not supported by Gemini variants"
    ))
}

// ---------------------------------------------------------------------------------------------
// Requests

/// The hub's fields read here; every other field is dropped with a fix code.
const KNOWN: [&str; 14] = [
    "model",
    "stream",
    "messages",
    "system",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "tools",
    "tool_choice",
    "thinking",
    "output_format",
    "output_config",
];

/// An Anthropic Messages request body as a Gemini `generateContent` body. The model and the
/// choice to stream are in Gemini's URL, not its body.
pub fn request(hub: &Map<String, Value>) -> Result<DialectRequest, RequestError> {
    let mut fixes = Fixes::default();
    let present = |k: &str| hub.get(k).filter(|v| !v.is_null());
    let mut body = Map::new();

    if present("mcp_servers").is_some() {
        return Err(unsupported("mcp_servers", "an MCP server"));
    }
    let messages = present("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| RequestError::invalid("messages: an array is required"))?;
    body.insert(
        "contents".into(),
        Value::Array(contents(messages, &mut fixes)?),
    );
    if let Some(system) = present("system") {
        let parts = system_parts(system, &mut fixes)?;
        if !parts.is_empty() {
            body.insert("systemInstruction".into(), json!({ "parts": parts }));
        }
    }
    if let Some(tools) = present("tools") {
        let decls = function_declarations(tools, &mut fixes)?;
        if !decls.is_empty() {
            body.insert("tools".into(), json!([{ "functionDeclarations": decls }]));
        }
    }
    if let Some(choice) = present("tool_choice") {
        body.insert("toolConfig".into(), tool_config(choice, &mut fixes)?);
    }

    if present("stop_sequences")
        .and_then(Value::as_array)
        .is_some_and(|s| s.len() > MAX_STOP_SEQUENCES)
    {
        return Err(unsupported(
            "stop_sequences",
            &format!("more than {MAX_STOP_SEQUENCES} stop sequences"),
        ));
    }
    let mut generation = Map::new();
    for (hub_key, key) in [
        ("max_tokens", "maxOutputTokens"),
        ("temperature", "temperature"),
        ("top_p", "topP"),
        ("top_k", "topK"),
        ("stop_sequences", "stopSequences"),
    ] {
        if let Some(v) = present(hub_key) {
            generation.insert(key.into(), v.clone());
        }
    }
    if let Some(thinking) = present("thinking") {
        if let Some(config) = thinking_config(thinking)? {
            generation.insert("thinkingConfig".into(), config);
        }
    }
    let mut format = present("output_format").cloned();
    if let Some(config) = present("output_config") {
        let config = config
            .as_object()
            .ok_or_else(|| RequestError::invalid("output_config: an object is required"))?;
        for (k, v) in config {
            match k.as_str() {
                "format" if !v.is_null() => format = Some(v.clone()),
                "format" => {}
                other => fixes.dropped(other),
            }
        }
    }
    if let Some(format) = format {
        let path = "output_format";
        match format.get("type").and_then(Value::as_str) {
            Some("json_schema") => {
                let schema = format
                    .get("schema")
                    .ok_or_else(|| RequestError::invalid(format!("{path}.schema: required")))?;
                generation.insert("responseMimeType".into(), json!("application/json"));
                generation.insert("responseJsonSchema".into(), json_schema(schema));
            }
            other => {
                return Err(unsupported(
                    &format!("{path}.type"),
                    &format!("the format `{}`", other.unwrap_or("")),
                ))
            }
        }
    }
    if !generation.is_empty() {
        body.insert("generationConfig".into(), Value::Object(generation));
    }

    for key in hub.keys() {
        if !KNOWN.contains(&key.as_str()) {
            fixes.dropped(key);
        }
    }
    Ok(DialectRequest {
        body: serde_json::to_vec(&Value::Object(body)).unwrap_or_default(),
        fixes: fixes.into_vec(),
    })
}

fn system_parts(system: &Value, fixes: &mut Fixes) -> Result<Vec<Value>, RequestError> {
    match system {
        Value::String(s) if s.is_empty() => Ok(Vec::new()),
        Value::String(s) => Ok(vec![json!({ "text": s })]),
        Value::Array(blocks) => {
            let mut parts = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                let path = format!("system[{i}]");
                if b.get("type").and_then(Value::as_str) != Some("text") {
                    return Err(unsupported(&path, "a system block other than text"));
                }
                if b.get("cache_control").is_some_and(|c| !c.is_null()) {
                    fixes.dropped("cache_control");
                }
                let text = b.get("text").and_then(Value::as_str).unwrap_or("");
                if !text.is_empty() {
                    parts.push(json!({ "text": text }));
                }
            }
            Ok(parts)
        }
        _ => Err(RequestError::invalid(
            "system: a string or an array of text blocks is required",
        )),
    }
}

/// The conversation as Gemini `contents`.
fn contents(messages: &[Value], fixes: &mut Fixes) -> Result<Vec<Value>, RequestError> {
    // Tool names by tool_use id, from the turns before: a functionResponse names its function.
    let mut names: HashMap<&str, &str> = HashMap::new();
    let mut out = Vec::with_capacity(messages.len());
    let mut placeholder = false;
    for (i, m) in messages.iter().enumerate() {
        let path = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some("user") => "user",
            Some("assistant") => "model",
            _ => {
                return Err(RequestError::invalid(format!(
                    "{path}.role: `user` or `assistant` is required"
                )))
            }
        };
        let mut turn = Turn::default();
        match m.get("content") {
            Some(Value::String(s)) => {
                if !s.is_empty() {
                    turn.push(json!({ "text": s }));
                }
            }
            Some(Value::Array(blocks)) => {
                for (j, b) in blocks.iter().enumerate() {
                    block(
                        b,
                        &format!("{path}.content[{j}]"),
                        &mut names,
                        &mut turn,
                        fixes,
                    )?;
                }
            }
            _ => {
                return Err(RequestError::invalid(format!(
                    "{path}.content: a string or an array of blocks is required"
                )))
            }
        }
        if role == "model" {
            // Gemini 3 checks the signature of the first call of each step.
            if let Some(first_call) = turn
                .parts
                .iter_mut()
                .find(|p| p.get("functionCall").is_some())
            {
                if first_call.get("thoughtSignature").is_none() {
                    first_call["thoughtSignature"] = json!(PLACEHOLDER_SIGNATURE);
                    placeholder = true;
                }
            }
        }
        if !turn.parts.is_empty() {
            out.push(json!({ "role": role, "parts": turn.parts }));
        }
    }
    if placeholder {
        fixes.add("thought_signature_placeholder");
    }
    Ok(out)
}

/// The parts of one turn, and a Gemini signature waiting for the part it belongs to.
#[derive(Default)]
struct Turn {
    parts: Vec<Value>,
    signature: Option<String>,
}

impl Turn {
    fn push(&mut self, mut part: Value) {
        if let Some(sig) = self.signature.take() {
            part["thoughtSignature"] = Value::String(sig);
        }
        self.parts.push(part);
    }
}

fn block<'a>(
    b: &'a Value,
    path: &str,
    names: &mut HashMap<&'a str, &'a str>,
    turn: &mut Turn,
    fixes: &mut Fixes,
) -> Result<(), RequestError> {
    let kind = b.get("type").and_then(Value::as_str).unwrap_or("");
    if b.get("cache_control").is_some_and(|c| !c.is_null()) {
        fixes.dropped("cache_control");
    }
    match kind {
        "text" => {
            let text = b.get("text").and_then(Value::as_str).unwrap_or("");
            if !text.is_empty() {
                turn.push(json!({ "text": text }));
            }
        }
        "image" | "document" => turn.push(media(b, path, kind)?),
        "tool_use" => {
            let name = b
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| RequestError::invalid(format!("{path}.name: required")))?;
            if let Some(id) = b.get("id").and_then(Value::as_str) {
                names.insert(id, name);
            }
            let args = match b.get("input") {
                Some(v @ Value::Object(_)) => v.clone(),
                _ => json!({}),
            };
            turn.push(json!({ "functionCall": { "name": name, "args": args } }));
        }
        "tool_result" => {
            let id = b.get("tool_use_id").and_then(Value::as_str).unwrap_or("");
            let name = names.get(id).ok_or_else(|| {
                RequestError::invalid(format!(
                    "{path}.tool_use_id: no earlier `tool_use` block has the id `{id}`"
                ))
            })?;
            let text = tool_result_text(b.get("content"), path)?;
            let key = if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                "error"
            } else {
                "output"
            };
            turn.push(json!({
                "functionResponse": { "name": name, "response": { key: text } }
            }));
        }
        "thinking" => {
            let sig = b.get("signature").and_then(Value::as_str).unwrap_or("");
            let text = b.get("thinking").and_then(Value::as_str).unwrap_or("");
            match sig.strip_prefix(SIGNATURE_PREFIX) {
                // A signed thought part, as Gemini wrote it.
                Some(sig) if !text.is_empty() => turn.push(json!({
                    "text": text, "thought": true, "thoughtSignature": sig
                })),
                // The signature of the part that follows.
                Some(sig) => turn.signature = Some(sig.to_owned()),
                // Another model's reasoning, or a summary without a signature: nothing Gemini
                // reads.
                None => {}
            }
        }
        "redacted_thinking" => fixes.dropped("redacted_thinking"),
        other => return Err(unsupported(path, &format!("a `{other}` block"))),
    }
    Ok(())
}

/// An image or document block as a part: inline data, or the text of a text document.
fn media(b: &Value, path: &str, kind: &str) -> Result<Value, RequestError> {
    let source = b.get("source").unwrap_or(&Value::Null);
    match source.get("type").and_then(Value::as_str) {
        Some("base64") => {
            let mime = source.get("media_type").and_then(Value::as_str);
            let data = source.get("data").and_then(Value::as_str);
            match (mime, data) {
                (Some(mime), Some(data)) => {
                    Ok(json!({ "inlineData": { "mimeType": mime, "data": data } }))
                }
                _ => Err(RequestError::invalid(format!(
                    "{path}.source: `media_type` and `data` are required"
                ))),
            }
        }
        Some("text") if kind == "document" => {
            let data = source.get("data").and_then(Value::as_str).unwrap_or("");
            Ok(json!({ "text": data }))
        }
        other => Err(unsupported(
            &format!("{path}.source"),
            &format!("an {kind} `{}` source", other.unwrap_or("")),
        )),
    }
}

/// A tool result's content as text (Gemini's function response is a JSON object; the text goes
/// under `output` or `error`, the keys Google's SDKs use).
fn tool_result_text(content: Option<&Value>, path: &str) -> Result<String, RequestError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (k, b) in blocks.iter().enumerate() {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => texts.push(b.get("text").and_then(Value::as_str).unwrap_or("")),
                    other => {
                        return Err(unsupported(
                            &format!("{path}.content[{k}]"),
                            &format!("a `{}` block in a tool result", other.unwrap_or("")),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(RequestError::invalid(format!(
            "{path}.content: a string or an array of blocks is required"
        ))),
    }
}

fn function_declarations(tools: &Value, fixes: &mut Fixes) -> Result<Vec<Value>, RequestError> {
    let tools = tools
        .as_array()
        .ok_or_else(|| RequestError::invalid("tools: an array is required"))?;
    let mut decls = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let path = format!("tools[{i}]");
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => return Err(unsupported(&path, &format!("the server tool `{other}`"))),
        }
        let mut decl = Map::new();
        for (k, v) in t.as_object().into_iter().flatten() {
            match k.as_str() {
                "name" => {
                    decl.insert("name".into(), v.clone());
                }
                "description" => {
                    decl.insert("description".into(), v.clone());
                }
                "input_schema" => {
                    decl.insert("parametersJsonSchema".into(), json_schema(v));
                }
                "type" => {}
                "cache_control" if v.is_null() => {}
                other => fixes.dropped(other),
            }
        }
        if !decl.contains_key("name") {
            return Err(RequestError::invalid(format!("{path}.name: required")));
        }
        decls.push(Value::Object(decl));
    }
    Ok(decls)
}

/// A JSON Schema as Gemini takes it (`parametersJsonSchema`, `responseJsonSchema`): the
/// `$schema` dialect marker left out, the rest unchanged.
fn json_schema(schema: &Value) -> Value {
    match schema {
        Value::Object(m) if m.contains_key("$schema") => {
            let mut m = m.clone();
            m.remove("$schema");
            Value::Object(m)
        }
        other => other.clone(),
    }
}

fn tool_config(choice: &Value, fixes: &mut Fixes) -> Result<Value, RequestError> {
    if choice
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        == Some(true)
    {
        fixes.dropped("disable_parallel_tool_use");
    }
    let config = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => json!({ "mode": "AUTO" }),
        Some("any") => json!({ "mode": "ANY" }),
        Some("none") => json!({ "mode": "NONE" }),
        Some("tool") => {
            let name = choice
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| RequestError::invalid("tool_choice.name: required"))?;
            json!({ "mode": "ANY", "allowedFunctionNames": [name] })
        }
        other => {
            return Err(unsupported(
                "tool_choice.type",
                &format!("`{}`", other.unwrap_or("")),
            ))
        }
    };
    Ok(json!({ "functionCallingConfig": config }))
}

fn thinking_config(thinking: &Value) -> Result<Option<Value>, RequestError> {
    match thinking.get("type").and_then(Value::as_str) {
        Some("enabled") => {
            let budget = thinking
                .get("budget_tokens")
                .and_then(Value::as_u64)
                .ok_or_else(|| RequestError::invalid("thinking.budget_tokens: required"))?;
            Ok(Some(
                json!({ "thinkingBudget": budget, "includeThoughts": true }),
            ))
        }
        // Gemini's dynamic budget: the model decides how long to think.
        Some("adaptive") => Ok(Some(
            json!({ "thinkingBudget": -1, "includeThoughts": true }),
        )),
        // Some Gemini models always think (a budget of 0 is refused there); without
        // `includeThoughts` none of it is in the answer, as with thinking off.
        Some("disabled") => Ok(None),
        other => Err(unsupported(
            "thinking.type",
            &format!("`{}`", other.unwrap_or("")),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Answers

/// What one answer part is, for the hub.
enum Part<'a> {
    Text(&'a str),
    Thought(&'a str),
    Call {
        name: &'a str,
        args: &'a Value,
    },
    /// A part with nothing the hub shows (an empty part carrying only a signature, or a kind
    /// the request never asks for).
    Other,
}

fn part_of(p: &Value) -> Part<'_> {
    if let Some(call) = p.get("functionCall") {
        return Part::Call {
            name: call.get("name").and_then(Value::as_str).unwrap_or(""),
            args: call.get("args").unwrap_or(&Value::Null),
        };
    }
    match p.get("text").and_then(Value::as_str) {
        Some(t) if p.get("thought").and_then(Value::as_bool) == Some(true) => Part::Thought(t),
        Some(t) => Part::Text(t),
        None => Part::Other,
    }
}

/// A part's `thoughtSignature`, as a hub signature.
fn signature_of(p: &Value) -> Option<String> {
    p.get("thoughtSignature")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(|s| format!("{SIGNATURE_PREFIX}{s}"))
}

/// A function call's arguments as the JSON text of an object.
fn args_json(args: &Value) -> String {
    match args {
        Value::Object(_) => args.to_string(),
        _ => "{}".to_owned(),
    }
}

/// Keeps the characters Anthropic allows in an id (`[a-zA-Z0-9_-]`).
fn id_safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Ids of the answer and of its tool calls, from Gemini's `responseId` (the same in every
/// chunk of a stream): stable for one answer, distinct between answers.
#[derive(Debug, Clone)]
struct Ids {
    base: String,
}

impl Ids {
    fn of(chunk: &Value) -> Ids {
        let base = chunk
            .get("responseId")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(id_safe)
            .unwrap_or_else(|| "gemini".to_owned());
        Ids { base }
    }

    fn message(&self) -> String {
        format!("msg_{}", self.base)
    }

    fn tool(&self, n: usize) -> String {
        format!("toolu_{}_{n}", self.base)
    }
}

/// Gemini `finishReason` → Anthropic `stop_reason`.
fn stop_reason_of(finish: &str, called: bool) -> &'static str {
    match finish {
        "MAX_TOKENS" => "max_tokens",
        "SAFETY"
        | "RECITATION"
        | "BLOCKLIST"
        | "PROHIBITED_CONTENT"
        | "SPII"
        | "IMAGE_SAFETY"
        | "IMAGE_PROHIBITED_CONTENT"
        | "IMAGE_RECITATION" => "refusal",
        _ if called => "tool_use",
        // STOP (which is also how a stop sequence ends), and reasons newer than this code.
        _ => "end_turn",
    }
}

/// Token counts from `usageMetadata` (each chunk of a stream carries the counts so far).
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    prompt: u64,
    cached: u64,
    output: u64,
}

impl Usage {
    fn read(&mut self, meta: Option<&Value>) {
        let Some(meta) = meta else { return };
        let n = |k: &str| meta.get(k).and_then(Value::as_u64);
        if let Some(p) = n("promptTokenCount") {
            self.prompt = p;
        }
        if let Some(c) = n("cachedContentTokenCount") {
            self.cached = c;
        }
        let (candidates, thoughts) = (n("candidatesTokenCount"), n("thoughtsTokenCount"));
        if candidates.is_some() || thoughts.is_some() {
            self.output = candidates.unwrap_or(0) + thoughts.unwrap_or(0);
        }
    }

    /// Anthropic usage: its `input_tokens` leaves out the tokens read from the cache.
    fn hub(&self) -> Value {
        json!({
            "input_tokens": self.prompt.saturating_sub(self.cached),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached,
            "output_tokens": self.output,
        })
    }
}

/// A Gemini `GenerateContentResponse` → an Anthropic Messages answer; `model` is the answer's
/// `model`.
pub fn whole(body: &[u8], model: &str) -> Result<Vec<u8>, String> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| format!("invalid JSON in a Gemini answer: {e}"))?;
    if !v.is_object() {
        return Err("a Gemini answer is not a JSON object".into());
    }
    if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
        return Err(format!("a Gemini answer carries an error: {e}"));
    }
    let ids = Ids::of(&v);
    let mut usage = Usage::default();
    usage.read(v.get("usageMetadata"));
    let candidate = v.pointer("/candidates/0");
    let parts = candidate
        .and_then(|c| c.pointer("/content/parts"))
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut content: Vec<Value> = Vec::new();
    let mut calls = 0;
    for p in parts {
        let sig = signature_of(p);
        match part_of(p) {
            Part::Text(t) => match content.last_mut() {
                Some(b) if b["type"] == "text" => {
                    let joined = format!("{}{t}", b["text"].as_str().unwrap_or(""));
                    b["text"] = Value::String(joined);
                }
                _ if t.is_empty() => {}
                _ => content.push(json!({ "type": "text", "text": t })),
            },
            Part::Thought(t) => {
                match content.last_mut() {
                    Some(b) if b["type"] == "thinking" && b["signature"] == "" => {
                        let joined = format!("{}{t}", b["thinking"].as_str().unwrap_or(""));
                        b["thinking"] = Value::String(joined);
                    }
                    _ => {
                        content.push(json!({ "type": "thinking", "thinking": t, "signature": "" }))
                    }
                }
                if let Some(sig) = sig {
                    if let Some(b) = content.last_mut() {
                        b["signature"] = Value::String(sig);
                    }
                }
            }
            Part::Call { name, args } => {
                if let Some(sig) = sig {
                    content.push(json!({ "type": "thinking", "thinking": "", "signature": sig }));
                }
                let input = match args {
                    Value::Object(_) => args.clone(),
                    _ => json!({}),
                };
                content.push(json!({
                    "type": "tool_use", "id": ids.tool(calls), "name": name, "input": input
                }));
                calls += 1;
            }
            Part::Other => {
                // A signature on its own part signs the thinking before it.
                if let (Some(sig), Some(b)) = (sig, content.last_mut()) {
                    if b["type"] == "thinking" && b["signature"] == "" {
                        b["signature"] = Value::String(sig);
                    }
                }
            }
        }
    }
    let blocked = candidate.is_none()
        && v.pointer("/promptFeedback/blockReason")
            .is_some_and(|r| !r.is_null());
    let stop_reason = if blocked {
        "refusal"
    } else {
        let finish = candidate
            .and_then(|c| c.get("finishReason"))
            .and_then(Value::as_str)
            .unwrap_or("STOP");
        stop_reason_of(finish, calls > 0)
    };
    let answer = json!({
        "id": ids.message(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": null,
        "usage": usage.hub(),
    });
    serde_json::to_vec(&answer).map_err(|e| e.to_string())
}

/// The content block being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Text,
    /// A thinking block, and whether its signature was written.
    Thinking {
        signed: bool,
    },
}

/// A Gemini `alt=sse` stream, chunk by chunk, as Anthropic Messages events.
#[derive(Debug)]
pub struct Stream {
    model: String,
    decoder: SseDecoder,
    events: Vec<SseEvent>,
    ids: Option<Ids>,
    usage: Usage,
    /// The block open now, and the index the next block gets.
    open: Option<Open>,
    next_index: usize,
    calls: usize,
    /// `message_stop` or an `error` event was written: the hub stream is over.
    over: bool,
}

impl Stream {
    /// `model` is the `model` of the hub's `message_start`.
    pub fn new(model: &str) -> Stream {
        Stream {
            model: model.to_owned(),
            decoder: SseDecoder::new(),
            events: Vec::new(),
            ids: None,
            usage: Usage::default(),
            open: None,
            next_index: 0,
            calls: 0,
            over: false,
        }
    }

    fn events(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        let events = std::mem::take(&mut self.events);
        let mut result = Ok(());
        for ev in &events {
            if self.over || ev.comment_only || ev.data.trim().is_empty() {
                continue;
            }
            if self.plain_text(&ev.data, out) {
                continue;
            }
            let v: Value = match serde_json::from_str(&ev.data) {
                Ok(v) => v,
                Err(e) => {
                    result = Err(format!("invalid JSON in a Gemini stream chunk: {e}"));
                    break;
                }
            };
            if let Err(e) = self.chunk(&v, out) {
                result = Err(e);
                break;
            }
        }
        // Keep the allocation for the next feed.
        self.events = events;
        self.events.clear();
        result
    }

    /// Writes a chunk of plain text mid-answer (nearly every chunk) read without a JSON tree;
    /// `false` when the chunk is anything else (its first, a thought, a call, a signature, a
    /// finish, an error, a shape the view does not read), left to [`Stream::chunk`].
    fn plain_text(&mut self, data: &str, out: &mut Vec<u8>) -> bool {
        if self.ids.is_none() {
            return false;
        }
        let Ok(view) = MapOnly::<ChunkView<'_>>::parse(data) else {
            return false;
        };
        let Some(parts) = view.plain_parts() else {
            return false;
        };
        if let Some(u) = &view.usage {
            u.apply(&mut self.usage);
        }
        for text in parts {
            if text.is_empty() {
                continue;
            }
            if self.open != Some(Open::Text) {
                self.begin(Open::Text, json!({ "type": "text", "text": "" }), out);
            }
            write_text_delta(out, self.next_index - 1, text);
        }
        true
    }

    fn chunk(&mut self, v: &Value, out: &mut Vec<u8>) -> Result<(), String> {
        let v = match v {
            // Without `alt=sse` Gemini streams a JSON array; one element per event is read the same.
            Value::Array(items) if items.len() == 1 => &items[0],
            Value::Object(_) => v,
            _ => return Err("a Gemini stream chunk is not a JSON object".into()),
        };
        if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
            let (kind, message) = error_of(e, 500);
            push_event(
                out,
                Some("error"),
                &error_body(Protocol::Anthropic, kind, &message),
            );
            self.over = true;
            return Ok(());
        }
        self.usage.read(v.get("usageMetadata"));
        self.start(v, out);
        let candidate = v.pointer("/candidates/0");
        if let Some(parts) = candidate
            .and_then(|c| c.pointer("/content/parts"))
            .and_then(Value::as_array)
        {
            for p in parts {
                self.part(p, out);
            }
        }
        let finish = candidate
            .and_then(|c| c.get("finishReason"))
            .and_then(Value::as_str);
        let blocked = candidate.is_none()
            && v.pointer("/promptFeedback/blockReason")
                .is_some_and(|r| !r.is_null());
        if let Some(stop_reason) = finish
            .map(|f| stop_reason_of(f, self.calls > 0))
            .or(blocked.then_some("refusal"))
        {
            self.close(out);
            push_event(
                out,
                Some("message_delta"),
                &json!({
                    "type": "message_delta",
                    "delta": { "stop_reason": stop_reason, "stop_sequence": null },
                    "usage": self.usage.hub(),
                }),
            );
            push_event(
                out,
                Some("message_stop"),
                &json!({ "type": "message_stop" }),
            );
            self.over = true;
        }
        Ok(())
    }

    fn start(&mut self, v: &Value, out: &mut Vec<u8>) {
        if self.ids.is_some() {
            return;
        }
        let ids = Ids::of(v);
        let mut usage = self.usage.hub();
        usage["output_tokens"] = json!(0);
        push_event(
            out,
            Some("message_start"),
            &json!({
                "type": "message_start",
                "message": {
                    "id": ids.message(), "type": "message", "role": "assistant",
                    "model": self.model, "content": [], "stop_reason": null,
                    "stop_sequence": null, "usage": usage,
                }
            }),
        );
        self.ids = Some(ids);
    }

    fn part(&mut self, p: &Value, out: &mut Vec<u8>) {
        let sig = signature_of(p);
        match part_of(p) {
            Part::Text(t) => {
                if t.is_empty() {
                    return;
                }
                if self.open != Some(Open::Text) {
                    self.begin(Open::Text, json!({ "type": "text", "text": "" }), out);
                }
                self.delta(json!({ "type": "text_delta", "text": t }), out);
            }
            Part::Thought(t) => {
                if self.open != Some(Open::Thinking { signed: false }) {
                    self.begin_thinking(out);
                }
                if !t.is_empty() {
                    self.delta(json!({ "type": "thinking_delta", "thinking": t }), out);
                }
                if let Some(sig) = sig {
                    self.sign(sig, out);
                }
            }
            Part::Call { name, args } => {
                if let Some(sig) = sig {
                    self.begin_thinking(out);
                    self.sign(sig, out);
                }
                self.close(out);
                let id = self.ids.as_ref().map(|i| i.tool(self.calls));
                self.calls += 1;
                let index = self.next_index;
                self.next_index += 1;
                push_event(
                    out,
                    Some("content_block_start"),
                    &json!({
                        "type": "content_block_start", "index": index,
                        "content_block": { "type": "tool_use", "id": id, "name": name, "input": {} }
                    }),
                );
                push_event(
                    out,
                    Some("content_block_delta"),
                    &json!({
                        "type": "content_block_delta", "index": index,
                        "delta": { "type": "input_json_delta", "partial_json": args_json(args) }
                    }),
                );
                push_event(
                    out,
                    Some("content_block_stop"),
                    &json!({ "type": "content_block_stop", "index": index }),
                );
            }
            Part::Other => {
                if let (Some(sig), Some(Open::Thinking { signed: false })) = (sig, self.open) {
                    self.sign(sig, out);
                }
            }
        }
    }

    fn begin_thinking(&mut self, out: &mut Vec<u8>) {
        self.begin(
            Open::Thinking { signed: false },
            json!({ "type": "thinking", "thinking": "", "signature": "" }),
            out,
        );
    }

    /// Writes the open thinking block's signature; the block ends with it.
    fn sign(&mut self, sig: String, out: &mut Vec<u8>) {
        self.delta(json!({ "type": "signature_delta", "signature": sig }), out);
        self.open = Some(Open::Thinking { signed: true });
        self.close(out);
    }

    fn begin(&mut self, kind: Open, block: Value, out: &mut Vec<u8>) {
        self.close(out);
        push_event(
            out,
            Some("content_block_start"),
            &json!({ "type": "content_block_start", "index": self.next_index, "content_block": block }),
        );
        self.open = Some(kind);
        self.next_index += 1;
    }

    fn delta(&self, delta: Value, out: &mut Vec<u8>) {
        push_event(
            out,
            Some("content_block_delta"),
            &json!({ "type": "content_block_delta", "index": self.next_index - 1, "delta": delta }),
        );
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        if self.open.take().is_some() {
            push_event(
                out,
                Some("content_block_stop"),
                &json!({ "type": "content_block_stop", "index": self.next_index - 1 }),
            );
        }
    }
}

/// The parts of a stream chunk the text path reads, without a JSON tree (strings borrowed
/// where unescaped). Fields it does not name are skipped; a part with any of the named
/// non-text fields makes the chunk one for the tree.
#[derive(Debug, serde::Deserialize)]
struct ChunkView<'a> {
    #[serde(default, borrow)]
    candidates: Option<Vec<MapOnly<CandidateView<'a>>>>,
    #[serde(default, rename = "usageMetadata")]
    usage: Option<MapOnly<UsageView>>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
    #[serde(default, rename = "promptFeedback")]
    prompt_feedback: Option<serde::de::IgnoredAny>,
}

#[derive(Debug, serde::Deserialize)]
struct CandidateView<'a> {
    #[serde(default, borrow)]
    content: Option<MapOnly<ContentView<'a>>>,
    #[serde(default, rename = "finishReason")]
    finish_reason: Option<serde::de::IgnoredAny>,
}

#[derive(Debug, serde::Deserialize)]
struct ContentView<'a> {
    #[serde(default, borrow)]
    parts: Option<Vec<MapOnly<PartView<'a>>>>,
}

#[derive(Debug, serde::Deserialize)]
struct PartView<'a> {
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    thought: Option<serde::de::IgnoredAny>,
    #[serde(default, rename = "thoughtSignature")]
    thought_signature: Option<serde::de::IgnoredAny>,
    #[serde(default, rename = "functionCall")]
    function_call: Option<serde::de::IgnoredAny>,
}

#[derive(Debug, serde::Deserialize)]
struct UsageView {
    #[serde(default, rename = "promptTokenCount")]
    prompt: Option<u64>,
    #[serde(default, rename = "cachedContentTokenCount")]
    cached: Option<u64>,
    #[serde(default, rename = "candidatesTokenCount")]
    candidates: Option<u64>,
    #[serde(default, rename = "thoughtsTokenCount")]
    thoughts: Option<u64>,
}

impl MapOnly<UsageView> {
    /// The same reading as [`Usage::read`].
    fn apply(&self, usage: &mut Usage) {
        let u = &self.0;
        if let Some(p) = u.prompt {
            usage.prompt = p;
        }
        if let Some(c) = u.cached {
            usage.cached = c;
        }
        if u.candidates.is_some() || u.thoughts.is_some() {
            usage.output = u.candidates.unwrap_or(0) + u.thoughts.unwrap_or(0);
        }
    }
}

impl<'a> ChunkView<'a> {
    /// The texts of the first candidate's parts, when the chunk holds plain text only.
    fn plain_parts(&self) -> Option<impl Iterator<Item = &str>> {
        if self.error.is_some() || self.prompt_feedback.is_some() {
            return None;
        }
        let candidate = &self.candidates.as_ref()?.first()?.0;
        if candidate.finish_reason.is_some() {
            return None;
        }
        let parts = candidate.content.as_ref()?.0.parts.as_ref()?;
        let plain = parts.iter().all(|p| {
            let p = &p.0;
            p.text.is_some()
                && p.thought.is_none()
                && p.thought_signature.is_none()
                && p.function_call.is_none()
        });
        plain.then(|| parts.iter().filter_map(|p| p.0.text.as_deref()))
    }
}

/// Appends a `text_delta` event, serialized straight from its parts.
fn write_text_delta(out: &mut Vec<u8>, index: usize, text: &str) {
    #[derive(serde::Serialize)]
    struct Delta<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        text: &'a str,
    }
    #[derive(serde::Serialize)]
    struct Event<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        index: usize,
        delta: Delta<'a>,
    }
    out.extend_from_slice(b"event: content_block_delta\ndata: ");
    let ev = Event {
        kind: "content_block_delta",
        index,
        delta: Delta {
            kind: "text_delta",
            text,
        },
    };
    // Serializing strings and numbers into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, &ev);
    out.extend_from_slice(b"\n\n");
}

impl StreamToHub for Stream {
    fn feed(&mut self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        if self.over {
            return Ok(());
        }
        self.decoder
            .feed(chunk, &mut self.events)
            .map_err(|e| format!("Gemini stream: {e}"))?;
        self.events(out)
    }

    fn end(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        if self.over {
            return Ok(());
        }
        // An event cut in the middle is a cut stream: no end for the hub, nothing to add.
        if self.decoder.end(&mut self.events).is_err() {
            self.events.clear();
            return Ok(());
        }
        self.events(out)
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

/// The hub's error kind for a Google API error `status` word.
fn kind_of_status_word(word: &str) -> Option<ErrorKind> {
    Some(match word {
        "RESOURCE_EXHAUSTED" => ErrorKind::RateLimited,
        "UNAVAILABLE" | "ABORTED" => ErrorKind::Overloaded,
        "INVALID_ARGUMENT" | "FAILED_PRECONDITION" | "OUT_OF_RANGE" => ErrorKind::InvalidRequest,
        "PERMISSION_DENIED" => ErrorKind::Permission,
        "UNAUTHENTICATED" => ErrorKind::Authentication,
        "NOT_FOUND" => ErrorKind::NotFound,
        "DEADLINE_EXCEEDED" => ErrorKind::Timeout,
        "INTERNAL" | "UNKNOWN" | "DATA_LOSS" | "CANCELLED" | "UNIMPLEMENTED" => ErrorKind::Internal,
        _ => return None,
    })
}

/// The kind and message of a Google API `error` object.
fn error_of(e: &Value, http_status: u16) -> (ErrorKind, String) {
    let word = e.get("status").and_then(Value::as_str);
    let message = e.get("message").and_then(Value::as_str).unwrap_or("");
    let code = e
        .get("code")
        .and_then(Value::as_u64)
        .and_then(|c| u16::try_from(c).ok())
        .unwrap_or(http_status);
    // AI Studio answers a bad API key with 400 INVALID_ARGUMENT; its detail says which.
    let bad_key = e
        .get("details")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|d| d.get("reason").and_then(Value::as_str) == Some("API_KEY_INVALID"));
    let kind = if bad_key {
        ErrorKind::Authentication
    } else {
        word.and_then(kind_of_status_word)
            .unwrap_or_else(|| error_kind_of_status(code))
    };
    let message = match (word, message) {
        (Some(w), "") => w.to_owned(),
        (Some(w), m) => format!("{w}: {m}"),
        (None, "") => format!("Gemini error {code}"),
        (None, m) => m.to_owned(),
    };
    (kind, message)
}

/// A Gemini error body (HTTP `status`) → the hub's error body.
pub fn error(status: u16, body: &[u8]) -> Vec<u8> {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    // The streaming method without `alt=sse` wraps its error in an array.
    let parsed = match parsed {
        Some(Value::Array(mut items)) if !items.is_empty() => Some(items.swap_remove(0)),
        other => other,
    };
    let (kind, message) = match parsed.as_ref().and_then(|v| v.get("error")) {
        Some(e) if e.is_object() => error_of(e, status),
        _ => {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            let snippet: String = text.chars().take(200).collect();
            let message = if snippet.is_empty() {
                format!("Gemini answered HTTP {status}")
            } else {
                format!("Gemini answered HTTP {status}: {snippet}")
            };
            (error_kind_of_status(status), message)
        }
    };
    serde_json::to_vec(&error_body(Protocol::Anthropic, kind, &message)).unwrap_or_default()
}

#[cfg(test)]
#[path = "tests/gemini.rs"]
mod tests;
