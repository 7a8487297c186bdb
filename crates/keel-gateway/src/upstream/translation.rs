//! Cross-protocol attempts: a variant that speaks the other protocol than the client is reached
//! through `keel_core::translate`, at the attempt boundary. The request (the client's body, or a
//! continuation built from it in the client's protocol) is translated for the variant, the
//! variant's `upstream_model` and `params` are applied to the translated body, and the answer
//! is translated back (whole bodies, error bodies, streams event by event), so that everything
//! after the attempt (settlement, the relay, the Stitcher, delivery) sees only the client's
//! protocol.
//!
//! Chat Completions ⇄ Messages translate; `/v1/completions`, `/v1/embeddings` and
//! `count_tokens` do not (a variant of the other protocol cannot serve them). A request that cannot be translated for a variant
//! is that variant being unable to serve it: execution moves on, and answers the client's 400
//! (naming the field) only when no variant of the plan could.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde_json::{Map, Value};

use keel_core::members::Members;
use keel_core::protocol::{Endpoint, MapOnly, Protocol};
use keel_core::request::{apply_variant, CanonicalRequest, RequestError};
use keel_core::sse::{ModelName, SseEvent};
use keel_core::translate::{
    chat_completion_to_message, chat_to_messages, error_body_to_protocol,
    message_to_chat_completion, messages_to_chat, AnthropicToChatStream, ChatToAnthropicStream,
    ResponseContext,
};
use keel_core::usage::{Carrier, Message, Reported, Usage};

use crate::config::VariantConfig;
use crate::wire::errors::{ErrorKind, GatewayError};
use keel_core::continuation::ResumeMode;

/// The response header that lists the translation's fix codes.
pub const PROMPT_FIX_HEADER: http::HeaderName = http::HeaderName::from_static("x-keel-prompt-fix");

/// A request translated for one variant of the other protocol.
pub struct Translated {
    /// The variant's endpoint.
    pub endpoint: Endpoint,
    /// The body in the variant's protocol, with its `upstream_model` and `params` applied.
    pub body: Map<String, Value>,
    /// What was dropped or changed (`x-keel-prompt-fix`).
    pub fixes: Vec<String>,
    pub response: ResponseTranslator,
}

/// Whether `variant` speaks the protocol of `endpoint` (no translation needed).
pub fn same_protocol(variant: &VariantConfig, endpoint: Endpoint) -> bool {
    variant.protocol == endpoint.protocol()
}

/// The request translated for `variant`, or `None` when the variant speaks the client's
/// protocol. `Err`: the variant cannot serve it (the client's error, naming the field).
pub fn translate_request(
    variant: &VariantConfig,
    req: &CanonicalRequest,
) -> Result<Option<Translated>, RequestError> {
    if same_protocol(variant, req.endpoint) {
        return Ok(None);
    }
    let client = req.endpoint.protocol();
    let (endpoint, mut t) = match req.endpoint {
        Endpoint::ChatCompletions => (
            Endpoint::Messages,
            chat_to_messages(&req.body, variant.default_max_tokens)?,
        ),
        Endpoint::Messages => {
            let mut t = messages_to_chat(&req.body)?;
            // A final assistant message is an Anthropic prefill (the client's own, or a
            // migration's continuation): an OpenAI-compatible server continues it only with
            // the variant's prefill fields.
            let assistant_final = t
                .body
                .member("messages")
                .and_then(Value::as_array)
                .and_then(|m| m.last())
                .and_then(|m| m.member("role"))
                .and_then(Value::as_str)
                == Some("assistant");
            if assistant_final && variant.resume == ResumeMode::Prefill {
                for (k, v) in &variant.continuation_fields {
                    t.body.insert(k.clone(), v.clone());
                }
            }
            (Endpoint::ChatCompletions, t)
        }
        Endpoint::Completions => {
            return Err(RequestError::invalid(
                "/v1/completions is not supported by Anthropic-protocol variants",
            ))
        }
        Endpoint::CountTokens => {
            return Err(RequestError::invalid(
                "count_tokens is not supported by OpenAI-protocol variants",
            ))
        }
        Endpoint::Embeddings => {
            return Err(RequestError::invalid(
                "/v1/embeddings is not supported by Anthropic-protocol variants",
            ))
        }
    };
    apply_variant(&mut t.body, &variant.upstream_model, &variant.params);
    Ok(Some(Translated {
        endpoint,
        body: t.body,
        fixes: t.fixes,
        response: ResponseTranslator {
            client,
            ctx: t.context,
            public_model: req.model.clone(),
            created_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        },
    }))
}

/// Whether `variant` can serve `req`: always, when it speaks the client's protocol itself;
/// otherwise when the request translates into its hub protocol and, for a dialect variant,
/// from there into its dialect.
pub fn check(variant: &VariantConfig, req: &CanonicalRequest) -> Result<(), RequestError> {
    let native = variant.dialect.is_native();
    if native && same_protocol(variant, req.endpoint) {
        return Ok(());
    }
    let translated = translate_request(variant, req)?;
    if native {
        return Ok(());
    }
    if !matches!(req.endpoint, Endpoint::ChatCompletions | Endpoint::Messages) {
        return Err(RequestError::invalid(format!(
            "{} variants serve chat completions and messages only",
            variant.dialect.name()
        )));
    }
    let hub = match translated {
        Some(t) => t.body,
        None => req.upstream_body(&variant.upstream_model, &variant.params),
    };
    crate::upstream::cloud::check(variant, &hub)
}

/// Translates a variant's answers back into the client's protocol.
pub struct ResponseTranslator {
    /// The client's protocol.
    pub client: Protocol,
    ctx: ResponseContext,
    public_model: String,
    created_s: u64,
}

impl ResponseTranslator {
    /// Answers with `model` instead of the name the client asked for.
    pub fn answer_as(&mut self, model: &str) {
        self.public_model = model.to_owned();
    }

    /// A whole success body (`Err`: one that cannot be translated).
    pub fn whole(&self, v: &Value) -> Result<Value, GatewayError> {
        match self.client {
            Protocol::OpenAi => {
                message_to_chat_completion(v, &self.ctx, &self.public_model, self.created_s)
            }
            Protocol::Anthropic => chat_completion_to_message(v, &self.public_model),
        }
        .map_err(malformed)
    }

    /// An error body (any shape, possibly not JSON) in the client's shape.
    pub fn error(&self, body: &[u8], status: u16) -> Bytes {
        let v: Value = serde_json::from_slice(body).unwrap_or_else(|_| {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            let message = if text.is_empty() {
                format!("the upstream answered HTTP {status}")
            } else {
                text.chars().take(300).collect()
            };
            serde_json::json!({"error": {"message": message}})
        });
        Bytes::from(error_body_to_protocol(&v, Some(status), self.client).to_string())
    }

    /// The stream translator for one attempt.
    pub fn stream(&self) -> StreamTranslator {
        match self.client {
            Protocol::OpenAi => StreamTranslator::ToChat(Box::new(AnthropicToChatStream::new(
                self.ctx.clone(),
                &self.public_model,
                self.created_s,
            ))),
            Protocol::Anthropic => StreamTranslator::ToMessages(Box::new(
                ChatToAnthropicStream::new(&self.public_model),
            )),
        }
    }
}

/// A variant's stream, translated event by event into the client's protocol.
pub enum StreamTranslator {
    /// Messages events → Chat Completions chunks.
    ToChat(Box<AnthropicToChatStream>),
    /// Chat Completions chunks → Messages events.
    ToMessages(Box<ChatToAnthropicStream>),
}

impl StreamTranslator {
    /// The protocol of the events it reads.
    pub fn upstream_protocol(&self) -> Protocol {
        match self {
            StreamTranslator::ToChat(_) => Protocol::Anthropic,
            StreamTranslator::ToMessages(_) => Protocol::OpenAi,
        }
    }

    /// Translates one upstream event into `out` (`Err`: a malformed upstream event).
    pub fn push(&mut self, ev: &SseEvent, out: &mut Vec<SseEvent>) -> Result<(), GatewayError> {
        match self {
            StreamTranslator::ToChat(t) => t.push(ev, out),
            StreamTranslator::ToMessages(t) => t.push(ev, out),
        }
        .map_err(malformed)
    }
}

/// An upstream answer the translation refused.
fn malformed(why: String) -> GatewayError {
    GatewayError::new(ErrorKind::Malformed, why)
}

/// The `x-keel-prompt-fix` value for fix codes (`None` when there are none).
pub fn fix_header(fixes: &[String]) -> Option<http::HeaderValue> {
    if fixes.is_empty() {
        return None;
    }
    http::HeaderValue::from_str(&fixes.join(",")).ok()
}

/// A same-protocol whole body checked, and renamed where asked (see [`checked_whole`]).
#[derive(Debug)]
pub struct Checked {
    pub body: Bytes,
    /// The usage the body reports, read in the same pass; `None` where its usage members have
    /// a shape the quick reading does not take (the meter then reads them from a tree).
    pub usage: Option<Reported>,
}

/// A same-protocol whole body checked to be one JSON object and, with `rename`, its top-level
/// `model` string given the public name, in one pass over its bytes and without a tree: the
/// same body when nothing changes, one copy when the name does. The same pass reads the usage
/// the body reports, for the meter. `None` when the quick reading cannot tell (not an object; a
/// name with escapes, not a string, or `null`; `model` given twice); the caller then parses the
/// body into a tree. Parsing every passed-through answer into a tree and writing it out again
/// would be about a fifth of keel's work on it; reading it a second time for its usage, a
/// twentieth.
pub fn checked_whole(body: &Bytes, rename: Option<&ModelRename>) -> Option<Checked> {
    /// The top level of an answer: `model`, and the members that carry usage (other members
    /// are checked and skipped); `model` is a slice of the body itself.
    #[derive(serde::Deserialize)]
    struct Top<'a> {
        #[serde(borrow, default)]
        model: Option<&'a str>,
        #[serde(default)]
        usage: Option<MapOnly<Usage>>,
        #[serde(default)]
        message: Option<MapOnly<Message>>,
    }
    /// `model` alone, for a body whose usage members have another shape.
    #[derive(serde::Deserialize)]
    struct ModelOnly<'a> {
        #[serde(borrow, default)]
        model: Option<&'a str>,
    }
    // Only an object (a derived struct also takes an array of its members in order).
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    let (model, usage) = match serde_json::from_slice::<Top<'_>>(body) {
        Ok(top) => {
            let usage = Carrier {
                usage: top.usage,
                message: top.message,
            };
            (top.model, Some(usage.reported()))
        }
        Err(_) => (
            serde_json::from_slice::<ModelOnly<'_>>(body).ok()?.model,
            None,
        ),
    };
    let checked = |body: Bytes| Some(Checked { body, usage });
    let Some(r) = rename else {
        return checked(body.clone());
    };
    let Some(model) = model else {
        // No name, or a `null` one, which the tree renames: left to it when a `model` key is
        // anywhere in the body.
        if memchr::memmem::find(body, b"\"model\"").is_some() {
            return None;
        }
        return checked(body.clone());
    };
    if model == r.name {
        return checked(body.clone());
    }
    // The borrowed string lies inside the body, between its quotes.
    let start = (model.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start + model.len();
    if start == 0 || body.get(start - 1) != Some(&b'"') || body.get(end) != Some(&b'"') {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() + r.encoded.len());
    out.extend_from_slice(&body[..start - 1]);
    out.extend_from_slice(r.encoded.as_bytes());
    out.extend_from_slice(&body[end + 1..]);
    checked(Bytes::from(out))
}

/// Renames the `model` of a same-protocol answer to the name the client asked for
/// (`response_model = "public"`). Whole bodies are re-encoded only when the name differs;
/// stream events are renamed by their decoder, at the byte level ([`ModelName`]), so a stream
/// stays byte-exact apart from the name.
#[derive(Debug, Clone)]
pub struct ModelRename {
    protocol: Protocol,
    name: String,
    /// `name` JSON-encoded, quotes included.
    encoded: String,
}

impl ModelRename {
    pub fn new(protocol: Protocol, name: &str) -> ModelRename {
        ModelRename {
            protocol,
            name: name.to_owned(),
            encoded: Value::String(name.to_owned()).to_string(),
        }
    }

    /// A whole body: its top-level `model` set to the name (`true` when it changed).
    pub fn whole(&self, v: &mut Value) -> bool {
        match v.member_mut("model") {
            Some(m) if m.as_str() != Some(self.name.as_str()) => {
                *m = Value::String(self.name.clone());
                true
            }
            _ => false,
        }
    }

    /// The name a same-protocol stream's decoder gives its events' `model`: every OpenAI
    /// chunk carries one; Anthropic only `message_start` (in `message.model`).
    pub fn stream(&self) -> ModelName {
        match self.protocol {
            Protocol::OpenAi => ModelName::in_every_event(self.encoded.clone()),
            Protocol::Anthropic => {
                ModelName::in_events_named(self.encoded.clone(), "message_start")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(body: &str, to: &str) -> Option<String> {
        let rename = ModelRename::new(Protocol::OpenAi, to);
        let out = checked_whole(&Bytes::from(body.to_owned()), Some(&rename))?;
        Some(String::from_utf8(out.body.to_vec()).unwrap())
    }

    /// The quick reading gives what parsing the body into a tree and renaming it gives, or
    /// leaves the body to that.
    #[test]
    fn whole_bodies_are_checked_and_renamed_on_their_bytes() {
        let body = r#"{"id":"x","choices":[{"message":{"content":"a \"model\": b"}}],"model" : "sim","usage":{}}"#;
        let renamed = check(body, "pub\"lic").unwrap();
        assert_eq!(
            renamed,
            r#"{"id":"x","choices":[{"message":{"content":"a \"model\": b"}}],"model" : "pub\"lic","usage":{}}"#
        );
        let mut tree: Value = serde_json::from_str(body).unwrap();
        assert!(ModelRename::new(Protocol::OpenAi, "pub\"lic").whole(&mut tree));
        assert_eq!(serde_json::from_str::<Value>(&renamed).unwrap(), tree);
        // A nested `model` before the top-level one is left alone.
        assert_eq!(
            check(
                r#"{"content":[{"input":{"model":"m"}}],"model":"sim"}"#,
                "p"
            )
            .unwrap(),
            r#"{"content":[{"input":{"model":"m"}}],"model":"p"}"#
        );
        // Unchanged: the same bytes, not a copy.
        let same = Bytes::from_static(br#"{"model":"p","n":1}"#);
        let rename = ModelRename::new(Protocol::OpenAi, "p");
        let out = checked_whole(&same, Some(&rename)).unwrap();
        assert_eq!(out.body.as_ptr(), same.as_ptr());
        assert_eq!(check(r#" {"n":1} "#, "p").unwrap(), r#" {"n":1} "#);
        // Left to the tree: a name with escapes, a name that is not a string, a repeated
        // member, an array, and anything that is not JSON.
        for undecided in [
            r#"{"model":"s\u0069m"}"#,
            r#"{"model":7}"#,
            r#"{"model":null}"#,
            r#"{"model":"a","model":"b"}"#,
            r#"["sim"]"#,
            r#"{"model":"sim"} trailing"#,
            r#"{"model":"sim""#,
            "",
        ] {
            assert_eq!(check(undecided, "p"), None, "{undecided}");
        }
        // Without a rename, a body is only checked.
        let plain = Bytes::from_static(br#"{"model":"sim"}"#);
        assert_eq!(checked_whole(&plain, None).unwrap().body, plain);
        assert!(checked_whole(&Bytes::from_static(b"not json"), None).is_none());
    }

    /// The usage read in the checking pass is the one the meter reads from the body alone; a
    /// usage member of another shape leaves it to the meter, and the body is still checked.
    #[test]
    fn the_checking_pass_reads_the_usage_the_meter_would() {
        for body in [
            r#"{"id":"x","model":"sim","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}"#,
            r#"{"model":"sim","usage":{"input_tokens":3,"cache_read_input_tokens":1,"output_tokens":5}}"#,
            r#"{"type":"message","message":{"usage":{"input_tokens":2}},"model":"sim"}"#,
            r#"{"model":"sim","usage":null}"#,
            r#"{"model":"sim"}"#,
        ] {
            let out = checked_whole(&Bytes::from(body.to_owned()), None).unwrap();
            let alone = keel_core::usage::of(body.as_bytes()).unwrap();
            assert_eq!(out.usage, Some(alone), "{body}");
        }
        let odd = Bytes::from_static(br#"{"model":"sim","usage":[1]}"#);
        let out = checked_whole(&odd, Some(&ModelRename::new(Protocol::OpenAi, "p"))).unwrap();
        assert_eq!(out.usage, None);
        assert_eq!(&out.body[..], br#"{"model":"p","usage":[1]}"#);
    }
}
