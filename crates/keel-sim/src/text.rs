//! Deterministic text with exact continuation.
//!
//! The simulated "language model" is a pure function: the next token depends only on the fleet
//! family's seed and the text so far (a rolling hash over the prompt and every token already in
//! the reply). That gives the two properties the gateway's tests need:
//!
//! * the same prompt yields the same tokens on every server of one family, at any speed;
//! * continuation is exact: given a prefix T of a reply (a prefill, or a completion prompt with T
//!   appended), the state after reading T equals the state after generating T, so T followed by
//!   the continuation equals the uninterrupted reply, token for token.
//!
//! Tokens follow keel's tokenizer rule ([`keel_core::tokens`]): words carry their leading space
//! (`" cat"`) and punctuation stands alone (`"."`), so splitting generated text gives back exactly
//! the generated tokens. A prefix cut inside a token is finished first (`" ca"` → `"t"`).

use keel_core::rng::{hash_bytes, mix};
use keel_core::tokens;

use crate::config::GenerationConfig;

const VOCAB: &[&str] = &[
    "the",
    "model",
    "routes",
    "every",
    "request",
    "to",
    "a",
    "healthy",
    "variant",
    "and",
    "keeps",
    "latency",
    "flat",
    "while",
    "streams",
    "continue",
    "on",
    "another",
    "server",
    "when",
    "one",
    "stalls",
    "tokens",
    "arrive",
    "in",
    "order",
    "with",
    "no",
    "gaps",
    "cache",
    "prefix",
    "warm",
    "queue",
    "short",
    "fleet",
    "of",
    "gpus",
    "answers",
    "quickly",
    "under",
    "load",
    "each",
    "reply",
    "is",
    "deterministic",
    "so",
    "tests",
    "can",
    "compare",
    "text",
    "exactly",
    "across",
    "servers",
    "retry",
    "budget",
    "limits",
    "storms",
    "hedge",
    "wins",
    "first",
    "byte",
    "seam",
    "stays",
    "clean",
];

/// Why a generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// The reply ended on its own.
    Natural,
    /// `max_tokens` was reached.
    Length,
    /// A stop sequence was produced (it is not part of the text).
    StopSequence(String),
    /// The provider's safety system stopped the answer (the `refusal` fault): a finished
    /// answer, not an error (OpenAI `content_filter`, Anthropic `refusal`, Gemini `SAFETY`,
    /// Bedrock `content_filtered`).
    Refusal,
}

/// A finished generation: the pieces to stream, in order, and why it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub pieces: Vec<String>,
    pub finish: Finish,
}

impl Output {
    pub fn text(&self) -> String {
        self.pieces.concat()
    }
}

/// Chat replies start a new assistant turn; completions continue the prompt's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Chat,
    Completion,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prev {
    Start,
    Word,
    Comma,
    Period,
}

#[derive(Debug, Clone)]
struct State {
    h: u64,
    /// Tokens in the reply so far (prefill included).
    position: u32,
    prev: Prev,
    min_reply: u32,
}

/// The generator of one family.
#[derive(Debug, Clone)]
pub struct Generator {
    family_seed: u64,
    /// Chance (per 10,000) that a reply ends at a sentence end once past the minimum.
    stop_per_10k: u64,
    min_reply: u32,
}

impl Generator {
    pub fn new(family: &str, cfg: GenerationConfig) -> Self {
        // Sentences average about nine tokens (one in eight words is followed by a period), so
        // ending at a sentence end with probability 9 / (mean - min) gives about `mean` tokens.
        let extra = cfg
            .mean_reply_tokens
            .saturating_sub(cfg.min_reply_tokens)
            .max(1) as f64;
        let q = (9.0 / extra).min(1.0);
        Generator {
            family_seed: hash_bytes(0x6b65_656c, family.as_bytes()),
            stop_per_10k: (q * 10_000.0) as u64,
            min_reply: cfg.min_reply_tokens,
        }
    }

    fn start(&self, mode: Mode, context: &str) -> State {
        let normalized = normalize(context);
        match mode {
            Mode::Chat => State {
                h: hash_bytes(self.family_seed, normalized.as_bytes()),
                position: 0,
                prev: Prev::Start,
                min_reply: self.min_reply,
            },
            Mode::Completion => {
                let mut st = State {
                    h: mix(self.family_seed ^ 0xC0),
                    position: 0,
                    prev: Prev::Start,
                    min_reply: 0,
                };
                for tok in tokens::split(&normalized) {
                    advance(&mut st, tok);
                }
                st.position = 0;
                st
            }
        }
    }

    /// The next token from a state, or `None` when the reply ends here.
    fn next(&self, st: &State) -> Option<String> {
        let r = mix(st.h ^ self.family_seed);
        if st.prev == Prev::Period && st.position >= st.min_reply && r % 10_000 < self.stop_per_10k
        {
            return None;
        }
        let roll = (r >> 16) % 8;
        if st.prev == Prev::Word && roll == 0 {
            return Some(".".into());
        }
        if st.prev == Prev::Word && roll == 1 {
            return Some(",".into());
        }
        let word = VOCAB[((r >> 24) % VOCAB.len() as u64) as usize];
        let mut tok = String::with_capacity(word.len() + 1);
        if st.prev != Prev::Start {
            tok.push(' ');
        }
        if matches!(st.prev, Prev::Start | Prev::Period) {
            let mut cs = word.chars();
            if let Some(c) = cs.next() {
                tok.extend(c.to_uppercase());
                tok.push_str(cs.as_str());
            }
        } else {
            tok.push_str(word);
        }
        Some(tok)
    }

    /// Generates a reply to `context` (the rendered conversation, or a completion prompt) after
    /// the `prefill` already present in the reply.
    pub fn generate(
        &self,
        mode: Mode,
        context: &str,
        prefill: &str,
        max_tokens: Option<u64>,
        stop: &[String],
    ) -> Output {
        let mut st = self.start(mode, context);
        let mut pieces: Vec<String> = Vec::new();
        let prefill_tokens = tokens::split(prefill);
        if let Some((last, head)) = prefill_tokens.split_last() {
            for tok in head {
                advance(&mut st, tok);
            }
            match self.next(&st) {
                Some(expected) if expected.len() > last.len() && expected.starts_with(last) => {
                    pieces.push(expected[last.len()..].to_owned());
                    advance(&mut st, &expected);
                }
                _ => advance(&mut st, last),
            }
        }
        let limit = max_tokens.unwrap_or(u64::MAX);
        let mut text = String::new();
        let finish = loop {
            if let Some((i, s)) = find_stop(&text, stop) {
                truncate_pieces(&mut pieces, i);
                break Finish::StopSequence(s.to_owned());
            }
            if pieces.len() as u64 >= limit {
                break Finish::Length;
            }
            match self.next(&st) {
                None => break Finish::Natural,
                Some(tok) => {
                    advance(&mut st, &tok);
                    text.push_str(&tok);
                    pieces.push(tok);
                }
            }
        };
        Output { pieces, finish }
    }
}

fn advance(st: &mut State, tok: &str) {
    st.h = mix(st.h ^ hash_bytes(0, tok.as_bytes()));
    st.position += 1;
    st.prev = match tok.trim() {
        "." | "!" | "?" => Prev::Period,
        "," => Prev::Comma,
        "" => st.prev,
        _ => Prev::Word,
    };
}

/// Collapses whitespace runs to one space and trims: trivial formatting does not change output.
pub fn normalize(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn find_stop<'a>(text: &str, stop: &'a [String]) -> Option<(usize, &'a str)> {
    stop.iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()).map(|i| (i, s.as_str())))
        .min_by_key(|(i, _)| *i)
}

/// Keeps only the first `keep` bytes of the concatenated pieces.
fn truncate_pieces(pieces: &mut Vec<String>, keep: usize) {
    let mut total = 0;
    let mut out = Vec::new();
    for p in pieces.drain(..) {
        if total >= keep {
            break;
        }
        if total + p.len() <= keep {
            total += p.len();
            out.push(p);
        } else {
            out.push(p[..keep - total].to_owned());
            total = keep;
        }
    }
    *pieces = out;
}

/// A deterministic word for a key (used for tool arguments).
pub fn word_for(key: u64) -> &'static str {
    VOCAB[(mix(key) % VOCAB.len() as u64) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn gen() -> Generator {
        Generator::new("default", GenerationConfig::default())
    }

    #[test]
    fn same_prompt_same_text_and_families_differ() {
        let a = gen().generate(Mode::Chat, "user: hello", "", None, &[]);
        let b = gen().generate(Mode::Chat, "user:   hello ", "", None, &[]);
        assert_eq!(a, b);
        assert!(a.pieces.len() >= 16, "{:?}", a);
        let c = Generator::new("other", GenerationConfig::default()).generate(
            Mode::Chat,
            "user: hello",
            "",
            None,
            &[],
        );
        assert_ne!(a.text(), c.text());
        assert_eq!(
            tokens::split(&a.text()),
            a.pieces.iter().map(String::as_str).collect::<Vec<_>>()
        );
    }

    #[test]
    fn stop_sequences_and_length() {
        let full = gen().generate(Mode::Chat, "user: hi", "", None, &[]);
        let five = gen().generate(Mode::Chat, "user: hi", "", Some(5), &[]);
        assert_eq!(five.pieces, full.pieces[..5].to_vec());
        assert_eq!(five.finish, Finish::Length);
        let stop = full.pieces[3].clone();
        let cut = gen().generate(
            Mode::Chat,
            "user: hi",
            "",
            None,
            std::slice::from_ref(&stop),
        );
        assert_eq!(cut.finish, Finish::StopSequence(stop.clone()));
        assert!(!cut.text().contains(&stop));
        assert!(full.text().starts_with(&cut.text()));
    }

    proptest! {
        #[test]
        fn chat_continuation_is_exact(prompt in "[a-z ]{1,40}", split_at in 0usize..200) {
            let g = gen();
            let whole = g.generate(Mode::Chat, &prompt, "", None, &[]).text();
            let cut = split_at.min(whole.len());
            let cut = (0..=cut).rev().find(|i| whole.is_char_boundary(*i)).unwrap();
            let prefix = &whole[..cut];
            let rest = g.generate(Mode::Chat, &prompt, prefix, None, &[]).text();
            prop_assert_eq!(format!("{prefix}{rest}"), whole);
        }

        #[test]
        fn completion_continuation_is_exact(prompt in "[a-z][a-z ]{0,40}[a-z]", k in 0usize..40) {
            let g = gen();
            let whole = g.generate(Mode::Completion, &prompt, "", Some(60), &[]);
            let k = k.min(whole.pieces.len());
            let prefix: String = whole.pieces[..k].concat();
            let rest = g.generate(Mode::Completion, &format!("{prompt}{prefix}"), "", Some(60 - k as u64), &[]);
            prop_assert_eq!(format!("{prefix}{}", rest.text()), whole.text());
        }
    }
}
