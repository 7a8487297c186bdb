//! The clouds' own wire formats ("dialects"), spoken by the same simulated server as OpenAI
//! Chat and Anthropic Messages: Azure OpenAI, Gemini (AI Studio and Vertex AI
//! `publishers/google`), Vertex AI's Claude (`publishers/anthropic`), Bedrock Converse and the
//! OpenAI Responses API.
//!
//! Each dialect is read by turning its request into the hub body the simulator already parses
//! (`crate::wire::parse_request`): Anthropic Messages for Gemini, Bedrock and Vertex Claude,
//! OpenAI Chat Completions for Azure and Responses. So a dialect's answer is the same text, with
//! the same latency, faults and counters, as the hub request the gateway converted it from, and
//! a conversation continued on another dialect (mid-stream migration) continues exactly. The
//! [`Reply`] is then written in the dialect's whole or streamed shape by [`Renderer`], and errors
//! in the dialect's error shape by [`error_response`].
//!
//! Routes are told apart by path alone ([`route`]); the model a cloud names in its path becomes
//! the hub body's `model`.

pub mod azure;
pub mod bedrock;
pub mod gemini;
pub mod responses;
pub mod vertex;

use serde_json::{json, Value};

use keel_core::protocol::{error_body, Endpoint, ErrorKind, Protocol};

use crate::wire::{Piece, Reply};

/// A dialect the simulator speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Azure,
    /// Gemini's `generateContent`; `vertex` when reached through Vertex AI's
    /// `publishers/google` path (bearer auth) rather than AI Studio's (an API key).
    Gemini {
        vertex: bool,
    },
    VertexClaude,
    Bedrock,
    Responses,
}

impl Dialect {
    /// The hub protocol the dialect's requests are read as.
    pub fn hub(self) -> Endpoint {
        match self {
            Dialect::Azure | Dialect::Responses => Endpoint::ChatCompletions,
            _ => Endpoint::Messages,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dialect::Azure => "azure",
            Dialect::Gemini { vertex: false } => "gemini",
            Dialect::Gemini { vertex: true } => "vertex-gemini",
            Dialect::VertexClaude => "vertex-claude",
            Dialect::Bedrock => "bedrock",
            Dialect::Responses => "responses",
        }
    }
}

/// A request path that belongs to a dialect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dialect: Dialect,
    /// The model (or Azure deployment) the path names.
    pub model: Option<String>,
    /// The path asks for a stream (`:streamGenerateContent`, `/converse-stream`,
    /// `:streamRawPredict`); other dialects say so in the body.
    pub stream: bool,
}

/// The dialect route of a `POST` path, if it is one.
pub fn route(path: &str) -> Option<Route> {
    let r = |dialect, model: Option<&str>, stream| {
        Some(Route {
            dialect,
            model: model.map(percent_decode),
            stream,
        })
    };
    if path == "/v1/responses" {
        return r(Dialect::Responses, None, false);
    }
    if path == "/openai/v1/chat/completions" {
        return r(Dialect::Azure, None, false);
    }
    if let Some(rest) = path.strip_prefix("/openai/deployments/") {
        let deployment = rest.strip_suffix("/chat/completions")?;
        return (!deployment.is_empty() && !deployment.contains('/'))
            .then(|| r(Dialect::Azure, Some(deployment), false))?;
    }
    if let Some(rest) = path.strip_prefix("/model/") {
        let (model, stream) = match rest.rsplit_once('/')? {
            (m, "converse") => (m, false),
            (m, "converse-stream") => (m, true),
            _ => return None,
        };
        return (!model.is_empty()).then(|| r(Dialect::Bedrock, Some(model), stream))?;
    }
    for version in ["/v1beta/", "/v1/", "/v1alpha/"] {
        if let Some(rest) = path
            .strip_prefix(version)
            .and_then(|p| p.strip_prefix("models/"))
        {
            let (model, method) = rest.rsplit_once(':')?;
            let stream = match method {
                "generateContent" => false,
                "streamGenerateContent" => true,
                _ => return None,
            };
            return r(Dialect::Gemini { vertex: false }, Some(model), stream);
        }
    }
    // Vertex AI: [/v1|/v1beta1]/projects/{p}/locations/{l}/publishers/{publisher}/models/{m}:{method}
    let rest = ["/v1/", "/v1beta1/", "/"]
        .iter()
        .find_map(|v| path.strip_prefix(v).filter(|p| p.starts_with("projects/")))?;
    let parts: Vec<&str> = rest.split('/').collect();
    let [("projects", _), ("locations", _), ("publishers", publisher), ("models", last)] = [
        (parts.first()?, parts.get(1)?),
        (parts.get(2)?, parts.get(3)?),
        (parts.get(4)?, parts.get(5)?),
        (parts.get(6)?, parts.get(7)?),
    ]
    .map(|(a, b)| (*a, *b)) else {
        return None;
    };
    if parts.len() != 8 {
        return None;
    }
    let (model, method) = last.rsplit_once(':')?;
    match (publisher, method) {
        ("google", "generateContent") => r(Dialect::Gemini { vertex: true }, Some(model), false),
        ("google", "streamGenerateContent") => {
            r(Dialect::Gemini { vertex: true }, Some(model), true)
        }
        ("anthropic", "rawPredict") => r(Dialect::VertexClaude, Some(model), false),
        ("anthropic", "streamRawPredict") => r(Dialect::VertexClaude, Some(model), true),
        _ => None,
    }
}

/// The hub request a dialect request stands for.
#[derive(Debug, Clone, PartialEq)]
pub struct HubRequest {
    /// An Anthropic Messages or OpenAI Chat body, as `crate::wire::parse_request` reads it.
    pub body: Value,
    /// A JSON schema the answer must follow (Gemini's `responseSchema`), for dialects whose
    /// hub (Anthropic) has no `response_format` of its own.
    pub schema: Option<Value>,
}

/// Turns a dialect request body into its hub body. Errors are the client's (400), in words
/// naming the field.
pub fn to_hub(route: &Route, body: &Value) -> Result<HubRequest, String> {
    let obj = body
        .as_object()
        .ok_or("request body must be a JSON object")?;
    match route.dialect {
        Dialect::Azure => azure::to_hub(route, obj),
        Dialect::Gemini { .. } => gemini::to_hub(route, obj),
        Dialect::VertexClaude => vertex::claude_to_hub(route, obj),
        Dialect::Bedrock => bedrock::to_hub(route, obj),
        Dialect::Responses => responses::to_hub(obj),
    }
}

/// Credentials a request carries, as the dialect's server checks them.
pub struct Credentials<'a> {
    pub headers: &'a http::HeaderMap,
    pub query: Option<&'a str>,
    /// The server's configured API key, if any.
    pub api_key: Option<&'a str>,
    /// Whether a bearer token was issued by this server's `/token` endpoint.
    pub issued: &'a dyn Fn(&str) -> bool,
}

impl Credentials<'_> {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn bearer(&self) -> Option<&str> {
        self.header("authorization")
            .and_then(|v| v.strip_prefix("Bearer "))
    }

    fn query_param(&self, name: &str) -> Option<String> {
        query_param(self.query.unwrap_or(""), name)
    }
}

/// Checks a request's credentials as the dialect's cloud does: Azure and AI Studio keys only
/// when the server has an API key configured (as for OpenAI and Anthropic); Vertex AI always
/// wants a bearer (the configured key or a token this server issued, any when neither is set
/// up); Bedrock always wants a SigV4 signature of the right shape for the `bedrock` service or a
/// bearer (a Bedrock API key). `Err`: (status, message).
pub fn authorize(dialect: Dialect, c: &Credentials) -> Result<(), (u16, String)> {
    let key = c.api_key;
    let denied = |m: &str| Err((401, m.to_owned()));
    match dialect {
        Dialect::Azure | Dialect::Responses => {
            let Some(key) = key else { return Ok(()) };
            let given = c.header("api-key").or_else(|| c.bearer());
            if given == Some(key) {
                Ok(())
            } else {
                denied("Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid key for an active subscription and use a correct regional API endpoint for your resource.")
            }
        }
        Dialect::Gemini { vertex: false } => {
            let Some(key) = key else { return Ok(()) };
            let given = c
                .header("x-goog-api-key")
                .map(str::to_owned)
                .or_else(|| c.query_param("key"));
            if given.as_deref() == Some(key) {
                Ok(())
            } else {
                Err((400, "API key not valid. Please pass a valid API key.".into()))
            }
        }
        Dialect::Gemini { vertex: true } | Dialect::VertexClaude => match c.bearer() {
            None => denied("Request is missing required authentication credential. Expected OAuth 2 access token, login cookie or other valid authentication credential."),
            Some(t) if (c.issued)(t) || key.is_none_or(|k| k == t) => Ok(()),
            Some(_) => denied("Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential."),
        },
        Dialect::Bedrock => {
            if let Some(t) = c.bearer() {
                return if key.is_none_or(|k| k == t) {
                    Ok(())
                } else {
                    Err((403, "Invalid API Key format: Must start with pre-defined prefix".into()))
                };
            }
            let Some(auth) = c.header("authorization") else {
                return Err((403, "Missing Authentication Token".into()));
            };
            bedrock::check_sigv4(auth, c.header("x-amz-date")).map_err(|m| (403, m))
        }
    }
}

/// An error answer in the dialect's shape: (status, extra headers, body).
pub fn error_response(
    dialect: Dialect,
    status: u16,
    message: &str,
) -> (u16, Vec<(&'static str, String)>, Value) {
    let kind = error_kind(status);
    match dialect {
        Dialect::Azure => (status, Vec::new(), azure::error_body(status, message)),
        Dialect::Responses => (
            status,
            Vec::new(),
            error_body(Protocol::OpenAi, kind, message),
        ),
        Dialect::Gemini { .. } => (status, Vec::new(), google_error(status, message)),
        Dialect::VertexClaude => match status {
            // Vertex's own answers (credentials, quota) are Google's; the model's are Anthropic's.
            401 | 403 | 429 => (status, Vec::new(), google_error(status, message)),
            _ => (
                status,
                Vec::new(),
                error_body(Protocol::Anthropic, kind, message),
            ),
        },
        Dialect::Bedrock => {
            let name = bedrock::error_name(status);
            (
                status,
                vec![(
                    "x-amzn-errortype",
                    format!("{name}:http://internal.amazon.com/coral/com.amazon.bedrock/"),
                )],
                json!({ "message": message }),
            )
        }
    }
}

/// Google's error body (`google.rpc.Status` in JSON).
pub fn google_error(status: u16, message: &str) -> Value {
    json!({"error": {"code": status, "message": message, "status": google_status(status)}})
}

/// The canonical gRPC status name Google's APIs give an HTTP status.
pub fn google_status(status: u16) -> &'static str {
    match status {
        400 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        409 => "ABORTED",
        429 => "RESOURCE_EXHAUSTED",
        499 => "CANCELLED",
        501 => "UNIMPLEMENTED",
        503 | 529 => "UNAVAILABLE",
        504 => "DEADLINE_EXCEEDED",
        _ => "INTERNAL",
    }
}

/// The hub error kind of an HTTP status (as `SimServer::protocol_error` maps it).
pub fn error_kind(status: u16) -> ErrorKind {
    match status {
        400 => ErrorKind::InvalidRequest,
        401 => ErrorKind::Authentication,
        403 => ErrorKind::Permission,
        404 => ErrorKind::NotFound,
        413 => ErrorKind::TooLarge,
        429 => ErrorKind::RateLimited,
        502 => ErrorKind::BadGateway,
        503 | 529 => ErrorKind::Overloaded,
        504 => ErrorKind::Timeout,
        _ => ErrorKind::Internal,
    }
}

/// How a generation's answer is written: a hub protocol as-is, or a dialect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Hub(Protocol),
    Dialect(Dialect),
}

/// Writes one [`Reply`] in its shape: the whole body, or the stream in pieces (the head goes
/// out with the first piece). Streams of some dialects number their events, hence `&mut self`.
#[derive(Debug, Clone)]
pub struct Renderer {
    shape: Shape,
    /// Responses: the next `sequence_number`.
    seq: u64,
}

impl Renderer {
    pub fn new(shape: Shape) -> Self {
        Renderer { shape, seq: 0 }
    }

    /// The content type of a streamed answer.
    pub fn stream_content_type(&self) -> &'static str {
        match self.shape {
            Shape::Dialect(Dialect::Bedrock) => "application/vnd.amazon.eventstream",
            _ => "text/event-stream; charset=utf-8",
        }
    }

    /// The whole (non-streamed) answer body.
    pub fn whole(&self, reply: &Reply) -> Vec<u8> {
        let v = match self.shape {
            Shape::Hub(_) | Shape::Dialect(Dialect::VertexClaude) => reply.body(),
            Shape::Dialect(Dialect::Azure) => azure::whole(reply),
            Shape::Dialect(Dialect::Gemini { .. }) => gemini::whole(reply),
            Shape::Dialect(Dialect::Bedrock) => bedrock::whole(reply),
            Shape::Dialect(Dialect::Responses) => responses::whole(reply),
        };
        v.to_string().into_bytes()
    }

    /// What precedes the first piece.
    pub fn head(&mut self, reply: &Reply) -> Vec<u8> {
        match self.shape {
            Shape::Hub(_) | Shape::Dialect(Dialect::VertexClaude) => raw(reply.stream_head()),
            Shape::Dialect(Dialect::Azure) => azure::head(reply),
            Shape::Dialect(Dialect::Gemini { .. }) => Vec::new(),
            Shape::Dialect(Dialect::Bedrock) => bedrock::head(reply),
            Shape::Dialect(Dialect::Responses) => responses::head(reply, &mut self.seq),
        }
    }

    /// The bytes carrying piece `index` (empty when the dialect sends it with another).
    pub fn piece(&mut self, reply: &Reply, index: usize, piece: &Piece) -> Vec<u8> {
        match self.shape {
            Shape::Hub(_) | Shape::Dialect(Dialect::VertexClaude) => reply.stream_piece(piece).raw,
            Shape::Dialect(Dialect::Azure) => azure::piece(reply, piece),
            Shape::Dialect(Dialect::Gemini { .. }) => gemini::piece(reply, index, piece),
            Shape::Dialect(Dialect::Bedrock) => bedrock::piece(piece),
            Shape::Dialect(Dialect::Responses) => responses::piece(reply, piece, &mut self.seq),
        }
    }

    /// What ends a complete stream.
    pub fn tail(&mut self, reply: &Reply) -> Vec<u8> {
        match self.shape {
            Shape::Hub(_) | Shape::Dialect(Dialect::VertexClaude) => raw(reply.stream_tail()),
            Shape::Dialect(Dialect::Azure) => azure::tail(reply),
            Shape::Dialect(Dialect::Gemini { .. }) => gemini::tail(reply),
            Shape::Dialect(Dialect::Bedrock) => bedrock::tail(reply),
            Shape::Dialect(Dialect::Responses) => responses::tail(reply, &mut self.seq),
        }
    }

    /// A broken event (the `malformed` fault): what a reader of the shape cannot parse.
    pub fn malformed(&self) -> Vec<u8> {
        match self.shape {
            Shape::Hub(Protocol::Anthropic) | Shape::Dialect(Dialect::VertexClaude) => {
                b"event: content_block_delta\ndata: {\"type\": \"content_block_delta\", \"delta\": \n\n"
                    .to_vec()
            }
            Shape::Dialect(Dialect::Gemini { .. }) => {
                b"data: {\"candidates\": [{\"content\": \r\n\r\n".to_vec()
            }
            Shape::Dialect(Dialect::Bedrock) => bedrock::malformed(),
            Shape::Dialect(Dialect::Responses) => {
                b"event: response.output_text.delta\ndata: {\"type\": \"response.output_text.delta\", \"delta\": \n\n"
                    .to_vec()
            }
            _ => b"data: {\"choices\": [{\"delta\": \n\n".to_vec(),
        }
    }

    /// The shape's in-stream error (the `stream_error` fault), ending the stream.
    pub fn stream_error(&mut self, status: u16) -> Vec<u8> {
        let message = format!("sim fault: in-stream error {status}");
        let kind = error_kind(status);
        match self.shape {
            Shape::Hub(Protocol::Anthropic) | Shape::Dialect(Dialect::VertexClaude) => {
                raw(vec![keel_core::sse::SseEvent::new(
                    Some("error"),
                    &error_body(Protocol::Anthropic, kind, &message).to_string(),
                )])
            }
            Shape::Hub(Protocol::OpenAi) | Shape::Dialect(Dialect::Azure) => {
                raw(vec![keel_core::sse::SseEvent::new(
                    None,
                    &error_body(Protocol::OpenAi, kind, &message).to_string(),
                )])
            }
            Shape::Dialect(Dialect::Gemini { .. }) => {
                format!("data: {}\r\n\r\n", google_error(status, &message)).into_bytes()
            }
            Shape::Dialect(Dialect::Bedrock) => bedrock::exception(status, &message),
            Shape::Dialect(Dialect::Responses) => {
                responses::error_event(status, &message, &mut self.seq)
            }
        }
    }
}

fn raw(events: Vec<keel_core::sse::SseEvent>) -> Vec<u8> {
    events.into_iter().flat_map(|e| e.raw).collect()
}

/// `%XX` sequences decoded (invalid ones kept as they are); `+` is kept.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
            if let Some(v) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One parameter of a query string or a form body (`+` is a space), decoded.
pub fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(&k.replace('+', " ")) == name).then(|| percent_decode(&v.replace('+', " ")))
    })
}

/// The hex part of a reply id (`msg_…`, `chatcmpl-…`), for ids of the dialect's own kinds.
fn id_hex(reply: &Reply) -> &str {
    reply
        .id
        .rsplit(['_', '-'])
        .next()
        .unwrap_or(reply.id.as_str())
}

/// The text of an Anthropic-style content list or string (text blocks joined).
fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(a) => a
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests;
