//! What admission takes for a keyed request, before selection, and gives back when it ends.
//!
//! In two phases, around admission's costly work on the prompt (normalization, token estimate,
//! context fit; see `prompt_work`):
//!
//! 1. [`admit_request`], which needs no token count: a concurrency slot (`max_concurrency`) and
//!    one request (`rpm`). So a key at its limits is refused before keel spends CPU on its
//!    prompt.
//! 2. [`admit_tokens`], once the prompt is estimated: the tokens it may use (`tpm`), and its
//!    budget reservations (tokens: the same count; spend: those tokens at the pool's highest
//!    prices).
//!
//! A refusal is a 429 naming the limit and the key, with `retry-after-ms` exact from GCRA (or
//! the budget window's end); whatever was already taken is given back, except the request taken
//! from `rpm` once the costly work has run (keel's CPU was spent on it). A request that could
//! never fit a limit is a 400 instead: checked on its answers alone before phase 1, so that it
//! takes nothing, and with its prompt in phase 2.
//!
//! **What a request reserves** ([`reservation`]): its estimated prompt plus every answer it may
//! generate, `answers × output`: `answers` is OpenAI's `n` (or `best_of`, when larger), times
//! the variants asked by `x-keel-consensus`, and
//! `output` the request's `max_tokens` (else the pool's largest `default_max_tokens`), bounded by
//! what the pool's largest context window leaves after the prompt when every variant has one (no
//! variant can produce more; a request asking more reserves at most that). Counts come from
//! clients, so every sum and product saturates: a `max_tokens` of 2^64 − 1 reserves what the
//! window leaves, or 2^64 − 1 where no window bounds it (which fits no limit); it never wraps to
//! a small number. Spend is computed in `f64` and converted with Rust's saturating cast.
//!
//! All of it is held in a [`Grant`] that travels in the request's context. When the last
//! context is dropped (the answer has ended, whole or stream, on any path) the grant
//! reconciles: tpm is adjusted by (used − reserved), budgets settle at the real tokens and spend
//! (see `meter`), and the slot is released. Store calls are async, so `Drop` spawns them.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use keel_core::protocol::{ErrorKind, Protocol};
use keel_core::quota::budget::Window;
use keel_core::quota::gcra::{Decision, Rate};
use keel_core::request::CanonicalRequest;

use super::headers::RateView;
use crate::config::{FailMode, KeyConfig};
use crate::observe::meter::{Meter, Totals};
use crate::observe::metrics::Metrics;
use crate::state::pools::Pool;
use crate::state::quota::{BudgetSpec, BudgetUnit, Held, Limit, Store, StoreError, STORE_TIMEOUT};
use crate::wire::errors::GatewayError;

/// Seconds since the Unix epoch (the budgets' calendar clock).
pub fn unix_now() -> u64 {
    unix_now_ms() / 1000
}

pub fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A key's rate limits.
pub fn rates(key: &KeyConfig) -> Vec<(Limit, Rate)> {
    [(Limit::Requests, key.rpm), (Limit::Tokens, key.tpm)]
        .into_iter()
        .filter_map(|(l, r)| r.map(|r| (l, Rate::per_minute(r))))
        .collect()
}

/// A key's budgets.
pub fn budgets(key: &KeyConfig) -> Vec<BudgetSpec> {
    [
        (BudgetUnit::Tokens, Window::Day, key.daily_tokens),
        (BudgetUnit::Tokens, Window::Month, key.monthly_tokens),
        (BudgetUnit::Spend, Window::Day, key.daily_spend_micros),
        (BudgetUnit::Spend, Window::Month, key.monthly_spend_micros),
    ]
    .into_iter()
    .filter_map(|(unit, window, limit)| {
        limit.map(|limit| BudgetSpec {
            unit,
            window,
            limit,
        })
    })
    .collect()
}

/// How a budget is named in messages.
pub fn budget_name(b: &BudgetSpec) -> String {
    let window = match b.window {
        Window::Day => "daily",
        Window::Month => "monthly",
    };
    match b.unit {
        BudgetUnit::Tokens => format!("{window}_tokens budget ({} tokens)", b.limit),
        BudgetUnit::Spend => format!("{window}_spend_usd budget (${:.6})", b.limit as f64 / 1e6),
    }
}

/// A store call bounded by [`STORE_TIMEOUT`].
async fn bounded<T>(
    f: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(STORE_TIMEOUT, f)
        .await
        .unwrap_or_else(|_| Err(StoreError(format!("no answer within {STORE_TIMEOUT:?}"))))
}

/// The client's view of what the request costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost {
    pub tokens: u64,
    pub spend_micros: u64,
}

/// What a pool says about a request's cost: the variants' most generous output default,
/// largest context window and highest prices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolBounds {
    /// The largest `default_max_tokens` (a request without `max_tokens` may get that much).
    pub default_max_tokens: u64,
    /// The largest context window, when every variant has one.
    pub largest_window: Option<u64>,
    /// USD per million tokens, i.e. micro-dollars per token.
    pub price_in: f64,
    pub price_out: f64,
}

impl PoolBounds {
    pub fn of(pool: &Pool) -> PoolBounds {
        let vs = || pool.variants.iter().map(|v| &v.cfg);
        PoolBounds {
            default_max_tokens: vs().map(|v| v.default_max_tokens as u64).max().unwrap_or(0),
            largest_window: pool.largest_window(),
            price_in: vs().map(|v| v.price_input_per_mtok).fold(0.0, f64::max),
            price_out: vs().map(|v| v.price_output_per_mtok).fold(0.0, f64::max),
        }
    }
}

/// Micro-dollars as a whole number, rounded up; a cast from `f64` saturates (and NaN, which
/// non-negative prices cannot make, is 0).
fn micros(x: f64) -> u64 {
    x.ceil() as u64
}

/// What a request reserves (see the module doc): `input` estimated prompt tokens, and, for an
/// endpoint that generates, `answers` answers of up to `max_tokens` each (the pool's default
/// when absent), each bounded by what the largest window leaves after the prompt. Saturating.
pub fn reservation(
    bounds: &PoolBounds,
    generates: bool,
    input: u64,
    max_tokens: Option<u64>,
    answers: u64,
) -> Cost {
    let output = if generates {
        let asked = max_tokens.unwrap_or(bounds.default_max_tokens);
        let per_answer = match bounds.largest_window {
            Some(w) => asked.min(w.saturating_sub(input)),
            None => asked,
        };
        per_answer.saturating_mul(answers.max(1))
    } else {
        0
    };
    Cost {
        tokens: input.saturating_add(output),
        spend_micros: micros(input as f64 * bounds.price_in + output as f64 * bounds.price_out),
    }
}

/// The request's reservation in `pool`, with `input` prompt tokens.
fn cost(pool: &Pool, req: &CanonicalRequest, input: u64) -> Cost {
    reservation(
        &PoolBounds::of(pool),
        req.endpoint.generates(),
        input,
        req.max_tokens,
        req.answers,
    )
}

/// What a keyed request holds while it runs; reconciles when dropped.
pub struct Grant {
    pub key: Arc<KeyConfig>,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    estimated_input: u64,
    /// One request taken from `rpm` (given back if the request is refused before the costly
    /// work on its prompt).
    rpm_taken: bool,
    /// The costly work on the prompt has run (phase 2 began): a refusal keeps the request
    /// taken from `rpm`.
    worked: bool,
    /// Tokens reserved from `tpm`.
    tpm_reserved: Option<u64>,
    /// Budget reservations.
    reserved: Vec<(BudgetSpec, u64)>,
    held: Option<Held>,
    /// Refused at admission: nothing was sent, everything is given back.
    refused: bool,
    /// The rate limits as this request left them (for the response headers).
    pub views: Vec<RateView>,
    /// What the attempts used.
    pub meter: Arc<Meter>,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("key", &self.key.id)
            .finish_non_exhaustive()
    }
}

impl Grant {
    /// What to settle, and the metrics, as of now.
    fn settlement(&mut self) -> (Totals, Settle) {
        let totals = if self.refused {
            Totals::default()
        } else {
            self.meter.totals(self.estimated_input)
        };
        let settle = Settle {
            key: self.key.clone(),
            store: self.store.clone(),
            refund_request: self.refused && self.rpm_taken && !self.worked,
            tpm_reserved: self.tpm_reserved,
            reserved: std::mem::take(&mut self.reserved),
            held: self.held.take(),
            totals,
        };
        (totals, settle)
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let (totals, settle) = self.settlement();
        if !self.refused {
            let id = self.key.id.as_str();
            let m = &self.metrics;
            m.counter("keel_tokens_total", &[("key", id), ("direction", "input")])
                .increment(totals.input);
            m.counter("keel_tokens_total", &[("key", id), ("direction", "output")])
                .increment(totals.output);
            m.gauge("keel_spend_total", &[("key", id)])
                .increment(totals.spend_micros as f64 / 1e6);
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(settle.run());
        }
    }
}

/// The store updates of a grant's end.
struct Settle {
    key: Arc<KeyConfig>,
    store: Arc<Store>,
    refund_request: bool,
    tpm_reserved: Option<u64>,
    reserved: Vec<(BudgetSpec, u64)>,
    held: Option<Held>,
    totals: Totals,
}

impl Settle {
    async fn run(self) {
        let id = self.key.id.as_str();
        let mut errors = Vec::new();
        if let Some(held) = &self.held {
            errors.extend(bounded(self.store.release(held)).await.err());
        }
        if let (true, Some(rpm)) = (self.refund_request, self.key.rpm) {
            let r = self
                .store
                .adjust(id, Limit::Requests, Rate::per_minute(rpm), -1);
            errors.extend(bounded(r).await.err());
        }
        let tokens = self.totals.input.saturating_add(self.totals.output);
        if let (Some(reserved), Some(tpm)) = (self.tpm_reserved, self.key.tpm) {
            let delta = (i128::from(tokens) - i128::from(reserved))
                .clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
            if delta != 0 {
                let r = self
                    .store
                    .adjust(id, Limit::Tokens, Rate::per_minute(tpm), delta);
                errors.extend(bounded(r).await.err());
            }
        }
        let now = unix_now();
        for (b, reserved) in &self.reserved {
            let actual = match b.unit {
                BudgetUnit::Tokens => tokens,
                BudgetUnit::Spend => self.totals.spend_micros,
            };
            let r = self.store.settle(id, *b, now, *reserved, actual);
            errors.extend(bounded(r).await.err());
        }
        for e in errors {
            tracing::warn!(key = id, error = %e.0, "quota store: could not settle a request");
        }
    }
}

/// What a key's admission reads of the gateway: the quota store, the metrics, the keys' state
/// (which paces the store's error log) and the quota settings.
pub struct Quotas<'a> {
    pub store: &'a Arc<Store>,
    pub metrics: &'a Arc<Metrics>,
    pub keys: &'a super::Keys,
    pub fail_mode: FailMode,
    pub slot_ttl_ms: u64,
}

/// A refusal: `kind` is the `keel_ratelimited_total` label.
fn refuse(
    q: &Quotas<'_>,
    key: &KeyConfig,
    kind: &'static str,
    wait_ms: u64,
    message: String,
) -> GatewayError {
    q.metrics
        .counter(
            "keel_ratelimited_total",
            &[("key", &key.id), ("kind", kind)],
        )
        .increment(1);
    GatewayError::new(ErrorKind::RateLimited, message).with_retry_after(wait_ms.max(1))
}

/// A store that could not answer: open admits (and counts it), closed refuses with 503.
fn store_failed(q: &Quotas<'_>, key: &KeyConfig, e: StoreError) -> Result<(), GatewayError> {
    q.metrics
        .counter("keel_quota_store_errors_total", &[])
        .increment(1);
    let mode = q.fail_mode;
    if q.keys.should_log_store_error() {
        tracing::warn!(key = %key.id, error = %e.0, fail_mode = ?mode, "quota store unavailable");
    }
    match mode {
        FailMode::Open => Ok(()),
        FailMode::Closed => Err(GatewayError::new(
            ErrorKind::Overloaded,
            "keel's quota store is unavailable; try again shortly",
        )
        .with_retry_after(1000)),
    }
}

/// 400 for a request that exceeds a whole limit; `answers`: how many it asks for.
fn never_fits(key: &KeyConfig, what: &str, needed: u64, limit: &str, answers: u64) -> GatewayError {
    let (counted, lower) = match answers {
        1 => ("estimated prompt + max_tokens".to_owned(), "max_tokens"),
        n => (
            format!("estimated prompt + max_tokens for each of {n} answers (n / best_of)"),
            "max_tokens or n",
        ),
    };
    GatewayError::new(
        ErrorKind::InvalidRequest,
        format!(
            "key `{}`: this request needs {needed} {what} ({counted}) but the key's whole {limit}; it can never fit: lower {lower} or shorten the prompt",
            key.id
        ),
    )
}

/// The 400 for a cost above a whole limit of the key, if any.
fn check_fits(key: &KeyConfig, cost: &Cost, answers: u64) -> Result<(), GatewayError> {
    if let Some(tpm) = key.tpm.filter(|t| cost.tokens > *t) {
        return Err(never_fits(
            key,
            "tokens",
            cost.tokens,
            &format!("tpm limit is {tpm} tokens per minute"),
            answers,
        ));
    }
    for b in budgets(key) {
        let need = match b.unit {
            BudgetUnit::Tokens => cost.tokens,
            BudgetUnit::Spend => cost.spend_micros,
        };
        if need > b.limit {
            let unit = match b.unit {
                BudgetUnit::Tokens => "tokens",
                BudgetUnit::Spend => "micro-dollars",
            };
            return Err(never_fits(key, unit, need, &budget_name(&b), answers));
        }
    }
    Ok(())
}

fn view(limit: Limit, max: u64, d: &Decision) -> RateView {
    let (remaining, reset_ns) = match *d {
        Decision::Allowed {
            remaining,
            reset_after_ns,
            ..
        } => (remaining, reset_after_ns),
        Decision::Denied { reset_after_ns, .. } => (0, reset_after_ns),
    };
    RateView {
        limit,
        max,
        remaining,
        reset_ns,
    }
}

/// A keyed request past phase 1: it holds its slot and its request from `rpm`, not yet its
/// tokens. Dropped, it gives back what it holds.
#[derive(Debug)]
pub struct Pending(Grant);

/// The rate-limit headers of `grant`'s views so far, on a refusal.
fn with_headers(mut e: GatewayError, grant: &Grant, protocol: Protocol) -> GatewayError {
    let mut headers = http::HeaderMap::new();
    super::headers::apply(&mut headers, protocol, &grant.views, unix_now_ms());
    e.headers = Some(Box::new(headers));
    e
}

/// Phase 1: a concurrency slot and one request from `rpm`, or a refusal (carrying the
/// rate-limit headers in `protocol`). A request whose answers alone exceed a whole limit is a
/// 400 before anything is taken.
pub async fn admit_request(
    q: &Quotas<'_>,
    key: &Arc<KeyConfig>,
    pool: &Pool,
    req: &CanonicalRequest,
    protocol: Protocol,
) -> Result<Pending, GatewayError> {
    check_fits(key, &cost(pool, req, 0), req.answers)?;
    let mut grant = Grant {
        key: key.clone(),
        store: q.store.clone(),
        metrics: q.metrics.clone(),
        estimated_input: req.estimated_input_tokens,
        rpm_taken: false,
        worked: false,
        tpm_reserved: None,
        reserved: Vec::new(),
        held: None,
        refused: true,
        views: Vec::new(),
        meter: Arc::default(),
    };
    match take_request(q, &mut grant).await {
        Ok(()) => Ok(Pending(grant)),
        Err(e) => Err(with_headers(e, &grant, protocol)),
    }
}

/// Phase 2, once the prompt is estimated (`req.estimated_input_tokens`): the request's tokens
/// from `tpm` and its budget reservations, or a refusal (carrying the rate-limit headers).
pub async fn admit_tokens(
    q: &Quotas<'_>,
    pending: Pending,
    pool: &Pool,
    req: &CanonicalRequest,
    protocol: Protocol,
) -> Result<Grant, GatewayError> {
    let Pending(mut grant) = pending;
    grant.worked = true;
    grant.estimated_input = req.estimated_input_tokens;
    let cost = cost(pool, req, req.estimated_input_tokens);
    let result = match check_fits(&grant.key, &cost, req.answers) {
        Ok(()) => take_tokens(q, &mut grant, &cost).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => {
            grant.refused = false;
            Ok(grant)
        }
        Err(e) => Err(with_headers(e, &grant, protocol)),
    }
}

/// Phase 1's steps, recording in `grant` what was taken.
async fn take_request(q: &Quotas<'_>, grant: &mut Grant) -> Result<(), GatewayError> {
    let key = grant.key.clone();
    let id = key.id.as_str();
    let store = q.store.clone();
    if let Some(max) = key.max_concurrency {
        // A shared store expires a slot a crashed replica never released.
        // A shared store renews held slots well within the TTL; a crashed replica's come back
        // after it (`[quota] slot_ttl_ms`).
        let ttl = Duration::from_millis(q.slot_ttl_ms);
        match bounded(store.acquire(id, max, ttl)).await {
            Ok(Some(h)) => grant.held = Some(h),
            Ok(None) => {
                return Err(refuse(
                    q,
                    &key,
                    "concurrency",
                    1000,
                    format!(
                        "key `{id}` has reached its max_concurrency of {max} requests in flight"
                    ),
                ))
            }
            Err(e) => store_failed(q, &key, e)?,
        }
    }
    if let Some(max) = key.rpm {
        take_rate(q, grant, Limit::Requests, max, 1).await?;
    }
    Ok(())
}

/// Takes `units` from a rate limit of `max` per minute, recording it in `grant`.
async fn take_rate(
    q: &Quotas<'_>,
    grant: &mut Grant,
    limit: Limit,
    max: u64,
    units: u64,
) -> Result<(), GatewayError> {
    let key = grant.key.clone();
    let id = key.id.as_str();
    match bounded(q.store.take(id, limit, Rate::per_minute(max), units)).await {
        Ok(d) => {
            grant.views.push(view(limit, max, &d));
            if let Decision::Denied { retry_after_ns, .. } = d {
                let (kind, what) = match limit {
                    Limit::Requests => (
                        "requests",
                        format!("rpm limit of {max} requests per minute"),
                    ),
                    Limit::Tokens => (
                        "tokens",
                        format!(
                            "tpm limit of {max} tokens per minute (this request reserves {units})"
                        ),
                    ),
                };
                return Err(refuse(
                    q,
                    &key,
                    kind,
                    retry_after_ns.div_ceil(1_000_000),
                    format!("key `{id}` has reached its {what}"),
                ));
            }
            match limit {
                Limit::Requests => grant.rpm_taken = true,
                Limit::Tokens => grant.tpm_reserved = Some(units),
            }
            Ok(())
        }
        Err(e) => store_failed(q, &key, e),
    }
}

/// Phase 2's steps, recording in `grant` what was taken.
async fn take_tokens(q: &Quotas<'_>, grant: &mut Grant, cost: &Cost) -> Result<(), GatewayError> {
    let key = grant.key.clone();
    let id = key.id.as_str();
    let store = q.store.clone();
    if let Some(max) = key.tpm {
        take_rate(q, grant, Limit::Tokens, max, cost.tokens).await?;
    }
    let now = unix_now();
    for b in budgets(&key) {
        let amount = match b.unit {
            BudgetUnit::Tokens => cost.tokens,
            BudgetUnit::Spend => cost.spend_micros,
        };
        match bounded(store.reserve(id, b, now, amount)).await {
            Ok(Ok(())) => grant.reserved.push((b, amount)),
            Ok(Err(x)) => {
                return Err(refuse(
                    q,
                    &key,
                    "budget",
                    x.retry_after_secs.saturating_mul(1000),
                    format!(
                        "key `{id}` has exhausted its {}: {} left, this request reserves {amount}",
                        budget_name(&b),
                        x.available
                    ),
                ))
            }
            Err(e) => store_failed(q, &key, e)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: PoolBounds = PoolBounds {
        default_max_tokens: 4096,
        largest_window: None,
        price_in: 2.0,
        price_out: 10.0,
    };

    /// Explicit values, so that the result is what a release build computes (a test build
    /// would panic on an overflow instead of wrapping).
    #[test]
    fn a_huge_max_tokens_saturates_or_is_bounded_by_the_window() {
        let r = reservation(&BOUNDS, true, 10, Some(u64::MAX), 1);
        assert_eq!(r.tokens, u64::MAX, "saturates, never wraps to 9");
        assert_eq!(r.spend_micros, u64::MAX);
        let r = reservation(&BOUNDS, true, u64::MAX, Some(u64::MAX), u64::MAX);
        assert_eq!(r.tokens, u64::MAX);
        // With every variant's window known, no answer can be longer than what the largest
        // leaves after the prompt.
        let windowed = PoolBounds {
            largest_window: Some(128_000),
            ..BOUNDS
        };
        let r = reservation(&windowed, true, 1_000, Some(u64::MAX), 1);
        assert_eq!(r.tokens, 128_000);
        assert_eq!(r.spend_micros, 1_000 * 2 + 127_000 * 10);
        let r = reservation(&windowed, true, 200_000, Some(u64::MAX), 1);
        assert_eq!(
            r.tokens, 200_000,
            "a prompt past every window reserves itself"
        );
        // A smaller max_tokens is kept as asked.
        assert_eq!(
            reservation(&windowed, true, 1_000, Some(500), 1).tokens,
            1_500
        );
    }

    #[test]
    fn every_answer_is_reserved() {
        let r = reservation(&BOUNDS, true, 10, Some(100), 128);
        assert_eq!(r.tokens, 10 + 128 * 100);
        assert_eq!(r.spend_micros, 10 * 2 + 128 * 100 * 10);
        // Without max_tokens: the pool's default, per answer.
        assert_eq!(reservation(&BOUNDS, true, 0, None, 3).tokens, 3 * 4096);
        // Each answer bounded by the window, then multiplied.
        let windowed = PoolBounds {
            largest_window: Some(1_000),
            ..BOUNDS
        };
        assert_eq!(
            reservation(&windowed, true, 100, Some(u64::MAX), 128).tokens,
            100 + 128 * 900
        );
        assert_eq!(
            reservation(&windowed, true, 100, Some(u64::MAX), u64::MAX).tokens,
            u64::MAX
        );
        // Embeddings generate nothing.
        assert_eq!(reservation(&BOUNDS, false, 10, Some(100), 128).tokens, 10);
    }
}
