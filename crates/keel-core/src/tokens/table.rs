//! A byte-pair encoding's table and its count of a text: the text split into pieces by the
//! encoding's pattern, each piece's bytes merged by rank until no adjacent pair is a token.
//!
//! **o200k** keeps only what a count needs: each token's rank by its bytes, and the pattern as
//! one regular expression for text beyond ASCII (ASCII is split by hand, [`o200k_split`]).
//! tiktoken's encoder is built once to read the ranks from, then dropped: it also keeps a
//! decoder, the tokens sorted and a copy of the pattern per thread (46 MB resident; keel's
//! table, [`Ranks`] and the pattern, about 10). Its pieces are merged here, as tiktoken merges
//! them (the tests compare every count): tiktoken publishes no merge that takes a piece of any
//! length. **cl100k** is
//! tiktoken's encoder as it is (the crate does not publish its pattern).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use fancy_regex::Regex;
use hashbrown::HashTable;
use rustc_hash::FxBuildHasher;
use std::hash::BuildHasher;
use tiktoken_rs::{CoreBPE, Rank};

use super::o200k_split;

/// Every rank of o200k lies below this (its last special token is 200,018).
const RANKS_BELOW: Rank = 1 << 18;

/// Pieces shorter than this are merged in place on the stack ([`short_merged_len`], a scan of
/// the parts for each merge, as tiktoken does: fastest for the short pieces of most text);
/// longer ones with a heap of their pairs ([`merged_len`], n log n: a prompt of 30,000 dashes
/// is one piece).
const SHORT_PIECE_BYTES: usize = 100;

/// Each token's rank by its bytes, compactly: every token's bytes one after another, where each
/// rank's bytes lie, and a hash table of ranks found by the hash of their bytes (4 bytes an
/// entry). A map of owned byte strings (24 bytes and an allocation a token) kept 6.5 MB more
/// resident, and looked up a little faster.
pub(super) struct Ranks {
    bytes: Vec<u8>,
    /// By rank: the start and end of its bytes in `bytes` (empty for a rank not in the table).
    spans: Vec<(u32, u32)>,
    table: HashTable<Rank>,
}

impl Ranks {
    fn new(tokens: impl Iterator<Item = (Rank, Vec<u8>)>) -> Ranks {
        let (mut bytes, mut spans) = (Vec::new(), Vec::new());
        for (rank, token) in tokens {
            let start = bytes.len() as u32;
            bytes.extend_from_slice(&token);
            let r = rank as usize;
            if spans.len() <= r {
                spans.resize(r + 1, (0, 0));
            }
            spans[r] = (start, bytes.len() as u32);
        }
        bytes.shrink_to_fit();
        spans.shrink_to_fit();
        let token_of = |r: &Rank| {
            let (a, b) = spans[*r as usize];
            &bytes[a as usize..b as usize]
        };
        let mut table = HashTable::with_capacity(spans.len());
        for (rank, &(a, b)) in spans.iter().enumerate() {
            if a < b {
                let token = &bytes[a as usize..b as usize];
                table.insert_unique(hash(token), rank as Rank, |r| hash(token_of(r)));
            }
        }
        Ranks {
            bytes,
            spans,
            table,
        }
    }

    fn token(&self, rank: Rank) -> &[u8] {
        let (a, b) = self.spans[rank as usize];
        &self.bytes[a as usize..b as usize]
    }

    /// The rank of the token whose bytes are `bytes`, if there is one.
    fn get(&self, bytes: &[u8]) -> Option<Rank> {
        self.table
            .find(hash(bytes), |r| same(self.token(*r), bytes))
            .copied()
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

/// The hash a token is found by. Most lookups are of a piece of two to eight bytes (a word and
/// its space): those are read as at most two overlapping words and mixed by one wide multiply;
/// longer ones go through rustc-hash.
fn hash(s: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let n = s.len();
    let (lo, hi) = match n {
        0 => (0, 0),
        1..4 => (
            s[0] as u64 | (s[n / 2] as u64) << 8 | (s[n - 1] as u64) << 16,
            0,
        ),
        4..8 => (half(s, 0) as u64, half(s, n - 4) as u64),
        8..=16 => (word(s, 0), word(s, n - 8)),
        _ => return FxBuildHasher.hash_one(s),
    };
    let m = ((lo ^ K) as u128).wrapping_mul((hi ^ n as u64 ^ K.rotate_left(29)) as u128);
    (m as u64) ^ ((m >> 64) as u64)
}

/// The 8 bytes of `s` from `at` (which leaves at least 8).
fn word(s: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(s[at..at + 8].try_into().unwrap_or([0; 8]))
}

/// The 4 bytes of `s` from `at` (which leaves at least 4).
fn half(s: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(s[at..at + 4].try_into().unwrap_or([0; 4]))
}

pub(super) enum Table {
    /// o200k: ranks by bytes, and the pattern for text beyond ASCII.
    Split { ranks: Ranks, pattern: Regex },
    /// tiktoken's own encoder.
    Tiktoken(CoreBPE),
}

impl Table {
    /// o200k's table, `None` should the embedded table or its pattern fail to parse.
    pub(super) fn o200k() -> Option<Table> {
        let core = tiktoken_rs::o200k_base().ok()?;
        let specials = core.special_tokens();
        let tokens = (0..RANKS_BELOW).filter_map(|rank| {
            let bytes = core.decode_bytes(&[rank]).ok()?;
            // A special token is never part of a text's pieces.
            let special = std::str::from_utf8(&bytes).is_ok_and(|s| specials.contains(s));
            (!special).then_some((rank, bytes))
        });
        let ranks = Ranks::new(tokens);
        let pattern = Regex::new(tiktoken_rs::O200K_BASE_PAT_STR).ok()?;
        Some(Table::Split { ranks, pattern })
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
                false => by_pattern(segment, pattern, ranks),
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
