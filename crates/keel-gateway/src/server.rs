//! The HTTP server: accept loop (HTTP/1.1 and h2c), a header-read timeout so slow clients cannot
//! hold connections, graceful shutdown with a drain deadline, and routing.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::time::Instant;

use keel_core::protocol::{Endpoint, ErrorKind, Protocol};

use crate::delivery::{self, RequestLog};
use crate::errors::GatewayError;
use crate::pools::{Controls, Pool, Selection};
use crate::{admission, execution, full_body, Body, Gateway};

/// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests (streams
/// included) finish for up to `drain_ms`.
pub async fn serve(
    gw: Arc<Gateway>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(gw.cfg.header_read_timeout_ms))
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)));
    tokio::pin!(shutdown);
    let monitor = tokio::spawn(crate::monitor::run(gw.clone()));
    loop {
        let (tcp, _) = tokio::select! {
            a = listener.accept() => match a {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        let gw = gw.clone();
        let svc = hyper::service::service_fn(move |req| handle(gw.clone(), req));
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(tcp), svc)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    monitor.abort();
    tracing::info!(
        drain_ms = gw.cfg.drain_ms,
        "shutting down: draining in-flight requests"
    );
    tokio::select! {
        _ = graceful.shutdown() => tracing::info!("drained"),
        _ = tokio::time::sleep(Duration::from_millis(gw.cfg.drain_ms)) => tracing::warn!("drain deadline reached; closing remaining connections"),
    }
    Ok(())
}

/// Longest wait for a cooling-down pool before answering 503 with retry-after.
const COOLDOWN_WAIT_MAX_MS: u64 = 2_000;

/// Selects, waiting when that helps: for the first variant back from a short cooldown (the
/// client would have to wait that long anyway), or in the pool's line while every variant is
/// full (see `capacity`). Returns `Unavailable` or `Full` when waiting would not help in time.
async fn select_or_wait(
    pool: &Arc<Pool>,
    req: &keel_core::request::CanonicalRequest,
    controls: Controls<'_>,
    id: &str,
    deadline: tokio::time::Instant,
) -> (Selection, Option<crate::pools::DecisionRecord>) {
    let started = tokio::time::Instant::now();
    let line_deadline = (started + Duration::from_millis(pool.cfg.queue_ms)).min(deadline);
    let mut ticket = None;
    loop {
        let (selection, record) = pool.select(req, controls, id);
        match selection {
            Selection::Unavailable { retry_after_ms } => {
                let wake =
                    tokio::time::Instant::now() + Duration::from_millis(retry_after_ms.max(10));
                if retry_after_ms > COOLDOWN_WAIT_MAX_MS || wake >= deadline {
                    return (selection, record);
                }
                tokio::time::sleep_until(wake).await;
            }
            Selection::Full => {
                if ticket.is_none() {
                    // Join only if the line can drain within the wait allowed.
                    let expected = pool.expected_wait_ms().unwrap_or(0);
                    if started + Duration::from_millis(expected) > line_deadline {
                        return (selection, record);
                    }
                    ticket = Some(pool.line.join());
                }
                let t = ticket.as_ref().expect("joined");
                if tokio::time::timeout_at(line_deadline, t.slot_freed())
                    .await
                    .is_err()
                {
                    return (selection, record);
                }
            }
            _ => {
                if ticket.is_some() {
                    metrics::histogram!("keel_queue_wait_seconds", "pool" => pool.cfg.name.clone())
                        .record(started.elapsed().as_secs_f64());
                }
                return (selection, record);
            }
        }
    }
}

fn new_request_id() -> String {
    // UUIDv7: time-ordered, so ids sort by arrival in logs.
    uuid::Uuid::now_v7().to_string()
}

/// Routes one request.
pub async fn handle(
    gw: Arc<Gateway>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let started = Instant::now();
    let path = req.uri().path().to_owned();
    let endpoint = Endpoint::from_path(&path);
    let anthropic_client = req.headers().contains_key("anthropic-version");
    let protocol = endpoint
        .map(Endpoint::protocol)
        .unwrap_or(if anthropic_client {
            Protocol::Anthropic
        } else {
            Protocol::OpenAi
        });
    let resp = match (req.method(), endpoint, path.as_str()) {
        (&Method::POST, Some(ep), _) => handle_generation(&gw, ep, req, started).await,
        (&Method::GET, _, "/v1/models") => models(&gw, anthropic_client),
        (&Method::GET, _, "/keel/health") => health(&gw),
        (&Method::GET, _, "/keel/decisions") => {
            let body = serde_json::to_string(&gw.decisions()).unwrap_or_else(|_| "[]".into());
            full_body(StatusCode::OK, "application/json", Bytes::from(body))
        }
        (&Method::GET, _, "/metrics") | (&Method::GET, _, "/keel/metrics") => full_body(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            Bytes::from(crate::metrics::render()),
        ),
        (_, Some(_), _)
        | (
            _,
            _,
            "/v1/models" | "/keel/health" | "/keel/decisions" | "/metrics" | "/keel/metrics",
        ) => {
            let mut r = GatewayError::new(
                ErrorKind::InvalidRequest,
                format!("method {} is not allowed on {path}", req.method()),
            )
            .to_response(protocol);
            *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
            r
        }
        _ => GatewayError::new(
            ErrorKind::NotFound,
            format!("no route for {} {path}", req.method()),
        )
        .to_response(protocol),
    };
    Ok(resp)
}

/// The four stages, in order, for one generation request.
pub async fn handle_generation(
    gw: &Arc<Gateway>,
    endpoint: Endpoint,
    req: Request<Incoming>,
    started: Instant,
) -> Response<Body> {
    let protocol = endpoint.protocol();
    let id = new_request_id();
    let (parts, body) = req.into_parts();
    gw.record_request();

    // Stage 0: admission.
    let admitted = match admission::admit(gw, endpoint, &parts, body, &id, started).await {
        Ok(a) => a,
        Err(e) => {
            return delivery::error_response(
                RequestLog::new(&id, started, endpoint, "none"),
                protocol,
                &e,
            )
        }
    };
    let admission::Admitted { req, pool, ctx } = admitted;
    let mut log = RequestLog::new(&id, started, endpoint, &pool.cfg.name);
    if endpoint == Endpoint::CountTokens && pool.protocol == Protocol::OpenAi {
        // OpenAI-protocol servers have no count_tokens endpoint: answer with keel's estimate.
        let body = json!({"input_tokens": req.estimated_input_tokens}).to_string();
        log.status = 200;
        log.variant = "keel-estimate".into();
        log.finish("ok", None);
        return full_body(StatusCode::OK, "application/json", Bytes::from(body));
    }

    // Stage 1: selection.
    let controls = Controls {
        force_variant: ctx.force_variant.as_deref(),
        preference: ctx.preference,
        min_tier: ctx.min_tier,
    };
    let (selection, record) = select_or_wait(&pool, &req, controls, &id, ctx.deadline).await;
    if let Some(r) = record {
        gw.record_decision(r);
    }
    let order = match selection {
        Selection::Plan(order) => order,
        Selection::Unavailable { retry_after_ms } => {
            let e = GatewayError::new(
                ErrorKind::Overloaded,
                format!("every variant of `{}` is cooling down", pool.cfg.name),
            )
            .with_retry_after(retry_after_ms);
            return delivery::error_response(log, protocol, &e);
        }
        Selection::Full => {
            // Refused by the wait line: the expected wait for a place at the back of it.
            let ahead = pool.line.waiting();
            let wait = pool.expected_wait_ms().unwrap_or(1000);
            metrics::counter!("keel_queue_refused_total", "pool" => pool.cfg.name.clone())
                .increment(1);
            let e = GatewayError::new(
                ErrorKind::Overloaded,
                format!(
                    "every variant of `{}` is at its concurrency limit and {ahead} requests are waiting",
                    pool.cfg.name
                ),
            )
            .with_retry_after(wait.max(1));
            return delivery::error_response(log, protocol, &e);
        }
        Selection::TooLong { needed, largest } => {
            let e = GatewayError::new(
                ErrorKind::InvalidRequest,
                format!("the request needs about {needed} tokens (prompt + max_tokens) but the largest context window in `{}` is {largest}", pool.cfg.name),
            );
            return delivery::error_response(log, protocol, &e);
        }
        Selection::NoTier { min_tier } => {
            let e = GatewayError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "x-keel-min-tier: `{}` has no variant of tier {min_tier} or better",
                    pool.cfg.name
                ),
            );
            return delivery::error_response(log, protocol, &e);
        }
        Selection::NoSuchVariant(name) => {
            let e = GatewayError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "x-keel-force-variant: `{}` has no variant `{name}`",
                    pool.cfg.name
                ),
            );
            return delivery::error_response(log, protocol, &e);
        }
    };

    // Stage 2: execution; stage 3: delivery. A non-streaming request is streamed upstream (and
    // assembled in delivery) so that it is protected by migration too.
    let client_stream = req.stream;
    let upstream_req = if !req.stream
        && endpoint != Endpoint::CountTokens
        && pool.cfg.assemble_non_streaming
        && pool.cfg.max_migrations > 0
    {
        let mut r = req;
        r.stream = true;
        r.body
            .insert("stream".into(), serde_json::Value::Bool(true));
        if pool.protocol == Protocol::OpenAi {
            r.body
                .insert("stream_options".into(), json!({"include_usage": true}));
        }
        r
    } else {
        req
    };
    let executed = execution::execute(gw, &pool, &upstream_req, &ctx, &order).await;
    delivery::deliver(
        log,
        &pool,
        &ctx,
        protocol,
        executed,
        upstream_req,
        order,
        client_stream,
    )
    .await
}

fn models(gw: &Gateway, anthropic: bool) -> Response<Body> {
    let names = gw.model_names();
    let body = if anthropic {
        let data: Vec<_> = names.iter().map(|n| json!({"type": "model", "id": n, "display_name": n, "created_at": "1970-01-01T00:00:00Z"})).collect();
        json!({"data": data, "has_more": false, "first_id": names.first(), "last_id": names.last()})
    } else {
        let data: Vec<_> = names
            .iter()
            .map(|n| json!({"id": n, "object": "model", "created": 0, "owned_by": "keel"}))
            .collect();
        json!({"object": "list", "data": data})
    };
    full_body(
        StatusCode::OK,
        "application/json",
        Bytes::from(body.to_string()),
    )
}

fn health(gw: &Gateway) -> Response<Body> {
    let pools: Vec<_> = gw
        .pools()
        .iter()
        .map(|p| json!({"name": p.cfg.name, "protocol": p.protocol.as_str(), "policy": p.cfg.policy, "variants": p.snapshot()}))
        .collect();
    full_body(
        StatusCode::OK,
        "application/json",
        Bytes::from(json!({"status": "ok", "pools": pools}).to_string()),
    )
}
