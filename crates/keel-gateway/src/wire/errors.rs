//! keel's own errors and how they reach the client: always in the client's protocol's error
//! shape, with a precise message, and `retry-after` / `retry-after-ms` when waiting helps.
//! Errors are built as data and logged once, at the edge (delivery), never where they arise.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use keel_core::protocol::{error_body, ErrorKind, Protocol};
use keel_core::request::RequestError;

use crate::Body;

/// An error keel answers itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayError {
    pub kind: ErrorKind,
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
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        GatewayError {
            kind,
            message: message.into(),
            retry_after_ms: None,
            headers: None,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_retry_after(mut self, ms: u64) -> Self {
        self.retry_after_ms = Some(ms);
        self
    }

    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The response in the client's protocol.
    pub fn to_response(&self, protocol: Protocol) -> Response<Body> {
        let mut body = error_body(protocol, self.kind, &self.message);
        if let (Some(code), Protocol::OpenAi) = (self.code, protocol) {
            body["error"]["code"] = code.into();
        }
        let body = body.to_string();
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
}

impl From<RequestError> for GatewayError {
    fn from(e: RequestError) -> Self {
        GatewayError::new(e.kind, e.message)
    }
}
