//! `GET /v1/models` and `GET /v1/models/{id}`: the names this gateway serves, in the client's
//! protocol's list shape (only the pools the caller's key may use).

use bytes::Bytes;
use http::{Response, StatusCode};
use serde_json::json;

use keel_core::protocol::{ErrorKind, Protocol};

use crate::config::KeyConfig;
use crate::wire::body::{full_body, Body};
use crate::wire::errors::GatewayError;
use crate::Gateway;

/// Every name a client may ask for: each pool's public name and its aliases, in config order
/// (only the pools its key may use, when keys are configured). Every pool serves both
/// protocols (a variant of the other protocol through translation), so both lists hold them
/// all.
fn listed_models<'g>(gw: &'g Gateway, key: Option<&KeyConfig>) -> Vec<&'g str> {
    gw.pools()
        .iter()
        .filter(|p| key.is_none_or(|k| k.allows(&p.cfg.name)))
        .flat_map(|p| std::iter::once(&p.cfg.name).chain(&p.cfg.aliases))
        .map(String::as_str)
        .collect()
}

/// One model in the client's list shape.
fn model_entry(name: &str, anthropic: bool) -> serde_json::Value {
    if anthropic {
        json!({"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"})
    } else {
        json!({"id": name, "object": "model", "created": 0, "owned_by": "keel"})
    }
}

/// `GET /v1/models`: OpenAI's list shape, or Anthropic's for an Anthropic client.
pub fn list(gw: &Gateway, key: Option<&KeyConfig>, anthropic: bool) -> Response<Body> {
    let names = listed_models(gw, key);
    let data: Vec<_> = names.iter().map(|n| model_entry(n, anthropic)).collect();
    let body = if anthropic {
        json!({"data": data, "has_more": false, "first_id": names.first(), "last_id": names.last()})
    } else {
        json!({"object": "list", "data": data})
    };
    full_body(
        StatusCode::OK,
        "application/json",
        Bytes::from(body.to_string()),
    )
}

/// `GET /v1/models/{id}`: one model, or 404 in the client's error shape.
pub fn one(
    gw: &Gateway,
    key: Option<&KeyConfig>,
    anthropic: bool,
    id: &str,
    protocol: Protocol,
) -> Response<Body> {
    let id = crate::wire::routes::percent_decode(id);
    match listed_models(gw, key).into_iter().find(|n| *n == id) {
        Some(n) => full_body(
            StatusCode::OK,
            "application/json",
            Bytes::from(model_entry(n, anthropic).to_string()),
        ),
        None => GatewayError::new(
            ErrorKind::NotFound,
            format!("model `{id}` is not served here"),
        )
        .to_response(protocol),
    }
}
