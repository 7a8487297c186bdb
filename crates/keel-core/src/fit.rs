//! Context fit: what a request's prompt costs in tokens by one tokenizer, and the `middle-out`
//! transform that drops whole messages from the middle of a conversation until it fits.
//!
//! **Counting.** A prompt is its system text (Anthropic's `system`), every message's text
//! (string contents, text parts, tool-call arguments and tool results) plus
//! [`MESSAGE_OVERHEAD_TOKENS`] per message for the role and framing the chat template adds, or
//! a completion prompt. Counting goes through a [`Tally`], so it stops at a cap (see
//! [`crate::tokens`]): a prompt far beyond every context window costs little to refuse.
//!
//! **Middle-out.** Messages are grouped into units that are kept or dropped together: an
//! assistant message that calls tools and the tool results that answer it (OpenAI `tool`
//! messages; Anthropic user messages holding `tool_result` blocks). Kept always: system and
//! developer messages, the unit holding the first user message, and every unit from the one
//! holding the last user message to the end (the turn being answered). The others are dropped
//! starting from the middle of the conversation and moving outwards (the middle of a long chat
//! is what its answer needs least), until the total fits the budget.

use serde_json::Value;

use crate::members::Members;
use crate::tokens::{Estimate, Memo, Tally, Tokenizer};

/// Tokens a chat template adds per message (role markers, separators): OpenAI documents 3 for
/// its models; one more covers the other templates keel has seen.
pub const MESSAGE_OVERHEAD_TOKENS: u64 = 4;

/// Calls `f` with every text in a message `content` (or Anthropic `system`, or a tool result's
/// content): a string, or an array of parts with `text` (nested `content` of `tool_result`
/// blocks, `input` of `tool_use` blocks as JSON).
pub fn for_each_text(content: &Value, f: &mut impl FnMut(&str)) {
    match content {
        Value::String(s) => f(s),
        Value::Array(parts) => {
            for p in parts {
                if let Some(t) = p.member("text").and_then(Value::as_str) {
                    f(t);
                }
                if let Some(c) = p.member("content") {
                    for_each_text(c, f);
                }
                if let Some(input) = p.member("input").filter(|i| i.is_object()) {
                    f(&input.to_string());
                }
            }
        }
        _ => {}
    }
}

/// Adds one chat message (content, tool-call arguments, framing) to a tally.
pub fn add_message(msg: &Value, tally: &mut Tally) {
    tally.add_tokens(MESSAGE_OVERHEAD_TOKENS);
    if let Some(c) = msg.member("content") {
        for_each_text(c, &mut |t| tally.add(t));
    }
    for call in msg
        .member("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(args) = call.pointer("/function/arguments").and_then(Value::as_str) {
            tally.add(args);
        }
    }
}

/// One message's tokens by `tokenizer`, counting stopped past `cap` (long texts looked up in
/// `memo` first: see [`Memo`]).
pub fn message_tokens(msg: &Value, tokenizer: Tokenizer, cap: u64, memo: Option<&dyn Memo>) -> u64 {
    let mut t = Tally::remembering(tokenizer, cap, memo);
    add_message(msg, &mut t);
    t.estimate().tokens
}

/// The prompt of a request body (chat `messages` and `system`, or a completion `prompt`) by
/// `tokenizer`, counting stopped past `cap` (long texts looked up in `memo` first).
pub fn prompt_tokens(
    body: &serde_json::Map<String, Value>,
    tokenizer: Tokenizer,
    cap: u64,
    memo: Option<&dyn Memo>,
) -> Estimate {
    let mut t = Tally::remembering(tokenizer, cap, memo);
    add_system(body, &mut t);
    for m in body
        .member("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        add_message(m, &mut t);
    }
    match body.member("prompt") {
        Some(Value::String(p)) => t.add(p),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(Value::as_str)
            .for_each(|p| t.add(p)),
        _ => {}
    }
    t.estimate()
}

/// Adds Anthropic's top-level `system` to a tally.
fn add_system(body: &serde_json::Map<String, Value>, tally: &mut Tally) {
    if let Some(system) = body.member("system") {
        for_each_text(system, &mut |s| tally.add(s));
    }
}

/// The tokens of Anthropic's top-level `system` (0 without one), counting stopped past `cap`.
pub fn system_tokens(
    body: &serde_json::Map<String, Value>,
    tokenizer: Tokenizer,
    cap: u64,
    memo: Option<&dyn Memo>,
) -> u64 {
    let mut t = Tally::remembering(tokenizer, cap, memo);
    add_system(body, &mut t);
    t.estimate().tokens
}

fn role(m: &Value) -> &str {
    m.member("role").and_then(Value::as_str).unwrap_or("")
}

/// Whether a message holds a content block of `kind` (`tool_use`, `tool_result`).
fn has_block(m: &Value, kind: &str) -> bool {
    m.member("content")
        .and_then(Value::as_array)
        .is_some_and(|parts| {
            parts
                .iter()
                .any(|p| p.member("type").and_then(Value::as_str) == Some(kind))
        })
}

/// Whether an assistant message calls tools (OpenAI `tool_calls`, Anthropic `tool_use`).
fn calls_tools(m: &Value) -> bool {
    role(m) == "assistant"
        && (m
            .member("tool_calls")
            .and_then(Value::as_array)
            .is_some_and(|c| !c.is_empty())
            || has_block(m, "tool_use"))
}

/// Whether a message carries tool results (OpenAI `tool`/`function`, Anthropic `tool_result`).
fn answers_tools(m: &Value) -> bool {
    matches!(role(m), "tool" | "function") || (role(m) == "user" && has_block(m, "tool_result"))
}

/// Messages grouped into units kept or dropped together: `(start, end)` half-open ranges.
pub fn units(messages: &[Value]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < messages.len() {
        let start = i;
        i += 1;
        if calls_tools(&messages[start]) {
            while i < messages.len() && answers_tools(&messages[i]) {
                i += 1;
            }
        }
        out.push((start, i));
    }
    out
}

/// The messages to drop (indexes, ascending) so that the rest costs at most `budget` tokens,
/// `costs[i]` being message `i`'s. `Some(vec![])` when everything fits already; `None` when even
/// the messages that are always kept (see the module docs) exceed the budget.
pub fn middle_out(messages: &[Value], costs: &[u64], budget: u64) -> Option<Vec<usize>> {
    debug_assert_eq!(messages.len(), costs.len());
    let mut total: u64 = costs.iter().sum();
    if total <= budget {
        return Some(Vec::new());
    }
    let units = units(messages);
    let holds =
        |u: &(usize, usize), pred: &dyn Fn(&Value) -> bool| messages[u.0..u.1].iter().any(pred);
    let first_user = units.iter().position(|u| holds(u, &|m| role(m) == "user"));
    let last_user = units.iter().rposition(|u| holds(u, &|m| role(m) == "user"));
    let droppable: Vec<usize> = (0..units.len())
        .filter(|&k| {
            Some(k) != first_user
                && last_user.is_none_or(|l| k < l)
                && !holds(&units[k], &|m| matches!(role(m), "system" | "developer"))
        })
        .collect();
    let mut dropped = Vec::new();
    for k in from_the_middle(droppable.len()).map(|j| droppable[j]) {
        if total <= budget {
            break;
        }
        let (s, e) = units[k];
        total -= costs[s..e].iter().sum::<u64>();
        dropped.extend(s..e);
    }
    if total > budget {
        return None;
    }
    dropped.sort_unstable();
    Some(dropped)
}

/// Positions `0..n` from the middle outwards: n/2, n/2 - 1, n/2 + 1, n/2 - 2, …
fn from_the_middle(n: usize) -> impl Iterator<Item = usize> {
    let mid = n / 2;
    (0..n).map(move |step| {
        let off = step.div_ceil(2);
        if step % 2 == 1 {
            mid - off
        } else {
            mid + off
        }
    })
}

/// Removes the messages at `dropped` (ascending indexes, as [`middle_out`] returns them).
pub fn remove(messages: &mut Vec<Value>, dropped: &[usize]) {
    let mut k = 0;
    let mut i = 0;
    messages.retain(|_| {
        let drop = dropped.get(k) == Some(&i);
        if drop {
            k += 1;
        }
        i += 1;
        !drop
    });
}

#[cfg(test)]
mod tests;
