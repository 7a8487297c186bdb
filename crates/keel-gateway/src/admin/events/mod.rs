//! `GET /keel/events` and `GET /keel/dashboard`: the live view of the fleet.
//!
//! One ticker ([`run`], started beside the monitor) builds a snapshot once per [`TICK`] while
//! anybody is subscribed, serializes it once, and publishes the bytes on the gateway's hub
//! ([`crate::observe::events::Hub`], which outlives reloads); every
//! subscriber's stream only copies the latest bytes out. An open page therefore costs one
//! snapshot per second in total however many pages are open, and nothing on the request path
//! beyond the [`window::Recent`] counters (one short lock per request). Subscribers are capped
//! ([`MAX_SUBSCRIBERS`], 503 beyond) so that pages cannot pile up.
//!
//! A snapshot is one JSON object:
//! - `health`: exactly what `GET /keel/health` answers (every pool's variants with their state,
//!   weight, TTFT estimate, gap variance, error rate, in-flight, concurrency limit, KV/queue
//!   signals, and the health colour and reasons where the gateway reports them);
//! - `window`: the route mix over the last minute and each pool's TTFT P50/P99 over the last five
//!   minutes with one point per ten seconds ([`window::WindowView`]);
//! - `decisions`: the latest decisions, newest first (`request_id`, `pool`, `route`, `variant`;
//!   the full record is at `/keel/decisions/{request_id}`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use keel_core::protocol::{ErrorKind, Protocol};
use serde_json::{json, Value};

use crate::wire::errors::GatewayError;
use crate::{full_body, Body, Gateway};

/// How often a snapshot is built and sent.
pub const TICK: Duration = Duration::from_secs(1);
/// Concurrent `/keel/events` subscribers allowed; more are answered 503.
pub const MAX_SUBSCRIBERS: usize = 16;
/// Decisions in a snapshot.
const LATEST_DECISIONS: usize = 20;

/// The dashboard page, embedded in the binary.
const DASHBOARD_HTML: &str = include_str!("dashboard.html");

/// Publishes a snapshot every [`TICK`] while anybody listens; runs until aborted.
pub async fn run(gw: Arc<Gateway>) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        if gw.events.subscribers() > 0 {
            gw.events.publish(sse_event(&snapshot(&gw)));
        } else {
            gw.events.forget();
        }
    }
}

/// One server-sent event carrying `doc` (JSON holds no raw newline, so one `data:` line).
fn sse_event(doc: &Value) -> Bytes {
    Bytes::from(format!("data: {doc}\n\n"))
}

/// The snapshot described in the module documentation.
pub fn snapshot(gw: &Gateway) -> Value {
    let decisions: Vec<Value> = gw
        .latest_decisions(LATEST_DECISIONS)
        .iter()
        .filter_map(|d| serde_json::to_value(d).ok())
        .map(|d| decision_summary(&d))
        .collect();
    json!({
        "time_ms": crate::state::keys::limits::unix_now_ms(),
        "health": crate::admin::health_document(gw),
        "window": gw.metrics.recent.view(),
        "decisions": decisions,
        "subscribers": gw.events.subscribers(),
    })
}

/// A decision record's line on the dashboard: the record's own `route` when it has one, else
/// the route its attempts imply; the variant that answered (the last successful attempt, else
/// the last attempt, else the plan's first).
fn decision_summary(d: &Value) -> Value {
    let attempts = d["attempts"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let kind_seen = |k: &str| attempts.iter().any(|a| a["kind"] == k);
    let route = d["route"].as_str().unwrap_or(if kind_seen("hedge") {
        "hedged"
    } else if kind_seen("continuation") {
        "migrated"
    } else if kind_seen("fallback") {
        "fallback"
    } else {
        "direct"
    });
    let variant = attempts
        .iter()
        .rev()
        .find(|a| a["outcome"] == "ok")
        .or(attempts.last())
        .map(|a| a["variant"].clone())
        .unwrap_or_else(|| d["plan"][0].clone());
    json!({
        "request_id": d["request_id"],
        "pool": d["pool"],
        "route": route,
        "variant": variant,
        "attempts": attempts.len(),
    })
}

/// `GET /keel/events`: the snapshot stream, or 503 when [`MAX_SUBSCRIBERS`] already listen.
pub fn subscribe(gw: &Gateway) -> Response<Body> {
    let Some((place, mut rx)) = gw.events.join(MAX_SUBSCRIBERS) else {
        return GatewayError::new(
            ErrorKind::Overloaded,
            format!("/keel/events already has {MAX_SUBSCRIBERS} subscribers: close a dashboard and try again"),
        )
        .with_retry_after(5000)
        .to_response(Protocol::OpenAi);
    };
    // The first event goes out at once: the latest snapshot if there is one, else a fresh one
    // (the first subscriber after a quiet spell would otherwise wait a tick for anything).
    let first = match rx.borrow_and_update().clone() {
        b if b.is_empty() => sse_event(&snapshot(gw)),
        b => b,
    };
    let stream = futures_util::stream::unfold(
        (Some(first), rx, place),
        |(pending, mut rx, place)| async move {
            let bytes = match pending {
                Some(b) => b,
                None => loop {
                    // Ends when the ticker is gone (the gateway is shutting down). An empty
                    // value is the ticker's "nothing published" (see `run`): not an event.
                    rx.changed().await.ok()?;
                    let b = rx.borrow_and_update().clone();
                    if !b.is_empty() {
                        break b;
                    }
                },
            };
            Some((Ok::<_, Infallible>(Frame::data(bytes)), (None, rx, place)))
        },
    );
    let body = StreamBody::new(stream)
        .map_err(|never| match never {})
        .boxed();
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// `GET /keel/dashboard`: the page.
pub fn dashboard() -> Response<Body> {
    let mut resp = full_body(
        StatusCode::OK,
        "text/html; charset=utf-8",
        Bytes::from_static(DASHBOARD_HTML.as_bytes()),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_summary_names_the_route_its_attempts_took() {
        let d = json!({
            "request_id": "r1", "pool": "p", "plan": ["a", "b"],
            "attempts": [
                {"variant": "a", "kind": "first", "outcome": "status_503"},
                {"variant": "b", "kind": "fallback", "outcome": "ok"}
            ]
        });
        let s = decision_summary(&d);
        assert_eq!(s["route"], "fallback");
        assert_eq!(s["variant"], "b");
        assert_eq!(s["attempts"], 2);
        // A record that carries its own route keeps it.
        let mut d2 = d.clone();
        d2["route"] = json!("throttled");
        assert_eq!(decision_summary(&d2)["route"], "throttled");
        // No attempts: the plan's first.
        let d3 = json!({"request_id": "r2", "pool": "p", "plan": ["a"], "attempts": []});
        assert_eq!(decision_summary(&d3)["variant"], "a");
        assert_eq!(decision_summary(&d3)["route"], "direct");
    }

    #[test]
    fn the_dashboard_is_self_contained() {
        // No external asset: nothing fetched from another origin.
        for needle in ["http://", "https://", "<script src", "<link"] {
            assert!(!DASHBOARD_HTML.contains(needle), "{needle}");
        }
        // The feed is read with the key as a bearer header (EventSource cannot send one).
        assert!(DASHBOARD_HTML.contains("fetch(\"/keel/events\", { headers: authHeaders()"));
        assert!(!DASHBOARD_HTML.contains("new EventSource"));
    }
}
