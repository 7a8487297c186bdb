//! Finding a variant that continues the generation: each remaining variant of the plan, in
//! order, gets a continuation built for its `resume` mode from the text already delivered. The
//! continuation is an attempt like any other (`settlement`): it must be able to enter the
//! variant (available, a free slot, the retry budget), and its outcome is settled the same way,
//! so a 401 marks the credential, a 429 lowers the learned limit or cools the variant down, and
//! a spent retry budget stops migrations as it stops fallbacks. A continuation the variant
//! rejects (a 400 for a prefill, say) falls through to the next variant.

use tokio::time::Instant;

use keel_core::continuation::{continuation, ResumeMode, Stitcher};

use super::{Relay, Segment};
use crate::attempt::{attempt, Served};
use crate::settlement::{AttemptKind, Refused, Settled, StreamEnd};

impl Relay {
    /// The next segment and its variant's resume mode, or why nothing can continue.
    pub(super) async fn migrate(
        &mut self,
        stitcher: &Stitcher,
        tried: &mut Vec<usize>,
    ) -> Result<(Segment, ResumeMode), String> {
        let mut reasons = Vec::new();
        let candidates: Vec<usize> = self
            .order
            .iter()
            .copied()
            .filter(|i| !tried.contains(i))
            .collect();
        for vi in candidates {
            if Instant::now() >= self.ctx.deadline {
                reasons.push("deadline reached".to_owned());
                break;
            }
            let name = self.pool.variants[vi].cfg.name.clone();
            let resume = self.pool.variants[vi].cfg.resume;
            // Built before entering: a variant that cannot continue costs no slot or budget.
            let built = continuation(
                &self.req,
                resume,
                &self.pool.variants[vi].cfg.continuation_fields,
                &stitcher.delivered,
                stitcher.delivered_tokens(),
            );
            let (endpoint, body) = match built {
                Ok(x) => x,
                Err(e) => {
                    tried.push(vi);
                    reasons.push(format!("{name}: {e:?}"));
                    continue;
                }
            };
            let entered = match self
                .attempts
                .enter(vi, AttemptKind::Continuation, self.ctx.deadline)
                .await
            {
                Ok(e) => e,
                Err(r) => {
                    reasons.push(format!("{name}: {}", r.describe()));
                    if r == Refused::Budget {
                        break;
                    }
                    continue;
                }
            };
            tried.push(vi);
            let mut req = self.req.clone();
            req.endpoint = endpoint;
            req.body = body;
            let mut ctx = self.ctx.clone();
            ctx.endpoint = endpoint;
            // The relay needs a stream, whatever the client asked for.
            ctx.client_stream = true;
            let result = attempt(&self.pool, vi, &req, &ctx).await;
            match self.attempts.settle(entered, result) {
                Settled::Served(committed, Served::Stream(start)) => {
                    return Ok((Segment { committed, start }, resume));
                }
                Settled::Served(committed, Served::Whole { .. }) => {
                    let f = keel_core::outcome::AttemptFailure::Malformed(
                        "answered a continuation without a stream".into(),
                    );
                    reasons.push(format!("{name}: {}", f.describe()));
                    self.attempts.settle_end(committed, StreamEnd::Failed(f));
                }
                Settled::ClientError(Served::Whole { status, .. }) => {
                    reasons.push(format!("{name}: continuation rejected with HTTP {status}"));
                }
                Settled::ClientError(_) => {
                    reasons.push(format!("{name}: continuation rejected"));
                }
                Settled::Failed => reasons.push(format!(
                    "{name}: {}",
                    self.attempts.last_failure().unwrap_or_default()
                )),
            }
        }
        if reasons.is_empty() {
            reasons.push("no other variant in the plan".into());
        }
        Err(reasons.join("; "))
    }
}
