//! Workload analysis: what a request's answer could have been reused for, computed from
//! fingerprints that never hold the prompt.
//!
//! - [`fingerprint`]: for one generation request, the response cache's key before and after
//!   normalization (the same [`cache_key::fingerprint`] the cache uses, in the tenant's
//!   namespace), its template id ([`template`]) and whether it is deterministic by policy.
//! - [`replay`]: an LRU + TTL replay of a pool's requests through a simulated response cache
//!   of a given byte budget.
//! - [`report`]: the figures per pool and hour (repeats, templates, entropy, output-length
//!   variation, simulated hit rate, what would be saved) and ranked recommendations.

pub mod recommend;
pub mod replay;
pub mod report;
pub mod template;

use serde_json::{Map, Value};

use crate::cache_key::{self, Policy};
use crate::protocol::Endpoint;

/// What the access log records of a generation request's content: hashes and flags only.
#[derive(Debug, Clone, PartialEq)]
pub struct Fingerprint {
    /// The cache key of the request as the client sent it (no normalization).
    pub key_raw: String,
    /// The cache key after normalization (the pool's mode, or `syntax` where the pool's is
    /// off: what normalizing would merge).
    pub key_norm: String,
    /// The prompt's template id.
    pub template: u64,
    /// Cacheable under the strictest policy: temperature 0, one answer, no tools.
    pub deterministic: bool,
    /// The request's `temperature` (absent: the APIs' default).
    pub temperature: Option<f64>,
    /// The request declares tools.
    pub tools: bool,
    /// The pool normalizes: its cache uses `key_norm` (else `key_raw`, and `key_norm` is what
    /// `syntax` would make of it).
    pub normalizes: bool,
}

impl Fingerprint {
    /// The key the pool's response cache uses for this request.
    pub fn cache_key(&self) -> &str {
        if self.normalizes {
            &self.key_norm
        } else {
            &self.key_raw
        }
    }
}

/// The policy under which a request counts as deterministic.
pub const DETERMINISTIC: Policy = Policy {
    max_temperature: 0.0,
    allow_tools: false,
};

/// Facts of a request body that need no mining: its determinism, temperature and tools.
pub fn policy_facts(endpoint: Endpoint, body: &Map<String, Value>) -> (bool, Option<f64>, bool) {
    let deterministic = cache_key::bypass_reason(endpoint, body, DETERMINISTIC).is_none();
    let temperature = body.get("temperature").and_then(Value::as_f64);
    let tools = body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    (deterministic, temperature, tools)
}

/// A request's fingerprint: `key_raw` is the cache key of the body before normalization
/// ([`cache_key::fingerprint`]), `normalized` the body after it (`unchanged`: normalization
/// changed nothing, so its key is the raw one and is not hashed again); `namespace` and `pool`
/// as the response cache keys them; `mine` gives the masked prompt's template id (a shared
/// [`template::Miner`] behind a lock, held only for that).
pub fn fingerprint(
    namespace: &str,
    endpoint: Endpoint,
    pool: &str,
    (key_raw, unchanged): (String, bool),
    normalized: &Map<String, Value>,
    mine: impl FnOnce(&[u64]) -> u64,
) -> Fingerprint {
    let key_norm = if unchanged {
        key_raw.clone()
    } else {
        cache_key::fingerprint(namespace, endpoint, pool, normalized)
    };
    let template = mine(&template::mask(&cache_key::prompt_text(normalized)));
    let (deterministic, temperature, tools) = policy_facts(endpoint, normalized);
    Fingerprint {
        key_raw,
        key_norm,
        template,
        deterministic,
        temperature,
        tools,
        normalizes: false,
    }
}

/// A template id as the log writes it: 16 hex digits.
pub fn template_hex(id: u64) -> String {
    format!("{id:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_keys_are_the_caches_and_hold_no_text() {
        let raw = body(json!({"model": "m", "temperature": 0,
            "messages": [{"role": "user", "content": "Summarize  order 12"}]}));
        let norm = body(json!({"model": "m", "temperature": 0,
            "messages": [{"role": "user", "content": "Summarize order 12"}]}));
        let mut miner = template::Miner::default();
        let raw_key = |ns: &str| cache_key::fingerprint(ns, Endpoint::ChatCompletions, "p", &raw);
        let f = fingerprint(
            "open",
            Endpoint::ChatCompletions,
            "p",
            (raw_key("open"), false),
            &norm,
            |t| miner.observe_tokens(t),
        );
        assert_eq!(
            f.key_norm,
            cache_key::fingerprint("open", Endpoint::ChatCompletions, "p", &norm)
        );
        assert_ne!(f.key_raw, f.key_norm);
        assert!(f.deterministic && !f.tools);
        assert_eq!(f.temperature, Some(0.0));
        assert!(!format!("{f:?}").contains("Summarize"));
        // Another tenant's identical request has another key.
        let g = fingerprint(
            "tenant:b",
            Endpoint::ChatCompletions,
            "p",
            (raw_key("tenant:b"), false),
            &norm,
            |t| miner.observe_tokens(t),
        );
        assert_ne!(g.key_norm, f.key_norm);
        assert_eq!(g.template, f.template);
        // Sampling or tools: not deterministic.
        let hot = body(json!({"model": "m", "messages": []}));
        assert!(!policy_facts(Endpoint::ChatCompletions, &hot).0);
    }
}
