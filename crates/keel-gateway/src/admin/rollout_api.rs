//! keel's own endpoints for shadow traffic and canaries:
//!
//! - `GET /keel/shadow/{pool}`: the pool's shadow comparisons, per shadow variant.
//! - `POST /keel/admin/canary/{pool}/promote` and `…/rollback`: an operator moves the pool's
//!   canary to 100 % or to 0 %.
//!
//! Who may call each is checked before (`routes::Target::access`).

use std::sync::Arc;

use keel_core::protocol::ErrorKind;
use serde_json::{json, Value};

use crate::state::pools::Pool;
use crate::wire::errors::GatewayError;
use crate::Gateway;

fn find<'g>(gw: &'g Gateway, name: &str) -> Result<&'g Arc<Pool>, GatewayError> {
    gw.pool(name).ok_or_else(|| {
        GatewayError::new(
            ErrorKind::NotFound,
            format!("no pool `{name}`; pools: {}", gw.model_names().join(", ")),
        )
    })
}

/// `GET /keel/shadow/{pool}`.
pub fn shadow(gw: &Gateway, name: &str) -> Result<Value, GatewayError> {
    let pool = find(gw, name)?;
    let shadow = pool.shadow.as_ref().ok_or_else(|| {
        GatewayError::new(
            ErrorKind::NotFound,
            format!("pool `{}` has no [pools.shadow]", pool.cfg.name),
        )
    })?;
    Ok(shadow.document(&pool.cfg.name))
}

/// `POST /keel/admin/canary/{pool}/promote` (`promote`) or `…/rollback`.
pub fn canary_order(gw: &Gateway, name: &str, promote: bool) -> Result<Value, GatewayError> {
    let pool = find(gw, name)?;
    let canary = pool.canary.as_ref().ok_or_else(|| {
        GatewayError::new(
            ErrorKind::NotFound,
            format!("pool `{}` has no [pools.canary]", pool.cfg.name),
        )
    })?;
    let state = canary.order(promote, pool.now_ms());
    Ok(json!({"pool": pool.cfg.name, "canary": state}))
}

/// The pool's canary state for `/keel/health`, merged into its entry.
pub fn health(pool: &Pool, doc: &mut Value) {
    if let (Some(c), Some(obj)) = (&pool.canary, doc.as_object_mut()) {
        obj.insert("canary".into(), c.report(pool.now_ms()));
    }
}
