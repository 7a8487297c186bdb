//! Token estimates by the model family's own tokenizer: OpenAI's byte-pair encodings
//! `o200k_base` and `cl100k_base` (tiktoken-rs's tables, written into the binary by the build
//! script: nothing is downloaded), and keel's rule (see [`super`]) with a measured correction
//! for every other model.
//!
//! **Which tokenizer.** A variant names one (`tokenizer = "o200k" | "cl100k" | "approx"`) or
//! it is inferred from its `upstream_model` by prefix ([`Tokenizer::for_model`]):
//! `gpt-4o`, `chatgpt-4o`, `gpt-4.1`, `gpt-4.5`, `gpt-5`, `gpt-oss`, `o1`, `o3`, `o4` → o200k;
//! `gpt-4`, `gpt-3.5`, `text-embedding-3`, `text-embedding-ada` → cl100k; anything else →
//! approx. A provider prefix such as `openai/` is ignored.
//!
//! **Approx.** Measured against o200k on keel's own documentation (46 KB of English prose with
//! tables, `benches/support/prose.rs`) and on 66 KB of its Rust source (`cargo bench -p
//! keel-core --bench tokens` prints the ratios), o200k counts 0.990× the rule on the prose and
//! 0.907× on the code: the rule keeps words whole (as BPE does for common English words) and
//! counts every punctuation character (where BPE merges runs such as `::` or `);`). cl100k gave
//! 0.995× and 0.906×. So the rule already errs on the high side for OpenAI's tokenizers on
//! English and code, and [`APPROX_FACTOR`] is 1.0; it is kept as a named constant so that a
//! family measured to count more (smaller vocabularies, other languages) can be accounted for in
//! one place. Counting too few is the costly mistake here: estimates refuse what cannot fit and
//! reserve quota.
//!
//! **Bounded work.** Estimates happen at admission for prompts of any size (a client may send
//! megabytes), so counting stops once the total passes a cap (the largest context window that
//! could hold the prompt): [`Tally`] counts in chunks and, before tokenizing, refuses by a lower
//! bound from the byte length alone (no BPE token is longer than [`MAX_TOKEN_BYTES`] bytes).
//! A capped estimate is a lower bound, which is all that is needed to refuse.
//!
//! **Speed and size.** tiktoken splits a text into pieces by a regular expression that needs a
//! backtracking engine: about 200 instructions a byte of the 250 its count costs. keel splits
//! by hand over all of Unicode ([`super::o200k_split`], [`super::cl100k_split`]) and merges the
//! pieces itself ([`super::table`]) over ranks embedded in the binary by the build script:
//! nothing to decode or compile at start-up, and resident only as lookups touch them (at most
//! 4.4 MB for o200k), where tiktoken's encoders take 46 MB (o200k) and 16 MB (cl100k) of heap.
//! The tests hold every count to tiktoken's.

use super::table;

/// How a variant's prompts are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tokenizer {
    /// OpenAI `o200k_base` (gpt-4o, gpt-4.1, o-series, gpt-5).
    O200k,
    /// OpenAI `cl100k_base` (gpt-4, gpt-3.5, text-embedding-3).
    Cl100k,
    /// keel's rule × [`APPROX_FACTOR`] (every other model).
    Approx,
}

/// The rule's count is multiplied by this for [`Tokenizer::Approx`]: the larger of o200k ÷ rule
/// on prose and on code, rounded up to 1.0 (see the module docs for the measurement).
pub const APPROX_FACTOR: f64 = 1.0;

/// The longest token of o200k and cl100k, in bytes (128 in both tables): a text of `n` bytes
/// has at least `n / 128` tokens.
pub const MAX_TOKEN_BYTES: usize = 128;

/// Tokenizers count in chunks of about this many bytes (cut at whitespace), so that a capped
/// count stops soon after the cap.
const CHUNK_BYTES: usize = 64 * 1024;

/// Model-name prefixes and their tokenizer; the first match wins (so `gpt-4o` is o200k, while
/// `gpt-4` alone is cl100k).
const PREFIXES: &[(&str, Tokenizer)] = &[
    ("gpt-4o", Tokenizer::O200k),
    ("chatgpt-4o", Tokenizer::O200k),
    ("gpt-4.1", Tokenizer::O200k),
    ("gpt-4.5", Tokenizer::O200k),
    ("gpt-5", Tokenizer::O200k),
    ("gpt-oss", Tokenizer::O200k),
    ("o1", Tokenizer::O200k),
    ("o3", Tokenizer::O200k),
    ("o4", Tokenizer::O200k),
    ("gpt-4", Tokenizer::Cl100k),
    ("gpt-3.5", Tokenizer::Cl100k),
    ("text-embedding-3", Tokenizer::Cl100k),
    ("text-embedding-ada", Tokenizer::Cl100k),
];

impl Tokenizer {
    /// Every tokenizer, in the order the config's error messages list them.
    pub const ALL: [Tokenizer; 3] = [Tokenizer::O200k, Tokenizer::Cl100k, Tokenizer::Approx];

    /// The name written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Tokenizer::O200k => "o200k",
            Tokenizer::Cl100k => "cl100k",
            Tokenizer::Approx => "approx",
        }
    }

    /// Whether this is a byte-pair encoding (o200k, cl100k): a few hundred instructions a byte,
    /// where the rule costs two.
    pub fn is_bpe(self) -> bool {
        self != Tokenizer::Approx
    }

    /// The tokenizer of an upstream model name, by prefix (see the module docs).
    pub fn for_model(upstream_model: &str) -> Tokenizer {
        let name = upstream_model.to_ascii_lowercase();
        // `openai/gpt-4o` (routers, LiteLLM-style names) is still gpt-4o.
        let name = name.rsplit('/').next().unwrap_or(&name);
        PREFIXES
            .iter()
            .find(|(p, _)| name.starts_with(p))
            .map(|(_, t)| *t)
            .unwrap_or(Tokenizer::Approx)
    }

    /// The tokens of `text`, counted whole (no cap).
    pub fn count(self, text: &str) -> u64 {
        match self {
            Tokenizer::O200k => table::o200k(text),
            Tokenizer::Cl100k => table::cl100k(text),
            Tokenizer::Approx => approx(text),
        }
    }

    /// The least number of tokens a text of `bytes` bytes can have (0 for the rule, which has
    /// no longest token).
    fn floor_from_bytes(self, bytes: usize) -> u64 {
        match self {
            Tokenizer::Approx => 0,
            _ => (bytes / MAX_TOKEN_BYTES) as u64,
        }
    }
}

/// keel's rule scaled by [`APPROX_FACTOR`], rounded up.
fn approx(text: &str) -> u64 {
    (super::count(text) as f64 * APPROX_FACTOR).ceil() as u64
}

/// An estimate of a prompt's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Estimate {
    pub tokens: u64,
    /// True when counting stopped at the cap: the prompt has at least `tokens` tokens.
    pub lower_bound: bool,
}

/// Texts shorter than this are counted, never looked up in a [`Memo`] (hashing them would cost
/// about what counting does).
pub const MEMO_MIN_BYTES: usize = 512;

/// The counts of texts counted before, by key. A byte-pair encoding costs about 250
/// instructions a byte (a 2,000-word prompt, 3 million: a millisecond), and most of a request's
/// prompt came with the requests before it: a system prompt, a document asked about again, a
/// conversation's earlier turns. A [`Tally`] given a memo looks each long text up by a key (a
/// seeded hash of the tokenizer and the text, which costs under a byte's instruction) before
/// counting it, and keeps what it counted. The gateway keeps one per pool; keel-core keeps no
/// state of its own.
pub trait Memo {
    /// The key of `text` counted by `tokenizer`.
    fn key(&self, tokenizer: Tokenizer, text: &str) -> u64;
    /// The count kept under `key`, if any.
    fn recall(&self, key: u64) -> Option<u64>;
    /// Keeps `tokens` under `key` (it may forget it later, for another).
    fn remember(&self, key: u64, tokens: u64);
}

/// Counts the pieces of a prompt (message texts) one after another, stopping once the total
/// passes `cap`.
#[derive(Clone)]
pub struct Tally<'m> {
    tokenizer: Tokenizer,
    cap: u64,
    est: Estimate,
    memo: Option<&'m dyn Memo>,
}

impl std::fmt::Debug for Tally<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tally")
            .field("tokenizer", &self.tokenizer)
            .field("cap", &self.cap)
            .field("est", &self.est)
            .finish_non_exhaustive()
    }
}

impl<'m> Tally<'m> {
    pub fn new(tokenizer: Tokenizer, cap: u64) -> Self {
        Tally {
            tokenizer,
            cap,
            est: Estimate::default(),
            memo: None,
        }
    }

    /// A tally that looks long texts counted by a byte-pair encoding up in `memo` (see
    /// [`Memo`]); the rule is counted, never looked up (it costs less than the hash).
    pub fn remembering(tokenizer: Tokenizer, cap: u64, memo: Option<&'m dyn Memo>) -> Self {
        Tally {
            memo: memo.filter(|_| tokenizer.is_bpe()),
            ..Tally::new(tokenizer, cap)
        }
    }

    /// Adds one piece of the prompt.
    pub fn add(&mut self, text: &str) {
        if self.est.lower_bound {
            return;
        }
        let floor = self.tokenizer.floor_from_bytes(text.len());
        if self.est.tokens.saturating_add(floor) > self.cap {
            // Too large to fit whatever its content: no need to tokenize it.
            self.est.tokens = self.est.tokens.saturating_add(floor);
            self.est.lower_bound = true;
            return;
        }
        let memo = self.memo.filter(|_| text.len() >= MEMO_MIN_BYTES);
        let key = memo.map(|m| m.key(self.tokenizer, text));
        if let (Some(m), Some(key)) = (memo, key) {
            if let Some(tokens) = m.recall(key) {
                self.add_tokens(tokens);
                return;
            }
        }
        let before = self.est.tokens;
        for chunk in chunks(text, CHUNK_BYTES) {
            self.est.tokens += self.tokenizer.count(chunk);
            if self.est.tokens > self.cap {
                // Stopped short of the text's end: its count is not known, so not kept.
                self.est.lower_bound = true;
                return;
            }
        }
        if let (Some(m), Some(key)) = (memo, key) {
            m.remember(key, self.est.tokens - before);
        }
    }

    /// Adds a fixed number of tokens (message framing, token-id inputs).
    pub fn add_tokens(&mut self, n: u64) {
        self.est.tokens = self.est.tokens.saturating_add(n);
        if self.est.tokens > self.cap {
            self.est.lower_bound = true;
        }
    }

    pub fn estimate(&self) -> Estimate {
        self.est
    }
}

/// Splits `text` into pieces of about `size` bytes, each cut just before a whitespace
/// character where there is one in the second half of the piece (so a cut rarely splits what
/// a tokenizer would keep together), else at a character boundary.
pub fn chunks(text: &str, size: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        if rest.len() <= size {
            return Some(std::mem::take(&mut rest));
        }
        let mut end = size;
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        let mut half = size / 2;
        while !rest.is_char_boundary(half) {
            half -= 1;
        }
        let cut = rest[half..end]
            .rfind(char::is_whitespace)
            .map(|i| half + i)
            .filter(|&i| i > 0)
            .unwrap_or(end);
        let (head, tail) = rest.split_at(cut.max(1));
        rest = tail;
        Some(head)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn infers_the_tokenizer_from_the_model_name() {
        for (m, t) in [
            ("gpt-4o-mini", Tokenizer::O200k),
            ("GPT-4.1", Tokenizer::O200k),
            ("openai/gpt-5-nano", Tokenizer::O200k),
            ("o3-mini", Tokenizer::O200k),
            ("gpt-4-turbo", Tokenizer::Cl100k),
            ("gpt-3.5-turbo", Tokenizer::Cl100k),
            ("text-embedding-3-small", Tokenizer::Cl100k),
            ("claude-sonnet-4-5", Tokenizer::Approx),
            ("llama-3.1-8b", Tokenizer::Approx),
            ("ollama/qwen3", Tokenizer::Approx),
        ] {
            assert_eq!(Tokenizer::for_model(m), t, "{m}");
        }
    }

    #[test]
    fn counts_like_the_reference_tokenizers() {
        // Reference counts from OpenAI's tiktoken for these exact strings.
        assert_eq!(Tokenizer::O200k.count("Hello, world!"), 4);
        assert_eq!(Tokenizer::Cl100k.count("Hello, world!"), 4);
        assert_eq!(Tokenizer::O200k.count(""), 0);
        // The rule counts 4 (`Hello`, `,`, ` world`, `!`).
        assert_eq!(Tokenizer::Approx.count("Hello, world!"), 4);
    }

    // `PROSE`: about 46 KB of the book's chapters, the benches' text.
    include!("../../benches/support/prose.rs");

    #[test]
    fn approx_stays_above_o200k_on_prose_and_code() {
        for text in [PROSE, include_str!("../request.rs")] {
            let (a, o) = (Tokenizer::Approx.count(text), Tokenizer::O200k.count(text));
            assert!(a >= o, "approx {a} < o200k {o}");
        }
    }

    /// tiktoken's own count of `text` by `tokenizer`'s encoding: the pattern by its regular
    /// expression, then each piece merged.
    fn tiktoken(tokenizer: Tokenizer, text: &str) -> u64 {
        use std::sync::OnceLock;
        static O200K: OnceLock<tiktoken_rs::CoreBPE> = OnceLock::new();
        static CL100K: OnceLock<tiktoken_rs::CoreBPE> = OnceLock::new();
        let core = match tokenizer {
            Tokenizer::O200k => O200K.get_or_init(|| tiktoken_rs::o200k_base().unwrap()),
            Tokenizer::Cl100k => CL100K.get_or_init(|| tiktoken_rs::cl100k_base().unwrap()),
            Tokenizer::Approx => unreachable!("the rule has no tiktoken encoding"),
        };
        core.encode_ordinary(text).len() as u64
    }

    /// Both encodings count `text` as tiktoken does.
    fn counts_as_tiktoken(text: &str) -> Result<(), TestCaseError> {
        for t in [Tokenizer::O200k, Tokenizer::Cl100k] {
            prop_assert_eq!(
                t.count(text),
                tiktoken(t, text),
                "{} {:?}",
                t.as_str(),
                text
            );
        }
        Ok(())
    }

    #[test]
    fn the_splits_by_hand_count_as_tiktoken_on_prose_code_and_long_runs() {
        let long_runs = format!(
            "{}\n{}x{}\n\n{}",
            "-".repeat(3000),
            " ".repeat(500),
            "ab".repeat(400),
            "9".repeat(301)
        );
        let non_ascii = "Zoë’s café — 東京の天気 «naïve» Ⅻ 😀\n".repeat(40);
        for text in [
            PROSE,
            include_str!("../request.rs"),
            long_runs.as_str(),
            non_ascii.as_str(),
        ] {
            for t in [Tokenizer::O200k, Tokenizer::Cl100k] {
                assert_eq!(t.count(text), tiktoken(t, text), "{}", t.as_str());
            }
        }
    }

    /// Fragments that meet every alternative of both patterns and every kind of cut: ASCII
    /// words in both cases, contractions, digits, each ASCII space, punctuation runs with
    /// newlines and slashes, control bytes; and beyond ASCII, letters of every case class,
    /// marks, digits, spaces and symbols.
    const FRAGMENTS: &[&str] = &[
        "the",
        " the",
        "The",
        "HELLO",
        "helloWorld",
        "x",
        "Q",
        "don't",
        "'S",
        "'ll",
        "'LL",
        "'re",
        "'ve",
        "'d",
        "'m",
        "'",
        "123",
        "45678",
        "0",
        " ",
        "  ",
        "\t",
        "\n",
        "\r\n",
        "\n\n",
        "\r",
        "\x0B",
        "\x0C",
        ".",
        ",",
        "/",
        "//",
        "...",
        "-",
        "{",
        "}\n",
        "();",
        "\x00",
        "\x1F",
        "\x7F",
        "—",
        "’",
        "é",
        "É",
        "ß",
        "中文",
        "\u{00A0}",
        "\u{0301}",
        "\u{3000}",
        "😀",
        "ǅ",
        "ʰ",
        "Ⅻ",
        "٣",
        "\u{2028}",
        "\u{0085}",
        "ſ",
        "\u{212A}",
        "'ſ",
        "'Ve",
        "'x",
        "١٢٣٤",
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn both_encodings_count_fragments_as_tiktoken_counts(
            parts in prop::collection::vec(prop::sample::select(FRAGMENTS), 0..40)
        ) {
            let text = parts.concat();
            counts_as_tiktoken(&text)?;
        }

        /// Every order of characters from each of the letter sets o200k's pattern tells apart
        /// (upper, title, lower, modifier and other letters, marks) beside what can lead or
        /// follow a word: where the sets overlap, the pattern backtracks.
        #[test]
        fn both_encodings_count_letters_of_every_class_as_tiktoken_counts(
            parts in prop::collection::vec(prop::sample::select(&[
                "A", "a", "ǅ", "ʰ", "中", "\u{301}", "\u{903}", " ", "'", "s", "ll", "1", "\n", ".", "/", "\u{a0}",
            ][..]), 0..24)
        ) {
            counts_as_tiktoken(&parts.concat())?;
        }

        #[test]
        fn a_long_piece_merges_as_tiktoken_merges_it(
            parts in prop::collection::vec(prop::sample::select(&["a", "b", "ab", "ba", "aa", "th", "e"][..]), 50..400)
        ) {
            let text = parts.concat();
            counts_as_tiktoken(&text)?;
        }

        #[test]
        fn both_encodings_count_any_text_as_tiktoken_counts(text in "\\PC{0,60}|[ -~\\s]{0,80}") {
            counts_as_tiktoken(&text)?;
        }
    }

    /// A memo that keeps everything and says how it was used.
    #[derive(Default)]
    struct Kept {
        counts: std::cell::RefCell<std::collections::HashMap<u64, u64>>,
        recalled: std::cell::Cell<usize>,
    }

    impl Memo for Kept {
        fn key(&self, tokenizer: Tokenizer, text: &str) -> u64 {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (tokenizer, text).hash(&mut h);
            h.finish()
        }
        fn recall(&self, key: u64) -> Option<u64> {
            let found = self.counts.borrow().get(&key).copied();
            self.recalled
                .set(self.recalled.get() + usize::from(found.is_some()));
            found
        }
        fn remember(&self, key: u64, tokens: u64) {
            self.counts.borrow_mut().insert(key, tokens);
        }
    }

    #[test]
    fn a_memo_gives_back_what_was_counted_and_keeps_no_partial_count() {
        let memo = Kept::default();
        let system = &PROSE[..4_000];
        let question = "And what does it cost?";
        let tally = |cap| {
            let mut t = Tally::remembering(Tokenizer::O200k, cap, Some(&memo));
            t.add(system);
            t.add(question);
            t.estimate()
        };
        let mut plain = Tally::new(Tokenizer::O200k, u64::MAX);
        plain.add(system);
        plain.add(question);
        assert_eq!(tally(u64::MAX), plain.estimate());
        // The long text is kept, the short one never looked up.
        assert_eq!((memo.counts.borrow().len(), memo.recalled.get()), (1, 0));
        assert_eq!(tally(u64::MAX), plain.estimate());
        assert_eq!(memo.recalled.get(), 1);
        // A count stopped at the cap is not kept; a kept count over the cap is a lower bound.
        let other = &PROSE[4_000..9_000];
        let mut capped = Tally::remembering(Tokenizer::O200k, 10, Some(&memo));
        capped.add(other);
        assert!(capped.estimate().lower_bound);
        assert_eq!(memo.counts.borrow().len(), 1);
        let recalled = tally(10);
        assert!(recalled.lower_bound && recalled.tokens > 10);
        // The rule is counted, never looked up.
        let mut rule = Tally::remembering(Tokenizer::Approx, u64::MAX, Some(&memo));
        rule.add(other);
        assert_eq!(memo.counts.borrow().len(), 1);
    }

    #[test]
    fn tally_is_exact_under_the_cap_and_a_lower_bound_over_it() {
        let text = PROSE;
        let exact = Tokenizer::O200k.count(text);
        let mut t = Tally::new(Tokenizer::O200k, u64::MAX);
        t.add(text);
        // Chunk cuts fall before whitespace, where o200k's pieces start anyway.
        let diff = t.estimate().tokens.abs_diff(exact);
        assert!(diff <= text.len() as u64 / CHUNK_BYTES as u64 + 1, "{diff}");
        assert!(!t.estimate().lower_bound);

        let mut t = Tally::new(Tokenizer::O200k, 100);
        t.add(text);
        let e = t.estimate();
        assert!(e.lower_bound && e.tokens > 100 && e.tokens <= exact);
    }

    #[test]
    fn a_huge_text_is_refused_from_its_length_alone() {
        // 9 MB: far more than 8k tokens must be in it, whatever it says.
        let huge = "x".repeat(9 << 20);
        let mut t = Tally::new(Tokenizer::O200k, 8_000);
        t.add(&huge);
        let e = t.estimate();
        assert!(e.lower_bound);
        assert_eq!(e.tokens, (9 << 20) / MAX_TOKEN_BYTES as u64);
    }

    proptest! {
        #[test]
        fn chunks_cover_the_text_in_order(s in "[a-zé \n]{0,300}", size in 4usize..40) {
            let pieces: Vec<&str> = chunks(&s, size).collect();
            prop_assert_eq!(pieces.concat(), s.clone());
            prop_assert!(pieces.iter().all(|p| !p.is_empty() && p.len() <= size.max(4)));
        }
    }
}
