//! Comparing two answers to one request (shadow traffic: the served answer against a shadow
//! variant's), and summing comparisons up.
//!
//! - **exact**: the two texts are byte for byte equal.
//! - **similarity**: token Jaccard over multisets of normalized words. Each text is lowercased
//!   and cut into runs of letters and digits (punctuation and whitespace only separate), and
//!   the similarity is Σ min(countₐ, count_b) / Σ max(countₐ, count_b) over all words: 1 for
//!   texts that differ only in case, spacing and punctuation, 0 for texts without a word in
//!   common. Two empty texts are similar (1). Word order is ignored on purpose: it measures
//!   whether two models said the same things, not whether they said them in the same order.
//! - **JSON field agreement**: when both texts are JSON, the share of leaf fields (paths such as
//!   `a.b[2]`, over the union of both documents' paths) whose values are equal.
//! - latency and token deltas: the shadow's minus the served one's.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

/// Nested JSON deeper than this is compared as one value.
const MAX_DEPTH: usize = 32;

/// One comparison of a shadow answer with the served one.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    pub exact: bool,
    pub similarity: f64,
    /// `None` when either text is not JSON.
    pub json_agreement: Option<f64>,
    pub latency_delta_ms: f64,
    pub token_delta: i64,
}

/// Compares `shadow` with `served`, with their latencies (ms) and output token counts.
pub fn compare(
    served: &str,
    shadow: &str,
    served_ms: f64,
    shadow_ms: f64,
    served_tokens: u64,
    shadow_tokens: u64,
) -> Comparison {
    Comparison {
        exact: served == shadow,
        similarity: similarity(served, shadow),
        json_agreement: json_agreement(served, shadow),
        latency_delta_ms: shadow_ms - served_ms,
        token_delta: shadow_tokens as i64 - served_tokens as i64,
    }
}

/// The words of a text: lowercased runs of letters and digits, with their counts.
fn words(text: &str) -> HashMap<String, u32> {
    let mut out: HashMap<String, u32> = HashMap::new();
    for w in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        *out.entry(w.to_lowercase()).or_default() += 1;
    }
    out
}

/// Token Jaccard over word multisets (see the module's doc), in 0..=1.
pub fn similarity(a: &str, b: &str) -> f64 {
    let (wa, wb) = (words(a), words(b));
    let (mut common, mut union) = (0u64, 0u64);
    for (w, &na) in &wa {
        let nb = wb.get(w).copied().unwrap_or(0);
        common += na.min(nb) as u64;
        union += na.max(nb) as u64;
    }
    union += wb
        .iter()
        .filter(|(w, _)| !wa.contains_key(*w))
        .map(|(_, &n)| n as u64)
        .sum::<u64>();
    if union == 0 {
        1.0
    } else {
        common as f64 / union as f64
    }
}

/// Leaf paths of a JSON document and their values.
fn leaves<'a>(v: &'a Value, path: String, depth: usize, out: &mut BTreeMap<String, &'a Value>) {
    match v {
        Value::Object(m) if depth < MAX_DEPTH && !m.is_empty() => {
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                leaves(x, p, depth + 1, out);
            }
        }
        Value::Array(a) if depth < MAX_DEPTH && !a.is_empty() => {
            for (i, x) in a.iter().enumerate() {
                leaves(x, format!("{path}[{i}]"), depth + 1, out);
            }
        }
        _ => {
            out.insert(path, v);
        }
    }
}

/// The share of leaf fields on which two JSON texts agree; `None` unless both parse as JSON
/// objects or arrays.
pub fn json_agreement(a: &str, b: &str) -> Option<f64> {
    let parse = |s: &str| {
        serde_json::from_str::<Value>(s.trim())
            .ok()
            .filter(|v| v.is_object() || v.is_array())
    };
    let (va, vb) = (parse(a)?, parse(b)?);
    let (mut la, mut lb) = (BTreeMap::new(), BTreeMap::new());
    leaves(&va, String::new(), 0, &mut la);
    leaves(&vb, String::new(), 0, &mut lb);
    let union = la.len() + lb.keys().filter(|k| !la.contains_key(*k)).count();
    if union == 0 {
        return Some(1.0);
    }
    let agree = la.iter().filter(|(k, v)| lb.get(*k) == Some(*v)).count();
    Some(agree as f64 / union as f64)
}

/// The text of a whole answer in either protocol: OpenAI Chat Completions
/// (`choices[0].message.content`), OpenAI completions (`choices[0].text`), or Anthropic
/// Messages (its `text` blocks, joined). `None` for anything else.
pub fn answer_text(v: &Value) -> Option<String> {
    if let Some(choice) = v.get("choices").and_then(|c| c.get(0)) {
        let text = choice
            .get("message")
            .and_then(|m| m.get("content"))
            .or_else(|| choice.get("text"));
        return match text {
            Some(Value::String(s)) => Some(s.clone()),
            // A tool-call-only answer has no text.
            Some(Value::Null) | None => Some(String::new()),
            Some(_) => None,
        };
    }
    let blocks = v.get("content")?.as_array()?;
    Some(
        blocks
            .iter()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect(),
    )
}

/// Comparisons summed up (one shadow variant of one pool).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Shadow requests sent and answered, compared below.
    pub compared: u64,
    /// Shadow requests that failed (an error status, a timeout, an unreadable answer).
    pub failed: u64,
    /// Sampled requests not sent: the shadow's concurrency limit or budget was reached.
    pub skipped: u64,
    pub exact: u64,
    similarity_sum: f64,
    json_sum: f64,
    /// Comparisons where both answers were JSON.
    pub json_compared: u64,
    latency_delta_sum: f64,
    token_delta_sum: f64,
}

impl Summary {
    pub fn add(&mut self, c: &Comparison) {
        self.compared += 1;
        self.exact += c.exact as u64;
        self.similarity_sum += c.similarity;
        if let Some(j) = c.json_agreement {
            self.json_sum += j;
            self.json_compared += 1;
        }
        self.latency_delta_sum += c.latency_delta_ms;
        self.token_delta_sum += c.token_delta as f64;
    }

    fn mean(&self, sum: f64, n: u64) -> Option<f64> {
        (n > 0).then(|| sum / n as f64)
    }

    pub fn exact_rate(&self) -> Option<f64> {
        self.mean(self.exact as f64, self.compared)
    }

    pub fn mean_similarity(&self) -> Option<f64> {
        self.mean(self.similarity_sum, self.compared)
    }

    pub fn mean_json_agreement(&self) -> Option<f64> {
        self.mean(self.json_sum, self.json_compared)
    }

    pub fn mean_latency_delta_ms(&self) -> Option<f64> {
        self.mean(self.latency_delta_sum, self.compared)
    }

    pub fn mean_token_delta(&self) -> Option<f64> {
        self.mean(self.token_delta_sum, self.compared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn similarity_is_token_jaccard_over_normalized_words() {
        assert_eq!(similarity("The cat sat.", "the  CAT sat"), 1.0);
        assert_eq!(similarity("", ""), 1.0);
        assert_eq!(similarity("a b", ""), 0.0);
        assert_eq!(similarity("one two", "three four"), 0.0);
        // {a:2, b:1} vs {a:1, c:1}: common 1, union a2 + b1 + c1 = 4.
        assert_eq!(similarity("a a b", "a c"), 0.25);
        // Order does not matter.
        assert_eq!(similarity("x y z", "z y x"), 1.0);
    }

    #[test]
    fn json_agreement_counts_leaf_fields_over_the_union() {
        assert_eq!(json_agreement("not json", "{}"), None);
        assert_eq!(json_agreement("\"a string\"", "\"a string\""), None);
        let a = r#"{"name": "x", "n": 1, "tags": ["a", "b"], "deep": {"k": true}}"#;
        let b = r#"{"name": "x", "n": 2, "tags": ["a"], "deep": {"k": true}, "extra": null}"#;
        // Paths: name ✓, n ✗, tags[0] ✓, tags[1] (a only), deep.k ✓, extra (b only): 3 of 6.
        assert_eq!(json_agreement(a, b), Some(0.5));
        assert_eq!(json_agreement(a, a), Some(1.0));
    }

    #[test]
    fn answer_text_reads_both_protocols() {
        let chat = serde_json::json!({"choices": [{"message": {"role": "assistant", "content": "hi there"}}]});
        assert_eq!(answer_text(&chat).as_deref(), Some("hi there"));
        let legacy = serde_json::json!({"choices": [{"text": "abc"}]});
        assert_eq!(answer_text(&legacy).as_deref(), Some("abc"));
        let msg = serde_json::json!({"content": [{"type": "text", "text": "a "}, {"type": "tool_use"}, {"type": "text", "text": "b"}]});
        assert_eq!(answer_text(&msg).as_deref(), Some("a b"));
        assert_eq!(answer_text(&serde_json::json!({"error": {}})), None);
    }

    #[test]
    fn comparisons_sum_up() {
        let c1 = compare("a b", "a b", 100.0, 150.0, 2, 2);
        assert!(c1.exact);
        assert_eq!((c1.latency_delta_ms, c1.token_delta), (50.0, 0));
        let c2 = compare("a b", "a c d", 100.0, 50.0, 2, 3);
        assert!(!c2.exact);
        assert_eq!(c2.similarity, 0.25);
        let mut s = Summary::default();
        s.add(&c1);
        s.add(&c2);
        assert_eq!(s.compared, 2);
        assert_eq!(s.exact_rate(), Some(0.5));
        assert_eq!(s.mean_similarity(), Some(0.625));
        assert_eq!(s.mean_latency_delta_ms(), Some(0.0));
        assert_eq!(s.mean_token_delta(), Some(0.5));
        assert_eq!(s.mean_json_agreement(), None);
    }
}
