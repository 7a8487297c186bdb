//! One OpenAPI operation per route: parameters, request body, and every response keel can give
//! (its own errors, and a model server's client errors passed through), with their headers.

use keel_core::protocol::{Endpoint, Protocol};
use serde_json::{json, Map, Value};

mod process;

use crate::pipeline::context::ClientApi;
use crate::wire::routes::{Access, Route, Target};

fn schema_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

fn param_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/parameters/{name}")})
}

fn header_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/headers/{name}")})
}

/// The `x-keel-*` headers on every answer to a generation request.
fn keel_headers(retry: bool) -> Value {
    let mut h = Map::new();
    for (name, component) in [
        ("x-keel-request-id", "RequestId"),
        ("x-keel-route", "Route"),
        ("x-keel-variant", "Variant"),
        ("x-keel-attempts", "Attempts"),
        ("x-keel-overhead-us", "OverheadUs"),
    ] {
        h.insert(name.into(), header_ref(component));
    }
    if retry {
        h.insert("retry-after".into(), header_ref("RetryAfter"));
        h.insert("retry-after-ms".into(), header_ref("RetryAfterMs"));
    }
    Value::Object(h)
}

/// The error schema for a protocol; `None` for paths shared by both protocols, where the
/// `anthropic-version` request header picks the shape.
fn error_schema(protocol: Option<Protocol>) -> Value {
    match protocol {
        Some(Protocol::OpenAi) => schema_ref("OpenAIError"),
        Some(Protocol::Anthropic) => schema_ref("AnthropicError"),
        None => json!({"anyOf": [schema_ref("OpenAIError"), schema_ref("AnthropicError")]}),
    }
}

/// Why keel answers each error status it answers itself.
const ERROR_STATUSES: &[(&str, &str)] = &[
    ("400", "Invalid request: malformed JSON, a missing or mistyped field keel reads, an invalid `x-keel-*` header, or a prompt longer than every variant's context window."),
    ("404", "No such model (pool), or no such route."),
    ("408", "The request body did not arrive within `body_read_timeout_ms`."),
    ("413", "The request body is larger than `max_body_bytes`."),
    ("415", "The request's `content-type` is not JSON."),
    ("429", "The pool's wait line is full of requests of the same or higher priority (`x-keel-priority`), or one of higher priority took this one's place; `retry-after` says when to try again, from the measured drain rate."),
    ("500", "keel failed while handling the request (a bug; reported in keel's log)."),
    ("502", "Every attempt failed: the model servers answered with errors, broke the connection or sent invalid responses."),
    ("503", "Every variant of the pool is cooling down, loading its model, or at its concurrency limit and the request's expected wait in line is longer than it may wait (`queue_ms`, its deadline); `retry-after` says when to try again. Also the answer to a new connection while `max_connections` are open (HTTP/1.1, `retry-after: 1`, `connection: close`)."),
    ("504", "The request's deadline (the pool's `total_ms`, or `x-keel-timeout-ms`) passed before an answer."),
];

/// Every error status of a generation request, with why keel answers it: keel's own, then a
/// model server's client errors passed through (`4XX`).
fn error_statuses() -> impl Iterator<Item = (&'static str, &'static str)> {
    ERROR_STATUSES.iter().copied().chain(std::iter::once((
        "4XX",
        "A client error from the model server (for example 401, 403, 422 or 429), passed through in the client's protocol.",
    )))
}

/// The name of the shared response component for one protocol's error status.
fn error_component(protocol: Protocol, status: &str) -> String {
    let prefix = match protocol {
        Protocol::OpenAi => "OpenAIError",
        Protocol::Anthropic => "AnthropicError",
    };
    format!("{prefix}{status}")
}

/// `components.responses`: each protocol's error responses, shared by its generation endpoints.
pub fn response_components() -> Value {
    let mut out = Map::new();
    for protocol in [Protocol::OpenAi, Protocol::Anthropic] {
        for (status, why) in error_statuses() {
            // Waiting helps when keel is saturated (429, 503) and may when a model server
            // refused (4XX).
            let retry = matches!(status, "429" | "503" | "4XX");
            out.insert(
                error_component(protocol, status),
                error_response(why, Some(protocol), keel_headers(retry)),
            );
        }
    }
    Value::Object(out)
}

/// A JSON error response.
pub(super) fn error_response(
    description: &str,
    protocol: Option<Protocol>,
    headers: Value,
) -> Value {
    json!({
        "description": description,
        "headers": headers,
        "content": {"application/json": {"schema": error_schema(protocol)}}
    })
}

/// A JSON 200 response (and, where the request may ask for one, its event stream).
pub(super) fn ok_response(
    description: &str,
    schema: Value,
    stream: Option<&str>,
    headers: Value,
) -> Value {
    let mut content = json!({"application/json": {"schema": schema}});
    if let Some(events) = stream {
        // Before OpenAPI 3.2 (`itemSchema`), an event stream's `schema` describes each event:
        // its `event` name, `data` and `id`, as 3.2 spells them.
        content["text/event-stream"] = json!({
            "schema": {
                "type": "object",
                "description": events,
                "required": ["data"],
                "properties": {
                    "event": {"type": "string"},
                    "data": {"type": "string"},
                    "id": {"type": "string"},
                    "retry": {"type": "integer", "minimum": 0}
                }
            }
        });
    }
    json!({"description": description, "headers": headers, "content": content})
}

/// What is special about one generation endpoint.
struct Generation {
    id: &'static str,
    summary: &'static str,
    description: &'static str,
    protocol: Protocol,
    request: &'static str,
    response: &'static str,
    /// The events of the stream answered when the body has `"stream": true`.
    stream: Option<&'static str>,
    /// A typical request body.
    example: Value,
}

/// A generation (or token count) operation.
fn generation(g: Generation) -> Value {
    let tag = g.protocol.as_str();
    let mut responses = Map::new();
    responses.insert(
        "200".into(),
        ok_response(
            "The model server's answer, in the client's protocol (translated when the variant speaks the other one).",
            schema_ref(g.response),
            g.stream,
            {
                let mut h = keel_headers(false);
                h["x-keel-prompt-fix"] = header_ref("PromptFix");
                h["x-keel-cache"] = header_ref("CacheState");
                h
            },
        ),
    );
    for (status, _) in error_statuses() {
        responses.insert(
            status.into(),
            json!({"$ref": format!("#/components/responses/{}", error_component(g.protocol, status))}),
        );
    }
    json!({
        "operationId": g.id,
        "summary": g.summary,
        "description": g.description,
        "tags": [tag],
        "parameters": [
            param_ref("Session"),
            param_ref("TimeoutMs"),
            param_ref("ForceVariant"),
            param_ref("Preference"),
            param_ref("MinTier"),
            param_ref("Priority"),
            param_ref("Normalize"),
            param_ref("Cache"),
        ],
        "requestBody": {
            "required": true,
            "content": {"application/json": {"schema": schema_ref(g.request), "example": g.example}}
        },
        "responses": responses,
    })
}

const OPENAI_STREAM: &str = "With `\"stream\": true`: server-sent events, each `data:` a JSON chunk, ending with `data: [DONE]`. A stream keel cannot complete ends with a `data:` object carrying `error` (OpenAI's error shape) and no `[DONE]`.";
const ANTHROPIC_STREAM: &str = "With `\"stream\": true`: server-sent events `message_start`, `content_block_start`, `content_block_delta`, `content_block_stop`, `message_delta`, `message_stop` (and `ping`). A stream keel cannot complete ends with `event: error` (Anthropic's error shape).";

fn generation_endpoint(ep: Endpoint) -> Value {
    let g = match ep {
        Endpoint::ChatCompletions => Generation {
            id: "createChatCompletion",
            summary: "OpenAI Chat Completions",
            description: "Relays a chat completion to a variant of the pool named by `model`.",
            protocol: Protocol::OpenAi,
            request: "ChatCompletionRequest",
            response: "ChatCompletion",
            stream: Some(OPENAI_STREAM),
            example: json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}),
        },
        Endpoint::Completions => Generation {
            id: "createCompletion",
            summary: "OpenAI (legacy) Completions",
            description: "Relays a text completion to an OpenAI-protocol variant of the pool named by `model` (a pool with none answers 400).",
            protocol: Protocol::OpenAi,
            request: "CompletionRequest",
            response: "Completion",
            stream: Some(OPENAI_STREAM),
            example: json!({"model": "gpt-4o-mini", "prompt": "Once upon a time", "max_tokens": 16}),
        },
        Endpoint::Messages => Generation {
            id: "createMessage",
            summary: "Anthropic Messages",
            description: "Relays a message to a variant of the pool named by `model`.",
            protocol: Protocol::Anthropic,
            request: "MessagesRequest",
            response: "Message",
            stream: Some(ANTHROPIC_STREAM),
            example: json!({"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}),
        },
        Endpoint::CountTokens => Generation {
            id: "countMessageTokens",
            summary: "Anthropic token count",
            description: "Counts a message's input tokens on an Anthropic-protocol variant, or answers keel's own estimate when the pool has none.",
            protocol: Protocol::Anthropic,
            request: "CountTokensRequest",
            response: "TokenCount",
            stream: None,
            example: json!({"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "Hello"}]}),
        },
        Endpoint::Embeddings => return embeddings(),
    };
    generation(g)
}

/// OpenAI `POST /v1/responses` (served in front of the Chat Completions path).
fn responses() -> Value {
    generation(Generation {
        id: "createResponse",
        summary: "OpenAI Responses",
        description: "Runs a Responses API request as a chat completion on a variant of the pool named by `model` (either protocol) and answers as a Response object or Responses events. Fields that need stored responses (`previous_response_id`, `conversation`, `background`, `prompt`) and hosted tools are refused with 400.",
        protocol: Protocol::OpenAi,
        request: "ResponsesRequest",
        response: "Response",
        stream: Some("With `\"stream\": true`: server-sent events named by their `type` (`response.created`, `response.output_text.delta`, …, `response.completed`), each `data:` a JSON object with that `type`."),
            example: json!({"model": "gpt-4o-mini", "input": "Hello", "max_output_tokens": 16}),
    })
}

/// OpenAI `POST /v1/embeddings`.
fn embeddings() -> Value {
    generation(Generation {
        id: "createEmbedding",
        summary: "OpenAI Embeddings",
        description: "Relays an embeddings request to a variant of the pool named by `model`.",
        protocol: Protocol::OpenAi,
        request: "EmbeddingsRequest",
        response: "EmbeddingList",
        stream: None,
        example: json!({"model": "text-embedding-3-small", "input": "Hello"}),
    })
}

/// A GET operation answered by keel itself.
/// The `x-keel-*` headers on keel's own answers (no upstream is involved).
fn own_headers() -> Value {
    let mut h = Map::new();
    for (name, component) in [
        ("x-keel-request-id", "RequestId"),
        ("x-keel-route", "Route"),
    ] {
        h.insert(name.into(), header_ref(component));
    }
    Value::Object(h)
}

/// A GET answered by keel itself; its 200 carries keel's own headers.
pub(super) fn keel_get(id: &str, summary: &str, tag: &str, mut ok: Value) -> Value {
    if ok["headers"].as_object().is_some_and(|h| h.is_empty()) {
        ok["headers"] = own_headers();
    }
    json!({
        "operationId": id,
        "summary": summary,
        "tags": [tag],
        "responses": {"200": ok}
    })
}

fn models_list() -> Value {
    let mut op = keel_get(
        "listModels",
        "The models served: every pool's name and aliases",
        "models",
        ok_response(
            "OpenAI's list shape, or Anthropic's when the request has `anthropic-version`.",
            json!({"anyOf": [schema_ref("OpenAIModelList"), schema_ref("AnthropicModelList")]}),
            None,
            json!({}),
        ),
    );
    op["parameters"] = json!([param_ref("AnthropicVersion")]);
    op
}

fn model_get() -> Value {
    let mut op = keel_get(
        "retrieveModel",
        "One model served",
        "models",
        ok_response(
            "OpenAI's model shape, or Anthropic's when the request has `anthropic-version`.",
            json!({"anyOf": [schema_ref("OpenAIModel"), schema_ref("AnthropicModel")]}),
            None,
            json!({}),
        ),
    );
    op["parameters"] = json!([
        {
            "name": "model_id",
            "in": "path",
            "required": true,
            "description": "A pool name or alias (percent-encoded; it may hold `/`).",
            "schema": {"type": "string", "minLength": 1}
        },
        param_ref("AnthropicVersion")
    ]);
    op["responses"]["404"] = error_response(
        "The model is not served here (in the protocol picked by `anthropic-version`).",
        None,
        json!({}),
    );
    op
}

fn text_ok(description: &str, content_type: &str) -> Value {
    json!({
        "description": description,
        "content": {content_type: {"schema": {"type": "string"}}}
    })
}

fn key_usage() -> Value {
    let mut op = keel_get(
        "keyUsage",
        "A virtual key's limits, budgets and in-flight count",
        "keel",
        ok_response(
            "The key's usage now.",
            json!({
                "type": "object",
                "required": ["id", "tenant", "limits", "budgets", "in_flight"],
                "properties": {
                    "id": {"type": "string"},
                    "tenant": {"type": "string"},
                    "limits": {"type": "object"},
                    "budgets": {"type": "array", "items": {"type": "object"}},
                    "in_flight": {"type": "integer"}
                }
            }),
            None,
            json!({}),
        ),
    );
    op["parameters"] = json!([{
        "name": "key_id",
        "in": "path",
        "required": true,
        "description": "The key's `id` in `[[keys]]`.",
        "schema": {"type": "string", "minLength": 1, "pattern": "^[^/]+$"}
    }]);
    op["responses"]["404"] =
        error_response("No key has this id.", Some(Protocol::OpenAi), json!({}));
    op
}

/// A 4xx keel answers itself on its own endpoints (OpenAI's error shape).
fn own_error(op: &mut Value, status: &str, why: &str) {
    op["responses"][status] = error_response(why, Some(Protocol::OpenAi), own_headers());
}

fn decisions_list() -> Value {
    let mut op = keel_get(
        "decisions",
        "The latest decision records, newest first, filtered by pool, variant and route",
        "keel",
        ok_response(
            "Decision records, newest first.",
            json!({"type": "array", "items": schema_ref("DecisionRecord")}),
            None,
            json!({}),
        ),
    );
    let text = |name: &str, description: &str| json!({"name": name, "in": "query", "required": false, "description": description, "schema": {"type": "string"}});
    op["parameters"] = json!([
        text("pool", "Only this pool's requests."),
        text("variant", "Only requests that made an attempt on this variant, or were served by it."),
        text("route", "Only requests answered with this `x-keel-route` (`direct`, `fallback`, `hedged`, `migrated`, `throttled`, `rejected`, `unavailable`, …)."),
        {"name": "limit", "in": "query", "required": false, "description": "At most this many records (default 100).",
         "schema": {"type": "integer", "minimum": 1, "maximum": crate::observe::decisions::QUERY_MAX}}
    ]);
    own_error(
        &mut op,
        "400",
        "An unknown query parameter, or a limit outside 1..=1000.",
    );
    op
}

fn decision_get() -> Value {
    let mut op = keel_get(
        "decision",
        "One request's decision record, by its `x-keel-request-id`",
        "keel",
        ok_response(
            "The decision record.",
            schema_ref("DecisionRecord"),
            None,
            json!({}),
        ),
    );
    op["parameters"] = json!([{
        "name": "request_id",
        "in": "path",
        "required": true,
        "description": "The request's `x-keel-request-id`.",
        "schema": {"type": "string", "minLength": 1}
    }]);
    own_error(
        &mut op,
        "404",
        "No record for this id: unknown, or evicted from the ring (`decisions_kept`).",
    );
    op
}

/// `POST /keel/admin/safe-mode`.
fn safe_mode() -> Value {
    let mut op = keel_get(
        "setSafeMode",
        "Force a pool's safe mode on or off, or hand it back to the health colour (admin key required when keys are configured)",
        "keel",
        ok_response(
            "The pools the order applied to, with their safe mode now.",
            json!({
                "type": "object",
                "required": ["pools"],
                "properties": {"pools": {"type": "array", "items": {
                    "type": "object",
                    "required": ["name", "safe_mode", "control"],
                    "properties": {
                        "name": {"type": "string"},
                        "safe_mode": {"type": "boolean"},
                        "control": {"enum": ["auto", "on", "off"]}
                    }
                }}}
            }),
            None,
            json!({}),
        ),
    );
    op["requestBody"] = json!({
        "required": true,
        "content": {"application/json": {
            "schema": {
                "type": "object",
                "required": ["mode"],
                "additionalProperties": false,
                "properties": {
                    "pool": {"type": ["string", "null"], "description": "A pool name; null or absent: every pool."},
                    "mode": {"enum": ["on", "off", "auto"], "description": "`on`/`off` force safe mode; `auto` lets the pool's health colour decide again."}
                }
            },
            "example": {"pool": null, "mode": "auto"}
        }}
    });
    for (status, why) in [
        ("400", "The body is not `{\"pool\": …, \"mode\": …}`."),
        ("404", "No pool has this name."),
        (
            "408",
            "The request body did not arrive within `body_read_timeout_ms`.",
        ),
        ("413", "The request body is larger than 4 KiB."),
        ("415", "The request's `content-type` is not JSON."),
    ] {
        op["responses"][status] = error_response(why, Some(Protocol::OpenAi), json!({}));
    }
    op
}

fn events() -> Value {
    let mut op = keel_get(
        "events",
        "The dashboard's live feed: one JSON snapshot per second as server-sent events",
        "keel",
        json!({
            "description": "An endless event stream; each event's `data` is one snapshot: `health` (as `GET /keel/health`), `window` (route mix over the last minute, TTFT P50/P99 per pool over the last five minutes), `decisions` (the latest, newest first).",
            "content": {"text/event-stream": {"schema": {"type": "string"}}}
        }),
    );
    op["responses"]["503"] = error_response(
        "Too many subscribers already (16): close a dashboard and try again.",
        Some(Protocol::OpenAi),
        json!({"retry-after": header_ref("RetryAfter"), "retry-after-ms": header_ref("RetryAfterMs")}),
    );
    op
}

/// The operation documenting one served route, with who may call it (`routes::Access`).
pub fn for_route(r: &Route) -> Value {
    let mut op = operation(r);
    let (security, unauthorized, forbidden) = match r.target.access() {
        Access::Anyone | Access::Tenant => return op,
        Access::Ops => (
            json!([{"adminKey": []}, {"opsKey": []}, {}]),
            "Keys or an admin key are configured, and no key (or an unknown one) was sent.",
            "The key sent is a tenant's key without the `ops` role.",
        ),
        Access::Admin => (
            json!([{"adminKey": []}, {}]),
            "Keys or an admin key are configured, and no admin key was sent.",
            "The key sent is not the admin key (or none is configured); or, on a gateway without keys, the request came from a web page of another origin.",
        ),
    };
    op["security"] = security;
    let mut errors = vec![("401", unauthorized), ("403", forbidden)];
    if r.target.access() == Access::Admin {
        errors.push((
            "415",
            "On a gateway without keys, the request was not sent as `application/json`.",
        ));
    }
    for (status, why) in errors {
        if op["responses"].get(status).is_none() {
            op["responses"][status] = error_response(why, Some(Protocol::OpenAi), json!({}));
        }
    }
    op
}

fn operation(r: &Route) -> Value {
    match r.target {
        Target::Generation(ClientApi::Endpoint(Endpoint::Embeddings)) => embeddings(),
        Target::Generation(ClientApi::Endpoint(ep)) => generation_endpoint(ep),
        Target::Generation(ClientApi::Responses) => responses(),
        Target::Models => models_list(),
        Target::Model => model_get(),
        Target::Health => keel_get(
            "health",
            "Health colours (overall and per pool, with reasons), safe mode, and each pool's variants: state, statistics, limits",
            "keel",
            ok_response(
                "Health of every pool.",
                schema_ref("Health"),
                None,
                json!({}),
            ),
        ),
        Target::Decisions => decisions_list(),
        Target::Decision => decision_get(),
        Target::Metrics => {
            // Served at two paths; operation ids must be unique.
            let id = if r.path == "/metrics" {
                "metrics"
            } else {
                "keelMetrics"
            };
            keel_get(
                id,
                "Prometheus metrics (text exposition format 0.0.4)",
                "keel",
                text_ok("Metrics.", "text/plain"),
            )
        }
        Target::KeyUsage => key_usage(),
        Target::SafeMode => safe_mode(),
        Target::Shadow => super::rollout::shadow(),
        Target::Analyze => super::rollout::analyze(),
        Target::CanaryPromote => super::rollout::canary(true),
        Target::CanaryRollback => super::rollout::canary(false),

        Target::Reload => process::reload(),
        Target::Ready => process::ready(),
        Target::Live => process::live(),
        Target::Events => events(),
        Target::Dashboard => keel_get(
            "dashboard",
            "The live dashboard: one self-contained HTML page fed by /keel/events",
            "keel",
            text_ok("The page.", "text/html"),
        ),
        Target::OpenApi => keel_get(
            "openapi",
            "This document (also committed as docs/openapi.json)",
            "keel",
            ok_response(
                "The OpenAPI 3.1 document.",
                json!({"type": "object"}),
                None,
                json!({}),
            ),
        ),
    }
}
