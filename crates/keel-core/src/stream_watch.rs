//! Per-event decisions the relay takes while a committed stream flows, kept pure so that each
//! is a deterministic unit test (time enters as measured gaps, never read here):
//!
//! * [`ToolCallHold`]: whether an event must be held back because it belongs to a tool call
//!   that is not complete yet. A migration may then never leave half a call on the client's
//!   side: the continuation regenerates the call whole. The bound on held events keeps an
//!   upstream that opens a call and never closes it from growing keel's memory.
//! * [`SlowRate`]: whether the token rate has fallen far enough below the variant's baseline,
//!   for long enough, to be worth a migration.

use std::borrow::Cow;

use serde_json::Value;

use crate::members::Members;
use crate::protocol::{event_role, ChunkView, EventRole, EventView, Protocol};
use crate::sse::SseEvent;

/// Whether an OpenAI chunk's text names `tool_calls` at all: most chunks are text, and this
/// rules them out without parsing. memchr's searcher, built once: `str::contains` on every
/// event, twice, costs 2% of keel's instructions a streamed request (callgrind).
fn mentions_tool_calls(data: &str) -> bool {
    static FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new("tool_calls"));
    FINDER.find(data.as_bytes()).is_some()
}

/// Is this event the start of a tool call?
pub fn starts_tool_call(protocol: Protocol, ev: &SseEvent) -> bool {
    // Most events are text: a substring or the event's name rules them out without parsing.
    let possible = match protocol {
        Protocol::OpenAi => mentions_tool_calls(&ev.data),
        Protocol::Anthropic => ev.event.as_deref() == Some("content_block_start"),
    };
    if !possible {
        return false;
    }
    if protocol == Protocol::OpenAi {
        if let Some(view) = ChunkView::parse(&ev.data) {
            return view.starts_tool_call();
        }
    }
    let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
        return false;
    };
    match protocol {
        Protocol::OpenAi => v
            .pointer("/choices/0/delta/tool_calls")
            .is_some_and(|t| !t.is_null()),
        Protocol::Anthropic => {
            ev.event.as_deref() == Some("content_block_start")
                && v.pointer("/content_block/type").and_then(Value::as_str) == Some("tool_use")
        }
    }
}

/// Does this event complete the tool calls held so far? OpenAI: the choice finishes (calls
/// of one choice stream interleaved until the finish reason); Anthropic: the block stops.
pub fn ends_tool_call(protocol: Protocol, ev: &SseEvent) -> bool {
    match protocol {
        Protocol::OpenAi => ChunkView::parse(&ev.data).is_some_and(|v| v.finished()),
        Protocol::Anthropic => ev.event.as_deref() == Some("content_block_stop"),
    }
}

/// What to do with one event under [`ToolCallHold`].
#[derive(Debug, PartialEq, Eq)]
pub enum Hold {
    /// Forward it now.
    Pass(SseEvent),
    /// Held: nothing to forward yet.
    Held,
    /// The call is complete: forward these, in order.
    Release(Vec<SseEvent>),
    /// More was held than `max_bytes` allows: a broken or hostile upstream.
    Overflow,
}

/// Holds tool-call events until each call is complete.
#[derive(Debug, Default)]
pub struct ToolCallHold {
    held: Vec<SseEvent>,
    held_bytes: usize,
    holding: bool,
}

impl ToolCallHold {
    /// Takes one event; `terminal` says the stream ends with it (which also releases).
    pub fn push(
        &mut self,
        protocol: Protocol,
        ev: SseEvent,
        terminal: bool,
        max_bytes: usize,
    ) -> Hold {
        if self.passes(protocol, &ev) {
            return Hold::Pass(ev);
        }
        self.holding = true;
        let ends = terminal || ends_tool_call(protocol, &ev);
        self.held_bytes += ev.raw.len();
        if self.held_bytes > max_bytes {
            return Hold::Overflow;
        }
        self.held.push(ev);
        if !ends {
            return Hold::Held;
        }
        self.holding = false;
        self.held_bytes = 0;
        Hold::Release(std::mem::take(&mut self.held))
    }

    /// Whether [`ToolCallHold::push`] would pass `ev` through unchanged: no call is being held,
    /// and `ev` starts none.
    pub fn passes(&self, protocol: Protocol, ev: &SseEvent) -> bool {
        self.passes_read(starts_tool_call(protocol, ev))
    }

    /// [`ToolCallHold::passes`] for an event already read: `starts_call` is its
    /// [`EventFacts::starts_call`].
    pub fn passes_read(&self, starts_call: bool) -> bool {
        !self.holding && !starts_call
    }

    /// Whether a call is being held (its events have not reached the client).
    pub fn holding(&self) -> bool {
        self.holding
    }
}

/// Largest tool-call, choice or content-block index keel accepts from an upstream. Real
/// responses use a handful; an absurd index (`4000000000`) is how a hostile upstream makes a
/// client, or an assembler, allocate without bound: the event is `malformed`.
pub const MAX_OUTPUT_INDEX: u64 = 1023;

/// The first index in the event above [`MAX_OUTPUT_INDEX`], if any. Only events that can carry
/// such indexes are parsed (OpenAI tool-call chunks, Anthropic content-block events), so plain
/// text chunks cost a substring scan.
pub fn oversized_index(protocol: Protocol, ev: &SseEvent) -> Option<u64> {
    let over = |i: Option<u64>| i.filter(|i| *i > MAX_OUTPUT_INDEX);
    match protocol {
        Protocol::OpenAi => {
            if !mentions_tool_calls(&ev.data) {
                return None;
            }
            let v: Value = serde_json::from_str(&ev.data).ok()?;
            let choices = v.member("choices")?.as_array()?;
            choices.iter().find_map(|c| {
                over(c.member("index").and_then(Value::as_u64)).or_else(|| {
                    let calls = c.member("delta")?.member("tool_calls")?.as_array()?;
                    calls
                        .iter()
                        .find_map(|t| over(t.member("index").and_then(Value::as_u64)))
                })
            })
        }
        Protocol::Anthropic => {
            if !ev.event.as_deref()?.starts_with("content_block") {
                return None;
            }
            // Without a tree where the event view can read the event (a translated stream's
            // every upstream event comes here).
            let index = match EventView::parse(&ev.data) {
                Some(view) => view.index(),
                None => serde_json::from_str::<Value>(&ev.data)
                    .ok()?
                    .member("index")
                    .and_then(Value::as_u64),
            };
            over(index)
        }
    }
}

/// Whether an output event carries generated tokens (text, tool-call arguments, thinking), as
/// opposed to a finish reason or usage alone. Only the gaps before token events measure the
/// token rate: a finish or usage chunk arrives right after the last token, and counting its
/// near-zero gap drags a variant's measured gap down until ordinary streams look slow (the soak
/// found exactly that storm of slowness migrations).
pub fn carries_tokens(protocol: Protocol, ev: &SseEvent) -> bool {
    match protocol {
        Protocol::OpenAi => ChunkView::parse(&ev.data)
            .is_some_and(|v| v.text().is_some_and(|t| !t.is_empty()) || v.starts_tool_call()),
        Protocol::Anthropic => ev.event.as_deref() == Some("content_block_delta"),
    }
}

/// What the relay needs to know of one upstream event, read in one pass: its role, whether it
/// carries generated tokens ([`carries_tokens`]) and its text (`continuation::event_text`,
/// `None` unless it is output). An OpenAI chunk, the common case, is parsed once for all three;
/// reading them separately parsed every chunk three times.
#[derive(Debug, Clone, PartialEq)]
pub struct EventFacts<'a> {
    pub role: EventRole,
    pub tokens: bool,
    /// Borrowed from the event's data unless the chunk escaped a character in it.
    pub text: Option<Cow<'a, str>>,
    /// An OpenAI chunk of one choice whose only content is text (`ChunkView::is_plain_text`):
    /// an assembler may append `text` without reading the chunk again.
    pub plain: bool,
    /// The first index above [`MAX_OUTPUT_INDEX`] ([`oversized_index`]).
    pub oversized: Option<u64>,
    /// It starts a tool call ([`starts_tool_call`]), which a [`ToolCallHold`] holds.
    pub starts_call: bool,
}

impl EventFacts<'_> {
    /// The facts without the borrow of the event they were read from: what travels with an
    /// event to where it is handled later (only its text can borrow, and only output has any).
    pub fn into_owned(self) -> EventFacts<'static> {
        EventFacts {
            role: self.role,
            tokens: self.tokens,
            text: self.text.map(|t| Cow::Owned(t.into_owned())),
            plain: self.plain,
            oversized: self.oversized,
            starts_call: self.starts_call,
        }
    }
}

/// Reads an event's [`EventFacts`].
pub fn read_event(protocol: Protocol, ev: &SseEvent) -> EventFacts<'_> {
    if protocol == Protocol::OpenAi && !ev.comment_only && ev.data != "[DONE]" {
        if let Some(view) = ChunkView::parse(&ev.data).filter(|v| !v.has_error()) {
            let output = view.has_output();
            let tokens =
                output && (view.text().is_some_and(|t| !t.is_empty()) || view.starts_tool_call());
            let plain = view.is_plain_text();
            // What `starts_tool_call` reads, from the view already parsed.
            let starts_call = mentions_tool_calls(&ev.data) && view.starts_tool_call();
            return EventFacts {
                role: if output {
                    EventRole::Output
                } else {
                    EventRole::Preamble
                },
                tokens,
                text: view.into_text().filter(|_| output),
                plain,
                oversized: oversized_index(protocol, ev),
                starts_call,
            };
        }
    }
    if protocol == Protocol::Anthropic && !ev.comment_only {
        if let Some(facts) = read_anthropic(ev) {
            return facts;
        }
    }
    let role = event_role(protocol, ev);
    let output = role == EventRole::Output;
    EventFacts {
        tokens: output && carries_tokens(protocol, ev),
        text: output
            .then(|| crate::continuation::event_text(protocol, ev))
            .flatten()
            .map(Cow::Owned),
        role,
        plain: false,
        oversized: oversized_index(protocol, ev),
        starts_call: starts_tool_call(protocol, ev),
    }
}

/// [`read_event`] for an Anthropic event, read once through [`EventView`]; `None` for the events
/// it leaves to the tree: keep-alives and ends (read by name, not parsed), errors (their message
/// is read from the tree), and data the view cannot read.
fn read_anthropic(ev: &SseEvent) -> Option<EventFacts<'_>> {
    let name = ev.event.as_deref().unwrap_or("");
    if matches!(name, "ping" | "message_stop" | "error") {
        return None;
    }
    let view = EventView::parse(&ev.data).filter(|v| !v.is_error())?;
    let output = matches!(name, "content_block_delta" | "message_delta");
    let delta = name == "content_block_delta";
    // What `starts_tool_call` reads from the tree, from the view.
    let starts_call = name == "content_block_start" && view.block_type() == Some("tool_use");
    let oversized = name
        .starts_with("content_block")
        .then(|| view.index())
        .flatten()
        .filter(|i| *i > MAX_OUTPUT_INDEX);
    Some(EventFacts {
        role: if output {
            EventRole::Output
        } else {
            EventRole::Preamble
        },
        tokens: delta,
        text: if delta { view.into_text() } else { None },
        plain: false,
        oversized,
        starts_call,
    })
}

/// The bytes around the text of a stream's plain chunks. An upstream writes every text chunk of
/// one stream alike — the same id, creation time, model and shape; only the text differs — so
/// once one plain chunk has been parsed, a later chunk whose bytes before and after its text are
/// the same is the same JSON with only that string changed. Where that string has nothing to
/// unescape, [`read_event_in`] reads it by comparing those bytes instead of parsing the chunk:
/// the chunk view's parse was a fifth of keel's instructions per streamed request (callgrind,
/// bench/history/2026-12-02-overhead-stops-12-18.md). Anthropic text deltas are written alike too (the same type,
/// index and delta type). Kept per segment (a continuation's upstream writes its own).
#[derive(Debug, Default, Clone)]
pub struct ChunkTemplate {
    /// The chunk up to its text's opening quote, included.
    before: String,
    /// From its text's closing quote, included, to the end.
    after: String,
    /// `before` or `after` names `tool_calls` ([`mentions_tool_calls`]): a chunk of this shape
    /// is searched whole for tool calls, as a parsed one is. Otherwise only its text could
    /// name them (the name holds no quote, so it cannot span the text's quotes), and a text
    /// that does not is a chunk without them: no scan of the whole chunk for every token.
    mentions: bool,
}

impl ChunkTemplate {
    /// Learns the template from `data`, a chunk read as plain output whose `text` the view
    /// borrowed from it (nothing unescaped): it must lie within `data`. `false` (the template
    /// unchanged) when `text` is empty or does not (a text unescaped into a string of its own).
    pub(crate) fn learn(&mut self, data: &str, text: &str) -> bool {
        let start = (text.as_ptr() as usize).wrapping_sub(data.as_ptr() as usize);
        let end = start.saturating_add(text.len());
        // Checked, not indexed: a text from anywhere else leaves the template as it was.
        let (Some(before), Some(after)) = (data.get(..start), data.get(end..)) else {
            return false;
        };
        if text.is_empty() {
            return false;
        }
        self.before.clear();
        self.before.push_str(before);
        self.after.clear();
        self.after.push_str(after);
        self.mentions = mentions_tool_calls(before) || mentions_tool_calls(after);
        true
    }

    /// The text of a chunk shaped like the template; `None` (parse it) when it is not, or its
    /// text is empty or holds anything a JSON string would escape (`"`, `\`, control
    /// characters).
    pub(crate) fn text<'a>(&self, data: &'a str) -> Option<&'a str> {
        if self.before.is_empty() {
            return None;
        }
        let text = data
            .strip_prefix(self.before.as_str())?
            .strip_suffix(self.after.as_str())?;
        let plain = |b: u8| b != b'"' && b != b'\\' && b >= 0x20;
        (!text.is_empty() && text.bytes().all(plain)).then_some(text)
    }
}

/// [`read_event`] for the events of one upstream stream, in order: a chunk shaped like the last
/// plain chunk read ([`ChunkTemplate`]) is read without parsing it; any other is parsed, and a
/// plain one becomes the template. For Anthropic the same holds of `content_block_delta` text
/// events (by name too: the template compares only the data).
pub fn read_event_in<'a>(
    protocol: Protocol,
    ev: &'a SseEvent,
    template: &mut ChunkTemplate,
) -> EventFacts<'a> {
    let alike = !ev.comment_only
        && match protocol {
            Protocol::OpenAi => true,
            Protocol::Anthropic => ev.event.as_deref() == Some("content_block_delta"),
        };
    if alike {
        if let Some(text) = template.text(&ev.data) {
            // Where neither the template nor the text names tool calls, the chunk names none,
            // and both readers below find nothing without searching it.
            let calls =
                protocol == Protocol::OpenAi && (template.mentions || mentions_tool_calls(text));
            return EventFacts {
                role: EventRole::Output,
                tokens: true,
                text: Some(Cow::Borrowed(text)),
                plain: protocol == Protocol::OpenAi,
                // An Anthropic delta's index is the one the template was learned from, which
                // was within bounds.
                oversized: calls.then(|| oversized_index(protocol, ev)).flatten(),
                starts_call: calls && starts_tool_call(protocol, ev),
            };
        }
    }
    let facts = read_event(protocol, ev);
    let teaches = match protocol {
        Protocol::OpenAi => facts.plain,
        Protocol::Anthropic => alike && facts.tokens && facts.oversized.is_none(),
    };
    if let (true, EventRole::Output, Some(Cow::Borrowed(text))) =
        (teaches, &facts.role, &facts.text)
    {
        if !text.is_empty() {
            template.learn(&ev.data, text);
        }
    }
    facts
}

/// A token rate this far below the baseline is slow (40% below): mean gap × 0.6 > baseline.
pub const SLOW_RATE: f64 = 0.6;
/// The evidence of a slowdown the relay acts on (see [`SlowRate::check`]): a stream three times
/// slower than its baseline over one window of [`SlowRate::WINDOW`] tokens, √3 (1.73) times as
/// slow over two windows in a row, or only just slow (gaps over 1 / [`SLOW_RATE`] of the
/// baseline) over three.
pub const SLOW_EVIDENCE: f64 = 1.098_612_288_668_109_8; // ln 3

/// A stream's inter-token gaps as they are read: their count and sum (the mean the health
/// record takes) and the last [`SlowRate::WINDOW`] of them (the TGSV and the slowdown check),
/// in the same few bytes whatever the stream's length (keeping every gap would take 8 bytes a
/// token, 16 KiB for 2,000 tokens, for the stream's whole life).
///
/// The ring holds `f32`s (a gap in milliseconds to seven digits): every live stream's relay
/// holds one inline.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Gaps {
    count: u32,
    sum_ms: f64,
    /// A ring: gap `i` is at `i % WINDOW`.
    recent: [f32; SlowRate::WINDOW],
}

impl Gaps {
    pub fn push(&mut self, gap_ms: f64) {
        self.recent[self.count as usize % SlowRate::WINDOW] = gap_ms as f32;
        self.count = self.count.saturating_add(1);
        self.sum_ms += gap_ms;
    }

    /// How many gaps were pushed.
    pub fn len(&self) -> usize {
        self.count as usize
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The mean of every gap pushed.
    pub fn mean_ms(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum_ms / self.count as f64)
    }

    /// The last `WINDOW` gaps (fewer while fewer were pushed), in no particular order.
    pub fn recent(&self) -> impl ExactSizeIterator<Item = f64> + Clone + '_ {
        self.recent[..self.len().min(SlowRate::WINDOW)]
            .iter()
            .map(|&g| f64::from(g))
    }
}

impl FromIterator<f64> for Gaps {
    fn from_iter<I: IntoIterator<Item = f64>>(gaps: I) -> Gaps {
        let mut g = Gaps::default();
        gaps.into_iter().for_each(|x| g.push(x));
        g
    }
}

/// Slowdown detection over a segment's inter-token gaps.
///
/// Evidence is weighed by how much slower the stream runs: every [`SlowRate::WINDOW`] gaps, a
/// window whose mean gap is slow (over 1 / [`SLOW_RATE`] of the baseline) adds the log of its
/// median gap's ratio to the baseline, and never less than the log of 1 / [`SLOW_RATE`]; a
/// window that is not slow clears it. A stream is slow once the evidence reaches
/// [`SLOW_EVIDENCE`]. A server that fell to a third of its speed or less (a degraded
/// instance) is left after ten tokens instead of thirty, while a mild slowdown still needs
/// three windows in a row. The median, not the mean, so that one long pause (the server
/// prefilling another request) counts as no more than a mild slowdown.
#[derive(Debug, Clone)]
pub struct SlowRate {
    baseline_gap_ms: f64,
    evidence: f32,
    /// Slow windows in a row behind the evidence.
    windows: u32,
}

impl SlowRate {
    /// Tokens per check.
    pub const WINDOW: usize = 10;

    pub fn new(baseline_gap_ms: f64) -> Self {
        SlowRate {
            baseline_gap_ms,
            evidence: 0.0,
            windows: 0,
        }
    }

    /// Called after each token event with the segment's gaps so far. Every `WINDOW` gaps it
    /// weighs the last `WINDOW` against the baseline; returns true once the evidence of a
    /// slowdown reaches [`SLOW_EVIDENCE`].
    pub fn check(&mut self, gaps: &Gaps) -> bool {
        let n = gaps.len();
        if n < Self::WINDOW || !n.is_multiple_of(Self::WINDOW) {
            return false;
        }
        let mean = gaps.recent().sum::<f64>() / Self::WINDOW as f64;
        // Gaps below 5 ms are dominated by scheduling noise: never call those slow.
        if mean > 5.0 && mean * SLOW_RATE > self.baseline_gap_ms {
            let mut window = [0.0; Self::WINDOW];
            window
                .iter_mut()
                .zip(gaps.recent())
                .for_each(|(w, g)| *w = g);
            window.sort_unstable_by(f64::total_cmp);
            let median = (window[Self::WINDOW / 2 - 1] + window[Self::WINDOW / 2]) / 2.0;
            let ratio = (median / self.baseline_gap_ms).max(1.0 / SLOW_RATE);
            self.evidence += ratio.ln() as f32;
            self.windows += 1;
        } else {
            self.evidence = 0.0;
            self.windows = 0;
        }
        // Within rounding of the bound: one window exactly three times as slow reaches it.
        f64::from(self.evidence) >= SLOW_EVIDENCE - 1e-6
    }

    /// The tokens over which the evidence of a slowdown was gathered.
    pub fn slow_tokens(&self) -> usize {
        self.windows as usize * Self::WINDOW
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn oa(v: Value) -> SseEvent {
        SseEvent::new(None, &v.to_string())
    }

    /// One pass reads what the three separate readings read, for every kind of event.
    #[test]
    fn read_event_agrees_with_the_separate_readings() {
        let events = [
            (
                Protocol::OpenAi,
                oa(json!({"choices":[{"delta":{"role":"assistant","content":""}}]})),
            ),
            (
                Protocol::OpenAi,
                oa(json!({"choices":[{"delta":{"content":" hi"}}]})),
            ),
            (
                Protocol::OpenAi,
                oa(json!({"choices":[{"delta":{"tool_calls":[{"index":0}]}}]})),
            ),
            (
                Protocol::OpenAi,
                oa(json!({"choices":[{"delta":{},"finish_reason":"stop"}]})),
            ),
            (
                Protocol::OpenAi,
                oa(json!({"choices":[],"usage":{"completion_tokens":3}})),
            ),
            (Protocol::OpenAi, oa(json!({"choices":[{"text":"x"}]}))),
            (Protocol::OpenAi, oa(json!({"error":{"message":"boom"}}))),
            (Protocol::OpenAi, oa(json!({"choices":[["hi"]]}))),
            (Protocol::OpenAi, SseEvent::new(None, "[DONE]")),
            (Protocol::OpenAi, SseEvent::new(None, "{not json")),
            (
                Protocol::Anthropic,
                SseEvent::new(
                    Some("content_block_delta"),
                    r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"yo"}}"#,
                ),
            ),
            (
                Protocol::Anthropic,
                SseEvent::new(
                    Some("message_delta"),
                    r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":2}}"#,
                ),
            ),
            (
                Protocol::Anthropic,
                SseEvent::new(
                    Some("message_start"),
                    r#"{"type":"message_start","message":{"id":"m"}}"#,
                ),
            ),
            (
                Protocol::Anthropic,
                SseEvent::new(
                    Some("content_block_start"),
                    r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"t","name":"f","input":{}}}"#,
                ),
            ),
            (
                Protocol::Anthropic,
                SseEvent::new(Some("ping"), r#"{"type":"ping"}"#),
            ),
            (
                Protocol::Anthropic,
                SseEvent::new(
                    Some("error"),
                    r#"{"type":"error","error":{"message":"overloaded"}}"#,
                ),
            ),
        ];
        for (p, ev) in events {
            assert_eq!(read_event(p, &ev), separately(p, &ev), "{:?}", ev.data);
            // What the commit point hands the relay instead of the event's second reading.
            assert_eq!(read_event(p, &ev).into_owned(), read_event(p, &ev));
        }
    }

    /// An event's facts, each read by its own reader from the event's tree.
    fn separately(p: Protocol, ev: &SseEvent) -> EventFacts<'static> {
        let role = event_role(p, ev);
        let output = role == EventRole::Output;
        let plain = p == Protocol::OpenAi
            && ChunkView::parse(&ev.data).is_some_and(|v| !v.has_error() && v.is_plain_text());
        EventFacts {
            tokens: output && carries_tokens(p, ev),
            text: output
                .then(|| crate::continuation::event_text(p, ev))
                .flatten()
                .map(Cow::Owned),
            role,
            plain,
            oversized: oversized_from_tree(p, ev),
            starts_call: starts_tool_call(p, ev),
        }
    }

    /// [`oversized_index`] read from the event's tree only.
    fn oversized_from_tree(p: Protocol, ev: &SseEvent) -> Option<u64> {
        if p == Protocol::OpenAi {
            return oversized_index(p, ev);
        }
        if !ev.event.as_deref()?.starts_with("content_block") {
            return None;
        }
        let v: Value = serde_json::from_str(&ev.data).ok()?;
        v.member("index")
            .and_then(Value::as_u64)
            .filter(|i| *i > MAX_OUTPUT_INDEX)
    }

    proptest::proptest! {
        /// Whatever an Anthropic event's name and members, reading it once gives what each
        /// reader gives from its tree.
        #[test]
        fn an_anthropic_event_read_once_agrees_with_the_separate_readings(
            name in 0usize..9,
            members in proptest::collection::vec((0usize..5, 0usize..13), 0..4),
        ) {
            const NAMES: [Option<&str>; 9] = [
                None, Some("message_start"), Some("content_block_start"), Some("content_block_delta"),
                Some("content_block_stop"), Some("message_delta"), Some("message_stop"), Some("ping"), Some("error"),
            ];
            const KEYS: [&str; 5] = ["type", "index", "delta", "other", "content_block"];
            const VALUES: [&str; 13] = [
                "null", "3", "1023", "1024", "-1", r#""error""#, r#""content_block_delta""#,
                r#"{"type":"text_delta","text":"h\u00e9 \"x\""}"#, r#"{"text":7}"#, r#"[{"text":"x"}]"#,
                r#"{"type":"tool_use","id":"t","input":{}}"#, r#"{"type":"text","text":""}"#, r#"{"type":7}"#,
            ];
            let data = format!(
                "{{{}}}",
                members
                    .iter()
                    .map(|(k, v)| format!("\"{}\":{}", KEYS[*k], VALUES[*v]))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let ev = SseEvent::new(NAMES[name], &data);
            proptest::prop_assert_eq!(
                oversized_index(Protocol::Anthropic, &ev),
                oversized_from_tree(Protocol::Anthropic, &ev)
            );
            proptest::prop_assert_eq!(read_event(Protocol::Anthropic, &ev), separately(Protocol::Anthropic, &ev));
        }
    }

    #[test]
    fn openai_tool_call_is_held_until_the_finish() {
        let mut h = ToolCallHold::default();
        let text = oa(json!({"choices": [{"index": 0, "delta": {"content": "hi"}}]}));
        assert_eq!(
            h.push(Protocol::OpenAi, text.clone(), false, 1 << 20),
            Hold::Pass(text)
        );
        let start = oa(
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}]}}]}),
        );
        let args = oa(
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}),
        );
        let fin =
            oa(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}));
        assert_eq!(
            h.push(Protocol::OpenAi, start.clone(), false, 1 << 20),
            Hold::Held
        );
        assert!(h.holding());
        assert_eq!(
            h.push(Protocol::OpenAi, args.clone(), false, 1 << 20),
            Hold::Held
        );
        assert_eq!(
            h.push(Protocol::OpenAi, fin.clone(), false, 1 << 20),
            Hold::Release(vec![start, args, fin])
        );
        assert!(!h.holding());
    }

    #[test]
    fn anthropic_tool_use_block_is_held_until_its_stop() {
        let mut h = ToolCallHold::default();
        let start = SseEvent::new(
            Some("content_block_start"),
            &json!({"index": 1, "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}}).to_string(),
        );
        let stop = SseEvent::new(Some("content_block_stop"), r#"{"index":1}"#);
        assert_eq!(
            h.push(Protocol::Anthropic, start.clone(), false, 1 << 20),
            Hold::Held
        );
        assert_eq!(
            h.push(Protocol::Anthropic, stop.clone(), false, 1 << 20),
            Hold::Release(vec![start, stop])
        );
    }

    #[test]
    fn a_call_that_never_ends_overflows_instead_of_growing() {
        let mut h = ToolCallHold::default();
        let ev = oa(
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "xxxxxxxxxx"}}]}}]}),
        );
        let mut outcome = Hold::Held;
        for _ in 0..100 {
            outcome = h.push(Protocol::OpenAi, ev.clone(), false, 2_000);
            if outcome != Hold::Held {
                break;
            }
        }
        assert_eq!(outcome, Hold::Overflow);
    }

    #[test]
    fn finish_and_usage_chunks_carry_no_tokens() {
        let text = oa(json!({"choices": [{"index": 0, "delta": {"content": "hi"}}]}));
        let empty = oa(json!({"choices": [{"index": 0, "delta": {"content": ""}}]}));
        let finish = oa(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}));
        let usage = oa(json!({"choices": [], "usage": {"total_tokens": 3}}));
        let call = oa(
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]}),
        );
        assert!(carries_tokens(Protocol::OpenAi, &text));
        assert!(carries_tokens(Protocol::OpenAi, &call));
        for ev in [&empty, &finish, &usage] {
            assert!(!carries_tokens(Protocol::OpenAi, ev), "{}", ev.data);
        }
        let delta = SseEvent::new(
            Some("content_block_delta"),
            r#"{"index":0,"delta":{"type":"text_delta","text":"x"}}"#,
        );
        let stop = SseEvent::new(
            Some("message_delta"),
            r#"{"delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3}}"#,
        );
        assert!(carries_tokens(Protocol::Anthropic, &delta));
        assert!(!carries_tokens(Protocol::Anthropic, &stop));
    }

    #[test]
    fn absurd_indexes_are_found() {
        let call = |i: u64| {
            oa(
                json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, "function": {"arguments": ""}}]}}]}),
            )
        };
        assert_eq!(oversized_index(Protocol::OpenAi, &call(3)), None);
        assert_eq!(
            oversized_index(Protocol::OpenAi, &call(4_000_000_000)),
            Some(4_000_000_000)
        );
        let text = oa(json!({"choices": [{"index": 0, "delta": {"content": "hi"}}]}));
        assert_eq!(oversized_index(Protocol::OpenAi, &text), None);
        let block = |i: u64| {
            SseEvent::new(
                Some("content_block_delta"),
                &json!({"index": i, "delta": {"type": "text_delta", "text": "x"}}).to_string(),
            )
        };
        assert_eq!(oversized_index(Protocol::Anthropic, &block(1)), None);
        assert_eq!(
            oversized_index(Protocol::Anthropic, &block(1 << 40)),
            Some(1 << 40)
        );
        // Wrong shapes are not this check's business (the event is classified elsewhere).
        let odd = SseEvent::new(Some("content_block_start"), "[1,2]");
        assert_eq!(oversized_index(Protocol::Anthropic, &odd), None);
        assert_eq!(
            oversized_index(Protocol::OpenAi, &oa(json!({"tool_calls": 5}))),
            None
        );
    }

    /// The first token at which a stream whose gaps are all `gap` ms is found slow against a
    /// 10 ms baseline.
    fn slow_at(gaps_ms: impl Fn(usize) -> f64) -> Option<usize> {
        let mut s = SlowRate::new(10.0);
        let mut gaps = Gaps::default();
        (0..60).find_map(|i| {
            gaps.push(gaps_ms(i));
            s.check(&gaps).then_some(i + 1)
        })
    }

    #[test]
    fn the_slower_the_stream_the_sooner_it_is_found_slow() {
        // Only just slow (17 × 0.6 = 10.2 > 10): three windows in a row.
        assert_eq!(slow_at(|_| 17.0), Some(30));
        // 1.8 and twice as slow: two windows; three times or more: one.
        assert_eq!(slow_at(|_| 18.0), Some(20));
        assert_eq!(slow_at(|_| 20.0), Some(20));
        assert_eq!(slow_at(|_| 30.0), Some(10));
        assert_eq!(slow_at(|_| 80.0), Some(10));
        assert!((SLOW_EVIDENCE - 3f64.ln()).abs() < 1e-12);
        // Not slow at all.
        assert_eq!(slow_at(|_| 16.0), None);
    }

    #[test]
    fn one_long_pause_weighs_as_a_mild_slowdown() {
        // A window of baseline gaps but one of 300 ms: its mean (39 ms) is nearly four times
        // the baseline, its median is the baseline. Each such window is mildly slow evidence.
        let pause_each_window = |i: usize| if i % 10 == 4 { 300.0 } else { 10.0 };
        assert_eq!(slow_at(pause_each_window), Some(30));
        let mut s = SlowRate::new(10.0);
        let mut gaps = Gaps::default();
        (0..10).for_each(|i| gaps.push(pause_each_window(i)));
        assert!(!s.check(&gaps));
        assert_eq!(s.slow_tokens(), 10);
    }

    #[test]
    fn a_normal_window_resets_the_count_and_tiny_gaps_never_count() {
        let mut s = SlowRate::new(10.0);
        let mut gaps = Gaps::default();
        for _ in 0..20 {
            gaps.push(17.0); // only just slow
            assert!(!s.check(&gaps));
        }
        (0..10).for_each(|_| gaps.push(10.0)); // a window at the baseline
        assert!(!s.check(&gaps));
        for _ in 0..2 {
            (0..10).for_each(|_| gaps.push(17.0));
            assert!(!s.check(&gaps));
        }
        let mut tiny = SlowRate::new(1.0);
        let mut g = Gaps::default();
        for _ in 0..30 {
            g.push(4.0);
            assert!(!tiny.check(&g));
        }
    }

    #[test]
    fn gaps_keep_the_mean_of_all_and_the_last_window_in_fixed_space() {
        let g: Gaps = (1..=25).map(f64::from).collect();
        assert_eq!(g.len(), 25);
        assert_eq!(g.mean_ms(), Some(13.0));
        let mut recent: Vec<f64> = g.recent().collect();
        recent.sort_by(f64::total_cmp);
        assert_eq!(recent, (16..=25).map(f64::from).collect::<Vec<_>>());
        let few: Gaps = [3.0, 5.0].into_iter().collect();
        assert_eq!(few.recent().len(), 2);
        assert_eq!(Gaps::default().mean_ms(), None);
    }

    /// An OpenAI chunk of stream `id` whose first choice's delta is `delta` (JSON).
    fn chunk_with(id: &str, delta: &str, finish: &str) -> SseEvent {
        SseEvent::new(
            None,
            &format!(
                r#"{{"id":"{id}","object":"chat.completion.chunk","created":7,"model":"m","choices":[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]}}"#
            ),
        )
    }

    /// A chunk of stream `id` carrying `text`.
    fn text_chunk_of(id: &str, text: &str) -> SseEvent {
        let delta = format!(r#"{{"content":{}}}"#, serde_json::to_string(text).unwrap());
        chunk_with(id, &delta, "null")
    }

    fn text_chunk(text: &str) -> SseEvent {
        text_chunk_of("c1", text)
    }

    #[test]
    fn a_chunk_shaped_like_the_last_plain_one_is_read_without_parsing() {
        let mut t = ChunkTemplate::default();
        let first = text_chunk("Hello");
        assert_eq!(
            read_event_in(Protocol::OpenAi, &first, &mut t),
            read_event(Protocol::OpenAi, &first)
        );
        // Learned: the next text chunk is read by its template, the text borrowed from it.
        let next = text_chunk(" world");
        assert_eq!(t.text(&next.data), Some(" world"));
        let facts = read_event_in(Protocol::OpenAi, &next, &mut t);
        assert_eq!(facts, read_event(Protocol::OpenAi, &next));
        assert!(matches!(facts.text, Some(Cow::Borrowed(" world"))));
        // Anything the template cannot read exactly is parsed: an escape, an empty text,
        // another stream's id, a finish.
        for ev in [
            text_chunk("a \"quote\""),
            text_chunk("line\nbreak"),
            text_chunk(""),
            text_chunk_of("c2", "x"),
            chunk_with("c1", r#"{"content":"x"}"#, r#""stop""#),
        ] {
            assert_eq!(t.text(&ev.data), None, "{}", ev.data);
        }
    }

    proptest::proptest! {
        /// Whatever an Anthropic stream's events are, reading them through a template gives
        /// what parsing each gives: text deltas of any text, of another block, tool-input
        /// deltas, and other events whose data is a text delta's.
        #[test]
        fn reading_anthropic_deltas_through_a_template_agrees_with_parsing(
            steps in proptest::collection::vec((0u8..8, "\\PC{0,6}|[\"\\\\\n\t]{1,3}|.{0,4}"), 1..24)
        ) {
            let delta = |index: u32, text: &str| {
                let data = serde_json::json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}});
                data.to_string()
            };
            let mut t = ChunkTemplate::default();
            for (kind, text) in &steps {
                let ev = match kind {
                    0..=3 => SseEvent::new(Some("content_block_delta"), &delta(0, text)),
                    4 => SseEvent::new(Some("content_block_delta"), &delta(1024, text)),
                    5 => SseEvent::new(Some("message_delta"), &delta(0, text)),
                    6 => SseEvent::new(None, &delta(0, text)),
                    _ => SseEvent::new(
                        Some("content_block_delta"),
                        r#"{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{"}}"#,
                    ),
                };
                let parsed = read_event(Protocol::Anthropic, &ev);
                proptest::prop_assert_eq!(read_event_in(Protocol::Anthropic, &ev, &mut t), parsed);
            }
        }

        /// Whatever a stream's chunks are, reading them through a template gives what parsing
        /// each gives, texts and ids that name `tool_calls` included.
        #[test]
        fn reading_through_a_template_agrees_with_parsing(
            steps in proptest::collection::vec((0u8..9, "\\PC{0,6}|[\"\\\\\n\t]{1,3}|.{0,4}|x?tool_calls"), 1..24)
        ) {
            let mut t = ChunkTemplate::default();
            for (kind, text) in &steps {
                let ev = match kind {
                    0..=3 => text_chunk(text),
                    4 => chunk_with("c1", r#"{"role":"assistant","content":""}"#, "null"),
                    5 => chunk_with("c1", r#"{}"#, r#""length""#),
                    6 => text_chunk_of("c9", text),
                    7 => text_chunk_of("tool_calls", text),
                    _ => chunk_with("c1", r#"{"tool_calls":[{"index":0,"id":"t","function":{"name":"f","arguments":""}}]}"#, "null"),
                };
                let parsed = read_event(Protocol::OpenAi, &ev);
                proptest::prop_assert_eq!(read_event_in(Protocol::OpenAi, &ev, &mut t), parsed);
            }
        }
    }
}
