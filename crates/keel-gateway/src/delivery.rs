//! Stage 3, delivery: the client's response, its `x-keel-*` headers, the stream pump, and the
//! accounting every request gets exactly once (metrics and one access-log line).
//!
//! Streams are relayed by `relay` (forwarding, failure detection, migration); a clean end is only
//! ever forwarded from an upstream's own terminal event, and a stream that cannot be completed
//! ends with an explicit error and is counted as `incomplete`. A client that goes away cancels
//! the upstream request at once (its connection is dropped) and is counted as `cancelled`.

use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use tokio::time::Instant;

use keel_core::protocol::{Endpoint, Protocol};
use keel_core::request::CanonicalRequest;

use crate::errors::GatewayError;
use crate::execution::{Executed, RequestCtx, Served};
use crate::pools::Pool;
use crate::relay::{Assembled, Relay, Sink};
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
            metrics::histogram!("keel_ttft_seconds", "pool" => pool, "endpoint" => endpoint)
                .record(t.as_secs_f64());
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

impl RequestLog {
    /// A log used only to write headers (its request is accounted for elsewhere).
    fn quiet(id: &str, route: &'static str, variant: &str, attempts: usize) -> Self {
        RequestLog {
            id: id.to_owned(),
            pool: String::new(),
            endpoint: Endpoint::ChatCompletions,
            route,
            variant: variant.to_owned(),
            attempts,
            started: Instant::now(),
            status: 0,
            ttft: None,
            done: true,
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
pub fn error_response(
    mut log: RequestLog,
    protocol: Protocol,
    err: &GatewayError,
) -> Response<Body> {
    log.status = err.status().as_u16();
    let mut resp = err.to_response(protocol);
    keel_headers(resp.headers_mut(), &log);
    let outcome = if log.status < 500 {
        "client_error"
    } else {
        "error"
    };
    log.finish(outcome, Some(&err.message));
    resp
}

/// Turns stage 2's result into the client's response. A stream is handed to a [`Relay`] task,
/// which may continue it on another variant of `order` (see `relay`); when the client asked for
/// a whole response (`client_stream` false) the relayed events are assembled into one body.
#[allow(clippy::too_many_arguments)]
pub async fn deliver(
    mut log: RequestLog,
    pool: &Arc<Pool>,
    ctx: &RequestCtx,
    protocol: Protocol,
    executed: Executed,
    req: CanonicalRequest,
    order: Vec<usize>,
    client_stream: bool,
) -> Response<Body> {
    log.attempts = executed.attempts.len();
    log.route = executed.route.unwrap_or(if executed.attempts.len() > 1 {
        "fallback"
    } else {
        "direct"
    });
    let (vi, served, guard) = match executed.outcome {
        Ok(x) => x,
        Err(e) => return error_response(log, protocol, &e),
    };
    log.variant = pool.variants[vi].cfg.name.clone();
    match served {
        Served::Whole {
            status,
            headers,
            body,
        } => {
            log.status = status.as_u16();
            log.ttft = Some(log.started.elapsed());
            let mut resp = crate::full_body(status, "application/json", body);
            for (k, v) in &headers {
                resp.headers_mut().insert(k.clone(), v.clone());
            }
            keel_headers(resp.headers_mut(), &log);
            let outcome = if status.is_success() {
                "ok"
            } else {
                "client_error"
            };
            drop(guard);
            log.finish(outcome, None);
            resp
        }
        Served::Stream(start) if !client_stream => {
            log.status = 200;
            log.ttft = Some(start.first_token_at.duration_since(log.started));
            let assembled = Arc::new(std::sync::Mutex::new(Assembled::default()));
            let relay = Relay {
                sink: Sink::Assemble(assembled.clone()),
                protocol,
                pool: pool.clone(),
                req,
                ctx: ctx.clone(),
                order,
            };
            let summary = relay.run(vi, start, guard, log).await;
            let (failure, assembler) = {
                let mut a = assembled.lock().unwrap_or_else(|e| e.into_inner());
                (a.failure.take(), std::mem::take(&mut a.body))
            };
            let mut resp = match failure {
                Some(m) => GatewayError::new(keel_core::protocol::ErrorKind::BadGateway, m)
                    .to_response(protocol),
                None => crate::full_body(
                    StatusCode::OK,
                    "application/json",
                    bytes::Bytes::from(assembler.finish(ctx.endpoint).to_string()),
                ),
            };
            keel_headers(
                resp.headers_mut(),
                &RequestLog::quiet(&ctx.id, summary.route, &summary.variant, summary.attempts),
            );
            resp
        }
        Served::Stream(start) => {
            log.status = 200;
            log.ttft = Some(start.first_token_at.duration_since(log.started));
            let mut headers = HeaderMap::new();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream; charset=utf-8"),
            );
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            for (k, v) in &start.headers {
                if k != header::CONTENT_TYPE {
                    headers.insert(k.clone(), v.clone());
                }
            }
            keel_headers(&mut headers, &log);
            let (tx, body) = crate::channel_body();
            let relay = Relay {
                sink: Sink::Client(tx),
                protocol,
                pool: pool.clone(),
                req,
                ctx: ctx.clone(),
                order,
            };
            tokio::spawn(relay.run(vi, start, guard, log));
            let mut resp = Response::new(body);
            *resp.status_mut() = StatusCode::OK;
            *resp.headers_mut() = headers;
            resp
        }
    }
}
