//! o200k's pre-tokenizer, written out by hand over all of Unicode. A byte-pair encoding first
//! splits the text into pieces by a regular expression, then merges each piece's bytes;
//! OpenAI's pattern for o200k needs a backtracking engine (a lookahead), and that engine spends
//! about 200 instructions a byte, four fifths of a count. The pattern's classes are sets of
//! Unicode's general categories ([`super::classes`]), so [`pieces`] finds the same pieces in one
//! forward pass, backtracking only where the pattern's two letter sets overlap.

use super::classes::{Pattern, Text};
use super::embedded::class::*;

/// The pattern's alternatives, in order (the first that matches at a place wins):
/// 1. `[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`
/// 2. `[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?`
/// 3. `\p{N}{1,3}`
/// 4. ` ?[^\s\p{L}\p{N}]+[\r\n/]*`
/// 5. `\s*[\r\n]+`
/// 6. `\s+(?!\S)`
/// 7. `\s+`
///
/// The first letter set is [`UPPER`], the second [`LOWER`]; uncased letters (`Lm`, `Lo`) and
/// marks are in both.
pub(super) struct O200k;

impl Pattern for O200k {
    fn piece_end<const A: bool>(t: Text<'_, A>, i: usize) -> usize {
        let (c, width) = t.at(i);
        // 1 and 2: letters, each first with the optional lead character, then without it (a
        // lead is no letter, so only a mark can also begin the letters).
        let lead = c & (NEWLINE | LETTER | NUMBER | END) == 0;
        if c & (UPPER | LOWER) != 0 || (lead && t.at(i + width).0 & (UPPER | LOWER) != 0) {
            let after_lead = i + width;
            let end = lead
                .then(|| lower_after_upper(t, after_lead))
                .flatten()
                .or_else(|| lower_after_upper(t, i))
                .or_else(|| lead.then(|| upper_then_lower(t, after_lead)).flatten())
                .or_else(|| upper_then_lower(t, i));
            if let Some(end) = end {
                return end + t.contraction(end);
            }
        }
        // 3: up to three numbers.
        if c & NUMBER != 0 {
            return t.run(i, |c| c & NUMBER != 0, 3);
        }
        // 4: an optional space, a run of other characters, then any `\r`, `\n` and `/`.
        if let Some(end) = t.punctuation_end(i, TAIL) {
            return end;
        }
        // 5 to 7: whitespace (up to its last newline before to the end of the text).
        t.whitespace_end(i, false)
    }
}

/// Alternative 1's letters from byte `s`, without the contraction: `[UPPER]*[LOWER]+`. The
/// first set's run is taken whole, then given back a character at a time until the second
/// set's run can begin: at the run's end if a character of the second set follows it, else
/// just after the run's last character that is in both sets (the second set's run then ends at
/// the character after it, which is in the first set only). `None` where neither is there.
#[inline(always)]
fn lower_after_upper<const A: bool>(t: Text<'_, A>, s: usize) -> Option<usize> {
    let (mut j, mut after_both) = (s, None);
    loop {
        let (c, width) = t.at(j);
        if c & UPPER == 0 {
            break;
        }
        j += width;
        if c & LOWER != 0 {
            after_both = Some(j);
        }
    }
    match t.at(j).0 & LOWER != 0 {
        true => Some(t.run(j, |c| c & LOWER != 0, usize::MAX)),
        false => after_both,
    }
}

/// Alternative 2's letters from byte `s`, without the contraction: `[UPPER]+[LOWER]*`, each run
/// whole (what the first leaves can only be a lower-case letter).
#[inline(always)]
fn upper_then_lower<const A: bool>(t: Text<'_, A>, s: usize) -> Option<usize> {
    let j = t.run(s, |c| c & UPPER != 0, usize::MAX);
    (j > s).then(|| t.run(j, |c| c & LOWER != 0, usize::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split(text: &str) -> Vec<&str> {
        super::super::classes::pieces::<O200k>(text)
            .map(|p| std::str::from_utf8(p).unwrap())
            .collect()
    }

    #[test]
    fn splits_as_the_pattern_does() {
        assert_eq!(split("Hello, world."), ["Hello", ",", " world", "."]);
        assert_eq!(split("don't  HELLOworld"), ["don't", " ", " HELLOworld"]);
        assert_eq!(split("12345 x"), ["123", "45", " x"]);
        assert_eq!(split("a  \n\n  b"), ["a", "  \n\n", " ", " b"]);
        assert_eq!(split("x;\n/y"), ["x", ";\n/", "y"]);
        assert_eq!(split("end   "), ["end", "   "]);
        assert_eq!(split("\t.x"), ["\t", ".x"]);
        // Uncased letters are in both sets; a title-case letter only in the first.
        assert_eq!(split("東京の天気 ǅemo"), ["東京の天気", " ǅemo"]);
        assert_eq!(split("café\u{301}s"), ["café\u{301}s"]);
    }

    /// The pieces of `text` by the published pattern, as tiktoken finds them.
    fn by_pattern(text: &str) -> Vec<&str> {
        use std::sync::OnceLock;
        static PATTERN: OnceLock<fancy_regex::Regex> = OnceLock::new();
        let pattern = PATTERN
            .get_or_init(|| fancy_regex::Regex::new(tiktoken_rs::O200K_BASE_PAT_STR).unwrap());
        pattern
            .find_iter(text)
            .map(|m| m.unwrap().as_str())
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Where the letter sets overlap, a count may come out right from the wrong pieces: the
        /// pieces themselves are compared here.
        #[test]
        fn the_pieces_are_the_patterns_matches(
            parts in prop::collection::vec(prop::sample::select(&[
                "A", "a", "ǅ", "ʰ", "中", "\u{301}", "\u{903}", " ", "'", "s", "ll", "1", "\n",
                ".", "/", "\u{a0}", "\r", "\t",
            ][..]), 0..24)
        ) {
            let text = parts.concat();
            prop_assert_eq!(split(&text), by_pattern(&text), "{:?}", text);
        }

        #[test]
        fn the_pieces_of_any_text_are_the_patterns_matches(text in "\\PC{0,60}") {
            prop_assert_eq!(split(&text), by_pattern(&text), "{:?}", text);
        }
    }
}
