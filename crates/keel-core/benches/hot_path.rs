//! The functions every streamed token passes through, one Criterion group each, so that a
//! change to the relay's per-event cost shows up here before it shows up in `keel bench
//! overhead`:
//! * `sse_decode_chunk_view`: a 64-token OpenAI stream, fed as the network delivers it (a few
//!   events per read), decoded into events and each read through `ChunkView` (text, finish).
//! * `stitch_original`: the same events through the `Stitcher` that keeps a migrated stream one
//!   response (segment 0: what every stream pays, migrated or not).
//!
//! `cargo bench -p keel-core --bench hot_path`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

use keel_core::continuation::Stitcher;
use keel_core::protocol::{ChunkView, Protocol};
use keel_core::sse::{SseDecoder, SseEvent};

const TOKENS: usize = 64;

/// An OpenAI chat stream as a vLLM-style server writes it: role chunk, one chunk per token,
/// finish chunk, usage chunk, `[DONE]`.
fn openai_stream() -> Vec<u8> {
    let head = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":"#;
    let mut s = String::new();
    s.push_str(&format!(
        "data: {head}{{\"role\":\"assistant\",\"content\":\"\"}},\"finish_reason\":null}}]}}\n\n"
    ));
    for i in 0..TOKENS {
        s.push_str(&format!(
            "data: {head}{{\"content\":\" word{i}\"}},\"finish_reason\":null}}]}}\n\n"
        ));
    }
    s.push_str(&format!(
        "data: {head}{{}},\"finish_reason\":\"stop\"}}]}}\n\n"
    ));
    s.push_str("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":64,\"total_tokens\":74}}\n\n");
    s.push_str("data: [DONE]\n\n");
    s.into_bytes()
}

fn decode(bytes: &[u8]) -> Vec<SseEvent> {
    let mut dec = SseDecoder::new();
    let mut out = Vec::with_capacity(TOKENS + 4);
    // Reads of about three events each, cut anywhere (as TCP delivers them).
    for piece in bytes.chunks(500) {
        dec.feed(piece, &mut out).expect("valid stream");
    }
    dec.end(&mut out).expect("complete stream");
    out
}

fn bench(c: &mut Criterion) {
    let bytes = openai_stream();
    let mut g = c.benchmark_group("per_stream_64_tokens");
    g.throughput(Throughput::Elements(TOKENS as u64));
    g.bench_function("sse_decode_chunk_view", |b| {
        b.iter(|| {
            let events = decode(black_box(&bytes));
            let mut chars = 0usize;
            for ev in &events {
                if let Some(v) = ChunkView::parse(&ev.data) {
                    chars += v.text().map_or(0, str::len) + v.finished() as usize;
                }
            }
            chars
        })
    });
    let events = decode(&bytes);
    g.bench_function("stitch_original", |b| {
        b.iter(|| {
            let mut st = Stitcher::new(Protocol::OpenAi);
            let mut trim = false;
            let mut out = 0usize;
            for ev in black_box(&events) {
                out += st.process(ev, &mut trim).map_or(0, |b| b.len());
            }
            out
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
