//! The semantic mode's index in Redis, so that a replica finds a near prompt that another
//! replica answered (exact keys are shared through the stores alone; a near match needs the
//! embeddings).
//!
//! Per parameters fingerprint (namespace, endpoint, pool and every non-prompt field: only
//! entries that could answer the request at all), two Redis keys:
//! `{prefix}cache:sem:{parameters}:at` — a sorted set of cache keys scored by the entry's expiry
//! (Unix ms) — and `…:vec`, a hash from cache key to the prompt's embedding (little-endian
//! `f32`s). Adding an entry drops the expired ones and, past [`MAX_PER_PARAMETERS`], those that
//! expire soonest, in one script; a lookup reads the live keys and their embeddings in one
//! script and compares them here. The entry itself is read through the stores under its key
//! (its own TTL in Redis stays the authority: an indexed key whose entry is gone is a miss).
//! Every call is bounded like the stores' ([`REDIS_TIMEOUT`]) and a failure is a miss.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::aio::ConnectionManager;
use redis::Script;

use keel_core::cache_key;

use super::store::REDIS_TIMEOUT;

/// Entries kept per parameters fingerprint (a lookup compares at most this many embeddings).
pub const MAX_PER_PARAMETERS: usize = 1024;

const ADD: &str = r#"
local now, expires, member, vector, max, ttl =
    tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6]
local function drop(members)
    for _, m in ipairs(members) do redis.call('HDEL', KEYS[2], m) end
end
drop(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now))
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], expires, member)
redis.call('HSET', KEYS[2], member, vector)
local over = redis.call('ZCARD', KEYS[1]) - max
if over > 0 then
    drop(redis.call('ZRANGE', KEYS[1], 0, over - 1))
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1)
end
if tonumber(redis.call('PTTL', KEYS[1])) < tonumber(ttl) then
    redis.call('PEXPIRE', KEYS[1], ttl)
    redis.call('PEXPIRE', KEYS[2], ttl)
end
return 1
"#;

const SCAN: &str = r#"
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf')
if #live == 0 then return {{}, {}} end
return {live, redis.call('HMGET', KEYS[2], unpack(live))}
"#;

/// The index on one Redis connection.
#[derive(Clone)]
pub struct SemanticIndex {
    conn: ConnectionManager,
    prefix: String,
    add: Script,
    scan: Script,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn encode(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn decode(b: &[u8]) -> Option<Vec<f32>> {
    b.len().is_multiple_of(4).then(|| {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    })
}

impl SemanticIndex {
    /// `prefix` is the stores' (`{key_prefix}cache:`).
    pub fn new(conn: ConnectionManager, prefix: &str) -> SemanticIndex {
        SemanticIndex {
            conn,
            prefix: format!("{prefix}sem:"),
            add: Script::new(ADD),
            scan: Script::new(SCAN),
        }
    }

    fn keys(&self, parameters: &str) -> [String; 2] {
        let base = format!("{}{parameters}", self.prefix);
        [format!("{base}:at"), format!("{base}:vec")]
    }

    /// Indexes the entry stored under `key`.
    pub async fn add(
        &self,
        key: &str,
        parameters: &str,
        embedding: &[f32],
        ttl: Duration,
    ) -> redis::RedisResult<()> {
        let now = now_ms();
        let ttl_ms = ttl.as_millis() as u64;
        let mut inv = self.add.prepare_invoke();
        for k in self.keys(parameters) {
            inv.key(k);
        }
        inv.arg(now)
            .arg(now + ttl_ms)
            .arg(key)
            .arg(encode(embedding))
            .arg(MAX_PER_PARAMETERS)
            .arg(ttl_ms.max(1));
        let mut conn = self.conn.clone();
        let _: i64 = bounded(inv.invoke_async(&mut conn)).await?;
        Ok(())
    }

    /// The nearest indexed entry's key and distance, if any is within `max_distance`.
    pub async fn nearest(
        &self,
        parameters: &str,
        embedding: &[f32],
        max_distance: f64,
    ) -> redis::RedisResult<Option<(f64, String)>> {
        let mut inv = self.scan.prepare_invoke();
        for k in self.keys(parameters) {
            inv.key(k);
        }
        inv.arg(now_ms());
        let mut conn = self.conn.clone();
        let (keys, vectors): (Vec<String>, Vec<Option<Vec<u8>>>) =
            bounded(inv.invoke_async(&mut conn)).await?;
        Ok(keys
            .into_iter()
            .zip(vectors)
            .filter_map(|(k, v)| {
                let d = cache_key::cosine_distance(embedding, &decode(&v?)?);
                (d <= max_distance).then_some((d, k))
            })
            .min_by(|a, b| a.0.total_cmp(&b.0)))
    }
}

/// A call cut at [`REDIS_TIMEOUT`].
async fn bounded<T>(
    call: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> redis::RedisResult<T> {
    match tokio::time::timeout(REDIS_TIMEOUT, call).await {
        Ok(r) => r,
        Err(_) => Err(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "timed out",
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeddings_round_trip_through_their_bytes() {
        let v = vec![0.25f32, -1.5, 3.0e-7, f32::MAX];
        assert_eq!(decode(&encode(&v)).unwrap(), v);
        assert!(decode(&[1, 2, 3]).is_none());
    }
}
