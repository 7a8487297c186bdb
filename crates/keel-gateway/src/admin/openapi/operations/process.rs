//! The process's own routes: reload, readiness, liveness (see `live`).

use keel_core::protocol::Protocol;
use serde_json::{json, Value};

use super::{error_response, keel_get, ok_response};

/// `POST /keel/admin/reload`.
pub(super) fn reload() -> Value {
    let mut op = keel_get(
        "reload",
        "Re-read the config file now, as SIGHUP does (admin key required when keys or an admin key are configured); in-flight requests finish on the config they started with",
        "keel",
        ok_response(
            "The new generation: its number, what changed per pool, settings that wait for a restart, and how long the reload took.",
            json!({
                "type": "object",
                "required": ["generation", "pools", "restart_needed_for", "took_ms"],
                "properties": {
                    "generation": {"type": "integer", "description": "1 for the first config, one more for each reload."},
                    "pools": {"type": "array", "items": {
                        "type": "object",
                        "required": ["pool", "change"],
                        "properties": {
                            "pool": {"type": "string"},
                            "change": {"enum": ["unchanged", "added", "removed", "changed"]},
                            "kept": {"type": "array", "items": {"type": "string"}, "description": "Variants defined as before: their live state goes on."},
                            "added": {"type": "array", "items": {"type": "string"}},
                            "redefined": {"type": "array", "items": {"type": "string"}, "description": "Variants whose definition changed: they start afresh (warming)."},
                            "removed": {"type": "array", "items": {"type": "string"}}
                        }
                    }},
                    "restart_needed_for": {"type": "array", "items": {"type": "string"}, "description": "Changed settings that take effect at the next restart (`worker_threads`, `listen_backlog`, `header_read_timeout_ms`, `idle_timeout_ms`, `client_write_timeout_ms`, `max_connections`)."},
                    "took_ms": {"type": "number"}
                }
            }),
            None,
            json!({}),
        ),
    );
    op["responses"]["400"] = error_response(
        "The reload was refused and the running config stays: `error.code` is `invalid` (the file cannot be read or has errors, listed in the message as `keel check` prints them), `refused` (a change that needs a restart, such as `listen` or `admin_listen`, or one that would remove every key or the admin key without `auth = \"open\"`) or `unavailable` (keel was not started from a file).",
        Some(Protocol::OpenAi),
        json!({}),
    );
    op
}

/// `GET /keel/ready`.
pub(super) fn ready() -> Value {
    let mut op = keel_get(
        "ready",
        "Readiness: 200 while keel accepts requests, 503 once it is shutting down (the fleet's state does not fail it; see /keel/health)",
        "keel",
        ok_response("Accepting requests.", ready_schema(), None, json!({})),
    );
    op["responses"]["503"] = json!({
        "description": "Draining: keel is shutting down.",
        "content": {"application/json": {"schema": ready_schema()}}
    });
    op
}

fn ready_schema() -> Value {
    json!({
        "type": "object",
        "required": ["ready", "generation", "pools"],
        "properties": {
            "ready": {"type": "boolean"},
            "reason": {"type": "string"},
            "generation": {"type": "integer"},
            "pools": {"type": "array", "items": {
                "type": "object",
                "required": ["name", "serving_variants"],
                "properties": {"name": {"type": "string"}, "serving_variants": {"type": "integer", "description": "Variants that could take a request now."}}
            }}
        }
    })
}

/// `GET /keel/live`.
pub(super) fn live() -> Value {
    keel_get(
        "live",
        "Liveness: the process answers",
        "keel",
        ok_response(
            "The process is alive.",
            json!({
                "type": "object",
                "required": ["live", "generation", "draining"],
                "properties": {"live": {"type": "boolean"}, "generation": {"type": "integer"}, "draining": {"type": "boolean"}}
            }),
            None,
            json!({}),
        ),
    )
}
