//! Where cached answers live: an in-process store bounded in bytes with a TTL per entry
//! (moka), and, when `[redis]` is configured, Redis, shared by every replica.
//!
//! Reads try this process first, then Redis (an answer found there is kept here too, for the
//! rest of its TTL); writes go to both. A Redis call that fails or is slow (cut at
//! [`REDIS_TIMEOUT`]) is a miss or a store skipped, counted in
//! `keel_cache_errors_total{op}` — the cache never fails a request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::notification::RemovalCause;
use moka::sync::Cache;
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};

use crate::config::cache::CacheConfig;
use crate::config::RedisConfig;
use crate::metrics::Metrics;

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

/// An entry with the time it stops being served.
#[derive(Clone)]
struct Stored {
    entry: Arc<Entry>,
    bytes: u32,
    ttl: Duration,
}

struct ByEntry;

impl moka::Expiry<String, Stored> for ByEntry {
    fn expire_after_create(&self, _: &String, v: &Stored, _: Instant) -> Option<Duration> {
        Some(v.ttl)
    }
}

/// The stores.
pub struct Stores {
    local: Cache<String, Stored>,
    redis: Option<(ConnectionManager, String)>,
    metrics: Arc<Metrics>,
    pub max_entry_bytes: u64,
}

impl Stores {
    /// Must be called inside a tokio runtime when `redis` is given.
    pub fn new(cfg: CacheConfig, redis: Option<&RedisConfig>, metrics: Arc<Metrics>) -> Stores {
        let evictions = metrics.clone();
        let local = Cache::builder()
            .max_capacity(cfg.max_bytes)
            .weigher(|_: &String, v: &Stored| v.bytes)
            .expire_after(ByEntry)
            .eviction_listener(move |_, _, cause| {
                let cause = match cause {
                    RemovalCause::Size => "size",
                    RemovalCause::Expired => "expired",
                    // Replaced or explicitly removed: not an eviction.
                    _ => return,
                };
                evictions
                    .counter("keel_cache_evictions_total", &[("cause", cause)])
                    .increment(1);
            })
            .build();
        let redis = redis.and_then(|r| match crate::quota::redis::connection(r) {
            Ok(conn) => Some((conn, format!("{}cache:", r.key_prefix))),
            Err(e) => {
                tracing::error!(error = %e.0, "[redis] unusable for the response cache: answers stay in this process");
                None
            }
        });
        Stores {
            local,
            redis,
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
        if let Some(s) = self.local.get(key) {
            return Some(s.entry);
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
        self.put_local(key, entry.clone(), bytes.len(), ttl);
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
        self.put_local(key, entry, bytes.len(), ttl);
        if let Some((conn, prefix)) = &self.redis {
            let mut conn = conn.clone();
            let cmd = redis::cmd("SET")
                .arg(format!("{prefix}{key}"))
                .arg(bytes)
                .arg("PX")
                .arg(ttl.as_millis() as u64)
                .clone();
            let me = self.handle();
            tokio::spawn(async move {
                let _: Option<()> = me.redis_call("set", cmd.query_async(&mut conn)).await;
            });
        }
        true
    }

    fn put_local(&self, key: &str, entry: Arc<Entry>, bytes: usize, ttl: Duration) {
        let bytes = u32::try_from(bytes).unwrap_or(u32::MAX);
        self.local.insert(key.to_owned(), Stored { entry, bytes, ttl });
        self.metrics
            .gauge("keel_cache_bytes", &[])
            .set(self.local.weighted_size() as f64);
    }

    /// Entries of this process, for the semantic scan (Redis is not scanned).
    pub fn local_entries(&self) -> impl Iterator<Item = Arc<Entry>> + '_ {
        self.local.iter().map(|(_, s)| s.entry)
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
