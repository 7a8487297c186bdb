//! The `keel` command: `serve`, `check`, `demo`, `sim`, `sim load`, `analyze`, `bench`.
// The one exception, with its reasoning, is in allocator.rs (an option of the allocator).
#![deny(unsafe_code)]

mod allocator;

mod analyze;
mod bench;
#[cfg(test)]
mod command_table;
mod demo;
mod guard_bench;
mod keel_process;
mod overhead;
mod scenario;
mod soak;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};

use keel_gateway::config::LogFormat;
use keel_gateway::{Config, Gateway};

#[derive(Parser)]
#[command(
    name = "keel",
    version,
    about = "LLM inference routing and resilience layer",
    after_help = "Start with `keel demo`: a simulated fleet and the gateway on 127.0.0.1:8080, no API key."
)]
struct Cli {
    /// What to do; without one, keel prints this help.
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        /// The config file (TOML: listen address, pools and their variants, keys); `keel check`
        /// validates it without serving. SIGHUP re-reads it.
        #[arg(long, default_value = "keel.toml")]
        config: String,
        /// Overrides `listen` from the config.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// `json` or `text`: the access log and keel's own log lines (overrides `[log] format`).
        #[arg(long, value_parser = parse_log_format)]
        log_format: Option<LogFormat>,
    },
    /// Validate a config file and print precise errors and warnings.
    Check {
        /// The config file to validate (as `keel serve --config` would read it): every error
        /// at once, as `file:line:column: field: what was expected`; exit 1 on any error.
        #[arg(long, default_value = "keel.toml")]
        config: String,
    },
    /// Start a simulated fleet and the gateway in front of it, send sample requests, keep serving.
    Demo(demo::DemoArgs),
    /// Start simulated model servers (or, with `load`, drive load at one).
    Sim(SimArgs),
    /// Virtual keys: `keel keys new` prints a fresh key and its `[[keys]]` entry.
    Keys {
        /// The keys command.
        #[command(subcommand)]
        which: KeysCommand,
    },
    /// What the cache and normalization would save: reads access logs, writes an HTML report,
    /// a JSON document and a summary.
    Analyze(analyze::AnalyzeArgs),
    /// Benchmarks: gateway overhead, routing, migration, cache, soak and the seed scenarios.
    Bench {
        /// The benchmark to run.
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Print a fresh high-entropy key and a `[[keys]]` snippet holding only its SHA-256 hash.
    New {
        /// The key's id (a name for metrics, logs and the admin endpoint).
        #[arg(long, default_value = "my-app")]
        id: String,
    },
}

#[derive(Args)]
struct SimArgs {
    /// `load`: drive load at a gateway or server instead of starting servers.
    #[command(subcommand)]
    load: Option<SimSub>,
    /// Number of identical default servers (ignored with --config).
    #[arg(long, default_value_t = 3)]
    servers: usize,
    /// A fleet description (TOML).
    #[arg(long)]
    config: Option<PathBuf>,
    /// First port; servers take consecutive ports (0 = any free ports).
    #[arg(long, default_value_t = 0)]
    base_port: u16,
}

#[derive(Subcommand)]
enum SimSub {
    /// Open-loop load against a base URL.
    Load(LoadArgs),
}

#[derive(Args)]
struct LoadArgs {
    /// Base URL as an SDK takes it (e.g. http://127.0.0.1:8080/v1, or http://127.0.0.1:8080 for Anthropic).
    #[arg(long)]
    url: String,
    /// The model name each request sends (a pool name or alias when the URL is keel's).
    #[arg(long)]
    model: String,
    /// Requests started per second (open loop: arrivals do not wait for answers).
    #[arg(long, default_value_t = 10.0)]
    rps: f64,
    /// Seconds of arrivals.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Streamed requests (`"stream": true`); the report then has time to first token.
    #[arg(long)]
    stream: bool,
    /// `chat`, `completions` or `messages`.
    #[arg(long, default_value = "chat")]
    endpoint: String,
    /// At most this many requests in flight; an arrival past it waits (default: no limit).
    #[arg(long)]
    concurrency_limit: Option<usize>,
    /// `max_tokens` of each request.
    #[arg(long, default_value_t = 32)]
    max_tokens: u64,
    /// Prompts of this many words (generated text, `--prompts` of them in rotation), instead
    /// of one short line: what a gateway's work on a realistic prompt costs (parsing,
    /// normalizing, counting).
    #[arg(long)]
    prompt_words: Option<usize>,
    /// How many different prompts of `--prompt-words` words take turns: a gateway that keeps
    /// what it learned of a prompt (keel's token counts) meets each again after this many
    /// requests; as many as the requests sent makes every prompt new.
    #[arg(long, default_value_t = 16, requires = "prompt_words")]
    prompts: u64,
    /// The seed of the first of the `--prompts` (each has its own): runs with seeds far apart
    /// send prompts the other never sent.
    #[arg(long, default_value_t = 0, requires = "prompt_words")]
    prompt_seed: u64,
    /// Seconds one request may take to its last byte before it is abandoned and counted as a
    /// `timeout` error.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// HTTP/1.1 only, over https:// too (where ALPN would choose HTTP/2).
    #[arg(long)]
    http1: bool,
    /// A PEM CA bundle to trust besides the system's roots (an https:// gateway whose
    /// certificate a private CA signed).
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// `--log-format`.
pub fn parse_log_format(s: &str) -> Result<LogFormat, String> {
    LogFormat::parse(s).ok_or_else(|| format!("expected `json` or `text`, got `{s}`"))
}

/// keel's own log lines (not the access log, which the gateway writes itself): on stdout, as
/// JSON objects or text, coloured only when stdout is a terminal; written by the log writer's
/// thread like the access log (`keel_gateway::observe::log_writer`), so that a stdout nobody reads never
/// stalls a request.
fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("KEEL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| keel_gateway::observe::log_writer::Stdout)
        .with_target(false);
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder
            .with_ansi(std::io::stdout().is_terminal())
            .try_init(),
    };
}

fn main() -> ExitCode {
    allocator::tune();
    let cli = Cli::parse();
    // `keel` alone is a question, not a mistake: the help, and success.
    let Some(command) = cli.command else {
        let _ = Cli::command().print_help();
        return ExitCode::SUCCESS;
    };
    keel_gateway::install_crypto();
    // `serve` reads its config first: it may set the runtime's worker threads.
    let mut serve_cfg = None;
    if let Command::Serve {
        config,
        listen,
        log_format,
    } = &command
    {
        match Config::load(config) {
            Ok(mut c) => {
                if let Some(l) = listen {
                    c.listen = *l;
                }
                if let Some(f) = log_format {
                    c.log.format = *f;
                }
                serve_cfg = Some(c);
            }
            Err(e) => {
                eprintln!("keel: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    let threads = match &command {
        Command::Bench {
            which: bench::BenchCommand::PlainProxy { threads, .. },
        } => *threads,
        _ => serve_cfg.as_ref().and_then(|c| c.worker_threads),
    };
    if let Some(n) = threads {
        builder.worker_threads(n);
    }
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("keel: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        let result = match command {
            Command::Serve {
                config,
                listen,
                log_format,
            } => match serve_cfg {
                Some(cfg) => {
                    // A reload re-reads the file with the same command-line overrides.
                    let source = keel_gateway::admin::live::ConfigSource {
                        path: PathBuf::from(config),
                        adjust: Box::new(move |c: &mut Config| {
                            if let Some(l) = listen {
                                c.listen = l;
                            }
                            if let Some(f) = log_format {
                                c.log.format = f;
                            }
                        }),
                    };
                    // On a worker, not on this (the main) thread: the accept loop spawns each
                    // connection's task, and a task spawned from outside the workers is handed
                    // to one through the shared queue with a wake-up, one more thread switch
                    // for every new connection.
                    tokio::spawn(serve(cfg, source))
                        .await
                        .unwrap_or_else(|e| Err(format!("the server task failed: {e}")))
                }
                None => Err("no configuration".into()),
            },
            Command::Check { config } => check(&config),
            Command::Demo(args) => demo::run(args).await,
            Command::Keys {
                which: KeysCommand::New { id },
            } => new_key(&id),
            Command::Sim(args) => sim(args).await,
            Command::Analyze(args) => tokio::task::spawn_blocking(move || analyze::run(args))
                .await
                .unwrap_or_else(|e| Err(format!("the analysis failed: {e}"))),
            Command::Bench { which } => {
                // The in-process gateways log (access lines included) only when asked to.
                if std::env::var_os("KEEL_LOG").is_some() {
                    init_tracing(LogFormat::Text);
                }
                bench::run(which).await
            }
        };
        // Log lines still queued (see `log_writer`) go out before exit.
        let _ = tokio::task::spawn_blocking(|| {
            keel_gateway::observe::log_writer::flush(std::time::Duration::from_secs(2))
        })
        .await;
        result
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("keel: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `keel keys new`: the secret once (keel keeps only its hash) and the config entry.
fn new_key(id: &str) -> Result<(), String> {
    let secret = keel_gateway::state::keys::new_secret()?;
    let hash =
        keel_gateway::state::keys::hash_text(&keel_gateway::state::keys::hash_secret(&secret));
    println!("# The key (give it to the client; keel stores only its hash, so keep it now):");
    println!("# {secret}");
    println!();
    println!("[[keys]]");
    println!("id = {id:?}");
    println!("hash = \"{hash}\"");
    println!("tenant = {id:?}");
    println!("# pools = [\"...\"]   # default: every pool");
    println!("# rpm = 600");
    println!("# tpm = 200000");
    println!("# max_concurrency = 16");
    println!("# daily_spend_usd = 10.0");
    println!("# priority = \"normal\"   # high | normal | low");
    Ok(())
}

/// Prints every problem in the file (one per line, `file:line:column: field: what`), or a summary.
fn check(path: &str) -> Result<(), String> {
    let cfg = match Config::load(path) {
        Ok(cfg) => cfg,
        Err(e) => {
            for issue in &e.issues {
                eprintln!("{issue}");
            }
            let n = e.issues.len();
            return Err(format!(
                "{path}: {n} error{}",
                if n == 1 { "" } else { "s" }
            ));
        }
    };
    for w in &cfg.warnings {
        println!("warning: {w}");
    }
    let variants: usize = cfg.pools.iter().map(|p| p.variants.len()).sum();
    println!(
        "{path}: ok ({} pools, {variants} variants, listen {})",
        cfg.pools.len(),
        cfg.listen
    );
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Reloads the config on every SIGHUP (the outcome is logged and counted by the reload).
fn reload_on_sighup(live: &std::sync::Arc<keel_gateway::admin::live::Live>) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            tracing::warn!("cannot listen for SIGHUP: reload through POST /keel/admin/reload");
            return;
        };
        let live = std::sync::Arc::downgrade(live);
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                let Some(live) = live.upgrade() else { return };
                tracing::info!("SIGHUP: reloading the config");
                let _ = tokio::task::spawn_blocking(move || live.reload()).await;
            }
        });
    }
    #[cfg(not(unix))]
    let _ = live;
}

async fn serve(cfg: Config, source: keel_gateway::admin::live::ConfigSource) -> Result<(), String> {
    init_tracing(cfg.log.format);
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
    // An access log that cannot be written is a configuration error: say so before starting.
    keel_gateway::observe::access_log::AccessLog::open(&cfg.log).map_err(|e| e.to_string())?;
    let listener = keel_gateway::http::server::listen(cfg.listen, cfg.listen_backlog)
        .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let live = keel_gateway::admin::live::Live::new(Gateway::new(cfg), Some(source));
    reload_on_sighup(&live);
    tracing::info!(%addr, pools = live.current().pools().len(), "keel listening");
    println!("keel listening on http://{addr}");
    let served =
        keel_gateway::http::server::serve_live(live.clone(), listener, shutdown_signal()).await;
    // Spans still queued go out before exit (blocking: off the async workers).
    let gw = live.current();
    let _ = tokio::task::spawn_blocking(move || gw.telemetry.flush()).await;
    served.map_err(|e| e.to_string())
}

async fn sim(args: SimArgs) -> Result<(), String> {
    if let Some(SimSub::Load(l)) = args.load {
        return load(l).await;
    }
    init_tracing(LogFormat::Text);
    let mut cfg = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| format!("{}: cannot read: {e}", p.display()))?;
            keel_sim::FleetConfig::from_toml(&text, &p.display().to_string())
                .map_err(|e| e.to_string())?
        }
        None => keel_sim::FleetConfig::uniform(args.servers.max(1)),
    };
    if args.base_port != 0 {
        let mut port = args.base_port;
        let expanded = cfg.expanded();
        for s in &mut cfg.servers {
            s.port = 0;
        }
        cfg.servers = expanded
            .into_iter()
            .map(|mut s| {
                s.port = port;
                port = port.saturating_add(1);
                s
            })
            .collect();
    }
    let started = std::time::Instant::now();
    let fleet = keel_sim::Fleet::start(&cfg)
        .await
        .map_err(|e| format!("cannot start the fleet: {e}"))?;
    println!(
        "keel-sim: {} servers up in {:.0} ms",
        fleet.servers.len(),
        started.elapsed().as_secs_f64() * 1000.0
    );
    for s in &fleet.servers {
        println!(
            "  {:<12} openai {}   anthropic {}   faults http://{}/sim/faults",
            s.name,
            s.openai_base(),
            s.anthropic_base(),
            s.addr
        );
        let base = s.anthropic_base();
        println!(
            "  {:<12} azure {base}   gemini {base}   vertex {base} (AnthropicVertex {base}/v1, token {base}/token)   bedrock {base}   responses {}",
            "", s.openai_base()
        );
    }
    shutdown_signal().await;
    Ok(())
}

async fn load(l: LoadArgs) -> Result<(), String> {
    let endpoint = match l.endpoint.as_str() {
        "chat" => keel_core::protocol::Endpoint::ChatCompletions,
        "completions" => keel_core::protocol::Endpoint::Completions,
        "messages" => keel_core::protocol::Endpoint::Messages,
        other => {
            return Err(format!(
                "--endpoint: expected chat, completions or messages, got `{other}`"
            ))
        }
    };
    if !(l.rps > 0.0 && l.rps.is_finite()) {
        return Err("--rps must be a positive number".into());
    }
    if !(l.timeout > 0.0 && l.timeout.is_finite()) {
        return Err("--timeout must be a positive number of seconds".into());
    }
    let mut cfg = keel_sim::load::LoadConfig::new(&l.url, &l.model);
    cfg.endpoint = endpoint;
    cfg.rps = l.rps;
    cfg.duration = Duration::from_secs_f64(l.duration.max(0.0));
    cfg.stream = l.stream;
    cfg.concurrency_limit = l.concurrency_limit;
    cfg.max_tokens = l.max_tokens;
    if let Some(words) = l.prompt_words {
        cfg.prompts = (l.prompt_seed..l.prompt_seed.saturating_add(l.prompts.max(1)))
            .map(|seed| keel_sim::load::prompt_of_words(words, seed))
            .collect();
    }
    cfg.request_timeout = Duration::from_secs_f64(l.timeout);
    cfg.http1_only = l.http1;
    if let Some(p) = &l.ca_file {
        cfg.ca_pem = Some(std::fs::read(p).map_err(|e| format!("--ca-file {}: {e}", p.display()))?);
    }
    let report = keel_sim::load::run(cfg).await;
    print!("{}", report.table());
    if let Some(p) = l.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
        println!("report written to {}", p.display());
    }
    Ok(())
}
