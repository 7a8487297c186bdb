//! The token usage an upstream reports in an answer or an event: OpenAI's `usage.prompt_tokens`
//! / `completion_tokens`, Anthropic's `usage.input_tokens` (+ cache reads and writes) /
//! `output_tokens`, at the top of a body or chunk or in Anthropic's `message` (its
//! `message_start`).
//!
//! Read without a JSON tree where it has the expected shape, and from its tree otherwise (a
//! member of the wrong type is then absent), so both readings agree wherever the first
//! succeeds. The members that carry it ([`Carrier`]) can also be read in the same pass as other
//! members of a body (see `keel_gateway::upstream::translation::checked_whole`): a whole answer
//! is then read once, not once to check it and again to meter it.

use serde::Deserialize;
use serde_json::Value;

use crate::members::Members;
use crate::protocol::MapOnly;

/// A `usage` object of either protocol.
#[derive(Debug, Default, PartialEq, Deserialize)]
pub struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
}

/// Anthropic's `message` (in `message_start`), for its `usage`.
#[derive(Debug, Default, PartialEq, Deserialize)]
pub struct Message {
    #[serde(default)]
    usage: Option<MapOnly<Usage>>,
}

/// The members of an object that may carry usage, read as fields of a larger reading: its
/// `usage`, and `message` (whose `usage` counts when the top has none).
#[derive(Debug, Default, PartialEq, Deserialize)]
pub struct Carrier {
    #[serde(default)]
    pub usage: Option<MapOnly<Usage>>,
    #[serde(default)]
    pub message: Option<MapOnly<Message>>,
}

/// What an answer or event reports: `None` when it has no usage object, else its (input,
/// output), either of which may be absent.
pub type Reported = Option<(Option<u64>, Option<u64>)>;

impl Carrier {
    /// The usage these members report.
    pub fn reported(self) -> Reported {
        let usage = self.usage.or_else(|| self.message.and_then(|m| m.0.usage));
        usage.map(|u| u.0.read())
    }
}

impl Usage {
    /// A `usage` object's tree; a count that is not a whole number reads as absent.
    fn from_tree(u: &Value) -> Self {
        let n = |key: &str| u.get(key).and_then(Value::as_u64);
        Usage {
            prompt_tokens: n("prompt_tokens"),
            completion_tokens: n("completion_tokens"),
            input_tokens: n("input_tokens"),
            cache_read_input_tokens: n("cache_read_input_tokens"),
            cache_creation_input_tokens: n("cache_creation_input_tokens"),
            output_tokens: n("output_tokens"),
        }
    }

    /// (input, output).
    fn read(&self) -> (Option<u64>, Option<u64>) {
        if let Some(prompt) = self.prompt_tokens {
            return (Some(prompt), self.completion_tokens);
        }
        let input = self.input_tokens.map(|i| {
            i.saturating_add(self.cache_read_input_tokens.unwrap_or(0))
                .saturating_add(self.cache_creation_input_tokens.unwrap_or(0))
        });
        (input, self.output_tokens)
    }
}

/// The usage a JSON object (an event's data, a whole body) reports; `Err` when it is not JSON.
pub fn of(data: &[u8]) -> serde_json::Result<Reported> {
    if let Ok(MapOnly(c)) = serde_json::from_slice::<MapOnly<Carrier>>(data) {
        return Ok(c.reported());
    }
    let v = serde_json::from_slice::<Value>(data)?;
    Ok(of_tree(&v))
}

/// The usage a JSON tree reports: at the top (OpenAI chunks and bodies, Anthropic bodies and
/// `message_delta`) or in `message` (Anthropic `message_start`).
pub fn of_tree(v: &Value) -> Reported {
    let usage = v
        .member("usage")
        .filter(|u| u.is_object())
        .or_else(|| v.member("message").and_then(|m| m.member("usage")))
        .filter(|u| u.is_object())?;
    Some(Usage::from_tree(usage).read())
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Whatever an event's usage holds, reading it without a tree gives what its tree
        /// gives.
        #[test]
        fn usage_read_without_a_tree_agrees_with_the_tree(
            fields in proptest::collection::vec((0usize..7, 0usize..9), 0..6),
            place in 0usize..4,
        ) {
            const KEYS: [&str; 7] = ["prompt_tokens", "completion_tokens", "input_tokens",
                "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens", "total_tokens"];
            const VALUES: [&str; 9] = ["3", "0", "18446744073709551615", "null", "-1", "2.5", "\"7\"", "{}", "[1]"];
            let mut seen = std::collections::HashSet::new();
            let members: Vec<String> = fields
                .iter()
                .filter(|(k, _)| seen.insert(*k))
                .map(|(k, v)| format!("\"{}\":{}", KEYS[*k], VALUES[*v]))
                .collect();
            let usage = format!("{{{}}}", members.join(","));
            let data = match place {
                0 => format!(r#"{{"id":"c","choices":[],"usage":{usage}}}"#),
                1 => format!(r#"{{"type":"message_start","message":{{"id":"m","usage":{usage}}}}}"#),
                2 => format!(r#"{{"usage":null,"message":{{"usage":{usage}}}}}"#),
                _ => format!(r#"{{"usage":[{usage}]}}"#),
            };
            let tree: Value = serde_json::from_str(&data).unwrap();
            proptest::prop_assert_eq!(of(data.as_bytes()).unwrap(), of_tree(&tree));
        }
    }

    #[test]
    fn either_protocols_usage_reads_as_input_and_output() {
        let openai = br#"{"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}"#;
        assert_eq!(of(openai).unwrap(), Some((Some(7), Some(3))));
        let anthropic = br#"{"usage":{"input_tokens":5,"cache_read_input_tokens":2,"cache_creation_input_tokens":1,"output_tokens":4}}"#;
        assert_eq!(of(anthropic).unwrap(), Some((Some(8), Some(4))));
        let start = br#"{"type":"message_start","message":{"usage":{"input_tokens":9}}}"#;
        assert_eq!(of(start).unwrap(), Some((Some(9), None)));
        assert_eq!(of(br#"{"id":"x"}"#).unwrap(), None);
        assert!(of(b"not json").is_err());
    }
}
