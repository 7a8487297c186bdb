//! `POST /keel/admin/safe-mode`: an operator forces a pool's safe mode on or off, or hands it
//! back to the health colour. Body `{"pool": "<name>" | null, "mode": "on" | "off" | "auto"}`
//! (`null`: every pool). Who may call it is checked before (`routes::Access::Admin`).

use std::time::Duration;

use http::request::Parts;
use hyper::body::Incoming;
use keel_core::health_colour::Control;
use keel_core::protocol::ErrorKind;
use serde_json::{json, Value};

use crate::wire::errors::GatewayError;
use crate::Gateway;

/// The largest body the endpoint reads.
const MAX_BODY: usize = 4096;

/// Applies the order and answers with the pools' safe-mode state, or the error to answer.
pub async fn safe_mode(gw: &Gateway, parts: &Parts, body: Incoming) -> Result<Value, GatewayError> {
    let timeout = Duration::from_millis(gw.cfg.body_read_timeout_ms);
    let bytes = crate::pipeline::admission::read_body(parts, body, MAX_BODY, timeout).await?;
    let (pool, control) = parse(&bytes)?;
    let pools: Vec<_> = match &pool {
        Some(name) => vec![gw.pool(name).ok_or_else(|| {
            GatewayError::new(
                ErrorKind::NotFound,
                format!("no pool `{name}`; pools: {}", gw.model_names().join(", ")),
            )
        })?],
        None => gw.pools().iter().collect(),
    };
    let now = gw.now_ms();
    let states: Vec<Value> = pools
        .into_iter()
        .map(|p| {
            p.safety.set(control, now);
            json!({"name": p.cfg.name, "safe_mode": p.safety.active(), "control": control})
        })
        .collect();
    Ok(json!({"pools": states}))
}

/// The body's pool (`None`: all) and mode.
fn parse(bytes: &[u8]) -> Result<(Option<String>, Control), GatewayError> {
    let bad = |m: String| GatewayError::new(ErrorKind::InvalidRequest, m);
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| bad(format!("the body is not valid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad("the body must be a JSON object: {\"pool\": …, \"mode\": …}".into()))?;
    if let Some(k) = obj.keys().find(|k| !matches!(k.as_str(), "pool" | "mode")) {
        return Err(bad(format!(
            "unknown field `{k}`: expected `pool` and `mode`"
        )));
    }
    let pool = match obj.get("pool") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            return Err(bad(format!(
                "`pool` must be a pool name or null (every pool), got {other}"
            )))
        }
    };
    let control = match obj.get("mode").and_then(Value::as_str) {
        Some("on") => Control::On,
        Some("off") => Control::Off,
        Some("auto") => Control::Auto,
        _ => {
            return Err(bad(format!(
                "`mode` must be \"on\", \"off\" or \"auto\", got {}",
                obj.get("mode").map_or("nothing".into(), Value::to_string)
            )))
        }
    };
    Ok((pool, control))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_parse_or_say_what_is_wrong() {
        assert_eq!(
            parse(br#"{"pool": "p", "mode": "on"}"#).unwrap(),
            (Some("p".into()), Control::On)
        );
        assert_eq!(
            parse(br#"{"pool": null, "mode": "auto"}"#).unwrap(),
            (None, Control::Auto)
        );
        assert_eq!(parse(br#"{"mode": "off"}"#).unwrap(), (None, Control::Off));
        for (body, says) in [
            (&b"nope"[..], "not valid JSON"),
            (b"[]", "JSON object"),
            (br#"{"mode": "maybe"}"#, "`mode` must be"),
            (br#"{"pool": 3, "mode": "on"}"#, "`pool` must be"),
            (
                br#"{"pool": "p", "mode": "on", "x": 1}"#,
                "unknown field `x`",
            ),
        ] {
            let e = parse(body).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidRequest);
            assert!(e.message.contains(says), "{}", e.message);
        }
    }
}
