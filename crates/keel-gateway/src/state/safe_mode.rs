//! A pool's health colour and safe mode at run time (the pure rules are
//! `keel_core::health_colour`).
//!
//! **Counting.** Every request of a pool is counted once when it ends (`access_log`): its
//! route (`fallback`, `migrated`) and whether the client saw a failure (a 5xx, or a stream's
//! error event). Every selection pass is timed where it runs (`selection`). Both go into the
//! pool's [`SignalWindow`].
//!
//! **Judging.** The monitor's tick (and every `GET /keel/health`) evaluates the window and the
//! pool's eligible capacity against `[pools.safe_mode]`, sets `keel_health_state{pool}`, and
//! feeds the colour to safe mode's hysteresis.
//!
//! **Safe mode.** Plain proxying with failover before the first byte only: no hedging, no
//! migration (a stream that fails after its first byte ends with an error event), no prompt
//! changes (no middle-out), no refresh probes, and no non-streaming request turned into a
//! stream for migration's sake. Translation stays: a variant of the other protocol can only be
//! reached through it, and its prompt fixes are what that protocol needs to accept the
//! request at all. The flag is one atomic, read where each of those features starts; switches
//! (automatic or forced through `POST /keel/admin/safe-mode`) are logged with their reason and
//! set `keel_safe_mode{pool}`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde_json::{json, Value};

use keel_core::health_colour::{
    evaluate, Control, Counters, SafeMode, SignalWindow, Switch, Thresholds, Verdict,
};

use crate::observe::metrics::Metrics;
use crate::per_thread::PerThread;
use crate::state::pools::Pool;

/// One pool's signal window, colour and safe mode.
pub struct Safety {
    pool: String,
    /// Whether safe mode is on: the only thing the request path reads.
    active: AtomicBool,
    thresholds: Thresholds,
    /// Counted per thread (every request counts twice: see `per_thread`).
    window: PerThread<SignalWindow>,
    state: Mutex<State>,
    metrics: Arc<Metrics>,
}

/// What the last evaluation found, and the last switch.
struct State {
    mode: SafeMode,
    verdict: Verdict,
    last_switch: Option<SwitchRecord>,
}

/// A switch as `/keel/health` shows it.
#[derive(Debug, Clone, Serialize)]
struct SwitchRecord {
    active: bool,
    reason: String,
    /// Milliseconds since the gateway started.
    at_ms: u64,
}

impl Safety {
    pub fn new(pool: &str, thresholds: Thresholds, metrics: Arc<Metrics>) -> Self {
        let s = Safety {
            pool: pool.to_owned(),
            active: AtomicBool::new(false),
            thresholds,
            window: PerThread::new(|| SignalWindow::new(thresholds.window_ms)),
            state: Mutex::new(State {
                mode: SafeMode::default(),
                verdict: Verdict {
                    colour: keel_core::health_colour::Colour::Green,
                    reasons: Vec::new(),
                },
                last_switch: None,
            }),
            metrics,
        };
        s.gauges(0, false);
        s
    }

    /// Whether the pool is in safe mode now.
    #[inline]
    pub fn active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    fn window(&self) -> std::sync::MutexGuard<'_, SignalWindow> {
        self.window.own()
    }

    /// The counters of the window ending at `now_ms`, over every thread's shard.
    fn totals(&self, now_ms: u64) -> Counters {
        let mut sum = Counters::default();
        for shard in self.window.all() {
            sum.add(&shard.totals(now_ms));
        }
        sum
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a request that ended: its route and outcome as the access log has them.
    pub fn record_request(&self, now_ms: u64, route: &str, outcome: &str) {
        let mut w = self.window();
        let c = w.at(now_ms);
        c.requests += 1;
        c.fallbacks += u64::from(route == "fallback");
        c.migrations += u64::from(route == "migrated");
        c.errors += u64::from(matches!(outcome, "error" | "incomplete"));
    }

    /// Counts one selection pass and how long it took.
    pub fn record_decision(&self, now_ms: u64, took: std::time::Duration) {
        let mut w = self.window();
        let c = w.at(now_ms);
        c.decisions += 1;
        c.decision_us += took.as_micros() as u64;
    }

    fn gauges(&self, colour: u8, active: bool) {
        let labels = [("pool", self.pool.as_str())];
        self.metrics
            .gauge("keel_health_state", &labels)
            .set(colour as f64);
        self.metrics
            .gauge("keel_safe_mode", &labels)
            .set(if active { 1.0 } else { 0.0 });
    }

    /// Applies a switch: the flag, the gauge, one log line, the record.
    fn apply(&self, st: &mut State, sw: Switch, now_ms: u64) {
        self.active.store(sw.active, Ordering::Relaxed);
        let state = if sw.active { "on" } else { "off" };
        tracing::warn!(pool = %self.pool, safe_mode = state, reason = %sw.reason, "safe mode {state}");
        st.last_switch = Some(SwitchRecord {
            active: sw.active,
            reason: sw.reason,
            at_ms: now_ms,
        });
    }

    /// Evaluates the pool's colour now and lets safe mode follow it (the monitor's tick).
    pub fn update(&self, pool: &Pool) {
        drop(self.judge(pool));
    }

    /// Evaluates as [`Safety::update`] does and returns the pool's health fields:
    /// `colour`, `reasons`, `signals` and `safe_mode`.
    pub fn report(&self, pool: &Pool) -> Value {
        let (st, counters, capacity, now) = self.judge(pool);
        self.document(&st, &counters, capacity, now)
    }

    fn judge(&self, pool: &Pool) -> (std::sync::MutexGuard<'_, State>, Counters, f64, u64) {
        let now = pool.now_ms();
        let counters = self.totals(now);
        let capacity = eligible_capacity(pool);
        let verdict = evaluate(&counters, capacity, &self.thresholds);
        let mut st = self.state();
        if let Some(sw) = st.mode.observe(&verdict, now, &self.thresholds) {
            self.apply(&mut st, sw, now);
        }
        st.verdict = verdict;
        self.gauges(st.verdict.colour.code(), st.mode.active);
        (st, counters, capacity, now)
    }

    /// An operator's order (`POST /keel/admin/safe-mode`).
    pub fn set(&self, control: Control, now_ms: u64) {
        let mut st = self.state();
        if let Some(sw) = st.mode.set(control) {
            self.apply(&mut st, sw, now_ms);
        }
        self.gauges(st.verdict.colour.code(), st.mode.active);
    }

    fn document(&self, st: &State, c: &Counters, capacity: f64, now: u64) -> Value {
        let t = &self.thresholds;
        json!({
            "colour": st.verdict.colour,
            "reasons": st.verdict.reasons,
            "signals": {
                "window_ms": t.window_ms,
                "requests": c.requests,
                "fallback_ratio": c.fallback_ratio(),
                "migration_ratio": c.migration_ratio(),
                "error_rate": c.error_rate(),
                "decision_ms": c.decision_ms(),
                "eligible_capacity": capacity,
            },
            "safe_mode": {
                "active": st.mode.active,
                "control": st.mode.control,
                "green_for_ms": st.mode.green_for_ms(now),
                "exit_after_ms": t.exit_after_ms,
                "last_switch": st.last_switch,
            },
        })
    }
}

/// The share of the pool's configured weight on variants able to serve now: available (not
/// cooling down, credentials good), not ejected, and not restarting. A variant loading its
/// model is not counted out: every variant with a health endpoint starts that way, and a fleet
/// starting up is not a fleet in trouble.
fn eligible_capacity(pool: &Pool) -> f64 {
    let snapshot = pool.snapshot();
    let total: f64 = pool.variants.iter().map(|v| v.cfg.weight as f64).sum();
    if total <= 0.0 {
        return 0.0;
    }
    let eligible: f64 = pool
        .variants
        .iter()
        .zip(&snapshot)
        .enumerate()
        .filter(|(i, (_, s))| s.available && !pool.restarting(*i))
        .map(|(_, (v, _))| v.cfg.weight as f64)
        .sum();
    eligible / total
}

/// Adds the fields of `extra` (an object) to `doc` (an object).
pub fn merge(doc: &mut Value, extra: Value) {
    if let (Some(d), Value::Object(e)) = (doc.as_object_mut(), extra) {
        d.extend(e);
    }
}

/// The gateway's colour: the worst of its pools' (green without pools), with their reasons,
/// each prefixed by its pool's name.
pub fn overall(pools: &[Value]) -> (&'static str, Vec<String>) {
    let rank = |c: &str| ["green", "yellow", "red"].iter().position(|x| *x == c);
    let worst = pools
        .iter()
        .filter_map(|p| rank(p["colour"].as_str()?))
        .max()
        .unwrap_or(0);
    let reasons = pools
        .iter()
        .flat_map(|p| {
            let name = p["name"].as_str().unwrap_or_default().to_owned();
            p["reasons"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r.as_str())
                .map(move |r| format!("pool `{name}`: {r}"))
                .collect::<Vec<_>>()
        })
        .collect();
    (["green", "yellow", "red"][worst], reasons)
}
