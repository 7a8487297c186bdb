//! Where cached answers live: an in-process store bounded in bytes with a TTL per entry (a
//! least-recently-used map, `lru`, with the bytes counted here), and, when `[redis]` is
//! configured, Redis, shared by every replica.
//!
//! In process: an entry past its TTL is dropped when it is read or when it reaches the
//! least-recently-used end (`keel_cache_evictions_total{cause="expired"}`); while the entries
//! weigh more than `[cache] max_bytes`, the least recently used go (`cause="size"`). An entry
//! weighs its serialized size.
//!
//! Reads try this process first, then Redis (an answer found there is kept here too, for the
//! rest of its TTL); writes go to both. A Redis call that fails or is slow (cut at
//! [`REDIS_TIMEOUT`]) is a miss or a store skipped, counted in
//! `keel_cache_errors_total{op}` — the cache never fails a request. Entries with an embedding
//! (the semantic mode) are also indexed in Redis for other replicas' near-prompt lookups (see
//! `semantic_index`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lru::LruCache;
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};

use crate::config::cache::CacheConfig;
use crate::config::RedisConfig;
use crate::observe::metrics::Metrics;

use super::semantic_index::SemanticIndex;

/// A Redis call's longest wait: a cache read slower than this is worth less than a miss.
pub const REDIS_TIMEOUT: Duration = Duration::from_millis(100);

/// One stored answer: the whole response the client was given, in the shape of the client's
/// endpoint (a streamed hit is rebuilt from it, see `replay`), and what replay needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// The request whose answer this is (a hit's decision record names it).
    pub request_id: String,
    /// The variant that generated it.
    pub variant: String,
    /// The whole answer (Chat completion, text completion or Anthropic message).
    pub body: serde_json::Value,
    /// Output tokens and the time they took (first token to the end), for paced replay.
    pub output_tokens: u64,
    pub generation_ms: u64,
    /// The prompt's embedding and the key of its other parameters, for the semantic mode
    /// (empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub embedding: Vec<f32>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub parameters: String,
}

/// An entry, its weight and the time it stops being served.
struct Stored {
    entry: Arc<Entry>,
    bytes: u64,
    expires: Instant,
}

/// The in-process store: most recently used first, its total weight, and its bound.
struct Local {
    map: LruCache<String, Stored>,
    bytes: u64,
    max_bytes: u64,
}

impl Local {
    /// The live entry under `key` (an expired one is dropped), marked as just used.
    fn get(
        &mut self,
        key: &str,
        now: Instant,
        evicted: &mut Vec<&'static str>,
    ) -> Option<Arc<Entry>> {
        let live = self.map.get(key).map(|s| s.expires > now)?;
        if live {
            return self.map.get(key).map(|s| s.entry.clone());
        }
        if let Some(old) = self.map.pop(key) {
            self.bytes -= old.bytes;
            evicted.push("expired");
        }
        None
    }

    /// Inserts, then drops expired entries from the least-recently-used end and, while over
    /// the bound, the least recently used.
    fn put(&mut self, key: String, stored: Stored, now: Instant, evicted: &mut Vec<&'static str>) {
        self.bytes += stored.bytes;
        if let Some(old) = self.map.put(key, stored) {
            self.bytes -= old.bytes;
        }
        while let Some((_, oldest)) = self.map.peek_lru() {
            let cause = if oldest.expires <= now {
                "expired"
            } else if self.bytes > self.max_bytes {
                "size"
            } else {
                break;
            };
            if let Some((_, old)) = self.map.pop_lru() {
                self.bytes -= old.bytes;
                evicted.push(cause);
            }
        }
    }
}

/// The stores.
pub struct Stores {
    local: Mutex<Local>,
    redis: Option<(ConnectionManager, String)>,
    /// The semantic mode's index, on the same connection.
    index: Option<SemanticIndex>,
    metrics: Arc<Metrics>,
    pub max_entry_bytes: u64,
}

impl Stores {
    /// Must be called inside a tokio runtime when `redis` is given.
    pub fn new(cfg: CacheConfig, redis: Option<&RedisConfig>, metrics: Arc<Metrics>) -> Stores {
        let local = Mutex::new(Local {
            map: LruCache::unbounded(),
            bytes: 0,
            max_bytes: cfg.max_bytes,
        });
        let redis = redis.and_then(|r| match crate::state::quota::redis::connection(r) {
            Ok(conn) => Some((conn, format!("{}cache:", r.key_prefix))),
            Err(e) => {
                tracing::error!(error = %e.0, "[redis] unusable for the response cache: answers stay in this process");
                None
            }
        });
        let index = redis
            .as_ref()
            .map(|(conn, prefix)| SemanticIndex::new(conn.clone(), prefix));
        Stores {
            local,
            redis,
            index,
            metrics,
            max_entry_bytes: cfg.max_entry_bytes,
        }
    }

    /// Whether answers are shared through Redis.
    pub fn shared(&self) -> bool {
        self.redis.is_some()
    }

    /// The entry under `key`, from this process or Redis.
    pub async fn get(&self, key: &str, ttl: Duration) -> Option<Arc<Entry>> {
        let mut evicted = Vec::new();
        let found = self.local().get(key, Instant::now(), &mut evicted);
        self.evicted(&evicted);
        if found.is_some() {
            return found;
        }
        let (conn, prefix) = self.redis.as_ref()?;
        let mut conn = conn.clone();
        let cmd = redis::cmd("GET").arg(format!("{prefix}{key}")).clone();
        let got: Option<Vec<u8>> = self.redis_call("get", cmd.query_async(&mut conn)).await?;
        let bytes = got?;
        let entry: Entry = match serde_json::from_slice(&bytes) {
            Ok(e) => e,
            Err(e) => {
                self.error("decode", &e.to_string());
                return None;
            }
        };
        let entry = Arc::new(entry);
        // Kept here for at most the pool's TTL (Redis holds the exact remainder).
        self.put_local(key, entry.clone(), bytes.len() as u64, ttl);
        Some(entry)
    }

    /// Stores `entry` under `key` for `ttl`; false when it is too large to keep.
    pub fn put(&self, key: &str, entry: Arc<Entry>, ttl: Duration) -> bool {
        let bytes = match serde_json::to_vec(&*entry) {
            Ok(b) => b,
            Err(e) => {
                self.error("encode", &e.to_string());
                return false;
            }
        };
        if bytes.len() as u64 > self.max_entry_bytes {
            self.metrics
                .counter("keel_cache_skipped_total", &[("reason", "too_large")])
                .increment(1);
            return false;
        }
        if let Some((conn, prefix)) = &self.redis {
            let mut conn = conn.clone();
            let cmd = redis::cmd("SET")
                .arg(format!("{prefix}{key}"))
                .arg(bytes.as_slice())
                .arg("PX")
                .arg(ttl.as_millis() as u64)
                .clone();
            let me = self.handle();
            // Indexed only once stored, so another replica never finds a key without its entry.
            let index = self
                .index
                .clone()
                .filter(|_| !entry.embedding.is_empty())
                .map(|i| (i, key.to_owned(), entry.clone()));
            tokio::spawn(async move {
                let stored: Option<()> = me.redis_call("set", cmd.query_async(&mut conn)).await;
                if let (Some(()), Some((index, key, e))) = (stored, index) {
                    let add = index.add(&key, &e.parameters, &e.embedding, ttl);
                    me.redis_call("semantic_index", add).await;
                }
            });
        }
        self.put_local(key, entry, bytes.len() as u64, ttl);
        true
    }

    fn local(&self) -> std::sync::MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put_local(&self, key: &str, entry: Arc<Entry>, bytes: u64, ttl: Duration) {
        let now = Instant::now();
        let stored = Stored {
            entry,
            bytes,
            expires: now + ttl,
        };
        let mut evicted = Vec::new();
        let total = {
            let mut local = self.local();
            local.put(key.to_owned(), stored, now, &mut evicted);
            local.bytes
        };
        self.evicted(&evicted);
        self.metrics
            .gauge("keel_cache_bytes", &[])
            .set(total as f64);
    }

    fn evicted(&self, causes: &[&'static str]) {
        for cause in causes {
            self.metrics
                .counter("keel_cache_evictions_total", &[("cause", cause)])
                .increment(1);
        }
    }

    /// The key and distance of the nearest entry any replica indexed for `parameters`, within
    /// `max_distance` (`None` without Redis, or when the lookup fails: a miss).
    pub async fn shared_nearest(
        &self,
        parameters: &str,
        embedding: &[f32],
        max_distance: f64,
    ) -> Option<(f64, String)> {
        let index = self.index.as_ref()?;
        let found = index.nearest(parameters, embedding, max_distance);
        self.redis_call("semantic_scan", found).await?
    }

    /// Live entries of this process, for the semantic scan (other replicas' are found through
    /// [`Stores::shared_nearest`]).
    pub fn local_entries(&self) -> Vec<Arc<Entry>> {
        let now = Instant::now();
        self.local()
            .map
            .iter()
            .filter(|(_, s)| s.expires > now)
            .map(|(_, s)| s.entry.clone())
            .collect()
    }

    /// What a spawned write needs.
    fn handle(&self) -> ErrorCounter {
        ErrorCounter(self.metrics.clone())
    }

    async fn redis_call<T>(
        &self,
        op: &'static str,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Option<T> {
        self.handle().redis_call(op, call).await
    }

    fn error(&self, op: &'static str, why: &str) {
        self.handle().error(op, why)
    }
}

/// Counts (and logs at debug) failed cache-store operations.
struct ErrorCounter(Arc<Metrics>);

impl ErrorCounter {
    async fn redis_call<T>(
        &self,
        op: &'static str,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Option<T> {
        match tokio::time::timeout(REDIS_TIMEOUT, call).await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                self.error(op, &e.to_string());
                None
            }
            Err(_) => {
                self.error(op, "timed out");
                None
            }
        }
    }

    fn error(&self, op: &'static str, why: &str) {
        tracing::debug!(op, error = why, "response cache store failed");
        self.0
            .counter("keel_cache_errors_total", &[("op", op)])
            .increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(bytes: u64, expires: Instant) -> Stored {
        Stored {
            entry: Arc::new(Entry {
                request_id: "r".into(),
                variant: "v".into(),
                body: serde_json::json!({}),
                output_tokens: 0,
                generation_ms: 0,
                embedding: Vec::new(),
                parameters: String::new(),
            }),
            bytes,
            expires,
        }
    }

    #[test]
    fn the_least_recently_used_go_when_over_the_bound_and_the_expired_when_seen() {
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let mut l = Local {
            map: LruCache::unbounded(),
            bytes: 0,
            max_bytes: 100,
        };
        let mut ev = Vec::new();
        l.put("a".into(), stored(40, later), now, &mut ev);
        l.put("b".into(), stored(40, later), now, &mut ev);
        assert!(l.get("a", now, &mut ev).is_some()); // a is now the most recent
        l.put("c".into(), stored(40, later), now, &mut ev);
        assert_eq!(ev, ["size"]);
        assert!(
            l.get("b", now, &mut ev).is_none(),
            "b was the least recently used"
        );
        assert_eq!(l.bytes, 80);
        // Replacing an entry counts its weight once.
        l.put("c".into(), stored(10, later), now, &mut ev);
        assert_eq!(l.bytes, 50);
        // Past its TTL an entry is not served, and is dropped.
        assert!(l.get("a", later, &mut ev).is_none());
        assert_eq!(ev, ["size", "expired"]);
        assert_eq!(l.bytes, 10);
        // An expired entry at the old end is dropped by the next insert.
        l.put(
            "d".into(),
            stored(10, later + Duration::from_secs(60)),
            later,
            &mut ev,
        );
        assert_eq!(ev, ["size", "expired", "expired"]);
        assert_eq!(l.bytes, 10);
    }
}
