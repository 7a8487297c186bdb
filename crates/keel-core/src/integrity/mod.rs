//! Output integrity, the pure part: whether an answer was cut short by its upstream
//! ([`truncation`]), whether a structured answer is the JSON that was asked for ([`json`]), and
//! how several structured answers are merged field by field ([`vote`]). The gateway performs
//! what these decide (continuations, a retry, parallel attempts) through its one settlement path.
//!
//! **When an answer counts as truncated.** Let `L` be the client's own output limit
//! (`max_completion_tokens`, else `max_tokens`; Anthropic `max_tokens`), and `G` the tokens the
//! answer holds: the tokens delivered before the current segment (by keel's tokenizer rule, the
//! same count a continuation lowers `max_tokens` by) plus the current segment's output tokens as
//! its upstream reports them in its usage (keel's count of the segment's text when it reports
//! none). The answer is truncated when its upstream stopped for length (`finish_reason:
//! "length"`, Anthropic `stop_reason: "max_tokens"`) and either the client set no limit (the
//! upstream's own limit cut it) or `G < L`. An answer that used the client's whole limit ended
//! where the client asked it to and is never touched.

pub mod json;
pub mod schema;
pub mod truncation;
pub mod vote;

use serde_json::{Map, Value};

/// The client's own output limit: `max_completion_tokens`, else `max_tokens` (Anthropic's
/// required `max_tokens` is the same field).
pub fn client_output_limit(body: &Map<String, Value>) -> Option<u64> {
    body.get("max_completion_tokens")
        .and_then(Value::as_u64)
        .or_else(|| body.get("max_tokens").and_then(Value::as_u64))
}

/// Whether an answer that stopped for length holding `generated` tokens was cut below what the
/// client allowed (see the module's definition).
pub fn below_client_limit(limit: Option<u64>, generated: u64) -> bool {
    limit.is_none_or(|l| generated < l)
}

/// What a whole answer says about integrity, for `x-keel-integrity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flag {
    Truncated,
    InvalidJson,
}

impl Flag {
    pub fn as_str(self) -> &'static str {
        match self {
            Flag::Truncated => "truncated",
            Flag::InvalidJson => "invalid_json",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_limit_is_the_clients_own() {
        let b = |v: Value| v.as_object().cloned().unwrap();
        assert_eq!(
            client_output_limit(&b(json!({"max_tokens": 50, "max_completion_tokens": 80}))),
            Some(80)
        );
        assert_eq!(client_output_limit(&b(json!({"max_tokens": 50}))), Some(50));
        assert_eq!(client_output_limit(&b(json!({}))), None);
        assert!(below_client_limit(None, 10_000));
        assert!(below_client_limit(Some(100), 99));
        assert!(!below_client_limit(Some(100), 100));
    }
}
