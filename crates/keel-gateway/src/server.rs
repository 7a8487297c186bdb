//! The HTTP server: accept loop (each connection served by [`crate::connection`]: HTTP/1.1 and
//! h2c, or HTTPS through [`crate::tls`] with `[tls]`; a header-read timeout so slow clients
//! cannot hold connections; at most `max_connections` open, see [`crate::conn_limit`]), graceful
//! shutdown with a drain deadline, and routing.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::time::Instant;

use keel_core::protocol::{Endpoint, ErrorKind, Protocol};

use crate::access_log::RequestLog;
use crate::cache::{self, Lookup};
use crate::capacity::{Throttle, ThrottleReason};
use crate::config::KeyConfig;
use crate::conn_limit::ConnLimit;
use crate::connection::Http;
use crate::context::{ClientApi, Priority};
use crate::decisions::Draft;
use crate::delivery;
use crate::errors::GatewayError;
use crate::execution::Outcome;
use crate::graceful::GracefulShutdown;
use crate::live::Live;
use crate::pools::Pool;
use crate::routes::{self, Plane, Resolved, Target};
use crate::selection::{select_or_wait, Controls, DecisionRecord, Selection};
use crate::settlement::Attempts;
use crate::{admission, execution, full_body, openapi, Body, Gateway};

/// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests (streams
/// included) finish for up to `drain_ms` (see [`serve_live`]). The config cannot be reloaded.
pub async fn serve(
    gw: Arc<Gateway>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    serve_live(Live::new(gw, None), listener, shutdown).await
}

/// The sockets keel serves: the main one and, with `admin_listen`, the operations plane's own.
pub struct Listeners {
    pub main: TcpListener,
    /// When set, `/keel/*` and `/metrics` are served here only, and `/v1/*` only on `main`.
    pub admin: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    fn from(main: TcpListener) -> Listeners {
        Listeners { main, admin: None }
    }
}

/// Which routes a listener serves (see `routes::Plane`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serves {
    /// Every route: keel has one listener.
    All,
    /// The data plane, beside an admin listener.
    Data,
    /// The operations plane (`admin_listen`).
    Ops,
}

impl Serves {
    fn serves(self, plane: Plane) -> bool {
        match (self, plane) {
            (Serves::All, _) | (_, Plane::Both) => true,
            (Serves::Data, p) => p == Plane::Data,
            (Serves::Ops, p) => p == Plane::Ops,
        }
    }
}

/// The next connection on `listener`, or never when there is none.
async fn accept_on(
    listener: Option<&TcpListener>,
) -> std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// A listening socket on `addr` whose kernel queue holds `backlog` connections not yet
/// accepted (see `Config::listen_backlog`): a burst of new connections waits there while the
/// workers are busy, instead of having its SYNs dropped and retried a second or more later.
pub fn listen(addr: std::net::SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As the runtime's own `bind` does: a restart may bind while the last process's
    // connections linger in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// How long streams cut at the drain deadline get to send their error event before exit.
const CUT_FLUSH: Duration = Duration::from_secs(2);

/// Serves the current generation of `live` until `shutdown` resolves; then drains: stops
/// accepting, fails readiness, lets in-flight requests (streams included) finish for up to
/// `drain_ms`, then ends the streams still running with an explicit error event (see `live`).
pub async fn serve_live(
    live: Arc<Live>,
    listeners: impl Into<Listeners>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let Listeners {
        main: listener,
        admin,
    } = listeners.into();
    let main_serves = if admin.is_some() {
        Serves::Data
    } else {
        Serves::All
    };
    let first = live.current();
    let graceful = GracefulShutdown::new();
    let http = Arc::new(Http::new(
        Duration::from_millis(first.cfg.header_read_timeout_ms),
        Duration::from_millis(first.cfg.idle_timeout_ms),
        Some(Duration::from_millis(first.cfg.client_write_timeout_ms)),
        &first.metrics,
    ));
    let connections = ConnLimit::new(first.cfg.max_connections, &first.metrics);
    tokio::pin!(shutdown);
    live.start_tasks();
    live.watch_source();
    loop {
        let (accepted, serves) = tokio::select! {
            a = listener.accept() => (a, main_serves),
            a = accept_on(admin.as_ref()) => (a, Serves::Ops),
            _ = &mut shutdown => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(slot) = connections.take() else {
            connections.refuse(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        // The certificate of the generation current at accept (a reload rotates it for the
        // connections that follow).
        let tls = live.current().cfg.tls.as_ref().map(|t| t.acceptor.clone());
        let live = live.clone();
        // Each request runs on the generation current at its start.
        let svc = hyper::service::service_fn(move |req| handle(live.current(), req, serves));
        // Taken here, not in the task: a shutdown that starts while the connection's first
        // bytes are awaited still waits for it (and tells it to close).
        let watcher = graceful.watcher();
        let http = http.clone();
        tokio::spawn(async move {
            match tls {
                Some(tls) => crate::tls::serve(http, tls, tcp, svc, watcher).await,
                None => http.serve(tcp, svc, watcher).await,
            }
            drop(slot);
        });
    }
    let process = first.process.clone();
    process.begin_drain();
    drop(listener);
    drop(admin);
    live.stop_tasks();
    let drain_ms = live.current().cfg.drain_ms;
    tracing::info!(drain_ms, "shutting down: draining in-flight requests");
    let all_closed = graceful.shutdown();
    tokio::pin!(all_closed);
    tokio::select! {
        _ = &mut all_closed => tracing::info!("drained"),
        _ = tokio::time::sleep(Duration::from_millis(drain_ms)) => {
            tracing::warn!("drain deadline reached; streams still running end with an error event");
            process.cut_streams();
            if tokio::time::timeout(CUT_FLUSH, &mut all_closed).await.is_err() {
                tracing::warn!("closing the connections still open");
            }
        }
    }
    Ok(())
}

/// Routes one request. A panic anywhere in its handling is answered with a 500 in the
/// client's protocol (and counted, see `access_log`), never a dropped connection with no word.
pub async fn handle(
    gw: Arc<Gateway>,
    req: Request<Incoming>,
    serves: Serves,
) -> Result<Response<Body>, Infallible> {
    let protocol = client_protocol(&req);
    // Boxed: hyper keeps one allocation of the service future's size per connection for as
    // long as the connection lives (a live stream's included, long after its head was sent).
    // Inline, the four stages made that 18 KB a connection; boxed, it is this 0.5 KB frame
    // and the stages' memory is freed once the response head is out (bench/RESULTS.md,
    // issue 16, memory per stream).
    let handled = std::panic::AssertUnwindSafe(Box::pin(route(gw, req, serves)))
        .catch_unwind()
        .await;
    Ok(handled.unwrap_or_else(|_| {
        tracing::error!("a request handler panicked; answered 500");
        GatewayError::new(
            ErrorKind::Internal,
            "keel: internal error while handling the request",
        )
        .to_response(protocol)
    }))
}

/// The protocol a client speaks, by path (or `anthropic-version` for shared paths).
fn client_protocol(req: &Request<Incoming>) -> Protocol {
    let anthropic_client = req.headers().contains_key("anthropic-version");
    Endpoint::from_path(req.uri().path())
        .map(Endpoint::protocol)
        .unwrap_or(if anthropic_client {
            Protocol::Anthropic
        } else {
            Protocol::OpenAi
        })
}

async fn route(gw: Arc<Gateway>, req: Request<Incoming>, serves: Serves) -> Response<Body> {
    let started = Instant::now();
    let path = req.uri().path().to_owned();
    let anthropic_client = req.headers().contains_key("anthropic-version");
    let protocol = client_protocol(&req);
    let json = |body: String| full_body(StatusCode::OK, "application/json", Bytes::from(body));
    let resolved = match routes::resolve(req.method(), &path) {
        // The other listener's routes do not exist on this one.
        Resolved::Route(t, _) if !serves.serves(t.plane()) => Resolved::NotFound,
        r => r,
    };
    if let Resolved::Route(target, _) = resolved {
        if let Err(e) = gw.keys.authorize(target.access(), req.headers(), req.uri()) {
            return own_answer(e.to_response(protocol));
        }
    }
    if let Resolved::Route(Target::Generation(api), _) = resolved {
        if gw.process.draining() {
            // A request on a connection still open after shutdown began.
            return GatewayError::new(
                ErrorKind::Overloaded,
                "keel is shutting down: send the request again (another replica will take it)",
            )
            .with_retry_after(1000)
            .to_response(protocol);
        }
        return handle_generation(&gw, api, req, started).await;
    }
    let resp = match resolved {
        Resolved::Route(Target::Generation(_), _) => unreachable!("handled above"),
        Resolved::Route(Target::Models, _) => match gw.keys.authenticate(req.headers()) {
            Ok(key) => models(&gw, key.as_deref(), anthropic_client),
            Err(e) => e.to_response(protocol),
        },
        Resolved::Route(Target::Model, id) => match gw.keys.authenticate(req.headers()) {
            Ok(key) => model(
                &gw,
                key.as_deref(),
                anthropic_client,
                id.unwrap_or_default(),
                protocol,
            ),
            Err(e) => e.to_response(protocol),
        },
        Resolved::Route(Target::KeyUsage, id) => {
            match crate::keys::admin::usage(&gw, id.unwrap_or_default()).await {
                Ok(doc) => json(doc.to_string()),
                Err(e) => e.to_response(protocol),
            }
        }
        Resolved::Route(Target::SafeMode, _) => {
            let (parts, body) = req.into_parts();
            match crate::safe_mode::admin::safe_mode(&gw, &parts, body).await {
                Ok(doc) => json(doc.to_string()),
                Err(e) => e.to_response(protocol),
            }
        }
        Resolved::Route(Target::Shadow, pool) => {
            match crate::rollout_api::shadow(&gw, &percent_decode(pool.unwrap_or_default())) {
                Ok(doc) => json(doc.to_string()),
                Err(e) => e.to_response(protocol),
            }
        }
        Resolved::Route(Target::Reload, _) => match crate::live::admin::reload(&gw).await {
            Ok(doc) => json(doc.to_string()),
            Err(e) => e.to_response(protocol),
        },
        Resolved::Route(t @ (Target::CanaryPromote | Target::CanaryRollback), pool) => {
            let name = percent_decode(pool.unwrap_or_default());
            let promote = t == Target::CanaryPromote;
            match crate::rollout_api::canary_order(&gw, &name, promote) {
                Ok(doc) => json(doc.to_string()),
                Err(e) => e.to_response(protocol),
            }
        }
        Resolved::Route(Target::Ready, _) => {
            let (status, doc) = crate::live::admin::ready(&gw);
            full_body(status, "application/json", Bytes::from(doc.to_string()))
        }
        Resolved::Route(Target::Live, _) => json(crate::live::admin::live(&gw).to_string()),
        Resolved::Route(Target::Health, _) => health(&gw),
        Resolved::Route(Target::Decisions, _) => {
            match crate::decisions::Query::parse(req.uri().query()) {
                Ok(q) => crate::decisions::document(gw.decision_log().query(&q)),
                Err(m) => {
                    GatewayError::new(ErrorKind::InvalidRequest, format!("/keel/decisions: {m}"))
                        .to_response(Protocol::OpenAi)
                }
            }
        }
        Resolved::Route(Target::Decision, request_id) => {
            let request_id = percent_decode(request_id.unwrap_or_default());
            match gw.decision_log().get(&request_id) {
                Some(r) => json(serde_json::to_string(&*r).unwrap_or_else(|_| "{}".into())),
                None => GatewayError::new(
                    ErrorKind::NotFound,
                    format!("no decision record for request `{request_id}`: unknown, or no longer kept (the latest {} are)", gw.cfg.decisions_kept),
                )
                .to_response(Protocol::OpenAi),
            }
        }
        Resolved::Route(Target::Metrics, _) => {
            // Process-wide, counted where lines are queued (see `log_writer`).
            gw.metrics
                .counter("keel_log_lines_dropped_total", &[])
                .absolute(crate::log_writer::dropped());
            full_body(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                Bytes::from(gw.metrics.render()),
            )
        }
        Resolved::Route(Target::OpenApi, _) => json(openapi::document_text()),
        Resolved::Route(Target::Events, _) => crate::events::subscribe(&gw),
        Resolved::Route(Target::Dashboard, _) => crate::events::dashboard(),
        Resolved::MethodNotAllowed => {
            let mut r = GatewayError::new(
                ErrorKind::InvalidRequest,
                format!("method {} is not allowed on {path}", req.method()),
            )
            .to_response(protocol);
            *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
            r
        }
        Resolved::NotFound => GatewayError::new(
            ErrorKind::NotFound,
            format!("no route for {} {path}", req.method()),
        )
        .to_response(protocol),
    };
    own_answer(resp)
}

/// keel's own answers carry a request id and a route too.
fn own_answer(mut resp: Response<Body>) -> Response<Body> {
    let id = crate::request_id::new();
    let route = delivery::own_route(resp.status());
    delivery::keel_headers(resp.headers_mut(), &id, route, "none", 0);
    resp
}

/// The four stages, in order, for one generation request.
pub async fn handle_generation(
    gw: &Arc<Gateway>,
    api: ClientApi,
    req: Request<Incoming>,
    started: Instant,
) -> Response<Body> {
    let endpoint = api.endpoint();
    let protocol = endpoint.protocol();
    let id = crate::request_id::new();
    let (parts, body) = req.into_parts();
    gw.record_request();
    // The request's span (only when tracing is configured), continuing the client's trace.
    let trace =
        gw.telemetry
            .start_request(&parts.headers, parts.uri.path(), endpoint, started, &id);

    // Stage 0: admission.
    let admitted = match admission::admit(gw, api, &parts, body, &id, started).await {
        Ok(a) => a,
        Err(e) => {
            let mut log = RequestLog::new(gw, &id, started, api.label(), "none");
            log.trace = trace;
            let record = DecisionRecord::bare(&id, "none");
            log.decision = Some(Draft::new(gw.decision_log(), started, record));
            if let Ok(Some(key)) = gw.keys.authenticate(&parts.headers) {
                log.key = key.id.clone();
                log.tenant = key.tenant.clone();
            }
            if e.kind == ErrorKind::RateLimited {
                log.route = "throttled";
            }
            let mut resp = delivery::error_response(log, protocol, &e);
            cache::stamp(resp.headers_mut(), "bypass");
            return resp;
        }
    };
    let views = admitted.ctx.grant.as_ref().map(|g| g.views.clone());
    let mut resp = match cache::Control::from_headers(&parts.headers) {
        Ok(control) => stages(gw, api, admitted, control, &id, started, trace).await,
        Err(e) => {
            let mut log = RequestLog::new(gw, &id, started, api.label(), &admitted.pool.cfg.name);
            log.trace = trace;
            delivery::error_response(log, protocol, &e)
        }
    };
    if let Some(views) = views {
        let now = crate::keys::limits::unix_now_ms();
        crate::keys::headers::apply(resp.headers_mut(), protocol, &views, now);
    }
    cache::stamp(resp.headers_mut(), "bypass");
    resp
}

/// Stages 1 to 3 for an admitted request.
async fn stages(
    gw: &Arc<Gateway>,
    api: ClientApi,
    admitted: admission::Admitted,
    control: cache::Control,
    id: &str,
    started: Instant,
    trace: Option<crate::telemetry::RequestSpan>,
) -> Response<Body> {
    let endpoint = api.endpoint();
    let protocol = endpoint.protocol();
    let admission::Admitted { req, pool, mut ctx } = admitted;
    let mut log = RequestLog::new(gw, id, started, api.label(), &pool.cfg.name);
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
    if endpoint == Endpoint::CountTokens && !pool.speaks(Protocol::Anthropic) {
        // OpenAI-protocol servers have no count_tokens endpoint: answer with keel's estimate.
        let body = json!({"input_tokens": req.estimated_input_tokens}).to_string();
        log.status = 200;
        log.variant = "keel-estimate".into();
        let mut resp = full_body(StatusCode::OK, "application/json", Bytes::from(body));
        log.stamp_overhead(resp.headers_mut());
        log.finish("ok", None);
        return resp;
    }

    // The response cache: a hit is answered now; a miss carries its capture to delivery.
    let capture = match gw.cache.lookup(gw, &pool, &req, &ctx, control).await {
        Lookup::Hit { entry, .. } => {
            return cache::replay::respond(&pool, &ctx, &req.model, entry, log)
        }
        Lookup::Follow(follower) => return cache::replay::follow(&pool, &ctx, follower, log),
        Lookup::Miss(c) => {
            log.cache = "miss";
            Some(*c)
        }
        Lookup::Bypass(_) => None,
    };
    let cache_state = if capture.is_some() { "miss" } else { "bypass" };

    // Stage 1: selection.
    pool.note_priority(ctx.priority, pool.now_ms());
    let controls = Controls {
        force_variant: ctx.force_variant.as_deref(),
        preference: ctx.preference,
        min_tier: ctx.min_tier,
        priority: ctx.priority,
    };
    let (selection, record) = select_or_wait(&pool, &req, controls, id, ctx.deadline).await;
    // The record is completed by the attempts and the log, and kept when both are done (see
    // `decisions`).
    let mut record = record.unwrap_or_else(|| DecisionRecord::bare(id, &pool.cfg.name));
    record.prompt_edits = ctx.prompt_edits.clone();
    let draft = Draft::new(gw.decision_log(), started, record);
    log.decision = Some(draft.clone());
    let mut attempts = Attempts::new(gw, &pool, Some(draft));
    attempts.priority = ctx.priority;
    attempts.trace = ctx.trace.clone();
    if matches!(selection, Selection::Throttled(_) | Selection::Full) {
        log.route = "throttled";
    }
    let mut order = match plan_or_error(&pool, selection) {
        Ok(order) => order,
        Err(e) => return delivery::error_response(log, protocol, &e),
    };
    // A canary puts the request's side first (a forced variant stays first).
    let side = match (&pool.canary, &ctx.force_variant) {
        (Some(c), None) => Some((c, c.side(&req, &ctx, pool.now_ms()))),
        _ => None,
    };
    if let Some((c, side)) = side {
        crate::canary::steer(c, side, &mut order);
        if let Some(draft) = &log.decision {
            draft.update(|r| {
                r.canary = Some(side.as_str());
                r.plan = order
                    .iter()
                    .map(|i| pool.variants[*i].cfg.name.clone())
                    .collect();
            });
        }
    }

    // A consensus asks several variants at once and merges their answers (stages 2 and 3 in
    // one, see `consensus`).
    if let Some(n) = ctx.consensus {
        return crate::consensus::run(log, &pool, &ctx, &req, &order, attempts, n).await;
    }

    // Stage 2: execution; stage 3: delivery. A non-streaming generation is streamed upstream
    // (and assembled in delivery) so that it is protected by migration too; count_tokens and
    // embeddings are whole answers, only ever failed over before the response.
    let upstream_req = if !req.stream
        && endpoint.generates()
        && pool.cfg.assemble_non_streaming
        && (pool.max_migrations() > 0 || pool.cfg.integrity.is_some())
    {
        let mut r = req;
        r.stream = true;
        r.body
            .insert("stream".into(), serde_json::Value::Bool(true));
        if endpoint.protocol() == Protocol::OpenAi {
            r.body
                .insert("stream_options".into(), json!({"include_usage": true}));
        }
        r
    } else {
        req
    };
    let executed = loop {
        let before = attempts.len();
        let executed = execution::execute(&pool, &upstream_req, &ctx, &order, attempts).await;
        let wait_for_fleet = matches!(executed.outcome, Outcome::Failed(_))
            && executed.attempts.len() > before
            && executed.attempts.restart_like()
            && Instant::now() < ctx.deadline;
        if !wait_for_fleet {
            break executed;
        }
        // Every variant tried is still loading its model or restarting: wait for the first
        // that is ready (selection waits while the monitor finds out), within the deadline.
        // Bounded: attempts on variants that fail otherwise count against `max_attempts`.
        attempts = executed.attempts;
        let (selection, _) = select_or_wait(&pool, &upstream_req, controls, id, ctx.deadline).await;
        if matches!(selection, Selection::Throttled(_) | Selection::Full) {
            log.route = "throttled";
        }
        order = match plan_or_error(&pool, selection) {
            Ok(order) => order,
            Err(e) => return delivery::error_response(log, protocol, &e),
        };
        if let Some((c, side)) = side {
            crate::canary::steer(c, side, &mut order);
        }
    };
    let mut resp = delivery::deliver(
        gw,
        log,
        &pool,
        &ctx,
        protocol,
        executed,
        upstream_req,
        order,
        capture,
    )
    .await;
    cache::stamp(resp.headers_mut(), cache_state);
    resp
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
            crate::settlement::loading_message(pool, true),
        )
        .with_retry_after(crate::settlement::LOADING_RETRY_AFTER_MS)),
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

/// Every name a client may ask for: each pool's public name and its aliases, in config order
/// (only the pools its key may use, when keys are configured). Every pool serves both
/// protocols (a variant of the other protocol through translation), so both lists hold them
/// all.
fn listed_models<'g>(gw: &'g Gateway, key: Option<&KeyConfig>) -> Vec<&'g str> {
    gw.pools()
        .iter()
        .filter(|p| key.is_none_or(|k| k.allows(&p.cfg.name)))
        .flat_map(|p| std::iter::once(&p.cfg.name).chain(&p.cfg.aliases))
        .map(String::as_str)
        .collect()
}

/// One model in the client's list shape.
fn model_entry(name: &str, anthropic: bool) -> serde_json::Value {
    if anthropic {
        json!({"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"})
    } else {
        json!({"id": name, "object": "model", "created": 0, "owned_by": "keel"})
    }
}

/// `GET /v1/models`: OpenAI's list shape, or Anthropic's for an Anthropic client.
fn models(gw: &Gateway, key: Option<&KeyConfig>, anthropic: bool) -> Response<Body> {
    let names = listed_models(gw, key);
    let data: Vec<_> = names.iter().map(|n| model_entry(n, anthropic)).collect();
    let body = if anthropic {
        json!({"data": data, "has_more": false, "first_id": names.first(), "last_id": names.last()})
    } else {
        json!({"object": "list", "data": data})
    };
    full_body(
        StatusCode::OK,
        "application/json",
        Bytes::from(body.to_string()),
    )
}

/// `GET /v1/models/{id}`: one model, or 404 in the client's error shape.
fn model(
    gw: &Gateway,
    key: Option<&KeyConfig>,
    anthropic: bool,
    id: &str,
    protocol: Protocol,
) -> Response<Body> {
    let id = percent_decode(id);
    match listed_models(gw, key).into_iter().find(|n| *n == id) {
        Some(n) => full_body(
            StatusCode::OK,
            "application/json",
            Bytes::from(model_entry(n, anthropic).to_string()),
        ),
        None => GatewayError::new(
            ErrorKind::NotFound,
            format!("model `{id}` is not served here"),
        )
        .to_response(protocol),
    }
}

/// `%XX` escapes decoded (a model id may hold `/` or `:`); invalid ones are kept as they are.
pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn health(gw: &Gateway) -> Response<Body> {
    full_body(
        StatusCode::OK,
        "application/json",
        Bytes::from(health_document(gw).to_string()),
    )
}

/// The `GET /keel/health` document (also each `/keel/events` snapshot's `health`).
pub fn health_document(gw: &Gateway) -> serde_json::Value {
    let pools: Vec<_> = gw
        .pools()
        .iter()
        .map(|p| {
            let mut doc = json!({"name": p.cfg.name, "protocol": p.protocol.as_str(), "policy": p.cfg.policy, "variants": p.snapshot()});
            crate::safe_mode::merge(&mut doc, p.safety.report(p));
            crate::rollout_api::health(p, &mut doc);
            doc
        })
        .collect();
    let (colour, reasons) = crate::safe_mode::overall(&pools);
    json!({"status": "ok", "colour": colour, "reasons": reasons, "pools": pools})
}
