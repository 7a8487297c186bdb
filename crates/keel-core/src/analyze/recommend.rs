//! What to do about a workload, ranked by the upstream requests it would save:
//!
//! - `cache`: turn on (or retune) a pool's `[pools.cache]` at the shortest TTL that gets
//!   within a point of the best replayed hit rate;
//! - `normalize`: `normalize = "syntax"` where it merges requests the raw keys keep apart;
//! - `temperature`: exact repeats that sample (temperature above the pool's ceiling), which
//!   no cache answers unless the clients or `max_temperature` change;
//! - `stable_template`: a template whose answers barely vary in length although it samples:
//!   a candidate for a cached or precomputed answer once someone checks its outputs.

use serde::Serialize;

use super::report::{share, PoolReport, TTL_CANDIDATES_MS};

/// A hit rate below this is not worth a cache recommendation.
pub const MIN_HIT_RATE: f64 = 0.02;
/// Normalization is recommended from this share of extra hits on.
pub const MIN_NORMALIZE_GAIN: f64 = 0.01;
/// A template is stable below this output-length CV.
pub const STABLE_CV: f64 = 0.1;
/// … with at least this many requests.
pub const STABLE_MIN_REQUESTS: u64 = 20;

/// One recommendation.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Recommendation {
    pub pool: String,
    /// `cache`, `normalize`, `temperature` or `stable_template`.
    pub kind: &'static str,
    /// One sentence for an operator.
    pub text: String,
    /// Upstream requests it would save (or, for `temperature` and `stable_template`, could).
    pub requests: u64,
    /// Their share of the pool's requests.
    pub share: f64,
    pub usd_per_day: f64,
    /// The TTL a `cache` recommendation names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
}

/// The scenario index of a TTL candidate (see `Analyzer::new`: the pool's own first, then each
/// candidate raw and normalized).
fn scenario(ttl_index: usize, normalized: bool) -> usize {
    1 + ttl_index * 2 + usize::from(normalized)
}

/// A TTL as people say it.
pub fn ttl_words(ms: u64) -> String {
    match ms {
        ms if ms % 3_600_000 == 0 => format!("{} h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{} min", ms / 60_000),
        ms => format!("{} s", ms as f64 / 1000.0),
    }
}

/// The ranked list.
pub fn recommend(pools: &[PoolReport]) -> Vec<Recommendation> {
    let mut out = Vec::new();
    for p in pools {
        let n = p.figures.requests;
        if p.figures.fingerprinted == 0 || n == 0 {
            continue;
        }
        let keyed = p.policy.normalizes;
        // The best hit rate with the pool's keys, and the shortest TTL within a point of it.
        let hits = |i: usize, norm: bool| {
            p.by_scenario
                .get(scenario(i, norm))
                .copied()
                .unwrap_or_default()
        };
        let best = (0..TTL_CANDIDATES_MS.len())
            .map(|i| hits(i, keyed).hits)
            .max()
            .unwrap_or(0);
        let pick = (0..TTL_CANDIDATES_MS.len())
            .find(|i| share(best - hits(*i, keyed).hits, n) <= 0.01)
            .unwrap_or(0);
        let saved = hits(pick, keyed);
        let rate = share(saved.hits, n);
        if rate >= MIN_HIT_RATE {
            let ttl = TTL_CANDIDATES_MS[pick];
            let verb = if p.policy.cache_on { "set" } else { "enable" };
            out.push(Recommendation {
                pool: p.pool.clone(),
                kind: "cache",
                text: format!(
                    "pool `{}`: {verb} `[pools.cache]` with ttl_ms = {ttl} ({}) — {:.0}% of requests answered without an upstream call, ${:.2}/day, {:.0} tokens/day",
                    p.pool,
                    ttl_words(ttl),
                    rate * 100.0,
                    saved.spend_usd / p.days,
                    (saved.tokens_in + saved.tokens_out) as f64 / p.days,
                ),
                requests: saved.hits,
                share: rate,
                usd_per_day: saved.spend_usd / p.days,
                ttl_ms: Some(ttl),
            });
        }
        if !keyed {
            let with = hits(pick, true);
            let gain = with.hits.saturating_sub(saved.hits);
            if share(gain, n) >= MIN_NORMALIZE_GAIN {
                out.push(Recommendation {
                    pool: p.pool.clone(),
                    kind: "normalize",
                    text: format!(
                        "pool `{}`: normalization `syntax` merges {:.0}% more requests (formatting differences only) — `normalize = \"syntax\"`",
                        p.pool,
                        share(gain, n) * 100.0
                    ),
                    requests: gain,
                    share: share(gain, n),
                    usd_per_day: (with.spend_usd - saved.spend_usd).max(0.0) / p.days,
                    ttl_ms: None,
                });
            }
        }
        let sampled_repeats = p.figures.repeats_normalized.min(p.figures.sampled);
        if p.figures.sampled > 0 && share(sampled_repeats, n) >= MIN_HIT_RATE {
            out.push(Recommendation {
                pool: p.pool.clone(),
                kind: "temperature",
                text: format!(
                    "pool `{}`: {:.0}% of requests sample (temperature above {}); up to {:.0}% are exact repeats that no cache answers unless clients send temperature 0 or `max_temperature` is raised",
                    p.pool,
                    share(p.figures.sampled, n) * 100.0,
                    p.policy.max_temperature,
                    share(sampled_repeats, n) * 100.0
                ),
                requests: sampled_repeats,
                share: share(sampled_repeats, n),
                usd_per_day: 0.0,
                ttl_ms: None,
            });
        }
        for t in &p.top_templates {
            let stable = t.output_cv.is_some_and(|cv| cv < STABLE_CV);
            if stable && t.requests >= STABLE_MIN_REQUESTS && t.deterministic_share < 0.5 {
                out.push(Recommendation {
                    pool: p.pool.clone(),
                    kind: "stable_template",
                    text: format!(
                        "pool `{}`: template {} ({} requests, {:.0}%) samples but its answers barely vary in length (CV {:.2}): check whether one answer would do",
                        p.pool,
                        t.id,
                        t.requests,
                        t.share * 100.0,
                        t.output_cv.unwrap_or(0.0)
                    ),
                    requests: t.requests,
                    share: t.share,
                    usd_per_day: 0.0,
                    ttl_ms: None,
                });
            }
        }
    }
    let rank = |r: &Recommendation| match r.kind {
        "cache" | "normalize" => 0,
        _ => 1,
    };
    out.sort_by(|a, b| {
        rank(a)
            .cmp(&rank(b))
            .then(b.requests.cmp(&a.requests))
            .then(a.pool.cmp(&b.pool))
    });
    out
}
