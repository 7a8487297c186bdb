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
//!   When nothing can continue, the stream ends with an explicit error event.
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
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use keel_core::continuation::{ResumeMode, Stitcher};
use keel_core::outcome::AttemptFailure;
use keel_core::protocol::{stream_error_event, ErrorKind, Protocol};
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

impl Relay {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gw: &Arc<Gateway>,
        sink: Sink,
        protocol: Protocol,
        pool: &Arc<Pool>,
        req: CanonicalRequest,
        ctx: &RequestCtx,
        order: Vec<usize>,
        attempts: Attempts,
    ) -> Relay {
        Relay {
            gw: gw.clone(),
            sink,
            protocol,
            pool: pool.clone(),
            req,
            ctx: ctx.clone(),
            order,
            attempts,
            sent: AtomicUsize::new(0),
            integrity_state: integrity::State::default(),
        }
    }

    /// Relays the committed stream to its end, migrating as needed, and accounts for it.
    ///
    /// This future lives as long as its stream, so its size is memory every live stream holds
    /// (3.6 KB; `cargo +nightly rustc -p keel-gateway --lib -- -Zprint-type-sizes` prints it).
    /// The rare branches (a race, a migration, a splice, a JSON retry, a length stop, the
    /// ending) are awaited boxed, and so is a migration's next segment: a future's state is as
    /// large as its largest await plus what is held across any await. Inline they made every
    /// live stream carry 13.4 KB, then 6.8 KB (bench/history/2026-12-01-overhead-stops-1-5.md).
    /// They allocate only when taken.
    pub fn run(
        mut self,
        committed: Committed,
        start: StreamStart,
        mut log: RequestLog,
    ) -> impl Future<Output = Summary> + Send {
        let mut stitcher = Stitcher::new(self.protocol);
        let mut tried = vec![committed.vi];
        let mut seg = Segment::new(committed, start);
        // The state is made here and captured by the async block, not passed to an async fn:
        // an async fn keeps its by-value arguments twice in its state (as arguments, and as the
        // locals they are moved into), ≈ 1.9 KB more for every live stream.
        async move {
            // Migrations for failures (stall, error) and for slowness are counted apart, so that
            // slowness never spends what a failure needs (see MAX_SLOW_MIGRATIONS).
            let (mut migrations, mut slow_migrations) = (0u32, 0u32);
            let mut trim = false;
            let ending = loop {
                // Read at each turn: a pool that enters safe mode mid-stream stops migrating.
                let max_migrations = self.pool.max_migrations();
                // Slowness alone is only worth a migration when there is somewhere to go: a slow
                // stream beats an error. The same goes for racing a quiet stream.
                let now = self.pool.now_ms();
                let elsewhere = self
                    .order
                    .iter()
                    .any(|i| !tried.contains(i) && self.pool.can_take(*i, now));
                let slow_allowed =
                    elsewhere && max_migrations > 0 && slow_migrations < MAX_SLOW_MIGRATIONS;
                let quiet = (elsewhere && migrations < max_migrations && !seg.raced)
                    .then(|| self.pool.quiet_threshold_ms(seg.committed.vi))
                    .flatten();
                let mut end = self
                    .segment(&mut seg, &mut stitcher, &mut trim, slow_allowed, quiet)
                    .await;
                if let SegmentEnd::Quiet = end {
                    seg.raced = true;
                    let silent_ms = seg.silent_ms();
                    let (next, mode, failure) =
                        match Box::pin(self.speculate(&mut seg, &stitcher, &mut tried)).await {
                            Speculated::NotRaced | Speculated::Resumed => continue,
                            Speculated::Ended(e) => {
                                end = e;
                                (None, ResumeMode::None, None)
                            }
                            Speculated::Won(next, mode) => {
                                (Some(next), mode, Some(AttemptFailure::Stall { silent_ms }))
                            }
                            Speculated::Rescued(f, next, mode) => (Some(next), mode, Some(f)),
                        };
                    if let (Some(next), Some(failure)) = (next, failure) {
                        // The race was won elsewhere: the original is retired as stalled (or as
                        // the failure it met meanwhile) and the continuation spliced in.
                        let seam =
                            Seam::new(&self.pool.variants[seg.committed.vi].cfg.name, &failure);
                        migrations += 1;
                        let spliced = Box::pin(self.switch(
                            &mut seg,
                            next,
                            failure,
                            &seam,
                            mode,
                            &mut stitcher,
                            &mut trim,
                            &mut log,
                        ))
                        .await;
                        if !spliced {
                            self.attempts
                                .settle_end(seg.committed, StreamEnd::ClientGone);
                            break Ending::ClientGone;
                        }
                        continue;
                    }
                }
                let failure = match end {
                    SegmentEnd::Complete => {
                        seg.start.source.reached_end();
                        let gaps_ms = std::mem::take(&mut seg.watch.gaps);
                        self.attempts
                            .settle_end(seg.committed, StreamEnd::Complete { gaps_ms });
                        if let Some(retry) = Box::pin(self.check_json(&stitcher, &mut log)).await {
                            // A whole answer that is not the JSON asked for: once more, afresh.
                            tried = vec![retry.committed.vi];
                            seg = retry;
                            stitcher = Stitcher::new(self.protocol);
                            trim = false;
                            continue;
                        }
                        break Ending::Complete;
                    }
                    SegmentEnd::LengthStop(held) => {
                        seg.start.source.reached_end();
                        let from = seg.committed.vi;
                        let truncation = seg.watch.truncation.take();
                        let facts = (
                            truncation.as_ref().and_then(|t| t.reported_output()),
                            seg.watch.tokens_before,
                            truncation.as_ref().is_some_and(|t| t.saw_tool_call()),
                        );
                        let gaps_ms = std::mem::take(&mut seg.watch.gaps);
                        self.attempts
                            .settle_end(seg.committed, StreamEnd::Complete { gaps_ms });
                        match Box::pin(self.after_length_stop(
                            from,
                            held,
                            facts,
                            &mut stitcher,
                            &mut trim,
                            &mut log,
                        ))
                        .await
                        {
                            integrity::AfterLength::Continued(next) => {
                                seg = *next;
                                continue;
                            }
                            integrity::AfterLength::ClientGone => break Ending::ClientGone,
                            integrity::AfterLength::Ended => {
                                if let Some(retry) =
                                    Box::pin(self.check_json(&stitcher, &mut log)).await
                                {
                                    tried = vec![retry.committed.vi];
                                    seg = retry;
                                    stitcher = Stitcher::new(self.protocol);
                                    trim = false;
                                    continue;
                                }
                                break Ending::Complete;
                            }
                        }
                    }
                    SegmentEnd::ClientGone => {
                        self.attempts
                            .settle_end(seg.committed, StreamEnd::ClientGone);
                        break Ending::ClientGone;
                    }
                    SegmentEnd::Deadline => {
                        self.attempts.settle_end(seg.committed, StreamEnd::Deadline);
                        break Ending::GiveUp("the request's total deadline was reached".into());
                    }
                    SegmentEnd::Failed(f) => f,
                    // Only a speculation sees these, and it has turned them into one of the above.
                    SegmentEnd::Quiet | SegmentEnd::Resumed => continue,
                };
                let seam = Seam::new(&self.pool.variants[seg.committed.vi].cfg.name, &failure);
                // Slowness was only detected while a slow migration was allowed.
                let slow = matches!(failure, AttemptFailure::Slow(_));
                if slow {
                    // A slow stream is still a stream: it is retired only once a continuation
                    // has its first token; if none can be had, it goes on where it is.
                    match Box::pin(self.migrate(&stitcher, &mut tried, false)).await {
                        Ok((next, mode)) => {
                            slow_migrations += 1;
                            let spliced = Box::pin(self.switch(
                                &mut seg,
                                next,
                                failure,
                                &seam,
                                mode,
                                &mut stitcher,
                                &mut trim,
                                &mut log,
                            ))
                            .await;
                            if !spliced {
                                self.attempts
                                    .settle_end(seg.committed, StreamEnd::ClientGone);
                                break Ending::ClientGone;
                            }
                        }
                        Err(_) => {
                            self.count_migration(seam.reason, "failed");
                            slow_migrations = MAX_SLOW_MIGRATIONS;
                            seg.watch.slow = None;
                            // The time spent looking elsewhere was not the stream's silence.
                            seg.watch.last_output = tokio::time::Instant::now();
                            seg.watch.last_token = None;
                        }
                    }
                    continue;
                }
                self.attempts
                    .settle_end(seg.committed, StreamEnd::Failed(failure));
                if self.pool.safety.active() {
                    break Ending::GiveUp(format!(
                        "{}; pool `{}` is in safe mode (no migration)",
                        seam.detail, self.pool.cfg.name
                    ));
                }
                if migrations >= max_migrations {
                    break Ending::GiveUp(format!(
                        "{}; no migration left (max_migrations = {max_migrations})",
                        seam.detail
                    ));
                }
                match Box::pin(self.migrate(&stitcher, &mut tried, true)).await {
                    Ok((next, mode)) => {
                        migrations += 1;
                        seg = *next;
                        let to = seg.committed.vi;
                        let spliced = Box::pin(self.splice(
                            to,
                            &seam,
                            mode,
                            &mut stitcher,
                            &mut trim,
                            &mut log,
                        ))
                        .await;
                        if !spliced {
                            self.attempts
                                .settle_end(seg.committed, StreamEnd::ClientGone);
                            break Ending::ClientGone;
                        }
                    }
                    Err(why) => {
                        self.count_migration(seam.reason, "failed");
                        break Ending::GiveUp(format!(
                            "{}; migration impossible: {why}",
                            seam.detail
                        ));
                    }
                }
            };
            // The ending runs boxed: its locals would otherwise take room in this future's
            // state, which every live stream holds (see `close`).
            Box::pin(self.close(ending, stitcher, log)).await
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
                let ev = stream_error_event(
                    self.protocol,
                    ErrorKind::BadGateway,
                    &format!("keel: {message}; the response is incomplete"),
                );
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

    /// Retires `seg` as `failure` and splices `next` in its place; false when the client is
    /// gone (the new segment is then the caller's to settle).
    #[allow(clippy::too_many_arguments)]
    async fn switch(
        &mut self,
        seg: &mut Segment,
        next: Box<Segment>,
        failure: AttemptFailure,
        seam: &Seam,
        mode: ResumeMode,
        stitcher: &mut Stitcher,
        trim: &mut bool,
        log: &mut RequestLog,
    ) -> bool {
        let old = std::mem::replace(seg, *next);
        self.attempts
            .settle_end(old.committed, StreamEnd::Failed(failure));
        let to = seg.committed.vi;
        self.splice(to, seam, mode, stitcher, trim, log).await
    }

    /// Splices the continuation on variant `to` in: the note at the seam
    /// (`: keel migrated from=… to=… reason=… after_tokens=…`, with `silent_ms=…` for a stall),
    /// the request's route and variant, and the stitcher's new segment. False when the client
    /// is gone.
    async fn splice(
        &self,
        to: usize,
        seam: &Seam,
        mode: ResumeMode,
        stitcher: &mut Stitcher,
        trim: &mut bool,
        log: &mut RequestLog,
    ) -> bool {
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
            stitcher.delivered_tokens()
        );
        tracing::info!(request_id = %self.ctx.id, pool = %self.pool.cfg.name, from = %from, to = %to, reason, detail, resume = ?mode, "migrated");
        if let Some(d) = self.attempts.decision() {
            d.note_migration(from, &to, reason, stitcher.delivered_tokens());
        }
        if !self.send(SseEvent::comment(&note)).await {
            return false;
        }
        log.route = "migrated";
        log.migrations += 1;
        log.serving(&self.pool.variants[to_vi].cfg);
        stitcher.begin_segment();
        *trim = mode == ResumeMode::Instruction;
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
