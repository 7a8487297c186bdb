//! The execute phase: attempts on the plan's variants until one serves, before any byte has
//! reached the client.
//!
//! **The commit point.** Nothing is sent to the client until an attempt has produced its first
//! token: for a stream, the first event carrying output (not the response head, not a role-only
//! preamble, not a ping); for a whole response, the complete, valid body. Before that point any
//! attempt may be abandoned silently and the next variant tried. After it, the response belongs
//! to that attempt, and a failure can only migrate the rest of the generation (`relay`) or end
//! the stream with an explicit error event, never a clean end.
//!
//! Every attempt enters its variant and is settled through `settlement` (the same path the
//! relay's continuations take). Retryable failures move on to the next variant; the client's
//! own errors are returned unchanged. Attempts are bounded by the pool's `max_attempts`, by the
//! total deadline, and by the fleet-wide retry budget. The first attempt may be **hedged**: if
//! its first token is late, the same request goes to the variant most likely to answer first,
//! and if that one is late too, to the next (up to `max_hedges`, within the hedge budget); the
//! first to produce a token wins.

use crate::observe::record::AttemptKind;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};

use tokio::time::Instant;

use keel_core::hedge::{Tier, VERY_LATE};
use keel_core::request::CanonicalRequest;

use crate::pipeline::attempt::{attempt, AttemptResult, Served};
use crate::pipeline::context::RequestCtx;
use crate::pipeline::selection::COOLDOWN_WAIT_MAX_MS;
use crate::pipeline::settlement::{Attempts, Committed, Entered, Refused, Settled};
use crate::state::pools::Pool;
use crate::upstream::translation;
use crate::wire::errors::GatewayError;

/// How stage 2 ended.
pub enum Outcome {
    /// An attempt serves the client.
    Served(Committed, Served),
    /// The client's own error, as the upstream gave it.
    ClientError(Served),
    /// No variant could serve.
    Failed(GatewayError),
}

/// The result of stage 2.
pub struct Executed {
    pub outcome: Outcome,
    /// Every attempt so far; the relay continues the same ledger.
    pub attempts: Attempts,
    /// After a hedge race, `hedged` when a hedge won and `direct` when the primary did;
    /// otherwise the route follows from the attempts.
    pub route: Option<&'static str>,
}

/// Runs attempts over `order` (primary first) until one serves.
///
/// An async block capturing `attempts` once (an async fn keeps a by-value argument twice in
/// its state).
#[allow(clippy::manual_async_fn)] // an async fn would hold its arguments twice
pub fn execute<'a>(
    pool: &'a Arc<Pool>,
    req: &'a CanonicalRequest,
    ctx: &'a RequestCtx,
    order: &'a [usize],
    mut attempts: Attempts,
) -> impl Future<Output = Executed> + 'a {
    async move {
        let max_attempts = pool.cfg.max_attempts as usize;
        // Set by a race whose winner is being settled.
        let mut route = None;
        pool.count_request();

        // A variant of the other protocol that cannot be given this request (a field its protocol
        // cannot express) is left out of the plan; when that leaves nothing, the client hears why.
        let mut untranslatable = None;
        let order: Vec<usize> = order
            .iter()
            .copied()
            .filter(
                |&vi| match translation::check(&pool.variants[vi].cfg, req) {
                    Ok(()) => true,
                    Err(e) => {
                        untranslatable.get_or_insert(e);
                        false
                    }
                },
            )
            .collect();
        if let (true, Some(e)) = (order.is_empty(), untranslatable) {
            return Executed {
                outcome: Outcome::Failed(GatewayError::from(e)),
                attempts,
                route: None,
            };
        }
        let order = &order[..];

        // Walk the plan; when it is exhausted with attempts left, come back to variants that are
        // still available (a one-variant pool can retry a transient 503), after a short backoff.
        let mut round = 0;
        'rounds: while attempts.counted() < max_attempts {
            let mut tried_this_round = false;
            for &vi in order {
                if attempts.counted() >= max_attempts || Instant::now() >= ctx.deadline {
                    break 'rounds;
                }
                if attempts.tried(vi) > round {
                    continue; // already tried in this round (e.g. as a hedge)
                }
                if round > 0 {
                    let backoff = Duration::from_millis(50 << round.min(4));
                    tokio::time::sleep_until((Instant::now() + backoff).min(ctx.deadline)).await;
                    if Instant::now() >= ctx.deadline {
                        break 'rounds;
                    }
                }
                let kind = if attempts.is_empty() {
                    AttemptKind::First
                } else {
                    AttemptKind::Fallback
                };
                let entered = match attempts.enter(vi, kind, ctx.deadline).await {
                    Ok(e) => e,
                    Err(Refused::Budget) => break 'rounds,
                    Err(_) => continue,
                };
                tried_this_round = true;
                // The first attempt may be hedged by the best other variant of the plan.
                let hedgeable = kind == AttemptKind::First && max_attempts > 1 && pool.hedging();
                let others: Vec<usize> = if hedgeable {
                    order.iter().copied().filter(|&j| j != vi).collect()
                } else {
                    Vec::new()
                };
                let delay = hedgeable
                    .then(|| {
                        pool.hedge_delay_ms(pool.hedge_target(&others)?, req.estimated_input_tokens)
                    })
                    .flatten();
                let outcomes = match delay {
                    Some(delay) => {
                        let race = race(
                            &mut attempts,
                            pool,
                            entered,
                            &others,
                            req,
                            ctx,
                            Duration::from_millis(delay),
                        )
                        .await;
                        route = race
                            .hedge_won
                            .map(|won| if won { "hedged" } else { "direct" });
                        for loser in race.cancelled {
                            attempts.cancelled(loser);
                        }
                        race.finished
                    }
                    None => {
                        let r = attempt(pool, vi, req, ctx, entered.traceparent()).await;
                        vec![(entered, r)]
                    }
                };
                for (entered, result) in outcomes {
                    let outcome = match attempts.settle(entered, result) {
                        Settled::Served(c, s) => Outcome::Served(c, s),
                        Settled::ClientError(s) => Outcome::ClientError(s),
                        Settled::Failed => continue,
                    };
                    return Executed {
                        outcome,
                        attempts,
                        route,
                    };
                }
                // Nothing served: the attempts from here on are fallbacks.
                route = None;
                if attempts.gave_up() {
                    break 'rounds;
                }
            }
            if !tried_this_round {
                // Every variant of the plan refused the round (cooling down after a failure, or
                // full): wait for the first one back from a short cooldown, as selection does
                // before the first attempt — a one-variant pool whose connection timed out once
                // would otherwise answer 502 while its server is healthy.
                match back_soon(pool, order, ctx.deadline, pool.now_ms()) {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => break,
                }
            }
            round += 1;
        }
        Executed {
            outcome: Outcome::Failed(attempts.give_up_error(ctx)),
            attempts,
            route: None,
        }
    }
}

/// When the first of `order` cooling down after a failure comes back, if that is within a
/// short cooldown ([`COOLDOWN_WAIT_MAX_MS`]) and before `deadline`; `None` when none will (none
/// is cooling: the variants are full, ejected or warming; or out for longer).
fn back_soon(pool: &Pool, order: &[usize], deadline: Instant, now_ms: u64) -> Option<Instant> {
    let ms = order
        .iter()
        .filter_map(|&vi| pool.cooling_for_ms(vi, now_ms))
        .min()?;
    let at = Instant::now() + Duration::from_millis(ms);
    (ms <= COOLDOWN_WAIT_MAX_MS && at < deadline).then_some(at)
}

/// What a hedge race left: finished attempts in the order they finished, whether a hedge won
/// (`None`: no race was decided), and the attempts still running (cancelled by dropping them).
struct Race {
    finished: Vec<(Entered, AttemptResult)>,
    hedge_won: Option<bool>,
    cancelled: Vec<Entered>,
}

/// One racer's attempt, tagged with its slot in the race.
type Racer<'a> = std::pin::Pin<Box<dyn Future<Output = (usize, AttemptResult)> + Send + 'a>>;

/// What one race teaches the pool's hedge records (`keel_core::hedge`): a first hedge sent at
/// its tier's moment won or lost; a hedge withheld there would have won or lost, by when the
/// primary answered.
struct Lesson {
    start: Instant,
    /// Hedges withheld, by tier: when each was due (ms after the start) and its target's median
    /// TTFT (ms).
    withheld: [Option<(f64, f64)>; 2],
    /// The tier of the first hedge sent, if one was.
    sent: Option<Tier>,
}

impl Lesson {
    fn withhold(&mut self, tier: Tier, due_ms: f64, median_ms: f64) {
        self.withheld[tier.index()] = Some((due_ms, median_ms));
    }
    /// The primary answered (`failed`: or failed): what each withheld hedge would have done.
    fn primary_done(&mut self, pool: &Pool, failed: bool) {
        let ttft = (!failed).then(|| self.start.elapsed().as_secs_f64() * 1e3);
        for tier in Tier::ALL {
            if let Some((due, median)) = self.withheld[tier.index()].take() {
                let won = keel_core::hedge::would_have_won(ttft, due, median);
                pool.record_hedge_payoff(tier, won);
            }
        }
    }
    /// The primary is still waiting now: a withheld hedge whose likely answer is past would
    /// have won (otherwise the primary's answer will tell).
    fn still_waiting(&mut self, pool: &Pool) {
        let waited = self.start.elapsed().as_secs_f64() * 1e3;
        for tier in Tier::ALL {
            let slot = &mut self.withheld[tier.index()];
            if slot.is_some_and(|(due, median)| {
                keel_core::hedge::would_have_won(Some(waited), due, median)
            }) {
                *slot = None;
                pool.record_hedge_payoff(tier, true);
            }
        }
    }
    /// The race was decided with a hedge running: the first hedge's tier learns whether it won;
    /// a hedge that won tells of the ones withheld before it as far as the primary was still
    /// waiting.
    fn decided(&mut self, pool: &Pool, hedge_won: bool) {
        if let Some(tier) = self.sent {
            pool.record_hedge_payoff(tier, hedge_won);
        }
        if hedge_won {
            self.still_waiting(pool);
        }
    }
}

/// Runs the primary; if its first token is late by `delay`, races it against a hedge on the
/// variant of `others` most likely to answer first then; if that hedge is late too (by its own
/// target's delay), another, up to the pool's `max_hedges` while the hedge budget allows. The
/// first to produce a token wins and the others are dropped at once (their connections close,
/// so the upstreams stop generating). A racer that fails leaves the others running.
///
/// The first hedge is withheld while the pool's record does not say hedges at the delay pay
/// (`Pool::hedge_sends`); the primary is then hedged only once it is `hedge::VERY_LATE` delays
/// late, and only while the record of such hedges does not say they rarely win.
async fn race(
    attempts: &mut Attempts,
    pool: &Arc<Pool>,
    primary: Entered,
    others: &[usize],
    req: &CanonicalRequest,
    ctx: &RequestCtx,
    delay: Duration,
) -> Race {
    let racer = |slot: usize, e: &Entered| -> Racer<'_> {
        let (vi, tp) = (e.vi, e.traceparent());
        Box::pin(async move { (slot, attempt(pool, vi, req, ctx, tp).await) })
    };
    let label = |outcome: &'static str| {
        pool.metrics
            .counter(
                "keel_hedges_total",
                &[("pool", &pool.cfg.name), ("outcome", outcome)],
            )
            .increment(1)
    };
    let mut running = FuturesUnordered::new();
    running.push(racer(0, &primary));
    let primary_vi = primary.vi;
    // Slot 0 is the primary, slots 1.. the hedges in the order they started.
    let mut entered: Vec<Option<Entered>> = vec![Some(primary)];
    let mut finished = Vec::new();
    let mut lesson = Lesson {
        start: Instant::now(),
        withheld: [None, None],
        sent: None,
    };
    let mut very_late = false;
    let mut next_hedge = Some(lesson.start + delay).filter(|at| *at < ctx.deadline);
    let very_late_at =
        Some(lesson.start + delay.mul_f64(VERY_LATE)).filter(|at| *at < ctx.deadline);
    loop {
        tokio::select! {
            Some((slot, r)) = running.next() => {
                let done = entered[slot].take().expect("a racer finishes once");
                let won = !matches!(r, AttemptResult::Failed(_));
                if slot == 0 {
                    lesson.primary_done(pool, !won);
                }
                finished.push((done, r));
                let hedges = entered.len() - 1;
                if won {
                    if hedges > 0 {
                        label(if slot == 0 { "lost" } else { "won" });
                        lesson.decided(pool, slot > 0);
                    }
                    return Race {
                        finished,
                        hedge_won: (hedges > 0).then_some(slot > 0),
                        cancelled: entered.into_iter().flatten().collect(),
                    };
                }
                if running.is_empty() {
                    // Every racer failed: the plan's fallbacks take over.
                    if hedges > 0 {
                        label("failed");
                    }
                    return Race { finished, hedge_won: None, cancelled: Vec::new() };
                }
            }
            _ = tokio::time::sleep_until(next_hedge.unwrap_or(ctx.deadline)), if next_hedge.is_some() => {
                next_hedge = None;
                // The best variant not already racing (or failed in this race).
                let busy: Vec<usize> = entered
                    .iter()
                    .flatten()
                    .map(|e| e.vi)
                    .chain(finished.iter().map(|(e, _)| e.vi))
                    .collect();
                let free: Vec<usize> = others.iter().copied().filter(|j| !busy.contains(j)).collect();
                let Some(h) = pool.hedge_target(&free) else {
                    label("no_variant");
                    continue;
                };
                let first = entered.len() == 1;
                let (delay_ms, median) = (
                    delay.as_secs_f64() * 1e3,
                    pool.median_ttft_ms(h).unwrap_or(0.0),
                );
                // A primary slow by nature (its usual first token comes after the hedge's likely
                // answer: a far zone, a degraded replica) is hedged at the delay whatever the
                // tail: the hedge usually wins, and its race says nothing of the tail's shape.
                let slow_by_nature = pool
                    .median_ttft_ms(primary_vi)
                    .is_some_and(|m| m > delay_ms + median);
                let tier = (first && !slow_by_nature).then_some(if very_late {
                    Tier::VeryLate
                } else {
                    Tier::AtDelay
                });
                if let Some(tier) = tier.filter(|t| !pool.hedge_sends(*t)) {
                    lesson.withhold(tier, tier.due_ms(delay_ms), median);
                    if tier == Tier::AtDelay {
                        label("withheld");
                        very_late = true;
                        next_hedge = very_late_at;
                    }
                    continue;
                }
                lesson.still_waiting(pool);
                // A first hedge at the delay leaves the budget's reserve to the primaries still
                // waiting at the very late moment (the true tail, whose hedges win most): one
                // that would dip into it is asked for again then, and its tier learns meanwhile
                // what it would have done.
                let at_delay = tier == Some(Tier::AtDelay);
                let reserve = if at_delay { keel_core::hedge::RESERVE } else { 0.0 };
                if !pool.hedge_budget_allows(reserve) {
                    if at_delay {
                        label("deferred");
                        lesson.withhold(Tier::AtDelay, delay_ms, median);
                        very_late = true;
                        next_hedge = very_late_at;
                    } else {
                        label("over_budget");
                    }
                    continue;
                }
                let Ok(hedge) = attempts.enter(h, AttemptKind::Hedge, ctx.deadline).await else {
                    label("no_variant");
                    continue;
                };
                if lesson.sent.is_none() {
                    lesson.sent = tier;
                }
                if let Some(d) = attempts.decision() {
                    let variant = |i: usize| pool.variants[i].cfg.name.as_str();
                    let reason = if very_late { "first_token_very_late" } else { "first_token_late" };
                    d.note_hedge(variant(primary_vi), variant(h), reason);
                }
                running.push(racer(entered.len(), &hedge));
                entered.push(Some(hedge));
                // If this hedge is late too by its own standard, another may follow.
                if entered.len() - 1 < pool.cfg.max_hedges as usize {
                    next_hedge = pool
                        .hedge_delay_ms(h, req.estimated_input_tokens)
                        .map(|ms| Instant::now() + Duration::from_millis(ms))
                        .filter(|at| *at < ctx.deadline);
                }
            }
        }
    }
}
