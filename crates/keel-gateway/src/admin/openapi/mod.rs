//! keel's OpenAPI 3.1 document, built from the route table (`routes::ROUTES`) so that every
//! served route is documented. Served at `GET /keel/openapi.json`; a copy is committed at
//! `docs/openapi.json` and a test fails when the two differ.
//!
//! Request schemas declare the fields keel reads and validates (required ones required); every
//! other field is allowed and passes through to the model server. Error bodies are in the
//! client's protocol's shape (see `keel_core::protocol::error_body`).

mod operations;
mod rollout;
mod schemas;

use std::sync::OnceLock;

use serde_json::{json, Map, Value};

use crate::wire::routes::{Route, ROUTES};

/// The document as JSON.
pub fn document() -> Value {
    let mut paths = Map::new();
    let served = ROUTES
        .iter()
        .map(|r| (r.path, r.verb, operations::for_route(r)));
    for (path, verb, op) in served {
        let item = paths.entry(path).or_insert_with(|| json!({}));
        item[verb.as_str().to_ascii_lowercase()] = op;
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "keel",
            "version": env!("CARGO_PKG_VERSION"),
            "summary": "An LLM inference gateway: OpenAI- and Anthropic-compatible endpoints in front of a fleet of model servers.",
            "description": "keel serves the OpenAI and Anthropic wire protocols and relays each generation request to a variant of the pool named by `model` (translating between the protocols where the variant speaks the other one). Request bodies are passed through: only the fields declared here are read and validated by keel; any other field reaches the model server as sent. Errors are answered in the client's protocol's shape. Headers `x-keel-*` steer and describe routing.",
            "license": {"name": env!("CARGO_PKG_LICENSE"), "identifier": env!("CARGO_PKG_LICENSE")}
        },
        "servers": [{"url": "/"}],
        "tags": [
            {"name": "openai", "description": "OpenAI-compatible endpoints (base URL `http://HOST/v1`)."},
            {"name": "anthropic", "description": "Anthropic-compatible endpoints (base URL `http://HOST`)."},
            {"name": "models", "description": "The models (pools) served, in either protocol's shape."},
            {"name": "keel", "description": "keel's own operational endpoints."}
        ],
        "paths": paths,
        "components": {
            "schemas": schemas::schemas(),
            "responses": operations::response_components(),
            "parameters": schemas::parameters(),
            "headers": schemas::headers(),
            "securitySchemes": {
                "adminKey": {"type": "http", "scheme": "bearer", "description": "The admin key whose SHA-256 is `[admin] key_hash`."},
                "opsKey": {"type": "http", "scheme": "bearer", "description": "A virtual key with `roles = [\"ops\"]`: reads the operations plane, changes nothing."}
            },
        },
    })
}

/// The document as served and committed: pretty-printed, with a final newline.
pub fn document_text() -> String {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| {
        let mut s = serde_json::to_string_pretty(&document()).unwrap_or_default();
        s.push('\n');
        s
    })
    .clone()
}

/// The routes the document describes, as (method, path).
pub fn documented_routes() -> Vec<(&'static str, &'static str)> {
    ROUTES
        .iter()
        .map(|r: &Route| (r.verb.as_str(), r.path))
        .collect()
}

#[cfg(test)]
mod tests;
