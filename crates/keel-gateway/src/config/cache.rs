//! The response cache's settings: `[pools.cache]` per pool (which requests are cached, for how
//! long, how hits are replayed) and the top-level `[cache]` (the in-process store's size).
//!
//! ```toml
//! [cache]
//! max_bytes = 67108864        # the in-process store, all pools together (default 64 MiB)
//! max_entry_bytes = 1048576   # larger answers are not stored (default 1 MiB)
//!
//! [pools.cache]
//! enabled = true              # default true once the table is written; no table: off
//! ttl_ms = 300000             # how long an answer is served (default 5 min)
//! max_temperature = 0.0       # requests sampling hotter are not cached (none given: 1.0)
//! allow_tools = false         # cache requests that declare tools
//! pace_replay = false         # replay a streamed hit at the recorded token rate
//! coalesce = true             # identical concurrent requests go upstream once
//! semantic = { embeddings_pool = "embed", max_distance = 0.05 }   # optional, off by default
//! ```

use super::read::{Issues, Table};

/// `[pools.cache]`.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolCacheConfig {
    pub enabled: bool,
    pub ttl_ms: u64,
    pub max_temperature: f64,
    pub allow_tools: bool,
    pub pace_replay: bool,
    pub coalesce: bool,
    pub semantic: Option<SemanticConfig>,
}

/// `[pools.cache] semantic`: near-identical prompts answered from the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct SemanticConfig {
    /// The pool whose embeddings compare prompts (it must serve `/v1/embeddings`).
    pub embeddings_pool: String,
    /// Largest cosine distance (1 − cosine similarity) that still hits, in [0, 1].
    pub max_distance: f64,
    /// Where `embeddings_pool` is written (checked once every pool is read).
    pub(super) at: usize,
}

impl Default for PoolCacheConfig {
    fn default() -> Self {
        PoolCacheConfig {
            enabled: false,
            ttl_ms: 300_000,
            max_temperature: 0.0,
            allow_tools: false,
            pace_replay: false,
            coalesce: true,
            semantic: None,
        }
    }
}

/// The top-level `[cache]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    pub max_bytes: u64,
    pub max_entry_bytes: u64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            max_bytes: 64 << 20,
            max_entry_bytes: 1 << 20,
        }
    }
}

pub(super) fn read_global(t: Option<Table>, issues: &mut Issues) -> CacheConfig {
    let d = CacheConfig::default();
    let Some(mut t) = t else {
        return d;
    };
    let c = CacheConfig {
        max_bytes: positive(&mut t, "max_bytes", issues).unwrap_or(d.max_bytes),
        max_entry_bytes: positive(&mut t, "max_entry_bytes", issues).unwrap_or(d.max_entry_bytes),
    };
    t.finish(issues);
    c
}

pub(super) fn read_pool(t: Option<Table>, issues: &mut Issues) -> PoolCacheConfig {
    let d = PoolCacheConfig::default();
    let Some(mut t) = t else {
        return d;
    };
    let max_temperature = match t.get::<f64>("max_temperature", issues) {
        Some(v) if !(0.0..=2.0).contains(&v.value) => {
            issues.report(
                v.at,
                &v.path,
                format!("expected a temperature between 0 and 2, got {}", v.value),
            );
            d.max_temperature
        }
        Some(v) => v.value,
        None => d.max_temperature,
    };
    let semantic = t
        .table("semantic", issues)
        .and_then(|s| read_semantic(s, issues));
    let c = PoolCacheConfig {
        enabled: t.value::<bool>("enabled", issues).unwrap_or(true),
        ttl_ms: positive(&mut t, "ttl_ms", issues).unwrap_or(d.ttl_ms),
        max_temperature,
        allow_tools: t
            .value::<bool>("allow_tools", issues)
            .unwrap_or(d.allow_tools),
        pace_replay: t
            .value::<bool>("pace_replay", issues)
            .unwrap_or(d.pace_replay),
        coalesce: t.value::<bool>("coalesce", issues).unwrap_or(d.coalesce),
        semantic,
    };
    t.finish(issues);
    c
}

fn read_semantic(mut t: Table, issues: &mut Issues) -> Option<SemanticConfig> {
    let pool = t.required::<String>("embeddings_pool", "the name of an embeddings pool", issues);
    let max_distance = match t.get::<f64>("max_distance", issues) {
        Some(v) if !(0.0..=1.0).contains(&v.value) => {
            issues.report(
                v.at,
                &v.path,
                format!(
                    "expected a cosine distance between 0 and 1, got {}",
                    v.value
                ),
            );
            None
        }
        Some(v) => Some(v.value),
        None => Some(0.05),
    };
    t.finish(issues);
    let pool = pool?;
    Some(SemanticConfig {
        embeddings_pool: pool.value,
        max_distance: max_distance?,
        at: pool.at,
    })
}

/// A count that must be at least 1.
fn positive(t: &mut Table, key: &'static str, issues: &mut Issues) -> Option<u64> {
    let v = t.get::<u64>(key, issues)?;
    if v.value == 0 {
        issues.report(v.at, &v.path, "must be at least 1");
        return None;
    }
    Some(v.value)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use crate::config::Config;

    const POOL: &str = "[[pools]]\nname = \"p\"\n";
    const VARIANT: &str = "[[pools.variants]]\nname = \"a\"\nurl = \"http://127.0.0.1:1/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n";

    fn parse(text: &str) -> Result<Config, Vec<(String, String)>> {
        Config::parse(text, "k.toml", &HashMap::new())
            .map_err(|e| e.issues.into_iter().map(|i| (i.field, i.message)).collect())
    }

    #[test]
    fn no_table_is_off_and_a_table_turns_it_on_with_the_documented_defaults() {
        let c = parse(&format!("{POOL}{VARIANT}")).unwrap();
        assert!(!c.pools[0].cache.enabled);
        assert_eq!(c.cache, super::CacheConfig::default());
        let c = parse(&format!(
            "[cache]\nmax_bytes = 1000\n{POOL}[pools.cache]\n{VARIANT}"
        ))
        .unwrap();
        let p = &c.pools[0].cache;
        assert!(p.enabled && p.coalesce && !p.allow_tools && !p.pace_replay);
        assert_eq!(
            (p.ttl_ms, p.max_temperature, p.semantic.clone()),
            (300_000, 0.0, None)
        );
        assert_eq!(c.cache.max_bytes, 1000);
        let c = parse(&format!(
            "{POOL}[pools.cache]\nttl_ms = 5\nmax_temperature = 0.5\nallow_tools = true\npace_replay = true\ncoalesce = false\nsemantic = {{ embeddings_pool = \"p\", max_distance = 0.2 }}\n{VARIANT}"
        ))
        .unwrap();
        let p = &c.pools[0].cache;
        assert_eq!((p.ttl_ms, p.max_temperature), (5, 0.5));
        assert!(p.allow_tools && p.pace_replay && !p.coalesce);
        let s = p.semantic.as_ref().unwrap();
        assert_eq!((s.embeddings_pool.as_str(), s.max_distance), ("p", 0.2));
    }

    #[test]
    fn bad_values_and_unknown_keys_name_the_field() {
        let bad =
            |table: &str| parse(&format!("{POOL}[pools.cache]\n{table}\n{VARIANT}")).unwrap_err();
        let one = |table: &str, field: &str, says: &str| {
            let e = bad(table);
            assert_eq!(e.len(), 1, "{e:?}");
            assert_eq!(e[0].0, field, "{e:?}");
            assert!(e[0].1.contains(says), "{e:?}");
        };
        one("ttl = 5", "pools[0].cache.ttl", "unknown");
        one("ttl_ms = 0", "pools[0].cache.ttl_ms", "at least 1");
        one(
            "max_temperature = 3.0",
            "pools[0].cache.max_temperature",
            "between 0 and 2",
        );
        one(
            "enabled = \"yes\"",
            "pools[0].cache.enabled",
            "true or false",
        );
        one(
            "semantic = { embeddings_pool = \"nope\" }",
            "pools[0].cache.semantic.embeddings_pool",
            "no pool is named `nope`",
        );
        one(
            "semantic = { embeddings_pool = \"p\", max_distance = 1.5 }",
            "pools[0].cache.semantic.max_distance",
            "between 0 and 1",
        );
        let e = parse(&format!("[cache]\nmax_bytes = 0\n{POOL}{VARIANT}")).unwrap_err();
        assert_eq!(e[0].0, "cache.max_bytes");
    }
}
