//! The deliver phase: the client's response and its `x-keel-*` headers. A whole response is
//! answered at once; a stream is handed to a [`Relay`] (forwarding, failure detection,
//! migration) that runs inside the client's body, feeds it and ends it only explicitly (see
//! `body`); a non-streaming request that keel streamed upstream is relayed in place into an
//! assembler.
//! Every request is accounted for once, by its `access_log::RequestLog`.

use std::future::Future;
use std::sync::{Arc, Mutex};

use http::{header, HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use keel_core::assemble::Assembler;
use keel_core::protocol::{ErrorKind, Protocol};
use keel_core::request::CanonicalRequest;

use crate::config::ResponseModel;
use crate::observe::access_log::RequestLog;
use crate::pipeline::attempt::{Served, StreamStart};
use crate::pipeline::cache::{self, Capture};
use crate::pipeline::context::RequestCtx;
use crate::pipeline::execution::{Executed, Outcome};
use crate::pipeline::phases::Flight;
use crate::pipeline::relay::{Assembled, Handover, Relay, Sink, Summary};
use crate::pipeline::settlement::{Attempts, Committed};
use crate::state::pools::Pool;
use crate::upstream::translation::PROMPT_FIX_HEADER;
use crate::wire::body::{driven, full_body, response_headers, Body};
use crate::wire::errors::GatewayError;

/// Sets the `x-keel-*` headers.
pub(crate) fn keel_headers(
    h: &mut HeaderMap,
    id: &str,
    route: &str,
    variant: &str,
    attempts: usize,
) {
    // Names made once, at compile time: inserting by `&str` validates the name every call.
    const REQUEST_ID: HeaderName = HeaderName::from_static("x-keel-request-id");
    const ROUTE: HeaderName = HeaderName::from_static("x-keel-route");
    const VARIANT: HeaderName = HeaderName::from_static("x-keel-variant");
    const ATTEMPTS: HeaderName = HeaderName::from_static("x-keel-attempts");
    let put = |h: &mut HeaderMap, name: HeaderName, v: &str| {
        if let Ok(v) = HeaderValue::from_str(v) {
            h.insert(name, v);
        }
    };
    put(h, REQUEST_ID, id);
    put(h, ROUTE, route);
    put(h, VARIANT, variant);
    h.insert(ATTEMPTS, HeaderValue::from(attempts));
}

fn log_headers(h: &mut HeaderMap, log: &RequestLog) {
    keel_headers(h, &log.id, log.route, &log.variant, log.attempts);
}

/// `x-keel-integrity`: what an answer failed of its integrity checks (see `relay::integrity`).
pub(crate) fn integrity_header(h: &mut HeaderMap, flags: &[&str]) {
    if let (false, Ok(v)) = (flags.is_empty(), HeaderValue::from_str(&flags.join(","))) {
        h.insert("x-keel-integrity", v);
    }
}

/// Adds what admission and the Responses front changed to `x-keel-prompt-fix` (before the
/// attempt's fixes), and how many messages middle-out dropped.
pub(crate) fn front_fixes(h: &mut HeaderMap, ctx: &RequestCtx) {
    crate::pipeline::guard::header(h, ctx.guard.as_deref());
    let front = ctx.responses.iter().flat_map(|f| f.fixes.iter());
    let mut all: Vec<&str> = ctx
        .prompt_fixes
        .iter()
        .chain(front)
        .map(String::as_str)
        .collect();
    if all.is_empty() {
        return;
    }
    if let Some(attempt) = h.get(PROMPT_FIX_HEADER).and_then(|v| v.to_str().ok()) {
        all.push(attempt);
    }
    if let Ok(v) = HeaderValue::from_str(&all.join(",")) {
        h.insert(PROMPT_FIX_HEADER, v);
    }
    if ctx.trimmed_messages > 0 {
        h.insert(
            crate::pipeline::context_fit::TRIMMED_HEADER,
            HeaderValue::from(ctx.trimmed_messages),
        );
    }
}

/// The `x-keel-prompt-fix` codes in `h`, for the access log.
pub(crate) fn fix_codes(h: &HeaderMap) -> Vec<String> {
    h.get(PROMPT_FIX_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(',').map(|c| c.trim().to_owned()).collect())
        .unwrap_or_default()
}

/// A successful whole answer in the client's API: a Chat completion becomes a Response object
/// for a Responses client. Errors have the same shape in both.
pub(crate) fn answer_body(
    ctx: &RequestCtx,
    status: StatusCode,
    body: bytes::Bytes,
) -> bytes::Bytes {
    if !status.is_success() {
        return body;
    }
    let body = crate::pipeline::guard::restore_whole(ctx.guard.as_deref(), body);
    match &ctx.responses {
        Some(front) => front.whole(&ctx.id, &body),
        None => body,
    }
}

/// The route of an answer keel gives itself, by status: `local` (a success: models, health,
/// decisions, metrics), `throttled` (429: a limit or the wait line), `rejected` (any other
/// client error: bad input, authentication, not found), `unavailable` (no variant could serve).
pub fn own_route(status: StatusCode) -> &'static str {
    match status.as_u16() {
        429 => "throttled",
        s if s < 400 => "local",
        s if s < 500 => "rejected",
        _ => "unavailable",
    }
}

/// An error keel answers itself (admission, selection or execution). A request the wait line
/// refused keeps its `throttled` route whatever the status (503 when it could not wait long
/// enough).
pub fn error_response(
    mut log: RequestLog,
    protocol: Protocol,
    err: &GatewayError,
) -> Response<Body> {
    log.status = err.status().as_u16();
    if log.route != "throttled" {
        log.route = own_route(err.status());
    }
    let mut resp = err.to_response(protocol);
    log_headers(resp.headers_mut(), &log);
    log.stamp_overhead(resp.headers_mut());
    let outcome = if log.status < 500 {
        "client_error"
    } else {
        "error"
    };
    log.finish(outcome, Some(&err.message));
    resp
}

/// A whole response from an upstream (a success, or the client's own error).
pub(crate) fn whole(
    mut log: RequestLog,
    ctx: &RequestCtx,
    status: StatusCode,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> Response<Body> {
    log.status = status.as_u16();
    log.ttft = Some(log.started.elapsed());
    let mut resp = full_body(status, "application/json", answer_body(ctx, status, body));
    for (k, v) in &headers {
        resp.headers_mut().insert(k.clone(), v.clone());
    }
    log_headers(resp.headers_mut(), &log);
    front_fixes(resp.headers_mut(), ctx);
    log.prompt_fixes = fix_codes(resp.headers());
    log.stamp_overhead(resp.headers_mut());
    let outcome = if status.is_success() {
        "ok"
    } else {
        "client_error"
    };
    log.finish(outcome, None);
    resp
}

/// Hands a whole successful answer's text to the pool's shadow variants (see `shadow`).
fn shadow_whole(
    pool: &Arc<Pool>,
    req: &CanonicalRequest,
    ctx: &RequestCtx,
    log: &RequestLog,
    body: &[u8],
) {
    if pool.shadow.is_none() {
        return;
    }
    let text = serde_json::from_slice(body)
        .ok()
        .and_then(|v| keel_core::compare::answer_text(&v));
    if let Some(text) = text {
        let latency_ms = log.started.elapsed().as_secs_f64() * 1000.0;
        crate::pipeline::shadow::after_served(
            pool,
            req,
            ctx,
            crate::pipeline::shadow::ServedAnswer { text, latency_ms },
        );
    }
}

/// A stream committed to the client, and what a continuation of it may use.
struct CommittedStream {
    committed: Committed,
    start: StreamStart,
    /// The plan: candidates for continuations, in order.
    order: Vec<usize>,
    attempts: Attempts,
}

/// What delivery decided before any await: the response, or a whole answer still to assemble
/// from a committed stream. Held by value in the delivery's future, which is what it would
/// otherwise hold in locals: boxing the larger variant would cost an allocation a request.
#[allow(clippy::large_enum_variant)]
enum Decided<'g> {
    Now(Response<Body>),
    Assemble {
        flight: Flight<'g>,
        stream: CommittedStream,
        capture: Option<Capture>,
    },
}

impl<'g> Flight<'g> {
    /// Turns stage 2's result into the client's response. A stream may be continued on another
    /// variant of `order` (see `relay`); when the client asked for a whole response the relayed
    /// events are assembled into one body. A cache miss's `capture` stores the complete answer
    /// the client was given (see `cache`); dropped on any other end.
    ///
    /// Everything but the assembly is done before the future is made: its state is then only
    /// what assembling needs, not every local of the decision (an async fn's state holds them
    /// all, and every request's future holds this one's).
    pub(super) fn deliver(
        self,
        executed: Executed,
        order: Vec<usize>,
        capture: Option<Capture>,
    ) -> impl Future<Output = Response<Body>> + use<'g> {
        let decided = self.respond(executed, order, capture);
        async move {
            match decided {
                Decided::Now(resp) => resp,
                // Boxed: inline, the relay run to the end would make every request's handler
                // that much larger, streams' included, and it is copied into its box once a
                // request.
                Decided::Assemble {
                    flight,
                    stream,
                    capture,
                } => Box::pin(flight.assembled(stream, capture)).await,
            }
        }
    }

    /// The response now, or the assembly a whole answer waits for.
    fn respond(
        mut self,
        executed: Executed,
        order: Vec<usize>,
        capture: Option<Capture>,
    ) -> Decided<'g> {
        let protocol = self.protocol();
        let Executed {
            outcome,
            attempts,
            route,
        } = executed;
        let log = &mut self.log;
        log.note_attempts(&attempts);
        log.route = route.unwrap_or(if attempts.len() > 1 {
            "fallback"
        } else {
            "direct"
        });
        let (committed, served) = match outcome {
            Outcome::Served(c, s) => (c, s),
            Outcome::ClientError(Served::Whole {
                status,
                headers,
                body,
                ..
            }) => {
                log.variant = attempts
                    .records()
                    .last()
                    .map_or("none".into(), |r| r.variant.clone());
                return Decided::Now(whole(self.log, &self.ctx, status, headers, body));
            }
            Outcome::ClientError(Served::Stream(_)) => {
                let e = GatewayError::new(ErrorKind::BadGateway, "upstream rejected the request");
                return Decided::Now(error_response(self.log, protocol, &e));
            }
            Outcome::Failed(e) => return Decided::Now(error_response(self.log, protocol, &e)),
        };
        log.serving(&self.pool.variants[committed.vi].cfg);
        let start = match served {
            Served::Whole {
                status,
                headers,
                body,
                usage,
            } => {
                let variant = &self.pool.variants[committed.vi].cfg;
                self.ctx.meter.whole_or_read(variant, usage, &body);
                drop(committed);
                return Decided::Now(self.whole_answer(status, headers, body, capture));
            }
            Served::Stream(start) => start,
        };
        self.log.status = 200;
        self.log.ttft = Some(start.first_token_at.duration_since(self.log.started));
        let stream = CommittedStream {
            committed,
            start,
            order,
            attempts,
        };
        if self.ctx.client_stream {
            Decided::Now(self.streamed(stream, capture))
        } else {
            Decided::Assemble {
                flight: self,
                stream,
                capture,
            }
        }
    }

    /// A whole answer from the upstream, stored in the cache when it is a success.
    fn whole_answer(
        mut self,
        status: StatusCode,
        headers: HeaderMap,
        body: bytes::Bytes,
        capture: Option<Capture>,
    ) -> Response<Body> {
        let Flight { pool, req, ctx, .. } = &self;
        shadow_whole(pool, req, ctx, &self.log, &body);
        let flags = crate::pipeline::relay::whole_flags(pool.cfg.integrity, req, &body);
        let stored = match capture {
            Some(c) if status.is_success() => {
                let answer = serde_json::from_slice(&body).unwrap_or_default();
                let log = &self.log;
                c.store(&answer, &log.variant, &ctx.id, log.started.elapsed())
            }
            _ => false,
        };
        if stored {
            self.log.cache = "stored";
        }
        let mut resp = whole(self.log, &self.ctx, status, headers, body);
        integrity_header(resp.headers_mut(), &flags);
        if stored {
            cache::stamp(resp.headers_mut(), "stored");
        }
        resp
    }

    /// Splits the flight at the commit point: the relay's share (the request itself, a copy
    /// of its context, the plan) and delivery's (the context and the access-log entry).
    fn hand_over(
        self,
        order: Vec<usize>,
        attempts: Attempts,
    ) -> (Handover, RequestCtx, RequestLog) {
        let protocol = self.protocol();
        let Flight {
            gw,
            pool,
            req,
            ctx,
            log,
            ..
        } = self;
        let handover = Handover {
            gw: gw.clone(),
            protocol,
            pool,
            req,
            ctx: ctx.clone(),
            order,
            attempts,
        };
        (handover, ctx, log)
    }

    /// A non-streaming request that keel streamed upstream: relayed in place into an
    /// assembler, and answered whole.
    async fn assembled(
        mut self,
        stream: CommittedStream,
        capture: Option<Capture>,
    ) -> Response<Body> {
        // The assembled answer's `model`: the name the client asked for, unless the pool keeps
        // the upstream's (its events are not renamed, see `RequestCtx::assembled`).
        let answer_as =
            (self.pool.cfg.response_model == ResponseModel::Public).then(|| self.req.model.clone());
        let fixes = stream.start.headers.get(PROMPT_FIX_HEADER).cloned();
        let mut fixed = HeaderMap::new();
        if let Some(v) = &fixes {
            fixed.insert(PROMPT_FIX_HEADER, v.clone());
        }
        front_fixes(&mut fixed, &self.ctx);
        self.log.prompt_fixes = fix_codes(&fixed);
        let stamp = self.log.overhead_stamp();
        let assembled = Arc::new(Mutex::new(Assembled {
            body: answer_as
                .as_deref()
                .map_or_else(Assembler::new, Assembler::answering_as),
            ..Assembled::default()
        }));
        let start_at = stream.start.first_token_at;
        let protocol = self.protocol();
        let (handover, ctx, log) = self.hand_over(stream.order, stream.attempts);
        let relay = Relay::new(handover, Sink::Assemble(assembled.clone()));
        let summary: Summary = relay.run(stream.committed, stream.start, log).await;
        let (failure, assembler) = {
            let mut a = assembled.lock().unwrap_or_else(|e| e.into_inner());
            (a.failure.take(), std::mem::take(&mut a.body))
        };
        let mut stored = false;
        let mut resp = match failure {
            Some(e) => {
                if let Some(c) = capture {
                    c.incomplete();
                }
                e.to_response(protocol)
            }
            None => {
                let answer = assembler.finish(ctx.endpoint);
                match capture {
                    Some(c) if summary.complete => {
                        let took = start_at.elapsed();
                        stored = c.store(&answer.to_value(), &summary.variant, &ctx.id, took);
                    }
                    Some(c) => c.incomplete(),
                    None => {}
                }
                let body = bytes::Bytes::from(answer.to_bytes());
                full_body(
                    StatusCode::OK,
                    "application/json",
                    answer_body(&ctx, StatusCode::OK, body),
                )
            }
        };
        if let Some(v) = fixes {
            resp.headers_mut().insert(PROMPT_FIX_HEADER, v);
        }
        front_fixes(resp.headers_mut(), &ctx);
        keel_headers(
            resp.headers_mut(),
            &ctx.id,
            summary.route,
            &summary.variant,
            summary.attempts,
        );
        integrity_header(resp.headers_mut(), &summary.integrity);
        stamp.apply(resp.headers_mut());
        if stored {
            cache::stamp(resp.headers_mut(), "stored");
        }
        resp
    }

    /// A stream: the response head now, and the relay inside the client's body (no task of its
    /// own; see `body::driven`), except a coalescing leader's.
    fn streamed(mut self, stream: CommittedStream, capture: Option<Capture>) -> Response<Body> {
        let protocol = self.protocol();
        let mut headers = response_headers();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        for (k, v) in &stream.start.headers {
            if k != header::CONTENT_TYPE {
                headers.insert(k.clone(), v.clone());
            }
        }
        let log = &mut self.log;
        log_headers(&mut headers, log);
        front_fixes(&mut headers, &self.ctx);
        log.prompt_fixes = fix_codes(&headers);
        log.stamp_overhead(&mut headers);
        let (tx, body, driver) = driven(protocol);
        // Ended by an error event if still running at the drain deadline (before the Responses
        // front, which translates it like the relay's own error events).
        let mut body = self.gw.process.cut_at_deadline(body, protocol);
        let ctx = &self.ctx;
        body = crate::pipeline::guard_stream::restore(body, protocol, ctx.guard.as_ref());
        if let Some(front) = &ctx.responses {
            body = front.stream(&ctx.id, body);
        }
        let (handover, ctx, log) = self.hand_over(stream.order, stream.attempts);
        match capture {
            None => {
                let relay = Relay::new(handover, Sink::Client(tx));
                driver.run(relay.run(stream.committed, stream.start, log));
            }
            Some(mut c) => {
                // The client's events are assembled on the side and stored if the stream completes.
                let copy = Arc::new(Mutex::new(Assembled::default()));
                // A coalescing leader's relay writes the flight's live log instead of this
                // client's body, and runs in a task of its own: this client reads the log as
                // every follower does, so no reader's pace (this client's included) holds back
                // the generation or the others.
                let (sink, reader) = match c.take_live() {
                    Some(live) => {
                        live.serving(&log.variant);
                        let reader = live.live().reader();
                        let sink = Sink::Shared {
                            copy: copy.clone(),
                            live,
                        };
                        (sink, Some((reader, tx)))
                    }
                    None => {
                        let sink = Sink::Tee {
                            client: tx,
                            copy: copy.clone(),
                        };
                        (sink, None)
                    }
                };
                let relay = Relay::new(handover, sink);
                let (endpoint, id, first) = (ctx.endpoint, ctx.id, stream.start.first_token_at);
                let generate = async move {
                    let summary = relay.run(stream.committed, stream.start, log).await;
                    let (failure, body) = {
                        let mut a = copy.lock().unwrap_or_else(|e| e.into_inner());
                        (a.failure.take(), std::mem::take(&mut a.body))
                    };
                    if summary.complete && failure.is_none() {
                        let answer = body.finish(endpoint).to_value();
                        c.store(&answer, &summary.variant, &id, first.elapsed());
                    } else {
                        c.incomplete();
                    }
                };
                match reader {
                    Some((reader, tx)) => {
                        tokio::spawn(generate);
                        driver.run(cache::flight::forward(reader, tx));
                    }
                    None => driver.run(generate),
                }
            }
        }
        let mut resp = Response::new(body);
        *resp.status_mut() = StatusCode::OK;
        *resp.headers_mut() = headers;
        resp
    }
}
