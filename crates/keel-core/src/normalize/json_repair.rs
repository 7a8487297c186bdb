//! JSON-example repair: a prompt that shows the model a JSON example with a dropped closing
//! brace or bracket gets the example completed, when exactly one completion is valid JSON (fix
//! code `schema_brace_recovered`).
//!
//! **What is an example.** In a prose segment (never inside a code span or fence, including a
//! fence labelled `json`: code is byte-identical by contract, and a fenced example is already
//! clearly delimited), a `{` or `[` that follows some prose of the same text (a text that starts
//! with `{` is data, not an example) opens a block. The block is scanned the way JSON is read:
//! `"…"` strings with `\` escapes, brackets pushed and popped. It ends where its brackets
//! balance (nothing to repair), at more closers than openers of a kind or a newline inside a
//! string (not JSON: left alone), or, still open, at the first blank line or the end of the segment.
//!
//! **Which completion.** For a block left open by one or two brackets, the example ends at the
//! end of the block's last line whose final character can end a JSON value (`}`, `]`, `"`, a
//! digit, `true`, `false`, `null`); trailing prose lines are not part of it. The missing closers
//! (counted per kind; two different ones in either order) are tried at every position right
//! after a value or an opener (a block with prose outside its strings is not JSON and is left
//! alone); each result is parsed. The example is repaired only when exactly one distinct text
//! parses: `{"a": {"b": 1, "c": 2}` is left alone, because `{"a": {"b": 1}, "c": 2}` and
//! `{"a": {"b": 1, "c": 2}}` are both valid. Examples over 16 KB or with more candidate
//! positions than the search allows are left alone.
//!
//! **A bound per request.** The search is bounded per example (size and positions), but an
//! example of 16 KB with two missing closers still means thousands of candidate parses (64
//! positions give 4,160 candidates of 16 KB: some 68 MB parsed), and a request may hold many
//! examples. So the work is also bounded per request by a [`RepairBudget`]: every byte of an
//! example scanned for positions and every byte of a candidate parsed is counted (counted, not
//! timed, so the same prompt always gets the same answer on any machine and under any load).
//! A candidate that would pass the budget is not parsed: repair stops there, the example it
//! belonged to is left as it was, and so is every later example of the request. The default,
//! [`RepairBudget::DEFAULT_BYTES`] (1 MiB), is some sixty times what a typical request's
//! examples need (a 300-byte example with one closer missing and 20 positions: 6 KB) and caps a
//! request's repair at a few milliseconds of parsing.

/// Fix code for a repaired example.
pub(super) const CODE: &str = "schema_brace_recovered";

const MAX_EXAMPLE: usize = 16 * 1024;
/// Candidate positions tried for one missing closer, and for two (pairs grow quadratically).
const MAX_POSITIONS_ONE: usize = 1024;
const MAX_POSITIONS_TWO: usize = 64;

/// The work JSON-example repair may still do for one request, in bytes examined (see the
/// module doc). One budget is shared by every text of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepairBudget {
    limit_bytes: u64,
    used_bytes: u64,
    exhausted: bool,
}

impl RepairBudget {
    /// The default bound per request: 1 MiB examined.
    pub const DEFAULT_BYTES: u64 = 1 << 20;

    /// A budget of `limit_bytes` examined.
    pub fn new(limit_bytes: u64) -> RepairBudget {
        RepairBudget {
            limit_bytes,
            used_bytes: 0,
            exhausted: false,
        }
    }

    /// The bytes examined so far (never more than the limit).
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes
    }

    /// Whether some work was refused: an example was left alone for want of budget.
    pub fn exhausted(&self) -> bool {
        self.exhausted
    }

    /// Takes `bytes` of work if the budget has them; otherwise takes nothing, marks the budget
    /// exhausted (no later work is allowed) and says no.
    fn spend(&mut self, bytes: usize) -> bool {
        let bytes = bytes as u64;
        if self.exhausted || self.used_bytes.saturating_add(bytes) > self.limit_bytes {
            self.exhausted = true;
            return false;
        }
        self.used_bytes += bytes;
        true
    }
}

impl Default for RepairBudget {
    fn default() -> RepairBudget {
        RepairBudget::new(RepairBudget::DEFAULT_BYTES)
    }
}

/// How a block opened at some `{` / `[` ended.
enum Block {
    /// Its brackets balance; the index just past the last closer.
    Balanced(usize),
    /// Not JSON; scanning resumes after this index.
    Invalid(usize),
    /// Still open at this index (a blank line or the segment's end).
    Open(usize),
}

/// Repairs the open JSON examples of one prose segment within `budget`. `after_prose`: some
/// non-blank text precedes the segment in its text. `None` when nothing was repaired.
pub(super) fn repair_examples(
    prose: &str,
    after_prose: bool,
    budget: &mut RepairBudget,
) -> Option<String> {
    let b = prose.as_bytes();
    let mut seen_prose = after_prose;
    let (mut out, mut copied) = (String::new(), 0);
    let mut i = 0;
    while i < b.len() {
        if !matches!(b[i], b'{' | b'[') {
            seen_prose |= !b[i].is_ascii_whitespace();
            i += 1;
            continue;
        }
        match scan(b, i) {
            Block::Balanced(end) => i = end,
            Block::Invalid(at) => i = at + 1,
            Block::Open(end) => {
                if seen_prose {
                    if let Some((example_end, fixed)) = complete(&prose[i..end], budget) {
                        out.push_str(&prose[copied..i]);
                        out.push_str(&fixed);
                        copied = i + example_end;
                    }
                }
                i = end;
            }
        }
        seen_prose = true;
    }
    if copied == 0 {
        return None;
    }
    out.push_str(&prose[copied..]);
    Some(out)
}

/// Reads a block from the opener at `start`. Brackets are counted per kind rather than matched
/// on a stack, so that a closer missing in the middle (`{"a": [1, 2}`) still reads as an open
/// block and can be completed.
fn scan(b: &[u8], start: usize) -> Block {
    let mut count = Counts::default();
    for (i, step) in Walk::new(b, start) {
        match step {
            Step::NewlineInString => return Block::Invalid(i),
            Step::StringEnd => {}
            Step::Byte(c @ (b'{' | b'[' | b'}' | b']')) => {
                count.add(c);
                match count.missing() {
                    Some((0, 0)) => return Block::Balanced(i + 1),
                    Some(_) => {}
                    None => return Block::Invalid(i),
                }
            }
            Step::Byte(b'\n') if blank_line_follows(&b[i + 1..]) => return Block::Open(i),
            Step::Byte(_) => {}
        }
    }
    Block::Open(b.len())
}

/// What [`Walk`] reports at a byte.
enum Step {
    /// A byte outside strings (opening quotes are not reported).
    Byte(u8),
    /// The quote closing a string.
    StringEnd,
    /// A newline inside a string: not JSON.
    NewlineInString,
}

/// Walks bytes the way JSON is read: string contents (with `\` escapes) are skipped.
struct Walk<'a> {
    b: &'a [u8],
    i: usize,
    in_string: bool,
}

impl<'a> Walk<'a> {
    fn new(b: &'a [u8], from: usize) -> Self {
        Walk {
            b,
            i: from,
            in_string: false,
        }
    }
}

impl Iterator for Walk<'_> {
    type Item = (usize, Step);

    fn next(&mut self) -> Option<(usize, Step)> {
        while let Some(&c) = self.b.get(self.i) {
            let at = self.i;
            self.i += 1;
            match (self.in_string, c) {
                (true, b'\\') => self.i += 1,
                (true, b'"') => {
                    self.in_string = false;
                    return Some((at, Step::StringEnd));
                }
                (true, b'\n') => return Some((at, Step::NewlineInString)),
                (true, _) => {}
                (false, b'"') => self.in_string = true,
                (false, _) => return Some((at, Step::Byte(c))),
            }
        }
        None
    }
}

/// Brackets seen, per kind.
#[derive(Default)]
struct Counts {
    curly: isize,
    square: isize,
}

impl Counts {
    fn add(&mut self, c: u8) {
        match c {
            b'{' => self.curly += 1,
            b'}' => self.curly -= 1,
            b'[' => self.square += 1,
            b']' => self.square -= 1,
            _ => {}
        }
    }

    /// The missing `}` and `]`; `None` when some kind has more closers than openers.
    fn missing(&self) -> Option<(usize, usize)> {
        Some((
            usize::try_from(self.curly).ok()?,
            usize::try_from(self.square).ok()?,
        ))
    }
}

fn blank_line_follows(rest: &[u8]) -> bool {
    let line_end = rest.iter().position(|&c| c == b'\n').unwrap_or(rest.len());
    rest[..line_end].iter().all(|c| matches!(c, b' ' | b'\t'))
}

/// For an open block: the example's end (within `block`) and its one valid completion, found
/// within `budget` (`None` when the budget runs out before the search ends).
fn complete(block: &str, budget: &mut RepairBudget) -> Option<(usize, String)> {
    let end = example_end(block)?;
    let example = &block[..end];
    if example.len() > MAX_EXAMPLE || !budget.spend(example.len()) {
        return None;
    }
    let (closers, positions) = closers_and_positions(example)?;
    let mut found: Option<String> = None;
    // `false`: stop, and leave the example alone (a second valid completion, or no budget).
    let mut try_text = |text: String| -> bool {
        if !budget.spend(text.len()) {
            return false;
        }
        if serde_json::from_str::<serde::de::IgnoredAny>(&text).is_err() {
            return true;
        }
        match &found {
            Some(f) if *f != text => false,
            _ => {
                found = Some(text);
                true
            }
        }
    };
    match closers.as_slice() {
        [one] if positions.len() <= MAX_POSITIONS_ONE => {
            for &p in &positions {
                if !try_text(insert(example, &[(p, *one)])) {
                    return None;
                }
            }
        }
        [first, second] if positions.len() <= MAX_POSITIONS_TWO => {
            // Two different closers may come in either order.
            let orders: &[(u8, u8)] = if first == second {
                &[(*first, *second)]
            } else {
                &[(*first, *second), (*second, *first)]
            };
            for &(x, y) in orders {
                for (n, &p) in positions.iter().enumerate() {
                    for &q in &positions[n..] {
                        if !try_text(insert(example, &[(p, x), (q, y)])) {
                            return None;
                        }
                    }
                }
            }
        }
        _ => return None,
    }
    found.map(|f| (end, f))
}

/// The end of the block's last line whose last non-blank character can end a JSON value.
fn example_end(block: &str) -> Option<usize> {
    let mut line_end = block.len();
    loop {
        let line_start = block[..line_end].rfind('\n').map_or(0, |n| n + 1);
        let trimmed = block[line_start..line_end].trim_end();
        let ends_value = trimmed.ends_with(['}', ']', '"'])
            || trimmed.ends_with(|c: char| c.is_ascii_digit())
            || ["true", "false", "null"]
                .iter()
                .any(|w| trimmed.ends_with(w));
        if ends_value && line_start + trimmed.len() > 0 {
            return Some(line_start + trimmed.len());
        }
        if line_start == 0 {
            return None;
        }
        line_end = line_start - 1;
    }
}

/// The closers the example lacks and the positions where one may go: right after a value's end
/// (a string's closing quote, a digit, `true`/`false`/`null`, a closer) or an opener. `None`
/// when the example has prose outside strings, ends inside a string or has more closers than
/// openers of a kind.
fn closers_and_positions(example: &str) -> Option<(Vec<u8>, Vec<usize>)> {
    let mut count = Counts::default();
    let mut positions = Vec::new();
    let mut walk = Walk::new(example.as_bytes(), 0);
    for (i, step) in &mut walk {
        match step {
            Step::StringEnd => positions.push(i + 1),
            Step::NewlineInString => return None,
            // Prose outside strings: no insertion can make this JSON.
            Step::Byte(c) if !is_json_byte(c) => return None,
            Step::Byte(c) => {
                count.add(c);
                // A closer can only follow a value's end or an opener; elsewhere (after `,`,
                // `:`, inside a number's sign or a keyword) the result never parses.
                if matches!(c, b'}' | b']' | b'{' | b'[' | b'0'..=b'9' | b'e' | b'l') {
                    positions.push(i + 1);
                }
            }
        }
    }
    let in_string = walk.in_string;
    let (curly, square) = count.missing()?;
    if in_string {
        return None;
    }
    let closers = std::iter::repeat_n(b'}', curly)
        .chain(std::iter::repeat_n(b']', square))
        .collect();
    Some((closers, positions))
}

/// A byte that may appear outside strings in JSON: structure, whitespace, numbers, and the
/// letters of `true`, `false` and `null`.
fn is_json_byte(c: u8) -> bool {
    matches!(
        c,
        b' ' | b'\t' | b'\n' | b'\r' | b'{' | b'}' | b'[' | b']' | b',' | b':' | b'0'
            ..=b'9'
                | b'-'
                | b'+'
                | b'.'
                | b'E'
                | b't'
                | b'r'
                | b'u'
                | b'e'
                | b'f'
                | b'a'
                | b'l'
                | b's'
                | b'n'
    )
}

/// `text` with each `(position, byte)` inserted; positions ascending (equal ones keep order).
fn insert(text: &str, at: &[(usize, u8)]) -> String {
    let mut out = String::with_capacity(text.len() + at.len());
    let mut copied = 0;
    for &(p, c) in at {
        out.push_str(&text[copied..p]);
        out.push(c as char);
        copied = p;
    }
    out.push_str(&text[copied..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fix(s: &str) -> Option<String> {
        repair_examples(s, false, &mut RepairBudget::default())
    }

    #[test]
    fn one_unambiguous_completion_is_applied() {
        assert_eq!(
            fix("Reply like {\"name\": \"x\", \"age\": 3").as_deref(),
            Some("Reply like {\"name\": \"x\", \"age\": 3}")
        );
        assert_eq!(
            fix("Use:\n{\n  \"tags\": [\"a\", \"b\"\n}\n\nThen stop.").as_deref(),
            Some("Use:\n{\n  \"tags\": [\"a\", \"b\"]\n}\n\nThen stop.")
        );
        // A prose line after the example is not part of it.
        assert_eq!(
            fix("Format: {\"ok\": true\nKeep it short.").as_deref(),
            Some("Format: {\"ok\": true}\nKeep it short.")
        );
        // A closer missing in the middle.
        assert_eq!(
            fix("Like {\"a\": [1, 2}").as_deref(),
            Some("Like {\"a\": [1, 2]}")
        );
        // Two missing closers, one place for them.
        assert_eq!(fix("Like [{\"a\": 1").as_deref(), Some("Like [{\"a\": 1}]"));
    }

    #[test]
    fn ambiguous_balanced_and_non_json_blocks_are_left_alone() {
        for s in [
            "Like {\"a\": {\"b\": 1, \"c\": 2}",
            "Like {\"a\": 1}",
            "{\"a\": 1",
            "Use {name} and [x",
            "Like {\"a\": \"b\ncd\"",
            "Like {\"a\": 1 as shown.",
            "Like {{{{\"a\": 1",
        ] {
            assert_eq!(fix(s), None, "{s:?}");
        }
    }

    #[test]
    fn after_prose_counts_earlier_segments() {
        assert_eq!(
            repair_examples("{\"a\": 1", true, &mut RepairBudget::default()).as_deref(),
            Some("{\"a\": 1}")
        );
    }

    /// An example of about 16 KB with two different closers missing and 64 positions for them,
    /// where only the completion at the very end parses: every one of the 4,160 candidates
    /// would be parsed, some 68 MB.
    fn pathological_example() -> String {
        let value = "x".repeat(500);
        let members: Vec<String> = (0..31).map(|i| format!("\"k{i}\": \"{value}\"")).collect();
        format!("Reply like [{{{}", members.join(", "))
    }

    #[test]
    fn a_pathological_example_does_at_most_the_budget_of_work() {
        let text = pathological_example();
        assert!(text.len() > 15_000 && text.len() <= MAX_EXAMPLE + 16);
        let (closers, positions) = closers_and_positions(&text["Reply like ".len()..]).unwrap();
        assert_eq!((closers.len(), positions.len()), (2, 64));
        let unbounded: u64 = 2 * 64 * 65 / 2 * (text.len() as u64 - 9);
        assert!(
            unbounded > 60 << 20,
            "the search alone would parse {unbounded} bytes"
        );

        let mut budget = RepairBudget::default();
        assert_eq!(repair_examples(&text, false, &mut budget), None);
        assert!(budget.exhausted());
        assert!(budget.used_bytes() <= RepairBudget::DEFAULT_BYTES);
        // Once spent, a later example, however small, is left alone too.
        assert_eq!(repair_examples("Like {\"a\": 1", false, &mut budget), None);

        // With room for it, the same example is repaired: the budget is what stopped it.
        let mut roomy = RepairBudget::new(u64::MAX);
        let fixed = repair_examples(&text, false, &mut roomy).unwrap();
        assert!(fixed.ends_with("\"}]"));
        assert!(!roomy.exhausted());
        assert!(roomy.used_bytes() > RepairBudget::DEFAULT_BYTES);
    }

    #[test]
    fn examples_before_the_budget_runs_out_are_repaired() {
        let mut budget = RepairBudget::new(200);
        let text = "Like {\"a\": 1\n\nor like {\"b\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16\n";
        let fixed = repair_examples(text, false, &mut budget).unwrap();
        assert!(fixed.starts_with("Like {\"a\": 1}\n"), "{fixed:?}");
        assert!(
            fixed.ends_with("16\n"),
            "the second example is left as it was: {fixed:?}"
        );
        assert!(budget.exhausted() && budget.used_bytes() <= 200);
    }
}
