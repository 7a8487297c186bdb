//! Sentences of a prose segment (a stretch of text outside code spans), as `full` mode's rules
//! and intent classifier see them.
//!
//! **Lines.** The segment is cut at newlines. Lines that are not running prose are skipped
//! whole: Markdown headings (`#`), block quotes (`>`), table rows (`|`), and indented code (four
//! spaces or a tab). A list marker at a line's start (`-`, `*`, `+`, `1.`, `1)`) is not part of
//! the line's first sentence.
//!
//! **Sentences.** A line is cut after each `.`, `!` or `?` that is followed by whitespace or ends
//! the line; the sentence's text excludes that terminator and surrounding whitespace. So
//! `3.5 mm` or `e.g.x` are not cut, `e.g. this` is (harmless: such a fragment matches no rule).
//!
//! **Instruction sentences.** A sentence is an instruction sentence when it is not a question
//! (its terminator is not `?`) and contains no quoted or bracketed text: no `"` at all, and no
//! byte inside a `{…}` or `[…]` block. Brackets are counted across lines, so a multi-line JSON
//! example is covered, and an unclosed `{` or `[` shields everything after it in the segment:
//! what follows a broken example may be part of it.

use std::ops::Range;

/// One sentence of a prose segment.
pub(super) struct Sentence {
    /// The sentence's text (terminator and surrounding whitespace excluded), as a byte range of
    /// the segment.
    pub range: Range<usize>,
    /// Safe to rewrite: see the module doc.
    pub instruction: bool,
}

/// The sentences of `prose`, in order, each with its instruction flag.
pub(super) fn sentences(prose: &str) -> Vec<Sentence> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut line_start = 0;
    for line in prose.split_inclusive('\n') {
        let body = line.trim_end_matches('\n');
        let depth_before = depth;
        depth = bracket_depth_after(body, depth);
        if !is_running_prose(body) {
            line_start += line.len();
            continue;
        }
        let first = list_marker_len(body);
        split_line(prose, line_start, first, body.len(), depth_before, &mut out);
        line_start += line.len();
    }
    out
}

/// Cuts one line (`prose[base + from .. base + to]`) into sentences.
fn split_line(
    prose: &str,
    base: usize,
    from: usize,
    to: usize,
    depth_at_start: usize,
    out: &mut Vec<Sentence>,
) {
    let b = prose.as_bytes();
    let mut depth = depth_at_start;
    let mut start = base + from;
    let mut shielded = depth > 0;
    let end = base + to;
    let mut i = start;
    while i < end {
        match b[i] {
            b'{' | b'[' => {
                depth += 1;
                shielded = true;
            }
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                shielded = true;
            }
            b'"' => shielded = true,
            b'.' | b'!' | b'?' if i + 1 == end || b[i + 1].is_ascii_whitespace() => {
                push(prose, start..i, b[i] == b'?', shielded, out);
                start = i + 1;
                shielded = depth > 0;
            }
            _ => {}
        }
        i += 1;
    }
    push(prose, start..end, false, shielded, out);
}

/// Records a sentence, trimmed; empty ones are dropped.
fn push(prose: &str, r: Range<usize>, question: bool, shielded: bool, out: &mut Vec<Sentence>) {
    let s = &prose[r.clone()];
    let lead = s.len() - s.trim_start().len();
    let trail = s.len() - s.trim_end().len();
    if lead + trail >= s.len() {
        return;
    }
    out.push(Sentence {
        range: r.start + lead..r.end - trail,
        instruction: !question && !shielded,
    });
}

/// The bracket depth after a line, starting from `depth`. Closers beyond the depth count as
/// nothing (a stray `}` in prose does not open anything).
fn bracket_depth_after(line: &str, mut depth: usize) -> usize {
    for c in line.bytes() {
        match c {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    depth
}

/// False for headings, block quotes, table rows and indented code.
fn is_running_prose(line: &str) -> bool {
    if line.starts_with("    ") || line.starts_with('\t') {
        return false;
    }
    !matches!(line.trim_start().bytes().next(), Some(b'#' | b'>' | b'|'))
}

/// The length of a list marker and its space at the start of a line (indentation included), or
/// 0.
fn list_marker_len(line: &str) -> usize {
    let indent = line.len() - line.trim_start().len();
    let rest = &line[indent..];
    let marker = match rest.bytes().next() {
        Some(b'-' | b'*' | b'+') => 1,
        Some(c) if c.is_ascii_digit() => {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            match rest.as_bytes().get(digits) {
                Some(b'.' | b')') => digits + 1,
                _ => return 0,
            }
        }
        _ => return 0,
    };
    match rest.as_bytes().get(marker) {
        Some(b' ') => indent + marker + 1,
        _ => 0,
    }
}

/// The clauses of a sentence: cut at `,`, `;` and `:`, each trimmed, as byte ranges of
/// `sentence` (empty clauses dropped).
pub(super) fn clauses(sentence: &str) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, c) in sentence.char_indices() {
        if matches!(c, ',' | ';' | ':') {
            push_trimmed(sentence, start..i, &mut out);
            start = i + 1;
        }
    }
    push_trimmed(sentence, start..sentence.len(), &mut out);
    out
}

fn push_trimmed(s: &str, r: Range<usize>, out: &mut Vec<Range<usize>>) {
    let part = &s[r.clone()];
    let lead = part.len() - part.trim_start().len();
    let trimmed = part.trim();
    if !trimmed.is_empty() {
        out.push(r.start + lead..r.start + lead + trimmed.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instructions(s: &str) -> Vec<&str> {
        sentences(s)
            .into_iter()
            .filter(|x| x.instruction)
            .map(|x| &s[x.range])
            .collect()
    }

    #[test]
    fn sentences_lines_and_shields() {
        let s = "Summarize it. Be brief!\n- Don't use markdown\nIs it ok? Say \"be brief\". Use {x} here.\n# Be brief\n    Be brief\nRate 3.5 stars";
        assert_eq!(
            instructions(s),
            [
                "Summarize it",
                "Be brief",
                "Don't use markdown",
                "Rate 3.5 stars"
            ]
        );
        // An unclosed bracket shields the rest of the segment.
        assert_eq!(instructions("Be brief. {\"a\": 1\nBe brief."), ["Be brief"]);
        assert_eq!(
            instructions("1) Be brief\n2. Be kind"),
            ["Be brief", "Be kind"]
        );
    }

    #[test]
    fn clauses_are_cut_at_punctuation() {
        let s = "Be brief, and clear;  no markdown :x";
        let got: Vec<&str> = clauses(s).into_iter().map(|r| &s[r]).collect();
        assert_eq!(got, ["Be brief", "and clear", "no markdown", "x"]);
    }
}
