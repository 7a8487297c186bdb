//! The operations of shadow traffic and canaries (`rollout_api`), and the workload analysis that
//! tells what turning on the cache would save (`analysis`).

use keel_core::protocol::Protocol;
use serde_json::{json, Value};

use super::operations::{error_response, keel_get, ok_response};

/// The `{pool}` path parameter.
fn pool_param() -> Value {
    json!([{
        "name": "pool",
        "in": "path",
        "required": true,
        "description": "The pool's public model name (or one of its aliases).",
        "schema": {"type": "string", "minLength": 1, "pattern": "^[^/]+$"}
    }])
}

fn errors(op: &mut Value, list: &[(&str, &str)]) {
    for (status, why) in list {
        op["responses"][*status] = error_response(why, Some(Protocol::OpenAi), json!({}));
    }
}

/// `GET /keel/shadow/{pool}`.
pub(super) fn shadow() -> Value {
    let num = json!({"type": ["number", "null"]});
    let mut op = keel_get(
        "shadow",
        "A pool's shadow comparisons: per shadow variant, how its answers compare with the served ones",
        "keel",
        ok_response(
            "The pool's shadow settings and one summary per shadow variant.",
            json!({
                "type": "object",
                "required": ["pool", "sample", "variants"],
                "properties": {
                    "pool": {"type": "string"},
                    "sample": {"type": "number"},
                    "max_in_flight": {"type": "integer"},
                    "max_per_minute": {"type": "integer"},
                    "in_flight": {"type": "integer"},
                    "variants": {"type": "array", "items": {
                        "type": "object",
                        "required": ["variant", "compared", "failed", "skipped"],
                        "properties": {
                            "variant": {"type": "string"},
                            "compared": {"type": "integer", "description": "Copies answered and compared."},
                            "failed": {"type": "integer", "description": "Copies that failed (never seen by a client)."},
                            "skipped": {"type": "integer", "description": "Sampled requests not copied: `max_in_flight` or `max_per_minute` reached."},
                            "exact_match_rate": num,
                            "mean_similarity": {"type": ["number", "null"], "description": "Token Jaccard over normalized words, 0..1."},
                            "json_compared": {"type": "integer"},
                            "mean_json_agreement": {"type": ["number", "null"], "description": "Share of equal leaf fields when both answers are JSON."},
                            "mean_latency_delta_ms": {"type": ["number", "null"], "description": "Shadow minus served, whole answer."},
                            "mean_token_delta": {"type": ["number", "null"], "description": "Shadow minus served output tokens."}
                        }
                    }}
                }
            }),
            None,
            json!({}),
        ),
    );
    op["parameters"] = pool_param();
    errors(
        &mut op,
        &[(
            "404",
            "No pool has this name, or it has no `[pools.shadow]`.",
        )],
    );
    op
}

/// `POST /keel/admin/canary/{pool}/promote` and `…/rollback`.
pub(super) fn canary(promote: bool) -> Value {
    let (id, summary) = if promote {
        ("promoteCanary", "Promote a pool's canary: every user on the candidate side (admin key required when keys are configured)")
    } else {
        ("rollbackCanary", "Roll a pool's canary back: every user on the stable side (admin key required when keys are configured)")
    };
    let mut op = keel_get(
        id,
        summary,
        "keel",
        ok_response(
            "The canary's state after the order (as in `/keel/health`).",
            json!({
                "type": "object",
                "required": ["pool", "canary"],
                "properties": {
                    "pool": {"type": "string"},
                    "canary": {"type": "object", "required": ["phase", "weight_percent"], "properties": {
                        "phase": {"enum": ["rolling", "promoted", "rolled_back"]},
                        "weight_percent": {"type": "number"}
                    }}
                }
            }),
            None,
            json!({}),
        ),
    );
    op["parameters"] = pool_param();
    errors(
        &mut op,
        &[(
            "404",
            "No pool has this name, or it has no `[pools.canary]`.",
        )],
    );
    op
}

/// `GET /keel/analyze`.
pub(super) fn analyze() -> Value {
    let count = json!({"type": "integer", "minimum": 0});
    let figures = json!({
        "requests": count, "fingerprinted": count, "repeats_raw": count,
        "repeats_normalized": count, "deterministic": count, "sampled": count, "tools": count,
        "spend_usd": {"type": "number"}, "templates": count,
        "template_entropy_bits": {"type": "number"},
        "simulated": {"type": "object", "description": "What the simulated cache's hits save: hits, tokens_in, tokens_out, spend_usd, latency_ms."},
        "simulated_hit_rate": {"type": "number"}
    });
    keel_get(
        "analyze",
        "Workload analysis of the recent requests of pools with `fingerprint = true`: repeats, templates, the response cache replayed over them, what it would save, recommendations (admin key or `ops` role)",
        "keel",
        ok_response(
            "The window (the latest requests kept per pool) and the report, in the shape of `keel analyze`'s report.json.",
            json!({
                "type": "object",
                "required": ["window", "report"],
                "properties": {
                    "window": {"type": "object", "properties": {
                        "per_pool": count, "requests": count,
                        "fingerprinting_pools": {"type": "array", "items": {"type": "string"}}
                    }},
                    "report": {"type": "object", "required": ["pools", "recommendations"], "properties": {
                        "first_ms": {"type": ["integer", "null"]},
                        "last_ms": {"type": ["integer", "null"]},
                        "days": {"type": "number"},
                        "approximate": {"type": "boolean"},
                        "pools": {"type": "array", "items": {"type": "object", "properties": figures}},
                        "recommendations": {"type": "array", "items": {
                            "type": "object",
                            "required": ["pool", "kind", "text"],
                            "properties": {
                                "pool": {"type": "string"},
                                "kind": {"type": "string", "enum": ["cache", "normalize", "temperature", "stable_template"]},
                                "text": {"type": "string"},
                                "requests": count,
                                "share": {"type": "number"},
                                "usd_per_day": {"type": "number"},
                                "ttl_ms": {"type": "integer"}
                            }
                        }}
                    }}
                }
            }),
            None,
            json!({}),
        ),
    )
}
