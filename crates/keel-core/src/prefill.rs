//! How much longer a long prompt takes to its first token on a variant: its prefill time per
//! prompt token, fitted to its recent first tokens.
//!
//! A server reads the whole prompt before its first token, so a prompt of 2,000 tokens answers
//! later than one of 20 on every variant alike. A hedge delay read from a variant's TTFT
//! quantile is a figure for the usual prompt: a long prompt passes it by its prefill alone and
//! is raced, and the hedge, which must read the same prompt from the start, almost never
//! answers first. The fit says how much of a prompt's wait is its length, so a long prompt is
//! raced only once it is late for a prompt of its size.

/// Samples' weight halves about every 42 s (e-folds every 60 s): a variant's prefill rate is a
/// property of its model and hardware, which change rarely, so the fit keeps a minute of
/// evidence; long prompts are a few in a hundred, and a shorter memory would hold too few.
pub const PREFILL_DECAY_MS: f64 = 60_000.0;

/// Samples (weighted by age) before the fit says anything.
pub const PREFILL_MIN_SAMPLES: f64 = 20.0;

/// The most the fit believes a prompt token costs (1 ms: 10,000 tokens in 10 s). Real servers
/// prefill at 0.01–0.5 ms a token; a steeper fit is a few noisy samples.
pub const MAX_MS_PER_TOKEN: f64 = 1.0;

/// Standard errors taken off the fitted slope: the delay is extended by what the samples show
/// with some confidence, so a pool whose prompts are all alike, or whose first tokens do not
/// depend on them, extends nothing or next to nothing. One, not two: a heavy tail's draws make
/// the slope's error a few tenths of itself over a minute of samples, and what an overstated
/// slope costs is small (a long prompt's hedge a little later), where an understated one
/// keeps the races a long prompt cannot win.
const CONFIDENCE: f64 = 1.0;

/// Time-decayed least squares of a variant's TTFT (ms) on its prompts' estimated tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillFit {
    at_ms: u64,
    /// Sums over the samples, each weighted by `e^(−age / PREFILL_DECAY_MS)`.
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    syy: f64,
}

/// What a fit says: the prefill time a prompt token costs, and the mean prompt of the samples
/// behind it (the quantile a hedge delay is read from is a figure for prompts about that long).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prefill {
    pub ms_per_token: f64,
    pub mean_tokens: f64,
}

impl Prefill {
    /// How much longer than the mean prompt `tokens` should take to its first token; 0 for a
    /// prompt no longer than the mean (a short prompt's delay stays the quantile's: the
    /// extension only spares long prompts a race they cannot win).
    pub fn extra_ms(&self, tokens: u64) -> f64 {
        (tokens as f64 - self.mean_tokens).max(0.0) * self.ms_per_token
    }
}

impl PrefillFit {
    /// One answered first token of a prompt of `tokens` (estimated).
    pub fn record(&mut self, now_ms: u64, tokens: u64, ttft_ms: f64) {
        if !ttft_ms.is_finite() || ttft_ms < 0.0 {
            return;
        }
        let keep = (-(now_ms.saturating_sub(self.at_ms) as f64) / PREFILL_DECAY_MS).exp();
        let (x, y) = (tokens as f64, ttft_ms);
        self.n = self.n * keep + 1.0;
        self.sx = self.sx * keep + x;
        self.sy = self.sy * keep + y;
        self.sxx = self.sxx * keep + x * x;
        self.sxy = self.sxy * keep + x * y;
        self.syy = self.syy * keep + y * y;
        self.at_ms = now_ms;
    }

    /// The prefill rate the samples show with confidence (the fitted slope less
    /// [`CONFIDENCE`] standard errors, at most [`MAX_MS_PER_TOKEN`]); `None` before
    /// [`PREFILL_MIN_SAMPLES`], or when the samples show none (prompts all alike, or a slope
    /// lost in the noise).
    pub fn prefill(&self) -> Option<Prefill> {
        if self.n < PREFILL_MIN_SAMPLES {
            return None;
        }
        let n = self.n;
        let mean_x = self.sx / n;
        let mean_y = self.sy / n;
        let var_x = self.sxx / n - mean_x * mean_x;
        // Below a token's spread the prompts are alike: there is no slope to fit.
        if var_x < 1.0 {
            return None;
        }
        let cov = self.sxy / n - mean_x * mean_y;
        let slope = cov / var_x;
        let var_y = (self.syy / n - mean_y * mean_y).max(0.0);
        let resid = (var_y - slope * cov).max(0.0);
        let se = (resid / ((n - 2.0).max(1.0) * var_x)).sqrt();
        let sure = (slope - CONFIDENCE * se).min(MAX_MS_PER_TOKEN);
        (sure > 0.0).then_some(Prefill {
            ms_per_token: sure,
            mean_tokens: mean_x,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// Prompts of 20, 300 and 2,000 tokens (70%, 25%, 5%), prefilled at `rate` ms a token
    /// after a lognormal 60 ms (σ 0.5), with a 2% tail ×10: heavy-tail's fleet.
    fn heavy_tail(rate: f64, samples: u64, seed: u64) -> PrefillFit {
        let mut rng = Rng::new(seed);
        let mut fit = PrefillFit::default();
        for i in 0..samples {
            let r = rng.next_f64();
            let tokens = if r < 0.7 {
                20
            } else if r < 0.95 {
                300
            } else {
                2000
            };
            let mut ttft = 60.0 * (0.5 * rng.normal()).exp();
            if rng.next_f64() < 0.02 {
                ttft *= 10.0;
            }
            fit.record(i * 200, tokens, ttft + rate * tokens as f64);
        }
        fit
    }

    #[test]
    fn a_long_prompt_waits_for_its_prefill() {
        for seed in 1..=20 {
            let p = heavy_tail(0.1, 300, seed).prefill().expect("a slope");
            assert!(
                p.ms_per_token > 0.05 && p.ms_per_token < 0.13,
                "{seed}: {p:?}"
            );
            let extra = p.extra_ms(2000);
            assert!(extra > 100.0 && extra < 230.0, "{seed}: {extra}");
            assert_eq!(
                p.extra_ms(20),
                0.0,
                "a short prompt keeps the quantile's delay"
            );
        }
    }

    #[test]
    fn no_slope_no_extension() {
        // First tokens independent of the prompt: the fit finds nothing to extend by in most
        // draws, and never much.
        let mut found = 0;
        for seed in 1..=20 {
            if let Some(p) = heavy_tail(0.0, 300, seed).prefill() {
                found += 1;
                assert!(p.extra_ms(2000) < 40.0, "{seed}: {p:?}");
            }
        }
        assert!(found <= 4, "{found} of 20 found a slope in noise");
        // Prompts all alike.
        let mut fit = PrefillFit::default();
        for i in 0..100 {
            fit.record(i * 100, 500, 50.0 + (i % 7) as f64);
        }
        assert_eq!(fit.prefill(), None);
        // Too few samples.
        assert_eq!(heavy_tail(0.1, 10, 1).prefill(), None);
    }

    #[test]
    fn old_samples_fade() {
        // A minute of a slow prefill, then ten minutes of a fast one: the fit follows.
        let mut fit = heavy_tail(0.5, 300, 3);
        let mut rng = Rng::new(9);
        for i in 0..3000u64 {
            let tokens = if i % 10 == 0 { 2000 } else { 20 };
            let ttft = 60.0 * (0.3 * rng.normal()).exp() + 0.05 * tokens as f64;
            fit.record(60_000 + i * 200, tokens, ttft);
        }
        let p = fit.prefill().expect("a slope");
        assert!(p.ms_per_token < 0.07, "{p:?}");
    }

    #[test]
    fn the_rate_is_capped_and_nonsense_is_ignored() {
        let mut fit = PrefillFit::default();
        for i in 0..100u64 {
            let tokens = (i % 10) * 100;
            fit.record(i * 10, tokens, 5.0 * tokens as f64);
            fit.record(i * 10, tokens, f64::NAN);
            fit.record(i * 10, tokens, -1.0);
        }
        let p = fit.prefill().unwrap();
        assert_eq!(p.ms_per_token, MAX_MS_PER_TOKEN);
    }
}
