//! The request path's one error type, from admission to delivery, and how it reaches the
//! client: always in the client's protocol's error shape (a response, or an error event once a
//! stream has begun), with a precise message, and `retry-after` / `retry-after-ms` when waiting
//! helps. Errors are built as data and logged once, at the edge (delivery), never where they
//! arise.
//!
//! A [`GatewayError`] carries what went wrong ([`ErrorKind`]): either an answer keel gives the
//! client itself (bad input, a limit, no variant that can serve: the protocol's class, final),
//! or a failure with one upstream (its connection, or an answer keel could not use), which
//! another variant may not meet ([`ErrorKind::retryable`]). The client-facing status and error
//! type follow from the kind ([`ErrorKind::class`]): an upstream's failure that reaches the
//! client is a 502.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use keel_core::protocol::{self, error_body, stream_error_event, Protocol};
use keel_core::request::RequestError;
use keel_core::sse::SseEvent;

use crate::Body;

/// What went wrong on a request's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// keel answers the request itself with this class: bad input, a limit, no variant that
    /// can serve.
    Answer(protocol::ErrorKind),
    /// The upstream refused the connection: nothing listens (a restarting server).
    Refused,
    /// Connecting to the upstream failed otherwise (timeout, unreachable, DNS).
    Connect,
    /// The upstream connection failed after it was made.
    Io,
    /// The upstream's answer could not be used (not translatable, not assembled).
    Malformed,
    /// The upstream could not serve otherwise: an error status, a whole answer where a stream
    /// was needed, an attempt that failed (each variant's reason in the message).
    Upstream,
}

impl ErrorKind {
    /// The class the client sees: its status and its protocol's error type.
    pub fn class(self) -> protocol::ErrorKind {
        match self {
            ErrorKind::Answer(k) => k,
            ErrorKind::Refused
            | ErrorKind::Connect
            | ErrorKind::Io
            | ErrorKind::Malformed
            | ErrorKind::Upstream => protocol::ErrorKind::BadGateway,
        }
    }

    /// Whether the request may still be served by another variant: true for a failure with
    /// one upstream, false for keel's own answer.
    pub fn retryable(self) -> bool {
        !matches!(self, ErrorKind::Answer(_))
    }
}

impl From<protocol::ErrorKind> for ErrorKind {
    fn from(k: protocol::ErrorKind) -> Self {
        ErrorKind::Answer(k)
    }
}

/// A kind is its class's when keel answers with that class itself.
impl PartialEq<protocol::ErrorKind> for ErrorKind {
    fn eq(&self, other: &protocol::ErrorKind) -> bool {
        *self == ErrorKind::Answer(*other)
    }
}

/// An error on the request path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayError {
    pub kind: ErrorKind,
    /// One line. An upstream's never carries its URL (keel prints no more of an upstream than
    /// its variant name).
    pub message: String,
    pub retry_after_ms: Option<u64>,
    /// Extra headers for the response (a keyed request's rate-limit headers).
    /// Boxed: most errors have none, and the error travels in every `Result`.
    pub headers: Option<Box<http::HeaderMap>>,
    /// OpenAI's machine-readable `error.code` (e.g. `context_length_exceeded`); Anthropic's
    /// shape has none.
    pub code: Option<&'static str>,
}

impl GatewayError {
    pub fn new(kind: impl Into<ErrorKind>, message: impl Into<String>) -> Self {
        GatewayError {
            kind: kind.into(),
            message: message.into(),
            retry_after_ms: None,
            headers: None,
            code: None,
        }
    }

    /// An upstream's failure of `kind`, described by `e` and its sources as one line.
    pub fn upstream(kind: ErrorKind, e: &dyn std::error::Error) -> Self {
        GatewayError::new(kind, chain(e))
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_retry_after(mut self, ms: u64) -> Self {
        self.retry_after_ms = Some(ms);
        self
    }

    /// Whether another variant may still serve the request (see [`ErrorKind::retryable`]).
    pub fn retryable(&self) -> bool {
        self.kind.retryable()
    }

    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.kind.class().status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The body in the client's protocol's error shape.
    pub fn body(&self, protocol: Protocol) -> serde_json::Value {
        let mut body = error_body(protocol, self.kind.class(), &self.message);
        if let (Some(code), Protocol::OpenAi) = (self.code, protocol) {
            body["error"]["code"] = code.into();
        }
        body
    }

    /// The response in the client's protocol.
    pub fn to_response(&self, protocol: Protocol) -> Response<Body> {
        let body = self.body(protocol).to_string();
        let mut resp = crate::full_body(self.status(), "application/json", Bytes::from(body));
        for (k, v) in self.headers.iter().flat_map(|h| h.iter()) {
            resp.headers_mut().insert(k.clone(), v.clone());
        }
        if let Some(ms) = self.retry_after_ms {
            let h = resp.headers_mut();
            let secs = ms.div_ceil(1000).max(1);
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
            h.insert("retry-after-ms", HeaderValue::from(ms));
        }
        resp
    }

    /// The error event that ends a stream already under way, in the client's protocol.
    pub fn to_event(&self, protocol: Protocol) -> SseEvent {
        stream_error_event(protocol, self.kind.class(), &self.message)
    }
}

/// An error and its sources, as one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg = format!("{msg}: {s}");
        src = s.source();
    }
    msg
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for GatewayError {}

impl From<RequestError> for GatewayError {
    fn from(e: RequestError) -> Self {
        GatewayError::new(e.kind, e.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upstreams_failure_is_a_retryable_502_and_keels_answer_is_final() {
        for kind in [
            ErrorKind::Refused,
            ErrorKind::Connect,
            ErrorKind::Io,
            ErrorKind::Malformed,
            ErrorKind::Upstream,
        ] {
            let e = GatewayError::new(kind, "x");
            assert!(e.retryable(), "{kind:?}");
            assert_eq!(e.status(), StatusCode::BAD_GATEWAY, "{kind:?}");
        }
        let e = GatewayError::new(protocol::ErrorKind::RateLimited, "x");
        assert!(!e.retryable());
        assert_eq!(e.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.kind, protocol::ErrorKind::RateLimited);
        assert_ne!(e.kind, protocol::ErrorKind::BadGateway);
    }

    #[test]
    fn an_upstreams_message_is_the_error_and_its_sources_on_one_line() {
        let inner = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = GatewayError::upstream(ErrorKind::Io, &ErrorWithSource(inner));
        assert_eq!(e.message, "reading: reset by peer");
        assert_eq!(e.to_string(), e.message);
    }

    #[derive(Debug)]
    struct ErrorWithSource(std::io::Error);

    impl std::fmt::Display for ErrorWithSource {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("reading")
        }
    }

    impl std::error::Error for ErrorWithSource {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
}
