//! Selection (the plan phase), as the gateway drives it: live health (`keel_core::health`), cooldowns
//! and concurrency turned into candidates for the pure policy (`keel_core::selection`), with
//! eligibility filters (ejection, warm-up, concurrency limit, context window, tier floor), an
//! ordered plan (primary, then fallbacks), a decision record for every request, and the waits
//! that help (a short cooldown ending, a place in the line of a full pool).

use crate::observe::record::CANDIDATES_KEPT;
use crate::observe::record::{CandidateRecord, DecisionRecord};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_core::health::{HealthConfig, State};
use keel_core::request::CanonicalRequest;
use keel_core::selection::{Candidate, Preference, RequestSignals};

use crate::pipeline::context::Priority;
use crate::pipeline::decision_candidates::{kept_candidates, omitted_summary};
use crate::state::capacity::{Throttle, ThrottleReason, Wake};
use crate::state::pools::{Pool, Published, Variant};

/// What selection produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Variant indexes in order: primary first.
    Plan(Vec<usize>),
    /// Every variant is cooling down or ejected; retry after this long.
    Unavailable { retry_after_ms: u64 },
    /// Nothing can serve now, and some variant is still loading its model: wait for it.
    Loading,
    /// Every variant that could serve is at its concurrency limit (configured or learned):
    /// wait in line for a slot.
    Full,
    /// Refused by the wait line of a full pool (see `capacity`).
    Throttled(Throttle),
    /// The request does not fit any variant's context window.
    /// `lower_bound`: the prompt was counted only until it could fit nothing.
    TooLong {
        needed: u64,
        largest: u64,
        lower_bound: bool,
    },
    /// No variant is at or above the requested fidelity (`x-keel-min-tier`).
    NoTier { min_tier: u8 },
    /// `x-keel-force-variant` named no variant of this pool.
    NoSuchVariant(String),
}

/// Per-request inputs to selection.
#[derive(Debug, Clone, Copy, Default)]
pub struct Controls<'a> {
    pub force_variant: Option<&'a str>,
    pub preference: Preference,
    /// Only variants with `tier <= min_tier` (1 = best fidelity).
    pub min_tier: Option<u8>,
    /// The request's rank in the wait line.
    pub priority: Priority,
}

/// The plan phase's selection: an ordered plan for this request, and its decision record.
pub fn select(
    pool: &Pool,
    req: &CanonicalRequest,
    controls: Controls<'_>,
    request_id: &str,
) -> (Selection, Option<DecisionRecord>) {
    let started = Instant::now();
    // The pool's clock read from the same instant (one clock read fewer per decision).
    let now_ms = started.saturating_duration_since(pool.epoch).as_millis() as u64;
    let needed = req
        .estimated_input_tokens
        .saturating_add(req.max_tokens.unwrap_or(0));
    let forced = match refuse_early(pool, req, controls, needed) {
        Ok(forced) => forced,
        Err(refused) => return (refused, None),
    };
    let signals = RequestSignals {
        affinity_key: pool.affinity_key(req),
        preference: controls.preference,
        slo_ttft_p95_ms: pool.cfg.slo_ttft_p95_ms,
        answer_tokens: pool.answer_tokens(req.max_tokens),
    };
    // The variants' published views (see `Pool::views`), read without waiting for any
    // lock: every figure below, the decision record's included, comes from these views.
    let mut held = pool.views();
    let deciding = Deciding {
        pool,
        views: held.current(),
        now_ms,
        hc: pool.cfg.health,
        needed,
        controls,
    };
    let mut candidates = deciding.candidates(false);
    let mut plan = pool.selector.plan(&candidates, &signals);
    if plan.order.is_empty() {
        // Everything else is out: a variant still warming up, or one ejected (slow, or
        // failing often but not always), beats making the client wait for the deadline.
        // Failover and the retry budget still bound what a failing one costs.
        candidates = deciding.candidates(true);
        plan = pool.selector.plan(&candidates, &signals);
    } else {
        // The variants held back only because they are still warming up or ejected come after
        // every variant the policy chose: when those all fail (a 429 storm on the one variant
        // warm at start-up), a variant that can answer beats an error.
        plan.order.extend(deciding.held_back(&plan.order));
    }
    let refusal = deciding.refusal(&plan.order);
    let mut record = deciding.record(request_id, &candidates, &plan);
    record.affinity_key = signals.affinity_key.map(|k| format!("{k:016x}"));
    record.answer_tokens = signals.answer_tokens;
    let duration = started.elapsed();
    record.duration_us = duration.as_secs_f64() * 1e6;
    pool.metrics
        .histogram(
            "keel_decision_duration_seconds",
            &[("pool", &pool.cfg.name)],
        )
        .record(duration.as_secs_f64());
    pool.safety.record_decision(now_ms, duration);
    let selection = match (forced, refusal) {
        (Some(i), _) => {
            let mut order = vec![i];
            order.extend(plan.order.iter().copied().filter(|j| *j != i));
            Selection::Plan(order)
        }
        (None, Some(refused)) => refused,
        (None, None) => Selection::Plan(plan.order),
    };
    (selection, Some(record))
}

/// Whether variant `v`'s context window holds `needed` tokens (prompt and output).
fn fits(v: &Variant, needed: u64) -> bool {
    v.cfg.context_window.is_none_or(|w| needed <= w)
}

/// Whether variant `v` meets the request's tier floor.
fn at_tier(v: &Variant, min_tier: Option<u8>) -> bool {
    min_tier.is_none_or(|t| v.cfg.tier <= t)
}

/// What is decided before any variant's state is read: the forced variant (tests,
/// debugging), which becomes the primary while the plan's others stay fallbacks and
/// migration targets; or the refusal of a request no variant could ever take.
fn refuse_early(
    pool: &Pool,
    req: &CanonicalRequest,
    controls: Controls<'_>,
    needed: u64,
) -> Result<Option<usize>, Selection> {
    let forced = match controls.force_variant {
        Some(name) => match pool.variants.iter().position(|v| v.cfg.name == name) {
            Some(i) => Some(i),
            None => return Err(Selection::NoSuchVariant(name.to_owned())),
        },
        None => None,
    };
    if !pool.variants.iter().any(|v| fits(v, needed)) {
        let largest = pool
            .variants
            .iter()
            .filter_map(|v| v.cfg.context_window)
            .max()
            .unwrap_or(0);
        return Err(Selection::TooLong {
            needed,
            largest,
            lower_bound: req.estimate_is_lower_bound,
        });
    }
    if let Some(t) = controls.min_tier {
        if !pool.variants.iter().any(|v| at_tier(v, Some(t))) {
            return Err(Selection::NoTier { min_tier: t });
        }
    }
    Ok(forced)
}

/// One decision's inputs: the pool, its variants' views as read once, and the request's
/// needs, so that every figure of the decision and its record comes from the same reading.
struct Deciding<'a> {
    pool: &'a Pool,
    views: Vec<&'a Published>,
    now_ms: u64,
    hc: HealthConfig,
    needed: u64,
    controls: Controls<'a>,
}

impl Deciding<'_> {
    /// Every variant as the policy sees it. `last_resort`: variants still warming, and
    /// ejected ones, may serve too.
    fn candidates(&self, last_resort: bool) -> Vec<Candidate> {
        let (pool, now_ms, hc) = (self.pool, self.now_ms, &self.hc);
        pool.variants
            .iter()
            .zip(&self.views)
            .enumerate()
            .map(|(i, (v, view))| {
                let state = view.est.state;
                // Not yet (or no longer) measured as healthy: the lowest weight there is.
                let warming = matches!(state, State::Warming { .. } | State::Ejected { .. });
                let live = match state {
                    State::Ejected { .. } => last_resort,
                    // A variant still loading its model gets no client request at all.
                    State::Warming { .. } => last_resort && !view.est.loading,
                    // Ejected by another replica (see `signals`): a last resort here too.
                    _ => last_resort || !view.availability.shared_ejected(now_ms),
                };
                let in_flight = v.in_flight.load(Ordering::Relaxed);
                let health = view.health_at(now_ms, hc);
                Candidate {
                    index: i,
                    weight: v.cfg.weight,
                    available: live
                        && fits(v, self.needed)
                        && at_tier(v, self.controls.min_tier)
                        && view.availability.available(now_ms)
                        && in_flight < pool.limit_for(i, self.controls.priority, now_ms),
                    health: if warming {
                        keel_core::health::FLOOR
                    } else {
                        health.weight
                    },
                    condition: if warming {
                        keel_core::health::FLOOR
                    } else {
                        health.factors.condition()
                    },
                    predicted_ttft_ms: health.predicted_ttft_ms,
                    ttft_samples: health.ttft_samples,
                    gap_ms: health.gap_ms,
                    gap_trust: health.gap_trust,
                    in_flight,
                    tier: v.cfg.tier,
                    price: v.cfg.price,
                    p95_ttft_ms: view.p95_ttft_ms,
                    queued: view.est.waiting.is_some_and(|w| hc.waiting.is_severe(w)),
                    name_hash: v.name_hash,
                }
            })
            .collect()
    }

    /// The variants that are out of `order` only because they are warming (their model loaded)
    /// or ejected, and could otherwise serve this request: the warming ones first (not yet
    /// measured, where an ejected one was measured failing), then those ejected by another
    /// replica, then those ejected here, each in the pool's order. None in a settled pool, where
    /// this reads each variant's state once and builds nothing.
    fn held_back(&self, order: &[usize]) -> Vec<usize> {
        let now_ms = self.now_ms;
        let rank = |i: usize| {
            let view = self.views[i];
            match view.est.state {
                State::Warming { .. } => Some(0),
                State::Ejected { .. } => Some(2),
                _ if view.availability.shared_ejected(now_ms) => Some(1),
                _ => None,
            }
        };
        if (0..self.views.len()).all(|i| rank(i).is_none()) {
            return Vec::new();
        }
        let mut held: Vec<usize> = self
            .candidates(true)
            .iter()
            .filter(|c| c.available && c.weight > 0 && !order.contains(&c.index))
            .map(|c| c.index)
            .collect();
        held.sort_by_key(|&i| rank(i));
        held
    }

    /// Why an empty plan is empty: every fitting variant full, the fleet loading, or every
    /// variant cooling down (with the soonest end for the Retry-After). `None` when the plan
    /// has a variant.
    fn refusal(&self, order: &[usize]) -> Option<Selection> {
        if !order.is_empty() {
            return None;
        }
        let (pool, now_ms) = (self.pool, self.now_ms);
        let full = |(i, v): (usize, &Variant)| {
            fits(v, self.needed)
                && at_tier(v, self.controls.min_tier)
                && self.views[i].availability.available(now_ms)
                && v.in_flight.load(Ordering::Relaxed)
                    >= pool.limit_for(i, self.controls.priority, now_ms)
        };
        if pool.variants.iter().enumerate().any(full) {
            return Some(Selection::Full);
        }
        if self.views.iter().any(|v| v.est.loading) {
            return Some(Selection::Loading);
        }
        let wait = self
            .views
            .iter()
            .map(|v| v.availability.available_in_ms(now_ms))
            .filter(|ms| *ms > 0)
            .min()
            .unwrap_or(self.hc.probe_interval_ms.max(1000));
        Some(Selection::Unavailable {
            retry_after_ms: wait,
        })
    }

    /// The decision record: the plan's head and the candidates that explain it, each with
    /// every input of its cost from the same views the decision read.
    fn record(
        &self,
        request_id: &str,
        candidates: &[Candidate],
        plan: &keel_core::selection::Plan,
    ) -> DecisionRecord {
        let pool = self.pool;
        // Costs by variant, one pass (a search per candidate is quadratic in the pool's size).
        let mut cost_by_index = vec![None; pool.variants.len()];
        for &(i, c) in &plan.costs {
            if let Some(slot) = cost_by_index.get_mut(i) {
                *slot = Some(c);
            }
        }
        let kept = kept_candidates(candidates, &plan.order, &cost_by_index);
        let omitted = omitted_summary(candidates, &kept, plan.order.len(), |i| {
            self.views[i].est.state.name()
        });
        DecisionRecord {
            request_id: request_id.to_owned(),
            time_unix_ms: crate::state::keys::limits::unix_now_ms(),
            pool: pool.cfg.name.clone(),
            policy: pool.selector.name(),
            reason: if plan.order.is_empty() {
                "none_available"
            } else {
                plan.reason.as_str()
            },
            plan: plan
                .order
                .iter()
                .take(CANDIDATES_KEPT)
                .map(|i| pool.variants[*i].cfg.name.clone())
                .collect(),
            candidates: kept
                .iter()
                .map(|&k| self.candidate_record(&candidates[k], cost_by_index[candidates[k].index]))
                .collect(),
            candidates_omitted: omitted,
            ..Default::default()
        }
    }

    /// One candidate's entry: the same figures it was built from, the same view, the same time.
    fn candidate_record(&self, c: &Candidate, cost: Option<f64>) -> CandidateRecord {
        let v = &self.pool.variants[c.index];
        let view = self.views[c.index];
        CandidateRecord {
            variant: v.cfg.name.clone(),
            state: view.est.state.name(),
            eligible: c.available,
            weight: c.health * c.weight as f64,
            configured_weight: c.weight,
            health: c.health,
            factors: view.health_at(self.now_ms, &self.hc).factors,
            predicted_ttft_ms: c.predicted_ttft_ms,
            p95_ttft_ms: c.p95_ttft_ms,
            gap_ms: c.gap_ms,
            tgsv_ms: view.est.tgsv_ms.get(),
            error_rate: view.est.error_rate.get(),
            kv_usage: view.est.kv_usage,
            queue_waiting: view.est.waiting,
            in_flight: c.in_flight,
            concurrency_limit: Some(v.concurrency_limit()).filter(|l| *l != u32::MAX),
            tier: c.tier,
            price: c.price,
            cost,
        }
    }
}

/// How often a request waiting for a loading fleet looks again.
const LOADING_POLL: Duration = Duration::from_millis(50);

/// Longest wait for a cooling-down pool before answering 503 with retry-after.
pub(crate) const COOLDOWN_WAIT_MAX_MS: u64 = 2_000;

/// Selects, waiting when that helps: for the first variant back from a short cooldown (the
/// client would have to wait that long anyway), or in the pool's line while every variant is
/// full (see `capacity`). Returns `Unavailable` when waiting would not help in time, and
/// `Throttled` when the line refuses the request (at once, or after waiting all it may).
pub async fn select_or_wait(
    pool: &Arc<Pool>,
    req: &keel_core::request::CanonicalRequest,
    controls: Controls<'_>,
    id: &str,
    deadline: tokio::time::Instant,
) -> (Selection, Option<DecisionRecord>) {
    let started = tokio::time::Instant::now();
    let line_deadline = (started + Duration::from_millis(pool.cfg.queue_ms)).min(deadline);
    let mut ticket: Option<crate::state::capacity::Ticket<'_>> = None;
    loop {
        let (selection, record) = select(pool, req, controls, id);
        let full = match selection {
            Selection::Unavailable { retry_after_ms } => {
                let wake =
                    tokio::time::Instant::now() + Duration::from_millis(retry_after_ms.max(10));
                if retry_after_ms > COOLDOWN_WAIT_MAX_MS || wake >= deadline {
                    return (selection, record);
                }
                tokio::time::sleep_until(wake).await;
                continue;
            }
            Selection::Loading => {
                // The monitor's warm-ups find out when a loading variant is ready; look again
                // shortly, for as long as the request's deadline allows.
                let wake = tokio::time::Instant::now() + LOADING_POLL;
                if wake >= deadline {
                    return (selection, record);
                }
                tokio::time::sleep_until(wake).await;
                continue;
            }
            Selection::Full => true,
            // A free slot, but requests that rank before this one are waiting for it: this one
            // goes in line behind them (a slot is theirs first).
            Selection::Plan(_) => match &ticket {
                None => pool.line.any_before(controls.priority, deadline),
                Some(t) => t.ahead() > 0,
            },
            _ => false,
        };
        if !full {
            if ticket.is_some() {
                pool.metrics
                    .histogram("keel_queue_wait_seconds", &[("pool", &pool.cfg.name)])
                    .record(started.elapsed().as_secs_f64());
            }
            return (selection, record);
        }
        let t = match &ticket {
            Some(t) => t,
            None => match pool.line.join(
                None,
                controls.priority,
                deadline,
                line_deadline,
                pool.running(),
            ) {
                Ok(t) => {
                    // Look again at once: a slot may have freed before it joined.
                    ticket = Some(t);
                    continue;
                }
                Err(refused) => return (Selection::Throttled(refused), record),
            },
        };
        let reason = match t.wait(line_deadline).await {
            Wake::LookAgain => continue,
            Wake::Displaced => ThrottleReason::Displaced,
            Wake::TimedOut => ThrottleReason::Timeout,
        };
        let throttle = Throttle {
            reason,
            priority: controls.priority,
            retry_after_ms: t.expected_wait_ms(pool.running()).max(1),
            ahead: t.ahead(),
        };
        return (Selection::Throttled(throttle), record);
    }
}
