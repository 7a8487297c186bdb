//! What fingerprinting one request costs the gateway (`fingerprint = true` on a pool): the raw
//! cache key, the `syntax`-normalized copy and its key, masking and template mining, on a chat
//! request of a system prompt and a ~1 KB user message, and on one of 32 KB. The baseline is the
//! response cache's own key, which a caching pool computes anyway.
//! `cargo bench -p keel-core --bench analyze`

use criterion::{criterion_group, criterion_main, Criterion};
use serde_json::{json, Map, Value};
use std::hint::black_box;

use keel_core::analyze::{fingerprint, template::Miner};
use keel_core::cache_key;
use keel_core::normalize::{normalize_request_within, Edits, FullConfig, Mode, RepairBudget};
use keel_core::protocol::Endpoint;

fn body(user_bytes: usize) -> Map<String, Value> {
    let sentence = "Summarize order 12345 for customer Alice, placed on 2026-12-04, in two lines. ";
    let user: String = sentence.repeat(user_bytes / sentence.len() + 1);
    match json!({"model": "m", "temperature": 0, "max_tokens": 64, "messages": [
        {"role": "system", "content": "You are a helpful support agent for an online shop."},
        {"role": "user", "content": user}]})
    {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

fn bench(c: &mut Criterion) {
    let full = FullConfig::default();
    let ep = Endpoint::ChatCompletions;
    for (name, size) in [("1KB", 1_000), ("32KB", 32_000)] {
        let b = body(size);
        let mut g = c.benchmark_group(format!("fingerprint_{name}"));
        g.bench_function("cache_key_only", |x| {
            x.iter(|| cache_key::fingerprint("open", ep, "p", black_box(&b)))
        });
        let mut miner = Miner::default();
        g.bench_function("fingerprint", |x| {
            x.iter(|| {
                let raw = cache_key::fingerprint("open", ep, "p", black_box(&b));
                let mut copy = b.clone();
                let fixes = normalize_request_within(
                    ep,
                    &mut copy,
                    Mode::Syntax,
                    &full,
                    &mut Edits::default(),
                    &mut RepairBudget::default(),
                );
                let keys = (raw, fixes.is_empty());
                fingerprint("open", ep, "p", keys, &copy, |t| miner.observe_tokens(t))
            })
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
