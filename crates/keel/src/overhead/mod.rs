//! `keel bench overhead`: the latency each gateway adds over calling a fast upstream directly.
//!
//! One zero-latency simulated server (keel-sim) runs in the bench process beside the open-loop
//! load generator. keel runs as its own process (`keel serve`), peers as their scripts start
//! them (`bench/peers/<name>.sh`). Where the machine has two cores or more, the gateway under
//! test is pinned to the last core and the bench process (load generator and upstream) to the
//! others (`taskset`), so that they do not preempt each other; the report says so.
//!
//! For each contender and mode (whole responses, streams): the highest sustainable rate (a doubling
//! ramp of short runs, then the gap to the first rate missed halved three times; a run sustains its
//! rate with no errors, at least 95% of it achieved and P99 total under 100 ms on a zero-latency
//! upstream, and a miss counts only when it repeats), then at each fixed rate it sustains, rounds
//! alternating direct and through the gateway (so both see the same machine state); figures are
//! medians across rounds of each round's percentiles, and "added" is gateway − direct. Peak memory
//! is the high-water resident set of the gateway's processes over the fixed-rate runs (a fresh
//! process after the ramp).
//!
//! `--translated` measures instead what cross-protocol translation adds: see [`translated`];
//! `--event-subscribers N` what open dashboards cost: see [`subscribers`]; `--streams N,…` what
//! thousands of live slow streams cost: see [`streams`]; `--tail-bounds` the throughput at
//! tail-latency bounds: see [`bounds`]; `--sequential` one client's closed loop: see
//! [`sequential`].

mod bounds;
mod sequential;
mod streams;
mod subscribers;
mod translated;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use keel_core::protocol::Endpoint;
use keel_sim::load::{LoadConfig, LoadReport};
use keel_sim::{Fleet, ServerConfig};

use crate::keel_process::KeelProcess;
use crate::scenario::{start_peer, Running};

/// What to run.
pub struct Options {
    pub rates: Vec<f64>,
    pub duration: f64,
    pub rounds: usize,
    pub contenders: Vec<String>,
    pub keel_threads: Option<usize>,
    pub keel_pool: String,
    pub max_rate: bool,
    pub pin: bool,
    pub out: Option<PathBuf>,
    /// Measure cross-protocol streams against same-protocol ones (keel only).
    pub translated: bool,
    /// Measure keel with N `/keel/events` readers (open dashboards) against none (keel only).
    pub event_subscribers: usize,
    /// Concurrent slow streams to hold (memory, CPU and added inter-token gap per gateway).
    pub streams: Vec<usize>,
    /// The highest rate under added-P99 bounds of 1, 5 and 10 ms, per gateway and mode.
    pub tail_bounds: bool,
    /// One client's closed loop (a request as soon as the last answer is read).
    pub sequential: bool,
}

/// Rates tried, in order, for the highest sustainable one.
const RAMP: [f64; 10] = [
    10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2000.0, 4000.0, 8000.0,
];
const RAMP_SECONDS: f64 = 2.0;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The median of the figures measured, or JSON null when none was (no `/proc` CPU times).
fn median_or_null(v: Vec<f64>) -> Value {
    if v.is_empty() {
        Value::Null
    } else {
        json!(median(v))
    }
}

/// How the processes share the CPUs, for a report's first line; `bench` names what runs beside
/// the load generator (upstream, pages…).
fn pinning(pinned: bool, gw_cpu: &str, bench: &str, bench_cpus: &str) -> String {
    if pinned {
        format!("gateway pinned to CPU {gw_cpu}, {bench} to CPU {bench_cpus}")
    } else {
        "no CPU pinning (one core, or --no-pin)".into()
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Pins `pid` and every thread and child process of it to `cpus` (a taskset list).
fn pin(pid: u32, cpus: &str) {
    for p in std::iter::once(pid).chain(descendants(pid)) {
        let _ = std::process::Command::new("taskset")
            .args(["-a", "-cp", cpus, &p.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten();
    for t in tasks.flatten() {
        let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        for c in children
            .split_whitespace()
            .filter_map(|c| c.parse::<u32>().ok())
        {
            out.push(c);
            out.extend(descendants(c));
        }
    }
    out
}

/// A memory field of /proc's status (`VmHWM:`, `VmRSS:`), KiB, summed over `pid` and its
/// descendants (a peer may run as several processes).
fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let kib: u64 = std::iter::once(pid)
        .chain(descendants(pid))
        .filter_map(|p| {
            let status = std::fs::read_to_string(format!("/proc/{p}/status")).ok()?;
            let line = status.lines().find(|l| l.starts_with(field))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .sum();
    (kib > 0).then_some(kib)
}

/// Peak resident set (MiB) of `pid` and its descendants.
fn peak_rss_mib(pid: u32) -> Option<f64> {
    status_kib(pid, "VmHWM:").map(|kib| kib as f64 / 1024.0)
}

/// A gateway under test: where to send, and its process.
struct Target {
    name: String,
    base: String,
    model: String,
    /// What the client calls (and so which protocol it speaks).
    endpoint: Endpoint,
    headers: Vec<(String, String)>,
    pid: Option<u32>,
    stop: Option<Box<dyn FnOnce() + Send>>,
}

impl Target {
    /// The upstream itself, called straight: the baseline every gateway's figures subtract.
    fn direct(fleet: &Fleet) -> Target {
        Target {
            name: "direct".into(),
            base: fleet.get(0).openai_base(),
            model: "sim".into(),
            endpoint: Endpoint::ChatCompletions,
            headers: Vec::new(),
            pid: None,
            stop: None,
        }
    }
}

/// `keel serve` as its own process over `fleet`.
async fn start_keel(fleet: &Fleet, o: &Options) -> Result<Target, String> {
    let threads = o
        .keel_threads
        .map(|n| format!("worker_threads = {n}\n"))
        .unwrap_or_default();
    let toml = crate::scenario::pool_toml(fleet, "bench", &o.keel_pool);
    let process = KeelProcess::spawn(&format!("{threads}{toml}"), None).await?;
    Ok(Target {
        name: "keel".into(),
        base: format!("http://127.0.0.1:{}/v1", process.port),
        model: "bench".into(),
        endpoint: Endpoint::ChatCompletions,
        headers: Vec::new(),
        pid: Some(process.pid()),
        stop: Some(Box::new(move || drop(process))),
    })
}

/// Starts keel or a peer; `None` (with the reason in `lines`) when a peer cannot start.
async fn start_target(
    name: &str,
    fleet: &Fleet,
    o: &Options,
    peers_dir: &Path,
    lines: &mut String,
) -> Result<Option<Target>, String> {
    Ok(Some(match name {
        "keel" => start_keel(fleet, o).await?,
        peer => match start_peer(peer, fleet, peers_dir).await {
            Ok(r) => peer_target(peer, r),
            Err(e) => {
                eprintln!("{peer}: skipped: {e}");
                lines.push_str(&format!("{peer}: skipped: {e}\n"));
                return Ok(None);
            }
        },
    }))
}

/// Pins the gateway's processes (when asked) and warms both paths (connection pools, caches).
async fn prepare(client: &reqwest::Client, direct: &Target, target: &Target, cpu: Option<&str>) {
    if let (Some(cpu), Some(pid)) = (cpu, target.pid) {
        pin(pid, cpu);
    }
    for t in [direct, target] {
        load(client, t, 50.0, 1.0, true).await;
    }
}

fn stop_target(target: &mut Target) {
    if let Some(stop) = target.stop.take() {
        stop();
    }
}

fn peer_target(name: &str, r: Running) -> Target {
    Target {
        name: name.into(),
        base: r.url.trim_end_matches("/chat/completions").to_owned(),
        model: "bench".into(),
        endpoint: Endpoint::ChatCompletions,
        headers: r.headers,
        pid: r.pid,
        stop: Some(r.stop),
    }
}

async fn load(
    client: &reqwest::Client,
    t: &Target,
    rps: f64,
    secs: f64,
    stream: bool,
) -> LoadReport {
    let mut c = LoadConfig::new(&t.base, &t.model);
    c.endpoint = t.endpoint;
    c.rps = rps;
    c.duration = Duration::from_secs_f64(secs);
    c.stream = stream;
    c.max_tokens = 16;
    c.headers = t.headers.clone();
    keel_sim::load::run_with_client(c, client.clone()).await
}

fn mode_name(stream: bool) -> &'static str {
    if stream {
        "stream"
    } else {
        "whole"
    }
}

fn sustained(r: &LoadReport, rps: f64) -> bool {
    r.errors == 0 && r.achieved_rps >= 0.95 * rps && r.total.p99_ms < 100.0
}

/// Halvings of the gap between the highest rate the ramp sustained and the first it did not
/// (a doubling ramp alone says only "at least 2,000, not 4,000"): three leave it within an
/// eighth of the gap.
const REFINE_STEPS: usize = 3;

/// The highest rate `t` sustains, or 0; and the lowest rate found that it does not (none when
/// the whole ramp was sustained): the ramp's rates in order until one is not sustained, then
/// that gap halved [`REFINE_STEPS`] times.
async fn max_rate(client: &reqwest::Client, t: &Target, stream: bool) -> (f64, Option<f64>) {
    let mut best = 0.0;
    let mut failed = None;
    for rps in RAMP {
        if !ramp_step(client, t, rps, stream).await {
            failed = Some(rps);
            break;
        }
        best = rps;
    }
    if best > 0.0 {
        for _ in 0..REFINE_STEPS {
            let Some(hi) = failed else { break };
            let mid = ((best + hi) / 2.0).round();
            if ramp_step(client, t, mid, stream).await {
                best = mid;
            } else {
                failed = Some(mid);
            }
        }
    }
    (best, failed)
}

/// Whether `t` sustains `rps` for one ramp step. A step that is not sustained is run once more
/// after a pause, and only a second miss counts: in a 2-s step at a low rate one slow request
/// is the P99, and a step right after an overload can meet the backlog it left.
async fn ramp_step(client: &reqwest::Client, t: &Target, rps: f64, stream: bool) -> bool {
    for tries in 1..=2 {
        let r = load(client, t, rps, RAMP_SECONDS, stream).await;
        eprintln!(
            "  {:<8} {:<6} {rps:>6} req/s: achieved {:.0}, errors {}{}, p99 {:.1} ms{}",
            t.name,
            mode_name(stream),
            r.achieved_rps,
            r.errors,
            if r.error_kinds.is_empty() {
                String::new()
            } else {
                format!(" {:?}", r.error_kinds)
            },
            r.total.p99_ms,
            if tries == 2 { " (again)" } else { "" }
        );
        if sustained(&r, rps) {
            return true;
        }
        if tries == 1 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    false
}

fn row(reps: &[LoadReport]) -> Value {
    let m = |f: fn(&LoadReport) -> f64| median(reps.iter().map(f).collect());
    json!({
        "ttfb_p50_ms": m(|r| r.ttft.p50_ms), "ttfb_p99_ms": m(|r| r.ttft.p99_ms),
        "total_p50_ms": m(|r| r.total.p50_ms), "total_p99_ms": m(|r| r.total.p99_ms),
        "errors": reps.iter().map(|r| r.errors).sum::<u64>(),
        "requests": reps.iter().map(|r| r.sent).sum::<u64>(),
    })
}

/// One simulated upstream that answers at once: all the latency measured is the gateway's.
async fn zero_latency_upstream() -> Result<Fleet, String> {
    let upstream = ServerConfig {
        ttft_ms: 0.0,
        ttft_sigma: 0.0,
        prefill_us_per_token: 0.0,
        gap_ms: 0.0,
        gap_sigma: 0.0,
        capacity: 100_000,
        ..ServerConfig::fast("fast")
    };
    Fleet::start_n(1, upstream).await.map_err(|e| e.to_string())
}

/// Which cores the gateway and the bench process get: `(pinned, gateway's, bench's)`.
fn cpu_plan(pin: bool) -> (bool, String, String) {
    (
        pin && cores() >= 2,
        format!("{}", cores() - 1),
        format!("0-{}", cores().saturating_sub(2)),
    )
}

fn http_client() -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| e.to_string())
}

pub async fn run(mut o: Options) -> Result<(), String> {
    // A gateway pinned to one core runs one worker thread, as nginx runs one worker process:
    // more threads on one core only preempt each other.
    if cpu_plan(o.pin).0 && o.keel_threads.is_none() {
        o.keel_threads = Some(1);
    }
    if o.translated {
        return translated::run(o).await;
    }
    if o.event_subscribers > 0 {
        return subscribers::run(o).await;
    }
    if !o.streams.is_empty() {
        return streams::run_all(o).await;
    }
    if o.tail_bounds {
        return bounds::run(o).await;
    }
    if o.sequential {
        return sequential::run(o).await;
    }
    let fleet = zero_latency_upstream().await?;
    let peers_dir = o
        .out
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("keel-bench-overhead"));
    let (pinned, gw_cpu, bench_cpus) = cpu_plan(o.pin);
    if pinned {
        pin(std::process::id(), &bench_cpus);
    }
    let client = http_client()?;
    let direct = Target::direct(&fleet);
    println!(
        "keel bench overhead: one zero-latency simulated upstream; {}; rates {:?} req/s, {} s × {} rounds; keel worker threads: {}",
        pinning(pinned, &gw_cpu, "load generator and upstream", &bench_cpus),
        o.rates,
        o.duration,
        o.rounds,
        o.keel_threads.map_or_else(|| "one per core".into(), |n| n.to_string())
    );
    print!("{HEADER}");
    let mut report = Vec::new();
    let mut lines = String::new();
    for name in &o.contenders {
        // The ramp ends in overload, which leaves any process holding more memory than it
        // needs: the fixed-rate runs get a fresh start of the gateway.
        let mut maxes = [None, None];
        if o.max_rate {
            let Some(mut target) =
                start_target(name, &fleet, &o, &peers_dir.join("ramp"), &mut lines).await?
            else {
                continue;
            };
            prepare(&client, &direct, &target, pinned.then_some(gw_cpu.as_str())).await;
            for (i, stream) in [false, true].into_iter().enumerate() {
                maxes[i] = Some(max_rate(&client, &target, stream).await);
            }
            stop_target(&mut target);
        }
        let Some(mut target) =
            // Its own directory: a peer's pid file must not be removed by the ramp's instance
            // as it exits.
            start_target(name, &fleet, &o, &peers_dir.join("fixed"), &mut lines).await?
        else {
            continue;
        };
        prepare(&client, &direct, &target, pinned.then_some(gw_cpu.as_str())).await;
        let mut by_rate = Vec::new();
        let mut sustainable = Vec::new();
        for (stream, ramp) in [false, true].into_iter().zip(maxes) {
            let mode = mode_name(stream);
            let max = ramp.map(|(m, _)| m);
            sustainable.push(json!({"mode": mode, "max_sustainable_rps": max,
                "first_unsustained_rps": ramp.and_then(|(_, f)| f)}));
            for &rps in &o.rates {
                if let Some(m) = max.filter(|m| rps > *m) {
                    let line = format!(
                        "{name:<8} {rps:>6} {mode:<7} over its sustainable rate ({m} req/s): not run\n"
                    );
                    print!("{line}");
                    lines.push_str(&line);
                    continue;
                }
                let (mut d, mut g) = (Vec::new(), Vec::new());
                for _ in 0..o.rounds {
                    d.push(load(&client, &direct, rps, o.duration, stream).await);
                    g.push(load(&client, &target, rps, o.duration, stream).await);
                }
                let (d, g) = (row(&d), row(&g));
                let added = |k: &str| {
                    (g[k].as_f64().unwrap_or(0.0) - d[k].as_f64().unwrap_or(0.0)) * 1000.0
                };
                let line = format!(
                    "{name:<8} {rps:>6} {mode:<7} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>8} {:>8}\n",
                    added("ttfb_p50_ms"),
                    added("ttfb_p99_ms"),
                    added("total_p50_ms"),
                    added("total_p99_ms"),
                    g["errors"],
                    g["requests"]
                );
                print!("{line}");
                lines.push_str(&line);
                by_rate.push(json!({"rps": rps, "mode": mode, "direct": d, "gateway": g,
                    "added_us": {"ttfb_p50": added("ttfb_p50_ms"), "ttfb_p99": added("ttfb_p99_ms"),
                                 "total_p50": added("total_p50_ms"), "total_p99": added("total_p99_ms")}}));
            }
        }
        let peak = target.pid.and_then(peak_rss_mib);
        let max = |i: usize| {
            let failed = sustainable[i]["first_unsustained_rps"]
                .as_f64()
                .map_or(String::new(), |f| format!(" ({f} not)"));
            sustainable[i]["max_sustainable_rps"]
                .as_f64()
                .map_or("not measured".into(), |m| format!("{m} req/s{failed}"))
        };
        let line = format!(
            "{name:<8} highest sustainable rate: whole {}, stream {}; peak memory {}\n",
            max(0),
            max(1),
            peak.map_or("unknown".into(), |m| format!("{m:.1} MiB"))
        );
        print!("{line}");
        lines.push_str(&line);
        report.push(json!({"contender": name, "sustainable": sustainable, "peak_rss_mib": peak, "rates": by_rate}));
        stop_target(&mut target);
    }
    if let Some(dir) = &o.out {
        write_out(dir, &o, pinned, &report, &lines)?;
    }
    Ok(())
}

/// Writes a mode's `{name}.json` (`rows` with the run's settings) and `{name}.txt` (`text`) into
/// `dir`; the JSON's path.
fn write_rows(
    dir: &Path,
    name: &str,
    o: &Options,
    pinned: bool,
    rows: Vec<Value>,
    text: &str,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{name}.json"));
    let doc = json!({"duration_s": o.duration, "rounds": o.rounds, "pinned": pinned, "rows": rows});
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&doc).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    std::fs::write(dir.join(format!("{name}.txt")), text).map_err(|e| e.to_string())?;
    Ok(path)
}

fn write_out(
    dir: &Path,
    o: &Options,
    pinned: bool,
    report: &[Value],
    lines: &str,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("overhead.json");
    let doc = json!({"rates": o.rates, "duration_s": o.duration, "rounds": o.rounds,
        "keel_worker_threads": o.keel_threads, "pinned": pinned, "contenders": report});
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&doc).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    std::fs::write(dir.join("overhead.txt"), format!("{HEADER}{lines}"))
        .map_err(|e| e.to_string())?;
    println!("written {} and overhead.txt", path.display());
    Ok(())
}

/// Column heads of the table (added latency in µs: gateway − direct, medians of rounds).
pub const HEADER: &str =
    "contender  req/s mode    +ttfb p50 +ttfb p99 +total p50 +total p99   errors requests\n";
