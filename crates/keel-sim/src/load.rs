//! Open-loop load generator (`keel sim load`).
//!
//! Requests are sent at a constant arrival rate whatever the server does (open loop): each is
//! dispatched at its scheduled time on its own task, never waiting for earlier responses, so a
//! stalled server cannot slow the generator down and hide its stalls (no coordinated omission).
//! Latencies are measured from the dispatch instant: the timer wakes the generator up to about
//! a millisecond after the schedule, and that slack is not the server's. The lag between
//! schedule and dispatch is reported (`dispatch_lag`), so a generator that fell behind shows.
//! Latencies go into HDR histograms (microsecond resolution): time to first token, total time,
//! inter-token gaps.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::{json, Value};

use keel_core::protocol::{event_role, Endpoint, EventRole};
use keel_core::sse::SseDecoder;
use keel_core::stream_watch::carries_tokens;

/// What to send.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// Base URL as an SDK takes it (`http://127.0.0.1:8080/v1` for OpenAI endpoints,
    /// `http://127.0.0.1:8080` for Anthropic's).
    pub url: String,
    pub endpoint: Endpoint,
    pub model: String,
    pub rps: f64,
    pub duration: Duration,
    pub stream: bool,
    /// Requests beyond this many in flight are not sent and count as `shed`.
    pub concurrency_limit: Option<usize>,
    pub max_tokens: u64,
    /// Extra request headers.
    pub headers: Vec<(String, String)>,
    /// Prompts used in rotation.
    pub prompts: Vec<String>,
    /// How long one request may take, from its send to its last byte; one that takes longer
    /// is abandoned and counted as a `timeout` error. Without it a request that never ends
    /// (a connection the pool handed out and nobody answers on) would hold the whole run.
    pub request_timeout: Duration,
    /// Speak HTTP/1.1 only, over TLS too (where ALPN would pick HTTP/2): to compare a TLS
    /// gateway with a plain one on the same protocol.
    pub http1_only: bool,
    /// A CA bundle (PEM) trusted besides the system's roots, for an https target whose
    /// certificate a private CA signed.
    pub ca_pem: Option<Vec<u8>>,
}

/// A prompt of `words` words of keel-sim's vocabulary, in sentences (a realistic prompt's size
/// for what parsing, normalizing and counting it costs a gateway); `seed` varies the text, so
/// prompts in rotation differ from their first words.
pub fn prompt_of_words(words: usize, seed: u64) -> String {
    let mut out = String::with_capacity(words * 8);
    for i in 0..words as u64 {
        if i > 0 {
            out.push_str(if i % 12 == 0 { ". " } else { " " });
        }
        out.push_str(crate::text::word_for(
            seed.wrapping_mul(1_000_003).wrapping_add(i),
        ));
    }
    out.push('.');
    out
}

impl LoadConfig {
    pub fn new(url: &str, model: &str) -> Self {
        LoadConfig {
            url: url.trim_end_matches('/').to_owned(),
            endpoint: Endpoint::ChatCompletions,
            model: model.to_owned(),
            rps: 10.0,
            duration: Duration::from_secs(5),
            stream: false,
            concurrency_limit: None,
            max_tokens: 32,
            headers: Vec::new(),
            prompts: vec!["Say something about routing.".into()],
            request_timeout: Duration::from_secs(60),
            http1_only: false,
            ca_pem: None,
        }
    }

    fn body(&self, i: usize) -> Value {
        let prompt = &self.prompts[i % self.prompts.len().max(1)];
        match self.endpoint {
            Endpoint::Completions => {
                json!({"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "stream": self.stream})
            }
            _ => json!({"model": self.model, "max_tokens": self.max_tokens, "stream": self.stream,
                "messages": [{"role": "user", "content": prompt}]}),
        }
    }

    fn target(&self) -> String {
        let path = self.endpoint.upstream_path();
        format!("{}{}", self.url, path)
    }
}

/// Percentiles of one measure, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, Default, PartialEq)]
pub struct Summary {
    pub count: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl Summary {
    pub fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Summary::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Summary {
            count: h.len(),
            p50_ms: ms(h.value_at_quantile(0.5)),
            p90_ms: ms(h.value_at_quantile(0.9)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            p999_ms: ms(h.value_at_quantile(0.999)),
            max_ms: ms(h.max()),
            mean_ms: h.mean() / 1000.0,
        }
    }
}

/// The outcome of a run.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    pub sent: u64,
    pub ok: u64,
    pub errors: u64,
    /// Not sent because of the concurrency limit.
    pub shed: u64,
    /// Error kinds (`status_503`, `connect`, `stream_error`, …) with counts.
    pub error_kinds: BTreeMap<String, u64>,
    pub ttft: Summary,
    pub total: Summary,
    pub gap: Summary,
    /// Events carrying generated tokens (text, tool-call arguments) received on streams: about
    /// one per token.
    pub tokens: u64,
    /// How late requests were dispatched relative to their schedule.
    pub dispatch_lag: Summary,
    /// Requests sent ÷ the whole run's wall time (the last responses' drain included).
    pub achieved_rps: f64,
    /// The most requests in flight at once (sent, not yet answered in full).
    pub peak_in_flight: u64,
}

impl LoadReport {
    /// A plain-text table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "sent {}  ok {}  errors {}  shed {}  achieved {:.1} req/s\n",
            self.sent, self.ok, self.errors, self.shed, self.achieved_rps
        );
        s.push_str(&format!(
            "{:<8} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
            "measure", "count", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms"
        ));
        for (name, m) in [
            ("ttft", &self.ttft),
            ("total", &self.total),
            ("gap", &self.gap),
        ] {
            s.push_str(&format!(
                "{:<8} {:>8} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3}\n",
                name, m.count, m.p50_ms, m.p90_ms, m.p99_ms, m.p999_ms, m.max_ms
            ));
        }
        s.push_str(&format!(
            "dispatch lag p50 {:.3} ms, p99 {:.3} ms\n",
            self.dispatch_lag.p50_ms, self.dispatch_lag.p99_ms
        ));
        for (k, v) in &self.error_kinds {
            s.push_str(&format!("error {k}: {v}\n"));
        }
        s
    }
}

struct Recorder {
    ttft: Histogram<u64>,
    total: Histogram<u64>,
    gap: Histogram<u64>,
    tokens: u64,
    ok: u64,
    errors: BTreeMap<String, u64>,
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static histogram bounds are valid")
}

/// Runs the load and returns the report.
pub async fn run(cfg: LoadConfig) -> LoadReport {
    crate::install_crypto();
    let mut builder = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true);
    if cfg.http1_only {
        builder = builder.http1_only();
    }
    if let Some(pem) = &cfg.ca_pem {
        match reqwest::Certificate::from_pem_bundle(pem) {
            Ok(certs) => builder = builder.tls_certs_merge(certs),
            Err(e) => {
                eprintln!("the CA bundle is unusable ({e}): only the system's roots are trusted")
            }
        }
    }
    let client = builder.build().unwrap_or_else(|_| reqwest::Client::new());
    run_with_client(cfg, client).await
}

/// Runs the load with a given client (to share connection pools between runs).
pub async fn run_with_client(cfg: LoadConfig, client: reqwest::Client) -> LoadReport {
    let rec = Arc::new(Mutex::new(Recorder {
        ttft: hist(),
        total: hist(),
        gap: hist(),
        tokens: 0,
        ok: 0,
        errors: BTreeMap::new(),
    }));
    let in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let cfg = Arc::new(cfg);
    let interval = Duration::from_secs_f64(1.0 / cfg.rps.max(0.001));
    let total = (cfg.duration.as_secs_f64() * cfg.rps).round() as usize;
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(total);
    let mut shed = 0;
    let mut peak_in_flight = 0;
    let mut lag = hist();
    for i in 0..total {
        let scheduled = start + interval.mul_f64(i as f64);
        tokio::time::sleep_until(scheduled.into()).await;
        let dispatched = Instant::now();
        let _ = lag.record(dispatched.saturating_duration_since(scheduled).as_micros() as u64 + 1);
        if let Some(limit) = cfg.concurrency_limit {
            if in_flight.load(std::sync::atomic::Ordering::Relaxed) >= limit {
                shed += 1;
                continue;
            }
        }
        let now_in_flight = in_flight.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        peak_in_flight = peak_in_flight.max(now_in_flight);
        let (client, cfg, rec, in_flight) =
            (client.clone(), cfg.clone(), rec.clone(), in_flight.clone());
        tasks.push(tokio::spawn(async move {
            let result =
                tokio::time::timeout(cfg.request_timeout, one(&client, &cfg, i, dispatched))
                    .await
                    .unwrap_or_else(|_| Err("timeout".to_owned()));
            in_flight.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            let mut r = rec.lock().unwrap_or_else(|e| e.into_inner());
            match result {
                Ok(m) => {
                    r.ok += 1;
                    r.tokens += m.tokens;
                    let _ = r.ttft.record(m.ttft_us.max(1));
                    let _ = r.total.record(m.total_us.max(1));
                    for g in m.gaps_us {
                        let _ = r.gap.record(g.max(1));
                    }
                }
                Err(kind) => *r.errors.entry(kind).or_default() += 1,
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let r = rec.lock().unwrap_or_else(|e| e.into_inner());
    let errors = r.errors.values().sum();
    LoadReport {
        sent: (total - shed) as u64,
        ok: r.ok,
        errors,
        shed: shed as u64,
        error_kinds: r.errors.clone(),
        ttft: Summary::of(&r.ttft),
        total: Summary::of(&r.total),
        gap: Summary::of(&r.gap),
        tokens: r.tokens,
        dispatch_lag: Summary::of(&lag),
        achieved_rps: (total - shed) as f64 / elapsed.max(1e-9),
        peak_in_flight: peak_in_flight as u64,
    }
}

struct Measured {
    ttft_us: u64,
    total_us: u64,
    gaps_us: Vec<u64>,
    tokens: u64,
}

async fn one(
    client: &reqwest::Client,
    cfg: &LoadConfig,
    i: usize,
    scheduled: Instant,
) -> Result<Measured, String> {
    let mut req = client
        .post(cfg.target())
        .header("content-type", "application/json")
        .body(cfg.body(i).to_string());
    if cfg.endpoint.protocol() == keel_core::protocol::Protocol::Anthropic {
        req = req.header("anthropic-version", "2023-06-01");
    }
    for (k, v) in &cfg.headers {
        req = req.header(k, v);
    }
    let resp = req.send().await.map_err(|e| {
        if e.is_connect() {
            "connect".to_owned()
        } else {
            "io".to_owned()
        }
    })?;
    let status = resp.status().as_u16();
    if status != 200 {
        return Err(format!("status_{status}"));
    }
    let us = |t: Instant| t.saturating_duration_since(scheduled).as_micros() as u64;
    if !cfg.stream {
        let body = resp.bytes().await.map_err(|_| "io".to_owned())?;
        serde_json::from_slice::<Value>(&body).map_err(|_| "malformed".to_owned())?;
        let now = us(Instant::now());
        return Ok(Measured {
            ttft_us: now,
            total_us: now,
            gaps_us: Vec::new(),
            tokens: 0,
        });
    }
    let protocol = cfg.endpoint.protocol();
    let mut dec = SseDecoder::new();
    let mut events = Vec::new();
    let mut body = resp.bytes_stream();
    let mut first: Option<u64> = None;
    let mut last = Instant::now();
    let mut gaps = Vec::new();
    let mut terminal = false;
    let mut tokens = 0;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|_| "stream_broken".to_owned())?;
        dec.feed(&chunk, &mut events)
            .map_err(|_| "stream_framing".to_owned())?;
        for ev in events.drain(..) {
            match event_role(protocol, &ev) {
                EventRole::Output => {
                    tokens += u64::from(carries_tokens(protocol, &ev));
                    let now = Instant::now();
                    match first {
                        None => first = Some(us(now)),
                        Some(_) => gaps.push(now.duration_since(last).as_micros() as u64),
                    }
                    last = now;
                }
                EventRole::Terminal => terminal = true,
                EventRole::Error(_) => return Err("stream_error".into()),
                EventRole::Malformed(_) => return Err("stream_malformed".into()),
                EventRole::KeepAlive | EventRole::Preamble => {}
            }
        }
    }
    if !terminal {
        return Err("stream_incomplete".into());
    }
    Ok(Measured {
        ttft_us: first.unwrap_or_else(|| us(Instant::now())),
        total_us: us(Instant::now()),
        gaps_us: gaps,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::prompt_of_words;

    #[test]
    fn a_prompt_has_the_words_asked_for_and_seeds_vary_it() {
        for words in [1, 12, 13, 500] {
            let p = prompt_of_words(words, 3);
            assert_eq!(p.split_whitespace().count(), words, "{p}");
            assert_eq!(p, prompt_of_words(words, 3));
        }
        assert_ne!(prompt_of_words(50, 1), prompt_of_words(50, 2));
    }
}
