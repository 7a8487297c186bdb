//! The fleet-wide retry budget (`keel_core::budget`), split into shards so that the call every
//! request makes — counting the request — takes no shared lock: each runtime thread counts into
//! its own shard (uncontended). Asking for a retry, which only failing or hedged attempts do,
//! locks every shard in order and decides on their totals, so the shards together grant exactly
//! what one budget would.

use keel_core::budget::{RetryBudget, RetryBudgetConfig};

use crate::per_thread::PerThread;

/// The retry budget's shards.
pub struct ShardedBudget {
    shards: PerThread<RetryBudget>,
}

impl ShardedBudget {
    /// One shard per available core (the runtime's default thread count).
    pub fn new(cfg: RetryBudgetConfig) -> ShardedBudget {
        ShardedBudget {
            shards: PerThread::new(|| RetryBudget::new(cfg)),
        }
    }

    pub fn with_shards(cfg: RetryBudgetConfig, n: usize) -> ShardedBudget {
        ShardedBudget {
            shards: PerThread::with_shards(n, || RetryBudget::new(cfg)),
        }
    }

    /// Counts one client request (the calling thread's shard only).
    pub fn record_request(&self, now_ms: u64) {
        self.shards.own().record_request(now_ms);
    }

    /// Asks for one retry; true (and counted) when the whole budget allows it.
    pub fn try_retry(&self, now_ms: u64) -> bool {
        self.try_retry_keeping(now_ms, 0.0)
    }

    /// [`ShardedBudget::try_retry`] leaving `reserve` of the budget untouched (see
    /// `RetryBudget::try_retry_keeping`).
    pub fn try_retry_keeping(&self, now_ms: u64, reserve: f64) -> bool {
        let own = self.shards.own_index();
        let mut guards = self.shards.all();
        let others =
            guards
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != own)
                .fold((0, 0), |(r, t), (_, g)| {
                    let (gr, gt) = g.totals(now_ms);
                    (r + gr, t + gt)
                });
        guards[own].try_retry_keeping(now_ms, others, reserve)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Requests counted on many threads and retries asked for on others grant exactly what
    /// one budget grants for the same traffic.
    #[test]
    fn the_shards_grant_what_one_budget_would() {
        let cfg = RetryBudgetConfig {
            ratio: 0.2,
            window_ms: 10_000,
            min_retries_per_sec: 1,
        };
        let sharded = Arc::new(ShardedBudget::with_shards(cfg, 4));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let b = sharded.clone();
                std::thread::spawn(move || (0..25).for_each(|_| b.record_request(500)))
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let asks: Vec<_> = (0..8)
            .map(|_| {
                let b = sharded.clone();
                std::thread::spawn(move || (0..20).filter(|_| b.try_retry(600)).count())
            })
            .collect();
        let granted: usize = asks.into_iter().map(|t| t.join().unwrap()).sum();
        let mut one = RetryBudget::new(cfg);
        (0..200).for_each(|_| one.record_request(500));
        let expected = (0..160).filter(|_| one.try_retry(600)).count();
        // Floor 10 + 20% of 200 requests.
        assert_eq!((granted, expected), (50, 50));
        // The window slides for every shard alike.
        assert!(sharded.try_retry(20_000));
    }
}
