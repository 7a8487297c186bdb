//! Azure OpenAI: Chat Completions at `/openai/deployments/{deployment}/chat/completions?api-version=…`
//! (the deployment names the model) and `/openai/v1/chat/completions` (the model in the body),
//! with Azure's additions to OpenAI's answers: a first stream chunk with empty `choices` and the
//! prompt's `prompt_filter_results`, `content_filter_results` on every choice, and errors shaped
//! `{"error": {"code": "429", "message": …}}`.

use serde_json::{json, Map, Value};

use super::{HubRequest, Route};
use crate::wire::{Piece, Reply};

pub fn to_hub(route: &Route, obj: &Map<String, Value>) -> Result<HubRequest, String> {
    let mut hub = obj.clone();
    if let Some(deployment) = &route.model {
        hub.insert("model".into(), json!(deployment));
    }
    Ok(HubRequest {
        body: Value::Object(hub),
        schema: None,
    })
}

fn filters() -> Value {
    let safe = json!({"filtered": false, "severity": "safe"});
    json!({"hate": safe, "self_harm": safe, "sexual": safe, "violence": safe})
}

fn prompt_filter_results() -> Value {
    json!([{"prompt_index": 0, "content_filter_results": filters()}])
}

/// OpenAI chunks with Azure's `content_filter_results` on each choice.
fn with_filters(events: Vec<keel_core::sse::SseEvent>, filtered: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for e in events {
        match serde_json::from_str::<Value>(&e.data) {
            Ok(mut v) => {
                if let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) {
                    for c in choices {
                        c["content_filter_results"] = if filtered { filters() } else { json!({}) };
                    }
                }
                out.extend(format!("data: {v}\n\n").into_bytes());
            }
            Err(_) => out.extend(e.raw),
        }
    }
    out
}

pub fn head(reply: &Reply) -> Vec<u8> {
    let first = json!({"choices": [], "created": 0, "id": "", "model": "", "object": "",
        "prompt_filter_results": prompt_filter_results()});
    let mut out = format!("data: {first}\n\n").into_bytes();
    out.extend(with_filters(reply.stream_head(), false));
    out
}

pub fn piece(reply: &Reply, piece: &Piece) -> Vec<u8> {
    with_filters(vec![reply.stream_piece(piece)], true)
}

pub fn tail(reply: &Reply) -> Vec<u8> {
    with_filters(reply.stream_tail(), false)
}

pub fn whole(reply: &Reply) -> Value {
    let mut v = reply.body();
    v["prompt_filter_results"] = prompt_filter_results();
    if let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) {
        for c in choices {
            c["content_filter_results"] = filters();
        }
    }
    v
}

/// Azure's error body: the status as a string code (or the name Azure gives it).
pub fn error_body(status: u16, message: &str) -> Value {
    match status {
        400 => {
            json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}})
        }
        404 => json!({"error": {"code": "DeploymentNotFound", "message": message}}),
        _ => json!({"error": {"code": status.to_string(), "message": message}}),
    }
}
