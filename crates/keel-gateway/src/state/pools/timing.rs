//! The pool's timing figures: its TTFT window, stall and quiet thresholds, the hedge delay and
//! target under the hedge budget, and the migrations a stream may make.

use std::sync::atomic::Ordering;

use keel_core::health::{State, TtftWindow};
use keel_core::hedge::Tier;

use crate::config::PoolConfig;

use super::*;

/// The quantile of TTFT the auto hedge delay waits for: 1 − hedge_budget / 2.
pub(super) fn hedge_quantile(cfg: &PoolConfig) -> f64 {
    (1.0 - cfg.hedge_budget / 2.0).clamp(0.5, 0.99)
}

/// The shortest silence that starts a speculative continuation: below it, scheduling noise on
/// a loaded machine alone would start races.
pub const QUIET_FLOOR_MS: u64 = 40;

/// Weight of each finished stream in the pool's typical answer length.
const ANSWER_SMOOTHING: f64 = 1.0 / 32.0;

/// The most a long prompt's prefill adds to a hedge delay: a minute (a prompt the size of a
/// large context window on a slow server); past it the request's deadline decides.
const MAX_PREFILL_WAIT_MS: f64 = 60_000.0;

impl Pool {
    /// A client TTFT for the pool's window (this thread's shard).
    pub(super) fn record_pool_ttft(&self, now_ms: u64, ms: f64) {
        self.ttft.own().record(now_ms, ms);
    }
    /// Takes over `old`'s recent TTFTs (a reload that kept the pool).
    pub(crate) fn inherit_ttft(&self, old: &Pool) {
        let from = old.ttft.all();
        for (to, from) in self.ttft.all().iter_mut().zip(from.iter()) {
            **to = (**from).clone();
        }
        *self.hedge_record() = old.hedge_record().clone();
        self.answer_tokens
            .store(old.answer_tokens.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    /// How many tokens this pool's answers stream, as selection weighs decode paces (see
    /// `keel_core::p2c::decode_factor`): the smoothed length of its finished client streams
    /// (about the last [`ANSWER_SMOOTHING`]⁻¹), at most the request's `max_tokens`. 0 before
    /// any stream has finished.
    pub(crate) fn answer_tokens(&self, max_tokens: Option<u64>) -> f64 {
        let typical = f64::from_bits(self.answer_tokens.load(Ordering::Relaxed));
        max_tokens.map_or(typical, |m| typical.min(m as f64))
    }
    /// A finished client stream of `tokens` tokens, for [`Pool::answer_tokens`]. The first
    /// one stands for the pool's answers until more come.
    pub(super) fn record_answer_tokens(&self, tokens: f64) {
        // Always `Some`: the update cannot fail, only retry when another stream wrote.
        let _ = self
            .answer_tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let v = f64::from_bits(bits);
                let next = if v == 0.0 {
                    tokens
                } else {
                    v + ANSWER_SMOOTHING * (tokens - v)
                };
                Some(next.to_bits())
            });
    }
    /// The pool's first tokens of the last 60 s at least `ms`.
    pub(super) fn pool_ttft_at_least(&self, now_ms: u64, ms: f64) -> usize {
        TtftWindow::at_least_of(&self.ttft.all(), now_ms, ms)
    }
    /// The pool-wide TTFT quantile `q` over the last 60 s.
    pub(super) fn pool_ttft(&self, q: f64) -> Option<f64> {
        TtftWindow::quantile_of(&self.ttft.all(), self.now_ms(), q)
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
    /// A P99-ish inter-token gap for streams on this variant (mean + 3 standard deviations): its
    /// own; before it has any (early in a variant's life), the slowest of its siblings', so
    /// that a stall there is still cut over after a few gaps rather than at `stall_ms`.
    pub(super) fn p99ish_gap_ms(&self, index: usize) -> Option<f64> {
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
    /// The hedge delay when `target` would take the hedge for a prompt of `prompt_tokens`
    /// (estimated), or `None` when hedging is off: the configured delay, or (auto) the target's
    /// recent TTFT quantile at 1 − hedge_budget/2 (the whole pool's until the target has the
    /// samples to place it: 40 for a P95), clamped to 50 ms–2 s (2 s before any sample), plus
    /// the longer prefill a prompt longer than the target's usual one takes there (see
    /// `keel_core::prefill`).
    ///
    /// Why the prefill: the quantile is a figure for the usual prompt, and a long prompt passes
    /// it by its length alone. Raced then, it loses: the hedge reads the same prompt from the
    /// start, behind the primary. A long prompt is raced once it is late for its size.
    ///
    /// Why that quantile: hedging after it races about half the budget's share of requests, so
    /// the budget is there for the slow first tokens instead of running out on ordinary ones.
    /// Why the target's: the question is whether the hedge would likely answer sooner, so a
    /// primary that is slow by nature (a far zone, a degraded replica) is raced as soon as the
    /// target would usually have answered, not once it is late by its own slow standard, and a
    /// pool-wide figure would carry the slow zone's samples. Why the pool's until then: a tail
    /// quantile of a few samples is their slowest one, and a pool whose variants all started
    /// together (a start, a reload) hedged its slowest requests of the first seconds at three or
    /// four times the usual first token (one long prompt or one heavy draw in a variant's first
    /// handful of answers set its delay), while the pool's samples together placed it well.
    pub fn hedge_delay_ms(&self, target: usize, prompt_tokens: u64) -> Option<u64> {
        match self.cfg.hedge {
            crate::config::Hedge::Off => None,
            crate::config::Hedge::AfterMs(ms) => Some(ms),
            crate::config::Hedge::Auto => {
                // One read of the target's view for both figures.
                let view = self.live(target);
                let delay = self.hedge_ttft_ms(&view).unwrap_or(2000.0);
                let longer = view
                    .prefill
                    .map_or(0.0, |p| p.extra_ms(prompt_tokens).min(MAX_PREFILL_WAIT_MS));
                Some((delay.clamp(50.0, 2000.0) + longer) as u64)
            }
        }
    }
    /// The variant of `candidates` that could take a hedge now (available, below its
    /// concurrency limit, not ejected, warming or floored by its health) and would most likely
    /// answer first: the lowest recent median TTFT × (in flight + 1).
    ///
    /// Its health, not its weight: the slow-start ramp starts at the floor, so a pool whose
    /// variants all joined together (a start, a reload) would have no hedge target for its
    /// first second, when its hedge delays are most needed; one extra request does not load a
    /// variant the ramp is easing traffic onto.
    ///
    /// Not simply the plan's next variant: the plan ranks by peak-EWMA estimates (which jump on
    /// one slow answer and fade slowly), while the race is won by whoever usually answers
    /// first now: the recent median, weighed by the requests already running there, and by
    /// its decode pace as selection prices it (the winner streams the whole answer: a first
    /// token won on a variant four times slower to decode is no win).
    pub fn hedge_target(&self, candidates: &[usize]) -> Option<usize> {
        let now = self.now_ms();
        let hc = self.cfg.health;
        // The pool's median, for candidates without samples of their own (read only then).
        let unknown = std::cell::OnceCell::new();
        let unknown = || *unknown.get_or_init(|| self.pool_ttft(0.5).unwrap_or(0.0));
        let targets: Vec<(usize, arc_swap::Guard<Arc<Published>>)> = candidates
            .iter()
            .map(|&i| (i, self.live(i)))
            .filter(|(i, live)| {
                let v = &self.variants[*i];
                live.availability.available(now)
                    && !live.availability.shared_ejected(now)
                    && matches!(live.est.state, State::Healthy | State::SlowStart { .. })
                    && live.health_at(now, &hc).factors.health() > keel_core::health::FLOOR
                    && v.in_flight.load(Ordering::Relaxed) < v.concurrency_limit()
            })
            .collect();
        let pricing = keel_core::p2c::Pricing {
            preference: Default::default(),
            answer_tokens: self.answer_tokens(None),
            fastest_gap_ms: keel_core::p2c::fastest_gap_ms(
                targets.iter().map(|(_, live)| live.est.gap_ms.get()),
            ),
        };
        targets
            .iter()
            .map(|(i, live)| {
                let median = live.p50_ttft_ms.unwrap_or_else(unknown);
                let load = self.variants[*i].in_flight.load(Ordering::Relaxed) as f64 + 1.0;
                let pace = pricing.decode_factor(
                    median,
                    live.est.gap_ms.get(),
                    live.est.gap_trust(now, &hc),
                );
                (*i, median * load * pace)
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(i, _)| i)
    }
    /// The variant a hedge goes to now, if one can take it and the hedge budget allows one
    /// more (then counted).
    pub fn try_hedge(&self, candidates: &[usize]) -> Option<usize> {
        let target = self.hedge_target(candidates)?;
        self.hedge_budget_allows(0.0).then_some(target)
    }
    /// Whether the hedge budget allows one more hedge now (then counted), leaving `reserve`
    /// (a share of the budget) untouched.
    pub fn hedge_budget_allows(&self, reserve: f64) -> bool {
        self.hedges.try_retry_keeping(self.now_ms(), reserve)
    }
    /// Whether a first hedge of `tier` goes out in this pool now (`keel_core::hedge`): always
    /// for a configured delay (`hedge = <ms>`: the operator's choice); for `auto`, as the
    /// pool's record of that tier says.
    pub fn hedge_sends(&self, tier: Tier) -> bool {
        !matches!(self.cfg.hedge, crate::config::Hedge::Auto) || self.hedge_record().sends(tier)
    }
    /// Records a request that reached `tier`'s moment: whether its hedge won, or would have.
    pub fn record_hedge_payoff(&self, tier: Tier, won: bool) {
        self.hedge_record().record(tier, won);
    }
    fn hedge_record(&self) -> std::sync::MutexGuard<'_, keel_core::hedge::Record> {
        // Only requests that reach the hedge delay take this lock (a few in a hundred); the
        // record is a few plain numbers, so a poisoned lock still holds a usable one.
        self.hedge_payoff
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    /// How long a continuation on `target` may take to its first token before it is given up
    /// for the next candidate (see `relay::speculation`): twice the TTFT quantile the auto
    /// hedge delay uses (its own, else the pool's; a continuation prefills the text already
    /// sent as well as the prompt), 100 ms–4 s (4 s before any sample). Without it, a
    /// continuation whose variant hung before its first token held the stream until
    /// `first_token_ms` (15 s) while the stalled original had nothing more to give.
    pub fn continuation_patience_ms(&self, target: usize) -> u64 {
        self.hedge_ttft_ms(&self.live(target))
            .map_or(4000, |q| (2.0 * q).clamp(100.0, 4000.0) as u64)
    }
    /// The TTFT quantile the auto hedge delay uses for the target whose view is `target`
    /// ([`hedge_quantile`]): its own once its samples place it, else the pool's; `None` before
    /// any sample.
    fn hedge_ttft_ms(&self, target: &Published) -> Option<f64> {
        target
            .hedge_ttft_ms
            .or_else(|| self.pool_ttft(hedge_quantile(&self.cfg)))
    }
    /// The median TTFT a hedge on `target` would likely take (its own, or the pool's).
    pub fn median_ttft_ms(&self, target: usize) -> Option<f64> {
        self.live(target)
            .p50_ttft_ms
            .or_else(|| self.pool_ttft(0.5))
    }
    /// The variant's baseline inter-token gap, for slowdown detection.
    pub fn baseline_gap_ms(&self, index: usize) -> Option<f64> {
        self.live(index).est.baseline_gap_ms()
    }
}
