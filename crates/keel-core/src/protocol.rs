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
    /// An event that carries (or may carry) generated output, or metadata about it.
    Content,
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
                    _ => EventRole::Content,
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
                    Ok(v) if name == "error" || v.get("type").and_then(Value::as_str) == Some("error") => {
                        EventRole::Error(error_message(&v))
                    }
                    Ok(_) => EventRole::Content,
                    Err(e) => EventRole::Malformed(format!("invalid JSON in `{name}` event: {e}")),
                },
            }
        }
    }
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
        assert_eq!(event_role(Protocol::OpenAi, &SseEvent::new(None, "[DONE]")), EventRole::Terminal);
        assert_eq!(event_role(Protocol::OpenAi, &SseEvent::new(None, "{\"choices\":[]}")), EventRole::Content);
        assert!(matches!(event_role(Protocol::OpenAi, &SseEvent::new(None, "{oops")), EventRole::Malformed(_)));
        let err = stream_error_event(Protocol::OpenAi, ErrorKind::BadGateway, "boom");
        assert_eq!(event_role(Protocol::OpenAi, &err), EventRole::Error("boom".into()));
    }

    #[test]
    fn classifies_anthropic_events() {
        let stop = SseEvent::new(Some("message_stop"), "{\"type\":\"message_stop\"}");
        assert_eq!(event_role(Protocol::Anthropic, &stop), EventRole::Terminal);
        let ping = SseEvent::new(Some("ping"), "{\"type\":\"ping\"}");
        assert_eq!(event_role(Protocol::Anthropic, &ping), EventRole::KeepAlive);
        let err = stream_error_event(Protocol::Anthropic, ErrorKind::Overloaded, "busy");
        assert_eq!(event_role(Protocol::Anthropic, &err), EventRole::Error("busy".into()));
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
