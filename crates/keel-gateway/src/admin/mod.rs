//! The operations plane: reload, the live events feed and dashboard, safe-mode and rollout
//! controls, and the OpenAPI document. Everything here is for the admin key or the `ops` role.

pub mod analysis;
pub mod events;
pub mod keys;
pub mod live;
pub mod openapi;
pub mod rollout_api;
pub mod safe_mode;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use keel_core::protocol::{ErrorKind, Protocol};

use crate::wire::body::{full_body, Body};
use crate::wire::errors::GatewayError;
use crate::wire::routes::Target;
use crate::Gateway;

/// Answers one request of the operations plane (the caller resolved and authorized it); `arg`
/// is the route's path parameter, when it has one.
pub async fn answer(
    gw: &std::sync::Arc<Gateway>,
    target: Target,
    arg: Option<&str>,
    req: Request<Incoming>,
    protocol: Protocol,
) -> Response<Body> {
    let json = |body: String| full_body(StatusCode::OK, "application/json", Bytes::from(body));
    match target {
        Target::KeyUsage => match crate::admin::keys::usage(gw, arg.unwrap_or_default()).await {
            Ok(doc) => json(doc.to_string()),
            Err(e) => e.to_response(protocol),
        },
        Target::SafeMode => {
            let (parts, body) = req.into_parts();
            match crate::admin::safe_mode::safe_mode(gw, &parts, body).await {
                Ok(doc) => json(doc.to_string()),
                Err(e) => e.to_response(protocol),
            }
        }
        Target::Shadow => {
            match crate::admin::rollout_api::shadow(
                gw,
                &crate::wire::routes::percent_decode(arg.unwrap_or_default()),
            ) {
                Ok(doc) => json(doc.to_string()),
                Err(e) => e.to_response(protocol),
            }
        }
        Target::Reload => match crate::admin::live::admin::reload(gw).await {
            Ok(doc) => json(doc.to_string()),
            Err(e) => e.to_response(protocol),
        },
        t @ (Target::CanaryPromote | Target::CanaryRollback) => {
            let name = crate::wire::routes::percent_decode(arg.unwrap_or_default());
            let promote = t == Target::CanaryPromote;
            match crate::admin::rollout_api::canary_order(gw, &name, promote) {
                Ok(doc) => json(doc.to_string()),
                Err(e) => e.to_response(protocol),
            }
        }
        Target::Ready => {
            let (status, doc) = crate::admin::live::admin::ready(gw);
            full_body(status, "application/json", Bytes::from(doc.to_string()))
        }
        Target::Live => json(crate::admin::live::admin::live(gw).to_string()),
        Target::Health => json(health_document(gw).to_string()),
        Target::Decisions => match crate::observe::decisions::Query::parse(req.uri().query()) {
            Ok(q) => crate::observe::decisions::document(gw.decision_log().query(&q)),
            Err(m) => GatewayError::new(ErrorKind::InvalidRequest, format!("/keel/decisions: {m}"))
                .to_response(Protocol::OpenAi),
        },
        Target::Decision => {
            let request_id = crate::wire::routes::percent_decode(arg.unwrap_or_default());
            match gw.decision_log().get(&request_id) {
                Some(r) => json(serde_json::to_string(&*r).unwrap_or_else(|_| "{}".into())),
                None => GatewayError::new(
                    ErrorKind::NotFound,
                    format!("no decision record for request `{request_id}`: unknown, or no longer kept (the latest {} are)", gw.cfg.decisions_kept),
                )
                .to_response(Protocol::OpenAi),
            }
        }
        Target::Metrics => {
            // Process-wide, counted where lines are queued (see `log_writer`).
            gw.metrics
                .counter("keel_log_lines_dropped_total", &[])
                .absolute(crate::observe::log_writer::dropped());
            full_body(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                Bytes::from(gw.metrics.render()),
            )
        }
        Target::OpenApi => json(openapi::document_text()),
        Target::Analyze => {
            // A replay of up to `state::analysis::RECENT` requests a pool: off the async
            // workers.
            let g = gw.clone();
            match tokio::task::spawn_blocking(move || analysis::document(&g)).await {
                Ok(doc) => json(doc.to_string()),
                Err(_) => GatewayError::new(ErrorKind::Internal, "keel: the analysis failed")
                    .to_response(protocol),
            }
        }
        Target::Events => crate::admin::events::subscribe(gw),
        Target::Dashboard => crate::admin::events::dashboard(),
        Target::Generation(_) | Target::Models | Target::Model => GatewayError::new(
            ErrorKind::NotFound,
            format!("no route for {} {}", req.method(), req.uri().path()),
        )
        .to_response(protocol),
    }
}

/// The `GET /keel/health` document (also each `/keel/events` snapshot's `health`).
pub fn health_document(gw: &Gateway) -> serde_json::Value {
    let pools: Vec<_> = gw
        .pools()
        .iter()
        .map(|p| {
            let mut doc = json!({"name": p.cfg.name, "protocol": p.protocol.as_str(), "policy": p.cfg.policy, "variants": p.snapshot()});
            crate::state::safe_mode::merge(&mut doc, p.safety.report(p));
            crate::admin::rollout_api::health(p, &mut doc);
            doc
        })
        .collect();
    let (colour, reasons) = crate::state::safe_mode::overall(&pools);
    json!({"status": "ok", "colour": colour, "reasons": reasons, "pools": pools})
}
