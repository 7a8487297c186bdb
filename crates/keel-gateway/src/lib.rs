//! keel-gateway: the IO shell around keel-core. Its folders are layers, from the top down;
//! each uses only its own and those below it (a test, `tests/it/layers.rs`, holds this):
//!
//! - [`http`]: accepting connections and routing each request, to the pipeline or the
//!   operations plane;
//! - [`admin`]: the operations plane (reload, the dashboard's feed, safe mode, rollouts, the
//!   OpenAPI document);
//! - [`pipeline`]: one generation request's phases, admit ─▶ cache ─▶ plan ─▶ execute ─▶
//!   deliver ([`pipeline::phases`]), with the relay that carries a stream past its first byte;
//! - the crate root: [`Gateway`], one generation of the config's state;
//! - [`state`]: what outlives a request (pools and their live variant state, learned limits and
//!   the wait line, keys and quotas, rollout state, shared signals);
//! - [`observe`]: metrics, traces, the access log, decision records;
//! - [`upstream`]: calling model servers, and translating to the other protocol;
//! - [`wire`]: what a client sees whoever produces it (bodies, errors, routes, request ids);
//! - [`config`]: `keel.toml` read into validated types.
//!
//! `docs/src/architecture.md` walks one streamed request through these files.
#![forbid(unsafe_code)]

pub mod admin;
pub mod config;
#[doc(hidden)]
pub mod fuzzing;
pub mod hooks;
pub mod http;
pub mod observe;
pub mod per_thread;
pub mod pipeline;
pub mod state;
pub mod upstream;
pub mod wire;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::observe::record::DecisionRecord;
pub use config::{install_crypto, Config};
use state::pools::{Pool, UpstreamLimits};
pub use wire::body::{full_body, Body};

/// The running gateway's shared state: one *generation* of the config. A reload (see [`live`])
/// builds the next generation and carries over what outlives one (metrics, decisions, quota,
/// events, hooks, telemetry, the process's drain state, the live state of unchanged variants);
/// requests keep the generation they started on.
pub struct Gateway {
    pub cfg: Config,
    pools: Vec<Arc<Pool>>,
    /// Pools by public name and alias. foldhash: a model name is looked up on every request
    /// (SipHash, the default, cost more than the rest of the lookup), and the map is built from
    /// the config alone, so a client's names cannot fill it.
    by_name: HashMap<String, usize, foldhash::fast::RandomState>,
    budget: state::retry_budget::ShardedBudget,
    /// Origin of `now_ms`: the core's clock is milliseconds since the gateway started.
    epoch: Instant,
    /// The most recent decision records (`GET /keel/decisions`).
    decisions: Arc<observe::decisions::DecisionLog>,
    /// This gateway's metrics registry.
    pub metrics: Arc<observe::metrics::Metrics>,
    /// Faults injected inside keel (tests only; see `hooks`).
    pub hooks: Arc<hooks::TestHooks>,
    /// Virtual keys (`[[keys]]`).
    pub keys: state::keys::Keys,
    /// Where the keys' limits and budgets are kept.
    pub quota: Arc<state::quota::Store>,
    /// `[log] access`: one line per request.
    pub access_log: Arc<observe::access_log::AccessLog>,
    /// `[telemetry]`: the OTLP trace exporter, when configured.
    pub telemetry: Arc<observe::telemetry::Telemetry>,
    /// The dashboard's snapshot stream (`/keel/events`).
    pub events: Arc<observe::events::Hub>,
    /// The process around the generations: draining, the reload handle (see `live`).
    pub process: Arc<state::process::Process>,
    /// 1 for the first config, one more for each reload.
    pub generation: u64,
    /// The response cache (`[pools.cache]`, `[cache]`); kept across a reload that changes
    /// neither `[cache]` nor `[redis]`.
    pub cache: Arc<state::cache::ResponseCache>,
}

impl Gateway {
    pub fn new(cfg: Config) -> Arc<Gateway> {
        Gateway::build(cfg, None)
    }

    /// A generation of `cfg`; `prev`: the generation it replaces on a reload, whose lasting
    /// state it carries over (see [`Lasting`] and `state::pools::carry`).
    pub(crate) fn build(cfg: Config, prev: Option<&Gateway>) -> Arc<Gateway> {
        // One clock for every generation: variant state carried over holds times on it.
        let epoch = prev.map_or_else(Instant::now, |g| g.epoch);
        let mut by_name = HashMap::default();
        let mut pools = Vec::new();
        let metrics = prev.map_or_else(observe::metrics::Metrics::new, |g| g.metrics.clone());
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
            pools.push(state::pools::carry::carried(old, p, limits, || {
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
        let carried = Lasting::from(prev, &cfg);
        let quota = carried.quota.unwrap_or_else(|| {
            let quota = state::quota::Store::from_config(cfg.redis.as_ref(), metrics.clone()).unwrap_or_else(|e| {
                tracing::error!(error = %e.0, "[redis] unusable: quota state stays in this process (limits are per replica)");
                state::quota::Store::Local(state::quota::local::Local::default())
            });
            if cfg.redis.is_some() && matches!(quota, state::quota::Store::Redis(_)) {
                tracing::info!("quota state (limits, budgets, in-flight slots) shared through Redis");
            }
            Arc::new(quota)
        });
        // A destination that cannot be opened is reported; `keel serve` checks it before
        // starting and a reload before swapping (see `observe::access_log::AccessLog::open`), so this
        // only falls back in embedders.
        let access_log = carried.access_log.unwrap_or_else(|| {
            Arc::new(
                observe::access_log::AccessLog::open(&cfg.log).unwrap_or_else(|e| {
                    tracing::error!(error = %e, "access log unusable: writing it to stderr");
                    observe::access_log::AccessLog::open(&config::LogConfig {
                        format: cfg.log.format,
                        access: config::AccessLogTarget::Stderr,
                    })
                    .unwrap_or_else(|_| observe::access_log::AccessLog::off())
                }),
            )
        });
        let cache = match prev {
            Some(g) if g.cfg.cache == cfg.cache && g.cfg.redis == cfg.redis => g.cache.clone(),
            _ => {
                let cache = state::cache::ResponseCache::new(&cfg, metrics.clone());
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
                .unwrap_or_else(|| Arc::new(observe::telemetry::Telemetry::new(&cfg.telemetry))),
            keys: state::keys::Keys::new(&cfg),
            decisions: carried.decisions.unwrap_or_else(|| {
                Arc::new(observe::decisions::DecisionLog::new(cfg.decisions_kept))
            }),
            quota,
            budget: state::retry_budget::ShardedBudget::new(cfg.retry_budget),
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

    /// A new request's access-log entry (see `observe::access_log`).
    pub fn request_log(
        &self,
        id: &str,
        started: tokio::time::Instant,
        endpoint: &'static str,
        pool: &str,
    ) -> observe::access_log::RequestLog {
        let (log, metrics) = (self.access_log.clone(), self.metrics.clone());
        observe::access_log::RequestLog::new(log, metrics, id, started, endpoint, pool)
    }

    /// What the shared signals task reads of this generation (see `state::signals`).
    pub fn signals_generation(&self) -> state::signals::Generation {
        state::signals::Generation {
            pools: self.pools.clone(),
            redis: self.cfg.redis.clone(),
            metrics: self.metrics.clone(),
            epoch: self.epoch,
        }
    }

    /// What a key's admission reads of this generation (see `keys::limits`).
    pub fn quotas(&self) -> state::keys::limits::Quotas<'_> {
        state::keys::limits::Quotas {
            store: &self.quota,
            metrics: &self.metrics,
            keys: &self.keys,
            fail_mode: self.cfg.quota_fail_mode,
            slot_ttl_ms: self.cfg.quota_slot_ttl_ms,
        }
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
    pub fn decision_log(&self) -> &Arc<observe::decisions::DecisionLog> {
        &self.decisions
    }

    /// The `n` most recent decision records, newest first (without copying the rest).
    pub fn latest_decisions(&self, n: usize) -> Vec<DecisionRecord> {
        let q = observe::decisions::Query {
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

/// The gateway-wide state a generation takes over from the one it replaces (`None`: build it
/// from the new config). Process-wide state is always carried (metrics, test hooks, the events
/// hub, the drain state); state tied to a section of the config is carried while that section
/// is unchanged (the quota store with `[redis]`, the access log with `[log]`, the trace exporter
/// with `[telemetry]`, the decision ring with `decisions_kept`). Pools carry their own (see
/// `state::pools::carry`).
struct Lasting {
    quota: Option<Arc<state::quota::Store>>,
    access_log: Option<Arc<observe::access_log::AccessLog>>,
    telemetry: Option<Arc<observe::telemetry::Telemetry>>,
    decisions: Option<Arc<observe::decisions::DecisionLog>>,
    hooks: Arc<hooks::TestHooks>,
    events: Arc<observe::events::Hub>,
    process: Arc<state::process::Process>,
}

impl Lasting {
    fn from(prev: Option<&Gateway>, cfg: &Config) -> Lasting {
        let Some(g) = prev else {
            return Lasting {
                quota: None,
                access_log: None,
                telemetry: None,
                decisions: None,
                hooks: Arc::default(),
                events: Arc::default(),
                process: Arc::default(),
            };
        };
        let keep = |unchanged: bool| unchanged.then_some(());
        Lasting {
            quota: keep(g.cfg.redis == cfg.redis).map(|_| g.quota.clone()),
            access_log: keep(g.cfg.log == cfg.log).map(|_| g.access_log.clone()),
            telemetry: keep(g.cfg.telemetry == cfg.telemetry).map(|_| g.telemetry.clone()),
            decisions: keep(g.cfg.decisions_kept == cfg.decisions_kept)
                .map(|_| g.decisions.clone()),
            hooks: g.hooks.clone(),
            events: g.events.clone(),
            process: g.process.clone(),
        }
    }
}
