//! Configuration: `keel.toml` read into validated runtime types, with every problem reported at
//! once. Each error names the file, line, column and field, and says what was expected:
//! `keel.toml:14:7: pools[0].variants[1].url: expected an http:// or https:// base URL, got
//! "ftp://x"`.
//!
//! How it reads: the TOML text is parsed once into toml's spanned document tree
//! ([`toml::de::DeTable`]: every key and value keeps its byte range), and then one small parser
//! per section walks its table: top level (here), `timeouts`, `budget` (`[retry_budget]`),
//! `pool`, `variant` and `health`. A section asks its `read::Table` for each key it
//! knows; a value of the wrong type or out of range is recorded in `read::Issues` and the
//! parser carries on with the default, and whatever keys were never asked for are reported as
//! unknown, with a suggestion ("did you mean `weight`?") among the keys that were.
//!
//! Why not serde derive with `deny_unknown_fields` and `Spanned<…>` fields (the previous design)?
//! A derived `Deserialize` stops at the first problem, and its errors point at the enclosing
//! table rather than at the field, so it can neither report every error at once nor name the
//! field of a type error. Only a TOML syntax error stops the reading: past one, the document
//! has no reliable shape.

mod budget;
pub mod cache;
pub mod cloud;
mod forward;
pub mod guard;
mod health;
mod integrity;
mod keys;
mod normalize;
mod observability;
pub mod pem;
mod pool;
mod read;
mod redis;
#[cfg(test)]
mod reference;
mod rollout;
mod safe_mode;
mod timeouts;
mod tls;
mod variant;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;

use toml::de::DeTable;

use keel_core::budget::RetryBudgetConfig;

pub use self::redis::{redact as redact_url, RedisConfig};
pub use integrity::IntegrityConfig;
pub use keel_core::continuation::ResumeMode;
pub use keel_core::selection::PolicyKind;
pub use keys::{hash_secret, hash_text, parse_hash, FailMode, KeyConfig};
pub use observability::{AccessLogTarget, LogConfig, LogFormat, TelemetryConfig};
pub use pem::install_crypto;
pub use pool::{Affinity, Hedge, PoolConfig, ResponseModel};
pub use rollout::{CanaryPoolConfig, Identity, ShadowConfig};
pub use timeouts::Timeouts;
pub use tls::{TlsConfig, UpstreamTls};
pub use variant::VariantConfig;

use read::{Issues, Kind, Table, Val};
use timeouts::TimeoutLayer;

/// How long a keep-alive client connection may wait idle by default: longer than the pool idle
/// timeouts of common clients and load balancers (reqwest and Go 90 s, AWS ALB 60 s), so the
/// client closes an idle connection, never keel while the client may be writing on it.
const DEFAULT_IDLE_TIMEOUT_MS: u64 = 300_000;

/// Connections waiting to be accepted, by default. The runtime's own default (128, the libc
/// `SOMAXCONN`) overflowed under a burst of new connections: a load generator opening
/// connections at 16,000 requests a second while keel's one worker was busy had 3,949 of its
/// SYNs dropped, each retried after 1, 3, 7 s, and the burst's median answer took 6.8 s
/// (bench/history/2026-12-03-overhead-stops-19-20.md). nginx listens with 511; Linux caps the
/// backlog at `net.core.somaxconn`, 4096 by default since 5.4.
const DEFAULT_LISTEN_BACKLOG: u32 = 4096;

/// Client connections open at once, by default: far above what one process serves well (a
/// live stream holds a few KB of keel's memory and a descriptor), far below the descriptor
/// limits a service is given (65,536 and up), so that refusing is what happens past it, not
/// `accept` failing for every client alike.
const DEFAULT_MAX_CONNECTIONS: usize = 10_000;

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    /// `admin_listen`: the operations plane's own address. When set, `/keel/*` and `/metrics`
    /// are served there only (and `/v1/*` only on `listen`), so that a firewall or a Service
    /// can keep them off the tenants' network; liveness and readiness answer on both.
    pub admin_listen: Option<SocketAddr>,
    /// `auth = "open"`: the operator runs keel without keys on purpose. A reload that would drop
    /// every key or the admin key is refused unless the new file says so.
    pub auth_open: bool,
    /// Connections the kernel may hold for keel before it accepts them (`listen(2)`'s
    /// backlog; the kernel caps it at `net.core.somaxconn`).
    pub listen_backlog: u32,
    /// `[tls]`: the listener speaks HTTPS (HTTP/2 or HTTP/1.1 by ALPN); `None`: plain HTTP
    /// and h2c.
    pub tls: Option<TlsConfig>,
    pub max_body_bytes: usize,
    pub header_read_timeout_ms: u64,
    /// How long a keep-alive client connection may wait idle for its next request.
    pub idle_timeout_ms: u64,
    /// The whole request body must arrive within this (slow bodies get 408).
    pub body_read_timeout_ms: u64,
    /// How long a client may take no response bytes while keel has some for it before its
    /// request is dropped (its connection, or its HTTP/2 stream); 0 turns the check off.
    pub client_write_timeout_ms: u64,
    /// Client connections open at once; past it a new one is answered 503 and closed.
    pub max_connections: usize,
    /// Largest whole (non-streamed) upstream response body; more is a `malformed` failure.
    pub max_upstream_body_bytes: usize,
    /// Largest single SSE event from an upstream; more is a `malformed` failure.
    pub max_sse_event_bytes: usize,
    pub drain_ms: u64,
    /// Decision records kept for `/keel/decisions` (a ring: the oldest goes first).
    pub decisions_kept: usize,
    /// Decision records show what prompt normalization changed, as the text around each change
    /// before and after (`prompt_edits`); false (the default) keeps no prompt text in records:
    /// whoever reads the operations plane would read fragments of tenants' prompts.
    pub decision_prompt_edits: bool,
    pub allow_force_variant: bool,
    /// Runtime worker threads for `keel serve` (default: one per core).
    pub worker_threads: Option<usize>,
    pub retry_budget: RetryBudgetConfig,
    pub pools: Vec<PoolConfig>,
    /// Virtual keys (`[[keys]]`); none = keel runs open.
    pub keys: Vec<KeyConfig>,
    /// SHA-256 of the admin key (`[admin] key_hash`), for `/keel/keys/{id}/usage`.
    pub admin_key_hash: Option<[u8; 32]>,
    /// `[quota] fail_mode`.
    pub quota_fail_mode: FailMode,
    /// `[quota] slot_ttl_ms`: a crashed replica's concurrency slots come back after this.
    pub quota_slot_ttl_ms: u64,
    /// `[redis]`: quota state shared by replicas; `None` keeps it in this process.
    pub redis: Option<RedisConfig>,
    /// `[cache]`: the in-process response cache's bounds (pools opt in with `[pools.cache]`).
    pub cache: cache::CacheConfig,
    /// `[log]`: the access log's format and destination.
    pub log: LogConfig,
    /// `[telemetry]`: OpenTelemetry traces (off unless `otlp_endpoint` is set).
    pub telemetry: TelemetryConfig,
    /// `[reload] watch`: re-read the config file when its modification time changes (polled
    /// every second; see `live`).
    pub reload_watch: bool,
    /// Warnings that do not stop the gateway (printed by `keel check` and at start).
    pub warnings: Vec<String>,
}

/// Line and column (1-based; the column counts characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub line: usize,
    pub column: usize,
}

/// One problem in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    pub file: String,
    /// Where in the file; `None` only when the file could not be read.
    pub at: Option<Position>,
    /// The field's path, such as `pools[0].variants[1].url`; empty for a syntax error.
    pub field: String,
    /// What is wrong and what was expected.
    pub message: String,
}

impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:", self.file)?;
        if let Some(Position { line, column }) = self.at {
            write!(f, "{line}:{column}:")?;
        }
        if !self.field.is_empty() {
            write!(f, " {}:", self.field)?;
        }
        write!(f, " {}", self.message)
    }
}

/// Every problem found in a config file, in file order (at least one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub issues: Vec<ConfigIssue>,
}

/// One problem per line.
impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, issue) in self.issues.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{issue}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Reads and validates a file.
    pub fn load(path: &str) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            issues: vec![ConfigIssue {
                file: path.to_owned(),
                at: None,
                field: String::new(),
                message: format!("cannot read: {e}"),
            }],
        })?;
        let env: HashMap<String, String> = std::env::vars().collect();
        Config::parse(&text, path, &env)
    }

    /// Parses TOML text; `origin` names the file in errors; `env` resolves `${VAR}`.
    pub fn parse(
        text: &str,
        origin: &str,
        env: &HashMap<String, String>,
    ) -> Result<Config, ConfigError> {
        let doc = DeTable::parse(text).map_err(|e| {
            let at = read::position(text, e.span().map(|s| s.start).unwrap_or(0));
            ConfigError {
                issues: vec![ConfigIssue {
                    file: origin.to_owned(),
                    at: Some(at),
                    field: String::new(),
                    message: e.message().trim().to_owned(),
                }],
            }
        })?;
        let mut issues = Issues::new(text, origin);
        let config = read_top(
            Table::new(String::new(), 0, doc.get_ref()),
            env,
            &mut issues,
        );
        if issues.count() == 0 {
            Ok(config)
        } else {
            Err(ConfigError {
                issues: issues.into_sorted(),
            })
        }
    }
}

/// The top-level keys, then each section.
fn read_top(mut t: Table, env: &HashMap<String, String>, issues: &mut Issues) -> Config {
    let default_listen = SocketAddr::from(([127, 0, 0, 1], 8080));
    let listen = address(&mut t, "listen", issues).unwrap_or(default_listen);
    let admin_listen = address(&mut t, "admin_listen", issues);
    if admin_listen.is_some_and(|a| a == listen && a.port() != 0) {
        if let Some(v) = t.raw("admin_listen") {
            issues.report(
                v.span().start,
                "admin_listen",
                "must differ from `listen`: the operations plane gets an address of its own",
            );
        }
    }
    let auth_open = match t.get::<String>("auth", issues) {
        None => false,
        Some(v) if v.value == "open" => true,
        Some(v) => {
            issues.report(
                v.at,
                &v.path,
                format!(
                    "expected \"open\" (keel runs without keys on purpose), got {:?}",
                    v.value
                ),
            );
            false
        }
    };
    let listen_backlog = at_least_one(t.get::<u32>("listen_backlog", issues), issues);
    let max_connections = at_least_one(t.get::<usize>("max_connections", issues), issues);
    let max_attempts = at_least_one(t.get::<u32>("max_attempts", issues), issues).unwrap_or(3);
    let worker_threads = at_least_one(t.get::<usize>("worker_threads", issues), issues);
    let decisions_kept = at_least_one(t.get::<usize>("decisions_kept", issues), issues);
    let timeouts = {
        let section = t.table("timeouts", issues);
        TimeoutLayer::read_table(section, issues).over(Timeouts::default())
    };
    let retry_budget = {
        let section = t.table("retry_budget", issues);
        budget::read(section, issues)
    };
    let redis = {
        let section = t.table("redis", issues);
        self::redis::read(section, env, issues)
    };
    let cache = cache::read_global(t.table("cache", issues), issues);
    let tls = tls::read(t.table("tls", issues), issues);
    let mut warnings = Vec::new();
    let pools = read_pools(&mut t, max_attempts, timeouts, env, &mut warnings, issues);
    check_semantic_pools(&pools, issues);
    let keys = {
        let tables = t.tables("keys", issues);
        keys::read_keys(tables, &pools, issues)
    };
    let admin_key_hash = {
        let section = t.table("admin", issues);
        keys::read_admin(section, issues)
    };
    let (quota_fail_mode, quota_slot_ttl_ms) = {
        let section = t.table("quota", issues);
        keys::read_quota(section, issues)
    };
    let log = observability::read_log(t.table("log", issues), issues);
    let telemetry = observability::read_telemetry(t.table("telemetry", issues), issues);
    let reload_watch = t.table("reload", issues).is_some_and(|mut r| {
        let watch = r.value("watch", issues).unwrap_or(false);
        r.finish(issues);
        watch
    });
    if auth_open && !keys.is_empty() {
        if let Some(v) = t.raw("auth") {
            issues.report(
                v.span().start,
                "auth",
                "auth = \"open\" says keel runs without keys, but [[keys]] are configured: remove one or the other",
            );
        }
    }
    let config = Config {
        log,
        telemetry,
        listen,
        admin_listen,
        auth_open,
        listen_backlog: listen_backlog.unwrap_or(DEFAULT_LISTEN_BACKLOG),
        tls,
        max_body_bytes: t
            .value("max_body_bytes", issues)
            .unwrap_or(10 * 1024 * 1024),
        header_read_timeout_ms: t.value("header_read_timeout_ms", issues).unwrap_or(10_000),
        idle_timeout_ms: t
            .value("idle_timeout_ms", issues)
            .unwrap_or(DEFAULT_IDLE_TIMEOUT_MS),
        body_read_timeout_ms: t.value("body_read_timeout_ms", issues).unwrap_or(30_000),
        client_write_timeout_ms: t.value("client_write_timeout_ms", issues).unwrap_or(30_000),
        max_connections: max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS),
        max_upstream_body_bytes: t
            .value("max_upstream_body_bytes", issues)
            .unwrap_or(64 * 1024 * 1024),
        max_sse_event_bytes: t
            .value("max_sse_event_bytes", issues)
            .unwrap_or(4 * 1024 * 1024),
        drain_ms: t.value("drain_ms", issues).unwrap_or(30_000),
        decisions_kept: decisions_kept.unwrap_or(10_000),
        decision_prompt_edits: t.value("decision_prompt_edits", issues).unwrap_or(false),
        allow_force_variant: t.value("allow_force_variant", issues).unwrap_or(false),
        worker_threads,
        retry_budget,
        pools,
        keys,
        admin_key_hash,
        quota_fail_mode,
        quota_slot_ttl_ms,
        redis,
        reload_watch,

        cache,
        warnings,
    };
    t.finish(issues);
    config
}

/// A socket address, reported where it is written when malformed.
fn address(t: &mut Table, key: &'static str, issues: &mut Issues) -> Option<SocketAddr> {
    let v = t.get::<String>(key, issues)?;
    match v.value.parse() {
        Ok(a) => Some(a),
        Err(_) => {
            issues.report(
                v.at,
                &v.path,
                format!(
                    "expected an address such as \"127.0.0.1:8080\", got {:?}",
                    v.value
                ),
            );
            None
        }
    }
}

/// A semantic cache's `embeddings_pool` must name a pool (checked once every pool is read).
fn check_semantic_pools(pools: &[PoolConfig], issues: &mut Issues) {
    for (i, p) in pools.iter().enumerate() {
        let Some(s) = &p.cache.semantic else { continue };
        if !pools.iter().any(|q| q.name == s.embeddings_pool) {
            issues.report(
                s.at,
                &format!("pools[{i}].cache.semantic.embeddings_pool"),
                format!("no pool is named `{}`", s.embeddings_pool),
            );
        }
    }
}

/// A count that must be at least 1, reported where it is written.
fn at_least_one<T: Kind + PartialEq + From<u8>>(
    v: Option<Val<T>>,
    issues: &mut Issues,
) -> Option<T> {
    let v = v?;
    if v.value == T::from(0) {
        issues.report(v.at, &v.path, "must be at least 1");
    }
    Some(v.value)
}

/// `[[pools]]`: at least one, and no public model name claimed twice.
fn read_pools(
    t: &mut Table,
    max_attempts: u32,
    timeouts: Timeouts,
    env: &HashMap<String, String>,
    warnings: &mut Vec<String>,
    issues: &mut Issues,
) -> Vec<PoolConfig> {
    let before = issues.count();
    let tables = t.tables("pools", issues);
    if tables.is_empty() && issues.count() == before {
        issues.report(
            t.raw("pools").map(|v| v.span().start).unwrap_or(0),
            "pools",
            "at least one [[pools]] table is required",
        );
    }
    let up = pool::Inherited {
        timeouts,
        max_attempts,
        env,
    };
    let mut names = HashMap::new();
    tables
        .into_iter()
        .map(|pt| pool::read(pt, &up, &mut names, warnings, issues))
        .collect()
}
