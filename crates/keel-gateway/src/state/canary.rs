//! Canary rollouts, as the gateway drives them (the decisions are `keel_core::canary`'s).
//!
//! A pool with `[pools.canary]` splits its variants into a stable and a candidate set. Each
//! request's identity (see [`Identity`]) hashes to a bucket; below the candidate's weight it
//! goes to the candidate side. Selection is left as it is: it plans over every variant, and
//! [`steer`] moves the chosen side's variants to the front of the plan, keeping the other
//! side's as fallbacks, so that a request is never failed because of the canary. When the
//! chosen side has no variant in the plan at all (none healthy or available), the request is
//! served by the other side and counted in `keel_canary_fallbacks_total`.
//!
//! Every client attempt on a candidate variant feeds the canary (error rate, TTFT; see
//! `Pool::record_attempt`), and shadow comparisons feed its agreement; each feed may advance
//! or roll back the weight. Transitions are logged (`tracing` warn for a rollback, info
//! otherwise), counted in `keel_canary_transitions_total`, and the latest ones are kept for
//! `/keel/health`. Operators promote or roll back through
//! `POST /keel/admin/canary/{pool}/promote|rollback`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{json, Value};

use keel_core::canary::{bucket, Canary, Side, Transition};

use crate::config::{CanaryPoolConfig, Identity, PoolConfig};
use crate::observe::metrics::Metrics;

/// Transitions kept for the health document.
const HISTORY: usize = 16;

/// One pool's canary.
pub struct CanaryRuntime {
    pool: String,
    identity: Identity,
    /// Per variant index: on the candidate side.
    candidate: Vec<bool>,
    state: Mutex<(Canary, VecDeque<Value>)>,
    metrics: Arc<Metrics>,
}

impl CanaryRuntime {
    /// The pool's canary, if it has one.
    pub fn new(cfg: &PoolConfig, metrics: Arc<Metrics>, now_ms: u64) -> Option<Self> {
        let c: &CanaryPoolConfig = cfg.canary.as_ref()?;
        let mut candidate = vec![false; cfg.variants.len()];
        for &i in &c.candidates {
            if let Some(x) = candidate.get_mut(i) {
                *x = true;
            }
        }
        let rt = CanaryRuntime {
            pool: cfg.name.clone(),
            identity: c.identity.clone(),
            candidate,
            state: Mutex::new((Canary::new(c.rule.clone(), now_ms), VecDeque::new())),
            metrics,
        };
        rt.set_weight_gauge(rt.lock().0.weight_bp());
        Some(rt)
    }

    fn lock(&self) -> MutexGuard<'_, (Canary, VecDeque<Value>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_candidate(&self, vi: usize) -> bool {
        self.candidate.get(vi).copied().unwrap_or(false)
    }

    /// The request's identity under the configured rule, if it carries one.
    /// What places a request on a side (`identity`).
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The side a request of identity `who` belongs on (see [`Self::identity`]).
    pub fn side(&self, who: &str, now_ms: u64) -> Side {
        let b = bucket(&self.pool, who.as_bytes());
        let side = {
            let mut st = self.lock();
            let t = st.0.evaluate(now_ms);
            let side = st.0.side(b);
            self.apply(&mut st, t);
            side
        };
        self.metrics
            .counter(
                "keel_canary_requests_total",
                &[("pool", &self.pool), ("side", side.as_str())],
            )
            .increment(1);
        side
    }

    /// An attempt on variant `vi` ended (only candidate attempts count).
    pub fn observe_attempt(&self, vi: usize, ok: bool, ttft_ms: Option<f64>, now_ms: u64) {
        if !self.is_candidate(vi) {
            return;
        }
        let mut st = self.lock();
        let t = st.0.observe_attempt(ok, ttft_ms, now_ms);
        self.apply(&mut st, t);
    }

    /// A shadow comparison's similarity.
    pub fn observe_agreement(&self, similarity: f64, now_ms: u64) {
        let mut st = self.lock();
        let t = st.0.observe_agreement(similarity, now_ms);
        self.apply(&mut st, t);
    }

    /// An operator's order: `promote` or `rollback`. Returns the state afterwards.
    pub fn order(&self, promote: bool, now_ms: u64) -> Value {
        let mut st = self.lock();
        let t = if promote {
            st.0.promote(now_ms)
        } else {
            st.0.roll_back(now_ms)
        };
        self.apply(&mut st, t);
        Self::document(&st, now_ms)
    }

    /// The canary's state for `/keel/health` (evaluated first: a dwell may have ended).
    pub fn report(&self, now_ms: u64) -> Value {
        let mut st = self.lock();
        let t = st.0.evaluate(now_ms);
        self.apply(&mut st, t);
        Self::document(&st, now_ms)
    }

    fn document(st: &(Canary, VecDeque<Value>), now_ms: u64) -> Value {
        let (c, history) = st;
        let step = match c.phase {
            keel_core::canary::Phase::Rolling { step } => Some(step),
            _ => None,
        };
        json!({
            "phase": c.phase.as_str(),
            "step": step,
            "weight_percent": c.weight_bp() as f64 / 100.0,
            "steps": c.cfg.steps,
            "in_phase_ms": now_ms.saturating_sub(c.since_ms),
            "step_stats": {
                "attempts": c.stats.attempts,
                "errors": c.stats.errors,
                "error_rate": c.stats.error_rate(),
                "ttft_p99_ms": c.stats.ttft_p99_ms(),
                "agreement": c.stats.agreement(),
            },
            "transitions": history,
        })
    }

    /// Logs, counts and remembers a transition.
    fn apply(&self, st: &mut (Canary, VecDeque<Value>), t: Option<Transition>) {
        let Some(t) = t else {
            return;
        };
        let (from, to) = (t.from_bp as f64 / 100.0, t.to_bp as f64 / 100.0);
        if t.kind == keel_core::canary::Move::RolledBack {
            tracing::warn!(pool = %self.pool, from_percent = from, manual = t.manual, reason = %t.reason, "canary rolled back");
        } else {
            tracing::info!(pool = %self.pool, from_percent = from, to_percent = to, manual = t.manual, reason = %t.reason, "canary {}", t.kind.as_str());
        }
        self.metrics
            .counter(
                "keel_canary_transitions_total",
                &[("pool", &self.pool), ("to", t.kind.as_str())],
            )
            .increment(1);
        self.set_weight_gauge(t.to_bp);
        if st.1.len() == HISTORY {
            st.1.pop_front();
        }
        st.1.push_back(json!({
            "to": t.kind.as_str(),
            "from_percent": from,
            "to_percent": to,
            "reason": t.reason,
            "manual": t.manual,
            "at_ms": st.0.since_ms,
        }));
    }

    fn set_weight_gauge(&self, bp: u32) {
        self.metrics
            .gauge("keel_canary_weight_percent", &[("pool", &self.pool)])
            .set(bp as f64 / 100.0);
    }
}

/// Moves the variants of `side` to the front of `order` (keeping each side's order), so that
/// the other side only serves as fallback. Returns false when `side` had no variant in the
/// plan (the request falls back to the other side; counted).
pub fn steer(canary: &CanaryRuntime, side: Side, order: &mut [usize]) -> bool {
    let wanted = |vi: &usize| canary.is_candidate(*vi) == (side == Side::Candidate);
    let any = order.iter().any(wanted);
    // A stable sort on "not wanted": the wanted side first, each side in plan order.
    order.sort_by_key(|vi| !wanted(vi));
    if !any && !order.is_empty() {
        canary
            .metrics
            .counter(
                "keel_canary_fallbacks_total",
                &[("pool", &canary.pool), ("side", side.as_str())],
            )
            .increment(1);
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime(candidates: &[bool]) -> CanaryRuntime {
        let rule = keel_core::canary::CanaryConfig {
            steps: vec![50.0, 100.0],
            dwell_ms: 0,
            min_requests: 1,
            max_error_rate: 0.5,
            max_ttft_p99_ms: None,
            min_agreement: None,
        };
        CanaryRuntime {
            pool: "p".into(),
            identity: Identity::User,
            candidate: candidates.to_vec(),
            state: Mutex::new((Canary::new(rule, 0), VecDeque::new())),
            metrics: Metrics::new(),
        }
    }

    #[test]
    fn steer_puts_the_chosen_side_first_and_keeps_the_rest_as_fallbacks() {
        let c = runtime(&[false, true, false, true]);
        let mut order = vec![0, 1, 2, 3];
        assert!(steer(&c, Side::Candidate, &mut order));
        assert_eq!(order, vec![1, 3, 0, 2]);
        assert!(steer(&c, Side::Stable, &mut order));
        assert_eq!(order, vec![0, 2, 1, 3]);
        // No candidate in the plan: the stable variants serve.
        let mut order = vec![2, 0];
        assert!(!steer(&c, Side::Candidate, &mut order));
        assert_eq!(order, vec![2, 0]);
    }

    #[test]
    fn only_candidate_attempts_count_and_transitions_are_kept() {
        let c = runtime(&[false, true]);
        c.observe_attempt(0, false, None, 1);
        assert_eq!(c.lock().0.stats.attempts, 0);
        c.observe_attempt(1, true, Some(10.0), 1);
        let doc = c.report(2);
        // One healthy attempt, no dwell: the canary went from 50 % to promoted.
        assert_eq!(doc["phase"], "promoted");
        assert_eq!(doc["transitions"][0]["to"], "promoted");
        let doc = c.order(false, 3);
        assert_eq!(doc["phase"], "rolled_back");
        assert_eq!(doc["transitions"][1]["manual"], true);
    }
}
