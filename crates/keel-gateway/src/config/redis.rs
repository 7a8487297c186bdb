//! `[redis]`: where replicas share quota state (rate limits, budgets, in-flight slots) and what
//! they learn about variants (`signals`). Absent, each replica keeps its own in memory.
//!
//! ```toml
//! [redis]
//! url = "redis://127.0.0.1:6379"   # `${VAR}` allowed, e.g. for a password; rediss:// for TLS
//! ca_file = "/etc/keel/redis-ca.pem"  # rediss:// only: the CA that signed the server's certificate
//! key_prefix = "keel:"             # every key keel writes starts with it
//! share_signals = true             # publish/apply ejections, cooldowns, learned limits
//! signal_ttl_ms = 5000             # the longest a replica trusts another's signal
//! ```

use std::collections::HashMap;
use std::fmt;

use redis::IntoConnectionInfo;

use super::read::{interpolate, Issues, Table};

/// A Redis server shared by all replicas.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://[user:password@]host[:port][/db]` (or `rediss://` for TLS), environment
    /// variables substituted.
    pub url: String,
    /// `ca_file`: the CA bundle (PEM, as read) that a `rediss://` server's certificate must
    /// chain to, instead of the system's roots (a private CA).
    pub ca_pem: Option<Vec<u8>>,
    pub key_prefix: String,
    /// Replicas tell each other which variants they ejected, cooled down or found full, on
    /// the channel `{key_prefix}signals` (see `signals`).
    pub share_signals: bool,
    /// The longest a replica acts on another's signal without hearing it again.
    pub signal_ttl_ms: u64,
}

/// Bounds of `signal_ttl_ms`: below, a lease is renewed more often than the monitor looks
/// (every 100 ms); above, a replica that died would hold a variant out of others for long.
const SIGNAL_TTL_MS: std::ops::RangeInclusive<u64> = 300..=600_000;

/// The URL may hold a password: never print it.
impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redact(&self.url))
            .field("ca_pem", &self.ca_pem.as_ref().map(|p| p.len()))
            .field("key_prefix", &self.key_prefix)
            .field("share_signals", &self.share_signals)
            .field("signal_ttl_ms", &self.signal_ttl_ms)
            .finish()
    }
}

/// The URL with any `user:password@` replaced by `***@`, for logs and debug output.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}***{}", &url[..s + 3], &url[at..]),
        _ => url.to_owned(),
    }
}

pub(super) fn read(
    t: Option<Table>,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> Option<RedisConfig> {
    let mut t = t?;
    let url = t
        .required::<String>("url", "a URL such as \"redis://127.0.0.1:6379\"", issues)
        .and_then(|u| {
            let url = interpolate(&u, env, issues)?;
            // TCP and TLS only (no unix sockets): say so here rather than at the first
            // request.
            let valid = (url.starts_with("redis://") || url.starts_with("rediss://"))
                && url.as_str().into_connection_info().is_ok();
            if !valid {
                issues.report(
                    u.at,
                    &u.path,
                    format!(
                        "expected a URL such as \"redis://127.0.0.1:6379\" or \"rediss://redis.internal:6380\", got {:?}",
                        redact(&u.value)
                    ),
                );
                return None;
            }
            Some(url)
        });
    let ca_pem = t.get::<String>("ca_file", issues).and_then(|c| {
        if url.as_ref().is_some_and(|u| !u.starts_with("rediss://")) {
            issues.report(
                c.at,
                &c.path,
                "ca_file needs a rediss:// url (TLS); this one is plain redis://",
            );
            return None;
        }
        crate::config::pem::ca_bundle(&c.value)
            .map_err(|m| issues.report(c.at, &c.path, m))
            .ok()
    });
    let key_prefix = t
        .value::<String>("key_prefix", issues)
        .unwrap_or_else(|| "keel:".to_owned());
    let share_signals = t.value::<bool>("share_signals", issues).unwrap_or(true);
    let signal_ttl_ms = match t.get::<u64>("signal_ttl_ms", issues) {
        Some(v) if !SIGNAL_TTL_MS.contains(&v.value) => {
            issues.report(
                v.at,
                &v.path,
                format!(
                    "expected {}..={} (ms), got {}",
                    SIGNAL_TTL_MS.start(),
                    SIGNAL_TTL_MS.end(),
                    v.value
                ),
            );
            None
        }
        v => Some(v.map_or(5_000, |v| v.value)),
    };
    t.finish(issues);
    Some(RedisConfig {
        url: url?,
        ca_pem,
        key_prefix,
        share_signals,
        signal_ttl_ms: signal_ttl_ms?,
    })
}
