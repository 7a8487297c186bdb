//! A byte-pair encoding's table and its count of a text: the text split into pieces by the
//! encoding's pattern, each piece's bytes merged by rank until no adjacent pair is a token.
//!
//! **o200k** keeps only what a count needs: each token's rank by its bytes, written into the
//! binary by keel-core's build script from tiktoken's table ([`Ranks`]), and the pattern as one
//! regular expression for text beyond ASCII (ASCII is split by hand, [`o200k_split`]).
//! tiktoken's encoder also keeps a decoder, the tokens sorted and a copy of the pattern per
//! thread (46 MB resident); a table decoded and hashed at start-up took 10 MB of heap. Its
//! pieces are merged here, as tiktoken merges them (the tests compare every count): tiktoken
//! publishes no merge that takes a piece of any length. **cl100k** is tiktoken's encoder as it
//! is (the crate does not publish its pattern).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::OnceLock;

use fancy_regex::Regex;
use tiktoken_rs::{CoreBPE, Rank};

use super::o200k_split;
use super::rank_hash::{self, half, hash, word, RANKS, SLOTS};

/// Pieces shorter than this are merged in place on the stack ([`short_merged_len`], a scan of
/// the parts for each merge, as tiktoken does: fastest for the short pieces of most text);
/// longer ones with a heap of their pairs ([`merged_len`], n log n: a prompt of 30,000 dashes
/// is one piece).
const SHORT_PIECE_BYTES: usize = 100;

/// o200k's rank of each token by its bytes, as keel-core's build script wrote it from
/// tiktoken's table (see `build.rs` for the layout): embedded read-only data, so a gateway
/// neither decodes nor hashes anything to start counting, and only the pages its lookups touch
/// become resident (at most about 3.8 MB: 1.3 MB of tokens, 0.8 MB of starts, 2 MB of slots).
///
/// The starts and slots are arrays of the sizes `rank_hash` gives them, so a build that wrote
/// other sizes does not compile, and no lookup checks a bound of either.
pub(super) struct Ranks {
    bytes: &'static [u8],
    starts: &'static [u8; 4 * (RANKS + 1)],
    slots: &'static [u8; 4 * SLOTS],
}

static O200K: Ranks = Ranks {
    bytes: include_bytes!(concat!(env!("OUT_DIR"), "/o200k_bytes.bin")),
    starts: include_bytes!(concat!(env!("OUT_DIR"), "/o200k_starts.bin")),
    slots: include_bytes!(concat!(env!("OUT_DIR"), "/o200k_slots.bin")),
};

impl Ranks {
    fn token(&self, rank: Rank) -> &'static [u8] {
        let r = (rank as usize & (RANKS - 1)) * 4;
        let (a, b) = (
            half(self.starts, r) as usize,
            half(self.starts, r + 4) as usize,
        );
        self.bytes.get(a..b).unwrap_or_default()
    }

    /// The rank of the token whose bytes are `bytes`, if there is one.
    fn get(&self, bytes: &[u8]) -> Option<Rank> {
        const RANK: u32 = RANKS as u32 - 1;
        let h = hash(bytes);
        let tag = rank_hash::tag(h);
        let mut at = rank_hash::home(h);
        loop {
            let slot = half(self.slots, at * 4);
            if slot == rank_hash::EMPTY {
                return None;
            }
            if slot >> rank_hash::RANK_BITS == tag && same(self.token(slot & RANK), bytes) {
                return Some(slot & RANK);
            }
            at = (at + 1) & (SLOTS - 1);
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

pub(super) enum Table {
    /// o200k: the embedded ranks, and the pattern for text beyond ASCII, compiled when such
    /// text first comes: about 3 ms, once, for 1.3 MB of heap that a gateway whose prompts are
    /// all ASCII never holds.
    Split {
        ranks: &'static Ranks,
        pattern: OnceLock<Option<Regex>>,
    },
    /// tiktoken's own encoder.
    Tiktoken(CoreBPE),
}

impl Table {
    /// o200k's table: always there (its ranks are embedded).
    pub(super) fn o200k() -> Option<Table> {
        Some(Table::Split {
            ranks: &O200K,
            pattern: OnceLock::new(),
        })
    }

    pub(super) fn cl100k() -> Option<Table> {
        tiktoken_rs::cl100k_base().ok().map(Table::Tiktoken)
    }

    /// The tokens of `text`.
    pub(super) fn count(&self, text: &str) -> u64 {
        let (ranks, pattern) = match self {
            Table::Tiktoken(core) => return core.encode_ordinary(text).len() as u64,
            Table::Split { ranks, pattern } => (ranks, pattern),
        };
        o200k_split::segments(text)
            .map(|(segment, ascii)| match ascii {
                true => o200k_split::ascii_pieces(segment.as_bytes())
                    .map(|piece| piece_tokens(piece, ranks))
                    .sum(),
                false => {
                    match pattern.get_or_init(|| Regex::new(tiktoken_rs::O200K_BASE_PAT_STR).ok()) {
                        Some(pattern) => by_pattern(segment, pattern, ranks),
                        // tiktoken's pattern did not compile (a fault of the build): keel's rule.
                        None => super::count(segment) as u64,
                    }
                }
            })
            .sum()
    }
}

/// The tokens of `segment`, split by the pattern's regular expression.
fn by_pattern(segment: &str, pattern: &Regex, ranks: &Ranks) -> u64 {
    let (mut tokens, mut end) = (0, 0);
    for found in pattern.find_iter(segment) {
        match found {
            Ok(m) => {
                tokens += piece_tokens(m.as_str().as_bytes(), ranks);
                end = m.end();
            }
            // The engine gave up (its backtracking limit, which this pattern's one lookahead
            // does not approach): the rest of the segment by keel's rule.
            Err(_) => return tokens + super::count(&segment[end..]) as u64,
        }
    }
    tokens
}

/// The tokens of one piece of the pattern.
fn piece_tokens(piece: &[u8], ranks: &Ranks) -> u64 {
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
fn short_merged_len(piece: &[u8], ranks: &Ranks) -> usize {
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
fn merged_len(piece: &[u8], ranks: &Ranks) -> usize {
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

    /// Every token of tiktoken's o200k is found at its own rank in the embedded table, and a
    /// string that is none is not found.
    #[test]
    fn every_token_is_found_at_its_rank() {
        let core = tiktoken_rs::o200k_base().expect("o200k parses");
        let specials = core.special_tokens();
        let mut found = 0;
        for rank in 0..RANKS as Rank {
            let Ok(token) = core.decode_bytes(&[rank]) else {
                assert_eq!(O200K.token(rank), b"", "rank {rank}");
                continue;
            };
            if std::str::from_utf8(&token).is_ok_and(|s| specials.contains(s)) {
                assert_eq!(O200K.get(&token), None, "special rank {rank}");
                continue;
            }
            assert_eq!(O200K.token(rank), &token[..], "rank {rank}");
            assert_eq!(O200K.get(&token), Some(rank), "rank {rank}");
            found += 1;
        }
        assert_eq!(found, 199_998);
        for absent in [&b"keel gateway keel"[..], b"\xff\xfe\xfd", b""] {
            assert_eq!(O200K.get(absent), None);
        }
    }
}
