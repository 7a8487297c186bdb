//! A simulated response cache: requests replayed in the order they started through an LRU
//! store bounded in bytes, entries served for a TTL from the end of the request that stored
//! them, and identical requests that start while the first is still in flight answered by it
//! (the cache's coalescing). Time is the requests' own (milliseconds), never a clock.
//!
//! Only what the real cache would store is stored: a successful answer of a request cacheable
//! by the pool's policy. An entry weighs an estimate of the stored answer
//! ([`entry_bytes`]: the access log holds the output's tokens, not its bytes).

use std::collections::{BTreeMap, HashMap};

/// The estimated weight of a stored answer of `tokens_out` tokens: a response envelope and
/// the cache entry's own fields, and about four bytes of text per token as JSON.
pub fn entry_bytes(tokens_out: u64) -> u64 {
    600 + 5 * tokens_out
}

/// One stored answer.
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// When the request that stores it started: identical requests from then on coalesce.
    from_ms: i64,
    expires_ms: i64,
    bytes: u64,
    /// Its place in the recency order.
    seq: u64,
}

/// What the simulated cache did with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replayed {
    /// Answered from the cache (or by an identical request in flight).
    Hit,
    /// Went upstream; its answer was stored when `stored`.
    Miss { stored: bool },
    /// Not cacheable: went upstream.
    Bypass,
}

/// The simulated cache (see the module doc).
#[derive(Debug)]
pub struct SimCache {
    slots: HashMap<u64, Slot>,
    order: BTreeMap<u64, u64>,
    next_seq: u64,
    bytes: u64,
    max_bytes: u64,
}

impl SimCache {
    /// A store of `max_bytes`.
    pub fn new(max_bytes: u64) -> SimCache {
        SimCache {
            slots: HashMap::new(),
            order: BTreeMap::new(),
            next_seq: 0,
            bytes: 0,
            max_bytes,
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    fn touch(&mut self, key: u64) {
        if let Some(s) = self.slots.get_mut(&key) {
            self.order.remove(&s.seq);
            s.seq = self.next_seq;
            self.order.insert(self.next_seq, key);
            self.next_seq += 1;
        }
    }

    fn remove(&mut self, key: u64) {
        if let Some(s) = self.slots.remove(&key) {
            self.order.remove(&s.seq);
            self.bytes -= s.bytes;
        }
    }

    /// One request that started at `start_ms` and ended at `end_ms`: `cacheable` by the
    /// pool's policy, `ok` when its answer was complete (storable), `ttl_ms` the pool's.
    pub fn request(&mut self, r: &Request) -> Replayed {
        if !r.cacheable {
            return Replayed::Bypass;
        }
        match self.slots.get(&r.key).copied() {
            Some(s) if s.from_ms <= r.start_ms && r.start_ms < s.expires_ms => {
                self.touch(r.key);
                return Replayed::Hit;
            }
            Some(_) => self.remove(r.key),
            None => {}
        }
        if !r.ok {
            return Replayed::Miss { stored: false };
        }
        let bytes = entry_bytes(r.tokens_out);
        if bytes > self.max_bytes {
            return Replayed::Miss { stored: false };
        }
        let slot = Slot {
            from_ms: r.start_ms,
            expires_ms: r.end_ms.max(r.start_ms).saturating_add(r.ttl_ms as i64),
            bytes,
            seq: self.next_seq,
        };
        self.order.insert(self.next_seq, r.key);
        self.next_seq += 1;
        self.slots.insert(r.key, slot);
        self.bytes += bytes;
        self.evict(r.start_ms);
        Replayed::Miss { stored: true }
    }

    /// Drops expired entries from the least-recently-used end, then the least recently used
    /// while over the byte budget (as the real store does).
    fn evict(&mut self, now_ms: i64) {
        while let Some((_, &key)) = self.order.first_key_value() {
            let s = self.slots[&key];
            if s.expires_ms <= now_ms || self.bytes > self.max_bytes {
                self.remove(key);
            } else {
                break;
            }
        }
    }
}

/// A request as the simulated cache sees it.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    pub key: u64,
    pub start_ms: i64,
    pub end_ms: i64,
    pub ttl_ms: u64,
    pub cacheable: bool,
    pub ok: bool,
    pub tokens_out: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: u64, start_ms: i64, end_ms: i64) -> Request {
        Request {
            key,
            start_ms,
            end_ms,
            ttl_ms: 1000,
            cacheable: true,
            ok: true,
            tokens_out: 10,
        }
    }

    #[test]
    fn repeats_hit_within_the_ttl_and_miss_after() {
        let mut c = SimCache::new(1 << 20);
        assert_eq!(c.request(&req(1, 0, 100)), Replayed::Miss { stored: true });
        assert_eq!(c.request(&req(1, 500, 510)), Replayed::Hit);
        // In flight: coalesced.
        assert_eq!(c.request(&req(1, 50, 60)), Replayed::Hit);
        // The TTL runs from the end of the storing request.
        assert_eq!(c.request(&req(1, 1099, 1100)), Replayed::Hit);
        assert_eq!(
            c.request(&req(1, 1100, 1200)),
            Replayed::Miss { stored: true }
        );
        assert_eq!(c.request(&req(2, 0, 1)), Replayed::Miss { stored: true });
    }

    #[test]
    fn failures_and_uncacheable_requests_store_nothing() {
        let mut c = SimCache::new(1 << 20);
        let failed = Request {
            ok: false,
            ..req(1, 0, 10)
        };
        assert_eq!(c.request(&failed), Replayed::Miss { stored: false });
        assert_eq!(c.request(&req(1, 20, 30)), Replayed::Miss { stored: true });
        let hot = Request {
            cacheable: false,
            ..req(1, 40, 50)
        };
        assert_eq!(c.request(&hot), Replayed::Bypass);
    }

    #[test]
    fn the_byte_budget_evicts_the_least_recently_used() {
        let one = entry_bytes(10);
        let mut c = SimCache::new(one * 2);
        c.request(&req(1, 0, 1));
        c.request(&req(2, 1, 2));
        assert_eq!(c.request(&req(1, 3, 4)), Replayed::Hit);
        c.request(&req(3, 5, 6));
        assert_eq!(c.len(), 2);
        // 2 was the least recently used.
        assert_eq!(c.request(&req(1, 7, 8)), Replayed::Hit);
        assert_eq!(c.request(&req(2, 9, 10)), Replayed::Miss { stored: true });
    }
}
