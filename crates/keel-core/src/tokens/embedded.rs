//! The layout of the tables keel-core's build script embeds in the binary: how the rank tables
//! of o200k and cl100k are probed (the hash a token's bytes are found by and where its entry
//! lies), and the bits a character's classes are written as. The build script writes the
//! tables with these definitions and the tokenizers read them with them, so both sides agree by
//! construction.

/// The size of one encoding's tables.
#[derive(Clone, Copy)]
pub struct Layout {
    /// Ranks below this have an entry in the table of where each token's bytes start (those
    /// past the last token's an empty one).
    pub ranks: usize,
    /// The open-addressing table's slots of 4 bytes, a power of two: each encoding's tokens
    /// fill 38% of them, so a lookup of a string that is no token (most of a merge's lookups)
    /// ends within about two slots of linear probing.
    pub slots: usize,
}

/// o200k: 199,998 tokens, ranks below 200,019.
pub const O200K: Layout = Layout {
    ranks: 1 << 18,
    slots: 1 << 19,
};

/// cl100k: 100,256 tokens, ranks below 100,277.
pub const CL100K: Layout = Layout {
    ranks: 1 << 17,
    slots: 1 << 18,
};

/// A slot no token occupies.
pub const EMPTY: u32 = u32::MAX;

/// A slot holds a rank in its low `RANK_BITS` bits (every rank of either encoding lies below
/// `1 << 18`) and the top bits of its token's hash above them: a probe passes over another
/// token's slot without reading that token's bytes, unless the two hashes share those 14 bits.
pub const RANK_BITS: u32 = 18;

/// The slot for `rank`, whose token hashes to `h` (written by the build script only).
#[allow(dead_code)]
pub fn slot(rank: u32, h: u64) -> u32 {
    tag(h) << RANK_BITS | rank
}

/// The bits of `h` a slot keeps beside its rank.
pub fn tag(h: u64) -> u32 {
    (h >> (64 - (32 - RANK_BITS))) as u32
}

/// Where the probe for a token hashing to `h` starts in a table of `slots` slots.
pub fn home(h: u64, slots: usize) -> usize {
    (h as usize) & (slots - 1)
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

/// A character's classes as the pre-tokenizers test them, as bits: one table read (ASCII) or
/// one binary search (beyond it) gives them all.
// The build script writes the classes beyond ASCII, the library reads all of them: each uses
// some of these names.
#[allow(dead_code)]
pub mod class {
    /// In o200k's first letter set, `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`.
    pub const UPPER: u8 = 1;
    /// In o200k's second letter set, `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`.
    pub const LOWER: u8 = 2;
    /// A letter, `\p{L}`.
    pub const LETTER: u8 = 4;
    /// A number, `\p{N}`.
    pub const NUMBER: u8 = 8;
    /// Whitespace, `\s` (Unicode's White_Space).
    pub const SPACE: u8 = 16;
    /// `\r` and `\n`.
    pub const NEWLINE: u8 = 32;
    /// What o200k's punctuation piece takes after its run: `\r`, `\n` and `/`.
    pub const TAIL: u8 = 64;
    /// Past the end of the text.
    pub const END: u8 = 128;

    /// `Lu` and `Lt`; `Ll`; `Lm` and `Lo`; `M` (a mark is in both of o200k's letter sets, and
    /// no letter).
    pub const CASED_UPPER: u8 = UPPER | LETTER;
    pub const CASED_LOWER: u8 = LOWER | LETTER;
    pub const UNCASED: u8 = UPPER | LOWER | LETTER;
    pub const MARK: u8 = UPPER | LOWER;
}
