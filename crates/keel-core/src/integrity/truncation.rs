//! Watching one segment of a stream for a stop for length, so that keel can continue the answer
//! instead of letting it end (see the parent module for when an answer counts as truncated).
//!
//! The events that close a stream (OpenAI: the chunk with `finish_reason: "length"`, the usage
//! chunk, `[DONE]`; Anthropic: `content_block_stop`, `message_delta` with `stop_reason:
//! "max_tokens"`, `message_stop`) are **held** instead of forwarded until the terminal event
//! shows how the segment ended. A segment that ended otherwise gets them released unchanged; a
//! truncated one is continued, and the client never sees its ending (an Anthropic text block
//! left open is continued by the next segment's text, see `continuation::Stitcher`). Any other
//! event arriving while holding releases what is held. At most [`MAX_HELD`] events are held;
//! more release everything and stop watching (the bound on what an upstream can make keel keep).

use serde_json::Value;

use crate::protocol::{ChunkView, Protocol};
use crate::sse::SseEvent;

/// Events held at most while waiting for a stream's end.
pub const MAX_HELD: usize = 16;

/// What to do with an event.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// Forward these, in order.
    Pass(Vec<SseEvent>),
    /// Kept for now.
    Held,
    /// The terminal event of a segment that stopped for length: `held` is its ending (the
    /// terminal event last). The caller decides with [`TruncationWatch::reported_output`]
    /// whether the answer is truncated; if it is not, `held` is forwarded as it is.
    LengthStop(Vec<SseEvent>),
}

/// Per-segment watch state.
#[derive(Debug)]
pub struct TruncationWatch {
    protocol: Protocol,
    held: Vec<SseEvent>,
    /// The segment stopped for length (seen in a held event).
    length_stop: bool,
    /// Output tokens the upstream reported for this segment.
    reported: Option<u64>,
    tool_call: bool,
    /// Gave up watching (too much to hold).
    off: bool,
}

impl TruncationWatch {
    pub fn new(protocol: Protocol) -> Self {
        TruncationWatch {
            protocol,
            held: Vec::new(),
            length_stop: false,
            reported: None,
            tool_call: false,
            off: false,
        }
    }

    /// Output tokens of this segment as its upstream reported them, if it did.
    pub fn reported_output(&self) -> Option<u64> {
        self.reported
    }

    /// Whether the segment carried a tool call (a cut tool call is never continued as text).
    pub fn saw_tool_call(&self) -> bool {
        self.tool_call
    }

    /// Takes one event (`terminal`: the stream's last).
    pub fn push(&mut self, ev: SseEvent, terminal: bool) -> Step {
        if self.off {
            return Step::Pass(vec![ev]);
        }
        let holds = match self.protocol {
            Protocol::OpenAi => self.openai(&ev, terminal),
            Protocol::Anthropic => self.anthropic(&ev, terminal),
        };
        if !holds {
            let mut out = std::mem::take(&mut self.held);
            out.push(ev);
            // Only an ending for length is ever a candidate; anything else resets the watch.
            self.length_stop = false;
            return Step::Pass(out);
        }
        self.held.push(ev);
        if terminal {
            return Step::LengthStop(std::mem::take(&mut self.held));
        }
        if self.held.len() > MAX_HELD {
            self.off = true;
            return Step::Pass(std::mem::take(&mut self.held));
        }
        Step::Held
    }

    /// Whether an OpenAI event is held.
    fn openai(&mut self, ev: &SseEvent, terminal: bool) -> bool {
        if terminal || ev.comment_only {
            return self.length_stop;
        }
        let view = ChunkView::parse(&ev.data);
        if view.as_ref().is_some_and(ChunkView::starts_tool_call) {
            self.tool_call = true;
        }
        let finishing = view.as_ref().is_some_and(ChunkView::finished);
        let usage = ev.data.contains("\"usage\"");
        if !(finishing || usage) {
            return self.length_stop && view.is_some_and(|v| !v.has_output());
        }
        let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
            return false;
        };
        if let Some(n) = v
            .pointer("/usage/completion_tokens")
            .and_then(Value::as_u64)
        {
            self.reported = Some(n);
        }
        if finishing {
            self.length_stop = v
                .pointer("/choices/0/finish_reason")
                .and_then(Value::as_str)
                == Some("length");
        }
        self.length_stop
    }

    /// Whether an Anthropic event is held.
    fn anthropic(&mut self, ev: &SseEvent, terminal: bool) -> bool {
        match ev.event.as_deref().unwrap_or("") {
            "message_stop" if terminal => self.length_stop,
            // Held until the message's end shows why the block stopped.
            "content_block_stop" => true,
            "ping" => !self.held.is_empty(),
            "message_delta" => {
                let v: Value = serde_json::from_str(&ev.data).unwrap_or(Value::Null);
                if let Some(n) = v.pointer("/usage/output_tokens").and_then(Value::as_u64) {
                    self.reported = Some(n);
                }
                self.length_stop =
                    v.pointer("/delta/stop_reason").and_then(Value::as_str) == Some("max_tokens");
                self.length_stop
            }
            "content_block_start" => {
                if ev.data.contains("\"tool_use\"") {
                    self.tool_call = true;
                }
                false
            }
            _ => false,
        }
    }
}

/// What of a truncated segment's held ending still goes to the client before the
/// continuation: text a closing OpenAI chunk carried, without its `finish_reason` and usage
/// (the answer goes on). Anthropic endings carry no text.
pub fn text_of_ending(protocol: Protocol, held: &[SseEvent]) -> Vec<SseEvent> {
    if protocol != Protocol::OpenAi {
        return Vec::new();
    }
    held.iter()
        .filter_map(|ev| {
            let text = ChunkView::parse(&ev.data)?.text().map(str::to_owned)?;
            if text.is_empty() {
                return None;
            }
            let mut v: Value = serde_json::from_str(&ev.data).ok()?;
            let obj = v.as_object_mut()?;
            obj.remove("usage");
            let choice = obj.get_mut("choices")?.get_mut(0)?.as_object_mut()?;
            choice.insert("finish_reason".into(), Value::Null);
            Some(SseEvent::new(None, &v.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn oa(v: Value) -> SseEvent {
        SseEvent::new(None, &v.to_string())
    }
    fn an(name: &str, v: Value) -> SseEvent {
        SseEvent::new(Some(name), &v.to_string())
    }
    fn text_chunk(t: &str) -> SseEvent {
        oa(
            json!({"id": "c", "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": null}]}),
        )
    }
    fn finish_chunk(reason: &str) -> SseEvent {
        oa(json!({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}))
    }
    fn usage_chunk(n: u64) -> SseEvent {
        oa(json!({"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}))
    }
    fn done() -> SseEvent {
        SseEvent::new(None, "[DONE]")
    }

    #[test]
    fn openai_length_stop_is_held_to_the_end_with_its_usage() {
        let mut w = TruncationWatch::new(Protocol::OpenAi);
        assert_eq!(
            w.push(text_chunk("Hi"), false),
            Step::Pass(vec![text_chunk("Hi")])
        );
        assert_eq!(w.push(finish_chunk("length"), false), Step::Held);
        assert_eq!(w.push(usage_chunk(7), false), Step::Held);
        match w.push(done(), true) {
            Step::LengthStop(held) => assert_eq!(held.len(), 3),
            other => panic!("{other:?}"),
        }
        assert_eq!(w.reported_output(), Some(7));
        assert!(!w.saw_tool_call());
    }

    #[test]
    fn openai_other_endings_pass_unchanged() {
        let mut w = TruncationWatch::new(Protocol::OpenAi);
        assert_eq!(
            w.push(finish_chunk("stop"), false),
            Step::Pass(vec![finish_chunk("stop")])
        );
        assert_eq!(
            w.push(usage_chunk(7), false),
            Step::Pass(vec![usage_chunk(7)])
        );
        assert_eq!(w.push(done(), true), Step::Pass(vec![done()]));
    }

    #[test]
    fn anthropic_block_stop_is_released_unless_the_message_stopped_for_length() {
        let stop = an(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        );
        let delta = |r: &str| {
            an(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": r}, "usage": {"output_tokens": 5}}),
            )
        };
        let end = an("message_stop", json!({"type": "message_stop"}));
        let mut w = TruncationWatch::new(Protocol::Anthropic);
        assert_eq!(w.push(stop.clone(), false), Step::Held);
        assert_eq!(
            w.push(delta("end_turn"), false),
            Step::Pass(vec![stop.clone(), delta("end_turn")])
        );
        assert_eq!(w.push(end.clone(), true), Step::Pass(vec![end.clone()]));

        let mut w = TruncationWatch::new(Protocol::Anthropic);
        assert_eq!(w.push(stop.clone(), false), Step::Held);
        assert_eq!(w.push(delta("max_tokens"), false), Step::Held);
        assert_eq!(
            w.push(end.clone(), true),
            Step::LengthStop(vec![stop, delta("max_tokens"), end])
        );
        assert_eq!(w.reported_output(), Some(5));
    }

    #[test]
    fn a_new_block_releases_a_held_stop_and_tool_use_is_noted() {
        let mut w = TruncationWatch::new(Protocol::Anthropic);
        let stop = an(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        );
        let start = an(
            "content_block_start",
            json!({"type": "content_block_start", "index": 1,
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}}),
        );
        assert_eq!(w.push(stop.clone(), false), Step::Held);
        assert_eq!(w.push(start.clone(), false), Step::Pass(vec![stop, start]));
        assert!(w.saw_tool_call());
    }

    #[test]
    fn holding_is_bounded() {
        let mut w = TruncationWatch::new(Protocol::OpenAi);
        assert_eq!(w.push(finish_chunk("length"), false), Step::Held);
        for _ in 0..MAX_HELD - 1 {
            assert_eq!(w.push(usage_chunk(1), false), Step::Held);
        }
        match w.push(usage_chunk(1), false) {
            Step::Pass(all) => assert_eq!(all.len(), MAX_HELD + 1),
            other => panic!("{other:?}"),
        }
        assert_eq!(w.push(done(), true), Step::Pass(vec![done()]));
    }

    #[test]
    fn a_closing_chunk_keeps_its_text_without_its_finish() {
        let closing = oa(
            json!({"id": "c", "choices": [{"index": 0, "delta": {"content": " end"}, "finish_reason": "length"}],
            "usage": {"completion_tokens": 4}}),
        );
        let kept = text_of_ending(Protocol::OpenAi, &[closing, usage_chunk(4), done()]);
        assert_eq!(kept.len(), 1);
        let v: Value = serde_json::from_str(&kept[0].data).unwrap();
        assert_eq!(v["choices"][0]["delta"]["content"], " end");
        assert!(v["choices"][0]["finish_reason"].is_null());
        assert!(v.get("usage").is_none());
    }
}
