//! `keel bench <scenario>`: seed scenarios on a simulated fleet, with every contender that can
//! run here (keel; nginx round robin, LiteLLM's proxy and Portkey's gateway through
//! `bench/peers/*.sh`), each against an identical fresh fleet and the identical
//! arrival sequence. The load generator acts as a client with the OpenAI SDK's default retry
//! policy (2 retries, exponential backoff from 0.5 s with jitter, honouring retry-after up to
//! 60 s). Every answer is compared with the simulator's deterministic reference text.
//!
//! Scenario files live in `bench/scenarios/*.toml`: the fleet (keel-sim's format under
//! `[fleet]`), the load, timed fault events, and keel's pool settings.
//!
//! **Flatness.** A scenario with faults also runs as its fault-free twin: the same fleet, load
//! and seeds with every fault and event removed (and the server settings named in `twin`
//! changed, e.g. heavy-tail's twin has no tail). The report divides each contender's P99 and
//! P99.9 under fault by its own fault-free figures: 1.0× is a layer that hides the fault
//! completely.
//!
//! Contender `keel-rr` is keel with `policy = "round_robin"` and no affinity: keel's own
//! baseline, so a comparison needs no peer gateway installed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use hdrhistogram::Histogram;
use serde::Deserialize;
use serde_json::{json, Value};

use keel_core::protocol::{Endpoint, Protocol};
use keel_core::rng::Rng;
use keel_sim::config::PrefillConvention;
use keel_sim::text::Generator;
use keel_sim::{FaultSpec, Fleet, FleetConfig, ServerHandle};

/// A scenario file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    pub description: String,
    #[serde(default = "d_duration")]
    pub duration_s: f64,
    #[serde(default = "d_quick")]
    pub quick_duration_s: f64,
    pub rps: f64,
    #[serde(default = "d_true")]
    pub stream: bool,
    #[serde(default = "d_max_tokens")]
    pub max_tokens: u64,
    /// Shares of short, medium and long prompts.
    #[serde(default = "d_mix")]
    pub prompt_mix: [f64; 3],
    /// Requests share this many long system prompts (prefix-reuse).
    #[serde(default)]
    pub shared_prefixes: u32,
    /// Lines added to keel's pool table.
    #[serde(default)]
    pub keel_pool: String,
    /// Lines added to each of keel's variant tables (e.g. `health_path = "/health"`).
    #[serde(default)]
    pub keel_variant: String,
    pub fleet: FleetConfig,
    #[serde(default)]
    pub events: Vec<Event>,
    /// Server settings the fault-free twin changes besides dropping faults and events, e.g.
    /// `twin = { tail_prob = 0.0 }`.
    #[serde(default)]
    pub twin: Option<toml::Table>,
}

fn d_duration() -> f64 {
    60.0
}
fn d_quick() -> f64 {
    4.0
}
fn d_true() -> bool {
    true
}
fn d_max_tokens() -> u64 {
    64
}
fn d_mix() -> [f64; 3] {
    [0.7, 0.25, 0.05]
}

/// A fault change at a share of the run.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Event {
    /// When, as a share of the duration (0..1).
    pub at: f64,
    /// Server index in the expanded fleet.
    pub server: usize,
    /// Faults to add; empty with `clear = true` clears the server's faults.
    #[serde(default)]
    pub faults: Vec<FaultSpec>,
    #[serde(default)]
    pub clear: bool,
}

impl Scenario {
    pub fn load(path: &Path) -> Result<Scenario, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let s: Scenario =
            toml::from_str(&text).map_err(|e| format!("{}: {}", path.display(), e.message()))?;
        s.fleet
            .validate()
            .map_err(|e| format!("{}: fleet.{e}", path.display()))?;
        s.fault_free()
            .map_err(|e| format!("{}: twin: {e}", path.display()))?;
        Ok(s)
    }

    /// Whether the scenario differs from its fault-free twin.
    pub fn has_faults(&self) -> bool {
        !self.events.is_empty()
            || self.fleet.servers.iter().any(|s| !s.faults.is_empty())
            || self.twin.as_ref().is_some_and(|t| !t.is_empty())
    }

    /// The fault-free twin: the same fleet, load and keel settings without faults and events,
    /// with the `twin` server settings applied.
    pub fn fault_free(&self) -> Result<Scenario, String> {
        let mut t = self.clone();
        t.name = format!("{} (fault-free)", self.name);
        t.events.clear();
        t.twin = None;
        for srv in &mut t.fleet.servers {
            srv.faults.clear();
            if let Some(over) = &self.twin {
                let mut table = toml::Table::try_from(&*srv).map_err(|e| e.to_string())?;
                table.extend(over.clone());
                *srv = table
                    .try_into()
                    .map_err(|e: toml::de::Error| e.message().to_owned())?;
            }
        }
        t.fleet.validate().map_err(|e| format!("fleet.{e}"))?;
        Ok(t)
    }
}

/// One request of the arrival sequence.
struct Planned {
    at: Duration,
    body: Value,
    reference: String,
}

fn prompt(rng: &mut Rng, mix: [f64; 3], i: usize, prefixes: &[String]) -> Value {
    let filler = "Explain how the routing layer keeps latency flat when a backend misbehaves. ";
    let question = format!(
        "Request {i}: {}",
        [
            "what is a seam?",
            "why hedge?",
            "how do retries storm?",
            "what is TGSV?"
        ][i % 4]
    );
    if !prefixes.is_empty() {
        let p = &prefixes[(rng.next_u64() % prefixes.len() as u64) as usize];
        return json!([{"role": "system", "content": p}, {"role": "user", "content": question}]);
    }
    let r = rng.next_f64();
    let content = if r < mix[0] {
        question
    } else if r < mix[0] + mix[1] {
        format!("{}{question}", filler.repeat(15))
    } else {
        format!("{}{question}", filler.repeat(110))
    };
    json!([{"role": "user", "content": content}])
}

fn plan(s: &Scenario, duration: f64, seed: u64) -> Vec<Planned> {
    let mut rng = Rng::new(seed);
    let prefixes: Vec<String> = (0..s.shared_prefixes)
        .map(|i| {
            // About 600 tokens: the house name, then 66 sentences of 9 tokens.
            format!("House style guide {i}. ")
                + &"Always answer precisely and cite the routing policy. ".repeat(66)
        })
        .collect();
    let generator = Generator::new("default", s.fleet.generation);
    let n = (duration * s.rps).round() as usize;
    (0..n)
        .map(|i| {
            let mut body = json!({"model": "bench", "max_tokens": s.max_tokens, "stream": s.stream, "messages": prompt(&mut rng, s.prompt_mix, i, &prefixes)});
            if s.stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            let reference = reference_text(&generator, Endpoint::ChatCompletions, &body);
            Planned { at: Duration::from_secs_f64(i as f64 / s.rps), body, reference }
        })
        .collect()
}

/// What one request ended as, seen by the client.
#[derive(Default)]
struct Seen {
    ttft_us: Option<u64>,
    total_us: u64,
    ok: bool,
    intact: bool,
    tgsv_ms: Option<f64>,
    /// Retries made after waiting an advertised retry-after, and how many of them succeeded.
    advised_retries: u32,
    advised_ok: u32,
    cached: u64,
    prompt: u64,
}

/// The OpenAI SDK's default retry policy around one request.
async fn sdk_request(
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

async fn read_answer(
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

/// A contender: something that serves `model` "bench" at `url` over the fleet.
pub struct Running {
    pub url: String,
    /// Headers sent with every request (a peer's per-request routing config).
    pub headers: Vec<(String, String)>,
    /// The peer's main process (for memory and CPU pinning); `None` in-process.
    pub pid: Option<u32>,
    pub stop: Box<dyn FnOnce() + Send>,
}

/// A pool table named `name` (`extra` lines in it) with one OpenAI variant per simulated server.
pub fn pool_toml(fleet: &Fleet, name: &str, extra: &str) -> String {
    pool_toml_of(&fleet.servers, Protocol::OpenAi, name, extra)
}

/// A pool table named `name` (`extra` lines in it) with one variant speaking `protocol` per
/// simulated server.
pub fn pool_toml_of(
    servers: &[ServerHandle],
    protocol: Protocol,
    name: &str,
    extra: &str,
) -> String {
    pool_toml_with(servers, protocol, name, extra, "")
}

/// [`pool_toml_of`] with `variant_extra` lines in every variant table.
pub fn pool_toml_with(
    servers: &[ServerHandle],
    protocol: Protocol,
    name: &str,
    extra: &str,
    variant_extra: &str,
) -> String {
    let mut toml = format!("[[pools]]\nname = \"{name}\"\n{extra}\n");
    for srv in servers {
        let url = match protocol {
            Protocol::OpenAi => srv.openai_base(),
            Protocol::Anthropic => srv.anthropic_base(),
        };
        toml.push_str(&format!(
            "[[pools.variants]]\nname = \"{}\"\nurl = \"{url}\"\nprotocol = \"{}\"\nupstream_model = \"sim\"\n{variant_extra}\n",
            srv.name,
            protocol.as_str()
        ));
    }
    toml
}

/// The text a simulated server of `generator`'s family answers to `body` on `endpoint` when
/// nothing goes wrong: what every answer through a gateway must equal byte for byte.
pub fn reference_text(generator: &Generator, endpoint: Endpoint, body: &Value) -> String {
    let sreq = keel_sim::wire::parse_request(endpoint, body, PrefillConvention::Explicit)
        .expect("bench requests are valid");
    generator
        .generate(
            sreq.mode,
            &sreq.context,
            &sreq.prefill,
            sreq.max_tokens,
            &sreq.stop,
        )
        .text()
}

/// An in-process gateway serving `toml` on a free loopback port, after its warm-up requests;
/// sending on the returned sender stops it.
pub async fn start_gateway(
    toml: &str,
    origin: &str,
) -> Result<(std::net::SocketAddr, tokio::sync::oneshot::Sender<()>), String> {
    let cfg = keel_gateway::Config::parse(toml, origin, &Default::default())
        .map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let gw = keel_gateway::Gateway::new(cfg);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(keel_gateway::server::serve(gw, listener, async move {
        let _ = rx.await;
    }));
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok((addr, tx))
}

/// keel's pool lines for `keel-rr`: the scenario's, with round robin instead of the policy and
/// without affinity.
fn round_robin_pool(extra: &str) -> String {
    let mut lines: Vec<&str> = extra
        .lines()
        .filter(|l| {
            let key = l.split('=').next().unwrap_or("").trim();
            key != "policy" && key != "affinity"
        })
        .collect();
    lines.push("policy = \"round_robin\"");
    lines.join("\n")
}

/// keel over the fleet with `pool` lines in its pool table (a contender `keel:LINES` adds
/// LINES, `;`-separated, to the scenario's, e.g. `keel:max_hedges = 1`).
async fn start_keel(s: &Scenario, fleet: &Fleet, pool: &str) -> Result<Running, String> {
    let toml = pool_toml_with(
        &fleet.servers,
        Protocol::OpenAi,
        "bench",
        pool,
        &s.keel_variant,
    );
    let (addr, tx) = start_gateway(&toml, &format!("<scenario {}>", s.name)).await?;
    Ok(Running {
        url: format!("http://{addr}/v1/chat/completions"),
        headers: Vec::new(),
        pid: None,
        stop: Box::new(move || {
            let _ = tx.send(());
        }),
    })
}

/// A peer gateway started by its script in `bench/peers/<name>.sh DIR PORT BASE_URL...`, which
/// writes `DIR/<name>.pid`; it serves the fleet as model `bench` on `PORT`.
pub async fn start_peer(name: &str, fleet: &Fleet, out: &Path) -> Result<Running, String> {
    let script = PathBuf::from(format!("bench/peers/{name}.sh"));
    if !script.exists() {
        return Err(format!("no peer script {}", script.display()));
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let dir = out.join(name);
    let status = std::process::Command::new("bash")
        .arg(&script)
        .arg(&dir)
        .arg(port.to_string())
        .args(fleet.servers.iter().map(|s| s.openai_base()))
        .status()
        .map_err(|e| format!("{name}: {e}"))?;
    if !status.success() {
        return Err(format!("{} exited with {status}", script.display()));
    }
    let pid_file = dir.join(format!("{name}.pid"));
    let stop = move || {
        if let Ok(pid) = std::fs::read_to_string(&pid_file) {
            let _ = std::process::Command::new("kill").arg(pid.trim()).status();
        }
    };
    let headers: Vec<(String, String)> = std::fs::read_to_string(dir.join("headers.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<BTreeMap<String, String>>(&t).ok())
        .map(|m| m.into_iter().collect())
        .unwrap_or_default();
    // Ready when it answers a request (LiteLLM takes seconds to start).
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let client = reqwest::Client::new();
    let probe = json!({"model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]});
    for _ in 0..600 {
        let mut req = client.post(&url).json(&probe);
        for (k, v) in &headers {
            req = req.header(k, v);
        }
        if req
            .send()
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false)
        {
            let pid = std::fs::read_to_string(dir.join(format!("{name}.pid")))
                .ok()
                .and_then(|p| p.trim().parse().ok());
            return Ok(Running {
                url,
                headers,
                pid,
                stop: Box::new(stop),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop();
    Err(format!(
        "{name} did not answer within 120 s (see {}/)",
        dir.display()
    ))
}

/// Figures of one contender on one scenario.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Figures {
    pub contender: String,
    pub requests: usize,
    pub ttft_ms: [f64; 4],
    pub total_ms: [f64; 4],
    pub error_rate: f64,
    pub intact: f64,
    pub tgsv_ms: f64,
    pub extra_requests: f64,
    pub extra_tokens: f64,
    pub admitted_rps: f64,
    pub kv_hit_rate: f64,
    /// Prompt tokens the fleet computed (not found in its KV caches) per request.
    pub prefill_tokens: f64,
    /// The busiest variant's upstream requests ÷ the mean over variants.
    pub request_balance: f64,
    /// The highest time-averaged in-flight count (running + waiting) of a variant ÷ the mean.
    pub inflight_balance: f64,
    /// Share of retries made after waiting an advertised retry-after that succeeded.
    pub retry_after_success: Option<f64>,
    /// Runs the figures are medians of.
    pub runs: usize,
    /// Lowest and highest P99 TTFT and P99 total time (ms) across those runs.
    pub ttft_p99_range: [f64; 2],
    pub total_p99_range: [f64; 2],
    #[serde(skip)]
    pub ttft_cdf: Vec<(f64, f64)>,
}

/// The median of each figure across runs (the CDF of the run with the median P99 TTFT).
fn median_figures(mut runs: Vec<Figures>) -> Figures {
    fn med(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
    if runs.len() == 1 {
        return runs.remove(0);
    }
    runs.sort_by(|a, b| a.ttft_ms[2].total_cmp(&b.ttft_ms[2]));
    let m = |f: &dyn Fn(&Figures) -> f64| med(runs.iter().map(f).collect());
    let q = |f: &dyn Fn(&Figures) -> [f64; 4]| [0, 1, 2, 3].map(|i| m(&|x| f(x)[i]));
    let retry: Vec<f64> = runs.iter().filter_map(|x| x.retry_after_success).collect();
    let range = |f: &dyn Fn(&Figures) -> f64| {
        runs.iter()
            .map(f)
            .fold([f64::INFINITY, f64::NEG_INFINITY], |[lo, hi], v| {
                [lo.min(v), hi.max(v)]
            })
    };
    Figures {
        contender: runs[0].contender.clone(),
        requests: runs.iter().map(|x| x.requests).sum(),
        ttft_ms: q(&|x| x.ttft_ms),
        total_ms: q(&|x| x.total_ms),
        error_rate: m(&|x| x.error_rate),
        intact: m(&|x| x.intact),
        tgsv_ms: m(&|x| x.tgsv_ms),
        extra_requests: m(&|x| x.extra_requests),
        extra_tokens: m(&|x| x.extra_tokens),
        admitted_rps: m(&|x| x.admitted_rps),
        kv_hit_rate: m(&|x| x.kv_hit_rate),
        prefill_tokens: m(&|x| x.prefill_tokens),
        request_balance: m(&|x| x.request_balance),
        inflight_balance: m(&|x| x.inflight_balance),
        retry_after_success: (!retry.is_empty()).then(|| med(retry)),
        runs: runs.len(),
        ttft_p99_range: range(&|x| x.ttft_ms[2]),
        total_p99_range: range(&|x| x.total_ms[2]),
        ttft_cdf: runs[runs.len() / 2].ttft_cdf.clone(),
    }
}

/// The largest value ÷ the mean (1 = perfectly even; 1 when there is nothing to spread).
fn max_over_mean(xs: &[f64]) -> f64 {
    let mean = xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    if mean <= 0.0 {
        return 1.0;
    }
    xs.iter().copied().fold(0.0, f64::max) / mean
}

/// Samples every server's in-flight count (running + waiting) every 10 ms until `stop` is
/// set; returns the time-averaged count per server.
fn sample_in_flight(
    servers: Vec<Arc<keel_sim::server::SimServer>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<Vec<f64>> {
    tokio::spawn(async move {
        let mut sums = vec![0i64; servers.len()];
        let mut n = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            tick.tick().await;
            for (sum, srv) in sums.iter_mut().zip(&servers) {
                let st = srv.stats();
                *sum += (st.running + st.waiting).max(0);
            }
            n += 1;
        }
        sums.iter().map(|s| *s as f64 / n.max(1) as f64).collect()
    })
}

fn quantiles(h: &Histogram<u64>) -> [f64; 4] {
    if h.is_empty() {
        return [0.0; 4];
    }
    [0.5, 0.9, 0.99, 0.999].map(|q| h.value_at_quantile(q) as f64 / 1000.0)
}

async fn run_contender(
    s: &Scenario,
    name: &str,
    duration: f64,
    seed: u64,
    out: &Path,
) -> Result<Figures, String> {
    let fleet = Fleet::start(&s.fleet).await.map_err(|e| e.to_string())?;
    let running = match name {
        "keel" => start_keel(s, &fleet, &s.keel_pool).await?,
        "keel-rr" => start_keel(s, &fleet, &round_robin_pool(&s.keel_pool)).await?,
        keel if keel.starts_with("keel:") => {
            let extra = keel["keel:".len()..].replace(';', "\n");
            start_keel(s, &fleet, &format!("{}\n{extra}", s.keel_pool)).await?
        }
        peer => start_peer(peer, &fleet, out).await?,
    };
    let planned = plan(s, duration, seed);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(|e| e.to_string())?;
    // Upstream requests and prefill work count from here (after the contender's warm-up).
    let before: Vec<keel_sim::server::Stats> =
        fleet.servers.iter().map(|s| s.state.stats()).collect();
    let stop_sampling = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = sample_in_flight(
        fleet.servers.iter().map(|s| s.state.clone()).collect(),
        stop_sampling.clone(),
    );
    let start = tokio::time::Instant::now();
    for ev in s.events.clone() {
        let srv = fleet
            .servers
            .get(ev.server)
            .ok_or(format!(
                "event names server {} of {}",
                ev.server,
                fleet.servers.len()
            ))?
            .state
            .clone();
        let at = start + Duration::from_secs_f64(ev.at * duration);
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            if ev.clear {
                srv.clear_faults();
            }
            for f in ev.faults {
                srv.add_fault(f);
            }
        });
    }
    let results: Arc<Mutex<Vec<Seen>>> = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // Answers received so far (the bar also covers the drain after the last arrival).
    let bar = indicatif::ProgressBar::new(planned.len() as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "  {prefix:<32} [{bar:30}] {pos}/{len} answers  {elapsed_precise}",
        )
        .map_err(|e| e.to_string())?
        .progress_chars("=> "),
    );
    bar.set_prefix(format!("{name}: {}", s.name));
    for (i, p) in planned.into_iter().enumerate() {
        tokio::time::sleep_until(start + p.at).await;
        let bar = bar.clone();
        let (client, url, headers, results) = (
            client.clone(),
            running.url.clone(),
            running.headers.clone(),
            results.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut body = p.body;
            body["model"] = json!("bench");
            let seen = sdk_request(
                &client,
                &url,
                &headers,
                &body,
                &p.reference,
                seed ^ i as u64,
            )
            .await;
            results.lock().unwrap_or_else(|e| e.into_inner()).push(seen);
            bar.inc(1);
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    bar.finish();
    let elapsed = start.elapsed().as_secs_f64();
    stop_sampling.store(true, std::sync::atomic::Ordering::Relaxed);
    let in_flight = sampler.await.map_err(|e| e.to_string())?;
    let after: Vec<keel_sim::server::Stats> =
        fleet.servers.iter().map(|s| s.state.stats()).collect();
    let per_server_requests: Vec<f64> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.requests.saturating_sub(b.requests) as f64)
        .collect();
    let prefill_tokens: u64 = after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.prefill_tokens.saturating_sub(b.prefill_tokens))
        .sum();
    if name.starts_with("keel") {
        // keel's last decision records (candidates, costs, attempts), to see why.
        let decisions = running
            .url
            .replace("/v1/chat/completions", "/keel/decisions");
        if let Ok(r) = client.get(&decisions).send().await {
            if let Ok(text) = r.text().await {
                let file = format!("{}-{name}-seed{seed}-decisions.json", s.name).replace(
                    |c: char| !c.is_ascii_alphanumeric() && c != '-' && c != '.',
                    "_",
                );
                let _ = std::fs::write(out.join(file), text);
            }
        }
    }
    (running.stop)();
    let seen = std::mem::take(&mut *results.lock().unwrap_or_else(|e| e.into_inner()));
    let mut ttft =
        Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).map_err(|e| e.to_string())?;
    let mut totals = ttft.clone();
    let (mut ok, mut intact, mut tgsv, mut tgsv_n, mut cached, mut prompt) =
        (0usize, 0usize, 0.0, 0usize, 0u64, 0u64);
    let (mut r429, mut r429_ok) = (0usize, 0usize);
    for x in &seen {
        if x.ok {
            ok += 1;
            if let Some(t) = x.ttft_us {
                let _ = ttft.record(t.max(1));
            }
            let _ = totals.record(x.total_us.max(1));
        }
        intact += usize::from(x.intact);
        if let Some(t) = x.tgsv_ms {
            tgsv += t;
            tgsv_n += 1;
        }
        cached += x.cached;
        prompt += x.prompt;
        r429 += x.advised_retries as usize;
        r429_ok += x.advised_ok as usize;
    }
    let upstream_requests: u64 = fleet.servers.iter().map(|s| s.state.stats().requests).sum();
    let tokens_sent: u64 = fleet
        .servers
        .iter()
        .map(|s| s.state.stats().tokens_sent)
        .sum();
    let reference_tokens: u64 = plan(s, duration, seed)
        .iter()
        .map(|p| keel_core::tokens::count(&p.reference) as u64)
        .sum();
    let n = seen.len().max(1);
    let cdf = (1..=100)
        .map(|p| {
            (
                p as f64 / 100.0,
                ttft.value_at_quantile((p as f64 / 100.0).min(0.999)) as f64 / 1000.0,
            )
        })
        .collect();
    let (ttft_ms, total_ms) = (quantiles(&ttft), quantiles(&totals));
    Ok(Figures {
        contender: name.into(),
        requests: seen.len(),
        ttft_ms,
        total_ms,
        error_rate: 1.0 - ok as f64 / n as f64,
        intact: intact as f64 / n as f64,
        tgsv_ms: if tgsv_n > 0 {
            tgsv / tgsv_n as f64
        } else {
            0.0
        },
        extra_requests: upstream_requests as f64 / n as f64 - 1.0,
        extra_tokens: tokens_sent as f64 / reference_tokens.max(1) as f64 - 1.0,
        admitted_rps: ok as f64 / elapsed,
        kv_hit_rate: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        prefill_tokens: prefill_tokens as f64 / n as f64,
        request_balance: max_over_mean(&per_server_requests),
        inflight_balance: max_over_mean(&in_flight),
        retry_after_success: (r429 > 0).then(|| r429_ok as f64 / r429 as f64),
        runs: 1,
        ttft_p99_range: [ttft_ms[2]; 2],
        total_p99_range: [total_ms[2]; 2],
        ttft_cdf: cdf,
    })
}

/// A latency CDF as a small standalone SVG (one polyline per contender).
fn svg_cdf(title: &str, figures: &[Figures]) -> String {
    let (w, h, pad) = (640.0, 400.0, 50.0);
    let max = figures
        .iter()
        .flat_map(|f| f.ttft_cdf.iter().map(|p| p.1))
        .fold(1.0f64, f64::max);
    let colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    let mut out = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{pad}\" y=\"20\">{title}: TTFT CDF (ms, log scale)</text>\n");
    let x = |ms: f64| pad + (w - 2.0 * pad) * (ms.max(1.0).ln() / max.max(2.0).ln());
    let y = |q: f64| h - pad - (h - 2.0 * pad) * q;
    out.push_str(&format!("<line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{}\" stroke=\"black\"/>\n", h - pad, w - pad, h - pad, h - pad));
    for tick in [1.0, 10.0, 100.0, 1000.0, 10000.0]
        .into_iter()
        .filter(|t| *t <= max * 1.01)
    {
        out.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{}\">{tick}</text>\n",
            x(tick),
            h - pad + 15.0
        ));
    }
    for (i, f) in figures.iter().enumerate() {
        let pts: Vec<String> = f
            .ttft_cdf
            .iter()
            .map(|(q, ms)| format!("{:.1},{:.1}", x(*ms), y(*q)))
            .collect();
        let c = colours[i % colours.len()];
        out.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>\n",
            pts.join(" ")
        ));
        out.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{}</text>\n",
            w - pad - 120.0,
            pad + 15.0 * i as f64,
            f.contender
        ));
    }
    out.push_str("</svg>\n");
    out
}

/// "145" for one run, "145 (139–152)" with the spread of several.
fn with_spread(v: f64, range: [f64; 2], runs: usize) -> String {
    if runs > 1 {
        format!("{v:.0} ({:.0}–{:.0})", range[0], range[1])
    } else {
        format!("{v:.0}")
    }
}

fn markdown(s: &Scenario, figures: &[Figures]) -> String {
    let mut t = format!("### {}\n\n{}", s.name, s.description);
    let runs = figures.iter().map(|f| f.runs).max().unwrap_or(1);
    if runs > 1 {
        t.push_str(&format!(
            " Medians of {runs} runs (seeds in a row; the lowest–highest P99 in brackets), {} req/s.",
            s.rps
        ));
    } else {
        t.push_str(&format!(" One run, {} req/s.", s.rps));
    }
    t.push_str("\n\n");
    t.push_str("| contender | TTFT p50 (ms) | p90 (ms) | p99 (ms) | p99.9 (ms) | total p50 (ms) | total p99 (ms) | errors (%) | intact (%) | TGSV (ms) | extra upstream requests (%) | extra tokens (%) | admitted (req/s) | KV hits (%) |\n");
    t.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for f in figures {
        t.push_str(&format!(
            "| {} | {:.0} | {:.0} | {} | {:.0} | {:.0} | {} | {:.2} | {:.1} | {:.1} | {:+.1} | {:+.1} | {:.1} | {:.0} |\n",
            f.contender, f.ttft_ms[0], f.ttft_ms[1], with_spread(f.ttft_ms[2], f.ttft_p99_range, f.runs), f.ttft_ms[3], f.total_ms[0],
            with_spread(f.total_ms[2], f.total_p99_range, f.runs),
            f.error_rate * 100.0, f.intact * 100.0, f.tgsv_ms, f.extra_requests * 100.0, f.extra_tokens * 100.0, f.admitted_rps, f.kv_hit_rate * 100.0
        ));
    }
    if s.shared_prefixes > 0 {
        t.push_str("\nPrefix cache and balance: prefill = prompt tokens the fleet computed (not in its KV caches) per request; balance = the busiest variant ÷ the mean, by upstream requests and by time-averaged in-flight requests.\n\n");
        t.push_str("| contender | KV hits | prefill tokens/req | TTFT p50 | p99 | requests max/mean | in-flight max/mean |\n");
        t.push_str("|---|---|---|---|---|---|---|\n");
        for f in figures {
            t.push_str(&format!(
                "| {} | {:.0}% | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |\n",
                f.contender,
                f.kv_hit_rate * 100.0,
                f.prefill_tokens,
                f.ttft_ms[0],
                f.ttft_ms[2],
                f.request_balance,
                f.inflight_balance
            ));
        }
    }
    for f in figures {
        if let Some(p) = f.retry_after_success {
            t.push_str(&format!("\nretry-after precision ({}): {:.0}% of retries made after waiting the advertised retry-after succeeded\n", f.contender, p * 100.0));
        }
    }
    t
}

/// One contender's figures under fault divided by its own fault-free figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Flatness {
    pub contender: String,
    /// P99 and P99.9 TTFT, fault ÷ fault-free.
    pub ttft_p99: f64,
    pub ttft_p999: f64,
    /// P99 and P99.9 total time, fault ÷ fault-free.
    pub total_p99: f64,
    pub total_p999: f64,
    /// Client-visible errors under fault (share of requests).
    pub error_rate: f64,
    /// Upstream requests and generated tokens beyond the fault-free run's, as a share of it.
    pub extra_requests: f64,
    pub extra_tokens: f64,
}

/// The goal: within this factor of the fault-free P99.
pub const FLATNESS_GOAL: f64 = 1.25;

pub fn flatness(fault: &Figures, free: &Figures) -> Flatness {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    Flatness {
        contender: fault.contender.clone(),
        ttft_p99: ratio(fault.ttft_ms[2], free.ttft_ms[2]),
        ttft_p999: ratio(fault.ttft_ms[3], free.ttft_ms[3]),
        total_p99: ratio(fault.total_ms[2], free.total_ms[2]),
        total_p999: ratio(fault.total_ms[3], free.total_ms[3]),
        error_rate: fault.error_rate,
        extra_requests: ratio(1.0 + fault.extra_requests, 1.0 + free.extra_requests) - 1.0,
        extra_tokens: ratio(1.0 + fault.extra_tokens, 1.0 + free.extra_tokens) - 1.0,
    }
}

fn flatness_markdown(s: &Scenario, fault: &[Figures], free: &[Figures]) -> String {
    let mut t = format!(
        "\nFlatness of {} (fault ÷ fault-free twin; goal ≤ {FLATNESS_GOAL}×):\n\n",
        s.name
    );
    t.push_str("| contender | TTFT p99 fault / free (ms) | ×  | TTFT p99.9 × | total p99 fault / free (ms) | × | total p99.9 × | errors (%) | extra upstream requests vs twin (%) | extra tokens vs twin (%) |\n");
    t.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for (f, g) in fault.iter().zip(free) {
        let x = flatness(f, g);
        t.push_str(&format!(
            "| {} | {:.0} / {:.0} | {:.2}× | {:.2}× | {:.0} / {:.0} | {:.2}× | {:.2}× | {:.2} | {:+.1} | {:+.1} |\n",
            f.contender, f.ttft_ms[2], g.ttft_ms[2], x.ttft_p99, x.ttft_p999, f.total_ms[2], g.total_ms[2],
            x.total_p99, x.total_p999, x.error_rate * 100.0, x.extra_requests * 100.0, x.extra_tokens * 100.0
        ));
    }
    t
}

/// How `keel bench <scenario>` runs.
pub struct RunOptions {
    pub contenders: Vec<String>,
    pub quick: bool,
    /// Seconds per run (default: the scenario's, or its quick duration).
    pub duration: Option<f64>,
    /// Arrival rate instead of the scenario's (e.g. one every contender can sustain).
    pub rps: Option<f64>,
    /// Runs per contender (seeds `seed`, `seed + 1`, …); figures are medians across them.
    pub repeat: usize,
    pub seed: u64,
    pub out: PathBuf,
}

/// Runs scenarios (`all`, one name, or a file) with the given contenders; writes JSON, Markdown
/// and SVG.
pub async fn run(which: &str, o: &RunOptions) -> Result<(), String> {
    let out = o.out.as_path();
    let dir = PathBuf::from("bench/scenarios");
    // A path names the user's own scenario file; a bare name one of the seed scenarios.
    let own = Path::new(which);
    let mut files: Vec<PathBuf> = if own.extension().is_some_and(|x| x == "toml") {
        vec![own.to_path_buf()]
    } else {
        std::fs::read_dir(&dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect()
    };
    files.sort();
    if which != "all" && own.extension().is_none() {
        files.retain(|p| p.file_stem().is_some_and(|s| s == which));
        if files.is_empty() {
            return Err(format!("no scenario `{which}` in {}", dir.display()));
        }
    }
    std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
    let mut all = BTreeMap::new();
    let mut flat_all = BTreeMap::new();
    let mut report = String::new();
    for f in files {
        let mut s = Scenario::load(&f)?;
        if let Some(rps) = o.rps {
            s.rps = rps;
        }
        let d = o.duration.unwrap_or(if o.quick {
            s.quick_duration_s
        } else {
            s.duration_s
        });
        eprintln!(
            "scenario {} ({d} s at {} req/s, {} run(s) per contender)",
            s.name,
            s.rps,
            o.repeat.max(1)
        );
        let twin = s.has_faults().then(|| s.fault_free()).transpose()?;
        let (mut figures, mut free) = (Vec::new(), Vec::new());
        'contenders: for c in &o.contenders {
            let (mut runs, mut twin_runs) = (Vec::new(), Vec::new());
            // Fault and fault-free runs alternate, so drift on a shared machine hits both.
            for r in 0..o.repeat.max(1) as u64 {
                for (which, runs) in [(Some(&s), &mut runs), (twin.as_ref(), &mut twin_runs)] {
                    let Some(which) = which else { continue };
                    match run_contender(which, c, d, o.seed + r, out).await {
                        Ok(fig) => runs.push(fig),
                        Err(e) => {
                            eprintln!("  {c}: skipped: {e}");
                            continue 'contenders;
                        }
                    }
                }
            }
            figures.push(median_figures(runs));
            if !twin_runs.is_empty() {
                free.push(median_figures(twin_runs));
            }
        }
        if figures.is_empty() || figures.iter().any(|f| f.requests == 0) {
            return Err(format!("scenario {} produced no figures", s.name));
        }
        let mut md = markdown(&s, &figures);
        if let Some(twin) = &twin {
            md.push_str(&flatness_markdown(&s, &figures, &free));
            let flat: Vec<Flatness> = figures
                .iter()
                .zip(&free)
                .map(|(f, g)| flatness(f, g))
                .collect();
            flat_all.insert(s.name.clone(), json!({"fault_free": free, "flatness": flat, "twin_servers": twin.fleet.servers.len()}));
        }
        println!("{md}");
        report.push_str(&md);
        report.push('\n');
        std::fs::write(
            out.join(format!("{}.svg", s.name)),
            svg_cdf(&s.name, &figures),
        )
        .map_err(|e| e.to_string())?;
        all.insert(s.name.clone(), figures);
    }
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&all).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    std::fs::write(
        out.join("flatness.json"),
        serde_json::to_string_pretty(&flat_all).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    std::fs::write(out.join("results.md"), report).map_err(|e| e.to_string())?;
    eprintln!(
        "written {}/results.json, flatness.json, results.md and one SVG per scenario",
        out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed_scenario(name: &str) -> Scenario {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/scenarios");
        Scenario::load(&dir.join(format!("{name}.toml"))).expect("seed scenario loads")
    }

    #[test]
    fn the_twin_drops_faults_and_events_and_applies_its_settings() {
        let zone = seed_scenario("zone-loss");
        assert!(zone.has_faults());
        let twin = zone.fault_free().unwrap();
        assert!(!twin.has_faults());
        assert!(twin.fleet.servers.iter().all(|s| s.faults.is_empty()));
        assert_eq!(twin.fleet.servers.len(), zone.fleet.servers.len());
        assert_eq!(twin.rps, zone.rps);

        let tail = seed_scenario("heavy-tail");
        assert!(tail.has_faults(), "a twin setting is a difference");
        let twin = tail.fault_free().unwrap();
        assert_eq!(twin.fleet.servers[0].tail_prob, 0.0);
        assert_eq!(twin.fleet.servers[0].ttft_ms, tail.fleet.servers[0].ttft_ms);

        assert!(!seed_scenario("overload").has_faults());
    }

    #[test]
    fn a_twin_setting_that_is_not_a_server_setting_is_refused() {
        let mut s = seed_scenario("heavy-tail");
        s.twin = Some(toml::toml! { tail_probability = 0.0 });
        assert!(s.fault_free().unwrap_err().contains("tail_probability"));
    }

    #[test]
    fn flatness_divides_fault_by_fault_free() {
        let fig = |p99: f64, extra: f64| Figures {
            contender: "keel".into(),
            requests: 100,
            ttft_ms: [50.0, 80.0, p99, p99 * 2.0],
            total_ms: [400.0, 500.0, p99 * 5.0, p99 * 6.0],
            error_rate: 0.0,
            intact: 1.0,
            tgsv_ms: 1.0,
            extra_requests: extra,
            extra_tokens: 0.0,
            admitted_rps: 40.0,
            kv_hit_rate: 0.0,
            retry_after_success: None,
            prefill_tokens: 0.0,
            request_balance: 1.0,
            inflight_balance: 1.0,
            runs: 1,
            ttft_p99_range: [p99; 2],
            total_p99_range: [p99 * 5.0; 2],
            ttft_cdf: Vec::new(),
        };
        let x = flatness(&fig(150.0, 0.1), &fig(120.0, 0.0));
        assert!((x.ttft_p99 - 1.25).abs() < 1e-9);
        assert!((x.total_p999 - 1.25).abs() < 1e-9);
        assert!((x.extra_requests - 0.1).abs() < 1e-9);
    }

    #[test]
    fn max_over_mean_measures_the_busiest_share() {
        assert_eq!(max_over_mean(&[2.0, 2.0, 2.0, 2.0]), 1.0);
        assert_eq!(max_over_mean(&[1.0, 1.0, 1.0, 5.0]), 2.5);
        assert_eq!(max_over_mean(&[0.0, 0.0]), 1.0);
        assert_eq!(max_over_mean(&[]), 1.0);
    }

    #[test]
    fn round_robin_pool_drops_policy_and_affinity_only() {
        assert_eq!(
            round_robin_pool("affinity = \"prefix\"\nstall_ms = 2000\npolicy = \"p2c\""),
            "stall_ms = 2000\npolicy = \"round_robin\""
        );
        assert_eq!(round_robin_pool(""), "policy = \"round_robin\"");
    }

    #[test]
    fn prefix_reuse_caches_are_bounded_below_the_shared_prompts() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/scenarios/prefix-reuse.toml");
        let s = Scenario::load(&path).unwrap();
        let plan = plan(&s, 1.0, 1);
        let prompt_tokens = plan
            .iter()
            .map(|p| {
                keel_core::tokens::count(p.body["messages"][0]["content"].as_str().unwrap_or(""))
            })
            .max()
            .unwrap();
        assert!((550..=650).contains(&prompt_tokens), "{prompt_tokens}");
        let servers = s.fleet.expanded();
        let prefixes = s.shared_prefixes as usize;
        for srv in &servers {
            let holds = (srv.kv_cache_blocks * srv.block_tokens) as usize / prompt_tokens;
            // One server holds a fraction of the prefixes; the fleet together holds them all.
            assert!(
                holds * 4 <= prefixes,
                "{} holds {holds} of {prefixes}",
                srv.name
            );
            assert!(holds * servers.len() >= prefixes);
        }
    }

    fn figures(name: &str, hit: f64, balance: f64) -> Figures {
        Figures {
            contender: name.into(),
            requests: 10,
            ttft_ms: [hit; 4],
            total_ms: [0.0; 4],
            error_rate: 0.0,
            intact: 1.0,
            tgsv_ms: 0.0,
            extra_requests: 0.0,
            extra_tokens: 0.0,
            admitted_rps: 1.0,
            kv_hit_rate: hit,
            prefill_tokens: 100.0 * hit,
            request_balance: balance,
            inflight_balance: balance,
            retry_after_success: None,
            runs: 1,
            ttft_p99_range: [hit; 2],
            total_p99_range: [0.0; 2],
            ttft_cdf: Vec::new(),
        }
    }

    #[test]
    fn medians_cover_the_cache_and_balance_figures() {
        let m = median_figures(vec![
            figures("keel", 0.9, 1.1),
            figures("keel", 0.5, 1.3),
            figures("keel", 0.7, 1.2),
        ]);
        assert_eq!(m.kv_hit_rate, 0.7);
        assert_eq!(m.prefill_tokens, 70.0);
        assert_eq!(m.request_balance, 1.2);
        assert_eq!(m.inflight_balance, 1.2);
        assert_eq!(m.runs, 3);
    }
}
