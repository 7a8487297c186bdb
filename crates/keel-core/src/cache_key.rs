//! The response cache's pure decisions: which requests may be answered from a cache, the
//! fingerprint that names a request's answer, and which answers are fit to be stored.
//!
//! **Cacheable by policy.** Only requests whose answer is deterministic enough to repeat: a
//! `temperature` at or below the pool's ceiling (a request without one samples at the APIs'
//! default of 1.0), no `n` > 1, and no tools unless the pool allows them (a tool call may have
//! side effects the client expects to happen every time).
//!
//! **The fingerprint** is SHA-256 over the request as it goes upstream after normalization,
//! serialized canonically: object keys sorted at every depth, numbers written one way (`0`
//! and `0.0` are the same temperature), the public model name replaced by the pool's (an
//! alias asks for the same answers), and the fields that change nothing in the answer left
//! out ([`IGNORED_FIELDS`]: `stream`, `stream_options`, `user`, `metadata`, …) — so a streamed
//! and a whole request share one entry. The namespace (a tenant, or `open`) and the client's
//! endpoint (a Chat and a Messages answer have different shapes) are hashed in first, each
//! length-prefixed so no two (namespace, request) pairs can write the same bytes.
//!
//! **Storable answers** ([`storable`]): the whole answer a client was given, with a finish
//! reason (a stream that never said why it ended was cut), and when the request asked for a
//! structured output, text that parses as JSON — for a JSON schema, an object holding every
//! top-level `required` key with a value of the declared JSON type. (keel does not carry a
//! full JSON-schema validator; this is the part of the schema an answer most often breaks.)

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::json_out::write_str;
use crate::members::Members;
use crate::protocol::Endpoint;

/// Request fields that do not change the answer: left out of the fingerprint.
pub const IGNORED_FIELDS: [&str; 6] = [
    "stream",
    "stream_options",
    "user",
    "metadata",
    "store",
    "service_tier",
];

/// The temperature a request without one samples at (OpenAI's and Anthropic's default).
pub const DEFAULT_TEMPERATURE: f64 = 1.0;

/// What makes a request cacheable.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// Highest `temperature` whose answers are cached.
    pub max_temperature: f64,
    /// Whether requests that declare tools are cached.
    pub allow_tools: bool,
}

/// Why a request is not cacheable (the `reason` label of `keel_cache_bypass_total`).
pub fn bypass_reason(
    endpoint: Endpoint,
    body: &Map<String, Value>,
    policy: Policy,
) -> Option<&'static str> {
    if !matches!(
        endpoint,
        Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Messages
    ) {
        return Some("endpoint");
    }
    let temperature = body
        .member("temperature")
        .and_then(Value::as_f64)
        .unwrap_or(DEFAULT_TEMPERATURE);
    if temperature > policy.max_temperature {
        return Some("temperature");
    }
    if body
        .member("n")
        .and_then(Value::as_u64)
        .is_some_and(|n| n > 1)
    {
        return Some("n");
    }
    let has_tools = body
        .member("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    if has_tools && !policy.allow_tools {
        return Some("tools");
    }
    None
}

/// The canonical bytes of a request's output-affecting content (see the module doc).
pub fn canonical_bytes(pool: &str, body: &Map<String, Value>) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    let mut keys: Vec<&String> = body
        .keys()
        .filter(|k| !IGNORED_FIELDS.contains(&k.as_str()))
        .collect();
    keys.sort();
    out.push(b'{');
    for (i, k) in keys.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_str(&mut out, k);
        out.push(b':');
        if k == "model" {
            write_str(&mut out, pool);
        } else {
            write_value(&mut out, &body[k.as_str()]);
        }
    }
    out.push(b'}');
    out
}

/// The cache key of a request: hex SHA-256 of namespace, endpoint and canonical request.
pub fn fingerprint(
    namespace: &str,
    endpoint: Endpoint,
    pool: &str,
    body: &Map<String, Value>,
) -> String {
    let mut h = Sha256::new();
    for part in [namespace.as_bytes(), endpoint.as_str().as_bytes()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    h.update(canonical_bytes(pool, body));
    let digest = h.finalize();
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push(b'{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_str(out, k);
                out.push(b':');
                write_value(out, &m[k.as_str()]);
            }
            out.push(b'}');
        }
        Value::Array(a) => {
            out.push(b'[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(out, x);
            }
            out.push(b']');
        }
        Value::Number(n) => out.extend_from_slice(canonical_number(n).as_bytes()),
        // serde_json's own escaping: one spelling per string.
        Value::String(s) => write_str(out, s),
        other => out.extend_from_slice(other.to_string().as_bytes()),
    }
}

/// Integers as integers (exactly, whatever their size); a float with no fractional part below
/// 2^53 as the integer it equals; other floats in Rust's shortest round-trip form.
fn canonical_number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    match n.as_f64() {
        Some(f) if f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0 => {
            format!("{}", f as i64)
        }
        Some(f) => format!("{f}"),
        None => n.to_string(),
    }
}

/// Fields that hold the prompt: the semantic mode compares them by embedding and everything
/// else by equality.
const PROMPT_FIELDS: [&str; 3] = ["messages", "system", "prompt"];

/// The prompt as one text for an embedding: each message as `role: text` on its own lines
/// (text parts only), the system prompt first, or a completions `prompt`.
pub fn prompt_text(body: &Map<String, Value>) -> String {
    fn text(v: &Value, out: &mut String) {
        match v {
            Value::String(s) => out.push_str(s),
            Value::Array(parts) => {
                for p in parts {
                    if let Some(t) = p.member("text").and_then(Value::as_str).or(p.as_str()) {
                        out.push_str(t);
                        out.push('\n');
                    }
                }
            }
            _ => {}
        }
    }
    let mut out = String::new();
    if let Some(system) = body.member("system") {
        out.push_str("system: ");
        text(system, &mut out);
        out.push('\n');
    }
    for m in body
        .member("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        out.push_str(m.member("role").and_then(Value::as_str).unwrap_or(""));
        out.push_str(": ");
        if let Some(c) = m.member("content") {
            text(c, &mut out);
        }
        out.push('\n');
    }
    if let Some(p) = body.member("prompt") {
        text(p, &mut out);
    }
    out
}

/// The key of everything but the prompt: requests that may answer each other in the semantic
/// mode share it (same namespace, endpoint, pool and parameters).
pub fn parameters_fingerprint(
    namespace: &str,
    endpoint: Endpoint,
    pool: &str,
    body: &Map<String, Value>,
) -> String {
    let rest: Map<String, Value> = body
        .iter()
        .filter(|(k, _)| !PROMPT_FIELDS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    fingerprint(namespace, endpoint, pool, &rest)
}

/// 1 − cosine similarity of two vectors (2 when either is empty, of zero length, or their
/// lengths differ: nothing is near it).
pub fn cosine_distance(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.is_empty() {
        return 2.0;
    }
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (f64::from(*x), f64::from(*y));
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    if na == 0.0 || nb == 0.0 {
        return 2.0;
    }
    1.0 - dot / (na.sqrt() * nb.sqrt())
}

/// The answer's text and finish reason, read from a whole body of `endpoint`.
struct AnswerView<'a> {
    text: String,
    finish: Option<&'a str>,
}

fn view(endpoint: Endpoint, answer: &Value) -> AnswerView<'_> {
    match endpoint {
        Endpoint::Messages => {
            let text = answer
                .member("content")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter(|b| b.member("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|b| b.member("text").and_then(Value::as_str))
                .collect();
            AnswerView {
                text,
                finish: answer.member("stop_reason").and_then(Value::as_str),
            }
        }
        _ => {
            let choice = answer.pointer("/choices/0");
            let text = choice
                .and_then(|c| c.pointer("/message/content").or_else(|| c.member("text")))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            AnswerView {
                text,
                finish: choice
                    .and_then(|c| c.member("finish_reason"))
                    .and_then(Value::as_str),
            }
        }
    }
}

/// The JSON schema an OpenAI request's `response_format` or an Anthropic request's
/// `output_format` asks for (`Some(None)`: any JSON object), or `None` when the request asks
/// for free text.
fn structured(request: &Map<String, Value>) -> Option<Option<&Value>> {
    let format = request
        .member("response_format")
        .or_else(|| request.member("output_format"))?;
    match format.member("type").and_then(Value::as_str) {
        Some("json_object") => Some(None),
        Some("json_schema") => Some(
            format
                .pointer("/json_schema/schema")
                .or_else(|| format.member("schema")),
        ),
        _ => None,
    }
}

/// Whether `v` has the JSON type a schema's `type` names (unknown or absent types accept).
fn has_type(v: &Value, ty: Option<&Value>) -> bool {
    let one = |t: &str| match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => true,
    };
    match ty {
        Some(Value::String(t)) => one(t),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).any(one),
        _ => true,
    }
}

/// Why a whole answer (`answer`, in `endpoint`'s shape) must not be stored for `request`, or
/// `None` when it may be.
pub fn unstorable(
    endpoint: Endpoint,
    request: &Map<String, Value>,
    answer: &Value,
) -> Option<String> {
    let view = view(endpoint, answer);
    match view.finish {
        None => return Some("the answer has no finish reason (it was cut short)".into()),
        Some("error") => return Some("the answer ended in an error".into()),
        Some(_) => {}
    }
    let schema = structured(request)?;
    let parsed: Value = match serde_json::from_str(view.text.trim()) {
        Ok(v) => v,
        Err(e) => return Some(format!("the structured output is not JSON: {e}")),
    };
    let Some(schema) = schema else {
        return (!parsed.is_object()).then(|| "the structured output is not a JSON object".into());
    };
    if !has_type(&parsed, schema.member("type")) {
        return Some("the structured output is not of the schema's type".into());
    }
    let props = schema.member("properties").and_then(Value::as_object);
    for key in schema
        .member("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        let Some(v) = parsed.get(key) else {
            return Some(format!(
                "the structured output lacks the required key `{key}`"
            ));
        };
        let ty = props
            .and_then(|p| p.get(key))
            .and_then(|p| p.member("type"));
        if !has_type(v, ty) {
            return Some(format!(
                "the structured output's `{key}` has the wrong type"
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    const POLICY: Policy = Policy {
        max_temperature: 0.0,
        allow_tools: false,
    };

    #[test]
    fn key_order_numbers_stream_and_alias_do_not_change_the_key() {
        let a = obj(
            json!({"model": "alias", "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0, "stream": true, "user": "u1"}),
        );
        let b = obj(
            json!({"temperature": 0.0, "messages": [{"content": "hi", "role": "user"}],
            "model": "pool"}),
        );
        let ka = fingerprint("t", Endpoint::ChatCompletions, "pool", &a);
        assert_eq!(ka, fingerprint("t", Endpoint::ChatCompletions, "pool", &b));
        assert_eq!(ka.len(), 64);
    }

    #[test]
    fn tenant_endpoint_and_every_parameter_change_the_key() {
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0});
        let k = |ns: &str, e: Endpoint, v: &Value| fingerprint(ns, e, "m", &obj(v.clone()));
        let key = k("t", Endpoint::ChatCompletions, &base);
        assert_ne!(key, k("u", Endpoint::ChatCompletions, &base));
        assert_ne!(key, k("t", Endpoint::Messages, &base));
        for (field, value) in [
            ("max_tokens", json!(5)),
            ("seed", json!(7)),
            ("top_p", json!(0.5)),
            ("response_format", json!({"type": "json_object"})),
            (
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
            ),
            ("stop", json!(["x"])),
        ] {
            let mut v = base.clone();
            v[field] = value;
            assert_ne!(key, k("t", Endpoint::ChatCompletions, &v), "{field}");
        }
        let mut other = base.clone();
        other["messages"][0]["content"] = json!("hi!");
        assert_ne!(key, k("t", Endpoint::ChatCompletions, &other));
        // Namespace and endpoint are length-prefixed: no shifting bytes between them.
        assert_ne!(
            k("ab", Endpoint::ChatCompletions, &base),
            k("a", Endpoint::ChatCompletions, &base)
        );
    }

    #[test]
    fn policy_bypasses() {
        let r = |v: Value| bypass_reason(Endpoint::ChatCompletions, &obj(v), POLICY);
        assert_eq!(r(json!({"temperature": 0})), None);
        assert_eq!(r(json!({})), Some("temperature"));
        assert_eq!(r(json!({"temperature": 0.7})), Some("temperature"));
        assert_eq!(r(json!({"temperature": 0, "n": 2})), Some("n"));
        assert_eq!(r(json!({"temperature": 0, "n": 1})), None);
        assert_eq!(
            r(json!({"temperature": 0, "tools": [{"type": "function"}]})),
            Some("tools")
        );
        assert_eq!(r(json!({"temperature": 0, "tools": []})), None);
        let allow = Policy {
            max_temperature: 1.0,
            allow_tools: true,
        };
        let body = obj(json!({"tools": [{"type": "function"}]}));
        assert_eq!(bypass_reason(Endpoint::Messages, &body, allow), None);
        assert_eq!(
            bypass_reason(Endpoint::Embeddings, &body, allow),
            Some("endpoint")
        );
    }

    #[test]
    fn answers_without_a_finish_reason_are_not_stored() {
        let req = obj(json!({}));
        let chat = |finish: Value| json!({"choices": [{"message": {"content": "x"}, "finish_reason": finish}]});
        assert_eq!(
            unstorable(Endpoint::ChatCompletions, &req, &chat(json!("stop"))),
            None
        );
        assert_eq!(
            unstorable(Endpoint::ChatCompletions, &req, &chat(json!("length"))),
            None
        );
        assert!(unstorable(Endpoint::ChatCompletions, &req, &chat(Value::Null)).is_some());
        assert!(unstorable(Endpoint::ChatCompletions, &req, &chat(json!("error"))).is_some());
        let msg =
            |stop: Value| json!({"content": [{"type": "text", "text": "x"}], "stop_reason": stop});
        assert_eq!(
            unstorable(Endpoint::Messages, &req, &msg(json!("end_turn"))),
            None
        );
        assert!(unstorable(Endpoint::Messages, &req, &msg(Value::Null)).is_some());
    }

    #[test]
    fn structured_outputs_must_fit_the_schema() {
        let schema = json!({"type": "object", "required": ["name", "age"],
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}});
        let req = obj(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}),
        );
        let chat = |text: &str| json!({"choices": [{"message": {"content": text}, "finish_reason": "stop"}]});
        let ok = |text: &str| unstorable(Endpoint::ChatCompletions, &req, &chat(text));
        assert_eq!(ok(r#"{"name": "Ada", "age": 36}"#), None);
        assert!(ok(r#"{"name": "Ada"}"#).unwrap().contains("`age`"));
        assert!(ok(r#"{"name": "Ada", "age": "36"}"#)
            .unwrap()
            .contains("wrong type"));
        assert!(ok("not json").unwrap().contains("not JSON"));
        assert!(ok("[1]").is_some());
        let any = obj(json!({"response_format": {"type": "json_object"}}));
        assert_eq!(
            unstorable(Endpoint::ChatCompletions, &any, &chat("{}")),
            None
        );
        assert!(unstorable(Endpoint::ChatCompletions, &any, &chat("3")).is_some());
    }

    #[test]
    fn semantic_parts() {
        let a = obj(json!({"model": "m", "system": "be brief", "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}));
        assert_eq!(prompt_text(&a), "system: be brief\nuser: hi\n\n");
        let mut b = a.clone();
        b.insert(
            "messages".into(),
            json!([{"role": "user", "content": "other"}]),
        );
        let k = |m: &Map<String, Value>| parameters_fingerprint("t", Endpoint::Messages, "m", m);
        assert_eq!(k(&a), k(&b));
        b.insert("max_tokens".into(), json!(3));
        assert_ne!(k(&a), k(&b));
        assert!(cosine_distance(&[1.0, 0.0], &[1.0, 0.0]).abs() < 1e-9);
        assert!((cosine_distance(&[1.0, 0.0], &[0.0, 1.0]) - 1.0).abs() < 1e-9);
        assert_eq!(cosine_distance(&[1.0], &[1.0, 0.0]), 2.0);
        assert_eq!(cosine_distance(&[0.0, 0.0], &[1.0, 0.0]), 2.0);
    }
}
