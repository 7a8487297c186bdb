//! Stage 2, execution: attempts on the plan's variants until one serves, before any byte has
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
//! and the first to produce a token wins.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use keel_core::request::CanonicalRequest;

use crate::attempt::{attempt, AttemptResult, Served};
use crate::context::RequestCtx;
use crate::errors::GatewayError;
use crate::pools::Pool;
use crate::settlement::{AttemptKind, Attempts, Committed, Entered, Refused, Settled};

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
    /// `hedged` when a hedge won; otherwise the route follows from the attempts.
    pub route: Option<&'static str>,
}

/// Runs attempts over `order` (primary first) until one serves.
pub async fn execute(
    pool: &Arc<Pool>,
    req: &CanonicalRequest,
    ctx: &RequestCtx,
    order: &[usize],
    mut attempts: Attempts,
) -> Executed {
    let max_attempts = pool.cfg.max_attempts as usize;
    let mut hedged = false;
    pool.count_request();

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
                .then(|| pool.hedge_delay_ms(pool.hedge_target(&others)?))
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
                    hedged = race.hedge_won == Some(true);
                    if let Some(loser) = race.cancelled {
                        attempts.cancelled(loser);
                    }
                    race.finished
                }
                None => {
                    let r = attempt(pool, vi, req, ctx).await;
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
                    route: hedged.then_some("hedged"),
                };
            }
            if attempts.gave_up() {
                break 'rounds;
            }
        }
        if !tried_this_round {
            break;
        }
        round += 1;
    }
    Executed {
        outcome: Outcome::Failed(attempts.give_up_error(ctx)),
        attempts,
        route: None,
    }
}

/// What a hedge race left: finished attempts in the order they finished, whether the hedge
/// won (`None`: no race was decided), and the loser still running (cancelled by dropping it).
struct Race {
    finished: Vec<(Entered, AttemptResult)>,
    hedge_won: Option<bool>,
    cancelled: Option<Entered>,
}

/// Runs the primary; if its first token is late by `delay`, races it against a hedge on the
/// best of `others` that can take one then. The first to produce a token wins and the other
/// is dropped at once (its connection closes, so the upstream stops generating).
async fn race(
    attempts: &mut Attempts,
    pool: &Arc<Pool>,
    primary: Entered,
    others: &[usize],
    req: &CanonicalRequest,
    ctx: &RequestCtx,
    delay: Duration,
) -> Race {
    let final_result = |r: &AttemptResult| !matches!(r, AttemptResult::Failed(_));
    let alone = |primary, r| Race {
        finished: vec![(primary, r)],
        hedge_won: None,
        cancelled: None,
    };
    let vi = primary.vi;
    let first = attempt(pool, vi, req, ctx);
    tokio::pin!(first);
    tokio::select! {
        r = &mut first => return alone(primary, r),
        _ = tokio::time::sleep(delay.min(ctx.deadline.saturating_duration_since(Instant::now()))) => {}
    }
    let target = (Instant::now() < ctx.deadline)
        .then(|| pool.try_hedge(others))
        .flatten();
    let hedge = match target {
        Some(h) => attempts
            .enter(h, AttemptKind::Hedge, ctx.deadline)
            .await
            .ok(),
        None => None,
    };
    let Some(hedge) = hedge else {
        let r = first.await;
        return alone(primary, r);
    };
    let second = attempt(pool, hedge.vi, req, ctx);
    tokio::pin!(second);
    let label = |outcome: &'static str| {
        pool.metrics
            .counter(
                "keel_hedges_total",
                &[("pool", &pool.cfg.name), ("outcome", outcome)],
            )
            .increment(1)
    };
    let (mut primary, mut hedge) = (Some(primary), Some(hedge));
    let mut finished = Vec::new();
    loop {
        tokio::select! {
            r = &mut first, if primary.is_some() => {
                let won = final_result(&r);
                finished.push((primary.take().expect("primary running"), r));
                if won {
                    label("lost");
                    return Race { finished, hedge_won: Some(false), cancelled: hedge };
                }
            }
            r = &mut second, if hedge.is_some() => {
                let won = final_result(&r);
                finished.push((hedge.take().expect("hedge running"), r));
                if won {
                    label("won");
                    return Race { finished, hedge_won: Some(true), cancelled: primary };
                }
            }
        }
        if primary.is_none() && hedge.is_none() {
            label("failed");
            return Race {
                finished,
                hedge_won: None,
                cancelled: None,
            };
        }
    }
}
