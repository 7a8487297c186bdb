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
//! upstream, and a miss counts only when it repeats), ramped `rounds` times with the contenders
//! alternating (a fresh start of each gateway every round) and reported as the median of the
//! rounds with each round's figure and, per round, each peer's ratio to keel: the generator's
//! core has fast and slow spells of its own, and one ramp per contender compared the spells it
//! met as much as the gateways. Then at each fixed rate it sustains, rounds alternating direct
//! and through the gateway (so both see the same machine state); figures are medians across
//! rounds of each round's percentiles, and "added" is gateway − direct; beside them the
//! gateway's CPU time per request (all its threads and processes, from `/proc`), and each
//! peer's over keel's, which compares the gateways' cost where the ramp compares whatever
//! saturates first. Peak memory is the high-water resident
//! set of the gateway's processes over the fixed-rate runs (a fresh process after the ramps).
//!
//! `--translated` measures instead what cross-protocol translation adds: see [`translated`];
//! `--event-subscribers N` what open dashboards cost: see [`subscribers`]; `--streams N,…` what
//! thousands of live slow streams cost: see [`streams`]; `--tail-bounds` the throughput at
//! tail-latency bounds: see [`bounds`]; `--sequential` one client's closed loop: see
//! [`sequential`].

pub mod bounds;
mod fixed;
pub mod plain_proxy;
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
use crate::scenario::{answers, start_peer, Running};

/// What to run.
pub struct Options {
    pub rates: Vec<f64>,
    pub duration: f64,
    pub rounds: usize,
    pub contenders: Vec<String>,
    pub keel_threads: Option<usize>,
    pub keel_pool: String,
    /// Extra top-level lines for keel's config.
    pub keel_top: String,
    /// The user message every request sends (`--prompt`); `None`: the load generator's own.
    pub prompt: Option<String>,
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
    /// Busy loops sharing the gateway's core for the whole run.
    pub contend: usize,
}

/// `--contend N`: N busy loops (`sh` spinning, a process each, as a compiler's jobs are) on the
/// gateway's core, or unpinned when nothing is pinned; stopped when dropped.
struct Contention(Vec<std::process::Child>);

/// The busy loops' process ids: [`pin`] leaves them where they were started (they are this
/// process's children, which it otherwise pins with it).
static BUSY_LOOPS: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

fn is_busy_loop(pid: u32) -> bool {
    BUSY_LOOPS.lock().is_ok_and(|l| l.contains(&pid))
}

impl Contention {
    fn start(n: usize, pinned: bool, gw_cpu: &str) -> Result<Contention, String> {
        let mut loops = Contention(Vec::new());
        for _ in 0..n {
            let mut cmd = if pinned {
                let mut c = std::process::Command::new("taskset");
                c.args(["-c", gw_cpu, "sh"]);
                c
            } else {
                std::process::Command::new("sh")
            };
            let child = cmd
                .args(["-c", "while :; do :; done"])
                .stdin(std::process::Stdio::null())
                .spawn()
                .map_err(|e| format!("cannot start a busy loop (--contend): {e}"))?;
            if let Ok(mut l) = BUSY_LOOPS.lock() {
                l.push(child.id());
            }
            loops.0.push(child);
        }
        // Every mode's report says so in its first line (`pinning`).
        Ok(loops)
    }
}

impl Drop for Contention {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Ok(mut l) = BUSY_LOOPS.lock() {
            l.retain(|pid| !self.0.iter().any(|c| c.id() == *pid));
        }
    }
}

/// Rates tried, in order, for the highest sustainable one. Past the stretch goal (10,000 whole
/// answers a second on one core): a ramp that ended at 8,000 reported a gateway that sustains it
/// as "8,000", not as its rate.
const RAMP: [f64; 11] = [
    10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2000.0, 4000.0, 8000.0, 16000.0,
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
    let place = if pinned {
        format!("gateway pinned to CPU {gw_cpu}, {bench} to CPU {bench_cpus}")
    } else {
        "no CPU pinning (one core, or --no-pin)".into()
    };
    match BUSY_LOOPS.lock().map_or(0, |l| l.len()) {
        0 => place,
        n if pinned => format!("{place}; {n} busy loop(s) on CPU {gw_cpu} (--contend)"),
        n => format!("{place}; {n} busy loop(s), unpinned (--contend)"),
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Pins `pid` and every thread and child process of it to `cpus` (a taskset list).
fn pin(pid: u32, cpus: &str) {
    for p in std::iter::once(pid).chain(descendants(pid)) {
        if is_busy_loop(p) {
            continue;
        }
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

/// CPU time (clock ticks, user + system) of `pid` and its descendants so far.
fn cpu_ticks(pid: u32) -> Option<u64> {
    std::iter::once(pid)
        .chain(descendants(pid))
        .map(|p| stat_cpu_ticks(&std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?))
        .sum()
}

/// utime + stime of one `/proc/<pid>/stat` line. The fields are counted after the command
/// name, which is in parentheses and may hold spaces and parentheses itself: state is field 3,
/// utime 14, stime 15.
fn stat_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Clock ticks per second of `/proc`'s times (`getconf CLK_TCK`, asked once; 100 on Linux
/// where unknown).
fn ticks_per_s() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse::<f64>().ok())
            .unwrap_or(100.0)
    })
}

/// The fewest clock ticks a run's CPU figures are given from: a figure from fewer is off by
/// more than 5% (at 10 req/s, 5 s of a near-idle gateway is a handful of ticks).
const MIN_TICKS: u64 = 20;

/// One load run and the CPU time the target's processes spent in it.
struct Run {
    report: LoadReport,
    /// How long the run took, the last answers included (an overloaded gateway drains for
    /// seconds past the load's duration).
    secs: f64,
    /// Clock ticks of CPU (user + system, every thread and child process); none for `direct`.
    ticks: Option<u64>,
}

impl Run {
    /// µs of CPU over the run, where enough ticks passed to tell (see [`MIN_TICKS`]).
    fn cpu_us(&self) -> Option<f64> {
        let ticks = self.ticks.filter(|&t| t >= MIN_TICKS)?;
        Some(ticks as f64 / ticks_per_s() * 1e6)
    }

    fn cpu_us_per_request(&self) -> Option<f64> {
        let n = self.report.sent;
        self.cpu_us().filter(|_| n > 0).map(|c| c / n as f64)
    }

    fn cpu_us_per_token(&self) -> Option<f64> {
        let n = self.report.tokens;
        self.cpu_us().filter(|_| n > 0).map(|c| c / n as f64)
    }

    /// The share of one core the target used over the run (a gateway pinned to one core that
    /// stays well below 1 at the rate it missed was not what saturated).
    fn cores(&self) -> Option<f64> {
        let ticks = self.ticks?;
        Some(ticks as f64 / ticks_per_s() / self.secs)
    }
}

/// [`load`], with the CPU time `t`'s processes spent over it.
async fn measure(client: &reqwest::Client, t: &Target, rps: f64, secs: f64, stream: bool) -> Run {
    let before = t.pid.and_then(cpu_ticks);
    let started = std::time::Instant::now();
    let report = load(client, t, rps, secs, stream).await;
    let after = t.pid.and_then(cpu_ticks);
    Run {
        report,
        secs: started.elapsed().as_secs_f64(),
        ticks: before.zip(after).map(|(b, a)| a.saturating_sub(b)),
    }
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
    let process = KeelProcess::spawn(&format!("{threads}{}\n{toml}", o.keel_top), None).await?;
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

/// The floor contender, `hyper` ([`plain_proxy`]): the current executable as `keel bench
/// plain-proxy` over `fleet`, with keel's worker threads.
async fn start_plain_proxy(fleet: &Fleet, o: &Options) -> Result<Target, String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["bench", "plain-proxy", "--port", &port.to_string()]);
    if let Some(n) = o.keel_threads {
        cmd.args(["--threads", &n.to_string()]);
    }
    let mut child = cmd
        .args(fleet.servers.iter().map(|s| s.openai_base()))
        .stdout(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start keel bench plain-proxy: {e}"))?;
    let base = format!("http://127.0.0.1:{port}/v1");
    let probe = reqwest::Client::new();
    for _ in 0..800 {
        if answers(&probe, &format!("{base}/chat/completions"), &[]).await {
            return Ok(Target {
                name: "hyper".into(),
                base,
                model: "bench".into(),
                endpoint: Endpoint::ChatCompletions,
                headers: Vec::new(),
                pid: Some(child.id()),
                stop: Some(Box::new(move || {
                    let _ = child.kill();
                    let _ = child.wait();
                })),
            });
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("keel bench plain-proxy exited at start: {status}"));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let _ = child.kill();
    Err("keel bench plain-proxy did not answer within 20 s".into())
}

/// Starts keel, the floor proxy or a peer; `None` (with the reason in `lines`) when a peer
/// cannot start.
async fn start_target(
    name: &str,
    fleet: &Fleet,
    o: &Options,
    peers_dir: &Path,
    lines: &mut String,
) -> Result<Option<Target>, String> {
    Ok(Some(match name {
        "keel" => start_keel(fleet, o).await?,
        "hyper" => start_plain_proxy(fleet, o).await?,
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
    use_prompt(&mut c);
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

/// What one ramp found in one mode.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Reach {
    /// The highest rate sustained (0: none).
    best: f64,
    /// The lowest rate found not sustained (none: the whole ramp was), and the share of a core
    /// the gateway used at it: well below 1, the gateway was not what saturated.
    missed: Option<(f64, Option<f64>)>,
}

/// The share of its core at which a gateway that missed a rate counts as saturated.
const SATURATED: f64 = 0.9;

/// How far `t` goes: the ramp's rates in order until one is not sustained, then that gap
/// halved [`REFINE_STEPS`] times.
async fn max_rate(client: &reqwest::Client, t: &Target, stream: bool) -> Reach {
    let mut reach = Reach::default();
    for rps in RAMP {
        match ramp_step(client, t, rps, stream).await {
            Ok(()) => reach.best = rps,
            Err(cores) => {
                reach.missed = Some((rps, cores));
                break;
            }
        }
    }
    if reach.best > 0.0 {
        for _ in 0..REFINE_STEPS {
            let Some((hi, _)) = reach.missed else { break };
            let mid = ((reach.best + hi) / 2.0).round();
            match ramp_step(client, t, mid, stream).await {
                Ok(()) => reach.best = mid,
                Err(cores) => reach.missed = Some((mid, cores)),
            }
        }
    }
    reach
}

/// One ramp of one contender: whole responses, then streams.
type Ramp = [Reach; 2];

/// What the ramps need besides the options: the upstream, the client, the baseline and where
/// the gateway runs.
struct Bench<'a> {
    fleet: &'a Fleet,
    client: &'a reqwest::Client,
    direct: &'a Target,
    peers_dir: &'a Path,
    gw_cpu: Option<&'a str>,
}

/// `rounds` ramps of every contender, alternating (a, b, a, b, …), each on a fresh start of its
/// gateway; per contender, the rounds it ran (none: it could not start).
async fn ramp_rounds(
    o: &Options,
    b: &Bench<'_>,
    lines: &mut String,
) -> Result<Vec<Vec<Ramp>>, String> {
    let mut ramps = vec![Vec::new(); o.contenders.len()];
    for round in 1..=o.rounds {
        for (c, name) in o.contenders.iter().enumerate() {
            // A peer that could not start in the first round is not tried again.
            if round > 1 && ramps[c].is_empty() {
                continue;
            }
            let dir = b.peers_dir.join("ramp");
            let Some(mut target) = start_target(name, b.fleet, o, &dir, lines).await? else {
                continue;
            };
            prepare(b.client, b.direct, &target, b.gw_cpu).await;
            let mut ramp: Ramp = Default::default();
            for (i, stream) in [false, true].into_iter().enumerate() {
                ramp[i] = max_rate(b.client, &target, stream).await;
            }
            stop_target(&mut target);
            eprintln!(
                "  round {round} of {}: {name} sustains whole {} req/s, stream {} req/s",
                o.rounds, ramp[0].best, ramp[1].best
            );
            ramps[c].push(ramp);
        }
    }
    Ok(ramps)
}

/// A mode's figures over the rounds: the median of the highest sustainable rates (and of the
/// first rates missed, where every round missed one), each round's, and the median share of a
/// core the gateway used where it missed, with whether that is saturation ([`SATURATED`]).
fn sustained_over_rounds(mode: &str, rounds: &[Ramp], i: usize) -> Value {
    let best: Vec<f64> = rounds.iter().map(|r| r[i].best).collect();
    let failed: Option<Vec<f64>> = rounds.iter().map(|r| r[i].missed.map(|m| m.0)).collect();
    let cores: Vec<f64> = rounds.iter().filter_map(|r| r[i].missed?.1).collect();
    let cores = (!cores.is_empty()).then(|| median(cores));
    json!({"mode": mode, "max_sustainable_rps": (!best.is_empty()).then(|| median(best.clone())),
        "first_unsustained_rps": failed.filter(|f| !f.is_empty()).map(median),
        "rounds_rps": best,
        "gateway_cores_where_missed": cores,
        "gateway_saturated": cores.map(|c| c >= SATURATED)})
}

/// Per peer and mode, keel's highest sustainable rate over the peer's in the same round, each
/// round's and their median (the goal's form: "≥ 0.8× nginx").
fn ratios_to_keel(o: &Options, ramps: &[Vec<Ramp>]) -> Vec<(String, Value)> {
    let Some(k) = o.contenders.iter().position(|n| n == "keel") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (c, name) in o.contenders.iter().enumerate() {
        if c == k || ramps[c].is_empty() {
            continue;
        }
        let modes: Vec<Value> = [false, true]
            .into_iter()
            .enumerate()
            .map(|(i, stream)| {
                let per_round: Vec<f64> = ramps[k]
                    .iter()
                    .zip(&ramps[c])
                    .filter(|(_, p)| p[i].best > 0.0)
                    .map(|(kr, p)| kr[i].best / p[i].best)
                    .collect();
                json!({"mode": mode_name(stream), "keel_over_peer_per_round": per_round,
                    "median": (!per_round.is_empty()).then(|| median(per_round.clone()))})
            })
            .collect();
        out.push((name.clone(), Value::Array(modes)));
    }
    out
}

/// Whether `t` sustains `rps` for one ramp step; if not, the share of a core it used on the
/// second try. A step that is not sustained is run once more after a pause, and only a second
/// miss counts: in a 2-s step at a low rate one slow request is the P99, and a step right after
/// an overload can meet the backlog it left.
async fn ramp_step(
    client: &reqwest::Client,
    t: &Target,
    rps: f64,
    stream: bool,
) -> Result<(), Option<f64>> {
    for tries in 1..=2 {
        let run = measure(client, t, rps, RAMP_SECONDS, stream).await;
        let r = &run.report;
        eprintln!(
            "  {:<8} {:<6} {rps:>6} req/s: achieved {:.0}, errors {}{}, p99 {:.1} ms, gateway CPU {}{}",
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
            run.cores()
                .map_or("unknown".into(), |c| format!("{c:.2} of a core")),
            if tries == 2 { " (again)" } else { "" }
        );
        if sustained(r, rps) {
            return Ok(());
        }
        if tries == 2 {
            return Err(run.cores());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Err(None)
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

/// The user message every request of this run sends, when `--prompt` set one.
static PROMPT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Makes `c` send the run's `--prompt`, if any.
fn use_prompt(c: &mut LoadConfig) {
    if let Some(p) = PROMPT.get() {
        c.prompts = vec![p.clone()];
    }
}

pub async fn run(mut o: Options) -> Result<(), String> {
    if let Some(p) = &o.prompt {
        let _ = PROMPT.set(p.clone());
    }
    // A gateway pinned to one core runs one worker thread, as nginx runs one worker process:
    // more threads on one core only preempt each other.
    if cpu_plan(o.pin).0 && o.keel_threads.is_none() {
        o.keel_threads = Some(1);
    }
    let (pinned, gw_cpu, _) = cpu_plan(o.pin);
    let _contention = Contention::start(o.contend, pinned, &gw_cpu)?;
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
    compare(&o).await
}

/// The default mode: every contender's ramps (`--max-rate`), then its fixed-rate runs, each
/// against the upstream called directly; the ratios between contenders; the files in `--out`.
async fn compare(o: &Options) -> Result<(), String> {
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
    let bench = Bench {
        fleet: &fleet,
        client: &client,
        direct: &direct,
        peers_dir: &peers_dir,
        gw_cpu: pinned.then_some(gw_cpu.as_str()),
    };
    let ramps = if o.max_rate {
        Some(ramp_rounds(o, &bench, &mut lines).await?)
    } else {
        None
    };
    for (c, name) in o.contenders.iter().enumerate() {
        let rounds = ramps.as_ref().map(|r| r[c].as_slice());
        if let Some(entry) = fixed::contender(o, &bench, name, rounds, &mut lines).await? {
            report.push(entry);
        }
    }
    let ratios = ramps
        .as_ref()
        .map_or_else(Vec::new, |r| ratios_to_keel(o, r));
    for (peer, modes) in &ratios {
        say(
            &mut lines,
            &format!(
                "keel's highest sustainable rate over {peer}'s, the same round: whole {}, stream {}\n",
                ratio_text(&modes[0]),
                ratio_text(&modes[1])
            ),
        );
    }
    let ratios: serde_json::Map<String, Value> = ratios.into_iter().collect();
    for line in fixed::cpu_ratios(&report) {
        say(&mut lines, &line);
    }
    if let Some(dir) = &o.out {
        write_out(dir, o, pinned, &report, &ratios, &lines)?;
    }
    Ok(())
}

/// Prints a line of the report and keeps it for `overhead.txt`.
fn say(lines: &mut String, line: &str) {
    print!("{line}");
    lines.push_str(line);
}

/// One mode's entry of [`ratios_to_keel`] in words: the median and each round's ratio.
fn ratio_text(m: &Value) -> String {
    let each: Vec<String> = m["keel_over_peer_per_round"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_f64)
        .map(|r| format!("{r:.2}"))
        .collect();
    m["median"].as_f64().map_or("none".into(), |med| {
        format!("{med:.2}× (rounds {})", each.join(", "))
    })
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
    let doc = json!({"duration_s": o.duration, "rounds": o.rounds, "pinned": pinned,
        "contend": o.contend, "rows": rows});
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
    ratios: &serde_json::Map<String, Value>,
    lines: &str,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("overhead.json");
    let doc = json!({"rates": o.rates, "duration_s": o.duration, "rounds": o.rounds,
        "keel_worker_threads": o.keel_threads, "pinned": pinned, "contend": o.contend, "contenders": report,
        "sustainable_rate_keel_over_peer": ratios});
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

/// Column heads of the table (added latency in µs: gateway − direct, medians of rounds; the
/// gateway's CPU per request in µs, user + system of all its threads and processes).
pub const HEADER: &str =
    "contender  req/s mode    +ttfb p50 +ttfb p99 +total p50 +total p99   errors requests  cpu µs\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_after_the_command_name() {
        let stat = "4242 (keel (serve) x) S 1 4242 4242 0 -1 4194560 900 0 0 0 1234 56 0 0 20 0 9 0 100 0 0";
        assert_eq!(stat_cpu_ticks(stat), Some(1234 + 56));
        assert_eq!(stat_cpu_ticks("4242 (keel) S 1"), None);
        assert_eq!(stat_cpu_ticks("garbage"), None);
        // This process has used some CPU by now, and the count never goes back.
        let a = cpu_ticks(std::process::id()).expect("readable /proc");
        assert!(cpu_ticks(std::process::id()).expect("readable /proc") >= a);
    }

    fn options(contenders: &[&str]) -> Options {
        Options {
            rates: vec![1000.0],
            duration: 1.0,
            rounds: 3,
            contenders: contenders.iter().map(|c| c.to_string()).collect(),
            keel_threads: None,
            keel_pool: String::new(),
            keel_top: String::new(),
            prompt: None,
            max_rate: true,
            pin: false,
            out: None,
            translated: false,
            event_subscribers: 0,
            streams: Vec::new(),
            tail_bounds: false,
            sequential: false,
            contend: 0,
        }
    }

    /// `--contend`: the busy loops run while the guard lives, [`pin`] leaves them alone, and
    /// dropping the guard stops and reaps them.
    #[test]
    fn busy_loops_run_until_dropped_and_are_never_pinned_with_the_bench() {
        let loops = Contention::start(2, false, "0").expect("sh starts");
        let pids: Vec<u32> = loops.0.iter().map(|c| c.id()).collect();
        assert_eq!(pids.len(), 2);
        for pid in &pids {
            assert!(is_busy_loop(*pid));
            // Until the child has exec'd, /proc shows this process's command line.
            let spinning = (0..500).any(|_| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let found = String::from_utf8_lossy(&cmdline).contains("while :; do :; done");
                if !found {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                found
            });
            assert!(spinning, "busy loop {pid} never ran");
        }
        assert!(!is_busy_loop(std::process::id()));
        // Every report's first line says the gateway shared its core.
        assert!(
            pinning(false, "1", "bench", "0").ends_with("; 2 busy loop(s), unpinned (--contend)")
        );
        drop(loops);
        assert_eq!(
            pinning(false, "1", "bench", "0"),
            "no CPU pinning (one core, or --no-pin)"
        );
        for pid in &pids {
            assert!(!is_busy_loop(*pid));
            assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
        }
    }

    #[test]
    fn ramp_rounds_report_medians_and_each_rounds_ratio_to_keel() {
        // nginx first in the list: the ratios are keel's over the peer's whatever the order.
        let o = options(&["nginx", "keel", "portkey"]);
        // Where a rate was missed, the gateway used 0.6 of its core there.
        let reach = |best: f64, missed: Option<f64>| Reach {
            best,
            missed: missed.map(|m| (m, Some(0.6))),
        };
        let ramps = vec![
            vec![
                [reach(5500.0, Some(6000.0)), reach(4000.0, Some(4500.0))],
                [reach(7500.0, None), reach(3000.0, Some(3500.0))],
                [reach(6000.0, Some(6500.0)), reach(3500.0, Some(4000.0))],
            ],
            vec![
                [reach(5500.0, Some(6000.0)), reach(2750.0, Some(3000.0))],
                [reach(5500.0, Some(6000.0)), reach(3000.0, Some(3500.0))],
                [reach(6000.0, Some(6500.0)), reach(2500.0, Some(2750.0))],
            ],
            Vec::new(), // could not start
        ];
        let whole = sustained_over_rounds("whole", &ramps[0], 0);
        assert_eq!(whole["max_sustainable_rps"], 6000.0);
        assert_eq!(whole["rounds_rps"], json!([5500.0, 7500.0, 6000.0]));
        // One round sustained the whole ramp: no first missed rate over the rounds.
        assert_eq!(whole["first_unsustained_rps"], Value::Null);
        let stream = sustained_over_rounds("stream", &ramps[1], 1);
        assert_eq!(stream["max_sustainable_rps"], 2750.0);
        assert_eq!(stream["first_unsustained_rps"], 3000.0);
        assert_eq!(stream["gateway_cores_where_missed"], 0.6);
        assert_eq!(stream["gateway_saturated"], false);
        let ratios = ratios_to_keel(&o, &ramps);
        assert_eq!(ratios.len(), 1, "only peers that ran: {ratios:?}");
        let (peer, modes) = &ratios[0];
        assert_eq!(peer, "nginx");
        assert_eq!(
            modes[0]["keel_over_peer_per_round"],
            json!([1.0, 5500.0 / 7500.0, 1.0])
        );
        assert_eq!(modes[0]["median"], 1.0);
        assert_eq!(
            modes[1]["keel_over_peer_per_round"],
            json!([2750.0 / 4000.0, 1.0, 2500.0 / 3500.0])
        );
        assert_eq!(modes[1]["median"], 2500.0 / 3500.0);
        assert!(ratios_to_keel(&options(&["nginx"]), &ramps[..1]).is_empty());
    }

    #[test]
    fn a_ratio_reads_as_the_median_and_each_round() {
        let m = json!({"keel_over_peer_per_round": [1.0, 0.75, 0.8], "median": 0.8});
        assert_eq!(ratio_text(&m), "0.80× (rounds 1.00, 0.75, 0.80)");
        let none = json!({"keel_over_peer_per_round": [], "median": null});
        assert_eq!(ratio_text(&none), "none");
    }
}
