//! The fleet-wide retry budget: retries may be at most `ratio` of requests over a sliding
//! window, plus a small floor, so that when every variant is slow, retries cannot multiply the
//! load (the retry storm). This is the scheme Finagle and Linkerd use; keel's defaults are 20%
//! over 10 s with a floor of 10 retries per second, which keeps a quiet service fully retryable
//! while capping a busy one.
//!
//! Time is passed in (`now_ms`, any monotonic origin), so behaviour is exact under test.

/// Budget parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryBudgetConfig {
    pub ratio: f64,
    pub window_ms: u64,
    pub min_retries_per_sec: u64,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        RetryBudgetConfig {
            ratio: 0.2,
            window_ms: 10_000,
            min_retries_per_sec: 10,
        }
    }
}

const BUCKETS: usize = 10;

/// Sliding-window counts of requests and retries, in `BUCKETS` slices of the window.
#[derive(Debug, Clone)]
pub struct RetryBudget {
    cfg: RetryBudgetConfig,
    slice_ms: u64,
    /// (slice number, requests, retries) per bucket.
    buckets: [(u64, u64, u64); BUCKETS],
}

impl RetryBudget {
    pub fn new(cfg: RetryBudgetConfig) -> Self {
        let slice_ms = (cfg.window_ms / BUCKETS as u64).max(1);
        RetryBudget {
            cfg,
            slice_ms,
            buckets: [(u64::MAX, 0, 0); BUCKETS],
        }
    }

    fn bucket(&mut self, now_ms: u64) -> &mut (u64, u64, u64) {
        let slice = now_ms / self.slice_ms;
        let b = &mut self.buckets[(slice % BUCKETS as u64) as usize];
        if b.0 != slice {
            *b = (slice, 0, 0);
        }
        b
    }

    /// Requests and retries counted in the window that ends at `now_ms`.
    pub fn totals(&self, now_ms: u64) -> (u64, u64) {
        let slice = now_ms / self.slice_ms;
        self.buckets
            .iter()
            .filter(|b| b.0 != u64::MAX && b.0 + BUCKETS as u64 > slice && b.0 <= slice)
            .fold((0, 0), |(r, t), b| (r + b.1, t + b.2))
    }

    /// Counts one client request.
    pub fn record_request(&mut self, now_ms: u64) {
        self.bucket(now_ms).1 += 1;
    }

    /// Asks for one retry; true (and counted) when the budget allows it.
    pub fn try_retry(&mut self, now_ms: u64) -> bool {
        self.try_retry_keeping(now_ms, (0, 0), 0.0)
    }

    /// [`RetryBudget::try_retry`] for one part of a budget split into parts (one per thread),
    /// for a retry that may not spend the last `reserve` of the budget's share of requests (0–1;
    /// the floor is never reserved): what is kept is there for retries the caller values more,
    /// which ask with a smaller reserve. `others` are the other parts' [`RetryBudget::totals`]
    /// (`(0, 0)` for a budget in one part); a granted retry is counted here. The parts together
    /// decide exactly as one budget would.
    pub fn try_retry_keeping(&mut self, now_ms: u64, others: (u64, u64), reserve: f64) -> bool {
        let (requests, retries) = self.totals(now_ms);
        let (requests, retries) = (requests + others.0, retries + others.1);
        let floor = self.cfg.min_retries_per_sec * self.cfg.window_ms / 1000;
        let share = requests as f64 * self.cfg.ratio * (1.0 - reserve.clamp(0.0, 1.0));
        // Rounded up, so that a quiet pool may retry (or hedge) its first request.
        let allowed = share.ceil() as u64 + floor;
        if retries < allowed {
            self.bucket(now_ms).2 += 1;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_then_ratio() {
        let cfg = RetryBudgetConfig {
            ratio: 0.2,
            window_ms: 10_000,
            min_retries_per_sec: 1,
        };
        let mut b = RetryBudget::new(cfg);
        // Floor: 10 retries in the window with no traffic at all.
        for _ in 0..10 {
            assert!(b.try_retry(0));
        }
        assert!(!b.try_retry(0));
        // 100 requests allow 20 more.
        for _ in 0..100 {
            b.record_request(500);
        }
        let granted = (0..50).filter(|_| b.try_retry(600)).count();
        assert_eq!(granted, 20);
    }

    /// A retry asked with a reserve stops where the reserve begins; one asked without it may
    /// still spend the rest.
    #[test]
    fn a_reserve_is_left_to_retries_asked_without_it() {
        let cfg = RetryBudgetConfig {
            ratio: 0.1,
            window_ms: 10_000,
            min_retries_per_sec: 0,
        };
        let mut b = RetryBudget::new(cfg);
        for _ in 0..200 {
            b.record_request(0);
        }
        let kept = (0..40)
            .filter(|_| b.try_retry_keeping(100, (0, 0), 0.25))
            .count();
        assert_eq!(kept, 15, "three quarters of 20");
        let rest = (0..40).filter(|_| b.try_retry(100)).count();
        assert_eq!(rest, 5);
    }

    #[test]
    fn window_slides() {
        let cfg = RetryBudgetConfig {
            ratio: 0.0,
            window_ms: 10_000,
            min_retries_per_sec: 1,
        };
        let mut b = RetryBudget::new(cfg);
        for _ in 0..10 {
            assert!(b.try_retry(0));
        }
        assert!(!b.try_retry(9_999));
        // After the window has passed, the old retries no longer count.
        assert!(b.try_retry(10_000));
    }
}
