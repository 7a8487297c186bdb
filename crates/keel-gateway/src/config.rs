//! Configuration, read in two steps: raw TOML structs (`deny_unknown_fields`, with source spans)
//! and then validated runtime types. Every error names the file, line, column and field, and
//! says what was expected: `keel.toml:14:1: pools[0].variants[1].url: expected an http:// or
//! https:// base URL, got "ftp://x"`.
//!
//! Strings in `url`, `api_key` and `upstream_model` may use `${ENV_VAR}`; a missing variable is
//! an error (a key silently becoming empty would only show up as 401s in production).

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;

use serde::Deserialize;
use serde_json::{Map, Value};
use toml::Spanned;

use keel_core::budget::RetryBudgetConfig;
use keel_core::health::{Band, HealthConfig};
use keel_core::protocol::Protocol;

pub use keel_core::continuation::ResumeMode;

/// The four timeouts, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP (and TLS) connection establishment.
    pub connect_ms: u64,
    /// From sending the request to the first generated token (streams) or the response head.
    pub first_token_ms: u64,
    /// Longest silence between two stream events once the first token arrived.
    pub stall_ms: u64,
    /// The whole request, all attempts together.
    pub total_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect_ms: 1_000,
            first_token_ms: 15_000,
            stall_ms: 10_000,
            total_ms: 600_000,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTimeouts {
    connect_ms: Option<u64>,
    first_token_ms: Option<u64>,
    stall_ms: Option<u64>,
    total_ms: Option<u64>,
}

impl RawTimeouts {
    fn over(&self, base: Timeouts) -> Timeouts {
        Timeouts {
            connect_ms: self.connect_ms.unwrap_or(base.connect_ms),
            first_token_ms: self.first_token_ms.unwrap_or(base.first_token_ms),
            stall_ms: self.stall_ms.unwrap_or(base.stall_ms),
            total_ms: self.total_ms.unwrap_or(base.total_ms),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    listen: Option<Spanned<String>>,
    max_body_bytes: Option<usize>,
    header_read_timeout_ms: Option<u64>,
    body_read_timeout_ms: Option<u64>,
    max_upstream_body_bytes: Option<usize>,
    max_sse_event_bytes: Option<usize>,
    drain_ms: Option<u64>,
    max_attempts: Option<u32>,
    allow_force_variant: Option<bool>,
    worker_threads: Option<usize>,
    #[serde(default)]
    timeouts: RawTimeouts,
    retry_budget: Option<RawBudget>,
    #[serde(default)]
    pools: Vec<Spanned<RawPool>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBudget {
    ratio: Option<f64>,
    window_ms: Option<u64>,
    min_retries_per_sec: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPool {
    name: String,
    #[serde(default)]
    aliases: Vec<String>,
    max_attempts: Option<u32>,
    #[serde(default)]
    timeouts: RawTimeouts,
    // Per-pool timeouts may also be written flat, as `first_token_ms = …` in the pool table.
    connect_ms: Option<u64>,
    first_token_ms: Option<u64>,
    stall_ms: Option<u64>,
    total_ms: Option<u64>,
    /// `p2c` (default) or `round_robin`.
    policy: Option<String>,
    /// Migrations per request after the first byte (default 2; 0 disables migration).
    max_migrations: Option<u32>,
    /// Longest wait in line for a slot when every variant is at its concurrency limit
    /// (default 2000; 0: refuse at once).
    queue_ms: Option<u64>,
    /// Stall threshold adapts to each variant's gaps (capped by `stall_ms`); false: `stall_ms` fixed.
    adaptive_stall: Option<bool>,
    /// Hedge late first tokens: `auto` (default: a recent TTFT quantile, 50 ms–2 s), `off`, or a delay in ms.
    hedge: Option<toml::Value>,
    /// Largest share of extra upstream requests hedges may add (default 0.1).
    hedge_budget: Option<f64>,
    /// Hold tool-call deltas until each call is complete (default true).
    hold_tool_calls: Option<bool>,
    /// Send non-streaming requests upstream as streams and assemble the body, so stalls and
    /// failures mid-generation migrate for them too (default true).
    assemble_non_streaming: Option<bool>,
    /// `none` (default), `session` or `prefix`.
    affinity: Option<String>,
    slo_ttft_p95_ms: Option<f64>,
    #[serde(default)]
    health: RawHealth,
    #[serde(default)]
    variants: Vec<Spanned<RawVariant>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHealth {
    decay_ms: Option<f64>,
    error_decay_ms: Option<f64>,
    eject_after_ms: Option<u64>,
    probe_interval_ms: Option<u64>,
    slow_start_ms: Option<u64>,
    prewarm_requests: Option<u32>,
    scrape_interval_ms: Option<u64>,
    ttft_ratio_warn: Option<f64>,
    ttft_ratio_severe: Option<f64>,
    tgsv_ratio_warn: Option<f64>,
    tgsv_ratio_severe: Option<f64>,
    error_rate_warn: Option<f64>,
    error_rate_severe: Option<f64>,
    kv_usage_warn: Option<f64>,
    kv_usage_severe: Option<f64>,
    waiting_warn: Option<f64>,
    waiting_severe: Option<f64>,
}

impl RawHealth {
    /// The health settings and scrape interval; an error names the field and what is expected.
    fn build(&self) -> Result<(HealthConfig, u64), (String, String)> {
        let d = HealthConfig::default();
        let band = |name: &str,
                    b: Band,
                    w: Option<f64>,
                    s: Option<f64>|
         -> Result<Band, (String, String)> {
            let band = Band {
                warn: w.unwrap_or(b.warn),
                severe: s.unwrap_or(b.severe),
            };
            if !(band.warn.is_finite()
                && band.severe.is_finite()
                && band.warn >= 0.0
                && band.severe > band.warn)
            {
                return Err((
                    format!("{name}_severe"),
                    format!(
                        "must be greater than {name}_warn (got warn {}, severe {})",
                        band.warn, band.severe
                    ),
                ));
            }
            Ok(band)
        };
        let cfg = HealthConfig {
            decay_ms: self.decay_ms.unwrap_or(d.decay_ms).max(1.0),
            error_decay_ms: self.error_decay_ms.unwrap_or(d.error_decay_ms).max(1.0),
            baseline_decay_ms: d.baseline_decay_ms,
            ttft_ratio: band(
                "ttft_ratio",
                d.ttft_ratio,
                self.ttft_ratio_warn,
                self.ttft_ratio_severe,
            )?,
            tgsv_ratio: band(
                "tgsv_ratio",
                d.tgsv_ratio,
                self.tgsv_ratio_warn,
                self.tgsv_ratio_severe,
            )?,
            error_rate: band(
                "error_rate",
                d.error_rate,
                self.error_rate_warn,
                self.error_rate_severe,
            )?,
            kv_usage: band(
                "kv_usage",
                d.kv_usage,
                self.kv_usage_warn,
                self.kv_usage_severe,
            )?,
            waiting: band("waiting", d.waiting, self.waiting_warn, self.waiting_severe)?,
            eject_after_ms: self.eject_after_ms.unwrap_or(d.eject_after_ms),
            probe_interval_ms: self
                .probe_interval_ms
                .unwrap_or(d.probe_interval_ms)
                .max(50),
            slow_start_ms: self.slow_start_ms.unwrap_or(d.slow_start_ms),
            prewarm_requests: self.prewarm_requests.unwrap_or(d.prewarm_requests),
        };
        Ok((cfg, self.scrape_interval_ms.unwrap_or(1000).max(100)))
    }
}

/// When to hedge a late first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hedge {
    Off,
    /// The hedge target's recent TTFT quantile at 1 − hedge_budget/2, clamped to 50 ms–2 s.
    Auto,
    /// A fixed delay.
    AfterMs(u64),
}

/// How requests stick to variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affinity {
    None,
    /// `x-keel-session`, else OpenAI `user`, else Anthropic `metadata.user_id`.
    Session,
    /// The first blocks of the prompt (system + earliest messages).
    Prefix,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVariant {
    name: String,
    url: String,
    protocol: RawProtocol,
    upstream_model: String,
    api_key: Option<String>,
    tier: Option<u8>,
    context_window: Option<u64>,
    max_concurrency: Option<u32>,
    weight: Option<u32>,
    #[serde(default)]
    params: toml::Table,
    resume: Option<ResumeMode>,
    /// Relative price, for `x-keel-preference: low-cost`.
    price: Option<f64>,
    /// Prometheus endpoint of a vLLM / SGLang / llama.cpp server, scraped for load signals.
    metrics_url: Option<String>,
    /// Extra fields of an OpenAI-compatible prefill continuation (default: vLLM's
    /// `continue_final_message = true, add_generation_prompt = false`).
    continuation_fields: Option<toml::Table>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum RawProtocol {
    #[serde(rename = "openai")]
    OpenAi,
    Anthropic,
}

impl From<RawProtocol> for Protocol {
    fn from(p: RawProtocol) -> Self {
        match p {
            RawProtocol::OpenAi => Protocol::OpenAi,
            RawProtocol::Anthropic => Protocol::Anthropic,
        }
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    pub header_read_timeout_ms: u64,
    /// The whole request body must arrive within this (slow bodies get 408).
    pub body_read_timeout_ms: u64,
    /// Largest whole (non-streamed) upstream response body; more is a `malformed` failure.
    pub max_upstream_body_bytes: usize,
    /// Largest single SSE event from an upstream; more is a `malformed` failure.
    pub max_sse_event_bytes: usize,
    pub drain_ms: u64,
    pub allow_force_variant: bool,
    /// Runtime worker threads for `keel serve` (default: one per core).
    pub worker_threads: Option<usize>,
    pub retry_budget: RetryBudgetConfig,
    pub pools: Vec<PoolConfig>,
    /// Warnings that do not stop the gateway (printed by `keel check` and at start).
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub name: String,
    pub aliases: Vec<String>,
    pub max_attempts: u32,
    pub timeouts: Timeouts,
    /// Selection policy name (`p2c` or `round_robin`).
    pub policy: String,
    pub affinity: Affinity,
    pub slo_ttft_p95_ms: Option<f64>,
    pub max_migrations: u32,
    pub queue_ms: u64,
    pub adaptive_stall: bool,
    pub hedge: Hedge,
    pub hedge_budget: f64,
    pub hold_tool_calls: bool,
    pub assemble_non_streaming: bool,
    pub health: HealthConfig,
    pub scrape_interval_ms: u64,
    pub variants: Vec<VariantConfig>,
}

#[derive(Clone)]
pub struct VariantConfig {
    pub name: String,
    /// Base URL as the provider's SDK takes it, without a trailing slash.
    pub url: String,
    pub protocol: Protocol,
    pub upstream_model: String,
    /// Never printed: `Debug` redacts it.
    pub api_key: Option<String>,
    pub tier: u8,
    pub context_window: Option<u64>,
    pub max_concurrency: Option<u32>,
    pub weight: u32,
    pub params: Map<String, Value>,
    pub resume: ResumeMode,
    pub price: f64,
    pub metrics_url: Option<String>,
    pub continuation_fields: Map<String, Value>,
}

impl fmt::Debug for VariantConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VariantConfig")
            .field("name", &self.name)
            .field("url", &self.url)
            .field("protocol", &self.protocol)
            .field("upstream_model", &self.upstream_model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("tier", &self.tier)
            .field("weight", &self.weight)
            .finish_non_exhaustive()
    }
}

/// A configuration error, already formatted with its position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Line and column (1-based) of a byte offset.
fn position(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let line = text[..offset].matches('\n').count() + 1;
    let col = offset - text[..offset].rfind('\n').map(|i| i + 1).unwrap_or(0) + 1;
    (line, col)
}

impl Config {
    /// Reads and validates a file.
    pub fn load(path: &str) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("{path}: cannot read: {e}")))?;
        let env: HashMap<String, String> = std::env::vars().collect();
        Config::parse(&text, path, &env)
    }

    /// Parses TOML text; `origin` names the file in errors; `env` resolves `${VAR}`.
    pub fn parse(
        text: &str,
        origin: &str,
        env: &HashMap<String, String>,
    ) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            let at = e.span().map(|s| position(text, s.start));
            let msg = e.message().trim().to_owned();
            match at {
                Some((l, c)) => ConfigError(format!("{origin}:{l}:{c}: {msg}")),
                None => ConfigError(format!("{origin}: {msg}")),
            }
        })?;
        // Points at the field's own line when it is written inside the table that starts at
        // `offset`, else at the table's header.
        let err_at = |offset: usize, field: String, what: String| {
            let key = field.rsplit('.').next().unwrap_or("");
            let table_end = text[offset..]
                .find("\n[")
                .map(|i| offset + i)
                .unwrap_or(text.len());
            let at = text[offset..table_end]
                .match_indices(key)
                .map(|(i, _)| offset + i)
                .find(|&i| {
                    let line_start = text[..i].rfind('\n').map(|n| n + 1).unwrap_or(0);
                    text[line_start..i].trim().is_empty()
                        && text[i + key.len()..].trim_start().starts_with('=')
                })
                .unwrap_or(offset);
            let (l, c) = position(text, at);
            ConfigError(format!("{origin}:{l}:{c}: {field}: {what}"))
        };

        let listen = match &raw.listen {
            Some(l) => l.get_ref().parse().map_err(|_| {
                err_at(
                    l.span().start,
                    "listen".into(),
                    format!(
                        "expected an address such as \"127.0.0.1:8080\", got {:?}",
                        l.get_ref()
                    ),
                )
            })?,
            None => SocketAddr::from(([127, 0, 0, 1], 8080)),
        };
        let base_timeouts = raw.timeouts.over(Timeouts::default());
        let default_attempts = raw.max_attempts.unwrap_or(3);
        let mut budget = RetryBudgetConfig::default();
        if let Some(b) = &raw.retry_budget {
            budget.ratio = b.ratio.unwrap_or(budget.ratio);
            budget.window_ms = b.window_ms.unwrap_or(budget.window_ms);
            budget.min_retries_per_sec =
                b.min_retries_per_sec.unwrap_or(budget.min_retries_per_sec);
            if !(0.0..=10.0).contains(&budget.ratio) {
                return Err(ConfigError(format!(
                    "{origin}: retry_budget.ratio: expected a number between 0 and 10"
                )));
            }
            if budget.window_ms < 1000 {
                return Err(ConfigError(format!(
                    "{origin}: retry_budget.window_ms: expected at least 1000"
                )));
            }
        }
        if raw.pools.is_empty() {
            return Err(ConfigError(format!(
                "{origin}: pools: at least one [[pools]] table is required"
            )));
        }

        let mut warnings = Vec::new();
        let mut names: HashMap<String, usize> = HashMap::new();
        let mut pools = Vec::new();
        for (pi, sp) in raw.pools.iter().enumerate() {
            let p = sp.get_ref();
            let at = sp.span().start;
            let field = |f: &str| format!("pools[{pi}].{f}");
            if p.name.is_empty() {
                return Err(err_at(at, field("name"), "must not be empty".into()));
            }
            for n in std::iter::once(&p.name).chain(p.aliases.iter()) {
                if let Some(other) = names.insert(n.clone(), pi) {
                    return Err(err_at(
                        at,
                        field("name"),
                        format!("model name `{n}` is already used by pools[{other}]"),
                    ));
                }
            }
            let flat = RawTimeouts {
                connect_ms: p.connect_ms,
                first_token_ms: p.first_token_ms,
                stall_ms: p.stall_ms,
                total_ms: p.total_ms,
            };
            let timeouts = flat.over(p.timeouts.over(base_timeouts));
            for (n, v) in [
                ("connect_ms", timeouts.connect_ms),
                ("first_token_ms", timeouts.first_token_ms),
                ("stall_ms", timeouts.stall_ms),
                ("total_ms", timeouts.total_ms),
            ] {
                if v == 0 {
                    return Err(err_at(at, field(n), "must be greater than 0".into()));
                }
            }
            let max_attempts = p.max_attempts.unwrap_or(default_attempts);
            if max_attempts == 0 {
                return Err(err_at(
                    at,
                    field("max_attempts"),
                    "must be at least 1".into(),
                ));
            }
            if p.variants.is_empty() {
                return Err(err_at(
                    at,
                    field("variants"),
                    "at least one [[pools.variants]] table is required".into(),
                ));
            }
            let mut variants: Vec<VariantConfig> = Vec::new();
            for (vi, sv) in p.variants.iter().enumerate() {
                let v = sv.get_ref();
                let vat = sv.span().start;
                let vfield = |f: &str| format!("pools[{pi}].variants[{vi}].{f}");
                let interp = |f: &str, s: &str| {
                    interpolate(s, env).map_err(|var| {
                        err_at(
                            vat,
                            vfield(f),
                            format!("environment variable `{var}` is not set"),
                        )
                    })
                };
                if v.name.is_empty() {
                    return Err(err_at(vat, vfield("name"), "must not be empty".into()));
                }
                if variants.iter().any(|o| o.name == v.name) {
                    return Err(err_at(
                        vat,
                        vfield("name"),
                        format!("variant name `{}` is used twice in this pool", v.name),
                    ));
                }
                let protocol = Protocol::from(v.protocol);
                let mut url = interp("url", &v.url)?.trim_end_matches('/').to_owned();
                if !(url.starts_with("http://") || url.starts_with("https://"))
                    || url.parse::<http::Uri>().is_err()
                {
                    return Err(err_at(
                        vat,
                        vfield("url"),
                        format!("expected an http:// or https:// base URL, got {:?}", v.url),
                    ));
                }
                if protocol == Protocol::Anthropic && url.ends_with("/v1") {
                    // The Anthropic SDK's base URL has no /v1; accept the common slip.
                    url.truncate(url.len() - 3);
                    warnings.push(format!("pools[{pi}].variants[{vi}].url: Anthropic base URLs do not end in /v1; using {url}"));
                }
                let upstream_model = interp("upstream_model", &v.upstream_model)?;
                let api_key = match &v.api_key {
                    Some(k) => Some(interp("api_key", k)?),
                    None => None,
                };
                let tier = v.tier.unwrap_or(1);
                if tier == 0 {
                    return Err(err_at(
                        vat,
                        vfield("tier"),
                        "expected 1 (best fidelity) or more".into(),
                    ));
                }
                let weight = v.weight.unwrap_or(1);
                let params = match serde_json::to_value(&v.params) {
                    Ok(Value::Object(m)) => m,
                    _ => {
                        return Err(err_at(
                            vat,
                            vfield("params"),
                            "expected a table of request fields".into(),
                        ))
                    }
                };
                let resume = v.resume.unwrap_or(ResumeMode::Prefill);
                variants.push(VariantConfig {
                    name: v.name.clone(),
                    url,
                    protocol,
                    upstream_model,
                    api_key,
                    tier,
                    context_window: v.context_window,
                    max_concurrency: v.max_concurrency,
                    weight,
                    params,
                    resume,
                    price: v.price.unwrap_or(1.0),
                    continuation_fields: match &v.continuation_fields {
                        None => keel_core::continuation::default_prefill_fields(),
                        Some(t) => match serde_json::to_value(t) {
                            Ok(Value::Object(m)) => m,
                            _ => {
                                return Err(err_at(
                                    vat,
                                    vfield("continuation_fields"),
                                    "expected a table of request fields".into(),
                                ))
                            }
                        },
                    },
                    metrics_url: match &v.metrics_url {
                        Some(u) => {
                            let u = interp("metrics_url", u)?;
                            if !(u.starts_with("http://") || u.starts_with("https://")) {
                                return Err(err_at(
                                    vat,
                                    vfield("metrics_url"),
                                    format!("expected an http:// or https:// URL, got {u:?}"),
                                ));
                            }
                            Some(u)
                        }
                        None => None,
                    },
                });
            }
            let protocol = variants[0].protocol;
            if let Some((vi, other)) = variants
                .iter()
                .enumerate()
                .find(|(_, v)| v.protocol != protocol)
            {
                return Err(err_at(
                    p.variants[vi].span().start,
                    format!("pools[{pi}].variants[{vi}].protocol"),
                    format!(
                        "`{}` differs from the pool's first variant (`{}`); a pool's variants share one protocol until cross-protocol translation lands",
                        other.protocol.as_str(),
                        protocol.as_str()
                    ),
                ));
            }
            if variants.iter().all(|v| v.weight == 0) {
                return Err(err_at(
                    at,
                    field("variants"),
                    "every variant has weight 0; at least one must take traffic".into(),
                ));
            }
            let policy = p.policy.clone().unwrap_or_else(|| "p2c".into());
            if !matches!(policy.as_str(), "p2c" | "round_robin") {
                return Err(err_at(
                    at,
                    field("policy"),
                    format!("expected `p2c` or `round_robin`, got `{policy}`"),
                ));
            }
            let affinity = match p.affinity.as_deref().unwrap_or("none") {
                "none" => Affinity::None,
                "session" => Affinity::Session,
                "prefix" => Affinity::Prefix,
                other => {
                    return Err(err_at(
                        at,
                        field("affinity"),
                        format!("expected `none`, `session` or `prefix`, got `{other}`"),
                    ))
                }
            };
            let (health, scrape_interval_ms) = p
                .health
                .build()
                .map_err(|(f, what)| err_at(at, field(&format!("health.{f}")), what))?;
            let hedge = match &p.hedge {
                None => Hedge::Auto,
                Some(toml::Value::String(s)) if s == "auto" => Hedge::Auto,
                Some(toml::Value::String(s)) if s == "off" => Hedge::Off,
                Some(toml::Value::Integer(ms)) if *ms > 0 => Hedge::AfterMs(*ms as u64),
                Some(other) => {
                    return Err(err_at(
                        at,
                        field("hedge"),
                        format!("expected \"auto\", \"off\" or a delay in ms, got {other}"),
                    ))
                }
            };
            let hedge_budget = p.hedge_budget.unwrap_or(0.1);
            if !(0.0..=1.0).contains(&hedge_budget) {
                return Err(err_at(
                    at,
                    field("hedge_budget"),
                    "expected a share between 0 and 1".into(),
                ));
            }
            for (vi, v) in variants.iter().enumerate() {
                let fit = match (v.resume, v.protocol) {
                    (ResumeMode::Completion, Protocol::Anthropic) => Some("Anthropic has no /v1/completions; use `prefill`"),
                    (ResumeMode::Prefill, Protocol::OpenAi) if v.url.contains("api.openai.com") => {
                        Some("OpenAI's hosted API does not continue a final assistant message; use `instruction`")
                    }
                    _ => None,
                };
                if let Some(why) = fit {
                    warnings.push(format!(
                        "pools[{pi}].variants[{vi}].resume: `{}` does not fit this variant: {why}",
                        match v.resume {
                            ResumeMode::Prefill => "prefill",
                            ResumeMode::Completion => "completion",
                            ResumeMode::Instruction => "instruction",
                            ResumeMode::None => "none",
                        }
                    ));
                }
            }
            pools.push(PoolConfig {
                max_migrations: p.max_migrations.unwrap_or(2),
                queue_ms: p.queue_ms.unwrap_or(2000),
                adaptive_stall: p.adaptive_stall.unwrap_or(true),
                hedge,
                hedge_budget,
                hold_tool_calls: p.hold_tool_calls.unwrap_or(true),
                assemble_non_streaming: p.assemble_non_streaming.unwrap_or(true),
                name: p.name.clone(),
                aliases: p.aliases.clone(),
                max_attempts,
                timeouts,
                policy,
                affinity,
                slo_ttft_p95_ms: p.slo_ttft_p95_ms,
                health,
                scrape_interval_ms,
                variants,
            });
        }

        Ok(Config {
            listen,
            max_body_bytes: raw.max_body_bytes.unwrap_or(10 * 1024 * 1024),
            header_read_timeout_ms: raw.header_read_timeout_ms.unwrap_or(10_000),
            body_read_timeout_ms: raw.body_read_timeout_ms.unwrap_or(30_000),
            max_upstream_body_bytes: raw.max_upstream_body_bytes.unwrap_or(64 * 1024 * 1024),
            max_sse_event_bytes: raw.max_sse_event_bytes.unwrap_or(4 * 1024 * 1024),
            drain_ms: raw.drain_ms.unwrap_or(30_000),
            allow_force_variant: raw.allow_force_variant.unwrap_or(false),
            worker_threads: match raw.worker_threads {
                Some(0) => {
                    return Err(ConfigError(format!(
                        "{origin}: worker_threads: must be at least 1"
                    )))
                }
                w => w,
            },
            retry_budget: budget,
            pools,
            warnings,
        })
    }
}

/// Replaces `${VAR}` with the variable's value; returns the missing variable's name on error.
fn interpolate(s: &str, env: &HashMap<String, String>) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let Some(j) = after.find('}') else {
            out.push_str(&rest[i..]);
            return Ok(out);
        };
        let name = &after[..j];
        out.push_str(env.get(name).ok_or_else(|| name.to_owned())?);
        rest = &after[j + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> HashMap<String, String> {
        HashMap::from([("KEY".to_owned(), "sk-secret".to_owned())])
    }

    const GOOD: &str = r#"
listen = "127.0.0.1:9000"
[[pools]]
name = "gpt"
aliases = ["gpt-4o"]
first_token_ms = 2000
[[pools.variants]]
name = "a"
url = "http://127.0.0.1:8000/v1/"
protocol = "openai"
upstream_model = "m"
api_key = "${KEY}"
params = { max_tokens = 100 }
"#;

    #[test]
    fn parses_and_applies_defaults() {
        let c = Config::parse(GOOD, "keel.toml", &env()).unwrap();
        assert_eq!(c.listen.port(), 9000);
        let p = &c.pools[0];
        assert_eq!(p.timeouts.first_token_ms, 2000);
        assert_eq!(p.timeouts.connect_ms, 1000);
        assert_eq!(p.max_attempts, 3);
        let v = &p.variants[0];
        assert_eq!(v.url, "http://127.0.0.1:8000/v1");
        assert_eq!(v.api_key.as_deref(), Some("sk-secret"));
        assert_eq!(v.params["max_tokens"], 100);
        assert!(
            !format!("{v:?}").contains("sk-secret"),
            "Debug must redact the key"
        );
    }

    #[test]
    fn missing_env_var_names_line_and_field() {
        let e = Config::parse(GOOD, "keel.toml", &HashMap::new()).unwrap_err();
        assert_eq!(
            e.0,
            "keel.toml:12:1: pools[0].variants[0].api_key: environment variable `KEY` is not set"
        );
    }

    #[test]
    fn unknown_fields_and_bad_values_are_precise() {
        let e = Config::parse(
            &GOOD.replace("weight", "x").replace(
                "upstream_model = \"m\"",
                "upstream_model = \"m\"\nwieght = 2",
            ),
            "k.toml",
            &env(),
        )
        .unwrap_err();
        assert!(
            e.0.starts_with("k.toml:12:1:") && e.0.contains("wieght"),
            "{}",
            e.0
        );
        let e = Config::parse(
            &GOOD.replace("http://127.0.0.1:8000/v1/", "ftp://x"),
            "k.toml",
            &env(),
        )
        .unwrap_err();
        assert!(
            e.0.contains("pools[0].variants[0].url: expected an http:// or https:// base URL"),
            "{}",
            e.0
        );
        let e =
            Config::parse(&GOOD.replace("\"openai\"", "\"grpc\""), "k.toml", &env()).unwrap_err();
        assert!(e.0.contains("unknown variant `grpc`"), "{}", e.0);
        let e =
            Config::parse(&GOOD.replace("127.0.0.1:9000", "nope"), "k.toml", &env()).unwrap_err();
        assert!(e.0.starts_with("k.toml:2:10: listen:"), "{}", e.0);
    }

    #[test]
    fn duplicate_model_names_are_rejected() {
        let twice = format!("{GOOD}\n[[pools]]\nname = \"gpt-4o\"\n[[pools.variants]]\nname=\"b\"\nurl=\"http://x\"\nprotocol=\"openai\"\nupstream_model=\"m\"\n");
        let e = Config::parse(&twice, "k.toml", &env()).unwrap_err();
        assert!(
            e.0.contains("`gpt-4o` is already used by pools[0]"),
            "{}",
            e.0
        );
    }
}
