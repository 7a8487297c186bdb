//! The load generator's client: one request with the OpenAI SDK's default retry policy, its
//! answer read and compared with the reference text.

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
}

/// The OpenAI SDK's default retry policy around one request.
pub(crate) async fn sdk_request(
    client: &reqwest::Client,
    url: &str,
    headers: &[(String, String)],
    body: &Value,
    reference: &str,
    rng_seed: u64,
) -> Seen {
    let started = Instant::now();
    let mut rng = Rng::new(rng_seed);
    let mut seen = Seen::default();
    let mut advised = false;
    for attempt in 0..=2u32 {
        let mut req = client.post(url).json(body).timeout(Duration::from_secs(60));
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let resp = req.send().await;
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
        if attempt == 2 {
            break;
        }
        advised = retry_wait.is_some();
        let backoff = retry_wait.unwrap_or_else(|| {
            (0.5 * 2f64.powi(attempt as i32)).min(8.0) * (1.0 - 0.25 * rng.next_f64())
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
