//! Stage 1, selection, as the gateway drives it: live health (`keel_core::health`), cooldowns
//! and concurrency turned into candidates for the pure policy (`keel_core::selection`), with
//! eligibility filters (ejection, warm-up, concurrency limit, context window, tier floor), an
//! ordered plan (primary, then fallbacks), a decision record for every request, and the waits
//! that help (a short cooldown ending, a place in the line of a full pool).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use keel_core::health::State;
use keel_core::request::CanonicalRequest;
use keel_core::selection::{Candidate, Preference, RequestSignals};

use crate::capacity::{Throttle, ThrottleReason, Wake};
use crate::context::Priority;
use crate::decision_candidates::{
    kept_candidates, omitted_summary, OmittedCandidates, CANDIDATES_KEPT,
};
use crate::pools::{Pool, Variant};
use crate::settlement::AttemptRecord;

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

/// One candidate in a decision record: every input of its cost, as selection saw it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CandidateRecord {
    pub variant: String,
    pub state: &'static str,
    /// Whether it could take this request (not cooling down, ejected, warming, full, too
    /// small for the prompt or below the tier floor).
    pub eligible: bool,
    /// Effective weight: configured weight × health.
    pub weight: f64,
    pub configured_weight: u32,
    /// Health weight in 0..=1, the product of `factors`.
    pub health: f64,
    pub factors: HealthFactors,
    /// Peak-EWMA time-to-first-token estimate, ms.
    pub predicted_ttft_ms: f64,
    pub p95_ttft_ms: Option<f64>,
    /// Time-between-tokens standard deviation (gap variance), ms.
    pub tgsv_ms: Option<f64>,
    pub error_rate: Option<f64>,
    /// Scraped from the upstream's metrics: KV-cache usage (0..=1) and requests waiting.
    pub kv_usage: Option<f64>,
    pub queue_waiting: Option<f64>,
    pub in_flight: u32,
    /// Configured or learned concurrency limit (`None`: unlimited).
    pub concurrency_limit: Option<u32>,
    pub tier: u8,
    pub price: f64,
    /// The policy's cost (lower wins); `None` when not eligible or for round robin.
    pub cost: Option<f64>,
}

/// The factors behind a health weight (`keel_core::health::Factors`), each in 0..=1.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct HealthFactors {
    pub ttft: f64,
    pub tgsv: f64,
    pub errors: f64,
    pub kv: f64,
    pub waiting: f64,
    pub ramp: f64,
}

/// Why a request went where it went (see `decisions`). Selection fills in the candidates and
/// the plan; the attempts and the request's end complete it. No prompt or output is kept.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DecisionRecord {
    pub request_id: String,
    /// Arrival, milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
    pub pool: String,
    /// The client's API (`chat_completions`, `messages`, …).
    pub endpoint: &'static str,
    /// Virtual key id and tenant, when keys are configured.
    pub key: Option<String>,
    pub tenant: Option<String>,
    pub policy: &'static str,
    pub reason: &'static str,
    /// The affinity key's hash (hex), when the pool uses affinity and the request has one.
    pub affinity_key: Option<String>,
    /// The plan's first [`CANDIDATES_KEPT`] variants (every one in pools no larger).
    pub plan: Vec<String>,
    /// Every candidate in pools of up to [`CANDIDATES_KEPT`] variants; in larger ones, the
    /// plan's head and the cheapest others (see [`kept_candidates`]), in variant order.
    pub candidates: Vec<CandidateRecord>,
    /// What a large pool's record leaves out, counted (`None` when nothing is).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidates_omitted: Option<Box<OmittedCandidates>>,
    /// Time selection took, µs.
    pub duration_us: f64,
    /// Every attempt the request made, in order (filled in when the request ends).
    pub attempts: Vec<AttemptRecord>,
    pub hedges: Vec<crate::decisions::HedgeRecord>,
    pub migrations: Vec<crate::decisions::MigrationRecord>,
    /// `x-keel-prompt-fix` codes.
    pub prompt_fixes: Vec<String>,
    /// `x-keel-guard`: what the PII and secret guard found and did (types and counts only).
    /// Boxed: most records have none, and the record's size is budgeted (see `decisions`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guard: Option<Box<String>>,
    /// What normalization changed: the text around each change, before and after (see
    /// `keel_core::normalize::Edits`; off with `decision_prompt_edits = false`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prompt_edits: Vec<keel_core::normalize::Edit>,
    /// `x-keel-route` and `x-keel-variant` as answered.
    pub route: &'static str,
    pub variant: String,
    pub status: u16,
    pub outcome: &'static str,
    pub ttft_ms: Option<f64>,
    pub total_ms: f64,
    /// Time with an upstream attempt outstanding, ms.
    pub upstream_wait_ms: f64,
    /// `x-keel-overhead-us`.
    pub overhead_us: Option<u64>,
    /// The canary side the request was put on (`stable`, `candidate`), in a pool with one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canary: Option<&'static str>,

    /// Output integrity events, `<issue>:<action>` (`truncated:continued`,
    /// `invalid_json:retried`, `invalid_json:flagged`, …; see `relay::integrity`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub integrity: Vec<String>,
    /// A consensus request's votes (see `consensus`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consensus: Option<serde_json::Value>,

    /// `x-keel-cache` (see `cache`), and for a hit the request whose answer was replayed.
    pub cache: &'static str,
    pub cached_from: Option<String>,
}

impl DecisionRecord {
    /// A record with no selection (the request ended before one).
    pub fn bare(request_id: &str, pool: &str) -> Self {
        DecisionRecord {
            request_id: request_id.to_owned(),
            pool: pool.to_owned(),
            ..Default::default()
        }
    }
}

impl Pool {
    /// Stage 1: an ordered plan for this request, and its decision record.
    pub fn select(
        &self,
        req: &CanonicalRequest,
        controls: Controls<'_>,
        request_id: &str,
    ) -> (Selection, Option<DecisionRecord>) {
        let started = Instant::now();
        // The pool's clock read from the same instant (one clock read fewer per decision).
        let now_ms = started.saturating_duration_since(self.epoch).as_millis() as u64;
        // A forced variant (tests, debugging) becomes the primary; the plan's other variants
        // stay as fallbacks and migration targets.
        let forced = match controls.force_variant {
            Some(name) => match self.variants.iter().position(|v| v.cfg.name == name) {
                Some(i) => Some(i),
                None => return (Selection::NoSuchVariant(name.to_owned()), None),
            },
            None => None,
        };
        let needed = req
            .estimated_input_tokens
            .saturating_add(req.max_tokens.unwrap_or(0));
        let fits = |v: &Variant| v.cfg.context_window.is_none_or(|w| needed <= w);
        if !self.variants.iter().any(fits) {
            let largest = self
                .variants
                .iter()
                .filter_map(|v| v.cfg.context_window)
                .max()
                .unwrap_or(0);
            let lower_bound = req.estimate_is_lower_bound;
            return (
                Selection::TooLong {
                    needed,
                    largest,
                    lower_bound,
                },
                None,
            );
        }
        let at_tier = |v: &Variant| controls.min_tier.is_none_or(|t| v.cfg.tier <= t);
        if let Some(t) = controls.min_tier {
            if !self.variants.iter().any(at_tier) {
                return (Selection::NoTier { min_tier: t }, None);
            }
        }
        let signals = RequestSignals {
            affinity_key: self.affinity_key(req),
            preference: controls.preference,
            slo_ttft_p95_ms: self.cfg.slo_ttft_p95_ms,
        };
        // The variants' published views (see `Pool::views`), read without waiting for any
        // lock: every figure below, the decision record's included, comes from these views.
        let hc = self.cfg.health;
        let mut held = self.views();
        let views = held.current();
        // `last_resort`: variants still warming, and ejected ones, may serve too.
        let build = |last_resort: bool| -> Vec<Candidate> {
            self.variants
                .iter()
                .zip(&views)
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
                    let health = view.health_at(now_ms, &hc);
                    Candidate {
                        index: i,
                        weight: v.cfg.weight,
                        available: live
                            && fits(v)
                            && at_tier(v)
                            && view.availability.available(now_ms)
                            && in_flight < self.limit_for(i, controls.priority, now_ms),
                        health: if warming {
                            keel_core::health::FLOOR
                        } else {
                            health.weight
                        },
                        predicted_ttft_ms: health.predicted_ttft_ms,
                        ttft_samples: health.ttft_samples,
                        in_flight,
                        tier: v.cfg.tier,
                        price: v.cfg.price,
                        p95_ttft_ms: view.p95_ttft_ms,
                        queued: view.est.waiting.is_some_and(|w| hc.waiting.is_severe(w)),
                        name_hash: v.name_hash,
                    }
                })
                .collect()
        };
        let mut candidates = build(false);
        let mut plan = self.selector.plan(&candidates, &signals);
        if plan.order.is_empty() {
            // Everything else is out: a variant still warming up, or one ejected (slow, or
            // failing often but not always), beats making the client wait for the deadline.
            // Failover and the retry budget still bound what a failing one costs.
            candidates = build(true);
            plan = self.selector.plan(&candidates, &signals);
        }
        let policy = self.selector.name();
        let full = |(i, v): (usize, &Variant)| {
            fits(v)
                && at_tier(v)
                && views[i].availability.available(now_ms)
                && v.in_flight.load(Ordering::Relaxed)
                    >= self.limit_for(i, controls.priority, now_ms)
        };
        // `None`: the plan itself, moved into the selection once the record has read it.
        let refusal = if plan.order.is_empty() && self.variants.iter().enumerate().any(full) {
            Some(Selection::Full)
        } else if plan.order.is_empty() && views.iter().any(|v| v.est.loading) {
            Some(Selection::Loading)
        } else if plan.order.is_empty() {
            // The soonest a variant's cooldown ends, for the Retry-After.
            let wait = views
                .iter()
                .map(|v| v.availability.available_in_ms(now_ms))
                .filter(|ms| *ms > 0)
                .min()
                .unwrap_or(hc.probe_interval_ms.max(1000));
            Some(Selection::Unavailable {
                retry_after_ms: wait,
            })
        } else {
            None
        };
        // Costs by variant, one pass (a search per candidate is quadratic in the pool's size).
        let mut cost_by_index = vec![None; self.variants.len()];
        for &(i, c) in &plan.costs {
            if let Some(slot) = cost_by_index.get_mut(i) {
                *slot = Some(c);
            }
        }
        let kept = kept_candidates(&candidates, &plan.order, &cost_by_index);
        let omitted = omitted_summary(&candidates, &kept, plan.order.len(), |i| {
            views[i].est.state.name()
        });
        let inputs: Vec<_> = kept
            .iter()
            .map(|&k| {
                // The same figures the candidate was built from: the same view, the same time.
                let view = views[candidates[k].index];
                let f = &view.health_at(now_ms, &hc).factors;
                let factors = HealthFactors {
                    ttft: f.ttft,
                    tgsv: f.tgsv,
                    errors: f.errors,
                    kv: f.kv,
                    waiting: f.waiting,
                    ramp: f.ramp,
                };
                (
                    view.est.state.name(),
                    factors,
                    view.est.tgsv_ms.get(),
                    view.est.error_rate.get(),
                    view.est.kv_usage,
                    view.est.waiting,
                )
            })
            .collect();
        let duration = started.elapsed();
        self.metrics
            .histogram(
                "keel_decision_duration_seconds",
                &[("pool", &self.cfg.name)],
            )
            .record(duration.as_secs_f64());
        self.safety.record_decision(now_ms, duration);
        let record = DecisionRecord {
            request_id: request_id.to_owned(),
            time_unix_ms: crate::keys::limits::unix_now_ms(),
            pool: self.cfg.name.clone(),
            policy,
            affinity_key: signals.affinity_key.map(|k| format!("{k:016x}")),
            reason: if plan.order.is_empty() {
                "none_available"
            } else {
                plan.reason.as_str()
            },
            plan: plan
                .order
                .iter()
                .take(CANDIDATES_KEPT)
                .map(|i| self.variants[*i].cfg.name.clone())
                .collect(),
            candidates: kept
                .iter()
                .zip(&inputs)
                .map(|(&k, input)| {
                    let c = &candidates[k];
                    let v = &self.variants[c.index];
                    let (state, factors, tgsv_ms, error_rate, kv_usage, queue_waiting) = *input;
                    CandidateRecord {
                        variant: v.cfg.name.clone(),
                        state,
                        eligible: c.available,
                        weight: c.health * c.weight as f64,
                        configured_weight: c.weight,
                        health: c.health,
                        factors,
                        predicted_ttft_ms: c.predicted_ttft_ms,
                        p95_ttft_ms: c.p95_ttft_ms,
                        tgsv_ms,
                        error_rate,
                        kv_usage,
                        queue_waiting,
                        in_flight: c.in_flight,
                        concurrency_limit: Some(v.concurrency_limit()).filter(|l| *l != u32::MAX),
                        tier: c.tier,
                        price: c.price,
                        cost: cost_by_index[c.index],
                    }
                })
                .collect(),
            candidates_omitted: omitted,
            duration_us: duration.as_secs_f64() * 1e6,
            ..Default::default()
        };
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
    let mut ticket: Option<crate::capacity::Ticket<'_>> = None;
    loop {
        let (selection, record) = pool.select(req, controls, id);
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
            None => match pool
                .line
                .join(controls.priority, deadline, line_deadline, pool.running())
            {
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
