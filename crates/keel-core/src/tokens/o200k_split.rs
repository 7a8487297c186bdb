//! o200k's pre-tokenizer for ASCII text, written out by hand. A byte-pair encoding first splits
//! the text into pieces by a regular expression, then merges each piece's bytes; OpenAI's
//! pattern for o200k (`tiktoken_rs::O200K_BASE_PAT_STR`) needs a backtracking engine (a
//! lookahead), and that engine spends about 200 instructions a byte, four fifths of a count.
//! Over ASCII the pattern's classes are plain byte tests, so [`ascii_pieces`] finds the same
//! pieces in one forward pass.
//!
//! **Where text is not ASCII.** [`segments`] cuts a text at places where a piece of the
//! pattern always ends and the next piece does not depend on anything before it; a segment
//! holding a byte beyond ASCII goes to the regular expression, the others to [`ascii_pieces`].
//! Two kinds of place qualify:
//! - after a `\n`, before an ASCII character that is neither whitespace nor `/`: no piece runs
//!   from a newline into such a character (newlines end a whitespace piece, or trail a
//!   punctuation piece, whose tail may only take `\r`, `\n` and `/`);
//! - at a space between two ASCII letters: the letters' piece ends at the space (its optional
//!   contraction begins with `'`), and the space starts the next word's piece.
//!
//! In both cases the pattern's one lookahead (`\s+(?!\S)`) reads the same at the cut as it
//! would read in the whole text. The tests hold every count to tiktoken's on random text mixing
//! ASCII with letters, marks, digits and spaces from other scripts.

/// The pattern's alternatives over ASCII, in order (the first that matches at a place wins):
/// 1. `[^\r\n\p{L}\p{N}]?[\p{Lu}…]*[\p{Ll}…]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`
/// 2. `[^\r\n\p{L}\p{N}]?[\p{Lu}…]+[\p{Ll}…]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?`
/// 3. `\p{N}{1,3}`
/// 4. ` ?[^\s\p{L}\p{N}]+[\r\n/]*`
/// 5. `\s*[\r\n]+`
/// 6. `\s+(?!\S)`
/// 7. `\s+`
///
/// Over ASCII, upper and lower case letters are disjoint, so 1 and 2 together take an optional
/// lead byte, the upper-case run, then the lower-case run (at least one of them non-empty).
/// `\s` is `\t \n \x0B \x0C \r` and space (Unicode's White_Space within ASCII).
pub(super) fn ascii_pieces(text: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= text.len() {
            return None;
        }
        let end = piece_end(text, at);
        let piece = &text[at..end];
        at = end;
        Some(piece)
    })
}

/// Each byte's classes, as bits: one table read where a byte is tested.
const UPPER: u8 = 1;
const LOWER: u8 = 2;
const DIGIT: u8 = 4;
/// `\s` over ASCII: `\t \n \x0B \x0C \r` and space (Unicode's White_Space).
const SPACE: u8 = 8;
/// `\r` and `\n`.
const NEWLINE: u8 = 16;
/// What a punctuation piece's tail takes: `\r`, `\n` and `/`.
const TAIL: u8 = 32;
/// Past the end of the text.
const END: u8 = 64;
const LETTER: u8 = UPPER | LOWER;

static CLASS: [u8; 256] = {
    let mut class = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        class[b] = if c.is_ascii_uppercase() {
            UPPER
        } else if c.is_ascii_lowercase() {
            LOWER
        } else if c.is_ascii_digit() {
            DIGIT
        } else if c == b'\r' || c == b'\n' {
            SPACE | NEWLINE | TAIL
        } else if c == b' ' || c == b'\t' || c == 0x0B || c == 0x0C {
            SPACE
        } else if c == b'/' {
            TAIL
        } else {
            0
        };
        b += 1;
    }
    class
};

/// Neither whitespace, letter nor digit (`[^\s\p{L}\p{N}]` over ASCII), nor the end.
fn is_other(class: u8) -> bool {
    class & (LETTER | DIGIT | SPACE | END) == 0
}

/// Where the piece starting at `i` ends.
fn piece_end(t: &[u8], i: usize) -> usize {
    let class = |j: usize| t.get(j).map_or(END, |&b| CLASS[b as usize]);
    let c = class(i);
    // 1 and 2: letters, after one optional byte that is not a newline, letter or digit.
    let letters = if c & LETTER != 0 {
        Some(i)
    } else if c & (NEWLINE | DIGIT) == 0 && class(i + 1) & LETTER != 0 {
        Some(i + 1)
    } else {
        None
    };
    if let Some(mut j) = letters {
        while class(j) & UPPER != 0 {
            j += 1;
        }
        while class(j) & LOWER != 0 {
            j += 1;
        }
        return j + contraction(&t[j..]);
    }
    // 3: up to three digits.
    if c & DIGIT != 0 {
        let mut j = i + 1;
        while j < i + 3 && class(j) & DIGIT != 0 {
            j += 1;
        }
        return j;
    }
    // 4: an optional space, a run of other bytes, then any `\r`, `\n` and `/`.
    let run = if t[i] == b' ' && is_other(class(i + 1)) {
        Some(i + 1)
    } else if is_other(c) {
        Some(i)
    } else {
        None
    };
    if let Some(mut j) = run {
        while is_other(class(j)) {
            j += 1;
        }
        while class(j) & TAIL != 0 {
            j += 1;
        }
        return j;
    }
    // Whitespace from here on: the run it starts.
    let mut r = i;
    let mut last_newline = None;
    while class(r) & SPACE != 0 {
        if class(r) & NEWLINE != 0 {
            last_newline = Some(r);
        }
        r += 1;
    }
    match last_newline {
        // 5: the run up to its last newline.
        Some(k) => k + 1,
        // 6: the run to the end of the text, or all but its last byte before a non-space.
        None if r == t.len() || r - i == 1 => r,
        None => r - 1,
    }
}

/// The length of the contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`, any case) that
/// `t` starts with, or 0.
fn contraction(t: &[u8]) -> usize {
    if t.first() != Some(&b'\'') {
        return 0;
    }
    let lower = |j: usize| t.get(j).map(|b| b.to_ascii_lowercase());
    match (lower(1), lower(2)) {
        (Some(b's' | b't' | b'm' | b'd'), _) => 2,
        (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => 3,
        _ => 0,
    }
}

/// `text` cut into segments as the module docs say, each with whether it is all ASCII. An
/// ASCII text is one segment; a text with a few other characters (a name, a curly quote) has
/// those in short segments, each reaching to the nearest cuts around them.
pub(super) fn segments(text: &str) -> impl Iterator<Item = (&str, bool)> {
    let t = text.as_bytes();
    let mut at = 0;
    // A segment beyond ASCII found ahead of the ASCII one returned before it.
    let mut pending: Option<(usize, usize)> = None;
    std::iter::from_fn(move || {
        if let Some((from, to)) = pending.take() {
            at = to;
            return Some((&text[from..to], false));
        }
        if at >= t.len() {
            return None;
        }
        // Most prompts are ASCII throughout: checked a word at a time, they are one segment.
        let rest = &t[at..];
        let wide = match rest.is_ascii() {
            true => None,
            false => rest.iter().position(|b| !b.is_ascii()).map(|k| at + k),
        };
        let Some(wide) = wide else {
            let all = &text[at..];
            at = t.len();
            return Some((all, true));
        };
        let from = (at + 1..=wide).rev().find(|&p| is_cut(t, p)).unwrap_or(at);
        let to = (wide + 1..t.len())
            .find(|&p| is_cut(t, p))
            .unwrap_or(t.len());
        if from == at {
            at = to;
            return Some((&text[from..to], false));
        }
        pending = Some((from, to));
        let ascii = &text[at..from];
        at = from;
        Some((ascii, true))
    })
}

/// Whether the text may be cut before byte `p` (see the module docs).
fn is_cut(t: &[u8], p: usize) -> bool {
    if p == 0 || p >= t.len() {
        return false;
    }
    let (before, here) = (t[p - 1], t[p]);
    let after_newline =
        before == b'\n' && here.is_ascii() && CLASS[here as usize] & (SPACE | TAIL) == 0;
    let between_words = here == b' '
        && before.is_ascii_alphabetic()
        && t.get(p + 1).is_some_and(|b| b.is_ascii_alphabetic());
    after_newline || between_words
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<&str> {
        ascii_pieces(text.as_bytes())
            .map(|p| std::str::from_utf8(p).unwrap())
            .collect()
    }

    #[test]
    fn splits_as_the_pattern_does() {
        assert_eq!(pieces("Hello, world."), ["Hello", ",", " world", "."]);
        assert_eq!(pieces("don't  HELLOworld"), ["don't", " ", " HELLOworld"]);
        assert_eq!(pieces("12345 x"), ["123", "45", " x"]);
        assert_eq!(pieces("a  \n\n  b"), ["a", "  \n\n", " ", " b"]);
        assert_eq!(pieces("x;\n/y"), ["x", ";\n/", "y"]);
        assert_eq!(pieces("end   "), ["end", "   "]);
        assert_eq!(pieces("\t.x"), ["\t", ".x"]);
    }

    #[test]
    fn cuts_only_where_the_pattern_restarts() {
        let text = "plain words ’quoted’ here\nnext line";
        let segs: Vec<(&str, bool)> = segments(text).collect();
        assert_eq!(segs.iter().map(|s| s.0).collect::<String>(), text);
        assert_eq!(
            segs,
            [
                ("plain", true),
                (" words ’quoted’ here\n", false),
                ("next line", true)
            ]
        );
        assert_eq!(segments("é").collect::<Vec<_>>(), [("é", false)]);
        assert_eq!(segments("").count(), 0);
    }
}
