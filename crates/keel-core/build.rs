//! Writes the rank tables of OpenAI's two byte-pair encodings, o200k and cl100k, and the
//! Unicode classes their pre-tokenizers read, into the build's output directory, to be
//! embedded in the binary (`tokens::table`, `tokens::classes`): read-only data that costs
//! no start-up work and no heap, and only the pages a count touches become resident. tiktoken's
//! encoders, built at run time, took 46 MB (o200k) and 16 MB (cl100k) of heap.
//!
//! For each encoding, three files of little-endian `u32`s except the first:
//! - `<name>_bytes.bin`: every token's bytes, one after another in rank order;
//! - `<name>_starts.bin`: for each rank below its [`embedded::Layout`]'s `ranks`, where its
//!   bytes start, and one more entry for the end (a rank with no token, or a special token,
//!   starts where it ends);
//! - `<name>_slots.bin`: the open-addressing table of [`embedded`], linear probing.
//!
//! And `unicode_classes.bin`: the code points beyond ASCII that are letters, marks, numbers or
//! whitespace, as sorted ranges of three `u32`s: first, last, and the class's bits
//! ([`embedded::class`]). They are read from regex-syntax, the tables tiktoken's own patterns
//! are matched by. `bmp_classes.bin` holds the same for each code point below U+10000, a byte
//! each: one read instead of a search for nearly all text.

#[path = "src/tokens/embedded.rs"]
mod embedded;

use std::path::Path;

use embedded::Layout;
use regex_syntax::hir::{Class, HirKind};
use tiktoken_rs::CoreBPE;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/tokens/embedded.rs");
    let out = std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR");
    let out = Path::new(&out);
    let o200k = tiktoken_rs::o200k_base().expect("tiktoken-rs's o200k table parses");
    tables(&o200k, embedded::O200K, &out.join("o200k"));
    drop(o200k);
    let cl100k = tiktoken_rs::cl100k_base().expect("tiktoken-rs's cl100k table parses");
    tables(&cl100k, embedded::CL100K, &out.join("cl100k"));
    let ranges = unicode_classes();
    write(&out.join("bmp_classes.bin"), &bmp_classes(&ranges));
    write(&out.join("unicode_classes.bin"), &le(&ranges));
}

/// Writes `core`'s three tables, named `<stem>_bytes.bin` and so on.
fn tables(core: &CoreBPE, layout: Layout, stem: &Path) {
    let specials = core.special_tokens();
    let (mut bytes, mut starts) = (Vec::new(), Vec::new());
    let mut last = 0;
    for rank in 0..layout.ranks as u32 {
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
    starts.resize(layout.ranks + 1, bytes.len() as u32);
    assert!(
        (last as usize) < layout.ranks - 1 && layout.ranks <= 1 << embedded::RANK_BITS,
        "a rank beyond the layout's"
    );

    let mut slots = vec![embedded::EMPTY; layout.slots];
    for rank in 0..layout.ranks {
        let token = &bytes[starts[rank] as usize..starts[rank + 1] as usize];
        if token.is_empty() {
            continue;
        }
        let h = embedded::hash(token);
        let mut at = embedded::home(h, layout.slots);
        while slots[at] != embedded::EMPTY {
            at = (at + 1) & (layout.slots - 1);
        }
        slots[at] = embedded::slot(rank as u32, h);
    }
    let name = |part: &str| {
        let mut path = stem.as_os_str().to_owned();
        path.push(format!("_{part}.bin"));
        path
    };
    write(Path::new(&name("bytes")), &bytes);
    write(Path::new(&name("starts")), &le(&starts));
    write(Path::new(&name("slots")), &le(&slots));
}

/// The ranges beyond ASCII of each class the pre-tokenizers tell apart, sorted, each as first,
/// last, bits.
fn unicode_classes() -> Vec<u32> {
    use embedded::class;
    let mut ranges = Vec::new();
    for (bits, pattern) in [
        (class::CASED_UPPER, r"[\p{Lu}\p{Lt}]"),
        (class::CASED_LOWER, r"\p{Ll}"),
        (class::UNCASED, r"[\p{Lm}\p{Lo}]"),
        (class::MARK, r"\p{M}"),
        (class::NUMBER, r"\p{N}"),
        (class::SPACE, r"\s"),
    ] {
        let hir = regex_syntax::Parser::new()
            .parse(pattern)
            .expect("a Unicode class parses");
        let HirKind::Class(Class::Unicode(set)) = hir.kind() else {
            panic!("{pattern} is not a Unicode class");
        };
        for r in set.ranges() {
            let (first, last) = (u32::from(r.start()).max(0x80), u32::from(r.end()));
            if first <= last {
                ranges.push([first, last, u32::from(bits)]);
            }
        }
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        assert!(pair[0][1] < pair[1][0], "the classes overlap");
    }
    ranges.concat()
}

/// The classes of every code point below U+10000 (the Basic Multilingual Plane, where nearly
/// all text lies), one byte each, from `ranges` as [`unicode_classes`] gives them (ASCII's
/// entries stay 0: ASCII has a table of its own).
fn bmp_classes(ranges: &[u32]) -> Vec<u8> {
    let mut table = vec![0u8; 0x10000];
    for range in ranges.chunks_exact(3) {
        let (first, last, bits) = (range[0] as usize, range[1] as usize, range[2] as u8);
        for entry in table.iter_mut().take(last + 1).skip(first) {
            *entry = bits;
        }
    }
    table
}

fn le(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn write(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}
