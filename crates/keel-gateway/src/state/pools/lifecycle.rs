//! A variant's lifecycle: cooldowns, loading and restarts, credentials, the outcome of every
//! attempt recorded into its health, and the maintenance the monitor does (probes, warm-ups,
//! refreshes, scrapes).

use keel_core::health::{State, PEAK_JUMP};

use super::*;

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
    pub(super) fn warm_up_failed(&mut self, now_ms: u64) {
        self.warm_up_failures = self.warm_up_failures.saturating_add(1);
        self.warm_up_failed_at_ms = now_ms;
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

impl Pool {
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
    pub(super) fn restart_step(
        &self,
        st: &mut VariantState,
        index: usize,
        now: u64,
        grace: u64,
    ) -> bool {
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
    /// failures; `ttft_ms` is the time to the first token (or whole body), of a client prompt
    /// of `prompt_tokens` (estimated) where it was one.
    pub fn record_attempt(
        &self,
        index: usize,
        ok: bool,
        ttft_ms: Option<f64>,
        prompt_tokens: Option<u64>,
    ) {
        let now = self.now_ms();
        if let Some(c) = &self.canary {
            c.observe_attempt(index, ok, ttft_ms, now);
        }
        let hc = self.cfg.health;
        let mut precedents = 0;
        if let Some(t) = ttft_ms {
            // Only a first token that could jump the estimate needs the pool's context.
            let jump_at = self.live(index).est.ttft_ms.get().map(|v| v * PEAK_JUMP);
            if jump_at.is_some_and(|j| t >= j) {
                precedents = self.pool_ttft_at_least(now, t);
            }
            self.record_pool_ttft(now, t);
        }
        self.update(index, |st| {
            let h = &mut st.health;
            if let Some(t) = ttft_ms {
                h.record_ttft_among(now, t, precedents, &hc);
                if let Some(tokens) = prompt_tokens {
                    h.record_prefill(now, tokens, t);
                }
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
    /// Feeds a finished client stream: its inter-token gaps, and its length for the pool's
    /// typical answer.
    pub fn record_stream(&self, index: usize, gaps: &keel_core::stream_watch::Gaps) {
        if !gaps.is_empty() {
            // A stream of n tokens has n − 1 gaps between them.
            self.record_answer_tokens(gaps.len() as f64 + 1.0);
        }
        let now = self.now_ms();
        let hc = self.cfg.health;
        self.update(index, |st| {
            st.health.record_stream_gaps(now, gaps, &hc);
            st.health.record_stream_end(now, false);
            st.health.tick(now, &hc);
        });
    }
    /// A client stream broke after its first token (it stalled, or failed with an error).
    pub fn record_break(&self, index: usize) {
        let now = self.now_ms();
        self.update(index, |st| st.health.record_stream_end(now, true));
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
                } else if st.availability.available(now) && st.health.take_probe(now, &hc) {
                    // Probed once its cooldown is over: a `retry-after` is the server's own
                    // word on when to ask again, and a probe before it would only be refused
                    // (in a 429 storm, every second probe).
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
    /// A probe's or warm-up's end: `ok` when it served, with its TTFT, and the gaps between
    /// its tokens when its stream reached its end.
    pub fn maintenance_done(
        &self,
        m: Maintenance,
        ok: bool,
        ttft_ms: Option<f64>,
        gaps: Option<&keel_core::stream_watch::Gaps>,
    ) {
        self.update(m.variant(), |st| {
            self.maintenance_result(st, m, ok, ttft_ms, gaps)
        });
    }
    pub(super) fn maintenance_result(
        &self,
        st: &mut VariantState,
        m: Maintenance,
        ok: bool,
        ttft_ms: Option<f64>,
        gaps: Option<&keel_core::stream_watch::Gaps>,
    ) {
        let now = self.now_ms();
        let hc = self.cfg.health;
        // The pace its stream showed.
        if let Some(g) = gaps.filter(|_| ok) {
            st.health.record_probe_gaps(now, g, &hc);
        }
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
                        st.health.record_warm_up(now, t, &hc);
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
}
