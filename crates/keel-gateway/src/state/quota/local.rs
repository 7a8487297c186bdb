//! Quota state in this process's memory (one replica). The clock is the process's monotonic
//! clock for rates and the wall clock for budgets, read here so the arithmetic in
//! `keel_core::quota` stays pure.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use keel_core::quota::budget::{Account, Exhausted};
use keel_core::quota::gcra::{self, Decision, Rate};

use super::{BudgetSpec, Held, Limit, Usage};

#[derive(Default)]
struct State {
    tats: HashMap<(String, Limit), u64>,
    accounts: HashMap<(String, BudgetSpec), Account>,
    in_flight: HashMap<String, u64>,
    next_token: u64,
}

/// In-memory quota state.
pub struct Local {
    origin: Instant,
    state: Mutex<State>,
}

impl Default for Local {
    fn default() -> Self {
        Local {
            origin: Instant::now(),
            state: Mutex::new(State::default()),
        }
    }
}

impl Local {
    fn now_ns(&self) -> u64 {
        // Offset by a period so that a fresh key (state 0) is never "in the future".
        self.origin.elapsed().as_nanos() as u64 + 3_600_000_000_000
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn take(&self, key: &str, limit: Limit, rate: Rate, cost: u64) -> Decision {
        let now = self.now_ns();
        let mut s = self.lock();
        let tat = s.tats.entry((key.to_owned(), limit)).or_insert(0);
        let d = gcra::check(rate, *tat, now, cost);
        if let Decision::Allowed { tat: t, .. } = d {
            *tat = t;
        }
        d
    }

    pub fn adjust(&self, key: &str, limit: Limit, rate: Rate, delta: i64) {
        let now = self.now_ns();
        let mut s = self.lock();
        let tat = s.tats.entry((key.to_owned(), limit)).or_insert(0);
        *tat = if delta >= 0 {
            gcra::charge(rate, *tat, now, delta as u64)
        } else {
            gcra::refund(rate, *tat, delta.unsigned_abs())
        };
    }

    pub fn reserve(
        &self,
        key: &str,
        budget: BudgetSpec,
        now_unix: u64,
        amount: u64,
    ) -> Result<(), Exhausted> {
        let mut s = self.lock();
        s.accounts
            .entry((key.to_owned(), budget))
            .or_default()
            .reserve(budget.limit, budget.window, now_unix, amount)
    }

    pub fn settle(&self, key: &str, budget: BudgetSpec, now_unix: u64, reserved: u64, actual: u64) {
        let mut s = self.lock();
        s.accounts
            .entry((key.to_owned(), budget))
            .or_default()
            .settle(budget.window, now_unix, reserved, actual);
    }

    /// In one process a slot cannot be orphaned by a crash, so `ttl` does not apply.
    pub fn acquire(&self, key: &str, max: u64, _ttl: Duration) -> Option<Held> {
        let mut s = self.lock();
        let n = s.in_flight.entry(key.to_owned()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        s.next_token += 1;
        Some(Held {
            key: key.to_owned(),
            token: s.next_token.to_string(),
        })
    }

    pub fn release(&self, held: &Held) {
        let mut s = self.lock();
        if let Some(n) = s.in_flight.get_mut(&held.key) {
            *n = n.saturating_sub(1);
        }
    }

    pub fn usage(
        &self,
        key: &str,
        rates: &[(Limit, Rate)],
        budgets: &[BudgetSpec],
        now_unix: u64,
    ) -> Usage {
        let now = self.now_ns();
        let s = self.lock();
        let rates = rates
            .iter()
            .map(|&(limit, rate)| {
                let tat = s.tats.get(&(key.to_owned(), limit)).copied().unwrap_or(0);
                let (remaining, reset) = gcra::peek(rate, tat, now);
                (limit, remaining, reset)
            })
            .collect();
        let budgets = budgets
            .iter()
            .map(|&b| {
                let a = s
                    .accounts
                    .get(&(key.to_owned(), b))
                    .copied()
                    .unwrap_or_default();
                let remaining = a.remaining(b.limit, b.window, now_unix);
                (b, b.limit - remaining, remaining)
            })
            .collect();
        Usage {
            rates,
            budgets,
            in_flight: s.in_flight.get(key).copied().unwrap_or(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::quota::budget::Window;

    #[test]
    fn slots_rates_and_budgets_in_memory() {
        let l = Local::default();
        let a = l.acquire("k", 2, Duration::from_secs(1)).unwrap();
        let _b = l.acquire("k", 2, Duration::from_secs(1)).unwrap();
        assert!(l.acquire("k", 2, Duration::from_secs(1)).is_none());
        l.release(&a);
        assert!(l.acquire("k", 2, Duration::from_secs(1)).is_some());

        let rpm = Rate::per_minute(2);
        assert!(matches!(
            l.take("k", Limit::Requests, rpm, 1),
            Decision::Allowed { .. }
        ));
        assert!(matches!(
            l.take("k", Limit::Requests, rpm, 1),
            Decision::Allowed { .. }
        ));
        assert!(matches!(
            l.take("k", Limit::Requests, rpm, 1),
            Decision::Denied { .. }
        ));
        assert!(matches!(
            l.take("other", Limit::Requests, rpm, 1),
            Decision::Allowed { .. }
        ));

        let b = BudgetSpec {
            unit: super::super::BudgetUnit::Tokens,
            window: Window::Day,
            limit: 100,
        };
        assert!(l.reserve("k", b, 1_000_000, 80).is_ok());
        assert!(l.reserve("k", b, 1_000_000, 30).is_err());
        l.settle("k", b, 1_000_000, 80, 10);
        let u = l.usage("k", &[(Limit::Requests, rpm)], &[b], 1_000_000);
        assert_eq!(u.budgets, vec![(b, 10, 90)]);
        assert_eq!(u.rates[0].1, 0);
        assert_eq!(u.in_flight, 2);
    }
}
