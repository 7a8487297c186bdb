//! `[[keys]]` (virtual keys: a hashed secret, a tenant, the pools it may use, its limits and
//! budgets, a tier floor and a priority), `[admin]` (the admin key's hash) and `[quota]` (what
//! admission does when the quota store cannot answer).
//!
//! Only SHA-256 hashes of the secrets are ever written in the config (`keel keys new` prints
//! one); the plain key is never stored, logged or shown in metrics.

use std::collections::HashMap;

use keel_core::queue::Priority;
use sha2::{Digest, Sha256};

use super::read::{Issues, Table, Val};
use super::PoolConfig;

/// SHA-256 of a secret.
pub fn hash_secret(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// `sha256:<hex>`, as the config writes a hash.
pub fn hash_text(hash: &[u8; 32]) -> String {
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// One virtual key.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyConfig {
    /// A name for metrics, logs and the admin endpoint (never the secret).
    pub id: String,
    /// SHA-256 of the secret.
    pub hash: [u8; 32],
    pub tenant: String,
    /// The canonical names of the pools the key may use; empty = all.
    pub pools: Vec<String>,
    pub rpm: Option<u64>,
    pub tpm: Option<u64>,
    pub max_concurrency: Option<u64>,
    pub daily_tokens: Option<u64>,
    pub monthly_tokens: Option<u64>,
    /// Spend budgets in micro-dollars (the config writes USD).
    pub daily_spend_micros: Option<u64>,
    pub monthly_spend_micros: Option<u64>,
    /// The key's requests only go to variants of this tier or better.
    pub min_tier: Option<u8>,
    pub priority: Priority,
    /// Prompt normalization for the key's requests (`normalize`), over the pool's mode; a
    /// request's `x-keel-normalize` still wins where `client_normalize` allows it.
    pub normalize: Option<keel_core::normalize::Mode>,
    /// `roles` has `ops`: the key may read the operations plane (`/keel/*` reads and
    /// `/metrics`: every tenant's traffic). Changing the gateway still needs the admin key.
    pub ops: bool,
    /// `roles` has `tenant` (the default when `roles` is not written): the key may call the
    /// data plane. A key for a metrics scraper is `roles = ["ops"]`: it can spend nothing.
    pub tenant_role: bool,
    /// The modes the key's clients may choose with `x-keel-normalize` (`client_normalize`);
    /// replaces the pool's list when written.
    pub client_normalize: Option<Vec<keel_core::normalize::Mode>>,
    /// `guard = { request = {...}, answer = {...} }`: the key's PII and secret policies, over
    /// its pool's (entry by entry).
    pub guard: Option<super::guard::KeyGuard>,
}

impl KeyConfig {
    /// Whether the key may use the pool named `pool` (a canonical pool name).
    pub fn allows(&self, pool: &str) -> bool {
        self.pools.is_empty() || self.pools.iter().any(|p| p == pool)
    }
}

/// What admission does when the quota store cannot answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailMode {
    /// Admit the request (counted in `keel_quota_store_errors_total`, logged once a minute).
    #[default]
    Open,
    /// Refuse it with 503 and `retry-after` of one second.
    Closed,
}

const FAIL_MODES: [(&str, FailMode); 2] = [("open", FailMode::Open), ("closed", FailMode::Closed)];

const PRIORITIES: [(&str, Priority); 3] = [
    ("high", Priority::High),
    ("normal", Priority::Normal),
    ("low", Priority::Low),
];

/// Parses `sha256:<64 hex digits>`.
pub fn parse_hash(s: &str) -> Result<[u8; 32], String> {
    let hex = s.strip_prefix("sha256:").ok_or_else(|| {
        format!("expected \"sha256:<64 hex digits>\" (see `keel keys new`), got {s:?}")
    })?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "expected 64 hex digits after \"sha256:\", got {} characters{}",
            hex.len(),
            if hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                ""
            } else {
                " (not all hex digits)"
            }
        ));
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// SHA-256 hashes of the example keys published in keel's repository (their secrets are public
/// beside them), with where. A deployment copied from an example must not start with a key that
/// anybody can present: `keel check` and startup refuse them (a test keeps this list equal to
/// the hashes the repository's examples hold).
pub const PUBLISHED_EXAMPLE_HASHES: &[(&str, &str)] = &[
    (
        "a89fe531231b61f60c3796aba78129756bdb8f1fbe3a128d346ae9c5ccab9b01",
        "deploy/k8s/secret.yaml (admin)",
    ),
    (
        "a22da5424debdce056f0bd1907316a922d67cdc7754661c879e91106a4e6008b",
        "deploy/k8s/secret.yaml (checkout)",
    ),
    (
        "13b544883bbe88b0f1b675d5fd7f8f137891a5f0fae6335730b857942a499203",
        "deploy/k8s/secret.yaml (support)",
    ),
];

/// Secrets anyone would try first; a key whose hash is one of theirs is refused as well.
const GUESSABLE_SECRETS: &[&str] = &[
    "", "test", "secret", "password", "changeme", "admin", "keel", "sk-keel", "sk-test", "1234",
    "12345678",
];

/// Why a key with this hash must not be accepted, if it is a published or guessable one.
pub fn known_secret(hash: &[u8; 32]) -> Option<String> {
    let hex = hash_text(hash);
    let hex = hex.trim_start_matches("sha256:");
    if let Some((_, at)) = PUBLISHED_EXAMPLE_HASHES.iter().find(|(h, _)| *h == hex) {
        return Some(format!(
            "this is the hash of an example key whose secret is published in keel's repository ({at}): anyone could present it; make a fresh key with `keel keys new`"
        ));
    }
    GUESSABLE_SECRETS
        .iter()
        .any(|s| hash_secret(s) == *hash)
        .then(|| {
            "this is the hash of a guessable secret; make a fresh key with `keel keys new`"
                .to_owned()
        })
}

/// A hash field: `key = "sha256:…"`, reported where it is written when malformed or when it
/// is the hash of a published or guessable secret.
fn hash_field(v: Option<Val<String>>, issues: &mut Issues) -> Option<[u8; 32]> {
    let v = v?;
    match parse_hash(&v.value) {
        Ok(h) => {
            if let Some(why) = known_secret(&h) {
                issues.report(v.at, &v.path, why);
                return None;
            }
            Some(h)
        }
        Err(m) => {
            issues.report(v.at, &v.path, m);
            None
        }
    }
}

/// A positive limit (0 would refuse everything: a mistake, reported).
fn positive(t: &mut Table, key: &'static str, issues: &mut Issues) -> Option<u64> {
    let v = t.get::<u64>(key, issues)?;
    if v.value == 0 {
        issues.report(v.at, &v.path, "expected a positive number, got 0");
        return None;
    }
    Some(v.value)
}

/// A USD amount as micro-dollars.
fn usd(t: &mut Table, key: &'static str, issues: &mut Issues) -> Option<u64> {
    let v = t.get::<f64>(key, issues)?;
    if !(v.value.is_finite() && v.value > 0.0) {
        issues.report(
            v.at,
            &v.path,
            format!("expected a positive amount of USD, got {}", v.value),
        );
        return None;
    }
    Some((v.value * 1e6).round() as u64)
}

/// `[[keys]]`: ids and hashes unique, pools known (by name or alias).
pub(super) fn read_keys(
    tables: Vec<Table>,
    pools: &[PoolConfig],
    issues: &mut Issues,
) -> Vec<KeyConfig> {
    let patterns = super::guard::pattern_names(pools);
    let mut ids: HashMap<String, String> = HashMap::new();
    let mut hashes: HashMap<[u8; 32], String> = HashMap::new();
    let mut keys = Vec::new();
    for mut t in tables {
        let here = t.path().to_owned();
        let id = t.required::<String>("id", "a name for the key", issues);
        let hash = t.required::<String>("hash", "\"sha256:<64 hex digits>\"", issues);
        let hash_at = hash.as_ref().map(|h| (h.at, h.path.clone()));
        let hash = hash_field(hash, issues);
        let tenant = t.get::<String>("tenant", issues).map(|v| v.value);
        let pool_names = t.strings("pools", issues);
        let mut allowed = Vec::new();
        for p in pool_names {
            let found = pools
                .iter()
                .find(|c| c.name == p.value || c.aliases.contains(&p.value));
            match found {
                Some(c) => allowed.push(c.name.clone()),
                None => {
                    let known: Vec<&str> = pools.iter().map(|c| c.name.as_str()).collect();
                    issues.report(
                        p.at,
                        &p.path,
                        format!(
                            "unknown pool `{}`; known pools: {}",
                            p.value,
                            known.join(", ")
                        ),
                    );
                }
            }
        }
        let min_tier = match t.get::<u8>("min_tier", issues) {
            Some(v) if v.value == 0 => {
                issues.report(v.at, &v.path, "expected a tier number (1 = best), got 0");
                None
            }
            v => v.map(|v| v.value),
        };
        let priority = t
            .choice("priority", &PRIORITIES, issues)
            .map(|v| v.value)
            .unwrap_or_default();
        let normalize = t
            .choice("normalize", &super::pool::NORMALIZE_MODES, issues)
            .map(|v| v.value);
        let roles_written = t.raw("roles").is_some();
        let (mut ops, mut tenant_role) = (false, !roles_written);
        for role in t.strings("roles", issues) {
            match role.value.as_str() {
                "ops" => ops = true,
                "tenant" => tenant_role = true,
                other => issues.report(
                    role.at,
                    &role.path,
                    format!("unknown role `{other}`; the roles are: tenant, ops"),
                ),
            }
        }
        let client_normalize = super::normalize::read_client_modes(&mut t, issues);
        let guard = {
            let g = t.table("guard", issues);
            super::guard::read_key(g, &patterns, issues)
        };
        let key = KeyConfig {
            guard,
            id: String::new(),
            hash: [0; 32],
            tenant: String::new(),
            pools: allowed,
            rpm: positive(&mut t, "rpm", issues),
            tpm: positive(&mut t, "tpm", issues),
            max_concurrency: positive(&mut t, "max_concurrency", issues),
            daily_tokens: positive(&mut t, "daily_tokens", issues),
            monthly_tokens: positive(&mut t, "monthly_tokens", issues),
            daily_spend_micros: usd(&mut t, "daily_spend_usd", issues),
            monthly_spend_micros: usd(&mut t, "monthly_spend_usd", issues),
            min_tier,
            priority,
            normalize,
            ops,
            tenant_role,
            client_normalize,
        };
        t.finish(issues);
        let (Some(id), Some(hash)) = (id, hash) else {
            continue;
        };
        if let Some(first) = ids.insert(id.value.clone(), here.clone()) {
            issues.report(
                id.at,
                &id.path,
                format!("duplicate key id `{}` (also {first})", id.value),
            );
            continue;
        }
        if let Some(first) = hashes.insert(hash, here.clone()) {
            if let Some((at, path)) = hash_at {
                issues.report(
                    at,
                    &path,
                    format!("the same hash as {first}: two keys cannot share a secret"),
                );
            }
            continue;
        }
        keys.push(KeyConfig {
            tenant: tenant.unwrap_or_else(|| id.value.clone()),
            id: id.value,
            hash,
            ..key
        });
    }
    keys
}

/// `[admin]`: `key_hash`.
pub(super) fn read_admin(t: Option<Table>, issues: &mut Issues) -> Option<[u8; 32]> {
    let mut t = t?;
    let hash = hash_field(t.get::<String>("key_hash", issues), issues);
    t.finish(issues);
    hash
}

/// How long a concurrency slot outlives a replica that stopped renewing it (crashed), unless
/// `[quota] slot_ttl_ms` says otherwise.
pub const DEFAULT_SLOT_TTL_MS: u64 = 30_000;

/// `[quota]`: `fail_mode`, `slot_ttl_ms`.
pub(super) fn read_quota(t: Option<Table>, issues: &mut Issues) -> (FailMode, u64) {
    let Some(mut t) = t else {
        return (FailMode::default(), DEFAULT_SLOT_TTL_MS);
    };
    let mode = t
        .choice("fail_mode", &FAIL_MODES, issues)
        .map(|v| v.value)
        .unwrap_or_default();
    let ttl = t
        .value::<u64>("slot_ttl_ms", issues)
        .unwrap_or(DEFAULT_SLOT_TTL_MS)
        .max(100);
    t.finish(issues);
    (mode, ttl)
}
