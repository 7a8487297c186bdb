//! Whether hedging a late first token pays in a pool: the share of late requests that a hedge
//! sent at the hedge delay would have answered first.
//!
//! A hedge costs a whole extra upstream request and helps only when the primary is still
//! waiting when the hedge answers. Whether that happens depends on the shape of the pool's
//! TTFT tail, not on the delay alone: under a smooth tail (a lognormal of σ 0.3, say) a request
//! late at the P95 almost always answers moments later, and a hedge sent then wins about one
//! time in thirty; under a heavy tail (a few requests ten times slower) a request that late is
//! usually one of the slow ones, and the hedge wins most of the time. So keel keeps a record
//! of that very event for each pool and hedges only while it says hedges win often enough.
//!
//! The record learns from every request that reaches the hedge delay, hedged or not:
//! - a hedge that was sent won or lost the race: that is the observation;
//! - a request that was not hedged (the record said it would not pay) still tells what a hedge
//!   would have done: it would have won if the primary's first token came later than the delay
//!   plus the hedge target's median TTFT (or the primary failed), so the record keeps learning
//!   while no hedge is sent, and hedging resumes as soon as the tail grows heavy.
//!
//! Until it has [`MIN_OBSERVATIONS`] the record says hedging at the delay does not pay, and the
//! gateway hedges only a primary far later than the delay ([`VERY_LATE`] delays), which still
//! cuts a heavy tail's slowest answers while the record learns, at a fraction of the cost.
//! Observations are weighed by an exponential moving average over about the last [`MEMORY`]
//! of them, so the record follows a pool whose tail changes.
//!
//! That later hedge has a record of its own ([`Tier::VeryLate`]), learned the same way from the
//! requests still waiting at [`VERY_LATE`] delays: it is sent while that record learns, and
//! afterwards only while it says such hedges win often enough. Under a smooth tail a primary
//! that late still answers before a hedge would in most cases (a lognormal of σ 0.3: fewer than
//! one in ten, the test below), so a pool whose tail is smooth stops paying for either hedge
//! once both records know it; a heavy tail keeps both.

/// Observations before the record decides (until then hedging at the delay is not taken to
/// pay). Few, because the record keeps learning either way and so corrects a wrong start: with
/// one win in thirty, two or more wins in eight (enough to pay) come up 2.7% of the time, and
/// the hedges then sent lose and turn it off; with two in five, one or none 11% of the time,
/// and the withheld requests' would-have-won turn it on. Learning is what costs: a heavy tail's
/// slowest answers are cut only at 1.5 delays until the record decides.
pub const MIN_OBSERVATIONS: u32 = 8;

/// The moving average's horizon in observations (its weight is 1 / `MEMORY`).
pub const MEMORY: u32 = 64;

/// The share of hedges that must win for hedging to pay: one hedge in four. Below it a hedge is
/// mostly an extra request for nothing; above it the requests it helps are the tail's. The two
/// tails keel-sim's scenarios draw sit on either side with room: a smooth one wins about one
/// race in eight, a heavy one about two in five. A threshold close to one in eight would be
/// crossed by chance in a record of a few dozen observations, and the hedges it then sent would
/// lose.
pub const PAYS_AT: f64 = 0.25;

/// How late, in hedge delays, a primary is hedged while hedges at the delay do not pay (or
/// the record does not know yet): a first token this late is rare under a smooth tail (about
/// the P99.9 of a lognormal of σ 0.3, the P99.3 of σ 0.5), and under a heavy tail it is one of
/// the slow ones, cut well before it would answer.
pub const VERY_LATE: f64 = 1.5;

/// The share of the hedge budget a first hedge at the delay leaves untouched: it is kept for
/// primaries still waiting at [`VERY_LATE`] delays, and for a hedge that is late too. When
/// hedges at the delay pay but spend most of the budget (a heavy tail, where a tenth of the
/// requests pass the delay), the slowest primaries, those a hedge saves the most, found it
/// spent and went unhedged: 4–17 a minute at 40 requests a second, the heavy tail's slowest
/// answers. A hedge at the delay that would dip into the reserve is asked for again at the
/// very late moment, with the whole budget. An eighth: a quarter deferred so many hedges at
/// the delay that the P99 rose by a fifth (heavy-tail, `bench/history`).
pub const RESERVE: f64 = 0.125;

/// When a first hedge goes out: at the hedge delay, or [`VERY_LATE`] delays after the start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    AtDelay,
    VeryLate,
}

impl Tier {
    /// Both tiers, in the order their moments come.
    pub const ALL: [Tier; 2] = [Tier::AtDelay, Tier::VeryLate];

    /// The tier's place in a per-tier array.
    pub fn index(self) -> usize {
        self as usize
    }

    /// When the tier's hedge is due, for a hedge delay of `delay_ms`.
    pub fn due_ms(self, delay_ms: f64) -> f64 {
        match self {
            Tier::AtDelay => delay_ms,
            Tier::VeryLate => delay_ms * VERY_LATE,
        }
    }
}

/// A pool's records of both tiers.
#[derive(Clone, Debug, Default)]
pub struct Record {
    by_tier: [Payoff; 2],
}

impl Record {
    /// Whether a first hedge of `tier` is sent: at the delay, once the record shows it pays;
    /// very late, while its record learns and then while it shows it pays.
    pub fn sends(&self, tier: Tier) -> bool {
        let record = &self.by_tier[tier.index()];
        match tier {
            Tier::AtDelay => record.pays(),
            Tier::VeryLate => record.win_share().is_none() || record.pays(),
        }
    }

    /// Records one request that reached `tier`'s moment: `won` when that tier's hedge answered
    /// first, or would have.
    pub fn record(&mut self, tier: Tier, won: bool) {
        self.by_tier[tier.index()].record(won);
    }

    /// The share of `tier`'s hedges that win (or would have), once its record knows.
    pub fn win_share(&self, tier: Tier) -> Option<f64> {
        self.by_tier[tier.index()].win_share()
    }
}

/// A pool's record of how often a hedge at the delay answers first.
#[derive(Clone, Debug, Default)]
pub struct Payoff {
    /// Observations so far (saturating at `MIN_OBSERVATIONS`: only the warm-up needs a count).
    seen: u32,
    /// The moving share of observations in which the hedge won (or would have).
    wins: f64,
}

impl Payoff {
    /// Records one request that reached the hedge delay: `won` when the hedge answered first,
    /// or would have.
    pub fn record(&mut self, won: bool) {
        let x = if won { 1.0 } else { 0.0 };
        // A plain mean while warming up, so the first observations weigh what later ones do.
        let weight = 1.0 / f64::from((self.seen + 1).min(MEMORY));
        self.wins += (x - self.wins) * weight;
        self.seen = (self.seen + 1).min(MEMORY);
    }

    /// Whether a hedge at the delay pays now: the record has seen enough, and hedges win at
    /// least [`PAYS_AT`] of the time.
    pub fn pays(&self) -> bool {
        self.seen >= MIN_OBSERVATIONS && self.wins >= PAYS_AT
    }

    /// The share of hedges that win (or would have), once the record has enough observations.
    pub fn win_share(&self) -> Option<f64> {
        (self.seen >= MIN_OBSERVATIONS).then_some(self.wins)
    }
}

/// What a request that was not hedged at the delay says about a hedge it could have had: it
/// would have won when the primary's first token (or failure, `ttft_ms = None`) came after the
/// hedge's likely answer, the delay plus the target's median TTFT.
pub fn would_have_won(ttft_ms: Option<f64>, delay_ms: f64, target_median_ms: f64) -> bool {
    ttft_ms.is_none_or(|t| t > delay_ms + target_median_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// Hedging does not pay until the record has seen enough, then follows the share of wins.
    #[test]
    fn learns_before_it_pays_then_follows_the_wins() {
        let mut p = Payoff::default();
        for _ in 0..MIN_OBSERVATIONS - 1 {
            p.record(true);
            assert!(!p.pays(), "undecided until {MIN_OBSERVATIONS} observations");
        }
        assert_eq!(p.win_share(), None);
        p.record(true);
        assert!(p.pays());
        assert_eq!(p.win_share(), Some(1.0));
        // Losses turn it off (the record forgets over about `MEMORY` observations), and wins
        // bring it back.
        let mut n = 0;
        while p.pays() {
            p.record(false);
            n += 1;
        }
        assert!(n <= 2 * MEMORY, "off after {n} losses");
        let mut n = 0;
        while !p.pays() {
            p.record(true);
            n += 1;
        }
        assert!(n <= 3, "back after {n} wins");
    }

    /// The moving share: one win in three stays one in three, steadily.
    #[test]
    fn the_share_is_a_moving_average() {
        let mut p = Payoff::default();
        for i in 0..3_000 {
            p.record(i % 3 == 0);
        }
        let share = p.win_share().unwrap();
        assert!((share - 1.0 / 3.0).abs() < 0.02, "{share}");
        assert!(p.pays());
    }

    /// A very late hedge is sent while its record learns, then only while it pays; a hedge at
    /// the delay only once its record shows it pays.
    #[test]
    fn the_very_late_tier_insures_while_it_learns() {
        let mut r = Record::default();
        assert!(!r.sends(Tier::AtDelay));
        assert!(r.sends(Tier::VeryLate));
        for _ in 0..MIN_OBSERVATIONS {
            r.record(Tier::VeryLate, false);
        }
        assert!(
            !r.sends(Tier::VeryLate),
            "a smooth tail: very late hedges lose"
        );
        assert!(!r.sends(Tier::AtDelay));
        for _ in 0..MIN_OBSERVATIONS {
            r.record(Tier::AtDelay, true);
            r.record(Tier::VeryLate, true);
        }
        assert!(r.sends(Tier::AtDelay) && r.sends(Tier::VeryLate));
        assert_eq!(r.win_share(Tier::AtDelay), Some(1.0));
    }

    /// A primary late at the delay would have lost to a hedge answering after the target's
    /// median when it answered first; a failed primary always loses.
    #[test]
    fn what_an_unhedged_request_says() {
        assert!(!would_have_won(Some(150.0), 100.0, 60.0));
        assert!(would_have_won(Some(170.0), 100.0, 60.0));
        assert!(would_have_won(None, 100.0, 60.0));
    }

    /// Draws a TTFT (ms) from a lognormal body of median 100 ms and σ 0.3, with a `heavy` share
    /// ten times slower.
    fn ttft(rng: &mut Rng, heavy: f64) -> f64 {
        let body = rng.lognormal(100.0, 0.3);
        if rng.next_f64() < heavy {
            body * 10.0
        } else {
            body
        }
    }

    /// The two tails the record tells apart: fed what unhedged requests late at the P95 (and
    /// at [`VERY_LATE`] times it) would have said, it withholds both hedges under a smooth
    /// lognormal tail and keeps them under a heavy one (2% of requests ten times slower).
    #[test]
    fn a_smooth_tail_does_not_pay_a_heavy_one_does() {
        let share = |heavy: f64, tier: Tier| {
            let mut rng = Rng::new(7);
            let mut draws: Vec<f64> = (0..20_000).map(|_| ttft(&mut rng, heavy)).collect();
            let mut sorted = draws.clone();
            sorted.sort_by(f64::total_cmp);
            let p95 = sorted[sorted.len() * 95 / 100];
            let median = sorted[sorted.len() / 2];
            let due = tier.due_ms(p95);
            let mut r = Record::default();
            for t in draws.drain(..).filter(|t| *t > due) {
                r.record(tier, would_have_won(Some(t), due, median));
            }
            (r.sends(tier), r.win_share(tier).unwrap())
        };
        for tier in Tier::ALL {
            let (smooth_sends, smooth) = share(0.0, tier);
            let (heavy_sends, heavy) = share(0.02, tier);
            assert!(
                !smooth_sends && smooth < 0.1,
                "{tier:?}, smooth tail: {smooth}"
            );
            assert!(heavy_sends && heavy > 0.25, "{tier:?}, heavy tail: {heavy}");
        }
    }
}
