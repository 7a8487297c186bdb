//! The character classes OpenAI's pre-tokenizers read ([`super::o200k_split`],
//! [`super::cl100k_split`]), as the bits of [`embedded::class`]: ASCII by a table read a byte,
//! other characters by a binary search of the ranges the build script read from regex-syntax
//! (the tables tiktoken's own patterns are matched by).

use super::embedded::class::*;

static CLASSES: [u8; 128] = {
    let mut class = [0u8; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        class[b] = if c.is_ascii_uppercase() {
            CASED_UPPER
        } else if c.is_ascii_lowercase() {
            CASED_LOWER
        } else if c.is_ascii_digit() {
            NUMBER
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

/// The code points beyond ASCII that are letters, marks, numbers or whitespace: sorted ranges of
/// three little-endian `u32`s (first, last, bits).
static UNICODE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/unicode_classes.bin"));

/// The classes of each code point below U+10000, a byte each (64 KiB of the binary, resident
/// only where text reaches): one read for nearly every character.
static BMP: &[u8; 0x10000] = include_bytes!(concat!(env!("OUT_DIR"), "/bmp_classes.bin"));

/// The classes of a character beyond ASCII.
fn unicode(c: char) -> u8 {
    let c = c as u32;
    if c < 0x10000 {
        return BMP[c as usize];
    }
    let field = |range: usize, k: usize| {
        let at = range * 12 + k * 4;
        UNICODE
            .get(at..at + 4)
            .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let ranges = UNICODE.len() / 12;
    // The first range whose last code point is not below `c`.
    let (mut lo, mut hi) = (0, ranges);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if field(mid, 1) < c {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    match lo < ranges && field(lo, 0) <= c {
        true => field(lo, 2) as u8,
        false => 0,
    }
}

/// A text as the splitters read it, a character's classes at a time. `ASCII` says the text is
/// all ASCII (checked once, a word at a time): each character is then one byte and its classes
/// one table read, and the compiler drops every branch for wider characters.
#[derive(Clone, Copy)]
pub(super) struct Text<'a, const ASCII: bool>(pub(super) &'a str);

impl<'a, const ASCII: bool> Text<'a, ASCII> {
    pub(super) fn bytes(self) -> &'a [u8] {
        self.0.as_bytes()
    }

    /// The classes of the character at byte `i` (a character boundary), and its length in
    /// bytes; [`END`] and 0 past the end.
    #[inline(always)]
    pub(super) fn at(self, i: usize) -> (u8, usize) {
        match self.bytes().get(i) {
            Some(&b) if ASCII || b < 0x80 => (CLASSES[(b & 0x7F) as usize], 1),
            None => (END, 0),
            Some(_) => beyond_ascii(self.0, i),
        }
    }

    /// The end of the run from byte `j` of at most `most` characters whose classes pass `is`.
    #[inline(always)]
    pub(super) fn run(self, mut j: usize, is: impl Fn(u8) -> bool, most: usize) -> usize {
        let mut n = 0;
        while n < most {
            let (c, width) = self.at(j);
            if !is(c) {
                break;
            }
            j += width;
            n += 1;
        }
        j
    }

    /// Where the whitespace piece starting at byte `i` ends, by the alternatives both patterns
    /// end with: the run up to its last newline (o200k's `\s*[\r\n]+`, cl100k's `\s*[\r\n]`);
    /// the run to the end of the text (cl100k's `\s++$` comes before its newline rule, o200k's
    /// `\s+(?!\S)` after); all of it but its last character when a non-space follows
    /// (`\s+(?!\S)`); else its one character.
    #[inline(always)]
    pub(super) fn whitespace_end(self, i: usize, end_first: bool) -> usize {
        let (mut r, mut newline_end, mut last) = (i, None, i);
        loop {
            let (c, width) = self.at(r);
            if c & SPACE == 0 {
                break;
            }
            if c & NEWLINE != 0 {
                newline_end = Some(r + 1);
            }
            last = r;
            r += width;
        }
        match newline_end {
            _ if end_first && r == self.0.len() => r,
            Some(end) => end,
            None if r == self.0.len() || last == i => r,
            None => last,
        }
    }

    /// Where the run of punctuation from byte `i` ends, with what follows it in `tail` (a class
    /// bit): both patterns' ` ?[^\s\p{L}\p{N}]+` and a tail (`[\r\n]*`, `[\r\n/]*`). `None` where
    /// no such run starts at `i`.
    #[inline(always)]
    pub(super) fn punctuation_end(self, i: usize, tail: u8) -> Option<usize> {
        let from = match self.bytes().get(i) == Some(&b' ') && is_other(self.at(i + 1).0) {
            true => i + 1,
            false => Some(i).filter(|&i| is_other(self.at(i).0))?,
        };
        let run = self.run(from, is_other, usize::MAX);
        Some(self.run(run, |c| c & tail != 0, usize::MAX))
    }

    /// The length of the contraction at byte `i` (see [`contraction`]).
    #[inline(always)]
    pub(super) fn contraction(self, i: usize) -> usize {
        match self.bytes().get(i) {
            Some(b'\'') => contraction(&self.0[i..]),
            _ => 0,
        }
    }
}

/// Neither whitespace, letter nor number (`[^\s\p{L}\p{N}]`; a mark is one), nor the end.
pub(super) fn is_other(class: u8) -> bool {
    class & (LETTER | NUMBER | SPACE | END) == 0
}

/// A pre-tokenizer: where the piece that starts at a byte ends.
pub(super) trait Pattern {
    /// Where the piece starting at byte `i` of `t` ends (past `i`).
    fn piece_end<const A: bool>(t: Text<'_, A>, i: usize) -> usize;
}

/// The pieces of `text` by `P`, in order.
pub(super) fn pieces<P: Pattern>(text: &str) -> impl Iterator<Item = &[u8]> {
    let (mut at, ascii) = (0, text.is_ascii());
    std::iter::from_fn(move || {
        if at >= text.len() {
            return None;
        }
        let end = match ascii {
            true => P::piece_end(Text::<true>(text), at),
            false => P::piece_end(Text::<false>(text), at),
        };
        // Every alternative takes a character at least; were one ever to take none, that
        // character is a piece of its own rather than the count never ending.
        let end = match end > at {
            true => end,
            false => at + text[at..].chars().next().map_or(1, char::len_utf8),
        };
        let piece = &text.as_bytes()[at..end];
        at = end;
        Some(piece)
    })
}

/// The classes of the character beyond ASCII at byte `i` of `t`, and its length.
#[inline(never)]
fn beyond_ascii(t: &str, i: usize) -> (u8, usize) {
    match t.get(i..).and_then(|rest| rest.chars().next()) {
        Some(c) => (unicode(c), c.len_utf8()),
        None => (END, 0),
    }
}

/// The length of the contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`, any case) that
/// `t` starts with, or 0. Beyond ASCII only `ſ` (long s) folds to one of its letters.
pub(super) fn contraction(t: &str) -> usize {
    let Some(rest) = t.strip_prefix('\'') else {
        return 0;
    };
    let b = rest.as_bytes();
    let lower = |j: usize| b.get(j).map(|b| b.to_ascii_lowercase());
    1 + match (lower(0), lower(1)) {
        (Some(b's' | b'd' | b'm' | b't'), _) => 1,
        (Some(b'l'), Some(b'l')) | (Some(b'v' | b'r'), Some(b'e')) => 2,
        _ if rest.starts_with('ſ') => 'ſ'.len_utf8(),
        _ => return 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every character's classes agree with regex's, the sets the build wrote.
    #[test]
    fn every_character_is_classed_as_the_patterns_class_it() {
        let sets = [
            (UPPER, r"^[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]$"),
            (LOWER, r"^[\p{Ll}\p{Lm}\p{Lo}\p{M}]$"),
            (LETTER, r"^\p{L}$"),
            (NUMBER, r"^\p{N}$"),
            (SPACE, r"^\s$"),
            (NEWLINE, r"^[\r\n]$"),
            (TAIL, r"^[\r\n/]$"),
        ]
        .map(|(bit, re)| (bit, regex::Regex::new(re).unwrap()));
        let folds = regex::Regex::new(r"(?i)^[sdmtlver]$").unwrap();
        let mut buf = [0; 4];
        for c in (0..=0x10FFFF).filter_map(char::from_u32) {
            let s: &str = c.encode_utf8(&mut buf);
            let want = sets
                .iter()
                .filter(|(_, re)| re.is_match(s))
                .fold(0, |bits, (bit, _)| bits | bit);
            assert_eq!(Text::<false>(s).at(0), (want, s.len()), "{c:?}");
            if !c.is_ascii() && folds.is_match(s) {
                assert_eq!(c, 'ſ', "{c:?} folds to a contraction's letter");
            }
        }
        assert_eq!(Text::<false>("").at(0), (END, 0));
    }

    /// A pattern that takes nothing still makes progress: each character its own piece.
    #[test]
    fn a_piece_is_never_empty() {
        struct Stuck;
        impl Pattern for Stuck {
            fn piece_end<const A: bool>(_: Text<'_, A>, i: usize) -> usize {
                i
            }
        }
        // At most three pieces: without the guard, empty ones would come without end.
        let split: Vec<&[u8]> = pieces::<Stuck>("aé").take(3).collect();
        assert_eq!(split, [&b"a"[..], "é".as_bytes()]);
    }

    #[test]
    fn contractions_of_any_case() {
        for (t, n) in [
            ("'s", 2),
            ("'Ll", 3),
            ("'VE", 3),
            ("'ſo", 3),
            ("'x", 0),
            ("'l", 0),
            ("s", 0),
        ] {
            assert_eq!(contraction(t), n, "{t:?}");
        }
    }
}
