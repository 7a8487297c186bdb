//! `[[pools]]`: a public model name (and aliases), how its requests are routed, and its
//! variants (parsed by [`super::variant`]), health settings ([`super::health`]) and timeouts
//! ([`super::timeouts`]).

use std::collections::HashMap;

use toml::de::DeValue;

use keel_core::health::HealthConfig;
use keel_core::health_colour::Thresholds;
use keel_core::selection::PolicyKind;

use super::read::{did_you_mean, Issues, Kind, Table};
use super::timeouts::{TimeoutLayer, Timeouts};
use super::variant::{self, VariantConfig};

/// When to hedge a late first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hedge {
    Off,
    /// The hedge target's recent TTFT quantile at 1 − hedge_budget/2, clamped to 50 ms–2 s.
    Auto,
    /// A fixed delay.
    AfterMs(u64),
}

/// The `model` a response carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResponseModel {
    /// The name the client asked for (the pool's public name, or the alias it used).
    #[default]
    Public,
    /// Whatever the upstream answered (for a translated answer: the variant's
    /// `upstream_model`).
    Upstream,
}

const RESPONSE_MODELS: [(&str, ResponseModel); 2] = [
    ("public", ResponseModel::Public),
    ("upstream", ResponseModel::Upstream),
];

/// How requests stick to variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affinity {
    None,
    /// `x-keel-session`, else OpenAI `user`, else Anthropic `metadata.user_id`.
    Session,
    /// The first blocks of the prompt (system + earliest messages).
    Prefix,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    pub name: String,
    pub aliases: Vec<String>,
    /// The `model` of the pool's responses (`response_model`).
    pub response_model: ResponseModel,
    pub max_attempts: u32,
    pub timeouts: Timeouts,
    /// Selection policy (`p2c` or `round_robin`; serializes as that name).
    pub policy: PolicyKind,
    pub affinity: Affinity,
    pub slo_ttft_p95_ms: Option<f64>,
    pub max_migrations: u32,
    pub queue_ms: u64,
    /// Requests that may wait in the pool's line at once (see `capacity`).
    pub queue_max: usize,
    pub adaptive_stall: bool,
    pub hedge: Hedge,
    pub hedge_budget: f64,
    /// Hedges one request may start when each is late in turn.
    pub max_hedges: u32,
    /// Refresh probes of serving variants without recent evidence may add at most this share
    /// of the pool's requests (10 s window).
    pub probe_budget: f64,
    /// The share of each variant's concurrency limit kept for high-priority requests while
    /// any have been seen in the last 10 s (`priority_reserve`, default 0.25).
    pub priority_reserve: f64,
    /// Serialize tool definitions and JSON schemas with sorted keys (stable bytes for the
    /// upstream's prompt cache); `canonical_tools`, default false.
    pub canonical_tools: bool,
    /// Prompt normalization (`normalize`: off, syntax, full; default off).
    pub normalize: keel_core::normalize::Mode,
    /// What `full` normalization adds, from `[[pools.normalize_rules]]` and
    /// `[pools.normalize_constraints]` (the built-in rules and constraints when absent). Used
    /// whenever a request of this pool is normalized in `full` mode, whether the pool, the key
    /// or the request's `x-keel-normalize` asked for it.
    pub normalize_full: std::sync::Arc<keel_core::normalize::FullConfig>,
    /// The modes a client may choose with `x-keel-normalize` (`client_normalize`; default
    /// `off` and `syntax`: `full` costs far more CPU and only the operator may offer it). A
    /// key's own list replaces this one.
    pub client_normalize: Vec<keel_core::normalize::Mode>,
    /// `[pools.guard]`: PII and secret policies for requests and answers (none when absent).
    pub guard: Option<std::sync::Arc<super::guard::PoolGuard>>,
    pub hold_tool_calls: bool,
    pub assemble_non_streaming: bool,
    pub health: HealthConfig,
    /// `[pools.safe_mode]`: the health colour's thresholds and safe mode's hysteresis.
    pub safe_mode: Thresholds,
    pub scrape_interval_ms: u64,
    /// How long refused connections count as a restart before the variant counts as dead.
    pub restart_grace_ms: u64,
    pub variants: Vec<VariantConfig>,
    /// `transforms = ["middle-out"]`: a prompt too long for every variant's context window
    /// loses whole messages from the middle of the conversation until it fits.
    pub middle_out: bool,
    /// `[pools.shadow]`: variants that get copies of served requests (see `shadow`).
    pub shadow: Option<super::rollout::ShadowConfig>,
    /// `[pools.canary]`: a stable/candidate split that moves in steps (see `canary`).
    pub canary: Option<super::rollout::CanaryPoolConfig>,

    /// `[pools.integrity]`: output checks (truncation, JSON) and repairs; `None`: no checks.
    pub integrity: Option<super::integrity::IntegrityConfig>,

    /// `[pools.cache]`: the response cache (off without the table).
    pub cache: super::cache::PoolCacheConfig,

    /// `fingerprint = true`: each generation request's access line holds its cache keys, its
    /// template id and its policy facts, never its text (see `keel_core::analyze`).
    pub fingerprint: bool,
}

pub(super) const NORMALIZE_MODES: [(&str, keel_core::normalize::Mode); 3] = [
    ("off", keel_core::normalize::Mode::Off),
    ("syntax", keel_core::normalize::Mode::Syntax),
    ("full", keel_core::normalize::Mode::Full),
];

const AFFINITIES: [(&str, Affinity); 3] = [
    ("none", Affinity::None),
    ("session", Affinity::Session),
    ("prefix", Affinity::Prefix),
];

/// What a pool inherits from the top level.
pub(super) struct Inherited<'a> {
    pub(super) timeouts: Timeouts,
    pub(super) max_attempts: u32,
    pub(super) env: &'a HashMap<String, String>,
}

/// Reads one pool. `names` maps every public model name seen so far to the pool path that
/// claimed it. A pool with errors still comes back (with defaults where values were wrong), so
/// that later pools are checked against its names; the errors are in `issues`.
pub(super) fn read(
    mut t: Table,
    up: &Inherited,
    names: &mut HashMap<String, String>,
    warnings: &mut Vec<String>,
    issues: &mut Issues,
) -> PoolConfig {
    let (name, aliases) = read_names(&mut t, names, issues);
    let max_attempts = match t.get::<u32>("max_attempts", issues) {
        Some(v) if v.value == 0 => {
            issues.report(v.at, &v.path, "must be at least 1");
            up.max_attempts
        }
        Some(v) => v.value,
        None => up.max_attempts,
    };
    let nested = {
        let nested = t.table("timeouts", issues);
        TimeoutLayer::read_table(nested, issues)
    };
    let flat = TimeoutLayer::read(&mut t, issues);
    let timeouts = flat.over(nested.over(up.timeouts));
    let policy = t
        .choice("policy", &policies(), issues)
        .map(|p| p.value)
        .unwrap_or_default();
    let affinity = t
        .choice("affinity", &AFFINITIES, issues)
        .map(|a| a.value)
        .unwrap_or(Affinity::None);
    let response_model = t
        .choice("response_model", &RESPONSE_MODELS, issues)
        .map(|r| r.value)
        .unwrap_or_default();
    let hedge = read_hedge(&mut t, issues);
    let hedge_budget = share(&mut t, "hedge_budget", 0.1, issues);
    let probe_budget = share(&mut t, "probe_budget", 0.05, issues);
    let priority_reserve = share(&mut t, "priority_reserve", 0.25, issues);
    let health = {
        let h = t.table("health", issues);
        super::health::read(h, issues)
    };
    let safe_mode = {
        let s = t.table("safe_mode", issues);
        super::safe_mode::read(s, issues)
    };
    let integrity = {
        let i = t.table("integrity", issues);
        super::integrity::read(i, issues)
    };
    let cache = {
        let c = t.table("cache", issues);
        super::cache::read_pool(c, issues)
    };
    let variants = read_variants(&mut t, up, warnings, issues);
    let middle_out = read_transforms(&mut t, issues);
    let shadow = {
        let s = t.table("shadow", issues);
        super::rollout::read_shadow(s, up, warnings, issues)
    };
    let canary = {
        let c = t.table("canary", issues);
        super::rollout::read_canary(c, &variants, issues)
    };

    let normalize_full = super::normalize::read(&mut t, issues);
    let client_normalize = super::normalize::read_client_modes(&mut t, issues)
        .unwrap_or_else(|| super::normalize::DEFAULT_CLIENT_MODES.to_vec());
    let guard = {
        let g = t.table("guard", issues);
        super::guard::read_pool(g, issues)
    };
    let pool = PoolConfig {
        guard,
        name,
        aliases,
        response_model,
        max_attempts,
        timeouts,
        policy,
        affinity,
        slo_ttft_p95_ms: t.value::<f64>("slo_ttft_p95_ms", issues),
        max_migrations: t.value::<u32>("max_migrations", issues).unwrap_or(2),
        queue_ms: t.value::<u64>("queue_ms", issues).unwrap_or(2000),
        queue_max: t.value::<usize>("queue_max", issues).unwrap_or(256),
        adaptive_stall: t.value::<bool>("adaptive_stall", issues).unwrap_or(true),
        hedge,
        hedge_budget,
        max_hedges: t.value::<u32>("max_hedges", issues).unwrap_or(2),
        probe_budget,
        priority_reserve,
        canonical_tools: t.value::<bool>("canonical_tools", issues).unwrap_or(false),
        normalize: t
            .choice("normalize", &NORMALIZE_MODES, issues)
            .map(|m| m.value)
            .unwrap_or(keel_core::normalize::Mode::Off),
        normalize_full,
        client_normalize,
        hold_tool_calls: t.value::<bool>("hold_tool_calls", issues).unwrap_or(true),
        assemble_non_streaming: t
            .value::<bool>("assemble_non_streaming", issues)
            .unwrap_or(true),
        health: health.0,
        safe_mode,
        scrape_interval_ms: health.1,
        restart_grace_ms: health.2,
        variants,
        middle_out,
        shadow,
        canary,

        integrity,

        cache,

        fingerprint: t.value::<bool>("fingerprint", issues).unwrap_or(false),
    };
    t.finish(issues);
    pool
}

/// `name` and `aliases`: the public model names, none claimed by an earlier pool.
fn read_names(
    t: &mut Table,
    names: &mut HashMap<String, String>,
    issues: &mut Issues,
) -> (String, Vec<String>) {
    let name = t.required::<String>("name", "the public model name (a string)", issues);
    if let Some(n) = &name {
        if n.value.is_empty() {
            issues.report(n.at, &n.path, "must not be empty");
        }
    }
    let aliases = t.strings("aliases", issues);
    for n in name.iter().chain(aliases.iter()) {
        if let Some(other) = names.insert(n.value.clone(), t.path().to_owned()) {
            issues.report(
                n.at,
                &n.path,
                format!("model name `{}` is already used by {other}", n.value),
            );
        }
    }
    (
        name.map(|n| n.value).unwrap_or_default(),
        aliases.into_iter().map(|a| a.value).collect(),
    )
}

/// The prompt transforms a pool may apply.
const TRANSFORMS: [&str; 1] = ["middle-out"];

/// `transforms`: a list of [`TRANSFORMS`]; returns whether `middle-out` is on.
fn read_transforms(t: &mut Table, issues: &mut Issues) -> bool {
    let mut middle_out = false;
    for v in t.strings("transforms", issues) {
        if v.value == "middle-out" {
            middle_out = true;
        } else {
            let hint = did_you_mean(&v.value, TRANSFORMS)
                .map(|m| format!("; did you mean `{m}`?"))
                .unwrap_or_default();
            issues.report(
                v.at,
                &v.path,
                format!(
                    "unknown transform `{}`; known: \"middle-out\"{hint}",
                    v.value
                ),
            );
        }
    }
    middle_out
}

fn policies() -> [(&'static str, PolicyKind); 2] {
    PolicyKind::ALL.map(|p| (p.as_str(), p))
}

/// `"auto"` (default), `"off"`, or a delay in ms (> 0).
/// A share between 0 and 1 (`default` when absent or out of range, which is reported).
fn share(t: &mut Table, key: &'static str, default: f64, issues: &mut Issues) -> f64 {
    match t.get::<f64>(key, issues) {
        Some(v) if !(0.0..=1.0).contains(&v.value) => {
            issues.report(
                v.at,
                &v.path,
                format!("expected a share between 0 and 1, got {}", v.value),
            );
            default
        }
        Some(v) => v.value,
        None => default,
    }
}

fn read_hedge(t: &mut Table, issues: &mut Issues) -> Hedge {
    let Some(raw) = t.raw("hedge") else {
        return Hedge::Auto;
    };
    match raw.get_ref() {
        DeValue::String(s) if s == "auto" => return Hedge::Auto,
        DeValue::String(s) if s == "off" => return Hedge::Off,
        DeValue::Integer(_) => {
            if let Some(ms) = u64::from_toml(raw.get_ref()).filter(|&ms| ms > 0) {
                return Hedge::AfterMs(ms);
            }
        }
        _ => {}
    }
    let hint = raw
        .get_ref()
        .as_str()
        .and_then(|s| did_you_mean(s, ["auto", "off"]))
        .map(|m| format!("; did you mean `{m}`?"))
        .unwrap_or_default();
    let got = issues.got(raw);
    issues.report(
        raw.span().start,
        &t.field_path("hedge"),
        format!("expected \"auto\", \"off\" or a delay in ms (> 0), got {got}{hint}"),
    );
    Hedge::Auto
}

/// The pool's variants: at least one, unique names, not all of weight 0. Protocols may mix:
/// a variant that speaks the other protocol than the client is reached through translation.
fn read_variants(
    t: &mut Table,
    up: &Inherited,
    warnings: &mut Vec<String>,
    issues: &mut Issues,
) -> Vec<VariantConfig> {
    let before = issues.count();
    let tables = t.tables("variants", issues);
    if tables.is_empty() {
        if issues.count() == before {
            issues.report(
                t.raw("variants").map(|v| v.span().start).unwrap_or(t.at()),
                &t.field_path("variants"),
                "at least one [[pools.variants]] table is required",
            );
        }
        return Vec::new();
    }
    let pool_forward = super::forward::read(t, issues);
    // Defaults for variants that set no cap of their own.
    let pool_connections = variant::connection_cap(t, issues);
    let pool_pending = t.value::<u32>("max_pending", issues);
    let wanted = tables.len();
    let mut parsed: Vec<variant::ParsedVariant> = Vec::new();
    let mut taken = Vec::new();
    for vt in tables {
        if let Some(v) = variant::read(vt, &mut taken, up.env, warnings, issues) {
            parsed.push(v);
        }
    }
    // Only when every variant was read: a broken one might have had a weight.
    if parsed.len() == wanted && parsed.iter().all(|v| v.cfg.weight == 0) {
        issues.report(
            t.raw("variants").map(|v| v.span().start).unwrap_or(t.at()),
            &t.field_path("variants"),
            "every variant has weight 0; at least one must take traffic",
        );
    }
    parsed
        .into_iter()
        .map(|v| {
            let forward = v.forward.or_else(|| pool_forward.clone());
            let max_connections = v.cfg.max_connections.or(pool_connections);
            let max_pending = v.cfg.max_pending.or(pool_pending);
            if max_connections.is_none() && max_pending.is_some_and(|p| p > 0) {
                warnings.push(format!(
                    "{}: variant `{}` sets max_pending but no max_connections: nothing waits for a connection, max_pending has no effect",
                    t.field_path("variants"),
                    v.cfg.name
                ));
            }
            VariantConfig {
                forward_headers: forward
                    .unwrap_or_else(|| super::forward::defaults(&v.cfg.dialect)),
                max_connections,
                max_pending,
                ..v.cfg
            }
        })
        .collect()
}
