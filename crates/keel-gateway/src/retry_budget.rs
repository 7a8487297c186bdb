//! The fleet-wide retry budget (`keel_core::budget`), split into shards so that the call every
//! request makes — counting the request — takes no shared lock: each runtime thread counts into
//! its own shard (uncontended). Asking for a retry, which only failing or hedged attempts do,
//! locks every shard in order and decides on their totals, so the shards together grant exactly
//! what one budget would.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use keel_core::budget::{RetryBudget, RetryBudgetConfig};

/// The retry budget's shards.
pub struct ShardedBudget {
    shards: Box<[Mutex<RetryBudget>]>,
}

/// Threads are numbered as they first count, and use shard `number % shards`.
static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD: Cell<Option<usize>> = const { Cell::new(None) };
}

fn thread_number() -> usize {
    THREAD.with(|t| match t.get() {
        Some(n) => n,
        None => {
            let n = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
            t.set(Some(n));
            n
        }
    })
}

fn lock(m: &Mutex<RetryBudget>) -> MutexGuard<'_, RetryBudget> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ShardedBudget {
    /// One shard per available core (the runtime's default thread count).
    pub fn new(cfg: RetryBudgetConfig) -> ShardedBudget {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_shards(cfg, n)
    }

    pub fn with_shards(cfg: RetryBudgetConfig, n: usize) -> ShardedBudget {
        ShardedBudget {
            shards: (0..n.max(1))
                .map(|_| Mutex::new(RetryBudget::new(cfg)))
                .collect(),
        }
    }

    fn own(&self) -> usize {
        thread_number() % self.shards.len()
    }

    /// Counts one client request (the calling thread's shard only).
    pub fn record_request(&self, now_ms: u64) {
        lock(&self.shards[self.own()]).record_request(now_ms);
    }

    /// Asks for one retry; true (and counted) when the whole budget allows it.
    pub fn try_retry(&self, now_ms: u64) -> bool {
        let own = self.own();
        // Always in index order, and a counting thread holds one shard at a time: no deadlock.
        let mut guards: Vec<_> = self.shards.iter().map(lock).collect();
        let others =
            guards
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != own)
                .fold((0, 0), |(r, t), (_, g)| {
                    let (gr, gt) = g.totals(now_ms);
                    (r + gr, t + gt)
                });
        guards[own].try_retry_with(now_ms, others)
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
