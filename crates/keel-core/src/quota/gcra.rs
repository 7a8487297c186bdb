//! GCRA, the generic cell rate algorithm: a rate limit kept as one number per key.
//!
//! A limit of `limit` units per `period` admits one unit every `T = period / limit` on average
//! and at most `limit` at once. The state is the *theoretical arrival time* `tat`: the instant
//! at which the key would be back to a full allowance. A request of `cost` units at `now` moves
//! it to `max(tat, now) + cost·T` and is admitted when that is at most `now + period`; otherwise
//! it is refused, and the exact wait is `new_tat − period − now`. Because the state is a single
//! timestamp, the same arithmetic runs in a Redis script for limits shared by replicas.
//!
//! Times are nanoseconds on any monotonic origin (passed in); state is a plain `u64`, so a
//! caller may keep it in memory, in an atomic, or in Redis.

/// A rate: `limit` units per `period_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub limit: u64,
    pub period_ns: u64,
}

impl Rate {
    /// `limit` units per minute (`rpm`, `tpm`).
    pub fn per_minute(limit: u64) -> Self {
        Rate {
            limit,
            period_ns: 60_000_000_000,
        }
    }

    /// Nanoseconds per unit (at least 1: a limit above one per nanosecond is no limit here).
    pub fn interval_ns(self) -> u64 {
        (self.period_ns / self.limit.max(1)).max(1)
    }
}

/// What a check decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Admitted: store `tat`.
    Allowed {
        tat: u64,
        /// Units still admissible at once after this one.
        remaining: u64,
        /// Until the allowance is full again.
        reset_after_ns: u64,
    },
    /// Refused: state unchanged.
    Denied {
        /// The exact time until `cost` units would be admitted.
        retry_after_ns: u64,
        /// Until the allowance is full again.
        reset_after_ns: u64,
    },
}

/// Checks and, when admitted, takes `cost` units at `now` from a key whose state is `tat` (0
/// for a key never seen). A cost above the whole limit can never be admitted: it is refused
/// with the wait for a full allowance, and the caller should say why (see [`Rate::limit`]).
pub fn check(rate: Rate, tat: u64, now: u64, cost: u64) -> Decision {
    let t = rate.interval_ns();
    let base = tat.max(now);
    let new_tat = base.saturating_add(cost.saturating_mul(t));
    let allow_at = new_tat.saturating_sub(rate.period_ns);
    if allow_at > now {
        return Decision::Denied {
            retry_after_ns: allow_at - now,
            reset_after_ns: base - now,
        };
    }
    let reset_after_ns = new_tat - now;
    Decision::Allowed {
        tat: new_tat,
        remaining: (rate.period_ns - reset_after_ns) / t,
        reset_after_ns,
    }
}

/// Gives back `units` taken earlier (a reservation larger than what was used). The allowance
/// never grows beyond full: `max(tat, now)` in [`check`] takes care of that.
pub fn refund(rate: Rate, tat: u64, units: u64) -> u64 {
    tat.saturating_sub(units.saturating_mul(rate.interval_ns()))
}

/// Takes `units` beyond a reservation (the answer used more than reserved), even past the
/// limit: the key then waits longer before its next request.
pub fn charge(rate: Rate, tat: u64, now: u64, units: u64) -> u64 {
    tat.max(now)
        .saturating_add(units.saturating_mul(rate.interval_ns()))
}

/// What the key has left at `now` without taking anything: (remaining, reset_after_ns).
pub fn peek(rate: Rate, tat: u64, now: u64) -> (u64, u64) {
    let reset = tat.saturating_sub(now);
    let remaining = rate.period_ns.saturating_sub(reset) / rate.interval_ns();
    (remaining.min(rate.limit), reset)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn allowed(d: Decision) -> u64 {
        match d {
            Decision::Allowed { tat, .. } => tat,
            Decision::Denied { retry_after_ns, .. } => {
                panic!("refused, retry after {retry_after_ns} ns")
            }
        }
    }

    #[test]
    fn a_burst_of_the_whole_limit_then_one_per_interval() {
        let rate = Rate::per_minute(60); // one a second
        let now = 1_000_000 * MS;
        let mut tat = 0;
        for i in 0..60 {
            match check(rate, tat, now, 1) {
                Decision::Allowed {
                    tat: t, remaining, ..
                } => {
                    tat = t;
                    assert_eq!(remaining, 59 - i);
                }
                d => panic!("request {i}: {d:?}"),
            }
        }
        // The 61st waits exactly one interval.
        assert_eq!(
            check(rate, tat, now, 1),
            Decision::Denied {
                retry_after_ns: 1000 * MS,
                reset_after_ns: 60_000 * MS
            }
        );
        // 1 ns early is still too early; on time is admitted.
        assert!(matches!(
            check(rate, tat, now + 1000 * MS - 1, 1),
            Decision::Denied {
                retry_after_ns: 1,
                ..
            }
        ));
        tat = allowed(check(rate, tat, now + 1000 * MS, 1));
        // Steady rate: one per second is admitted forever, a second one in the same second not.
        for s in 2..100u64 {
            let t = now + s * 1000 * MS;
            tat = allowed(check(rate, tat, t, 1));
            assert!(matches!(check(rate, tat, t, 1), Decision::Denied { .. }));
        }
    }

    #[test]
    fn retry_after_is_the_true_time_until_admission() {
        // Walk a key through random-ish arrivals; whenever it is refused, it must be refused a
        // nanosecond before `retry_after` and admitted exactly at it.
        let rate = Rate {
            limit: 7,
            period_ns: 3_000 * MS,
        };
        let mut tat = 0;
        let mut now = 5 * MS;
        for i in 0..500u64 {
            now += (i * 7919) % (900 * MS);
            let cost = 1 + i % 3;
            match check(rate, tat, now, cost) {
                Decision::Allowed { tat: t, .. } => tat = t,
                Decision::Denied { retry_after_ns, .. } => {
                    let at = now + retry_after_ns;
                    assert!(matches!(
                        check(rate, tat, at - 1, cost),
                        Decision::Denied { .. }
                    ));
                    tat = allowed(check(rate, tat, at, cost));
                    now = at;
                }
            }
        }
    }

    #[test]
    fn tokens_reserved_then_reconciled() {
        let tpm = Rate::per_minute(10_000);
        let now = 10 * MS;
        // Reserve 8,000 (prompt + max_tokens); 2,000 left at once.
        let tat = allowed(check(tpm, 0, now, 8_000));
        assert!(matches!(
            check(tpm, tat, now, 2_001),
            Decision::Denied { .. }
        ));
        // The answer used 3,000: 5,000 come back.
        let tat = refund(tpm, tat, 5_000);
        assert_eq!(peek(tpm, tat, now).0, 7_000);
        assert!(matches!(
            check(tpm, tat, now, 7_000),
            Decision::Allowed { .. }
        ));
        // A refund never makes more than a full allowance.
        let tat = refund(tpm, tat, 1_000_000);
        assert_eq!(peek(tpm, tat, now).0, 10_000);
        // Used more than reserved: the excess is charged even past the limit.
        let tat = allowed(check(tpm, 0, now, 9_000));
        let tat = charge(tpm, tat, now, 4_000);
        match check(tpm, tat, now, 1) {
            Decision::Denied { retry_after_ns, .. } => assert_eq!(retry_after_ns, 3_001 * 6 * MS),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn a_cost_above_the_limit_is_never_admitted() {
        let rate = Rate::per_minute(100);
        assert!(matches!(check(rate, 0, 0, 101), Decision::Denied { .. }));
        assert!(matches!(
            check(rate, 0, 0, 100),
            Decision::Allowed { remaining: 0, .. }
        ));
    }
}
