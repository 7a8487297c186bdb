//! What admission takes for a keyed request, before selection, and gives back when it ends.
//!
//! In order: a concurrency slot (`max_concurrency`), one request (`rpm`), the tokens it may use
//! (`tpm`: estimated input + max_tokens), and its budget reservations (tokens: the same count;
//! spend: those tokens at the pool's highest prices). A refusal is a 429 naming the limit and the
//! key, with `retry-after-ms` exact from GCRA (or the budget window's end); whatever was already
//! taken is given back. A request that could never fit a limit is a 400 instead.
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
use super::meter::{Meter, Totals};
use crate::config::{FailMode, KeyConfig};
use crate::errors::GatewayError;
use crate::metrics::Metrics;
use crate::pools::Pool;
use crate::quota::{BudgetSpec, BudgetUnit, Held, Limit, Store, StoreError, STORE_TIMEOUT};
use crate::Gateway;

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
struct Cost {
    tokens: u64,
    spend_micros: u64,
}

/// Tokens: the estimated prompt plus the most the answer may hold (the request's `max_tokens`,
/// or the pool's largest default). Spend: those tokens at the pool's highest prices.
fn cost(pool: &Pool, req: &CanonicalRequest) -> Cost {
    let vs = pool.variants.iter().map(|v| &v.cfg);
    let max_tokens = if req.endpoint.generates() {
        req.max_tokens.unwrap_or_else(|| {
            vs.clone()
                .map(|v| v.default_max_tokens as u64)
                .max()
                .unwrap_or(0)
        })
    } else {
        0
    };
    let input = req.estimated_input_tokens;
    let price_in = vs
        .clone()
        .map(|v| v.price_input_per_mtok)
        .fold(0.0, f64::max);
    let price_out = vs.map(|v| v.price_output_per_mtok).fold(0.0, f64::max);
    Cost {
        tokens: input + max_tokens,
        spend_micros: (input as f64 * price_in + max_tokens as f64 * price_out).ceil() as u64,
    }
}

/// What a keyed request holds while it runs; reconciles when dropped.
pub struct Grant {
    pub key: Arc<KeyConfig>,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    estimated_input: u64,
    /// One request taken from `rpm` (given back if the request is refused before sending).
    rpm_taken: bool,
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
            refund_request: self.refused && self.rpm_taken,
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
        let tokens = self.totals.input + self.totals.output;
        if let (Some(reserved), Some(tpm)) = (self.tpm_reserved, self.key.tpm) {
            let delta = tokens as i64 - reserved as i64;
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

/// A refusal: `kind` is the `keel_ratelimited_total` label.
fn refuse(
    gw: &Gateway,
    key: &KeyConfig,
    kind: &'static str,
    wait_ms: u64,
    message: String,
) -> GatewayError {
    gw.metrics
        .counter(
            "keel_ratelimited_total",
            &[("key", &key.id), ("kind", kind)],
        )
        .increment(1);
    GatewayError::new(ErrorKind::RateLimited, message).with_retry_after(wait_ms.max(1))
}

/// A store that could not answer: open admits (and counts it), closed refuses with 503.
fn store_failed(gw: &Gateway, key: &KeyConfig, e: StoreError) -> Result<(), GatewayError> {
    gw.metrics
        .counter("keel_quota_store_errors_total", &[])
        .increment(1);
    let mode = gw.cfg.quota_fail_mode;
    if gw.keys.should_log_store_error() {
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

/// 400 for a request that exceeds a whole limit.
fn never_fits(key: &KeyConfig, what: &str, needed: u64, limit: &str) -> GatewayError {
    GatewayError::new(
        ErrorKind::InvalidRequest,
        format!(
            "key `{}`: this request needs {needed} {what} (estimated prompt + max_tokens) but the key's whole {limit}; it can never fit: lower max_tokens or shorten the prompt",
            key.id
        ),
    )
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

/// Takes what a keyed request needs, or refuses it. On a refusal the returned error carries
/// the rate-limit headers in `protocol`.
pub async fn admit(
    gw: &Gateway,
    key: &Arc<KeyConfig>,
    pool: &Pool,
    req: &CanonicalRequest,
    protocol: Protocol,
) -> Result<Grant, GatewayError> {
    let cost = cost(pool, req);
    if let Some(tpm) = key.tpm.filter(|t| cost.tokens > *t) {
        return Err(never_fits(
            key,
            "tokens",
            cost.tokens,
            &format!("tpm limit is {tpm} tokens per minute"),
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
            return Err(never_fits(key, unit, need, &budget_name(&b)));
        }
    }
    let mut grant = Grant {
        key: key.clone(),
        store: gw.quota.clone(),
        metrics: gw.metrics.clone(),
        estimated_input: req.estimated_input_tokens,
        rpm_taken: false,
        tpm_reserved: None,
        reserved: Vec::new(),
        held: None,
        refused: true,
        views: Vec::new(),
        meter: Arc::default(),
    };
    let result = take(gw, &mut grant, &cost).await;
    let mut headers = http::HeaderMap::new();
    super::headers::apply(&mut headers, protocol, &grant.views, unix_now_ms());
    match result {
        Ok(()) => {
            grant.refused = false;
            Ok(grant)
        }
        Err(mut e) => {
            e.headers = Some(Box::new(headers));
            Err(e)
        }
    }
}

/// The steps of [`admit`], recording in `grant` what was taken.
async fn take(gw: &Gateway, grant: &mut Grant, cost: &Cost) -> Result<(), GatewayError> {
    let key = grant.key.clone();
    let id = key.id.as_str();
    let store = gw.quota.clone();
    if let Some(max) = key.max_concurrency {
        // A shared store expires a slot a crashed replica never released.
        // A shared store renews held slots well within the TTL; a crashed replica's come back
        // after it (`[quota] slot_ttl_ms`).
        let ttl = Duration::from_millis(gw.cfg.quota_slot_ttl_ms);
        match bounded(store.acquire(id, max, ttl)).await {
            Ok(Some(h)) => grant.held = Some(h),
            Ok(None) => {
                return Err(refuse(
                    gw,
                    &key,
                    "concurrency",
                    1000,
                    format!(
                        "key `{id}` has reached its max_concurrency of {max} requests in flight"
                    ),
                ))
            }
            Err(e) => store_failed(gw, &key, e)?,
        }
    }
    for (limit, rate, units) in [
        (Limit::Requests, key.rpm, 1),
        (Limit::Tokens, key.tpm, cost.tokens),
    ] {
        let Some(max) = rate else { continue };
        match bounded(store.take(id, limit, Rate::per_minute(max), units)).await {
            Ok(d) => {
                grant.views.push(view(limit, max, &d));
                if let Decision::Denied { retry_after_ns, .. } = d {
                    let (kind, what) = match limit {
                        Limit::Requests => ("requests", format!("rpm limit of {max} requests per minute")),
                        Limit::Tokens => ("tokens", format!("tpm limit of {max} tokens per minute (this request reserves {units})")),
                    };
                    return Err(refuse(
                        gw,
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
            }
            Err(e) => store_failed(gw, &key, e)?,
        }
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
                    gw,
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
            Err(e) => store_failed(gw, &key, e)?,
        }
    }
    Ok(())
}
