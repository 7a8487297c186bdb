//! `keel bench overhead --event-subscribers N`: what open dashboards cost the gateway.
//!
//! One `keel serve` process over a zero-latency simulated server. At each rate and mode, every
//! round measures three runs one after the other: straight to the upstream (`direct`), through
//! keel with no dashboard open (`0 pages`), and through keel while N readers of `/keel/events`
//! (simulated dashboards: they read every byte) stay subscribed (`N pages`); keel's two runs
//! swap order every round so both see the same machine state. Figures are medians across rounds
//! of each round's percentiles; "+" is run − direct in µs, and the last row of each group is
//! `N pages − 0 pages`. keel's CPU time per request (user + system, from `/proc`) is the steadier
//! figure on a shared machine.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel_sim::load::LoadReport;
use serde_json::{json, Value};

use super::{
    cpu_plan, http_client, load, measure, median_or_null, mode_name, pin, pinning, row,
    zero_latency_upstream, Options, Run, Target,
};
use crate::keel_process::KeelProcess;

/// N open `/keel/events` readers; dropping it closes them.
struct Pages {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Pages {
    /// Opens `n` readers of `gateway`'s `/keel/events` (`http://host:port`), counting the
    /// snapshots they receive into `events`; fails when keel refuses one.
    async fn open(
        client: &reqwest::Client,
        gateway: &str,
        n: usize,
        events: &Arc<AtomicU64>,
    ) -> Result<Pages, String> {
        let mut tasks = Vec::new();
        for _ in 0..n {
            let mut resp = client
                .get(format!("{gateway}/keel/events"))
                .send()
                .await
                .map_err(|e| format!("/keel/events: {e}"))?;
            if !resp.status().is_success() {
                return Err(format!("/keel/events answered {}", resp.status()));
            }
            let count = events.clone();
            tasks.push(tokio::spawn(async move {
                // Reads like a page: every byte, counting events (each ends with a blank line).
                while let Ok(Some(chunk)) = resp.chunk().await {
                    let n = chunk.windows(2).filter(|w| w == b"\n\n").count();
                    count.fetch_add(n as u64, Ordering::Relaxed);
                }
            }));
        }
        Ok(Pages { tasks })
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn summarize(runs: &[Run]) -> Value {
    let reports: Vec<LoadReport> = runs.iter().map(|r| r.report.clone()).collect();
    let mut v = row(&reports);
    let cpu: Vec<f64> = runs.iter().filter_map(Run::cpu_us_per_request).collect();
    v["cpu_us_per_request"] = median_or_null(cpu);
    v
}

/// One table line: `a − b` in µs for the latency columns; `cpu` as given.
fn line(rps: f64, mode: &str, label: &str, a: &Value, b: &Value, cpu: Option<f64>) -> String {
    let d = |k: &str| (a[k].as_f64().unwrap_or(0.0) - b[k].as_f64().unwrap_or(0.0)) * 1000.0;
    format!(
        "{rps:>6} {mode:<7} {label:<17} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>11} {:>7} {:>8}\n",
        d("ttfb_p50_ms"),
        d("ttfb_p99_ms"),
        d("total_p50_ms"),
        d("total_p99_ms"),
        cpu.map_or("—".into(), |c| format!("{c:.1}")),
        a["errors"],
        a["requests"],
    )
}

const HEADER: &str = " req/s mode    keel with         +ttfb p50 +ttfb p99 +total p50 +total p99 cpu µs/req  errors requests\n";

pub async fn run(o: Options) -> Result<(), String> {
    if o.contenders.iter().any(|c| c != "keel") {
        return Err("--event-subscribers measures keel alone: drop --contenders".into());
    }
    let n = o.event_subscribers;
    let fleet = zero_latency_upstream().await?;
    let (pinned, gw_cpu, bench_cpus) = cpu_plan(o.pin);
    if pinned {
        pin(std::process::id(), &bench_cpus);
    }
    let client = http_client()?;
    let threads = o
        .keel_threads
        .map(|n| format!("worker_threads = {n}\n"))
        .unwrap_or_default();
    let toml = crate::scenario::pool_toml(&fleet, "bench", &o.keel_pool);
    let keel = KeelProcess::spawn(&format!("{threads}{toml}"), None).await?;
    if pinned {
        pin(keel.pid(), &gw_cpu);
    }
    let gateway = format!("http://127.0.0.1:{}", keel.port);
    let target = |name: &str, base: String, model: &str, pid: Option<u32>| Target {
        name: name.into(),
        base,
        model: model.into(),
        endpoint: keel_core::protocol::Endpoint::ChatCompletions,
        headers: Vec::new(),
        pid,
        stop: None,
    };
    let direct = target("direct", fleet.get(0).openai_base(), "sim", None);
    let through = target("keel", format!("{gateway}/v1"), "bench", Some(keel.pid()));
    for t in [&direct, &through] {
        load(&client, t, 50.0, 1.0, true).await;
    }
    let intro = format!(
        "keel bench overhead --event-subscribers {n}: one zero-latency simulated upstream; {}; rates {:?} req/s, {} s × {} rounds\n",
        pinning(pinned, &gw_cpu, "load generator, upstream and pages", &bench_cpus),
        o.rates,
        o.duration,
        o.rounds,
    );
    print!("{intro}{HEADER}");
    let events = Arc::new(AtomicU64::new(0));
    let mut lines = String::new();
    let mut report = Vec::new();
    for stream in [false, true] {
        let mode = mode_name(stream);
        for &rps in &o.rates {
            let (mut d, mut none, mut pages) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..o.rounds {
                d.push(measure(&client, &direct, rps, o.duration, stream).await);
                for with_pages in [round % 2 == 1, round % 2 == 0] {
                    if with_pages {
                        let open = Pages::open(&client, &gateway, n, &events).await?;
                        // Subscribed and past the first (immediate) snapshot before the load.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        pages.push(measure(&client, &through, rps, o.duration, stream).await);
                        drop(open);
                    } else {
                        none.push(measure(&client, &through, rps, o.duration, stream).await);
                    }
                }
            }
            let [d, none, pages] = [&d, &none, &pages].map(|r| summarize(r));
            let cpu = |v: &Value| v["cpu_us_per_request"].as_f64();
            let with = format!("{n} pages");
            let mut text = line(rps, mode, "0 pages", &none, &d, cpu(&none));
            text += &line(rps, mode, &with, &pages, &d, cpu(&pages));
            let cpu_added = cpu(&pages).zip(cpu(&none)).map(|(p, z)| p - z);
            text += &line(
                rps,
                mode,
                &format!("{with} − 0 pages"),
                &pages,
                &none,
                cpu_added,
            );
            print!("{text}");
            lines.push_str(&text);
            report.push(
                json!({"rps": rps, "mode": mode, "direct": d, "no_pages": none, "pages": pages}),
            );
        }
    }
    let tail = format!(
        "snapshots received by the pages: {} (one a second per page)\n",
        events.load(Ordering::Relaxed)
    );
    print!("{tail}");
    drop(keel);
    if let Some(dir) = &o.out {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let doc = json!({"rates": o.rates, "duration_s": o.duration, "rounds": o.rounds,
            "event_subscribers": n, "pinned": pinned, "rows": report});
        let path = dir.join("event-subscribers.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&doc).unwrap_or_default(),
        )
        .map_err(|e| format!("{}: {e}", path.display()))?;
        std::fs::write(
            dir.join("event-subscribers.txt"),
            format!("{intro}{HEADER}{lines}{tail}"),
        )
        .map_err(|e| e.to_string())?;
        println!("written {}", path.display());
    }
    Ok(())
}
