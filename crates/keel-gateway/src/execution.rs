//! Stage 2, execution: attempts on the plan's variants until one serves, before any byte has
//! reached the client.
//!
//! **The commit point.** Nothing is sent to the client until an attempt has produced its first
//! token: for a stream, the first event carrying output (not the response head, not a role-only
//! preamble, not a ping); for a whole response, the complete, valid body. Before that point any
//! attempt may be abandoned silently and the next variant tried. After it, the response belongs
//! to that attempt, and a failure can only end the stream with an explicit error event
//! (see `delivery`), never a clean end.
//!
//! Each failure is classified once (`keel_core::outcome`): retryable failures move on to the next
//! variant, honouring `retry-after` as a cooldown; 401/403 mark the variant's credential broken
//! and move on; the client's own errors are returned unchanged. Attempts are bounded by the
//! pool's `max_attempts`, by the total deadline, and by the fleet-wide retry budget.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::{HeaderMap, StatusCode};
use tokio::time::{timeout_at, Instant};

use keel_core::outcome::{parse_retry_after, AttemptFailure, Verdict};
use keel_core::protocol::{error_message, event_role, Endpoint, ErrorKind, EventRole};
use keel_core::request::CanonicalRequest;
use keel_core::sse::{SseDecoder, SseEvent};

use crate::errors::GatewayError;
use crate::pools::{InFlight, Pool};
use crate::{upstream, Gateway};

/// Longest `retry-after` keel honours as a cooldown.
const MAX_COOLDOWN_MS: u64 = 300_000;
/// A refused connection is very likely refused again: keep the variant out briefly.
const CONNECT_COOLDOWN_MS: u64 = 1_000;

/// Per-request context shared by the stages.
#[derive(Debug, Clone)]
pub struct RequestCtx {
    pub id: String,
    pub started: Instant,
    pub endpoint: Endpoint,
    /// Client headers that travel upstream.
    pub forwarded: HeaderMap,
    /// All attempts together end here (pool `total_ms`, capped by `x-keel-timeout-ms`).
    pub deadline: Instant,
    pub force_variant: Option<String>,
    pub preference: keel_core::selection::Preference,
    pub min_tier: Option<u8>,
}

/// Upstream bytes of a committed stream.
pub type UpstreamBytes = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// A committed stream: what was received up to and including the first output event, and the
/// rest still to read.
pub struct StreamStart {
    /// Events up to and including the first output event.
    pub head: Vec<SseEvent>,
    /// Events received in the same read as the first output, not yet processed.
    pub pending: Vec<SseEvent>,
    pub decoder: SseDecoder,
    pub upstream: UpstreamBytes,
    pub headers: HeaderMap,
    /// When the first output arrived.
    pub first_token_at: Instant,
}

/// What the client gets.
pub enum Served {
    Whole {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
    Stream(StreamStart),
}

/// One attempt, for headers, metrics and logs.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    pub variant: String,
    pub outcome: String,
}

/// The result of stage 2.
pub struct Executed {
    /// The serving variant, what it served, and its in-flight guard (held until delivery ends).
    pub outcome: Result<(usize, Served, InFlight), GatewayError>,
    pub attempts: Vec<AttemptRecord>,
    /// `hedged` when a hedge won; otherwise the route follows from the attempts.
    pub route: Option<&'static str>,
}

pub(crate) enum AttemptResult {
    Served(Served),
    /// The client's own error, returned as the upstream gave it.
    ClientError(Served),
    Failed(AttemptFailure),
}

/// What the attempts of one request have left behind.
/// Longest retry-after a "full" 429 may carry: capacity frees within a second or two, while
/// a rate-limit quota (hosted APIs) asks for longer, and is honoured as a cooldown.
const FULL_RETRY_AFTER_MAX_MS: u64 = 2_000;

/// A 429 while other requests of this gateway are running on the variant (this attempt's
/// slot is still held), with at most a short retry-after: the variant is full, not out of
/// quota.
fn is_full(f: &AttemptFailure, pool: &Pool, vi: usize) -> bool {
    matches!(f, AttemptFailure::Status { status: 429, retry_after_ms, .. }
        if retry_after_ms.is_none_or(|ms| ms <= FULL_RETRY_AFTER_MAX_MS))
        && pool.variants[vi].in_flight.load(Ordering::Relaxed) >= 2
}

#[derive(Default)]
struct Ledger {
    attempts: Vec<AttemptRecord>,
    failures: Vec<(String, AttemptFailure)>,
    retry_after_ms: Option<u64>,
}

impl Ledger {
    /// Records one finished attempt (metrics, health, cooldowns); returns what the client gets
    /// when the attempt is final (served, or the client's own error).
    fn settle(
        &mut self,
        gw: &Gateway,
        pool: &Pool,
        vi: usize,
        result: AttemptResult,
        started: Instant,
    ) -> Option<Served> {
        let variant = &pool.variants[vi].cfg;
        let label = match &result {
            AttemptResult::Served(_) => "ok".to_owned(),
            AttemptResult::ClientError(Served::Whole { status, .. }) => {
                format!("status_{}", status.as_u16())
            }
            AttemptResult::ClientError(_) => "client_error".to_owned(),
            AttemptResult::Failed(f) => f.label(),
        };
        metrics::counter!("keel_attempts_total", "pool" => pool.cfg.name.clone(), "variant" => variant.name.clone(), "outcome" => label.clone()).increment(1);
        self.attempts.push(AttemptRecord {
            variant: variant.name.clone(),
            outcome: label,
        });
        match result {
            AttemptResult::Served(s) => {
                let ttft = match &s {
                    Served::Stream(st) => st.first_token_at.duration_since(started),
                    Served::Whole { .. } => started.elapsed(),
                };
                pool.record_attempt(vi, true, Some(ttft.as_secs_f64() * 1000.0));
                pool.record_success(vi);
                pool.variants[vi].limit.success();
                Some(s)
            }
            AttemptResult::ClientError(s) => {
                pool.record_attempt(vi, true, None);
                Some(s)
            }
            AttemptResult::Failed(f) => {
                let now_ms = gw.now_ms();
                match f.verdict() {
                    Verdict::Retry { .. } if is_full(&f, pool, vi) => {
                        // Full at this concurrency, not broken: lower its limit (see
                        // `capacity`); it stays available below it.
                        let running = pool.variants[vi].in_flight.load(Ordering::Relaxed);
                        pool.variants[vi].limit.full_at(running);
                        self.retry_after_ms = pool.expected_wait_ms();
                    }
                    Verdict::Retry { cooldown_ms } => {
                        pool.record_attempt(vi, false, None);
                        let cool = cooldown_ms
                            .or(matches!(f, AttemptFailure::Connect(_))
                                .then_some(CONNECT_COOLDOWN_MS));
                        if let Some(ms) = cool {
                            pool.cool_down(vi, now_ms, ms.min(MAX_COOLDOWN_MS));
                        }
                        if cooldown_ms.is_some() {
                            self.retry_after_ms = cooldown_ms;
                        }
                    }
                    Verdict::BrokenCredential => {
                        pool.record_attempt(vi, false, None);
                        pool.mark_credential_broken(vi, now_ms);
                        metrics::counter!("keel_variant_credential_broken_total", "pool" => pool.cfg.name.clone(), "variant" => variant.name.clone())
                            .increment(1);
                        tracing::error!(pool = %pool.cfg.name, variant = %variant.name, "upstream refused the variant's credential; variant marked broken and skipped for 60 s");
                    }
                    // Running out of the request's own time says nothing about the variant.
                    Verdict::ReturnToClient | Verdict::GiveUp => {}
                }
                self.failures.push((variant.name.clone(), f));
                None
            }
        }
    }

    fn gave_up(&self) -> bool {
        self.failures
            .last()
            .is_some_and(|(_, f)| f.verdict() == Verdict::GiveUp)
    }
}

/// One attempt, or a primary raced by a hedge.
struct Outcome {
    vi: usize,
    result: AttemptResult,
    guard: InFlight,
    started: Instant,
}

/// Runs the primary; if its first token is late by `delay`, races it against a hedge on the
/// first of `others` that can take one then. The first to produce a token wins and the other
/// is dropped at once (its connection closes, so the upstream stops generating). Finished
/// outcomes come back in order. Also returns whether the hedge won (`None`: no race was
/// decided) and the attempt cancelled, with its start.
async fn race(
    pool: &Arc<Pool>,
    vi: usize,
    others: &[usize],
    req: &CanonicalRequest,
    ctx: &RequestCtx,
    delay: Duration,
) -> (Vec<Outcome>, Option<bool>, Option<(usize, Instant)>) {
    let final_result = |r: &AttemptResult| !matches!(r, AttemptResult::Failed(_));
    let mut guard = Some(pool.enter(vi));
    let started = Instant::now();
    let primary = attempt(pool, vi, req, ctx);
    tokio::pin!(primary);
    tokio::select! {
        r = &mut primary => return (vec![Outcome { vi, result: r, guard: guard.take().expect("guard"), started }], None, None),
        _ = tokio::time::sleep(delay.min(ctx.deadline.saturating_duration_since(Instant::now()))) => {}
    }
    let target = (Instant::now() < ctx.deadline)
        .then(|| pool.try_hedge(others))
        .flatten();
    let Some(hedge_vi) = target else {
        let r = primary.await;
        return (
            vec![Outcome {
                vi,
                result: r,
                guard: guard.take().expect("guard"),
                started,
            }],
            None,
            None,
        );
    };
    let mut hedge_guard = Some(pool.enter(hedge_vi));
    let hedge_started = Instant::now();
    let hedge = attempt(pool, hedge_vi, req, ctx);
    tokio::pin!(hedge);
    let mut out = Vec::new();
    let (mut primary_done, mut hedge_done) = (false, false);
    let label = |outcome: &'static str| {
        metrics::counter!("keel_hedges_total", "pool" => pool.cfg.name.clone(), "outcome" => outcome).increment(1)
    };
    loop {
        tokio::select! {
            r = &mut primary, if !primary_done => {
                primary_done = true;
                let won = final_result(&r);
                out.push(Outcome { vi, result: r, guard: guard.take().expect("guard"), started });
                if won {
                    label("lost");
                    // Nothing was received from the cancelled hedge: it had no first token.
                    metrics::counter!("keel_hedge_wasted_tokens_total", "pool" => pool.cfg.name.clone()).increment(0);
                    return (out, Some(false), (!hedge_done).then_some((hedge_vi, hedge_started)));
                }
            }
            r = &mut hedge, if !hedge_done => {
                hedge_done = true;
                let won = final_result(&r);
                out.push(Outcome { vi: hedge_vi, result: r, guard: hedge_guard.take().expect("guard"), started: hedge_started });
                if won {
                    label("won");
                    return (out, Some(true), (!primary_done).then_some((vi, started)));
                }
            }
        }
        if primary_done && hedge_done {
            label("failed");
            return (out, None, None);
        }
    }
}

/// Runs attempts over `order` (primary first) until one serves.
pub async fn execute(
    gw: &Gateway,
    pool: &Arc<Pool>,
    req: &CanonicalRequest,
    ctx: &RequestCtx,
    order: &[usize],
) -> Executed {
    let max_attempts = pool.cfg.max_attempts as usize;
    let mut ledger = Ledger::default();
    let mut budget_refused = false;
    let mut hedged = false;
    pool.count_request();

    // Walk the plan; when it is exhausted with attempts left, come back to variants that are
    // still available (a one-variant pool can retry a transient 503), after a short backoff.
    let mut round = 0;
    'rounds: while ledger.attempts.len() < max_attempts {
        let mut tried_this_round = false;
        for &vi in order {
            if ledger.attempts.len() >= max_attempts {
                break 'rounds;
            }
            let now = Instant::now();
            if now >= ctx.deadline {
                break 'rounds;
            }
            if ledger
                .attempts
                .iter()
                .filter(|a| a.variant == pool.variants[vi].cfg.name)
                .count()
                > round
            {
                continue; // already tried in this round (e.g. as a hedge)
            }
            if !ledger.attempts.is_empty() {
                if !pool.available(vi, gw.now_ms()) || !pool.wait_for_slot(vi, ctx.deadline).await {
                    continue;
                }
                if !gw.try_retry() {
                    budget_refused = true;
                    metrics::counter!("keel_retry_budget_exhausted_total", "pool" => pool.cfg.name.clone()).increment(1);
                    break 'rounds;
                }
            }
            if round > 0 {
                let backoff = Duration::from_millis(50 << round.min(4));
                tokio::time::sleep_until((now + backoff).min(ctx.deadline)).await;
                if Instant::now() >= ctx.deadline {
                    break 'rounds;
                }
            }
            tried_this_round = true;
            // The first attempt may be hedged by the best other variant of the plan.
            let hedgeable = ledger.attempts.is_empty() && max_attempts > 1 && pool.hedging();
            let others: Vec<usize> = if hedgeable {
                order.iter().copied().filter(|&j| j != vi).collect()
            } else {
                Vec::new()
            };
            let delay = hedgeable
                .then(|| pool.hedge_delay_ms(pool.hedge_target(&others)?))
                .flatten();
            let outcomes = match delay {
                Some(delay) => {
                    let (outcomes, hedge_won, cancelled) =
                        race(pool, vi, &others, req, ctx, Duration::from_millis(delay)).await;
                    hedged = hedge_won == Some(true);
                    if let Some((c, c_started)) = cancelled {
                        pool.record_late_ttft(c, c_started.elapsed().as_secs_f64() * 1000.0);
                        let name = pool.variants[c].cfg.name.clone();
                        metrics::counter!("keel_attempts_total", "pool" => pool.cfg.name.clone(), "variant" => name.clone(), "outcome" => "hedge_cancelled").increment(1);
                        ledger.attempts.push(AttemptRecord {
                            variant: name,
                            outcome: "hedge_cancelled".into(),
                        });
                    }
                    outcomes
                }
                _ => {
                    let guard = pool.enter(vi);
                    let started = Instant::now();
                    vec![Outcome {
                        vi,
                        result: attempt(pool, vi, req, ctx).await,
                        guard,
                        started,
                    }]
                }
            };
            for mut o in outcomes {
                if let Some(served) = ledger.settle(gw, pool, o.vi, o.result, o.started) {
                    o.guard.serving = true;
                    let route = if hedged { Some("hedged") } else { None };
                    return Executed {
                        outcome: Ok((o.vi, served, o.guard)),
                        attempts: ledger.attempts,
                        route,
                    };
                }
            }
            if ledger.gave_up() {
                break 'rounds;
            }
        }
        if !tried_this_round {
            break;
        }
        round += 1;
    }
    let err = give_up_error(
        pool,
        ctx,
        &ledger.failures,
        budget_refused,
        ledger.retry_after_ms,
    );
    Executed {
        outcome: Err(err),
        attempts: ledger.attempts,
        route: None,
    }
}

/// The client's error when no variant could serve: 504 when time ran out, 503 when every
/// variant was saturated (with the shortest retry-after), 502 otherwise; the message lists
/// every attempt.
fn give_up_error(
    pool: &Pool,
    ctx: &RequestCtx,
    failures: &[(String, AttemptFailure)],
    budget_refused: bool,
    retry_after_ms: Option<u64>,
) -> GatewayError {
    let tried: Vec<String> = failures
        .iter()
        .map(|(v, f)| format!("{v}: {}", f.describe()))
        .collect();
    let mut message = format!("no variant of `{}` could serve the request", pool.cfg.name);
    if tried.is_empty() {
        message.push_str(" (no attempt could be made before the deadline)");
    } else {
        message.push_str(&format!("; tried {}", tried.join("; ")));
    }
    if budget_refused {
        message.push_str(
            "; further retries refused by the retry budget (the fleet is failing broadly)",
        );
    }
    let timed_out = Instant::now() >= ctx.deadline
        || failures.iter().all(|(_, f)| {
            matches!(
                f,
                AttemptFailure::FirstTokenTimeout { .. } | AttemptFailure::Deadline { .. }
            )
        });
    let saturated = !failures.is_empty()
        && failures.iter().all(|(_, f)| {
            matches!(
                f,
                AttemptFailure::Status {
                    status: 429 | 503 | 529,
                    ..
                }
            )
        });
    if failures.is_empty() || timed_out {
        GatewayError::new(ErrorKind::Timeout, message)
    } else if saturated {
        let e = GatewayError::new(ErrorKind::Overloaded, message);
        match retry_after_ms {
            Some(ms) => e.with_retry_after(ms),
            None => e,
        }
    } else {
        GatewayError::new(ErrorKind::BadGateway, message)
    }
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
            out.append(name.clone(), value.clone());
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

/// Strips URLs from transport errors: they carry no secrets today, but keel never prints more
/// of an upstream than its variant name.
fn transport_error(e: reqwest::Error) -> AttemptFailure {
    let connect = e.is_connect();
    let e = e.without_url();
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg = format!("{msg}: {s}");
        src = s.source();
    }
    if connect {
        AttemptFailure::Connect(msg)
    } else {
        AttemptFailure::Io(msg)
    }
}

pub(crate) async fn attempt(
    pool: &Pool,
    vi: usize,
    req: &CanonicalRequest,
    ctx: &RequestCtx,
) -> AttemptResult {
    let variant = &pool.variants[vi].cfg;
    let body =
        match serde_json::to_vec(&req.upstream_view(&variant.upstream_model, &variant.params)) {
            Ok(b) => b,
            Err(e) => {
                return AttemptResult::Failed(AttemptFailure::Malformed(format!(
                    "cannot encode request: {e}"
                )))
            }
        };
    let started = Instant::now();
    let streaming = req.stream && ctx.endpoint != Endpoint::CountTokens;
    let first_token_deadline = started + Duration::from_millis(pool.cfg.timeouts.first_token_ms);
    let head_deadline = if streaming {
        first_token_deadline.min(ctx.deadline)
    } else {
        ctx.deadline
    };
    let hit_total = |d: Instant| d >= ctx.deadline;

    let send = upstream::request(&pool.client, variant, ctx.endpoint, &ctx.forwarded, body).send();
    let resp = match timeout_at(head_deadline, send).await {
        Err(_) => return AttemptResult::Failed(timeout_failure(hit_total(head_deadline), started)),
        Ok(Err(e)) => return AttemptResult::Failed(transport_error(e)),
        Ok(Ok(r)) => r,
    };
    let status = resp.status();
    let headers = kept_headers(resp.headers());

    if !status.is_success() {
        let h = resp.headers();
        let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let retry_after_ms = parse_retry_after(
            get("retry-after-ms").as_deref(),
            get("retry-after").as_deref(),
            MAX_COOLDOWN_MS,
        );
        let body = match timeout_at(
            (Instant::now() + Duration::from_secs(5)).min(ctx.deadline),
            resp.bytes(),
        )
        .await
        {
            Ok(Ok(b)) => b,
            _ => Bytes::new(),
        };
        let message = serde_json::from_slice(&body)
            .map(|v| error_message(&v))
            .unwrap_or_default();
        let message: String = message.chars().take(300).collect();
        let failure = AttemptFailure::Status {
            status: status.as_u16(),
            retry_after_ms,
            message,
        };
        return match failure.verdict() {
            Verdict::ReturnToClient => AttemptResult::ClientError(Served::Whole {
                status,
                headers,
                body,
            }),
            _ => AttemptResult::Failed(failure),
        };
    }

    if !streaming {
        let body = match timeout_at(ctx.deadline, resp.bytes()).await {
            Err(_) => {
                return AttemptResult::Failed(AttemptFailure::Deadline {
                    after_ms: started.elapsed().as_millis() as u64,
                })
            }
            Ok(Err(e)) => return AttemptResult::Failed(transport_error(e)),
            Ok(Ok(b)) => b,
        };
        if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&body) {
            return AttemptResult::Failed(AttemptFailure::Malformed(format!(
                "response body is not JSON: {e}"
            )));
        }
        return AttemptResult::Served(Served::Whole {
            status,
            headers,
            body,
        });
    }

    let content_type = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if !content_type.starts_with("text/event-stream") {
        return AttemptResult::Failed(AttemptFailure::Malformed(format!(
            "expected an event stream, got content-type {content_type:?}"
        )));
    }
    let protocol = variant.protocol;
    let mut upstream: UpstreamBytes = Box::pin(resp.bytes_stream());
    let mut decoder = SseDecoder::new();
    let mut head = Vec::new();
    let mut events = Vec::new();
    loop {
        let chunk = match timeout_at(head_deadline, upstream.next()).await {
            Err(_) => {
                return AttemptResult::Failed(timeout_failure(hit_total(head_deadline), started))
            }
            Ok(None) => {
                return AttemptResult::Failed(AttemptFailure::Io(
                    "stream ended before the first token".into(),
                ))
            }
            Ok(Some(Err(e))) => return AttemptResult::Failed(transport_error(e)),
            Ok(Some(Ok(c))) => c,
        };
        if let Err(e) = decoder.feed(&chunk, &mut events) {
            return AttemptResult::Failed(AttemptFailure::Malformed(e.to_string()));
        }
        let mut drained = events.drain(..);
        for ev in drained.by_ref() {
            let role = event_role(protocol, &ev);
            match role {
                EventRole::Preamble | EventRole::KeepAlive => head.push(ev),
                EventRole::Output | EventRole::Terminal => {
                    head.push(ev);
                    let pending: Vec<SseEvent> = drained.collect();
                    return AttemptResult::Served(Served::Stream(StreamStart {
                        head,
                        pending,
                        decoder,
                        upstream,
                        headers,
                        first_token_at: Instant::now(),
                    }));
                }
                EventRole::Error(m) => {
                    return AttemptResult::Failed(AttemptFailure::Io(format!(
                        "upstream reported an error before the first token: {m}"
                    )))
                }
                EventRole::Malformed(m) => {
                    return AttemptResult::Failed(AttemptFailure::Malformed(m))
                }
            }
        }
    }
}
