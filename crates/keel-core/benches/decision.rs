//! One routing decision over a 16- and a 256-variant pool: health weights and predictions read for every
//! variant, candidates built, power of two choices (and the affinity variant) run.
//! `cargo bench -p keel-core --bench decision`

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

use keel_core::health::{HealthConfig, VariantHealth};
use keel_core::rng::{mix, Rng};
use keel_core::selection::{Candidate, PowerOfTwo, RequestSignals, Selector};

fn pool(n: usize) -> (Vec<VariantHealth>, HealthConfig) {
    let cfg = HealthConfig {
        prewarm_requests: 0,
        ..Default::default()
    };
    let mut rng = Rng::new(1);
    let hs = (0..n)
        .map(|i| {
            let mut h = VariantHealth::new(0);
            for t in 0..64u64 {
                h.record_ttft(t * 50, rng.lognormal(80.0 + i as f64, 0.3), &cfg);
                h.record_outcome(t * 50, rng.next_f64() > 0.01, &cfg);
                h.record_stream_gaps(
                    t * 50,
                    &[10.0, 12.0, 9.0, 11.0, 30.0].into_iter().collect(),
                    &cfg,
                );
            }
            h
        })
        .collect();
    (hs, cfg)
}

fn decide(
    hs: &[VariantHealth],
    cfg: &HealthConfig,
    p: &PowerOfTwo,
    signals: &RequestSignals,
    now: u64,
) -> usize {
    let candidates: Vec<Candidate> = hs
        .iter()
        .enumerate()
        .map(|(i, h)| Candidate {
            index: i,
            weight: 1,
            available: true,
            health: h.weight(now, cfg),
            condition: h.est.factors(now, cfg).condition(),
            predicted_ttft_ms: h.predicted_ttft_ms(now, cfg),
            ttft_samples: h.est.ttft_ms.evidence(),
            gap_ms: h.est.gap_ms.get(),
            gap_trust: h.est.gap_trust(now, cfg),
            in_flight: (i % 3) as u32,
            tier: 1,
            price: 1.0,
            p95_ttft_ms: h.p95_ttft_ms(),
            queued: false,
            name_hash: mix(i as u64),
        })
        .collect();
    p.plan(&candidates, signals).order[0]
}

fn bench(c: &mut Criterion) {
    let plain = RequestSignals {
        slo_ttft_p95_ms: Some(500.0),
        ..Default::default()
    };
    for n in [16usize, 256] {
        let (hs, cfg) = pool(n);
        let p = PowerOfTwo::new(Rng::new(7), n);
        c.bench_function(&format!("decision_{n}_variants_p2c"), |b| {
            b.iter(|| decide(black_box(&hs), &cfg, &p, &plain, 3300))
        });
        let mut key = 0u64;
        c.bench_function(&format!("decision_{n}_variants_affinity"), |b| {
            b.iter(|| {
                key = key.wrapping_add(1);
                let s = RequestSignals {
                    affinity_key: Some(mix(key)),
                    ..plain
                };
                decide(black_box(&hs), &cfg, &p, &s, 3300)
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
