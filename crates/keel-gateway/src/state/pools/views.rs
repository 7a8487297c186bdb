//! What the request path reads of each variant without a lock: the view every update
//! publishes ([`Published`]), the per-thread cache the routing decision reads them through
//! ([`Views`]), and the snapshot `/keel/health` shows.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use arc_swap::ArcSwap;
use serde::Serialize;

use keel_core::continuation::ResumeMode;
use keel_core::health::{Estimates, HealthConfig, State};
use keel_core::selection::Availability;

use super::*;

/// One thread's copies of a pool's published views, one per variant (see [`Pool::views`]).
pub(crate) type ViewCache = Vec<arc_swap::Cache<Arc<ArcSwap<Published>>, Arc<Published>>>;

/// Every variant's view, held for one reader of all of them (see [`Pool::views`]).
pub(crate) enum Views<'a> {
    /// The calling thread's cache of the views.
    Cached(MutexGuard<'a, ViewCache>),
    /// Loaded one by one, because another thread sharing the cache's shard holds it.
    Loaded(Vec<Arc<Published>>),
}

impl Views<'_> {
    /// The views as of now, by variant: each stays as read while `self` lives.
    pub(crate) fn current(&mut self) -> Vec<&Published> {
        match self {
            Views::Cached(cache) => cache.iter_mut().map(|view| &**view.load()).collect(),
            Views::Loaded(views) => views.iter().map(|view| &**view).collect(),
        }
    }
}

/// What the request path reads of a variant, published by every update of its health or
/// availability: estimates, cooldowns and the TTFT quantiles, as of the last update. Figures
/// that depend on time (relaxed estimates, slow start, cooldowns) are computed from it at the
/// reader's `now_ms`, so reading a view gives what reading the state would have.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Published {
    pub(crate) est: Estimates,
    pub(crate) availability: Availability,
    pub(crate) p50_ttft_ms: Option<f64>,
    pub(crate) p95_ttft_ms: Option<f64>,
    /// The quantile the auto hedge delay uses, once the variant's samples place it (see
    /// [`Pool::hedge_delay_ms`]).
    pub(crate) hedge_ttft_ms: Option<f64>,
    /// How much longer a long prompt takes to its first token here, where its client samples
    /// show it (see [`Pool::hedge_delay_ms`]).
    pub(crate) prefill: Option<keel_core::prefill::Prefill>,
    /// Refusing connections within its restart grace (see [`Pool::mark_restarting`]).
    pub(crate) restarting: bool,
    /// The health figures selection reads, computed at publication, while they do not depend
    /// on the time (see [`Estimates::steady_until_ms`]).
    pub(super) steady: Option<Steady>,
}

/// A variant's health factors, weight and predicted TTFT at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct HealthNow {
    pub(crate) factors: keel_core::health::Factors,
    pub(crate) weight: f64,
    pub(crate) predicted_ttft_ms: f64,
    /// The samples behind `predicted_ttft_ms`.
    pub(crate) ttft_samples: f64,
    /// The mean inter-token gap estimate, and how far it still holds.
    pub(crate) gap_ms: Option<f64>,
    pub(crate) gap_trust: f64,
}

impl HealthNow {
    pub(super) fn of(est: &Estimates, now_ms: u64, hc: &HealthConfig) -> HealthNow {
        let factors = est.factors(now_ms, hc);
        HealthNow {
            factors,
            weight: est.weight_of(&factors),
            predicted_ttft_ms: est.predicted_ttft_ms(now_ms, hc),
            ttft_samples: est.ttft_ms.evidence(),
            gap_ms: est.gap_ms.get(),
            gap_trust: est.gap_trust(now_ms, hc),
        }
    }
}

/// [`HealthNow`] as it stays at any `now_ms` up to `until_ms`: a routing decision reads it
/// instead of computing it for every variant (at 256 variants that computation was the
/// largest part of a decision).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Steady {
    figures: HealthNow,
    until_ms: u64,
}

impl Published {
    /// The view of a variant's state at `now_ms`; `hedge_q` is its pool's [`hedge_quantile`].
    pub(super) fn of(st: &VariantState, hedge_q: f64, hc: &HealthConfig, now_ms: u64) -> Published {
        let h = &st.health;
        let est = h.est;
        let steady = est
            .steady_until_ms(hc)
            .filter(|until| now_ms <= *until)
            .map(|until_ms| Steady {
                figures: HealthNow::of(&est, now_ms, hc),
                until_ms,
            });
        Published {
            est,
            availability: st.availability,
            p50_ttft_ms: h.ttft_quantile_ms(0.5),
            p95_ttft_ms: h.p95_ttft_ms(),
            hedge_ttft_ms: h.supported_ttft_quantile_ms(hedge_q),
            prefill: h.prefill(),
            restarting: st.restarting_since.is_some(),
            steady,
        }
    }

    /// The health figures at `now_ms`: those computed at publication while they still hold,
    /// else computed now. In slow start only the ramp moves with the time, so only the ramp
    /// is computed per read (a fleet just deployed is all in slow start, and computing every
    /// figure took exponentials per variant per decision).
    pub(crate) fn health_at(&self, now_ms: u64, hc: &HealthConfig) -> HealthNow {
        match self.steady {
            Some(s) if now_ms <= s.until_ms => {
                let mut figures = s.figures;
                if matches!(self.est.state, State::SlowStart { .. }) {
                    figures.factors.ramp = self.est.ramp(now_ms, hc);
                    figures.weight = self.est.weight_of(&figures.factors);
                }
                figures
            }
            _ => HealthNow::of(&self.est, now_ms, hc),
        }
    }
}

/// What `/keel/health` and the gauges show for a variant.
#[derive(Debug, Clone, Serialize)]
pub struct VariantSnapshot {
    pub name: String,
    /// What its upstream speaks (`protocol` as configured: `bedrock`, `azure`, …).
    pub dialect: &'static str,
    pub state: &'static str,
    pub state_code: u8,
    pub available: bool,
    pub cooldown_ms: u64,
    /// What is left of another replica's ejection or cooldown of it (see `signals`; 0: none).
    pub shared_hold_ms: u64,
    pub credential_broken: bool,
    pub weight: f64,
    pub ttft_ms: Option<f64>,
    pub p95_ttft_ms: Option<f64>,
    /// Its decode pace: the mean inter-token gap of its recent streams (and probes).
    pub gap_ms: Option<f64>,
    pub tgsv_ms: Option<f64>,
    pub error_rate: Option<f64>,
    /// The share of its client streams that broke after their first token (see
    /// `keel_core::health::HealthConfig::break_rate`).
    pub break_rate: Option<f64>,
    pub kv_usage: Option<f64>,
    pub waiting: Option<f64>,
    pub in_flight: u32,
    /// The concurrency limit in force (configured, from the connection caps, or learned from
    /// 429s); `None`: unlimited.
    pub concurrency_limit: Option<u32>,
    /// Upstream connections open under its `max_connections` (busy or idle); `None`: no cap.
    pub connections_held: Option<u32>,
    /// How it continues a generation started elsewhere: its configured `resume`, or
    /// `instruction` once it refused a prefill.
    pub resume: ResumeMode,
    /// `resume` was learned (the variant refused a prefill), not configured.
    pub resume_learned: bool,
}

impl Pool {
    pub(super) fn publish(&self, st: &VariantState, index: usize) {
        let live = Published::of(
            st,
            hedge_quantile(&self.cfg),
            &self.cfg.health,
            self.now_ms(),
        );
        self.variants[index].live.store(Arc::new(live));
    }
    /// Variant `index`'s published view.
    /// (A guard, not a copy of the view: hold it briefly.)
    pub(crate) fn live(&self, index: usize) -> arc_swap::Guard<Arc<Published>> {
        self.variants[index].live.load()
    }
    /// Every variant's view, for a reader of all of them (the routing decision; read them with
    /// [`Views::current`]), through the calling thread's cache of the views: a view that has
    /// not changed since this thread last read it costs one load of a pointer, and each stays
    /// as read while the guard lives (every figure a decision takes from the views comes from
    /// the same views). At 256 variants `arc-swap`'s protected load per view, and a copy of
    /// what the decision read of each, were a quarter of a decision.
    /// A thread whose shard another thread holds (threads beyond the number of cores share
    /// shards) does not wait: it loads each view, as the cache would when every view changed.
    pub(crate) fn views(&self) -> Views<'_> {
        match self.views.try_shard(self.views.own_index()) {
            Some(cache) => Views::Cached(cache),
            None => Views::Loaded(self.variants.iter().map(|v| v.live.load_full()).collect()),
        }
    }
    pub fn snapshot(&self) -> Vec<VariantSnapshot> {
        let now = self.now_ms();
        let hc = self.cfg.health;
        self.variants
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let st = self.variant_state(i);
                let h = &st.health;
                let a = st.availability;
                VariantSnapshot {
                    name: v.cfg.name.clone(),
                    dialect: v.cfg.dialect.name(),
                    state: h.est.state.name(),
                    state_code: h.est.state.code(),
                    available: a.available(now)
                        && !a.shared_ejected(now)
                        && !matches!(h.est.state, State::Ejected { .. }),
                    cooldown_ms: a.available_in_ms(now),
                    shared_hold_ms: a.shared_hold_ms(now),
                    credential_broken: a.credential_broken,
                    weight: h.weight(now, &hc) * v.cfg.weight as f64,
                    ttft_ms: h.est.ttft_ms.get(),
                    p95_ttft_ms: h.p95_ttft_ms(),
                    gap_ms: h.est.gap_ms.get(),
                    tgsv_ms: h.est.tgsv_ms.get(),
                    error_rate: h.est.error_rate.get(),
                    break_rate: h.est.break_rate.get(),
                    kv_usage: h.est.kv_usage,
                    waiting: h.est.waiting,
                    in_flight: v.in_flight.load(Ordering::Relaxed),
                    concurrency_limit: Some(v.concurrency_limit()).filter(|l| *l != u32::MAX),
                    connections_held: self.client.connections_held(&v.cfg.name),
                    resume: v.resume(),
                    resume_learned: v.resume_learned(),
                }
            })
            .collect()
    }
}
