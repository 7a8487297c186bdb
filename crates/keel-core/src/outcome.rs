//! Classification of every upstream outcome into what the execution stage does next.
//!
//! The rule (see the failover table in docs/src/failover.md): transient capacity and server
//! faults are retried on another variant; the client's own mistakes are returned as the upstream
//! gave them and never retried (retrying a 400 elsewhere only multiplies the same error); a
//! rejected credential is the variant's fault, not the client's, so keel fails over and marks
//! the variant.

/// Why an attempt did not produce a usable response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptFailure {
    /// TCP/TLS connection could not be established.
    Connect(String),
    /// The connection was refused (nothing listens: a server restarting, or dead).
    Refused(String),
    /// The connection broke before a complete response head or first event arrived.
    Io(String),
    /// No response head within the connect/first-token deadline.
    FirstTokenTimeout { after_ms: u64 },
    /// The request's total deadline ran out.
    Deadline { after_ms: u64 },
    /// The upstream answered with an error status.
    Status {
        status: u16,
        retry_after_ms: Option<u64>,
        message: String,
    },
    /// The upstream answered 200 with a body keel could not understand (or one past a size
    /// bound: an event, a body, a tool-call index).
    Malformed(String),
    /// After the first token: no output for `silent_ms`.
    Stall { silent_ms: u64 },
    /// After the first token: the token rate fell well below the variant's baseline.
    Slow(String),
    /// The upstream reported an error inside its stream.
    ErrorEvent(String),
}

impl AttemptFailure {
    /// A short label for metrics (`outcome` label of attempts).
    pub fn label(&self) -> String {
        match self {
            AttemptFailure::Connect(_) | AttemptFailure::Refused(_) => "connect_error".into(),
            AttemptFailure::Io(_) => "io_error".into(),
            AttemptFailure::FirstTokenTimeout { .. } => "first_token_timeout".into(),
            AttemptFailure::Deadline { .. } => "deadline".into(),
            f if f.is_loading() => "loading".into(),
            AttemptFailure::Status { status, .. } => format!("status_{status}"),
            AttemptFailure::Malformed(_) => "malformed".into(),
            AttemptFailure::Stall { .. } => "stall".into(),
            AttemptFailure::Slow(_) => "slow".into(),
            AttemptFailure::ErrorEvent(_) => "error_event".into(),
        }
    }

    /// One line for logs and for the client's "what was tried" message.
    pub fn describe(&self) -> String {
        match self {
            AttemptFailure::Connect(e) | AttemptFailure::Refused(e) => {
                format!("connect error: {e}")
            }
            AttemptFailure::Io(e) => format!("connection error: {e}"),
            AttemptFailure::FirstTokenTimeout { after_ms } => {
                format!("no first token within {after_ms} ms")
            }
            AttemptFailure::Deadline { after_ms } => {
                format!("total deadline of {after_ms} ms reached")
            }
            AttemptFailure::Status {
                status, message, ..
            } => {
                if message.is_empty() {
                    format!("HTTP {status}")
                } else {
                    format!("HTTP {status}: {message}")
                }
            }
            AttemptFailure::Malformed(e) => format!("malformed response: {e}"),
            AttemptFailure::Stall { silent_ms } => {
                format!("the upstream stalled: no output for {silent_ms} ms")
            }
            AttemptFailure::Slow(e) => format!("the upstream slowed down: {e}"),
            AttemptFailure::ErrorEvent(e) => format!("upstream error event: {e}"),
        }
    }

    /// The reason a failure after the first token gives for a migration: `stall`, `slow` or
    /// `error` (the label of `: keel migrated … reason=` and of `keel_migrations_total`).
    pub fn migration_reason(&self) -> &'static str {
        match self {
            AttemptFailure::Stall { .. } => "stall",
            AttemptFailure::Slow(_) => "slow",
            _ => "error",
        }
    }

    /// A server that is still loading its model (llama.cpp, TGI and others answer 503 with a
    /// message saying so): warming, not failing.
    pub fn is_loading(&self) -> bool {
        matches!(self, AttemptFailure::Status { status: 503, message, .. }
            if message.to_ascii_lowercase().contains("loading"))
    }

    pub fn verdict(&self) -> Verdict {
        match self {
            AttemptFailure::Status {
                status,
                retry_after_ms,
                ..
            } => classify_status(*status, *retry_after_ms),
            AttemptFailure::Deadline { .. } => Verdict::GiveUp,
            _ => Verdict::Retry { cooldown_ms: None },
        }
    }
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Try the next variant; optionally keep this one out of rotation for a while.
    Retry { cooldown_ms: Option<u64> },
    /// The variant's credential was refused: try the next variant and mark this one broken.
    BrokenCredential,
    /// The client's own error: return the upstream's response unchanged.
    ReturnToClient,
    /// Nothing more can be done within this request (deadline).
    GiveUp,
}

/// Classifies an upstream HTTP status. 2xx is not a failure and never reaches here.
pub fn classify_status(status: u16, retry_after_ms: Option<u64>) -> Verdict {
    match status {
        401 | 403 => Verdict::BrokenCredential,
        408 | 429 | 529 => Verdict::Retry {
            cooldown_ms: retry_after_ms,
        },
        // 400, 404 (unknown model), 413, 422 and every other 4xx: the request itself is at fault.
        400..=499 => Verdict::ReturnToClient,
        // 500, 502, 503, 504 and any other server-side status.
        _ => Verdict::Retry {
            cooldown_ms: retry_after_ms,
        },
    }
}

/// Reads `retry-after-ms` (OpenAI's precise form) or `retry-after` in seconds. HTTP-date values
/// are not interpreted (no provider sends them for rate limits), and values are capped at
/// `cap_ms` so that a confused upstream cannot park a variant for hours.
pub fn parse_retry_after(
    retry_after_ms: Option<&str>,
    retry_after: Option<&str>,
    cap_ms: u64,
) -> Option<u64> {
    let ms = retry_after_ms
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| v.ceil() as u64)
        .or_else(|| {
            retry_after
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|s| (s * 1000.0).ceil() as u64)
        })?;
    Some(ms.min(cap_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_statuses() {
        for s in [408, 429, 500, 502, 503, 504, 529] {
            assert!(
                matches!(classify_status(s, None), Verdict::Retry { .. }),
                "{s}"
            );
        }
        assert_eq!(
            classify_status(429, Some(2000)),
            Verdict::Retry {
                cooldown_ms: Some(2000)
            }
        );
    }

    #[test]
    fn client_errors_are_returned() {
        for s in [400, 404, 413, 422] {
            assert_eq!(classify_status(s, None), Verdict::ReturnToClient, "{s}");
        }
    }

    #[test]
    fn a_loading_server_is_recognised_by_its_message() {
        let status = |s: u16, m: &str| AttemptFailure::Status {
            status: s,
            retry_after_ms: None,
            message: m.into(),
        };
        assert!(status(503, "Loading model").is_loading());
        assert_eq!(status(503, "Loading model").label(), "loading");
        assert!(!status(503, "overloaded").is_loading());
        assert!(!status(500, "loading").is_loading());
    }

    #[test]
    fn credential_errors_fail_over() {
        assert_eq!(classify_status(401, None), Verdict::BrokenCredential);
        assert_eq!(classify_status(403, None), Verdict::BrokenCredential);
    }

    #[test]
    fn retry_after_forms() {
        assert_eq!(
            parse_retry_after(Some("1500"), Some("9"), 60_000),
            Some(1500)
        );
        assert_eq!(parse_retry_after(None, Some("2"), 60_000), Some(2000));
        assert_eq!(parse_retry_after(None, Some("0.25"), 60_000), Some(250));
        assert_eq!(parse_retry_after(None, Some("86400"), 60_000), Some(60_000));
        assert_eq!(
            parse_retry_after(None, Some("Wed, 21 Oct 2015 07:28:00 GMT"), 60_000),
            None
        );
    }
}
