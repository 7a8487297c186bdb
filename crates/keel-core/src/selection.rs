//! Stage 1, selection: turn a pool's variants into an ordered plan (primary, then fallbacks).
//!
//! Selection sits behind one small trait, [`Selector`], so that policies are interchangeable and
//! testable alone: a policy sees only plain data about the candidates ([`Candidate`]) and the
//! request ([`RequestSignals`]) and returns an order. It never reads a clock; randomness comes
//! from an [`Rng`] the policy was built with (seeded in tests). Availability (cooldowns,
//! ejection, context fit, tier floor) is decided by the caller and arrives as `available`.
//!
//! Two policies:
//! * [`WeightedRoundRobin`], smooth weighted round robin (nginx's algorithm): each selection adds
//!   every candidate's weight to its running score, picks the highest, and subtracts the total
//!   from the winner; picks match weights and are spread out (5,1,1 gives a a b a c a a).
//!   Health is ignored: this is the "plain round robin" baseline.
//! * [`PowerOfTwo`] (module [`crate::p2c`]), keel's default: live cost with affinity.

pub use crate::p2c::PowerOfTwo;
use crate::rng::Rng;

/// What a policy knows about one variant for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Position of the variant in its pool.
    pub index: usize,
    /// Configured weight.
    pub weight: u32,
    /// False while the variant may not take this request (cooling down, credential broken,
    /// ejected or warming up, at its concurrency limit, context too small, below the tier floor).
    pub available: bool,
    /// Live health weight in 0..=1 (see [`crate::health`]).
    pub health: f64,
    /// The part of `health` that counts a known fault (errors, breaks, a full cache or queue:
    /// [`crate::health::Factors::condition`]); 1 when nothing is wrong. Two costs close enough
    /// to count as equal are not, when the costlier is in worse condition (see [`crate::p2c`]).
    pub condition: f64,
    /// Predicted time to first token (peak-EWMA), ms.
    pub predicted_ttft_ms: f64,
    /// The samples behind `predicted_ttft_ms` (see [`crate::health::Ewma::evidence`]): how far
    /// it can be trusted when two costs are close (see [`crate::p2c::equivalent_band`]).
    pub ttft_samples: f64,
    /// Mean inter-token gap of its recent streams, ms (`None`: not measured yet).
    pub gap_ms: Option<f64>,
    /// How far `gap_ms` still holds, in 0..=1: 1 while fresh, fading once no stream or probe
    /// has measured it for longer than the grace (see [`crate::health::Estimates::gap_trust`]).
    pub gap_trust: f64,
    pub in_flight: u32,
    /// 1 = best fidelity.
    pub tier: u8,
    /// Relative price (for `low-cost`).
    pub price: f64,
    /// Recent P95 of TTFT, when known.
    pub p95_ttft_ms: Option<f64>,
    /// Its server reports a queue in the severe band (scraped waiting requests at or past
    /// `waiting_severe`): a new request would wait behind them for a slot.
    pub queued: bool,
    /// A stable hash of the variant's name (for rendezvous hashing).
    pub name_hash: u64,
}

impl Candidate {
    /// A candidate with neutral live signals (tests, round robin).
    pub fn plain(index: usize, weight: u32, available: bool) -> Self {
        Candidate {
            index,
            weight,
            available,
            health: 1.0,
            condition: 1.0,
            predicted_ttft_ms: 100.0,
            ttft_samples: f64::INFINITY,
            gap_ms: None,
            gap_trust: 1.0,
            in_flight: 0,
            tier: 1,
            price: 1.0,
            p95_ttft_ms: None,
            queued: false,
            name_hash: crate::rng::mix(index as u64 + 1),
        }
    }
}

/// `x-keel-preference`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preference {
    #[default]
    LowLatency,
    HighFidelity,
    LowCost,
}

impl Preference {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "low-latency" => Some(Preference::LowLatency),
            "high-fidelity" => Some(Preference::HighFidelity),
            "low-cost" => Some(Preference::LowCost),
            _ => None,
        }
    }
}

/// Request-level inputs to selection, bundled so new signals do not change the trait.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RequestSignals {
    /// Session or prefix key when the pool uses affinity.
    pub affinity_key: Option<u64>,
    pub preference: Preference,
    /// The pool's `slo_ttft_p95_ms`.
    pub slo_ttft_p95_ms: Option<f64>,
    /// Tokens the answer is expected to stream (the pool's typical answer, at most the
    /// request's `max_tokens`): how much a variant's decode pace weighs in its cost (0: not at
    /// all; see [`crate::p2c::decode_factor`]).
    pub answer_tokens: f64,
}

/// Why the primary was chosen (decision records).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reason {
    #[default]
    RoundRobin,
    /// Lower cost of two random choices.
    PowerOfTwo,
    /// The only eligible variant.
    Only,
    /// Affinity: the key's rendezvous choice.
    Affinity,
    /// Affinity, but the preferred variant was over the load bound.
    AffinityOverflow,
    /// Nothing within the SLO: chosen among those outside it.
    OutsideSlo,
    /// Every variant within the SLO reports a full queue: chosen among those that do.
    Queued,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RoundRobin => "round_robin",
            Reason::PowerOfTwo => "p2c",
            Reason::Only => "only",
            Reason::Affinity => "affinity",
            Reason::AffinityOverflow => "affinity_overflow",
            Reason::OutsideSlo => "outside_slo",
            Reason::Queued => "queued",
        }
    }
}

/// An ordered list of variant indexes: the first is the primary, the rest are fallbacks.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Plan {
    pub order: Vec<usize>,
    pub reason: Reason,
    /// (index, cost) of every eligible candidate, for the decision record.
    pub costs: Vec<(usize, f64)>,
}

/// A selection policy. One instance serves every request of a pool, from any thread at once:
/// `plan` takes `&self`, so a policy keeps what it learns in atomics (or, for the round-robin
/// baseline, behind a lock of its own), and a decision never waits for the pool's state.
pub trait Selector: Send + Sync {
    /// Name used as the `policy` label in metrics and logs.
    fn name(&self) -> &'static str;
    /// Orders the available candidates. Unavailable ones are never part of the plan.
    fn plan(&self, candidates: &[Candidate], signals: &RequestSignals) -> Plan;
}

/// Which selection policy a pool uses; the config names it by [`PolicyKind::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum PolicyKind {
    /// [`PowerOfTwo`]: live cost with affinity (the default).
    #[default]
    #[serde(rename = "p2c")]
    P2c,
    /// [`WeightedRoundRobin`]: weighted, health-blind.
    #[serde(rename = "round_robin")]
    RoundRobin,
}

impl PolicyKind {
    /// Every policy, in the order the config's error messages list them.
    pub const ALL: [PolicyKind; 2] = [PolicyKind::P2c, PolicyKind::RoundRobin];

    /// The name written in the config (and in the health JSON).
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::P2c => "p2c",
            PolicyKind::RoundRobin => "round_robin",
        }
    }
}

/// Builds the policy of a pool of `variants`, seeded.
pub fn policy(kind: PolicyKind, seed: u64, variants: usize) -> Box<dyn Selector> {
    match kind {
        PolicyKind::P2c => Box::new(PowerOfTwo::new(Rng::new(seed), variants)),
        PolicyKind::RoundRobin => Box::new(WeightedRoundRobin::new()),
    }
}

/// Smooth weighted round robin; fallbacks follow in descending weight, ties by index. Each pick
/// depends on every pick before it, so its running scores sit behind a lock of their own (the
/// health-blind baseline, not keel's default policy).
#[derive(Debug, Default)]
pub struct WeightedRoundRobin {
    /// Running score per pool index.
    current: std::sync::Mutex<Vec<i64>>,
}

impl WeightedRoundRobin {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Selector for WeightedRoundRobin {
    fn name(&self) -> &'static str {
        "weighted_round_robin"
    }

    fn plan(&self, candidates: &[Candidate], _signals: &RequestSignals) -> Plan {
        let max_index = candidates.iter().map(|c| c.index + 1).max().unwrap_or(0);
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.len() < max_index {
            current.resize(max_index, 0);
        }
        let live: Vec<&Candidate> = candidates
            .iter()
            .filter(|c| c.available && c.weight > 0)
            .collect();
        if live.is_empty() {
            return Plan::default();
        }
        let total: i64 = live.iter().map(|c| c.weight as i64).sum();
        let mut best = live[0].index;
        for c in &live {
            current[c.index] += c.weight as i64;
            if current[c.index] > current[best] {
                best = c.index;
            }
        }
        current[best] -= total;
        drop(current);
        let mut rest: Vec<&Candidate> = live.into_iter().filter(|c| c.index != best).collect();
        rest.sort_by(|a, b| b.weight.cmp(&a.weight).then(a.index.cmp(&b.index)));
        let mut order = Vec::with_capacity(rest.len() + 1);
        order.push(best);
        order.extend(rest.iter().map(|c| c.index));
        Plan {
            order,
            reason: Reason::RoundRobin,
            costs: Vec::new(),
        }
    }
}

/// Whether a variant may take traffic now: cooldowns from `retry-after` and broken credentials,
/// and what other replicas reported about it (`shared_*`, see keel-gateway's `signals`).
///
/// The shared holds are kept apart from this replica's own cooldown so that what it measured
/// and what it was told never mix: only its own findings are reported to the others (nothing
/// echoes), and its own evidence of recovery (a success) ends what it was told.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Availability {
    /// Unavailable until this time (ms, caller's monotonic origin).
    pub cooldown_until_ms: u64,
    /// Set when the upstream refused the variant's credential (401/403).
    pub credential_broken: bool,
    /// Another replica cooled the variant down: unavailable until then.
    pub shared_cooldown_until_ms: u64,
    /// Another replica ejected the variant: a last resort only (like an ejected one) until then.
    pub shared_eject_until_ms: u64,
    /// A client's request earned a refusal the client may have caused (a long `retry-after`):
    /// unavailable here until then, briefly, while keel's own request confirms it. Never
    /// reported to other replicas: one client's request must not hold a variant out for all.
    pub unconfirmed_until_ms: u64,
}

impl Availability {
    pub fn available(&self, now_ms: u64) -> bool {
        now_ms >= self.cooldown_until_ms
            && now_ms >= self.shared_cooldown_until_ms
            && now_ms >= self.unconfirmed_until_ms
    }

    /// Holds the variant out for `for_ms` on a client's evidence alone (see
    /// [`Availability::unconfirmed_until_ms`]).
    pub fn hold_unconfirmed(&mut self, now_ms: u64, for_ms: u64) {
        self.unconfirmed_until_ms = self.unconfirmed_until_ms.max(now_ms.saturating_add(for_ms));
    }

    /// Keeps the variant out of rotation for `for_ms`; an existing longer cooldown stays.
    pub fn cool_down(&mut self, now_ms: u64, for_ms: u64) {
        self.cooldown_until_ms = self.cooldown_until_ms.max(now_ms.saturating_add(for_ms));
    }

    /// A refused credential: out of rotation for `recheck_ms`, then one request probes it again.
    pub fn mark_credential_broken(&mut self, now_ms: u64, recheck_ms: u64) {
        self.credential_broken = true;
        self.cool_down(now_ms, recheck_ms);
    }

    /// A success clears the broken mark, what other replicas said and a client's unconfirmed
    /// evidence: this replica has just seen the variant work.
    pub fn record_success(&mut self) {
        self.credential_broken = false;
        self.shared_cooldown_until_ms = 0;
        self.shared_eject_until_ms = 0;
        self.unconfirmed_until_ms = 0;
    }

    /// Milliseconds until the variant is available again (0 when it is).
    pub fn available_in_ms(&self, now_ms: u64) -> u64 {
        self.cooldown_until_ms
            .max(self.shared_cooldown_until_ms)
            .max(self.unconfirmed_until_ms)
            .saturating_sub(now_ms)
    }

    /// Whether another replica's ejection holds now.
    pub fn shared_ejected(&self, now_ms: u64) -> bool {
        now_ms < self.shared_eject_until_ms
    }

    /// Milliseconds left of what other replicas reported (cooldown or ejection; 0: none).
    pub fn shared_hold_ms(&self, now_ms: u64) -> u64 {
        self.shared_cooldown_until_ms
            .max(self.shared_eject_until_ms)
            .saturating_sub(now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_holds_stay_apart_from_own_cooldown_and_end_on_a_success() {
        let mut a = Availability {
            shared_cooldown_until_ms: 1_000,
            shared_eject_until_ms: 2_000,
            ..Availability::default()
        };
        assert!(!a.available(500));
        assert_eq!(a.cooldown_until_ms, 0, "own cooldown untouched");
        assert_eq!(a.available_in_ms(500), 500);
        assert!(a.available(1_000));
        assert!(a.shared_ejected(1_500));
        assert!(!a.shared_ejected(2_000));
        assert_eq!(a.shared_hold_ms(1_500), 500);
        a.hold_unconfirmed(0, 300);
        assert_eq!(
            a.cooldown_until_ms, 0,
            "a client's evidence is not this replica's finding"
        );
        assert_eq!(a.available_in_ms(0), 1_000);
        a.record_success();
        assert!(a.available(0));
        assert!(!a.shared_ejected(0));
        assert_eq!(a.shared_hold_ms(0), 0);
    }

    #[test]
    fn policy_kinds_serialize_as_their_config_names() {
        for kind in PolicyKind::ALL {
            assert_eq!(
                serde_json::to_value(kind).unwrap(),
                serde_json::Value::String(kind.as_str().to_owned())
            );
        }
        assert_eq!(PolicyKind::default(), PolicyKind::P2c);
        assert_eq!(policy(PolicyKind::P2c, 1, 2).name(), "p2c");
        assert_eq!(
            policy(PolicyKind::RoundRobin, 1, 2).name(),
            "weighted_round_robin"
        );
    }

    fn cands(weights: &[u32]) -> Vec<Candidate> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| Candidate::plain(i, w, true))
            .collect()
    }

    #[test]
    fn smooth_sequence_matches_nginx() {
        let s = WeightedRoundRobin::new();
        let c = cands(&[5, 1, 1]);
        let picks: Vec<usize> = (0..7)
            .map(|_| s.plan(&c, &RequestSignals::default()).order[0])
            .collect();
        assert_eq!(picks, vec![0, 0, 1, 0, 2, 0, 0]);
    }

    #[test]
    fn plan_lists_every_available_variant_once() {
        let s = WeightedRoundRobin::new();
        let mut c = cands(&[1, 3, 2, 1]);
        c[2].available = false;
        let p = s.plan(&c, &RequestSignals::default());
        assert_eq!(p.order, vec![1, 0, 3]);
        let mut sorted = p.order.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 3]);
    }

    #[test]
    fn nothing_available_gives_empty_plan() {
        let s = WeightedRoundRobin::new();
        let mut c = cands(&[1, 1]);
        c[0].available = false;
        c[1].weight = 0;
        assert!(s.plan(&c, &RequestSignals::default()).order.is_empty());
    }

    #[test]
    fn cooldown_expires() {
        let mut a = Availability::default();
        a.cool_down(1_000, 2_000);
        assert!(!a.available(2_999));
        assert_eq!(a.available_in_ms(2_000), 1_000);
        assert!(a.available(3_000));
        a.cool_down(3_000, 10);
        a.cool_down(3_000, 5);
        assert_eq!(a.cooldown_until_ms, 3_010);
    }
}
