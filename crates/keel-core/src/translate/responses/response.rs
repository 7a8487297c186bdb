//! A whole Chat completion → a Response object.

use crate::members::Members;
use serde_json::{json, Value};

use super::{
    function_call_item, message_item, reasoning_item, response_object, text_part, Ending,
    ResponseIds, ResponsesContext,
};

/// Translates a `chat.completion` body (the first choice) into a Response object.
pub fn chat_completion_to_response(
    chat: &Value,
    ctx: &ResponsesContext,
    ids: &ResponseIds,
) -> Value {
    let named;
    let ids = if ids.model.is_empty() {
        named = ResponseIds {
            model: chat["model"].as_str().unwrap_or_default().to_owned(),
            ..ids.clone()
        };
        &named
    } else {
        ids
    };
    let choice = chat.pointer("/choices/0");
    let message = choice.and_then(|c| c.member("message"));
    let str_at = |k: &str| message.and_then(|m| m.get(k)).and_then(Value::as_str);
    let mut output = Vec::new();
    if let Some(r) = str_at("reasoning_content").filter(|r| !r.is_empty()) {
        output.push(reasoning_item(ids.item("rs", output.len()), "completed", r));
    }
    let mut content = Vec::new();
    if let Some(t) = str_at("content").filter(|t| !t.is_empty()) {
        content.push(text_part(t));
    }
    if let Some(r) = str_at("refusal").filter(|r| !r.is_empty()) {
        content.push(json!({"type": "refusal", "refusal": r}));
    }
    if !content.is_empty() {
        output.push(message_item(
            ids.item("msg", output.len()),
            "completed",
            content,
        ));
    }
    let calls = message
        .and_then(|m| m.member("tool_calls"))
        .and_then(Value::as_array);
    for call in calls.into_iter().flatten() {
        let s = |p: &str| call.pointer(p).and_then(Value::as_str).unwrap_or("");
        output.push(function_call_item(
            ids.item("fc", output.len()),
            "completed",
            s("/id"),
            s("/function/name"),
            s("/function/arguments"),
        ));
    }
    let finish = choice
        .and_then(|c| c.member("finish_reason"))
        .and_then(Value::as_str);
    response_object(
        ctx,
        ids,
        Some(Ending::of_finish(finish)),
        output,
        chat.member("usage").filter(|u| u.is_object()),
    )
}
