//! cl100k's pre-tokenizer, written out by hand over all of Unicode. A byte-pair encoding first
//! splits the text into pieces by a regular expression, then merges each piece's bytes;
//! cl100k's pattern (tiktoken's, with possessive quantifiers) needs a backtracking engine, which
//! spends about 200 instructions a byte. Its classes are only letters (`\p{L}`), numbers
//! (`\p{N}`), whitespace (`\s`) and `\r`/`\n` ([`super::classes`]), so [`pieces`] finds the same
//! pieces in one forward pass.

use super::classes::{Pattern, Text};
use super::embedded::class::*;

/// The pattern's alternatives, in order (the first that matches at a place wins):
/// 1. `'(?i:[sdmt]|ll|ve|re)`: a contraction;
/// 2. `[^\r\n\p{L}\p{N}]?+\p{L}++`: letters, after one optional character that is no newline,
///    letter or number;
/// 3. `\p{N}{1,3}+`: up to three numbers;
/// 4. ` ?[^\s\p{L}\p{N}]++[\r\n]*+`: an optional space, a run of other characters, then any
///    `\r` and `\n`;
/// 5. `\s++$`: whitespace to the end of the text;
/// 6. `\s*[\r\n]`: whitespace up to its last newline;
/// 7. `\s+(?!\S)`: whitespace, all but its last character when a non-space follows;
/// 8. `\s`: one whitespace character.
pub(super) struct Cl100k;

impl Pattern for Cl100k {
    fn piece_end<const A: bool>(t: Text<'_, A>, i: usize) -> usize {
        let (c, width) = t.at(i);
        // 1: a contraction.
        let n = t.contraction(i);
        if n > 0 {
            return i + n;
        }
        // 2: letters, after one optional character that is not a newline, letter or number.
        let letters = if c & LETTER != 0 {
            Some(i)
        } else if c & (NEWLINE | NUMBER) == 0 && t.at(i + width).0 & LETTER != 0 {
            Some(i + width)
        } else {
            None
        };
        if let Some(j) = letters {
            return t.run(j, |c| c & LETTER != 0, usize::MAX);
        }
        // 3: up to three numbers.
        if c & NUMBER != 0 {
            return t.run(i, |c| c & NUMBER != 0, 3);
        }
        // 4: an optional space, a run of other characters, then any `\r` and `\n`.
        if let Some(end) = t.punctuation_end(i, NEWLINE) {
            return end;
        }
        // 5 to 8: whitespace (to the end of the text before up to its last newline).
        t.whitespace_end(i, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str) -> Vec<&str> {
        super::super::classes::pieces::<Cl100k>(text)
            .map(|p| std::str::from_utf8(p).unwrap())
            .collect()
    }

    #[test]
    fn splits_as_the_pattern_does() {
        assert_eq!(split("Hello, world."), ["Hello", ",", " world", "."]);
        assert_eq!(
            split("don't  HELLOworld"),
            ["don", "'t", " ", " HELLOworld"]
        );
        assert_eq!(split("12345 x"), ["123", "45", " x"]);
        assert_eq!(split("a  \n\n  b"), ["a", "  \n\n", " ", " b"]);
        assert_eq!(split("x;\n/y"), ["x", ";\n", "/y"]);
        assert_eq!(split("end   "), ["end", "   "]);
        assert_eq!(split("'ſo 東京"), ["'ſ", "o", " 東京"]);
    }
}
