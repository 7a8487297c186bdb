//! The IO pump of one segment, and what it does with each event: classify it, watch the gaps
//! between outputs, hold tool calls until complete, stitch, forward.

use std::time::Duration;

use tokio::time::Instant;

use keel_core::continuation::Stitcher;
use keel_core::outcome::AttemptFailure;
use keel_core::protocol::{event_role, EventRole};
use keel_core::sse::SseEvent;
use keel_core::stream_watch::{
    oversized_index, Hold, SlowRate, ToolCallHold, MAX_OUTPUT_INDEX, SLOW_CHECKS, SLOW_RATE,
};

use super::{Relay, Segment, SegmentEnd};
use crate::attempt::{next_events, ReadEnd};

/// Per-segment watch state.
struct Watch {
    last_output: Instant,
    hold: ToolCallHold,
    slow: Option<SlowRate>,
}

impl Relay {
    /// Relays one segment until it completes or fails.
    pub(super) async fn segment(
        &self,
        seg: &mut Segment,
        st: &mut Stitcher,
        trim: &mut bool,
        gaps: &mut Vec<f64>,
        slow_allowed: bool,
    ) -> SegmentEnd {
        let vi = seg.committed.vi;
        let stall = Duration::from_millis(self.pool.stall_threshold_ms(vi));
        let mut w = Watch {
            last_output: seg.start.first_token_at,
            hold: ToolCallHold::default(),
            slow: slow_allowed
                .then(|| self.pool.baseline_gap_ms(vi))
                .flatten()
                .map(SlowRate::new),
        };
        let start = &mut seg.start;
        for ev in std::mem::take(&mut start.head)
            .into_iter()
            .chain(std::mem::take(&mut start.pending))
        {
            if let Some(end) = self.handle(ev, st, trim, &mut w, gaps).await {
                return end;
            }
        }
        let mut events = Vec::new();
        loop {
            let stall_at = (w.last_output + stall).min(self.ctx.deadline);
            let read = tokio::select! {
                r = next_events(&mut start.upstream, &mut start.decoder, stall_at, &mut events) => r,
                _ = self.sink.closed() => return SegmentEnd::ClientGone,
            };
            match read {
                Ok(()) => {}
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
            for ev in std::mem::take(&mut events) {
                if let Some(end) = self.handle(ev, st, trim, &mut w, gaps).await {
                    return end;
                }
            }
        }
    }

    /// The per-event policy.
    async fn handle(
        &self,
        ev: SseEvent,
        st: &mut Stitcher,
        trim: &mut bool,
        w: &mut Watch,
        gaps: &mut Vec<f64>,
    ) -> Option<SegmentEnd> {
        let role = event_role(self.protocol, &ev);
        match role {
            EventRole::Malformed(m) => {
                return Some(SegmentEnd::Failed(AttemptFailure::Malformed(format!(
                    "malformed event: {m}"
                ))))
            }
            EventRole::Error(m) => return Some(SegmentEnd::Failed(AttemptFailure::ErrorEvent(m))),
            EventRole::Output => {
                let now = Instant::now();
                gaps.push(now.duration_since(w.last_output).as_secs_f64() * 1000.0);
                w.last_output = now;
                if w.slow.as_mut().is_some_and(|s| s.check(gaps)) {
                    return Some(SegmentEnd::Failed(AttemptFailure::Slow(format!(
                        "token rate below {:.0}% of the variant's baseline on {SLOW_CHECKS} checks in a row",
                        SLOW_RATE * 100.0
                    ))));
                }
            }
            _ => {}
        }
        if let Some(i) = oversized_index(self.protocol, &ev) {
            return Some(SegmentEnd::Failed(AttemptFailure::Malformed(format!(
                "an index of {i} (more than {MAX_OUTPUT_INDEX})"
            ))));
        }
        let terminal = role == EventRole::Terminal;
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
        for ev in release {
            if let Some(bytes) = st.process(&ev, trim) {
                if !self.send(bytes).await {
                    return Some(SegmentEnd::ClientGone);
                }
            }
        }
        terminal.then_some(SegmentEnd::Complete)
    }
}
