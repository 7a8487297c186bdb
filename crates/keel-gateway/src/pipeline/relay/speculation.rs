//! Speculative continuation: a stream that goes quiet for longer than its variant's gaps
//! explain (4 × its P99-ish inter-token gap, at least [`crate::state::pools::QUIET_FLOOR_MS`]) gets
//! a continuation started elsewhere *while it is still being read*. Whichever produces the next
//! token first keeps the stream: if the original resumes, the continuation is cancelled (it
//! cost a prefill, never text: it had produced nothing); if the continuation answers first, the
//! original is abandoned as stalled and the continuation is spliced in like any migration. So a
//! stall costs a few gaps, not the hard stall threshold, and a pause that was only a pause
//! costs one cancelled request.
//!
//! While the race runs nothing is forwarded from the original (`Relay::wait_for_more` only
//! reads), so abandoning it loses and duplicates nothing; the continuation is built from
//! exactly the text the client has. One race per segment; it is a continuation attempt like any
//! other (it enters its variant and spends the retry budget through `settlement`). A
//! continuation later to its first token than its variant's first tokens usually are (twice the
//! quantile the hedge delay uses), or one that fails before its first token, gives way to the next
//! candidate (two at most); one still silent when the original fails is cancelled, and the
//! migration goes on elsewhere.

use std::time::Duration;

use keel_core::continuation::{ResumeMode, Stitcher};
use keel_core::outcome::AttemptFailure;

use super::{Relay, Segment, SegmentEnd};
use crate::pipeline::attempt::{attempt, AttemptResult};

/// How a race ended.
pub(super) enum Speculated {
    /// Nothing could race (no candidate, no budget, or every continuation tried failed): the
    /// original carries on, under the hard stall threshold.
    NotRaced,
    /// The original produced more first; the continuation was cancelled.
    Resumed,
    /// The continuation produced its first token first: switch to it. (Segments come boxed:
    /// the relay holds this across an await, and its future lives as long as the stream.)
    Won(Box<Segment>, ResumeMode),
    /// The original failed while the continuation was under way, and the continuation serves.
    Rescued(AttemptFailure, Box<Segment>, ResumeMode),
    /// The original ended (a failure nothing rescued, the client gone, the deadline).
    Ended(SegmentEnd),
}

/// Continuations one race may try: a continuation that fails, or does not answer within its
/// patience (see `Pool::continuation_patience_ms`), gives way to the next candidate, once.
const RACED_CONTINUATIONS: usize = 2;

enum First {
    Original(SegmentEnd),
    Continuation(Box<AttemptResult>),
    /// The continuation's patience ran out before its first token.
    Impatient,
}

impl Relay {
    /// Races a continuation against the quiet segment `seg`: up to [`RACED_CONTINUATIONS`] in
    /// turn, each given up once it is later to its first token than its variant's first
    /// tokens usually are.
    pub(super) async fn speculate(
        &mut self,
        seg: &mut Segment,
        stitcher: &Stitcher,
        tried: &mut Vec<usize>,
    ) -> Speculated {
        for _ in 0..RACED_CONTINUATIONS {
            let now = self.pool.now_ms();
            let Some(vi) = self
                .order
                .iter()
                .copied()
                .find(|i| !tried.contains(i) && self.pool.can_take(*i, now))
            else {
                return Speculated::NotRaced;
            };
            let Ok(c) = self.prepare(stitcher, vi).await else {
                return Speculated::NotRaced;
            };
            let pool = self.pool.clone();
            let patience = Duration::from_millis(pool.continuation_patience_ms(vi));
            let give_up = tokio::time::Instant::now() + patience;
            // Its own copy: `c` goes on to be settled (and, refused, rebuilt) while this runs.
            let (req, ctx) = (c.req.clone(), c.ctx.clone());
            let cont = attempt(&pool, vi, &req, &ctx, c.entered.traceparent());
            tokio::pin!(cont);
            let first = {
                let original = self.wait_for_more(seg);
                tokio::pin!(original);
                tokio::select! {
                    // The original first: a token that arrives as the continuation answers
                    // keeps the stream where it is.
                    biased;
                    end = &mut original => First::Original(end),
                    r = &mut cont => First::Continuation(Box::new(r)),
                    _ = tokio::time::sleep_until(give_up) => First::Impatient,
                }
            };
            match first {
                // A refused prefill is retried in `instruction` mode at once (`finish`), the
                // original waiting meanwhile (it is not read; nothing of it is lost).
                First::Continuation(result) => {
                    tried.push(vi);
                    match self.finish(stitcher, c, *result).await {
                        (Ok(next), resume) => return Speculated::Won(Box::new(next), resume),
                        // It failed before its first token (a variant just dead, refusing,
                        // throttled): the next candidate races instead. Given up here, the
                        // stream waited out the hard stall threshold for nothing.
                        (Err(_), _) => {}
                    }
                }
                First::Original(SegmentEnd::Failed(f)) => {
                    // The original is gone: the continuation already under way is its
                    // migration, if it answers within its patience; past it, the migration
                    // goes on to the next candidate.
                    tried.push(vi);
                    let Ok(result) = tokio::time::timeout_at(give_up, cont).await else {
                        self.attempts.cancelled(c.entered);
                        return Speculated::Ended(SegmentEnd::Failed(f));
                    };
                    return match self.finish(stitcher, c, result).await {
                        (Ok(next), resume) => Speculated::Rescued(f, Box::new(next), resume),
                        (Err(_), _) => Speculated::Ended(SegmentEnd::Failed(f)),
                    };
                }
                First::Original(end) => {
                    // Resumed, ended cleanly, client gone or deadline: the continuation is not
                    // needed. Dropping its future closes its connection.
                    self.attempts.cancelled(c.entered);
                    return match end {
                        SegmentEnd::Resumed => Speculated::Resumed,
                        other => Speculated::Ended(other),
                    };
                }
                // Cancelled (its wait is a lower bound of its variant's TTFT); the original is
                // still read, and the next candidate races it.
                First::Impatient => {
                    tried.push(vi);
                    self.attempts.cancelled(c.entered);
                }
            }
        }
        Speculated::NotRaced
    }
}
