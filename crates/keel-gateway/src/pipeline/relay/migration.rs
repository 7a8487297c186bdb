//! Finding a variant that continues the generation: each remaining variant of the plan, in
//! order, gets a continuation built for its `resume` mode from the text already delivered. The
//! continuation is an attempt like any other (`settlement`): it must be able to enter the
//! variant (available, a free slot, the retry budget), and its outcome is settled the same way,
//! so a 401 marks the credential, a 429 lowers the learned limit or cools the variant down, and
//! a spent retry budget stops migrations as it stops fallbacks. A continuation the variant
//! rejects (a 400, say) falls through to the next variant, except a prefill the variant
//! refuses as such ("does not support assistant message prefill"): the variant learns
//! `instruction` mode and the continuation is retried in it at once ([`Relay::finish`]). When the whole fleet
//! is loading or restarting, a failed stream waits for the first ready variant (within its
//! deadline) instead of ending in an error.

use crate::observe::record::AttemptKind;
use std::time::Duration;

use tokio::time::Instant;

use keel_core::continuation::{continuation, ResumeMode, Stitcher};
use keel_core::outcome::AttemptFailure;
use keel_core::request::CanonicalRequest;

use super::{Relay, Segment};
use crate::pipeline::attempt::{attempt, AttemptResult, Served};
use crate::pipeline::context::RequestCtx;
use crate::pipeline::settlement::{Entered, Refused, Settled, StreamEnd};
use crate::upstream::translation;
use keel_core::continuation::is_prefill_refusal;
use keel_core::protocol::error_message;

use crate::wire::errors::{ErrorKind, GatewayError};

/// How often a stream waiting for a restarting fleet looks again.
const FLEET_POLL: Duration = Duration::from_millis(50);
/// Passes over a restarting fleet in which a connection may break without ending the wait.
const TRANSPORT_ROUNDS: u32 = 2;

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
        self.prepare_inner(stitcher, vi, true).await
    }

    /// [`Relay::prepare`]; `budgeted` is false for a continuation that replaces one its
    /// variant refused without failing (it spent the retry budget already).
    async fn prepare_inner(
        &mut self,
        stitcher: &Stitcher,
        vi: usize,
        budgeted: bool,
    ) -> Result<Continuation, Skipped> {
        // The variant's resume mode now: configured, or learned from a refused prefill.
        let resume = self.pool.variants[vi].resume();
        let v = &self.pool.variants[vi].cfg;
        let name = v.name.clone();
        let skipped = |reason: String, stop| Skipped { reason, stop };
        // Built in the client's protocol; a variant of the other protocol gets it translated
        // (its prefill fields are added after translation, see `translation`).
        let same = translation::same_protocol(v, self.req.endpoint);
        let no_fields = serde_json::Map::new();
        let (endpoint, body) = continuation(
            &self.req,
            resume,
            if same {
                &v.continuation_fields
            } else {
                &no_fields
            },
            &stitcher.delivered,
            stitcher.delivered_tokens(),
        )
        .map_err(|e| skipped(format!("{name}: {e:?}"), false))?;
        let mut req = self.req.clone();
        req.endpoint = endpoint;
        req.body = body;
        translation::check(v, &req)
            .map_err(|e| skipped(format!("{name}: {}", e.message), false))?;
        let deadline = self.ctx.deadline;
        let entered = if budgeted {
            self.attempts
                .enter(vi, AttemptKind::Continuation, deadline)
                .await
        } else {
            self.attempts
                .reenter(vi, AttemptKind::Continuation, deadline)
                .await
        };
        let entered = entered
            .map_err(|r| skipped(format!("{name}: {}", r.describe()), r == Refused::Budget))?;
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

    /// Sends continuation `c` and settles it ([`Relay::finish`]).
    pub(super) async fn send_continuation(
        &mut self,
        stitcher: &Stitcher,
        c: Continuation,
    ) -> (Result<Segment, GatewayError>, ResumeMode) {
        let tp = c.entered.traceparent();
        let result = attempt(&self.pool, c.entered.vi, &c.req, &c.ctx, tp).await;
        self.finish(stitcher, c, result).await
    }

    /// Settles continuation `c` with its `result`: the next segment (and the resume mode it
    /// continues in), or why it cannot be one. A `prefill` continuation its variant refuses
    /// ("does not support assistant message prefill", as Anthropic's newer models answer) is
    /// no failure of the variant: it is settled as `prefill_refused`, the variant continues in
    /// `instruction` mode from now on (logged once), and the continuation is retried at once
    /// in that mode on the same variant, without spending the retry budget again or a
    /// migration.
    pub(super) async fn finish(
        &mut self,
        stitcher: &Stitcher,
        c: Continuation,
        result: AttemptResult,
    ) -> (Result<Segment, GatewayError>, ResumeMode) {
        if !(c.resume == ResumeMode::Prefill && refuses_prefill(&result)) {
            return (self.conclude(c.entered, result), c.resume);
        }
        let vi = c.entered.vi;
        self.attempts.settle_prefill_refused(c.entered);
        let v = &self.pool.variants[vi];
        if v.learn_instruction() {
            tracing::warn!(pool = %self.pool.cfg.name, variant = %v.cfg.name, "the variant refuses assistant prefill; it continues generations in `instruction` mode from now on");
            self.pool
                .metrics
                .counter(
                    "keel_resume_learned_total",
                    &[("pool", &self.pool.cfg.name), ("variant", &v.cfg.name)],
                )
                .increment(1);
        }
        match self.prepare_inner(stitcher, vi, false).await {
            Ok(c) => {
                let tp = c.entered.traceparent();
                let result = attempt(&self.pool, vi, &c.req, &c.ctx, tp).await;
                (self.conclude(c.entered, result), c.resume)
            }
            Err(s) => {
                let e = GatewayError::new(ErrorKind::Upstream, s.reason);
                (Err(e), ResumeMode::Instruction)
            }
        }
    }

    /// Settles a continuation's attempt: the next segment, or why it cannot be one.
    pub(super) fn conclude(
        &mut self,
        entered: Entered,
        result: AttemptResult,
    ) -> Result<Segment, GatewayError> {
        let name = self.pool.variants[entered.vi].cfg.name.clone();
        let unserved = |why: String| Err(GatewayError::new(ErrorKind::Upstream, why));
        match self.attempts.settle(entered, result) {
            Settled::Served(committed, Served::Stream(start)) => Ok(Segment::new(committed, start)),
            Settled::Served(committed, Served::Whole { .. }) => {
                let f =
                    AttemptFailure::Malformed("answered a continuation without a stream".into());
                let reason = format!("{name}: {}", f.describe());
                self.attempts.settle_end(committed, StreamEnd::Failed(f));
                unserved(reason)
            }
            Settled::ClientError(Served::Whole { status, .. }) => {
                unserved(format!("{name}: continuation rejected with HTTP {status}"))
            }
            Settled::ClientError(_) => unserved(format!("{name}: continuation rejected")),
            Settled::Failed => unserved(format!(
                "{name}: {}",
                self.attempts.last_failure().unwrap_or_default()
            )),
        }
    }

    /// The next segment and its variant's resume mode, or why nothing can continue.
    ///
    /// With `wait_for_fleet` (a stream that failed, not one that is merely slow): when nothing
    /// could continue because every variant is loading or restarting (the whole fleet
    /// restarts), the stream waits for the first ready variant, as a new request would in
    /// selection, within its deadline, and tries again, every variant included (its own may be
    /// back first). A connection that broke on the way (a restart drops open connections, and
    /// a pooled one may meet that first) is tolerated in at most [`TRANSPORT_ROUNDS`] passes.
    pub(super) async fn migrate(
        &mut self,
        stitcher: &Stitcher,
        tried: &mut Vec<usize>,
        wait_for_fleet: bool,
    ) -> Result<(Box<Segment>, ResumeMode), GatewayError> {
        let mut transport_rounds = 0;
        loop {
            let before = self.attempts.failure_marks();
            let (why, stopped) = match self.migrate_once(stitcher, tried).await {
                // Boxed: the relay holds it across an await, and its future lives as long as
                // the stream (a `Segment` inline made every live stream's state 1.2 KB larger).
                Ok((next, mode)) => return Ok((Box::new(next), mode)),
                Err(e) => e,
            };
            let after = self.attempts.failure_marks();
            // Every failure of this pass left its variant warming (none failed otherwise), or
            // failed at the connection, as in a restart.
            let warming = after.1 - before.1;
            let transport = self
                .attempts
                .failures_since(before.0)
                .filter(|f| {
                    matches!(
                        f,
                        AttemptFailure::Io(_)
                            | AttemptFailure::Connect(_)
                            | AttemptFailure::Refused(_)
                    ) && !f.is_loading()
                })
                .count();
            let total = after.0 - before.0;
            let tolerable = if warming == total {
                true
            } else if transport >= total - warming && transport_rounds < TRANSPORT_ROUNDS {
                transport_rounds += 1;
                true
            } else {
                false
            };
            // Only while some variant is loading or restarting: otherwise nothing is coming.
            let warming_fleet = (0..self.pool.variants.len()).any(|i| self.pool.loading(i));
            if !wait_for_fleet
                || stopped
                || !tolerable
                || !warming_fleet
                || !self.wait_for_ready().await
            {
                return Err(why);
            }
            tried.clear();
        }
    }

    /// Waits while no variant is ready and some is loading or restarting, until one is ready:
    /// true then; false when nothing is warming (waiting would not help) or at the deadline.
    async fn wait_for_ready(&self) -> bool {
        let pool = &self.pool;
        loop {
            let wake = Instant::now() + FLEET_POLL;
            if wake >= self.ctx.deadline {
                return false;
            }
            tokio::time::sleep_until(wake).await;
            let now = pool.now_ms();
            let n = pool.variants.len();
            if (0..n).any(|i| !pool.loading(i) && pool.can_take(i, now)) {
                return true;
            }
            if !(0..n).any(|i| pool.loading(i)) {
                return false;
            }
        }
    }

    /// One pass over the variants that may continue: the next segment, or why none could
    /// (and whether the retry budget stopped the search).
    async fn migrate_once(
        &mut self,
        stitcher: &Stitcher,
        tried: &mut Vec<usize>,
    ) -> Result<(Segment, ResumeMode), (GatewayError, bool)> {
        let mut reasons = Vec::new();
        let mut stopped = false;
        // The plan first; then the pool's other variants, which may have recovered since the
        // plan was made (entering re-checks each).
        let others = (0..self.pool.variants.len()).filter(|i| !self.order.contains(i));
        let mut candidates: Vec<usize> = self
            .order
            .iter()
            .copied()
            .chain(others)
            .filter(|i| !tried.contains(i))
            .collect();
        // A continuation by instruction is a new message whose first words may repeat or
        // lose a little of the seam; a prefill (or completion) continues the text itself. So
        // the variants that continue exactly go first, each group in plan order.
        candidates.sort_by_key(|&vi| self.pool.variants[vi].resume() == ResumeMode::Instruction);
        for vi in candidates {
            if Instant::now() >= self.ctx.deadline {
                reasons.push("deadline reached".to_owned());
                stopped = true;
                break;
            }
            let c = match self.prepare(stitcher, vi).await {
                Ok(c) => c,
                Err(s) => {
                    reasons.push(s.reason);
                    if s.stop {
                        stopped = true;
                        break;
                    }
                    continue;
                }
            };
            tried.push(vi);
            match self.send_continuation(stitcher, c).await {
                (Ok(next), resume) => return Ok((next, resume)),
                (Err(e), _) => reasons.push(e.message),
            }
        }
        if reasons.is_empty() {
            reasons.push("no other variant in the plan".into());
        }
        let why = GatewayError::new(ErrorKind::Upstream, reasons.join("; "));
        Err((why, stopped))
    }
}

/// Whether an attempt's result is its variant refusing assistant prefill: a 400 whose message
/// says so ([`is_prefill_refusal`]). Any other 400 is not.
fn refuses_prefill(result: &AttemptResult) -> bool {
    match result {
        AttemptResult::ClientError(Served::Whole { status, body, .. })
            if status.as_u16() == 400 =>
        {
            serde_json::from_slice::<serde_json::Value>(body)
                .map(|v| is_prefill_refusal(&error_message(&v)))
                .unwrap_or(false)
        }
        _ => false,
    }
}
