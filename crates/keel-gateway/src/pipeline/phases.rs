//! The request pipeline's phases for one generation request, in the order it travels:
//!
//! ```text
//! admit ─▶ cache ─▶ plan ─▶ execute ─▶ deliver
//! ```
//!
//! - **admit** ([`super::admission`]): the key, its limits and quotas, the body parsed into the
//!   canonical request, normalization and the context-window fit; the per-request context
//!   ([`RequestCtx`]) is made here.
//! - **cache** ([`super::cache`]): a hit is answered at once; a miss carries its capture on to
//!   delivery; identical requests in flight follow the leader's stream.
//! - **plan** ([`super::selection`]): the ordered variants to try (live selection, the wait line
//!   of a full pool), the canary's side first, and the decision record begun.
//! - **execute** ([`super::execution`]): attempts with failover and hedging until one answers
//!   or none can, waiting for the fleet while every variant tried is loading or restarting.
//! - **deliver** ([`super::delivery`]): the answer in the client's protocol; a stream goes on in
//!   the relay ([`super::relay`]) with mid-stream migration.
//!
//! Each phase reads the [`Flight`] (the request, its context, its access-log entry) and
//! extends it; a phase that answers the request itself (an error, a cache hit, a consensus)
//! returns the response as `Err`, which ends the pipeline.

use crate::observe::record::DecisionRecord;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use tokio::time::Instant;

use keel_core::members::Members;
use keel_core::protocol::{Endpoint, ErrorKind, Protocol};
use keel_core::request::CanonicalRequest;

use crate::config::Identity;
use crate::observe::access_log::RequestLog;
use crate::observe::decisions::Draft;
use crate::observe::telemetry::RequestSpan;
use crate::pipeline::admission::{self, Admitted};
use crate::pipeline::cache::{self, Capture, Lookup};
use crate::pipeline::context::{ClientApi, Priority, RequestCtx};
use crate::pipeline::delivery;
use crate::pipeline::execution::{self, Executed, Outcome};
use crate::pipeline::selection::{select_or_wait, Controls, Selection};
use crate::pipeline::settlement::Attempts;
use crate::state::capacity::{Throttle, ThrottleReason};
use crate::state::pools::Pool;
use crate::wire::body::{full_body, Body};
use crate::wire::errors::GatewayError;
use crate::Gateway;
use keel_core::canary::Side;

/// A phase's result: the request goes on with `T`, or the phase answered it.
type Phase<T> = Result<T, Answer>;

/// How a phase ends the pipeline early.
enum Answer {
    /// The client's error, in its protocol.
    Error(GatewayError),
    /// The response cache's answer.
    Cached(Arc<cache::Entry>),
    /// The stream of an identical request in flight, followed live.
    Follow(cache::flight::Follower),
}

impl From<GatewayError> for Answer {
    fn from(e: GatewayError) -> Self {
        Answer::Error(e)
    }
}

/// Runs every phase, in order, for one generation request.
///
/// An async block capturing the request once (an async fn keeps a by-value argument twice),
/// and what follows admission is one future made by [`take_off`] and awaited where it is made:
/// a future held in a local first, or a local the block borrows, stays in the block's state
/// beside it across the await, and every move of the request's future copies that state.
#[allow(clippy::manual_async_fn)] // an async fn would hold its arguments twice
pub fn run(
    gw: &Arc<Gateway>,
    api: ClientApi,
    req: Request<Incoming>,
    started: Instant,
) -> impl Future<Output = Response<Body>> + use<'_> {
    async move {
        let endpoint = api.endpoint();
        let id = crate::wire::request_id::new();
        let (parts, body) = req.into_parts();
        gw.record_request();
        // The request's span (only when tracing is configured), continuing the client's trace.
        let trace =
            gw.telemetry
                .start_request(&parts.headers, parts.uri.path(), endpoint, started, &id);
        match admission::admit(gw, api, &parts, body, &id, started).await {
            Ok(admitted) => take_off(gw, api, admitted, &parts, &id, started, trace).await,
            Err(e) => refused(gw, api, &parts, &id, started, trace, &e),
        }
    }
}

/// The answer to a request admission refused.
fn refused(
    gw: &Arc<Gateway>,
    api: ClientApi,
    parts: &http::request::Parts,
    id: &str,
    started: Instant,
    trace: Option<RequestSpan>,
    e: &GatewayError,
) -> Response<Body> {
    let mut log = gw.request_log(id, started, api.label(), "none");
    log.trace = trace;
    let record = DecisionRecord::bare(id, "none");
    log.decision = Some(Draft::new(gw.decision_log(), started, record));
    if let Ok(Some(key)) = gw.keys.authenticate(&parts.headers) {
        log.key = key.id.clone();
        log.tenant = key.tenant.clone();
    }
    if e.kind == ErrorKind::RateLimited {
        log.route = "throttled";
    }
    let mut resp = delivery::error_response(log, api.endpoint().protocol(), e);
    cache::stamp(resp.headers_mut(), "bypass");
    resp
}

/// An admitted request's flight (or the client's error for its cache controls), its response
/// given the key's limits in its headers.
fn take_off<'g>(
    gw: &'g Arc<Gateway>,
    api: ClientApi,
    admitted: Admitted,
    parts: &http::request::Parts,
    id: &'g str,
    started: Instant,
    trace: Option<RequestSpan>,
) -> impl Future<Output = Response<Body>> + 'g {
    use futures_util::future::{ready, Either, FutureExt};
    let protocol = api.endpoint().protocol();
    let views = admitted.ctx.grant.as_ref().map(|g| g.views.clone());
    let flight = match cache::Control::from_headers(&parts.headers) {
        Ok(control) => {
            Either::Left(Flight::new(gw, api, admitted, id, started, trace).fly(control))
        }
        Err(e) => {
            let mut log = gw.request_log(id, started, api.label(), &admitted.pool.cfg.name);
            log.trace = trace;
            Either::Right(ready(delivery::error_response(log, protocol, &e)))
        }
    };
    flight.map(move |mut resp| {
        if let Some(views) = views {
            let now = crate::state::keys::limits::unix_now_ms();
            crate::state::keys::headers::apply(resp.headers_mut(), protocol, &views, now);
        }
        cache::stamp(resp.headers_mut(), "bypass");
        resp
    })
}

/// An admitted request on its way through the phases after admission.
pub struct Flight<'g> {
    pub(super) gw: &'g Arc<Gateway>,
    id: &'g str,
    started: Instant,
    endpoint: Endpoint,
    pub(super) pool: Arc<Pool>,
    pub(super) req: CanonicalRequest,
    pub(super) ctx: RequestCtx,
    /// The request's access-log entry, finished when the request ends.
    pub(super) log: RequestLog,
}

/// What planning decided: the variants to try in order, the attempt ledger it began, and the
/// canary side the order was steered to.
struct Plan {
    order: Vec<usize>,
    attempts: Attempts,
    side: Option<Side>,
}

impl<'g> Flight<'g> {
    fn new(
        gw: &'g Arc<Gateway>,
        api: ClientApi,
        admitted: Admitted,
        id: &'g str,
        started: Instant,
        trace: Option<RequestSpan>,
    ) -> Flight<'g> {
        let Admitted {
            req,
            pool,
            mut ctx,
            fingerprint,
        } = admitted;
        let mut log = gw.request_log(id, started, api.label(), &pool.cfg.name);
        log.fingerprint = fingerprint;
        log.usage = Some((ctx.meter.clone(), req.estimated_input_tokens));
        log.trace = trace.clone();
        ctx.trace = trace;
        log.health_of = Some(pool.clone());
        log.guard = ctx
            .guard
            .as_ref()
            .map(|g| g.summary())
            .filter(|s| !s.is_empty());
        if let Some(grant) = &ctx.grant {
            log.key = grant.key.id.clone();
            log.tenant = grant.key.tenant.clone();
        }
        Flight {
            gw,
            id,
            started,
            endpoint: api.endpoint(),
            pool,
            req,
            ctx,
            log,
        }
    }

    pub(super) fn protocol(&self) -> Protocol {
        self.endpoint.protocol()
    }

    /// The phases after admission.
    ///
    /// An async block rather than an async fn, here and in the phases it awaits: an async fn
    /// keeps a by-value argument twice in its state (as the argument, and as the local it is
    /// moved into), and every move of the request's future copies its whole state; the flight
    /// alone is 1.3 KB.
    #[allow(clippy::manual_async_fn)] // an async fn would hold the flight twice
    fn fly(mut self, control: cache::Control) -> impl Future<Output = Response<Body>> + 'g {
        async move {
            if let Some(resp) = self.estimate_tokens() {
                return resp;
            }
            // The lookup's state (4.7 KB) is boxed, and only for a pool with a cache: inline, it
            // would be in every flight's state.
            let looked_up = if self.pool.cfg.cache.enabled {
                Box::pin(self.cache(control)).await
            } else {
                Ok(None)
            };
            let capture = match looked_up {
                Ok(capture) => capture,
                Err(answer) => return self.answer(answer),
            };
            let cache_state = if capture.is_some() { "miss" } else { "bypass" };
            let plan = match self.plan().await {
                Ok(plan) => plan,
                Err(answer) => return self.answer(answer),
            };
            // A consensus asks several variants at once and merges their answers (execution
            // and delivery in one); rare, so its state is boxed rather than in every flight's.
            if let Some(n) = self.ctx.consensus {
                let merged = crate::pipeline::consensus::run(self, &plan.order, plan.attempts, n);
                return Box::pin(merged).await;
            }
            self.stream_upstream();
            let (executed, order) = match self.execute(plan).await {
                Ok(done) => done,
                Err(answer) => return self.answer(answer),
            };
            let mut resp = self.deliver(executed, order, capture).await;
            cache::stamp(resp.headers_mut(), cache_state);
            resp
        }
    }

    /// The response for a phase that answered the request itself.
    fn answer(self, answer: Answer) -> Response<Body> {
        let protocol = self.protocol();
        let Flight {
            gw,
            pool,
            req,
            ctx,
            log,
            ..
        } = self;
        let decisions = gw.decision_log();
        match answer {
            Answer::Error(e) => delivery::error_response(log, protocol, &e),
            Answer::Cached(entry) => {
                cache::replay::respond(&pool, &ctx, &req.model, entry, log, decisions)
            }
            Answer::Follow(follower) => {
                cache::replay::follow(&pool, &ctx, follower, log, decisions)
            }
        }
    }

    /// OpenAI-protocol servers have no count_tokens endpoint: such a pool answers with keel's
    /// estimate.
    fn estimate_tokens(&mut self) -> Option<Response<Body>> {
        if self.endpoint != Endpoint::CountTokens || self.pool.speaks(Protocol::Anthropic) {
            return None;
        }
        let body = json!({"input_tokens": self.req.estimated_input_tokens}).to_string();
        let log = &mut self.log;
        log.status = 200;
        log.variant = "keel-estimate".into();
        let mut resp = full_body(StatusCode::OK, "application/json", Bytes::from(body));
        log.stamp_overhead(resp.headers_mut());
        log.finish("ok", None);
        Some(resp)
    }

    /// The response cache: a hit (or a follower of an identical request in flight) is answered
    /// now; a miss carries its capture on to delivery.
    async fn cache(&mut self, control: cache::Control) -> Phase<Option<Capture>> {
        let Flight {
            gw, pool, req, ctx, ..
        } = self;
        match gw.cache.lookup(gw, pool, req, ctx, control).await {
            Lookup::Hit { entry, .. } => Err(Answer::Cached(entry)),
            Lookup::Follow(follower) => Err(Answer::Follow(follower)),
            Lookup::Miss(c) => {
                self.log.cache = "miss";
                Ok(Some(*c))
            }
            Lookup::Bypass(_) => Ok(None),
        }
    }

    /// The request's rank and preferences, as selection takes them.
    fn controls(&self) -> Controls<'_> {
        Controls {
            force_variant: self.ctx.force_variant.as_deref(),
            preference: self.ctx.preference,
            min_tier: self.ctx.min_tier,
            priority: self.ctx.priority,
        }
    }

    /// Selection for this request, waiting in the pool's line within its deadline.
    fn select<'s>(
        &'s self,
        pool: &'s Arc<Pool>,
    ) -> impl Future<Output = (Selection, Option<DecisionRecord>)> + 's {
        select_or_wait(pool, &self.req, self.controls(), self.id, self.ctx.deadline)
    }

    /// Selection (waiting in the pool's line when every variant is full), the decision record
    /// begun, and the canary's side put first (a forced variant stays first).
    async fn plan(&mut self) -> Phase<Plan> {
        let pool = self.pool.clone();
        pool.note_priority(self.ctx.priority, pool.now_ms());
        let (selection, record) = self.select(&pool).await;
        // The record is completed by the attempts and the log, and kept when both are done
        // (see `decisions`).
        let mut record = record.unwrap_or_else(|| DecisionRecord::bare(self.id, &pool.cfg.name));
        record.prompt_edits = self.ctx.prompt_edits.clone();
        let draft = Draft::new(self.gw.decision_log(), self.started, record);
        self.log.decision = Some(draft.clone());
        let mut attempts = Attempts::new(self.gw, &pool, Some(draft));
        attempts.priority = self.ctx.priority;
        attempts.trace = self.ctx.trace.clone();
        attempts.prompt_tokens = std::num::NonZeroU32::new(
            u32::try_from(self.req.estimated_input_tokens).unwrap_or(u32::MAX),
        );
        let mut order = self.order_or_answer(selection)?;
        let side = match (&pool.canary, &self.ctx.force_variant) {
            (Some(c), None) => Some(c.side(&self.canary_identity(c.identity()), pool.now_ms())),
            _ => None,
        };
        if let (Some(c), Some(side)) = (&pool.canary, side) {
            crate::state::canary::steer(c, side, &mut order);
            if let Some(draft) = &self.log.decision {
                draft.update(|r| {
                    r.canary = Some(side.as_str());
                    r.plan = order
                        .iter()
                        .map(|i| pool.variants[*i].cfg.name.clone())
                        .collect();
                });
            }
        }
        Ok(Plan {
            order,
            attempts,
            side,
        })
    }

    /// What places this request on a canary's side; a request without the identity is placed
    /// by its request id: at random, in proportion to the weight.
    fn canary_identity(&self, identity: &Identity) -> String {
        let (req, ctx) = (&self.req, &self.ctx);
        let who = match identity {
            Identity::Key => ctx.grant.as_ref().map(|g| g.key.id.clone()),
            Identity::Tenant => ctx.grant.as_ref().map(|g| g.key.tenant.clone()),
            Identity::User => req
                .body
                .member("user")
                .or_else(|| {
                    req.body
                        .member("metadata")
                        .and_then(|m| m.member("user_id"))
                })
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned),
            Identity::Header(h) => ctx
                .forwarded
                .get(h.as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        };
        who.unwrap_or_else(|| ctx.id.clone())
    }

    /// The plan a selection produced, or the client's error.
    fn order_or_answer(&mut self, selection: Selection) -> Phase<Vec<usize>> {
        if matches!(selection, Selection::Throttled(_) | Selection::Full) {
            self.log.route = "throttled";
        }
        Ok(plan_or_error(&self.pool, selection)?)
    }

    /// The request as it goes upstream. A non-streaming generation is streamed upstream (and
    /// assembled in delivery) so that migration protects it too, where one can happen: a pool
    /// of one variant has nowhere to continue a generation (a migration never returns to the
    /// variant it left), so there the whole answer is passed through, and neither the server
    /// nor keel pays for a stream that protects nothing. count_tokens and embeddings are whole
    /// answers, only ever failed over before the response.
    fn stream_upstream(&mut self) {
        let pool = &self.pool;
        let r = &mut self.req;
        let can_migrate = pool.max_migrations() > 0 && pool.variants.len() > 1;
        if !r.stream
            && self.endpoint.generates()
            && pool.cfg.assemble_non_streaming
            && (can_migrate || pool.cfg.integrity.is_some())
        {
            r.stream = true;
            r.body
                .insert("stream".into(), serde_json::Value::Bool(true));
            if self.endpoint.protocol() == Protocol::OpenAi {
                r.body
                    .insert("stream_options".into(), json!({"include_usage": true}));
            }
        }
    }

    /// Attempts down the plan until one answers or none can. While every variant tried is
    /// still loading its model or restarting, it waits for the first that is ready (selection
    /// waits while the monitor finds out), within the deadline; attempts on variants that fail
    /// otherwise count against `max_attempts`, which bounds the loop.
    fn execute(
        &mut self,
        plan: Plan,
    ) -> impl Future<Output = Phase<(Executed, Vec<usize>)>> + use<'_, 'g> {
        let pool = self.pool.clone();
        let Plan {
            mut order,
            mut attempts,
            side,
        } = plan;
        async move {
            loop {
                let before = attempts.len();
                let executed =
                    execution::execute(&pool, &self.req, &self.ctx, &order, attempts).await;
                let wait_for_fleet = matches!(executed.outcome, Outcome::Failed(_))
                    && executed.attempts.len() > before
                    && executed.attempts.restart_like()
                    && Instant::now() < self.ctx.deadline;
                if !wait_for_fleet {
                    return Ok((executed, order));
                }
                attempts = executed.attempts;
                let (selection, _) = self.select(&pool).await;
                order = self.order_or_answer(selection)?;
                if let (Some(c), Some(side)) = (&pool.canary, side) {
                    crate::state::canary::steer(c, side, &mut order);
                }
            }
        }
    }
}

/// The plan selection produced, or the client's error when there is none.
fn plan_or_error(pool: &Pool, selection: Selection) -> Result<Vec<usize>, GatewayError> {
    match selection {
        Selection::Plan(order) => Ok(order),
        Selection::Unavailable { retry_after_ms } => {
            let e = GatewayError::new(
                ErrorKind::Overloaded,
                format!("every variant of `{}` is cooling down", pool.cfg.name),
            )
            .with_retry_after(retry_after_ms);
            Err(e)
        }
        Selection::Full => Err(throttled(
            pool,
            Throttle {
                reason: ThrottleReason::Timeout,
                priority: Priority::default(),
                retry_after_ms: pool.expected_wait_ms().unwrap_or(1000).max(1),
                ahead: pool.line.waiting() as usize,
            },
        )),
        Selection::Throttled(t) => Err(throttled(pool, t)),
        Selection::TooLong {
            needed,
            largest,
            lower_bound,
        } => Err(too_long(pool, needed, largest, lower_bound)),
        Selection::NoTier { min_tier } => {
            let e = GatewayError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "x-keel-min-tier: `{}` has no variant of tier {min_tier} or better",
                    pool.cfg.name
                ),
            );
            Err(e)
        }
        Selection::NoSuchVariant(name) => {
            let e = GatewayError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "x-keel-force-variant: `{}` has no variant `{name}`",
                    pool.cfg.name
                ),
            );
            Err(e)
        }
        Selection::Loading => Err(GatewayError::new(
            ErrorKind::Overloaded,
            crate::pipeline::settlement::loading_message(pool, true),
        )
        .with_retry_after(crate::pipeline::settlement::LOADING_RETRY_AFTER_MS)),
    }
}

/// The wait line's refusal: 429 when the line is full for the request's priority, 503 when the
/// fleet cannot serve it in time; counted by reason.
fn throttled(pool: &Pool, t: Throttle) -> GatewayError {
    pool.metrics
        .counter(
            "keel_queue_refused_total",
            &[("pool", &pool.cfg.name), ("reason", t.reason.as_str())],
        )
        .increment(1);
    let name = &pool.cfg.name;
    let (kind, message) = match t.reason {
        ThrottleReason::Full => (
            ErrorKind::RateLimited,
            format!("the wait line of `{name}` is full for {} priority: {} requests that rank before this one are waiting", t.priority.as_str(), t.ahead),
        ),
        ThrottleReason::Displaced => (
            ErrorKind::RateLimited,
            format!("a request of higher rank took this one's place in the full wait line of `{name}`"),
        ),
        ThrottleReason::Deadline => (
            ErrorKind::Overloaded,
            format!("every variant of `{name}` is at its concurrency limit and the expected wait ({} ms, {} requests ahead) is longer than this request may wait", t.retry_after_ms, t.ahead),
        ),
        ThrottleReason::Timeout => (
            ErrorKind::Overloaded,
            format!("every variant of `{name}` stayed at its concurrency limit for as long as this request may wait"),
        ),
    };
    GatewayError::new(kind, message).with_retry_after(t.retry_after_ms)
}

/// The 400 for a prompt that fits no variant's context window, naming the sizes.
fn too_long(pool: &Pool, needed: u64, largest: u64, lower_bound: bool) -> GatewayError {
    let about = if lower_bound { "more than" } else { "about" };
    let trimmed = if pool.cfg.middle_out {
        " even after middle-out trimming (the system prompt, the first user message and the last turn are always kept)"
    } else {
        ""
    };
    GatewayError::new(
        ErrorKind::InvalidRequest,
        format!(
            "context length exceeded: the request needs {about} {needed} tokens (prompt + max_tokens){trimmed}, but the largest context window in `{}` is {largest} tokens",
            pool.cfg.name
        ),
    )
    .with_code("context_length_exceeded")
}

#[cfg(test)]
mod tests {
    /// Every request's handler future is built on the stack and moved into its box (see
    /// `http::server::handle`): its size is bytes copied a request, and memory held until the
    /// response head is out. Stages awaited only on some paths are boxed where they are taken
    /// (assembling a whole answer: `delivery`, a cache lookup: `Flight::fly`) so that they do
    /// not enlarge every request's, and the phases hold their by-value arguments once (async
    /// blocks, not async fns). The bound is the test profile's (unoptimized: 7.5 KB; 12.2 KB
    /// with each argument held twice and the cache lookup inline).
    #[test]
    fn a_requests_handler_future_stays_small() {
        fn returned_size<A, B, C, D, R>(_: impl FnOnce(A, B, C, D) -> R) -> usize {
            std::mem::size_of::<R>()
        }
        let size = returned_size(super::run);
        eprintln!("phases::run's future: {size} bytes");
        assert!(size <= 8_000, "phases::run's future is {size} bytes");
    }
}
