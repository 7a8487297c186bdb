//! The per-request work on a pool's shared state, from one and from two threads at once: a
//! routing decision (`Pool::select`, decision record included), the attempt's bookkeeping
//! (`count_request`, `available`, `hedge_delay_ms`, `stall_threshold_ms`, a slot taken and
//! given back), its outcome (`record_attempt`, `record_success`, `record_stream`) and the
//! request's count in the pool's safe-mode window. With the pool behind one mutex, the second
//! thread waits for the first; read from published views, it does not.
//!
//! `cargo bench -p keel-gateway --bench pool`
//!
//! Each figure is the time per request per thread: equal at one and two threads means the
//! threads do not slow each other down (on a machine with at least two free cores).

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

use keel_core::protocol::Endpoint;
use keel_core::queue::Priority;
use keel_core::selection::Preference;
use keel_gateway::observe::metrics::Metrics;
use keel_gateway::pipeline::selection::{Controls, Selection};
use keel_gateway::state::pools::{Pool, UpstreamLimits};

fn pool(variants: usize) -> Arc<Pool> {
    let mut text = String::from(
        "[[pools]]\nname = \"p\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n",
    );
    for i in 0..variants {
        text.push_str(&format!(
            "[[pools.variants]]\nname = \"v{i}\"\nurl = \"http://127.0.0.1:9/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n"
        ));
    }
    let cfg = keel_gateway::Config::parse(&text, "bench.toml", &HashMap::new()).expect("config");
    keel_gateway::install_crypto();
    let pool = Arc::new(Pool::new(
        cfg.pools[0].clone(),
        keel_gateway::upstream::client(
            1_000,
            metrics::Counter::noop(),
            &|_| metrics::Counter::noop(),
            &|_| None,
            &cfg.pools[0].variants,
        ),
        Instant::now(),
        Metrics::new(),
        UpstreamLimits {
            max_body_bytes: 1 << 20,
            max_event_bytes: 1 << 16,
        },
    ));
    // Live statistics on every variant, as after some traffic.
    for round in 0..64 {
        for i in 0..variants {
            pool.record_attempt(i, true, Some(80.0 + (i * 7 + round) as f64 % 40.0), None);
            pool.record_stream(i, &[10.0, 12.0, 9.0, 11.0].into_iter().collect());
        }
    }
    pool
}

/// One request's work on the pool's shared state.
fn request(pool: &Arc<Pool>, req: &keel_core::request::CanonicalRequest) {
    let controls = Controls {
        force_variant: None,
        preference: Preference::LowLatency,
        min_tier: None,
        priority: Priority::Normal,
    };
    pool.count_request();
    let (selection, record) =
        keel_gateway::pipeline::selection::select(pool, req, controls, "bench");
    black_box(record);
    let Selection::Plan(order) = selection else {
        panic!("no plan");
    };
    let v = order[0];
    black_box(pool.available(v, pool.now_ms()));
    black_box(pool.hedge_delay_ms(v, 200));
    black_box(pool.stall_threshold_ms(v));
    let slot = pool.try_enter(v, Priority::Normal).expect("a free slot");
    pool.record_attempt(v, true, Some(90.0), None);
    pool.record_success(v);
    pool.record_stream(v, &[10.0, 11.0, 12.0].into_iter().collect());
    drop(slot);
    pool.safety.record_request(pool.now_ms(), "direct", "ok");
}

fn contention(c: &mut Criterion) {
    let req = keel_core::request::parse(
        Endpoint::ChatCompletions,
        br#"{"model":"p","messages":[{"role":"user","content":"hello"}],"stream":true}"#,
    )
    .expect("request");
    let mut group = c.benchmark_group("pool_request");
    group.measurement_time(Duration::from_secs(4));
    for variants in [16usize, 256] {
        let p = pool(variants);
        for threads in [1usize, 2] {
            group.bench_with_input(
                BenchmarkId::new(format!("{variants}_variants"), format!("{threads}_threads")),
                &threads,
                |b, &threads| {
                    b.iter_custom(|iters| {
                        let start = Instant::now();
                        std::thread::scope(|s| {
                            for _ in 0..threads {
                                s.spawn(|| {
                                    for _ in 0..iters {
                                        request(&p, &req);
                                    }
                                });
                            }
                        });
                        // Time per request per thread.
                        start.elapsed()
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, contention);
criterion_main!(benches);
