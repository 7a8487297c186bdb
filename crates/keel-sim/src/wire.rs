//! The wire protocols as the simulator speaks them: reading OpenAI and Anthropic requests into
//! one [`SimRequest`], and writing a [`Reply`] back as the real APIs do (stream events and
//! whole bodies). Formats follow the public API references: OpenAI chat/completion chunks with
//! `stream_options.include_usage`, Anthropic's message_start … message_stop event sequence.

use serde_json::{json, Map, Value};

use keel_core::protocol::Endpoint;
use keel_core::rng::hash_bytes;
use keel_core::sse::SseEvent;
use keel_core::tokens;

use crate::config::PrefillConvention;
use crate::schema;
use crate::text::{normalize, Finish, Mode, Output};

/// A request as the simulator needs it.
#[derive(Debug, Clone)]
pub struct SimRequest {
    pub endpoint: Endpoint,
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    pub mode: Mode,
    /// The rendered conversation (chat) or the prompt (completions).
    pub context: String,
    /// Reply text already present: a final assistant message being continued (or, for an
    /// `instruction` request, the cut-off answer the model is asked to continue).
    pub prefill: String,
    /// The conversation ends with an assistant message (what a server that refuses prefill
    /// rejects).
    pub ends_with_assistant: bool,
    /// A request to continue a cut-off answer: an assistant message followed by a final user
    /// message asking to continue it (keel's `instruction` resume mode). The simulated model
    /// follows it: it continues the answer, but in a new message (see `Server::generate`).
    pub instruction: bool,
    pub max_tokens: Option<u64>,
    pub stop: Vec<String>,
    /// Set when the request asks for a tool call.
    pub tool_call: Option<ToolCall>,
    /// The whole JSON text a `response_format` asks for (see [`structured_reply`]).
    pub structured: Option<String>,
    pub prompt_tokens: u64,
    /// The tool definitions as received (their JSON text, keys in the order sent): rendered
    /// before the conversation, as a real server's chat template does, so they lead the
    /// prefix its KV cache matches on.
    pub tools_text: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// Reads a request body. Errors are client errors (400) with a precise message.
pub fn parse_request(
    endpoint: Endpoint,
    body: &Value,
    prefill_convention: PrefillConvention,
) -> Result<SimRequest, String> {
    let obj = body
        .as_object()
        .ok_or("request body must be a JSON object")?;
    let model = obj
        .get("model")
        .and_then(Value::as_str)
        .ok_or("missing required field `model`")?
        .to_owned();
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let max_tokens = match endpoint {
        Endpoint::Messages => Some(
            obj.get("max_tokens")
                .and_then(Value::as_u64)
                .ok_or("missing required field `max_tokens`")?,
        ),
        _ => obj
            .get("max_completion_tokens")
            .or_else(|| obj.get("max_tokens"))
            .and_then(Value::as_u64),
    };
    if let Some(n) = obj.get("n").and_then(Value::as_u64) {
        if n != 1 {
            return Err("only `n` = 1 is supported".into());
        }
    }
    let stop = match obj.get("stop").or_else(|| obj.get("stop_sequences")) {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
        Some(_) => return Err("`stop` must be a string or an array of strings".into()),
    };

    let Prompt {
        mode,
        context,
        prefill,
        ends_with_assistant,
        instruction,
    } = match endpoint {
        Endpoint::Completions => completion_prompt(obj)?,
        _ => chat_prompt(obj, endpoint, prefill_convention)?,
    };
    let tool_call = if endpoint == Endpoint::Completions {
        None
    } else {
        pick_tool(obj, endpoint, &context)?
    };
    let structured = match (endpoint, &tool_call) {
        (Endpoint::ChatCompletions, None) => structured_reply(obj, &context)?,
        _ => None,
    };
    let prompt_tokens = tokens::count(&normalize(&context)) as u64 + tokens::count(&prefill) as u64;
    let tools_text = obj.get("tools").map(|t| t.to_string()).unwrap_or_default();
    Ok(SimRequest {
        endpoint,
        model,
        stream,
        include_usage,
        mode,
        context,
        prefill,
        ends_with_assistant,
        instruction,
        max_tokens,
        stop,
        tool_call,
        structured,
        prompt_tokens,
        tools_text,
    })
}

/// The prompt as the simulated model reads it: the context, and the text a continuation
/// carries (an assistant prefill, or the answer an instruction asks to continue).
struct Prompt {
    mode: Mode,
    context: String,
    prefill: String,
    ends_with_assistant: bool,
    instruction: bool,
}

/// `/v1/completions`: the prompt string.
fn completion_prompt(obj: &serde_json::Map<String, Value>) -> Result<Prompt, String> {
    let prompt = match obj.get("prompt") {
        Some(Value::String(p)) => p.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_owned()
        }
        _ => return Err("`prompt` must be a string".into()),
    };
    Ok(Prompt {
        mode: Mode::Completion,
        context: prompt,
        prefill: String::new(),
        ends_with_assistant: false,
        instruction: false,
    })
}

/// Chat and Messages: the conversation as context, and a final assistant message as prefill
/// (Messages always; Chat with `continue_final_message` or the prefill convention) or as the
/// answer a user's "continue" asks for (keel's instruction mode).
fn chat_prompt(
    obj: &serde_json::Map<String, Value>,
    endpoint: Endpoint,
    prefill_convention: PrefillConvention,
) -> Result<Prompt, String> {
    let msgs = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("missing required field `messages`")?;
    if msgs.is_empty() {
        return Err("`messages` must not be empty".into());
    }
    let continue_final = obj
        .get("continue_final_message")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let add_generation_prompt = obj
        .get("add_generation_prompt")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    if continue_final && add_generation_prompt && obj.contains_key("add_generation_prompt") {
        return Err("continue_final_message and add_generation_prompt cannot both be true".into());
    }
    let last_is_assistant = msgs
        .last()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        == Some("assistant");
    let role_at = |i: usize| {
        msgs.get(i)
            .and_then(|m| m.get("role"))
            .and_then(Value::as_str)
    };
    // [… assistant: partial answer, user: "… continue …"]: keel's instruction mode.
    let instruction = msgs.len() >= 2
        && role_at(msgs.len() - 1) == Some("user")
        && role_at(msgs.len() - 2) == Some("assistant")
        && content_text(msgs[msgs.len() - 1].get("content").unwrap_or(&Value::Null))
            .to_ascii_lowercase()
            .contains("continue");
    let prefill_final = last_is_assistant
        && match endpoint {
            Endpoint::Messages => true,
            _ => continue_final || prefill_convention == PrefillConvention::Always,
        };
    let mut context = String::new();
    if let Some(system) = obj.get("system") {
        context.push_str("system: ");
        context.push_str(&content_text(system));
        context.push('\n');
    }
    let upto = if instruction {
        msgs.len() - 2
    } else if prefill_final {
        msgs.len() - 1
    } else {
        msgs.len()
    };
    for (i, m) in msgs[..upto].iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or(format!("missing required field `messages[{i}].role`"))?;
        context.push_str(role);
        context.push_str(": ");
        context.push_str(&content_text(m.get("content").unwrap_or(&Value::Null)));
        context.push('\n');
    }
    let prefill = if prefill_final || instruction {
        content_text(msgs[upto].get("content").unwrap_or(&Value::Null))
    } else {
        String::new()
    };
    Ok(Prompt {
        mode: Mode::Chat,
        context,
        prefill,
        ends_with_assistant: last_is_assistant,
        instruction,
    })
}

/// Text of a message `content`: a string, or the text parts of an array (other parts by type).
fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p.get("text").and_then(Value::as_str) {
                Some(t) => t.to_owned(),
                None => format!(
                    "[{}]",
                    p.get("type").and_then(Value::as_str).unwrap_or("part")
                ),
            })
            .collect::<Vec<_>>()
            .join(" "),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Decides whether to call a tool: a forcing `tool_choice`, or the last user message naming a
/// tool. Arguments are derived from the tool's JSON schema, deterministically.
fn pick_tool(
    obj: &Map<String, Value>,
    endpoint: Endpoint,
    context: &str,
) -> Result<Option<ToolCall>, String> {
    let Some(tools) = obj.get("tools").and_then(Value::as_array) else {
        return Ok(None);
    };
    let specs: Vec<(&str, Option<&Value>)> = tools
        .iter()
        .filter_map(|t| match endpoint {
            Endpoint::Messages => Some((t.get("name")?.as_str()?, t.get("input_schema"))),
            _ => Some((
                t.pointer("/function/name")?.as_str()?,
                t.pointer("/function/parameters"),
            )),
        })
        .collect();
    if specs.is_empty() {
        return Ok(None);
    }
    let choice = obj.get("tool_choice");
    let choice_kind = choice
        .and_then(|c| c.as_str().or_else(|| c.get("type").and_then(Value::as_str)))
        .unwrap_or("auto");
    let forced_name = choice
        .and_then(|c| c.pointer("/function/name").or_else(|| c.get("name")))
        .and_then(Value::as_str);
    let last_user = context
        .lines()
        .rfind(|l| l.starts_with("user: "))
        .unwrap_or("")
        .to_lowercase();
    let last_line_is_user = context
        .lines()
        .last()
        .is_some_and(|l| l.starts_with("user: "));
    let chosen = match (choice_kind, forced_name) {
        ("none", _) => None,
        (_, Some(name)) => Some(
            specs
                .iter()
                .find(|(n, _)| *n == name)
                .ok_or(format!("tool_choice names unknown tool `{name}`"))?,
        ),
        ("required" | "any", _) => specs
            .iter()
            .find(|(n, _)| last_user.contains(&n.to_lowercase()))
            .or(specs.first()),
        _ if last_line_is_user => specs
            .iter()
            .find(|(n, _)| last_user.contains(&n.to_lowercase())),
        _ => None,
    };
    Ok(chosen.map(|(name, schema)| {
        let key = hash_bytes(7, format!("{context}\u{0}{name}").as_bytes());
        // Arguments are always an object, whatever the schema says at its top.
        let arguments = schema
            .map(|s| schema::value_for(s, key))
            .filter(Value::is_object)
            .unwrap_or_else(|| json!({}));
        let prefix = if endpoint == Endpoint::Messages {
            "toolu_"
        } else {
            "call_"
        };
        ToolCall {
            id: format!("{prefix}{:016x}", key),
            name: name.to_string(),
            arguments: arguments.to_string(),
        }
    }))
}

/// The reply text a chat `response_format` asks for: `json_object`, a JSON object; `json_schema`,
/// JSON valid against the schema; both derived from the conversation, deterministically (so
/// another server continues it exactly). `None` for plain text.
fn structured_reply(obj: &Map<String, Value>, context: &str) -> Result<Option<String>, String> {
    let Some(format) = obj.get("response_format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let key = hash_bytes(11, context.as_bytes());
    let schema = match format.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => json!({"type": "object", "properties": {
            "answer": {"type": "string", "minLength": 24}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}),
        Some("json_schema") => format
            .pointer("/json_schema/schema")
            .cloned()
            .ok_or("`response_format.json_schema.schema` is required")?,
        _ => {
            return Err(
                "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\""
                    .into(),
            )
        }
    };
    Ok(Some(schema::value_for(&schema, key).to_string()))
}

/// One streamed unit after the head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    /// Part of a tool call's JSON arguments.
    ToolArgs(String),
}

/// A reply ready to be sent.
#[derive(Debug, Clone)]
pub struct Reply {
    pub endpoint: Endpoint,
    pub id: String,
    pub model: String,
    pub created: u64,
    pub include_usage: bool,
    pub pieces: Vec<Piece>,
    pub tool_call: Option<ToolCall>,
    pub finish: Finish,
    pub prompt_tokens: u64,
    /// Prompt tokens served from the simulated KV cache.
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

impl Reply {
    pub fn new(req: &SimRequest, out: Output, id_seed: u64, created: u64) -> Self {
        let (pieces, completion_tokens, finish) = match &req.tool_call {
            Some(tc) => {
                let chunks: Vec<Piece> = tc
                    .arguments
                    .as_bytes()
                    .chunks(12)
                    .map(|c| Piece::ToolArgs(String::from_utf8_lossy(c).into_owned()))
                    .collect();
                (
                    chunks,
                    tokens::count(&tc.arguments) as u64 + 1,
                    Finish::Natural,
                )
            }
            None if req.structured.is_some() => {
                // The JSON text, after what a continued request already holds of it.
                let text = req.structured.as_deref().unwrap_or_default();
                let rest = text.strip_prefix(req.prefill.as_str()).unwrap_or(text);
                let pieces: Vec<Piece> = tokens::split(rest)
                    .into_iter()
                    .map(|t| Piece::Text(t.to_owned()))
                    .collect();
                let n = pieces.len() as u64;
                (pieces, n, Finish::Natural)
            }
            None => {
                let n = out.pieces.len() as u64;
                (
                    out.pieces.into_iter().map(Piece::Text).collect(),
                    n,
                    out.finish,
                )
            }
        };
        let id = match req.endpoint {
            Endpoint::Messages => format!("msg_{id_seed:016x}"),
            Endpoint::Completions => format!("cmpl-{id_seed:016x}"),
            _ => format!("chatcmpl-{id_seed:016x}"),
        };
        Reply {
            endpoint: req.endpoint,
            id,
            model: req.model.clone(),
            created,
            include_usage: req.include_usage,
            pieces,
            tool_call: req.tool_call.clone(),
            finish,
            prompt_tokens: req.prompt_tokens,
            cached_tokens: 0,
            completion_tokens,
        }
    }

    /// Ends a text reply for length after `n` tokens (the `truncate` fault); a tool call or a
    /// reply already that short is left alone.
    pub fn truncate(&mut self, n: u64) {
        if self.tool_call.is_none() && self.pieces.len() as u64 > n {
            self.pieces.truncate(n as usize);
            self.completion_tokens = n;
            self.finish = Finish::Length;
        }
    }

    /// Ends a text reply after `n` tokens (or where it ends, when shorter) with a safety stop
    /// (the `refusal` fault); a tool call is left alone.
    pub fn refuse(&mut self, n: u64) {
        if self.tool_call.is_none() {
            self.pieces.truncate(n as usize);
            self.completion_tokens = self.pieces.len() as u64;
            self.finish = Finish::Refusal;
        }
    }

    fn openai_finish(&self) -> &'static str {
        match (&self.tool_call, &self.finish) {
            (Some(_), _) => "tool_calls",
            (_, Finish::Length) => "length",
            (_, Finish::Refusal) => "content_filter",
            _ => "stop",
        }
    }

    fn anthropic_stop(&self) -> (&'static str, Value) {
        match (&self.tool_call, &self.finish) {
            (Some(_), _) => ("tool_use", Value::Null),
            (_, Finish::Length) => ("max_tokens", Value::Null),
            (_, Finish::StopSequence(s)) => ("stop_sequence", json!(s)),
            (_, Finish::Refusal) => ("refusal", Value::Null),
            _ => ("end_turn", Value::Null),
        }
    }

    fn usage_openai(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens}
        })
    }

    pub fn text(&self) -> String {
        self.pieces
            .iter()
            .filter_map(|p| {
                if let Piece::Text(t) = p {
                    Some(t.as_str())
                } else {
                    None
                }
            })
            .collect()
    }

    fn chunk(&self, choice: Value) -> SseEvent {
        let object = if self.endpoint == Endpoint::Completions {
            "text_completion"
        } else {
            "chat.completion.chunk"
        };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]});
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        SseEvent::new(None, &v.to_string())
    }

    /// Events sent together with the first token.
    pub fn stream_head(&self) -> Vec<SseEvent> {
        match self.endpoint {
            Endpoint::Messages => {
                let block = match &self.tool_call {
                    Some(tc) => {
                        json!({"type": "tool_use", "id": tc.id, "name": tc.name, "input": {}})
                    }
                    None => json!({"type": "text", "text": ""}),
                };
                vec![
                    anthropic_event(
                        "message_start",
                        json!({"type": "message_start", "message": {
                        "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
                        "stop_reason": null, "stop_sequence": null,
                        "usage": {"input_tokens": self.prompt_tokens, "cache_read_input_tokens": self.cached_tokens, "output_tokens": 1}}}),
                    ),
                    anthropic_event(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": 0, "content_block": block}),
                    ),
                    anthropic_event("ping", json!({"type": "ping"})),
                ]
            }
            Endpoint::Completions => Vec::new(),
            _ => {
                let delta = match &self.tool_call {
                    Some(tc) => json!({"role": "assistant", "content": null, "tool_calls": [
                        {"index": 0, "id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": ""}}]}),
                    None => json!({"role": "assistant", "content": ""}),
                };
                vec![self.chunk(
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}),
                )]
            }
        }
    }

    /// The event carrying one piece.
    pub fn stream_piece(&self, piece: &Piece) -> SseEvent {
        match (self.endpoint, piece) {
            (Endpoint::Messages, Piece::Text(t)) => anthropic_event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}),
            ),
            (Endpoint::Messages, Piece::ToolArgs(a)) => anthropic_event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": a}}),
            ),
            (Endpoint::Completions, Piece::Text(t)) => {
                self.chunk(json!({"index": 0, "text": t, "logprobs": null, "finish_reason": null}))
            }
            (_, Piece::Text(t)) => {
                self.chunk(json!({"index": 0, "delta": {"content": t}, "logprobs": null, "finish_reason": null}))
            }
            (_, Piece::ToolArgs(a)) => self.chunk(json!({"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": a}}]}, "logprobs": null, "finish_reason": null})),
        }
    }

    /// The events that end a complete stream.
    pub fn stream_tail(&self) -> Vec<SseEvent> {
        match self.endpoint {
            Endpoint::Messages => {
                let (reason, seq) = self.anthropic_stop();
                vec![
                    anthropic_event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": 0}),
                    ),
                    anthropic_event(
                        "message_delta",
                        json!({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": {"output_tokens": self.completion_tokens}}),
                    ),
                    anthropic_event("message_stop", json!({"type": "message_stop"})),
                ]
            }
            _ => {
                let last = if self.endpoint == Endpoint::Completions {
                    json!({"index": 0, "text": "", "logprobs": null, "finish_reason": self.openai_finish()})
                } else {
                    json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": self.openai_finish()})
                };
                let mut out = vec![self.chunk(last)];
                if self.include_usage {
                    let object = if self.endpoint == Endpoint::Completions {
                        "text_completion"
                    } else {
                        "chat.completion.chunk"
                    };
                    let v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
                        "choices": [], "usage": self.usage_openai()});
                    out.push(SseEvent::new(None, &v.to_string()));
                }
                out.push(SseEvent::new(None, "[DONE]"));
                out
            }
        }
    }

    /// The non-streaming response body.
    pub fn body(&self) -> Value {
        match self.endpoint {
            Endpoint::Messages => {
                let (reason, seq) = self.anthropic_stop();
                let content = match &self.tool_call {
                    Some(tc) => json!([{"type": "tool_use", "id": tc.id, "name": tc.name,
                        "input": serde_json::from_str::<Value>(&tc.arguments).unwrap_or(json!({}))}]),
                    None => json!([{"type": "text", "text": self.text()}]),
                };
                json!({"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                    "stop_reason": reason, "stop_sequence": seq,
                    "usage": {"input_tokens": self.prompt_tokens, "cache_read_input_tokens": self.cached_tokens,
                        "output_tokens": self.completion_tokens}})
            }
            Endpoint::Completions => {
                json!({"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [{"index": 0, "text": self.text(), "logprobs": null,
                "finish_reason": self.openai_finish()}], "usage": self.usage_openai()})
            }
            _ => {
                let message = match &self.tool_call {
                    Some(tc) => {
                        json!({"role": "assistant", "content": null, "refusal": null, "tool_calls": [
                        {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}]})
                    }
                    None => json!({"role": "assistant", "content": self.text(), "refusal": null}),
                };
                json!({"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": self.openai_finish()}],
                    "usage": self.usage_openai()})
            }
        }
    }
}

fn anthropic_event(name: &str, data: Value) -> SseEvent {
    SseEvent::new(Some(name), &data.to_string())
}

/// Anthropic's `count_tokens` answer.
pub fn count_tokens_body(req: &SimRequest) -> Value {
    json!({"input_tokens": req.prompt_tokens})
}
