//! Shared signals: replicas tell each other what they learned about variants (`[redis]
//! share_signals`, on by default with `[redis]`).
//!
//! **What is shared.** A replica that ejected a variant (or finds it refusing connections),
//! cooled it down (a `retry-after`, a connect error, a refused credential) or learned its
//! concurrency limit from a 429 publishes a [`Signal`] on the Redis pub/sub channel
//! `{key_prefix}signals`. A variant is named by pool name + variant name, so replicas must share
//! those names (they run the same config).
//!
//! **How a replica finds what to publish.** Not through hooks on the request path: the task
//! here looks at each variant's own state every [`TICK`] (25 ms) ([`Pool::findings`]) and publishes
//! what changed. The request path pays nothing, and a finding reaches the others within a tick
//! plus one Redis round trip.
//!
//! **Leases.** An ejection or cooldown is published as a lease: again every third of the TTL
//! while this replica still sees it, and a `recovered` signal when its ejection ends. A
//! replica that dies, or loses Redis, stops renewing, and its word lapses within the TTL.
//! A learned limit is published once, when it drops.
//!
//! **Merge rule (a replica receiving a signal).** Its own messages are ignored. What it is told
//! is kept apart from what it measured (`Availability::shared_*`, `Limit::set_shared`), so it
//! is never published again (no echo) and never changes its own health estimates:
//!
//! - `eject`: the variant is a last resort (like a locally ejected one) until
//!   max(current hold, now + min(for_ms, the signal's TTL, this replica's TTL)).
//! - `cooldown`: unavailable until the same bound.
//! - `recovered`: the hold from `eject` ends (a replica that still sees it down renews it
//!   within a third of its TTL).
//! - `limit`: the concurrency limit in force is at most the signalled one (the lowest of those
//!   received while one holds), for the TTL; this replica's own learned limit is untouched.
//!
//! No remote word outlives this replica's own `signal_ttl_ms` without being heard again, and
//! this replica's own evidence wins: a success on the variant ends both holds at once.
//!
//! **Failure.** Redis down never affects a request: publishing happens here, bounded by the
//! connection's 1 s timeout, and the subscription reconnects with backoff (see `link`).

mod link;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::state::pools::Pool;

pub use link::{spawn, Generation};

/// How often the variants' state is looked at and expired caps are lifted. Short: a replica
/// sends a dead variant a request every few tens of milliseconds under load, and each tick
/// only reads a few fields per variant under its pool's lock. (At 100 ms, two replicas often
/// both tried a killed variant before the first one's word arrived; see
/// bench/history/2026-11-30-normalization-cache-rollout-reload.md.)
pub const TICK: Duration = Duration::from_millis(25);

/// What a signal says about a variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Ejected (or refusing connections) at the sender.
    Eject,
    /// Cooled down at the sender for `for_ms`.
    Cooldown,
    /// Concurrency limit learned from a 429 at the sender.
    Limit,
    /// The sender's ejection ended.
    Recovered,
}

impl Kind {
    /// The `kind` label of the signal counters.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Eject => "eject",
            Kind::Cooldown => "cooldown",
            Kind::Limit => "limit",
            Kind::Recovered => "recovered",
        }
    }
}

/// One message on the signals channel (JSON).
///
/// Durations are relative (`for_ms`, `ttl_ms`), not instants: replicas' clocks differ, and
/// pub/sub delivers at once or never, so "for the next N ms" means the same on both sides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Signal {
    /// The sender (random per process): a replica ignores its own messages.
    pub replica: String,
    pub pool: String,
    pub variant: String,
    pub kind: Kind,
    /// How long the sender expects it to hold (`eject`: its TTL; `cooldown`: what is left).
    #[serde(default)]
    pub for_ms: u64,
    /// `limit`: the learned limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// The sender's TTL: the longest anyone should act on this message alone.
    pub ttl_ms: u64,
}

/// What this replica itself measured about a variant, read by the publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Findings {
    /// Ejected, or refusing connections (restarting or dead).
    pub down: bool,
    /// Its own cooldown ends then (monotonic ms; in the past: none).
    pub cooldown_until_ms: u64,
    /// Its own learned concurrency limit (`u32::MAX`: none).
    pub learned_limit: u32,
}

/// What the publisher last said about a variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Said {
    /// When the current `eject` lease was last renewed; `None`: not down.
    eject_at_ms: Option<u64>,
    /// The cooldown last published, and when.
    cooldown_until_ms: u64,
    cooldown_at_ms: u64,
    /// The limit last published (or seen rising since).
    limit: u32,
}

impl Default for Said {
    fn default() -> Self {
        Said {
            eject_at_ms: None,
            cooldown_until_ms: 0,
            cooldown_at_ms: 0,
            limit: u32::MAX,
        }
    }
}

/// One thing to publish: kind, `for_ms`, limit.
pub type News = (Kind, u64, Option<u32>);

/// What to publish about a variant now, given what this replica measured and what it last said.
pub fn news(said: &mut Said, f: Findings, now_ms: u64, ttl_ms: u64) -> Vec<News> {
    let renew_every = ttl_ms / 3;
    let mut out = Vec::new();
    match (f.down, said.eject_at_ms) {
        (true, Some(at)) if now_ms < at + renew_every => {}
        (true, _) => {
            said.eject_at_ms = Some(now_ms);
            out.push((Kind::Eject, ttl_ms, None));
        }
        (false, Some(_)) => {
            said.eject_at_ms = None;
            out.push((Kind::Recovered, 0, None));
        }
        (false, None) => {}
    }
    if f.cooldown_until_ms > now_ms {
        let longer = f.cooldown_until_ms > said.cooldown_until_ms;
        // A cooldown longer than the TTL is renewed like an ejection.
        let lapsing = now_ms >= said.cooldown_at_ms + renew_every;
        if longer || lapsing {
            said.cooldown_until_ms = f.cooldown_until_ms;
            said.cooldown_at_ms = now_ms;
            let left = f.cooldown_until_ms - now_ms;
            out.push((Kind::Cooldown, left.min(ttl_ms), None));
        }
    }
    if f.learned_limit < said.limit {
        out.push((Kind::Limit, ttl_ms, Some(f.learned_limit)));
    }
    // A limit that grew back is not news, but the next drop below the old value is.
    said.limit = f.learned_limit;
    out
}

/// Until when a hold lasts: the later of the current one and now + the shortest of what the
/// sender expects, the sender's TTL and this replica's TTL.
pub fn hold_until(current_ms: u64, now_ms: u64, s: &Signal, own_ttl_ms: u64) -> u64 {
    let trust = s.for_ms.min(s.ttl_ms).min(own_ttl_ms);
    current_ms.max(now_ms.saturating_add(trust))
}

/// Shared concurrency caps in force, by (pool, variant): the cap and when it lapses
/// (the generation's clock, as `Gateway::now_ms` reads it).
#[derive(Debug, Default)]
pub struct Caps(HashMap<(String, String), (u32, u64)>);

impl Caps {
    /// Merges a `limit` signal: the lowest cap while one holds, for the trusted time.
    pub fn merge(&mut self, s: &Signal, now_ms: u64, own_ttl_ms: u64) -> Option<u32> {
        let limit = s.limit?;
        let key = (s.pool.clone(), s.variant.clone());
        let entry = self.0.entry(key).or_insert((u32::MAX, 0));
        if entry.1 <= now_ms {
            *entry = (u32::MAX, 0);
        }
        entry.0 = entry.0.min(limit);
        entry.1 = hold_until(entry.1, now_ms, s, own_ttl_ms);
        Some(entry.0)
    }

    /// Removes the caps that lapsed by `now_ms` and returns their (pool, variant).
    pub fn lapsed(&mut self, now_ms: u64) -> Vec<(String, String)> {
        let gone: Vec<_> = self
            .0
            .iter()
            .filter(|(_, (_, until))| *until <= now_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &gone {
            self.0.remove(k);
        }
        gone
    }
}

/// The pool called `name` (not an alias: replicas name variants by pool name).
fn pool_named<'g>(pools: &'g [Arc<Pool>], name: &str) -> Option<&'g Arc<Pool>> {
    pools.iter().find(|p| p.cfg.name == name)
}
