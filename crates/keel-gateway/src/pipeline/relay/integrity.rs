//! Output integrity after the commit point (a pool's `[pools.integrity]`, see
//! `keel_core::integrity` for the definitions).
//!
//! * **Truncation.** The segment pump holds a stream's ending while it may be a stop for
//!   length (`keel_core::integrity::truncation`). When the answer was cut below the client's
//!   own limit and `auto_continue` allows, the segment is settled as complete (its variant did
//!   nothing wrong), and the answer is continued on the same or another variant (the plan's
//!   in order, the serving one included, then the pool's others) exactly as a
//!   migration continues one (`migration`: a continuation attempt through settlement, within
//!   the deadline and the retry budget), after the note `: keel continued from=… to=…
//!   reason=truncated after_tokens=…`; the route becomes `continued`. Otherwise the held ending
//!   goes out unchanged and the answer is flagged `truncated`.
//! * **JSON.** When the answer is complete and a `json_object` / `json_schema` answer was
//!   asked for, its text is checked. A whole response (assembled here) that fails is retried
//!   once with `json_retry` (a new attempt through settlement, the plan's variants in order;
//!   the failed answer is discarded only once the retry has its first token). A stream's text
//!   has reached the client already: it is only flagged.
//!
//! Flags reach the client as `x-keel-integrity` on a whole response, and as an SSE comment
//! `: keel integrity=<flag>` after a stream's terminal event (the last bytes of its body); both
//! are in the decision record and `keel_integrity_total`.

use crate::observe::record::AttemptKind;
use keel_core::continuation::{ResumeMode, Stitcher};
use keel_core::integrity::{self, json, truncation, Flag};
use keel_core::members::Members;
use keel_core::sse::SseEvent;
use tokio::time::Instant;

use super::{Course, Relay, Segment, Sink};
use crate::config::IntegrityConfig;
use crate::observe::access_log::RequestLog;
use crate::pipeline::attempt::attempt;
use crate::pipeline::settlement::Refused;

/// What the relay has done about integrity so far for one request.
#[derive(Debug, Default)]
pub struct State {
    pub continuations: u32,
    pub json_retried: bool,
    /// Flags of the answer as delivered.
    pub flags: Vec<Flag>,
}

/// What a segment that stopped for length had said about its output.
pub(super) struct LengthStop {
    /// The output tokens its upstream reported.
    pub(super) reported: Option<u64>,
    /// Tokens delivered before it.
    pub(super) tokens_before: u64,
    /// It carried a tool call.
    pub(super) tool_call: bool,
}

/// How a segment that stopped for length went on.
pub(super) enum AfterLength {
    /// A continuation has its first token: relay it next.
    Continued(Box<Segment>),
    /// The ending went out: the answer is complete.
    Ended,
    ClientGone,
}

impl Relay {
    pub(super) fn integrity(&self) -> Option<IntegrityConfig> {
        self.pool.cfg.integrity
    }

    /// Counts one integrity event (`issue`: truncated, invalid_json; `action`: continued,
    /// retried, flagged).
    fn count_integrity(&self, issue: Flag, action: &'static str) {
        self.pool
            .metrics
            .counter(
                "keel_integrity_total",
                &[
                    ("pool", &self.pool.cfg.name),
                    ("issue", issue.as_str()),
                    ("action", action),
                ],
            )
            .increment(1);
        if let Some(d) = self.attempts.decision() {
            let note = format!("{}:{action}", issue.as_str());
            d.update(|r| r.integrity.push(note));
        }
    }

    /// A segment (`from`, already settled) ended for length with `held` as its ending.
    pub(super) async fn after_length_stop(
        &mut self,
        from: usize,
        held: Vec<SseEvent>,
        stop: LengthStop,
        c: &mut Course,
    ) -> AfterLength {
        let LengthStop {
            reported,
            tokens_before,
            tool_call,
        } = stop;
        let Course {
            stitcher,
            trim,
            log,
            ..
        } = c;
        let generated = reported.map_or(stitcher.delivered_tokens(), |r| tokens_before + r);
        let limit = integrity::client_output_limit(&self.req.body);
        let truncated = integrity::below_client_limit(limit, generated);
        let cfg = self.integrity().unwrap_or_default();
        // A closing chunk that carries text (no known server sends one) would have to be
        // split around the continuation: such an answer is only flagged.
        let may_continue = truncated
            && cfg.auto_continue
            && !tool_call
            && truncation::text_of_ending(self.protocol, &held).is_empty()
            && !self.pool.safety.active()
            && self.integrity_state.continuations < cfg.max_continuations
            && Instant::now() < self.ctx.deadline;
        if may_continue {
            // Any variant may continue, the one that cut the answer included: the plan's in
            // order (the serving one is usually its first), then the pool's others.
            let mut tried = Vec::new();
            if let Ok((next, mode)) = self.migrate(stitcher, &mut tried, false).await {
                self.integrity_state.continuations += 1;
                let to = next.committed.vi;
                if !self
                    .seam_continued(from, to, mode, stitcher, trim, log)
                    .await
                {
                    self.attempts.settle_end(
                        next.committed,
                        crate::pipeline::settlement::StreamEnd::ClientGone,
                    );
                    return AfterLength::ClientGone;
                }
                return AfterLength::Continued(next);
            }
        }
        if truncated {
            self.count_integrity(Flag::Truncated, "flagged");
            self.integrity_state.flags.push(Flag::Truncated);
        }
        if self.forward(held, stitcher, trim).await {
            AfterLength::Ended
        } else {
            AfterLength::ClientGone
        }
    }

    /// Forwards events through the stitcher; false when the client is gone.
    async fn forward(
        &self,
        events: Vec<SseEvent>,
        stitcher: &mut Stitcher,
        trim: &mut bool,
    ) -> bool {
        for ev in events {
            if let Some(bytes) = stitcher.process(&ev, trim) {
                if !self.send(bytes).await {
                    return false;
                }
            }
        }
        true
    }

    /// The seam of a continuation for truncation: its note, the route, the stitcher's new
    /// segment. False when the client is gone.
    async fn seam_continued(
        &self,
        from: usize,
        to: usize,
        mode: ResumeMode,
        stitcher: &mut Stitcher,
        trim: &mut bool,
        log: &mut RequestLog,
    ) -> bool {
        let name = |i: usize| self.pool.variants[i].cfg.name.clone();
        let (from, to_name) = (name(from), name(to));
        let after = stitcher.delivered_tokens();
        self.count_integrity(Flag::Truncated, "continued");
        if let Some(d) = self.attempts.decision() {
            d.note_migration(&from, &to_name, "truncated", after);
        }
        let note = format!(
            "keel continued from={from} to={to_name} reason=truncated after_tokens={after}"
        );
        if !self.send(SseEvent::comment(&note)).await {
            return false;
        }
        log.route = "continued";
        log.serving(&self.pool.variants[to].cfg);
        stitcher.begin_segment();
        *trim = mode == ResumeMode::Instruction;
        true
    }

    /// A complete answer's JSON check: the retry's first segment when a whole answer failed
    /// and `json_retry` allows one (the assembled answer is then discarded), else `None` (a
    /// failure is flagged).
    pub(super) async fn check_json(
        &mut self,
        stitcher: &Stitcher,
        log: &mut RequestLog,
    ) -> Option<Segment> {
        let cfg = self.integrity()?;
        let expected = json::expected(&self.req.body)?;
        if json::check(&stitcher.delivered, &expected).is_ok() {
            return None;
        }
        let assembled = match &self.sink {
            Sink::Assemble(a) => Some(a.clone()),
            // A streamed answer (cached or not) has reached the client: flagged, not retried.
            Sink::Client(_) | Sink::Tee { .. } | Sink::Shared { .. } => None,
        };
        let allowed =
            cfg.json_retry && !self.integrity_state.json_retried && !self.pool.safety.active();
        if let (true, Some(assembled)) = (allowed, assembled) {
            self.integrity_state.json_retried = true;
            if let Some(next) = self.retry_whole().await {
                self.count_integrity(Flag::InvalidJson, "retried");
                *assembled.lock().unwrap_or_else(|e| e.into_inner()) = Default::default();
                log.route = "fallback";
                log.serving(&self.pool.variants[next.committed.vi].cfg);
                return Some(next);
            }
        }
        self.count_integrity(Flag::InvalidJson, "flagged");
        self.integrity_state.flags.push(Flag::InvalidJson);
        None
    }

    /// The request again, from the start, on the plan's variants in order until one has its
    /// first token (each attempt enters and is settled through `settlement`).
    async fn retry_whole(&mut self) -> Option<Segment> {
        let mut ctx = self.ctx.clone();
        ctx.client_stream = true;
        for vi in self.order.clone() {
            if Instant::now() >= ctx.deadline {
                return None;
            }
            let entered = match self
                .attempts
                .enter(vi, AttemptKind::Fallback, ctx.deadline)
                .await
            {
                Ok(e) => e,
                Err(Refused::Budget) => return None,
                Err(_) => continue,
            };
            let tp = entered.traceparent();
            let result = attempt(&self.pool, vi, &self.req, &ctx, tp).await;
            if let Ok(seg) = self.conclude(entered, result) {
                return Some(seg);
            }
        }
        None
    }

    /// Reports the flags after a stream's terminal event (`: keel integrity=…`); false when the client
    /// is gone. A whole response carries them in `x-keel-integrity` instead.
    pub(super) async fn report_flags(&self) -> bool {
        if matches!(self.sink, Sink::Assemble(_)) {
            return true;
        }
        for f in &self.integrity_state.flags {
            let note = format!("keel integrity={}", f.as_str());
            if !self.send(SseEvent::comment(&note)).await {
                return false;
            }
        }
        true
    }
}

/// The flags of a whole answer an upstream gave as one body (not relayed: nothing can be
/// repaired, only reported).
pub fn whole_flags(
    cfg: Option<IntegrityConfig>,
    req: &keel_core::request::CanonicalRequest,
    body: &[u8],
) -> Vec<&'static str> {
    if cfg.is_none() {
        return Vec::new();
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Vec::new();
    };
    let mut flags = Vec::new();
    let length_stop = v
        .pointer("/choices/0/finish_reason")
        .and_then(|r| r.as_str())
        == Some("length")
        || v.member("stop_reason").and_then(|r| r.as_str()) == Some("max_tokens");
    let generated = v
        .pointer("/usage/completion_tokens")
        .or_else(|| v.pointer("/usage/output_tokens"))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    let limit = integrity::client_output_limit(&req.body);
    if length_stop && integrity::below_client_limit(limit, generated) {
        flags.push(Flag::Truncated.as_str());
    }
    if let (Some(expected), Some(text)) = (json::expected(&req.body), json::answer_text(&v)) {
        if json::check(text, &expected).is_err() {
            flags.push(Flag::InvalidJson.as_str());
        }
    }
    flags
}
