//! Server-sent events: an incremental, strict decoder that keeps every event's raw bytes.
//!
//! keel forwards upstream events to the client byte for byte (so a client sees exactly what the
//! model server wrote), but it must also understand each event to know when a stream is complete,
//! when it failed, and (later) what text has been delivered. The decoder therefore returns both:
//! the parsed fields and the raw block, including its terminating blank line.
//!
//! Framing follows the WHATWG EventSource rules: lines end in `\n`, `\r\n` or `\r`; a blank line
//! dispatches the event; lines starting with `:` are comments; `data` lines are joined with `\n`.
//! "Strict" means: a stream that ends with a partial event is an error ([`SseDecoder::finish`]),
//! and a field line without a known name is reported rather than silently dropped.

use std::fmt;
use std::ops::Range;

mod model_name;

pub use model_name::{model_member, ModelName};

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field, if any (Anthropic names every event; OpenAI names none).
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`.
    pub data: String,
    /// True when the block held only comments (`: keep-alive`), no fields.
    pub comment_only: bool,
    /// The exact bytes of the block as received, including the blank line that ended it.
    pub raw: Vec<u8>,
}

impl SseEvent {
    /// Builds an event and its wire form (`event:` line when named, one `data:` line per line).
    pub fn new(event: Option<&str>, data: &str) -> Self {
        let mut raw = Vec::with_capacity(data.len() + 32);
        if let Some(name) = event {
            raw.extend_from_slice(b"event: ");
            raw.extend_from_slice(name.as_bytes());
            raw.push(b'\n');
        }
        for line in data.split('\n') {
            raw.extend_from_slice(b"data: ");
            raw.extend_from_slice(line.as_bytes());
            raw.push(b'\n');
        }
        raw.push(b'\n');
        SseEvent {
            event: event.map(str::to_owned),
            data: data.to_owned(),
            comment_only: false,
            raw,
        }
    }

    /// A comment block (`: text`), ignored by every SSE parser; keel reports late decisions this way.
    pub fn comment(text: &str) -> Vec<u8> {
        format!(": {text}\n\n").into_bytes()
    }
}

/// A framing violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseError {
    /// The stream ended in the middle of an event (no terminating blank line).
    Truncated { pending_bytes: usize },
    /// A line that is neither a comment nor a known field.
    UnknownField { line: String },
    /// Event bytes that are not UTF-8.
    NotUtf8,
    /// One event grew past the decoder's limit (a hostile or broken upstream).
    TooLarge { limit: usize },
}

impl fmt::Display for SseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SseError::Truncated { pending_bytes } => {
                write!(
                    f,
                    "stream ended inside an event ({pending_bytes} bytes without a blank line)"
                )
            }
            SseError::UnknownField { line } => write!(f, "unknown SSE field line: {line:?}"),
            SseError::NotUtf8 => write!(f, "SSE event is not valid UTF-8"),
            SseError::TooLarge { limit } => {
                write!(f, "an SSE event exceeds the limit of {limit} bytes")
            }
        }
    }
}

impl std::error::Error for SseError {}

/// Default bound on one event's size: far above any real chunk (a tool call's arguments arrive
/// in many small events), far below what would hurt the process.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// The most room a new event block starts with (a larger event grows its block as it arrives).
const TYPICAL_EVENT_ROOM: usize = 4096;

/// Incremental decoder: feed arbitrary byte chunks, collect whole events. One event may hold at
/// most `max_event_bytes` (raw bytes, fields included); a longer one is [`SseError::TooLarge`].
#[derive(Debug)]
pub struct SseDecoder {
    max_event_bytes: usize,
    /// Bytes of the current, not yet dispatched block.
    block: Vec<u8>,
    /// Offset in `block` where the next unparsed line starts.
    line_start: usize,
    event: Option<String>,
    data: Option<String>,
    saw_field: bool,
    /// A `\r` ended the previous line; a `\n` right after it belongs to that line ending.
    after_cr: bool,
    /// A blank line ended in `\r`: dispatch once the next byte shows whether `\n` follows.
    dispatch_pending: bool,
    /// The name each event's `model` member is given as it is decoded, if any.
    model: Option<Box<ModelName>>,
    /// The current event's `model` has been given it (only its first is).
    model_named: bool,
}

impl Default for SseDecoder {
    fn default() -> Self {
        Self::with_max_event_bytes(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder that refuses events larger than `max_event_bytes`.
    pub fn with_max_event_bytes(max_event_bytes: usize) -> Self {
        SseDecoder {
            max_event_bytes,
            block: Vec::new(),
            line_start: 0,
            event: None,
            data: None,
            saw_field: false,
            after_cr: false,
            dispatch_pending: false,
            model: None,
            model_named: false,
        }
    }

    /// A decoder that gives each event's `model` member this name: in the event's data and,
    /// in the same place, in its raw bytes (which are otherwise kept as received).
    pub fn renaming_model(mut self, name: ModelName) -> Self {
        self.model = Some(Box::new(name));
        self
    }

    /// Feeds bytes and appends every event they complete to `out`.
    ///
    /// Works a line at a time: the bytes up to the next line ending are appended to the block
    /// in one copy and the line is parsed where it lies (no byte-at-a-time growth, no copy of
    /// the line), which made decoding the largest cost of the relay after the allocator.
    pub fn feed(&mut self, mut bytes: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        while let Some(&first) = bytes.first() {
            if self.after_cr {
                self.after_cr = false;
                if first == b'\n' {
                    // The `\n` of a `\r\n` belongs to the event too: within the limit.
                    self.reserve_within_limit(1)?;
                    self.block.push(first);
                    self.line_start = self.block.len();
                    bytes = &bytes[1..];
                    if self.dispatch_pending {
                        self.dispatch_pending = false;
                        self.dispatch(out);
                    }
                    continue;
                }
                if self.dispatch_pending {
                    self.dispatch_pending = false;
                    self.dispatch(out);
                }
            }
            // memchr's vectorized search: a byte-at-a-time scan for the line ending was the
            // decoder's largest cost (callgrind,
            // bench/history/2026-12-02-overhead-stops-12-18.md).
            let Some(at) = memchr::memchr2(b'\n', b'\r', bytes) else {
                // No line ending yet: keep the partial line for the next read.
                self.reserve_within_limit(bytes.len())?;
                self.block.extend_from_slice(bytes);
                return Ok(());
            };
            let ending = bytes[at];
            self.reserve_within_limit(at + 1)?;
            self.block.extend_from_slice(&bytes[..=at]);
            bytes = &bytes[at + 1..];
            self.after_cr = ending == b'\r';
            let end = self.block.len() - 1;
            let start = std::mem::replace(&mut self.line_start, self.block.len());
            if start == end {
                if ending == b'\r' {
                    // Wait for a possible `\n` so the raw block keeps its whole line ending.
                    self.dispatch_pending = true;
                } else {
                    self.dispatch(out);
                }
            } else {
                // The line is parsed in place: the block is moved out for the call and back.
                let block = std::mem::take(&mut self.block);
                let parsed = std::str::from_utf8(&block[start..end])
                    .map_err(|_| SseError::NotUtf8)
                    .and_then(|line| self.field(line));
                self.block = block;
                if let (Some(span), Some(name)) = (parsed?, &self.model) {
                    // The line's `model`, renamed in the raw bytes as in the data: the line is
                    // the block's last, so only its own few bytes after the name move.
                    replace_range(
                        &mut self.block,
                        start + span.start..start + span.end,
                        name.encoded().as_bytes(),
                    );
                    self.line_start = self.block.len();
                }
            }
        }
        Ok(())
    }

    /// Refuses `n` more bytes of the current block when they would take it past the limit.
    fn reserve_within_limit(&self, n: usize) -> Result<(), SseError> {
        if self.block.len() + n > self.max_event_bytes {
            return Err(SseError::TooLarge {
                limit: self.max_event_bytes,
            });
        }
        Ok(())
    }

    /// Declares the end of the stream and dispatches an event whose blank line ended in `\r`
    /// (it waits for a possible `\n`, and at the end of the stream none comes); an unfinished
    /// event is a framing error.
    pub fn end(&mut self, out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        self.finish()?;
        if self.dispatch_pending {
            self.dispatch_pending = false;
            self.after_cr = false;
            self.dispatch(out);
        }
        Ok(())
    }

    /// Checks the end of the stream without dispatching (see [`SseDecoder::end`], which also
    /// hands over an event whose last line ended in a lone `\r`): an unfinished event is a
    /// framing error.
    pub fn finish(&self) -> Result<(), SseError> {
        if self.dispatch_pending || self.block.iter().all(|b| *b == b'\n' || *b == b'\r') {
            Ok(())
        } else {
            Err(SseError::Truncated {
                pending_bytes: self.block.len(),
            })
        }
    }

    /// Takes one field line; `Some` with where in the line a `model` member was renamed in the
    /// data (see [`SseDecoder::renaming_model`]).
    fn field(&mut self, line: &str) -> Result<Option<Range<usize>>, SseError> {
        if line.starts_with(':') {
            return Ok(None);
        }
        // A byte search: `:` is ASCII, so its index is a char boundary (`split_once` with a
        // char pattern cost more than the rest of the line's parse).
        let (name, value) = match memchr::memchr(b':', line.as_bytes()) {
            Some(at) => {
                let v = &line[at + 1..];
                (&line[..at], v.strip_prefix(' ').unwrap_or(v))
            }
            None => (line, ""),
        };
        match name {
            "event" => self.event = Some(value.to_owned()),
            "data" => {
                self.saw_field = true;
                return Ok(self.data_line(line, value));
            }
            "id" | "retry" => {}
            _ => {
                return Err(SseError::UnknownField {
                    line: line.to_owned(),
                })
            }
        }
        self.saw_field = true;
        Ok(None)
    }

    /// Adds a `data` line's value (a suffix of `line`) to the event's data, with its `model`
    /// renamed when the decoder renames one: where in `line` that name was.
    fn data_line(&mut self, line: &str, value: &str) -> Option<Range<usize>> {
        let span = match &mut self.model {
            Some(name) if !self.model_named => name.span(self.event.as_deref(), value),
            _ => None,
        };
        let name = self.model.as_deref().map_or("", |n| n.encoded());
        let d = match &mut self.data {
            Some(d) => {
                d.push('\n');
                d
            }
            None => self
                .data
                .insert(String::with_capacity(value.len() + name.len())),
        };
        let Some(span) = span else {
            d.push_str(value);
            return None;
        };
        d.push_str(&value[..span.start]);
        d.push_str(name);
        d.push_str(&value[span.end..]);
        self.model_named = true;
        let at = line.len() - value.len();
        Some(at + span.start..at + span.end)
    }

    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        // The next block starts with room for one like this one and a little more (events of
        // a stream are much alike, but the next token's text may be longer): one allocation
        // per event instead of a series of regrowths.
        let len = self.block.len();
        let room = (len + len / 4 + 32).min(TYPICAL_EVENT_ROOM);
        let raw = std::mem::replace(&mut self.block, Vec::with_capacity(room));
        self.line_start = 0;
        self.model_named = false;
        let only_blank = raw.iter().all(|b| *b == b'\n' || *b == b'\r');
        if only_blank {
            // Extra blank lines between events carry nothing.
            return;
        }
        let comment_only = !self.saw_field;
        out.push(SseEvent {
            event: self.event.take(),
            data: self.data.take().unwrap_or_default(),
            comment_only,
            raw,
        });
        self.saw_field = false;
    }
}

/// Replaces `range` of `block` with `with`, moving only the bytes after the range (`Vec::splice`
/// goes through an iterator and, for a longer replacement, a temporary buffer).
fn replace_range(block: &mut Vec<u8>, range: Range<usize>, with: &[u8]) {
    let tail = block.len() - range.end;
    let new_end = range.start + with.len();
    if with.len() > range.len() {
        block.resize(new_end + tail, 0);
    }
    block.copy_within(range.end..range.end + tail, new_end);
    block[range.start..new_end].copy_from_slice(with);
    block.truncate(new_end + tail);
}

/// Decodes a complete SSE body strictly (used by tests and by the load generator).
pub fn decode_all(body: &[u8]) -> Result<Vec<SseEvent>, SseError> {
    let mut dec = SseDecoder::new();
    let mut out = Vec::new();
    dec.feed(body, &mut out)?;
    dec.end(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_replaced_by_shorter_equal_and_longer_bytes() {
        for (with, expected) in [
            ("", "ab|ef"),
            ("X", "ab|X|ef"),
            ("XY", "ab|XY|ef"),
            ("XYZW", "ab|XYZW|ef"),
        ] {
            let mut block = b"ab|cd|ef".to_vec();
            let with = if with.is_empty() {
                String::new()
            } else {
                format!("{with}|")
            };
            replace_range(&mut block, 3..6, with.as_bytes());
            assert_eq!(String::from_utf8(block).unwrap(), expected);
        }
    }

    #[test]
    fn splits_across_arbitrary_chunk_boundaries() {
        let body = b"event: a\r\ndata: 1\r\n\r\n: ping\n\ndata: x\ndata: y\n\n";
        for cut in 0..body.len() {
            let mut dec = SseDecoder::new();
            let mut out = Vec::new();
            dec.feed(&body[..cut], &mut out).unwrap();
            dec.feed(&body[cut..], &mut out).unwrap();
            dec.finish().unwrap();
            assert_eq!(out.len(), 3, "cut at {cut}");
            assert_eq!(out[0].event.as_deref(), Some("a"));
            assert_eq!(out[0].data, "1");
            assert_eq!(out[0].raw, b"event: a\r\ndata: 1\r\n\r\n");
            assert!(out[1].comment_only);
            assert_eq!(out[2].data, "x\ny");
        }
    }

    #[test]
    fn an_event_past_the_limit_is_refused() {
        let mut dec = SseDecoder::with_max_event_bytes(64);
        let mut out = Vec::new();
        dec.feed(b"data: short\n\n", &mut out).unwrap();
        assert_eq!(out.len(), 1);
        let long = format!("data: {}\n\n", "x".repeat(100));
        assert_eq!(
            dec.feed(long.as_bytes(), &mut out),
            Err(SseError::TooLarge { limit: 64 })
        );
    }

    #[test]
    fn an_event_ended_by_cr_at_the_end_of_the_stream_is_dispatched() {
        let out = decode_all(b"data: 1\r\r").unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].data, "1");
        assert_eq!(out[0].raw, b"data: 1\r\r");
        // Round trip: an event's raw bytes decode to the event itself.
        assert_eq!(decode_all(&out[0].raw).unwrap(), out);
    }

    #[test]
    fn the_lf_of_a_crlf_counts_against_the_limit() {
        // Found by fuzzing: a block of exactly the limit ending in `\r` took its `\n` past it.
        let line = b"data: 12345\r";
        let mut dec = SseDecoder::with_max_event_bytes(line.len());
        let mut out = Vec::new();
        dec.feed(line, &mut out).unwrap();
        assert_eq!(
            dec.feed(b"\n", &mut out),
            Err(SseError::TooLarge { limit: line.len() })
        );
    }

    #[test]
    fn truncated_stream_is_an_error() {
        let mut dec = SseDecoder::new();
        let mut out = Vec::new();
        dec.feed(b"data: {\"a\":1}\n", &mut out).unwrap();
        assert!(out.is_empty());
        assert!(matches!(dec.finish(), Err(SseError::Truncated { .. })));
    }

    #[test]
    fn unknown_field_is_reported() {
        assert!(matches!(
            decode_all(b"bogus line\n\n"),
            Err(SseError::UnknownField { .. })
        ));
    }

    #[test]
    fn encoder_round_trips() {
        let ev = SseEvent::new(Some("message_start"), "{\"a\":\n1}");
        let back = decode_all(&ev.raw).unwrap();
        assert_eq!(back, vec![ev]);
    }
}
