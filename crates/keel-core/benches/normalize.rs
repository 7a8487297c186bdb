//! Prompt normalization throughput on ~1 MB of prompt text, cut into ~1 KB messages (chapters
//! of keel's book: prose, tables, code blocks). Three inputs: already canonical text (the pre-scan /
//! no-allocation path), text needing fixes (smart quotes, NBSP, zero-width spaces, CRLF,
//! trailing spaces), and a half-and-half mix. `normalize_syntax` measures `syntax` mode;
//! `normalize_full` measures `full` mode's per-text pipeline (`syntax`, JSON-example repair,
//! the default rewrite rules) on the same inputs plus one whose every message carries vague
//! format instructions the rules rewrite.
//! `normalize_request` runs a whole request of eight such messages, with and without the
//! decision record's edits.
//! `json_repair_budget` runs `full` mode on a hostile request: four messages, each a 16 KB JSON
//! example with two closers missing and 64 places for them (4,160 candidate parses each), with
//! the default per-request repair budget and with none.
//! `cargo bench -p keel-core --bench normalize`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

use keel_core::normalize::{
    normalize_prompt_text, normalize_request_with, normalize_request_within, normalize_text, Edits,
    Fixes, FullConfig, Mode, RepairBudget,
};
use keel_core::protocol::Endpoint;

#[path = "support/prose.rs"]
mod prose;
use prose::PROSE;

const TARGET: usize = 1_000_000;

fn normalize(s: &str) -> String {
    normalize_text(s, &mut Fixes::default()).unwrap_or_else(|| s.to_string())
}

/// ~1 KB messages cut from the prose at line ends, repeated to about 1 MB.
fn chunks() -> Vec<String> {
    let mut out = Vec::new();
    let mut total = 0;
    while total < TARGET {
        let mut cur = String::new();
        for line in PROSE.lines() {
            cur.push_str(line);
            cur.push('\n');
            if cur.len() >= 1000 {
                total += cur.len();
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    out
}

/// The kinds of damage copy-pasted prompts carry.
fn dirty(s: &str) -> String {
    s.replace("'", "\u{2019}")
        .replacen(" the ", " the\u{00A0}", 3)
        .replacen(". ", ".\u{200B} ", 2)
        .replace('\n', "  \r\n")
}

fn bench(c: &mut Criterion) {
    let clean: Vec<String> = chunks().iter().map(|s| normalize(s)).collect();
    let fixes: Vec<String> = chunks().iter().map(|s| dirty(s)).collect();
    let mixed: Vec<String> = clean
        .iter()
        .zip(&fixes)
        .enumerate()
        .map(|(i, (c, f))| if i % 2 == 0 { c.clone() } else { f.clone() })
        .collect();
    let inputs = [
        ("clean", &clean),
        ("needs_fixes", &fixes),
        ("mixed", &mixed),
    ];
    let mut group = c.benchmark_group("normalize_syntax");
    for (name, texts) in inputs {
        let bytes: usize = texts.iter().map(String::len).sum();
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                let mut fixes = Fixes::default();
                for t in texts {
                    black_box(normalize_text(black_box(t), &mut fixes));
                }
            })
        });
    }
    group.finish();

    let cfg = FullConfig::default();
    let vague: Vec<String> = clean
        .iter()
        .map(|s| format!("Summarize this. Don't use markdown, be brief.\n\n{s}"))
        .collect();
    let mut group = c.benchmark_group("normalize_full");
    for (name, texts) in inputs.into_iter().chain([("vague_instructions", &vague)]) {
        let bytes: usize = texts.iter().map(String::len).sum();
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                let mut fixes = Fixes::default();
                for t in texts {
                    black_box(normalize_prompt_text(black_box(t), &cfg, &mut fixes));
                }
            })
        });
    }
    group.finish();

    // A whole request of 8 messages needing fixes, as admission runs it: without and with the
    // decision record's edits (`decision_prompt_edits`).
    let request: serde_json::Map<String, serde_json::Value> = serde_json::from_value(
        serde_json::json!({"model": "m", "messages": fixes[..8].iter()
            .map(|t| serde_json::json!({"role": "user", "content": t}))
            .collect::<Vec<_>>()}),
    )
    .expect("an object");
    let mut group = c.benchmark_group("normalize_request");
    for (name, keep) in [("codes_only", false), ("with_edits", true)] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || request.clone(),
                |mut body| {
                    let mut edits = if keep {
                        Edits::kept()
                    } else {
                        Edits::default()
                    };
                    black_box(normalize_request_with(
                        Endpoint::ChatCompletions,
                        &mut body,
                        Mode::Syntax,
                        &cfg,
                        &mut edits,
                    ));
                    black_box(edits.into_list())
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

/// A request of four messages, each a 16 KB example whose completion search has 4,160
/// candidates of which only the last parses.
fn hostile_request() -> serde_json::Map<String, serde_json::Value> {
    let value = "x".repeat(500);
    let members: Vec<String> = (0..31).map(|i| format!("\"k{i}\": \"{value}\"")).collect();
    let example = format!("Reply like [{{{}", members.join(", "));
    serde_json::from_value(serde_json::json!({"model": "m", "messages": (0..4)
        .map(|_| serde_json::json!({"role": "user", "content": example}))
        .collect::<Vec<_>>()}))
    .expect("an object")
}

fn bench_repair_budget(c: &mut Criterion) {
    let request = hostile_request();
    let cfg = FullConfig::default();
    let mut group = c.benchmark_group("json_repair_budget");
    group.sample_size(10);
    for (name, limit) in [
        ("default_budget", RepairBudget::DEFAULT_BYTES),
        ("unbounded", u64::MAX),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || request.clone(),
                |mut body| {
                    let mut budget = RepairBudget::new(limit);
                    black_box(normalize_request_within(
                        Endpoint::ChatCompletions,
                        &mut body,
                        Mode::Full,
                        &cfg,
                        &mut Edits::default(),
                        &mut budget,
                    ));
                    black_box(budget.used_bytes())
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, bench, bench_repair_budget);
criterion_main!(benches);
