//! Restoring masked values in a streamed answer, event by event, in the client's protocol.
//!
//! Text deltas (OpenAI `choices[0].delta.content`, Anthropic `text_delta`) and tool-call
//! argument deltas (OpenAI `delta.tool_calls[i].function.arguments`, Anthropic
//! `input_json_delta`) each go through their own [`Restorer`]: a placeholder split across
//! events is held back (at most the longest placeholder less one byte) and emitted whole,
//! restored, with the event that completes it. Held text is flushed before the event that ends
//! its channel (OpenAI: the chunk with a `finish_reason`, or `[DONE]`; Anthropic:
//! `content_block_stop`), so nothing is lost. Every other event passes through unchanged:
//! errors, comments, usage, a refusal.
//!
//! The restorer sits after stitching: what keel delivered upstream-side (the continuation's
//! prefill after a migration, the cache's copy) stays in the masked form.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::answer::Redactor;
use super::mask::{Counts, Masker, Restorer};
use super::policy::Policy;
use super::Guard;
use crate::members::Members;
use crate::protocol::Protocol;
use crate::sse::SseEvent;

/// What one request's answer is treated with: its placeholder map, and the answer policy with
/// its detectors; the answer direction's findings are counted in `counts`.
pub struct Answering<'a> {
    pub masker: &'a Masker,
    pub guard: &'a Guard,
    pub policy: &'a Policy,
    pub counts: &'a mut Counts,
}

impl Answering<'_> {
    fn active(&self) -> bool {
        !self.masker.is_empty() || !self.policy.is_empty()
    }
}

/// One channel of text (a text block, a tool call's arguments): answer redaction on the
/// upstream's form, then restoring.
#[derive(Debug, Default)]
struct Channel {
    redactor: Redactor,
    restorer: Restorer,
}

impl Channel {
    fn json() -> Channel {
        Channel {
            redactor: Redactor::default(),
            restorer: Restorer::json(),
        }
    }

    fn push(&mut self, a: &mut Answering, delta: &str) -> String {
        let clear = if a.policy.is_empty() {
            delta.to_owned()
        } else {
            self.redactor.push(a.guard, a.policy, delta, a.counts)
        };
        self.restorer.push(a.masker, &clear)
    }

    fn finish(&mut self, a: &mut Answering) -> String {
        let clear = self.redactor.finish(a.guard, a.policy, a.counts);
        let mut out = self.restorer.push(a.masker, &clear);
        out.push_str(&self.restorer.finish(a.masker));
        out
    }

    fn held(&self) -> usize {
        self.redactor.held() + self.restorer.held()
    }
}

/// One stream's channels.
#[derive(Debug)]
pub struct StreamRestorer {
    protocol: Protocol,
    /// OpenAI: the text of choice 0. Anthropic: text blocks by index.
    text: BTreeMap<u64, Channel>,
    /// Tool-call arguments: OpenAI by tool-call index, Anthropic by block index.
    args: BTreeMap<u64, Channel>,
}

impl StreamRestorer {
    pub fn new(protocol: Protocol) -> StreamRestorer {
        StreamRestorer {
            protocol,
            text: BTreeMap::new(),
            args: BTreeMap::new(),
        }
    }

    /// Bytes held back now, over every channel.
    pub fn held(&self) -> usize {
        self.text
            .values()
            .chain(self.args.values())
            .map(Channel::held)
            .sum()
    }

    /// Appends the client's bytes for upstream event `ev` to `out`.
    pub fn event(&mut self, a: &mut Answering, ev: &SseEvent, out: &mut Vec<u8>) {
        if ev.comment_only || !a.active() {
            out.extend_from_slice(&ev.raw);
            return;
        }
        match self.protocol {
            Protocol::OpenAi => self.openai(a, ev, out),
            Protocol::Anthropic => self.anthropic(a, ev, out),
        }
    }

    fn openai(&mut self, a: &mut Answering, ev: &SseEvent, out: &mut Vec<u8>) {
        if ev.data == "[DONE]" {
            self.openai_flush(a, out);
            out.extend_from_slice(&ev.raw);
            return;
        }
        let Ok(Value::Object(mut v)) = serde_json::from_str::<Value>(&ev.data) else {
            out.extend_from_slice(&ev.raw);
            return;
        };
        let Some(choice) = v
            .member_mut("choices")
            .and_then(|c| c.get_mut(0))
            .and_then(Value::as_object_mut)
        else {
            out.extend_from_slice(&ev.raw);
            return;
        };
        let finishing = choice.member("finish_reason").is_some_and(|f| !f.is_null());
        // Each choice (`n` > 1) is a channel of its own.
        let ci = choice.member("index").and_then(Value::as_u64).unwrap_or(0);
        let Some(delta) = choice.member_mut("delta").and_then(Value::as_object_mut) else {
            out.extend_from_slice(&ev.raw);
            return;
        };
        let mut changed = false;
        if let Some(Value::String(t)) = delta.member_mut("content") {
            let r = self.text.entry(ci).or_default();
            let mut s = r.push(a, t);
            if finishing {
                s.push_str(&r.finish(a));
            }
            changed |= s != *t;
            *t = s;
        } else if finishing {
            let held = self.text.entry(ci).or_default().finish(a);
            if !held.is_empty() {
                delta.insert("content".into(), Value::String(held));
                changed = true;
            }
        }
        if let Some(Value::Array(calls)) = delta.member_mut("tool_calls") {
            for call in calls.iter_mut() {
                let i = call.member("index").and_then(Value::as_u64).unwrap_or(0);
                let args = call
                    .member_mut("function")
                    .and_then(|f| f.member_mut("arguments"));
                if let Some(Value::String(args)) = args {
                    let r = self
                        .args
                        .entry(call_key(ci, i))
                        .or_insert_with(Channel::json);
                    let mut s = r.push(a, args);
                    if finishing {
                        s.push_str(&r.finish(a));
                    }
                    changed |= s != *args;
                    *args = s;
                }
            }
        }
        if finishing {
            changed |= self.openai_flush_args(a, ci, delta);
        }
        if changed {
            out.extend_from_slice(
                &SseEvent::new(ev.event.as_deref(), &Value::Object(v).to_string()).raw,
            );
        } else {
            out.extend_from_slice(&ev.raw);
        }
    }

    /// Choice `ci`'s tool-call arguments still held when it finishes: added to its last delta.
    fn openai_flush_args(
        &mut self,
        a: &mut Answering,
        ci: u64,
        delta: &mut Map<String, Value>,
    ) -> bool {
        let mut extra = Vec::new();
        for (key, r) in self
            .args
            .range_mut(call_key(ci, 0)..=call_key(ci, u64::from(u32::MAX)))
        {
            let held = r.finish(a);
            if !held.is_empty() {
                let i = key & u64::from(u32::MAX);
                extra.push(json!({"index": i, "function": {"arguments": held}}));
            }
        }
        if extra.is_empty() {
            return false;
        }
        match delta.member_mut("tool_calls") {
            Some(Value::Array(calls)) => calls.extend(extra),
            _ => {
                delta.insert("tool_calls".into(), Value::Array(extra));
            }
        }
        true
    }

    /// Whatever is still held when the stream ends without a finishing chunk.
    fn openai_flush(&mut self, a: &mut Answering, out: &mut Vec<u8>) {
        let mut choices: Vec<u64> = self.text.keys().copied().collect();
        choices.extend(self.args.keys().map(|k| k >> 32));
        choices.sort_unstable();
        choices.dedup();
        for ci in choices {
            let text = self.text.entry(ci).or_default().finish(a);
            let mut delta = Map::new();
            if !text.is_empty() {
                delta.insert("content".into(), Value::String(text));
            }
            self.openai_flush_args(a, ci, &mut delta);
            if !delta.is_empty() {
                let chunk = json!({"object": "chat.completion.chunk", "choices": [{"index": ci, "delta": delta, "finish_reason": null}]});
                out.extend_from_slice(&SseEvent::new(None, &chunk.to_string()).raw);
            }
        }
    }

    fn anthropic(&mut self, a: &mut Answering, ev: &SseEvent, out: &mut Vec<u8>) {
        match ev.event.as_deref() {
            Some("content_block_delta") => {}
            Some("content_block_stop") => {
                if let Some(i) = block_index(&ev.data) {
                    self.anthropic_flush(a, i, out);
                }
                out.extend_from_slice(&ev.raw);
                return;
            }
            Some("message_stop") | Some("message_delta") => {
                let open: Vec<u64> = self.text.keys().chain(self.args.keys()).copied().collect();
                for i in open {
                    self.anthropic_flush(a, i, out);
                }
                out.extend_from_slice(&ev.raw);
                return;
            }
            _ => {
                out.extend_from_slice(&ev.raw);
                return;
            }
        }
        let Ok(Value::Object(mut v)) = serde_json::from_str::<Value>(&ev.data) else {
            out.extend_from_slice(&ev.raw);
            return;
        };
        let i = v.member("index").and_then(Value::as_u64).unwrap_or(0);
        let Some(delta) = v.member_mut("delta").and_then(Value::as_object_mut) else {
            out.extend_from_slice(&ev.raw);
            return;
        };
        let (field, r) = match delta.member("type").and_then(Value::as_str) {
            Some("text_delta") => ("text", self.text.entry(i).or_default()),
            Some("input_json_delta") => (
                "partial_json",
                self.args.entry(i).or_insert_with(Channel::json),
            ),
            _ => {
                out.extend_from_slice(&ev.raw);
                return;
            }
        };
        let Some(Value::String(t)) = delta.get_mut(field) else {
            out.extend_from_slice(&ev.raw);
            return;
        };
        let s = r.push(a, t);
        if s == *t {
            out.extend_from_slice(&ev.raw);
            return;
        }
        *t = s;
        out.extend_from_slice(
            &SseEvent::new(ev.event.as_deref(), &Value::Object(v).to_string()).raw,
        );
    }

    /// A block's held text, as one more delta of that block.
    fn anthropic_flush(&mut self, a: &mut Answering, i: u64, out: &mut Vec<u8>) {
        let mut flush = |r: Option<Channel>, kind: &str, field: &str, out: &mut Vec<u8>| {
            let Some(mut r) = r else { return };
            let held = r.finish(a);
            if held.is_empty() {
                return;
            }
            let data = json!({"type": "content_block_delta", "index": i, "delta": {"type": kind, field: held}});
            out.extend_from_slice(
                &SseEvent::new(Some("content_block_delta"), &data.to_string()).raw,
            );
        };
        flush(self.text.remove(&i), "text_delta", "text", out);
        flush(
            self.args.remove(&i),
            "input_json_delta",
            "partial_json",
            out,
        );
    }
}

/// The channel key of choice `ci`'s tool call `i` (a choice index above 2^32 is no real one).
fn call_key(ci: u64, i: u64) -> u64 {
    (ci.min(u64::from(u32::MAX)) << 32) | i.min(u64::from(u32::MAX))
}

fn block_index(data: &str) -> Option<u64> {
    serde_json::from_str::<Value>(data)
        .ok()?
        .member("index")
        .and_then(Value::as_u64)
}
