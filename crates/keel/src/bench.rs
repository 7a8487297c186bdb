//! `keel bench overhead`: the latency keel adds over calling a fast simulated upstream directly.
//!
//! One zero-latency simulated server (in this process, beside the load generator) and keel as
//! its own process (`keel serve`, access log on, written to /dev/null); the same open-loop load
//! (constant arrival rate) is sent directly to the server and through keel, alternating in
//! rounds within one run so that both see the same machine state. Reported: P50/P99/P99.9 of time to first byte/token and of total time,
//! and the difference (keel − direct) of the medians across rounds.

use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;
use serde_json::json;

use keel_core::protocol::Endpoint;
use keel_gateway::Config;
use keel_sim::load::{LoadConfig, LoadReport};
use keel_sim::{Fleet, ServerConfig};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Latency added by keel over a direct call, streaming and not.
    Overhead {
        /// Requests per second (open loop).
        #[arg(long, default_value_t = 1000.0)]
        rps: f64,
        /// Seconds per measured round.
        #[arg(long, default_value_t = 5.0)]
        duration: f64,
        /// Rounds per target (alternating direct / keel).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Directory for overhead.json.
        #[arg(long)]
        out: Option<PathBuf>,
        /// keel's runtime worker threads (`worker_threads` in keel.toml); default: one per core.
        #[arg(long)]
        keel_threads: Option<usize>,
    },
}

pub async fn run(cmd: BenchCommand) -> Result<(), String> {
    match cmd {
        BenchCommand::Overhead { rps, duration, rounds, out, keel_threads } => overhead(rps, duration, rounds.max(1), out, keel_threads).await,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn overhead(rps: f64, duration: f64, rounds: usize, out: Option<PathBuf>, keel_threads: Option<usize>) -> Result<(), String> {
    let upstream = ServerConfig { ttft_ms: 0.0, ttft_sigma: 0.0, prefill_us_per_token: 0.0, gap_ms: 0.0, gap_sigma: 0.0, capacity: 100_000, ..ServerConfig::fast("fast") };
    let fleet = Fleet::start_n(1, upstream).await.map_err(|e| e.to_string())?;
    let sim = fleet.get(0);
    let toml = format!(
        "[[pools]]\nname = \"bench\"\n[[pools.variants]]\nname = \"fast\"\nurl = \"{}\"\nprotocol = \"openai\"\nupstream_model = \"sim\"\n",
        sim.openai_base()
    );
    Config::parse(&toml, "<bench>", &Default::default()).map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let cfg_path = std::env::temp_dir().join(format!("keel-bench-{}.toml", std::process::id()));
    let threads = keel_threads.map(|n| format!("worker_threads = {n}\n")).unwrap_or_default();
    std::fs::write(&cfg_path, format!("listen = \"{addr}\"\n{threads}{toml}")).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = std::process::Command::new(exe)
        .args(["serve", "--config"])
        .arg(&cfg_path)
        .env("KEEL_LOG", std::env::var("KEEL_BENCH_LOG").unwrap_or_else(|_| "info".into()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start keel serve: {e}"))?;
    let probe = reqwest::Client::new();
    let mut up = false;
    for _ in 0..200 {
        if probe.get(format!("http://{addr}/keel/health")).send().await.is_ok() {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    if !up {
        let _ = child.kill();
        return Err("keel serve did not come up".into());
    }
    let client = reqwest::Client::builder().pool_max_idle_per_host(4096).tcp_nodelay(true).build().map_err(|e| e.to_string())?;

    let targets = [("direct", sim.openai_base(), "sim"), ("keel", format!("http://{addr}/v1"), "bench")];
    let mut results = Vec::new();
    println!(
        "keel bench overhead: {rps} req/s open loop, {duration} s × {rounds} rounds per target, one zero-latency simulated upstream, keel worker threads: {}",
        keel_threads.map(|n| n.to_string()).unwrap_or_else(|| "one per core".into())
    );
    println!("{:<10} {:<7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8}", "mode", "target", "ttfb p50", "ttfb p99", "total p50", "total p99", "total p99.9", "errors");
    for stream in [false, true] {
        let mode = if stream { "stream" } else { "whole" };
        let make = |url: &str, model: &str, secs: f64| {
            let mut c = LoadConfig::new(url, model);
            c.endpoint = Endpoint::ChatCompletions;
            c.rps = rps;
            c.duration = Duration::from_secs_f64(secs);
            c.stream = stream;
            c.max_tokens = 16;
            c
        };
        // Warm both paths (connection pools, caches).
        for (_, url, model) in &targets {
            keel_sim::load::run_with_client(make(url, model, 0.5), client.clone()).await;
        }
        let mut per_target: Vec<Vec<LoadReport>> = vec![Vec::new(), Vec::new()];
        for _ in 0..rounds {
            for (i, (_, url, model)) in targets.iter().enumerate() {
                per_target[i].push(keel_sim::load::run_with_client(make(url, model, duration), client.clone()).await);
            }
        }
        let mut medians = Vec::new();
        for (i, (name, _, _)) in targets.iter().enumerate() {
            let reps = &per_target[i];
            let m = |f: fn(&LoadReport) -> f64| median(reps.iter().map(f).collect());
            let row = json!({
                "mode": mode, "target": name,
                "ttfb_p50_ms": m(|r| r.ttft.p50_ms), "ttfb_p99_ms": m(|r| r.ttft.p99_ms),
                "total_p50_ms": m(|r| r.total.p50_ms), "total_p99_ms": m(|r| r.total.p99_ms), "total_p999_ms": m(|r| r.total.p999_ms),
                "errors": reps.iter().map(|r| r.errors).sum::<u64>(), "requests": reps.iter().map(|r| r.sent).sum::<u64>(),
                "achieved_rps": m(|r| r.achieved_rps),
            });
            println!(
                "{:<10} {:<7} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>8}",
                mode, name, row["ttfb_p50_ms"].as_f64().unwrap_or(0.0), row["ttfb_p99_ms"].as_f64().unwrap_or(0.0),
                row["total_p50_ms"].as_f64().unwrap_or(0.0), row["total_p99_ms"].as_f64().unwrap_or(0.0),
                row["total_p999_ms"].as_f64().unwrap_or(0.0), row["errors"]
            );
            medians.push(row);
        }
        let d = |k: &str| (medians[1][k].as_f64().unwrap_or(0.0) - medians[0][k].as_f64().unwrap_or(0.0)) * 1000.0;
        println!(
            "{:<10} added by keel: ttfb p50 {:+.0} µs, p99 {:+.0} µs; total p50 {:+.0} µs, p99 {:+.0} µs",
            mode, d("ttfb_p50_ms"), d("ttfb_p99_ms"), d("total_p50_ms"), d("total_p99_ms")
        );
        results.push(json!({"mode": mode, "direct": medians[0], "keel": medians[1],
            "added_us": {"ttfb_p50": d("ttfb_p50_ms"), "ttfb_p99": d("ttfb_p99_ms"), "total_p50": d("total_p50_ms"), "total_p99": d("total_p99_ms")}}));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&cfg_path);
    if let Some(dir) = out {
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join("overhead.json");
        let doc = json!({"rps": rps, "duration_s": duration, "rounds": rounds, "keel_worker_threads": keel_threads, "results": results});
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap_or_default()).map_err(|e| format!("{}: {e}", path.display()))?;
        println!("written {}", path.display());
    }
    Ok(())
}
