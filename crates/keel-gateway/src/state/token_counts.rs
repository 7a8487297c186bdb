//! The token counts of a pool's long prompt texts, kept by a hash of the text: the
//! [`Memo`] that context fit looks a text up in before counting it with a byte-pair encoding
//! (see `keel_core::tokens::Memo` for why: a system prompt or a conversation's earlier turns come
//! back with every request, and their count costs about 250 instructions a byte).
//!
//! A table of [`SLOTS`] words, each a count and the part of its key that did not choose the slot:
//! reads and writes are single atomic words (no lock, no torn entry), a new text takes the slot
//! of whichever text was there, and the table is allocated on the first text kept, so a pool
//! whose variants count by the rule never holds one. The hash is seeded per pool: a client
//! cannot make its text take another's count without knowing the seed, and the worst a
//! collision does is misestimate one prompt.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use keel_core::tokens::{Memo, Tokenizer};

/// Texts kept (32 KiB).
pub const SLOTS: usize = 4096;

/// A slot's low bits hold the count, the high bits the key's high bits.
const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// A pool's kept counts.
#[derive(Default)]
pub struct TokenCounts {
    seed: foldhash::quality::RandomState,
    slots: OnceLock<Box<[AtomicU64]>>,
    /// `keel_bpe_texts_total{count="kept"}` and `{count="counted"}`, for a pool that counts by
    /// a byte-pair encoding.
    texts: Option<(metrics::Counter, metrics::Counter)>,
}

impl TokenCounts {
    /// The counts of pool `pool`, counted in `keel_bpe_texts_total` where the pool `counts_by_bpe`.
    pub fn new(
        metrics: &crate::observe::metrics::Metrics,
        pool: &str,
        counts_by_bpe: bool,
    ) -> Self {
        let texts = counts_by_bpe.then(|| {
            let by = |count| {
                metrics.counter("keel_bpe_texts_total", &[("pool", pool), ("count", count)])
            };
            (by("kept"), by("counted"))
        });
        TokenCounts {
            texts,
            ..TokenCounts::default()
        }
    }
}

impl std::fmt::Debug for TokenCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCounts")
            .field("allocated", &self.slots.get().is_some())
            .finish()
    }
}

/// The slot of `key`: its low bits (the high bits are kept in the slot).
fn slot(key: u64) -> usize {
    key as usize % SLOTS
}

impl Memo for TokenCounts {
    fn key(&self, tokenizer: Tokenizer, text: &str) -> u64 {
        self.seed.hash_one((tokenizer, text))
    }

    fn recall(&self, key: u64) -> Option<u64> {
        let slots = self.slots.get()?;
        let word = slots[slot(key)].load(Ordering::Relaxed);
        // An empty slot is 0; a kept count is never 0 (a kept text is long).
        let kept =
            (word != 0 && word >> COUNT_BITS == key >> COUNT_BITS).then_some(word & COUNT_MASK);
        if let (Some(_), Some((found, _))) = (kept, &self.texts) {
            found.increment(1);
        }
        kept
    }

    fn remember(&self, key: u64, tokens: u64) {
        if let Some((_, counted)) = &self.texts {
            counted.increment(1);
        }
        if tokens == 0 || tokens > COUNT_MASK {
            return;
        }
        let slots = self
            .slots
            .get_or_init(|| (0..SLOTS).map(|_| AtomicU64::new(0)).collect());
        let word = (key >> COUNT_BITS) << COUNT_BITS | tokens;
        slots[slot(key)].store(word, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_kept_by_tokenizer_and_text() {
        let counts = TokenCounts::default();
        let text = "a long system prompt ".repeat(40);
        let key = counts.key(Tokenizer::O200k, &text);
        assert_eq!(counts.recall(key), None);
        assert!(
            counts.slots.get().is_none(),
            "nothing is allocated before a count is kept"
        );
        counts.remember(key, 161);
        assert_eq!(counts.recall(key), Some(161));
        assert_eq!(counts.key(Tokenizer::O200k, &text), key);
        let other = counts.key(Tokenizer::Cl100k, &text);
        assert_ne!(other, key);
        assert_eq!(counts.recall(other), None);
        assert_eq!(
            counts.recall(counts.key(Tokenizer::O200k, &text[1..])),
            None
        );
        // Two pools' keys differ (their seeds do).
        assert_ne!(TokenCounts::default().key(Tokenizer::O200k, &text), key);
    }

    #[test]
    fn a_text_takes_its_slot_from_the_one_there_and_huge_counts_are_not_kept() {
        let counts = TokenCounts::default();
        // Two keys of one slot, differing above the count's bits.
        let (a, b) = (5u64 << 40 | 7, 6u64 << 40 | 7);
        counts.remember(a, 10);
        counts.remember(b, 20);
        assert_eq!((counts.recall(a), counts.recall(b)), (None, Some(20)));
        counts.remember(a, COUNT_MASK + 1);
        assert_eq!((counts.recall(a), counts.recall(b)), (None, Some(20)));
    }
}
