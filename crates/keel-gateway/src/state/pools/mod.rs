//! Runtime state of pools and variants: live health (`keel_core::health`), cooldowns and
//! credentials, in-flight counts and learned concurrency limits, the hedge budget, and the
//! lifecycle the monitor advances (probes, warm-ups). Selection reads it (`selection`);
//! settlement writes it (`settlement`).
//!
//! **No shared lock on the request path.** Updates (an attempt's outcome, a cooldown, the
//! monitor's tick) take the lock of the one variant they change ([`VariantState`]), and each
//! ends by publishing that variant's [`Published`] view: a `Copy` of its estimates and availability,
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
//!
//! The `Pool`'s methods are split by role: `views.rs` (the published views and the health
//! snapshot), `slots.rs` (limits, slots and in-flight requests), `lifecycle.rs` (cooldowns,
//! restarts, recorded outcomes, the monitor's maintenance), `timing.rs` (TTFT window, stall and
//! quiet thresholds, hedging) and `shared.rs` (what other replicas said).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::per_thread::PerThread;
use crate::state::capacity::{Limit, WaitLine};
use crate::state::retry_budget::ShardedBudget;
use keel_core::budget::RetryBudgetConfig;
use keel_core::continuation::ResumeMode;
use keel_core::health::{TtftWindow, VariantHealth};
use keel_core::protocol::Protocol;
use keel_core::queue::Priority;
use keel_core::request::CanonicalRequest;
use keel_core::rng::hash_bytes;
use keel_core::selection::{self, Availability, Selector};

use crate::config::{Affinity, PoolConfig, VariantConfig};
use crate::observe::metrics::Metrics;

pub(crate) mod carry;
mod lifecycle;
mod shared;
mod slots;
#[cfg(test)]
mod tests;
mod timing;
mod views;

pub use lifecycle::Maintenance;
pub use slots::InFlight;
use timing::hedge_quantile;
pub use timing::QUIET_FLOOR_MS;
pub use views::VariantSnapshot;
pub(crate) use views::{Published, ViewCache};

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
    live: Arc<ArcSwap<Published>>,
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
    /// Whether hedges at the delay, and very late ones, win often enough to send them
    /// (`keel_core::hedge`).
    hedge_payoff: std::sync::Mutex<keel_core::hedge::Record>,
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
    /// Tokens a client stream of this pool carries, smoothed (`f64` bits; see
    /// [`Pool::answer_tokens`]).
    answer_tokens: AtomicU64,
    /// The pool's health colour and safe mode (see `safe_mode`); kept across a config reload.
    pub safety: Arc<crate::state::safe_mode::Safety>,
    /// The counts of long prompt texts, for context fit (see `state::token_counts`).
    pub token_counts: crate::state::token_counts::TokenCounts,
    /// `[pools.canary]`'s split and its state (see `canary`).
    pub canary: Option<crate::state::canary::CanaryRuntime>,
    /// `[pools.shadow]`'s variants and their comparisons (see `shadow`).
    pub shadow: Option<crate::state::shadow::Shadow>,
    /// The template miner and recent requests of a pool that fingerprints its requests
    /// (`fingerprint = true`; see `state::analysis`).
    pub analysis: Option<crate::state::analysis::Analysis>,
}

/// Bounds on what keel reads from an upstream (see `attempt`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpstreamLimits {
    /// A whole response body.
    pub max_body_bytes: usize,
    /// One SSE event; also the most a held tool call may accumulate.
    pub max_event_bytes: usize,
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

/// A finished request's place in the pool's health window and live analysis.
impl crate::observe::access_log::PoolRecords for Pool {
    fn request_ended(&self, route: &'static str, outcome: &'static str) {
        self.safety.record_request(self.now_ms(), route, outcome);
    }

    fn analyses(&self) -> bool {
        self.analysis.is_some()
    }

    fn analyse(&self, record: keel_core::analyze::report::Record) {
        if let Some(a) = &self.analysis {
            a.record(record);
        }
    }
}

impl Pool {
    /// The distinct tokenizers of the pool's variants.
    pub fn tokenizers(&self) -> Vec<keel_core::tokens::Tokenizer> {
        let mut ts: Vec<keel_core::tokens::Tokenizer> =
            self.variants.iter().map(|v| v.cfg.tokenizer).collect();
        ts.sort_unstable();
        ts.dedup();
        ts
    }

    /// Whether some variant counts prompts by a byte-pair encoding.
    pub fn counts_by_bpe(&self) -> bool {
        self.variants.iter().any(|v| v.cfg.tokenizer.is_bpe())
    }

    /// The largest context window, when every variant has one (a variant without one may take
    /// any prompt).
    pub fn largest_window(&self) -> Option<u64> {
        self.variants
            .iter()
            .map(|v| v.cfg.context_window)
            .collect::<Option<Vec<u64>>>()?
            .into_iter()
            .max()
    }

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
                    live: Arc::new(ArcSwap::from_pointee(Published::of(
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
            safety: Arc::new(crate::state::safe_mode::Safety::new(
                &cfg.name,
                cfg.safe_mode,
                metrics.clone(),
            )),
            canary: crate::state::canary::CanaryRuntime::new(
                &cfg,
                metrics.clone(),
                epoch.elapsed().as_millis() as u64,
            ),
            shadow: crate::state::shadow::Shadow::new(cfg.shadow.as_ref()),
            analysis: cfg.fingerprint.then(Default::default),
            token_counts: crate::state::token_counts::TokenCounts::new(
                &metrics,
                &cfg.name,
                cfg.variants.iter().any(|v| v.tokenizer.is_bpe()),
            ),
            protocol,
            variants,
            client,
            selector,
            hedges: ShardedBudget::new(RetryBudgetConfig {
                ratio: cfg.hedge_budget,
                window_ms: 10_000,
                min_retries_per_sec: 0,
            }),
            hedge_payoff: Default::default(),
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
            answer_tokens: AtomicU64::new(0f64.to_bits()),
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
    /// The affinity key of a request under this pool's affinity mode.
    pub fn affinity_key(&self, req: &CanonicalRequest) -> Option<u64> {
        match self.cfg.affinity {
            Affinity::None => None,
            Affinity::Session => req.session_key(),
            Affinity::Prefix => req.prefix_key(),
        }
    }
}
