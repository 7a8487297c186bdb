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
pub use bpe::{chunks, Estimate, Tally, Tokenizer, APPROX_FACTOR, MAX_TOKEN_BYTES};

/// Splits `text` into tokens by the rule above. Pieces borrow from `text`.
pub fn split(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut chars = text.char_indices().peekable();
    let mut start = 0;
    while chars.peek().is_some() {
        // Optional whitespace run.
        while chars.next_if(|&(_, c)| c.is_whitespace()).is_some() {}
        match chars.next() {
            None => {}
            Some((_, c)) if c.is_alphanumeric() => {
                while chars.next_if(|&(_, d)| d.is_alphanumeric()).is_some() {}
            }
            Some(_) => {}
        }
        let end = chars.peek().map(|&(j, _)| j).unwrap_or(text.len());
        out.push(&text[start..end]);
        start = end;
    }
    out
}

/// Counts tokens by the rule without allocating.
pub fn count(text: &str) -> usize {
    let mut n = 0;
    let mut in_ws = false;
    let mut in_word = false;
    for c in text.chars() {
        if c.is_whitespace() {
            if !in_ws {
                in_word = false;
                in_ws = true;
            }
        } else if c.is_alphanumeric() {
            if !in_word {
                n += 1;
                in_word = true;
            }
            in_ws = false;
        } else {
            n += 1;
            in_word = false;
            in_ws = false;
        }
    }
    if in_ws {
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn documented_example() {
        assert_eq!(split("Hello, world."), vec!["Hello", ",", " world", "."]);
        assert_eq!(count("Hello, world."), 4);
        assert_eq!(split("a  b\n"), vec!["a", "  b", "\n"]);
        assert_eq!(count(""), 0);
    }

    proptest! {
        #[test]
        fn split_round_trips_and_agrees_with_count(s in "[a-zé ,.\n!0-9]{0,60}") {
            let pieces = split(&s);
            prop_assert_eq!(pieces.concat(), s.clone());
            prop_assert_eq!(pieces.len(), count(&s));
        }
    }
}
