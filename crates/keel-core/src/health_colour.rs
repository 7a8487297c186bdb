//! A pool's health colour (green, yellow, red) from what its recent requests saw, and the
//! hysteresis of the safe mode a red pool enters.
//!
//! Pure: the gateway counts requests into a [`SignalWindow`] (a sliding window of time
//! buckets), passes the window's [`Counters`] and the pool's eligible capacity to [`evaluate`],
//! and feeds the colour to a [`SafeMode`] with the time. Five signals, each with a yellow and a
//! red threshold ([`Thresholds`]):
//!
//! | signal | value | worse when |
//! |---|---|---|
//! | fallback ratio | requests answered by a fallback / requests | higher |
//! | migration ratio | requests migrated mid-stream / requests | higher |
//! | decision latency | mean selection time per selection, ms | higher |
//! | error rate | requests ending in a client-visible 5xx (or stream error event) / requests | higher |
//! | eligible capacity | configured weight of variants able to serve / all configured weight | lower |
//!
//! The ratios are judged only once the window holds `min_requests` requests (one failed request
//! of two is no evidence about a pool), decision latency once it holds as many selections;
//! capacity is judged always. A ratio is judged by what its requests show with confidence: the
//! lower end of its one-sided 95% Wilson interval ([`at_least`]). Four migrated streams among a
//! window's first 20 requests are a ratio of 0.2, which 20 requests cannot tell from 0.09: judged
//! as the ratio itself, that sample turned a pool red, and its safe mode then ended the next
//! streams whose upstream failed with an error instead of migrating them (`keel bench soak`,
//! bench/history/2026-12-02-overhead-stops-12-18.md). The colour is the worst of the signals', and every signal at yellow or red
//! gives one reason naming its value, the bound it was judged on, and the threshold crossed.

use serde::Serialize;

/// A health colour, ordered from best to worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Colour {
    Green,
    Yellow,
    Red,
}

impl Colour {
    pub fn as_str(self) -> &'static str {
        match self {
            Colour::Green => "green",
            Colour::Yellow => "yellow",
            Colour::Red => "red",
        }
    }

    /// The gauge value: 0 green, 1 yellow, 2 red.
    pub fn code(self) -> u8 {
        self as u8
    }
}

/// One signal's thresholds: the value at which it turns yellow, and red.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub yellow: f64,
    pub red: f64,
}

impl Limits {
    /// The colour of `value` for a signal that is worse when higher (`value >= yellow` is
    /// yellow).
    fn above(self, value: f64) -> Colour {
        if value >= self.red {
            Colour::Red
        } else if value >= self.yellow {
            Colour::Yellow
        } else {
            Colour::Green
        }
    }

    /// The colour of `value` for a signal that is worse when lower (`value <= yellow` is
    /// yellow).
    fn below(self, value: f64) -> Colour {
        if value <= self.red {
            Colour::Red
        } else if value <= self.yellow {
            Colour::Yellow
        } else {
            Colour::Green
        }
    }

    /// The threshold a colour was reached at.
    fn at(self, colour: Colour) -> f64 {
        if colour == Colour::Red {
            self.red
        } else {
            self.yellow
        }
    }
}

/// The thresholds of a pool's colour, the window they are judged over, and safe mode's
/// settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// The sliding window the counters cover.
    pub window_ms: u64,
    /// Ratios are judged only over at least this many requests.
    pub min_requests: u64,
    pub fallback_ratio: Limits,
    pub migration_ratio: Limits,
    /// Mean selection time, milliseconds.
    pub decision_ms: Limits,
    pub error_rate: Limits,
    /// Share of configured weight able to serve (lower is worse).
    pub eligible_capacity: Limits,
    /// Enter safe mode by itself when red.
    pub auto: bool,
    /// Leave automatic safe mode once the colour has been green this long.
    pub exit_after_ms: u64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            window_ms: 60_000,
            min_requests: 20,
            fallback_ratio: Limits {
                yellow: 0.10,
                red: 0.30,
            },
            migration_ratio: Limits {
                yellow: 0.05,
                red: 0.20,
            },
            decision_ms: Limits {
                yellow: 2.0,
                red: 10.0,
            },
            error_rate: Limits {
                yellow: 0.05,
                red: 0.25,
            },
            // A two-variant pool with one down is yellow; three with two down are red.
            eligible_capacity: Limits {
                yellow: 0.75,
                red: 0.35,
            },
            auto: true,
            exit_after_ms: 30_000,
        }
    }
}

/// What a window's requests saw.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    pub requests: u64,
    /// Requests answered after the first variant failed (route `fallback`).
    pub fallbacks: u64,
    /// Requests whose stream was migrated to another variant.
    pub migrations: u64,
    /// Requests that ended in a client-visible failure (5xx, or a stream's error event).
    pub errors: u64,
    /// Selection passes, and their total time in microseconds.
    pub decisions: u64,
    pub decision_us: u64,
}

impl Counters {
    /// Adds another window's counts (the shards of one window, see keel-gateway's `per_thread`).
    pub fn add(&mut self, o: &Counters) {
        self.requests += o.requests;
        self.fallbacks += o.fallbacks;
        self.migrations += o.migrations;
        self.errors += o.errors;
        self.decisions += o.decisions;
        self.decision_us += o.decision_us;
    }

    fn ratio(&self, n: u64) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            n as f64 / self.requests as f64
        }
    }

    pub fn fallback_ratio(&self) -> f64 {
        self.ratio(self.fallbacks)
    }

    pub fn migration_ratio(&self) -> f64 {
        self.ratio(self.migrations)
    }

    pub fn error_rate(&self) -> f64 {
        self.ratio(self.errors)
    }

    /// Mean selection time in milliseconds (0 without selections).
    pub fn decision_ms(&self) -> f64 {
        if self.decisions == 0 {
            0.0
        } else {
            self.decision_us as f64 / self.decisions as f64 / 1000.0
        }
    }
}

/// A colour and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    pub colour: Colour,
    /// One line per signal at yellow or red, worst first.
    pub reasons: Vec<String>,
}

/// The colour of a pool whose window holds `c` and whose eligible capacity (0–1) is
/// `capacity`.
pub fn evaluate(c: &Counters, capacity: f64, t: &Thresholds) -> Verdict {
    let mut judged: Vec<(Colour, String)> = Vec::new();
    // `value` is what the reason shows; a ratio is compared by its confident lower `bound`,
    // any other signal by its value.
    let mut judge = |name: &str,
                     value: f64,
                     bound: Option<f64>,
                     limits: Limits,
                     higher_is_worse: bool,
                     unit: &str| {
        let judged_on = bound.unwrap_or(value);
        let colour = if higher_is_worse {
            limits.above(judged_on)
        } else {
            limits.below(judged_on)
        };
        if colour != Colour::Green {
            let cmp = if higher_is_worse { ">=" } else { "<=" };
            let bound = bound
                .map(|b| format!(" (at least {} with 95% confidence)", fmt(b)))
                .unwrap_or_default();
            judged.push((
                colour,
                format!(
                    "{name} {}{bound} {cmp} {} threshold {}{unit}",
                    fmt(value),
                    colour.as_str(),
                    fmt(limits.at(colour))
                ),
            ));
        }
    };
    if c.requests >= t.min_requests && c.requests > 0 {
        let over = format!(" (over {} requests)", c.requests);
        for (name, k, limits) in [
            ("fallback ratio", c.fallbacks, t.fallback_ratio),
            ("migration ratio", c.migrations, t.migration_ratio),
            ("error rate", c.errors, t.error_rate),
        ] {
            let bound = Some(at_least(k, c.requests));
            judge(name, c.ratio(k), bound, limits, true, &over);
        }
    }
    // Also judged over enough samples only: one selection preempted on a busy machine is not
    // a slow selector.
    if c.decisions >= t.min_requests && c.decisions > 0 {
        judge(
            "decision latency",
            c.decision_ms(),
            None,
            t.decision_ms,
            true,
            " ms (mean selection time)",
        );
    }
    judge(
        "eligible capacity",
        capacity,
        None,
        t.eligible_capacity,
        false,
        " (share of configured weight able to serve)",
    );
    // Worst first; the order of the signals above among equals.
    judged.sort_by_key(|j| std::cmp::Reverse(j.0));
    Verdict {
        colour: judged.first().map_or(Colour::Green, |(c, _)| *c),
        reasons: judged.into_iter().map(|(_, r)| r).collect(),
    }
}

/// The one-sided 95% normal quantile of [`at_least`].
const CONFIDENCE_Z: f64 = 1.645;

/// The ratio `k / n` is at least this with 95% confidence: the lower end of its one-sided Wilson
/// score interval (which, unlike the normal approximation, stays within 0–1 and is sound for
/// small `n` and ratios near 0 or 1). 0 when `n` is 0.
pub fn at_least(k: u64, n: u64) -> f64 {
    if n == 0 {
        return 0.0;
    }
    let (k, n) = (k.min(n) as f64, n as f64);
    let p = k / n;
    let z2 = CONFIDENCE_Z * CONFIDENCE_Z;
    let centre = p + z2 / (2.0 * n);
    let spread = CONFIDENCE_Z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    ((centre - spread) / (1.0 + z2 / n)).max(0.0)
}

/// A number as a reason shows it: at most three decimals, no trailing zeros.
fn fmt(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_owned()
}

/// Buckets in a window: its resolution is `window_ms / BUCKETS`.
pub const BUCKETS: u64 = 20;

/// Counters over the last `window_ms`, in [`BUCKETS`] time buckets: a bucket older than the
/// window is cleared when its slot comes round again, so the totals age out smoothly.
#[derive(Debug, Clone)]
pub struct SignalWindow {
    bucket_ms: u64,
    /// Per slot: the bucket's index in time (`now_ms / bucket_ms`) and its counters.
    slots: Vec<(u64, Counters)>,
}

impl SignalWindow {
    pub fn new(window_ms: u64) -> Self {
        SignalWindow {
            bucket_ms: (window_ms / BUCKETS).max(1),
            slots: vec![(u64::MAX, Counters::default()); BUCKETS as usize],
        }
    }

    /// The counters of the bucket for `now_ms`, cleared if its slot held an older one.
    pub fn at(&mut self, now_ms: u64) -> &mut Counters {
        let index = now_ms / self.bucket_ms;
        let slot = &mut self.slots[(index % BUCKETS) as usize];
        if slot.0 != index {
            *slot = (index, Counters::default());
        }
        &mut slot.1
    }

    /// The totals of the buckets within the window ending at `now_ms`.
    pub fn totals(&self, now_ms: u64) -> Counters {
        let index = now_ms / self.bucket_ms;
        let mut sum = Counters::default();
        for (i, c) in &self.slots {
            if *i != u64::MAX && *i <= index && index - *i < BUCKETS {
                sum.add(c);
            }
        }
        sum
    }
}

/// Who set safe mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Control {
    /// The colour decides (enter on red, leave after green for `exit_after_ms`).
    Auto,
    /// Forced on by an operator.
    On,
    /// Forced off by an operator (stays off even in red).
    Off,
}

/// A change of safe mode, with the reason to log.
#[derive(Debug, Clone, PartialEq)]
pub struct Switch {
    pub active: bool,
    pub reason: String,
}

/// Safe mode's state for one pool: who controls it, whether it is on, and since when the
/// colour has been green (for leaving).
#[derive(Debug, Clone, PartialEq)]
pub struct SafeMode {
    pub control: Control,
    pub active: bool,
    pub green_since_ms: Option<u64>,
}

impl Default for SafeMode {
    fn default() -> Self {
        SafeMode {
            control: Control::Auto,
            active: false,
            green_since_ms: None,
        }
    }
}

impl SafeMode {
    /// Takes the colour seen at `now_ms` (with its reasons); returns the switch it causes, if
    /// any. Automatic safe mode turns on at red and off only once the colour has been green
    /// for `exit_after_ms` without a break (yellow holds it; red starts over).
    pub fn observe(&mut self, v: &Verdict, now_ms: u64, t: &Thresholds) -> Option<Switch> {
        self.green_since_ms = match v.colour {
            Colour::Green => Some(self.green_since_ms.unwrap_or(now_ms)),
            _ => None,
        };
        if self.control != Control::Auto || !t.auto {
            return None;
        }
        if !self.active && v.colour == Colour::Red {
            self.active = true;
            return Some(Switch {
                active: true,
                reason: format!("colour red: {}", v.reasons.join("; ")),
            });
        }
        let green_for = self.green_since_ms.map(|s| now_ms - s);
        if self.active && green_for.is_some_and(|g| g >= t.exit_after_ms) {
            self.active = false;
            return Some(Switch {
                active: false,
                reason: format!(
                    "colour green for {} ms (exit_after_ms = {})",
                    green_for.unwrap_or(0),
                    t.exit_after_ms
                ),
            });
        }
        None
    }

    /// An operator's order; returns the switch it causes, if any. `Auto` hands control back
    /// to the colour as it is: safe mode stays as it was until the next observation decides.
    pub fn set(&mut self, control: Control) -> Option<Switch> {
        self.control = control;
        let active = match control {
            Control::On => true,
            Control::Off => false,
            Control::Auto => return None,
        };
        let changed = self.active != active;
        self.active = active;
        changed.then(|| Switch {
            active,
            reason: format!(
                "forced {} by an operator",
                if active { "on" } else { "off" }
            ),
        })
    }

    /// How long the colour has been green at `now_ms` (0 when it is not).
    pub fn green_for_ms(&self, now_ms: u64) -> u64 {
        self.green_since_ms.map_or(0, |s| now_ms.saturating_sub(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(requests: u64, fallbacks: u64, migrations: u64, errors: u64) -> Counters {
        Counters {
            requests,
            fallbacks,
            migrations,
            errors,
            decisions: requests,
            decision_us: requests * 100,
        }
    }

    #[test]
    fn a_quiet_healthy_pool_is_green_without_reasons() {
        let v = evaluate(&counters(100, 2, 1, 1), 1.0, &Thresholds::default());
        assert_eq!(v.colour, Colour::Green);
        assert!(v.reasons.is_empty());
    }

    #[test]
    fn each_signal_turns_yellow_then_red_at_its_thresholds() {
        let t = Thresholds::default();
        // A ratio is judged on what its requests show with 95% confidence: 17 fallbacks in
        // 100 requests are at least 0.117, past the yellow threshold (0.1).
        let v = evaluate(&counters(100, 17, 0, 0), 1.0, &t);
        assert_eq!(v.colour, Colour::Yellow);
        assert_eq!(
            v.reasons,
            ["fallback ratio 0.17 (at least 0.117 with 95% confidence) >= yellow threshold 0.1 (over 100 requests)"]
        );
        let v = evaluate(&counters(100, 0, 30, 0), 1.0, &t);
        assert_eq!(v.colour, Colour::Red);
        assert_eq!(
            v.reasons,
            ["migration ratio 0.3 (at least 0.231 with 95% confidence) >= red threshold 0.2 (over 100 requests)"]
        );
        // A ratio at the red threshold over 100 requests may be a little below it: yellow.
        assert_eq!(
            evaluate(&counters(100, 0, 20, 0), 1.0, &t).colour,
            Colour::Yellow
        );
        let v = evaluate(&counters(40, 0, 0, 8), 1.0, &t);
        assert_eq!(
            v.reasons,
            ["error rate 0.2 (at least 0.117 with 95% confidence) >= yellow threshold 0.05 (over 40 requests)"]
        );
        let slow = Counters {
            decisions: 20,
            decision_us: 20 * 12_500,
            ..Counters::default()
        };
        let v = evaluate(&slow, 1.0, &t);
        assert_eq!(v.colour, Colour::Red);
        // Too few selections to judge.
        let few = Counters {
            decisions: 19,
            ..slow
        };
        assert_eq!(evaluate(&few, 1.0, &t).colour, Colour::Green);
        assert_eq!(v.colour, Colour::Red);
        assert_eq!(
            v.reasons,
            ["decision latency 12.5 >= red threshold 10 ms (mean selection time)"]
        );
        let v = evaluate(&Counters::default(), 1.0 / 3.0, &t);
        assert_eq!(v.colour, Colour::Red);
        assert_eq!(
            v.reasons,
            ["eligible capacity 0.333 <= red threshold 0.35 (share of configured weight able to serve)"]
        );
        assert_eq!(
            evaluate(&Counters::default(), 0.5, &t).colour,
            Colour::Yellow
        );
        assert_eq!(
            evaluate(&Counters::default(), 0.76, &t).colour,
            Colour::Green
        );
    }

    #[test]
    fn ratios_wait_for_enough_requests_and_reasons_come_worst_first() {
        let t = Thresholds::default();
        // 19 requests, all failed: not judged yet (min_requests = 20).
        assert_eq!(
            evaluate(&counters(19, 19, 0, 19), 1.0, &t).colour,
            Colour::Green
        );
        let v = evaluate(&counters(20, 6, 0, 12), 0.7, &t);
        assert_eq!(v.colour, Colour::Red);
        assert_eq!(
            v.reasons,
            [
                "error rate 0.6 (at least 0.419 with 95% confidence) >= red threshold 0.25 (over 20 requests)",
                "fallback ratio 0.3 (at least 0.164 with 95% confidence) >= yellow threshold 0.1 (over 20 requests)",
                "eligible capacity 0.7 <= yellow threshold 0.75 (share of configured weight able to serve)",
            ]
        );
    }

    /// The sample that turned a soak's pool red ten seconds in: 4 migrated streams among the
    /// window's first 20 requests, a ratio of 0.2 that 20 requests cannot tell from 0.09. It is
    /// yellow; the same ratio over 1,000 requests is red only once it is clearly past 0.2, and a
    /// pool whose every request fails is red as soon as the window holds `min_requests`.
    #[test]
    fn a_small_sample_is_judged_by_what_it_shows_with_confidence() {
        let t = Thresholds::default();
        let v = evaluate(&counters(20, 0, 4, 0), 1.0, &t);
        assert_eq!(v.colour, Colour::Yellow, "{:?}", v.reasons);
        assert_eq!(
            evaluate(&counters(1000, 0, 200, 0), 1.0, &t).colour,
            Colour::Yellow
        );
        assert_eq!(
            evaluate(&counters(1000, 0, 250, 0), 1.0, &t).colour,
            Colour::Red
        );
        assert_eq!(
            evaluate(&counters(20, 0, 0, 20), 1.0, &t).colour,
            Colour::Red
        );
    }

    #[test]
    fn the_confident_lower_bound_is_below_the_ratio_and_closes_in_as_requests_grow() {
        assert_eq!(at_least(0, 0), 0.0);
        assert_eq!(at_least(0, 50), 0.0);
        let mut last = 0.0;
        for n in [20, 100, 1_000, 100_000] {
            let b = at_least(n / 5, n);
            assert!(b < 0.2 && b > last, "n {n}: {b}");
            last = b;
        }
        assert!(last > 0.197, "{last}");
        // All of them: at least 1 − z²/(n + z²).
        let all = at_least(20, 20);
        assert!((all - 20.0 / (20.0 + CONFIDENCE_Z * CONFIDENCE_Z)).abs() < 1e-12);
    }

    #[test]
    fn the_window_forgets_buckets_older_than_itself() {
        let mut w = SignalWindow::new(1000); // 50 ms buckets
        w.at(0).requests += 1;
        w.at(40).requests += 2; // same bucket
        w.at(500).errors += 1;
        assert_eq!(w.totals(500).requests, 3);
        assert_eq!(w.totals(999).requests, 3);
        // At 1000 ms the first bucket (0–49 ms) is a whole window old.
        assert_eq!(w.totals(1000).requests, 0);
        assert_eq!(w.totals(1000).errors, 1);
        // A slot that comes round again starts empty.
        w.at(1010).requests += 5;
        assert_eq!(w.totals(1010).requests, 5);
        assert_eq!(w.totals(1600).errors, 0);
    }

    fn verdict(colour: Colour) -> Verdict {
        Verdict {
            colour,
            reasons: vec![format!("{} reason", colour.as_str())],
        }
    }

    #[test]
    fn safe_mode_enters_on_red_and_leaves_after_green_for_the_hysteresis() {
        let t = Thresholds {
            exit_after_ms: 1000,
            ..Thresholds::default()
        };
        let mut s = SafeMode::default();
        assert_eq!(s.observe(&verdict(Colour::Yellow), 0, &t), None);
        let on = s.observe(&verdict(Colour::Red), 100, &t).unwrap();
        assert_eq!(
            on,
            Switch {
                active: true,
                reason: "colour red: red reason".into()
            }
        );
        assert_eq!(s.observe(&verdict(Colour::Red), 200, &t), None);
        // Green, then yellow: the green time starts over.
        assert_eq!(s.observe(&verdict(Colour::Green), 300, &t), None);
        assert_eq!(s.observe(&verdict(Colour::Yellow), 1200, &t), None);
        assert_eq!(s.observe(&verdict(Colour::Green), 1300, &t), None);
        assert_eq!(s.observe(&verdict(Colour::Green), 2299, &t), None);
        assert!(s.active);
        assert_eq!(s.green_for_ms(2299), 999);
        let off = s.observe(&verdict(Colour::Green), 2300, &t).unwrap();
        assert_eq!(
            off,
            Switch {
                active: false,
                reason: "colour green for 1000 ms (exit_after_ms = 1000)".into()
            }
        );
        assert!(!s.active);
    }

    #[test]
    fn an_operator_overrides_the_colour_until_control_goes_back_to_auto() {
        let t = Thresholds::default();
        let mut s = SafeMode::default();
        assert!(s.set(Control::On).unwrap().active);
        // Forced on: green for ever does not release it.
        assert_eq!(s.observe(&verdict(Colour::Green), 0, &t), None);
        assert_eq!(s.observe(&verdict(Colour::Green), 1_000_000, &t), None);
        assert!(s.active);
        assert!(!s.set(Control::Off).unwrap().active);
        // Forced off: red does not turn it on.
        assert_eq!(s.observe(&verdict(Colour::Red), 1_000_100, &t), None);
        assert!(!s.active);
        assert_eq!(s.set(Control::Auto), None);
        assert!(s.observe(&verdict(Colour::Red), 1_000_200, &t).is_some());
        // Automatic safe mode off in the config: red is reported, nothing switches.
        let manual = Thresholds {
            auto: false,
            ..Thresholds::default()
        };
        let mut s = SafeMode::default();
        assert_eq!(s.observe(&verdict(Colour::Red), 0, &manual), None);
        assert!(!s.active);
    }
}
