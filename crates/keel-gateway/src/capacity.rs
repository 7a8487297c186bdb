//! Capacity: how many requests each variant can take at once, and the pool's wait line for
//! when every variant is full.
//!
//! **Learned limits (AIMD).** A model server that is full answers 429 (vLLM behind a queue
//! limit, llama.cpp with `--parallel`, hosted APIs). A 429 while other requests of ours are
//! running on that variant says "full at this concurrency": the variant's limit drops to what
//! it was running minus one, and nothing else changes. Cooling the whole variant down for the
//! advertised retry-after instead (what a generic proxy does) leaves a saturated fleet idle
//! while every variant waits out its cooldown, which is how admitted throughput falls below
//! capacity under overload. A 429 to a lone request, or one asking to wait more than 2 s, is a
//! quota, not a capacity, and is honoured as a cooldown (see `execution`). After `limit` successes in a row the limit grows by one
//! (additive increase), so a transient never caps a variant for good.
//!
//! **The wait line.** When every variant is at its limit, a request waits, first come first
//! served, for a slot to be freed, up to the pool's `queue_ms` (and its own deadline). If the
//! line is already longer than that can drain, it is refused at once with a Retry-After equal
//! to the expected wait for its place: the line drains at (requests running) / (mean time a
//! request holds its slot), both measured.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tokio::sync::Notify;

/// A variant's learned concurrency limit (`u32::MAX`: none learned yet).
#[derive(Debug)]
pub struct Limit {
    limit: AtomicU32,
    /// Successes since the limit last changed.
    streak: AtomicU32,
}

impl Default for Limit {
    fn default() -> Self {
        Limit {
            limit: AtomicU32::new(u32::MAX),
            streak: AtomicU32::new(0),
        }
    }
}

impl Limit {
    pub fn get(&self) -> u32 {
        self.limit.load(Ordering::Relaxed)
    }

    /// A 429 arrived while `running` requests (this one included) were on the variant.
    pub fn full_at(&self, running: u32) {
        let new = running.saturating_sub(1).max(1);
        self.limit.fetch_min(new, Ordering::Relaxed);
        self.streak.store(0, Ordering::Relaxed);
    }

    /// One success: after `limit` of them in a row, the limit grows by one.
    pub fn success(&self) {
        let limit = self.get();
        if limit == u32::MAX {
            return;
        }
        if self.streak.fetch_add(1, Ordering::Relaxed) + 1 >= limit {
            self.streak.store(0, Ordering::Relaxed);
            let _ =
                self.limit
                    .compare_exchange(limit, limit + 1, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

/// The pool's line of requests waiting for a slot.
#[derive(Debug, Default)]
pub struct WaitLine {
    /// Signalled once per freed slot; waiters are woken in the order they started waiting.
    freed: Notify,
    waiting: AtomicU32,
    /// EWMA of how long a request holds its slot, in µs (f64 bits; 0 before any).
    hold_us: AtomicU64,
}

/// Weight of the newest sample in the slot-holding time average.
const HOLD_ALPHA: f64 = 0.05;

impl WaitLine {
    /// A slot was freed, after serving a request for `held_us` (`None`: it served none).
    pub fn freed(&self, held_us: Option<f64>) {
        if let Some(held_us) = held_us {
            self.hold(held_us);
        }
        self.freed.notify_one();
    }

    fn hold(&self, held_us: f64) {
        let old = f64::from_bits(self.hold_us.load(Ordering::Relaxed));
        let new = if old == 0.0 {
            held_us
        } else {
            old + HOLD_ALPHA * (held_us - old)
        };
        self.hold_us.store(new.to_bits(), Ordering::Relaxed);
    }

    pub fn waiting(&self) -> u32 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Expected wait (ms) for a request joining the line behind `ahead` others, when
    /// `running` requests hold the pool's slots. `None` before any slot was ever freed.
    pub fn expected_wait_ms(&self, ahead: u32, running: u32) -> Option<u64> {
        let hold_ms = f64::from_bits(self.hold_us.load(Ordering::Relaxed)) / 1000.0;
        (hold_ms > 0.0)
            .then(|| ((ahead as f64 + 1.0) * hold_ms / running.max(1) as f64).ceil() as u64)
    }

    /// Joins the line; the ticket leaves it when dropped.
    pub fn join(&self) -> Ticket<'_> {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        Ticket { line: self }
    }
}

/// A place in the wait line.
pub struct Ticket<'a> {
    line: &'a WaitLine,
}

impl Ticket<'_> {
    /// Waits for the next freed slot.
    pub async fn slot_freed(&self) {
        self.line.freed.notified().await;
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.line.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_429_lowers_the_limit_and_successes_raise_it_again() {
        let l = Limit::default();
        l.success();
        assert_eq!(l.get(), u32::MAX);
        l.full_at(7);
        assert_eq!(l.get(), 6);
        // A later 429 at a higher count cannot raise it.
        l.full_at(9);
        assert_eq!(l.get(), 6);
        for _ in 0..5 {
            l.success();
        }
        assert_eq!(l.get(), 6);
        l.success();
        assert_eq!(l.get(), 7);
        // A lone request refused: the floor is one.
        l.full_at(1);
        assert_eq!(l.get(), 1);
    }

    #[test]
    fn expected_wait_follows_littles_law() {
        let line = WaitLine::default();
        assert_eq!(line.expected_wait_ms(0, 4), None);
        line.freed(None);
        assert_eq!(line.expected_wait_ms(0, 4), None);
        line.freed(Some(800_000.0));
        // 8 slots held 800 ms each free one every 100 ms: the 3rd in line waits 300 ms.
        assert_eq!(line.expected_wait_ms(2, 8), Some(300));
        let t = line.join();
        let u = line.join();
        assert_eq!(line.waiting(), 2);
        drop(t);
        drop(u);
        assert_eq!(line.waiting(), 0);
    }
}
