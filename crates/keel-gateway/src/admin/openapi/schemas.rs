//! `components` but the shared error responses: request and response schemas of both protocols
//! (the fields keel reads, and the shapes it answers), keel's own bodies, and the request and
//! response headers.
//!
//! Request objects allow unknown fields (keel passes them through to the model server), so
//! only what keel itself validates is constrained here.

use serde_json::{json, Value};

/// A nullable schema of `type`.
fn nullable(ty: &str) -> Value {
    json!({"type": [ty, "null"]})
}

/// An object schema with `required` fields and `properties`; unknown fields allowed.
fn object(required: &[&str], properties: Value) -> Value {
    json!({"type": "object", "required": required, "properties": properties})
}

/// A health colour.
fn colour() -> Value {
    json!({"enum": ["green", "yellow", "red"]})
}

/// Why a colour is not green: one line per signal at yellow or red, naming its value and
/// threshold.
fn reasons() -> Value {
    json!({"type": "array", "items": {"type": "string"}})
}

/// `model`, as keel reads it: a non-empty pool name or alias.
fn model_field() -> Value {
    json!({"type": "string", "minLength": 1, "description": "A pool name or alias (see `GET /v1/models`)."})
}

fn stream_field() -> Value {
    json!({"type": ["boolean", "null"], "description": "Answer with server-sent events."})
}

/// A non-negative output limit.
fn token_limit(description: &str) -> Value {
    json!({"type": ["integer", "null"], "minimum": 0, "description": description})
}

/// A count of answers (`n`, `best_of`): a positive integer (400 otherwise), 1 when absent.
fn answers(description: &str) -> Value {
    json!({"type": ["integer", "null"], "minimum": 1, "default": 1, "description": description})
}

/// `messages`, as keel reads it: a non-empty array of objects that each have a string `role`
/// (the roles the protocol defines) and a `content` of text or typed parts.
fn messages_field(roles: &[&str], content_nullable: bool) -> Value {
    let mut content = vec![json!({"type": "string"})];
    if content_nullable {
        content.push(json!({"type": "null"}));
    }
    content.push(json!({"type": "array", "items": object(&["type"], json!({
        "type": {"type": "string"},
        "text": {"type": "string"}
    }))}));
    json!({
        "type": "array",
        "minItems": 1,
        "items": object(&["role"], json!({
            "role": {"enum": roles},
            "content": {
                "description": "A string, or an array of content parts (`{\"type\": \"text\", \"text\": …}` and others).",
                "anyOf": content
            }
        }))
    })
}

fn openai_requests() -> [(&'static str, Value); 4] {
    let user =
        json!({"type": "string", "description": "Stickiness key when `x-keel-session` is absent."});
    [
        (
            "ChatCompletionRequest",
            object(
                &["model", "messages"],
                json!({
                    "model": model_field(),
                    "messages": messages_field(&["system", "developer", "user", "assistant", "tool"], true),
                    "stream": stream_field(),
                    "max_completion_tokens": token_limit("Output limit (preferred over `max_tokens`)."),
                    "max_tokens": token_limit("Output limit."),
                    "n": answers("How many answers to generate; a key's tpm and token budgets reserve `max_tokens` for each."),
                    "user": user.clone(),
                }),
            ),
        ),
        (
            "CompletionRequest",
            object(
                &["model", "prompt"],
                json!({
                    "model": model_field(),
                    "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                    "stream": stream_field(),
                    "max_tokens": token_limit("Output limit."),
                    "n": answers("How many answers to return; a key's tpm and token budgets reserve `max_tokens` for each of `n` or `best_of`, whichever is larger."),
                    "best_of": answers("How many answers the server generates to return the best `n`."),
                    "user": user.clone(),
                }),
            ),
        ),
        (
            "ResponsesRequest",
            object(
                &["model", "input"],
                json!({
                    "model": model_field(),
                    "input": {"description": "Text, or an array of input items (messages with `role` and `content`, function call outputs, …).", "anyOf": [
                        {"type": "string"},
                        {"type": "array", "items": {"type": "object"}}
                    ]},
                    "instructions": nullable("string"),
                    "stream": stream_field(),
                    "max_output_tokens": token_limit("Output limit, reasoning tokens included."),
                    "previous_response_id": nullable("string"),
                    "user": user,
                }),
            ),
        ),
        (
            "EmbeddingsRequest",
            object(
                &["model", "input"],
                json!({
                    "model": model_field(),
                    "input": {"description": "Text, an array of texts, or token ids.", "anyOf": [
                        {"type": "string"},
                        {"type": "array", "items": {"type": "string"}},
                        {"type": "array", "items": {"type": "integer"}},
                        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}
                    ]},
                    "encoding_format": {"enum": ["float", "base64"]},
                    "dimensions": {"type": "integer", "minimum": 1},
                    "user": {"type": "string"},
                }),
            ),
        ),
    ]
}

fn openai_responses() -> [(&'static str, Value); 6] {
    let usage = json!({"type": ["object", "null"], "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"}
    }});
    let finish_reason = nullable("string");
    [
        (
            "ChatCompletion",
            object(
                &["id", "object", "choices"],
                json!({
                    "id": {"type": "string"},
                    "object": {"const": "chat.completion"},
                    "created": {"type": "integer"},
                    "model": {"type": "string"},
                    "choices": {"type": "array", "items": object(&["index", "message", "finish_reason"], json!({
                        "index": {"type": "integer"},
                        "message": object(&["role"], json!({
                            "role": {"const": "assistant"},
                            "content": nullable("string"),
                            "tool_calls": {"type": "array", "items": {"type": "object"}}
                        })),
                        "finish_reason": finish_reason.clone()
                    }))},
                    "usage": usage.clone(),
                }),
            ),
        ),
        (
            "Completion",
            object(
                &["id", "object", "choices"],
                json!({
                    "id": {"type": "string"},
                    "object": {"const": "text_completion"},
                    "created": {"type": "integer"},
                    "model": {"type": "string"},
                    "choices": {"type": "array", "items": object(&["index", "text", "finish_reason"], json!({
                        "index": {"type": "integer"},
                        "text": {"type": "string"},
                        "finish_reason": finish_reason
                    }))},
                    "usage": usage,
                }),
            ),
        ),
        (
            "Response",
            object(
                &["id", "object", "status", "output"],
                json!({
                    "id": {"type": "string"},
                    "object": {"const": "response"},
                    "created_at": {"type": "number"},
                    "status": {"type": "string", "description": "`completed`, `incomplete`, `failed`, `in_progress`, …"},
                    "model": {"type": "string"},
                    "output": {"type": "array", "items": object(&["type"], json!({"type": {"type": "string"}}))},
                    "usage": {"type": ["object", "null"], "properties": {
                        "input_tokens": {"type": "integer"},
                        "output_tokens": {"type": "integer"},
                        "total_tokens": {"type": "integer"}
                    }},
                }),
            ),
        ),
        (
            "EmbeddingList",
            object(
                &["object", "data"],
                json!({
                    "object": {"const": "list"},
                    "data": {"type": "array", "items": object(&["object", "index", "embedding"], json!({
                        "object": {"const": "embedding"},
                        "index": {"type": "integer"},
                        "embedding": {"description": "Numbers, or base64 of little-endian float32s with `encoding_format: base64`.",
                            "anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}
                    }))},
                    "model": {"type": "string"},
                    "usage": {"type": "object", "properties": {
                        "prompt_tokens": {"type": "integer"},
                        "total_tokens": {"type": "integer"}
                    }},
                }),
            ),
        ),
        (
            "OpenAIModel",
            object(
                &["id", "object"],
                json!({
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                }),
            ),
        ),
        (
            "OpenAIModelList",
            object(
                &["object", "data"],
                json!({
                    "object": {"const": "list"},
                    "data": {"type": "array", "items": {"$ref": "#/components/schemas/OpenAIModel"}},
                }),
            ),
        ),
    ]
}

fn anthropic_schemas() -> [(&'static str, Value); 6] {
    let system = json!({"description": "A string, or an array of text blocks.", "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "object"}}
    ]});
    let messages = messages_field(&["user", "assistant"], false);
    [
        (
            "MessagesRequest",
            object(
                &["model", "messages", "max_tokens"],
                json!({
                    "model": model_field(),
                    "messages": messages.clone(),
                    "max_tokens": {"type": "integer", "minimum": 0, "description": "Output limit."},
                    "system": system.clone(),
                    "stream": stream_field(),
                    "metadata": {"type": "object", "properties": {
                        "user_id": {"type": "string", "description": "Stickiness key when `x-keel-session` is absent."}
                    }},
                }),
            ),
        ),
        (
            "CountTokensRequest",
            object(
                &["model", "messages"],
                json!({
                    "model": model_field(),
                    "messages": messages,
                    "system": system,
                }),
            ),
        ),
        (
            "Message",
            object(
                &["id", "type", "role", "content"],
                json!({
                    "id": {"type": "string"},
                    "type": {"const": "message"},
                    "role": {"const": "assistant"},
                    "model": {"type": "string"},
                    "content": {"type": "array", "items": object(&["type"], json!({"type": {"type": "string"}}))},
                    "stop_reason": nullable("string"),
                    "stop_sequence": nullable("string"),
                    "usage": {"type": ["object", "null"], "properties": {
                        "input_tokens": {"type": "integer"},
                        "output_tokens": {"type": "integer"}
                    }},
                }),
            ),
        ),
        (
            "TokenCount",
            object(
                &["input_tokens"],
                json!({
                    "input_tokens": {"type": "integer", "minimum": 0}
                }),
            ),
        ),
        (
            "AnthropicModel",
            object(
                &["type", "id"],
                json!({
                    "type": {"const": "model"},
                    "id": {"type": "string"},
                    "display_name": {"type": "string"},
                    "created_at": {"type": "string"},
                }),
            ),
        ),
        (
            "AnthropicModelList",
            object(
                &["data", "has_more"],
                json!({
                    "data": {"type": "array", "items": {"$ref": "#/components/schemas/AnthropicModel"}},
                    "has_more": {"type": "boolean"},
                    "first_id": nullable("string"),
                    "last_id": nullable("string"),
                }),
            ),
        ),
    ]
}

/// Error bodies: the shapes `keel_core::protocol::error_body` writes.
fn errors() -> [(&'static str, Value); 2] {
    [
        (
            "OpenAIError",
            object(
                &["error"],
                json!({
                    "error": object(&["message", "type"], json!({
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": nullable("string"),
                        "code": {"type": ["string", "integer", "null"]}
                    }))
                }),
            ),
        ),
        (
            "AnthropicError",
            object(
                &["type", "error"],
                json!({
                    "type": {"const": "error"},
                    "error": object(&["type", "message"], json!({
                        "type": {"type": "string"},
                        "message": {"type": "string"}
                    }))
                }),
            ),
        ),
    ]
}

/// keel's own bodies (`/keel/health`, `/keel/decisions`).
fn keel_schemas() -> [(&'static str, Value); 2] {
    [
        (
            "Health",
            object(
                &["status", "colour", "reasons", "pools"],
                json!({
                    "status": {"const": "ok"},
                    "colour": colour(),
                    "reasons": reasons(),
                    "pools": {"type": "array", "items": object(&["name", "protocol", "variants", "colour", "reasons", "signals", "safe_mode"], json!({
                        "name": {"type": "string"},
                        "protocol": {"enum": ["openai", "anthropic"]},
                        "policy": {"type": "string"},
                        "colour": colour(),
                        "reasons": reasons(),
                        "signals": object(
                            &["window_ms", "requests", "fallback_ratio", "migration_ratio", "error_rate", "decision_ms", "eligible_capacity"],
                            json!({
                                "window_ms": {"type": "integer"},
                                "requests": {"type": "integer"},
                                "fallback_ratio": {"type": "number"},
                                "migration_ratio": {"type": "number"},
                                "error_rate": {"type": "number"},
                                "decision_ms": {"type": "number", "description": "Mean selection time over the window."},
                                "eligible_capacity": {"type": "number", "description": "Share of configured weight able to serve."}
                            }),
                        ),
                        "safe_mode": object(
                            &["active", "control", "green_for_ms", "exit_after_ms", "last_switch"],
                            json!({
                                "active": {"type": "boolean"},
                                "control": {"enum": ["auto", "on", "off"]},
                                "green_for_ms": {"type": "integer"},
                                "exit_after_ms": {"type": "integer"},
                                "last_switch": {"anyOf": [{"type": "null"}, object(&["active", "reason", "at_ms"], json!({
                                    "active": {"type": "boolean"},
                                    "reason": {"type": "string"},
                                    "at_ms": {"type": "integer", "description": "Milliseconds since the gateway started."}
                                }))]}
                            }),
                        ),
                        "canary": {"type": "object", "description": "Only for a pool with `[pools.canary]`: `phase` (`rolling`, `promoted`, `rolled_back`), `step`, `weight_percent`, `steps`, `in_phase_ms`, `step_stats` (the candidate's attempts, errors, error rate, TTFT P99 and shadow agreement over the step) and the latest `transitions` with their reasons."},
                        "variants": {"type": "array", "items": object(&["name", "state", "available"], json!({
                            "name": {"type": "string"},
                            "dialect": {"enum": ["openai", "anthropic", "azure", "gemini", "vertex", "bedrock", "openai-responses"], "description": "What the variant's upstream speaks; `protocol` above is the hub the pool is spoken to in."},
                            "state": {"type": "string"},
                            "available": {"type": "boolean"},
                            "in_flight": {"type": "integer"},
                            "concurrency_limit": nullable("integer"),
                            "connections_held": {"type": ["integer", "null"], "description": "Upstream connections open now under the variant's `max_connections` (busy or idle); null without a cap."}
                        }))}
                    }))}
                }),
            ),
        ),
        (
            "DecisionRecord",
            object(
                &[
                    "request_id",
                    "time_unix_ms",
                    "pool",
                    "endpoint",
                    "policy",
                    "reason",
                    "plan",
                    "candidates",
                    "attempts",
                    "hedges",
                    "migrations",
                    "prompt_fixes",
                    "route",
                    "variant",
                    "status",
                    "outcome",
                    "total_ms",
                    "upstream_wait_ms",
                ],
                json!({
                    "request_id": {"type": "string"},
                    "time_unix_ms": {"type": "integer"},
                    "pool": {"type": "string"},
                    "endpoint": {"type": "string"},
                    "key": {"type": ["string", "null"]},
                    "tenant": {"type": ["string", "null"]},
                    "policy": {"type": "string"},
                    "reason": {"type": "string"},
                    "affinity_key": {"type": ["string", "null"]},
                    "plan": {"type": "array", "items": {"type": "string"}},
                    "candidates": {"type": "array", "items": {"type": "object"}},
                    "candidates_omitted": {
                        "type": "object",
                        "description": "Pools of more than 16 variants: the candidates not listed, counted.",
                        "properties": {
                            "count": {"type": "integer"},
                            "eligible": {"type": "integer"},
                            "by_state": {"type": "object", "additionalProperties": {"type": "integer"}},
                            "plan_tail": {"type": "integer"}
                        }
                    },
                    "duration_us": {"type": "number"},
                    "attempts": {"type": "array", "items": {"type": "object"}},
                    "hedges": {"type": "array", "items": {"type": "object"}},
                    "migrations": {"type": "array", "items": {"type": "object"}},
                    "prompt_fixes": {"type": "array", "items": {"type": "string"}},
                    "guard": {"type": "string", "description": "What the PII and secret guard found and did, as `x-keel-guard`: `masked=email:2;blocked=secret:1` (types and counts, never values; present when it found anything)."},
                    "prompt_edits": {"type": "array", "description": "What normalization changed (present when anything did, unless `decision_prompt_edits = false`): at most 8 edits, each the text around one change before and after, invisible characters written as escapes.", "items": {"type": "object", "required": ["at", "before", "after"], "properties": {"at": {"type": "string", "description": "`system`, `messages[i]` or `messages[i].text[k]`"}, "before": {"type": "string"}, "after": {"type": "string"}}}},
                    "route": {"type": "string"},
                    "variant": {"type": "string"},
                    "status": {"type": "integer"},
                    "outcome": {"type": "string"},
                    "ttft_ms": {"type": ["number", "null"]},
                    "total_ms": {"type": "number"},
                    "upstream_wait_ms": {"type": "number"},
                    "overhead_us": {"type": ["integer", "null"]},
                    "canary": {"enum": ["stable", "candidate"], "description": "The canary side the request was put on (pools with `[pools.canary]` only)."},
                    "integrity": {"type": "array", "items": {"type": "string"}, "description": "Output integrity events, `<issue>:<action>` (present when any)."},
                    "consensus": {"type": "object", "description": "A consensus request's answers, agreement and disagreeing fields (present for consensus requests)."},
                    "cache": {"type": "string", "description": "What the response cache did: hit, miss, stored or bypass"},
                    "cached_from": {"type": ["string", "null"], "description": "For a cache hit: the request whose answer was replayed"}
                }),
            ),
        ),
    ]
}

/// A request header parameter.
fn header_param(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "header", "required": false, "description": description, "schema": schema})
}

/// `components.parameters`: the request headers.
pub fn parameters() -> Value {
    json!({
        "Session": header_param("x-keel-session",
            "Stickiness key: requests with one key prefer one variant (overrides `user` / `metadata.user_id`).",
            json!({"type": "string"})),
        "TimeoutMs": header_param("x-keel-timeout-ms",
            "Deadline for all attempts together, in milliseconds (capped by the pool's `total_ms`); past it keel answers 504.",
            json!({"type": "integer", "minimum": 1})),
        "ForceVariant": header_param("x-keel-force-variant",
            "Send the request to this variant first (only with `allow_force_variant = true`; 400 otherwise).",
            json!({"type": "string"})),
        "Preference": header_param("x-keel-preference",
            "What selection favours.",
            json!({"enum": ["low-latency", "high-fidelity", "low-cost"]})),
        "MinTier": header_param("x-keel-min-tier",
            "Only variants of this fidelity tier or better (1 = best).",
            json!({"type": "integer", "minimum": 1, "maximum": 255})),
        "Priority": header_param("x-keel-priority",
            "Rank in the wait line of a full pool (then the deadline, then arrival). With no virtual keys configured it is taken as sent; a key's priority caps it (a client may only lower its own).",
            json!({"enum": ["high", "normal", "low"], "default": "normal"})),
        "Normalize": header_param("x-keel-normalize",
            "Prompt normalization for this request, over the key's and the pool's `normalize`. Only the modes the key's (else the pool's) `client_normalize` lists may be chosen (default `off` and `syntax`), or the mode that applies anyway; another is a 400 naming the allowed modes.",
            json!({"enum": ["off", "syntax", "full"]})),
        "Cache": header_param("x-keel-cache",
            "The response cache for this request (pools with `[pools.cache]`): `no-cache` skips the lookup (the fresh answer is stored), `no-store` never stores the answer, `off` does neither, `on` is the default. `cache-control: no-cache` / `no-store` are honoured too.",
            json!({"enum": ["on", "off", "no-cache", "no-store"]})),
        "AnthropicVersion": header_param("anthropic-version",
            "Present: answer in Anthropic's shape (lists, models, errors).",
            json!({"type": "string"})),
    })
}

/// `components.headers`: the response headers.
pub fn headers() -> Value {
    let header =
        |description: &str, schema: Value| json!({"description": description, "schema": schema});
    json!({
        "RequestId": header("keel's id for the request (a UUIDv7), as in its logs and decision records.", json!({"type": "string"})),
        "Route": header("How the answer was reached: `direct`, `fallback`, `hedged`, `migrated`, `cached` (the response cache); keel's own answers: `local` (a success), `rejected` (bad input, authentication, not found), `throttled` (a limit or the wait line), `unavailable` (no variant could serve).", json!({"type": "string"})),
        "Variant": header("The variant that answered (`none` when no variant was tried, `keel-estimate` for keel's own token count).", json!({"type": "string"})),
        "Attempts": header("Upstream attempts made.", json!({"type": "integer", "minimum": 0})),
        "OverheadUs": header("Time spent inside keel, µs: since the request arrived until the response head, minus the time with an upstream attempt outstanding (a stream: up to its first byte).", json!({"type": "integer", "minimum": 0})),
        "PromptFix": header("Fix codes of a cross-protocol translation: what was dropped or changed.", json!({"type": "string"})),
        "CacheState": header("What the response cache did: `hit` (answered from the cache; route `cached`), `stored` (this whole answer was stored), `miss` (went upstream; a stream may be stored at its end), `bypass` (not cacheable, or the cache is off).", json!({"enum": ["hit", "stored", "miss", "bypass"]})),
        "RetryAfter": header("Seconds to wait before retrying.", json!({"type": "integer", "minimum": 0})),
        "RetryAfterMs": header("Milliseconds to wait before retrying.", json!({"type": "integer", "minimum": 0})),
    })
}

/// `components.schemas`.
pub fn schemas() -> Value {
    let schemas: serde_json::Map<String, Value> = openai_requests()
        .into_iter()
        .chain(openai_responses())
        .chain(anthropic_schemas())
        .chain(errors())
        .chain(keel_schemas())
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    Value::Object(schemas)
}
