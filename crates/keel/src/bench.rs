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
        /// Extra lines for keel's pool table, e.g. "assemble_non_streaming = false".
        #[arg(long, default_value = "")]
        keel_pool: String,
    },
    /// Duration of one routing decision (stage 1) over an N-variant pool: P50/P99/P99.9.
    Decision {
        #[arg(long, default_value_t = 16)]
        variants: usize,
        #[arg(long, default_value_t = 200_000)]
        iterations: usize,
    },
    /// A seed scenario from bench/scenarios (or `all`): `keel bench heavy-tail [--quick]
    /// [--duration S] [--seed N] [--out DIR] [--contenders keel,nginx]`.
    #[command(external_subcommand)]
    Scenario(Vec<String>),
    /// Mid-stream stalls: keel vs keel without migration vs plain round robin.
    Migration {
        #[arg(long, default_value_t = 400)]
        requests: usize,
        #[arg(long, default_value_t = 40.0)]
        rps: f64,
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
        BenchCommand::Overhead {
            rps,
            duration,
            rounds,
            out,
            keel_threads,
            keel_pool,
        } => overhead(rps, duration, rounds.max(1), out, keel_threads, &keel_pool).await,
        BenchCommand::Decision {
            variants,
            iterations,
        } => decision(variants.max(2), iterations.max(1000)),
        BenchCommand::Routing {
            rps,
            duration,
            seed,
        } => routing(rps, duration, seed).await,
        BenchCommand::Migration { requests, rps } => migration(requests, rps).await,
        BenchCommand::Scenario(args) => scenario_args(args).await,
    }
}

/// A fleet of four simulated variants (`tweak` adjusts each) and an in-process gateway with one
/// pool `p` over them (`pool_extra` lines in the pool table). Dropping the sender stops it.
async fn fleet_and_gateway(
    template: ServerConfig,
    tweak: impl Fn(usize, &mut ServerConfig),
    pool_extra: &str,
) -> Result<
    (
        Fleet,
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
    ),
    String,
> {
    let servers = (0..4)
        .map(|i| {
            let mut s = ServerConfig {
                name: format!("v{i}"),
                seed: Some(template.seed.unwrap_or(1) + i as u64),
                ..template.clone()
            };
            tweak(i, &mut s);
            s
        })
        .collect();
    let fleet = Fleet::start(&keel_sim::FleetConfig {
        servers,
        ..Default::default()
    })
    .await
    .map_err(|e| e.to_string())?;
    let toml = crate::scenario::pool_toml(&fleet, "p", pool_extra);
    let (addr, stop) = crate::scenario::start_gateway(&toml, "<bench>").await?;
    Ok((fleet, addr, stop))
}

/// Parses `<scenario> [--quick] [--duration S] [--seed N] [--out DIR] [--contenders a,b]`.
async fn scenario_args(args: Vec<String>) -> Result<(), String> {
    let name = args.first().cloned().ok_or("usage: keel bench <scenario|all> [--quick] [--duration S] [--seed N] [--out DIR] [--contenders keel,nginx]")?;
    let (mut quick, mut duration, mut seed, mut out, mut contenders) = (
        false,
        None,
        1u64,
        PathBuf::from("bench/out"),
        vec!["keel".to_owned(), "nginx".to_owned()],
    );
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        let mut value = |flag: &str| it.next().cloned().ok_or(format!("{flag} needs a value"));
        match a.as_str() {
            "--quick" => quick = true,
            "--duration" => {
                duration = Some(
                    value("--duration")?
                        .parse::<f64>()
                        .map_err(|_| "--duration: seconds expected")?,
                )
            }
            "--seed" => {
                seed = value("--seed")?
                    .parse()
                    .map_err(|_| "--seed: an integer expected")?
            }
            "--out" => out = PathBuf::from(value("--out")?),
            "--contenders" => {
                contenders = value("--contenders")?
                    .split(',')
                    .map(str::to_owned)
                    .collect()
            }
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    crate::scenario::run(&name, &contenders, quick, duration, seed, &out).await
}

/// Percentiles (µs) of a sample set.
fn percentiles_us(mut v: Vec<f64>) -> (f64, f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)];
    (
        q(0.5),
        q(0.99),
        q(0.999),
        v.iter().sum::<f64>() / v.len() as f64,
    )
}

/// The gateway's real stage-1 call (`Pool::select`: lock, health weights, candidates, policy,
/// decision record) timed one call at a time.
fn decision(variants: usize, iterations: usize) -> Result<(), String> {
    let mut toml =
        String::from("[[pools]]\nname = \"bench\"\n[pools.health]\nprewarm_requests = 0\n");
    for i in 0..variants {
        toml.push_str(&format!("[[pools.variants]]\nname = \"v{i}\"\nurl = \"http://127.0.0.1:9/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n"));
    }
    let cfg = Config::parse(&toml, "<bench>", &Default::default()).map_err(|e| e.to_string())?;
    let gw = keel_gateway::Gateway::new(cfg);
    let pool = gw.pool("bench").ok_or("pool missing")?.clone();
    let mut rng = keel_core::rng::Rng::new(3);
    for _ in 0..64 {
        for i in 0..variants {
            pool.record_attempt(
                i,
                rng.next_f64() > 0.02,
                Some(rng.lognormal(80.0 + i as f64 * 3.0, 0.3)),
            );
            pool.record_stream(i, &[10.0, 11.0, 9.0, 12.0, 10.0]);
        }
    }
    let req = keel_core::request::parse(
        keel_core::protocol::Endpoint::ChatCompletions,
        br#"{"model":"bench","messages":[{"role":"user","content":"hello"}]}"#,
    )
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
    use keel_sim::{FaultKind, FaultSpec};
    println!("keel bench routing: 4 variants (lognormal TTFT median 60 ms, 2% tail ×10), one degraded (30% 503, 4× slower); {rps} req/s for {duration} s, streaming, client without retries");
    println!(
        "{:<12} {:>9} {:>9} {:>9} {:>10} {:>10} {:>8}",
        "policy", "ttft p50", "ttft p90", "ttft p99", "total p50", "total p99", "errors"
    );
    let mut rows = Vec::new();
    for policy in ["p2c", "round_robin"] {
        let template = ServerConfig {
            seed: Some(seed),
            ttft_ms: 60.0,
            ttft_sigma: 0.4,
            gap_ms: 8.0,
            tail_prob: 0.02,
            tail_factor: 10.0,
            ..Default::default()
        };
        let degraded = |i: usize, s: &mut ServerConfig| {
            if i == 0 {
                let mut f = FaultSpec::new(FaultKind::Degraded);
                f.error_rate = Some(0.3);
                f.factor = Some(4.0);
                s.faults = vec![f];
            }
        };
        let (fleet, addr, stop) =
            fleet_and_gateway(template, degraded, &format!("policy = \"{policy}\"")).await?;
        let mut c = LoadConfig::new(&format!("http://{addr}/v1"), "p");
        c.rps = rps;
        c.duration = Duration::from_secs_f64(duration);
        c.stream = true;
        c.max_tokens = 24;
        c.prompts = (0..50)
            .map(|i| format!("request {i} about routing"))
            .collect();
        let r = keel_sim::load::run(c).await;
        let _ = stop.send(());
        println!(
            "{:<12} {:>9.1} {:>9.1} {:>9.1} {:>10.1} {:>10.1} {:>7.2}%",
            policy,
            r.ttft.p50_ms,
            r.ttft.p90_ms,
            r.ttft.p99_ms,
            r.total.p50_ms,
            r.total.p99_ms,
            100.0 * r.errors as f64 / r.sent.max(1) as f64
        );
        let degraded_share = fleet.servers[0].state.stats().requests as f64
            / fleet
                .servers
                .iter()
                .map(|s| s.state.stats().requests)
                .sum::<u64>()
                .max(1) as f64;
        rows.push((policy, degraded_share));
    }
    for (policy, share) in rows {
        println!(
            "{policy}: degraded variant received {:.1}% of upstream requests",
            share * 100.0
        );
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn overhead(
    rps: f64,
    duration: f64,
    rounds: usize,
    out: Option<PathBuf>,
    keel_threads: Option<usize>,
    keel_pool: &str,
) -> Result<(), String> {
    let upstream = ServerConfig {
        ttft_ms: 0.0,
        ttft_sigma: 0.0,
        prefill_us_per_token: 0.0,
        gap_ms: 0.0,
        gap_sigma: 0.0,
        capacity: 100_000,
        ..ServerConfig::fast("fast")
    };
    let fleet = Fleet::start_n(1, upstream)
        .await
        .map_err(|e| e.to_string())?;
    let sim = fleet.get(0);
    let toml = crate::scenario::pool_toml(&fleet, "bench", keel_pool);
    Config::parse(&toml, "<bench>", &Default::default()).map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let cfg_path = std::env::temp_dir().join(format!("keel-bench-{}.toml", std::process::id()));
    let threads = keel_threads
        .map(|n| format!("worker_threads = {n}\n"))
        .unwrap_or_default();
    std::fs::write(&cfg_path, format!("listen = \"{addr}\"\n{threads}{toml}"))
        .map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = std::process::Command::new(exe)
        .args(["serve", "--config"])
        .arg(&cfg_path)
        .env(
            "KEEL_LOG",
            std::env::var("KEEL_BENCH_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start keel serve: {e}"))?;
    let probe = reqwest::Client::new();
    let mut up = false;
    for _ in 0..200 {
        if probe
            .get(format!("http://{addr}/keel/health"))
            .send()
            .await
            .is_ok()
        {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    if !up {
        let _ = child.kill();
        return Err("keel serve did not come up".into());
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| e.to_string())?;

    let targets = [
        ("direct", sim.openai_base(), "sim"),
        ("keel", format!("http://{addr}/v1"), "bench"),
    ];
    let mut results = Vec::new();
    println!(
        "keel bench overhead: {rps} req/s open loop, {duration} s × {rounds} rounds per target, one zero-latency simulated upstream, keel worker threads: {}",
        keel_threads.map(|n| n.to_string()).unwrap_or_else(|| "one per core".into())
    );
    println!(
        "{:<10} {:<7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "mode", "target", "ttfb p50", "ttfb p99", "total p50", "total p99", "total p99.9", "errors"
    );
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
                per_target[i].push(
                    keel_sim::load::run_with_client(make(url, model, duration), client.clone())
                        .await,
                );
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
                mode,
                name,
                row["ttfb_p50_ms"].as_f64().unwrap_or(0.0),
                row["ttfb_p99_ms"].as_f64().unwrap_or(0.0),
                row["total_p50_ms"].as_f64().unwrap_or(0.0),
                row["total_p99_ms"].as_f64().unwrap_or(0.0),
                row["total_p999_ms"].as_f64().unwrap_or(0.0),
                row["errors"]
            );
            medians.push(row);
        }
        let d = |k: &str| {
            (medians[1][k].as_f64().unwrap_or(0.0) - medians[0][k].as_f64().unwrap_or(0.0)) * 1000.0
        };
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
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&doc).unwrap_or_default(),
        )
        .map_err(|e| format!("{}: {e}", path.display()))?;
        println!("written {}", path.display());
    }
    Ok(())
}

/// One streamed request through a gateway: the delivered text, or why it is not intact.
async fn stream_text(client: &reqwest::Client, url: &str, prompt: &str) -> Result<String, String> {
    use futures_util::StreamExt;
    let body = serde_json::json!({"model": "p", "stream": true, "max_tokens": 200, "messages": [{"role": "user", "content": prompt}]});
    let resp = client
        .post(url)
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    if resp.status() != 200 {
        return Err(format!("status {}", resp.status()));
    }
    let mut dec = keel_core::sse::SseDecoder::new();
    let mut events = Vec::new();
    let mut text = String::new();
    let mut done = false;
    let mut stream = resp.bytes_stream();
    while let Some(c) = stream.next().await {
        let c = c.map_err(|e| format!("broken: {e}"))?;
        dec.feed(&c, &mut events)
            .map_err(|e| format!("framing: {e}"))?;
        for ev in events.drain(..) {
            if ev.comment_only {
                continue;
            }
            if ev.data == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value =
                serde_json::from_str(&ev.data).map_err(|_| "malformed".to_owned())?;
            if v.get("error").is_some() {
                return Err("error event".into());
            }
            if let Some(t) = v
                .pointer("/choices/0/delta/content")
                .and_then(|t| t.as_str())
            {
                text.push_str(t);
            }
        }
    }
    if done {
        Ok(text)
    } else {
        Err("no terminal event".into())
    }
}

/// 4 variants; one stalls forever after 10 tokens in 20% of its streams (5% of all requests).
async fn migration(requests: usize, rps: f64) -> Result<(), String> {
    use keel_sim::{FaultKind, FaultSpec};
    println!("keel bench migration: 4 variants (lognormal TTFT median 40 ms, gaps 5 ms), one stalls forever after 10 tokens in 20% of its streams (5% of all); {requests} streamed requests at {rps}/s");
    println!(
        "{:<22} {:>8} {:>10} {:>11} {:>11} {:>13}",
        "contender", "intact", "errors", "total p50", "total p99", "extra tokens"
    );
    let clean = Fleet::start_n(1, ServerConfig::fast("reference"))
        .await
        .map_err(|e| e.to_string())?;
    let client = reqwest::Client::new();
    let prompts: Vec<String> = (0..requests)
        .map(|i| format!("question number {i} about resilient streaming"))
        .collect();
    let mut reference = Vec::new();
    for p in &prompts {
        let v: serde_json::Value = client
            .post(format!("{}/chat/completions", clean.get(0).openai_base()))
            .json(&serde_json::json!({"model": "sim", "max_tokens": 200, "messages": [{"role": "user", "content": p}]}))
            .send().await.map_err(|e| e.to_string())?.json().await.map_err(|e| e.to_string())?;
        reference.push(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
        );
    }
    let reference_tokens: u64 = reference
        .iter()
        .map(|t| keel_core::tokens::count(t) as u64)
        .sum();
    for (name, pool_extra) in [
        ("keel", "stall_ms = 2000"),
        ("keel, no migration", "stall_ms = 2000\nmax_migrations = 0"),
        (
            "round robin",
            "stall_ms = 2000\nmax_migrations = 0\npolicy = \"round_robin\"\nhedge = \"off\"",
        ),
    ] {
        let template = ServerConfig {
            seed: Some(1),
            ttft_ms: 40.0,
            ttft_sigma: 0.3,
            gap_ms: 5.0,
            gap_sigma: 0.2,
            ..Default::default()
        };
        let stalls = |i: usize, s: &mut ServerConfig| {
            if i == 0 {
                let mut f = FaultSpec::new(FaultKind::Stall);
                f.after_tokens = Some(10);
                f.rate = Some(0.2);
                s.faults = vec![f];
            }
        };
        let (fleet, addr, stop) = fleet_and_gateway(template, stalls, pool_extra).await?;
        let url = format!("http://{addr}/v1/chat/completions");
        let start = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rps)).await;
            let (client, url, p, want) =
                (client.clone(), url.clone(), p.clone(), reference[i].clone());
            tasks.push(tokio::spawn(async move {
                let t = std::time::Instant::now();
                let r = stream_text(&client, &url, &p).await;
                (
                    r.map(|text| text == want),
                    t.elapsed().as_secs_f64() * 1000.0,
                )
            }));
        }
        let (mut intact, mut errors, mut lat) = (0, 0, Vec::new());
        for t in tasks {
            if let Ok((r, ms)) = t.await {
                lat.push(ms);
                match r {
                    Ok(true) => intact += 1,
                    Ok(false) => {}
                    Err(_) => errors += 1,
                }
            }
        }
        let _ = stop.send(());
        let sent: u64 = fleet
            .servers
            .iter()
            .map(|s| s.state.stats().tokens_sent)
            .sum();
        lat.sort_by(f64::total_cmp);
        let q = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
        println!(
            "{:<22} {:>7.1}% {:>10} {:>9.0}ms {:>9.0}ms {:>12.1}%",
            name,
            100.0 * intact as f64 / requests as f64,
            errors,
            q(0.5),
            q(0.99),
            100.0 * (sent as f64 - reference_tokens as f64) / reference_tokens as f64
        );
    }
    println!("intact: text byte-identical to the uninterrupted generation, with a terminal event; extra tokens: upstream tokens sent beyond the delivered answers (negative: answers cut short)");
    Ok(())
}
