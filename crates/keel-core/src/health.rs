//! Live health of one variant: statistics fed by every attempt, a weight with hysteresis, and
//! the ejection / probing / slow-start / warm-up lifecycle. Pure: `now_ms` is passed to every
//! call, reads never mutate.
//!
//! **Signals.** Peak-EWMA of time to first token (a slower sample replaces the estimate at once,
//! faster ones blend in with decay `decay_ms`, as tower's `PeakEwma`, but never by less than
//! their share of the samples behind the estimate, so that a first or stale value is averaged
//! away within a few samples whatever it was: see [`Ewma`]); EWMA of inter-token gaps;
//! token-gap variance (TGSV: standard deviation of the last 10 inter-chunk gaps of each stream,
//! blended per variant); EWMA error rate; the share of its client streams that broke after their
//! first token (over about a minute, see [`BREAK_DECAY_MS`]); a windowed P95 of TTFT; scraped KV-cache usage and
//! waiting requests (vLLM / llama.cpp metrics).
//!
//! **Weights.** Each signal maps to a factor by a piecewise curve relative to the variant's own
//! baseline (for TTFT and TGSV: ratio to a baseline that follows improvements at once and
//! degradations only slowly, over `baseline_decay_ms`): 1 in the normal band, linear down to 0.1
//! through the warning band, 0.1 in the severe band. The weight is the product of the factors.
//!
//! **Hysteresis.** A variant goes to weight 0 (ejected) only after some signal has been severe
//! for `eject_after_ms` continuously, so a momentary spike lowers its share but never causes
//! oscillation. Ejected variants are probed every `probe_interval_ms`; a successful probe starts
//! warm-up (`prewarm_requests` requests, no client traffic) and then a slow-start ramp from 10%
//! to 100% of its weight over `slow_start_ms`.

/// Bands of one signal: `warn` is where decay starts, `severe` where the floor is reached.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Band {
    pub warn: f64,
    pub severe: f64,
}

impl Band {
    /// 1 up to `warn`, linear to [`FLOOR`] at `severe`, `FLOOR` beyond.
    pub fn factor(&self, x: f64) -> f64 {
        // NaN (no signal) counts as normal.
        if x.is_nan() || x <= self.warn {
            1.0
        } else if x >= self.severe {
            FLOOR
        } else {
            1.0 - (1.0 - FLOOR) * (x - self.warn) / (self.severe - self.warn)
        }
    }

    pub fn is_severe(&self, x: f64) -> bool {
        x >= self.severe
    }
}

/// Refresh intervals without any sample after which estimates relax (see `refresh_after_ms`):
/// beyond the longest wait between refresh probes that keep confirming the estimate (see
/// [`REFRESH_SPREAD`]), so that a variant re-measured that seldom never relaxes between them.
pub const STALE_GRACE: u64 = (1 << REFRESH_SPREAD) + 2;

/// The lowest weight of a variant that is degraded but not ejected.
pub const FLOOR: f64 = 0.1;

/// Health parameters (per pool).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HealthConfig {
    /// Decay of the TTFT, gap and TGSV estimates.
    pub decay_ms: f64,
    /// Decay of the error rate: errors must weigh in within a second or two.
    pub error_decay_ms: f64,
    pub baseline_decay_ms: f64,
    /// TTFT as a ratio of the variant's baseline. Defaults 2× / 5×: hosted APIs routinely vary by
    /// 2× across minutes; 5× is a sick instance.
    pub ttft_ratio: Band,
    /// TGSV as a ratio of the baseline gap.
    pub tgsv_ratio: Band,
    /// Error rate (EWMA of 0/1 outcomes).
    pub error_rate: Band,
    /// The share of client streams that broke after their first token (stalled, or failed
    /// with an error): each costs its client a pause and a continuation elsewhere (an upstream
    /// request more, its prompt and the text so far prefilled again). Default 0.02 / 0.2: full
    /// weight up to one stream in fifty (a single break among a variant's first streams reads
    /// under 5%, see [`BREAK_PRIOR`], and costs less than [`crate::p2c::EQUIVALENT`], so one
    /// unlucky stream does not keep a variant from its share), 0.64 at one in ten (1.6× the
    /// cost of a peer whose streams do not break), the floor from one in five.
    pub break_rate: Band,
    /// Scraped KV-cache usage (0..1).
    pub kv_usage: Band,
    /// Scraped waiting requests.
    pub waiting: Band,
    pub eject_after_ms: u64,
    pub probe_interval_ms: u64,
    /// A serving variant without a TTFT sample for this long is re-measured by a refresh probe
    /// (within the pool's probe budget); its estimates stand unchanged meanwhile, and start
    /// relaxing only after [`STALE_GRACE`] × this without any evidence (probes off or over
    /// budget), so a client request goes to a variant on fresh evidence.
    pub refresh_after_ms: u64,
    pub slow_start_ms: u64,
    pub prewarm_requests: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            decay_ms: 10_000.0,
            error_decay_ms: 1_000.0,
            baseline_decay_ms: 300_000.0,
            ttft_ratio: Band {
                warn: 2.0,
                severe: 5.0,
            },
            tgsv_ratio: Band {
                warn: 3.0,
                severe: 10.0,
            },
            error_rate: Band {
                warn: 0.05,
                severe: 0.3,
            },
            break_rate: Band {
                warn: 0.02,
                severe: 0.2,
            },
            kv_usage: Band {
                warn: 0.85,
                severe: 0.98,
            },
            waiting: Band {
                warn: 4.0,
                severe: 32.0,
            },
            eject_after_ms: 3_000,
            probe_interval_ms: 1_000,
            refresh_after_ms: 1_000,
            slow_start_ms: 10_000,
            prewarm_requests: 2,
        }
    }
}

/// The decay of a variant's break rate: streams break rarely, so the rate is read over about a
/// minute of them (at five streams a second, 300), where a single break is a third of a percent
/// and a variant breaking one in twenty reads 5% ± 1%.
pub const BREAK_DECAY_MS: f64 = 60_000.0;

/// Unbroken streams a variant's break rate starts from: its first break reads 1 in 21 (5%),
/// not 100%, and a few lucky streams do not make a variant that breaks look better than its
/// peers.
pub const BREAK_PRIOR: f64 = 20.0;

/// A sample at least this multiple of a peak-EWMA's value replaces it at once.
///
/// tower's PeakEwma jumps on any larger sample, so its level rises with the sampling rate: on a
/// lognormal TTFT (σ 0.3) a variant taking 5 requests a second sits near the P98 of its recent
/// samples, one re-measured once a second near its P90. Cost then compares a busy fast variant's
/// tail with an idle slow one's typical value, and a slow zone 6× slower looks only 1.5× worse
/// once in-flight counts are weighed in. Jumping only on a sample twice the value keeps the
/// instant reaction to a real slowdown (a saturated or sick server) while ordinary jitter
/// blends in, so the estimate stays near the mean whatever the traffic.
pub const PEAK_JUMP: f64 = 2.0;

/// A time-decayed moving average; `peak` makes a sample at least [`PEAK_JUMP`] × the value
/// replace it at once.
///
/// **How far a sample moves it.** Each sample moves the value by the larger of two weights:
/// its share of time (`1 − e^(−Δt / decay)`, Δt since the previous sample: a sample stands for
/// the level since then) and its share of the evidence (1 / the samples behind the value,
/// each decayed by its age over `decay`). The first is the usual EWMA, and all there is in
/// steady state (with samples every Δt the evidence is `1 / (1 − e^(−Δt / decay))`, so the two
/// weights are equal). The second matters from a start: a plain EWMA counts its first sample
/// (a cold warm-up, one unlucky first token, a peak it jumped to) as if it had always been the
/// level, so on a variant measured once a second (refresh probes, decay 10 s) each sample
/// after it moves the value by a tenth only, and a 60% error takes a dozen seconds to fall
/// under 20%; meanwhile the variant loses every comparison and gets no client traffic that
/// would correct it. Counted as the one sample it is, a first value is averaged away by the
/// next few whatever it was: the value reaches the level within a few samples from any start.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ewma {
    value: Option<f64>,
    at_ms: u64,
    /// Samples behind `value` as of `at_ms`, each weighted by `e^(−age / decay)`.
    evidence: f64,
}

impl Ewma {
    pub fn get(&self) -> Option<f64> {
        self.value
    }

    /// The samples behind the value as of its last sample (each weighted by its age then):
    /// 1 after the first sample or a peak, about `decay / Δt` for a variant sampled every Δt.
    pub fn evidence(&self) -> f64 {
        if self.value.is_some() {
            self.evidence
        } else {
            0.0
        }
    }

    /// Records a sample; `true` when it jumped the value to itself (a peak), rather than
    /// blending in or being the first.
    pub fn record(&mut self, now_ms: u64, sample: f64, decay_ms: f64, peak: bool) -> bool {
        let jumped = peak && self.value.is_some_and(|v| sample >= v * PEAK_JUMP);
        let (value, evidence) = match self.value {
            None => (sample, 1.0),
            Some(_) if jumped => (sample, 1.0),
            Some(v) => {
                let dt = now_ms.saturating_sub(self.at_ms) as f64;
                // At least a small step per sample, so bursts within one millisecond still count.
                let keep = (-dt.max(1.0) / decay_ms.max(1.0)).exp();
                let evidence = self.evidence * keep + 1.0;
                let w = (1.0 - keep).max(1.0 / evidence);
                (v + (sample - v) * w, evidence)
            }
        };
        self.value = Some(value);
        self.evidence = evidence;
        self.at_ms = now_ms;
        jumped
    }

    /// As [`Ewma::record`] without a peak, moved by the time weight alone and adding nothing
    /// to the evidence: for a baseline, which must follow a degradation at its own slow pace
    /// however few samples it has seen, and for a hint that is not a sample (a lower bound).
    pub fn record_timed(&mut self, now_ms: u64, sample: f64, decay_ms: f64) {
        let (value, evidence) = match self.value {
            None => (sample, 1.0),
            Some(v) => {
                let dt = now_ms.saturating_sub(self.at_ms) as f64;
                let keep = (-dt.max(1.0) / decay_ms.max(1.0)).exp();
                (v * keep + sample * (1.0 - keep), self.evidence * keep)
            }
        };
        self.value = Some(value);
        self.evidence = evidence;
        self.at_ms = now_ms;
    }

    pub fn reset(&mut self) {
        self.value = None;
    }

    /// A value as if `evidence` samples of `value` had been recorded at `at_ms` (a prior).
    pub fn seeded(at_ms: u64, value: f64, evidence: f64) -> Self {
        Ewma {
            value: Some(value),
            at_ms,
            evidence,
        }
    }

    /// The value as of `now_ms`, relaxed toward `target` for the time without samples: a peak
    /// fades even when the variant gets little traffic (as it does when its weight is low).
    pub fn relaxed(&self, now_ms: u64, target: f64, decay_ms: f64) -> Option<f64> {
        let v = self.value?;
        let dt = now_ms.saturating_sub(self.at_ms);
        if dt == 0 {
            // Nothing to relax (the usual case: a sample within the grace). The same value the
            // formula gives with exp(0) = 1, without the exp, which was a routing decision's
            // largest single cost at 256 variants (four per candidate).
            return Some(target + (v - target));
        }
        Some(target + (v - target) * (-(dt as f64) / decay_ms.max(1.0)).exp())
    }
}

/// Recent TTFT samples (at most `capacity`, none older than 60 s) for windowed quantiles: a
/// variant's P95 for the SLO filter, a pool's hedge delay. Kept sorted as they arrive, so a
/// record costs a binary search and a short move and a quantile is one index.
#[derive(Debug, Clone, PartialEq)]
pub struct TtftWindow {
    capacity: usize,
    /// (time, value) in arrival order.
    arrivals: std::collections::VecDeque<(u64, f64)>,
    sorted: Vec<f64>,
}

const WINDOW_SAMPLES: usize = 64;
const WINDOW_MS: u64 = 60_000;

/// Samples a window needs above a quantile before [`TtftWindow::supported_quantile`] gives
/// it: 40 for a P95, fewer than the 64 a busy variant holds.
pub const TAIL_SUPPORT: usize = 2;

impl Default for TtftWindow {
    fn default() -> Self {
        TtftWindow::with_capacity(WINDOW_SAMPLES)
    }
}

impl TtftWindow {
    pub fn with_capacity(capacity: usize) -> Self {
        TtftWindow {
            capacity: capacity.max(1),
            arrivals: Default::default(),
            sorted: Vec::with_capacity(capacity),
        }
    }

    pub fn record(&mut self, now_ms: u64, v: f64) {
        while let Some(&(t, old)) = self.arrivals.front() {
            if self.arrivals.len() < self.capacity && now_ms.saturating_sub(t) <= WINDOW_MS {
                break;
            }
            self.arrivals.pop_front();
            if let Ok(i) = self.sorted.binary_search_by(|x| x.total_cmp(&old)) {
                self.sorted.remove(i);
            }
        }
        self.arrivals.push_back((now_ms, v));
        let i = self.sorted.partition_point(|x| x.total_cmp(&v).is_lt());
        self.sorted.insert(i, v);
    }

    /// Recent samples at least `v`.
    pub fn at_least(&self, v: f64) -> usize {
        self.sorted.len() - self.sorted.partition_point(|x| x.total_cmp(&v).is_lt())
    }

    /// The nearest-rank `q` quantile of the recent samples.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        nearest_rank(&self.sorted, q)
    }

    /// [`TtftWindow::quantile`], once at least [`TAIL_SUPPORT`] samples lie above it; `None`
    /// before. A tail quantile of a few samples is their slowest one: a window of seven holds
    /// its P95 at its maximum, so one long prompt or one draw from a heavy tail sets it, and a
    /// hedge delay read from it waits three or four times the usual first token.
    pub fn supported_quantile(&self, q: f64) -> Option<f64> {
        let n = self.sorted.len();
        let rank = (n as f64 * q.clamp(0.0, 1.0)).ceil() as usize;
        (n.saturating_sub(rank) >= TAIL_SUPPORT)
            .then(|| nearest_rank(&self.sorted, q))
            .flatten()
    }

    /// Samples of the last 60 s as of `now_ms` at least `v`, over several windows together
    /// (see [`TtftWindow::quantile_of`]).
    pub fn at_least_of<W: std::ops::Deref<Target = TtftWindow>>(
        windows: &[W],
        now_ms: u64,
        v: f64,
    ) -> usize {
        windows
            .iter()
            .flat_map(|w| w.arrivals.iter())
            .filter(|(t, x)| now_ms.saturating_sub(*t) <= WINDOW_MS && *x >= v)
            .count()
    }

    /// The nearest-rank `q` quantile of several windows' samples together, those of the last
    /// 60 s as of `now_ms` (one series counted apart, e.g. per thread: a window expires its
    /// samples only as it records, and one may have been idle).
    pub fn quantile_of<W: std::ops::Deref<Target = TtftWindow>>(
        windows: &[W],
        now_ms: u64,
        q: f64,
    ) -> Option<f64> {
        let mut all: Vec<f64> = windows
            .iter()
            .flat_map(|w| w.arrivals.iter())
            .filter(|(t, _)| now_ms.saturating_sub(*t) <= WINDOW_MS)
            .map(|(_, v)| *v)
            .collect();
        all.sort_unstable_by(f64::total_cmp);
        nearest_rank(&all, q)
    }
}

fn nearest_rank(sorted: &[f64], q: f64) -> Option<f64> {
    let rank = (sorted.len() as f64 * q.clamp(0.0, 1.0)).ceil() as usize;
    sorted.get(rank.saturating_sub(1)).copied()
}

/// Where a variant is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// New, restarted or back from ejection: `remaining` warm-up requests before client traffic.
    Warming {
        remaining: u32,
    },
    /// Taking traffic, ramping up since `since_ms`.
    SlowStart {
        since_ms: u64,
    },
    Healthy,
    /// No client traffic; probed every `probe_interval_ms` (by the gateway, once any cooldown
    /// its server asked for is over).
    Ejected {
        since_ms: u64,
        last_probe_ms: u64,
    },
}

impl State {
    /// Numeric form for the `keel_variant_state` gauge.
    pub fn code(&self) -> u8 {
        match self {
            State::Healthy => 0,
            State::SlowStart { .. } => 1,
            State::Warming { .. } => 2,
            State::Ejected { .. } => 3,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            State::Healthy => "healthy",
            State::SlowStart { .. } => "slow_start",
            State::Warming { .. } => "warming",
            State::Ejected { .. } => "ejected",
        }
    }
}

/// The factors behind a weight, for decision records.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct Factors {
    pub ttft: f64,
    pub tgsv: f64,
    pub errors: f64,
    /// From the break rate (see [`HealthConfig::break_rate`]).
    pub breaks: f64,
    pub kv: f64,
    pub waiting: f64,
    pub ramp: f64,
}

impl Factors {
    pub fn product(&self) -> f64 {
        self.health() * self.ramp
    }

    /// The product of the factors that judge how the variant serves: all but the slow-start
    /// ramp, which says only how recently it joined.
    pub fn health(&self) -> f64 {
        self.ttft * self.tgsv * self.errors * self.breaks * self.kv * self.waiting
    }

    /// The product of the factors that count a known fault: errors, breaks, a full KV cache or
    /// queue. Not the TTFT and TGSV ratios to the variant's own baselines, which move with its
    /// estimates' noise (under `keel bench heavy-tail` healthy variants' TTFT factors were
    /// below 1 in 99% of decision records, median 0.89, a tenth below 0.8), nor the ramp.
    pub fn condition(&self) -> f64 {
        self.errors * self.breaks * self.kv * self.waiting
    }
}

/// Live statistics and lifecycle of one variant.
#[derive(Debug, Clone, PartialEq)]
pub struct VariantHealth {
    /// What selection reads (published as a copy after every update, see [`Estimates`]).
    pub est: Estimates,
    window: TtftWindow,
    severe_since_ms: Option<u64>,
    /// Consecutive TTFT samples in the severe band: a spike lasts exactly as long as its samples
    /// do, so `eject_after_ms` is measured without estimator lag; one slow outlier (a very long
    /// prompt) is not a condition.
    ttft_severe_streak: u32,
    tgsv_severe_streak: u32,
    /// Recent outcomes (time, ok) for the windowed error rate that decides ejection.
    outcomes: Vec<(u64, bool)>,
    outcome_next: usize,
    /// Consecutive successful probes while ejected.
    probe_successes: u32,
    /// The first token of the last successful probe while ejected: the probe that returns the
    /// variant confirms the level when it agrees with it.
    probe_ttft_ms: Option<f64>,
    /// The last TTFT evidence (an answered first token, a lower bound from a lost race, or a
    /// refresh probe's answer or failure).
    pub last_sample_ms: Option<u64>,
    /// Refresh probes in a row that found the estimate right (see [`REFRESH_AGREES`]): each
    /// doubles the wait before the next, up to [`REFRESH_SPREAD`] doublings.
    refresh_agreed: u32,
    /// The last client sample jumped the TTFT estimate (see [`PEAK_JUMP`]) and no evidence has
    /// come since: the next refresh probe is due after [`JUMP_RECHECK`] of the interval.
    jumped: bool,
    /// Client first tokens against their prompts' sizes: how much longer a long prompt takes.
    prefill: crate::prefill::PrefillFit,
}

/// The share of `refresh_after_ms` after which a variant whose estimate one client sample
/// jumped is re-measured. The jump prices it out, so until that probe it gets no client
/// request: a whole interval of that for every outlier (a heavy-tail first token, or a busy
/// host's scheduling delay on a fast variant) would starve it of its share. The probe comes
/// sooner; none is sent when a client's sample comes first.
pub const JUMP_RECHECK: u64 = 8;

/// Recent samples (in the variant's TTFT window) at least as slow as a new one that make it
/// the variant's ordinary tail rather than news: it blends into the estimate instead of
/// jumping it (see [`PEAK_JUMP`]). On a variant whose first tokens spread as a lognormal of
/// σ 0.5, one draw in twenty is twice the mean; jumping to each priced the variant out until a
/// probe re-measured it, a probe for every such draw, and shifted its share to its peers for
/// nothing. A real slowdown is slower than anything the window holds, and still jumps.
pub const JUMP_PRECEDENTS: usize = 2;

/// A refresh probe whose answer is within this ratio of the estimate (either way) confirms it.
pub const REFRESH_AGREES: f64 = 1.25;

/// The most doublings of `refresh_after_ms` between refresh probes that keep confirming the
/// estimate: a variant left out of the draw (a slow zone) is re-measured after 1, 2, 4, then
/// every 8 s instead of every second (within the grace, [`STALE_GRACE`] intervals, after which
/// its estimate would relax); a probe that disagrees, or fails, brings the interval back to
/// one. A zone that recovers is found within 8 s, while clients are served by the variants
/// that are fast now.
pub const REFRESH_SPREAD: u32 = 3;

/// The read side of a variant's health: its estimates and lifecycle state, without the sample
/// windows and streaks that only updates need. It is `Copy`, so the pool publishes one per
/// variant after every update (see `keel_gateway::pools`) and a routing decision reads the
/// published copies without taking the pool's lock; every figure is computed from it at the
/// decision's `now_ms`, exactly as from the [`VariantHealth`] it was copied from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimates {
    pub ttft_ms: Ewma,
    baseline_ttft_ms: Ewma,
    pub gap_ms: Ewma,
    baseline_gap_ms: Ewma,
    pub tgsv_ms: Ewma,
    pub error_rate: Ewma,
    /// The share of client streams that broke after their first token (see
    /// [`HealthConfig::break_rate`]); `None` before the first stream ended.
    pub break_rate: Ewma,
    pub kv_usage: Option<f64>,
    pub waiting: Option<f64>,
    pub state: State,
    /// It answered that it is still loading its model; cleared by its first success.
    pub loading: bool,
}

impl Estimates {
    /// The time estimates are relaxed to: `now_ms` less the grace in which refresh probes are
    /// expected to bring fresh evidence (estimates stand unchanged within it).
    fn relax_clock(&self, now_ms: u64, cfg: &HealthConfig) -> u64 {
        now_ms.saturating_sub(STALE_GRACE * cfg.refresh_after_ms)
    }

    /// Predicted TTFT for cost: the peak-EWMA as last measured. A variant without client
    /// traffic is kept fresh by refresh probes (`needs_refresh`), so a slow variant is not
    /// re-measured with client requests; only when no evidence at all arrives for longer than
    /// the grace (probes off or over budget) does the estimate decay toward zero for the time
    /// beyond it (as tower's PeakEwma does), so a variant is never starved by a stale
    /// estimate. A neutral guess before any sample.
    pub fn predicted_ttft_ms(&self, now_ms: u64, cfg: &HealthConfig) -> f64 {
        self.ttft_ms
            .relaxed(self.relax_clock(now_ms, cfg), 0.0, cfg.decay_ms)
            .unwrap_or(100.0)
    }

    /// How far the inter-token gap estimate (`gap_ms`) still holds at `now_ms`, in 0..=1: 1
    /// while its last sample is within the grace (streams and refresh probes measure it), then
    /// fading over `decay_ms`, as the TTFT estimate relaxes: a variant priced out for a slow
    /// pace that nothing measures again (probes off) is tried again in time. 1 before any
    /// sample (there is nothing to trust less).
    pub fn gap_trust(&self, now_ms: u64, cfg: &HealthConfig) -> f64 {
        match self
            .gap_ms
            .relaxed(self.relax_clock(now_ms, cfg), 0.0, cfg.decay_ms)
        {
            Some(relaxed) => match self.gap_ms.get() {
                Some(v) if v > 0.0 => (relaxed / v).clamp(0.0, 1.0),
                _ => 1.0,
            },
            None => 1.0,
        }
    }

    /// The slow-start factor at `now_ms`: from [`FLOOR`] to 1 over `slow_start_ms` after slow
    /// start began, 1 in any other state.
    pub fn ramp(&self, now_ms: u64, cfg: &HealthConfig) -> f64 {
        match self.state {
            State::SlowStart { since_ms } if cfg.slow_start_ms > 0 => {
                (now_ms.saturating_sub(since_ms) as f64 / cfg.slow_start_ms as f64)
                    .clamp(FLOOR, 1.0)
            }
            _ => 1.0,
        }
    }

    pub fn factors(&self, now_ms: u64, cfg: &HealthConfig) -> Factors {
        let relax_now = self.relax_clock(now_ms, cfg);
        let ratio = |e: &Ewma, b: &Ewma, decay: f64| match b.get() {
            Some(b) if b > 0.0 => e.relaxed(relax_now, b, decay).map(|v| v / b).unwrap_or(1.0),
            _ => 1.0,
        };
        // Refresh probes re-measure a variant floored by an error burst; without any evidence
        // beyond the grace the rate relaxes (over `decay_ms`, slower than the error EWMA itself
        // moves), so it is tried again eventually. Ejection is decided on the windowed count
        // instead (see `severe`).
        let errors = self
            .error_rate
            .relaxed(relax_now, 0.0, cfg.decay_ms)
            .unwrap_or(0.0);
        // Relaxed alike: a variant floored for its breaks gets no client stream that could
        // show it mended, so without any for longer than the grace it is tried again.
        let breaks = self
            .break_rate
            .relaxed(relax_now, 0.0, BREAK_DECAY_MS)
            .unwrap_or(0.0);
        let ramp = self.ramp(now_ms, cfg);
        Factors {
            ttft: cfg
                .ttft_ratio
                .factor(ratio(&self.ttft_ms, &self.baseline_ttft_ms, cfg.decay_ms)),
            tgsv: cfg
                .tgsv_ratio
                .factor(ratio(&self.tgsv_ms, &self.baseline_gap_ms, cfg.decay_ms)),
            errors: cfg.error_rate.factor(errors),
            breaks: cfg.break_rate.factor(breaks),
            kv: self.kv_usage.map(|k| cfg.kv_usage.factor(k)).unwrap_or(1.0),
            waiting: self.waiting.map(|w| cfg.waiting.factor(w)).unwrap_or(1.0),
            ramp,
        }
    }

    /// The last moment (inclusive) up to which [`Estimates::predicted_ttft_ms`],
    /// [`Estimates::gap_trust`] and every factor of [`Estimates::factors`] but the slow-start
    /// ramp give exactly what they give now,
    /// if `now_ms` is within it: while every estimate's last sample is within the grace, nothing
    /// relaxes, so those figures do not depend on the time. Lets a reader compute them once per
    /// update instead of once per read, and only the ramp ([`Estimates::ramp`], one division)
    /// per read during slow start.
    pub fn steady_until_ms(&self, cfg: &HealthConfig) -> Option<u64> {
        let grace = STALE_GRACE * cfg.refresh_after_ms;
        // The estimates `factors`, `predicted_ttft_ms` and `gap_trust` relax (see
        // `relax_clock`).
        [
            &self.ttft_ms,
            &self.tgsv_ms,
            &self.error_rate,
            &self.break_rate,
            &self.gap_ms,
        ]
        .iter()
        .map(|e| match e.value {
            Some(_) => e.at_ms.saturating_add(grace),
            None => u64::MAX,
        })
        .min()
    }

    /// The selection weight in 0..=1 (0 while warming or ejected).
    pub fn weight(&self, now_ms: u64, cfg: &HealthConfig) -> f64 {
        match self.state {
            State::Warming { .. } | State::Ejected { .. } => 0.0,
            _ => self.weight_of(&self.factors(now_ms, cfg)),
        }
    }

    /// [`Estimates::weight`] from factors already computed for the same moment (a routing
    /// decision computes them once and also records them).
    pub fn weight_of(&self, factors: &Factors) -> f64 {
        match self.state {
            State::Warming { .. } | State::Ejected { .. } => 0.0,
            _ => factors.product().max(FLOOR * FLOOR),
        }
    }

    /// The variant's own baseline inter-token gap (follows improvements fast, slowdowns slowly).
    pub fn baseline_gap_ms(&self) -> Option<f64> {
        self.baseline_gap_ms.get()
    }
}

/// Samples in a row that make a latency signal a condition rather than an outlier.
const SEVERE_STREAK: u32 = 3;
/// Outcomes kept for the windowed error rate.
const OUTCOMES_KEPT: usize = 32;
/// The error-rate window, and the fewest outcomes in it that can show a condition.
const OUTCOME_WINDOW_MS: u64 = 10_000;
const MIN_OUTCOMES: usize = 3;
/// Successful probes in a row that return an ejected variant.
const PROBES_TO_RETURN: u32 = 2;

impl VariantHealth {
    /// A variant that must warm up first (`prewarm` requests; 0 starts it healthy).
    pub fn new(prewarm: u32) -> Self {
        VariantHealth {
            est: Estimates {
                ttft_ms: Ewma::default(),
                baseline_ttft_ms: Ewma::default(),
                gap_ms: Ewma::default(),
                baseline_gap_ms: Ewma::default(),
                tgsv_ms: Ewma::default(),
                error_rate: Ewma::default(),
                break_rate: Ewma::default(),
                kv_usage: None,
                waiting: None,
                state: if prewarm > 0 {
                    State::Warming { remaining: prewarm }
                } else {
                    State::Healthy
                },
                loading: false,
            },
            window: TtftWindow::default(),
            severe_since_ms: None,
            ttft_severe_streak: 0,
            tgsv_severe_streak: 0,
            outcomes: Vec::with_capacity(OUTCOMES_KEPT),
            outcome_next: 0,
            probe_successes: 0,
            probe_ttft_ms: None,
            last_sample_ms: None,
            refresh_agreed: 0,
            jumped: false,
            prefill: Default::default(),
        }
    }

    /// The variant said it is still loading its model: it is warming (no client traffic; the
    /// monitor's warm-up requests find out when it is ready), not failing.
    pub fn mark_loading(&mut self, cfg: &HealthConfig) {
        self.est.loading = true;
        self.est.state = State::Warming {
            remaining: cfg.prewarm_requests.max(1),
        };
    }

    /// Baselines follow improvements at once and degradations slowly.
    fn record_baseline(b: &mut Ewma, now_ms: u64, sample: f64, cfg: &HealthConfig) {
        match b.get() {
            Some(v) if sample < v => b.record_timed(now_ms, sample, cfg.decay_ms / 10.0),
            _ => b.record_timed(now_ms, sample, cfg.baseline_decay_ms),
        }
    }

    pub fn record_ttft(&mut self, now_ms: u64, ms: f64, cfg: &HealthConfig) {
        self.record_ttft_among(now_ms, ms, 0, cfg);
    }

    /// [`VariantHealth::record_ttft`] for a first token the pool's other recent first tokens
    /// can put in context: `pool_precedents` of them (every variant's, see
    /// [`TtftWindow::at_least_of`]) were at least as slow. A draw the pool's tail has matched
    /// is that tail, whichever variant it fell on, and blends in instead of jumping (see
    /// [`JUMP_PRECEDENTS`]). A variant's own window sees a tail one fifth as often as a pool of
    /// five does: on first tokens spread as a lognormal of σ 0.5, one draw in twenty is twice
    /// the mean, and most of them jumped their variant out of the draw until a refresh probe
    /// re-measured it (a probe for 3% of the requests of `keel bench heavy-tail`'s fault-free
    /// twin). A variant that really slows down answers slower than the pool's recent first
    /// tokens, and still jumps.
    pub fn record_ttft_among(
        &mut self,
        now_ms: u64,
        ms: f64,
        pool_precedents: usize,
        cfg: &HealthConfig,
    ) {
        let severe = self
            .est
            .baseline_ttft_ms
            .get()
            .is_some_and(|b| b > 0.0 && cfg.ttft_ratio.is_severe(ms / b));
        self.ttft_severe_streak = if severe {
            self.ttft_severe_streak + 1
        } else {
            0
        };
        // A sample the estimate jumps to is news: the variant is re-measured after
        // [`JUMP_RECHECK`] of a refresh interval, however long probes had been confirming the
        // level before, so that an outlier which keeps clients away is soon corrected; the
        // spread then starts again from one interval. A sample the variant's recent window
        // has seen matched (see [`JUMP_PRECEDENTS`]) is its ordinary tail, and blends in.
        let news = self.window.at_least(ms).max(pool_precedents) < JUMP_PRECEDENTS;
        self.jumped = self.est.ttft_ms.record(now_ms, ms, cfg.decay_ms, news);
        if self.jumped {
            self.refresh_agreed = 0;
        }
        Self::record_baseline(&mut self.est.baseline_ttft_ms, now_ms, ms, cfg);
        self.window.record(now_ms, ms);
        self.last_sample_ms = Some(now_ms);
    }

    /// A client's first token of a prompt of `tokens` (estimated), for the prefill fit; its
    /// TTFT sample is [`VariantHealth::record_ttft`]'s.
    pub fn record_prefill(&mut self, now_ms: u64, tokens: u64, ms: f64) {
        self.prefill.record(now_ms, tokens, ms);
    }

    /// The variant's prefill rate, where its recent first tokens show one.
    pub fn prefill(&self) -> Option<crate::prefill::Prefill> {
        self.prefill.prefill()
    }

    /// A lower bound of a TTFT: an attempt cancelled `ms` after it started (it lost a hedge
    /// race). Blended in as a plain EWMA sample, not a peak: it refreshes a stale estimate
    /// that has relaxed toward zero (or a variant that always loses races would keep looking
    /// cheap and keep being chosen), while it barely moves a fresh one (a random tail event on
    /// a good variant is no news about the variant). A hint, not a sample: it moves the
    /// estimate by its share of time only, whatever the samples behind it. Not in the window
    /// or the baseline, which hold answered first tokens only.
    pub fn record_late_ttft(&mut self, now_ms: u64, ms: f64, cfg: &HealthConfig) {
        self.est.ttft_ms.record_timed(now_ms, ms, cfg.decay_ms);
        self.last_sample_ms = Some(now_ms);
        self.jumped = false;
    }

    /// Whether a refresh probe should re-measure this variant now: it is serving (healthy or in
    /// slow start) and has had no TTFT evidence for `refresh_after_ms` (or never had any),
    /// doubled for each refresh in a row that confirmed the estimate (see [`REFRESH_SPREAD`]).
    /// Ejected and warming variants have their own probes and warm-ups.
    pub fn needs_refresh(&self, now_ms: u64, cfg: &HealthConfig) -> bool {
        let after = if self.jumped {
            cfg.refresh_after_ms / JUMP_RECHECK
        } else {
            cfg.refresh_after_ms << self.refresh_agreed.min(REFRESH_SPREAD)
        };
        cfg.refresh_after_ms > 0
            && matches!(self.est.state, State::Healthy | State::SlowStart { .. })
            && self
                .last_sample_ms
                .is_none_or(|t| now_ms.saturating_sub(t) >= after)
    }

    /// A refresh probe's result: its answer time as a TTFT sample, or a failure as an error
    /// outcome; either way it is fresh evidence. (Its stream's pace is recorded apart, see
    /// [`VariantHealth::record_probe_gaps`]: a pace that differs does not bring the next probe
    /// closer, since a server's pace moves with its batch, idle for a probe and loaded for
    /// clients, and every probe measures it anyway.)
    ///
    /// A probe that answers in at most 1 / [`PEAK_JUMP`] of the estimate replaces it, the
    /// mirror of the jump: the estimate was one outlier (a heavy-tail first token), and the
    /// probe was sent because that outlier keeps clients away; blended at the EWMA's pace it
    /// would keep them away for several `decay_ms`, re-measured every second for nothing.
    pub fn refresh_result(&mut self, now_ms: u64, ttft_ms: Option<f64>, cfg: &HealthConfig) {
        self.jumped = false;
        self.count_agreement(ttft_ms.zip(self.est.ttft_ms.get()));
        if let (Some(t), Some(v)) = (ttft_ms, self.est.ttft_ms.get()) {
            if t * PEAK_JUMP <= v {
                self.est.ttft_ms.reset();
            }
        }
        match ttft_ms {
            Some(t) => self.record_ttft(now_ms, t, cfg),
            None => self.last_sample_ms = Some(now_ms),
        }
        self.record_outcome(now_ms, ttft_ms.is_some(), cfg);
        self.tick(now_ms, cfg);
    }

    /// A client stream ended: it reached its end (`broke` false), or broke after its first
    /// token (a stall, an error), for the break rate. A stream moved for its slow pace, or left
    /// by its client, is neither.
    pub fn record_stream_end(&mut self, now_ms: u64, broke: bool) {
        let rate = &mut self.est.break_rate;
        if rate.get().is_none() {
            *rate = Ewma::seeded(now_ms, 0.0, BREAK_PRIOR);
        }
        rate.record(now_ms, if broke { 1.0 } else { 0.0 }, BREAK_DECAY_MS, false);
    }

    /// A warm-up's first token. Warm-ups are the same small request as refresh probes, and a
    /// second one that agrees with the first confirms the level as a refresh probe does: a
    /// variant left out of the draw from its start (a slow zone) is first re-measured after two
    /// intervals, not one.
    pub fn record_warm_up(&mut self, now_ms: u64, ms: f64, cfg: &HealthConfig) {
        self.count_agreement(self.est.ttft_ms.get().map(|v| (ms, v)));
        self.record_ttft(now_ms, ms, cfg);
    }

    /// A sample of keel's own (refresh probe, warm-up, returning probe) against the estimate it
    /// was taken to check, `(sample, estimate)`: within [`REFRESH_AGREES`] it confirms the
    /// level once more (see [`REFRESH_SPREAD`]); otherwise, or without one, the count restarts.
    fn count_agreement(&mut self, pair: Option<(f64, f64)>) {
        let agrees = pair.is_some_and(|(t, v)| v > 0.0 && (t / v).max(v / t) <= REFRESH_AGREES);
        self.refresh_agreed = if agrees {
            self.refresh_agreed.saturating_add(1)
        } else {
            0
        };
    }

    /// Inter-token gaps of one stream: their mean, and its TGSV over the last 10.
    pub fn record_stream_gaps(
        &mut self,
        now_ms: u64,
        gaps: &crate::stream_watch::Gaps,
        cfg: &HealthConfig,
    ) {
        let Some(mean) = gaps.mean_ms() else {
            return;
        };
        self.est.gap_ms.record(now_ms, mean, cfg.decay_ms, false);
        Self::record_baseline(&mut self.est.baseline_gap_ms, now_ms, mean, cfg);
        let last = gaps.recent();
        if last.len() >= 2 {
            let n = last.len() as f64;
            let m = last.clone().sum::<f64>() / n;
            let var = last.map(|g| (g - m) * (g - m)).sum::<f64>() / (n - 1.0);
            let tgsv = var.sqrt();
            let severe = self
                .est
                .baseline_gap_ms
                .get()
                .is_some_and(|b| b > 0.0 && cfg.tgsv_ratio.is_severe(tgsv / b));
            self.tgsv_severe_streak = if severe {
                self.tgsv_severe_streak + 1
            } else {
                0
            };
            self.est.tgsv_ms.record(now_ms, tgsv, cfg.decay_ms, false);
        }
    }

    /// The inter-token gaps of a probe's or warm-up's stream, recorded as a client stream's
    /// are. A pace at most 1 / [`PEAK_JUMP`] of the estimate replaces it, as a refresh's TTFT
    /// does: a variant priced out for a slow pace gets no client streams, so probes alone
    /// measure it, and a recovered one blended back at the EWMA's pace would wait several
    /// `decay_ms` for its share.
    pub fn record_probe_gaps(
        &mut self,
        now_ms: u64,
        gaps: &crate::stream_watch::Gaps,
        cfg: &HealthConfig,
    ) {
        let Some(pace) = gaps.mean_ms() else {
            return;
        };
        if self.est.gap_ms.get().is_some_and(|v| pace * PEAK_JUMP <= v) {
            self.est.gap_ms.reset();
        }
        self.record_stream_gaps(now_ms, gaps, cfg);
    }

    /// An attempt's outcome: `true` when it served, `false` for a backend failure.
    pub fn record_outcome(&mut self, now_ms: u64, ok: bool, cfg: &HealthConfig) {
        self.est.error_rate.record(
            now_ms,
            if ok { 0.0 } else { 1.0 },
            cfg.error_decay_ms,
            false,
        );
        if self.outcomes.len() < OUTCOMES_KEPT {
            self.outcomes.push((now_ms, ok));
        } else {
            self.outcomes[self.outcome_next] = (now_ms, ok);
        }
        self.outcome_next = (self.outcome_next + 1) % OUTCOMES_KEPT;
        if ok {
            self.est.loading = false;
        }
        if let State::Warming { remaining } = self.est.state {
            if ok {
                self.est.state = if remaining <= 1 {
                    State::SlowStart { since_ms: now_ms }
                } else {
                    State::Warming {
                        remaining: remaining - 1,
                    }
                };
            }
        }
    }

    pub fn record_scrape(&mut self, kv_usage: Option<f64>, waiting: Option<f64>) {
        self.est.kv_usage = kv_usage;
        self.est.waiting = waiting;
    }

    /// Recent `q` quantile of TTFT (60 s window, last 64 samples): hedge delays are drawn
    /// from it.
    pub fn ttft_quantile_ms(&self, q: f64) -> Option<f64> {
        self.window.quantile(q)
    }

    /// [`VariantHealth::ttft_quantile_ms`] once enough samples lie above it to place it (see
    /// [`TtftWindow::supported_quantile`]).
    pub fn supported_ttft_quantile_ms(&self, q: f64) -> Option<f64> {
        self.window.supported_quantile(q)
    }

    /// Recent P95 of TTFT (60 s window, last 64 samples).
    pub fn p95_ttft_ms(&self) -> Option<f64> {
        self.window.quantile(0.95)
    }

    /// Predicted TTFT for cost (see [`Estimates::predicted_ttft_ms`]).
    pub fn predicted_ttft_ms(&self, now_ms: u64, cfg: &HealthConfig) -> f64 {
        self.est.predicted_ttft_ms(now_ms, cfg)
    }

    /// The health factors (see [`Estimates::factors`]).
    pub fn factors(&self, now_ms: u64, cfg: &HealthConfig) -> Factors {
        self.est.factors(now_ms, cfg)
    }

    /// Errors and outcomes in the last [`OUTCOME_WINDOW_MS`].
    fn error_window(&self, now_ms: u64) -> (usize, usize) {
        self.outcomes
            .iter()
            .filter(|(t, _)| now_ms.saturating_sub(*t) <= OUTCOME_WINDOW_MS)
            .fold((0, 0), |(n, e), (_, ok)| (n + 1, e + usize::from(!ok)))
    }

    /// Whether a severe condition holds now: a latency signal severe for several samples in a
    /// row, or a windowed error rate in the severe band over enough outcomes. Both hold while
    /// the variant gets no traffic (its weight is floored), so `eject_after_ms` can elapse.
    fn severe(&self, now_ms: u64, cfg: &HealthConfig) -> bool {
        let (n, errors) = self.error_window(now_ms);
        // A variant floored by failures gets no traffic: its last outcome (a failure) and its
        // error rate stand until probing decides, so it is ejected rather than left floored.
        let last_failed = self.outcomes.len() == OUTCOMES_KEPT
            && !self.outcomes[(self.outcome_next + OUTCOMES_KEPT - 1) % OUTCOMES_KEPT].1
            || self.outcomes.len() < OUTCOMES_KEPT && self.outcomes.last().is_some_and(|o| !o.1);
        self.ttft_severe_streak >= SEVERE_STREAK
            || self.tgsv_severe_streak >= SEVERE_STREAK
            || (n >= MIN_OUTCOMES && cfg.error_rate.is_severe(errors as f64 / n as f64))
            || (last_failed
                && cfg
                    .error_rate
                    .is_severe(self.est.error_rate.get().unwrap_or(0.0)))
    }

    /// The selection weight in 0..=1 (see [`Estimates::weight`]).
    pub fn weight(&self, now_ms: u64, cfg: &HealthConfig) -> f64 {
        self.est.weight(now_ms, cfg)
    }

    /// Advances the lifecycle: ejects after a sustained severe condition, ends slow start.
    /// Call after recording samples and periodically.
    pub fn tick(&mut self, now_ms: u64, cfg: &HealthConfig) {
        match self.est.state {
            State::Healthy | State::SlowStart { .. } => {
                if self.severe(now_ms, cfg) {
                    let since = *self.severe_since_ms.get_or_insert(now_ms);
                    if now_ms.saturating_sub(since) >= cfg.eject_after_ms {
                        self.est.state = State::Ejected {
                            since_ms: now_ms,
                            last_probe_ms: now_ms,
                        };
                        self.severe_since_ms = None;
                        return;
                    }
                } else {
                    self.severe_since_ms = None;
                }
                if let State::SlowStart { since_ms } = self.est.state {
                    if now_ms.saturating_sub(since_ms) >= cfg.slow_start_ms {
                        self.est.state = State::Healthy;
                    }
                }
            }
            State::Warming { .. } | State::Ejected { .. } => {}
        }
    }

    /// True when an ejected variant should be probed now (and marks the probe as sent).
    pub fn take_probe(&mut self, now_ms: u64, cfg: &HealthConfig) -> bool {
        if let State::Ejected {
            since_ms,
            last_probe_ms,
        } = self.est.state
        {
            if now_ms.saturating_sub(last_probe_ms) >= cfg.probe_interval_ms {
                self.est.state = State::Ejected {
                    since_ms,
                    last_probe_ms: now_ms,
                };
                return true;
            }
        }
        false
    }

    /// A probe's result. Success clears the bad statistics and starts warm-up (or slow start).
    pub fn probe_result(
        &mut self,
        now_ms: u64,
        ok: bool,
        ttft_ms: Option<f64>,
        cfg: &HealthConfig,
    ) {
        if !matches!(self.est.state, State::Ejected { .. }) {
            return;
        }
        let slow = matches!((ttft_ms, self.est.baseline_ttft_ms.get()), (Some(t), Some(b)) if cfg.ttft_ratio.is_severe(t / b));
        if !ok || slow {
            self.probe_successes = 0; // still sick: stay ejected
            self.probe_ttft_ms = None;
            return;
        }
        self.probe_successes += 1;
        let previous = std::mem::replace(&mut self.probe_ttft_ms, ttft_ms);
        if self.probe_successes < PROBES_TO_RETURN {
            return;
        }
        self.probe_successes = 0;
        self.probe_ttft_ms = None;
        self.outcomes.clear();
        self.outcome_next = 0;
        self.est.ttft_ms.reset();
        self.est.error_rate.reset();
        self.est.break_rate.reset();
        self.est.tgsv_ms.reset();
        self.ttft_severe_streak = 0;
        self.tgsv_severe_streak = 0;
        if let Some(t) = ttft_ms {
            self.est.ttft_ms.record(now_ms, t, cfg.decay_ms, true);
        }
        // The returning probe is fresh evidence: no refresh is due at once.
        self.last_sample_ms = Some(now_ms);
        // Probes that agree with each other confirm the level the variant returns at, as
        // refresh probes would: a returning variant takes little client traffic while its
        // ramp is low, and is re-measured after two intervals rather than one.
        self.refresh_agreed = 0;
        self.count_agreement(ttft_ms.zip(previous));
        // The probes were the warm-up's own request (the same small generation), answered in
        // a row: they count toward it, and only what the warm-up asks beyond them is sent.
        self.est.state = match cfg.prewarm_requests.saturating_sub(PROBES_TO_RETURN) {
            0 => State::SlowStart { since_ms: now_ms },
            remaining => State::Warming { remaining },
        };
    }

    /// A restarted variant (e.g. its metrics show a reset): warm it up again.
    pub fn restarted(&mut self, cfg: &HealthConfig) {
        if cfg.prewarm_requests > 0 {
            self.est.state = State::Warming {
                remaining: cfg.prewarm_requests,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> HealthConfig {
        HealthConfig {
            prewarm_requests: 0,
            ..Default::default()
        }
    }

    fn healthy_with_baseline(c: &HealthConfig) -> VariantHealth {
        let mut h = VariantHealth::new(0);
        for t in 0..50 {
            h.record_ttft(t * 100, 100.0, c);
            h.record_outcome(t * 100, true, c);
        }
        h
    }

    #[test]
    fn steady_figures_do_not_move_until_an_estimate_would_relax() {
        let c = HealthConfig {
            slow_start_ms: 0,
            ..cfg()
        };
        let mut h = healthy_with_baseline(&c);
        // A slower spell and a few errors, so that every factor is off 1 and relaxing matters.
        for t in 50..60 {
            h.record_ttft(t * 100, 260.0, &c);
            h.record_outcome(t * 100, t % 3 != 0, &c);
            h.record_stream_gaps(t * 100, &[30.0, 32.0, 29.0].into_iter().collect(), &c);
        }
        let est = h.est;
        let published = 6_000;
        let until = est.steady_until_ms(&c).expect("steady outside slow start");
        assert!(until >= published, "a fresh sample is within the grace");
        let figures = |now: u64| {
            let f = est.factors(now, &c);
            (f, est.weight(now, &c), est.predicted_ttft_ms(now, &c))
        };
        let at_publication = figures(published);
        for now in [published, published + 1, (published + until) / 2, until] {
            assert_eq!(figures(now), at_publication, "at {now} ms");
        }
        // One millisecond later the oldest estimate relaxes, and the figures move.
        assert_ne!(figures(until + 1), at_publication);

        // Slow start ramps with the time: every factor but the ramp stays, and the ramp is
        // what `ramp` says at each moment.
        let ramping = Estimates {
            state: State::SlowStart {
                since_ms: published,
            },
            ..est
        };
        let slow = HealthConfig {
            slow_start_ms: 30_000,
            ..c
        };
        assert_eq!(ramping.steady_until_ms(&slow), Some(until));
        let steady = ramping.factors(published, &slow);
        let mut ramps = Vec::new();
        for now in [published, published + 1, (published + until) / 2, until] {
            let f = ramping.factors(now, &slow);
            assert_eq!(
                f,
                Factors {
                    ramp: ramping.ramp(now, &slow),
                    ..steady
                },
                "at {now} ms"
            );
            ramps.push(f.ramp);
        }
        // (It starts at the floor and has risen off it by the last moment.)
        assert!(ramps.windows(2).all(|w| w[0] <= w[1]), "{ramps:?}");
        assert!(ramps[0] < ramps[3], "{ramps:?}");
    }

    #[test]
    fn band_curve_is_piecewise() {
        let b = Band {
            warn: 2.0,
            severe: 5.0,
        };
        assert_eq!(b.factor(1.0), 1.0);
        assert_eq!(b.factor(2.0), 1.0);
        assert!((b.factor(3.5) - 0.55).abs() < 1e-9);
        assert_eq!(b.factor(5.0), FLOOR);
        assert_eq!(b.factor(50.0), FLOOR);
    }

    #[test]
    fn peak_ewma_jumps_up_and_decays_down() {
        let mut e = Ewma::default();
        for t in 0..100 {
            e.record(t * 100, 100.0, 10_000.0, true);
        }
        // Jitter blends in: a sample under twice the value is averaged, never jumped to, so
        // the level does not climb with the sampling rate.
        for t in 1..=5 {
            e.record(10_000 + t * 100, 190.0, 10_000.0, true);
        }
        let v = e.get().unwrap();
        assert!(v > 100.0 && v < 110.0, "{v}");
        e.record(10_600, 500.0, 10_000.0, true);
        assert_eq!(e.get(), Some(500.0));
        e.record(20_600, 100.0, 10_000.0, true);
        let v = e.get().unwrap();
        assert!(v > 100.0 && v < 300.0, "{v}");
    }

    #[test]
    fn a_spike_shorter_than_eject_after_never_ejects() {
        let c = cfg();
        let mut h = healthy_with_baseline(&c);
        let t0 = 10_000;
        // 2.9 s of 10× TTFT: weight drops to the floor, but no ejection.
        for i in 0..30 {
            h.record_ttft(t0 + i * 100, 1000.0, &c);
            h.tick(t0 + i * 100, &c);
            assert_ne!(h.est.state.name(), "ejected");
        }
        assert!(h.weight(t0 + 2900, &c) <= FLOOR + 1e-9);
        // Recovery: fast samples blend the peak back down and the severe clock resets.
        for i in 0..300 {
            h.record_ttft(t0 + 3000 + i * 100, 100.0, &c);
            h.tick(t0 + 3000 + i * 100, &c);
        }
        assert_eq!(h.est.state, State::Healthy);
        assert!(
            h.weight(t0 + 33_000, &c) > 0.9,
            "{}",
            h.weight(t0 + 33_000, &c)
        );
        // The same spike held past eject_after does eject.
        for i in 0..=35 {
            h.record_ttft(t0 + 40_000 + i * 100, 1000.0, &c);
            h.tick(t0 + 40_000 + i * 100, &c);
        }
        assert!(matches!(h.est.state, State::Ejected { .. }));
    }

    /// The finding behind the evidence weight: a variant's first sample was a cold 67 ms, and
    /// after it only refresh probes (one a second) measured it, at its true 42 ms; its peers'
    /// estimates, on hundreds of client samples, sat at 42. As a plain EWMA (decay 10 s) each
    /// probe moved it by a tenth: 57 ms after five probes, and the variant lost every
    /// comparison meanwhile. From any start, a few samples now bring it within 15% of the level.
    #[test]
    fn an_estimate_reaches_the_level_within_a_few_samples_from_any_start() {
        let c = cfg();
        for start in [67.0, 20.0, 30.0, 80.0] {
            let mut h = VariantHealth::new(0);
            h.record_ttft(0, start, &c);
            for i in 1..=5 {
                h.refresh_result(i * 1_000, Some(42.0), &c);
            }
            let p = h.predicted_ttft_ms(5_000, &c);
            assert!((p - 42.0).abs() <= 0.15 * 42.0, "from {start} ms: {p} ms");
            // Client samples, ten a second, do the same within the first few.
            let mut e = Ewma::default();
            e.record(0, start, c.decay_ms, true);
            for i in 1..=5 {
                e.record(i * 100, 42.0, c.decay_ms, true);
            }
            let v = e.get().unwrap();
            assert!((v - 42.0).abs() <= 0.15 * 42.0, "from {start} ms: {v} ms");
        }
        // The same samples after two different starts: the starts are forgotten alike.
        let after = |start: f64| {
            let mut e = Ewma::default();
            e.record(0, start, c.decay_ms, true);
            for i in 1..=10 {
                e.record(i * 1_000, 40.0 + (i % 3) as f64, c.decay_ms, true);
            }
            e.get().unwrap()
        };
        assert!((after(67.0) - after(25.0)).abs() < 0.15 * 41.0);
        // A settled estimate is moved by a sample's share of time, as any EWMA: one slower
        // sample a second after a hundred at 42 barely moves it (about a tenth of the
        // difference), and the evidence behind it is about decay / interval.
        let mut settled = Ewma::default();
        for i in 0..100 {
            settled.record(i * 100, 42.0, c.decay_ms, true);
        }
        assert!(settled.evidence() > 50.0, "{}", settled.evidence());
        settled.record(100 * 100 + 1_000, 62.0, c.decay_ms, true);
        let v = settled.get().unwrap();
        assert!(v > 42.0 && v <= 44.5, "{v}");
        // A first sample, and a peak it jumped to, are one sample's evidence.
        let mut fresh = Ewma::default();
        assert_eq!(fresh.evidence(), 0.0);
        fresh.record(0, 42.0, c.decay_ms, true);
        assert_eq!(fresh.evidence(), 1.0);
        settled.record(20_000, 200.0, c.decay_ms, true);
        assert_eq!((settled.get(), settled.evidence()), (Some(200.0), 1.0));
    }

    #[test]
    fn sustained_severity_ejects_then_probe_and_slow_start_ramp() {
        let c = cfg();
        let mut h = healthy_with_baseline(&c);
        let t0 = 10_000;
        // Errors become a condition once the window holds enough of them (about 1 s here), and
        // the variant is ejected 3 s later.
        for i in 0..=50 {
            h.record_outcome(t0 + i * 100, false, &c);
            h.tick(t0 + i * 100, &c);
        }
        assert!(
            matches!(h.est.state, State::Ejected { .. }),
            "{:?}",
            h.est.state
        );
        assert_eq!(h.weight(t0 + 5000, &c), 0.0);
        let State::Ejected { since_ms: t1, .. } = h.est.state else {
            unreachable!()
        };
        assert!(!h.take_probe(t1 + 500, &c));
        assert!(h.take_probe(t1 + 1000, &c));
        assert!(!h.take_probe(t1 + 1500, &c), "one probe per interval");
        h.probe_result(t1 + 1000, true, Some(100.0), &c);
        assert!(
            matches!(h.est.state, State::Ejected { .. }),
            "one good probe is not enough"
        );
        assert!(h.take_probe(t1 + 2000, &c));
        h.probe_result(t1 + 1100, true, Some(100.0), &c);
        assert_eq!(
            h.est.state,
            State::SlowStart {
                since_ms: t1 + 1100
            }
        );
        // The ramp: 10% at the start, half way at 5 s, full at 10 s.
        assert!((h.weight(t1 + 1100, &c) - FLOOR).abs() < 1e-9);
        assert!((h.weight(t1 + 6100, &c) - 0.5).abs() < 1e-9);
        h.tick(t1 + 11_100, &c);
        assert_eq!(h.est.state, State::Healthy);
        assert_eq!(h.weight(t1 + 11_100, &c), 1.0);
    }

    /// The probes that return an ejected variant are the warm-up's own request: they count
    /// toward it, so a returning variant is not asked the same thing twice over.
    #[test]
    fn the_probes_that_return_a_variant_count_toward_its_warm_up() {
        for (prewarm, after) in [
            (0, State::SlowStart { since_ms: 2_100 }),
            (2, State::SlowStart { since_ms: 2_100 }),
            (3, State::Warming { remaining: 1 }),
        ] {
            let c = HealthConfig {
                prewarm_requests: prewarm,
                ..cfg()
            };
            let mut h = VariantHealth::new(0);
            h.est.state = State::Ejected {
                since_ms: 0,
                last_probe_ms: 0,
            };
            h.probe_result(1_000, true, Some(100.0), &c);
            h.probe_result(2_100, true, Some(100.0), &c);
            assert_eq!(h.est.state, after, "prewarm {prewarm}");
        }
    }

    #[test]
    fn warm_up_takes_requests_before_traffic() {
        let c = HealthConfig {
            prewarm_requests: 2,
            ..Default::default()
        };
        let mut h = VariantHealth::new(2);
        assert_eq!(h.weight(0, &c), 0.0);
        h.record_outcome(1, true, &c);
        assert_eq!(h.est.state, State::Warming { remaining: 1 });
        h.record_outcome(2, true, &c);
        assert_eq!(h.est.state, State::SlowStart { since_ms: 2 });
    }

    #[test]
    fn p95_window() {
        let c = cfg();
        let mut h = VariantHealth::new(0);
        for i in 0..100 {
            h.record_ttft(i, (i % 20) as f64, &c);
        }
        // The last 64 samples hold 16..=19 four times and 0..=15 three times.
        assert_eq!(h.p95_ttft_ms(), Some(19.0));
        // Rank ceil(0.5 × 64) = 32 of 0,0,0,1,1,1,…,15,15,15,16,…: value 10.
        assert_eq!(h.ttft_quantile_ms(0.5), Some(10.0));
        assert_eq!(h.ttft_quantile_ms(1.0), Some(19.0));
        // Samples older than the window no longer count.
        h.record_ttft(100 + WINDOW_MS + 1, 500.0, &c);
        assert_eq!(h.ttft_quantile_ms(0.5), Some(500.0));
    }

    /// A tail quantile is the window's own only once two samples lie above it: seven samples,
    /// one of them a heavy draw, hold a P95 at that draw; forty hold it below both of their
    /// two slowest.
    #[test]
    fn a_tail_quantile_needs_samples_above_it() {
        let c = cfg();
        let mut h = VariantHealth::new(0);
        h.record_ttft(0, 600.0, &c);
        for i in 1..7 {
            h.record_ttft(i, 60.0, &c);
        }
        assert_eq!(h.ttft_quantile_ms(0.95), Some(600.0));
        assert_eq!(h.supported_ttft_quantile_ms(0.95), None);
        // The median of seven has three above it.
        assert_eq!(h.supported_ttft_quantile_ms(0.5), Some(60.0));
        for i in 7..39 {
            h.record_ttft(i, 60.0 + i as f64, &c);
        }
        // 39 samples: rank 38, one above.
        assert_eq!(h.supported_ttft_quantile_ms(0.95), None);
        h.record_ttft(39, 60.0, &c);
        // 40: rank 38 (97 ms), 98 and 600 above.
        assert_eq!(h.supported_ttft_quantile_ms(0.95), Some(97.0));
        assert_eq!(h.ttft_quantile_ms(0.95), Some(97.0));
    }

    #[test]
    fn window_quantiles_match_a_sort_of_the_recent_samples() {
        let mut rng = crate::rng::Rng::new(7);
        let mut w = TtftWindow::with_capacity(16);
        let mut all: Vec<(u64, f64)> = Vec::new();
        let mut t = 0;
        for i in 0..500u64 {
            // Bursts and gaps, so that both the capacity and the 60 s age evict samples.
            t += match i % 50 {
                0 => 70_000,
                n if n % 7 == 0 => 20_000,
                _ => 1000,
            };
            let v = (rng.next_u64() % 1000) as f64;
            w.record(t, v);
            all.push((t, v));
            let mut recent: Vec<f64> = all
                .iter()
                .rev()
                .take(16)
                .filter(|(at, _)| t - at <= WINDOW_MS)
                .map(|x| x.1)
                .collect();
            recent.sort_by(f64::total_cmp);
            for q in [0.0, 0.5, 0.9, 0.95, 1.0] {
                let rank = (recent.len() as f64 * q).ceil() as usize;
                assert_eq!(w.quantile(q), recent.get(rank.saturating_sub(1)).copied());
            }
        }
    }

    #[test]
    fn a_late_ttft_refreshes_a_stale_estimate_and_barely_moves_a_fresh_one() {
        let c = cfg();
        let mut stale = VariantHealth::new(0);
        stale.record_ttft(0, 360.0, &c);
        // Idle for a minute with no evidence at all: past the grace, the prediction has relaxed
        // toward zero.
        assert!(stale.predicted_ttft_ms(60_000, &c) < 5.0);
        stale.record_late_ttft(60_000, 150.0, &c);
        let p = stale.predicted_ttft_ms(60_000, &c);
        assert!(p > 150.0 && p <= 360.0, "{p}");

        let mut fresh = VariantHealth::new(0);
        fresh.record_ttft(0, 60.0, &c);
        fresh.record_late_ttft(200, 200.0, &c);
        let p = fresh.predicted_ttft_ms(200, &c);
        assert!(p > 60.0 && p < 70.0, "{p}");
    }

    #[test]
    fn estimates_stand_while_refresh_probes_are_due_and_a_probe_refreshes_them() {
        let c = cfg();
        let mut h = VariantHealth::new(0);
        assert!(h.needs_refresh(0, &c), "never measured");
        h.record_ttft(0, 360.0, &c);
        assert!(!h.needs_refresh(c.refresh_after_ms - 1, &c));
        assert!(h.needs_refresh(c.refresh_after_ms, &c));
        // Within the grace the slow estimate stands: no client is sent to re-measure it.
        let grace = STALE_GRACE * c.refresh_after_ms;
        assert_eq!(h.predicted_ttft_ms(grace, &c), 360.0);
        assert!(h.predicted_ttft_ms(grace + c.decay_ms as u64, &c) < 360.0);
        // A refresh probe's answer is fresh evidence: blended in when it confirms the estimate
        // roughly, replacing it when the estimate was an outlier (twice the probe or more).
        h.refresh_result(2_000, Some(200.0), &c);
        assert!(!h.needs_refresh(2_500, &c));
        let p = h.predicted_ttft_ms(2_000, &c);
        assert!(p < 360.0 && p > 200.0, "{p}");
        h.refresh_result(2_100, Some(60.0), &c);
        assert_eq!(h.predicted_ttft_ms(2_100, &c), 60.0);
        // A failed probe is an error outcome, and evidence too.
        h.refresh_result(3_000, None, &c);
        assert_eq!(h.last_sample_ms, Some(3_000));
        assert!(h.est.error_rate.get().unwrap() > 0.0);
        // Ejected and warming variants have their own probes.
        let mut w = VariantHealth::new(2);
        assert!(!w.needs_refresh(10_000, &c));
        w.est.state = State::Ejected {
            since_ms: 0,
            last_probe_ms: 0,
        };
        assert!(!w.needs_refresh(10_000, &c));
    }

    /// A variant out of the draw (a slow zone) whose refresh probes keep finding the same
    /// level is re-measured less often: 1 s, 2 s, 4 s, then every 8 s; a probe that finds it
    /// changed (or fails) brings the interval back to a second.
    #[test]
    fn refresh_probes_that_confirm_the_estimate_spread_out() {
        let c = cfg();
        let r = c.refresh_after_ms;
        let mut h = VariantHealth::new(0);
        h.record_ttft(0, 360.0, &c);
        let mut at = 0;
        for wait in [r, 2 * r, 4 * r, 8 * r, 8 * r] {
            assert!(!h.needs_refresh(at + wait - 1, &c), "{wait}");
            assert!(h.needs_refresh(at + wait, &c), "{wait}");
            at += wait;
            h.refresh_result(at, Some(380.0), &c);
        }
        assert!(
            8 * r < STALE_GRACE * r,
            "spread within the grace: the estimate never relaxes"
        );
        assert_eq!(
            h.predicted_ttft_ms(at + 8 * r, &c),
            h.est.ttft_ms.get().unwrap()
        );
        // The zone recovered: the probe disagrees, the next one is due a second later.
        h.refresh_result(at, Some(60.0), &c);
        assert!(h.needs_refresh(at + r, &c));
        h.refresh_result(at + r, Some(61.0), &c);
        assert!(!h.needs_refresh(at + 2 * r, &c));
        h.refresh_result(at + 3 * r, None, &c);
        assert!(
            h.needs_refresh(at + 4 * r, &c),
            "a failure resets the spread"
        );
    }

    /// A client sample the estimate jumps to resets the spread: an idle variant whose probes
    /// had confirmed its level for a while, then answers a client at twice it, is probed again
    /// after an eighth of the interval, not eight intervals; then a whole interval later.
    #[test]
    fn a_peak_is_re_measured_within_an_eighth_of_the_interval() {
        let c = cfg();
        let r = c.refresh_after_ms;
        let soon = r / JUMP_RECHECK;
        let mut h = VariantHealth::new(0);
        h.record_ttft(0, 40.0, &c);
        let mut at = 0;
        for wait in [r, 2 * r, 4 * r] {
            at += wait;
            h.refresh_result(at, Some(41.0), &c);
        }
        assert!(!h.needs_refresh(at + 4 * r, &c), "the spread holds");
        h.record_ttft(at + 100, 45.0, &c);
        assert!(
            !h.needs_refresh(at + 100 + 4 * r, &c),
            "an ordinary sample keeps the spread"
        );
        at += 200;
        h.record_ttft(at, 120.0, &c);
        assert!(!h.needs_refresh(at + soon - 1, &c));
        assert!(h.needs_refresh(at + soon, &c), "a peak is re-measured soon");
        // The probe finds the old level: the estimate is back, and the next probe a whole
        // interval later (the spread starts again, the peak having broken it).
        at += soon;
        h.refresh_result(at, Some(42.0), &c);
        assert_eq!(h.est.ttft_ms.get(), Some(42.0));
        assert!(!h.needs_refresh(at + r - 1, &c));
        assert!(h.needs_refresh(at + r, &c));
        // A client's sample after a peak is evidence as good as a probe's.
        h.record_ttft(at + r, 130.0, &c);
        h.record_ttft(at + r + 10, 128.0, &c);
        assert!(!h.needs_refresh(at + r + 10 + soon, &c));
    }

    /// A variant whose recent first tokens include draws as slow as a new one takes it as its
    /// tail: the estimate blends it in, and no early re-measure is due. A sample slower than
    /// anything seen, or seen once only, is still a peak.
    #[test]
    fn a_draw_from_the_variants_own_tail_blends_in() {
        let c = cfg();
        let soon = c.refresh_after_ms / JUMP_RECHECK;
        let mut h = VariantHealth::new(0);
        let mut at = 0;
        for i in 0..30 {
            at += 100;
            h.record_ttft(at, if i % 15 == 7 { 130.0 } else { 40.0 }, &c);
        }
        // The first 130 ms draw jumped; the second had one precedent and jumped too.
        let before = h.est.ttft_ms.get().unwrap();
        assert!(before < 60.0, "{before}");
        at += 100;
        h.record_ttft(at, 120.0, &c);
        let after = h.est.ttft_ms.get().unwrap();
        assert!(
            after > before && after < 2.0 * before,
            "{before} -> {after}"
        );
        assert!(!h.needs_refresh(at + soon, &c), "no early re-measure");
        // Slower than any recent draw: a peak.
        at += 100;
        h.record_ttft(at, 400.0, &c);
        assert_eq!(h.est.ttft_ms.get(), Some(400.0));
        assert!(h.needs_refresh(at + soon, &c));
    }

    /// A draw the pool's other variants have matched is the pool's tail, whichever variant it
    /// fell on: it blends in although the variant's own window has never seen one like it. A
    /// draw slower than the pool's recent first tokens is still a peak.
    #[test]
    fn a_draw_the_pool_has_matched_blends_in() {
        let c = cfg();
        let soon = c.refresh_after_ms / JUMP_RECHECK;
        let mut h = VariantHealth::new(0);
        let mut at = 0;
        for _ in 0..20 {
            at += 100;
            h.record_ttft(at, 40.0, &c);
        }
        at += 100;
        h.record_ttft_among(at, 130.0, JUMP_PRECEDENTS, &c);
        let blended = h.est.ttft_ms.get().unwrap();
        assert!(blended < 80.0, "{blended}");
        assert!(!h.needs_refresh(at + soon, &c), "no early re-measure");
        at += 100;
        h.record_ttft_among(at, 400.0, JUMP_PRECEDENTS - 1, &c);
        assert_eq!(h.est.ttft_ms.get(), Some(400.0), "a peak");
        assert!(h.needs_refresh(at + soon, &c));
    }

    /// Several windows' samples of the last 60 s at least a value, counted together.
    #[test]
    fn samples_at_least_a_value_are_counted_over_windows_and_time() {
        let (mut a, mut b) = (TtftWindow::default(), TtftWindow::default());
        a.record(0, 500.0);
        a.record(1_000, 100.0);
        b.record(2_000, 300.0);
        b.record(3_000, 50.0);
        let both = [&a, &b];
        assert_eq!(TtftWindow::at_least_of(&both, 3_000, 100.0), 3);
        assert_eq!(TtftWindow::at_least_of(&both, 3_000, 301.0), 1);
        // The 500 ms sample is over 60 s old.
        assert_eq!(TtftWindow::at_least_of(&both, WINDOW_MS + 1, 100.0), 2);
    }

    /// Warm-ups that agree confirm the level as refresh probes do: a variant out of the draw
    /// from its start is first re-measured after two intervals. Warm-ups that disagree (a cold
    /// first one) leave it at one.
    #[test]
    fn agreeing_warm_ups_spread_the_first_refresh() {
        let c = cfg();
        let r = c.refresh_after_ms;
        for (second, wait) in [(370.0, 2 * r), (200.0, r)] {
            let mut h = VariantHealth::new(0);
            h.record_warm_up(0, 360.0, &c);
            h.record_warm_up(100, second, &c);
            assert!(!h.needs_refresh(100 + wait - 1, &c), "{second}");
            assert!(h.needs_refresh(100 + wait, &c), "{second}");
        }
    }

    /// The probes that return an ejected variant confirm its level when they agree with each
    /// other: its first refresh is two intervals later.
    #[test]
    fn returning_probes_that_agree_spread_the_first_refresh() {
        let c = cfg();
        let r = c.refresh_after_ms;
        for (first, wait) in [(61.0, 2 * r), (150.0, r)] {
            let mut h = VariantHealth::new(0);
            h.est.state = State::Ejected {
                since_ms: 0,
                last_probe_ms: 0,
            };
            h.probe_result(1_000, true, Some(first), &c);
            h.probe_result(2_000, true, Some(60.0), &c);
            assert!(matches!(h.est.state, State::SlowStart { .. }));
            assert!(!h.needs_refresh(2_000 + wait - 1, &c), "{first}");
            assert!(h.needs_refresh(2_000 + wait, &c), "{first}");
        }
    }

    /// The break rate starts from a prior of unbroken streams: one break among a variant's
    /// first streams reads under 5% and costs less than the equivalence band, while a variant
    /// that keeps breaking one stream in ten reaches 10% and loses a third of its weight. It
    /// relaxes once no stream has ended for longer than the grace.
    #[test]
    fn the_break_rate_prices_streams_that_break_not_one_unlucky_stream() {
        let c = cfg();
        let mut h = VariantHealth::new(0);
        h.record_stream_end(0, true);
        let f = h.est.factors(0, &c).breaks;
        assert!(f > 1.0 / crate::p2c::EQUIVALENT, "one break: {f}");
        let mut at = 0;
        for i in 0..600 {
            at += 200;
            h.record_stream_end(at, i % 10 == 0);
        }
        let rate = h.est.break_rate.get().unwrap();
        assert!((rate - 0.1).abs() < 0.02, "{rate}");
        let f = h.est.factors(at, &c).breaks;
        assert!((0.55..0.72).contains(&f), "{f}");
        let later = at + STALE_GRACE * c.refresh_after_ms + 60_000;
        assert!(h.est.factors(later, &c).breaks > f, "relaxes");
        // A variant whose streams do not break keeps its full weight.
        let mut ok = VariantHealth::new(0);
        for i in 0..100 {
            ok.record_stream_end(i * 200, false);
        }
        assert_eq!(ok.est.factors(20_000, &c).breaks, 1.0);
    }

    fn gaps_of(ms: f64, n: usize) -> crate::stream_watch::Gaps {
        std::iter::repeat_n(ms, n).collect()
    }

    /// A probe's pace refreshes the gap estimate: blended in, or replacing it when the variant
    /// is twice as fast as estimated or more (a slow decoder recovered).
    #[test]
    fn a_probes_pace_refreshes_the_gap_estimate() {
        let c = cfg();
        let r = c.refresh_after_ms;
        let mut h = VariantHealth::new(0);
        h.record_probe_gaps(0, &gaps_of(32.0, 7), &c);
        assert_eq!(h.est.gap_ms.get(), Some(32.0));
        h.record_probe_gaps(r, &gaps_of(30.0, 7), &c);
        let blended = h.est.gap_ms.get().unwrap();
        assert!(blended > 30.0 && blended < 32.0, "{blended}");
        h.record_probe_gaps(2 * r, &gaps_of(8.0, 7), &c);
        assert_eq!(h.est.gap_ms.get(), Some(8.0));
        // A stream without gaps (a single token) says nothing of the pace.
        h.record_probe_gaps(3 * r, &gaps_of(0.0, 0), &c);
        assert_eq!(h.est.gap_ms.get(), Some(8.0));
    }

    /// The gap estimate's trust holds within the grace, then fades over `decay_ms`.
    #[test]
    fn the_gap_estimate_is_trusted_less_once_nothing_measures_it() {
        let c = cfg();
        let mut h = VariantHealth::new(0);
        assert_eq!(h.est.gap_trust(0, &c), 1.0);
        h.record_stream_gaps(1_000, &gaps_of(32.0, 20), &c);
        let grace = STALE_GRACE * c.refresh_after_ms;
        assert_eq!(h.est.gap_trust(1_000 + grace, &c), 1.0);
        let later = h.est.gap_trust(1_000 + grace + c.decay_ms as u64, &c);
        assert!((later - (-1f64).exp()).abs() < 1e-9, "{later}");
        assert!(h.est.steady_until_ms(&c).unwrap() <= 1_000 + grace);
    }

    /// Windows counted apart combine as one window over all their recent samples.
    #[test]
    fn windows_counted_apart_give_the_quantile_of_all_their_samples() {
        let (mut a, mut b, mut one) = (
            TtftWindow::with_capacity(64),
            TtftWindow::with_capacity(64),
            TtftWindow::with_capacity(128),
        );
        for i in 0..40u64 {
            let v = (i * 37 % 101) as f64;
            if i % 3 == 0 {
                a.record(1_000 + i, v)
            } else {
                b.record(1_000 + i, v)
            }
            one.record(1_000 + i, v);
        }
        for q in [0.0, 0.5, 0.9, 0.95, 1.0] {
            assert_eq!(
                TtftWindow::quantile_of(&[&a, &b], 2_000, q),
                one.quantile(q),
                "{q}"
            );
        }
        // A window idle for over a minute no longer counts.
        let mut idle = TtftWindow::with_capacity(64);
        idle.record(0, 10_000.0);
        assert_eq!(
            TtftWindow::quantile_of(&[&a, &b, &idle], 61_000, 1.0),
            one.quantile(1.0)
        );
        assert_eq!(TtftWindow::quantile_of::<&TtftWindow>(&[], 0, 0.5), None);
    }
}
