//! Runtime state of pools and variants, and stage 1 (selection) as the gateway drives it: live
//! health (`keel_core::health`) and cooldowns turned into candidates for the pure policy
//! (`keel_core::selection`), with eligibility filters (ejection, warm-up, concurrency limit,
//! context window, tier floor) and a decision record for every request.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;

use crate::capacity::{Limit, WaitLine};
use keel_core::budget::{RetryBudget, RetryBudgetConfig};
use keel_core::health::{State, TtftWindow, VariantHealth};
use keel_core::protocol::Protocol;
use keel_core::request::CanonicalRequest;
use keel_core::rng::hash_bytes;
use keel_core::selection::{self, Availability, Candidate, Preference, RequestSignals, Selector};

use crate::config::{Affinity, PoolConfig, VariantConfig};

/// One variant at run time.
#[derive(Debug)]
pub struct Variant {
    pub cfg: VariantConfig,
    pub in_flight: AtomicU32,
    /// Concurrency limit learned from the variant's 429s.
    pub limit: Limit,
    name_hash: u64,
}

struct PoolState {
    selector: Box<dyn Selector>,
    /// Hedges may add at most `hedge_budget` of the pool's requests (sliding 10 s window).
    hedges: RetryBudget,
    /// Recent client TTFTs over the whole pool: the auto hedge delay before a variant has its
    /// own, the median assumed for a variant without samples.
    ttft: TtftWindow,
    availability: Vec<Availability>,
    health: Vec<VariantHealth>,
    /// A warm-up or probe request is in flight for this variant.
    maintenance_busy: Vec<bool>,
}

/// Client TTFT samples in a pool's window (the hedge delay's quantile).
const POOL_TTFT_SAMPLES: usize = 512;

/// One pool at run time.
pub struct Pool {
    pub cfg: PoolConfig,
    pub protocol: Protocol,
    pub variants: Vec<Variant>,
    /// Upstream HTTP client (connection pool) with this pool's connect timeout.
    pub client: reqwest::Client,
    state: Mutex<PoolState>,
    /// The gateway's clock origin: `now_ms` is milliseconds since then.
    epoch: Instant,
    /// Requests waiting for a slot while every variant is at its concurrency limit.
    pub line: WaitLine,
}

/// What selection produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Variant indexes in order: primary first.
    Plan(Vec<usize>),
    /// Every variant is cooling down or ejected; retry after this long.
    Unavailable { retry_after_ms: u64 },
    /// Every variant that could serve is at its concurrency limit (configured or learned):
    /// wait in line for a slot.
    Full,
    /// The request does not fit any variant's context window.
    TooLong { needed: u64, largest: u64 },
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
}

/// One candidate in a decision record.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateRecord {
    pub variant: String,
    pub state: &'static str,
    pub eligible: bool,
    pub weight: f64,
    pub predicted_ttft_ms: f64,
    pub in_flight: u32,
    pub cost: Option<f64>,
}

/// Why a request went where it went.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    pub request_id: String,
    pub pool: String,
    pub policy: &'static str,
    pub reason: &'static str,
    pub plan: Vec<String>,
    pub candidates: Vec<CandidateRecord>,
    pub duration_us: f64,
}

/// Decrements a variant's in-flight count when dropped (also when a stream is cancelled).
pub struct InFlight {
    pub(crate) pool: Arc<Pool>,
    pub(crate) index: usize,
    since: Instant,
    /// The attempt is serving the client: its holding time feeds the wait line's estimate
    /// (refused or cancelled attempts would make slots look quicker to free than they are).
    pub(crate) serving: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.pool.variants[self.index]
            .in_flight
            .fetch_sub(1, Ordering::Relaxed);
        let held_us = self.since.elapsed().as_secs_f64() * 1e6;
        self.pool.line.freed(self.serving.then_some(held_us));
    }
}

/// Maintenance work the monitor performs for a variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Maintenance {
    Probe(usize),
    WarmUp(usize),
}

/// What `/keel/health` and the gauges show for a variant.
#[derive(Debug, Clone, Serialize)]
pub struct VariantSnapshot {
    pub name: String,
    pub state: &'static str,
    pub state_code: u8,
    pub available: bool,
    pub cooldown_ms: u64,
    pub credential_broken: bool,
    pub weight: f64,
    pub ttft_ms: Option<f64>,
    pub p95_ttft_ms: Option<f64>,
    pub tgsv_ms: Option<f64>,
    pub error_rate: Option<f64>,
    pub kv_usage: Option<f64>,
    pub waiting: Option<f64>,
    pub in_flight: u32,
    /// The concurrency limit in force (configured or learned from 429s); `None`: unlimited.
    pub concurrency_limit: Option<u32>,
}

impl Variant {
    /// The lower of the configured `max_concurrency` and the limit learned from 429s.
    pub fn concurrency_limit(&self) -> u32 {
        self.cfg
            .max_concurrency
            .unwrap_or(u32::MAX)
            .min(self.limit.get())
    }
}

impl Pool {
    pub fn new(cfg: PoolConfig, client: reqwest::Client, epoch: Instant) -> Self {
        let variants: Vec<Variant> = cfg
            .variants
            .iter()
            .map(|v| Variant {
                cfg: v.clone(),
                in_flight: AtomicU32::new(0),
                limit: Limit::default(),
                name_hash: hash_bytes(0x6e61_6d65, v.name.as_bytes()),
            })
            .collect();
        let protocol = cfg.variants[0].protocol;
        let n = variants.len();
        let seed = hash_bytes(epoch.elapsed().as_nanos() as u64, cfg.name.as_bytes())
            ^ std::process::id() as u64;
        let selector = selection::policy(cfg.policy, seed);
        let health = (0..n)
            .map(|_| VariantHealth::new(cfg.health.prewarm_requests))
            .collect();
        Pool {
            protocol,
            variants,
            client,
            state: Mutex::new(PoolState {
                selector,
                hedges: RetryBudget::new(RetryBudgetConfig {
                    ratio: cfg.hedge_budget,
                    window_ms: 10_000,
                    min_retries_per_sec: 0,
                }),
                ttft: TtftWindow::with_capacity(POOL_TTFT_SAMPLES),
                availability: vec![Availability::default(); n],
                health,
                maintenance_busy: vec![false; n],
            }),
            epoch,
            cfg,
            line: WaitLine::default(),
        }
    }

    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // The state is plain data updated in one step; a poisoned lock still holds valid data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The affinity key of a request under this pool's affinity mode.
    pub fn affinity_key(&self, req: &CanonicalRequest) -> Option<u64> {
        match self.cfg.affinity {
            Affinity::None => None,
            Affinity::Session => req.session_key(),
            Affinity::Prefix => req.prefix_key(),
        }
    }

    /// Stage 1: an ordered plan for this request, and its decision record.
    pub fn select(
        &self,
        req: &CanonicalRequest,
        controls: Controls<'_>,
        request_id: &str,
    ) -> (Selection, Option<DecisionRecord>) {
        let started = Instant::now();
        let now_ms = self.now_ms();
        // A forced variant (tests, debugging) becomes the primary; the plan's other variants
        // stay as fallbacks and migration targets.
        let forced = match controls.force_variant {
            Some(name) => match self.variants.iter().position(|v| v.cfg.name == name) {
                Some(i) => Some(i),
                None => return (Selection::NoSuchVariant(name.to_owned()), None),
            },
            None => None,
        };
        let needed = req.estimated_input_tokens + req.max_tokens.unwrap_or(0);
        let fits = |v: &Variant| v.cfg.context_window.is_none_or(|w| needed <= w);
        if !self.variants.iter().any(fits) {
            let largest = self
                .variants
                .iter()
                .filter_map(|v| v.cfg.context_window)
                .max()
                .unwrap_or(0);
            return (Selection::TooLong { needed, largest }, None);
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
        let mut st = self.state();
        let hc = self.cfg.health;
        let build = |st: &PoolState, allow_warming: bool| -> Vec<Candidate> {
            self.variants
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let h = &st.health[i];
                    let warming = matches!(h.state, State::Warming { .. });
                    let live = match h.state {
                        State::Ejected { .. } => false,
                        State::Warming { .. } => allow_warming,
                        _ => true,
                    };
                    let in_flight = v.in_flight.load(Ordering::Relaxed);
                    Candidate {
                        index: i,
                        weight: v.cfg.weight,
                        available: live
                            && fits(v)
                            && at_tier(v)
                            && st.availability[i].available(now_ms)
                            && in_flight < v.concurrency_limit(),
                        health: if warming {
                            keel_core::health::FLOOR
                        } else {
                            h.weight(now_ms, &hc)
                        },
                        predicted_ttft_ms: h.predicted_ttft_ms(now_ms, &hc),
                        in_flight,
                        tier: v.cfg.tier,
                        price: v.cfg.price,
                        p95_ttft_ms: h.p95_ttft_ms(),
                        name_hash: v.name_hash,
                    }
                })
                .collect()
        };
        let mut candidates = build(&st, false);
        let mut plan = st.selector.plan(&candidates, &signals);
        if plan.order.is_empty()
            && st
                .health
                .iter()
                .any(|h| matches!(h.state, State::Warming { .. }))
        {
            // Everything else is out: a variant still warming up beats an error.
            candidates = build(&st, true);
            plan = st.selector.plan(&candidates, &signals);
        }
        let policy = st.selector.name();
        let full = |(i, v): (usize, &Variant)| {
            !matches!(st.health[i].state, State::Ejected { .. })
                && fits(v)
                && at_tier(v)
                && st.availability[i].available(now_ms)
                && v.in_flight.load(Ordering::Relaxed) >= v.concurrency_limit()
        };
        let selection = if plan.order.is_empty() && self.variants.iter().enumerate().any(full) {
            Selection::Full
        } else if plan.order.is_empty() {
            let wait = st
                .availability
                .iter()
                .map(|a| a.available_in_ms(now_ms))
                .filter(|ms| *ms > 0)
                .min()
                .unwrap_or(hc.probe_interval_ms.max(1000));
            Selection::Unavailable {
                retry_after_ms: wait,
            }
        } else {
            Selection::Plan(plan.order.clone())
        };
        let selection = match forced {
            Some(i) => {
                let mut order = vec![i];
                order.extend(plan.order.iter().copied().filter(|j| *j != i));
                Selection::Plan(order)
            }
            None => selection,
        };
        let states: Vec<&'static str> = st.health.iter().map(|h| h.state.name()).collect();
        drop(st);
        let duration = started.elapsed();
        metrics::histogram!("keel_decision_duration_seconds", "pool" => self.cfg.name.clone())
            .record(duration.as_secs_f64());
        let record = DecisionRecord {
            request_id: request_id.to_owned(),
            pool: self.cfg.name.clone(),
            policy,
            reason: if plan.order.is_empty() {
                "none_available"
            } else {
                plan.reason.as_str()
            },
            plan: plan
                .order
                .iter()
                .map(|i| self.variants[*i].cfg.name.clone())
                .collect(),
            candidates: candidates
                .iter()
                .map(|c| CandidateRecord {
                    variant: self.variants[c.index].cfg.name.clone(),
                    state: states[c.index],
                    eligible: c.available,
                    weight: c.health * c.weight as f64,
                    predicted_ttft_ms: c.predicted_ttft_ms,
                    in_flight: c.in_flight,
                    cost: plan.costs.iter().find(|(i, _)| *i == c.index).map(|x| x.1),
                })
                .collect(),
            duration_us: duration.as_secs_f64() * 1e6,
        };
        (selection, Some(record))
    }

    /// Whether a variant may be tried now (re-checked before every attempt).
    pub fn available(&self, index: usize, now_ms: u64) -> bool {
        let st = self.state();
        st.availability[index].available(now_ms)
            && !matches!(st.health[index].state, State::Ejected { .. })
    }

    /// Expected wait (ms) for a request joining the back of the wait line now, from the
    /// requests running on every variant (see `capacity`); `None` before any was measured.
    pub fn expected_wait_ms(&self) -> Option<u64> {
        let running = self
            .variants
            .iter()
            .map(|v| v.in_flight.load(Ordering::Relaxed))
            .sum();
        self.line.expected_wait_ms(self.line.waiting(), running)
    }

    /// Whether hedging is on for this pool.
    pub fn hedging(&self) -> bool {
        !matches!(self.cfg.hedge, crate::config::Hedge::Off)
    }

    /// Waits in the pool's line until the variant is below its concurrency limit: false when
    /// that takes longer than `queue_ms` or the deadline allows. A retry after a "full" 429
    /// goes through here, so it waits for a slot instead of being refused again at once.
    pub async fn wait_for_slot(&self, index: usize, deadline: tokio::time::Instant) -> bool {
        let v = &self.variants[index];
        let below = || v.in_flight.load(Ordering::Relaxed) < v.concurrency_limit();
        if below() {
            return true;
        }
        let until = (tokio::time::Instant::now()
            + std::time::Duration::from_millis(self.cfg.queue_ms))
        .min(deadline);
        let ticket = self.line.join();
        while !below() {
            if tokio::time::timeout_at(until, ticket.slot_freed())
                .await
                .is_err()
            {
                return false;
            }
        }
        true
    }

    pub fn cool_down(&self, index: usize, now_ms: u64, for_ms: u64) {
        self.state().availability[index].cool_down(now_ms, for_ms);
    }

    pub fn mark_credential_broken(&self, index: usize, now_ms: u64) {
        // Re-check a refused credential once a minute: keys get rotated back in.
        self.state().availability[index].mark_credential_broken(now_ms, 60_000);
    }

    pub fn record_success(&self, index: usize) {
        self.state().availability[index].record_success();
    }

    /// Feeds one attempt's outcome to the variant's health: `ok` is false only for backend
    /// failures; `ttft_ms` is the time to the first token (or whole body).
    pub fn record_attempt(&self, index: usize, ok: bool, ttft_ms: Option<f64>) {
        let now = self.now_ms();
        let hc = self.cfg.health;
        let mut st = self.state();
        if let Some(t) = ttft_ms {
            st.ttft.record(now, t);
        }
        let h = &mut st.health[index];
        if let Some(t) = ttft_ms {
            h.record_ttft(now, t, &hc);
        }
        h.record_outcome(now, ok, &hc);
        h.tick(now, &hc);
    }

    /// Feeds a lower bound of a TTFT: an attempt cancelled `ms` after it started, before its
    /// first token (it lost a hedge race).
    pub fn record_late_ttft(&self, index: usize, ms: f64) {
        let now = self.now_ms();
        let hc = self.cfg.health;
        self.state().health[index].record_late_ttft(now, ms, &hc);
    }

    /// Feeds a finished stream's inter-token gaps.
    pub fn record_stream(&self, index: usize, gaps_ms: &[f64]) {
        let now = self.now_ms();
        let hc = self.cfg.health;
        let mut st = self.state();
        st.health[index].record_stream_gaps(now, gaps_ms, &hc);
        st.health[index].tick(now, &hc);
    }

    pub fn record_scrape(&self, index: usize, kv_usage: Option<f64>, waiting: Option<f64>) {
        self.state().health[index].record_scrape(kv_usage, waiting);
    }

    /// Advances every variant's lifecycle and returns the probes and warm-ups due now.
    pub fn maintenance(&self) -> Vec<Maintenance> {
        let now = self.now_ms();
        let hc = self.cfg.health;
        let mut st = self.state();
        let mut out = Vec::new();
        for i in 0..self.variants.len() {
            st.health[i].tick(now, &hc);
            if st.maintenance_busy[i] {
                continue;
            }
            if st.health[i].take_probe(now, &hc) {
                st.maintenance_busy[i] = true;
                out.push(Maintenance::Probe(i));
            } else if matches!(st.health[i].state, State::Warming { .. }) {
                st.maintenance_busy[i] = true;
                out.push(Maintenance::WarmUp(i));
            }
        }
        out
    }

    /// The result of a probe or warm-up request.
    pub fn maintenance_done(&self, m: Maintenance, ok: bool, ttft_ms: Option<f64>) {
        let now = self.now_ms();
        let hc = self.cfg.health;
        let mut st = self.state();
        match m {
            Maintenance::Probe(i) => {
                st.maintenance_busy[i] = false;
                st.health[i].probe_result(now, ok, ttft_ms, &hc);
            }
            Maintenance::WarmUp(i) => {
                st.maintenance_busy[i] = false;
                if ok {
                    if let Some(t) = ttft_ms {
                        st.health[i].record_ttft(now, t, &hc);
                    }
                    st.health[i].record_outcome(now, true, &hc);
                }
            }
        }
    }

    pub fn snapshot(&self) -> Vec<VariantSnapshot> {
        let now = self.now_ms();
        let hc = self.cfg.health;
        let st = self.state();
        self.variants
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let h = &st.health[i];
                let a = st.availability[i];
                VariantSnapshot {
                    name: v.cfg.name.clone(),
                    state: h.state.name(),
                    state_code: h.state.code(),
                    available: a.available(now) && !matches!(h.state, State::Ejected { .. }),
                    cooldown_ms: a.available_in_ms(now),
                    credential_broken: a.credential_broken,
                    weight: h.weight(now, &hc) * v.cfg.weight as f64,
                    ttft_ms: h.ttft_ms.get(),
                    p95_ttft_ms: h.p95_ttft_ms(),
                    tgsv_ms: h.tgsv_ms.get(),
                    error_rate: h.error_rate.get(),
                    kv_usage: h.kv_usage,
                    waiting: h.waiting,
                    in_flight: v.in_flight.load(Ordering::Relaxed),
                    concurrency_limit: Some(v.concurrency_limit()).filter(|l| *l != u32::MAX),
                }
            })
            .collect()
    }

    /// The stall threshold for a stream on this variant: adaptive, max(4 × its P99-ish gap
    /// (mean + 3 standard deviations), 500 ms), capped by the pool's `stall_ms`; or `stall_ms`.
    pub fn stall_threshold_ms(&self, index: usize) -> u64 {
        let cap = self.cfg.timeouts.stall_ms;
        if !self.cfg.adaptive_stall {
            return cap;
        }
        let st = self.state();
        let h = &st.health[index];
        match h.gap_ms.get() {
            Some(gap) => {
                let p99ish = gap + 3.0 * h.tgsv_ms.get().unwrap_or(gap);
                ((4.0 * p99ish).max(500.0) as u64).min(cap)
            }
            None => cap,
        }
    }

    /// Counts a request for the hedge budget.
    pub fn count_request(&self) {
        let now = self.now_ms();
        self.state().hedges.record_request(now);
    }

    /// The hedge delay when `target` would take the hedge, or `None` when hedging is off: the
    /// configured delay, or (auto) the target's recent TTFT quantile at 1 − hedge_budget/2 (the
    /// whole pool's before the target has samples), clamped to 50 ms–2 s (2 s before any sample).
    ///
    /// Why that quantile: hedging after it races about half the budget's share of requests, so
    /// the budget is there for the slow first tokens instead of running out on ordinary ones.
    /// Why the target's: the question is whether the hedge would likely answer sooner, so a
    /// primary that is slow by nature (a far zone, a degraded replica) is raced as soon as the
    /// target would usually have answered, not once it is late by its own slow standard, and a
    /// pool-wide figure would carry the slow zone's samples.
    pub fn hedge_delay_ms(&self, target: usize) -> Option<u64> {
        match self.cfg.hedge {
            crate::config::Hedge::Off => None,
            crate::config::Hedge::AfterMs(ms) => Some(ms),
            crate::config::Hedge::Auto => {
                let q = (1.0 - self.cfg.hedge_budget / 2.0).clamp(0.5, 0.99);
                let st = self.state();
                let delay = st.health[target]
                    .ttft_quantile_ms(q)
                    .or_else(|| st.ttft.quantile(q))
                    .unwrap_or(2000.0);
                Some(delay.clamp(50.0, 2000.0) as u64)
            }
        }
    }

    /// The variant of `candidates` that could take a hedge now (available, below its
    /// concurrency limit, not ejected, warming or floored by its health) and would most likely
    /// answer first: the lowest recent median TTFT × (in flight + 1).
    ///
    /// Not simply the plan's next variant: the plan ranks by live estimates that relax toward
    /// zero while a variant is idle (so that it gets re-measured), and a hedge is no place for
    /// re-measuring a variant that was slow the last time it was seen.
    pub fn hedge_target(&self, candidates: &[usize]) -> Option<usize> {
        let now = self.now_ms();
        let hc = self.cfg.health;
        let st = self.state();
        let unknown = st.ttft.quantile(0.5).unwrap_or(0.0);
        candidates
            .iter()
            .copied()
            .filter(|&i| {
                let v = &self.variants[i];
                st.availability[i].available(now)
                    && matches!(st.health[i].state, State::Healthy | State::SlowStart { .. })
                    && st.health[i].weight(now, &hc) > keel_core::health::FLOOR
                    && v.in_flight.load(Ordering::Relaxed) < v.concurrency_limit()
            })
            .map(|i| {
                let median = st.health[i].ttft_quantile_ms(0.5).unwrap_or(unknown);
                let load = self.variants[i].in_flight.load(Ordering::Relaxed) as f64 + 1.0;
                (i, median * load)
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(i, _)| i)
    }

    /// The variant a hedge goes to now, if one can take it and the hedge budget allows one
    /// more (then counted).
    pub fn try_hedge(&self, candidates: &[usize]) -> Option<usize> {
        let target = self.hedge_target(candidates)?;
        let now = self.now_ms();
        self.state().hedges.try_retry(now).then_some(target)
    }

    /// The variant's baseline inter-token gap, for slowdown detection.
    pub fn baseline_gap_ms(&self, index: usize) -> Option<f64> {
        self.state().health[index].baseline_gap_ms()
    }

    /// Counts a request on a variant until the guard drops.
    pub fn enter(self: &Arc<Self>, index: usize) -> InFlight {
        self.variants[index]
            .in_flight
            .fetch_add(1, Ordering::Relaxed);
        InFlight {
            pool: self.clone(),
            index,
            since: Instant::now(),
            serving: false,
        }
    }
}
