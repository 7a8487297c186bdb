//! OpenAI's byte-pair encodings and their count of a text: the text split into pieces by the
//! encoding's pattern, each piece's bytes merged by rank until no adjacent pair is a token.
//!
//! Each encoding keeps only what a count needs: each token's rank by its bytes, written into the
//! binary by keel-core's build script from tiktoken's table ([`Ranks`]). tiktoken's encoders
//! also keep a decoder, the tokens sorted and a copy of the pattern per thread, built at
//! start-up: 46 MB of heap for o200k, 16 MB for cl100k. The pieces are merged here, as tiktoken
//! merges them (the tests compare every count): tiktoken publishes no merge that takes a piece
//! of any length.
//!
//! **The split.** Both patterns are written out by hand over all of Unicode
//! ([`super::o200k_split`], [`super::cl100k_split`]): no regular expression is compiled or run.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::cl100k_split::Cl100k;
use super::classes;
use super::embedded::{self, half, hash, word};
use super::o200k_split::O200k;

/// A token's rank: its place in the encoding's table, lower merging first.
type Rank = u32;

/// Pieces shorter than this are merged in place on the stack ([`short_merged_len`], a scan of
/// the parts for each merge, as tiktoken does: fastest for the short pieces of most text);
/// longer ones with a heap of their pairs ([`merged_len`], n log n: a prompt of 30,000 dashes
/// is one piece).
const SHORT_PIECE_BYTES: usize = 100;

/// An encoding's rank of each token by its bytes, as keel-core's build script wrote it from
/// tiktoken's table (see `build.rs` for the layout): embedded read-only data, so a gateway
/// neither decodes nor hashes anything to start counting, and only the pages its lookups touch
/// become resident (o200k at most about 4.4 MB: 1.4 MB of tokens, 1 MB of starts, 2 MB of
/// slots; cl100k about half that).
///
/// `STARTS` and `SLOTS` are the byte sizes of the starts and slots, from the encoding's
/// [`embedded::Layout`]: a build that wrote other sizes does not compile, and no lookup checks
/// a bound of either.
pub(super) struct Ranks<const STARTS: usize, const SLOTS: usize> {
    bytes: &'static [u8],
    starts: &'static [u8; STARTS],
    slots: &'static [u8; SLOTS],
}

/// The byte sizes of a layout's starts and slots.
const fn sizes(layout: embedded::Layout) -> (usize, usize) {
    (4 * (layout.ranks + 1), 4 * layout.slots)
}

const O200K_SIZES: (usize, usize) = sizes(embedded::O200K);
const CL100K_SIZES: (usize, usize) = sizes(embedded::CL100K);

static O200K: Ranks<{ O200K_SIZES.0 }, { O200K_SIZES.1 }> = Ranks {
    bytes: include_bytes!(concat!(env!("OUT_DIR"), "/o200k_bytes.bin")),
    starts: include_bytes!(concat!(env!("OUT_DIR"), "/o200k_starts.bin")),
    slots: include_bytes!(concat!(env!("OUT_DIR"), "/o200k_slots.bin")),
};

static CL100K: Ranks<{ CL100K_SIZES.0 }, { CL100K_SIZES.1 }> = Ranks {
    bytes: include_bytes!(concat!(env!("OUT_DIR"), "/cl100k_bytes.bin")),
    starts: include_bytes!(concat!(env!("OUT_DIR"), "/cl100k_starts.bin")),
    slots: include_bytes!(concat!(env!("OUT_DIR"), "/cl100k_slots.bin")),
};

/// A rank table as the merges use it.
trait Lookup {
    /// The rank of the token whose bytes are `bytes`, if there is one.
    fn get(&self, bytes: &[u8]) -> Option<Rank>;
}

impl<const STARTS: usize, const SLOTS: usize> Ranks<STARTS, SLOTS> {
    /// Ranks below this have a start.
    const RANKS: usize = STARTS / 4 - 1;

    fn token(&self, rank: Rank) -> &'static [u8] {
        let r = (rank as usize % Self::RANKS) * 4;
        let (a, b) = (
            half(self.starts, r) as usize,
            half(self.starts, r + 4) as usize,
        );
        self.bytes.get(a..b).unwrap_or_default()
    }
}

impl<const STARTS: usize, const SLOTS: usize> Lookup for Ranks<STARTS, SLOTS> {
    fn get(&self, bytes: &[u8]) -> Option<Rank> {
        const RANK: u32 = (1 << embedded::RANK_BITS) - 1;
        let slots = SLOTS / 4;
        let h = hash(bytes);
        let tag = embedded::tag(h);
        let mut at = embedded::home(h, slots);
        loop {
            let slot = half(self.slots, at * 4);
            if slot == embedded::EMPTY {
                return None;
            }
            if slot >> embedded::RANK_BITS == tag && same(self.token(slot & RANK), bytes) {
                return Some(slot & RANK);
            }
            at = (at + 1) & (slots - 1);
        }
    }
}

/// `a == b`, for the short strings of a lookup without a call to `memcmp`: two overlapping
/// loads from each end cover 4 to 16 bytes.
fn same(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    match n {
        0..4 => a == b,
        4..8 => half(a, 0) == half(b, 0) && half(a, n - 4) == half(b, n - 4),
        8..=16 => word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8),
        _ => a == b,
    }
}

/// The tokens of `text` by o200k.
pub(super) fn o200k(text: &str) -> u64 {
    classes::pieces::<O200k>(text)
        .map(|piece| piece_tokens(piece, &O200K))
        .sum()
}

/// The tokens of `text` by cl100k.
pub(super) fn cl100k(text: &str) -> u64 {
    classes::pieces::<Cl100k>(text)
        .map(|piece| piece_tokens(piece, &CL100K))
        .sum()
}

/// The tokens of one piece of the pattern.
fn piece_tokens(piece: &[u8], ranks: &impl Lookup) -> u64 {
    let tokens = match piece.len() {
        0 => 0,
        1 => 1,
        _ if ranks.get(piece).is_some() => 1,
        n if n < SHORT_PIECE_BYTES => short_merged_len(piece, ranks),
        _ => merged_len(piece, ranks),
    };
    tokens as u64
}

/// [`merged_len`] for a piece shorter than [`SHORT_PIECE_BYTES`], without allocating: the
/// parts' starts and the ranks of each part joined with the next, in arrays scanned for the
/// lowest rank (the leftmost of equals) before each merge.
fn short_merged_len(piece: &[u8], ranks: &impl Lookup) -> usize {
    let n = piece.len();
    // Part `k` is `piece[start[k]..start[k + 1]]`; the last start is the piece's end.
    let mut start = [0usize; SHORT_PIECE_BYTES + 1];
    let mut joined = [Rank::MAX; SHORT_PIECE_BYTES];
    let mut parts = n;
    for (k, s) in start.iter_mut().enumerate().take(n + 1) {
        *s = k;
    }
    let rank = |start: &[usize], parts: usize, k: usize| -> Rank {
        if k + 1 < parts {
            ranks
                .get(&piece[start[k]..start[k + 2]])
                .unwrap_or(Rank::MAX)
        } else {
            Rank::MAX
        }
    };
    for (k, j) in joined.iter_mut().enumerate().take(parts) {
        *j = rank(&start, parts, k);
    }
    loop {
        let (mut best, mut k_best) = (Rank::MAX, 0);
        for (k, &r) in joined[..parts].iter().enumerate() {
            if r < best {
                (best, k_best) = (r, k);
            }
        }
        if best == Rank::MAX {
            return parts;
        }
        // Part `k_best + 1` joins part `k_best`.
        start.copy_within(k_best + 2..=parts, k_best + 1);
        joined.copy_within(k_best + 2..parts, k_best + 1);
        parts -= 1;
        joined[k_best] = rank(&start, parts, k_best);
        if k_best > 0 {
            joined[k_best - 1] = rank(&start, parts, k_best - 1);
        }
    }
}

/// How many tokens `piece` merges into: the adjacent pair of lowest rank merged first (the
/// leftmost of equals), as tiktoken does, with a heap of the pairs so that each merge costs
/// log n. A pair's entry is stale once either side has merged since it was pushed; it is
/// recognised by its rank, which names one byte string.
fn merged_len(piece: &[u8], ranks: &impl Lookup) -> usize {
    let n = piece.len();
    // Parts are named by their first byte; `next[i]` is where the part after part `i` starts.
    let mut next: Vec<usize> = (1..=n).collect();
    let mut prev: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
    let mut alive = vec![true; n];
    let pair_rank = |i: usize, next: &[usize]| -> Option<Rank> {
        let j = next[i];
        (j < n).then(|| ranks.get(&piece[i..next[j]]))?
    };
    let mut heap: BinaryHeap<Reverse<(Rank, usize)>> = (0..n)
        .filter_map(|i| pair_rank(i, &next).map(|r| Reverse((r, i))))
        .collect();
    let mut parts = n;
    while let Some(Reverse((rank, i))) = heap.pop() {
        if !alive[i] || pair_rank(i, &next) != Some(rank) {
            continue;
        }
        let j = next[i];
        alive[j] = false;
        next[i] = next[j];
        if next[i] < n {
            prev[next[i]] = Some(i);
        }
        parts -= 1;
        if let Some(r) = pair_rank(i, &next) {
            heap.push(Reverse((r, i)));
        }
        if let Some(p) = prev[i] {
            if let Some(r) = pair_rank(p, &next) {
                heap.push(Reverse((r, p)));
            }
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every token of tiktoken's `core` is found at its own rank in the embedded table, and a
    /// string that is none is not found.
    fn every_token_found_at_its_rank<const A: usize, const B: usize>(
        core: &tiktoken_rs::CoreBPE,
        ranks: &Ranks<A, B>,
        tokens: usize,
    ) {
        let specials = core.special_tokens();
        let mut found = 0;
        for rank in 0..Ranks::<A, B>::RANKS as Rank {
            let Ok(token) = core.decode_bytes(&[rank]) else {
                assert_eq!(ranks.token(rank), b"", "rank {rank}");
                continue;
            };
            if std::str::from_utf8(&token).is_ok_and(|s| specials.contains(s)) {
                assert_eq!(ranks.get(&token), None, "special rank {rank}");
                continue;
            }
            assert_eq!(ranks.token(rank), &token[..], "rank {rank}");
            assert_eq!(ranks.get(&token), Some(rank), "rank {rank}");
            found += 1;
        }
        assert_eq!(found, tokens);
        for absent in [&b"keel gateway keel"[..], b"\xff\xfe\xfd", b""] {
            assert_eq!(ranks.get(absent), None);
        }
    }

    #[test]
    fn every_o200k_token_is_found_at_its_rank() {
        every_token_found_at_its_rank(&tiktoken_rs::o200k_base().unwrap(), &O200K, 199_998);
    }

    #[test]
    fn every_cl100k_token_is_found_at_its_rank() {
        every_token_found_at_its_rank(&tiktoken_rs::cl100k_base().unwrap(), &CL100K, 100_256);
    }
}
