//! `[[pools.variants]]`: one concrete way to serve a pool's model.
//!
//! Strings in `url`, `api_key`, `upstream_model`, `metrics_url` and `health_url` may use
//! `${ENV_VAR}`; a
//! missing variable is an error (a key silently becoming empty would only show up as 401s in
//! production).

use std::collections::HashMap;
use std::fmt;

use serde_json::{Map, Value};

use keel_core::continuation::ResumeMode;
use keel_core::protocol::Protocol;
use keel_core::tokens::Tokenizer;

use super::read::{interpolate, Issues, Table, Val};

#[derive(Clone, PartialEq)]
pub struct VariantConfig {
    pub name: String,
    /// Base URL as the provider's SDK takes it, without a trailing slash.
    pub url: String,
    /// The protocol the gateway speaks with it: the dialect's hub (see `config::cloud`).
    pub protocol: Protocol,
    /// What the upstream itself speaks, and where and as whom (`protocol` and its keys).
    pub dialect: super::cloud::Dialect,
    pub upstream_model: String,
    /// Never printed: `Debug` redacts it.
    pub api_key: Option<String>,
    pub tier: u8,
    pub context_window: Option<u64>,
    /// How this variant's prompts are counted (`tokenizer`; default inferred from
    /// `upstream_model`, see `keel_core::tokens::Tokenizer::for_model`).
    pub tokenizer: Tokenizer,
    pub max_concurrency: Option<u32>,
    /// Upstream connections keel holds open to the variant at once (`max_connections`, the
    /// variant's or its pool's; `None`: no cap). See `upstream::direct` for how it is held.
    pub max_connections: Option<u32>,
    /// Requests admitted to the variant beyond its connections, each waiting in keel's
    /// connection pool for one (`max_pending`, the variant's or its pool's; 0 when absent).
    /// Past it the variant counts as full for selection (see [`VariantConfig::slot_cap`]).
    pub max_pending: Option<u32>,
    pub weight: u32,
    pub params: Map<String, Value>,
    pub resume: ResumeMode,
    pub price: f64,
    /// USD per million input tokens, for spend budgets (default 0).
    pub price_input_per_mtok: f64,
    /// USD per million output tokens, for spend budgets (default 0).
    pub price_output_per_mtok: f64,
    pub metrics_url: Option<String>,
    /// The server's readiness endpoint (`health_path` on the base URL's origin, or
    /// `health_url`): while the variant is loading, restarting or ejected, the monitor asks it
    /// (a GET; 200 = ready) before sending any generation request.
    pub health_url: Option<String>,
    pub continuation_fields: Map<String, Value>,
    /// `max_tokens` for a Chat Completions request without one translated for this
    /// Anthropic-protocol variant (Anthropic requires it).
    pub default_max_tokens: u32,
    /// The client's headers this variant's requests carry (`forward_headers`: the variant's,
    /// else its pool's, else the defaults of `config::forward`); no other client header
    /// reaches the upstream.
    pub forward_headers: Vec<http::HeaderName>,
    /// A private CA and/or a client certificate for this variant's https:// upstream.
    pub tls: Option<super::UpstreamTls>,
}

impl fmt::Debug for VariantConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VariantConfig")
            .field("name", &self.name)
            .field("url", &super::redact_url(&self.url))
            .field("protocol", &self.protocol)
            .field("dialect", &self.dialect)
            .field("upstream_model", &self.upstream_model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("tier", &self.tier)
            .field("context_window", &self.context_window)
            .field("tokenizer", &self.tokenizer)
            .field("weight", &self.weight)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl VariantConfig {
    /// The requests the variant may have in flight for its connection caps: one per
    /// connection plus those that may wait for one; `None` without `max_connections`.
    pub fn slot_cap(&self) -> Option<u32> {
        self.max_connections
            .map(|c| c.saturating_add(self.max_pending.unwrap_or(0)))
    }
}

const RESUME_MODES: [(&str, ResumeMode); 4] = [
    ("prefill", ResumeMode::Prefill),
    ("completion", ResumeMode::Completion),
    ("instruction", ResumeMode::Instruction),
    ("none", ResumeMode::None),
];

/// The `default_max_tokens` when a variant sets none.
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

/// A variant as read.
pub(super) struct ParsedVariant {
    pub(super) cfg: VariantConfig,
    /// Its own `forward_headers`, if written (the pool's applies otherwise).
    pub(super) forward: Option<Vec<http::HeaderName>>,
}

/// A connection cap (`max_connections`): a positive count, reported otherwise.
pub(super) fn connection_cap(t: &mut Table, issues: &mut Issues) -> Option<u32> {
    let v = t.get::<u32>("max_connections", issues)?;
    if v.value == 0 {
        issues.report(
            v.at,
            &v.path,
            "expected 1 or more connections, got 0 (remove the key for no cap)",
        );
        return None;
    }
    Some(v.value)
}

/// Reads one variant; `taken` holds the names of the pool's earlier variants (this one's is
/// added). `None` when a required field is missing or wrong (already reported).
pub(super) fn read(
    mut t: Table,
    taken: &mut Vec<String>,
    env: &HashMap<String, String>,
    warnings: &mut Vec<String>,
    issues: &mut Issues,
) -> Option<ParsedVariant> {
    let name = t.required::<String>("name", "the variant's name (a string)", issues);
    if let Some(n) = &name {
        if n.value.is_empty() {
            issues.report(n.at, &n.path, "must not be empty");
        } else if taken.contains(&n.value) {
            issues.report(
                n.at,
                &n.path,
                format!("variant name `{}` is used twice in this pool", n.value),
            );
        } else {
            taken.push(n.value.clone());
        }
    }
    let kind = t
        .required_choice("protocol", &super::cloud::PROTOCOLS, issues)
        .map(|k| k.value);
    let url = t
        .required::<String>("url", "an http:// or https:// base URL", issues)
        .and_then(|u| {
            let anthropic = kind.filter(|k| *k == super::cloud::Kind::Anthropic);
            base_url(u, anthropic.map(|k| k.hub()), env, warnings, issues)
        });
    let upstream_model = if super::cloud::model_optional(&mut t, kind) {
        t.get::<String>("upstream_model", issues)
    } else {
        t.required::<String>(
            "upstream_model",
            "the model name the upstream knows",
            issues,
        )
    }
    .and_then(|m| interpolate(&m, env, issues));
    let api_key = t
        .get::<String>("api_key", issues)
        .and_then(|k| interpolate(&k, env, issues));
    let dialect = kind.and_then(|k| super::cloud::read(&mut t, k, api_key.as_deref(), env, issues));
    let tier = match t.get::<u8>("tier", issues) {
        Some(v) if v.value == 0 => {
            issues.report(v.at, &v.path, "expected 1 (best fidelity) or more, got 0");
            1
        }
        Some(v) => v.value,
        None => 1,
    };
    let context_window = t.value::<u64>("context_window", issues);
    let tokenizer = t
        .choice(
            "tokenizer",
            &Tokenizer::ALL.map(|k| (k.as_str(), k)),
            issues,
        )
        .map(|k| k.value);
    let max_concurrency = t.value::<u32>("max_concurrency", issues);
    let max_connections = connection_cap(&mut t, issues);
    let max_pending = t.value::<u32>("max_pending", issues);
    let weight = t.value::<u32>("weight", issues).unwrap_or(1);
    let params = t.json_table("params", issues).unwrap_or_default();
    let resume = t
        .choice("resume", &RESUME_MODES, issues)
        .map(|r| r.value)
        .unwrap_or(match kind {
            // Hosted OpenAI models do not continue a final assistant message.
            Some(super::cloud::Kind::Azure | super::cloud::Kind::OpenAiResponses) => {
                ResumeMode::Instruction
            }
            _ => ResumeMode::Prefill,
        });
    let price = t.value::<f64>("price", issues).unwrap_or(1.0);
    let price_input_per_mtok = token_price(&mut t, "price_input_per_mtok", issues);
    let price_output_per_mtok = token_price(&mut t, "price_output_per_mtok", issues);
    let metrics_url = t
        .get::<String>("metrics_url", issues)
        .and_then(|u| metrics_url(u, env, issues));
    let health_path = t.get::<String>("health_path", issues);
    let health_url = t.get::<String>("health_url", issues);
    let continuation_fields = t
        .json_table("continuation_fields", issues)
        .unwrap_or_else(keel_core::continuation::default_prefill_fields);
    let default_max_tokens = match t.get::<u32>("default_max_tokens", issues) {
        Some(v) if v.value == 0 => {
            issues.report(v.at, &v.path, "expected a positive number of tokens, got 0");
            DEFAULT_MAX_TOKENS
        }
        Some(v) => v.value,
        None => DEFAULT_MAX_TOKENS,
    };
    let forward = super::forward::read(&mut t, issues);
    let tls = super::tls::read_upstream(&mut t, url.as_deref(), issues);
    let resume_path = t.field_path("resume");
    t.finish(issues);

    let health_url = health_endpoint(health_path, health_url, url.as_deref(), env, issues);
    let (name, url, kind, dialect) = (name?, url?, kind?, dialect?);
    // Only an Azure deployment may leave the model out: the deployment names it.
    let upstream_model = match (upstream_model, &dialect) {
        (Some(m), _) => m,
        (None, super::cloud::Dialect::Azure(a)) => a.deployment.clone()?,
        (None, _) => return None,
    };
    let cfg = VariantConfig {
        name: name.value,
        url,
        protocol: kind.hub(),
        dialect,
        tokenizer: tokenizer.unwrap_or_else(|| Tokenizer::for_model(&upstream_model)),
        upstream_model,
        api_key,
        tier,
        context_window,
        max_concurrency,
        max_connections,
        max_pending,
        weight,
        params,
        resume,
        price,
        price_input_per_mtok,
        price_output_per_mtok,
        metrics_url,
        health_url,
        continuation_fields,
        default_max_tokens,
        forward_headers: Vec::new(),
        tls,
    };
    if let Some(why) = resume_misfit(&cfg) {
        warnings.push(format!(
            "{}: `{}` does not fit this variant: {why}",
            resume_path,
            resume_name(cfg.resume)
        ));
    }
    Some(ParsedVariant { cfg, forward })
}

/// The base URL without a trailing slash; an Anthropic base URL loses a `/v1` (with a warning).
fn base_url(
    u: Val<String>,
    protocol: Option<Protocol>,
    env: &HashMap<String, String>,
    warnings: &mut Vec<String>,
    issues: &mut Issues,
) -> Option<String> {
    let mut url = interpolate(&u, env, issues)?
        .trim_end_matches('/')
        .to_owned();
    if !(url.starts_with("http://") || url.starts_with("https://"))
        || url.parse::<http::Uri>().is_err()
    {
        issues.report(
            u.at,
            &u.path,
            format!(
                "expected an http:// or https:// base URL, got {:?}",
                u.value
            ),
        );
        return None;
    }
    if protocol == Some(Protocol::Anthropic) && url.ends_with("/v1") {
        // The Anthropic SDK's base URL has no /v1; accept the common slip.
        url.truncate(url.len() - 3);
        warnings.push(format!(
            "{}: Anthropic base URLs do not end in /v1; using {url}",
            u.path
        ));
    }
    Some(url)
}

fn metrics_url(
    u: Val<String>,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> Option<String> {
    let url = interpolate(&u, env, issues)?;
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        issues.report(
            u.at,
            &u.path,
            format!("expected an http:// or https:// URL, got {url:?}"),
        );
        return None;
    }
    Some(url)
}

/// The readiness endpoint: `health_path` (an absolute path, joined to the origin of the base
/// URL: llama.cpp's and vLLM's `/health` sit beside `/v1`, not under it) or `health_url`
/// (a whole URL); not both.
fn health_endpoint(
    path: Option<Val<String>>,
    url: Option<Val<String>>,
    base: Option<&str>,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> Option<String> {
    match (path, url) {
        (Some(_), Some(u)) => {
            issues.report(
                u.at,
                &u.path,
                "set either health_path or health_url, not both",
            );
            None
        }
        (Some(p), None) => {
            if !p.value.starts_with('/') {
                issues.report(
                    p.at,
                    &p.path,
                    format!(
                        "expected a path starting with `/` (e.g. \"/health\"), got {:?}",
                        p.value
                    ),
                );
                return None;
            }
            let uri = base?.parse::<http::Uri>().ok()?;
            let (scheme, authority) = (uri.scheme_str()?, uri.authority()?);
            Some(format!("{scheme}://{authority}{}", p.value))
        }
        (None, Some(u)) => metrics_url(u, env, issues),
        (None, None) => None,
    }
}

/// Why a variant's resume mode cannot work for it, if it cannot.
fn resume_misfit(v: &VariantConfig) -> Option<&'static str> {
    match (v.resume, v.protocol) {
        (ResumeMode::Completion, Protocol::Anthropic) => {
            Some("Anthropic has no /v1/completions; use `prefill`")
        }
        (ResumeMode::Prefill, Protocol::OpenAi) if v.url.contains("api.openai.com") => Some(
            "OpenAI's hosted API does not continue a final assistant message; use `instruction`",
        ),
        _ => None,
    }
}

fn resume_name(mode: ResumeMode) -> &'static str {
    RESUME_MODES
        .iter()
        .find(|(_, m)| *m == mode)
        .map(|(n, _)| *n)
        .unwrap_or("?")
}

/// A price in USD per million tokens: finite and not negative (0 when absent).
fn token_price(t: &mut Table, key: &'static str, issues: &mut Issues) -> f64 {
    match t.get::<f64>(key, issues) {
        Some(v) if !(v.value.is_finite() && v.value >= 0.0) => {
            issues.report(
                v.at,
                &v.path,
                format!(
                    "expected a price of 0 or more USD per million tokens, got {}",
                    v.value
                ),
            );
            0.0
        }
        Some(v) => v.value,
        None => 0.0,
    }
}
