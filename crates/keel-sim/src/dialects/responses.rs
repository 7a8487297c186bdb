//! The OpenAI Responses API (`POST /v1/responses`, stateless: nothing is stored, so
//! `previous_response_id` is refused), read as OpenAI Chat Completions.
//!
//! Requests: `input` (a string, or items: messages with `input_text`/`output_text`/
//! `input_image` parts, `function_call`, `function_call_output`), `instructions`, function
//! `tools`, `tool_choice`, `max_output_tokens`, sampling, `text.format`. A trailing assistant
//! message is continued as a prefill (`continue_final_message`). Answers: a `response` object
//! whose `output` holds a `message` item or a `function_call` item; streams are named events
//! with a `sequence_number` (response.created … response.completed, or response.incomplete
//! when the output limit cut the answer).

use serde_json::{json, Map, Value};

use crate::text::Finish;
use crate::wire::{Piece, Reply};

use super::HubRequest;

pub fn to_hub(obj: &Map<String, Value>) -> Result<HubRequest, String> {
    if let Some(id) = obj.get("previous_response_id").and_then(Value::as_str) {
        return Err(format!("Previous response with id '{id}' not found."));
    }
    let mut messages: Vec<Value> = Vec::new();
    if let Some(i) = obj.get("instructions").and_then(Value::as_str) {
        messages.push(json!({"role": "system", "content": i}));
    }
    match obj.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                match kind {
                    "message" => {
                        let role = item
                            .get("role")
                            .and_then(Value::as_str)
                            .ok_or(format!("input[{i}].role: required"))?;
                        messages
                            .push(json!({"role": role, "content": content(item.get("content"))}));
                    }
                    "function_call" => {
                        let call = json!({"id": item.get("call_id"), "type": "function", "function": {
                            "name": item.get("name"), "arguments": item.get("arguments").cloned().unwrap_or(json!("{}"))}});
                        match messages.last_mut() {
                            Some(m) if m["role"] == "assistant" => {
                                match m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                                    Some(calls) => calls.push(call),
                                    None => m["tool_calls"] = json!([call]),
                                }
                            }
                            _ => messages.push(
                                json!({"role": "assistant", "content": null, "tool_calls": [call]}),
                            ),
                        }
                    }
                    "function_call_output" => {
                        let output = match item.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            Some(other) => content_text(other),
                            None => String::new(),
                        };
                        messages.push(json!({"role": "tool", "tool_call_id": item.get("call_id"), "content": output}));
                    }
                    "reasoning" => {}
                    other => {
                        return Err(format!(
                            "input[{i}].type: `{other}` is not supported by this server"
                        ))
                    }
                }
            }
        }
        _ => return Err("Missing required parameter: 'input'.".into()),
    }
    let mut hub = Map::new();
    hub.insert(
        "model".into(),
        obj.get("model")
            .cloned()
            .ok_or("Missing required parameter: 'model'.")?,
    );
    if messages.last().is_some_and(|m| m["role"] == "assistant") {
        hub.insert("continue_final_message".into(), json!(true));
        hub.insert("add_generation_prompt".into(), json!(false));
    }
    hub.insert("messages".into(), Value::Array(messages));
    if let Some(n) = obj.get("max_output_tokens") {
        hub.insert("max_completion_tokens".into(), n.clone());
    }
    for k in ["temperature", "top_p", "stream"] {
        if let Some(v) = obj.get(k) {
            hub.insert(k.into(), v.clone());
        }
    }
    let mut tools = Vec::new();
    for (i, t) in obj
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {
                let mut f = json!({"name": t.get("name"),
                    "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"}))});
                if let Some(d) = t.get("description") {
                    f["description"] = d.clone();
                }
                tools.push(json!({"type": "function", "function": f}));
            }
            other => {
                return Err(format!(
                    "tools[{i}].type: {} is not supported by this server",
                    other.unwrap_or("(missing)")
                ))
            }
        }
    }
    if !tools.is_empty() {
        hub.insert("tools".into(), Value::Array(tools));
    }
    match obj.get("tool_choice") {
        Some(Value::String(s)) => {
            hub.insert("tool_choice".into(), json!(s));
        }
        Some(c) if c.get("type").and_then(Value::as_str) == Some("function") => {
            hub.insert(
                "tool_choice".into(),
                json!({"type": "function", "function": {"name": c.get("name")}}),
            );
        }
        _ => {}
    }
    match obj
        .get("text")
        .and_then(|t| t.pointer("/format/type"))
        .and_then(Value::as_str)
    {
        Some("json_schema") => {
            let f = &obj["text"]["format"];
            hub.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": {"name": f.get("name"),
                    "schema": f.get("schema").cloned().unwrap_or(json!({"type": "object"}))}}),
            );
        }
        Some("json_object") => {
            hub.insert("response_format".into(), json!({"type": "json_object"}));
        }
        _ => {}
    }
    Ok(HubRequest {
        body: Value::Object(hub),
        schema: None,
    })
}

/// A message item's content as Chat content parts.
fn content(c: Option<&Value>) -> Value {
    match c {
        Some(Value::Array(parts)) => Value::Array(
            parts
                .iter()
                .map(|p| match p.get("type").and_then(Value::as_str) {
                    Some("input_image") => {
                        json!({"type": "image_url", "image_url": {"url": p.get("image_url")}})
                    }
                    Some("input_text" | "output_text" | "text") => {
                        json!({"type": "text", "text": p.get("text")})
                    }
                    Some(other) => json!({ "type": other }),
                    None => json!({"type": "text", "text": p.get("text")}),
                })
                .collect(),
        ),
        Some(v) => v.clone(),
        None => Value::Null,
    }
}

fn content_text(v: &Value) -> String {
    super::text_of(v)
}

fn ids(reply: &Reply) -> (String, String) {
    let hex = super::id_hex(reply);
    let item = if reply.tool_call.is_some() {
        format!("fc_{hex}")
    } else {
        format!("msg_{hex}")
    };
    (format!("resp_{hex}"), item)
}

fn incomplete(reply: &Reply) -> bool {
    reply.tool_call.is_none() && matches!(reply.finish, Finish::Length | Finish::Refusal)
}

/// Why an incomplete answer stopped.
fn incomplete_reason(reply: &Reply) -> &'static str {
    if reply.finish == Finish::Refusal {
        "content_filter"
    } else {
        "max_output_tokens"
    }
}

/// The output item, finished (`done`) or as first announced.
fn item(reply: &Reply, done: bool) -> Value {
    let (_, id) = ids(reply);
    let status = match (done, incomplete(reply)) {
        (false, _) => "in_progress",
        (true, true) => "incomplete",
        (true, false) => "completed",
    };
    match &reply.tool_call {
        Some(tc) => json!({"type": "function_call", "id": id, "call_id": tc.id, "name": tc.name,
            "arguments": if done { tc.arguments.as_str() } else { "" }, "status": status}),
        None => {
            let content = if done {
                json!([{"type": "output_text", "text": reply.text(), "annotations": [], "logprobs": []}])
            } else {
                json!([])
            };
            json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
        }
    }
}

fn usage(reply: &Reply) -> Value {
    json!({"input_tokens": reply.prompt_tokens,
        "input_tokens_details": {"cached_tokens": reply.cached_tokens},
        "output_tokens": reply.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": reply.prompt_tokens + reply.completion_tokens})
}

/// The response object: in progress (no output yet) or final.
fn response(reply: &Reply, done: bool) -> Value {
    let (id, _) = ids(reply);
    let status = match (done, incomplete(reply)) {
        (false, _) => "in_progress",
        (true, true) => "incomplete",
        (true, false) => "completed",
    };
    json!({"id": id, "object": "response", "created_at": reply.created, "status": status,
        "error": null,
        "incomplete_details": if done && incomplete(reply) { json!({"reason": incomplete_reason(reply)}) } else { Value::Null },
        "instructions": null, "max_output_tokens": null, "model": reply.model,
        "output": if done { json!([item(reply, true)]) } else { json!([]) },
        "parallel_tool_calls": true, "previous_response_id": null,
        "reasoning": {"effort": null, "summary": null}, "store": false,
        "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
        "tools": [], "top_p": 1.0, "truncation": "disabled",
        "usage": if done { usage(reply) } else { Value::Null },
        "user": null, "metadata": {}})
}

pub fn whole(reply: &Reply) -> Value {
    response(reply, true)
}

fn event(seq: &mut u64, name: &str, mut data: Value) -> Vec<u8> {
    data["type"] = json!(name);
    data["sequence_number"] = json!(*seq);
    *seq += 1;
    format!("event: {name}\ndata: {data}\n\n").into_bytes()
}

pub fn head(reply: &Reply, seq: &mut u64) -> Vec<u8> {
    let (_, item_id) = ids(reply);
    let mut out = event(
        seq,
        "response.created",
        json!({"response": response(reply, false)}),
    );
    out.extend(event(
        seq,
        "response.in_progress",
        json!({"response": response(reply, false)}),
    ));
    out.extend(event(
        seq,
        "response.output_item.added",
        json!({"output_index": 0, "item": item(reply, false)}),
    ));
    if reply.tool_call.is_none() {
        out.extend(event(
            seq,
            "response.content_part.added",
            json!({"item_id": item_id,
            "output_index": 0, "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
        ));
    }
    out
}

pub fn piece(reply: &Reply, piece: &Piece, seq: &mut u64) -> Vec<u8> {
    let (_, item_id) = ids(reply);
    match piece {
        Piece::Text(t) => event(
            seq,
            "response.output_text.delta",
            json!({"item_id": item_id,
            "output_index": 0, "content_index": 0, "delta": t, "logprobs": []}),
        ),
        Piece::ToolArgs(a) => event(
            seq,
            "response.function_call_arguments.delta",
            json!({"item_id": item_id, "output_index": 0, "delta": a}),
        ),
    }
}

pub fn tail(reply: &Reply, seq: &mut u64) -> Vec<u8> {
    let (_, item_id) = ids(reply);
    let mut out = Vec::new();
    match &reply.tool_call {
        Some(tc) => out.extend(event(
            seq,
            "response.function_call_arguments.done",
            json!({"item_id": item_id, "output_index": 0, "arguments": tc.arguments}),
        )),
        None => {
            let text = reply.text();
            out.extend(event(
                seq,
                "response.output_text.done",
                json!({"item_id": item_id,
                "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
            ));
            out.extend(event(
                seq,
                "response.content_part.done",
                json!({"item_id": item_id,
                "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}}),
            ));
        }
    }
    out.extend(event(
        seq,
        "response.output_item.done",
        json!({"output_index": 0, "item": item(reply, true)}),
    ));
    let last = if incomplete(reply) {
        "response.incomplete"
    } else {
        "response.completed"
    };
    out.extend(event(seq, last, json!({"response": response(reply, true)})));
    out
}

/// The `error` event a stream ends with on an error.
pub fn error_event(status: u16, message: &str, seq: &mut u64) -> Vec<u8> {
    let code = match status {
        429 => "rate_limit_exceeded",
        503 | 529 => "server_is_overloaded",
        _ => "server_error",
    };
    event(
        seq,
        "error",
        json!({"code": code, "message": message, "param": null}),
    )
}
