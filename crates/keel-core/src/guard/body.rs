//! Applying a policy to a request body: every text a model reads (messages, system prompts,
//! tool definitions, tool calls' arguments, tool results, in any of the client APIs) is a
//! JSON string somewhere in the body; each is scanned, except the strings of fields that name
//! or identify rather than say something (`model`, `role`, `type`, ids, tool names) and inline
//! binary data (`data:` URLs, base64 `data` fields).
//!
//! Zero-width characters inside a string are removed before it is scanned, so that a value
//! obfuscated with them (`jane\u{200B}@example.com`) is still found; a string with no finding
//! keeps them.

use serde_json::{Map, Value};

use super::mask::{apply, Counts, Masker};
use super::policy::Policy;
use super::Guard;

/// Fields whose string values are never scanned.
const SKIPPED: &[&str] = &[
    "model",
    "role",
    "type",
    "id",
    "tool_call_id",
    "tool_use_id",
    "call_id",
    "name",
    "data",
    "media_type",
    "detail",
    "format",
    "stop_reason",
    "finish_reason",
];

/// Characters dropped before scanning: zero-width space, non-joiner and joiner, word joiner,
/// the byte-order mark and the soft hyphen.
fn invisible(c: char) -> bool {
    matches!(
        c,
        '\u{200B}' | '\u{200C}' | '\u{200D}' | '\u{2060}' | '\u{FEFF}' | '\u{00AD}'
    )
}

/// Applies `policy` to one string: scans it (without its invisible characters) and returns
/// the replacement when `mask` or `redact` changed it.
pub fn apply_text(
    guard: &Guard,
    policy: &Policy,
    text: &str,
    masker: &mut Masker,
    counts: &mut Counts,
) -> Option<String> {
    if text.chars().any(invisible) {
        let visible: String = text.chars().filter(|&c| !invisible(c)).collect();
        let before = counts.clone();
        let out = apply(guard, policy, &visible, masker, counts);
        // Found something: the visible form travels (masked where the policy masks).
        return out.or_else(|| (*counts != before).then_some(visible));
    }
    apply(guard, policy, text, masker, counts)
}

/// Applies `policy` to every scanned string of a request body (a JSON object), in place.
pub fn apply_body(
    guard: &Guard,
    policy: &Policy,
    body: &mut Map<String, Value>,
    masker: &mut Masker,
    counts: &mut Counts,
) {
    if policy.is_empty() {
        return;
    }
    walk_object(guard, policy, body, masker, counts);
}

fn walk(guard: &Guard, policy: &Policy, v: &mut Value, masker: &mut Masker, counts: &mut Counts) {
    match v {
        Value::String(s) => {
            if s.starts_with("data:") {
                return;
            }
            if let Some(new) = apply_text(guard, policy, s, masker, counts) {
                *s = new;
            }
        }
        Value::Array(items) => {
            for item in items {
                walk(guard, policy, item, masker, counts);
            }
        }
        Value::Object(map) => walk_object(guard, policy, map, masker, counts),
        _ => {}
    }
}

fn walk_object(
    guard: &Guard,
    policy: &Policy,
    map: &mut Map<String, Value>,
    masker: &mut Masker,
    counts: &mut Counts,
) {
    for (k, item) in map.iter_mut() {
        if item.is_string() && SKIPPED.contains(&k.as_str()) {
            continue;
        }
        walk(guard, policy, item, masker, counts);
    }
}
