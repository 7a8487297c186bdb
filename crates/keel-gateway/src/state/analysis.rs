//! The live side of workload analysis (`keel_core::analyze`): a pool with `fingerprint = true`
//! mines its prompts' templates here and keeps its most recent fingerprinted requests in a
//! bounded ring, and `GET /keel/analyze` (`admin::analysis`) runs the same analysis as
//! `keel analyze` over those windows (operations plane: the admin key or a key with the `ops` role, like every read of
//! all tenants' traffic).

use std::collections::VecDeque;
use std::sync::Mutex;

use keel_core::analyze::report::{Options, PoolPolicy, Record};
use keel_core::analyze::template::Miner;

/// Requests kept per pool for `/keel/analyze`.
pub const RECENT: usize = 4096;

/// A fingerprinting pool's template miner and its recent requests.
#[derive(Debug, Default)]
pub struct Analysis {
    miner: Mutex<Miner>,
    recent: Mutex<VecDeque<Record>>,
}

impl Analysis {
    /// The template id of masked prompt tokens (the lock is held for the mining only).
    pub fn mine(&self, tokens: &[u64]) -> u64 {
        self.miner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe_tokens(tokens)
    }

    /// Keeps one finished request, dropping the oldest past [`RECENT`].
    pub fn record(&self, r: Record) {
        let mut q = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= RECENT {
            q.pop_front();
        }
        q.push_back(r);
    }

    /// The requests kept now, oldest first.
    pub fn snapshot(&self) -> Vec<Record> {
        let q = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        q.iter().cloned().collect()
    }
}

/// The replay's settings from a config: each pool's cache policy and normalization, and the
/// store's byte budget.
pub fn options(cfg: &crate::Config) -> Options {
    let mut opts = Options {
        max_bytes: cfg.cache.max_bytes,
        ..Default::default()
    };
    for p in &cfg.pools {
        opts.pools.insert(
            p.name.clone(),
            PoolPolicy {
                ttl_ms: p.cache.ttl_ms,
                max_temperature: p.cache.max_temperature,
                allow_tools: p.cache.allow_tools,
                normalizes: p.normalize != keel_core::normalize::Mode::Off,
                cache_on: p.cache.enabled,
            },
        );
    }
    opts
}
