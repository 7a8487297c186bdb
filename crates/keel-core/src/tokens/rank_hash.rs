//! How o200k's static rank table is laid out and probed: the hash a token's bytes are found by
//! and where its entry lies. keel-core's build script writes the table with these functions and
//! [`super::table`] reads it with them, so both sides agree by construction.

/// The table has `1 << SLOT_BITS` slots of 4 bytes: o200k's 200,017 tokens fill 38% of them,
/// so a lookup of a string that is no token (most of a merge's lookups) ends within about two
/// slots of linear probing.
pub const SLOT_BITS: u32 = 19;

/// The slots' count.
pub const SLOTS: usize = 1 << SLOT_BITS;

/// A slot no token occupies.
pub const EMPTY: u32 = u32::MAX;

/// A slot holds a rank in its low `RANK_BITS` bits (every o200k rank lies below `1 << 18`)
/// and the top bits of its token's hash above them: a probe passes over another token's slot
/// without reading that token's bytes, unless the two hashes share those 14 bits.
pub const RANK_BITS: u32 = 18;

/// Ranks below this have an entry in the table of where each token's bytes start (those past
/// the last token's an empty one).
pub const RANKS: usize = 1 << RANK_BITS;

/// The slot for `rank`, whose token hashes to `h` (written by the build script only).
#[allow(dead_code)]
pub fn slot(rank: u32, h: u64) -> u32 {
    tag(h) << RANK_BITS | rank
}

/// The bits of `h` a slot keeps beside its rank.
pub fn tag(h: u64) -> u32 {
    (h >> (64 - (32 - RANK_BITS))) as u32
}

/// Where the probe for a token hashing to `h` starts.
pub fn home(h: u64) -> usize {
    (h as usize) & (SLOTS - 1)
}

/// The hash a token is found by. Most lookups are of a piece of two to eight bytes (a word and
/// its space): those are read as at most two overlapping words and mixed by one wide multiply;
/// longer ones go through rustc-hash.
pub fn hash(s: &[u8]) -> u64 {
    use std::hash::BuildHasher;
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
        _ => return rustc_hash::FxBuildHasher.hash_one(s),
    };
    let m = ((lo ^ K) as u128).wrapping_mul((hi ^ n as u64 ^ K.rotate_left(29)) as u128);
    (m as u64) ^ ((m >> 64) as u64)
}

/// The 8 bytes of `s` from `at` (which leaves at least 8).
pub fn word(s: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(s[at..at + 8].try_into().unwrap_or([0; 8]))
}

/// The 4 bytes of `s` from `at` (which leaves at least 4).
pub fn half(s: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(s[at..at + 4].try_into().unwrap_or([0; 4]))
}
