//! The two wire protocols keel speaks (OpenAI and Anthropic): endpoints, error shapes, and how to
//! read a streamed event (content, terminal, error).
//!
//! Everything here is data in, data out. Message shapes are kept as `serde_json::Value` so that
//! unknown fields pass through untouched; only the fields keel acts on are interpreted.

use serde_json::{json, Value};

use crate::sse::SseEvent;

/// A wire protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    OpenAi,
    Anthropic,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::OpenAi => "openai",
            Protocol::Anthropic => "anthropic",
        }
    }
}

/// A client-facing (and upstream) API endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `POST /v1/completions`.
    Completions,
    /// Anthropic `POST /v1/messages`.
    Messages,
    /// Anthropic `POST /v1/messages/count_tokens`.
    CountTokens,
}

impl Endpoint {
    pub fn protocol(self) -> Protocol {
        match self {
            Endpoint::ChatCompletions | Endpoint::Completions => Protocol::OpenAi,
            Endpoint::Messages | Endpoint::CountTokens => Protocol::Anthropic,
        }
    }

    /// Path appended to a variant's base URL, as the official SDKs do: OpenAI base URLs end in
    /// `/v1` (`https://api.openai.com/v1`), Anthropic's do not (`https://api.anthropic.com`).
    pub fn upstream_path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/chat/completions",
            Endpoint::Completions => "/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::CountTokens => "/v1/messages/count_tokens",
        }
    }

    /// The endpoint served at a request path (the same paths on keel and on model servers).
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/messages/count_tokens" => Some(Endpoint::CountTokens),
            _ => None,
        }
    }

    /// The label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Messages => "messages",
            Endpoint::CountTokens => "count_tokens",
        }
    }
}

/// The class of an error, mapped to each protocol's `type` string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    Authentication,
    Permission,
    NotFound,
    TooLarge,
    UnsupportedMediaType,
    RateLimited,
    Timeout,
    Overloaded,
    BadGateway,
    Internal,
}

impl ErrorKind {
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest => 400,
            ErrorKind::Authentication => 401,
            ErrorKind::Permission => 403,
            ErrorKind::NotFound => 404,
            ErrorKind::TooLarge => 413,
            ErrorKind::UnsupportedMediaType => 415,
            ErrorKind::RateLimited => 429,
            ErrorKind::Internal => 500,
            ErrorKind::BadGateway => 502,
            ErrorKind::Overloaded => 503,
            ErrorKind::Timeout => 504,
        }
    }

    fn openai_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest | ErrorKind::TooLarge | ErrorKind::UnsupportedMediaType => {
                "invalid_request_error"
            }
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Timeout => "timeout_error",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::BadGateway | ErrorKind::Internal => "api_error",
        }
    }

    fn anthropic_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest | ErrorKind::UnsupportedMediaType => "invalid_request_error",
            ErrorKind::TooLarge => "request_too_large",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Timeout => "timeout_error",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::BadGateway | ErrorKind::Internal => "api_error",
        }
    }
}

/// The error body in the protocol's own shape.
pub fn error_body(protocol: Protocol, kind: ErrorKind, message: &str) -> Value {
    match protocol {
        Protocol::OpenAi => json!({
            "error": {"message": message, "type": kind.openai_type(), "param": null, "code": null}
        }),
        Protocol::Anthropic => json!({
            "type": "error",
            "error": {"type": kind.anthropic_type(), "message": message}
        }),
    }
}

/// The terminal error event for a stream that cannot be completed. OpenAI has no error event,
/// so keel sends a final `data:` object carrying `error` (the official SDKs raise on it) and no
/// `[DONE]`; Anthropic has `event: error`.
pub fn stream_error_event(protocol: Protocol, kind: ErrorKind, message: &str) -> SseEvent {
    let body = error_body(protocol, kind, message).to_string();
    match protocol {
        Protocol::OpenAi => SseEvent::new(None, &body),
        Protocol::Anthropic => SseEvent::new(Some("error"), &body),
    }
}

/// What a streamed upstream event means for the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventRole {
    /// Metadata before any output (OpenAI's role-only first chunk, Anthropic `message_start`,
    /// `content_block_start`, `content_block_stop`).
    Preamble,
    /// An event carrying generated output (text, tool-call arguments, a finish reason, usage).
    /// The first such event is the "first token".
    Output,
    /// A keep-alive: comments, Anthropic `ping`.
    KeepAlive,
    /// The protocol's clean end: OpenAI `data: [DONE]`, Anthropic `message_stop`.
    Terminal,
    /// The upstream reported an error inside the stream.
    Error(String),
    /// The event is not valid for the protocol (bad JSON).
    Malformed(String),
}

/// Classifies one upstream event.
pub fn event_role(protocol: Protocol, ev: &SseEvent) -> EventRole {
    if ev.comment_only {
        return EventRole::KeepAlive;
    }
    match protocol {
        Protocol::OpenAi => {
            if ev.data == "[DONE]" {
                return EventRole::Terminal;
            }
            match serde_json::from_str::<Value>(&ev.data) {
                Ok(v) => match v.get("error") {
                    Some(e) if !e.is_null() => EventRole::Error(error_message(&v)),
                    _ if openai_chunk_has_output(&v) => EventRole::Output,
                    _ => EventRole::Preamble,
                },
                Err(e) => EventRole::Malformed(format!("invalid JSON in stream chunk: {e}")),
            }
        }
        Protocol::Anthropic => {
            let name = ev.event.as_deref().unwrap_or("");
            match name {
                "ping" => EventRole::KeepAlive,
                "message_stop" => EventRole::Terminal,
                _ => match serde_json::from_str::<Value>(&ev.data) {
                    Ok(v)
                        if name == "error"
                            || v.get("type").and_then(Value::as_str) == Some("error") =>
                    {
                        EventRole::Error(error_message(&v))
                    }
                    Ok(_) if matches!(name, "content_block_delta" | "message_delta") => {
                        EventRole::Output
                    }
                    Ok(_) => EventRole::Preamble,
                    Err(e) => EventRole::Malformed(format!("invalid JSON in `{name}` event: {e}")),
                },
            }
        }
    }
}

/// Whether an OpenAI chunk carries output: content, tool calls, a refusal, reasoning, completion
/// text, a finish reason, or the final usage chunk.
fn openai_chunk_has_output(v: &Value) -> bool {
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        return false;
    };
    if choices.is_empty() {
        return v.get("usage").is_some_and(|u| !u.is_null());
    }
    let non_empty = |x: Option<&Value>| x.and_then(Value::as_str).is_some_and(|s| !s.is_empty());
    choices.iter().any(|c| {
        let d = c.get("delta");
        non_empty(c.get("text"))
            || c.get("finish_reason").is_some_and(|f| !f.is_null())
            || d.is_some_and(|d| {
                non_empty(d.get("content"))
                    || non_empty(d.get("refusal"))
                    || non_empty(d.get("reasoning_content"))
                    || d.get("tool_calls").is_some_and(|t| !t.is_null())
                    || d.get("function_call").is_some_and(|t| !t.is_null())
            })
    })
}

/// The human message inside either protocol's error object.
pub fn error_message(v: &Value) -> String {
    v.pointer("/error/message")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_openai_events() {
        assert_eq!(
            event_role(Protocol::OpenAi, &SseEvent::new(None, "[DONE]")),
            EventRole::Terminal
        );
        let role_only = r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#;
        assert_eq!(
            event_role(Protocol::OpenAi, &SseEvent::new(None, role_only)),
            EventRole::Preamble
        );
        let text = r#"{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#;
        assert_eq!(
            event_role(Protocol::OpenAi, &SseEvent::new(None, text)),
            EventRole::Output
        );
        assert!(matches!(
            event_role(Protocol::OpenAi, &SseEvent::new(None, "{oops")),
            EventRole::Malformed(_)
        ));
        let err = stream_error_event(Protocol::OpenAi, ErrorKind::BadGateway, "boom");
        assert_eq!(
            event_role(Protocol::OpenAi, &err),
            EventRole::Error("boom".into())
        );
    }

    #[test]
    fn classifies_anthropic_events() {
        let stop = SseEvent::new(Some("message_stop"), "{\"type\":\"message_stop\"}");
        assert_eq!(event_role(Protocol::Anthropic, &stop), EventRole::Terminal);
        let start = SseEvent::new(Some("message_start"), "{\"type\":\"message_start\"}");
        assert_eq!(event_role(Protocol::Anthropic, &start), EventRole::Preamble);
        let delta = SseEvent::new(
            Some("content_block_delta"),
            "{\"type\":\"content_block_delta\"}",
        );
        assert_eq!(event_role(Protocol::Anthropic, &delta), EventRole::Output);
        let ping = SseEvent::new(Some("ping"), "{\"type\":\"ping\"}");
        assert_eq!(event_role(Protocol::Anthropic, &ping), EventRole::KeepAlive);
        let err = stream_error_event(Protocol::Anthropic, ErrorKind::Overloaded, "busy");
        assert_eq!(
            event_role(Protocol::Anthropic, &err),
            EventRole::Error("busy".into())
        );
    }

    #[test]
    fn error_shapes_follow_each_protocol() {
        let o = error_body(Protocol::OpenAi, ErrorKind::NotFound, "no such model");
        assert_eq!(o["error"]["type"], "not_found_error");
        let a = error_body(Protocol::Anthropic, ErrorKind::TooLarge, "too big");
        assert_eq!(a["type"], "error");
        assert_eq!(a["error"]["type"], "request_too_large");
    }
}
