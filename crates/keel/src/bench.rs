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
    /// Duration of one routing decision (stage 1) over an N-variant pool: P50/P99/P99.9.
    Decision {
        #[arg(long, default_value_t = 16)]
        variants: usize,
        #[arg(long, default_value_t = 200_000)]
        iterations: usize,
    },
    /// keel's live selection vs plain round robin on a fleet with one degraded variant.
    Routing {
        #[arg(long, default_value_t = 100.0)]
        rps: f64,
        #[arg(long, default_value_t = 20.0)]
        duration: f64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

pub async fn run(cmd: BenchCommand) -> Result<(), String> {
    match cmd {
        BenchCommand::Overhead { rps, duration, rounds, out, keel_threads } => overhead(rps, duration, rounds.max(1), out, keel_threads).await,
        BenchCommand::Decision { variants, iterations } => decision(variants.max(2), iterations.max(1000)),
        BenchCommand::Routing { rps, duration, seed } => routing(rps, duration, seed).await,
    }
}

/// Percentiles (µs) of a sample set.
fn percentiles_us(mut v: Vec<f64>) -> (f64, f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)];
    (q(0.5), q(0.99), q(0.999), v.iter().sum::<f64>() / v.len() as f64)
}

/// The gateway's real stage-1 call (`Pool::select`: lock, health weights, candidates, policy,
/// decision record) timed one call at a time.
fn decision(variants: usize, iterations: usize) -> Result<(), String> {
    let mut toml = String::from("[[pools]]\nname = \"bench\"\n[pools.health]\nprewarm_requests = 0\n");
    for i in 0..variants {
        toml.push_str(&format!("[[pools.variants]]\nname = \"v{i}\"\nurl = \"http://127.0.0.1:9/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n"));
    }
    let cfg = Config::parse(&toml, "<bench>", &Default::default()).map_err(|e| e.to_string())?;
    let gw = keel_gateway::Gateway::new(cfg);
    let pool = gw.pool("bench").ok_or("pool missing")?.clone();
    let mut rng = keel_core::rng::Rng::new(3);
    for _ in 0..64 {
        for i in 0..variants {
            pool.record_attempt(i, rng.next_f64() > 0.02, Some(rng.lognormal(80.0 + i as f64 * 3.0, 0.3)));
            pool.record_stream(i, &[10.0, 11.0, 9.0, 12.0, 10.0]);
        }
    }
    let req = keel_core::request::parse(keel_core::protocol::Endpoint::ChatCompletions, br#"{"model":"bench","messages":[{"role":"user","content":"hello"}]}"#)
        .map_err(|e| e.message)?;
    let mut samples = Vec::with_capacity(iterations);
    for n in 0..iterations {
        let t = std::time::Instant::now();
        let (sel, rec) = pool.select(&req, keel_gateway::pools::Controls::default(), "bench");
        let elapsed = t.elapsed();
        std::hint::black_box((sel, rec));
        if n >= iterations / 10 {
            samples.push(elapsed.as_secs_f64() * 1e6);
        }
    }
    let (p50, p99, p999, mean) = percentiles_us(samples);
    println!("keel bench decision: Pool::select over {variants} variants, {iterations} calls (first 10% discarded as warm-up)");
    println!("p50 {p50:.2} µs   p99 {p99:.2} µs   p99.9 {p999:.2} µs   mean {mean:.2} µs");
    Ok(())
}

/// 4 variants with heavy-tailed latency, one of them degraded (errors and slowness): keel's
/// live selection against plain round robin, same fleet settings, same arrival sequence.
async fn routing(rps: f64, duration: f64, seed: u64) -> Result<(), String> {
    use keel_sim::{FaultKind, FaultSpec, FleetConfig};
    println!("keel bench routing: 4 variants (lognormal TTFT median 60 ms, 2% tail ×10), one degraded (30% 503, 4× slower); {rps} req/s for {duration} s, streaming, client without retries");
    println!("{:<12} {:>9} {:>9} {:>9} {:>10} {:>10} {:>8}", "policy", "ttft p50", "ttft p90", "ttft p99", "total p50", "total p99", "errors");
    let mut rows = Vec::new();
    for policy in ["p2c", "round_robin"] {
        let servers = (0..4)
            .map(|i| {
                let mut s = ServerConfig { name: format!("v{i}"), seed: Some(seed + i as u64), ttft_ms: 60.0, ttft_sigma: 0.4, gap_ms: 8.0, tail_prob: 0.02, tail_factor: 10.0, ..Default::default() };
                if i == 0 {
                    let mut f = FaultSpec::new(FaultKind::Degraded);
                    f.error_rate = Some(0.3);
                    f.factor = Some(4.0);
                    s.faults = vec![f];
                }
                s
            })
            .collect();
        let fleet = Fleet::start(&FleetConfig { servers, ..Default::default() }).await.map_err(|e| e.to_string())?;
        let mut toml = format!("[[pools]]\nname = \"p\"\npolicy = \"{policy}\"\n");
        for s in &fleet.servers {
            toml.push_str(&format!("[[pools.variants]]\nname = \"{}\"\nurl = \"{}\"\nprotocol = \"openai\"\nupstream_model = \"sim\"\n", s.name, s.openai_base()));
        }
        let cfg = Config::parse(&toml, "<bench>", &Default::default()).map_err(|e| e.to_string())?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let gw = keel_gateway::Gateway::new(cfg);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(keel_gateway::server::serve(gw, listener, async move {
            let _ = stopped.await;
        }));
        tokio::time::sleep(Duration::from_millis(300)).await; // warm-up requests
        let mut c = LoadConfig::new(&format!("http://{addr}/v1"), "p");
        c.rps = rps;
        c.duration = Duration::from_secs_f64(duration);
        c.stream = true;
        c.max_tokens = 24;
        c.prompts = (0..50).map(|i| format!("request {i} about routing")).collect();
        let r = keel_sim::load::run(c).await;
        let _ = stop.send(());
        println!(
            "{:<12} {:>9.1} {:>9.1} {:>9.1} {:>10.1} {:>10.1} {:>7.2}%",
            policy, r.ttft.p50_ms, r.ttft.p90_ms, r.ttft.p99_ms, r.total.p50_ms, r.total.p99_ms, 100.0 * r.errors as f64 / r.sent.max(1) as f64
        );
        let degraded_share = fleet.servers[0].state.stats().requests as f64 / fleet.servers.iter().map(|s| s.state.stats().requests).sum::<u64>().max(1) as f64;
        rows.push((policy, degraded_share));
    }
    for (policy, share) in rows {
        println!("{policy}: degraded variant received {:.1}% of upstream requests", share * 100.0);
    }
    Ok(())
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
