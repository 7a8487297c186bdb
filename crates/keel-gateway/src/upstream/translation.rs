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

use keel_core::protocol::{Endpoint, Protocol};
use keel_core::request::{apply_variant, CanonicalRequest, RequestError};
use keel_core::sse::SseEvent;
use keel_core::translate::{
    chat_completion_to_message, chat_to_messages, error_body_to_protocol,
    message_to_chat_completion, messages_to_chat, AnthropicToChatStream, ChatToAnthropicStream,
    ResponseContext,
};

use crate::config::VariantConfig;
use crate::wire::errors::{ErrorKind, GatewayError};
use keel_core::continuation::ResumeMode;

/// The response header that lists the translation's fix codes.
pub const PROMPT_FIX_HEADER: &str = "x-keel-prompt-fix";

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
                .get("messages")
                .and_then(Value::as_array)
                .and_then(|m| m.last())
                .and_then(|m| m.get("role"))
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

/// Renames the `model` of a same-protocol answer to the name the client asked for
/// (`response_model = "public"`). Whole bodies are re-encoded only when the name differs;
/// stream events are rewritten in place at the byte level (see [`model_member`]), so a
/// stream stays byte-exact apart from the name.
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
        match v.get_mut("model") {
            Some(m) if m.as_str() != Some(self.name.as_str()) => {
                *m = Value::String(self.name.clone());
                true
            }
            _ => false,
        }
    }

    /// One stream event: every OpenAI chunk carries `model`; Anthropic only `message_start`
    /// (in `message.model`, before the empty `content`).
    pub fn event(&self, ev: &mut SseEvent) {
        let carries = match self.protocol {
            Protocol::OpenAi => ev.data != "[DONE]",
            Protocol::Anthropic => {
                ev.event.as_deref() == Some("message_start")
                    || (ev.event.is_none() && ev.data.contains("\"message_start\""))
            }
        };
        if !carries || ev.comment_only {
            return;
        }
        // Both spans found first, then the raw bytes spliced in place and the data rebuilt
        // from its slices (a span starts and ends at a quote, so they are whole characters);
        // `String::replace_range` moved the bytes one at a time, at 1% of keel's CPU.
        let Some(in_data) = model_member(ev.data.as_bytes(), &self.encoded) else {
            return;
        };
        let in_raw = match data_offset(&ev.raw, &ev.data) {
            Some(at) => Some(in_data.start + at..in_data.end + at),
            None => model_member(&ev.raw, &self.encoded),
        };
        if let Some(in_raw) = in_raw {
            let mut data = String::with_capacity(ev.data.len() + self.encoded.len());
            data.push_str(&ev.data[..in_data.start]);
            data.push_str(&self.encoded);
            data.push_str(&ev.data[in_data.end..]);
            ev.data = data;
            ev.raw.splice(in_raw, self.encoded.bytes());
        }
    }
}

/// `"model"`, searched for with a searcher built once: every chunk of every renamed stream
/// passes through here, and a window-by-window compare was 2% of keel's CPU.
static MODEL_KEY: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"model\""));

/// Where an event's `data` starts in its `raw` bytes, when the event ends with one `data:` line
/// holding all of it (nearly every event) and nothing before that line names `"model"`: then
/// [`model_member`] finds in `raw` what it finds in `data`, that far along, and the second
/// search is not needed.
fn data_offset(raw: &[u8], data: &str) -> Option<usize> {
    let line = raw.strip_suffix(b"\n\n")?;
    let at = line.len().checked_sub(data.len())?;
    let before = &line[..at];
    let starts_line = [&b"data:"[..], b"data: "].iter().any(|field| {
        before
            .strip_suffix(*field)
            .is_some_and(|b| b.is_empty() || b.ends_with(b"\n"))
    });
    let whole = starts_line
        && &line[at..] == data.as_bytes()
        && memchr::memchr(b'\n', data.as_bytes()).is_none();
    (whole && MODEL_KEY.find(before).is_none()).then_some(at)
}

/// Where the string of the first `"model": "<string>"` member of a JSON text lies (quotes
/// included), for replacing it with `encoded` (a JSON string, quotes included); `None` when
/// there is none or it already holds that string. A literal `"` inside a JSON string is always
/// escaped, so the bytes `"model"` followed by `:` can only be an object key.
pub fn model_member(json: &[u8], encoded: &str) -> Option<std::ops::Range<usize>> {
    const KEY: &[u8] = b"\"model\"";
    let is_ws = |b: u8| b == b' ' || b == b'\t';
    let mut from = 0;
    while let Some(at) = MODEL_KEY.find(&json[from..]) {
        let key_end = from + at + KEY.len();
        from = key_end;
        let mut i = key_end;
        while i < json.len() && is_ws(json[i]) {
            i += 1;
        }
        if json.get(i) != Some(&b':') {
            continue;
        }
        i += 1;
        while i < json.len() && is_ws(json[i]) {
            i += 1;
        }
        if json.get(i) != Some(&b'"') {
            return None;
        }
        // The string's end: the next quote not escaped.
        let start = i;
        let mut j = i + 1;
        loop {
            match json.get(j)? {
                b'\\' => j += 2,
                b'"' => break,
                _ => j += 1,
            }
        }
        let end = j + 1;
        if &json[start..end] == encoded.as_bytes() {
            return None;
        }
        return Some(start..end);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rename_model_member(json: &[u8], encoded: &str) -> Option<Vec<u8>> {
        let span = model_member(json, encoded)?;
        let mut out = json.to_vec();
        out.splice(span, encoded.bytes());
        Some(out)
    }

    #[test]
    fn renames_the_model_member_only() {
        let enc = Value::String("pub\"lic".into()).to_string();
        let got = rename_model_member(
            br#"{"id":"x","content":"say \"model\": \"no\"","model" : "si\"m","n":1}"#,
            &enc,
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(got).unwrap(),
            r#"{"id":"x","content":"say \"model\": \"no\"","model" : "pub\"lic","n":1}"#
        );
        assert!(rename_model_member(br#"{"model":"pub\"lic"}"#, &enc).is_none());
        assert!(rename_model_member(br#"{"model":null}"#, &enc).is_none());
        assert!(rename_model_member(br#"{"model":"unterminated"#, &enc).is_none());
    }

    proptest::proptest! {
        /// Whatever an event's lines are, its raw bytes are renamed where a search of them
        /// would rename them, whether or not the second search was skipped.
        #[test]
        fn renaming_raw_bytes_agrees_with_searching_them(
            fields in proptest::collection::vec(0usize..4, 0..3),
            space in proptest::bool::ANY,
            pieces in proptest::collection::vec(0usize..7, 0..6),
            end in 0usize..3,
        ) {
            const FIELDS: [&str; 4] = ["event: message_start\n", "id: \"model\":\"x\"\n", ": \"model\"\n", "data: {\"model\":\"first\"}\n"];
            const PIECES: [&str; 7] = [r#""model":"sim""#, r#""model" : "gpt""#, r#""x":1"#, r#""t":"say \"model\": \"no\"""#, r#""model":null"#, "\"m\u{e9}\":\"\u{e9}\"", r#""model":"si\"m""#];
            const ENDS: [&str; 3] = ["\n\n", "\r\n\r\n", "\n\r\n"];
            let data = format!("{{{}}}", pieces.iter().map(|i| PIECES[*i]).collect::<Vec<_>>().join(","));
            let mut raw = fields.iter().map(|i| FIELDS[*i]).collect::<String>();
            raw.push_str(if space { "data: " } else { "data:" });
            raw.push_str(&data);
            raw.push_str(ENDS[end]);
            let Ok(mut evs) = keel_core::sse::decode_all(raw.as_bytes()) else {
                return Ok(());
            };
            let Some(mut ev) = evs.pop() else {
                return Ok(());
            };
            let r = ModelRename::new(Protocol::OpenAi, "pub");
            let expected = model_member(ev.data.as_bytes(), &r.encoded).and_then(|_| {
                rename_model_member(&ev.raw, &r.encoded)
            });
            let before = ev.raw.clone();
            r.event(&mut ev);
            proptest::prop_assert_eq!(ev.raw, expected.unwrap_or(before));
        }
    }

    #[test]
    fn renames_events_keeping_their_framing() {
        let r = ModelRename::new(Protocol::OpenAi, "gpt");
        let mut ev = keel_core::sse::decode_all(b"data: {\"model\":\"sim\",\"x\":1}\r\n\r\n")
            .unwrap()
            .remove(0);
        r.event(&mut ev);
        assert_eq!(ev.data, r#"{"model":"gpt","x":1}"#);
        assert_eq!(ev.raw, b"data: {\"model\":\"gpt\",\"x\":1}\r\n\r\n");
        let r = ModelRename::new(Protocol::Anthropic, "claude");
        let mut ev = SseEvent::new(
            Some("message_start"),
            r#"{"type":"message_start","message":{"id":"m","model":"sim","content":[]}}"#,
        );
        r.event(&mut ev);
        assert!(ev.data.contains(r#""model":"claude""#));
        assert_eq!(keel_core::sse::decode_all(&ev.raw).unwrap()[0], ev);
    }
}
