//! The load generator's client: one request with the OpenAI SDK's default retry policy (or,
//! with `honour_retry_after`, a client that keeps coming back when told to), its answer read
//! and compared with the reference text.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;

use keel_core::rng::Rng;

/// What one request ended as, seen by the client.
#[derive(Default)]
pub(crate) struct Seen {
    pub(crate) ttft_us: Option<u64>,
    pub(crate) total_us: u64,
    pub(crate) ok: bool,
    pub(crate) intact: bool,
    pub(crate) tgsv_ms: Option<f64>,
    /// Retries made after waiting an advertised retry-after, and how many of them succeeded.
    pub(crate) advised_retries: u32,
    pub(crate) advised_ok: u32,
    pub(crate) cached: u64,
    pub(crate) prompt: u64,
    /// The request's priority (`x-keel-priority`), when the scenario sets one.
    pub(crate) priority: Option<keel_core::queue::Priority>,
    /// 429 and 503 answers it got (each followed by a retry, or the end).
    pub(crate) refusals: u32,
    /// Answers (of any status) whose headers came after the request's deadline.
    pub(crate) late: u32,
}

/// How the client retries.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Policy {
    /// Retry 429/503 answers that carry a retry-after as often as it takes (within
    /// [`WORK_LIMIT`]), waiting what they advise; otherwise the SDK's two retries.
    pub(crate) honour_retry_after: bool,
    /// Sent as `x-keel-timeout-ms`; answers later than this count as late.
    pub(crate) deadline_ms: Option<u64>,
}

/// A client that honours retry-after gives up on a piece of work after this long.
const WORK_LIMIT: Duration = Duration::from_secs(120);

/// One piece of work: the request with its retries (see [`Policy`]).
pub(crate) async fn sdk_request(
    client: &reqwest::Client,
    url: &str,
    headers: &[(String, String)],
    body: &Value,
    reference: &str,
    rng_seed: u64,
    policy: Policy,
) -> Seen {
    let started = Instant::now();
    let mut rng = Rng::new(rng_seed);
    let mut seen = Seen::default();
    let mut advised = false;
    let mut attempt = 0u32;
    loop {
        let mut req = client.post(url).json(body).timeout(Duration::from_secs(60));
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let sent = Instant::now();
        let resp = req.send().await;
        if policy
            .deadline_ms
            .is_some_and(|ms| sent.elapsed() > Duration::from_millis(ms))
        {
            seen.late += 1;
        }
        if std::mem::take(&mut advised) {
            seen.advised_retries += 1;
            seen.advised_ok += u32::from(resp.as_ref().is_ok_and(|r| r.status().is_success()));
        }
        let retry_wait = match resp {
            Ok(r) if r.status().is_success() => {
                read_answer(
                    r,
                    body["stream"].as_bool().unwrap_or(false),
                    started,
                    reference,
                    &mut seen,
                )
                .await;
                seen.total_us = started.elapsed().as_micros() as u64;
                return seen;
            }
            Ok(r) => {
                let status = r.status().as_u16();
                seen.refusals += u32::from(matches!(status, 429 | 503));
                if !matches!(status, 408 | 409 | 429 | 500..=599) {
                    break;
                }
                let h = |n: &str| {
                    r.headers()
                        .get(n)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<f64>().ok())
                };
                h("retry-after-ms")
                    .map(|ms| ms / 1000.0)
                    .or(h("retry-after"))
                    .filter(|s| *s >= 0.0 && *s <= 60.0)
            }
            Err(_) => None,
        };
        // Told when to come back: such a client comes back then, for as long as the work may
        // take; any other failure gets the SDK's two retries.
        let told = policy.honour_retry_after && retry_wait.is_some();
        if (told && started.elapsed() >= WORK_LIMIT) || (!told && attempt >= 2) {
            break;
        }
        attempt += u32::from(!told);
        advised = retry_wait.is_some();
        let backoff = retry_wait.unwrap_or_else(|| {
            (0.5 * 2f64.powi(attempt.saturating_sub(1) as i32)).min(8.0)
                * (1.0 - 0.25 * rng.next_f64())
        });
        tokio::time::sleep(Duration::from_secs_f64(backoff)).await;
    }
    seen.total_us = started.elapsed().as_micros() as u64;
    seen
}

pub(crate) async fn read_answer(
    resp: reqwest::Response,
    stream: bool,
    started: Instant,
    reference: &str,
    seen: &mut Seen,
) {
    if !stream {
        if let Ok(v) = resp.json::<Value>().await {
            seen.ttft_us = Some(started.elapsed().as_micros() as u64);
            seen.ok = v["choices"][0]["message"]["content"].is_string();
            seen.intact = v["choices"][0]["message"]["content"].as_str() == Some(reference);
            seen.cached = v
                .pointer("/usage/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            seen.prompt = v
                .pointer("/usage/prompt_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
        }
        return;
    }
    let mut dec = keel_core::sse::SseDecoder::new();
    let mut events = Vec::new();
    let mut text = String::new();
    let mut gaps = Vec::new();
    let mut last: Option<Instant> = None;
    let mut done = false;
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let Ok(chunk) = chunk else { return };
        if dec.feed(&chunk, &mut events).is_err() {
            return;
        }
        for ev in events.drain(..) {
            if ev.comment_only {
                continue;
            }
            if ev.data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
                return;
            };
            if v.get("error").is_some() {
                return;
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                seen.cached = u
                    .pointer("/prompt_tokens_details/cached_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                seen.prompt = u["prompt_tokens"].as_u64().unwrap_or(0);
            }
            if let Some(t) = v
                .pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
            {
                let now = Instant::now();
                match last {
                    None => seen.ttft_us = Some(started.elapsed().as_micros() as u64),
                    Some(l) => gaps.push(now.duration_since(l).as_secs_f64() * 1000.0),
                }
                last = Some(now);
                text.push_str(t);
            }
        }
    }
    seen.ok = done;
    seen.intact = done && text == reference;
    if gaps.len() >= 2 {
        let m = gaps.iter().sum::<f64>() / gaps.len() as f64;
        seen.tgsv_ms = Some(
            (gaps.iter().map(|g| (g - m) * (g - m)).sum::<f64>() / (gaps.len() - 1) as f64).sqrt(),
        );
    }
}
