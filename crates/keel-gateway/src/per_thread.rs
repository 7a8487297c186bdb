//! State that every request updates, split per runtime thread so that the update takes no
//! shared lock: each thread writes its own shard (its lock is uncontended), and the rare reader
//! that needs the whole (a budget's decision, the monitor's judgement of a pool's colour) locks
//! every shard in index order and combines them. Used by the retry budget, the hedge and probe
//! budgets (`retry_budget`), the safe-mode signal window (`safe_mode`) and the idle upstream
//! connections (`upstream::direct`).

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// One `T` per thread (threads share shards round-robin beyond the number of cores).
#[derive(Debug)]
pub struct PerThread<T> {
    shards: Box<[Mutex<T>]>,
}

/// Threads are numbered as they first touch a shard, and use shard `number % shards`.
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each shard is plain data updated in one step; a poisoned lock still holds valid data.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T> PerThread<T> {
    /// One shard per available core (the runtime's default thread count).
    pub fn new(make: impl Fn() -> T) -> Self {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_shards(n, make)
    }

    pub fn with_shards(n: usize, make: impl Fn() -> T) -> Self {
        PerThread {
            shards: (0..n.max(1)).map(|_| Mutex::new(make())).collect(),
        }
    }

    /// The calling thread's shard's index.
    pub fn own_index(&self) -> usize {
        thread_number() % self.shards.len()
    }

    /// The calling thread's shard.
    pub fn own(&self) -> MutexGuard<'_, T> {
        lock(&self.shards[self.own_index()])
    }

    /// How many shards there are.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// Shard `i` (`i < shards()`), waiting for it.
    pub fn shard(&self, i: usize) -> MutexGuard<'_, T> {
        lock(&self.shards[i])
    }

    /// Shard `i`, unless another thread holds it at the moment.
    pub fn try_shard(&self, i: usize) -> Option<MutexGuard<'_, T>> {
        match self.shards[i].try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Every shard, locked in index order (a thread holds at most its own shard otherwise, so
    /// this cannot deadlock).
    pub fn all(&self) -> Vec<MutexGuard<'_, T>> {
        self.shards.iter().map(lock).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each thread counts into its own shard; all of them together hold every count.
    #[test]
    fn threads_write_their_own_shard_and_the_total_is_whole() {
        let counts = PerThread::with_shards(3, || 0u64);
        std::thread::scope(|s| {
            for _ in 0..6 {
                s.spawn(|| {
                    let mine = counts.own_index();
                    for _ in 0..1_000 {
                        *counts.own() += 1;
                    }
                    assert_eq!(counts.own_index(), mine, "a thread keeps its shard");
                });
            }
        });
        let all = counts.all();
        assert_eq!(all.len(), 3);
        assert_eq!(all.iter().map(|c| **c).sum::<u64>(), 6_000);
    }
}
