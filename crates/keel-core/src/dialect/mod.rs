//! Upstream dialects: the wire formats of clouds that speak neither OpenAI Chat Completions nor
//! Anthropic Messages (Gemini, Vertex AI, Bedrock Converse, the OpenAI Responses API) and the
//! quirks of one that nearly does (Azure OpenAI).
//!
//! # A hub, not a matrix
//!
//! Each dialect maps to and from one *hub* protocol, the one it is closest to:
//!
//! | dialect | hub | request | answer |
//! |---|---|---|---|
//! | Gemini (AI Studio, Vertex `publishers/google`) | Anthropic Messages | [`gemini::request`] | [`gemini::whole`], [`gemini::Stream`] |
//! | Bedrock Converse | Anthropic Messages | [`bedrock::request`] | [`bedrock::whole`], [`bedrock::Stream`] |
//! | Vertex `publishers/anthropic` | Anthropic Messages | [`vertex_claude_request`] | unchanged |
//! | OpenAI Responses | OpenAI Chat Completions | [`responses::request`] | [`responses::whole`], [`responses::Stream`] |
//! | Azure OpenAI | OpenAI Chat Completions | unchanged | [`azure::whole`], [`azure::Stream`] |
//!
//! The gateway treats a variant of a dialect as a variant of its hub protocol: selection,
//! hedging, settlement, the relay, mid-stream migration and the translation between the two
//! client protocols (`crate::translate`) see only the hub's bodies and events. The dialect is
//! applied at the upstream edge: the hub request becomes the dialect's just before it is sent,
//! and the dialect's answer becomes the hub's as it is read. So a client of either protocol (or
//! of the Responses API) reaches every dialect, a continuation built for the hub (an assistant
//! prefill) becomes the dialect's own (a trailing assistant or `model` turn), and a new dialect
//! is one module here plus its URL and credentials in the gateway.
//!
//! Every function is pure: no clock, no IO. What cannot be expressed is a
//! [`RequestError`](crate::request::RequestError) naming the field; what is dropped or changed on
//! the way is a fix code, as in `crate::translate`.

pub mod azure;
pub mod bedrock;
pub mod gemini;
pub mod responses;

use serde_json::{Map, Value};

use crate::protocol::ErrorKind;

/// A request in a dialect's words.
#[derive(Debug, Clone, PartialEq)]
pub struct DialectRequest {
    /// The body to send (JSON).
    pub body: Vec<u8>,
    /// Short codes for what was dropped or changed on the way (`x-keel-prompt-fix`).
    pub fixes: Vec<String>,
}

/// A streamed answer in a dialect's framing, turned into the hub protocol's server-sent events
/// as its bytes arrive.
pub trait StreamToHub: Send {
    /// Reads the next bytes of the upstream body (any split: an event or a frame may arrive in
    /// pieces) and appends the hub's SSE text for every complete event to `out`. `Err`: the
    /// stream is malformed (a bad frame, a checksum that does not match, JSON that is not the
    /// dialect's); the attempt fails as a broken upstream would.
    fn feed(&mut self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), String>;

    /// The upstream body ended. Appends what the hub still needs when the dialect's stream
    /// ended properly (its own end of answer seen); a stream cut before that end appends
    /// nothing, so the reader sees a stream without its terminal event, as it would from a
    /// hub-protocol server that died mid-answer.
    fn end(&mut self, out: &mut Vec<u8>) -> Result<(), String>;
}

/// Appends one server-sent event (`event:` line when named, one `data:` line) to `out`.
pub fn push_event(out: &mut Vec<u8>, event: Option<&str>, data: &Value) {
    if let Some(name) = event {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
    }
    out.extend_from_slice(b"data: ");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, data);
    out.extend_from_slice(b"\n\n");
}

/// The `anthropic_version` Vertex AI's Claude endpoints require in the body.
pub const VERTEX_ANTHROPIC_VERSION: &str = "vertex-2023-10-16";

/// An Anthropic Messages body for Vertex AI's Claude (`publishers/anthropic`): the model is in
/// the path, not the body, and `anthropic_version` is in the body, not a header.
pub fn vertex_claude_request(mut hub: Map<String, Value>) -> DialectRequest {
    hub.remove("model");
    hub.entry("anthropic_version")
        .or_insert_with(|| Value::from(VERTEX_ANTHROPIC_VERSION));
    DialectRequest {
        body: serde_json::to_vec(&Value::Object(hub)).unwrap_or_default(),
        fixes: Vec::new(),
    }
}

/// The hub's error kind an upstream HTTP status stands for, for dialects whose error bodies
/// are rewritten into the hub's (`crate::protocol::error_body`).
pub fn error_kind_of_status(status: u16) -> ErrorKind {
    match status {
        400 | 422 => ErrorKind::InvalidRequest,
        401 => ErrorKind::Authentication,
        403 => ErrorKind::Permission,
        404 => ErrorKind::NotFound,
        408 | 504 => ErrorKind::Timeout,
        413 => ErrorKind::TooLarge,
        429 => ErrorKind::RateLimited,
        503 | 529 => ErrorKind::Overloaded,
        502 => ErrorKind::BadGateway,
        _ => ErrorKind::Internal,
    }
}
