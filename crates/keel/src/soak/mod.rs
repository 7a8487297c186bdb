//! `keel bench soak`: keel under steady load for a long time while variants fail and recover
//! at random, checking that no answer is ever corrupted, truncated or failed while a healthy
//! variant exists, and that the gateway does not grow.
//!
//! Set-up: a keel-sim fleet of twelve servers in this process, six behind an OpenAI pool and six
//! behind an Anthropic pool, and a real `keel serve` child process over them (so its memory and
//! file descriptors are its own). Open-loop arrivals at `--rps` (each request on its own task at
//! its scheduled time, whatever the gateway does), mixed at random: either pool in its own
//! protocol, 60% streams, 24/48/96 max tokens. Meanwhile [`schedule`] puts random faults on
//! random variants (stall, die mid-stream, 500/503 bursts, 429 storms with retry-after, slowness,
//! restart) for a few seconds each, never more than a third of a pool at once. Everything is
//! drawn from `--seed`, so a seed reproduces a run's requests and faults (timing on a loaded
//! machine does not reproduce exactly, which is the point of a soak).
//!
//! Every answer is compared byte for byte with the simulator's reference text (see [`client`]
//! for the verdicts). Goals, each failing the command (nonzero exit) when missed:
//! - no lost or duplicated text, no silent truncation, no client-visible error;
//! - open file descriptors other than established connections: growth after warm-up ≤
//!   max(10%, [`FD_SLACK`] descriptors). Connections (from the soak's client, to the
//!   simulators) follow the requests in flight and the pools' idle timeouts, so they are
//!   counted apart and reported; a leaked socket shows up half-closed among the others;
//! - no upstream generation still open once every answer is in (an attempt the gateway
//!   abandoned, say after a migration, must have been cancelled).
//!
//! Resident memory (VmRSS) growth after warm-up has the goal < 10%, but fails the command only
//! for runs of [`RSS_JUDGED_FROM`] or longer: in a one-minute run the allocator is still
//! settling (arenas, connection pools and health windows fill up over the first minutes), so
//! the short run in the test command reports it without judging it.
//!
//! "Start" and "end" figures are medians of the samples (every few seconds) over the window
//! right after the warm-up (the first 10% of the run, at least 10 s, at most 3 min) and over the
//! same length at the end of the arrivals, so one sample taken during a burst of connections
//! does not decide the verdict.

mod client;
mod report;
mod schedule;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::time::Instant;

use keel_core::protocol::Protocol;
use keel_sim::{Fleet, FleetConfig, ServerConfig};

use crate::keel_process::KeelProcess;
use client::Verdict;
use report::{Report, Sample};

/// Growth of open descriptors tolerated whatever the percentage.
pub const FD_SLACK: u64 = 16;
/// Shortest run whose memory growth is judged.
pub const RSS_JUDGED_FROM: Duration = Duration::from_secs(300);
const VARIANTS_PER_POOL: usize = 6;
const POOLS: [(&str, Protocol); 2] = [
    ("soak-chat", Protocol::OpenAi),
    ("soak-messages", Protocol::Anthropic),
];

/// What to run.
pub struct Options {
    pub duration: Duration,
    pub rps: f64,
    pub seed: u64,
    pub out: PathBuf,
}

/// Parses `30m`, `60s`, `1h`, `90` (seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let secs = match unit {
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("`{s}`: a duration such as 60s, 30m or 1h expected")),
    };
    n.trim()
        .parse::<f64>()
        .ok()
        .filter(|x| *x > 0.0 && x.is_finite())
        .map(|x| Duration::from_secs_f64(x * secs))
        .ok_or(format!("`{s}`: a positive duration expected"))
}

/// The fleet: servers `[p × 6, (p + 1) × 6)` serve pool `p`, slightly jittery, at 40 tokens/s.
/// Not faster: the simulators share this process and the machine with the gateway, and on a
/// loaded machine scheduling delays of 10 ms or more are common. With 8 ms gaps those delays
/// made healthy variants look 40% slower than their baseline, so the gateway's slowness
/// detection migrated streams around the fleet for nothing (see bench/history/2026-11-30-fuzzing-soak-safeguards.md); with
/// 25 ms gaps the soak measures the injected faults, not the scheduler.
async fn start_fleet(seed: u64) -> Result<Fleet, String> {
    let servers = (0..POOLS.len() * VARIANTS_PER_POOL)
        .map(|i| ServerConfig {
            name: format!(
                "{}-{}",
                POOLS[i / VARIANTS_PER_POOL].0,
                i % VARIANTS_PER_POOL
            ),
            seed: Some(seed.wrapping_mul(100) + i as u64),
            ttft_ms: 40.0,
            ttft_sigma: 0.3,
            gap_ms: 25.0,
            gap_sigma: 0.2,
            ..Default::default()
        })
        .collect();
    Fleet::start(&FleetConfig {
        servers,
        ..Default::default()
    })
    .await
    .map_err(|e| format!("cannot start the fleet: {e}"))
}

/// The gateway's resident set, open descriptors, and how many of those are established
/// connections: accepted on its `port` (from the soak's client) and to the `upstream` ports
/// (the simulated servers); `None` once the process is gone. Every loopback socket of the
/// machine is in /proc/net/tcp; the soak's own client and the simulators are in this process,
/// so a socket whose local port is the gateway's, or whose remote port is a simulator's, is the
/// gateway's.
fn sample(pid: u32, port: u16, upstream: &[u16], t_s: f64) -> Option<Sample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kib = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    let port_of = |addr: &str| {
        addr.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    let (mut client_conns, mut upstream_conns) = (0, 0);
    for line in std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
    {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 || f[3] != "01" {
            continue;
        }
        if port_of(f[1]) == Some(port) {
            client_conns += 1;
        } else if port_of(f[2]).is_some_and(|p| upstream.contains(&p)) {
            upstream_conns += 1;
        }
    }
    Some(Sample {
        t_s,
        rss_kib,
        fds,
        client_conns,
        upstream_conns,
    })
}

/// Seconds of warm-up before the "start" resource figures: the first 10% of the run, at least
/// 10 s, at most 3 min.
pub(crate) fn warmup_s(duration: Duration) -> f64 {
    (0.1 * duration.as_secs_f64()).clamp(10.0, 180.0)
}

/// Decision records the gateway keeps: as many as the warm-up makes, so that the ring (about
/// 1.7 KiB a record, bounded by `decisions_kept`) is full before the start figures and the RSS
/// goal measures growth beyond bounded state (with the default 10,000, a 5-minute run at 20
/// req/s judged the ring's fill: bench/history/2026-12-01-overhead-stops-6-11.md).
fn decisions_kept(o: &Options) -> usize {
    ((warmup_s(o.duration) * o.rps) as usize).max(100)
}

/// Runs the soak; `Err` when a goal is missed (after writing the report) or it cannot run.
pub async fn run(o: Options) -> Result<(), String> {
    let duration_ms = o.duration.as_millis() as u64;
    let fleet = start_fleet(o.seed).await?;
    let top = format!("decisions_kept = {}\n", decisions_kept(&o));
    let toml: String = std::iter::once(top)
        .chain(POOLS.iter().enumerate().map(|(p, (name, protocol))| {
            let servers = &fleet.servers[p * VARIANTS_PER_POOL..(p + 1) * VARIANTS_PER_POOL];
            crate::scenario::pool_toml_of(servers, *protocol, name, "")
        }))
        .collect();
    std::fs::create_dir_all(&o.out).map_err(|e| format!("{}: {e}", o.out.display()))?;
    let log_path = o.out.join("gateway.log");
    let log =
        std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let mut gateway = KeelProcess::spawn(&toml, Some(log)).await?;
    let pid = gateway.pid();
    let port = gateway.port;
    let base = format!("http://127.0.0.1:{port}");
    let windows = schedule::generate(o.seed, duration_ms, &[VARIANTS_PER_POOL; POOLS.len()]);
    let n = (o.duration.as_secs_f64() * o.rps).round() as usize;
    eprintln!(
        "keel bench soak: {} s at {} req/s ({n} requests), {} faults, seed {}, gateway pid {pid}",
        o.duration.as_secs(),
        o.rps,
        windows.len(),
        o.seed
    );
    let start = Instant::now();

    // Faults come and go on schedule.
    let servers: Vec<_> = fleet.servers.iter().map(|s| s.state.clone()).collect();
    let faults = tokio::spawn({
        let steps = schedule::steps(&windows);
        let servers = servers.clone();
        async move {
            for s in steps {
                tokio::time::sleep_until(start + Duration::from_millis(s.at_ms)).await;
                let server = &servers[s.pool * VARIANTS_PER_POOL + s.variant];
                server.clear_faults();
                for f in s.faults {
                    server.add_fault(f);
                }
            }
        }
    });

    // The gateway's memory and descriptors every few seconds.
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let interval = if o.duration < RSS_JUDGED_FROM { 2 } else { 5 };
    let sim_ports: Vec<u16> = fleet.servers.iter().map(|s| s.addr.port()).collect();
    let sampler = tokio::spawn({
        let (samples, sim_ports) = (samples.clone(), sim_ports.clone());
        async move {
            let mut tick = tokio::time::interval(Duration::from_secs(interval));
            loop {
                tick.tick().await;
                let Some(s) = sample(pid, port, &sim_ports, start.elapsed().as_secs_f64()) else {
                    return;
                };
                lock(&samples).push(s);
            }
        }
    });

    // Open-loop arrivals.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .map_err(|e| e.to_string())?;
    let generator = keel_sim::text::Generator::new("default", Default::default());
    let names: Vec<&str> = POOLS.iter().map(|p| p.0).collect();
    let seen: Arc<Mutex<Vec<(client::Planned, client::Seen)>>> = Arc::default();
    let mut tasks = Vec::with_capacity(n);
    let progress_every = (n / 10).max(1);
    // How late each request left: a starved machine shows here first.
    let mut lag_us = Vec::with_capacity(n);
    for i in 0..n {
        let due = start + Duration::from_secs_f64(i as f64 / o.rps);
        tokio::time::sleep_until(due).await;
        lag_us.push(due.elapsed().as_micros() as u64);
        if i % progress_every == 0 && i > 0 {
            progress(&seen, i, samples.clone());
        }
        let p = client::plan(o.seed, i, &names, &generator);
        let (client, base, seen) = (client.clone(), base.clone(), seen.clone());
        tasks.push(tokio::spawn(async move {
            let s = client::send(&client, &base, &p).await;
            lock(&seen).push((p, s));
        }));
    }
    let arrivals_s = start.elapsed().as_secs_f64();
    for t in tasks {
        let _ = t.await;
    }
    faults.abort();
    for s in &servers {
        s.clear_faults();
    }
    // Every answer is in: no upstream generation may still be open (a stalled attempt the
    // gateway migrated away from must have been cancelled). Probes may be in flight briefly.
    let mut open_upstream = 0;
    for _ in 0..50 {
        open_upstream = servers
            .iter()
            .map(|s| (s.stats().running + s.stats().waiting).max(0) as u64)
            .sum();
        if open_upstream == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drained = sample(pid, port, &sim_ports, start.elapsed().as_secs_f64());
    sampler.abort();
    let exited = gateway.exited();
    drop(gateway);

    let seen = std::mem::take(&mut *lock(&seen));
    let samples = std::mem::take(&mut *lock(&samples));
    let report = Report::build(
        &o,
        &windows,
        &seen,
        report::Resources {
            samples,
            drained,
            open_upstream,
            arrivals_s,
            exited,
            dispatch_lag_ms: percentiles_ms(lag_us.into_iter())?,
        },
    )?;
    report.write(&o.out)?;
    print!("{}", report.table());
    eprintln!(
        "written {}/soak.json, soak.md and gateway.log",
        o.out.display()
    );
    let failed = report.failed_goals();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("soak: goals not met: {}", failed.join("; ")))
    }
}

fn progress(
    seen: &Mutex<Vec<(client::Planned, client::Seen)>>,
    sent: usize,
    samples: Arc<Mutex<Vec<Sample>>>,
) {
    let seen = lock(seen);
    let bad = seen
        .iter()
        .filter(|(_, s)| s.verdict != Verdict::Intact)
        .count();
    let last = lock(&samples).last().cloned();
    eprintln!(
        "  sent {sent}, answered {}, not intact {bad}{}",
        seen.len(),
        last.map(|s| format!(
            ", gateway {:.1} MiB, {} fds",
            s.rss_kib as f64 / 1024.0,
            s.fds
        ))
        .unwrap_or_default()
    );
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Nothing holding these locks can leave the data half-written.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Latency percentiles (ms) of a set of answers.
fn percentiles_ms(us: impl Iterator<Item = u64>) -> Result<[f64; 3], String> {
    let mut h =
        Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).map_err(|e| e.to_string())?;
    for v in us {
        let _ = h.record(v.max(1));
    }
    if h.is_empty() {
        return Ok([0.0; 3]);
    }
    Ok([0.5, 0.99, 1.0].map(|q| h.value_at_quantile(q) as f64 / 1000.0))
}
