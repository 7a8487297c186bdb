//! Token counting throughput on ~100 KB of mixed English and code: o200k and cl100k against
//! tiktoken-rs's own encoders and keel's one-pass rule. The text is chapters of keel's book
//! (English prose, tables) and Rust source, repeated to 100 KB. A second group counts 100 KB of
//! text in other scripts (Chinese, Japanese, Russian, Greek, Arabic, Hindi, accented Latin).
//! Before the benchmarks it prints o200k ÷ rule on the prose and on the code (the measurement
//! behind `tokens::APPROX_FACTOR`).
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

/// Sentences of keel's own in scripts beyond ASCII, repeated to about 100 KB.
fn multilingual() -> String {
    const SENTENCES: &[&str] = &[
        "网关把每个请求送到最快的副本，并在流中断时从已发送的文本继续生成。\n",
        "ゲートウェイは遅い応答を待たずに、別のサーバーで続きを生成します。\n",
        "Шлюз выбирает самый быстрый вариант и продолжает поток без потерь.\n",
        "Η πύλη επιλέγει τον ταχύτερο διακομιστή για κάθε αίτημα.\n",
        "تختار البوابة أسرع خادم وتكمل النص من حيث توقف.\n",
        "गेटवे हर अनुरोध को सबसे तेज़ सर्वर पर भेजता है।\n",
        "Le répartiteur reprend la génération là où le flux s'est arrêté — sans perte.\n",
    ];
    let mut text = String::new();
    while text.len() < 100_000 {
        SENTENCES.iter().for_each(|s| text.push_str(s));
    }
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
        println!("{}: {} tokens in the corpus", t.as_str(), t.count(&text));
        g.bench_function(t.as_str(), |b| b.iter(|| t.count(black_box(&text))));
    }
    // tiktoken's own encoders, the pattern split by its regular expression: what each count
    // cost before keel split by hand.
    for (name, tiktoken) in [
        (
            "o200k_by_tiktoken",
            tiktoken_rs::o200k_base().expect("o200k"),
        ),
        (
            "cl100k_by_tiktoken",
            tiktoken_rs::cl100k_base().expect("cl100k"),
        ),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| tiktoken.encode_ordinary(black_box(&text)).len())
        });
    }
    g.bench_function("rule", |b| b.iter(|| tokens::count(black_box(&text))));
    g.finish();

    let text = multilingual();
    let mut g = c.benchmark_group("tokens_100kb_multilingual");
    g.throughput(Throughput::Bytes(text.len() as u64));
    for (t, tiktoken) in [
        (Tokenizer::O200k, tiktoken_rs::o200k_base().expect("o200k")),
        (
            Tokenizer::Cl100k,
            tiktoken_rs::cl100k_base().expect("cl100k"),
        ),
    ] {
        g.bench_function(t.as_str(), |b| b.iter(|| t.count(black_box(&text))));
        g.bench_function(format!("{}_by_tiktoken", t.as_str()), |b| {
            b.iter(|| tiktoken.encode_ordinary(black_box(&text)).len())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
