//! Finding a variant that continues the generation: each remaining variant of the plan, in
//! order, gets a continuation built for its `resume` mode from the text already delivered. The
//! continuation is an attempt like any other (`settlement`): it must be able to enter the
//! variant (available, a free slot, the retry budget), and its outcome is settled the same way,
//! so a 401 marks the credential, a 429 lowers the learned limit or cools the variant down, and
//! a spent retry budget stops migrations as it stops fallbacks. A continuation the variant
//! rejects (a 400 for a prefill, say) falls through to the next variant.

use tokio::time::Instant;

use keel_core::continuation::{continuation, ResumeMode, Stitcher};
use keel_core::outcome::AttemptFailure;
use keel_core::request::CanonicalRequest;

use super::{Relay, Segment};
use crate::attempt::{attempt, AttemptResult, Served};
use crate::context::RequestCtx;
use crate::settlement::{AttemptKind, Entered, Refused, Settled, StreamEnd};

/// A continuation request that has entered its variant, ready to send.
pub(super) struct Continuation {
    pub entered: Entered,
    pub req: CanonicalRequest,
    pub ctx: RequestCtx,
    pub resume: ResumeMode,
}

/// Why a variant could not be asked to continue.
pub(super) struct Skipped {
    pub reason: String,
    /// The retry budget is spent: no other variant may be tried either.
    pub stop: bool,
}

impl Relay {
    /// Builds the continuation for variant `vi` and enters it (before entering: a variant that
    /// cannot continue costs no slot or budget).
    pub(super) async fn prepare(
        &mut self,
        stitcher: &Stitcher,
        vi: usize,
    ) -> Result<Continuation, Skipped> {
        let v = &self.pool.variants[vi].cfg;
        let (name, resume) = (v.name.clone(), v.resume);
        let skipped = |reason: String, stop| Skipped { reason, stop };
        let (endpoint, body) = continuation(
            &self.req,
            resume,
            &v.continuation_fields,
            &stitcher.delivered,
            stitcher.delivered_tokens(),
        )
        .map_err(|e| skipped(format!("{name}: {e:?}"), false))?;
        let entered = self
            .attempts
            .enter(vi, AttemptKind::Continuation, self.ctx.deadline)
            .await
            .map_err(|r| skipped(format!("{name}: {}", r.describe()), r == Refused::Budget))?;
        let mut req = self.req.clone();
        req.endpoint = endpoint;
        req.body = body;
        let mut ctx = self.ctx.clone();
        ctx.endpoint = endpoint;
        // The relay needs a stream, whatever the client asked for.
        ctx.client_stream = true;
        Ok(Continuation {
            entered,
            req,
            ctx,
            resume,
        })
    }

    /// Settles a continuation's attempt: the next segment, or why it cannot be one.
    pub(super) fn conclude(
        &mut self,
        entered: Entered,
        result: AttemptResult,
    ) -> Result<Segment, String> {
        let name = self.pool.variants[entered.vi].cfg.name.clone();
        match self.attempts.settle(entered, result) {
            Settled::Served(committed, Served::Stream(start)) => Ok(Segment::new(committed, start)),
            Settled::Served(committed, Served::Whole { .. }) => {
                let f =
                    AttemptFailure::Malformed("answered a continuation without a stream".into());
                let reason = format!("{name}: {}", f.describe());
                self.attempts.settle_end(committed, StreamEnd::Failed(f));
                Err(reason)
            }
            Settled::ClientError(Served::Whole { status, .. }) => {
                Err(format!("{name}: continuation rejected with HTTP {status}"))
            }
            Settled::ClientError(_) => Err(format!("{name}: continuation rejected")),
            Settled::Failed => Err(format!(
                "{name}: {}",
                self.attempts.last_failure().unwrap_or_default()
            )),
        }
    }

    /// The next segment and its variant's resume mode, or why nothing can continue.
    pub(super) async fn migrate(
        &mut self,
        stitcher: &Stitcher,
        tried: &mut Vec<usize>,
    ) -> Result<(Segment, ResumeMode), String> {
        let mut reasons = Vec::new();
        // The plan first; then the pool's other variants, which may have recovered since the
        // plan was made (entering re-checks each).
        let others = (0..self.pool.variants.len()).filter(|i| !self.order.contains(i));
        let candidates: Vec<usize> = self
            .order
            .iter()
            .copied()
            .chain(others)
            .filter(|i| !tried.contains(i))
            .collect();
        for vi in candidates {
            if Instant::now() >= self.ctx.deadline {
                reasons.push("deadline reached".to_owned());
                break;
            }
            let c = match self.prepare(stitcher, vi).await {
                Ok(c) => c,
                Err(s) => {
                    reasons.push(s.reason);
                    if s.stop {
                        break;
                    }
                    continue;
                }
            };
            tried.push(vi);
            let result = attempt(&self.pool, vi, &c.req, &c.ctx).await;
            match self.conclude(c.entered, result) {
                Ok(next) => return Ok((next, c.resume)),
                Err(reason) => reasons.push(reason),
            }
        }
        if reasons.is_empty() {
            reasons.push("no other variant in the plan".into());
        }
        Err(reasons.join("; "))
    }
}
