//! The latency and capacity model of one simulated server.
//!
//! time to first token = queueing (real: a semaphore of `capacity` slots)
//!                     + base × lognormal jitter (× `tail_factor` with probability `tail_prob`)
//!                     + prefill per prompt token not already in the KV cache
//!                     + fault extras (cold start, network delay);
//! inter-token gap     = median × lognormal jitter × (1 + load_stretch × running / capacity).
//!
//! The KV cache is an LRU of prefix-block hashes: the prompt is cut into blocks of
//! `block_tokens` tokens, block i's hash chains blocks 0..=i (as vLLM's prefix caching does), and
//! the cached prefix is the run of leading blocks found in the cache.

use std::num::NonZeroUsize;

use lru::LruCache;

use keel_core::rng::{hash_bytes, mix, Rng};
use keel_core::tokens;

use crate::config::ServerConfig;

/// Prefix-block cache.
pub struct KvCache {
    blocks: LruCache<u64, ()>,
    block_tokens: usize,
}

impl KvCache {
    pub fn new(blocks: u32, block_tokens: u32) -> Self {
        KvCache {
            blocks: LruCache::new(
                NonZeroUsize::new(blocks.max(1) as usize).unwrap_or(NonZeroUsize::MIN),
            ),
            block_tokens: block_tokens.max(1) as usize,
        }
    }

    /// Looks the prompt up and then stores its blocks. Returns (cached tokens, total tokens).
    pub fn admit(&mut self, prompt: &str) -> (usize, usize) {
        let toks = tokens::split(prompt);
        let mut h = 0u64;
        let mut cached = 0;
        let mut still_hit = true;
        for block in toks.chunks(self.block_tokens) {
            if block.len() < self.block_tokens {
                break; // only full blocks are cached, as in vLLM
            }
            for t in block {
                h = mix(h ^ hash_bytes(1, t.as_bytes()));
            }
            if still_hit && self.blocks.get(&h).is_some() {
                cached += block.len();
            } else {
                still_hit = false;
                self.blocks.put(h, ());
            }
        }
        (cached, toks.len())
    }

    /// Share of the cache in use, 0..=1 (`vllm:kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        self.blocks.len() as f64 / self.blocks.cap().get() as f64
    }
}

/// Draws TTFT (without queueing and fault extras) in milliseconds.
pub fn draw_ttft_ms(
    cfg: &ServerConfig,
    rng: &mut Rng,
    uncached_tokens: usize,
    ttft_factor: f64,
) -> f64 {
    let mut base = rng.lognormal(cfg.ttft_ms, cfg.ttft_sigma) * ttft_factor;
    if cfg.tail_prob > 0.0 && rng.next_f64() < cfg.tail_prob {
        base *= cfg.tail_factor;
    }
    base + cfg.prefill_us_per_token * uncached_tokens as f64 / 1000.0
}

/// Draws one inter-token gap in milliseconds.
pub fn draw_gap_ms(cfg: &ServerConfig, rng: &mut Rng, running: u32, gap_factor: f64) -> f64 {
    let load = 1.0 + cfg.load_stretch * running as f64 / cfg.capacity.max(1) as f64;
    rng.lognormal(cfg.gap_ms, cfg.gap_sigma) * load * gap_factor
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_hits_only_leading_blocks() {
        let mut kv = KvCache::new(64, 4);
        let a = "one two three four five six seven eight nine ten";
        assert_eq!(kv.admit(a), (0, 10));
        // Same first 8 tokens (two full blocks), different tail.
        assert_eq!(
            kv.admit("one two three four five six seven eight x y z w"),
            (8, 12)
        );
        // Different first block: nothing is a hit even though later blocks match text.
        assert_eq!(kv.admit("zero two three four five six seven eight").0, 0);
        assert!(kv.usage() > 0.0);
    }

    #[test]
    fn bounded_cache_evicts_least_recently_used_prefixes() {
        // Room for two prompts of two blocks each.
        let mut kv = KvCache::new(4, 4);
        let p = |i: u32| format!("prompt {i} a b c d e f");
        assert_eq!(kv.admit(&p(0)), (0, 8));
        assert_eq!(kv.admit(&p(1)), (0, 8));
        assert_eq!(kv.admit(&p(0)).0, 8, "both fit");
        assert!((kv.usage() - 1.0).abs() < 1e-9);
        // A third prompt evicts the least recently used one (1), not the one just used (0).
        assert_eq!(kv.admit(&p(2)), (0, 8));
        assert_eq!(kv.admit(&p(0)).0, 8);
        assert_eq!(kv.admit(&p(1)).0, 0, "evicted");
        // Cycling through more prompts than fit never hits.
        let mut kv = KvCache::new(4, 4);
        let hits: usize = (0..30).map(|i| kv.admit(&p(i % 3)).0).sum();
        assert_eq!(hits, 0);
    }

    #[test]
    fn ttft_grows_with_uncached_prompt() {
        let cfg = ServerConfig {
            ttft_sigma: 0.0,
            ttft_ms: 10.0,
            prefill_us_per_token: 1000.0,
            ..Default::default()
        };
        let mut rng = Rng::new(1);
        assert_eq!(draw_ttft_ms(&cfg, &mut rng, 0, 1.0), 10.0);
        assert_eq!(draw_ttft_ms(&cfg, &mut rng, 50, 1.0), 60.0);
    }
}
