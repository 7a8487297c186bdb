//! `keel bench`: the benchmarks. Gateway overhead lives in `overhead`, the seed scenarios in
//! `scenario`; here are the command line, one routing decision, live selection against round
//! robin, and mid-stream migration.

use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;

use keel_gateway::Config;
use keel_sim::load::LoadConfig;
use keel_sim::{Fleet, ServerConfig};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Latency each gateway adds over a direct call (streaming and not) at fixed rates, its
    /// highest sustainable rate and its peak memory.
    Overhead {
        /// Fixed request rates (open loop), comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "500,1000,2000")]
        rates: Vec<f64>,
        /// Seconds per measured round.
        #[arg(long, default_value_t = 5.0)]
        duration: f64,
        /// Rounds per rate and mode (alternating direct / gateway), and of the ramp to the
        /// highest sustainable rate (alternating contenders; the median is reported, with each
        /// peer's ratio to keel round by round).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Gateways to measure: keel, nginx, litellm, portkey (peers via bench/peers/*.sh), and
        /// hyper: the floor, a plain proxy on keel's HTTP stack (`keel bench plain-proxy`).
        #[arg(long, value_delimiter = ',', default_value = "keel")]
        contenders: Vec<String>,
        /// Directory for overhead.json and overhead.txt.
        #[arg(long)]
        out: Option<PathBuf>,
        /// keel's runtime worker threads (`worker_threads` in keel.toml); default: one when the
        /// gateway is pinned to one core (as nginx runs one worker process), else one per core.
        #[arg(long)]
        keel_threads: Option<usize>,
        /// Extra lines for keel's pool table, e.g. "assemble_non_streaming = false".
        #[arg(long, default_value = "")]
        keel_pool: String,
        /// Extra top-level lines for keel's config, e.g. "client_write_timeout_ms = 0" (to
        /// compare keel with a setting and without it, run by run).
        #[arg(long, default_value = "")]
        keel_top: String,
        /// The user message every request sends (default: a short question), e.g. one that
        /// holds values a guarded pool masks.
        #[arg(long)]
        prompt: Option<String>,
        /// Skip the ramp that finds each gateway's highest sustainable rate.
        #[arg(long)]
        no_max_rate: bool,
        /// Do not pin the gateway and the load generator to separate cores.
        #[arg(long)]
        no_pin: bool,
        /// Cross-protocol streams against same-protocol ones, keel only: an OpenAI client served
        /// by an Anthropic-protocol upstream and the reverse, beside the same-protocol runs, in
        /// alternating rounds: added latency and keel's CPU per streamed token. No ramp.
        #[arg(long)]
        translated: bool,
        /// keel with N readers of `/keel/events` open (simulated dashboards) against none, in
        /// alternating rounds: what open dashboards cost. keel only; no ramp.
        #[arg(long, default_value_t = 0)]
        event_subscribers: usize,
        /// Hold this many concurrent slow streams (a token every 100 ms, 10 s each) through each
        /// contender, e.g. `--streams 1000,5000`: resident memory, CPU share and the added
        /// inter-token gap. No ramp.
        #[arg(long, value_delimiter = ',')]
        streams: Vec<usize>,
        /// Throughput at tail-latency bounds: per contender and mode, the highest rate of the
        /// ramp whose added P99 stays under 1, 5 and 10 ms; writes bounds.svg (added P99 against
        /// offered rate) with --out.
        #[arg(long)]
        tail_bounds: bool,
        /// One client, one connection, each request sent when the last answer has been read
        /// (a closed loop), direct and through each contender in alternating rounds: added
        /// P50/P90/P99 and the requests per second one client completes. No ramp.
        #[arg(long)]
        sequential: bool,
        /// Run N busy loops on the gateway's core (every core with --no-pin) for the whole run,
        /// as a compile or a noisy neighbour would: how each gateway's latency holds up when it
        /// shares its CPU. Works with every mode.
        #[arg(long, default_value_t = 0)]
        contend: usize,
    },
    /// Duration of one routing decision (stage 1) over an N-variant pool: P50/P99/P99.9.
    Decision {
        /// Variants in the pool selection chooses from.
        #[arg(long, default_value_t = 16)]
        variants: usize,
        /// Decisions timed.
        #[arg(long, default_value_t = 200_000)]
        iterations: usize,
    },
    /// Draws `bounds.svg` (added P99 against offered rate) again from a `bounds.json` that
    /// `bench overhead --tail-bounds` wrote, e.g. one kept under bench/data.
    PlotBounds {
        /// The saved bounds.json.
        json: PathBuf,
        /// Where to write the SVG (default: bounds.svg beside the JSON).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// The floor contender of `bench overhead` (`--contenders hyper`): a plain reverse proxy on
    /// keel's HTTP stack (tokio, hyper's server and pooled client) and nothing else, round robin
    /// over `upstreams`. Runs until killed.
    #[command(hide = true)]
    PlainProxy {
        /// The loopback port to listen on.
        #[arg(long)]
        port: u16,
        /// The runtime's worker threads (as keel's `worker_threads`).
        #[arg(long)]
        threads: Option<usize>,
        /// Upstream base URLs (`http://host:port/...`; the path is the client's).
        #[arg(required = true)]
        upstreams: Vec<String>,
    },
    /// A seed scenario from bench/scenarios (or `all`): `keel bench heavy-tail [--quick]
    /// [--duration S] [--seed N] [--out DIR] [--contenders keel,nginx]`.
    #[command(external_subcommand)]
    Scenario(Vec<String>),
    /// Mid-stream stalls: keel vs keel without migration vs plain round robin.
    Migration {
        /// Streamed requests per contender and run.
        #[arg(long, default_value_t = 400)]
        requests: usize,
        /// Arrival rate (open loop).
        #[arg(long, default_value_t = 40.0)]
        rps: f64,
        /// Runs per contender (seeds in a row); the table shows medians and their spread.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
        repeat: u64,
    },
    /// Steady load on a two-pool simulated fleet while random faults come and go, against a
    /// `keel serve` child process: every answer checked byte for byte, memory and descriptors
    /// watched. Exits nonzero when a goal is missed.
    Soak {
        /// How long arrivals last: 60s, 30m, 1h.
        #[arg(long, default_value = "30m", value_parser = crate::soak::parse_duration)]
        duration: Duration,
        /// Arrival rate (open loop), both pools together.
        #[arg(long, default_value_t = 20.0)]
        rps: f64,
        /// The run's random seed (arrivals and faults).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Directory for soak.json, soak.md and gateway.log.
        #[arg(long, default_value = "bench/out/soak")]
        out: PathBuf,
    },
    /// The guard's PII and secret detectors on the labelled data set: precision and recall per
    /// entity and throughput, beside Presidio's analyzer when `--presidio-python` is given.
    Guard {
        /// The data set (JSON Lines, as bench/data/guard/generate.py writes it).
        #[arg(long, default_value = "bench/data/guard/texts.jsonl")]
        data: PathBuf,
        /// A Python with presidio-analyzer installed: runs bench/scripts/guard_presidio.py on the
        /// same texts for the side-by-side columns.
        #[arg(long)]
        presidio_python: Option<PathBuf>,
        /// List every text where keel's findings and the labels disagree.
        #[arg(long)]
        misses: bool,
    },
    /// Repeated deterministic requests through the response cache: upstream requests saved,
    /// hit rate with normalization off and `syntax`, TTFT of hits and misses.
    Cache {
        /// Requests sent in each configuration.
        #[arg(long, default_value_t = 400)]
        requests: usize,
        /// Share of requests that repeat an earlier question (most with a trivial formatting
        /// difference).
        #[arg(long, default_value_t = 0.4)]
        repeat_share: f64,
        /// Requests in flight at once.
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Seed of the questions and their repeats.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// `keel analyze` against ground truth: three synthetic workloads through keel twice (cache
    /// off for the log, then on as recommended), predicted vs measured hit rate and upstream
    /// requests saved; and the analysis's throughput and peak memory on a synthetic log.
    Analyze {
        /// Requests per workload shape.
        #[arg(long, default_value_t = 300)]
        requests: usize,
        /// Requests in flight at once.
        #[arg(long, default_value_t = 4)]
        concurrency: usize,
        /// Seed of the workloads.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Size of the synthetic log for the throughput measure, in MB (0: skip it).
        #[arg(long, default_value_t = 200)]
        log_mb: u64,
        /// Give the second run's caches this TTL (instead of the recommended one) and send a
        /// group of requests every 40 ms in both runs, so that entries expire during the run.
        #[arg(long)]
        ttl_ms: Option<u64>,
        /// Where the logs and reports go.
        #[arg(long, default_value = "target/bench-analyze")]
        out: std::path::PathBuf,
    },
    /// keel's live selection vs plain round robin on a fleet with one degraded variant.
    Routing {
        /// Arrival rate (open loop).
        #[arg(long, default_value_t = 100.0)]
        rps: f64,
        /// Seconds of arrivals per run.
        #[arg(long, default_value_t = 20.0)]
        duration: f64,
        /// First seed (fleet and arrivals); runs take the seeds after it.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Runs per policy (seeds in a row, policies alternating); the table shows medians and
        /// their spread.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
        repeat: u64,
    },
}

pub async fn run(cmd: BenchCommand) -> Result<(), String> {
    match cmd {
        BenchCommand::Overhead {
            rates,
            duration,
            rounds,
            contenders,
            out,
            keel_threads,
            keel_pool,
            keel_top,
            prompt,
            no_max_rate,
            no_pin,
            translated,
            event_subscribers,
            streams,
            tail_bounds,
            sequential,
            contend,
        } => {
            crate::overhead::run(crate::overhead::Options {
                rates,
                duration,
                rounds: rounds.max(1),
                contenders,
                keel_threads,
                keel_pool,
                keel_top,
                prompt,
                max_rate: !no_max_rate,
                pin: !no_pin,
                out,
                translated,
                event_subscribers,
                streams,
                tail_bounds,
                sequential,
                contend,
            })
            .await
        }
        BenchCommand::Decision {
            variants,
            iterations,
        } => decision(variants.max(2), iterations.max(1000)),
        BenchCommand::PlotBounds { json, out } => {
            let text =
                std::fs::read_to_string(&json).map_err(|e| format!("{}: {e}", json.display()))?;
            let svg = crate::overhead::bounds::replot(&text)
                .map_err(|e| format!("{}: {e}", json.display()))?;
            let out = out.unwrap_or_else(|| json.with_file_name("bounds.svg"));
            std::fs::write(&out, svg).map_err(|e| format!("{}: {e}", out.display()))?;
            println!("written {}", out.display());
            Ok(())
        }
        BenchCommand::PlainProxy {
            port, upstreams, ..
        } => crate::overhead::plain_proxy::serve(port, &upstreams).await,
        BenchCommand::Routing {
            rps,
            duration,
            seed,
            repeat,
        } => routing(rps, duration, seed, repeat).await,
        BenchCommand::Migration {
            requests,
            rps,
            repeat,
        } => migration(requests, rps, repeat).await,
        BenchCommand::Soak {
            duration,
            rps,
            seed,
            out,
        } => {
            if !(rps > 0.0 && rps.is_finite()) {
                return Err("--rps must be a positive number".into());
            }
            crate::soak::run(crate::soak::Options {
                duration,
                rps,
                seed,
                out,
            })
            .await
        }
        BenchCommand::Scenario(args) => scenario_args(args).await,
        BenchCommand::Analyze {
            requests,
            concurrency,
            seed,
            log_mb,
            ttl_ms,
            out,
        } => analyze(requests, concurrency, seed, log_mb, ttl_ms, &out).await,
        BenchCommand::Guard {
            data,
            presidio_python,
            misses,
        } => crate::guard_bench::run(crate::guard_bench::Options {
            data,
            presidio_python,
            misses,
        }),
        BenchCommand::Cache {
            requests,
            repeat_share,
            concurrency,
            seed,
        } => {
            if !(0.0..1.0).contains(&repeat_share) {
                return Err("--repeat-share must be at least 0 and below 1".into());
            }
            crate::scenario::cache::run(requests.max(1), repeat_share, concurrency, seed).await
        }
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

/// `keel bench <scenario|all|FILE.toml> [options]`: the seed scenarios side by side with peers.
#[derive(clap::Parser, Debug)]
#[command(
    name = "keel bench <scenario|all|FILE.toml>",
    about = "Seed scenarios from bench/scenarios (or your own file) with every contender against an identical fleet and arrivals"
)]
pub(crate) struct ScenarioArgs {
    /// A scenario name from bench/scenarios, `canary-rollback` (keel only), `all`, or a scenario file.
    scenario: String,
    /// A few seconds per scenario (a smoke run).
    #[arg(long)]
    quick: bool,
    /// Seconds per run (replaces the scenario's own).
    #[arg(long, value_parser = positive)]
    duration: Option<f64>,
    /// Requests per second (replaces the scenario's own).
    #[arg(long, value_parser = positive)]
    rps: Option<f64>,
    /// Runs per contender (seeds in a row); figures are medians, with the spread of the P99s.
    /// Default 3 (1 with --quick).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: Option<u32>,
    /// First seed (fleet and arrivals).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output directory (Markdown, JSON, SVG).
    #[arg(long, default_value = "bench/out")]
    out: PathBuf,
    /// Comma-separated: keel, keel-rr (keel with round robin, no affinity), nginx, litellm,
    /// portkey; `keel:LINES` is keel with extra pool lines (`;`-separated), e.g.
    /// `keel:max_hedges = 1` or `keel:hedge = "off"`.
    #[arg(long, value_delimiter = ',', default_value = "keel,nginx")]
    contenders: Vec<String>,
}

fn positive(v: &str) -> Result<f64, String> {
    v.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && *x > 0.0)
        .ok_or_else(|| format!("a positive number expected, got `{v}`"))
}

/// Parses the scenario form's arguments (with `--help`) and runs it.
async fn scenario_args(args: Vec<String>) -> Result<(), String> {
    use clap::Parser;
    let parsed =
        match ScenarioArgs::try_parse_from(std::iter::once("keel bench".to_owned()).chain(args)) {
            Ok(a) => a,
            Err(e) if !e.use_stderr() => {
                // --help: print and succeed.
                print!("{e}");
                return Ok(());
            }
            Err(e) => return Err(e.to_string()),
        };
    let o = crate::scenario::RunOptions {
        contenders: parsed.contenders,
        quick: parsed.quick,
        duration: parsed.duration,
        rps: parsed.rps,
        repeat: parsed.repeat.unwrap_or(if parsed.quick { 1 } else { 3 }) as usize,
        seed: parsed.seed,
        out: parsed.out,
    };
    crate::scenario::run(&parsed.scenario, &o).await
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
    let mut cfg =
        Config::parse(&toml, "<bench>", &Default::default()).map_err(|e| e.to_string())?;
    cfg.log.access = keel_gateway::config::AccessLogTarget::Off;
    let gw = keel_gateway::Gateway::new(cfg);
    let pool = gw.pool("bench").ok_or("pool missing")?.clone();
    let mut rng = keel_core::rng::Rng::new(3);
    for _ in 0..64 {
        for i in 0..variants {
            pool.record_attempt(
                i,
                rng.next_f64() > 0.02,
                Some(rng.lognormal(80.0 + i as f64 * 3.0, 0.3)),
                None,
            );
            pool.record_stream(i, &[10.0, 11.0, 9.0, 12.0, 10.0].into_iter().collect());
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
        let (sel, rec) = keel_gateway::pipeline::selection::select(
            &pool,
            &req,
            keel_gateway::pipeline::selection::Controls::default(),
            "bench",
        );
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

/// Rows of figures by contender over repeated runs, printed as medians with their spread.
struct Repeated {
    columns: &'static [&'static str],
    rows: Vec<(String, Vec<Vec<f64>>)>,
}

impl Repeated {
    fn new(columns: &'static [&'static str]) -> Self {
        Repeated {
            columns,
            rows: Vec::new(),
        }
    }

    /// Adds one run's figures for `contender`.
    fn add(&mut self, contender: &str, figures: Vec<f64>) {
        match self.rows.iter_mut().find(|r| r.0 == contender) {
            Some(r) => r.1.push(figures),
            None => self.rows.push((contender.to_owned(), vec![figures])),
        }
    }

    /// A Markdown table: each cell the median over runs, with lowest–highest when several.
    fn table(&self) -> String {
        let mut t = format!("| contender | {} |\n|---|", self.columns.join(" | "));
        t.push_str(&"---|".repeat(self.columns.len()));
        t.push('\n');
        for (name, runs) in &self.rows {
            t.push_str(&format!("| {name} |"));
            for c in 0..self.columns.len() {
                let mut v: Vec<f64> = runs.iter().map(|r| r[c]).collect();
                v.sort_by(f64::total_cmp);
                let median = v[v.len() / 2];
                let cell = if v.len() > 1 {
                    format!(" {median:.1} ({:.1}–{:.1}) |", v[0], v[v.len() - 1])
                } else {
                    format!(" {median:.1} |")
                };
                t.push_str(&cell);
            }
            t.push('\n');
        }
        t
    }
}

/// 4 variants with heavy-tailed latency, one of them degraded (errors and slowness): keel's
/// live selection against plain round robin, same fleet settings, same arrival sequence.
async fn routing(rps: f64, duration: f64, seed: u64, repeat: u64) -> Result<(), String> {
    use keel_sim::{FaultKind, FaultSpec};
    println!("keel bench routing: 4 variants (lognormal TTFT median 60 ms, 2% tail ×10), one degraded (30% 503, 4× slower); {rps} req/s for {duration} s, streaming, client without retries; medians of {repeat} run(s) per policy (lowest–highest in brackets)\n");
    let mut table = Repeated::new(&[
        "TTFT p50 (ms)",
        "TTFT p90 (ms)",
        "TTFT p99 (ms)",
        "total p50 (ms)",
        "total p99 (ms)",
        "errors (%)",
        "degraded variant's share (%)",
    ]);
    for run in 0..repeat {
        for policy in ["p2c", "round_robin"] {
            let template = ServerConfig {
                seed: Some(seed + run),
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
            eprintln!("  run {}/{repeat}: {policy}", run + 1);
            let r = keel_sim::load::run(c).await;
            let _ = stop.send(());
            let total: u64 = fleet.servers.iter().map(|s| s.state.stats().requests).sum();
            let degraded_share =
                fleet.servers[0].state.stats().requests as f64 / total.max(1) as f64;
            table.add(
                policy,
                vec![
                    r.ttft.p50_ms,
                    r.ttft.p90_ms,
                    r.ttft.p99_ms,
                    r.total.p50_ms,
                    r.total.p99_ms,
                    100.0 * r.errors as f64 / r.sent.max(1) as f64,
                    100.0 * degraded_share,
                ],
            );
        }
    }
    println!("{}", table.table());
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
async fn migration(requests: usize, rps: f64, repeat: u64) -> Result<(), String> {
    use keel_sim::{FaultKind, FaultSpec};
    println!("keel bench migration: 4 variants (lognormal TTFT median 40 ms, gaps 5 ms), one stalls forever after 10 tokens in 20% of its streams (5% of all); {requests} streamed requests at {rps}/s; medians of {repeat} run(s) (lowest–highest in brackets)\n");
    let mut table = Repeated::new(&[
        "intact (%)",
        "errors",
        "total p50 (ms)",
        "total p99 (ms)",
        "extra tokens (%)",
    ]);
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
    for (run, (name, pool_extra)) in (0..repeat).flat_map(|run| {
        [
            ("keel", "stall_ms = 2000"),
            ("keel, no migration", "stall_ms = 2000\nmax_migrations = 0"),
            (
                "round robin",
                "stall_ms = 2000\nmax_migrations = 0\npolicy = \"round_robin\"\nhedge = \"off\"",
            ),
        ]
        .map(|c| (run, c))
    }) {
        eprintln!("  run {}/{repeat}: {name}", run + 1);
        let template = ServerConfig {
            seed: Some(1 + run),
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
        table.add(
            name,
            vec![
                100.0 * intact as f64 / requests as f64,
                errors as f64,
                q(0.5),
                q(0.99),
                100.0 * (sent as f64 - reference_tokens as f64) / reference_tokens as f64,
            ],
        );
    }
    println!("{}", table.table());
    println!("intact: text byte-identical to the uninterrupted generation, with a terminal event; extra tokens: upstream tokens sent beyond the delivered answers (negative: answers cut short)");
    Ok(())
}

/// `keel bench analyze`: the ground-truth table, then the throughput on a synthetic log.
async fn analyze(
    requests: usize,
    concurrency: usize,
    seed: u64,
    log_mb: u64,
    ttl_ms: Option<u64>,
    out: &std::path::Path,
) -> Result<(), String> {
    use crate::analyze::truth;
    let sending = truth::Sending {
        concurrency,
        pace: match ttl_ms {
            Some(_) => std::time::Duration::from_millis(40),
            None => std::time::Duration::ZERO,
        },
    };
    println!(
        "keel bench analyze: {requests} requests per shape, {concurrency} at a time, through keel twice (cache off for the log, then on as recommended)\n"
    );
    let rows =
        truth::ground_truth(requests.max(1), sending, seed, &out.join("truth"), ttl_ms).await?;
    print!("{}", truth::table(&rows));
    println!(
        "\nreport of the first run: {}",
        out.join("truth/report.html").display()
    );
    if log_mb > 0 {
        let dir = out.join("throughput");
        let (mb, rate, rss) = tokio::task::spawn_blocking(move || truth::throughput(log_mb, &dir))
            .await
            .map_err(|e| e.to_string())??;
        println!(
            "\nthroughput: {mb:.0} MB of synthetic access log analyzed at {rate:.0} MB/s; peak RSS {}",
            rss.map_or("unknown".into(), |kb| format!("{:.0} MB", kb as f64 / 1024.0))
        );
    }
    if rows.iter().all(truth::Row::passes) {
        Ok(())
    } else {
        Err(
            "a prediction missed its goal (±5 points of hit rate, ±5% of upstream requests saved)"
                .into(),
        )
    }
}
