//! Token counting throughput on ~100 KB of mixed English and code: o200k and cl100k (tiktoken-rs)
//! against keel's one-pass rule. The text is chapters of keel's book (English prose, tables)
//! and Rust source, repeated to 100 KB. Before the benchmarks it prints o200k ÷ rule on the
//! prose and on the code (the measurement behind `tokens::APPROX_FACTOR`).
//! `cargo bench -p keel-core --bench tokens`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

use keel_core::tokens::{self, Tokenizer};

#[path = "support/prose.rs"]
mod prose;
use prose::PROSE;

const CODE: &[&str] = &[
    include_str!("../src/request.rs"),
    include_str!("../src/sse.rs"),
    include_str!("../src/health.rs"),
];

/// About 100 KB, half prose and half code, cut at a character boundary.
fn corpus() -> String {
    let code = CODE.concat();
    let mut text = String::new();
    while text.len() < 100_000 {
        text.push_str(&PROSE[..PROSE.len().min(25_000)]);
        text.push_str(&code[..code.len().min(25_000)]);
    }
    let mut end = 100_000;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text
}

fn print_ratios() {
    let code = CODE.concat();
    for (what, text) in [("prose (book)", PROSE), ("code (Rust)", code.as_str())] {
        let rule = tokens::count(text) as f64;
        let o200k = Tokenizer::O200k.count(text) as f64;
        let cl100k = Tokenizer::Cl100k.count(text) as f64;
        println!(
            "{what}: {} bytes, rule {rule}, o200k {o200k}, cl100k {cl100k}; o200k/rule = {:.3}, cl100k/rule = {:.3}, approx/o200k = {:.3}",
            text.len(),
            o200k / rule,
            cl100k / rule,
            Tokenizer::Approx.count(text) as f64 / o200k
        );
    }
}

fn bench(c: &mut Criterion) {
    print_ratios();
    let text = corpus();
    let mut g = c.benchmark_group("tokens_100kb");
    g.throughput(Throughput::Bytes(text.len() as u64));
    for t in Tokenizer::ALL {
        t.preload();
        println!("{}: {} tokens in the corpus", t.as_str(), t.count(&text));
        g.bench_function(t.as_str(), |b| b.iter(|| t.count(black_box(&text))));
    }
    // tiktoken's own encoder, the pattern split by its regular expression: what o200k's
    // count cost before ASCII was split by hand.
    let tiktoken = tiktoken_rs::o200k_base().expect("o200k");
    g.bench_function("o200k_by_tiktoken", |b| {
        b.iter(|| tiktoken.encode_ordinary(black_box(&text)).len())
    });
    g.bench_function("rule", |b| b.iter(|| tokens::count(black_box(&text))));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
