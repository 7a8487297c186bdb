//! `GET /keel/keys/{id}/usage` (the operations plane: see `routes::Access::Ops`): a key's limits, budgets and in-flight
//! count as the quota store has them now.

use keel_core::protocol::ErrorKind;
use serde_json::{json, Value};

use crate::state::keys::limits::{budgets, rates, unix_now, unix_now_ms};
use crate::state::quota::BudgetUnit;
use crate::wire::errors::GatewayError;
use crate::Gateway;

/// The usage document, or the error to answer.
pub async fn usage(gw: &Gateway, id: &str) -> Result<Value, GatewayError> {
    let key = gw
        .keys
        .by_id(id)
        .ok_or_else(|| GatewayError::new(ErrorKind::NotFound, format!("no key with id `{id}`")))?;
    let rates = rates(key);
    let budgets = budgets(key);
    let now = unix_now();
    let usage = gw
        .quota
        .usage(&key.id, &rates, &budgets, now)
        .await
        .map_err(|e| {
            GatewayError::new(
                ErrorKind::Overloaded,
                format!("keel's quota store is unavailable: {}", e.0),
            )
            .with_retry_after(1000)
        })?;
    let limits: serde_json::Map<String, Value> = rates
        .iter()
        .zip(&usage.rates)
        .map(|((limit, rate), (_, remaining, reset_ns))| {
            (
                limit.as_str().to_owned(),
                json!({"limit": rate.limit, "per": "minute", "remaining": remaining, "reset_ms": reset_ns.div_ceil(1_000_000)}),
            )
        })
        .collect();
    let budgets: Vec<Value> = usage
        .budgets
        .iter()
        .map(|(b, used, remaining)| {
            let (_, end) = b.window.bounds(now);
            let (unit, scale) = match b.unit {
                BudgetUnit::Tokens => ("tokens", 1.0),
                BudgetUnit::Spend => ("usd", 1e6),
            };
            json!({
                "name": crate::state::keys::limits::budget_name(b),
                "unit": unit,
                "window": format!("{:?}", b.window).to_lowercase(),
                "limit": b.limit as f64 / scale,
                "used": *used as f64 / scale,
                "remaining": *remaining as f64 / scale,
                "window_end": crate::state::keys::headers::rfc3339(end * 1000),
            })
        })
        .collect();
    Ok(json!({
        "id": key.id,
        "tenant": key.tenant,
        "priority": key.priority.as_str(),
        "pools": key.pools,
        "limits": limits,
        "max_concurrency": key.max_concurrency,
        "in_flight": usage.in_flight,
        "budgets": budgets,
        "at": crate::state::keys::headers::rfc3339(unix_now_ms()),
    }))
}
