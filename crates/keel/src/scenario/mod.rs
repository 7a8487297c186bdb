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
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Deserialize;
use serde_json::{json, Value};

use keel_core::protocol::Endpoint;
use keel_core::queue::Priority;
use keel_core::rng::Rng;
use keel_sim::text::Generator;
use keel_sim::{FaultSpec, Fleet, FleetConfig};

mod canary;

pub mod cache;
mod client;
mod contenders;
mod report;

use client::*;
pub use contenders::*;
use report::*;

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
    /// Share of requests sent with `x-keel-priority: high`; the rest are sent as `low`.
    /// Absent: no priority header (the report then has no per-priority table).
    #[serde(default)]
    pub priority_mix: Option<f64>,
    /// Clients retry a 429/503 that carries a retry-after as often as it takes, waiting what it
    /// advises (otherwise: the OpenAI SDK's two retries).
    #[serde(default)]
    pub honour_retry_after: bool,
    /// Each request's deadline, sent as `x-keel-timeout-ms`.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
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
    priority: Option<Priority>,
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
    // A separate sequence, so that a priority mix leaves the prompts as they were.
    let mut ranks = Rng::new(seed ^ 0x7072_696f);
    let n = (duration * s.rps).round() as usize;
    (0..n)
        .map(|i| {
            let mut body = json!({"model": "bench", "max_tokens": s.max_tokens, "stream": s.stream, "messages": prompt(&mut rng, s.prompt_mix, i, &prefixes)});
            if s.stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            let reference = reference_text(&generator, Endpoint::ChatCompletions, &body);
            let priority = s.priority_mix.map(|high| if ranks.next_f64() < high { Priority::High } else { Priority::Low });
            Planned { at: Duration::from_secs_f64(i as f64 / s.rps), body, reference, priority }
        })
        .collect()
}

/// Samples every server's in-flight count (running + waiting) every 10 ms until `stop` is
/// set; returns the time-averaged count per server and the highest running count seen on any.
fn sample_in_flight(
    servers: Vec<Arc<keel_sim::server::SimServer>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<(Vec<f64>, i64)> {
    tokio::spawn(async move {
        let mut peak = 0i64;
        let mut sums = vec![0i64; servers.len()];
        let mut n = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            tick.tick().await;
            for (sum, srv) in sums.iter_mut().zip(&servers) {
                let st = srv.stats();
                *sum += (st.running + st.waiting).max(0);
                peak = peak.max(st.running + st.waiting);
            }
            n += 1;
        }
        (
            sums.iter().map(|s| *s as f64 / n.max(1) as f64).collect(),
            peak,
        )
    })
}

async fn run_contender(
    s: &Scenario,
    name: &str,
    duration: f64,
    seed: u64,
    out: &Path,
) -> Result<Figures, String> {
    let fleet = Fleet::start(&s.fleet.seeded(seed))
        .await
        .map_err(|e| e.to_string())?;
    let running = start_contender(s, &fleet, name, out).await?;
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
    schedule_events(s, &fleet, start, duration)?;
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
        let mut headers = headers;
        if let Some(pr) = p.priority {
            headers.push(("x-keel-priority".into(), pr.as_str().into()));
        }
        if let Some(ms) = s.deadline_ms {
            headers.push(("x-keel-timeout-ms".into(), ms.to_string()));
        }
        let policy = Policy {
            honour_retry_after: s.honour_retry_after,
            deadline_ms: s.deadline_ms,
        };
        tasks.push(tokio::spawn(async move {
            let mut body = p.body;
            body["model"] = json!("bench");
            let mut seen = sdk_request(
                &client,
                &url,
                &headers,
                &body,
                &p.reference,
                seed ^ i as u64,
                policy,
            )
            .await;
            seen.priority = p.priority;
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
    let (in_flight, upstream_peak) = sampler.await.map_err(|e| e.to_string())?;
    let after: Vec<keel_sim::server::Stats> =
        fleet.servers.iter().map(|s| s.state.stats()).collect();
    // What each server did while the load ran (from when the contender was ready: keel's
    // start-up warm-ups and a peer's readiness check are a one-time cost, not a cost per
    // request under load).
    let during = |f: fn(&keel_sim::server::Stats) -> u64| -> Vec<u64> {
        after
            .iter()
            .zip(&before)
            .map(|(a, b)| f(a).saturating_sub(f(b)))
            .collect()
    };
    let per_server_requests: Vec<f64> = during(|s| s.requests).iter().map(|&r| r as f64).collect();
    let prefill_tokens: u64 = during(|s| s.prefill_tokens).iter().sum();
    let upstream_requests: u64 = during(|s| s.requests).iter().sum();
    let tokens_sent: u64 = during(|s| s.tokens_sent).iter().sum();
    // The simulator's refusals (429 when full): a layer that respects capacity causes none.
    let upstream_refused: u64 = during(|s| s.errors).iter().sum();
    if name.starts_with("keel") {
        save_keel_state(&client, &running.url, s, name, seed, out).await;
    }
    (running.stop)();
    let seen = std::mem::take(&mut *results.lock().unwrap_or_else(|e| e.into_inner()));
    let upstream = Upstream {
        per_server_requests,
        prefill_tokens,
        requests: upstream_requests,
        tokens_sent,
        refused: upstream_refused,
        in_flight,
        peak: upstream_peak,
    };
    figures(s, name, duration, seed, &seen, elapsed, upstream)
}

/// The contender under test, started against the fleet and warmed up.
async fn start_contender(
    s: &Scenario,
    fleet: &Fleet,
    name: &str,
    out: &Path,
) -> Result<Running, String> {
    Ok(match name {
        "keel" => start_keel(s, fleet, &s.keel_pool).await?,
        "keel-rr" => start_keel(s, fleet, &round_robin_pool(&s.keel_pool)).await?,
        keel if keel.starts_with("keel:") => {
            let extra = keel["keel:".len()..].replace(';', "\n");
            start_keel(s, fleet, &format!("{}\n{extra}", s.keel_pool)).await?
        }
        peer => start_peer(peer, fleet, out).await?,
    })
}

/// The scenario's fault events, each applied to its server at its share of the run.
fn schedule_events(
    s: &Scenario,
    fleet: &Fleet,
    start: tokio::time::Instant,
    duration: f64,
) -> Result<(), String> {
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
    Ok(())
}

/// keel's last decision records (candidates, costs, attempts) and its metrics (attempts by
/// kind, probes, hedges), kept beside the figures to see why.
async fn save_keel_state(
    client: &reqwest::Client,
    chat_url: &str,
    s: &Scenario,
    name: &str,
    seed: u64,
    out: &Path,
) {
    for (path, what) in [
        ("/keel/decisions?limit=1000", "decisions.json"),
        ("/metrics", "metrics.txt"),
    ] {
        let url = chat_url.replace("/v1/chat/completions", path);
        if let Ok(r) = client.get(&url).send().await {
            if let Ok(text) = r.text().await {
                let file = format!("{}-{name}-seed{seed}-{what}", s.name).replace(
                    |c: char| !c.is_ascii_alphanumeric() && c != '-' && c != '.',
                    "_",
                );
                let _ = std::fs::write(out.join(file), text);
            }
        }
    }
}

/// What the fleet's servers did while the load ran.
struct Upstream {
    per_server_requests: Vec<f64>,
    prefill_tokens: u64,
    requests: u64,
    tokens_sent: u64,
    /// The simulator's refusals (429 when full): a layer that respects capacity causes none.
    refused: u64,
    /// Mean in-flight requests per server, and the most at once.
    in_flight: Vec<f64>,
    peak: i64,
}

/// One run's figures from what the clients saw and what the servers did.
fn figures(
    s: &Scenario,
    name: &str,
    duration: f64,
    seed: u64,
    seen: &[Seen],
    elapsed: f64,
    upstream: Upstream,
) -> Result<Figures, String> {
    let mut ttft =
        Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).map_err(|e| e.to_string())?;
    let mut totals = ttft.clone();
    let (mut ok, mut intact, mut tgsv, mut tgsv_n, mut cached, mut prompt) =
        (0usize, 0usize, 0.0, 0usize, 0u64, 0u64);
    let (mut r429, mut r429_ok) = (0usize, 0usize);
    for x in seen {
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
        extra_requests: upstream.requests as f64 / n as f64 - 1.0,
        extra_tokens: upstream.tokens_sent as f64 / reference_tokens.max(1) as f64 - 1.0,
        admitted_rps: ok as f64 / elapsed,
        kv_hit_rate: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        prefill_tokens: upstream.prefill_tokens as f64 / n as f64,
        request_balance: max_over_mean(&upstream.per_server_requests),
        inflight_balance: max_over_mean(&upstream.in_flight),
        retry_after_success: (r429 > 0).then(|| r429_ok as f64 / r429 as f64),
        by_priority: by_priority(seen)?,
        upstream_peak: upstream.peak as f64,
        upstream_refused: upstream.refused as f64,
        late: seen.iter().map(|x| x.late as f64).sum(),
        runs: 1,
        ttft_p99_range: [ttft_ms[2]; 2],
        total_p99_range: [total_ms[2]; 2],
        ttft_cdf: cdf,
    })
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
    // The canary scenario is keel's own (no peer has canaries): it runs with contender keel.
    let canary =
        (which == "all" || which == canary::NAME) && o.contenders.iter().any(|c| c == "keel");
    if which == canary::NAME {
        std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
        let md = canary::run(o.quick, o.seed, out).await?;
        println!("{md}");
        return std::fs::write(out.join("canary-rollback.md"), md).map_err(|e| e.to_string());
    }
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
    if canary {
        eprintln!("scenario {}", canary::NAME);
        let md = canary::run(o.quick, o.seed, out).await?;
        println!("{md}");
        report.push_str(&md);
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
            by_priority: Vec::new(),
            upstream_peak: 0.0,
            upstream_refused: 0.0,
            late: 0.0,
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
            by_priority: Vec::new(),
            upstream_peak: 0.0,
            upstream_refused: 0.0,
            late: 0.0,
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
