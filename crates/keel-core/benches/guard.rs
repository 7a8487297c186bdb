//! Guard detection throughput on ~1 MB of text cut into ~1 KB messages: `clean` is README
//! prose, tables and code (digits, colons and `@` occur, values do not); `dense` is the same
//! prose with a value (email, phone, card, IBAN, IP, key, JWT ...) every ~80 bytes. `mask`
//! runs the whole request-direction step (scan + placeholders) on the dense text.
//! `cargo bench -p keel-core --bench guard`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

use keel_core::guard::mask::{apply, Counts, Masker};
use keel_core::guard::policy::Policy;
use keel_core::guard::Guard;

const README: &str = include_str!("../../../README.md");
const TARGET: usize = 1_000_000;

const VALUES: &[&str] = &[
    "jane.doe@example.com",
    "+44 20 7946 0958",
    "4111 1111 1111 1111",
    "DE89 3704 0044 0532 0130 00",
    "123-45-6789",
    "192.168.10.254",
    "AKIAIOSFODNN7EXAMPLE",
    "postgres://admin:s3cr3t@db.internal",
    "(415) 555-0132",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.abcdefghijklmnop",
];

fn chunks(dense: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut total = 0;
    let mut k = 0;
    while total < TARGET {
        let mut cur = String::new();
        for line in README.lines() {
            for word in line.split(' ') {
                cur.push_str(word);
                cur.push(' ');
                if dense && cur.len() % 80 < word.len() + 1 {
                    cur.push_str(VALUES[k % VALUES.len()]);
                    cur.push(' ');
                    k += 1;
                }
            }
            cur.push('\n');
            if cur.len() >= 1000 {
                total += cur.len();
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    out
}

fn bench(c: &mut Criterion) {
    let guard = Guard::builtin();
    let mut g = c.benchmark_group("guard_scan");
    for (name, texts) in [("clean", chunks(false)), ("dense", chunks(true))] {
        let bytes: usize = texts.iter().map(String::len).sum();
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(name, |b| {
            b.iter(|| {
                let n: usize = texts.iter().map(|t| guard.scan(black_box(t)).len()).sum();
                black_box(n)
            })
        });
        if name == "dense" {
            let policy = Policy::parse(&guard, [("default", "mask")]).expect("policy");
            g.bench_function("dense_mask", |b| {
                b.iter(|| {
                    let mut m = Masker::default();
                    let mut counts = Counts::default();
                    for t in &texts {
                        black_box(apply(&guard, &policy, black_box(t), &mut m, &mut counts));
                    }
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
