//! Quota state shared by replicas through Redis (`[redis]` in the config).
//!
//! Every operation is one Lua script (sent as EVALSHA, loaded again when a restarted server
//! has forgotten it), and Redis runs a script atomically: a check and its update cannot
//! interleave with another replica's, so N replicas admit exactly what one would. The scripts
//! (`redis/*.lua`, each prefixed with `redis/prelude.lua`) port `keel_core::quota`:
//!
//! - **Rates** (GCRA): one number per key and limit, the theoretical arrival time, in integer
//!   *microseconds* since the Unix epoch on Redis's own clock (`TIME`), so replicas with skewed
//!   clocks agree. Microseconds because Lua's numbers are doubles, exact only below 2^53: the
//!   epoch in nanoseconds (1.8e18) would not fit, in microseconds (1.8e15) it does. The
//!   arithmetic is `gcra::check`/`charge`/`refund`/`peek` run in microsecond units; the answers
//!   are given back in nanoseconds (×1000). The one difference from the in-memory store: the
//!   time per unit is rounded down to a whole microsecond instead of a nanosecond.
//! - **Budgets**: a hash {start, spent, reserved} per key and (unit, window), with the window
//!   computed here from the caller's `now_unix` and rolled only forward in Redis (a replica
//!   whose clock lags into the previous day cannot reset a newer day's spending). It expires an
//!   hour after its window ends.
//! - **Concurrency slots**: a sorted set of tokens scored by expiry (ms). Acquire drops expired
//!   tokens, counts and adds; release removes. A task here renews the slots this replica holds
//!   every third of their TTL, so a long stream keeps its slot while a replica that dies stops
//!   renewing and its slots come back after the TTL.
//!
//! Amounts come from clients and upstreams and may be absurd (a usage of 2^64 − 1 tokens):
//! the scripts saturate sums and products at 2^53, as `keel_core::quota` saturates at 2^64, so
//! such a key is simply out of tokens or budget, and no reply or expiry time overflows.
//!
//! Keys: `{prefix}{{key id}}:rate:requests`, `…:rate:tokens`, `…:budget:{unit}:{window}`,
//! `…:slots`; the braces make a key's state one Redis Cluster hash slot.
//!
//! Bounded: every call is cut at [`STORE_TIMEOUT`] and any failure (timeout, connection
//! refused, server error) becomes a [`StoreError`], counted in
//! `keel_quota_store_errors_total{op}` and logged at most every ten seconds. The connection is
//! a `ConnectionManager`, which reconnects by itself when the server comes back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Client, FromRedisValue, Script, ScriptInvocation};
use keel_core::quota::budget::{Exhausted, Window};
use keel_core::quota::gcra::{self, Decision, Rate};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::{BudgetSpec, BudgetUnit, Held, Limit, StoreError, Usage, STORE_TIMEOUT};
use crate::config::{redact_url, RedisConfig};
use crate::observe::metrics::Metrics;

#[cfg(test)]
mod test_server;
#[cfg(test)]
mod tests;

/// How long a budget account outlives its window: reservations in flight at the turn settle
/// into the next window and must still find it.
const BUDGET_GRACE_S: u64 = 3_600;
/// How often the renewal task looks again when this replica holds no slot.
const IDLE_RENEWAL: Duration = Duration::from_secs(1);
/// At most one log line per this, however many errors.
const LOG_EVERY_MS: u64 = 10_000;

/// A client for `config.url` and a connection manager on it that connects on first use and
/// reconnects by itself (1 s connect and response timeouts, 10–500 ms between tries). Shared
/// with `signals`, which publishes through the manager and subscribes through the client.
/// A `rediss://` URL connects over TLS (rustls), trusting `ca_file` when set, else the
/// system's roots.
pub(crate) fn connect_lazily(config: &RedisConfig) -> Result<(Client, ConnectionManager), String> {
    let named = |e: ::redis::RedisError| format!("redis {}: {e}", redact_url(&config.url));
    crate::config::install_crypto();
    let client = match &config.ca_pem {
        Some(ca) => Client::build_with_tls(
            config.url.as_str(),
            ::redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca.clone()),
            },
        ),
        None => Client::open(config.url.as_str()),
    }
    .map_err(named)?;
    let manager = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(1)))
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(Duration::from_millis(500));
    let conn = ConnectionManager::new_lazy_with_config(client.clone(), manager).map_err(named)?;
    Ok((client, conn))
}

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(
            include_str!("redis/prelude.lua"),
            include_str!(concat!("redis/", $file))
        ))
    };
}

/// The scripts, hashed once (and loaded into Redis at start, see [`Inner::warm_up`]).
struct Scripts {
    take: Script,
    adjust: Script,
    reserve: Script,
    settle: Script,
    acquire: Script,
    renew: Script,
    usage: Script,
}

impl Scripts {
    fn all(&self) -> [&Script; 7] {
        [
            &self.take,
            &self.adjust,
            &self.reserve,
            &self.settle,
            &self.acquire,
            &self.renew,
            &self.usage,
        ]
    }

    fn new() -> Self {
        Scripts {
            take: script!("take.lua"),
            adjust: script!("adjust.lua"),
            reserve: script!("reserve.lua"),
            settle: script!("settle.lua"),
            acquire: script!("acquire.lua"),
            renew: script!("renew.lua"),
            usage: script!("usage.lua"),
        }
    }
}

/// What the store and its renewal task share.
struct Inner {
    conn: ConnectionManager,
    prefix: String,
    scripts: Scripts,
    metrics: Arc<Metrics>,
    /// Slots this replica holds, to renew: Redis key of the slot set → token → TTL (ms).
    held: Mutex<HashMap<String, HashMap<String, u64>>>,
    errors: ErrorLog,
}

/// Quota state in Redis, shared by every replica that uses the same server and prefix.
pub struct Redis {
    inner: Arc<Inner>,
    /// Wakes the renewal task when a slot with a shorter TTL is taken.
    wake: Arc<Notify>,
    renewer: JoinHandle<()>,
}

/// The renewal task ends with the store: a replica that is gone stops renewing.
impl Drop for Redis {
    fn drop(&mut self) {
        self.renewer.abort();
    }
}

/// A lazily connected manager on `config.url` (the quota store's and the response cache's).
pub(crate) fn connection(config: &RedisConfig) -> Result<ConnectionManager, StoreError> {
    connect_lazily(config)
        .map(|(_, conn)| conn)
        .map_err(StoreError)
}

impl Redis {
    /// A store on `config.url`. The connection is made on first use, so keel starts (and
    /// applies its fail mode) while Redis is down. Must be called inside a tokio runtime.
    pub fn connect(config: &RedisConfig, metrics: Arc<Metrics>) -> Result<Redis, StoreError> {
        let conn = connection(config)?;
        let inner = Arc::new(Inner {
            conn,
            prefix: config.key_prefix.clone(),
            scripts: Scripts::new(),
            metrics,
            held: Mutex::new(HashMap::new()),
            errors: ErrorLog::new(),
        });
        let wake = Arc::new(Notify::new());
        let renewer = tokio::spawn(renew_slots(inner.clone(), wake.clone()));
        Ok(Redis {
            inner,
            wake,
            renewer,
        })
    }

    pub async fn take(
        &self,
        key: &str,
        limit: Limit,
        rate: Rate,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        self.take_at(None, key, limit, rate, cost).await
    }

    /// [`Redis::take`] at `now_us` (`None`: Redis's clock; tests pass one).
    async fn take_at(
        &self,
        now_us: Option<u64>,
        key: &str,
        limit: Limit,
        rate: Rate,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        let r = micros(rate);
        let mut inv = self.inner.scripts.take.prepare_invoke();
        inv.key(self.inner.rate_key(key, limit))
            .arg(clock_arg(now_us))
            .arg(r.period_ns)
            .arg(r.limit)
            .arg(cost);
        let v: Vec<u64> = self.inner.call("take", &inv).await?;
        match v[..] {
            [1, remaining, reset, tat] => Ok(Decision::Allowed {
                tat: tat.saturating_mul(1_000),
                remaining,
                reset_after_ns: reset.saturating_mul(1_000),
            }),
            [0, retry, reset] => Ok(Decision::Denied {
                retry_after_ns: retry.saturating_mul(1_000),
                reset_after_ns: reset.saturating_mul(1_000),
            }),
            _ => Err(self.inner.fail("take", format!("unexpected answer {v:?}"))),
        }
    }

    pub async fn adjust(
        &self,
        key: &str,
        limit: Limit,
        rate: Rate,
        delta: i64,
    ) -> Result<(), StoreError> {
        self.adjust_at(None, key, limit, rate, delta).await
    }

    async fn adjust_at(
        &self,
        now_us: Option<u64>,
        key: &str,
        limit: Limit,
        rate: Rate,
        delta: i64,
    ) -> Result<(), StoreError> {
        let r = micros(rate);
        let mut inv = self.inner.scripts.adjust.prepare_invoke();
        inv.key(self.inner.rate_key(key, limit))
            .arg(clock_arg(now_us))
            .arg(r.period_ns)
            .arg(r.limit)
            .arg(if delta >= 0 { "charge" } else { "refund" })
            .arg(delta.unsigned_abs());
        self.inner.call::<i64>("adjust", &inv).await.map(drop)
    }

    pub async fn reserve(
        &self,
        key: &str,
        budget: BudgetSpec,
        now_unix: u64,
        amount: u64,
    ) -> Result<Result<(), Exhausted>, StoreError> {
        let (start, end) = budget.window.bounds(now_unix);
        let mut inv = self.inner.scripts.reserve.prepare_invoke();
        inv.key(self.inner.budget_key(key, budget))
            .arg(budget.limit)
            .arg(start)
            .arg(end)
            .arg(amount)
            .arg(BUDGET_GRACE_S);
        let v: Vec<u64> = self.inner.call("reserve", &inv).await?;
        match v[..] {
            [1, _] => Ok(Ok(())),
            [0, available] => Ok(Err(Exhausted {
                available,
                retry_after_secs: end - now_unix,
            })),
            _ => Err(self
                .inner
                .fail("reserve", format!("unexpected answer {v:?}"))),
        }
    }

    pub async fn settle(
        &self,
        key: &str,
        budget: BudgetSpec,
        now_unix: u64,
        reserved: u64,
        actual: u64,
    ) -> Result<(), StoreError> {
        let (start, end) = budget.window.bounds(now_unix);
        let mut inv = self.inner.scripts.settle.prepare_invoke();
        inv.key(self.inner.budget_key(key, budget))
            .arg(start)
            .arg(end)
            .arg(reserved)
            .arg(actual)
            .arg(BUDGET_GRACE_S);
        self.inner.call::<i64>("settle", &inv).await.map(drop)
    }

    /// Holds one of `max` slots of `key` for `ttl`, renewed by this replica until released.
    pub async fn acquire(
        &self,
        key: &str,
        max: u64,
        ttl: Duration,
    ) -> Result<Option<Held>, StoreError> {
        // Unique per holder (a label, not a secret): the request-id generator, without dashes.
        let token = crate::wire::request_id::new().replace('-', "");
        let set = self.inner.slots_key(key);
        let ttl_ms = (ttl.as_millis() as u64).max(1);
        let mut inv = self.inner.scripts.acquire.prepare_invoke();
        inv.key(&set).arg("").arg(max).arg(ttl_ms).arg(&token);
        if self.inner.call::<i64>("acquire", &inv).await? == 0 {
            return Ok(None);
        }
        self.inner
            .held()
            .entry(set)
            .or_default()
            .insert(token.clone(), ttl_ms);
        self.wake.notify_one();
        Ok(Some(Held {
            key: key.to_owned(),
            token,
        }))
    }

    /// Gives a slot back. It is no longer renewed even when Redis cannot be told, so at worst
    /// it comes back after its TTL. (A single `ZREM` is atomic: no script needed.)
    pub async fn release(&self, held: &Held) -> Result<(), StoreError> {
        let set = self.inner.slots_key(&held.key);
        {
            let mut all = self.inner.held();
            if let Some(tokens) = all.get_mut(&set) {
                tokens.remove(&held.token);
                if tokens.is_empty() {
                    all.remove(&set);
                }
            }
        }
        let mut cmd = ::redis::cmd("ZREM");
        cmd.arg(&set).arg(&held.token);
        let mut conn = self.inner.conn.clone();
        let answer = tokio::time::timeout(STORE_TIMEOUT, cmd.query_async::<i64>(&mut conn)).await;
        self.inner.answer("release", answer).map(drop)
    }

    pub async fn usage(
        &self,
        key: &str,
        rates: &[(Limit, Rate)],
        budgets: &[BudgetSpec],
        now_unix: u64,
    ) -> Result<Usage, StoreError> {
        let mut inv = self.inner.scripts.usage.prepare_invoke();
        for &(limit, _) in rates {
            inv.key(self.inner.rate_key(key, limit));
        }
        for &b in budgets {
            inv.key(self.inner.budget_key(key, b));
        }
        inv.key(self.inner.slots_key(key)).arg("").arg(rates.len());
        let v: Vec<u64> = self.inner.call("usage", &inv).await?;
        if v.len() != 2 + rates.len() + 3 * budgets.len() {
            return Err(self.inner.fail("usage", format!("unexpected answer {v:?}")));
        }
        let now = v[0];
        let tats = &v[1..1 + rates.len()];
        let accounts = v[1 + rates.len()..v.len() - 1].chunks(3);
        let rates = rates
            .iter()
            .zip(tats)
            .map(|(&(limit, rate), &tat)| {
                let (remaining, reset) = gcra::peek(micros(rate), tat, now);
                (limit, remaining, reset.saturating_mul(1_000))
            })
            .collect();
        let budgets = budgets
            .iter()
            .zip(accounts)
            .map(|(&b, a)| {
                let (start, _) = b.window.bounds(now_unix);
                // The same forward-only roll as the scripts.
                let spent = if start > a[0] { 0 } else { a[1] };
                let used = spent.saturating_add(a[2]);
                (b, used.min(b.limit), b.limit.saturating_sub(used))
            })
            .collect();
        Ok(Usage {
            rates,
            budgets,
            in_flight: v[v.len() - 1],
        })
    }
}

impl Inner {
    /// Connects and loads every script once, when the store starts: otherwise a fresh
    /// replica's first requests paid the connection and a script load (a `NOSCRIPT` answer,
    /// then the script sent whole) within [`STORE_TIMEOUT`], and under load a fail-closed
    /// replica refused them with 503. Failures are left to the requests (Redis may be down:
    /// the fail mode applies then, as at any time).
    async fn warm_up(&self) {
        let mut conn = self.conn.clone();
        for script in self.scripts.all() {
            if script.load_async(&mut conn).await.is_err() {
                return;
            }
        }
    }

    fn rate_key(&self, key: &str, limit: Limit) -> String {
        format!("{}{{{key}}}:rate:{}", self.prefix, limit.as_str())
    }

    /// One account per unit and window: a changed limit in the config keeps what was spent.
    fn budget_key(&self, key: &str, b: BudgetSpec) -> String {
        let unit = match b.unit {
            BudgetUnit::Tokens => "tokens",
            BudgetUnit::Spend => "spend",
        };
        let window = match b.window {
            Window::Day => "day",
            Window::Month => "month",
        };
        format!("{}{{{key}}}:budget:{unit}:{window}", self.prefix)
    }

    fn slots_key(&self, key: &str) -> String {
        format!("{}{{{key}}}:slots", self.prefix)
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashMap<String, u64>>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs a script, bounded by [`STORE_TIMEOUT`].
    async fn call<T: FromRedisValue>(
        &self,
        op: &'static str,
        inv: &ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        let answer = tokio::time::timeout(STORE_TIMEOUT, inv.invoke_async(&mut conn)).await;
        self.answer(op, answer)
    }

    fn answer<T>(
        &self,
        op: &'static str,
        answer: Result<::redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Result<T, StoreError> {
        match answer {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.fail(op, e.to_string())),
            Err(_) => Err(self.fail(op, format!("no answer within {STORE_TIMEOUT:?}"))),
        }
    }

    /// Counts and (rate-limited) logs a failed operation.
    fn fail(&self, op: &'static str, why: String) -> StoreError {
        self.metrics
            .counter("keel_quota_store_errors_total", &[("op", op)])
            .increment(1);
        self.errors.log(op, &why);
        StoreError(format!("redis {op}: {why}"))
    }

    /// Renews every slot this replica holds, one script per key.
    async fn renew_all(&self) {
        let held: Vec<(String, Vec<(String, u64)>)> = self
            .held()
            .iter()
            .map(|(set, tokens)| {
                (
                    set.clone(),
                    tokens.iter().map(|(t, l)| (t.clone(), *l)).collect(),
                )
            })
            .collect();
        for (set, tokens) in held {
            let mut inv = self.scripts.renew.prepare_invoke();
            inv.key(&set).arg("");
            for (token, ttl_ms) in &tokens {
                inv.arg(token).arg(*ttl_ms);
            }
            // A failure is counted and logged; the slots may then expire, which only lets
            // more requests in for a moment.
            let _ = self.call::<i64>("renew", &inv).await;
        }
    }

    /// A third of the shortest TTL held, so two renewals can fail before a slot expires.
    fn renewal_period(&self) -> Duration {
        self.held()
            .values()
            .flat_map(|tokens| tokens.values())
            .min()
            .map(|&ms| Duration::from_millis((ms / 3).max(1)))
            .unwrap_or(IDLE_RENEWAL)
    }
}

/// Keeps this replica's slots alive until released (aborted when the store is dropped).
async fn renew_slots(inner: Arc<Inner>, wake: Arc<Notify>) {
    use tokio::time::{sleep_until, Instant};
    inner.warm_up().await;
    let mut next = Instant::now() + inner.renewal_period();
    loop {
        tokio::select! {
            _ = sleep_until(next) => {
                inner.renew_all().await;
                next = Instant::now() + inner.renewal_period();
            }
            // A new slot, perhaps with a shorter TTL: renew sooner if it needs it (never later,
            // or a steady stream of new slots would postpone renewal forever).
            _ = wake.notified() => next = next.min(Instant::now() + inner.renewal_period()),
        }
    }
}

/// The rate in microsecond units (the field keeps its name: keel_core's arithmetic does not
/// care which unit it counts in).
fn micros(rate: Rate) -> Rate {
    Rate {
        limit: rate.limit,
        period_ns: (rate.period_ns / 1_000).max(1),
    }
}

fn clock_arg(now_us: Option<u64>) -> String {
    now_us.map(|n| n.to_string()).unwrap_or_default()
}

/// One log line per [`LOG_EVERY_MS`] at most, saying how many errors it stands for: a Redis
/// outage under load would otherwise log once per request.
struct ErrorLog {
    origin: Instant,
    /// When the last line was written (ms since `origin`), `u64::MAX` before the first.
    last_ms: AtomicU64,
    unlogged: AtomicU64,
}

impl ErrorLog {
    fn new() -> Self {
        ErrorLog {
            origin: Instant::now(),
            last_ms: AtomicU64::new(u64::MAX),
            unlogged: AtomicU64::new(0),
        }
    }

    fn log(&self, op: &str, why: &str) {
        let now = self.origin.elapsed().as_millis() as u64;
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == u64::MAX || now.saturating_sub(last) >= LOG_EVERY_MS;
        if !due
            || self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let also = self.unlogged.swap(0, Ordering::Relaxed);
        tracing::warn!(
            op,
            error = why,
            also_failed_since_last_line = also,
            "quota store (redis) unavailable; admission applies the configured fail mode"
        );
    }
}
