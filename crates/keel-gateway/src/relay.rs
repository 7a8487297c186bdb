//! After the commit point: relaying a stream to the client, detecting when its upstream fails,
//! and migrating the rest of the generation to another variant.
//!
//! Events are forwarded one whole event at a time (never a partial one), through a
//! [`Stitcher`] that keeps the client's stream one response. The relay watches each segment:
//!
//! * **stall**: no output for the stall threshold (adaptive per variant: max(4 × its P99-ish
//!   inter-token gap, 500 ms), capped by `stall_ms`);
//! * **slow**: the mean gap of the last 10 tokens more than 1/0.6 of the variant's baseline on three
//!   checks in a row (a token rate 40% below normal);
//! * **error**: the connection breaks or closes before the terminal event, a malformed event,
//!   or an error event from the upstream.
//!
//! On any of these, while `max_migrations` allows, the relay builds a continuation request from
//! the text already delivered for the next variant in the plan (by its `resume` mode), sends it
//! with the first-token deadline, and splices its stream in after an SSE comment
//! `: keel migrated from=<a> to=<b> reason=<stall|slow|error> after_tokens=<n>`. A continuation
//! the next variant rejects (a 400 for prefill, say) falls through to the following variant. When
//! nothing can continue, the stream ends with an explicit error event, never a clean end.
//!
//! Tool calls (with `hold_tool_calls`, the default) are held back until each call is complete,
//! so a migration never leaves half a call on the client's side: the cost is that a call's
//! argument deltas reach the client together, when the call ends, instead of as generated.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::{timeout_at, Instant};

use keel_core::continuation::{continuation, ResumeMode, Stitcher};
use keel_core::protocol::{
    event_role, stream_error_event, ChunkView, ErrorKind, EventRole, Protocol,
};
use keel_core::request::CanonicalRequest;
use keel_core::sse::SseEvent;

use crate::delivery::RequestLog;
use crate::execution::{attempt, AttemptResult, RequestCtx, Served, StreamStart};
use crate::pools::{InFlight, Pool};

/// Consecutive slow checks (of 10 tokens each) that count as a slowdown.
const SLOW_CHECKS: u32 = 3;
/// A token rate this far below the baseline is slow (40% below).
const SLOW_RATE: f64 = 0.6;

/// Where relayed events go.
pub enum Sink {
    /// The client's streamed response body.
    Client(mpsc::Sender<Bytes>),
    /// Assembled in place into one non-streaming body (no channel, no extra task).
    Assemble(Arc<std::sync::Mutex<Assembled>>),
}

/// A non-streaming response being assembled from the relayed events.
#[derive(Default)]
pub struct Assembled {
    pub decoder: keel_core::sse::SseDecoder,
    pub body: keel_core::assemble::Assembler,
    /// The error the relay ended with, if any.
    pub failure: Option<String>,
}

impl Sink {
    async fn send(&self, protocol: Protocol, bytes: Vec<u8>) -> bool {
        match self {
            Sink::Client(tx) => bytes.is_empty() || tx.send(Bytes::from(bytes)).await.is_ok(),
            Sink::Assemble(a) => {
                let mut a = a.lock().unwrap_or_else(|e| e.into_inner());
                let mut events = Vec::new();
                let _ = a.decoder.feed(&bytes, &mut events);
                for ev in &events {
                    match event_role(protocol, ev) {
                        EventRole::Error(m) => a.failure = Some(m),
                        _ => {
                            if let Err(m) = a.body.push(protocol, ev) {
                                a.failure = Some(m);
                            }
                        }
                    }
                }
                true
            }
        }
    }

    async fn closed(&self) {
        match self {
            Sink::Client(tx) => tx.closed().await,
            Sink::Assemble(_) => std::future::pending().await,
        }
    }
}

/// Everything needed to relay a stream and continue it elsewhere.
pub struct Relay {
    pub sink: Sink,
    pub protocol: Protocol,
    pub pool: Arc<Pool>,
    pub req: CanonicalRequest,
    pub ctx: RequestCtx,
    /// The plan: candidates for continuations, in order.
    pub order: Vec<usize>,
}

/// How one segment ended.
enum SegmentEnd {
    Complete,
    ClientGone,
    /// The upstream failed; `reason` is `stall`, `slow` or `error`.
    Failed {
        reason: &'static str,
        message: String,
    },
    /// The request's total deadline: no migration can help.
    Deadline,
}

/// What the client's headers would say about a relayed response, known once it has ended.
#[derive(Debug, Clone)]
pub struct Summary {
    pub route: &'static str,
    pub variant: String,
    pub attempts: usize,
}

/// One segment being relayed.
struct Segment {
    vi: usize,
    start: StreamStart,
    _guard: InFlight,
}

impl Relay {
    async fn send(&self, bytes: Vec<u8>) -> bool {
        self.sink.send(self.protocol, bytes).await
    }

    /// Relays the committed stream to its end, migrating as needed, and accounts for it.
    pub async fn run(
        self,
        vi: usize,
        start: StreamStart,
        guard: InFlight,
        mut log: RequestLog,
    ) -> Summary {
        let mut stitcher = Stitcher::new(self.protocol);
        let mut seg = Segment {
            vi,
            start,
            _guard: guard,
        };
        let mut tried = vec![vi];
        let mut migrations = 0u32;
        let mut trim = false;
        let end = loop {
            let mut gaps = Vec::new();
            // Slowness alone is only worth a migration when there is somewhere to go: a slow
            // stream beats an error.
            let now = self.pool.now_ms();
            let slow_allowed = migrations < self.pool.cfg.max_migrations
                && self
                    .order
                    .iter()
                    .any(|i| !tried.contains(i) && self.pool.available(*i, now));
            let end = self
                .segment(&mut seg, &mut stitcher, &mut trim, &mut gaps, slow_allowed)
                .await;
            match &end {
                SegmentEnd::Complete => self.pool.record_stream(seg.vi, &gaps),
                SegmentEnd::Failed { .. } => self.pool.record_attempt(seg.vi, false, None),
                _ => {}
            }
            let (reason, message) = match end {
                SegmentEnd::Failed { reason, message } => (reason, message),
                other => break other,
            };
            if migrations >= self.pool.cfg.max_migrations {
                break SegmentEnd::Failed {
                    reason,
                    message: format!(
                        "{message}; no migration left (max_migrations = {})",
                        self.pool.cfg.max_migrations
                    ),
                };
            }
            let from = self.pool.variants[seg.vi].cfg.name.clone();
            match self.migrate(&stitcher, &mut tried).await {
                Ok((next, mode)) => {
                    migrations += 1;
                    let to = &self.pool.variants[next.vi].cfg.name;
                    let note = format!(
                        "keel migrated from={from} to={to} reason={reason} after_tokens={}",
                        stitcher.delivered_tokens()
                    );
                    metrics::counter!("keel_migrations_total", "pool" => self.pool.cfg.name.clone(), "reason" => reason, "outcome" => "ok").increment(1);
                    tracing::info!(request_id = %self.ctx.id, pool = %self.pool.cfg.name, from = %from, to = %to, reason, detail = %message, "migrated");
                    if !self.send(SseEvent::comment(&note)).await {
                        break SegmentEnd::ClientGone;
                    }
                    log.route = "migrated";
                    log.variant = to.clone();
                    log.attempts += 1;
                    stitcher.begin_segment();
                    trim = mode == ResumeMode::Instruction;
                    seg = next;
                }
                Err(why) => {
                    metrics::counter!("keel_migrations_total", "pool" => self.pool.cfg.name.clone(), "reason" => reason, "outcome" => "failed").increment(1);
                    break SegmentEnd::Failed {
                        reason,
                        message: format!("{message}; migration impossible: {why}"),
                    };
                }
            }
        };
        drop(seg);
        let summary = Summary {
            route: log.route,
            variant: log.variant.clone(),
            attempts: log.attempts,
        };
        match end {
            SegmentEnd::Complete => log.finish("ok", None),
            SegmentEnd::ClientGone => log.finish("cancelled", Some("client disconnected")),
            SegmentEnd::Deadline => {
                self.give_up(&mut log, "the request's total deadline was reached")
                    .await
            }
            SegmentEnd::Failed { message, .. } => self.give_up(&mut log, &message).await,
        }
        summary
    }

    async fn give_up(&self, log: &mut RequestLog, message: &str) {
        let ev = stream_error_event(
            self.protocol,
            ErrorKind::BadGateway,
            &format!("keel: {message}; the response is incomplete"),
        );
        let _ = self.send(ev.raw).await;
        log.finish("incomplete", Some(message));
    }

    /// Finds a variant that continues the generation; tries each remaining one in plan order.
    async fn migrate(
        &self,
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
            let variant = &self.pool.variants[vi].cfg;
            if !self.pool.available(vi, self.pool.now_ms()) {
                reasons.push(format!("{}: unavailable", variant.name));
                continue;
            }
            tried.push(vi);
            let (endpoint, body) = match continuation(
                &self.req,
                variant.resume,
                &variant.continuation_fields,
                &stitcher.delivered,
                stitcher.delivered_tokens(),
            ) {
                Ok(x) => x,
                Err(e) => {
                    reasons.push(format!("{}: {e:?}", variant.name));
                    continue;
                }
            };
            let mut req = self.req.clone();
            req.endpoint = endpoint;
            req.body = body;
            let mut ctx = self.ctx.clone();
            ctx.endpoint = endpoint;
            let guard = self.pool.enter(vi);
            let started = Instant::now();
            match attempt(&self.pool, vi, &req, &ctx).await {
                AttemptResult::Served(Served::Stream(start)) => {
                    self.pool.record_attempt(
                        vi,
                        true,
                        Some(start.first_token_at.duration_since(started).as_secs_f64() * 1000.0),
                    );
                    return Ok((
                        Segment {
                            vi,
                            start,
                            _guard: guard,
                        },
                        variant.resume,
                    ));
                }
                AttemptResult::Served(Served::Whole { .. }) => {
                    reasons.push(format!("{}: answered without a stream", variant.name))
                }
                AttemptResult::ClientError(Served::Whole { status, .. }) => {
                    // e.g. a prefill the variant rejects: try the next one.
                    reasons.push(format!(
                        "{}: continuation rejected with HTTP {status}",
                        variant.name
                    ));
                }
                AttemptResult::ClientError(_) => {
                    reasons.push(format!("{}: continuation rejected", variant.name))
                }
                AttemptResult::Failed(f) => {
                    self.pool.record_attempt(vi, false, None);
                    reasons.push(format!("{}: {}", variant.name, f.describe()));
                }
            }
        }
        if reasons.is_empty() {
            reasons.push("no other variant in the plan".into());
        }
        Err(reasons.join("; "))
    }

    /// Relays one segment until it completes or fails.
    async fn segment(
        &self,
        seg: &mut Segment,
        st: &mut Stitcher,
        trim: &mut bool,
        gaps: &mut Vec<f64>,
        slow_allowed: bool,
    ) -> SegmentEnd {
        let stall = Duration::from_millis(self.pool.stall_threshold_ms(seg.vi));
        let baseline_gap = if slow_allowed {
            self.pool.baseline_gap_ms(seg.vi)
        } else {
            None
        };
        let mut w = Watch {
            last_output: seg.start.first_token_at,
            held: Vec::new(),
            holding: false,
            slow_checks: 0,
            baseline_gap,
        };
        for ev in std::mem::take(&mut seg.start.head)
            .into_iter()
            .chain(std::mem::take(&mut seg.start.pending))
        {
            if let Some(end) = self.handle(ev, st, trim, &mut w, gaps).await {
                return end;
            }
        }
        let mut events = Vec::new();
        loop {
            let stall_at = (w.last_output + stall).min(self.ctx.deadline);
            let next = tokio::select! {
                r = timeout_at(stall_at, seg.start.upstream.next()) => r,
                _ = self.sink.closed() => return SegmentEnd::ClientGone,
            };
            let chunk = match next {
                Err(_) if stall_at >= self.ctx.deadline => return SegmentEnd::Deadline,
                Err(_) => {
                    return SegmentEnd::Failed {
                        reason: "stall",
                        message: format!(
                            "the upstream stalled: no output for {} ms",
                            stall.as_millis()
                        ),
                    }
                }
                Ok(None) => {
                    return SegmentEnd::Failed {
                        reason: "error",
                        message: "the upstream closed the stream before it was complete".into(),
                    }
                }
                Ok(Some(Err(e))) => {
                    return SegmentEnd::Failed {
                        reason: "error",
                        message: format!("upstream connection failed mid-stream: {e}"),
                    }
                }
                Ok(Some(Ok(c))) => c,
            };
            if let Err(e) = seg.start.decoder.feed(&chunk, &mut events) {
                return SegmentEnd::Failed {
                    reason: "error",
                    message: format!("upstream stream framing error: {e}"),
                };
            }
            for ev in std::mem::take(&mut events) {
                if let Some(end) = self.handle(ev, st, trim, &mut w, gaps).await {
                    return end;
                }
            }
        }
    }

    async fn handle(
        &self,
        ev: SseEvent,
        st: &mut Stitcher,
        trim: &mut bool,
        w: &mut Watch,
        gaps: &mut Vec<f64>,
    ) -> Option<SegmentEnd> {
        let role = event_role(self.protocol, &ev);
        match &role {
            EventRole::Malformed(m) => {
                return Some(SegmentEnd::Failed {
                    reason: "error",
                    message: format!("upstream sent a malformed event: {m}"),
                })
            }
            EventRole::Error(m) => {
                return Some(SegmentEnd::Failed {
                    reason: "error",
                    message: format!("upstream error event: {m}"),
                })
            }
            EventRole::Output => {
                let now = Instant::now();
                gaps.push(now.duration_since(w.last_output).as_secs_f64() * 1000.0);
                w.last_output = now;
                if let Some(end) = w.check_rate(gaps) {
                    return Some(end);
                }
            }
            _ => {}
        }
        let terminal = role == EventRole::Terminal;
        if self.pool.cfg.hold_tool_calls && (w.holding || starts_tool_call(self.protocol, &ev)) {
            w.holding = true;
            let ends = ends_tool_call(self.protocol, &ev) || terminal;
            w.held.push(ev);
            if !ends {
                return None;
            }
            w.holding = false;
            for held in std::mem::take(&mut w.held) {
                if let Some(bytes) = st.process(&held, trim) {
                    if !self.send(bytes).await {
                        return Some(SegmentEnd::ClientGone);
                    }
                }
            }
        } else if let Some(bytes) = st.process(&ev, trim) {
            if !self.send(bytes).await {
                return Some(SegmentEnd::ClientGone);
            }
        }
        terminal.then_some(SegmentEnd::Complete)
    }
}

/// Per-segment watch state.
struct Watch {
    last_output: Instant,
    /// Tool-call events held back until the call completes.
    held: Vec<SseEvent>,
    holding: bool,
    slow_checks: u32,
    baseline_gap: Option<f64>,
}

impl Watch {
    /// Every 10 tokens: is the token rate more than 40% below the variant's baseline?
    fn check_rate(&mut self, gaps: &[f64]) -> Option<SegmentEnd> {
        let baseline = self.baseline_gap?;
        if gaps.len() < 11 || gaps.len() % 10 != 1 {
            return None;
        }
        // The first gap is the time to the first token; rate checks use inter-token gaps only.
        let window = &gaps[gaps.len() - 10..];
        let mean = window.iter().sum::<f64>() / window.len() as f64;
        // Gaps below 5 ms are dominated by scheduling noise: never call those slow.
        if mean > 5.0 && mean * SLOW_RATE > baseline {
            self.slow_checks += 1;
        } else {
            self.slow_checks = 0;
        }
        (self.slow_checks >= SLOW_CHECKS).then(|| SegmentEnd::Failed {
            reason: "slow",
            message: format!("token rate fell below {:.0}% of the variant's baseline on {SLOW_CHECKS} checks in a row", SLOW_RATE * 100.0),
        })
    }
}

fn starts_tool_call(protocol: Protocol, ev: &SseEvent) -> bool {
    if protocol == Protocol::OpenAi {
        if let Some(view) = ChunkView::parse(&ev.data) {
            return view.starts_tool_call();
        }
    }
    let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
        return false;
    };
    match protocol {
        Protocol::OpenAi => v
            .pointer("/choices/0/delta/tool_calls")
            .is_some_and(|t| !t.is_null()),
        Protocol::Anthropic => {
            ev.event.as_deref() == Some("content_block_start")
                && v.pointer("/content_block/type").and_then(Value::as_str) == Some("tool_use")
        }
    }
}

fn ends_tool_call(protocol: Protocol, ev: &SseEvent) -> bool {
    match protocol {
        Protocol::OpenAi => ChunkView::parse(&ev.data).is_some_and(|v| v.finished()),
        Protocol::Anthropic => ev.event.as_deref() == Some("content_block_stop"),
    }
}
