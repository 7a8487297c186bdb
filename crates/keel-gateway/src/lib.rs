//! keel-gateway: the IO shell around keel-core. It reads requests, drives the four stages in
//! order, and performs what they decide. Modules in the order a request travels:
//!
//! ```text
//! client ─▶ server ─▶ admission ─▶ selection ─▶ execution ──────────────▶ delivery ─▶ client
//!                     (context)                 attempt, settlement       relay (after the
//!                                                                         first byte), body,
//!                                                                         access_log
//! ```
//!
//! [`server`] accepts connections ([`connection`] serves each) and routes each request to [`server::handle_generation`],
//! which calls the stages in that order. Every upstream attempt, whichever stage starts it,
//! enters its variant and is settled through [`settlement`]; one on a variant of the other
//! protocol than the client's is translated at the attempt's boundary ([`translation`]). State that outlives a request:
//! [`pools`] (live variant state), [`capacity`] (learned limits, the wait line), [`monitor`]
//! (probes, warm-ups, scrapes), [`metrics`] (this gateway's registry).
#![forbid(unsafe_code)]

pub mod access_log;
pub mod admission;
pub mod attempt;
pub mod body;
pub mod cache;
pub mod canary;
pub mod capacity;
pub mod client_write;
pub mod config;
pub mod conn_limit;
pub mod connection;
pub mod consensus;
pub mod context;
pub mod context_fit;
pub mod decision_candidates;
pub mod decisions;
pub mod delivery;
pub mod errors;
pub mod events;
pub mod execution;
#[doc(hidden)]
pub mod fuzzing;
pub mod graceful;
pub mod guard;
pub mod guard_stream;
pub mod h2_head;
pub mod hooks;
pub mod keys;
pub mod live;
pub mod log_writer;
pub mod metrics;
pub mod monitor;
pub mod openapi;
pub mod per_thread;
pub mod pools;
pub mod prompt_work;
pub mod quota;
pub mod relay;
pub mod request_id;
pub mod responses;
pub mod retry_budget;
pub mod rollout_api;
pub mod routes;
pub mod safe_mode;
pub mod selection;
pub mod server;
pub mod settlement;
pub mod shadow;
pub mod signals;
pub mod telemetry;
pub mod tls;
pub mod translation;
pub mod upstream;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

pub use body::{full_body, Body};
pub use config::Config;
use pools::{Pool, UpstreamLimits};
use selection::DecisionRecord;

/// The running gateway's shared state: one *generation* of the config. A reload (see [`live`])
/// builds the next generation and carries over what outlives one (metrics, decisions, quota,
/// events, hooks, telemetry, the process's drain state, the live state of unchanged variants);
/// requests keep the generation they started on.
pub struct Gateway {
    pub cfg: Config,
    pools: Vec<Arc<Pool>>,
    by_name: HashMap<String, usize>,
    budget: retry_budget::ShardedBudget,
    /// Origin of `now_ms`: the core's clock is milliseconds since the gateway started.
    epoch: Instant,
    /// The most recent decision records (`GET /keel/decisions`).
    decisions: Arc<decisions::DecisionLog>,
    /// This gateway's metrics registry.
    pub metrics: Arc<metrics::Metrics>,
    /// Faults injected inside keel (tests only; see `hooks`).
    pub hooks: Arc<hooks::TestHooks>,
    /// Virtual keys (`[[keys]]`).
    pub keys: keys::Keys,
    /// Where the keys' limits and budgets are kept.
    pub quota: Arc<quota::Store>,
    /// `[log] access`: one line per request.
    pub access_log: Arc<access_log::AccessLog>,
    /// `[telemetry]`: the OTLP trace exporter, when configured.
    pub telemetry: Arc<telemetry::Telemetry>,
    /// The dashboard's snapshot stream (`/keel/events`).
    pub events: Arc<events::Hub>,
    /// The process around the generations: draining, the reload handle (see `live`).
    pub process: Arc<live::Process>,
    /// 1 for the first config, one more for each reload.
    pub generation: u64,
    /// The response cache (`[pools.cache]`, `[cache]`); kept across a reload that changes
    /// neither `[cache]` nor `[redis]`.
    pub cache: Arc<cache::ResponseCache>,
}

impl Gateway {
    pub fn new(cfg: Config) -> Arc<Gateway> {
        Gateway::build(cfg, None)
    }

    /// A generation of `cfg`; `prev`: the generation it replaces on a reload, whose lasting
    /// state it carries over (see `live::carry`).
    pub(crate) fn build(cfg: Config, prev: Option<&Gateway>) -> Arc<Gateway> {
        // One clock for every generation: variant state carried over holds times on it.
        let epoch = prev.map_or_else(Instant::now, |g| g.epoch);
        let mut by_name = HashMap::new();
        let mut pools = Vec::new();
        let metrics = prev.map_or_else(metrics::Metrics::new, |g| g.metrics.clone());
        let limits = UpstreamLimits {
            max_body_bytes: cfg.max_upstream_body_bytes,
            max_event_bytes: cfg.max_sse_event_bytes,
        };
        for (i, p) in cfg.pools.iter().enumerate() {
            by_name.insert(p.name.clone(), i);
            for a in &p.aliases {
                by_name.insert(a.clone(), i);
            }
            let old = prev.and_then(|g| g.pools.iter().find(|o| o.cfg.name == p.name));
            pools.push(live::carry::pool(old, p, limits, || {
                Pool::new(
                    p.clone(),
                    upstream::client(
                        p.timeouts.connect_ms,
                        metrics.counter(
                            "keel_upstream_connections_opened_total",
                            &[("pool", &p.name)],
                        ),
                        &|variant| {
                            metrics.counter(
                                "keel_upstream_token_fetches_total",
                                &[("pool", &p.name), ("variant", variant)],
                            )
                        },
                        &|variant| {
                            Some(metrics.gauge(
                                "keel_upstream_connections",
                                &[("pool", &p.name), ("variant", variant)],
                            ))
                        },
                        &p.variants,
                    ),
                    epoch,
                    metrics.clone(),
                    limits,
                )
            }));
        }
        if cfg.keys.is_empty() {
            tracing::info!(
                "no [[keys]] configured: keel runs open (any client, no per-key limits)"
            );
        } else {
            tracing::info!(
                keys = cfg.keys.len(),
                "virtual keys configured: requests need a key"
            );
        }
        // The connection is made lazily: a Redis that is down at startup is the fail mode's
        // business per request, not a reason to refuse to start. Only a URL the client library
        // rejects (config validation accepts only `redis://`) ends here.
        let carried = live::carry::Lasting::from(prev, &cfg);
        let quota = carried.quota.unwrap_or_else(|| {
            let quota = quota::Store::from_config(cfg.redis.as_ref(), metrics.clone()).unwrap_or_else(|e| {
                tracing::error!(error = %e.0, "[redis] unusable: quota state stays in this process (limits are per replica)");
                quota::Store::Local(quota::local::Local::default())
            });
            if cfg.redis.is_some() && matches!(quota, quota::Store::Redis(_)) {
                tracing::info!("quota state (limits, budgets, in-flight slots) shared through Redis");
            }
            Arc::new(quota)
        });
        // A destination that cannot be opened is reported; `keel serve` checks it before
        // starting and a reload before swapping (see `access_log::AccessLog::open`), so this
        // only falls back in embedders.
        let access_log = carried.access_log.unwrap_or_else(|| {
            Arc::new(access_log::AccessLog::open(&cfg.log).unwrap_or_else(|e| {
                tracing::error!(error = %e, "access log unusable: writing it to stderr");
                access_log::AccessLog::open(&config::LogConfig {
                    format: cfg.log.format,
                    access: config::AccessLogTarget::Stderr,
                })
                .unwrap_or_else(|_| access_log::AccessLog::off())
            }))
        });
        let cache = match prev {
            Some(g) if g.cfg.cache == cfg.cache && g.cfg.redis == cfg.redis => g.cache.clone(),
            _ => {
                let cache = cache::ResponseCache::new(&cfg, metrics.clone());
                if cache.shared() {
                    tracing::info!("cached answers shared through Redis");
                }
                cache
            }
        };
        Arc::new(Gateway {
            cache,
            access_log,
            telemetry: carried
                .telemetry
                .unwrap_or_else(|| Arc::new(telemetry::Telemetry::new(&cfg.telemetry))),
            keys: keys::Keys::new(&cfg),
            decisions: carried
                .decisions
                .unwrap_or_else(|| Arc::new(decisions::DecisionLog::new(cfg.decisions_kept))),
            quota,
            budget: retry_budget::ShardedBudget::new(cfg.retry_budget),
            cfg,
            pools,
            by_name,
            epoch,
            metrics,
            hooks: carried.hooks,
            events: carried.events,
            process: carried.process,
            generation: prev.map_or(1, |g| g.generation + 1),
        })
    }

    /// Milliseconds since the gateway started: the time passed into the pure core.
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub fn pool(&self, model: &str) -> Option<&Arc<Pool>> {
        self.by_name.get(model).map(|i| &self.pools[*i])
    }

    pub fn pools(&self) -> &[Arc<Pool>] {
        &self.pools
    }

    /// Public model names (pool names; aliases are accepted but not listed).
    pub fn model_names(&self) -> Vec<&str> {
        self.pools.iter().map(|p| p.cfg.name.as_str()).collect()
    }

    /// The ring of decision records (`/keel/decisions`).
    pub fn decision_log(&self) -> &Arc<decisions::DecisionLog> {
        &self.decisions
    }

    /// The `n` most recent decision records, newest first (without copying the rest).
    pub fn latest_decisions(&self, n: usize) -> Vec<DecisionRecord> {
        let q = decisions::Query {
            limit: n,
            ..Default::default()
        };
        self.decisions
            .query(&q)
            .iter()
            .map(|r| DecisionRecord::clone(r))
            .collect()
    }

    pub(crate) fn record_request(&self) {
        let now = self.now_ms();
        self.budget.record_request(now);
    }

    pub(crate) fn try_retry(&self) -> bool {
        let now = self.now_ms();
        self.budget.try_retry(now)
    }
}

/// Installs the process-wide TLS crypto provider (ring) once.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
