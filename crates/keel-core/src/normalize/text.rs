//! `syntax` normalization of one prompt text.
//!
//! The text is cut into code spans (fenced ``` blocks and inline `code`), which are kept byte for
//! byte, and prose, which goes through three steps in this order:
//! 1. character mapping: invisible format characters removed, curly quotes to ASCII, exotic
//!    spaces to a plain space, CRLF / CR to LF;
//! 2. Unicode NFC (after the mapping, so that removing a zero-width joiner between a letter and
//!    its combining mark cannot leave a non-NFC string behind, which would break idempotence);
//! 3. layout: trailing spaces per line dropped, runs of spaces/tabs inside a line collapsed to one
//!    space (leading indentation is kept: it carries meaning in Markdown lists), two or more blank
//!    lines become one, and the whole text is trimmed.

use std::borrow::Cow;

use unicode_normalization::{is_nfc_quick, IsNormalized, UnicodeNormalization};

use super::Fixes;

/// Normalizes one text; `None` when nothing changed (the common case allocates nothing).
pub fn normalize_text(text: &str, fixes: &mut Fixes) -> Option<String> {
    if is_clean_ascii(text.as_bytes()) || is_json(text) {
        return None;
    }
    let segments = split_code(text);
    let mut out = String::with_capacity(text.len());
    let last = segments.len().saturating_sub(1);
    for (i, seg) in segments.iter().enumerate() {
        match seg {
            Segment::Code(code) => out.push_str(code),
            Segment::Prose(prose) => {
                let mapped = map_chars(prose, i > 0, i < last, fixes);
                let composed = nfc(&mapped, fixes);
                layout(&composed, i == 0, i == last, &mut out, fixes);
            }
        }
    }
    (out != text).then_some(out)
}

/// Quick "nothing to do" test: ASCII without CR, tabs, double spaces, spaces before a newline,
/// three newlines in a row, or whitespace at either end. Such a text is already canonical.
fn is_clean_ascii(b: &[u8]) -> bool {
    if !b.is_ascii() {
        return false;
    }
    if b.first().is_some_and(u8::is_ascii_whitespace)
        || b.last().is_some_and(u8::is_ascii_whitespace)
    {
        return false;
    }
    !b.windows(2).any(|w| {
        matches!(
            w,
            [b'\r' | b'\t', _] | [_, b'\r' | b'\t'] | [b' ', b' ' | b'\n'] | [b'\n', b'\n']
        )
    })
}

/// A text that parses as JSON as a whole is data, not prose: it is left alone.
pub(super) fn is_json(text: &str) -> bool {
    let t = text.trim_start();
    (t.starts_with('{') || t.starts_with('['))
        && serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok()
}

pub(super) enum Segment<'a> {
    Code(&'a str),
    Prose(&'a str),
}

/// Cuts the text at code spans: a run of n backticks opens a span that ends at the next run of
/// exactly n backticks. An unmatched single or double run is plain prose; an unmatched fence
/// (three or more) runs to the end of the text, as Markdown renders it.
pub(super) fn split_code(text: &str) -> Vec<Segment<'_>> {
    let b = text.as_bytes();
    let mut segments = Vec::new();
    let (mut prose_start, mut i) = (0, 0);
    while let Some(tick) = memchr::memchr(b'`', &b[i..]) {
        i += tick;
        let run = backtick_run(b, i);
        let close = find_run(b, i + run, run);
        let end = match close {
            Some(c) => c + run,
            None if run >= 3 => b.len(),
            None => {
                i += run;
                continue;
            }
        };
        if prose_start < i {
            segments.push(Segment::Prose(&text[prose_start..i]));
        }
        segments.push(Segment::Code(&text[i..end]));
        prose_start = end;
        i = end;
    }
    if prose_start < b.len() || segments.is_empty() {
        segments.push(Segment::Prose(&text[prose_start..]));
    }
    segments
}

fn backtick_run(b: &[u8], from: usize) -> usize {
    b[from..].iter().take_while(|&&c| c == b'`').count()
}

/// The start of the next run of exactly `len` backticks at or after `from`.
fn find_run(b: &[u8], mut from: usize, len: usize) -> Option<usize> {
    while let Some(tick) = memchr::memchr(b'`', &b[from..]) {
        from += tick;
        let run = backtick_run(b, from);
        if run == len {
            return Some(from);
        }
        from += run;
    }
    None
}

/// What the mapping step does with one character.
enum Mapped {
    Keep,
    Drop,
    Into(char, &'static str),
}

fn map_one(c: char) -> Mapped {
    match c {
        '\u{200B}'..='\u{200F}'
        | '\u{2060}'
        | '\u{FEFF}'
        | '\u{00AD}'
        | '\u{202A}'..='\u{202E}'
        | '\u{2066}'..='\u{2069}' => Mapped::Drop,
        '\u{2018}' | '\u{2019}' | '\u{201A}' | '\u{201B}' | '\u{2032}' => {
            Mapped::Into('\'', "quotes_ascii")
        }
        '\u{201C}' | '\u{201D}' | '\u{201E}' | '\u{201F}' | '\u{2033}' => {
            Mapped::Into('"', "quotes_ascii")
        }
        '\u{00A0}'
        | '\u{1680}'
        | '\u{2000}'..='\u{200A}'
        | '\u{202F}'
        | '\u{205F}'
        | '\u{3000}' => Mapped::Into(' ', "spaces_collapsed"),
        _ => Mapped::Keep,
    }
}

/// The bytes where a character the mapping step may change starts: CR, and the UTF-8 lead bytes
/// of every character [`map_one`] maps (U+00A0/U+00AD: C2; U+1680: E1; U+2000–U+206F: E2;
/// U+3000: E3; U+FEFF: EF). Lead bytes are never inside a character, so each is a boundary.
fn is_candidate(b: u8) -> bool {
    matches!(b, b'\r' | 0xC2 | 0xE1 | 0xE2 | 0xE3 | 0xEF)
}

/// `after_code` / `before_code`: a code span touches the segment's start / end. An invisible
/// character next to a backtick is kept: removing it could join two backtick runs into one and
/// change where code spans are, which would make a second pass differ from the first.
///
/// Only candidate bytes ([`is_candidate`]) are looked at; the text between changes is copied
/// as whole slices, and nothing is allocated until the first change.
fn map_chars<'a>(
    prose: &'a str,
    after_code: bool,
    before_code: bool,
    fixes: &mut Fixes,
) -> Cow<'a, str> {
    let b = prose.as_bytes();
    let mut out: Option<String> = None;
    // `prose[..copied]` is in `out` (as mapped); what follows is still to copy.
    let mut copied = 0;
    let mut i = 0;
    while let Some(at) = b[i..].iter().position(|&x| is_candidate(x)).map(|p| i + p) {
        let c = prose[at..].chars().next().unwrap_or('\0');
        let len = c.len_utf8();
        i = at + len;
        let into = if c == '\r' {
            fixes.add("crlf_to_lf");
            if b.get(at + 1) == Some(&b'\n') {
                None
            } else {
                Some('\n')
            }
        } else {
            match map_one(c) {
                Mapped::Keep => continue,
                Mapped::Drop => {
                    let prev_tick = if at > copied {
                        b[at - 1] == b'`'
                    } else {
                        let last = out.as_ref().and_then(|o| o.as_bytes().last());
                        last.map_or(after_code, |&p| p == b'`')
                    };
                    let next_tick = b.get(i).map_or(before_code, |&n| n == b'`');
                    if prev_tick || next_tick {
                        continue;
                    }
                    fixes.add("invisible_removed");
                    None
                }
                Mapped::Into(to, code) => {
                    fixes.add(code);
                    Some(to)
                }
            }
        };
        let o = out.get_or_insert_with(|| String::with_capacity(prose.len()));
        o.push_str(&prose[copied..at]);
        if let Some(to) = into {
            o.push(to);
        }
        copied = i;
    }
    match out {
        None => Cow::Borrowed(prose),
        Some(mut o) => {
            o.push_str(&prose[copied..]);
            Cow::Owned(o)
        }
    }
}

fn nfc<'a>(s: &'a str, fixes: &mut Fixes) -> Cow<'a, str> {
    if s.is_ascii() || is_nfc_quick(s.chars()) == IsNormalized::Yes {
        return Cow::Borrowed(s);
    }
    let composed: String = s.nfc().collect();
    if composed == s {
        return Cow::Borrowed(s);
    }
    fixes.add("unicode_nfc");
    Cow::Owned(composed)
}

/// The layout step on one prose segment, appended to `out`. `first` / `last`: the segment starts
/// / ends the whole text, so its leading / trailing whitespace is trimmed.
fn layout(s: &str, first: bool, last: bool, out: &mut String, fixes: &mut Fixes) {
    // Whitespace is held back until the next visible character decides what it becomes.
    let mut pending_ws = String::new();
    let mut newlines = 0usize;
    let mut at_start = first;
    let mut line_start = false;
    let b = s.as_bytes();
    let mut i = 0;
    // Works on bytes: every character layout cares about is ASCII, so runs of other bytes are
    // copied as whole slices (always cut at character boundaries).
    while i < b.len() {
        match b[i] {
            b' ' | b'\t' => pending_ws.push(b[i] as char),
            b'\n' => {
                if !pending_ws.is_empty() {
                    fixes.add("trailing_whitespace");
                    pending_ws.clear();
                }
                newlines += 1;
                line_start = true;
            }
            _ => {
                let run = memchr::memchr3(b' ', b'\t', b'\n', &b[i..]).map_or(b.len(), |n| i + n);
                if newlines == 0 && !line_start && !at_start && pending_ws == " " {
                    // Between two words on a line: the common case, nothing to decide.
                    out.push(' ');
                    pending_ws.clear();
                } else {
                    flush(
                        &mut pending_ws,
                        &mut newlines,
                        at_start,
                        line_start,
                        out,
                        fixes,
                    );
                }
                at_start = false;
                line_start = false;
                out.push_str(&s[i..run]);
                i = run;
                continue;
            }
        }
        i += 1;
    }
    if last {
        if newlines > 0 || !pending_ws.is_empty() {
            fixes.add("trimmed");
        }
    } else {
        flush(
            &mut pending_ws,
            &mut newlines,
            at_start,
            line_start,
            out,
            fixes,
        );
    }
}

/// Writes the held-back newlines (at most two: one blank line) and spaces before a visible
/// character: kept as indentation at a line's start, else collapsed to one space.
fn flush(
    ws: &mut String,
    newlines: &mut usize,
    at_start: bool,
    line_start: bool,
    out: &mut String,
    fixes: &mut Fixes,
) {
    if at_start {
        if *newlines > 0 || !ws.is_empty() {
            fixes.add("trimmed");
        }
    } else {
        if *newlines > 2 {
            fixes.add("blank_lines_collapsed");
        }
        out.push_str(&"\n\n"[..(*newlines).min(2)]);
        if line_start {
            out.push_str(ws);
        } else if !ws.is_empty() {
            if ws != " " {
                fixes.add("spaces_collapsed");
            }
            out.push(' ');
        }
    }
    ws.clear();
    *newlines = 0;
}
