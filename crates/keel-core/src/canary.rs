//! Canary rollouts, the pure part: which side of a split a user is on, and when the split moves.
//!
//! A pool's variants are cut into a *stable* set and a *candidate* set. Each request's identity
//! (a key, a tenant, the client's `user`, a header) hashes to a bucket in `0..10_000`; the
//! request goes to the candidate side when its bucket is below the candidate's weight in basis
//! points. The hash does not change, so a user stays on one side while the weight holds, and a
//! user who reached the candidate stays there as the weight grows (the set of buckets below the
//! weight only grows).
//!
//! The weight walks through configured steps (for example 1 % → 5 % → 20 % → 100 %). Each step
//! lasts at least `dwell_ms` and at least `min_requests` candidate attempts; it advances only if
//! the candidate's error rate, TTFT P99 and (when shadow comparisons exist) agreement stayed
//! within their thresholds over the step. The moment one is out of bounds (judged once
//! `min_requests` attempts were seen), the canary rolls back by itself: the weight drops to 0
//! and stays there until an operator promotes it. Time is passed in; nothing here reads a clock.

use crate::rng::hash_bytes;

/// Buckets a weight is counted in: 10 000 = 100 %.
pub const BUCKETS: u32 = 10_000;

/// TTFT samples kept per step for the P99 (the most recent ones).
const TTFT_SAMPLES: usize = 1024;

/// When a canary moves.
#[derive(Debug, Clone, PartialEq)]
pub struct CanaryConfig {
    /// Candidate weights in percent, ascending; the last is 100 (reaching it promotes).
    pub steps: Vec<f64>,
    /// The least time spent at one step before advancing.
    pub dwell_ms: u64,
    /// Candidate attempts a step needs before it is judged (advance or roll back).
    pub min_requests: u64,
    /// Roll back when the candidate's share of failed attempts exceeds this.
    pub max_error_rate: f64,
    /// Roll back when the candidate's TTFT P99 over the step exceeds this.
    pub max_ttft_p99_ms: Option<f64>,
    /// Roll back when the mean shadow similarity over the step falls below this (judged only
    /// once `min_requests` comparisons exist).
    pub min_agreement: Option<f64>,
}

/// Where the rollout stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// At `steps[step]`.
    Rolling { step: usize },
    /// Every user on the candidate side.
    Promoted,
    /// Every user on the stable side.
    RolledBack,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Rolling { .. } => "rolling",
            Phase::Promoted => "promoted",
            Phase::RolledBack => "rolled_back",
        }
    }
}

/// Which variant set serves a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Stable,
    Candidate,
}

impl Side {
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Stable => "stable",
            Side::Candidate => "candidate",
        }
    }
}

/// What the candidate did during the current step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStats {
    pub attempts: u64,
    pub errors: u64,
    /// The latest TTFTs (at most [`TTFT_SAMPLES`]), in arrival order within a ring.
    ttft_ms: Vec<f64>,
    ttft_next: usize,
    pub agreement_sum: f64,
    pub agreement_n: u64,
}

impl StepStats {
    pub fn error_rate(&self) -> Option<f64> {
        (self.attempts > 0).then(|| self.errors as f64 / self.attempts as f64)
    }

    /// The P99 of the kept TTFT samples (nearest rank).
    pub fn ttft_p99_ms(&self) -> Option<f64> {
        if self.ttft_ms.is_empty() {
            return None;
        }
        let mut v = self.ttft_ms.clone();
        let rank = ((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1;
        let (_, p, _) = v.select_nth_unstable_by(rank, f64::total_cmp);
        Some(*p)
    }

    pub fn agreement(&self) -> Option<f64> {
        (self.agreement_n > 0).then(|| self.agreement_sum / self.agreement_n as f64)
    }

    fn push_ttft(&mut self, ms: f64) {
        if self.ttft_ms.len() < TTFT_SAMPLES {
            self.ttft_ms.push(ms);
        } else {
            self.ttft_ms[self.ttft_next] = ms;
            self.ttft_next = (self.ttft_next + 1) % TTFT_SAMPLES;
        }
    }
}

/// How the weight moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    Advanced,
    Promoted,
    RolledBack,
}

impl Move {
    pub fn as_str(self) -> &'static str {
        match self {
            Move::Advanced => "advanced",
            Move::Promoted => "promoted",
            Move::RolledBack => "rolled_back",
        }
    }
}

/// One change of the weight, with its reason.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub kind: Move,
    pub from_bp: u32,
    pub to_bp: u32,
    /// Why, in words (the thresholds that held, or the one that broke).
    pub reason: String,
    /// Ordered by an operator, not by the thresholds.
    pub manual: bool,
}

/// One pool's canary.
#[derive(Debug, Clone)]
pub struct Canary {
    pub cfg: CanaryConfig,
    pub phase: Phase,
    /// When the current phase began.
    pub since_ms: u64,
    pub stats: StepStats,
    /// The last transition, for the health document.
    pub last: Option<Transition>,
}

/// The bucket (`0..BUCKETS`) of an identity; `salt` (the pool's name) makes pools split
/// independently.
pub fn bucket(salt: &str, identity: &[u8]) -> u32 {
    let seed = hash_bytes(0x6361_6e61_7279, salt.as_bytes());
    (hash_bytes(seed, identity) % BUCKETS as u64) as u32
}

/// A percent weight in basis points.
fn bp(percent: f64) -> u32 {
    ((percent * 100.0).round().clamp(0.0, BUCKETS as f64)) as u32
}

impl Canary {
    /// A canary at its first step.
    pub fn new(cfg: CanaryConfig, now_ms: u64) -> Self {
        Canary {
            cfg,
            phase: Phase::Rolling { step: 0 },
            since_ms: now_ms,
            stats: StepStats::default(),
            last: None,
        }
    }

    /// The candidate's weight now, in basis points.
    pub fn weight_bp(&self) -> u32 {
        match self.phase {
            Phase::Rolling { step } => bp(self.cfg.steps.get(step).copied().unwrap_or(100.0)),
            Phase::Promoted => BUCKETS,
            Phase::RolledBack => 0,
        }
    }

    /// The side of a request whose identity falls in `bucket`.
    pub fn side(&self, bucket: u32) -> Side {
        if bucket < self.weight_bp() {
            Side::Candidate
        } else {
            Side::Stable
        }
    }

    /// One attempt on a candidate variant ended (`ttft_ms`: its first token, when it had one);
    /// returns the transition it caused, if any.
    pub fn observe_attempt(
        &mut self,
        ok: bool,
        ttft_ms: Option<f64>,
        now_ms: u64,
    ) -> Option<Transition> {
        if !matches!(self.phase, Phase::Rolling { .. }) {
            return None;
        }
        self.stats.attempts += 1;
        if !ok {
            self.stats.errors += 1;
        }
        if let Some(t) = ttft_ms {
            self.stats.push_ttft(t);
        }
        self.evaluate(now_ms)
    }

    /// One shadow comparison (similarity in 0..=1) of the candidate with the served answer.
    pub fn observe_agreement(&mut self, similarity: f64, now_ms: u64) -> Option<Transition> {
        if !matches!(self.phase, Phase::Rolling { .. }) {
            return None;
        }
        self.stats.agreement_sum += similarity.clamp(0.0, 1.0);
        self.stats.agreement_n += 1;
        self.evaluate(now_ms)
    }

    /// Judges the current step: rolls back when a threshold broke, advances when the step
    /// lasted long enough with enough evidence. Call it on every observation and read.
    pub fn evaluate(&mut self, now_ms: u64) -> Option<Transition> {
        let Phase::Rolling { step } = self.phase else {
            return None;
        };
        if self.stats.attempts < self.cfg.min_requests {
            return None;
        }
        if let Some(why) = self.broken() {
            return Some(self.roll_back_with(why, false, now_ms));
        }
        if now_ms.saturating_sub(self.since_ms) < self.cfg.dwell_ms {
            return None;
        }
        let why = self.healthy_summary();
        let next = step + 1;
        let to = if next >= self.cfg.steps.len() || self.cfg.steps[next] >= 100.0 {
            Phase::Promoted
        } else {
            Phase::Rolling { step: next }
        };
        let kind = if to == Phase::Promoted {
            Move::Promoted
        } else {
            Move::Advanced
        };
        Some(self.go(to, kind, why, false, now_ms))
    }

    /// The first threshold the step broke, in words.
    fn broken(&self) -> Option<String> {
        let s = &self.stats;
        let rate = s.error_rate().unwrap_or(0.0);
        if rate > self.cfg.max_error_rate {
            return Some(format!(
                "candidate error rate {rate:.3} > max_error_rate {} ({} of {} attempts)",
                self.cfg.max_error_rate, s.errors, s.attempts
            ));
        }
        if let (Some(max), Some(p99)) = (self.cfg.max_ttft_p99_ms, s.ttft_p99_ms()) {
            if p99 > max {
                return Some(format!(
                    "candidate TTFT P99 {p99:.0} ms > max_ttft_p99_ms {max}"
                ));
            }
        }
        if let (Some(min), Some(a)) = (self.cfg.min_agreement, s.agreement()) {
            if s.agreement_n >= self.cfg.min_requests && a < min {
                return Some(format!(
                    "shadow agreement {a:.3} < min_agreement {min} over {} comparisons",
                    s.agreement_n
                ));
            }
        }
        None
    }

    fn healthy_summary(&self) -> String {
        let s = &self.stats;
        let mut why = format!(
            "healthy over the step: error rate {:.3} in {} attempts",
            s.error_rate().unwrap_or(0.0),
            s.attempts
        );
        if let Some(p) = s.ttft_p99_ms() {
            why.push_str(&format!(", TTFT P99 {p:.0} ms"));
        }
        if let Some(a) = s.agreement() {
            why.push_str(&format!(", agreement {a:.3}"));
        }
        why
    }

    /// An operator's promotion: every user on the candidate side.
    pub fn promote(&mut self, now_ms: u64) -> Option<Transition> {
        if self.phase == Phase::Promoted {
            return None;
        }
        Some(self.go(
            Phase::Promoted,
            Move::Promoted,
            "promoted by an operator".into(),
            true,
            now_ms,
        ))
    }

    /// An operator's rollback: every user on the stable side.
    pub fn roll_back(&mut self, now_ms: u64) -> Option<Transition> {
        if self.phase == Phase::RolledBack {
            return None;
        }
        Some(self.roll_back_with("rolled back by an operator".into(), true, now_ms))
    }

    fn roll_back_with(&mut self, why: String, manual: bool, now_ms: u64) -> Transition {
        self.go(Phase::RolledBack, Move::RolledBack, why, manual, now_ms)
    }

    fn go(
        &mut self,
        to: Phase,
        kind: Move,
        reason: String,
        manual: bool,
        now_ms: u64,
    ) -> Transition {
        let from_bp = self.weight_bp();
        self.phase = to;
        self.since_ms = now_ms;
        self.stats = StepStats::default();
        let t = Transition {
            kind,
            from_bp,
            to_bp: self.weight_bp(),
            reason,
            manual,
        };
        self.last = Some(t.clone());
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> CanaryConfig {
        CanaryConfig {
            steps: vec![1.0, 5.0, 20.0, 100.0],
            dwell_ms: 1_000,
            min_requests: 10,
            max_error_rate: 0.1,
            max_ttft_p99_ms: Some(500.0),
            min_agreement: Some(0.8),
        }
    }

    fn feed(c: &mut Canary, n: u64, errors: u64, ttft: f64, now: u64) -> Option<Transition> {
        let mut last = None;
        for i in 0..n {
            if let Some(t) = c.observe_attempt(i >= errors, Some(ttft), now) {
                last = Some(t);
            }
        }
        last
    }

    #[test]
    fn buckets_are_stable_and_spread() {
        assert_eq!(bucket("p", b"alice"), bucket("p", b"alice"));
        assert_ne!(bucket("p", b"alice"), bucket("q", b"alice"));
        // 10 000 identities land about evenly in ten slices of the bucket range.
        let mut slices = [0u32; 10];
        for i in 0..10_000 {
            slices[(bucket("p", format!("user-{i}").as_bytes()) / 1_000) as usize] += 1;
        }
        assert!(
            slices.iter().all(|&n| (850..=1150).contains(&n)),
            "{slices:?}"
        );
    }

    #[test]
    fn weights_in_basis_points_and_sides() {
        let mut c = Canary::new(cfg(), 0);
        assert_eq!(c.weight_bp(), 100);
        assert_eq!(c.side(99), Side::Candidate);
        assert_eq!(c.side(100), Side::Stable);
        c.phase = Phase::Rolling { step: 2 };
        assert_eq!(c.weight_bp(), 2_000);
        c.phase = Phase::Promoted;
        assert_eq!(c.side(9_999), Side::Candidate);
        c.phase = Phase::RolledBack;
        assert_eq!(c.side(0), Side::Stable);
    }

    #[test]
    fn advances_only_after_dwell_and_enough_attempts() {
        let mut c = Canary::new(cfg(), 0);
        // Enough attempts, but the dwell has not passed.
        assert_eq!(feed(&mut c, 10, 0, 100.0, 999), None);
        // The dwell passed, with evidence: the next attempt (or read) advances.
        let t = c.evaluate(1_000).expect("advances");
        assert_eq!((t.kind, t.from_bp, t.to_bp), (Move::Advanced, 100, 500));
        assert!(!t.manual && t.reason.contains("healthy"), "{}", t.reason);
        assert_eq!(c.phase, Phase::Rolling { step: 1 });
        assert_eq!(c.since_ms, 1_000);
        assert_eq!(c.stats.attempts, 0, "a new step starts a new window");
        // The dwell passed, but too few attempts: it stays.
        feed(&mut c, 9, 0, 100.0, 5_000);
        assert_eq!(c.evaluate(5_000), None);
        assert_eq!(c.phase, Phase::Rolling { step: 1 });
        let t = feed(&mut c, 1, 0, 100.0, 5_000).expect("tenth attempt advances");
        assert_eq!(t.to_bp, 2_000);
        feed(&mut c, 10, 0, 100.0, 6_000).expect("third step reached");
        // The last step is 100 %: reaching it promotes.
        assert_eq!(c.phase, Phase::Promoted);
        assert_eq!(c.last.as_ref().map(|t| t.kind), Some(Move::Promoted));
        assert_eq!(c.weight_bp(), BUCKETS);
        // Once promoted nothing moves by itself.
        assert_eq!(feed(&mut c, 50, 50, 9_000.0, 99_000), None);
    }

    #[test]
    fn rolls_back_on_error_rate_once_judged() {
        let mut c = Canary::new(cfg(), 0);
        // Errors before `min_requests` attempts are not judged yet.
        assert_eq!(feed(&mut c, 5, 5, 100.0, 10), None);
        let t = feed(&mut c, 5, 0, 100.0, 20).expect("judged at the tenth attempt");
        assert_eq!((t.kind, t.from_bp, t.to_bp), (Move::RolledBack, 100, 0));
        assert!(t.reason.contains("error rate 0.500"), "{}", t.reason);
        assert_eq!(c.phase, Phase::RolledBack);
        // Rolled back: the weight stays 0 whatever happens next.
        assert_eq!(feed(&mut c, 100, 0, 10.0, 100_000), None);
        assert_eq!(c.weight_bp(), 0);
    }

    #[test]
    fn rolls_back_on_ttft_p99_and_on_agreement() {
        let mut c = Canary::new(cfg(), 0);
        assert_eq!(feed(&mut c, 100, 0, 100.0, 0), None);
        // One slow first token in 101 is within the P99 (nearest rank: the 100th value)...
        assert_eq!(c.observe_attempt(true, Some(900.0), 0), None);
        // ...two in 102 are not.
        let t = c.observe_attempt(true, Some(900.0), 0).expect("rolls back");
        assert!(t.reason.contains("TTFT P99 900 ms"), "{}", t.reason);

        let mut c = Canary::new(cfg(), 0);
        feed(&mut c, 10, 0, 100.0, 0);
        for _ in 0..9 {
            assert_eq!(c.observe_agreement(0.5, 0), None, "judged at min_requests");
        }
        let t = c.observe_agreement(0.5, 0).expect("rolls back");
        assert!(t.reason.contains("agreement 0.500"), "{}", t.reason);
    }

    #[test]
    fn manual_promote_and_rollback() {
        let mut c = Canary::new(cfg(), 0);
        let t = c.roll_back(5).expect("moves");
        assert!(t.manual && t.kind == Move::RolledBack);
        assert_eq!(c.roll_back(6), None, "already rolled back");
        let t = c.promote(7).expect("moves");
        assert_eq!((t.from_bp, t.to_bp, t.manual), (0, BUCKETS, true));
        assert_eq!(c.promote(8), None);
    }

    #[test]
    fn a_user_on_the_candidate_stays_there_as_the_weight_grows() {
        let mut c = Canary::new(cfg(), 0);
        let users: Vec<u32> = (0..2_000)
            .map(|i| bucket("p", format!("u{i}").as_bytes()))
            .collect();
        let mut before: Vec<bool> = users
            .iter()
            .map(|b| c.side(*b) == Side::Candidate)
            .collect();
        for step in 1..3 {
            c.phase = Phase::Rolling { step };
            let now: Vec<bool> = users
                .iter()
                .map(|b| c.side(*b) == Side::Candidate)
                .collect();
            assert!(before.iter().zip(&now).all(|(b, n)| !*b || *n));
            before = now;
        }
        let share = before.iter().filter(|x| **x).count() as f64 / users.len() as f64;
        assert!((0.17..0.23).contains(&share), "{share}");
    }
}
