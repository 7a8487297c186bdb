//! Runtime state of pools and variants: live health (`keel_core::health`), cooldowns and
//! credentials, in-flight counts and learned concurrency limits, the hedge budget, and the
//! lifecycle the monitor advances (probes, warm-ups). Selection reads it (`selection`);
//! settlement writes it (`settlement`).
//!
//! **No shared lock on the request path.** Updates (an attempt's outcome, a cooldown, the
//! monitor's tick) take the lock of the one variant they change ([`VariantState`]), and each
//! ends by publishing that variant's [`Live`] view: a `Copy` of its estimates and availability,
//! swapped in atomically (`arc-swap`); so requests finishing on different variants never wait
//! for each other. What every request reads (the routing decision, the availability re-check
//! before each attempt, the hedge delay and target, the stall thresholds) reads those views and
//! never waits for a lock. The routing decision, which reads every variant's view, reads them
//! through a per-thread cache of the views ([`Pool::views`]): one plain load per variant while
//! its view has not changed, instead of `arc-swap`'s protected load. In-flight counts and slot
//! admission are atomics, the policy's own state is atomic (`keel_core::p2c`), and what every
//! request counts into the whole pool (the hedge and probe budgets, the pool's TTFT window, the
//! wait line's drain rate) is counted per thread ([`PerThread`]). `benches/pool.rs` measures a request's work on the pool from one and
//! from two threads at once.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use arc_swap::ArcSwap;
use serde::Serialize;

use crate::capacity::{Limit, WaitLine, Wake};
use crate::per_thread::PerThread;
use crate::retry_budget::ShardedBudget;
use keel_core::budget::RetryBudgetConfig;
use keel_core::continuation::ResumeMode;
use keel_core::health::{Estimates, HealthConfig, State, TtftWindow, VariantHealth};
use keel_core::protocol::Protocol;
use keel_core::queue::Priority;
use keel_core::request::CanonicalRequest;
use keel_core::rng::hash_bytes;
use keel_core::selection::{self, Availability, Selector};

use crate::config::{Affinity, PoolConfig, VariantConfig};
use crate::metrics::Metrics;

/// One variant at run time.
#[derive(Debug)]
pub struct Variant {
    pub cfg: VariantConfig,
    /// Shared with the same variant in the next config generation when its definition did not
    /// change (see `live`), so both count the requests running on it.
    pub in_flight: Arc<AtomicU32>,
    /// Concurrency limit learned from the variant's 429s (shared like `in_flight`).
    pub limit: Arc<Limit>,
    /// The variant refused a `prefill` continuation ("does not support assistant message
    /// prefill"): it continues in `instruction` mode for the rest of its life.
    prefill_refused: AtomicBool,
    pub(crate) name_hash: u64,
    /// What updates of this variant read and write together, behind its own lock.
    state: Mutex<VariantState>,
    /// The variant's health and availability as last published (see the module's notes);
    /// shared with the per-thread caches of the views ([`Pool::views`]).
    live: Arc<ArcSwap<Live>>,
}

/// One thread's copies of a pool's published views, one per variant (see [`Pool::views`]).
pub(crate) type ViewCache = Vec<arc_swap::Cache<Arc<ArcSwap<Live>>, Arc<Live>>>;

/// Every variant's view, held for one reader of all of them (see [`Pool::views`]).
pub(crate) enum Views<'a> {
    /// The calling thread's cache of the views.
    Cached(MutexGuard<'a, ViewCache>),
    /// Loaded one by one, because another thread sharing the cache's shard holds it.
    Loaded(Vec<Arc<Live>>),
}

impl Views<'_> {
    /// The views as of now, by variant: each stays as read while `self` lives.
    pub(crate) fn current(&mut self) -> Vec<&Live> {
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
pub(crate) struct Live {
    pub(crate) est: Estimates,
    pub(crate) availability: Availability,
    pub(crate) p50_ttft_ms: Option<f64>,
    pub(crate) p95_ttft_ms: Option<f64>,
    /// The quantile the auto hedge delay uses (see [`Pool::hedge_delay_ms`]).
    pub(crate) hedge_ttft_ms: Option<f64>,
    /// Refusing connections within its restart grace (see [`Pool::mark_restarting`]).
    pub(crate) restarting: bool,
    /// The health figures selection reads, computed at publication, while they do not depend
    /// on the time (see [`Estimates::steady_until_ms`]).
    steady: Option<Steady>,
}

/// A variant's health factors, weight and predicted TTFT at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct HealthNow {
    pub(crate) factors: keel_core::health::Factors,
    pub(crate) weight: f64,
    pub(crate) predicted_ttft_ms: f64,
    /// The samples behind `predicted_ttft_ms`.
    pub(crate) ttft_samples: f64,
}

impl HealthNow {
    fn of(est: &Estimates, now_ms: u64, hc: &HealthConfig) -> HealthNow {
        let factors = est.factors(now_ms, hc);
        HealthNow {
            factors,
            weight: est.weight_of(&factors),
            predicted_ttft_ms: est.predicted_ttft_ms(now_ms, hc),
            ttft_samples: est.ttft_ms.evidence(),
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

impl Live {
    /// The view of a variant's state at `now_ms`; `hedge_q` is its pool's [`hedge_quantile`].
    fn of(st: &VariantState, hedge_q: f64, hc: &HealthConfig, now_ms: u64) -> Live {
        let h = &st.health;
        let est = h.est;
        let steady = est
            .steady_until_ms(hc)
            .filter(|until| now_ms <= *until)
            .map(|until_ms| Steady {
                figures: HealthNow::of(&est, now_ms, hc),
                until_ms,
            });
        Live {
            est,
            availability: st.availability,
            p50_ttft_ms: h.ttft_quantile_ms(0.5),
            p95_ttft_ms: h.p95_ttft_ms(),
            hedge_ttft_ms: h.ttft_quantile_ms(hedge_q),
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

/// How long a warming variant waits after `failures` warm-ups (or readiness checks) failed in
/// a row: none after none, then 100 ms doubling to a second. A variant back from a restart is
/// noticed within a second; a dead one costs a connection attempt a second, not ten.
pub(crate) fn warm_up_backoff_ms(failures: u32) -> u64 {
    match failures {
        0 => 0,
        n => (100u64 << (n - 1).min(4)).min(1000),
    }
}

impl VariantState {
    fn warm_up_failed(&mut self, now_ms: u64) {
        self.warm_up_failures = self.warm_up_failures.saturating_add(1);
        self.warm_up_failed_at_ms = now_ms;
    }
}

/// The quantile of TTFT the auto hedge delay waits for: 1 − hedge_budget / 2.
fn hedge_quantile(cfg: &PoolConfig) -> f64 {
    (1.0 - cfg.hedge_budget / 2.0).clamp(0.5, 0.99)
}

/// One variant's state behind its lock: what updates read and write together.
#[derive(Debug, Clone)]
pub(crate) struct VariantState {
    pub(crate) health: VariantHealth,
    pub(crate) availability: Availability,
    /// A warm-up or probe request is in flight for this variant.
    pub(crate) maintenance_busy: bool,
    /// Warm-ups (or readiness checks) failed in a row since the variant last answered one:
    /// the next waits [`warm_up_backoff_ms`] after the last, so a dead variant costs one
    /// connection attempt a second instead of one a monitor tick.
    pub(crate) warm_up_failures: u32,
    /// When the last failed warm-up ended (ms, the pool's clock).
    pub(crate) warm_up_failed_at_ms: u64,
    /// Readiness (see [`Pool::mark_ready`]): the variant's health endpoint answered 200 since
    /// it last went loading or restarting.
    pub(crate) ready: bool,
    /// Since when the variant has been refusing connections (a restart), if it is.
    pub(crate) restarting_since: Option<u64>,
    /// A client's request met a refusal that keel's own request must confirm
    /// ([`Maintenance::Confirm`]) before it counts against the variant.
    pub(crate) confirm: bool,
}

/// Client TTFT samples in a pool's window (the hedge delay's quantile), over all its shards.
const POOL_TTFT_SAMPLES: usize = 512;
/// The fewest a shard keeps.
const POOL_TTFT_SHARD_MIN: usize = 64;

/// One pool at run time.
pub struct Pool {
    pub cfg: PoolConfig,
    /// The first variant's protocol (a pool may mix protocols: see [`Pool::speaks`]).
    pub protocol: Protocol,
    pub variants: Vec<Variant>,
    /// Upstream HTTP client (connection pool) with this pool's connect timeout.
    pub client: crate::upstream::Client,
    /// Recent client TTFTs over the whole pool: the auto hedge delay before a variant has its
    /// own, the median assumed for a variant without samples. Recorded per thread (every
    /// attempt with a first token records one) and combined only when read, which is only for
    /// a variant without samples of its own.
    ttft: PerThread<TtftWindow>,
    /// Each thread's cache of the variants' views, for the routing decision (see
    /// [`Pool::views`]).
    views: PerThread<ViewCache>,
    /// The selection policy (shared by every request without a lock: `Selector::plan` takes
    /// `&self`).
    pub(crate) selector: Box<dyn Selector>,
    /// Hedges may add at most `hedge_budget` of the pool's requests (sliding 10 s window).
    hedges: ShardedBudget,
    /// Refresh probes may add at most `probe_budget` of the pool's requests (10 s window).
    probes: ShardedBudget,
    /// The gateway's clock origin: `now_ms` is milliseconds since then.
    pub(crate) epoch: Instant,
    /// Requests waiting for a slot while every variant is at its concurrency limit.
    pub line: WaitLine,
    /// The gateway's metrics registry.
    pub metrics: Arc<Metrics>,
    /// Bounds on what is read from upstreams.
    pub limits: UpstreamLimits,
    /// When (`now_ms` + 1) the pool last admitted a high-priority request; 0: never.
    high_seen: AtomicU64,
    /// The pool's health colour and safe mode (see `safe_mode`); kept across a config reload.
    pub safety: Arc<crate::safe_mode::Safety>,
    /// `[pools.canary]`'s split and its state (see `canary`).
    pub canary: Option<crate::canary::CanaryRuntime>,
    /// `[pools.shadow]`'s variants and their comparisons (see `shadow`).
    pub shadow: Option<crate::shadow::Shadow>,
    /// The template miner and recent requests of a pool that fingerprints its requests
    /// (`fingerprint = true`; see `analysis`).
    pub analysis: Option<crate::analysis::Analysis>,
}

/// How long after the last high-priority request its share of capacity stays reserved.
const HIGH_RESERVE_FOR_MS: u64 = 10_000;

/// The shortest silence that starts a speculative continuation: below it, scheduling noise on
/// a loaded machine alone would start races.
pub const QUIET_FLOOR_MS: u64 = 40;

/// Bounds on what keel reads from an upstream (see `attempt`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpstreamLimits {
    /// A whole response body.
    pub max_body_bytes: usize,
    /// One SSE event; also the most a held tool call may accumulate.
    pub max_event_bytes: usize,
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
    /// An ejected variant: is it well again?
    Probe(usize),
    /// A new, returning or loading variant, before client traffic.
    WarmUp(usize),
    /// A serving variant without recent evidence: re-measure it (within the probe budget).
    Refresh(usize),
    /// A readiness check on the variant's health endpoint (no generation), before warm-ups.
    Ready(usize),
    /// A client's request met a refusal that the client may have caused (a 401/403, a long
    /// `retry-after`): a request of keel's own, carrying nothing of any client's, decides
    /// whether the variant is marked for everyone (see `settlement`).
    Confirm(usize),
}

impl Maintenance {
    pub fn variant(self) -> usize {
        let (Maintenance::Probe(i)
        | Maintenance::WarmUp(i)
        | Maintenance::Refresh(i)
        | Maintenance::Ready(i)
        | Maintenance::Confirm(i)) = self;
        i
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
    pub tgsv_ms: Option<f64>,
    pub error_rate: Option<f64>,
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

impl Variant {
    /// The lowest of the configured `max_concurrency`, the connection caps
    /// (`max_connections` + `max_pending`: past them the variant is full, and requests fail
    /// over or wait in the pool's line) and the limit learned from 429s.
    pub fn concurrency_limit(&self) -> u32 {
        self.cfg
            .max_concurrency
            .unwrap_or(u32::MAX)
            .min(self.cfg.slot_cap().unwrap_or(u32::MAX))
            .min(self.limit.get())
    }

    /// How the variant continues a generation now: its configured `resume`, or `instruction`
    /// once it has refused a prefill ([`Variant::learn_instruction`]).
    pub fn resume(&self) -> ResumeMode {
        if self.resume_learned() {
            ResumeMode::Instruction
        } else {
            self.cfg.resume
        }
    }

    /// Whether the variant's resume mode was learned from a prefill refusal.
    pub fn resume_learned(&self) -> bool {
        self.prefill_refused.load(Ordering::Relaxed)
    }

    /// The variant refused a prefill: it continues in `instruction` mode from now on. True the
    /// first time (the caller logs it once).
    pub fn learn_instruction(&self) -> bool {
        !self.prefill_refused.swap(true, Ordering::Relaxed)
    }
}

impl Pool {
    /// Whether some variant of the pool speaks `protocol`.
    pub fn speaks(&self, protocol: Protocol) -> bool {
        self.variants.iter().any(|v| v.cfg.protocol == protocol)
    }

    pub fn new(
        cfg: PoolConfig,
        client: crate::upstream::Client,
        epoch: Instant,
        metrics: Arc<Metrics>,
        limits: UpstreamLimits,
    ) -> Self {
        let variants: Vec<Variant> = cfg
            .variants
            .iter()
            .map(|v| {
                let mut health = VariantHealth::new(cfg.health.prewarm_requests);
                if v.health_url.is_some() {
                    // Not ready until its health endpoint says so: no client request before.
                    health.mark_loading(&cfg.health);
                }
                let state = VariantState {
                    health,
                    availability: Availability::default(),
                    maintenance_busy: false,
                    warm_up_failures: 0,
                    warm_up_failed_at_ms: 0,
                    ready: false,
                    restarting_since: None,
                    confirm: false,
                };
                Variant {
                    cfg: v.clone(),
                    in_flight: Arc::new(AtomicU32::new(0)),
                    limit: Arc::default(),
                    prefill_refused: AtomicBool::new(false),
                    name_hash: hash_bytes(0x6e61_6d65, v.name.as_bytes()),
                    live: Arc::new(ArcSwap::from_pointee(Live::of(
                        &state,
                        hedge_quantile(&cfg),
                        &cfg.health,
                        epoch.elapsed().as_millis() as u64,
                    ))),
                    state: Mutex::new(state),
                }
            })
            .collect();
        let views = PerThread::new(|| {
            variants
                .iter()
                .map(|v| arc_swap::Cache::new(v.live.clone()))
                .collect()
        });
        let protocol = cfg.variants[0].protocol;
        let n = variants.len();
        let seed = hash_bytes(epoch.elapsed().as_nanos() as u64, cfg.name.as_bytes())
            ^ std::process::id() as u64;
        let selector = selection::policy(cfg.policy, seed, n);
        let line = WaitLine::new(
            cfg.queue_max,
            Some(Priority::ALL.map(|p| {
                metrics.gauge(
                    "keel_queue_depth",
                    &[("pool", &cfg.name), ("priority", p.as_str())],
                )
            })),
        );
        Pool {
            safety: Arc::new(crate::safe_mode::Safety::new(
                &cfg.name,
                cfg.safe_mode,
                metrics.clone(),
            )),
            canary: crate::canary::CanaryRuntime::new(
                &cfg,
                metrics.clone(),
                epoch.elapsed().as_millis() as u64,
            ),
            shadow: crate::shadow::Shadow::new(cfg.shadow.as_ref()),
            analysis: cfg.fingerprint.then(Default::default),
            protocol,
            variants,
            client,
            selector,
            hedges: ShardedBudget::new(RetryBudgetConfig {
                ratio: cfg.hedge_budget,
                window_ms: 10_000,
                min_retries_per_sec: 0,
            }),
            probes: ShardedBudget::new(RetryBudgetConfig {
                ratio: cfg.probe_budget,
                window_ms: 10_000,
                min_retries_per_sec: 0,
            }),
            views,
            ttft: {
                let shards = std::thread::available_parallelism().map_or(1, |n| n.get());
                let each = (POOL_TTFT_SAMPLES / shards).max(POOL_TTFT_SHARD_MIN);
                PerThread::with_shards(shards, || TtftWindow::with_capacity(each))
            },
            epoch,
            cfg,
            line,
            metrics,
            limits,
            high_seen: AtomicU64::new(0),
        }
    }

    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Variant `index`'s state, for reading (the admin snapshot, carrying it across a reload).
    /// Changes go through [`Pool::update`], which publishes them.
    pub(crate) fn variant_state(&self, index: usize) -> MutexGuard<'_, VariantState> {
        // The state is plain data updated in one step; a poisoned lock still holds valid data.
        self.variants[index]
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Changes variant `index`'s state and publishes its view.
    pub(crate) fn update<R>(&self, index: usize, f: impl FnOnce(&mut VariantState) -> R) -> R {
        let mut st = self.variant_state(index);
        let r = f(&mut st);
        self.publish(&st, index);
        r
    }

    /// A client TTFT for the pool's window (this thread's shard).
    fn record_pool_ttft(&self, now_ms: u64, ms: f64) {
        self.ttft.own().record(now_ms, ms);
    }

    /// Takes over `old`'s recent TTFTs (a reload that kept the pool).
    pub(crate) fn inherit_ttft(&self, old: &Pool) {
        let from = old.ttft.all();
        for (to, from) in self.ttft.all().iter_mut().zip(from.iter()) {
            **to = (**from).clone();
        }
    }

    /// The pool-wide TTFT quantile `q` over the last 60 s.
    fn pool_ttft(&self, q: f64) -> Option<f64> {
        TtftWindow::quantile_of(&self.ttft.all(), self.now_ms(), q)
    }

    fn publish(&self, st: &VariantState, index: usize) {
        let live = Live::of(
            st,
            hedge_quantile(&self.cfg),
            &self.cfg.health,
            self.now_ms(),
        );
        self.variants[index].live.store(Arc::new(live));
    }

    /// Variant `index`'s published view.
    /// (A guard, not a copy of the view: hold it briefly.)
    pub(crate) fn live(&self, index: usize) -> arc_swap::Guard<Arc<Live>> {
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

    /// The affinity key of a request under this pool's affinity mode.
    pub fn affinity_key(&self, req: &CanonicalRequest) -> Option<u64> {
        match self.cfg.affinity {
            Affinity::None => None,
            Affinity::Session => req.session_key(),
            Affinity::Prefix => req.prefix_key(),
        }
    }

    /// Whether a variant may be tried now (re-checked before every attempt): not cooling down,
    /// credential not refused. Ejection is selection's business (an ejected variant is planned
    /// only when nothing else can serve); concurrency is a separate question
    /// ([`Pool::below_limit`]): a full variant is waited for, not skipped.
    pub fn available(&self, index: usize, now_ms: u64) -> bool {
        self.live(index).availability.available(now_ms)
    }

    /// Milliseconds until a variant cooling down after a failure may be tried again; `None`
    /// when it is not cooling down, or is ejected or warming (probes and warm-ups, not a
    /// client's retry, find out when those are back).
    pub fn cooling_for_ms(&self, index: usize, now_ms: u64) -> Option<u64> {
        let live = self.live(index);
        let ms = live.availability.available_in_ms(now_ms);
        let out = live.est.loading
            || live.availability.shared_ejected(now_ms)
            || matches!(live.est.state, State::Ejected { .. });
        (ms > 0 && !out).then_some(ms)
    }

    /// Notes a request's priority: high-priority traffic reserves its share of capacity.
    pub fn note_priority(&self, priority: Priority, now_ms: u64) {
        if priority == Priority::High {
            self.high_seen.store(now_ms + 1, Ordering::Relaxed);
        }
    }

    /// The concurrency a request of `priority` may use on a variant: its whole limit for high
    /// priority; otherwise the limit less `priority_reserve` of it (at least one slot left)
    /// while high-priority requests have been seen lately, so that they find a free slot
    /// instead of waiting behind the bulk. Unlimited variants reserve nothing.
    pub fn limit_for(&self, index: usize, priority: Priority, now_ms: u64) -> u32 {
        let limit = self.variants[index].concurrency_limit();
        let seen = self.high_seen.load(Ordering::Relaxed);
        let high_lately = seen != 0 && now_ms + 1 < seen + HIGH_RESERVE_FOR_MS;
        if priority == Priority::High || limit == u32::MAX || !high_lately {
            return limit;
        }
        let reserve = (f64::from(limit) * self.cfg.priority_reserve).ceil() as u32;
        limit.saturating_sub(reserve).max(1)
    }

    /// Whether a variant has a free slot for a request of `priority` (see [`Pool::limit_for`]).
    pub fn below_limit(&self, index: usize, priority: Priority) -> bool {
        let v = &self.variants[index];
        v.in_flight.load(Ordering::Relaxed) < self.limit_for(index, priority, self.now_ms())
    }

    /// Whether an attempt could start on a variant right now, without waiting.
    pub fn can_take(&self, index: usize, now_ms: u64) -> bool {
        self.below_limit(index, Priority::Normal) && self.available(index, now_ms)
    }

    /// Requests holding the pool's slots now.
    pub fn running(&self) -> u32 {
        self.variants
            .iter()
            .map(|v| v.in_flight.load(Ordering::Relaxed))
            .sum()
    }

    /// Expected wait (ms) for a request joining the back of the wait line now, from the
    /// measured drain rate (see `capacity`); `None` before any was measured.
    pub fn expected_wait_ms(&self) -> Option<u64> {
        self.line
            .expected_wait_ms(self.line.waiting() as usize, self.running())
    }

    /// Whether hedging is on for this pool (never in safe mode).
    pub fn hedging(&self) -> bool {
        !matches!(self.cfg.hedge, crate::config::Hedge::Off)
            && self.cfg.max_hedges > 0
            && !self.safety.active()
    }

    /// Migrations a stream may make after its first byte: `max_migrations`, none in safe mode.
    pub fn max_migrations(&self) -> u32 {
        if self.safety.active() {
            0
        } else {
            self.cfg.max_migrations
        }
    }

    /// Takes a slot on a variant for a request of `priority` in one atomic step: the check
    /// against the limit and the increment are one compare-and-swap, so a burst of requests
    /// arriving together cannot exceed the limit (a separate check and increment could both see
    /// the last free slot). `None`: the variant is at the limit.
    pub fn try_enter(self: &Arc<Self>, index: usize, priority: Priority) -> Option<InFlight> {
        let limit = self.limit_for(index, priority, self.now_ms());
        self.variants[index]
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()?;
        Some(InFlight {
            pool: self.clone(),
            index,
            since: Instant::now(),
            serving: false,
        })
    }

    /// Takes a slot on a variant, waiting in the pool's line while it is at its concurrency
    /// limit: `None` when that takes longer than `queue_ms` or the deadline allows. A retry
    /// after a "full" 429 goes through here, so it waits for a slot instead of being refused
    /// again at once.
    pub async fn wait_for_slot(
        self: &Arc<Self>,
        index: usize,
        priority: Priority,
        deadline: tokio::time::Instant,
    ) -> Option<InFlight> {
        if let Some(slot) = self.try_enter(index, priority) {
            return Some(slot);
        }
        let until = (tokio::time::Instant::now()
            + std::time::Duration::from_millis(self.cfg.queue_ms))
        .min(deadline);
        let ticket = self
            .line
            .join(priority, deadline, until, self.running())
            .ok()?;
        loop {
            if let Some(slot) = self.try_enter(index, priority) {
                return Some(slot);
            }
            if ticket.wait(until).await != Wake::LookAgain {
                return None;
            }
        }
    }

    pub fn cool_down(&self, index: usize, now_ms: u64, for_ms: u64) {
        self.update(index, |st| st.availability.cool_down(now_ms, for_ms));
    }

    /// Holds the variant out briefly on a client's evidence alone, and asks keel's own request
    /// to confirm it ([`Maintenance::Confirm`]); never shared with other replicas.
    pub fn hold_unconfirmed(&self, index: usize, now_ms: u64, for_ms: u64) {
        self.update(index, |st| {
            st.availability.hold_unconfirmed(now_ms, for_ms);
            st.confirm = true;
        });
    }

    /// The variant answered that it is still loading its model (see `VariantHealth::mark_loading`).
    pub fn mark_loading(&self, index: usize) {
        let hc = self.cfg.health;
        self.update(index, |st| {
            st.health.mark_loading(&hc);
            // It answered: alive and loading, not dead.
            st.ready = false;
            st.restarting_since = None;
        });
    }

    /// The variant refused a connection. One that is not ejected is restarting: it is warming
    /// like a loading one (no client request; the monitor finds out when it is ready, through
    /// its health endpoint where it has one), so requests wait for a ready variant instead of
    /// failing. One that has refused for longer than `restart_grace_ms` is dead: ejected (and
    /// probed). Returns whether it is warming for a restart now.
    pub fn mark_restarting(&self, index: usize) -> bool {
        let now = self.now_ms();
        let grace = self.cfg.restart_grace_ms;
        self.update(index, |st| self.restart_step(st, index, now, grace))
    }

    fn restart_step(&self, st: &mut VariantState, index: usize, now: u64, grace: u64) -> bool {
        let hc = self.cfg.health;
        if matches!(st.health.est.state, State::Ejected { .. }) {
            return false;
        }
        let since = *st.restarting_since.get_or_insert(now);
        st.ready = false;
        if now.saturating_sub(since) > grace {
            let h = &mut st.health;
            h.est.loading = false;
            h.est.state = State::Ejected {
                since_ms: now,
                last_probe_ms: now,
            };
            st.restarting_since = None;
            tracing::warn!(pool = %self.cfg.name, variant = %self.variants[index].cfg.name, grace_ms = grace, "variant refused connections for longer than restart_grace_ms; ejected");
            return false;
        }
        if !st.health.est.loading {
            st.health.mark_loading(&hc);
        }
        true
    }

    /// The variant's health endpoint answered 200: the monitor's warm-ups may go to it now.
    pub fn mark_ready(&self, index: usize) {
        self.update(index, |st| {
            st.ready = true;
            st.restarting_since = None;
        });
    }

    /// Whether the variant is in a restart: refusing connections, within its grace.
    pub fn restarting(&self, index: usize) -> bool {
        self.live(index).restarting
    }

    /// Whether the variant last said it is still loading its model.
    pub fn loading(&self, index: usize) -> bool {
        self.live(index).est.loading
    }

    pub fn mark_credential_broken(&self, index: usize, now_ms: u64) {
        // Re-check a refused credential once a minute: keys get rotated back in.
        self.update(index, |st| {
            st.availability.mark_credential_broken(now_ms, 60_000)
        });
    }

    pub fn record_success(&self, index: usize) {
        self.update(index, |st| {
            st.availability.record_success();
            st.restarting_since = None;
        });
    }

    /// Feeds one attempt's outcome to the variant's health: `ok` is false only for backend
    /// failures; `ttft_ms` is the time to the first token (or whole body).
    pub fn record_attempt(&self, index: usize, ok: bool, ttft_ms: Option<f64>) {
        let now = self.now_ms();
        if let Some(c) = &self.canary {
            c.observe_attempt(index, ok, ttft_ms, now);
        }
        let hc = self.cfg.health;
        if let Some(t) = ttft_ms {
            self.record_pool_ttft(now, t);
        }
        self.update(index, |st| {
            let h = &mut st.health;
            if let Some(t) = ttft_ms {
                h.record_ttft(now, t, &hc);
            }
            h.record_outcome(now, ok, &hc);
            h.tick(now, &hc);
        });
    }

    /// Feeds a lower bound of a TTFT: an attempt cancelled `ms` after it started, before its
    /// first token (it lost a hedge race).
    pub fn record_late_ttft(&self, index: usize, ms: f64) {
        let now = self.now_ms();
        let hc = self.cfg.health;
        self.update(index, |st| st.health.record_late_ttft(now, ms, &hc));
    }

    /// Feeds a finished stream's inter-token gaps.
    pub fn record_stream(&self, index: usize, gaps_ms: &[f64]) {
        let now = self.now_ms();
        let hc = self.cfg.health;
        self.update(index, |st| {
            st.health.record_stream_gaps(now, gaps_ms, &hc);
            st.health.tick(now, &hc);
        });
    }

    pub fn record_scrape(&self, index: usize, kv_usage: Option<f64>, waiting: Option<f64>) {
        self.update(index, |st| st.health.record_scrape(kv_usage, waiting));
    }

    /// Advances every variant's lifecycle and returns the probes and warm-ups due now. A
    /// warming variant whose last warm-ups failed waits out its backoff first.
    pub fn maintenance(&self) -> Vec<Maintenance> {
        let now = self.now_ms();
        let hc = self.cfg.health;
        let mut out = Vec::new();
        // Refresh candidates: (last evidence, index).
        let mut stale: Vec<(u64, usize)> = Vec::new();
        for i in 0..self.variants.len() {
            self.update(i, |st| {
                st.health.tick(now, &hc);
                if st.maintenance_busy {
                    return;
                }
                if st.confirm {
                    // Once the variant may be entered (a short cooldown may hold it out).
                    if st.availability.available(now) {
                        st.maintenance_busy = true;
                        out.push(Maintenance::Confirm(i));
                    }
                } else if st.health.take_probe(now, &hc) {
                    st.maintenance_busy = true;
                    out.push(Maintenance::Probe(i));
                } else if matches!(st.health.est.state, State::Warming { .. }) {
                    if now < st.warm_up_failed_at_ms + warm_up_backoff_ms(st.warm_up_failures) {
                        return;
                    }
                    st.maintenance_busy = true;
                    // Readiness first where the variant has a health endpoint.
                    out.push(if self.variants[i].cfg.health_url.is_some() && !st.ready {
                        Maintenance::Ready(i)
                    } else {
                        Maintenance::WarmUp(i)
                    });
                } else if st.availability.available(now) && st.health.needs_refresh(now, &hc) {
                    stale.push((st.health.last_sample_ms.unwrap_or(0), i));
                }
            });
        }
        // Refresh probes, the longest without evidence first, while the budget lasts (none in
        // safe mode: probes of ejected variants above stay, they are how a variant returns).
        // Only the monitor starts maintenance, so a variant listed here is still idle.
        if self.safety.active() {
            return out;
        }
        stale.sort_unstable();
        for (_, i) in stale {
            if !self.probes.try_retry(now) {
                break;
            }
            self.variant_state(i).maintenance_busy = true;
            out.push(Maintenance::Refresh(i));
        }
        out
    }

    /// A probe or warm-up that could not start now (the variant is full): due again later.
    pub fn maintenance_skipped(&self, m: Maintenance) {
        self.variant_state(m.variant()).maintenance_busy = false;
    }

    /// The result of a probe or warm-up request.
    pub fn maintenance_done(&self, m: Maintenance, ok: bool, ttft_ms: Option<f64>) {
        self.update(m.variant(), |st| {
            self.maintenance_result(st, m, ok, ttft_ms)
        });
    }

    fn maintenance_result(
        &self,
        st: &mut VariantState,
        m: Maintenance,
        ok: bool,
        ttft_ms: Option<f64>,
    ) {
        let now = self.now_ms();
        let hc = self.cfg.health;
        match m {
            Maintenance::Probe(_) => {
                st.maintenance_busy = false;
                st.health.probe_result(now, ok, ttft_ms, &hc);
                if ok {
                    st.restarting_since = None;
                }
            }
            // A readiness check that did not find the variant ready (one that did goes on to
            // a warm-up at once, see `monitor`).
            Maintenance::Ready(_) => {
                st.maintenance_busy = false;
                st.warm_up_failed(now);
            }
            Maintenance::WarmUp(_) => {
                st.maintenance_busy = false;
                if !ok {
                    st.warm_up_failed(now);
                }
                if ok {
                    st.warm_up_failures = 0;
                    if let Some(t) = ttft_ms {
                        st.health.record_ttft(now, t, &hc);
                    }
                    st.health.record_outcome(now, true, &hc);
                    st.restarting_since = None;
                }
            }
            Maintenance::Refresh(_) => {
                st.maintenance_busy = false;
                st.health.refresh_result(now, ttft_ms.filter(|_| ok), &hc);
            }
            // Its outcome was settled as evidence of keel's own (see `settlement`).
            Maintenance::Confirm(_) => {
                st.maintenance_busy = false;
                st.confirm = false;
            }
        }
    }

    /// A client's request met a refusal it may have caused: keel's own request confirms it
    /// (the monitor sends one at its next tick) before the variant is marked for everyone.
    pub fn to_confirm(&self, index: usize) {
        self.variant_state(index).confirm = true;
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
                    tgsv_ms: h.est.tgsv_ms.get(),
                    error_rate: h.est.error_rate.get(),
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

    /// A P99-ish inter-token gap for streams on this variant (mean + 3 standard deviations): its
    /// own; before it has any (early in a variant's life), the slowest of its siblings', so
    /// that a stall there is still cut over after a few gaps rather than at `stall_ms`.
    fn p99ish_gap_ms(&self, index: usize) -> Option<f64> {
        let of = |i: usize| {
            let est = self.live(i).est;
            est.gap_ms
                .get()
                .map(|gap| gap + 3.0 * est.tgsv_ms.get().unwrap_or(gap))
        };
        of(index).or_else(|| {
            (0..self.variants.len())
                .filter_map(of)
                .max_by(f64::total_cmp)
        })
    }

    /// The stall threshold for a stream on this variant: adaptive, max(4 × its P99-ish gap,
    /// 500 ms), capped by the pool's `stall_ms`; or `stall_ms` (adaptive off, or no gap
    /// statistics anywhere in the pool yet).
    pub fn stall_threshold_ms(&self, index: usize) -> u64 {
        let cap = self.cfg.timeouts.stall_ms;
        if !self.cfg.adaptive_stall {
            return cap;
        }
        match self.p99ish_gap_ms(index) {
            Some(p99ish) => ((4.0 * p99ish).max(500.0) as u64).min(cap),
            None => cap,
        }
    }

    /// How long a stream on this variant may be silent before a continuation is raced against
    /// it (see `relay::speculation`): 4 × its P99-ish gap, at least [`QUIET_FLOOR_MS`]; `None`
    /// without gap statistics in the pool, with `adaptive_stall` off, or when that is not below
    /// the stall threshold (the stall then decides alone).
    pub fn quiet_threshold_ms(&self, index: usize) -> Option<u64> {
        if !self.cfg.adaptive_stall {
            return None;
        }
        let stall = self.stall_threshold_ms(index);
        let p99ish = self.p99ish_gap_ms(index)?;
        let quiet = (4.0 * p99ish).max(QUIET_FLOOR_MS as f64) as u64;
        (quiet < stall).then_some(quiet)
    }

    /// Counts a request for the hedge and probe budgets.
    pub fn count_request(&self) {
        let now = self.now_ms();
        self.hedges.record_request(now);
        self.probes.record_request(now);
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
                let delay = self
                    .live(target)
                    .hedge_ttft_ms
                    .or_else(|| self.pool_ttft(hedge_quantile(&self.cfg)))
                    .unwrap_or(2000.0);
                Some(delay.clamp(50.0, 2000.0) as u64)
            }
        }
    }

    /// The variant of `candidates` that could take a hedge now (available, below its
    /// concurrency limit, not ejected, warming or floored by its health) and would most likely
    /// answer first: the lowest recent median TTFT × (in flight + 1).
    ///
    /// Not simply the plan's next variant: the plan ranks by peak-EWMA estimates (which jump on
    /// one slow answer and fade slowly), while the race is won by whoever usually answers
    /// first now: the recent median, weighed by the requests already running there.
    pub fn hedge_target(&self, candidates: &[usize]) -> Option<usize> {
        let now = self.now_ms();
        let hc = self.cfg.health;
        // The pool's median, for candidates without samples of their own (read only then).
        let unknown = std::cell::OnceCell::new();
        let unknown = || *unknown.get_or_init(|| self.pool_ttft(0.5).unwrap_or(0.0));
        candidates
            .iter()
            .map(|&i| (i, self.live(i)))
            .filter(|(i, live)| {
                let v = &self.variants[*i];
                live.availability.available(now)
                    && !live.availability.shared_ejected(now)
                    && matches!(live.est.state, State::Healthy | State::SlowStart { .. })
                    && live.est.weight(now, &hc) > keel_core::health::FLOOR
                    && v.in_flight.load(Ordering::Relaxed) < v.concurrency_limit()
            })
            .map(|(i, live)| {
                let median = live.p50_ttft_ms.unwrap_or_else(unknown);
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
        self.hedges.try_retry(now).then_some(target)
    }

    /// The variant's baseline inter-token gap, for slowdown detection.
    pub fn baseline_gap_ms(&self, index: usize) -> Option<f64> {
        self.live(index).est.baseline_gap_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn pool(max_concurrency: u32) -> Arc<Pool> {
        pool_of(1, max_concurrency)
    }

    /// A pool of `variants` variants (`v0`, `v1`, …), each with `max_concurrency`.
    fn pool_of(variants: usize, max_concurrency: u32) -> Arc<Pool> {
        let mut text = String::from("[[pools]]\nname = \"p\"\n");
        for i in 0..variants {
            text.push_str(&format!(
                "[[pools.variants]]\nname = \"v{i}\"\nurl = \"http://127.0.0.1:9/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\nmax_concurrency = {max_concurrency}\n"
            ));
        }
        let cfg = crate::Config::parse(&text, "t.toml", &HashMap::new()).unwrap();
        crate::install_crypto();
        Arc::new(Pool::new(
            cfg.pools[0].clone(),
            crate::upstream::client(
                1_000,
                metrics::Counter::noop(),
                &|_| metrics::Counter::noop(),
                &|_| None,
                &cfg.pools[0].variants,
            ),
            Instant::now(),
            Metrics::new(),
            UpstreamLimits {
                max_body_bytes: 1 << 20,
                max_event_bytes: 1 << 16,
            },
        ))
    }

    /// Many threads racing for the slots of a variant: never more held at once than its limit,
    /// and every slot comes back when its guard drops.
    #[test]
    fn taking_a_slot_is_one_atomic_step() {
        let p = pool(3);
        let peak = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..2_000 {
                        if let Some(slot) = p.try_enter(0, Priority::Normal) {
                            let now = p.variants[0].in_flight.load(Ordering::Relaxed);
                            peak.fetch_max(now, Ordering::Relaxed);
                            drop(slot);
                        }
                    }
                });
            }
        });
        assert!(peak.load(Ordering::Relaxed) <= 3, "peak {peak:?}");
        assert_eq!(p.variants[0].in_flight.load(Ordering::Relaxed), 0);
        let held: Vec<_> = (0..5)
            .filter_map(|_| p.try_enter(0, Priority::High))
            .collect();
        assert_eq!(held.len(), 3);
    }

    /// The variant's published view is what its state says.
    fn assert_published(p: &Pool, i: usize) {
        let st = p.variant_state(i).clone();
        let live = p.live(i);
        assert_eq!(live.est, st.health.est);
        assert_eq!(live.availability, st.availability);
        assert_eq!(live.restarting, st.restarting_since.is_some());
        assert_eq!(live.p50_ttft_ms, st.health.ttft_quantile_ms(0.5));
        assert_eq!(live.p95_ttft_ms, st.health.p95_ttft_ms());
    }

    /// A view published during slow start reads, at every later moment, exactly the figures
    /// computed afresh from its estimates then (the ramp is the only figure that moves).
    #[test]
    fn a_slow_start_view_reads_the_figures_computed_afresh() {
        let p = pool(4);
        let hc = HealthConfig {
            slow_start_ms: 10_000,
            ..p.cfg.health
        };
        let mut st = p.variant_state(0).clone();
        for t in 0..20 {
            st.health.record_ttft(t * 50, 100.0 + t as f64, &hc);
            st.health.record_outcome(t * 50, t % 7 != 0, &hc);
        }
        st.health.est.state = State::SlowStart { since_ms: 1_000 };
        let live = Live::of(&st, 0.9, &hc, 1_000);
        assert!(
            live.steady.is_some(),
            "fresh estimates publish steady figures"
        );
        let mut weights = Vec::new();
        for now in (1_000..=12_000).step_by(500) {
            let afresh = HealthNow::of(&live.est, now, &hc);
            assert_eq!(live.health_at(now, &hc), afresh, "at {now} ms");
            weights.push(afresh.weight);
        }
        assert!(
            weights.first() < weights.last(),
            "the ramp moved: {weights:?}"
        );
    }

    /// A dead variant is not warmed every monitor tick: failed warm-ups back off, 100 ms
    /// doubling to a second, and one that answers starts afresh.
    #[test]
    fn failed_warm_ups_back_off() {
        assert_eq!(
            (0..7).map(warm_up_backoff_ms).collect::<Vec<_>>(),
            [0, 100, 200, 400, 800, 1000, 1000]
        );
        let p = pool(4);
        let warm_up = |p: &Pool| {
            p.maintenance()
                .into_iter()
                .any(|m| matches!(m, Maintenance::WarmUp(0)))
        };
        assert!(warm_up(&p), "a new variant warms up");
        p.maintenance_done(Maintenance::WarmUp(0), false, None);
        assert_eq!(p.variant_state(0).warm_up_failures, 1);
        // Its backoff not yet over (the failure dated ahead of the clock, so the test does not
        // depend on how fast it runs): nothing due.
        p.variant_state(0).warm_up_failed_at_ms = p.now_ms() + 60_000;
        assert!(!warm_up(&p));
        p.variant_state(0).warm_up_failed_at_ms = 0;
        p.variant_state(0).warm_up_failures = 0;
        assert!(warm_up(&p), "due again once the backoff is over");
        p.maintenance_done(Maintenance::WarmUp(0), true, Some(50.0));
        assert_eq!(p.variant_state(0).warm_up_failures, 0);
    }

    /// Requests read the published views, never the state: every kind of update must publish.
    #[test]
    fn every_update_publishes_the_variants_view() {
        let p = pool(4);
        assert_published(&p, 0);
        type Step = Box<dyn Fn(&Pool)>;
        let steps: Vec<(&str, Step)> = vec![
            (
                "attempt",
                Box::new(|p| p.record_attempt(0, true, Some(120.0))),
            ),
            ("failure", Box::new(|p| p.record_attempt(0, false, None))),
            (
                "stream",
                Box::new(|p| p.record_stream(0, &[10.0, 30.0, 12.0])),
            ),
            ("late ttft", Box::new(|p| p.record_late_ttft(0, 400.0))),
            (
                "scrape",
                Box::new(|p| p.record_scrape(0, Some(0.5), Some(3.0))),
            ),
            ("cooldown", Box::new(|p| p.cool_down(0, p.now_ms(), 5_000))),
            (
                "credential",
                Box::new(|p| p.mark_credential_broken(0, p.now_ms())),
            ),
            ("success", Box::new(|p| p.record_success(0))),
            ("loading", Box::new(|p| p.mark_loading(0))),
            (
                "restarting",
                Box::new(|p| {
                    p.mark_restarting(0);
                }),
            ),
            ("ready", Box::new(|p| p.mark_ready(0))),
            (
                "maintenance",
                Box::new(|p| {
                    for m in p.maintenance() {
                        p.maintenance_done(m, true, Some(90.0));
                    }
                }),
            ),
        ];
        for (what, step) in steps {
            let before = p.live(0);
            step(&p);
            assert_published(&p, 0);
            assert!(
                format!("{before:?}") != format!("{:?}", p.live(0)) || what == "maintenance",
                "{what} changed nothing: the step does not test its publication"
            );
        }
    }

    /// A request for pool `p`.
    fn request() -> CanonicalRequest {
        keel_core::request::parse(
            keel_core::protocol::Endpoint::ChatCompletions,
            br#"{"model":"p","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap()
    }

    /// Decisions and updates from many threads at once: the views end as the states say (an
    /// update publishes before it lets go of its variant, so the last one published wins).
    #[test]
    fn concurrent_updates_leave_every_view_current() {
        let p = pool_of(4, 1_000);
        let req = request();
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let (p, req) = (&p, &req);
                s.spawn(move || {
                    for n in 0..500u32 {
                        let controls = crate::selection::Controls {
                            force_variant: None,
                            preference: Default::default(),
                            min_tier: None,
                            priority: Priority::Normal,
                        };
                        let (sel, _) = p.select(req, controls, "t");
                        let crate::selection::Selection::Plan(order) = sel else {
                            panic!("no plan: {sel:?}");
                        };
                        let ttft = 50.0 + f64::from((t * 500 + n) % 97);
                        p.record_attempt(order[0], n % 50 != 0, Some(ttft));
                        p.record_stream(order[0], &[10.0, 11.0]);
                    }
                });
            }
        });
        for i in 0..4 {
            assert_published(&p, i);
        }
    }

    /// A thread's cached views are brought up to date by its next decision: a variant cooled
    /// down by another thread after this one last decided is out of this one's next plan, and
    /// back in it once the cooldown is lifted.
    #[test]
    fn a_decision_reads_views_published_since_its_thread_last_decided() {
        let p = pool_of(3, 1_000);
        let req = request();
        let plan = || match p.select(&req, crate::selection::Controls::default(), "t").0 {
            crate::selection::Selection::Plan(order) => order,
            other => panic!("no plan: {other:?}"),
        };
        assert_eq!(
            plan().len(),
            3,
            "this thread's cache filled with every variant"
        );
        std::thread::scope(|s| {
            s.spawn(|| p.cool_down(1, p.now_ms(), 60_000));
        });
        for _ in 0..20 {
            let order = plan();
            assert!(!order.contains(&1), "a stale view of variant 1: {order:?}");
        }
        std::thread::scope(|s| {
            s.spawn(|| p.variant_state(1).availability = Availability::default());
        });
        // Lifting a cooldown by hand publishes nothing; an update of the variant does.
        std::thread::scope(|s| {
            s.spawn(|| p.record_success(1));
        });
        assert_eq!(plan().len(), 3, "variant 1 back after its view changed");

        // While another holder has this thread's shard of the cache, a decision loads the
        // views instead of waiting (here the holder is this thread itself: waiting would never
        // end), and reads them as current.
        let shard = p.views.own();
        p.cool_down(2, p.now_ms(), 60_000);
        let sorted = |mut order: Vec<usize>| {
            order.sort_unstable();
            order
        };
        assert!(matches!(p.views(), Views::Loaded(_)));
        assert_eq!(sorted(plan()), [0, 1]);
        drop(shard);
        assert!(matches!(p.views(), Views::Cached(_)));
        assert_eq!(sorted(plan()), [0, 1]);
    }
}
