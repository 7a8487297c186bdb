//! Prompt normalization: trivially different spellings of one prompt (smart quotes, NBSP,
//! zero-width characters, CRLF, stray spaces and blank lines) become one canonical text, so that
//! upstream prefix caches and our own caches see the same bytes. Pure: a JSON body in, the same
//! body edited in place and the list of fixes applied out.
//!
//! Only prose is touched: system prompts and the text content of messages. Tool definitions, tool
//! calls and their arguments, tool results, non-text parts, code spans and texts that are JSON as
//! a whole stay byte-identical.

mod text;

use serde_json::{Map, Value};

use crate::protocol::Endpoint;
pub use text::normalize_text;

/// How much normalization a pool or request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Nothing is changed.
    #[default]
    Off,
    /// Meaning-preserving character and whitespace fixes.
    Syntax,
    /// `Syntax` plus rewrite rules for vague format instructions. The rules are not written yet,
    /// so this mode currently does what `Syntax` does.
    Full,
}

impl Mode {
    /// Parses the config / header spelling: `off`, `syntax` or `full`.
    pub fn parse(s: &str) -> Option<Mode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" => Some(Mode::Off),
            "syntax" => Some(Mode::Syntax),
            "full" => Some(Mode::Full),
            _ => None,
        }
    }
}

/// The fix codes applied, each listed once, in the order first applied.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Fixes(Vec<&'static str>);

impl Fixes {
    pub fn add(&mut self, code: &'static str) {
        if !self.0.contains(&code) {
            self.0.push(code);
        }
    }

    pub fn codes(&self) -> &[&'static str] {
        &self.0
    }

    pub fn into_codes(self) -> Vec<&'static str> {
        self.0
    }
}

/// Normalizes the prose of a Chat Completions or Messages body in place; other endpoints and
/// `Mode::Off` leave it untouched. Returns the fix codes applied (empty when nothing changed).
pub fn normalize_request(
    endpoint: Endpoint,
    body: &mut Map<String, Value>,
    mode: Mode,
) -> Vec<&'static str> {
    let mut fixes = Fixes::default();
    if mode == Mode::Off {
        return Vec::new();
    }
    match endpoint {
        Endpoint::ChatCompletions => {
            for msg in messages(body) {
                // A tool message's content is a tool result: data, not prose.
                if msg.get("role").and_then(Value::as_str) != Some("tool") {
                    if let Some(content) = msg.get_mut("content") {
                        normalize_content(content, &mut fixes);
                    }
                }
            }
        }
        Endpoint::Messages | Endpoint::CountTokens => {
            if let Some(system) = body.get_mut("system") {
                normalize_content(system, &mut fixes);
            }
            for msg in messages(body) {
                if let Some(content) = msg.get_mut("content") {
                    normalize_content(content, &mut fixes);
                }
            }
        }
        Endpoint::Completions | Endpoint::Embeddings => {}
    }
    fixes.into_codes()
}

/// The opt-out marker: a first line of the first system or user text.
pub const OPT_OUT_LINE: &str = "#keel-no-normalize";

/// Removes a first line `#keel-no-normalize` from the first system or user text of a Chat
/// Completions or Messages body, so it never reaches the model; true when it was there (the
/// caller then skips normalization and records the fix code `opt_out`).
pub fn take_opt_out(endpoint: Endpoint, body: &mut Map<String, Value>) -> bool {
    let first = match endpoint {
        Endpoint::ChatCompletions => messages(body)
            .find(|m| {
                matches!(
                    m.get("role").and_then(Value::as_str),
                    Some("system" | "developer" | "user")
                )
            })
            .and_then(|m| m.get_mut("content")),
        Endpoint::Messages | Endpoint::CountTokens => {
            if body.contains_key("system") {
                body.get_mut("system")
            } else {
                messages(body)
                    .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
                    .and_then(|m| m.get_mut("content"))
            }
        }
        Endpoint::Completions | Endpoint::Embeddings => None,
    };
    let Some(text) = first.and_then(first_text) else {
        return false;
    };
    let Some(rest) = text.strip_prefix(OPT_OUT_LINE) else {
        return false;
    };
    let rest = match rest
        .strip_prefix("\r\n")
        .or_else(|| rest.strip_prefix('\n'))
    {
        Some(r) => r,
        None if rest.is_empty() => rest,
        // `#keel-no-normalize-later…` is some other first line, not the marker.
        None => return false,
    };
    *text = rest.to_owned();
    true
}

/// The first text of a content value: the string itself, or the first `text` part's text.
fn first_text(content: &mut Value) -> Option<&mut String> {
    match content {
        Value::String(s) => Some(s),
        Value::Array(parts) => parts
            .iter_mut()
            .filter_map(Value::as_object_mut)
            .find(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .and_then(|p| match p.get_mut("text") {
                Some(Value::String(s)) => Some(s),
                _ => None,
            }),
        _ => None,
    }
}

fn messages(body: &mut Map<String, Value>) -> impl Iterator<Item = &mut Map<String, Value>> {
    body.get_mut("messages")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object_mut)
}

/// A content value is a string or an array of parts in both protocols; only parts of type
/// `text` (with a string `text`) are prose.
fn normalize_content(content: &mut Value, fixes: &mut Fixes) {
    match content {
        Value::String(s) => normalize_in_place(s, fixes),
        Value::Array(parts) => {
            for part in parts.iter_mut().filter_map(Value::as_object_mut) {
                if part.get("type").and_then(Value::as_str) == Some("text") {
                    if let Some(Value::String(s)) = part.get_mut("text") {
                        normalize_in_place(s, fixes);
                    }
                }
            }
        }
        _ => {}
    }
}

fn normalize_in_place(s: &mut String, fixes: &mut Fixes) {
    if let Some(new) = normalize_text(s, fixes) {
        *s = new;
    }
}

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
