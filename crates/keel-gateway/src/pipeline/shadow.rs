//! Shadow traffic: copies of served requests sent to variants that never answer a client, and
//! their answers compared with the served one (`keel_core::compare`).
//!
//! The hook is called once a request's answer is complete (the relay's clean end of a stream,
//! or a whole answer in delivery), with the text the client got. A sampled request (`sample`,
//! decided by a hash of the request id) is sent to every shadow variant in a spawned task, so
//! the client's response is never delayed; the copy goes non-streaming, with the client's
//! forwarded headers but none of its context: it is not metered against the client's key,
//! takes no capacity slot or retry budget of the pool, and its failures reach no client. Its
//! own bounds: `max_in_flight` copies at once and `max_per_minute`; past them a sampled request
//! is skipped (counted). Results: `GET /keel/shadow/{pool}` and `keel_shadow_*` metrics; a pool
//! with a canary also takes each similarity as canary agreement.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use keel_core::compare::{answer_text, compare};
use keel_core::protocol::{self, Endpoint};
use keel_core::request::CanonicalRequest;
use keel_core::tokens;

use crate::config::VariantConfig;
use crate::pipeline::context::RequestCtx;
use crate::state::pools::Pool;
use crate::wire::errors::{ErrorKind, GatewayError};

/// What the client was served, for the comparison.
pub struct ServedAnswer {
    pub text: String,
    pub latency_ms: f64,
}

/// Called when a request's answer is complete: sends sampled copies to the pool's shadow
/// variants in the background.
pub fn after_served(
    pool: &Arc<Pool>,
    req: &CanonicalRequest,
    ctx: &RequestCtx,
    served: ServedAnswer,
) {
    let Some(shadow) = &pool.shadow else {
        return;
    };
    if !ctx.endpoint.generates() || !shadow.sampled(&ctx.id) {
        return;
    }
    let served = Arc::new(served);
    for (i, variant) in shadow.cfg.variants.iter().enumerate() {
        if !shadow.admit(pool.now_ms()) {
            shadow.summaries()[i].skipped += 1;
            count(pool, variant, "skipped");
            continue;
        }
        let body = match copy_for(variant, req) {
            Ok(b) => b,
            Err(why) => {
                tracing::debug!(pool = %pool.cfg.name, variant = %variant.name, %why, "shadow copy not sent");
                shadow.in_flight.fetch_sub(1, Ordering::AcqRel);
                shadow.summaries()[i].failed += 1;
                count(pool, variant, "failed");
                continue;
            }
        };
        let pool = pool.clone();
        let variant = variant.clone();
        let forwarded = ctx.forwarded.clone();
        let served = served.clone();
        tokio::spawn(async move {
            let got = send(&pool, &variant, body, &forwarded).await;
            if let Some(s) = &pool.shadow {
                s.in_flight.fetch_sub(1, Ordering::AcqRel);
            }
            settle(&pool, i, &served, got);
        });
    }
}

/// The copy's endpoint and body: non-streaming, in the variant's protocol, with its upstream
/// model and parameters.
fn copy_for(
    variant: &VariantConfig,
    req: &CanonicalRequest,
) -> Result<(Endpoint, Vec<u8>), GatewayError> {
    let (endpoint, mut body) = match crate::upstream::translation::translate_request(variant, req) {
        Ok(None) => (
            req.endpoint,
            req.upstream_body(&variant.upstream_model, &variant.params),
        ),
        Ok(Some(t)) => (t.endpoint, t.body),
        Err(e) => return Err(e.into()),
    };
    body.insert("stream".into(), Value::Bool(false));
    body.remove("stream_options");
    serde_json::to_vec(&body)
        .map(|b| (endpoint, b))
        .map_err(|e| GatewayError::new(protocol::ErrorKind::Internal, e.to_string()))
}

/// The shadow's answer text and how long it took (ms), or why there is none.
async fn send(
    pool: &Pool,
    variant: &VariantConfig,
    (endpoint, body): (Endpoint, Vec<u8>),
    forwarded: &http::HeaderMap,
) -> Result<(String, f64), GatewayError> {
    let failed = |kind: ErrorKind, why: String| GatewayError::new(kind, why);
    let started = Instant::now();
    let deadline = started + Duration::from_millis(pool.cfg.timeouts.total_ms);
    let send = pool.client.send(
        &variant.name,
        crate::upstream::request(variant, endpoint, forwarded, None, body),
    );
    let resp = match tokio::time::timeout_at(deadline, send).await {
        Err(_) => return Err(failed(ErrorKind::Io, "timed out".into())),
        Ok(Err(e)) => return Err(failed(e.kind, format!("transport: {e}"))),
        Ok(Ok(r)) => r,
    };
    if !resp.status.is_success() {
        let status = resp.status.as_u16();
        return Err(failed(ErrorKind::Upstream, format!("status {status}")));
    }
    let bytes =
        crate::pipeline::attempt::read_body(resp, pool.limits.max_body_bytes, deadline, started)
            .await
            .map_err(|f| failed(ErrorKind::Upstream, f.label()))?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| failed(ErrorKind::Malformed, format!("not JSON: {e}")))?;
    let text =
        answer_text(&v).ok_or_else(|| failed(ErrorKind::Malformed, "no answer text".into()))?;
    Ok((text, started.elapsed().as_secs_f64() * 1000.0))
}

/// Records one copy's result.
fn settle(pool: &Pool, i: usize, served: &ServedAnswer, got: Result<(String, f64), GatewayError>) {
    let Some(shadow) = &pool.shadow else {
        return;
    };
    let variant = &shadow.cfg.variants[i];
    let (text, ms) = match got {
        Ok(x) => x,
        Err(why) => {
            tracing::debug!(pool = %pool.cfg.name, variant = %variant.name, %why, "shadow copy failed");
            shadow.summaries()[i].failed += 1;
            count(pool, variant, "failed");
            return;
        }
    };
    let c = compare(
        &served.text,
        &text,
        served.latency_ms,
        ms,
        tokens::count(&served.text) as u64,
        tokens::count(&text) as u64,
    );
    let (similarity, latency_delta_ms) = {
        let mut s = shadow.summaries();
        s[i].add(&c);
        (s[i].mean_similarity(), s[i].mean_latency_delta_ms())
    };
    count(pool, variant, "compared");
    let labels = [
        ("pool", pool.cfg.name.as_str()),
        ("variant", variant.name.as_str()),
    ];
    pool.metrics
        .gauge("keel_shadow_similarity", &labels)
        .set(similarity.unwrap_or(1.0));
    pool.metrics
        .gauge("keel_shadow_latency_delta_seconds", &labels)
        .set(latency_delta_ms.unwrap_or(0.0) / 1000.0);
    if let Some(canary) = &pool.canary {
        canary.observe_agreement(c.similarity, pool.now_ms());
    }
}

fn count(pool: &Pool, variant: &VariantConfig, outcome: &'static str) {
    pool.metrics
        .counter(
            "keel_shadow_requests_total",
            &[
                ("pool", &pool.cfg.name),
                ("variant", &variant.name),
                ("outcome", outcome),
            ],
        )
        .increment(1);
}
