//! After the commit point: relaying a stream to the client, detecting when its upstream fails,
//! and migrating the rest of the generation to another variant.
//!
//! * [`segment`]: the IO pump of one segment and its per-event policy. Events are forwarded one
//!   whole event at a time (never a partial one), through a `Stitcher` that keeps the client's
//!   stream one response. Each segment is watched for a **stall** (no output for the stall
//!   threshold: adaptive per variant, max(4 × its P99-ish inter-token gap, 500 ms), capped by
//!   `stall_ms`), a **slowdown** (`keel_core::stream_watch::SlowRate`), and an **error** (the
//!   connection breaks or closes before the terminal event, a malformed or oversized event, an
//!   error event). Failures are typed `AttemptFailure`s, the same vocabulary as before the
//!   commit point.
//! * [`migration`]: finding a variant that continues the generation. A continuation is an
//!   attempt like any other: it enters its variant and is settled through `settlement`, so it
//!   respects cooldowns, credentials, learned concurrency limits and the retry budget.
//! * this module: the decision between them. On a failure, while `max_migrations` allows, the
//!   failed segment is settled, a continuation is started, and its stream is spliced in after an
//!   SSE comment `: keel migrated from=<a> to=<b> reason=<stall|slow|error> after_tokens=<n>`.
//!   When nothing can continue, the stream ends with an explicit error event; except after a
//!   slowdown, or a silence at the adaptive stall threshold (shorter than `stall_ms`), which may
//!   be a stream that is only slow: that one goes on where it is.
//!
//! The client's body ends cleanly only through [`Sink::end`], called after a terminal event
//! (the upstream's or keel's error event); if the relay disappears any other way (it panics,
//! or returns early), the body aborts (see `body`). A streamed relay runs inside the client's
//! body (`body::driven`); once the client is gone it finishes in a task of its own.

mod integrity;
mod migration;
mod segment;
mod sink;
mod speculation;

use std::future::Future;
use std::ops::ControlFlow;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use keel_core::continuation::{ResumeMode, Stitcher};
use keel_core::outcome::AttemptFailure;
use keel_core::protocol::{ErrorKind, Protocol};
use keel_core::request::CanonicalRequest;
use keel_core::sse::SseEvent;

pub use integrity::whole_flags;
pub use sink::{Assembled, Sent, Sink};
use speculation::Speculated;

use crate::observe::access_log::RequestLog;
use crate::pipeline::attempt::StreamStart;
use crate::pipeline::context::RequestCtx;
use crate::pipeline::settlement::{Attempts, Committed, StreamEnd};
use crate::state::pools::Pool;
use crate::wire::errors::GatewayError;
use crate::Gateway;

/// Everything needed to relay a stream and continue it elsewhere.
pub struct Relay {
    pub gw: Arc<Gateway>,
    pub sink: Sink,
    pub protocol: Protocol,
    pub pool: Arc<Pool>,
    pub req: CanonicalRequest,
    pub ctx: RequestCtx,
    /// The plan: candidates for continuations, in order.
    pub order: Vec<usize>,
    /// The request's attempts so far (stage 2's); continuations join them.
    pub attempts: Attempts,
    /// Event blocks sent to the client (test hooks count them).
    sent: AtomicUsize,
    /// Continuations for truncation, the JSON retry, and the answer's flags.
    integrity_state: integrity::State,
}

/// What a relay takes over at the commit point: the request and its plan.
pub struct Handover {
    pub gw: Arc<Gateway>,
    pub protocol: Protocol,
    pub pool: Arc<Pool>,
    pub req: CanonicalRequest,
    pub ctx: RequestCtx,
    /// The plan: candidates for continuations, in order.
    pub order: Vec<usize>,
    /// The request's attempts so far; continuations join them.
    pub attempts: Attempts,
}

/// How one segment ended (or paused).
enum SegmentEnd {
    Complete,
    ClientGone,
    /// Silent past its variant's quiet threshold: worth racing a continuation.
    Quiet,
    /// While raced: the stream produced more (kept, not yet forwarded).
    Resumed,
    /// The upstream failed after its first token.
    Failed(AttemptFailure),
    /// The request's total deadline: no migration can help.
    Deadline,
    /// The upstream stopped for length: its ending, held back (see `integrity`).
    LengthStop(Vec<keel_core::sse::SseEvent>),
}

/// What the client's headers would say about a relayed response, known once it has ended.
#[derive(Debug, Clone)]
pub struct Summary {
    pub route: &'static str,
    pub variant: String,
    pub attempts: usize,
    /// `x-keel-integrity` flags (`truncated`, `invalid_json`) of the answer as delivered.
    pub integrity: Vec<&'static str>,

    /// The stream reached its upstream's terminal event and the client was there to the end.
    pub complete: bool,
}

/// One segment being relayed: the committed attempt, its stream, and what the relay has
/// watched of it.
struct Segment {
    committed: Committed,
    start: StreamStart,
    watch: segment::Watch,
    /// A continuation was raced against it once already.
    raced: bool,
}

/// Migrations for slowness alone, per request, on top of `max_migrations` (which bounds
/// migrations for stalls and errors). Slowness is a preference, a failure a necessity: the soak
/// found a fleet-wide slowdown making streams hop between equally slow variants until a real
/// stall found no migration left and ended the stream with an error.
const MAX_SLOW_MIGRATIONS: u32 = 1;

/// What the note at a seam says about the segment that ended there.
struct Seam {
    from: String,
    reason: &'static str,
    /// How long a stall lasted.
    silent_ms: Option<u64>,
    detail: String,
}

impl Seam {
    fn new(from: &str, f: &AttemptFailure) -> Seam {
        Seam {
            from: from.to_owned(),
            reason: f.migration_reason(),
            silent_ms: match f {
                AttemptFailure::Stall { silent_ms } => Some(*silent_ms),
                _ => None,
            },
            detail: f.describe(),
        }
    }
}

/// How the whole relay ended.
enum Ending {
    Complete,
    ClientGone,
    /// An explicit error event ends the stream: why.
    GiveUp(String),
}

/// The relay's course through one client stream, past the segment being relayed: what the
/// client has been sent, the access line that records where it came from, and the
/// migrations spent.
struct Course {
    stitcher: Stitcher,
    /// The next events' overlap with the text already delivered is trimmed (an instruction
    /// continuation's).
    trim: bool,
    log: RequestLog,
    /// The variants this stream has been on since its answer began.
    tried: Vec<usize>,
    /// Migrations for failures (stall, error) and for slowness are counted apart, so that
    /// slowness never spends what a failure needs (see MAX_SLOW_MIGRATIONS).
    migrations: u32,
    slow_migrations: u32,
    /// The pool's `max_migrations` as read at this segment's start.
    max_migrations: u32,
}

impl Relay {
    pub fn new(handover: Handover, sink: Sink) -> Relay {
        let Handover {
            gw,
            protocol,
            pool,
            req,
            ctx,
            order,
            attempts,
        } = handover;
        Relay {
            gw,
            sink,
            protocol,
            pool,
            req,
            ctx,
            order,
            attempts,
            sent: AtomicUsize::new(0),
            integrity_state: integrity::State::default(),
        }
    }

    /// Relays the committed stream to its end, migrating as needed, and accounts for it.
    ///
    /// This future lives as long as its stream, so its size is memory every live stream holds
    /// (3.5 KB in a release build; `cargo +nightly rustc --release -p keel-gateway --lib --
    /// -Zprint-type-sizes` prints it, and `a_live_streams_relay_future_stays_small` bounds it).
    /// Only the segment's pump is awaited inline: what follows a segment's end (a race, a
    /// migration, a splice, a JSON retry, a length stop) is awaited boxed, and so is the
    /// ending, because a future's state is as large as its largest await plus what is held
    /// across any await. Inline they made every live stream carry 13.4 KB, then 6.8 KB
    /// (bench/history/2026-12-01-overhead-stops-1-5.md). Even a complete stream's end goes
    /// through the boxed step (one allocation of ≈ 3.3 KB, freed at once): inline, its JSON
    /// check would add 48 bytes to every live stream.
    pub fn run(
        mut self,
        committed: Committed,
        start: StreamStart,
        log: RequestLog,
    ) -> impl Future<Output = Summary> + Send {
        let mut course = Course {
            stitcher: Stitcher::new(self.protocol),
            trim: false,
            log,
            tried: vec![committed.vi],
            migrations: 0,
            slow_migrations: 0,
            max_migrations: 0,
        };
        let mut seg = Segment::new(committed, start);
        // The state is made here and captured by the async block, not passed to an async fn:
        // an async fn keeps its by-value arguments twice in its state (as arguments, and as the
        // locals they are moved into), ≈ 1.9 KB more for every live stream.
        async move {
            let ending = loop {
                let (slow_allowed, quiet) = self.start_turn(&mut course, &seg);
                let c = &mut course;
                let end = self
                    .segment(&mut seg, &mut c.stitcher, &mut c.trim, slow_allowed, quiet)
                    .await;
                match Box::pin(self.after_segment(&mut course, seg, end)).await {
                    ControlFlow::Continue(next) => seg = next,
                    ControlFlow::Break(ending) => break ending,
                }
            };
            let Course { stitcher, log, .. } = course;
            // The ending runs boxed: its locals would otherwise take room in this future's
            // state, which every live stream holds (see `close`).
            Box::pin(self.close(ending, stitcher, log)).await
        }
    }

    /// Starts a turn of the relay's loop: reads the pool's `max_migrations` for it (a pool
    /// that enters safe mode mid-stream stops migrating), and returns what the segment's pump
    /// watches for: whether slowness may end it, and after how long a silence it is worth
    /// racing a continuation.
    fn start_turn(&self, c: &mut Course, seg: &Segment) -> (bool, Option<u64>) {
        c.max_migrations = self.pool.max_migrations();
        // Slowness alone is only worth a migration when there is somewhere to go: a slow stream
        // beats an error. The same goes for racing a quiet stream.
        let now = self.pool.now_ms();
        let elsewhere = self
            .order
            .iter()
            .any(|i| !c.tried.contains(i) && self.pool.can_take(*i, now));
        let slow_allowed =
            elsewhere && c.max_migrations > 0 && c.slow_migrations < MAX_SLOW_MIGRATIONS;
        let quiet = (elsewhere && c.migrations < c.max_migrations && !seg.raced)
            .then(|| self.pool.quiet_threshold_ms(seg.committed.vi))
            .flatten();
        (slow_allowed, quiet)
    }

    /// What follows the end of segment `seg`: the segment to relay next (the same one, or a
    /// continuation spliced in), or how the relay ends, every segment then settled.
    ///
    /// Awaited boxed once per segment end; its own rare branches (a race, a migration, a
    /// splice, a JSON retry, a length stop) are boxed in turn, so that this box stays small
    /// and each of theirs is allocated only when taken.
    async fn after_segment(
        &mut self,
        c: &mut Course,
        mut seg: Segment,
        end: SegmentEnd,
    ) -> ControlFlow<Ending, Segment> {
        let end = match end {
            SegmentEnd::Quiet => {
                seg.raced = true;
                let silent_ms = seg.silent_ms();
                // The race won elsewhere retires the original as stalled (or as the failure it
                // met meanwhile) and splices the continuation in.
                match Box::pin(self.speculate(&mut seg, &c.stitcher, &mut c.tried)).await {
                    Speculated::NotRaced | Speculated::Resumed => {
                        return ControlFlow::Continue(seg)
                    }
                    Speculated::Ended(end) => end,
                    Speculated::Won(next, mode) => {
                        c.migrations += 1;
                        let stall = AttemptFailure::Stall { silent_ms };
                        return Box::pin(self.switch(c, seg, *next, stall, mode)).await;
                    }
                    Speculated::Rescued(failure, next, mode) => {
                        c.migrations += 1;
                        return Box::pin(self.switch(c, seg, *next, failure, mode)).await;
                    }
                }
            }
            end => end,
        };
        let failure = match end {
            SegmentEnd::Complete => {
                self.settle_complete(seg);
                return self.checked_json(c).await;
            }
            SegmentEnd::LengthStop(held) => return self.after_length(c, seg, held).await,
            SegmentEnd::ClientGone => return self.client_gone(seg),
            SegmentEnd::Deadline => {
                self.attempts.settle_end(seg.committed, StreamEnd::Deadline);
                let why = "the request's total deadline was reached";
                return ControlFlow::Break(Ending::GiveUp(why.into()));
            }
            SegmentEnd::Failed(f) => f,
            // Only a speculation sees these, and it has turned them into one of the above.
            SegmentEnd::Quiet | SegmentEnd::Resumed => return ControlFlow::Continue(seg),
        };
        // Slowness was only detected while a slow migration was allowed.
        if matches!(failure, AttemptFailure::Slow(_)) {
            return self.after_slow(c, seg, failure).await;
        }
        if let AttemptFailure::Stall { silent_ms } = failure {
            if silent_ms < self.pool.cfg.timeouts.stall_ms {
                return self.after_early_stall(c, seg, failure).await;
            }
        }
        self.after_failure(c, seg, failure).await
    }

    /// Settles a segment that reached its upstream's terminal event.
    fn settle_complete(&mut self, mut seg: Segment) {
        seg.start.source.reached_end();
        let gaps = seg.watch.gaps;
        self.attempts
            .settle_end(seg.committed, StreamEnd::Complete { gaps });
    }

    /// Settles `seg` as left by its client, which ends the relay.
    fn client_gone(&mut self, seg: Segment) -> ControlFlow<Ending, Segment> {
        self.attempts
            .settle_end(seg.committed, StreamEnd::ClientGone);
        ControlFlow::Break(Ending::ClientGone)
    }

    /// After a whole answer: its JSON retry's first segment (relayed afresh), or the end.
    async fn checked_json(&mut self, c: &mut Course) -> ControlFlow<Ending, Segment> {
        let Some(retry) = Box::pin(self.check_json(&c.stitcher, &mut c.log)).await else {
            return ControlFlow::Break(Ending::Complete);
        };
        // A whole answer that is not the JSON asked for: once more, afresh.
        c.tried = vec![retry.committed.vi];
        c.stitcher = Stitcher::new(self.protocol);
        c.trim = false;
        ControlFlow::Continue(retry)
    }

    /// After a segment that stopped for length, with `held` its ending: a continuation, or the
    /// ending released (see `integrity`).
    async fn after_length(
        &mut self,
        c: &mut Course,
        mut seg: Segment,
        held: Vec<SseEvent>,
    ) -> ControlFlow<Ending, Segment> {
        let from = seg.committed.vi;
        let truncation = seg.watch.truncation.take();
        let facts = integrity::LengthStop {
            reported: truncation.as_ref().and_then(|t| t.reported_output()),
            tokens_before: seg.watch.tokens_before,
            tool_call: truncation.as_ref().is_some_and(|t| t.saw_tool_call()),
        };
        self.settle_complete(seg);
        match Box::pin(self.after_length_stop(from, held, facts, c)).await {
            integrity::AfterLength::Continued(next) => ControlFlow::Continue(*next),
            integrity::AfterLength::ClientGone => ControlFlow::Break(Ending::ClientGone),
            integrity::AfterLength::Ended => self.checked_json(c).await,
        }
    }

    /// After a segment found slow: a slow stream is still a stream, so it is retired only once
    /// a continuation has its first token; if none can be had, it goes on where it is.
    async fn after_slow(
        &mut self,
        c: &mut Course,
        mut seg: Segment,
        failure: AttemptFailure,
    ) -> ControlFlow<Ending, Segment> {
        match Box::pin(self.migrate(&c.stitcher, &mut c.tried, false)).await {
            Ok((next, mode)) => {
                c.slow_migrations += 1;
                Box::pin(self.switch(c, seg, *next, failure, mode)).await
            }
            Err(_) => {
                self.count_migration(failure.migration_reason(), "failed");
                c.slow_migrations = MAX_SLOW_MIGRATIONS;
                seg.watch.slow = None;
                // The time spent looking elsewhere was not the stream's silence.
                seg.watch.last_output = tokio::time::Instant::now();
                seg.watch.last_token = None;
                ControlFlow::Continue(seg)
            }
        }
    }

    /// After a silence at the variant's adaptive stall threshold, shorter than the configured
    /// `stall_ms`: a silence the variant's own gaps do not explain, which may still be a
    /// stream that is only slow (when the whole fleet is overloaded, every stream is). It is
    /// continued elsewhere, the original retired once the continuation has its first token,
    /// as a failure migration; when no continuation can be had (no migration left, safe mode,
    /// no candidate, the retry budget spent), it goes on where it is, and only `stall_ms` of
    /// silence fails it, when one more migration is tried. A stream that was alive is never
    /// ended with an error for want of somewhere else to go.
    async fn after_early_stall(
        &mut self,
        c: &mut Course,
        mut seg: Segment,
        failure: AttemptFailure,
    ) -> ControlFlow<Ending, Segment> {
        if !self.pool.safety.active() && c.migrations < c.max_migrations {
            match Box::pin(self.migrate(&c.stitcher, &mut c.tried, false)).await {
                Ok((next, mode)) => {
                    c.migrations += 1;
                    return Box::pin(self.switch(c, seg, *next, failure, mode)).await;
                }
                Err(_) => self.count_migration(failure.migration_reason(), "failed"),
            }
        }
        seg.watch.patient = true;
        ControlFlow::Continue(seg)
    }

    /// After a segment that failed: settled as failed, then a continuation spliced in, or an
    /// error event when none may or can be had.
    async fn after_failure(
        &mut self,
        c: &mut Course,
        seg: Segment,
        failure: AttemptFailure,
    ) -> ControlFlow<Ending, Segment> {
        let seam = Seam::new(&self.pool.variants[seg.committed.vi].cfg.name, &failure);
        self.attempts
            .settle_end(seg.committed, StreamEnd::Failed(failure));
        let give_up = |why: String| ControlFlow::Break(Ending::GiveUp(why));
        if self.pool.safety.active() {
            let pool = &self.pool.cfg.name;
            return give_up(format!(
                "{}; pool `{pool}` is in safe mode (no migration)",
                seam.detail
            ));
        }
        if c.migrations >= c.max_migrations {
            let max = c.max_migrations;
            return give_up(format!(
                "{}; no migration left (max_migrations = {max})",
                seam.detail
            ));
        }
        match Box::pin(self.migrate(&c.stitcher, &mut c.tried, true)).await {
            Ok((next, mode)) => {
                c.migrations += 1;
                Box::pin(self.splice_or_settle(c, *next, &seam, mode)).await
            }
            Err(why) => {
                self.count_migration(seam.reason, "failed");
                give_up(format!("{}; migration impossible: {why}", seam.detail))
            }
        }
    }

    /// How a stream that has ended is accounted for and closed: the access line and the
    /// summary, the shadow comparison, and the client's end (a clean one, or an error event).
    async fn close(self, ending: Ending, mut stitcher: Stitcher, mut log: RequestLog) -> Summary {
        log.note_attempts(&self.attempts);
        let summary = Summary {
            route: log.route,
            variant: log.variant.clone(),
            attempts: log.attempts,
            integrity: self
                .integrity_state
                .flags
                .iter()
                .map(|f| f.as_str())
                .collect(),

            complete: matches!(ending, Ending::Complete),
        };
        let ends_cleanly = match ending {
            Ending::Complete => {
                let served = crate::pipeline::shadow::ServedAnswer {
                    text: std::mem::take(&mut stitcher.delivered),
                    latency_ms: log.started.elapsed().as_secs_f64() * 1000.0,
                };
                crate::pipeline::shadow::after_served(&self.pool, &self.req, &self.ctx, served);
                log.finish("ok", None);
                self.report_flags().await
            }
            Ending::ClientGone => {
                log.finish("cancelled", Some("client disconnected"));
                false
            }
            Ending::GiveUp(message) => {
                let why = format!("keel: {message}; the response is incomplete");
                let ev = GatewayError::new(ErrorKind::BadGateway, why).to_event(self.protocol);
                log.finish("incomplete", Some(&message));
                self.send(ev.raw).await
            }
        };
        let Relay { sink, attempts, .. } = self;
        // Every attempt is settled: the decision record is complete before the client sees
        // the end.
        drop(attempts);
        if ends_cleanly {
            sink.end().await;
        }
        summary
    }

    fn count_migration(&self, reason: &'static str, outcome: &'static str) {
        self.pool
            .metrics
            .counter(
                "keel_migrations_total",
                &[
                    ("pool", &self.pool.cfg.name),
                    ("reason", reason),
                    ("outcome", outcome),
                ],
            )
            .increment(1);
    }

    /// Retires `old` as `failure` and splices `next` in its place.
    async fn switch(
        &mut self,
        c: &mut Course,
        old: Segment,
        next: Segment,
        failure: AttemptFailure,
        mode: ResumeMode,
    ) -> ControlFlow<Ending, Segment> {
        let seam = Seam::new(&self.pool.variants[old.committed.vi].cfg.name, &failure);
        self.attempts
            .settle_end(old.committed, StreamEnd::Failed(failure));
        self.splice_or_settle(c, next, &seam, mode).await
    }

    /// Splices `next` in and relays it on; when the client is gone, `next` is settled and the
    /// relay ends.
    async fn splice_or_settle(
        &mut self,
        c: &mut Course,
        next: Segment,
        seam: &Seam,
        mode: ResumeMode,
    ) -> ControlFlow<Ending, Segment> {
        if self.splice(next.committed.vi, seam, mode, c).await {
            ControlFlow::Continue(next)
        } else {
            self.client_gone(next)
        }
    }

    /// Splices the continuation on variant `to` in: the note at the seam
    /// (`: keel migrated from=… to=… reason=… after_tokens=…`, with `silent_ms=…` for a stall),
    /// the request's route and variant, and the stitcher's new segment. False when the client
    /// is gone.
    async fn splice(&self, to: usize, seam: &Seam, mode: ResumeMode, c: &mut Course) -> bool {
        let Seam {
            from,
            reason,
            silent_ms,
            detail,
        } = seam;
        self.count_migration(reason, "ok");
        let to_vi = to;
        let to = self.pool.variants[to].cfg.name.clone();
        let silent = match silent_ms {
            Some(ms) => format!(" silent_ms={ms}"),
            None => String::new(),
        };
        let note = format!(
            "keel migrated from={from} to={to} reason={reason} after_tokens={}{silent}",
            c.stitcher.delivered_tokens()
        );
        tracing::info!(request_id = %self.ctx.id, pool = %self.pool.cfg.name, from = %from, to = %to, reason, detail, resume = ?mode, "migrated");
        if let Some(d) = self.attempts.decision() {
            d.note_migration(from, &to, reason, c.stitcher.delivered_tokens());
        }
        if !self.send(SseEvent::comment(&note)).await {
            return false;
        }
        c.log.route = "migrated";
        c.log.migrations += 1;
        c.log.serving(&self.pool.variants[to_vi].cfg);
        c.stitcher.begin_segment();
        c.trim = mode == ResumeMode::Instruction;
        true
    }

    /// Sends bytes of whole events to the sink; false when the client is gone (or, for keel's
    /// own notes and error events, when the assembler refused them).
    async fn send(&self, bytes: Vec<u8>) -> bool {
        matches!(self.deliver(bytes).await, Sent::Ok)
    }

    /// Sends bytes of whole events to the sink.
    async fn deliver(&self, bytes: Vec<u8>) -> Sent {
        if bytes.is_empty() {
            return Sent::Ok;
        }
        self.count_block();
        self.sink.send(self.protocol, bytes).await
    }

    /// Counts one block of events on its way to the sink (bytes sent, or events handed to the
    /// assembler as read), where the test hooks inject a failure.
    fn count_block(&self) {
        let sent = self.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        self.gw.hooks.before_send(sent);
    }
}

#[cfg(test)]
mod tests {
    /// The size of the value `f` returns, without calling it.
    fn returned_size<A, B, C, D, R>(_: impl FnOnce(A, B, C, D) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// Every live stream holds its relay's future: its size is memory per stream. The bound is
    /// the test profile's (unoptimized, larger than a release build's). It holds the stream's
    /// inter-token gaps inline, in fixed space (`keel_core::stream_watch::Gaps`).
    #[test]
    fn a_live_streams_relay_future_stays_small() {
        let size = returned_size(super::Relay::run);
        eprintln!("Relay::run's future: {size} bytes");
        assert!(size <= 3_328, "Relay::run's future is {size} bytes");
        // Allocated at each segment's end (every stream's, at least).
        let size = returned_size(super::Relay::after_segment);
        eprintln!("Relay::after_segment's future: {size} bytes");
        assert!(
            size <= 4_096,
            "Relay::after_segment's future is {size} bytes"
        );
    }
}
