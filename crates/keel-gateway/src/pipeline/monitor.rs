//! The health monitor: a background task that keeps every variant's lifecycle moving while no
//! request does. It advances hysteresis and slow start, sends probes to ejected variants and
//! warm-up requests to new, restarted or returning ones (so no client pays a cold start),
//! scrapes vLLM / SGLang / llama.cpp Prometheus endpoints for load signals, and refreshes the
//! per-variant gauges.
//!
//! A variant with a health endpoint (`health_path` / `health_url`) is asked for readiness
//! first: while it is loading or restarting, a cheap GET (no generation) is sent instead of a
//! warm-up, and only a 200 lets the warm-ups go (at once); an ejected one is probed only once
//! it answers 200. These checks are counted in `keel_maintenance_requests_total{kind="health"}`;
//! they are not attempts (no slot, no retry budget).

use crate::observe::record::AttemptKind;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use keel_core::protocol::{Endpoint, EventRole, Protocol};
use keel_core::stream_watch::{read_event_in, Gaps};

use crate::pipeline::attempt::{attempt, AttemptResult, Served, StreamStart};
use crate::pipeline::context::RequestCtx;
use crate::pipeline::settlement::Attempts;
use crate::state::pools::{Maintenance, Pool};
use crate::Gateway;

/// How often the lifecycle is advanced.
const TICK: Duration = Duration::from_millis(100);
/// Metrics upkeep (draining histogram buffers) every this many ticks.
const UPKEEP_TICKS: u64 = 50;
/// Probes and warm-ups must answer within this.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// A health endpoint must answer within this.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    let mut last_scrape: Vec<Instant> = gw
        .pools()
        .iter()
        .map(|_| Instant::now() - Duration::from_secs(3600))
        .collect();
    let mut ticks = 0u64;
    loop {
        for (pi, pool) in gw.pools().iter().enumerate() {
            for m in pool.maintenance() {
                tokio::spawn(maintain(gw.clone(), pool.clone(), m));
            }
            if last_scrape[pi].elapsed() >= Duration::from_millis(pool.cfg.scrape_interval_ms) {
                last_scrape[pi] = Instant::now();
                for (vi, v) in pool.variants.iter().enumerate() {
                    if let Some(url) = v.cfg.metrics_url.clone() {
                        tokio::spawn(scrape(pool.clone(), vi, url));
                    }
                }
            }
            publish_gauges(pool);
            pool.safety.update(pool);
        }
        ticks += 1;
        if ticks.is_multiple_of(UPKEEP_TICKS) {
            gw.metrics.upkeep();
        }
        tokio::time::sleep(TICK).await;
    }
}

/// Tokens a probe or warm-up asks for: enough gaps between them to measure the variant's
/// decode pace (selection prices it, see `keel_core::p2c::decode_factor`), so that a variant
/// priced out for a slow pace is measured again without client streams and comes back once
/// it is fast; few enough to cost little more than one token.
const PROBE_TOKENS: u32 = 8;

/// A minimal generation: [`PROBE_TOKENS`] output tokens, streamed, so that its sample is the
/// time to the first token as a client's streamed attempt measures it, and the gaps after it
/// are the variant's pace (see [`read_to_end`]).
fn tiny_request(pool: &Pool, vi: usize) -> (Endpoint, Vec<u8>) {
    let v = &pool.variants[vi].cfg;
    let body = json!({"model": v.upstream_model, "max_tokens": PROBE_TOKENS, "stream": true, "messages": [{"role": "user", "content": "ping"}]});
    let endpoint = match v.protocol {
        Protocol::OpenAi => Endpoint::ChatCompletions,
        Protocol::Anthropic => Endpoint::Messages,
    };
    (endpoint, body.to_string().into_bytes())
}

/// A probe or warm-up: an attempt like any other (see `settlement`), whose outcome moves the
/// variant's lifecycle.
async fn maintain(gw: Arc<Gateway>, pool: Arc<Pool>, m: Maintenance) {
    let (vi, kind, label) = match m {
        Maintenance::Probe(i) => (i, AttemptKind::Probe, "probe"),
        Maintenance::WarmUp(i) => (i, AttemptKind::WarmUp, "warmup"),
        Maintenance::Refresh(i) => (i, AttemptKind::Probe, "refresh"),
        Maintenance::Ready(i) => (i, AttemptKind::WarmUp, "warmup"),
        Maintenance::Confirm(i) => (i, AttemptKind::Probe, "confirm"),
    };
    // Readiness first, where the variant has a health endpoint: a loading or restarting one
    // warms up only once it answers 200 (then at once, in this task), an ejected one is
    // probed only then.
    if matches!(m, Maintenance::Ready(_) | Maintenance::Probe(_))
        && !check_ready(&pool, vi, matches!(m, Maintenance::Ready(_))).await
    {
        pool.maintenance_done(m, false, None, None);
        return;
    }
    let m = match m {
        Maintenance::Ready(i) => Maintenance::WarmUp(i),
        other => other,
    };
    let (endpoint, body) = tiny_request(&pool, vi);
    let req = match keel_core::request::parse(endpoint, &body) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e.message, "cannot build a probe request");
            pool.maintenance_done(m, false, None, None);
            return;
        }
    };
    let started = tokio::time::Instant::now();
    let ctx = RequestCtx {
        id: format!("{label}-{}", pool.variants[vi].cfg.name),
        started,
        endpoint,
        forwarded: http::HeaderMap::new(),
        deadline: started + PROBE_TIMEOUT,
        client_stream: false,
        assembled: false,
        force_variant: None,
        preference: Default::default(),
        min_tier: None,
        priority: Default::default(),
        responses: None,
        grant: None,
        prompt_fixes: Vec::new(),
        prompt_edits: Vec::new(),
        trimmed_messages: 0,
        meter: Default::default(),
        trace: None,
        consensus: None,
        guard: None,
    };
    let mut attempts = Attempts::new(&gw, &pool, None);
    let Ok(entered) = attempts.enter(vi, kind, ctx.deadline).await else {
        // Full with client traffic (or no longer available): try again on a later tick.
        pool.maintenance_skipped(m);
        return;
    };
    let mut result = attempt(&pool, vi, &req, &ctx, None).await;
    let mut paced = None;
    if let AttemptResult::Served(Served::Stream(start)) = &mut result {
        paced = read_to_end(start, endpoint.protocol(), ctx.deadline).await;
    }
    let ttft_ms = attempts.settle_maintenance(entered, result);
    let ok = ttft_ms.is_some();
    pool.metrics
        .counter(
            "keel_maintenance_requests_total",
            &[
                ("pool", &pool.cfg.name),
                ("variant", &pool.variants[vi].cfg.name),
                ("kind", label),
                ("outcome", if ok { "ok" } else { "error" }),
            ],
        )
        .increment(1);
    pool.maintenance_done(m, ok, ttft_ms, paced.as_ref());
}

/// Reads the rest of a probe's stream up to its terminal event, so that its upstream
/// connection is kept for the next request; a stream dropped before its end has its
/// connection closed, which a client would pay for with a new connection (a TLS handshake to a
/// hosted API). Returns the gaps between its tokens when it reached its end (a stream cut
/// short says nothing sure about the pace). Its TTFT sample is already taken at the first
/// token; a failure here is only the end of the read.
async fn read_to_end(
    start: &mut StreamStart,
    protocol: Protocol,
    deadline: tokio::time::Instant,
) -> Option<Gaps> {
    let mut events = std::mem::take(&mut start.pending);
    let mut gaps = Gaps::default();
    let mut last_token: Option<Instant> = None;
    loop {
        for ev in events.drain(..) {
            let facts = read_event_in(protocol, &ev, &mut start.template);
            match facts.role {
                EventRole::Terminal => {
                    start.source.reached_end();
                    return Some(gaps);
                }
                EventRole::Output if facts.tokens => {
                    let now = Instant::now();
                    if let Some(last) = last_token.replace(now) {
                        gaps.push(now.duration_since(last).as_secs_f64() * 1000.0);
                    }
                }
                _ => {}
            }
        }
        if start.source.next(deadline, &mut events).await.is_err() {
            return None;
        }
    }
}

/// Asks the variant's health endpoint whether it is ready (true without one). A 503 there
/// means still loading (`warming`: the variant stays warming); a refused connection, still
/// restarting (see `Pool::mark_restarting`). A 404 or 405 means the server has no such
/// endpoint: logged, and the warm-up (a real generation) decides instead.
async fn check_ready(pool: &Pool, vi: usize, warming: bool) -> bool {
    let v = &pool.variants[vi].cfg;
    let Some(url) = v.health_url.as_deref() else {
        return true;
    };
    let answer =
        tokio::time::timeout(READY_TIMEOUT, pool.client.http(&v.name).get(url).send()).await;
    let (ready, outcome) = match answer {
        Ok(Ok(r)) if r.status() == http::StatusCode::OK => (true, "ok"),
        Ok(Ok(r)) if matches!(r.status().as_u16(), 404 | 405) => {
            tracing::warn!(pool = %pool.cfg.name, variant = %v.name, status = r.status().as_u16(), "the variant's health endpoint does not exist; check health_path / health_url (readiness is left to warm-up requests)");
            (true, "no_endpoint")
        }
        Ok(Ok(r)) => {
            if warming && r.status() == http::StatusCode::SERVICE_UNAVAILABLE {
                pool.mark_loading(vi);
            }
            (false, "not_ready")
        }
        Ok(Err(e)) => match crate::pipeline::attempt::transport_error(e.into()) {
            keel_core::outcome::AttemptFailure::Refused(_) => {
                pool.mark_restarting(vi);
                (false, "refused")
            }
            _ => (false, "error"),
        },
        Err(_) => (false, "timeout"),
    };
    if ready {
        pool.mark_ready(vi);
    }
    pool.metrics
        .counter(
            "keel_maintenance_requests_total",
            &[
                ("pool", &pool.cfg.name),
                ("variant", &v.name),
                ("kind", "health"),
                ("outcome", outcome),
            ],
        )
        .increment(1);
    ready
}

/// Reads a Prometheus text exposition for KV-cache usage and queued requests, by the metric
/// names vLLM and llama.cpp expose.
pub fn parse_load_metrics(text: &str) -> (Option<f64>, Option<f64>) {
    let mut kv = None;
    let mut waiting = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((name_labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = name_labels.split('{').next().unwrap_or("");
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        match name {
            // vLLM ≥ 0.10 and older name; SGLang exposes the vLLM-compatible names too.
            "vllm:kv_cache_usage_perc"
            | "vllm:gpu_cache_usage_perc"
            | "llamacpp:kv_cache_usage_ratio" => {
                kv = Some(kv.map_or(v, |k: f64| k.max(v)));
            }
            "vllm:num_requests_waiting"
            | "llamacpp:requests_deferred"
            | "sglang:num_queue_reqs" => {
                waiting = Some(waiting.unwrap_or(0.0) + v);
            }
            _ => {}
        }
    }
    (kv, waiting)
}

async fn scrape(pool: Arc<Pool>, vi: usize, url: String) {
    let r = tokio::time::timeout(Duration::from_secs(2), async {
        pool.client
            .http(&pool.variants[vi].cfg.name)
            .get(&url)
            .send()
            .await?
            .error_for_status()?
            .text()
            .await
    })
    .await;
    if let Ok(Ok(text)) = r {
        let (kv, waiting) = parse_load_metrics(&text);
        pool.record_scrape(vi, kv, waiting);
    }
}

fn publish_gauges(pool: &Pool) {
    for s in pool.snapshot() {
        let labels = [
            ("pool", pool.cfg.name.as_str()),
            ("variant", s.name.as_str()),
        ];
        let m = &pool.metrics;
        m.gauge("keel_variant_weight", &labels).set(s.weight);
        m.gauge("keel_variant_ttft_seconds", &labels)
            .set(s.ttft_ms.unwrap_or(0.0) / 1000.0);
        m.gauge("keel_variant_gap_seconds", &labels)
            .set(s.gap_ms.unwrap_or(0.0) / 1000.0);
        m.gauge("keel_variant_tgsv_seconds", &labels)
            .set(s.tgsv_ms.unwrap_or(0.0) / 1000.0);
        m.gauge("keel_variant_inflight", &labels)
            .set(s.in_flight as f64);
        m.gauge("keel_variant_state", &labels)
            .set(s.state_code as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_and_llamacpp_names() {
        let vllm = "# HELP x\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.42\nvllm:num_requests_waiting{model_name=\"m\"} 3\n";
        assert_eq!(parse_load_metrics(vllm), (Some(0.42), Some(3.0)));
        let llama = "llamacpp:kv_cache_usage_ratio 0.5\nllamacpp:requests_deferred 2\n";
        assert_eq!(parse_load_metrics(llama), (Some(0.5), Some(2.0)));
        assert_eq!(parse_load_metrics("other 1\n"), (None, None));
    }
}
