//! Stage 3, delivery: the client's response, its `x-keel-*` headers, the stream pump, and the
//! accounting every request gets exactly once (metrics and one access-log line).
//!
//! After the commit point a stream is forwarded event by event (never a partial event), so
//! that if the upstream fails keel can still end the stream with a well-formed error event in
//! the client's protocol. A clean end is only ever forwarded from the upstream's own terminal
//! event: a stream that stalls, breaks, turns malformed or outlives its deadline ends with an
//! explicit error and is counted as `incomplete`. A client that goes away cancels the upstream
//! request at once (its connection is dropped) and is counted as `cancelled`.

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use tokio::sync::mpsc;
use tokio::time::{timeout_at, Instant};

use keel_core::protocol::{event_role, stream_error_event, Endpoint, ErrorKind, EventRole, Protocol};
use keel_core::sse::SseEvent;

use crate::errors::GatewayError;
use crate::execution::{Executed, RequestCtx, Served, StreamStart};
use crate::pools::{InFlight, Pool};
use crate::Body;

/// What one request leaves in metrics and the log, recorded once by [`RequestLog::finish`].
pub struct RequestLog {
    pub id: String,
    pub pool: String,
    pub endpoint: Endpoint,
    pub route: &'static str,
    pub variant: String,
    pub attempts: usize,
    pub started: Instant,
    pub status: u16,
    pub ttft: Option<Duration>,
    done: bool,
}

impl RequestLog {
    pub fn new(ctx_id: &str, started: Instant, endpoint: Endpoint, pool: &str) -> Self {
        metrics::gauge!("keel_requests_in_flight").increment(1.0);
        RequestLog {
            id: ctx_id.to_owned(),
            pool: pool.to_owned(),
            endpoint,
            route: "direct",
            variant: "none".into(),
            attempts: 0,
            started,
            status: 0,
            ttft: None,
            done: false,
        }
    }

    /// Records the request's end: `outcome` is `ok`, `client_error`, `error`, `incomplete` or
    /// `cancelled`; `detail` says why when it is not `ok`.
    pub fn finish(&mut self, outcome: &'static str, detail: Option<&str>) {
        if self.done {
            return;
        }
        self.done = true;
        metrics::gauge!("keel_requests_in_flight").decrement(1.0);
        let elapsed = self.started.elapsed();
        let (pool, endpoint) = (self.pool.clone(), self.endpoint.as_str());
        metrics::counter!("keel_requests_total", "pool" => pool.clone(), "endpoint" => endpoint, "route" => self.route, "outcome" => outcome)
            .increment(1);
        metrics::histogram!("keel_request_duration_seconds", "pool" => pool.clone(), "endpoint" => endpoint, "outcome" => outcome)
            .record(elapsed.as_secs_f64());
        if let Some(t) = self.ttft {
            metrics::histogram!("keel_ttft_seconds", "pool" => pool, "endpoint" => endpoint).record(t.as_secs_f64());
        }
        let ttft_ms = self.ttft.map(|t| t.as_secs_f64() * 1000.0);
        let level_warn = matches!(outcome, "error" | "incomplete");
        macro_rules! log {
            ($lvl:ident) => {
                tracing::$lvl!(
                    request_id = %self.id, pool = %self.pool, endpoint, route = self.route, variant = %self.variant,
                    attempts = self.attempts, status = self.status, outcome, duration_ms = elapsed.as_secs_f64() * 1000.0,
                    ttft_ms, detail = detail.unwrap_or(""), "request"
                )
            };
        }
        if level_warn {
            log!(warn);
        } else {
            log!(info);
        }
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        // A response dropped before it finished (client gone, task aborted) is still counted.
        self.finish("cancelled", Some("response dropped before completion"));
    }
}

/// Sets the `x-keel-*` headers.
fn keel_headers(h: &mut HeaderMap, log: &RequestLog) {
    let put = |h: &mut HeaderMap, name: &'static str, v: &str| {
        if let Ok(v) = HeaderValue::from_str(v) {
            h.insert(name, v);
        }
    };
    put(h, "x-keel-request-id", &log.id);
    put(h, "x-keel-route", log.route);
    put(h, "x-keel-variant", &log.variant);
    put(h, "x-keel-attempts", &log.attempts.to_string());
}

/// An error keel answers itself (admission, selection or execution).
pub fn error_response(mut log: RequestLog, protocol: Protocol, err: &GatewayError) -> Response<Body> {
    log.status = err.status().as_u16();
    let mut resp = err.to_response(protocol);
    keel_headers(resp.headers_mut(), &log);
    let outcome = if log.status < 500 { "client_error" } else { "error" };
    log.finish(outcome, Some(&err.message));
    resp
}

/// Turns stage 2's result into the client's response.
pub fn deliver(mut log: RequestLog, pool: &Pool, ctx: &RequestCtx, protocol: Protocol, executed: Executed) -> Response<Body> {
    log.attempts = executed.attempts.len();
    log.route = if executed.attempts.len() > 1 { "fallback" } else { "direct" };
    let (vi, served, guard) = match executed.outcome {
        Ok(x) => x,
        Err(e) => return error_response(log, protocol, &e),
    };
    log.variant = pool.variants[vi].cfg.name.clone();
    match served {
        Served::Whole { status, headers, body } => {
            log.status = status.as_u16();
            log.ttft = Some(log.started.elapsed());
            let mut resp = crate::full_body(status, "application/json", body);
            for (k, v) in &headers {
                resp.headers_mut().insert(k.clone(), v.clone());
            }
            keel_headers(resp.headers_mut(), &log);
            let outcome = if status.is_success() { "ok" } else { "client_error" };
            drop(guard);
            log.finish(outcome, None);
            resp
        }
        Served::Stream(start) => {
            log.status = 200;
            log.ttft = Some(start.first_token_at.duration_since(log.started));
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            for (k, v) in &start.headers {
                if k != header::CONTENT_TYPE {
                    headers.insert(k.clone(), v.clone());
                }
            }
            keel_headers(&mut headers, &log);
            let (tx, body) = crate::channel_body();
            let pump = Pump { tx, protocol, stall: Duration::from_millis(pool.cfg.timeouts.stall_ms), deadline: ctx.deadline };
            tokio::spawn(pump.run(start, log, guard));
            let mut resp = Response::new(body);
            *resp.status_mut() = StatusCode::OK;
            *resp.headers_mut() = headers;
            resp
        }
    }
}

/// Forwards a committed stream to the client.
struct Pump {
    tx: mpsc::Sender<Bytes>,
    protocol: Protocol,
    stall: Duration,
    deadline: Instant,
}

/// How a stream ended.
enum End {
    Complete,
    /// The upstream sent its own error event (forwarded as is).
    UpstreamError(String),
    /// keel ended the stream with an error event.
    Failed(String),
    ClientGone,
}

impl Pump {
    async fn send(&self, bytes: Vec<u8>) -> bool {
        self.tx.send(Bytes::from(bytes)).await.is_ok()
    }

    /// Forwards one event; `Some(end)` when the stream is over.
    async fn forward(&self, ev: SseEvent) -> Option<End> {
        match event_role(self.protocol, &ev) {
            EventRole::Malformed(m) => return Some(End::Failed(format!("upstream sent a malformed event: {m}"))),
            role => {
                if !self.send(ev.raw).await {
                    return Some(End::ClientGone);
                }
                match role {
                    EventRole::Terminal => Some(End::Complete),
                    EventRole::Error(m) => Some(End::UpstreamError(m)),
                    _ => None,
                }
            }
        }
    }

    async fn run(self, mut start: StreamStart, mut log: RequestLog, guard: InFlight) {
        let mut gaps = Vec::new();
        let end = self.stream(&mut start, &mut gaps).await;
        if matches!(end, End::Complete) {
            guard.pool.record_stream(guard.index, &gaps);
        } else if matches!(end, End::Failed(_) | End::UpstreamError(_)) {
            guard.pool.record_attempt(guard.index, false, None);
        }
        // Drop the upstream first: closing its connection stops the generation.
        drop(start);
        drop(guard);
        match end {
            End::Complete => log.finish("ok", None),
            End::ClientGone => log.finish("cancelled", Some("client disconnected")),
            End::UpstreamError(m) => log.finish("incomplete", Some(&format!("upstream error event: {m}"))),
            End::Failed(m) => {
                let ev = stream_error_event(self.protocol, ErrorKind::BadGateway, &format!("keel: {m}; the response is incomplete"));
                let _ = self.send(ev.raw).await;
                log.finish("incomplete", Some(&m));
            }
        }
    }

    /// Forwards the stream; `gaps` receives the inter-token gaps (ms) for the health statistics.
    async fn stream(&self, start: &mut StreamStart, gaps: &mut Vec<f64>) -> End {
        if !self.send(std::mem::take(&mut start.head)).await {
            return End::ClientGone;
        }
        // A terminal event may already be in the head (an empty generation).
        if start.pending.is_empty() && start.decoder_done_in_head() {
            return End::Complete;
        }
        for ev in std::mem::take(&mut start.pending) {
            if let Some(end) = self.forward(ev).await {
                return end;
            }
        }
        let mut events = Vec::new();
        let mut last_output = start.first_token_at;
        loop {
            let stall_at = (last_output + self.stall).min(self.deadline);
            let next = tokio::select! {
                r = timeout_at(stall_at, start.upstream.next()) => r,
                _ = self.tx.closed() => return End::ClientGone,
            };
            let chunk = match next {
                Err(_) if stall_at >= self.deadline => return End::Failed("the request's total deadline was reached".into()),
                Err(_) => return End::Failed(format!("no data from the upstream for {} ms (stall)", self.stall.as_millis())),
                Ok(None) => return End::Failed("the upstream closed the stream before it was complete".into()),
                Ok(Some(Err(e))) => return End::Failed(format!("upstream connection failed mid-stream: {e}")),
                Ok(Some(Ok(c))) => c,
            };
            if let Err(e) = start.decoder.feed(&chunk, &mut events) {
                return End::Failed(format!("upstream stream framing error: {e}"));
            }
            for ev in std::mem::take(&mut events) {
                if matches!(event_role(self.protocol, &ev), EventRole::Output) {
                    let now = Instant::now();
                    gaps.push(now.duration_since(last_output).as_secs_f64() * 1000.0);
                    last_output = now;
                }
                if let Some(end) = self.forward(ev).await {
                    return end;
                }
            }
        }
    }
}

impl StreamStart {
    /// True when the committed head already ended with the protocol's terminal event.
    fn decoder_done_in_head(&self) -> bool {
        self.terminal_in_head
    }
}
