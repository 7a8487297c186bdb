//! The soak's fault schedule: which variant misbehaves how, from when to when. Pure and seeded,
//! so that a seed names one run's faults exactly.
//!
//! Per pool, fault onsets arrive as a Poisson process (mean gap [`MEAN_ONSET_GAP_MS`]); at each
//! onset a variant that is healthy at that instant is picked at random and given a random fault
//! for a random 2–8 s, unless the pool already has its share of faulted variants (at most a
//! third, at least one less than all): then the onset is skipped. So a healthy variant exists in
//! every pool at every instant, and whatever a client sees go wrong is the gateway's doing.

use keel_core::rng::{mix, Rng};
use keel_sim::{FaultKind, FaultSpec};
use serde::Serialize;

/// Mean time between fault onsets in one pool. With 2–8 s faults this keeps a pool with six
/// variants at its two-faulted limit a good part of the time, without being so dense that
/// every request meets a fault.
const MEAN_ONSET_GAP_MS: f64 = 1500.0;
const MIN_FAULT_MS: u64 = 2000;
const MAX_FAULT_MS: u64 = 8000;
/// A restart refuses connections for this share of its window, then serves cold.
const RESTART_DOWN_SHARE: f64 = 0.4;

/// What goes wrong with a variant during its window.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// Streams stop sending after `after_tokens` and never resume (the gateway must notice).
    Stall { after_tokens: u64, rate: f64 },
    /// The connection drops after `after_tokens` (the server died mid-stream).
    Die { after_tokens: u64, rate: f64 },
    /// Answers `status` (500 or 503) before the first byte.
    ErrorBurst { status: u16, rate: f64 },
    /// A 429 storm with a retry-after.
    RateLimited { retry_after_s: f64, rate: f64 },
    /// Inter-token gaps `factor` times longer.
    Slow { factor: f64 },
    /// Connections reset, then the first `cold_requests` pay `cold_extra_ms` of time to first token.
    Restart {
        cold_extra_ms: u64,
        cold_requests: u64,
    },
}

impl Fault {
    pub fn name(&self) -> &'static str {
        match self {
            Fault::Stall { .. } => "stall",
            Fault::Die { .. } => "die",
            Fault::ErrorBurst { .. } => "error_burst",
            Fault::RateLimited { .. } => "rate_limited",
            Fault::Slow { .. } => "slow",
            Fault::Restart { .. } => "restart",
        }
    }

    fn draw(rng: &mut Rng) -> Fault {
        // A share of requests rather than all: a variant that fails only sometimes is harder
        // to notice than one that fails every time.
        let rate = 0.3 + 0.7 * rng.next_f64();
        let tokens = 2 + rng.next_u64() % 11;
        match rng.next_u64() % 6 {
            0 => Fault::Stall {
                after_tokens: tokens,
                rate,
            },
            1 => Fault::Die {
                after_tokens: tokens,
                rate,
            },
            2 => Fault::ErrorBurst {
                status: if rng.next_f64() < 0.5 { 500 } else { 503 },
                rate,
            },
            3 => Fault::RateLimited {
                retry_after_s: (1 + rng.next_u64() % 3) as f64,
                rate,
            },
            4 => Fault::Slow {
                factor: 3.0 + (rng.next_u64() % 8) as f64,
            },
            _ => Fault::Restart {
                cold_extra_ms: 1000 + 500 * (rng.next_u64() % 5),
                cold_requests: 3 + rng.next_u64() % 6,
            },
        }
    }
}

/// One fault on one variant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Window {
    pub pool: usize,
    pub variant: usize,
    pub start_ms: u64,
    pub end_ms: u64,
    pub fault: Fault,
}

/// The most variants of a pool of `n` that may be faulted at once.
pub fn max_faulted(n: usize) -> usize {
    (n / 3).min(n.saturating_sub(1))
}

/// The fault windows of a run of `duration_ms` over pools of the given sizes, by start time.
pub fn generate(seed: u64, duration_ms: u64, pool_sizes: &[usize]) -> Vec<Window> {
    let mut out = Vec::new();
    for (pool, &n) in pool_sizes.iter().enumerate() {
        // One stream per pool: adding a pool does not change another pool's faults.
        let mut rng = Rng::new(mix(seed ^ mix(pool as u64 + 1)));
        let mut windows: Vec<Window> = Vec::new();
        let mut t = 0.0f64;
        loop {
            t += -MEAN_ONSET_GAP_MS * (1.0 - rng.next_f64()).ln();
            let start = t as u64;
            if start + MIN_FAULT_MS > duration_ms {
                break;
            }
            let busy: Vec<usize> = windows
                .iter()
                .filter(|w| w.end_ms > start)
                .map(|w| w.variant)
                .collect();
            if busy.len() >= max_faulted(n) {
                continue;
            }
            let free: Vec<usize> = (0..n).filter(|v| !busy.contains(v)).collect();
            let variant = free[(rng.next_u64() % free.len() as u64) as usize];
            let length = MIN_FAULT_MS + rng.next_u64() % (MAX_FAULT_MS - MIN_FAULT_MS + 1);
            windows.push(Window {
                pool,
                variant,
                start_ms: start,
                end_ms: (start + length).min(duration_ms),
                fault: Fault::draw(&mut rng),
            });
        }
        out.extend(windows);
    }
    out.sort_by_key(|w| (w.start_ms, w.pool, w.variant));
    out
}

/// A change to one variant's faults at an instant.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub at_ms: u64,
    pub pool: usize,
    pub variant: usize,
    /// The variant's faults are cleared, then these are added.
    pub faults: Vec<FaultSpec>,
}

/// The windows as fault changes to make, in time order. A window ends by clearing its
/// variant's faults (a variant has one window at a time, so this clears nothing else).
pub fn steps(windows: &[Window]) -> Vec<Step> {
    let mut out = Vec::new();
    for w in windows {
        let step = |at_ms: u64, faults: Vec<FaultSpec>| Step {
            at_ms,
            pool: w.pool,
            variant: w.variant,
            faults,
        };
        let with = |kind: FaultKind, f: &dyn Fn(&mut FaultSpec)| {
            let mut s = FaultSpec::new(kind);
            f(&mut s);
            s
        };
        match &w.fault {
            Fault::Restart {
                cold_extra_ms,
                cold_requests,
            } => {
                let up = w.start_ms + ((w.end_ms - w.start_ms) as f64 * RESTART_DOWN_SHARE) as u64;
                out.push(step(w.start_ms, vec![FaultSpec::new(FaultKind::Reset)]));
                out.push(step(
                    up,
                    vec![with(FaultKind::ColdStart, &|s| {
                        s.extra_ms = Some(*cold_extra_ms);
                        s.count = Some(*cold_requests);
                    })],
                ));
            }
            fault => {
                let spec = match *fault {
                    Fault::Stall { after_tokens, rate } => with(FaultKind::Stall, &|s| {
                        s.after_tokens = Some(after_tokens);
                        s.rate = Some(rate);
                    }),
                    Fault::Die { after_tokens, rate } => with(FaultKind::Close, &|s| {
                        s.after_tokens = Some(after_tokens);
                        s.rate = Some(rate);
                    }),
                    Fault::ErrorBurst { status, rate } => with(FaultKind::Error, &|s| {
                        s.status = Some(status);
                        s.rate = Some(rate);
                    }),
                    Fault::RateLimited {
                        retry_after_s,
                        rate,
                    } => with(FaultKind::Error, &|s| {
                        s.status = Some(429);
                        s.retry_after_s = Some(retry_after_s);
                        s.rate = Some(rate);
                    }),
                    Fault::Slow { factor } => with(FaultKind::Slowdown, &|s| {
                        s.factor = Some(factor);
                    }),
                    Fault::Restart { .. } => unreachable!("handled above"),
                };
                out.push(step(w.start_ms, vec![spec]));
            }
        }
        out.push(step(w.end_ms, Vec::new()));
    }
    // At one instant, a window's end comes before the next window's start on that variant.
    out.sort_by_key(|s| (s.at_ms, !s.faults.is_empty()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_a_third_of_a_pool_is_faulted_and_a_variant_has_one_fault_at_a_time() {
        for seed in 0..200 {
            let sizes = [6, 6, 3];
            let windows = generate(seed, 120_000, &sizes);
            assert!(!windows.is_empty());
            for w in &windows {
                assert!(w.start_ms < w.end_ms && w.end_ms <= 120_000, "{w:?}");
                // Every instant at which the count can rise is some window's start.
                let live: Vec<&Window> = windows
                    .iter()
                    .filter(|o| {
                        o.pool == w.pool && o.start_ms <= w.start_ms && o.end_ms > w.start_ms
                    })
                    .collect();
                assert!(
                    live.len() <= max_faulted(sizes[w.pool]),
                    "seed {seed}: {live:?}"
                );
                assert_eq!(
                    live.iter().filter(|o| o.variant == w.variant).count(),
                    1,
                    "seed {seed}: {live:?}"
                );
            }
        }
    }

    #[test]
    fn a_seed_names_one_schedule() {
        assert_eq!(generate(7, 60_000, &[6, 6]), generate(7, 60_000, &[6, 6]));
        assert_ne!(generate(7, 60_000, &[6, 6]), generate(8, 60_000, &[6, 6]));
        // A pool's faults do not depend on the pools after it.
        let one: Vec<Window> = generate(7, 60_000, &[6]);
        let two: Vec<Window> = generate(7, 60_000, &[6, 6])
            .into_iter()
            .filter(|w| w.pool == 0)
            .collect();
        assert_eq!(one, two);
    }

    #[test]
    fn every_kind_occurs_and_each_window_ends_cleared() {
        let windows = generate(1, 600_000, &[6]);
        for kind in [
            "stall",
            "die",
            "error_burst",
            "rate_limited",
            "slow",
            "restart",
        ] {
            assert!(windows.iter().any(|w| w.fault.name() == kind), "{kind}");
        }
        let steps = steps(&windows);
        for w in &windows {
            let at = |s: &Step| s.pool == w.pool && s.variant == w.variant && s.at_ms == w.end_ms;
            let end = steps.iter().position(|s| at(s) && s.faults.is_empty());
            let next_start = steps.iter().position(|s| at(s) && !s.faults.is_empty());
            assert!(end.is_some(), "{w:?}");
            assert!(next_start.is_none_or(|n| n > end.unwrap()), "{w:?}");
        }
        assert!(steps.windows(2).all(|p| p[0].at_ms <= p[1].at_ms));
    }

    #[test]
    fn pools_too_small_to_spare_a_variant_get_no_faults() {
        assert_eq!(max_faulted(1), 0);
        assert_eq!(max_faulted(2), 0);
        assert_eq!(max_faulted(3), 1);
        assert!(generate(3, 60_000, &[2]).is_empty());
    }
}
