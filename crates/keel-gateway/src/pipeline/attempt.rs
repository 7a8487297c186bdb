//! One upstream attempt: send the request to a variant and read until its first token (for a
//! stream: the first event carrying output, not the response head, not a role-only preamble,
//! not a ping) or its whole body, under the attempt's deadlines. The result is classified, not
//! acted on: entering and settling are `settlement`'s.
//!
//! Everything read from an upstream is bounded: a whole body by `max_upstream_body_bytes`, an
//! error body by [`MAX_ERROR_BODY_BYTES`], one SSE event by `max_sse_event_bytes`. Exceeding a
//! bound is a `malformed` failure, which fails over (or, after the first byte, migrates).
//!
//! An upstream that answers a streamed request with one JSON body (some OpenAI-compatible
//! servers ignore `stream`) is served: passed through to a client that asked for a whole
//! response, turned into the equivalent stream (`keel_core::synthesize`) for one that asked
//! for a stream.

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderValue, StatusCode};
use tokio::time::{timeout_at, Instant};

use keel_core::json_out;
use keel_core::outcome::{parse_retry_after, AttemptFailure, Verdict};
use keel_core::protocol::{error_summary, Endpoint, EventRole};
use keel_core::request::CanonicalRequest;
use keel_core::sse::{SseDecoder, SseError, SseEvent};
use keel_core::stream_watch::{
    oversized_index, read_event_in, ChunkTemplate, EventFacts, MAX_OUTPUT_INDEX,
};
use keel_core::synthesize::stream_from_whole;
use keel_core::usage::Reported;

use crate::config::ResponseModel;
use crate::pipeline::context::RequestCtx;
use crate::pipeline::settlement::MAX_COOLDOWN_MS;
use crate::state::pools::Pool;
use crate::upstream;
use crate::upstream::translation::{self, ModelRename, StreamTranslator, PROMPT_FIX_HEADER};
use crate::wire::errors::{ErrorKind, GatewayError};

/// Largest error body read from an upstream (only its message is used).
pub const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// Upstream bytes of a committed stream.
pub type UpstreamBytes = upstream::Body;

/// A committed stream: what was received up to and including the first output event, and the
/// rest still to read.
pub struct StreamStart {
    /// Events received and not yet relayed: those up to and including the first output
    /// event, then any that came in the same read.
    pub pending: Vec<SseEvent>,
    /// What the commit point read of the first of `pending`, the events before the first
    /// output (a preamble, keep-alives), in order: the relay takes them as read instead of
    /// parsing them again (a second parse of an OpenAI stream's role chunk costs ≈ 3,900
    /// instructions a stream).
    pub read: Vec<EventFacts<'static>>,
    /// The rest of the stream, in the client's protocol.
    pub source: Source,
    pub headers: HeaderMap,
    /// When the first output arrived.
    pub first_token_at: Instant,
    /// The shape of the stream's plain chunks, learned from its first text at the commit
    /// point, so that the relay reads that chunk again without parsing it (see
    /// `stream_watch::ChunkTemplate`).
    pub template: ChunkTemplate,
}

/// What the client gets.
// A stream's start is several times a whole answer's size; it is moved a few times per request,
// where a box would be one more allocation per stream.
#[allow(clippy::large_enum_variant)]
pub enum Served {
    Whole {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
        /// The usage the body reports where it was read already (where the body was checked);
        /// `None`: the meter reads it from the body.
        usage: Option<Reported>,
    },
    Stream(StreamStart),
}

/// How one attempt ended, before settlement.
pub enum AttemptResult {
    Served(Served),
    /// The client's own error, returned as the upstream gave it.
    ClientError(Served),
    Failed(AttemptFailure),
}

/// Why reading a stream stopped.
pub enum ReadEnd {
    /// The deadline passed first.
    Timeout,
    /// The upstream closed the stream.
    Closed,
    /// Boxed: a read's result is part of the relay's future, which every live stream holds,
    /// and an error is rare.
    Transport(Box<GatewayError>),
    Framing(SseError),
    /// A cross-protocol stream's event could not be translated (or broke a bound).
    Translation(String),
}

impl ReadEnd {
    /// The failure it means, for reads other than a timeout (whose meaning depends on which
    /// deadline it was).
    pub fn failure(self, what: &str) -> AttemptFailure {
        match self {
            ReadEnd::Timeout => AttemptFailure::Io(format!("timed out {what}")),
            ReadEnd::Closed => AttemptFailure::Io(format!("the upstream closed the stream {what}")),
            ReadEnd::Transport(e) => transport_error(*e),
            ReadEnd::Framing(e) => AttemptFailure::Malformed(format!("stream framing: {e}")),
            ReadEnd::Translation(m) => {
                AttemptFailure::Malformed(format!("translating the stream: {m}"))
            }
        }
    }
}

/// Reads the next chunk of a stream before `deadline` and decodes the events it completes into
/// `out` (possibly none: a chunk may end inside an event). Shared by the first-token wait and
/// the relay.
pub async fn next_events(
    upstream: &mut UpstreamBytes,
    decoder: &mut SseDecoder,
    deadline: Instant,
    out: &mut Vec<SseEvent>,
) -> Result<(), ReadEnd> {
    let chunk = match timeout_at(deadline, upstream.next()).await {
        Err(_) => return Err(ReadEnd::Timeout),
        Ok(None) => {
            // The end of the bytes may complete a last event (one whose blank line ended in a
            // lone `\r`); only when it does not is the stream closed.
            let before = out.len();
            decoder.end(out).map_err(ReadEnd::Framing)?;
            return if out.len() > before {
                Ok(())
            } else {
                Err(ReadEnd::Closed)
            };
        }
        Ok(Some(Err(e))) => return Err(ReadEnd::Transport(Box::new(e))),
        Ok(Some(Ok(c))) => c,
    };
    decoder.feed(&chunk, out).map_err(ReadEnd::Framing)
}

/// An upstream stream as events in the client's protocol: decoded, and translated when the
/// variant speaks the other protocol.
pub struct Source {
    upstream: UpstreamBytes,
    decoder: SseDecoder,
    translator: Option<StreamTranslator>,
    raw: Vec<SseEvent>,
}

impl Source {
    pub fn new(
        upstream: UpstreamBytes,
        decoder: SseDecoder,
        translator: Option<StreamTranslator>,
    ) -> Source {
        Source {
            upstream,
            decoder,
            translator,
            raw: Vec::new(),
        }
    }

    /// Gives the stream's events the `model` of `rename` (a same-protocol stream's: a
    /// translated one's events are built with the client's name).
    pub fn renaming(mut self, rename: Option<ModelRename>) -> Source {
        if let (Some(r), None) = (rename, &self.translator) {
            let decoder = std::mem::take(&mut self.decoder);
            self.decoder = decoder.renaming_model(r.stream());
        }
        self
    }

    /// The stream's terminal event was read: what is left upstream is only the transfer's end,
    /// worth reading to keep the connection (see [`upstream::BodyStream`]). A source dropped
    /// without this is given up, and its upstream connection closed at once.
    pub fn reached_end(&mut self) {
        self.upstream.as_mut().reached_end();
    }

    /// A source with nothing more to read.
    pub fn empty() -> Source {
        Source::new(
            Box::pin(futures_util::stream::empty()),
            SseDecoder::new(),
            None,
        )
    }

    /// [`next_events`], in the client's protocol.
    pub async fn next(
        &mut self,
        deadline: Instant,
        out: &mut Vec<SseEvent>,
    ) -> Result<(), ReadEnd> {
        let Some(t) = &mut self.translator else {
            return next_events(&mut self.upstream, &mut self.decoder, deadline, out).await;
        };
        self.raw.clear();
        next_events(
            &mut self.upstream,
            &mut self.decoder,
            deadline,
            &mut self.raw,
        )
        .await?;
        let from = t.upstream_protocol();
        for ev in &self.raw {
            if let Some(i) = oversized_index(from, ev) {
                return Err(ReadEnd::Translation(format!(
                    "an index of {i} (more than {MAX_OUTPUT_INDEX})"
                )));
            }
            t.push(ev, out)
                .map_err(|e| ReadEnd::Translation(e.message))?;
        }
        Ok(())
    }
}

/// Reads a whole body of at most `limit` bytes before `deadline`.
pub(crate) async fn read_body(
    resp: upstream::Response,
    limit: usize,
    deadline: Instant,
    started: Instant,
) -> Result<Bytes, AttemptFailure> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(too_large(limit));
    }
    let mut stream = resp.body;
    let mut body = Vec::new();
    loop {
        match timeout_at(deadline, stream.next()).await {
            Err(_) => {
                return Err(AttemptFailure::Deadline {
                    after_ms: started.elapsed().as_millis() as u64,
                })
            }
            Ok(None) => return Ok(Bytes::from(body)),
            Ok(Some(Err(e))) => return Err(transport_error(e)),
            Ok(Some(Ok(c))) => {
                if body.len() + c.len() > limit {
                    return Err(too_large(limit));
                }
                body.extend_from_slice(&c);
            }
        }
    }
}

fn too_large(limit: usize) -> AttemptFailure {
    AttemptFailure::Malformed(format!(
        "the response body exceeds {limit} bytes (max_upstream_body_bytes)"
    ))
}

/// Upstream response headers passed to the client: request ids for support tickets, and
/// `retry-after` on returned errors. Everything else (rate-limit counters of one variant,
/// cookies, framing) would mislead or leak.
fn kept_headers(h: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (name, value) in h {
        let n = name.as_str();
        if matches!(
            n,
            "content-type"
                | "x-request-id"
                | "request-id"
                | "retry-after"
                | "retry-after-ms"
                | "openai-processing-ms"
        ) {
            // Detached: the stream keeps these, and a slice would pin the upstream
            // connection's read buffer.
            out.append(name.clone(), crate::upstream::detached(value));
        }
    }
    out
}

fn timeout_failure(hit_total: bool, started: Instant) -> AttemptFailure {
    let after_ms = started.elapsed().as_millis() as u64;
    if hit_total {
        AttemptFailure::Deadline { after_ms }
    } else {
        AttemptFailure::FirstTokenTimeout { after_ms }
    }
}

/// What an upstream's error means for the attempt.
pub fn transport_error(e: GatewayError) -> AttemptFailure {
    match e.kind {
        ErrorKind::Refused => AttemptFailure::Refused(e.message),
        ErrorKind::Connect => AttemptFailure::Connect(e.message),
        ErrorKind::Malformed => AttemptFailure::Malformed(e.message),
        // A transport reports only the kinds above and `Io`; the rest are counted as its
        // connection's failure should one ever come this way.
        ErrorKind::Io | ErrorKind::Upstream | ErrorKind::Answer(_) => AttemptFailure::Io(e.message),
    }
}

/// Runs one attempt on variant `vi` until its first token, its whole body, or its failure.
/// `traceparent` is the attempt span's, sent upstream in place of the client's (tracing on).
///
/// A plain fn mapping `run`'s future rather than an async fn awaiting it: no second future
/// around the first, whose state every move would copy again.
pub fn attempt<'a>(
    pool: &'a Pool,
    vi: usize,
    req: &'a CanonicalRequest,
    ctx: &'a RequestCtx,
    traceparent: Option<HeaderValue>,
) -> impl std::future::Future<Output = AttemptResult> + 'a {
    use futures_util::FutureExt;
    run(pool, vi, req, ctx, traceparent).map(|r| r.unwrap_or_else(AttemptResult::Failed))
}

async fn run(
    pool: &Pool,
    vi: usize,
    req: &CanonicalRequest,
    ctx: &RequestCtx,
    traceparent: Option<HeaderValue>,
) -> Result<AttemptResult, AttemptFailure> {
    let variant = &pool.variants[vi].cfg;
    let prepared = Prepared::new(pool, vi, req, ctx)?;
    let started = Instant::now();
    let streaming = req.stream && ctx.endpoint.generates();
    let first_token_deadline = started + Duration::from_millis(pool.cfg.timeouts.first_token_ms);
    let head_deadline = if streaming {
        first_token_deadline.min(ctx.deadline)
    } else {
        ctx.deadline
    };
    let hit_total = |d: Instant| d >= ctx.deadline;

    let send = pool.client.send(
        &variant.name,
        upstream::request(
            variant,
            prepared.endpoint,
            &ctx.forwarded,
            traceparent,
            prepared.body,
        ),
    );
    let resp = match timeout_at(head_deadline, send).await {
        Err(_) => return Err(timeout_failure(hit_total(head_deadline), started)),
        Ok(Err(e)) => return Err(transport_error(e)),
        Ok(Ok(r)) => r,
    };
    let status = resp.status;
    let mut headers = kept_headers(&resp.headers);
    let mut fixes = prepared.fixes;
    for f in &resp.fixes {
        if !fixes.contains(f) {
            fixes.push(f.clone());
        }
    }
    if let Some(v) = translation::fix_header(&fixes) {
        headers.insert(PROMPT_FIX_HEADER, v);
    }
    let answer = Answer {
        back: prepared.back,
        rename: prepared.rename,
        headers,
        started,
    };
    if !status.is_success() {
        return Ok(answer.refused(resp, ctx).await);
    }
    let content_type = resp
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let is_stream = content_type.starts_with("text/event-stream");
    if !streaming || !is_stream {
        if streaming && !content_type.is_empty() && !content_type.contains("json") {
            return Err(AttemptFailure::Malformed(format!(
                "expected an event stream or a JSON body, got content-type {content_type:?}"
            )));
        }
        return answer.whole(pool, resp, ctx, streaming).await;
    }
    answer
        .first_token(pool, resp, ctx, head_deadline, hit_total(head_deadline))
        .await
}

/// The request as it goes to one variant: translated for it when it speaks the other
/// protocol, and how its answer is brought back.
struct Prepared {
    endpoint: Endpoint,
    body: Vec<u8>,
    /// Translates the answer back to the client's protocol (a variant of the other one).
    back: Option<translation::ResponseTranslator>,
    fixes: Vec<String>,
    /// Renames the answer's `model` to the name the client asked for.
    rename: Option<ModelRename>,
}

impl Prepared {
    fn new(
        pool: &Pool,
        vi: usize,
        req: &CanonicalRequest,
        ctx: &RequestCtx,
    ) -> Result<Prepared, AttemptFailure> {
        let variant = &pool.variants[vi].cfg;
        // A variant of the other protocol: the request translated for it (execution and the
        // relay check beforehand that it can be), the answer translated back.
        let translated = translation::translate_request(variant, req).map_err(|e| {
            AttemptFailure::Malformed(format!("cannot translate the request: {}", e.message))
        })?;
        let public = pool.cfg.response_model == ResponseModel::Public;
        let (endpoint, body, mut back, fixes) = match translated {
            None => (
                ctx.endpoint,
                req.upstream_view(&variant.upstream_model, &variant.params)
                    .to_vec(),
                None,
                Vec::new(),
            ),
            Some(t) => (
                t.endpoint,
                json_out::object_to_vec(&t.body),
                Some(t.response),
                t.fixes,
            ),
        };
        // The answer's `model`: the name the client asked for (translation already answers
        // with it), unless the pool keeps the upstream's.
        let protocol = ctx.endpoint.protocol();
        let rename = (public && back.is_none()).then(|| ModelRename::new(protocol, &req.model));
        if let (false, Some(b)) = (public, &mut back) {
            b.answer_as(&variant.upstream_model);
        }
        Ok(Prepared {
            endpoint,
            body,
            back,
            fixes,
            rename,
        })
    }
}

/// An upstream's answer on its way to becoming the attempt's result.
struct Answer {
    back: Option<translation::ResponseTranslator>,
    rename: Option<ModelRename>,
    headers: HeaderMap,
    started: Instant,
}

impl Answer {
    /// A non-success status: the client's own error (in its protocol) or a failure that
    /// fails over, with the upstream's wait when it gave one.
    async fn refused(self, resp: upstream::Response, ctx: &RequestCtx) -> AttemptResult {
        let status = resp.status;
        let h = &resp.headers;
        let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let retry_after_ms = parse_retry_after(
            get("retry-after-ms").as_deref(),
            get("retry-after").as_deref(),
            MAX_COOLDOWN_MS,
        );
        let read_until = (Instant::now() + Duration::from_secs(5)).min(ctx.deadline);
        let body = read_body(resp, MAX_ERROR_BODY_BYTES, read_until, self.started)
            .await
            .unwrap_or_default();
        // Identifiers only (see `error_summary`): the text reaches the client's give-up
        // message, logs and decision records.
        let message = serde_json::from_slice(&body)
            .map(|v| error_summary(&v))
            .unwrap_or_default();
        let failure = AttemptFailure::Status {
            status: status.as_u16(),
            retry_after_ms,
            message,
        };
        match failure.verdict() {
            Verdict::ReturnToClient => AttemptResult::ClientError(Served::Whole {
                status,
                body: match &self.back {
                    Some(b) => b.error(&body, status.as_u16()),
                    None => body,
                },
                headers: self.headers,
                usage: None,
            }),
            _ => AttemptResult::Failed(failure),
        }
    }

    /// A whole body: read, translated or renamed, and served whole, or as a stream made from
    /// it when the client asked for one.
    async fn whole(
        self,
        pool: &Pool,
        resp: upstream::Response,
        ctx: &RequestCtx,
        streaming: bool,
    ) -> Result<AttemptResult, AttemptFailure> {
        let status = resp.status;
        let protocol = ctx.endpoint.protocol();
        let body = read_body(resp, pool.limits.max_body_bytes, ctx.deadline, self.started).await?;
        let rename = self
            .rename
            .as_ref()
            .filter(|_| ctx.endpoint != Endpoint::CountTokens);
        if !streaming && self.back.is_none() {
            // Passed through as it came: checked and renamed on its bytes.
            if let Some(checked) = translation::checked_whole(&body, rename) {
                return Ok(AttemptResult::Served(Served::Whole {
                    status,
                    headers: self.headers,
                    body: checked.body,
                    usage: checked.usage,
                }));
            }
        }
        let mut value: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| AttemptFailure::Malformed(format!("response body is not JSON: {e}")))?;
        let mut body = body;
        if let Some(b) = &self.back {
            value = b.whole(&value).map_err(|e| {
                AttemptFailure::Malformed(format!("cannot translate the response: {e}"))
            })?;
            body = Bytes::from(value.to_string());
        } else if let Some(r) = rename {
            if r.whole(&mut value) {
                body = Bytes::from(value.to_string());
            }
        }
        if !streaming || !ctx.client_stream {
            if streaming {
                // Streamed upstream for assembly, answered whole: the answer itself, unless it
                // is an error dressed as a success.
                stream_from_whole(protocol, ctx.endpoint, &value)
                    .map_err(AttemptFailure::Malformed)?;
            }
            return Ok(AttemptResult::Served(Served::Whole {
                status,
                headers: self.headers,
                body,
                usage: None,
            }));
        }
        let pending =
            stream_from_whole(protocol, ctx.endpoint, &value).map_err(AttemptFailure::Malformed)?;
        Ok(AttemptResult::Served(Served::Stream(StreamStart {
            pending,
            read: Vec::new(),
            source: Source::empty(),
            headers: self.headers,
            first_token_at: Instant::now(),
            template: ChunkTemplate::default(),
        })))
    }

    /// A stream: read until its first token (the commit point), keeping the preamble and
    /// keep-alives before it; `total` says whether the deadline is the request's own.
    async fn first_token(
        self,
        pool: &Pool,
        resp: upstream::Response,
        ctx: &RequestCtx,
        head_deadline: Instant,
        total: bool,
    ) -> Result<AttemptResult, AttemptFailure> {
        let protocol = ctx.endpoint.protocol();
        // Fused: the relay may ask again after the end (see `next_events`).
        let mut source = Source::new(
            resp.body,
            SseDecoder::with_max_event_bytes(pool.limits.max_event_bytes),
            self.back.as_ref().map(|b| b.stream()),
        )
        // An assembled answer is given its name once, by the assembler (see
        // `RequestCtx::assembled`).
        .renaming(self.rename.filter(|_| !ctx.assembled));
        let mut head = Vec::new();
        let mut read = Vec::new();
        let mut events = Vec::new();
        let mut template = ChunkTemplate::default();
        loop {
            if let Err(end) = source.next(head_deadline, &mut events).await {
                return Err(match end {
                    ReadEnd::Timeout => timeout_failure(total, self.started),
                    other => other.failure("before the first token"),
                });
            }
            let mut drained = events.drain(..);
            for ev in drained.by_ref() {
                // Read as the relay reads events, once; an OpenAI stream's first text chunk
                // teaches the template the relay starts from.
                let facts = read_event_in(protocol, &ev, &mut template);
                if let Some(i) = facts.oversized {
                    return Err(AttemptFailure::Malformed(format!(
                        "an index of {i} (more than {MAX_OUTPUT_INDEX})"
                    )));
                }
                match &facts.role {
                    // Keep-alives while a server queues the request are forwarded once it
                    // answers, but not without bound; a preamble that never ends is broken.
                    EventRole::KeepAlive if head.len() >= MAX_PREAMBLE_EVENTS => {}
                    EventRole::Preamble if head.len() >= MAX_PREAMBLE_EVENTS => {
                        return Err(AttemptFailure::Malformed(format!(
                            "more than {MAX_PREAMBLE_EVENTS} events before the first token"
                        )))
                    }
                    EventRole::KeepAlive | EventRole::Preamble => {
                        // Neither carries text (output only does): nothing to copy.
                        read.push(facts.into_owned());
                        head.push(ev);
                    }
                    EventRole::Output | EventRole::Terminal => {
                        // Not kept: the template reads it again at a fraction of a parse.
                        drop(facts);
                        head.push(ev);
                        head.extend(drained);
                        return Ok(AttemptResult::Served(Served::Stream(StreamStart {
                            pending: head,
                            read,
                            source,
                            headers: self.headers,
                            first_token_at: Instant::now(),
                            template,
                        })));
                    }
                    EventRole::Error(m) => {
                        return Err(AttemptFailure::ErrorEvent(format!(
                            "before the first token: {m}"
                        )))
                    }
                    EventRole::Malformed(m) => return Err(AttemptFailure::Malformed(m.clone())),
                }
            }
        }
    }
}

/// Events (preamble, keep-alives) kept before the first token: far more than any server sends.
const MAX_PREAMBLE_EVENTS: usize = 1_000;
