//! Writes o200k's rank table into the build's output directory, to be embedded in the binary
//! (`tokens::table`): read-only data that costs no start-up work and no heap, and only the pages
//! a count touches become resident. Decoding tiktoken's table at run time and hashing it took
//! 10 MB of heap in every gateway with an OpenAI pool.
//!
//! Three files, little-endian `u32`s except the first:
//! - `o200k_bytes.bin`: every token's bytes, one after another in rank order;
//! - `o200k_starts.bin`: for each rank below [`rank_hash::RANKS`], where its bytes start, and
//!   one more entry for the end (a rank with no token, or a special token, starts where it
//!   ends);
//! - `o200k_slots.bin`: the open-addressing table of [`rank_hash`], linear probing.

#[path = "src/tokens/rank_hash.rs"]
mod rank_hash;

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/tokens/rank_hash.rs");
    let out = std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR");
    let out = Path::new(&out);
    let core = tiktoken_rs::o200k_base().expect("tiktoken-rs's embedded o200k table parses");
    let specials = core.special_tokens();

    let (mut bytes, mut starts) = (Vec::new(), Vec::new());
    let mut last = 0;
    for rank in 0..rank_hash::RANKS as u32 {
        let Ok(token) = core.decode_bytes(&[rank]) else {
            continue;
        };
        // A special token is never part of a text's pieces.
        if std::str::from_utf8(&token).is_ok_and(|s| specials.contains(s)) {
            continue;
        }
        starts.resize(rank as usize + 1, bytes.len() as u32);
        bytes.extend_from_slice(&token);
        last = rank;
    }
    starts.resize(rank_hash::RANKS + 1, bytes.len() as u32);
    assert!(
        (last as usize) < rank_hash::RANKS - 1,
        "a rank collides with the empty slot"
    );

    let mut slots = vec![rank_hash::EMPTY; rank_hash::SLOTS];
    let mask = slots.len() - 1;
    for rank in 0..rank_hash::RANKS {
        let token = &bytes[starts[rank] as usize..starts[rank + 1] as usize];
        if token.is_empty() {
            continue;
        }
        let h = rank_hash::hash(token);
        let mut at = rank_hash::home(h);
        while slots[at] != rank_hash::EMPTY {
            at = (at + 1) & mask;
        }
        slots[at] = rank_hash::slot(rank as u32, h);
    }

    let le = |words: &[u32]| {
        words
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect::<Vec<u8>>()
    };
    write(&out.join("o200k_bytes.bin"), &bytes);
    write(&out.join("o200k_starts.bin"), &le(&starts));
    write(&out.join("o200k_slots.bin"), &le(&slots));
}

fn write(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}
