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
//! other (it enters its variant and spends the retry budget through `settlement`).

use keel_core::continuation::{ResumeMode, Stitcher};
use keel_core::outcome::AttemptFailure;

use super::{Relay, Segment, SegmentEnd};
use crate::pipeline::attempt::{attempt, AttemptResult};

/// How a race ended.
pub(super) enum Speculated {
    /// Nothing could race (no candidate, no budget, or the continuation failed): the original
    /// carries on, under the hard stall threshold.
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

enum First {
    Original(SegmentEnd),
    Continuation(Box<AttemptResult>),
}

impl Relay {
    /// Races a continuation against the quiet segment `seg`.
    pub(super) async fn speculate(
        &mut self,
        seg: &mut Segment,
        stitcher: &Stitcher,
        tried: &mut Vec<usize>,
    ) -> Speculated {
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
        // Its own copy: `c` goes on to be settled (and, refused, rebuilt) while this runs.
        let (req, ctx) = (c.req.clone(), c.ctx.clone());
        let cont = attempt(&pool, vi, &req, &ctx, c.entered.traceparent());
        tokio::pin!(cont);
        let first = {
            let original = self.wait_for_more(seg);
            tokio::pin!(original);
            tokio::select! {
                // The original first: a token that arrives as the continuation answers keeps
                // the stream where it is.
                biased;
                end = &mut original => First::Original(end),
                r = &mut cont => First::Continuation(Box::new(r)),
            }
        };
        match first {
            // A refused prefill is retried in `instruction` mode at once (`finish`), the
            // original waiting meanwhile (it is not read; nothing of it is lost).
            First::Continuation(result) => {
                tried.push(vi);
                match self.finish(stitcher, c, *result).await {
                    (Ok(next), resume) => Speculated::Won(Box::new(next), resume),
                    (Err(_), _) => Speculated::NotRaced,
                }
            }
            First::Original(SegmentEnd::Failed(f)) => {
                // The original is gone: the continuation already under way is its migration.
                tried.push(vi);
                let result = cont.await;
                match self.finish(stitcher, c, result).await {
                    (Ok(next), resume) => Speculated::Rescued(f, Box::new(next), resume),
                    (Err(_), _) => Speculated::Ended(SegmentEnd::Failed(f)),
                }
            }
            First::Original(end) => {
                // Resumed, ended cleanly, client gone or deadline: the continuation is not
                // needed. Dropping its future closes its connection.
                self.attempts.cancelled(c.entered);
                match end {
                    SegmentEnd::Resumed => Speculated::Resumed,
                    other => Speculated::Ended(other),
                }
            }
        }
    }
}
