//! A byte-pair encoding's table and its count of a text: the text split into pieces by the
//! encoding's pattern, each piece's bytes merged by rank until no adjacent pair is a token.
//!
//! **o200k** keeps only what a count needs: each token's rank by its bytes, and the pattern as
//! one regular expression for text beyond ASCII (ASCII is split by hand, [`o200k_split`]).
//! tiktoken's encoder is built once to read the ranks from, then dropped: it also keeps a
//! decoder, the tokens sorted and a copy of the pattern per thread (46 MB resident; the ranks
//! take 12). Its pieces are merged here, as tiktoken merges them (the tests compare every
//! count): tiktoken publishes no merge that takes a piece of any length. **cl100k** is
//! tiktoken's encoder as it is (the crate does not publish its pattern).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use fancy_regex::Regex;
use rustc_hash::FxHashMap;
use tiktoken_rs::{CoreBPE, Rank};

use super::o200k_split;

/// Every rank of o200k lies below this (its last special token is 200,018).
const RANKS_BELOW: Rank = 1 << 18;

/// Pieces shorter than this are merged in place on the stack ([`short_merged_len`], a scan of
/// the parts for each merge, as tiktoken does: fastest for the short pieces of most text);
/// longer ones with a heap of their pairs ([`merged_len`], n log n: a prompt of 30,000 dashes
/// is one piece).
const SHORT_PIECE_BYTES: usize = 100;

/// Each token's rank by its bytes.
type Ranks = FxHashMap<Vec<u8>, Rank>;

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
        let mut ranks = FxHashMap::default();
        for rank in 0..RANKS_BELOW {
            let Ok(bytes) = core.decode_bytes(&[rank]) else {
                continue;
            };
            // A special token is never part of a text's pieces.
            if !std::str::from_utf8(&bytes).is_ok_and(|s| specials.contains(s)) {
                ranks.insert(bytes, rank);
            }
        }
        ranks.shrink_to_fit();
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
        if text.is_ascii() {
            // Most prompts: one segment, found a word at a time rather than a byte.
            return o200k_split::ascii_pieces(text.as_bytes())
                .map(|piece| piece_tokens(piece, ranks))
                .sum();
        }
        let mut tokens = 0;
        for (segment, ascii) in o200k_split::segments(text) {
            if ascii {
                for piece in o200k_split::ascii_pieces(segment.as_bytes()) {
                    tokens += piece_tokens(piece, ranks);
                }
                continue;
            }
            let mut end = 0;
            for found in pattern.find_iter(segment) {
                match found {
                    Ok(m) => {
                        tokens += piece_tokens(m.as_str().as_bytes(), ranks);
                        end = m.end();
                    }
                    // The engine gave up (its backtracking limit, which this pattern's one
                    // lookahead does not approach): the rest of the segment by keel's rule.
                    Err(_) => {
                        tokens += super::count(&segment[end..]) as u64;
                        break;
                    }
                }
            }
        }
        tokens
    }
}

/// The tokens of one piece of the pattern.
fn piece_tokens(piece: &[u8], ranks: &Ranks) -> u64 {
    let tokens = match piece.len() {
        0 => 0,
        1 => 1,
        _ if ranks.contains_key(piece) => 1,
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
                .copied()
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
        (j < n).then(|| ranks.get(&piece[i..next[j]]).copied())?
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
