//! `keel bench overhead --streams 1000,5000`: what thousands of live, slow streams cost a
//! gateway, the shape of production LLM traffic (a token every 100 ms, streams of ten seconds).
//!
//! One simulated upstream writes a token every 100 ms (no jitter) for 100 tokens. For each
//! target count N, the open-loop load generator starts N / 10 streams a second for long enough
//! that N are open at once (Little's law: rate × 10 s), first straight to the upstream, then
//! through each gateway. Reported per gateway: the streams actually open at the end of the
//! ramp-up, the resident memory while they are (`VmRSS`, sampled every 250 ms, the highest
//! sample) and per 1,000 streams above the idle process, the gateway's CPU share over the run
//! (user + system time ÷ wall time, from `/proc`), and the inter-token gap at P50 and P99
//! minus the direct run's (what the gateway adds between two tokens of a live stream).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use keel_sim::load::{LoadConfig, LoadReport};
use keel_sim::{Fleet, FleetConfig, GenerationConfig, ServerConfig};

use super::{
    cpu_plan, cpu_ticks, pin, pinning, start_target, stop_target, ticks_per_s, Options, Target,
};

/// Gap between two tokens of a simulated stream, and tokens per stream.
const GAP_MS: f64 = 100.0;
const TOKENS: u64 = 100;

/// The upstream: one server, a token every 100 ms, exactly `TOKENS` of them.
async fn slow_upstream() -> Result<Fleet, String> {
    let server = ServerConfig {
        name: "slow".into(),
        ttft_ms: 0.0,
        ttft_sigma: 0.0,
        prefill_us_per_token: 0.0,
        gap_ms: GAP_MS,
        gap_sigma: 0.0,
        capacity: 1_000_000,
        ..ServerConfig::fast("slow")
    };
    let cfg = FleetConfig {
        generation: GenerationConfig {
            min_reply_tokens: TOKENS as u32,
            mean_reply_tokens: TOKENS as u32,
        },
        servers: vec![server],
    };
    Fleet::start(&cfg).await.map_err(|e| e.to_string())
}

/// Resident set (KiB) of `pid` and its descendants now.
fn rss_kib(pid: u32) -> Option<u64> {
    super::status_kib(pid, "VmRSS:")
}

/// What one run through one target measured.
struct Run {
    report: LoadReport,
    /// Highest VmRSS sample during the run, KiB.
    peak_rss_kib: Option<u64>,
    /// The gateway's CPU time over the run ÷ the run's wall time.
    cpu_share: Option<f64>,
}

/// Starts `n` streams' worth of load at `t`: N / stream-length streams a second for two
/// stream lengths, so that N are open at once for the second half.
async fn run(client: &reqwest::Client, t: &Target, n: usize) -> Run {
    let stream_s = GAP_MS * TOKENS as f64 / 1000.0;
    let secs = 2.0 * stream_s;
    let mut c = LoadConfig::new(&t.base, &t.model);
    c.endpoint = t.endpoint;
    c.rps = n as f64 / stream_s;
    c.duration = Duration::from_secs_f64(secs);
    c.stream = true;
    c.max_tokens = TOKENS;
    c.headers = t.headers.clone();
    super::use_prompt(&mut c);
    // Sample the gateway's memory while the load runs.
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = t.pid.map(|pid| {
        let (done, peak) = (done.clone(), peak.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                if let Some(k) = rss_kib(pid) {
                    peak.fetch_max(k, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    });
    let started = std::time::Instant::now();
    let before = t.pid.and_then(cpu_ticks);
    let report = keel_sim::load::run_with_client(c, client.clone()).await;
    let after = t.pid.and_then(cpu_ticks);
    let wall = started.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    if let Some(s) = sampler {
        let _ = s.await;
    }
    let cpu_share = before
        .zip(after)
        .map(|(b, a)| a.saturating_sub(b) as f64 / ticks_per_s() / wall);
    Run {
        report,
        peak_rss_kib: Some(peak.load(Ordering::Relaxed)).filter(|k| *k > 0),
        cpu_share,
    }
}

/// Streams open at once at the height of a run, as the load generator counted them. (This
/// was once arrivals per second × mean stream duration, with the arrival rate taken over the
/// whole run including the last streams' drain: a third too low, which made every
/// per-stream memory figure half as large again as it was.)
fn open_streams(r: &LoadReport) -> f64 {
    r.peak_in_flight as f64
}

const HEADER: &str =
    "contender streams  open  errors  rss MiB  MiB/1k streams  cpu %  +gap p50 ms  +gap p99 ms\n";

pub async fn run_all(o: Options) -> Result<(), String> {
    let fleet = slow_upstream().await?;
    let peers_dir = o
        .out
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("keel-bench-streams"));
    let (pinned, gw_cpu, bench_cpus) = cpu_plan(o.pin);
    if pinned {
        pin(std::process::id(), &bench_cpus);
    }
    // One connection per stream, as N separate clients would open; a new client (and pool) per
    // run, so that one run's idle connections (and the simulated upstream's ends of them, in
    // this process) do not count against the next run's file descriptors: with 5,000 streams
    // they made the later runs fail to connect.
    let client = || {
        reqwest::Client::builder()
            .pool_max_idle_per_host(usize::MAX)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| e.to_string())
    };
    let direct = Target::direct(&fleet);
    let intro = format!(
        "keel bench overhead --streams: one simulated upstream writing a token every {GAP_MS} ms, {TOKENS} tokens a stream; {}; targets {:?} concurrent streams\n",
        pinning(pinned, &gw_cpu, "load generator and upstream", &bench_cpus),
        o.streams,
    );
    print!("{intro}{HEADER}");
    let mut lines = String::new();
    let mut rows = Vec::new();
    for &n in &o.streams {
        let base = run(&client()?, &direct, n).await;
        for name in &o.contenders {
            let Some(mut target) = start_target(name, &fleet, &o, &peers_dir, &mut lines).await?
            else {
                continue;
            };
            if let Some(pid) = target.pid.filter(|_| pinned) {
                pin(pid, &gw_cpu);
            }
            // Idle memory after a few requests (connection pools made, lazy tables built).
            let mut warm = LoadConfig::new(&target.base, &target.model);
            warm.endpoint = target.endpoint;
            warm.rps = 20.0;
            warm.duration = Duration::from_secs(1);
            warm.stream = true;
            warm.max_tokens = 2;
            warm.headers = target.headers.clone();
            let c = client()?;
            keel_sim::load::run_with_client(warm, c.clone()).await;
            let idle = target.pid.and_then(rss_kib);
            let r = run(&c, &target, n).await;
            let mib = |k: u64| k as f64 / 1024.0;
            let open = open_streams(&r.report);
            let per_1k = r
                .peak_rss_kib
                .zip(idle)
                .map(|(p, i)| mib(p.saturating_sub(i)) / (open / 1000.0).max(1e-9));
            let gap = |f: fn(&LoadReport) -> f64| f(&r.report) - f(&base.report);
            let (gap50, gap99) = (gap(|x| x.gap.p50_ms), gap(|x| x.gap.p99_ms));
            let line = format!(
                "{name:<9} {n:>7} {open:>5.0} {:>7} {:>8} {:>15} {:>6} {gap50:>12.2} {gap99:>12.2}\n",
                r.report.errors,
                r.peak_rss_kib.map_or("—".into(), |k| format!("{:.1}", mib(k))),
                per_1k.map_or("—".into(), |m| format!("{m:.1}")),
                r.cpu_share.map_or("—".into(), |c| format!("{:.0}", c * 100.0)),
            );
            print!("{line}");
            lines.push_str(&line);
            if r.report.errors > 0 {
                let kinds = format!("          errors by kind: {:?}\n", r.report.error_kinds);
                print!("{kinds}");
                lines.push_str(&kinds);
            }
            rows.push(json!({
                "contender": name, "target_streams": n, "open_streams": open,
                "errors": r.report.errors, "error_kinds": r.report.error_kinds, "requests": r.report.sent,
                "idle_rss_mib": idle.map(mib), "peak_rss_mib": r.peak_rss_kib.map(mib),
                "rss_mib_per_1k_streams": per_1k, "cpu_share": r.cpu_share,
                "gap_p50_ms": r.report.gap.p50_ms, "gap_p99_ms": r.report.gap.p99_ms,
                "direct_gap_p50_ms": base.report.gap.p50_ms, "direct_gap_p99_ms": base.report.gap.p99_ms,
                "added_gap_p50_ms": gap50, "added_gap_p99_ms": gap99,
            }));
            stop_target(&mut target);
        }
    }
    if let Some(dir) = &o.out {
        write(
            dir,
            &intro,
            &lines,
            &json!({"pinned": pinned, "rows": rows}),
        )?;
    }
    Ok(())
}

fn write(dir: &std::path::Path, intro: &str, lines: &str, doc: &Value) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("streams.json");
    std::fs::write(&path, serde_json::to_string_pretty(doc).unwrap_or_default())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    std::fs::write(dir.join("streams.txt"), format!("{intro}{HEADER}{lines}"))
        .map_err(|e| e.to_string())?;
    println!("written {} and streams.txt", path.display());
    Ok(())
}
