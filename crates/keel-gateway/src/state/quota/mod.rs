//! Where quota state lives: the per-key rate-limit states (GCRA theoretical arrival times),
//! budget accounts and in-flight slots that admission checks and delivery settles.
//!
//! One replica keeps them in memory ([`local::Local`]); several replicas share them through
//! Redis (`[redis]` in the config), where every operation is one atomic script so that limits
//! hold exactly across replicas. The arithmetic is `keel_core::quota` in both cases. Callers
//! use [`Store`] and never see which.
//!
//! Every operation is keyed by a [`Slot`]: the key id plus what is limited. A store that cannot
//! answer (Redis down or slow) returns [`StoreError`]; admission then applies the configured
//! fail mode (open: admit and count it; closed: refuse with 503), so no request hangs on it.

pub mod local;
pub mod redis;

use std::time::Duration;

use keel_core::quota::budget::{Exhausted, Window};
use keel_core::quota::gcra::{Decision, Rate};

/// What is limited for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    /// Requests per minute.
    Requests,
    /// Tokens (input + output) per minute.
    Tokens,
}

impl Limit {
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::Tokens => "tokens",
        }
    }
}

/// What a budget counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BudgetUnit {
    Tokens,
    /// Micro-dollars, by the variants' price table.
    Spend,
}

/// One budget of a key: `limit` units per `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BudgetSpec {
    pub unit: BudgetUnit,
    pub window: Window,
    pub limit: u64,
}

/// The store could not answer in time (or at all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreError(pub String);

/// A held concurrency slot; give it back with [`Store::release`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub key: String,
    /// The store's token for this slot (Redis: a member of the key's in-flight set).
    pub token: String,
}

/// Bound on every store operation: a slow store must not hold requests.
pub const STORE_TIMEOUT: Duration = Duration::from_millis(50);

/// Quota state, in memory or shared.
pub enum Store {
    Local(local::Local),
    /// Shared by replicas (`[redis]`).
    Redis(redis::Redis),
}

impl Store {
    /// The store the config asks for: shared through Redis with `[redis]`, else in memory.
    /// Must be called inside a tokio runtime (the Redis store renews its slots from a task).
    pub fn from_config(
        redis: Option<&crate::config::RedisConfig>,
        metrics: std::sync::Arc<crate::observe::metrics::Metrics>,
    ) -> Result<Store, StoreError> {
        match redis {
            Some(config) => Ok(Store::Redis(redis::Redis::connect(config, metrics)?)),
            None => Ok(Store::Local(local::Local::default())),
        }
    }

    /// Takes `cost` units of `limit` from `key` at the store's `now` (admits, or says how long
    /// to wait).
    pub async fn take(
        &self,
        key: &str,
        limit: Limit,
        rate: Rate,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        match self {
            Store::Local(s) => Ok(s.take(key, limit, rate, cost)),
            Store::Redis(s) => s.take(key, limit, rate, cost).await,
        }
    }

    /// Adjusts a rate state after the fact: `delta` > 0 charges more (the answer used more
    /// than reserved), < 0 refunds.
    pub async fn adjust(
        &self,
        key: &str,
        limit: Limit,
        rate: Rate,
        delta: i64,
    ) -> Result<(), StoreError> {
        match self {
            Store::Local(s) => {
                s.adjust(key, limit, rate, delta);
                Ok(())
            }
            Store::Redis(s) => s.adjust(key, limit, rate, delta).await,
        }
    }

    /// Reserves `amount` of a budget before the request is sent.
    pub async fn reserve(
        &self,
        key: &str,
        budget: BudgetSpec,
        now_unix: u64,
        amount: u64,
    ) -> Result<Result<(), Exhausted>, StoreError> {
        match self {
            Store::Local(s) => Ok(s.reserve(key, budget, now_unix, amount)),
            Store::Redis(s) => s.reserve(key, budget, now_unix, amount).await,
        }
    }

    /// Replaces a reservation by the real amount when the answer has ended.
    pub async fn settle(
        &self,
        key: &str,
        budget: BudgetSpec,
        now_unix: u64,
        reserved: u64,
        actual: u64,
    ) -> Result<(), StoreError> {
        match self {
            Store::Local(s) => {
                s.settle(key, budget, now_unix, reserved, actual);
                Ok(())
            }
            Store::Redis(s) => s.settle(key, budget, now_unix, reserved, actual).await,
        }
    }

    /// Holds one of `max` concurrency slots of `key`; `None` when all are held. A shared store
    /// expires a slot after `ttl` unless renewed, so a crashed replica's slots come back.
    pub async fn acquire(
        &self,
        key: &str,
        max: u64,
        ttl: Duration,
    ) -> Result<Option<Held>, StoreError> {
        match self {
            Store::Local(s) => Ok(s.acquire(key, max, ttl)),
            Store::Redis(s) => s.acquire(key, max, ttl).await,
        }
    }

    pub async fn release(&self, held: &Held) -> Result<(), StoreError> {
        match self {
            Store::Local(s) => {
                s.release(held);
                Ok(())
            }
            Store::Redis(s) => s.release(held).await,
        }
    }

    /// A key's current usage, for `GET /keel/keys/{id}/usage` and the rate-limit headers.
    pub async fn usage(
        &self,
        key: &str,
        rates: &[(Limit, Rate)],
        budgets: &[BudgetSpec],
        now_unix: u64,
    ) -> Result<Usage, StoreError> {
        match self {
            Store::Local(s) => Ok(s.usage(key, rates, budgets, now_unix)),
            Store::Redis(s) => s.usage(key, rates, budgets, now_unix).await,
        }
    }
}

/// A key's usage at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Usage {
    /// Per rate limit: (limit, remaining now, ns until full again).
    pub rates: Vec<(Limit, u64, u64)>,
    /// Per budget: (budget, spent + reserved, remaining).
    pub budgets: Vec<(BudgetSpec, u64, u64)>,
    pub in_flight: u64,
}
