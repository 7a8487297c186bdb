//! The IO pump of one segment, and what it does with each event: classify it, watch the gaps
//! between outputs, hold tool calls until complete, stitch, forward.

use std::time::Duration;

use tokio::time::Instant;

use keel_core::continuation::Stitcher;
use keel_core::integrity::truncation::{Step, TruncationWatch};
use keel_core::outcome::AttemptFailure;
use keel_core::protocol::{event_role, EventRole};
use keel_core::sse::SseEvent;
use keel_core::stream_watch::{
    read_event_in, ChunkTemplate, EventFacts, Gaps, Hold, SlowRate, ToolCallHold, MAX_OUTPUT_INDEX,
    SLOW_RATE,
};

use super::{Relay, Segment, SegmentEnd, Sent};
use crate::pipeline::attempt::{ReadEnd, StreamStart};
use crate::pipeline::settlement::Committed;

/// Per-segment watch state; it lives as long as the segment, across pump calls.
pub(super) struct Watch {
    /// The last output of any kind (silence is measured from it).
    pub(super) last_output: Instant,
    /// The last event carrying tokens (gaps are measured between these; `None` until the
    /// segment's first).
    pub(super) last_token: Option<Instant>,
    hold: ToolCallHold,
    /// The shape of this segment's plain chunks, which are then read without parsing them.
    template: ChunkTemplate,
    pub(super) slow: Option<SlowRate>,
    slow_checked: bool,
    /// Gaps between outputs (from the first output on).
    pub(super) gaps: Gaps,
    /// Holds the stream's ending while it may be a stop for length (pools with
    /// `[pools.integrity]`; see `integrity`).
    pub(super) truncation: Option<TruncationWatch>,
    /// Tokens delivered before this segment began.
    pub(super) tokens_before: u64,
    /// A silence at the variant's adaptive stall threshold found nowhere to continue: from then
    /// on only the configured `stall_ms` of silence fails the segment (see
    /// `Relay::after_early_stall`).
    pub(super) patient: bool,
}

impl Segment {
    pub(super) fn new(committed: Committed, mut start: StreamStart) -> Segment {
        let template = std::mem::take(&mut start.template);
        Segment {
            watch: Watch {
                last_output: start.first_token_at,
                last_token: None,
                hold: ToolCallHold::default(),
                template,
                slow: None,
                slow_checked: false,
                gaps: Gaps::default(),
                truncation: None,
                tokens_before: 0,
                patient: false,
            },
            committed,
            start,
            raced: false,
        }
    }

    /// How long the stream has been silent.
    pub(super) fn silent_ms(&self) -> u64 {
        self.watch.last_output.elapsed().as_millis() as u64
    }
}

impl Relay {
    /// How long `seg` may go silent before it has stalled: its variant's adaptive threshold
    /// (see `Pool::stall_threshold_ms`), or the configured `stall_ms` once the segment is
    /// patient.
    fn stall_after(&self, seg: &Segment) -> Duration {
        Duration::from_millis(if seg.watch.patient {
            self.pool.cfg.timeouts.stall_ms
        } else {
            self.pool.stall_threshold_ms(seg.committed.vi)
        })
    }

    fn stall_failure(&self, seg: &Segment) -> SegmentEnd {
        SegmentEnd::Failed(AttemptFailure::Stall {
            silent_ms: seg.silent_ms(),
        })
    }

    /// Relays one segment until it completes or fails; with `quiet_ms`, returns
    /// [`SegmentEnd::Quiet`] once the stream has been silent that long (the caller may race a
    /// continuation, see `speculation`).
    pub(super) async fn segment(
        &self,
        seg: &mut Segment,
        st: &mut Stitcher,
        trim: &mut bool,
        slow_allowed: bool,
        quiet_ms: Option<u64>,
    ) -> SegmentEnd {
        let vi = seg.committed.vi;
        let stall = self.stall_after(seg);
        if !seg.watch.slow_checked {
            seg.watch.slow_checked = true;
            seg.watch.slow = slow_allowed
                .then(|| self.pool.baseline_gap_ms(vi))
                .flatten()
                .map(SlowRate::new);
            if self.integrity().is_some() {
                seg.watch.truncation = Some(TruncationWatch::new(self.protocol));
                seg.watch.tokens_before = st.delivered_tokens();
            }
        }
        let Segment { start, watch, .. } = seg;
        // One buffer of events for the whole segment: each read appends to it and
        // `handle_all` drains it, so its capacity is reused rather than grown anew per read.
        let mut events = std::mem::take(&mut start.pending);
        let read = std::mem::take(&mut start.read);
        let (batch, end) = self.handle_all(&mut events, read, st, trim, watch, start, vi);
        if let Some(end) = self.send_released(batch, end).await {
            return end;
        }
        loop {
            let stall_at = (watch.last_output + stall).min(self.ctx.deadline);
            // A held tool call is never raced: its events have not reached the client.
            let quiet_at = quiet_ms
                .filter(|_| !watch.hold.holding())
                .map(|ms| watch.last_output + Duration::from_millis(ms))
                .filter(|at| *at < stall_at);
            let read_until = quiet_at.unwrap_or(stall_at);
            let read = tokio::select! {
                r = start.source.next(read_until, &mut events) => r,
                _ = self.sink.closed() => return SegmentEnd::ClientGone,
            };
            match read {
                Ok(()) => {}
                Err(ReadEnd::Timeout) if quiet_at.is_some() => return SegmentEnd::Quiet,
                Err(ReadEnd::Timeout) if stall_at >= self.ctx.deadline => {
                    return SegmentEnd::Deadline
                }
                Err(ReadEnd::Timeout) => {
                    return SegmentEnd::Failed(AttemptFailure::Stall {
                        silent_ms: stall.as_millis() as u64,
                    })
                }
                Err(other) => {
                    return SegmentEnd::Failed(other.failure("before the stream was complete"))
                }
            }
            let (batch, end) = self.handle_all(&mut events, Vec::new(), st, trim, watch, start, vi);
            if let Some(end) = self.send_released(batch, end).await {
                return end;
            }
        }
    }

    /// Handles events in order until one ends the segment; the events after it are kept for
    /// the segment's next pump call (a slow stream that has nowhere to go goes on with them).
    /// `read` holds what was read already of the first events (see `StreamStart::read`).
    ///
    /// What the events of one upstream read release for the client goes out as one write
    /// (one body frame, one syscall) after the last of them, or before the segment ends (see
    /// [`Relay::send_released`]): the events are already here, so batching them delays
    /// nothing, and a write per event was a fifth of keel's CPU per stream. Not async: what it
    /// holds while it works is not kept in every live stream's future.
    #[allow(clippy::too_many_arguments)]
    fn handle_all(
        &self,
        events: &mut Vec<SseEvent>,
        read: Vec<EventFacts<'static>>,
        st: &mut Stitcher,
        trim: &mut bool,
        watch: &mut Watch,
        start: &mut StreamStart,
        vi: usize,
    ) -> (Vec<u8>, Option<SegmentEnd>) {
        let mut batch = Vec::with_capacity(events.iter().map(|e| e.raw.len()).sum());
        // The events of one read arrived together: one clock reading stamps them all.
        let now = Instant::now();
        let mut read = read.into_iter();
        let mut events = events.drain(..);
        while let Some(ev) = events.next() {
            let end = self.handle(ev, read.next(), now, st, trim, watch, vi, &mut batch);
            if end.is_some() {
                start.pending.extend(events.by_ref());
                return (batch, end);
            }
        }
        (batch, None)
    }

    /// Sends what [`Relay::handle_all`] released; everything released before the segment
    /// ended reaches the client first.
    async fn send_released(&self, batch: Vec<u8>, end: Option<SegmentEnd>) -> Option<SegmentEnd> {
        match self.deliver(batch).await {
            Sent::Ok => end,
            Sent::ClientGone => Some(SegmentEnd::ClientGone),
            Sent::Refused(e) => Some(SegmentEnd::Failed(AttemptFailure::Malformed(e.message))),
        }
    }

    /// While a continuation races a quiet segment: waits for the segment's next event that
    /// matters (output, its end, an error) without forwarding anything, so that dropping this
    /// future (the continuation won) loses nothing and sends nothing. Returns `Resumed` with the
    /// events kept for the pump, or how the segment ended.
    pub(super) async fn wait_for_more(&self, seg: &mut Segment) -> SegmentEnd {
        let stall = self.stall_after(seg);
        let mut events = Vec::new();
        loop {
            let stall_at = (seg.watch.last_output + stall).min(self.ctx.deadline);
            let read = tokio::select! {
                r = seg.start.source.next(stall_at, &mut events) => r,
                _ = self.sink.closed() => return SegmentEnd::ClientGone,
            };
            match read {
                Ok(()) => {}
                Err(ReadEnd::Timeout) if stall_at >= self.ctx.deadline => {
                    return SegmentEnd::Deadline
                }
                Err(ReadEnd::Timeout) => return self.stall_failure(seg),
                Err(other) => {
                    return SegmentEnd::Failed(other.failure("before the stream was complete"))
                }
            }
            let matters = events.iter().any(|ev| {
                !matches!(
                    event_role(self.protocol, ev),
                    EventRole::KeepAlive | EventRole::Preamble
                )
            });
            seg.start.pending.append(&mut events);
            if matters {
                return SegmentEnd::Resumed;
            }
        }
    }

    /// The per-event policy; what the event releases for the client is appended to `batch`.
    /// `read`: what was read of it already, if anything; `now`: when it was read.
    #[allow(clippy::too_many_arguments)]
    fn handle(
        &self,
        ev: SseEvent,
        read: Option<EventFacts<'static>>,
        now: Instant,
        st: &mut Stitcher,
        trim: &mut bool,
        w: &mut Watch,
        vi: usize,
        batch: &mut Vec<u8>,
    ) -> Option<SegmentEnd> {
        // Each event is read once; the meter, the gap watch and the stitcher share what was read.
        let EventFacts {
            role,
            tokens,
            text,
            plain,
            oversized,
            starts_call,
        } = match read {
            Some(facts) => facts,
            None => read_event_in(self.protocol, &ev, &mut w.template),
        };
        // The request's usage, per attempt: the access log's and the trace's tokens, and a
        // keyed request's reconciliation (see `keys`).
        self.ctx
            .meter
            .event(&self.pool.variants[vi].cfg, &ev, tokens, plain);
        // Checked now, acted on once this event is forwarded: whether the stream moves or
        // goes on where it is, its text reaches the client exactly once. When slow: the tokens
        // over which it was found so.
        let mut slow = None;
        match role {
            EventRole::Malformed(m) => {
                return Some(SegmentEnd::Failed(AttemptFailure::Malformed(format!(
                    "malformed event: {m}"
                ))))
            }
            EventRole::Error(m) => return Some(SegmentEnd::Failed(AttemptFailure::ErrorEvent(m))),
            EventRole::Output => {
                w.last_output = now;
                if !tokens {
                    // A finish or usage chunk: no gap to measure.
                } else if let Some(last) = w.last_token.replace(now) {
                    w.gaps.push(now.duration_since(last).as_secs_f64() * 1000.0);
                    slow = w
                        .slow
                        .as_mut()
                        .and_then(|s| s.check(&w.gaps).then(|| s.slow_tokens()));
                }
            }
            _ => {}
        }
        if let Some(i) = oversized {
            return Some(SegmentEnd::Failed(AttemptFailure::Malformed(format!(
                "an index of {i} (more than {MAX_OUTPUT_INDEX})"
            ))));
        }
        let terminal = role == EventRole::Terminal;
        // The common case, an event the tool-call hold would pass through (no call being held,
        // and this event starts none) and no integrity checks: the event goes straight into the
        // batch, stitched with what was read of it above.
        let passes_hold = !self.pool.cfg.hold_tool_calls || w.hold.passes_read(starts_call);
        if passes_hold && w.truncation.is_none() {
            let mark = batch.len();
            st.process_known(&ev, text.as_deref(), trim, batch);
            // A non-streaming client's first segment: the event, as read above, goes straight
            // into the assembler (bytes the stitcher passed through unchanged, which decoding and
            // reading them again would only reproduce). Continuations' rewritten bytes, and
            // anything already in the batch, keep the byte path, in order.
            if let Some(a) = self
                .sink
                .assembler()
                .filter(|_| st.segment == 0 && mark == 0)
            {
                batch.truncate(mark);
                self.count_block();
                let mut a = a.lock().unwrap_or_else(|e| e.into_inner());
                let pushed = a.body.push_read(self.protocol, &ev, plain, text.as_deref());
                if let Err(m) = pushed {
                    return Some(SegmentEnd::Failed(AttemptFailure::Malformed(m)));
                }
            }
            return self.after_forwarding(slow, terminal);
        }
        // What was read of the event borrows it; from here on the event itself moves.
        drop(text);
        let release = if self.pool.cfg.hold_tool_calls {
            match w.hold.push(
                self.protocol,
                ev,
                terminal,
                self.pool.limits.max_event_bytes,
            ) {
                Hold::Pass(ev) => vec![ev],
                Hold::Held => return None,
                Hold::Release(evs) => evs,
                Hold::Overflow => {
                    return Some(SegmentEnd::Failed(AttemptFailure::Malformed(format!(
                        "a tool call held more than {} bytes without completing",
                        self.pool.limits.max_event_bytes
                    ))))
                }
            }
        } else {
            vec![ev]
        };
        // Only pools with integrity checks look for a stop for length (see `integrity`).
        let out = match w.truncation.as_mut() {
            None => release,
            Some(t) => {
                let last = release.len().saturating_sub(1);
                let mut out = Vec::with_capacity(release.len());
                for (i, ev) in release.into_iter().enumerate() {
                    match t.push(ev, terminal && i == last) {
                        Step::Pass(evs) => out.extend(evs),
                        Step::Held => {}
                        Step::LengthStop(held) => {
                            // What came before the stop reaches the client (with the batch).
                            for ev in &out {
                                st.process_into(ev, trim, batch);
                            }
                            return Some(SegmentEnd::LengthStop(held));
                        }
                    }
                }
                out
            }
        };
        for ev in &out {
            st.process_into(ev, trim, batch);
        }
        self.after_forwarding(slow, terminal)
    }

    /// How the segment goes on once an event's bytes are in the batch: a slowdown seen on it
    /// moves the stream, its terminal event completes the segment.
    fn after_forwarding(&self, slow: Option<usize>, terminal: bool) -> Option<SegmentEnd> {
        if let Some(tokens) = slow {
            return Some(SegmentEnd::Failed(AttemptFailure::Slow(format!(
                "token rate below {:.0}% of the variant's baseline over the last {tokens} tokens",
                SLOW_RATE * 100.0
            ))));
        }
        terminal.then_some(SegmentEnd::Complete)
    }
}
