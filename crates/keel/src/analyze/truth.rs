//! The analysis against ground truth (`keel bench analyze`): synthetic workloads of known
//! shape go through a real in-process gateway over keel-sim twice. The first run has the cache
//! off and `fingerprint = true`: its access log is analyzed. The second has each pool's cache
//! on as the analysis recommends (the recommended TTL, `syntax` normalization where
//! recommended; the 5-minute default where nothing is recommended): the measured hit rate (the
//! answers marked `x-keel-cache: hit`) and upstream requests saved (the simulated servers'
//! request counts, run one minus run two) are set beside the predicted ones.
//!
//! Three shapes, one pool each (one simulated server each, so upstream requests count per pool):
//! - `templated`: eight templates with few values each, so requests repeat; a fifth of them
//!   written with a doubled space (what `syntax` normalization merges); temperature 0;
//! - `chat`: every prompt unique (nothing to save), temperature 0;
//! - `mixed`: forty questions asked over and over, half at temperature 0 and half at 0.9 (only
//!   the first are cacheable).

use std::path::{Path, PathBuf};

use serde_json::json;

use keel_core::analyze::report::{share, Analyzer, PoolReport};
use keel_core::rng::Rng;
use keel_sim::{Fleet, ServerConfig};

/// The workload shapes (pool names).
pub const SHAPES: [&str; 3] = ["templated", "chat", "mixed"];

/// Words of the unique chat prompts.
const VOCABULARY: [&str; 24] = [
    "why", "how", "does", "the", "river", "moon", "bread", "rise", "glacier", "melt", "bees",
    "dance", "tides", "turn", "salt", "taste", "volcano", "sleep", "clouds", "form", "light",
    "bend", "stars", "burn",
];

/// One request of a workload: pool, prompt, temperature.
type Ask = (&'static str, String, f64);

/// The three shapes interleaved, `per_shape` requests each.
pub fn workload(per_shape: usize, seed: u64) -> Vec<Ask> {
    let mut rng = Rng::new(seed);
    let names = ["Alice", "Bob", "Carol", "Dmitri"];
    let templates = [
        "Summarize order {n} for customer {name}.",
        "Translate ticket {n} from {name} into French.",
        "What is the refund status of order {n}? Customer: {name}",
        "Write a two-line reply to {name} about invoice {n}.",
        "Classify the complaint {n} sent by {name}.",
        "List three next steps for case {n} owned by {name}.",
        "Give {name} a one-sentence update on shipment {n}.",
        "Draft a polite reminder to {name} about payment {n}.",
    ];
    let mut out = Vec::with_capacity(per_shape * 3);
    for i in 0..per_shape {
        let t = templates[(rng.next_u64() % templates.len() as u64) as usize];
        let text = t
            .replace("{n}", &(100 + rng.next_u64() % 3).to_string())
            .replace("{name}", names[(rng.next_u64() % 2) as usize]);
        let text = if rng.next_f64() < 0.2 {
            text.replacen(' ', "  ", 1)
        } else {
            text
        };
        out.push(("templated", text, 0.0));
        let words: Vec<&str> = (0..6 + rng.next_u64() % 6)
            .map(|_| VOCABULARY[(rng.next_u64() % VOCABULARY.len() as u64) as usize])
            .collect();
        out.push(("chat", format!("{} ({seed}-{i})?", words.join(" ")), 0.0));
        let q = rng.next_u64() % 40;
        let temperature = if rng.next_f64() < 0.5 { 0.0 } else { 0.9 };
        out.push((
            "mixed",
            format!("Question {q}: explain it briefly."),
            temperature,
        ));
    }
    out
}

/// What one run measured per pool: upstream requests and answers marked as hits.
#[derive(Debug, Default, Clone, Copy)]
struct Measured {
    upstream: u64,
    hits: u64,
    requests: u64,
}

/// One shape's comparison.
#[derive(Debug, Clone)]
pub struct Row {
    pub shape: &'static str,
    pub requests: u64,
    pub config: String,
    pub predicted_hit_rate: f64,
    pub measured_hit_rate: f64,
    pub predicted_saved: u64,
    pub measured_saved: i64,
}

impl Row {
    /// Within ±5 points of hit rate, and ±5% of requests saved (one request at least: a
    /// workload that saves nothing must be predicted to save nothing).
    pub fn passes(&self) -> bool {
        let saved_ok = (self.predicted_saved as f64 - self.measured_saved as f64).abs()
            <= (0.05 * self.measured_saved.abs() as f64).max(1.0);
        (self.predicted_hit_rate - self.measured_hit_rate).abs() <= 0.05 && saved_ok
    }
}

/// The gateway config over `fleet` (server `i` serves pool `SHAPES[i]`), `extra[i]` in pool
/// `i`'s table, the access log at `log` when given.
fn config(fleet: &Fleet, extra: &[String], log: Option<&Path>) -> String {
    let access = log.map_or("off".to_owned(), |p| p.display().to_string());
    let mut toml = format!("[log]\naccess = {access:?}\n\n");
    for (i, shape) in SHAPES.iter().enumerate() {
        toml.push_str(&format!(
            "[[pools]]\nname = \"{shape}\"\nfingerprint = true\nhedge = \"off\"\n{}\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n[[pools.variants]]\nname = \"{shape}-sim\"\nurl = \"{}\"\nprotocol = \"openai\"\nupstream_model = \"sim\"\nprice_input_per_mtok = 1.0\nprice_output_per_mtok = 4.0\n\n",
            extra[i],
            fleet.servers[i].openai_base()
        ));
    }
    toml
}

/// Runs the workload through a fresh gateway and fleet, `concurrency` requests at a time.
/// How a run sends its requests: `concurrency` at a time, each group `pace` after the one
/// before at the earliest (zero: as soon as the group before is answered). A fixed pace gives
/// both runs the same arrival times, for a TTL that expires during the run.
#[derive(Debug, Clone, Copy)]
pub struct Sending {
    pub concurrency: usize,
    pub pace: std::time::Duration,
}

async fn run_once(
    work: &[Ask],
    extra: &[String],
    log: Option<&Path>,
    sending: Sending,
) -> Result<Vec<Measured>, String> {
    let concurrency = sending.concurrency;
    let fleet = Fleet::start_n(SHAPES.len(), ServerConfig::fast("sim"))
        .await
        .map_err(|e| e.to_string())?;
    let toml = config(&fleet, extra, log);
    let cfg = keel_gateway::Config::parse(&toml, "<bench analyze>", &Default::default())
        .map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let gw = keel_gateway::Gateway::new(cfg);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(keel_gateway::http::server::serve(
        gw,
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    let url = format!("http://{addr}/v1/chat/completions");
    let client = keel_sim::http_client();
    let mut measured = vec![Measured::default(); SHAPES.len()];
    let start = tokio::time::Instant::now();
    for (k, chunk) in work.chunks(concurrency.max(1)).enumerate() {
        tokio::time::sleep_until(start + sending.pace * k as u32).await;
        let tasks: Vec<_> = chunk
            .iter()
            .map(|(pool, text, temperature)| {
                let body = json!({"model": pool, "temperature": temperature, "max_tokens": 12,
                    "messages": [{"role": "user", "content": text}]});
                let (client, url) = (client.clone(), url.clone());
                tokio::spawn(async move {
                    let r = client
                        .post(&url)
                        .json(&body)
                        .send()
                        .await
                        .map_err(|e| e.to_string())?;
                    let hit = r.headers().get("x-keel-cache").is_some_and(|v| v == "hit");
                    let status = r.status();
                    r.bytes().await.map_err(|e| e.to_string())?;
                    if status != 200 {
                        return Err(format!("status {status}"));
                    }
                    Ok::<bool, String>(hit)
                })
            })
            .collect();
        for ((pool, _, _), t) in chunk.iter().zip(tasks) {
            let hit = t.await.map_err(|e| e.to_string())??;
            let i = SHAPES.iter().position(|s| s == pool).unwrap_or(0);
            measured[i].requests += 1;
            measured[i].hits += u64::from(hit);
        }
    }
    for (i, m) in measured.iter_mut().enumerate() {
        m.upstream = fleet.servers[i].state.stats().requests;
    }
    drop(stop);
    Ok(measured)
}

/// The pool lines of the cache the analysis recommends for `p`, and the predicted hits.
fn recommended(report: &keel_core::analyze::report::Report, p: &PoolReport) -> (String, u64) {
    let rec = |kind: &str| {
        report
            .recommendations
            .iter()
            .find(|r| r.pool == p.pool && r.kind == kind)
    };
    let ttl = rec("cache").and_then(|r| r.ttl_ms).unwrap_or(300_000);
    let normalize = rec("normalize").is_some();
    let ti = keel_core::analyze::report::TTL_CANDIDATES_MS
        .iter()
        .position(|t| *t == ttl)
        .unwrap_or(1);
    let predicted = p
        .by_scenario
        .get(1 + ti * 2 + usize::from(normalize))
        .map_or(0, |s| s.hits);
    let lines = format!(
        "{}[pools.cache]\nttl_ms = {ttl}\n",
        if normalize {
            "normalize = \"syntax\"\n"
        } else {
            ""
        }
    );
    (lines, predicted)
}

/// The ground-truth comparison: `per_shape` requests per shape, sent as `sending` says; the log
/// and the report go to `dir`. With `ttl_ms`, the second run gives every pool's cache that TTL
/// (no normalization) and the prediction is the replay with that TTL, the pools' own policy.
pub async fn ground_truth(
    per_shape: usize,
    sending: Sending,
    seed: u64,
    dir: &Path,
    ttl_ms: Option<u64>,
) -> Result<Vec<Row>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let log = dir.join("access.log");
    let _ = std::fs::remove_file(&log);
    let work = workload(per_shape, seed);
    let off = vec![String::new(); SHAPES.len()];
    let first = run_once(&work, &off, Some(&log), sending).await?;
    let flushed = tokio::task::spawn_blocking(|| {
        keel_gateway::observe::log_writer::flush(std::time::Duration::from_secs(5))
    })
    .await;
    if flushed.is_err() {
        return Err("the access log could not be flushed".into());
    }
    let mut opts = keel_core::analyze::report::Options::default();
    if let Some(ttl) = ttl_ms {
        for shape in SHAPES {
            let policy = keel_core::analyze::report::PoolPolicy {
                ttl_ms: ttl,
                cache_on: true,
                ..Default::default()
            };
            opts.pools.insert(shape.to_owned(), policy);
        }
    }
    let mut analyzer = Analyzer::new(opts);
    let logs = vec![log.clone()];
    let reading = super::read_logs(&logs, &super::logs::Filter::default(), &mut analyzer)?;
    let report = analyzer.finish();
    super::write_outputs(dir, &report, &reading, &[log.display().to_string()])?;
    let mut extra = Vec::new();
    let mut predicted = Vec::new();
    for shape in SHAPES {
        let p = report
            .pools
            .iter()
            .find(|p| p.pool == shape)
            .ok_or_else(|| format!("no `{shape}` lines in the access log"))?;
        let (lines, hits) = match ttl_ms {
            Some(ttl) => (
                format!("[pools.cache]\nttl_ms = {ttl}\n"),
                p.figures.simulated.hits,
            ),
            None => recommended(&report, p),
        };
        extra.push(lines);
        predicted.push((p.figures.requests, hits));
    }
    let second = run_once(&work, &extra, None, sending).await?;
    Ok(SHAPES
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let (requests, hits) = predicted[i];
            Row {
                shape,
                requests,
                config: extra[i].trim().replace('\n', "; "),
                predicted_hit_rate: share(hits, requests),
                measured_hit_rate: share(second[i].hits, second[i].requests),
                predicted_saved: hits,
                measured_saved: first[i].upstream as i64 - second[i].upstream as i64,
            }
        })
        .collect())
}

/// The table for bench/RESULTS.md.
pub fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| shape | requests | second run's pool config | hit rate predicted | measured | upstream saved predicted | measured | within goal |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | `{}` | {:.1}% | {:.1}% | {} | {} | {} |\n",
            r.shape,
            r.requests,
            r.config,
            r.predicted_hit_rate * 100.0,
            r.measured_hit_rate * 100.0,
            r.predicted_saved,
            r.measured_saved,
            if r.passes() { "yes" } else { "NO" }
        ));
    }
    s
}

/// Analysis throughput on a synthetic log of `mb` megabytes written to `dir`: MB/s and the
/// process's peak resident memory (VmHWM) after the analysis.
pub fn throughput(mb: u64, dir: &Path) -> Result<(f64, f64, Option<u64>), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path: PathBuf = dir.join("synthetic.log");
    {
        let f = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        super::logs::synthetic(&mut w, mb * 1_000_000, 7).map_err(|e| e.to_string())?;
        std::io::Write::flush(&mut w).map_err(|e| e.to_string())?;
    }
    let mut analyzer = Analyzer::new(Default::default());
    let reading = super::read_logs(
        std::slice::from_ref(&path),
        &super::logs::Filter::default(),
        &mut analyzer,
    )?;
    let started = std::time::Instant::now();
    let report = analyzer.finish();
    let seconds = reading.seconds + started.elapsed().as_secs_f64();
    super::write_outputs(dir, &report, &reading, &[path.display().to_string()])?;
    let _ = std::fs::remove_file(&path);
    let mb_read = reading.bytes as f64 / 1e6;
    Ok((mb_read, mb_read / seconds.max(1e-9), peak_rss_kb()))
}

/// The process's peak resident set (kB), where /proc tells it.
fn peak_rss_kb() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
