//! Prompt normalization: trivially different spellings of one prompt (smart quotes, NBSP,
//! zero-width characters, CRLF, stray spaces and blank lines) become one canonical text, so that
//! upstream prefix caches and our own caches see the same bytes. Pure: a JSON body in, the same
//! body edited in place and the list of fixes applied out.
//!
//! Only prose is touched: system prompts and the text content of messages. Tool definitions, tool
//! calls and their arguments, tool results, non-text parts, code spans and texts that are JSON as
//! a whole stay byte-identical.
//!
//! `full` mode adds three steps on the prompt (system, developer and user texts; never the
//! assistant's turns, which are the model's own words): JSON-example repair ([`json_repair`]),
//! rewrite rules for vague format instructions ([`rules`]), and intent completion ([`intent`]).
//! What they may change, and why a second pass changes nothing, is in [`full`].
//!
//! **Bounded work.** `syntax` is linear in the text. `full`'s rules and intent completion are
//! linear too; JSON-example repair searches for a completion by parsing candidates, so its
//! work is bounded per request by a [`RepairBudget`] of bytes examined, counted rather than
//! timed (see [`json_repair`]): the same prompt gets the same answer on any machine. The
//! gateway shares one budget across a request's texts ([`normalize_request_within`]) and, since
//! this module reads no clock and spawns nothing, decides itself where the work runs.

mod edits;
mod full;
mod intent;
mod json_repair;
mod prose;
mod rules;
mod text;

use std::borrow::Cow;

use serde_json::{Map, Value};

use crate::members::Members;
use crate::protocol::Endpoint;
pub use edits::{Edit, Edits};
pub use full::{
    normalize_prompt_text, normalize_prompt_text_within, ErrorAt, FullConfig, FullConfigError,
};
pub use intent::Intent;
pub use json_repair::RepairBudget;
pub use rules::RuleSpec;
pub use text::normalize_text;

/// How much normalization a pool or request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Nothing is changed.
    #[default]
    Off,
    /// Meaning-preserving character and whitespace fixes.
    Syntax,
    /// `Syntax` plus JSON-example repair, rewrite rules for vague format instructions and
    /// intent completion, as configured by a [`FullConfig`].
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

/// The fix codes applied, each listed once, in the order first applied. `syntax` codes are
/// static; `full` adds codes that name a configured rule (`rule_rewritten:<name>`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Fixes(Vec<Cow<'static, str>>);

impl Fixes {
    pub fn add(&mut self, code: impl Into<Cow<'static, str>>) {
        let code = code.into();
        if !self.0.contains(&code) {
            self.0.push(code);
        }
    }

    pub fn codes(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|c| c.as_ref())
    }

    pub fn contains(&self, code: &str) -> bool {
        self.codes().any(|c| c == code)
    }

    pub fn into_codes(self) -> Vec<String> {
        self.0.into_iter().map(Cow::into_owned).collect()
    }
}

/// Normalizes the prose of a Chat Completions or Messages body in place; other endpoints and
/// `Mode::Off` leave it untouched. `full` configures what `Mode::Full` adds (ignored in the
/// other modes). Returns the fix codes applied (empty when nothing changed).
pub fn normalize_request(
    endpoint: Endpoint,
    body: &mut Map<String, Value>,
    mode: Mode,
    full: &FullConfig,
) -> Vec<String> {
    normalize_request_with(endpoint, body, mode, full, &mut Edits::default())
}

/// [`normalize_request`], also recording each change in `edits` (see [`Edits`]).
pub fn normalize_request_with(
    endpoint: Endpoint,
    body: &mut Map<String, Value>,
    mode: Mode,
    full: &FullConfig,
    edits: &mut Edits,
) -> Vec<String> {
    let mut budget = RepairBudget::default();
    normalize_request_within(endpoint, body, mode, full, edits, &mut budget)
}

/// [`normalize_request_with`], with `full` mode's JSON-example repair within `budget` for the
/// whole request; afterwards `budget` says how much work was done and whether it ran out.
pub fn normalize_request_within(
    endpoint: Endpoint,
    body: &mut Map<String, Value>,
    mode: Mode,
    full: &FullConfig,
    edits: &mut Edits,
    budget: &mut RepairBudget,
) -> Vec<String> {
    let mut fixes = Fixes::default();
    if mode == Mode::Off {
        return Vec::new();
    }
    let full = (mode == Mode::Full).then_some(full);
    match endpoint {
        Endpoint::ChatCompletions => {
            for (i, msg) in messages(body).enumerate() {
                let role = msg.member("role").and_then(Value::as_str);
                // A tool message's content is a tool result: data, not prose.
                if role == Some("tool") {
                    continue;
                }
                let prompt = full.filter(|_| is_prompt_role(role));
                if let Some(content) = msg.member_mut("content") {
                    let at = || format!("messages[{i}]");
                    normalize_content(content, prompt, &mut fixes, edits, budget, at);
                }
            }
        }
        Endpoint::Messages | Endpoint::CountTokens => {
            if let Some(system) = body.member_mut("system") {
                let at = || "system".to_owned();
                normalize_content(system, full, &mut fixes, edits, budget, at);
            }
            for (i, msg) in messages(body).enumerate() {
                let prompt =
                    full.filter(|_| is_prompt_role(msg.member("role").and_then(Value::as_str)));
                if let Some(content) = msg.member_mut("content") {
                    let at = || format!("messages[{i}]");
                    normalize_content(content, prompt, &mut fixes, edits, budget, at);
                }
            }
        }
        Endpoint::Completions | Endpoint::Embeddings => {}
    }
    if let Some(full) = full {
        intent::complete(endpoint, body, full, &mut fixes, edits);
    }
    fixes.into_codes()
}

/// The roles whose texts are the prompt (what `full` mode may rewrite): everything but the
/// assistant's turns and tool results.
fn is_prompt_role(role: Option<&str>) -> bool {
    matches!(role, Some("system" | "developer" | "user"))
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
                    m.member("role").and_then(Value::as_str),
                    Some("system" | "developer" | "user")
                )
            })
            .and_then(|m| m.member_mut("content")),
        Endpoint::Messages | Endpoint::CountTokens => {
            if body.contains_key("system") {
                body.member_mut("system")
            } else {
                messages(body)
                    .find(|m| m.member("role").and_then(Value::as_str) == Some("user"))
                    .and_then(|m| m.member_mut("content"))
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
    texts_mut(content).into_iter().next()
}

fn messages(body: &mut Map<String, Value>) -> impl Iterator<Item = &mut Map<String, Value>> {
    body.member_mut("messages")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object_mut)
}

/// The text strings of a content value: the string itself, or each `text` part's `text` (both
/// protocols use these two shapes; other parts are not prose).
fn texts_mut(content: &mut Value) -> Vec<&mut String> {
    match content {
        Value::String(s) => vec![s],
        Value::Array(parts) => parts
            .iter_mut()
            .filter_map(Value::as_object_mut)
            .filter(|p| p.member("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| match p.member_mut("text") {
                Some(Value::String(s)) => Some(s),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// Normalizes each text of a content value: `syntax` always, plus `full`'s per-text steps when
/// `full` is given (a prompt text in `full` mode).
/// `at` names the content (`messages[2]`) for `edits`; a text part is named after it
/// (`messages[2].text[1]`).
fn normalize_content(
    content: &mut Value,
    full: Option<&FullConfig>,
    fixes: &mut Fixes,
    edits: &mut Edits,
    budget: &mut RepairBudget,
    at: impl Fn() -> String,
) {
    let parts = content.is_array();
    for (k, s) in texts_mut(content).into_iter().enumerate() {
        let new = match full {
            Some(cfg) => full::normalize_prompt_text_within(s, cfg, fixes, budget),
            None => normalize_text(s, fixes),
        };
        if let Some(new) = new {
            let name = || match parts {
                true => format!("{}.text[{k}]", at()),
                false => at(),
            };
            edits.record(name, s, &new);
            *s = new;
        }
    }
}

#[cfg(test)]
mod full_tests;
#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
