//! The canonical request: what admission makes of a client's body, and how an upstream body is
//! derived from it for one variant.
//!
//! The client's JSON object is kept whole (unknown fields pass through untouched); keel reads
//! only what it acts on: the model name, `stream`, the session key, `max_tokens`, and a token
//! estimate. Cross-protocol translation (a later stage) slots in at [`CanonicalRequest::upstream_body`]:
//! it receives the target endpoint and may rewrite the body for it.

use serde_json::{Map, Value};

use crate::json_out;
use crate::members::Members;
use crate::protocol::{Endpoint, ErrorKind};
use crate::tokens;

/// A client error found while reading a request: kind plus a precise message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestError {
    pub kind: ErrorKind,
    pub message: String,
}

impl RequestError {
    pub fn invalid(message: impl Into<String>) -> Self {
        RequestError {
            kind: ErrorKind::InvalidRequest,
            message: message.into(),
        }
    }
}

/// A parsed, validated request.
#[derive(Debug, Clone)]
pub struct CanonicalRequest {
    pub endpoint: Endpoint,
    /// The public model name the client asked for.
    pub model: String,
    pub stream: bool,
    /// Stickiness key: `x-keel-session` (set by the caller), else OpenAI `user`, else Anthropic
    /// `metadata.user_id`.
    pub session: Option<String>,
    /// The client's output limit, if it gave one.
    pub max_tokens: Option<u64>,
    /// How many answers the upstream generates, each up to `max_tokens`: OpenAI's `n` (Chat
    /// Completions and Completions), or Completions' `best_of` when larger (the server
    /// generates `best_of` and returns the best `n`); 1 otherwise. Quotas reserve for all (the
    /// gateway multiplies it for a consensus of several variants).
    pub answers: u64,
    /// Input tokens. An embeddings input is counted at parsing (item by item: token-id arrays
    /// have no text); a prompt by [`CanonicalRequest::estimate_by_rule`] (which [`parse`]
    /// calls) or, in the gateway, by its pool's tokenizers (see [`crate::fit`]), which is why
    /// [`from_object`] leaves it at 0: a long prompt is read once, not twice.
    pub estimated_input_tokens: u64,
    /// True when counting stopped at a cap: the prompt has at least that many tokens (enough
    /// to know that it fits no context window).
    pub estimate_is_lower_bound: bool,
    /// The client's body, untouched.
    pub body: Map<String, Value>,
    /// How many bytes the client sent, where the request was read from bytes (0 otherwise): the
    /// size the upstream body is written into.
    pub received_bytes: usize,
}

/// Parses and validates a request body for `endpoint`, its prompt estimated by keel's rule.
pub fn parse(endpoint: Endpoint, bytes: &[u8]) -> Result<CanonicalRequest, RequestError> {
    let mut req = from_object(endpoint, parse_object(bytes)?)?;
    req.received_bytes = bytes.len();
    req.estimate_by_rule();
    Ok(req)
}

/// Reads a request body as a JSON object (precise errors for every other kind of body).
pub fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, RequestError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        RequestError::invalid(format!(
            "request body is not valid UTF-8 (invalid byte at offset {})",
            e.valid_up_to()
        ))
    })?;
    if text.trim().is_empty() {
        return Err(RequestError::invalid(
            "request body is empty; expected a JSON object",
        ));
    }
    let value: Value = serde_json::from_str(text).map_err(|e| {
        RequestError::invalid(format!(
            "request body is not valid JSON: {} at line {} column {}",
            describe_json_error(&e),
            e.line(),
            e.column()
        ))
    })?;
    match value {
        Value::Object(body) => Ok(body),
        _ => Err(RequestError::invalid("request body must be a JSON object")),
    }
}

/// Validates a request body (already a JSON object) for `endpoint`. A prompt's tokens are
/// left to the caller (see [`CanonicalRequest::estimated_input_tokens`]).
pub fn from_object(
    endpoint: Endpoint,
    body: Map<String, Value>,
) -> Result<CanonicalRequest, RequestError> {
    let model = match body.member("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(Value::String(_)) => return Err(RequestError::invalid("`model` must not be empty")),
        Some(_) => return Err(RequestError::invalid("`model` must be a string")),
        None => return Err(RequestError::invalid("missing required field `model`")),
    };
    let stream = match body.member("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(RequestError::invalid("`stream` must be a boolean")),
    };

    // Embeddings input is counted per item (token-id arrays have no text).
    let mut counted_tokens = 0;
    match endpoint {
        Endpoint::Embeddings => counted_tokens = crate::embeddings::parse(&body)?.tokens(),
        Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::CountTokens => {
            match body.member("messages") {
                Some(Value::Array(msgs)) if !msgs.is_empty() => {
                    for (i, m) in msgs.iter().enumerate() {
                        let Some(obj) = m.as_object() else {
                            return Err(RequestError::invalid(format!(
                                "`messages[{i}]` must be an object"
                            )));
                        };
                        if !obj.member("role").is_some_and(Value::is_string) {
                            return Err(RequestError::invalid(format!(
                                "missing required field `messages[{i}].role`"
                            )));
                        }
                    }
                }
                Some(Value::Array(_)) => {
                    return Err(RequestError::invalid("`messages` must not be empty"))
                }
                Some(_) => return Err(RequestError::invalid("`messages` must be an array")),
                None => return Err(RequestError::invalid("missing required field `messages`")),
            }
        }
        Endpoint::Completions => match body.member("prompt") {
            Some(Value::String(_)) => {}
            Some(Value::Array(parts)) if parts.iter().all(Value::is_string) => {}
            Some(_) => {
                return Err(RequestError::invalid(
                    "`prompt` must be a string or an array of strings",
                ))
            }
            None => return Err(RequestError::invalid("missing required field `prompt`")),
        },
    }

    let max_tokens = match endpoint {
        Endpoint::Messages => match body.member("max_tokens") {
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                RequestError::invalid("`max_tokens` must be a non-negative integer")
            })?),
            None => return Err(RequestError::invalid("missing required field `max_tokens`")),
        },
        _ => {
            let v = body
                .member("max_completion_tokens")
                .or_else(|| body.member("max_tokens"));
            match v {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_u64().ok_or_else(|| {
                    RequestError::invalid("`max_tokens` must be a non-negative integer")
                })?),
            }
        }
    };

    let answers = match endpoint {
        Endpoint::ChatCompletions => count_param(&body, "n")?,
        Endpoint::Completions => count_param(&body, "n")?.max(count_param(&body, "best_of")?),
        _ => 1,
    };

    let session = body
        .member("user")
        .and_then(Value::as_str)
        .or_else(|| {
            body.member("metadata")
                .and_then(|m| m.member("user_id"))
                .and_then(Value::as_str)
        })
        .map(str::to_owned);

    Ok(CanonicalRequest {
        endpoint,
        model,
        stream,
        session,
        max_tokens,
        answers,
        estimated_input_tokens: counted_tokens,
        estimate_is_lower_bound: false,
        body,
        received_bytes: 0,
    })
}

/// A count of answers (`n`, `best_of`): a positive integer; 1 when absent or null.
fn count_param(body: &Map<String, Value>, name: &str) -> Result<u64, RequestError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(1),
        Some(v) => v
            .as_u64()
            .filter(|n| *n >= 1)
            .ok_or_else(|| RequestError::invalid(format!("`{name}` must be a positive integer"))),
    }
}

/// Where a prompt's texts go: joined into a string, or counted as if joined.
trait Texts {
    fn is_empty(&self) -> bool;
    fn push(&mut self, text: &str);
}

impl Texts for String {
    fn is_empty(&self) -> bool {
        str::is_empty(self)
    }

    fn push(&mut self, text: &str) {
        self.push_str(text);
    }
}

impl Texts for tokens::Counter {
    fn is_empty(&self) -> bool {
        tokens::Counter::is_empty(self)
    }

    fn push(&mut self, text: &str) {
        self.feed(text);
    }
}

/// The prompt's texts joined, each cut after its first [`PREFIX_KEY_TOKENS`]: the join's first
/// that many tokens are the same as the whole texts' (a text's token ends where its next begins,
/// so no cut at a token's end changes the tokens before it), without copying a long text whole.
#[derive(Default)]
struct Head(String);

impl Texts for Head {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn push(&mut self, text: &str) {
        let cut = tokens::prefix_len(text, PREFIX_KEY_TOKENS).unwrap_or(text.len());
        self.0.push_str(&text[..cut]);
    }
}

/// Adds the text of a message `content` (a string, or an array of typed parts).
fn push_content_text(content: &Value, out: &mut impl Texts) {
    match content {
        Value::String(s) => push_text(s, out),
        Value::Array(parts) => {
            for p in parts {
                if let Some(t) = p.member("text").and_then(Value::as_str) {
                    push_text(t, out);
                }
            }
        }
        _ => {}
    }
}

/// Adds one text, separated from the previous one by a newline.
fn push_text(t: &str, out: &mut impl Texts) {
    if !out.is_empty() {
        out.push("\n");
    }
    out.push(t);
}

fn describe_json_error(e: &serde_json::Error) -> String {
    let s = e.to_string();
    // serde_json appends " at line L column C"; keel states the position itself.
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_owned(),
        None => s,
    }
}

/// Tokens of the prompt's beginning that key prefix affinity: four KV-cache blocks of 16, the
/// part a shared system prompt or few-shot preamble fills.
pub const PREFIX_KEY_TOKENS: usize = 64;

impl CanonicalRequest {
    /// Sets [`CanonicalRequest::estimated_input_tokens`] to the prompt's tokens by keel's rule
    /// (see [`crate::tokens`]): its texts counted as if joined by newlines, without joining
    /// them. An embeddings input keeps its count from parsing.
    pub fn estimate_by_rule(&mut self) {
        let mut text = tokens::Counter::default();
        match self.endpoint {
            Endpoint::Embeddings => return,
            Endpoint::Completions => match self.body.member("prompt") {
                Some(Value::String(p)) => text.feed(p),
                // A batch of prompts: each counted alone.
                Some(Value::Array(parts)) => {
                    let each = parts.iter().filter_map(Value::as_str).map(tokens::count);
                    self.estimated_input_tokens = each.sum::<usize>() as u64;
                    return;
                }
                _ => {}
            },
            Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::CountTokens => {
                for c in self.message_contents() {
                    push_content_text(c, &mut text);
                }
                if let Some(system) = self.body.member("system") {
                    push_content_text(system, &mut text);
                }
            }
        }
        self.estimated_input_tokens = text.finish() as u64;
    }

    /// The `content` of each message that has one, in order.
    fn message_contents(&self) -> impl Iterator<Item = &Value> {
        let messages = self.body.member("messages").and_then(Value::as_array);
        messages
            .into_iter()
            .flatten()
            .filter_map(|m| m.member("content"))
    }

    /// Prefix-affinity key: a hash of the first [`PREFIX_KEY_TOKENS`] tokens of the canonical
    /// prompt (system, then messages in order; or the completion prompt). `None` when the prompt
    /// is shorter than that: short prompts gain nothing from a warm cache.
    pub fn prefix_key(&self) -> Option<u64> {
        let mut head = Head::default();
        if let Some(system) = self.body.member("system") {
            push_content_text(system, &mut head);
        }
        match self.endpoint {
            Endpoint::Completions => match self.body.member("prompt") {
                Some(Value::String(p)) => push_text(p, &mut head),
                Some(Value::Array(a)) => a
                    .iter()
                    .filter_map(Value::as_str)
                    .for_each(|p| push_text(p, &mut head)),
                _ => {}
            },
            _ => {
                for c in self.message_contents() {
                    push_content_text(c, &mut head);
                    if tokens::prefix_len(&head.0, PREFIX_KEY_TOKENS).is_some() {
                        break;
                    }
                }
            }
        }
        let end = tokens::prefix_len(&head.0, PREFIX_KEY_TOKENS)?;
        Some(crate::rng::hash_bytes(
            0x7072_6566,
            &head.0.as_bytes()[..end],
        ))
    }

    /// Session-affinity key (see [`CanonicalRequest::session`]).
    pub fn session_key(&self) -> Option<u64> {
        self.session
            .as_ref()
            .map(|s| crate::rng::hash_bytes(0x7365_7373, s.as_bytes()))
    }
}

/// Per-variant request overrides. Numeric output limits are caps (the smaller value wins);
/// every other key replaces the client's value.
pub const CAPPED_PARAMS: &[&str] = &["max_tokens", "max_completion_tokens"];

/// The upstream body as a serializable view: the client's fields in their order with `model`
/// replaced and the variant's overrides applied, written without copying the client's body
/// (messages can be megabytes).
pub struct UpstreamBody<'a> {
    req: &'a CanonicalRequest,
    upstream_model: &'a str,
    params: &'a Map<String, Value>,
}

impl UpstreamBody<'_> {
    /// The body's JSON (as `serde_json` writes it: see [`crate::json_out`]).
    pub fn to_vec(&self) -> Vec<u8> {
        // Room for the client's body and a longer model name, so that a long prompt is not
        // copied again as the buffer grows.
        let mut out = Vec::with_capacity(self.req.received_bytes + 64);
        let mut o = json_out::Object::begin(&mut out);
        for (k, v) in &self.req.body {
            if k == "model" {
                o.member_str(k, self.upstream_model);
            } else if let Some(over) = self.override_for(k, v) {
                o.member(k, &over);
            } else {
                o.member(k, v);
            }
        }
        for (k, v) in self.params {
            if !self.req.body.contains_key(k) {
                o.member(k, v);
            }
        }
        o.end();
        out
    }

    /// The variant's value for the client's member `key` (now `current`), if it overrides it.
    fn override_for(&self, key: &str, current: &Value) -> Option<Value> {
        let v = self.params.get(key)?;
        if CAPPED_PARAMS.contains(&key) {
            if let (Some(cap), Some(c)) = (v.as_u64(), current.as_u64()) {
                return Some(Value::from(c.min(cap)));
            }
        }
        Some(v.clone())
    }
}

impl CanonicalRequest {
    /// The body for one variant, written without copying it (see [`UpstreamBody`]).
    pub fn upstream_view<'a>(
        &'a self,
        upstream_model: &'a str,
        params: &'a Map<String, Value>,
    ) -> UpstreamBody<'a> {
        UpstreamBody {
            req: self,
            upstream_model,
            params,
        }
    }

    /// The body to send to one variant: the client's body with the upstream model name and the
    /// variant's parameter overrides applied.
    pub fn upstream_body(
        &self,
        upstream_model: &str,
        params: &Map<String, Value>,
    ) -> Map<String, Value> {
        let mut body = self.body.clone();
        apply_variant(&mut body, upstream_model, params);
        body
    }
}

/// Sets the upstream model name and applies a variant's parameter overrides to a body already
/// in the variant's protocol (see [`CAPPED_PARAMS`]).
pub fn apply_variant(
    body: &mut Map<String, Value>,
    upstream_model: &str,
    params: &Map<String, Value>,
) {
    body.insert("model".into(), Value::String(upstream_model.to_owned()));
    for (k, v) in params {
        if CAPPED_PARAMS.contains(&k.as_str()) {
            if let (Some(cap), Some(cur)) = (v.as_u64(), body.get(k).and_then(Value::as_u64)) {
                body.insert(k.clone(), Value::from(cur.min(cap)));
                continue;
            }
        }
        body.insert(k.clone(), v.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reports_json_position() {
        let e = parse(
            Endpoint::ChatCompletions,
            b"{\n  \"model\": \"x\",\n  oops\n}",
        )
        .unwrap_err();
        assert!(e.message.contains("line 3 column 3"), "{}", e.message);
    }

    #[test]
    fn answers_count_n_and_best_of() {
        let chat = |extra: &str| {
            parse(
                Endpoint::ChatCompletions,
                format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#)
                    .as_bytes(),
            )
        };
        assert_eq!(chat("").unwrap().answers, 1);
        assert_eq!(chat(r#","n":null"#).unwrap().answers, 1);
        assert_eq!(chat(r#","n":128"#).unwrap().answers, 128);
        // best_of is Completions' alone.
        assert_eq!(chat(r#","best_of":4"#).unwrap().answers, 1);
        for bad in [r#","n":0"#, r#","n":-1"#, r#","n":"2""#, r#","n":1.5"#] {
            let e = chat(bad).unwrap_err();
            assert_eq!(e.message, "`n` must be a positive integer", "{bad}");
        }
        let completion = |extra: &str| {
            parse(
                Endpoint::Completions,
                format!(r#"{{"model":"m","prompt":"hi"{extra}}}"#).as_bytes(),
            )
        };
        assert_eq!(completion(r#","n":2,"best_of":5"#).unwrap().answers, 5);
        assert_eq!(completion(r#","n":3"#).unwrap().answers, 3);
        assert!(completion(r#","best_of":0"#).is_err());
        let m = parse(
            Endpoint::Messages,
            br#"{"model":"m","max_tokens":5,"n":9,"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert_eq!(m.answers, 1, "Messages has no n");
    }

    #[test]
    fn names_missing_fields() {
        let e = parse(
            Endpoint::Messages,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.message, "missing required field `max_tokens`");
        let e = parse(
            Endpoint::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.message, "missing required field `model`");
        let e = parse(Endpoint::ChatCompletions, br#"{"model":"m"}"#).unwrap_err();
        assert_eq!(e.message, "missing required field `messages`");
        let e = parse(Endpoint::Completions, br#"{"model":"m"}"#).unwrap_err();
        assert_eq!(e.message, "missing required field `prompt`");
        let e = parse(Endpoint::Embeddings, br#"{"model":"m"}"#).unwrap_err();
        assert_eq!(e.message, "missing required field `input`");
    }

    #[test]
    fn prefix_key_depends_only_on_the_prompt_beginning() {
        let system = "You are a helpful assistant that answers questions about routing. ".repeat(8);
        let mk = |q: &str| {
            let body = json!({"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]});
            parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap()
        };
        assert_eq!(mk("first").prefix_key(), mk("second").prefix_key());
        assert!(mk("x").prefix_key().is_some());
        let short = parse(
            Endpoint::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert_eq!(short.prefix_key(), None);
    }

    /// The key as the whole texts joined and split give it (up to the message that brings
    /// the count to the key's tokens: text after it would join a trailing space to its token).
    fn prefix_key_of_whole_texts(system: &str, messages: &[String]) -> Option<u64> {
        let mut text = system.to_owned();
        for m in messages {
            push_text(m, &mut text);
            if tokens::count(&text) >= PREFIX_KEY_TOKENS {
                break;
            }
        }
        let pieces = tokens::split(&text);
        (pieces.len() >= PREFIX_KEY_TOKENS).then(|| {
            let head = pieces[..PREFIX_KEY_TOKENS].concat();
            crate::rng::hash_bytes(0x7072_6566, head.as_bytes())
        })
    }

    proptest::proptest! {
        #[test]
        fn prefix_key_reads_only_the_head_of_each_text(
            system in "[a-z ,\n]{0,300}",
            messages in proptest::collection::vec("[a-z ,.\n]{0,400}|[ \n]{0,90}", 1..6),
        ) {
            let chat: Vec<Value> = messages
                .iter()
                .map(|m| json!({"role": "user", "content": m}))
                .collect();
            let body = json!({"model": "m", "max_tokens": 1, "system": system, "messages": chat});
            let req = parse(Endpoint::Messages, body.to_string().as_bytes()).unwrap();
            // Anthropic's `system` comes first in the key.
            let expected = prefix_key_of_whole_texts(&system, &messages);
            proptest::prop_assert_eq!(req.prefix_key(), expected);
        }
    }

    #[test]
    fn a_prompt_is_estimated_by_the_rule_only_when_asked() {
        let body = br#"{"model":"m","system":"Be brief.","max_tokens":5,"messages":[
            {"role":"user","content":"Hello, world."},
            {"role":"assistant","content":[{"type":"text","text":"Hi"}]}]}"#;
        let r = from_object(Endpoint::Messages, parse_object(body).unwrap()).unwrap();
        assert_eq!(r.estimated_input_tokens, 0);
        // "Hello, world.\nHi\nBe brief.": Hello , ␣world . ⏎Hi ⏎Be ␣brief .
        assert_eq!(
            parse(Endpoint::Messages, body)
                .unwrap()
                .estimated_input_tokens,
            8
        );
        let completion = br#"{"model":"m","prompt":["one two","three"]}"#;
        assert_eq!(
            parse(Endpoint::Completions, completion)
                .unwrap()
                .estimated_input_tokens,
            3
        );
    }

    #[test]
    fn estimates_embeddings_input() {
        let r = parse(
            Endpoint::Embeddings,
            br#"{"model":"m","input":["Hello, world.","more"],"user":"u"}"#,
        )
        .unwrap();
        assert_eq!(r.estimated_input_tokens, 5);
        assert!(!r.stream);
        assert_eq!(r.session.as_deref(), Some("u"));
        let r = parse(
            Endpoint::Embeddings,
            br#"{"model":"m","input":[[1,2],[3]]}"#,
        )
        .unwrap();
        assert_eq!(r.estimated_input_tokens, 3);
    }

    #[test]
    fn rejects_invalid_utf8() {
        let e = parse(Endpoint::ChatCompletions, b"{\"model\":\"\xff\"}").unwrap_err();
        assert!(e.message.contains("UTF-8"));
    }

    #[test]
    fn upstream_body_keeps_unknown_fields_and_caps_limits() {
        let r = parse(
            Endpoint::ChatCompletions,
            br#"{"model":"pub","messages":[{"role":"user","content":"hi"}],"max_tokens":500,"x_custom":{"a":1},"user":"u1"}"#,
        )
        .unwrap();
        assert_eq!(r.session.as_deref(), Some("u1"));
        let params = json!({"max_tokens": 100, "temperature": 0})
            .as_object()
            .unwrap()
            .clone();
        let b = r.upstream_body("real-model", &params);
        assert_eq!(b["model"], "real-model");
        assert_eq!(b["max_tokens"], 100);
        assert_eq!(b["temperature"], 0);
        assert_eq!(b["x_custom"], json!({"a":1}));
        let view = r.upstream_view("real-model", &params).to_vec();
        assert_eq!(view, serde_json::to_vec(&b).unwrap());
    }
}

/// Serializes tool definitions and JSON schemas with sorted keys (`canonical_tools`): two
/// clients that send the same tools in another key order then reach the upstream with the same
/// bytes, so its prompt cache (which sees the tools first, as the chat template renders them)
/// keeps hitting. Covers `tools` (either protocol) and `response_format`'s schema. Returns
/// whether anything moved.
pub fn canonicalize_tools(body: &mut Map<String, Value>) -> bool {
    let mut changed = false;
    for key in ["tools", "response_format"] {
        if let Some(v) = body.get_mut(key) {
            if !keys_sorted(v) {
                *v = sorted_keys(v);
                changed = true;
            }
        }
    }
    changed
}

/// Whether every object in `v` already has its keys in order (map equality ignores order).
fn keys_sorted(v: &Value) -> bool {
    match v {
        Value::Object(m) => {
            m.keys().zip(m.keys().skip(1)).all(|(a, b)| a <= b) && m.values().all(keys_sorted)
        }
        Value::Array(a) => a.iter().all(keys_sorted),
        _ => true,
    }
}

fn sorted_keys(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), sorted_keys(&m[k])))
                    .collect(),
            )
        }
        Value::Array(a) => Value::Array(a.iter().map(sorted_keys).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod canonical_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tools_in_any_key_order_serialize_to_the_same_bytes() {
        let a = json!({"model": "m", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}}}]});
        let b = json!({"tools": [{"function": {"parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "type": "object"}, "name": "f"}, "type": "function"}], "model": "m"});
        let (mut a, mut b) = (
            a.as_object().unwrap().clone(),
            b.as_object().unwrap().clone(),
        );
        assert_ne!(a["tools"].to_string(), b["tools"].to_string());
        canonicalize_tools(&mut a);
        canonicalize_tools(&mut b);
        assert_eq!(a["tools"].to_string(), b["tools"].to_string());
        // Array order is meaning (tool order, enum order): kept.
        let mut c = json!({"tools": [{"name": "z"}, {"name": "a"}]})
            .as_object()
            .unwrap()
            .clone();
        assert!(!canonicalize_tools(&mut c));
        assert_eq!(c["tools"][0]["name"], "z");
    }
}
