//! keel's one documented tokenizer rule, used wherever a token count is needed without the
//! model's own tokenizer (estimates before routing; the simulator's exact usage).
//!
//! **Rule.** A token is an optional run of whitespace followed by either a run of alphanumeric
//! characters or exactly one other character. Whitespace at the very end of the text is one
//! more token. So `"Hello, world."` is `["Hello", ",", " world", "."]` (4 tokens).
//!
//! This is close to what a word-piece tokenizer does on English prose, costs one pass, and
//! round-trips: concatenating the pieces gives the text back, and splitting a concatenation of
//! generated pieces gives the same pieces (the simulator relies on this for exact continuation).
//!
//! Estimates by a model family's real tokenizer (OpenAI's BPE tables) live in [`bpe`].

mod bpe;
mod cl100k_split;
mod classes;
mod embedded;
mod o200k_split;
mod table;
pub use bpe::{
    chunks, Estimate, Memo, Tally, Tokenizer, APPROX_FACTOR, MAX_TOKEN_BYTES, MEMO_MIN_BYTES,
};

/// The tokens of `text` by the rule above, in order, read as they are taken. Pieces borrow
/// from `text`.
fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut chars = text.char_indices().peekable();
    let mut start = 0;
    std::iter::from_fn(move || {
        chars.peek()?;
        // Optional whitespace run.
        while chars.next_if(|&(_, c)| c.is_whitespace()).is_some() {}
        if let Some((_, c)) = chars.next() {
            if c.is_alphanumeric() {
                while chars.next_if(|&(_, d)| d.is_alphanumeric()).is_some() {}
            }
        }
        let end = chars.peek().map_or(text.len(), |&(j, _)| j);
        let piece = &text[start..end];
        start = end;
        Some(piece)
    })
}

/// Splits `text` into tokens by the rule above. Pieces borrow from `text`.
pub fn split(text: &str) -> Vec<&str> {
    pieces(text).collect()
}

/// The length in bytes of `text`'s first `n` tokens by the rule (`split(text)[..n]` joined),
/// read no further than they go; `None` when the text has fewer.
pub fn prefix_len(text: &str, n: usize) -> Option<usize> {
    let (taken, len) = pieces(text)
        .take(n)
        .fold((0, 0), |(k, len), p| (k + 1, len + p.len()));
    (taken == n).then_some(len)
}

/// Counts tokens by the rule without allocating.
pub fn count(text: &str) -> usize {
    let mut c = Counter::default();
    c.feed(text);
    c.finish()
}

/// Counts tokens by the rule over text given in pieces: the count of the pieces joined, without
/// joining them.
///
/// A token starts at every character that is neither whitespace nor alphanumeric, and at every
/// alphanumeric one that does not follow another; so a byte of ASCII text adds to the count by
/// itself and the byte before it alone, and a block of it is counted without a state carried
/// from byte to byte (which the compiler does many bytes at a time). A block holding other
/// characters is read a character at a time. ASCII text costs about two instructions a byte
/// (a character at a time, 23), which matters because a long prompt is counted at admission.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counter {
    tokens: usize,
    /// The class of the last character read: [`OTHER`] (also before any), [`ALNUM`] or
    /// [`SPACE`].
    last: u8,
    /// Some text was given (see [`Counter::is_empty`]).
    fed: bool,
}

const OTHER: u8 = 0;
const ALNUM: u8 = 1;
const SPACE: u8 = 2;

/// Bytes checked for ASCII at once (a block holding any other character is read a character
/// at a time).
const BLOCK: usize = 1024;

/// An ASCII byte's class as `char::is_whitespace` and `char::is_alphanumeric` have it.
fn ascii_class(b: u8) -> u8 {
    if ascii_space(b) {
        SPACE
    } else if ascii_alnum(b) {
        ALNUM
    } else {
        OTHER
    }
}

// Without branches (`|`, not `||`), so that a block's loop is vectorized.
fn ascii_alnum(b: u8) -> bool {
    ((b | 0x20).wrapping_sub(b'a') < 26) | (b.wrapping_sub(b'0') < 10)
}

fn ascii_space(b: u8) -> bool {
    (b == b' ') | (b.wrapping_sub(0x09) < 5)
}

fn char_class(c: char) -> u8 {
    if c.is_whitespace() {
        SPACE
    } else if c.is_alphanumeric() {
        ALNUM
    } else {
        OTHER
    }
}

/// Whether a character of class `class` after one of class `last` starts a token.
fn starts(last: u8, class: u8) -> bool {
    class == OTHER || (class == ALNUM && last != ALNUM)
}

impl Counter {
    /// Adds the next piece of text.
    pub fn feed(&mut self, text: &str) {
        let bytes = text.as_bytes();
        let mut at = 0;
        while at < bytes.len() {
            let mut end = (at + BLOCK).min(bytes.len());
            let block = &bytes[at..end];
            if block.is_ascii() {
                self.ascii_block(block);
            } else {
                while !text.is_char_boundary(end) {
                    end += 1;
                }
                for c in text[at..end].chars() {
                    let class = char_class(c);
                    self.tokens += usize::from(starts(self.last, class));
                    self.last = class;
                }
            }
            at = end;
        }
        self.fed |= !text.is_empty();
    }

    /// Counts a non-empty block of ASCII bytes, 64 at a time: first whether each is
    /// alphanumeric, then each byte's start from that and the byte before it, summed in a byte
    /// (the form the compiler turns into vector instructions: over ten times the speed of the
    /// loop a character at a time).
    fn ascii_block(&mut self, block: &[u8]) {
        let mut n = 0;
        // 1 where the character before is alphanumeric (the rule's `starts`, a byte at a time).
        let mut before = u8::from(self.last == ALNUM);
        let mut chunks = block.chunks_exact(64);
        for chunk in &mut chunks {
            let mut alnum = [0u8; 65];
            alnum[0] = before;
            for (a, &b) in alnum[1..].iter_mut().zip(chunk) {
                *a = u8::from(ascii_alnum(b));
            }
            let mut started = 0u8;
            for (k, &b) in chunk.iter().enumerate() {
                let (a, before) = (alnum[k + 1], alnum[k]);
                let other = u8::from(!ascii_space(b)) & (a ^ 1);
                started = started.wrapping_add(other | (a & (before ^ 1)));
            }
            n += usize::from(started);
            before = alnum[64];
        }
        for &b in chunks.remainder() {
            let a = u8::from(ascii_alnum(b));
            n += usize::from((u8::from(!ascii_space(b)) & (a ^ 1)) | (a & (before ^ 1)));
            before = a;
        }
        self.tokens += n;
        self.last = block.last().map_or(self.last, |&b| ascii_class(b));
    }

    /// Whether no text (or only empty text) was given.
    pub fn is_empty(&self) -> bool {
        !self.fed
    }

    /// The count: whitespace at the very end is one more token.
    pub fn finish(&self) -> usize {
        self.tokens + usize::from(self.last == SPACE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_prefix_is_the_first_pieces_joined(text in "[a-z .,\n\t]{0,40}|\\PC{0,24}", n in 0usize..12) {
            let pieces = split(&text);
            let expected = (n <= pieces.len()).then(|| pieces[..n].concat().len());
            prop_assert_eq!(prefix_len(&text, n), expected);
        }
    }

    #[test]
    fn documented_example() {
        assert_eq!(split("Hello, world."), vec!["Hello", ",", " world", "."]);
        assert_eq!(count("Hello, world."), 4);
        assert_eq!(split("a  b\n"), vec!["a", "  b", "\n"]);
        assert_eq!(count(""), 0);
    }

    /// The rule read a character at a time, as the table must read it.
    fn count_by_chars(text: &str) -> usize {
        let (mut n, mut in_ws, mut in_word) = (0, false, false);
        for c in text.chars() {
            if c.is_whitespace() {
                in_word = false;
                in_ws = true;
            } else if c.is_alphanumeric() {
                n += usize::from(!in_word);
                in_word = true;
                in_ws = false;
            } else {
                n += 1;
                in_word = false;
                in_ws = false;
            }
        }
        n + usize::from(in_ws)
    }

    #[test]
    fn text_of_many_blocks_counts_as_the_characters_do() {
        let words = [
            "route", " the", "  model", ",", "\n", "42", "x.y", "\t", "é", "日本",
        ];
        for ascii_only in [true, false] {
            let mut text = String::new();
            for i in 0..3_000usize {
                let w = words[(i * 7 + i / 13) % words.len()];
                if !ascii_only || w.is_ascii() {
                    text.push_str(w);
                }
            }
            assert!(text.len() > 4 * BLOCK);
            assert_eq!(count(&text), count_by_chars(&text));
            let mut c = Counter::default();
            for piece in text.split_inclusive(',') {
                c.feed(piece);
            }
            assert_eq!(c.finish(), count_by_chars(&text));
        }
    }

    #[test]
    fn every_ascii_byte_is_classed_as_the_standard_library_classes_it() {
        for b in 0u8..128 {
            let text = format!("a{}b", b as char);
            assert_eq!(count(&text), count_by_chars(&text), "byte {b}");
        }
    }

    proptest! {
        #[test]
        fn the_table_counts_as_the_characters_do_in_pieces_too(
            s in "(\\PC|[ \t\n\r\u{85}\u{a0}\u{3000}a-z0-9é,.]){0,80}",
            cut in 0usize..80,
        ) {
            prop_assert_eq!(count(&s), count_by_chars(&s));
            let mut cut = cut.min(s.len());
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            let mut c = Counter::default();
            c.feed(&s[..cut]);
            c.feed(&s[cut..]);
            prop_assert_eq!(c.finish(), count_by_chars(&s));
            prop_assert_eq!(c.is_empty(), s.is_empty());
        }

        /// Mostly ASCII and longer than a block: blocks counted whole, blocks holding another
        /// character, pieces cut anywhere.
        #[test]
        fn long_mostly_ascii_text_counts_as_the_characters_do(
            s in "[ a-zA-Z0-9,.\n\t!é]{0,300}",
            cuts in proptest::collection::vec(0usize..300, 0..4),
        ) {
            prop_assert_eq!(count(&s), count_by_chars(&s));
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(s.len())).collect();
            cuts.sort_unstable();
            let mut c = Counter::default();
            let mut from = 0;
            for mut cut in cuts.into_iter().chain([s.len()]) {
                while !s.is_char_boundary(cut) {
                    cut -= 1;
                }
                let cut = cut.max(from);
                c.feed(&s[from..cut]);
                from = cut;
            }
            prop_assert_eq!(c.finish(), count_by_chars(&s));
        }

        #[test]
        fn split_round_trips_and_agrees_with_count(s in "[a-zé ,.\n!0-9]{0,60}") {
            let pieces = split(&s);
            prop_assert_eq!(pieces.concat(), s.clone());
            prop_assert_eq!(pieces.len(), count(&s));
        }
    }
}
