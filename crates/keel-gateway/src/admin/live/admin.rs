//! The process's own endpoints: `POST /keel/admin/reload`, `GET /keel/ready` (readiness) and
//! `GET /keel/live` (liveness), separate from `/keel/health` (the fleet's state).
//!
//! Readiness is about this replica, not the fleet: 200 while keel accepts requests, 503 once it
//! is draining. A fleet with no serving variant does not fail it: every replica shares the fleet,
//! so failing readiness everywhere would only swap keel's clear errors (in the client's protocol,
//! with `retry-after`) for a load balancer's bare 503. The answer still says, per pool, how many
//! variants could serve now, for whoever looks.

use http::StatusCode;
use keel_core::protocol::ErrorKind;
use serde_json::{json, Value};

use crate::wire::errors::GatewayError;
use crate::Gateway;

/// `POST /keel/admin/reload`: re-reads the config file now (who may: `routes::Access::Admin`).
pub async fn reload(gw: &Gateway) -> Result<Value, GatewayError> {
    let Some(live) = gw.process.reloader() else {
        return Err(GatewayError::new(
            ErrorKind::InvalidRequest,
            "reload: this gateway does not run under a reload handle",
        ));
    };
    // Reading and validating the file is synchronous and short; off the async workers anyway.
    let result = tokio::task::spawn_blocking(move || live.reload())
        .await
        .map_err(|_| GatewayError::new(ErrorKind::Internal, "reload: the reload task failed"))?;
    result.map_err(|e| {
        GatewayError::new(
            ErrorKind::InvalidRequest,
            format!(
                "reload refused ({}); the running config stays: {}",
                e.outcome, e.message
            ),
        )
        .with_code(e.outcome)
    })
}

/// `GET /keel/ready`: 200 while accepting, 503 while draining.
pub fn ready(gw: &Gateway) -> (StatusCode, Value) {
    let pools: Vec<Value> = gw
        .pools()
        .iter()
        .map(|p| {
            let serving = p.snapshot().iter().filter(|v| v.available).count();
            json!({"name": p.cfg.name, "serving_variants": serving})
        })
        .collect();
    if gw.process.draining() {
        let doc = json!({"ready": false, "reason": "draining: keel is shutting down", "generation": gw.generation, "pools": pools});
        (StatusCode::SERVICE_UNAVAILABLE, doc)
    } else {
        let doc = json!({"ready": true, "generation": gw.generation, "pools": pools});
        (StatusCode::OK, doc)
    }
}

/// `GET /keel/live`: the process answers (the runtime serves requests).
pub fn live(gw: &Gateway) -> Value {
    json!({"live": true, "generation": gw.generation, "draining": gw.process.draining()})
}
