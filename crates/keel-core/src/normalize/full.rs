//! `full` mode: its configuration and its per-text pipeline.
//!
//! On each prompt text (system, developer and user texts), after `syntax`:
//! 1. JSON-example repair ([`super::json_repair`]) on each prose segment;
//! 2. rewrite rules ([`super::rules`]) on the instruction sentences of each prose segment.
//!
//! Then, once per request, intent completion ([`super::intent`]).
//!
//! **What stays byte-identical.** Everything `syntax` keeps (tool definitions, calls, arguments
//! and results, non-text parts, code spans and fences, texts that are JSON as a whole), plus the
//! assistant's turns (only their `syntax` fixes apply). Inside prose, a JSON example is changed
//! only by inserting its missing closers.
//!
//! **Idempotence.** A second `full` pass changes nothing: `syntax` output is canonical; a
//! repaired example is balanced; a rule's replacement is checked at construction to be canonical,
//! free of cutting characters and matched by no rule; an appended constraint is canonical, is
//! already rewritten by the rules at construction, and its presence counts as "has a
//! constraint".

use std::fmt;

use super::intent::Intent;
use super::json_repair::{self, repair_examples, RepairBudget};
use super::rules::{self, rewrite_prose, RuleSpec, Rules};
use super::text::{is_json, normalize_text, split_code, Segment};
use super::Fixes;

/// What `full` mode adds to `syntax`: the rewrite rules and each intent's output constraint.
#[derive(Debug, Clone, PartialEq)]
pub struct FullConfig {
    rules: Rules,
    /// The constraint per intent, in [`Intent::ALL`]'s order; `None`: the intent is off.
    constraints: Vec<Option<String>>,
}

/// A rule or constraint that cannot be used: which one, and why (the message names it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FullConfigError {
    pub at: ErrorAt,
    pub message: String,
}

/// What a [`FullConfigError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorAt {
    /// The rule at this index of the rule set.
    Rule(usize),
    Constraint(Intent),
}

impl fmt::Display for FullConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for FullConfigError {}

impl FullConfig {
    /// `rules`: the rule set (`None`: [`FullConfig::default_rules`]); `constraints`: overrides
    /// of intents' constraints (an empty text turns the intent off).
    pub fn new(
        rules: Option<&[RuleSpec]>,
        constraints: &[(Intent, String)],
    ) -> Result<FullConfig, FullConfigError> {
        let specs = rules.map_or_else(rules::default_specs, <[RuleSpec]>::to_vec);
        let rules = rules::compile(&specs).map_err(|(n, message)| FullConfigError {
            at: ErrorAt::Rule(n),
            message,
        })?;
        let mut out = Vec::with_capacity(Intent::ALL.len());
        for intent in Intent::ALL {
            let text = constraints
                .iter()
                .rev()
                .find(|(i, _)| *i == intent)
                .map_or(intent.default_constraint(), |(_, t)| t.as_str());
            out.push(prepare_constraint(intent, text, &rules)?);
        }
        Ok(FullConfig {
            rules,
            constraints: out,
        })
    }

    /// The built-in rules: `no_markdown`, `brief`, `bullets`, `json_only`, `no_explanation`.
    pub fn default_rules() -> Vec<RuleSpec> {
        rules::default_specs()
    }

    pub(super) fn constraint(&self, intent: Intent) -> Option<&str> {
        let n = Intent::ALL.iter().position(|i| *i == intent)?;
        self.constraints[n].as_deref()
    }

    pub(super) fn constraints(&self) -> impl Iterator<Item = &str> {
        self.constraints.iter().flatten().map(String::as_str)
    }
}

impl Default for FullConfig {
    /// The default rules and constraints (checked by a unit test, so this cannot fail).
    fn default() -> FullConfig {
        FullConfig::new(None, &[]).unwrap_or_else(|_| FullConfig {
            rules: Rules::empty(),
            constraints: vec![None; Intent::ALL.len()],
        })
    }
}

/// Checks one constraint and returns it as it will be appended: already rewritten by the rules,
/// so that a second pass finds nothing to rewrite in it.
fn prepare_constraint(
    intent: Intent,
    text: &str,
    rules: &Rules,
) -> Result<Option<String>, FullConfigError> {
    if text.is_empty() {
        return Ok(None);
    }
    let err = |why: &str| FullConfigError {
        at: ErrorAt::Constraint(intent),
        message: format!("constraint for `{}`: {why}", intent.name()),
    };
    if let Some(c) = text
        .chars()
        .find(|c| matches!(c, '"' | '`' | '{' | '}' | '[' | ']' | '\n'))
    {
        return Err(err(&format!("must not contain {c:?}")));
    }
    if normalize_text(text, &mut Fixes::default()).is_some() {
        return Err(err(
            "must already be normalized (ASCII quotes, single spaces, no invisible characters, NFC, trimmed)",
        ));
    }
    let rewritten = rewrite_prose(text, rules, rules::Edges::default(), &mut Fixes::default());
    Ok(Some(rewritten.unwrap_or_else(|| text.to_owned())))
}

/// `syntax`, then `full`'s per-text steps, on one prompt text (a system, developer or user
/// text); `None` when nothing changed. Intent completion is per request: see
/// [`super::normalize_request`]. JSON-example repair works within a fresh default
/// [`RepairBudget`]; see [`normalize_prompt_text_within`] to share one.
pub fn normalize_prompt_text(text: &str, cfg: &FullConfig, fixes: &mut Fixes) -> Option<String> {
    normalize_prompt_text_within(text, cfg, fixes, &mut RepairBudget::default())
}

/// [`normalize_prompt_text`], with JSON-example repair within `budget` (shared by the texts
/// of one request).
pub fn normalize_prompt_text_within(
    text: &str,
    cfg: &FullConfig,
    fixes: &mut Fixes,
    budget: &mut RepairBudget,
) -> Option<String> {
    let synced = normalize_text(text, fixes);
    let cur = synced.as_deref().unwrap_or(text);
    if is_json(cur) || !needs_full(cur, cfg) {
        return synced;
    }
    let segments = split_code(cur);
    let last = segments.len().saturating_sub(1);
    let mut out = String::with_capacity(cur.len() + 16);
    let (mut changed, mut seen_text) = (false, false);
    for (i, seg) in segments.iter().enumerate() {
        let prose = match seg {
            Segment::Code(code) => {
                out.push_str(code);
                seen_text = true;
                continue;
            }
            Segment::Prose(p) => *p,
        };
        let repaired = repair_examples(prose, seen_text, budget);
        if repaired.is_some() {
            fixes.add(json_repair::CODE);
        }
        let p1 = repaired.as_deref().unwrap_or(prose);
        let edges = rules::Edges {
            code_before: i > 0,
            code_after: i < last,
        };
        let rewritten = rewrite_prose(p1, &cfg.rules, edges, fixes);
        changed |= repaired.is_some() || rewritten.is_some();
        out.push_str(rewritten.as_deref().unwrap_or(p1));
        seen_text |= !prose.trim().is_empty();
    }
    if changed {
        Some(out)
    } else {
        synced
    }
}

/// Quick test: a text without brackets gets no repair, and without rules no rewrite.
fn needs_full(text: &str, cfg: &FullConfig) -> bool {
    !cfg.rules.is_empty() || text.bytes().any(|c| matches!(c, b'{' | b'['))
}
