//! `keel bench overhead --sequential`: one client, one connection, each request sent as soon as
//! the previous answer has been read (a closed loop), straight to the upstream and through each
//! gateway in alternating rounds. This is how a single caller — a script, a test suite, an
//! agent's tool loop — sees a gateway: the machine stays awake between requests (unlike an open
//! loop at 10 req/s, where every request wakes sleeping cores and nginx itself adds about a
//! millisecond), so what is left is the gateway's own path. Reports the added P50/P90/P99 of
//! the whole request and the requests per second one client completes.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{json, Value};

use super::{
    cpu_plan, median, mode_name, pin, pinning, prepare, start_target, stop_target, write_rows,
    zero_latency_upstream, Options, Target,
};

/// One round's latencies (µs) and how many requests it completed per second.
struct Round {
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    rps: f64,
    errors: u64,
}

/// Requests back to back on one connection for `secs`.
async fn round(client: &reqwest::Client, t: &Target, stream: bool, secs: f64) -> Round {
    let body = json!({"model": t.model, "max_tokens": 16, "stream": stream,
        "messages": [{"role": "user", "content": "say hi"}]});
    let url = format!("{}/chat/completions", t.base);
    let mut hist = Histogram::<u64>::new(3).expect("a histogram");
    let (mut done, mut errors) = (0u64, 0u64);
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(secs);
    while Instant::now() < until {
        let t0 = Instant::now();
        let mut req = client.post(&url).json(&body);
        for (k, v) in &t.headers {
            req = req.header(k, v);
        }
        let ok = match req.send().await {
            Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
            Ok(r) => {
                let _ = r.bytes().await;
                false
            }
            Err(_) => false,
        };
        if ok {
            let _ = hist.record(t0.elapsed().as_micros() as u64);
            done += 1;
        } else {
            errors += 1;
        }
    }
    let q = |p: f64| hist.value_at_quantile(p) as f64;
    Round {
        p50_us: q(0.50),
        p90_us: q(0.90),
        p99_us: q(0.99),
        rps: done as f64 / start.elapsed().as_secs_f64(),
        errors,
    }
}

const HEADER: &str =
    "contender mode    +p50 µs  +p90 µs  +p99 µs   req/s one client (direct)   errors\n";

pub async fn run(o: Options) -> Result<(), String> {
    let fleet = zero_latency_upstream().await?;
    let peers_dir = o
        .out
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("keel-bench-sequential"));
    let (pinned, gw_cpu, bench_cpus) = cpu_plan(o.pin);
    if pinned {
        pin(std::process::id(), &bench_cpus);
    }
    // One connection: the client never opens a second while the first is idle.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| e.to_string())?;
    let direct = Target::direct(&fleet);
    let intro = format!(
        "keel bench overhead --sequential: one client, one connection, closed loop; one zero-latency simulated upstream; {}; {} s × {} rounds, alternating direct and gateway\n",
        pinning(pinned, &gw_cpu, "client and upstream", &bench_cpus),
        o.duration,
        o.rounds,
    );
    print!("{intro}{HEADER}");
    let (mut lines, mut rows) = (String::new(), Vec::new());
    for name in &o.contenders {
        let Some(mut target) = start_target(name, &fleet, &o, &peers_dir, &mut lines).await? else {
            continue;
        };
        prepare(&client, &direct, &target, pinned.then_some(gw_cpu.as_str())).await;
        for stream in [false, true] {
            let (mut d, mut g) = (Vec::new(), Vec::new());
            for _ in 0..o.rounds {
                d.push(round(&client, &direct, stream, o.duration).await);
                g.push(round(&client, &target, stream, o.duration).await);
            }
            let m = |rs: &[Round], f: fn(&Round) -> f64| median(rs.iter().map(f).collect());
            let added = |f: fn(&Round) -> f64| m(&g, f) - m(&d, f);
            let errors: u64 = g.iter().map(|r| r.errors).sum();
            let mode = mode_name(stream);
            let line = format!(
                "{name:<9} {mode:<7} {:>7.0} {:>8.0} {:>8.0} {:>10.0} ({:>6.0}) {:>12}\n",
                added(|r| r.p50_us),
                added(|r| r.p90_us),
                added(|r| r.p99_us),
                m(&g, |r| r.rps),
                m(&d, |r| r.rps),
                errors
            );
            print!("{line}");
            lines.push_str(&line);
            let side = |rs: &[Round]| -> Value {
                json!({"p50_us": m(rs, |r| r.p50_us), "p90_us": m(rs, |r| r.p90_us),
                    "p99_us": m(rs, |r| r.p99_us), "rps": m(rs, |r| r.rps)})
            };
            rows.push(json!({"contender": name, "mode": mode, "direct": side(&d),
                "gateway": side(&g), "errors": errors,
                "added_us": {"p50": added(|r| r.p50_us), "p90": added(|r| r.p90_us), "p99": added(|r| r.p99_us)}}));
        }
        stop_target(&mut target);
    }
    if let Some(dir) = &o.out {
        let text = format!("{intro}{HEADER}{lines}");
        let path = write_rows(dir, "sequential", &o, pinned, rows, &text)?;
        println!("written {} and sequential.txt", path.display());
    }
    Ok(())
}
