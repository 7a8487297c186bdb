//! `[redis]`: where replicas share quota state (rate limits, budgets, in-flight slots). Absent,
//! each replica keeps its own in memory.
//!
//! ```toml
//! [redis]
//! url = "redis://127.0.0.1:6379"   # `${VAR}` allowed, e.g. for a password
//! key_prefix = "keel:"             # every key keel writes starts with it
//! ```

use std::collections::HashMap;
use std::fmt;

use redis::IntoConnectionInfo;

use super::read::{Issues, Table};
use super::variant::interpolate;

/// A Redis server shared by all replicas.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://[user:password@]host[:port][/db]`, environment variables substituted.
    pub url: String,
    pub key_prefix: String,
}

/// The URL may hold a password: never print it.
impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redact(&self.url))
            .field("key_prefix", &self.key_prefix)
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
            // Only plain TCP is compiled in (no TLS, no unix sockets): say so here rather than
            // at the first request.
            let valid = url.starts_with("redis://") && url.as_str().into_connection_info().is_ok();
            if !valid {
                issues.report(
                    u.at,
                    &u.path,
                    format!(
                        "expected a URL such as \"redis://127.0.0.1:6379\", got {:?}",
                        redact(&u.value)
                    ),
                );
                return None;
            }
            Some(url)
        });
    let key_prefix = t
        .value::<String>("key_prefix", issues)
        .unwrap_or_else(|| "keel:".to_owned());
    t.finish(issues);
    Some(RedisConfig {
        url: url?,
        key_prefix,
    })
}
