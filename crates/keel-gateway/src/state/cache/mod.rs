//! The response cache's state: stored answers (in this process, or shared through Redis), the
//! semantic index, and the identical requests in flight that others wait on or follow. What a
//! request does with it (lookup, capture, replay) is the pipeline's (`pipeline::cache`).

pub mod flight;
pub mod semantic_index;
pub mod store;

use std::sync::Arc;

use crate::observe::metrics::Metrics;
use flight::Flights;
pub use store::Entry;
use store::Stores;

/// The response cache of one gateway.
pub struct ResponseCache {
    pub(crate) stores: Stores,
    pub(crate) flights: Arc<Flights>,
    pub(crate) metrics: Arc<Metrics>,
}

impl ResponseCache {
    /// Redis is only connected when some pool caches.
    pub fn new(cfg: &crate::Config, metrics: Arc<Metrics>) -> Arc<ResponseCache> {
        let used = cfg.pools.iter().any(|p| p.cache.enabled);
        let redis = cfg.redis.as_ref().filter(|_| used);
        Arc::new(ResponseCache {
            stores: Stores::new(cfg.cache, redis, metrics.clone()),
            flights: Arc::new(Flights::default()),
            metrics,
        })
    }

    /// Whether answers are shared with other replicas through Redis.
    pub fn shared(&self) -> bool {
        self.stores.shared()
    }

    /// Generations in progress that others wait on (tests).
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    pub(crate) fn count(&self, pool: &str, result: &'static str) {
        self.metrics
            .counter(
                "keel_cache_lookups_total",
                &[("pool", pool), ("result", result)],
            )
            .increment(1);
    }
}
