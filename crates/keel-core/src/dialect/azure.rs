//! Azure OpenAI's Chat Completions: OpenAI's protocol with Azure's content-filter annotations.
//!
//! Requests and error bodies are OpenAI's (Azure's `retry-after-ms` header is read by the
//! gateway). Answers carry what OpenAI's never do, and a strict OpenAI client may choke on:
//!
//! - a first chunk with no choices and no usage, only `prompt_filter_results` (and an empty
//!   `id`, `model` and `object`): dropped;
//! - `content_filter_results` on every choice, `prompt_filter_results` beside the choices,
//!   `content_filter_offsets` on the annotation chunks of the asynchronous filter: removed;
//! - an annotation chunk whose choices, once the annotations are gone, say nothing (no delta,
//!   no finish reason): dropped, as OpenAI never sends a choice without a delta.
//!
//! Everything else passes byte for byte, `[DONE]` included. `finish_reason: "content_filter"`
//! stays: it is OpenAI's own word for a finished answer the filter cut.

use serde_json::{Map, Value};

use super::{push_event, StreamToHub};
use crate::sse::{SseDecoder, SseEvent};

/// Top-level fields of Azure's answers that OpenAI's do not have.
const ANSWER_FIELDS: &[&str] = &["prompt_filter_results", "prompt_annotations"];
/// Per-choice fields of Azure's answers that OpenAI's do not have.
const CHOICE_FIELDS: &[&str] = &["content_filter_results", "content_filter_offsets"];

/// Removes Azure's annotations from a chunk or an answer; true when any was there.
fn strip(v: &mut Map<String, Value>) -> bool {
    let mut changed = false;
    for f in ANSWER_FIELDS {
        changed |= v.remove(*f).is_some();
    }
    if let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) {
        for c in choices.iter_mut().filter_map(Value::as_object_mut) {
            for f in CHOICE_FIELDS {
                changed |= c.remove(*f).is_some();
            }
        }
    }
    changed
}

/// A whole Azure answer → OpenAI's: the annotations removed.
pub fn whole(body: &[u8]) -> Result<Vec<u8>, String> {
    let mut v: Map<String, Value> = serde_json::from_slice(body)
        .map_err(|e| format!("an Azure answer is not a JSON object: {e}"))?;
    if !strip(&mut v) {
        return Ok(body.to_vec());
    }
    Ok(serde_json::to_vec(&Value::Object(v)).unwrap_or_default())
}

/// An Azure chat stream → OpenAI's (see the module's notes).
#[derive(Debug, Default)]
pub struct Stream {
    decoder: SseDecoder,
    events: Vec<SseEvent>,
}

impl Stream {
    pub fn new() -> Stream {
        Stream::default()
    }
}

/// What becomes of one Azure chunk.
enum Chunk {
    Keep,
    Drop,
    Rewrite(Value),
}

fn read_chunk(data: &str) -> Result<Chunk, String> {
    // Most chunks carry an annotation; one scan spares parsing the rest.
    let annotated = ANSWER_FIELDS
        .iter()
        .chain(CHOICE_FIELDS)
        .any(|f| data.contains(f));
    let cheap_empty = data.contains("\"choices\":[]") || data.contains("\"choices\": []");
    if !annotated && !cheap_empty {
        return Ok(Chunk::Keep);
    }
    let mut v: Map<String, Value> = serde_json::from_str(data)
        .map_err(|e| format!("an Azure stream chunk is not a JSON object: {e}"))?;
    if v.get("error").is_some_and(|e| !e.is_null()) {
        return Ok(Chunk::Keep);
    }
    let changed = strip(&mut v);
    let has_usage = v.get("usage").is_some_and(|u| !u.is_null());
    let says_something = |c: &Value| {
        c.get("delta").is_some_and(|d| !d.is_null())
            || c.get("finish_reason").is_some_and(|f| !f.is_null())
            || c.get("logprobs").is_some_and(|l| !l.is_null())
    };
    let choices = v.get("choices").and_then(Value::as_array);
    let silent = choices.is_none_or(|c| !c.iter().any(says_something));
    if silent && !has_usage {
        return Ok(Chunk::Drop);
    }
    Ok(if changed {
        Chunk::Rewrite(Value::Object(v))
    } else {
        Chunk::Keep
    })
}

impl Stream {
    /// Passes one event on, or not. `complete`: the event's raw bytes end with its blank line
    /// (every event but one the body's end completed).
    fn pass(ev: &SseEvent, complete: bool, out: &mut Vec<u8>) -> Result<(), String> {
        let chunk = if ev.comment_only || ev.data.trim() == "[DONE]" {
            Chunk::Keep
        } else {
            read_chunk(&ev.data)?
        };
        match chunk {
            Chunk::Keep if complete => out.extend_from_slice(&ev.raw),
            Chunk::Keep if ev.comment_only => out.extend_from_slice(&ev.raw),
            Chunk::Keep => out.extend_from_slice(&SseEvent::new(ev.event.as_deref(), &ev.data).raw),
            Chunk::Drop => {}
            Chunk::Rewrite(v) => push_event(out, ev.event.as_deref(), &v),
        }
        Ok(())
    }
}

impl StreamToHub for Stream {
    fn feed(&mut self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        self.decoder
            .feed(chunk, &mut self.events)
            .map_err(|e| e.to_string())?;
        for ev in self.events.drain(..) {
            Stream::pass(&ev, true, out)?;
        }
        Ok(())
    }

    fn end(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        // A last event the body's end completed: passed on; a partial one: the stream was
        // cut, which the reader sees from the missing `[DONE]`.
        let mut events = Vec::new();
        if self.decoder.end(&mut events).is_ok() {
            for ev in events {
                Stream::pass(&ev, false, out)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "tests/azure.rs"]
mod tests;
